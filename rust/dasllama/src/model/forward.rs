//! The forward pass shared by every family: embed, N x (attention + GLU FFN), norm, logits.
//! Multi-token calls (prefill) run every matmul as one weight-stationary GEMM over all rows.

use super::{Activation, Model, Numerics};
use crate::cpu::{matmul_many, ops, team, Team};
use crate::session::KvCache;
use crate::{Error, Result};

/// Scratch reused across calls so decode does not allocate per token.
#[derive(Default)]
pub struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<u8>,
}

impl Scratch {
    pub const fn new() -> Scratch {
        Scratch { x: Vec::new(), h: Vec::new(), q: Vec::new(), k: Vec::new(), v: Vec::new(), att: Vec::new(), o: Vec::new(), gate: Vec::new(), up: Vec::new(), act: Vec::new() }
    }
}

fn grow(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// One parallel pass when the weights share an input format, else one pass each.
/// `counts`: the batch's rows per session.
fn matmul_fused(segs: &mut [(&crate::cpu::Weight, &mut [f32])], x: &[f32], counts: &[usize], act: &mut Vec<u8>, t: &Team) {
    let vt = segs[0].0.ty.vec_dot_type();
    if segs.iter().all(|(w, _)| w.ty.vec_dot_type() == vt) {
        matmul_many(segs, x, counts, act, t);
    } else {
        for (w, out) in segs.iter_mut() {
            matmul_many(&mut [(w, out)], x, counts, act, t);
        }
    }
}

/// Evaluate `tokens` at positions `kv.len()..`, append their K/V, and write the logits after the
/// last token into `logits`. Runs on the thread team.
pub fn forward(m: &Model, kv: &mut KvCache, tokens: &[u32], s: &mut Scratch, logits: &mut Vec<f32>) -> Result<()> {
    team().session(|t| forward_rows(m, &mut [kv], &[tokens.len()], tokens, s, logits, t))
}

/// Advance several sessions in one pass over the weights: session i takes `counts[i]` tokens from
/// `tokens` (in order: decode steps and prefill chunks alike). `logits` receives one row per
/// session, after its last token. Every row is computed with the same arithmetic as when its
/// session runs alone.
pub fn forward_batch(m: &Model, kvs: &mut [&mut KvCache], counts: &[usize], tokens: &[u32], s: &mut Scratch, logits: &mut Vec<f32>) -> Result<()> {
    team().session(|t| forward_rows(m, kvs, counts, tokens, s, logits, t))
}

#[allow(clippy::too_many_arguments)]
fn forward_rows(
    m: &Model,
    kvs: &mut [&mut KvCache],
    counts: &[usize],
    tokens: &[u32],
    s: &mut Scratch,
    logits: &mut Vec<f32>,
    team: &Team,
) -> Result<()> {
    let c = &m.config;
    let n = tokens.len();
    assert_eq!(kvs.len(), counts.len(), "one token count per session");
    if n == 0 || counts.iter().sum::<usize>() != n || counts.contains(&0) {
        return Err(Error::InvalidArgument("eval needs at least one token per session".into()));
    }
    for (kv, &cnt) in kvs.iter().zip(counts) {
        if kv.len() + cnt > c.seq_len {
            return Err(Error::ContextOverflow(format!(
                "{cnt} tokens at position {} would run past the context window of {} tokens; start a new session or shorten the prompt",
                kv.len(),
                c.seq_len
            )));
        }
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
        return Err(Error::InvalidArgument(format!("token id {bad} is out of range for a vocabulary of {}", c.vocab_size)));
    }
    // Row t of the batch: (its session, its position).
    let mut rows = Vec::with_capacity(n);
    for (si, (kv, &cnt)) in kvs.iter().zip(counts).enumerate() {
        rows.extend((0..cnt).map(|j| (si, kv.len() + j)));
    }
    let (d, qd, kvd, hd) = (c.dim, c.q_dim(), c.kv_dim(), c.hidden_dim);
    let mut xbuf = std::mem::take(&mut s.x);
    grow(&mut xbuf, n * d);
    let x = &mut xbuf[..n * d];
    for (t, &tok) in tokens.iter().enumerate() {
        let row = &mut x[t * d..(t + 1) * d];
        m.tok_embd.dequantize_row(tok as usize, row);
        if let Some(sc) = c.embed_scale {
            row.iter_mut().for_each(|v| *v *= sc);
        }
    }
    for (kv, &cnt) in kvs.iter_mut().zip(counts) {
        let want = kv.len() + cnt;
        kv.reserve(want)?;
    }
    // RoPE sines and cosines per row, once for every layer (one table per RoPE base).
    let half = c.rope_dim / 2;
    let bases = if c.rope_base_swa != c.rope_base { vec![c.rope_base, c.rope_base_swa] } else { vec![c.rope_base] };
    let mut rope_tab = Vec::with_capacity(bases.len() * n * half);
    let mut one = Vec::with_capacity(half);
    for &b in &bases {
        for &(_, pos) in &rows {
            ops::rope_cache(c.rope_dim, pos, b, &mut one);
            rope_tab.extend_from_slice(&one);
        }
    }
    for (il, l) in m.layers.iter().enumerate() {
        let h = grow(&mut s.h, n * d);
        h.copy_from_slice(x);
        h.chunks_exact_mut(d).for_each(|r| ops::rms_norm(r, &l.attn_norm, c.norm_eps));
        grow(&mut s.q, n * qd);
        grow(&mut s.k, n * kvd);
        grow(&mut s.v, n * kvd);
        matmul_fused(
            &mut [(&l.wq, &mut s.q[..n * qd]), (&l.wk, &mut s.k[..n * kvd]), (&l.wv, &mut s.v[..n * kvd])],
            &s.h[..n * d],
            counts,
            &mut s.act,
            team,
        );
        let swa = c.is_swa_layer(il);
        let tab = &rope_tab[if swa && bases.len() > 1 { n * half } else { 0 }..];
        let heads = |buf: &mut [f32], width: usize, norm: &Option<Vec<f32>>| {
            let each = |t: usize, row: &mut [f32]| {
                let cache = &tab[t * half..(t + 1) * half];
                for hv in row.chunks_exact_mut(c.head_dim) {
                    if let Some(w) = norm {
                        ops::rms_norm(hv, w, c.norm_eps);
                    }
                    ops::rope(hv, cache, c.rope_neox);
                }
            };
            if n >= 16 {
                team.for_each_row_mut(buf, width, &each);
            } else {
                buf.chunks_exact_mut(width).enumerate().for_each(|(t, r)| each(t, r));
            }
        };
        heads(&mut s.q[..n * qd], qd, &l.q_norm);
        heads(&mut s.k[..n * kvd], kvd, &l.k_norm);
        let mut off = 0;
        for (kv, &cnt) in kvs.iter_mut().zip(counts) {
            kv.append(il, &s.k[off * kvd..(off + cnt) * kvd], &s.v[off * kvd..(off + cnt) * kvd]);
            off += cnt;
        }
        let window = if swa { c.sliding_window } else { 0 };
        let att = grow(&mut s.att, n * qd);
        match m.numerics {
            Numerics::Fast => attention(m, kvs, il, &rows, window, &s.q[..n * qd], att, team),
            Numerics::Ggml => attention_ggml(m, kvs, il, &rows, counts, window, &s.q[..n * qd], att, team),
        }
        let o = grow(&mut s.o, n * d);
        matmul_fused(&mut [(&l.wo, o)], &s.att[..n * qd], counts, &mut s.act, team);
        if let Some(w) = &l.post_attn_norm {
            o.chunks_exact_mut(d).for_each(|r| ops::rms_norm(r, w, c.norm_eps));
        }
        x.iter_mut().zip(o.iter()).for_each(|(a, b)| *a += b);

        let h = grow(&mut s.h, n * d);
        h.copy_from_slice(x);
        h.chunks_exact_mut(d).for_each(|r| ops::rms_norm(r, &l.ffn_norm, c.norm_eps));
        grow(&mut s.gate, n * hd);
        grow(&mut s.up, n * hd);
        matmul_fused(&mut [(&l.w_gate, &mut s.gate[..n * hd]), (&l.w_up, &mut s.up[..n * hd])], &s.h[..n * d], counts, &mut s.act, team);
        let act = c.activation;
        let up = &s.up[..n * hd];
        let glu = |t: usize, g: &mut [f32]| {
            let u = &up[t * g.len()..(t + 1) * g.len()];
            match act {
                Activation::Silu => ops::swiglu(g, u),
                Activation::GeluTanh => ops::geglu(g, u),
            }
        };
        if n >= 16 {
            team.for_each_row_mut(&mut s.gate[..n * hd], hd, &glu);
        } else {
            glu(0, &mut s.gate[..n * hd]);
        }
        let o = grow(&mut s.o, n * d);
        matmul_fused(&mut [(&l.w_down, o)], &s.gate[..n * hd], counts, &mut s.act, team);
        if let Some(w) = &l.post_ffn_norm {
            o.chunks_exact_mut(d).for_each(|r| ops::rms_norm(r, w, c.norm_eps));
        }
        x.iter_mut().zip(o.iter()).for_each(|(a, b)| *a += b);
    }
    for (kv, &cnt) in kvs.iter_mut().zip(counts) {
        let len = kv.len() + cnt;
        kv.commit(len);
    }
    // Logits only after each session's last token: the vocabulary matmul is the largest one.
    let out_rows = counts.len();
    let last = grow(&mut s.h, out_rows * d);
    let mut end = 0;
    for (i, &cnt) in counts.iter().enumerate() {
        end += cnt;
        last[i * d..(i + 1) * d].copy_from_slice(&x[(end - 1) * d..end * d]);
    }
    last.chunks_exact_mut(d).for_each(|r| ops::rms_norm(r, &m.output_norm, c.norm_eps));
    logits.resize(out_rows * c.vocab_size, 0.0);
    s.x = xbuf;
    // One row per session: each is a row on its own to ggml's order.
    matmul_fused(&mut [(&m.output, &mut logits[..])], &s.h[..out_rows * d], &vec![1; out_rows], &mut s.act, team);
    Ok(())
}

/// Query heads as llama.cpp's attention takes them against an f16 cache: scaled first where the
/// family scales queries, then rounded to f16.
fn f16_queries(c: &super::Config, q: &[f32], qs: &mut Vec<f32>) {
    qs.clear();
    qs.extend_from_slice(q);
    if c.scale_query {
        qs.iter_mut().for_each(|v| *v *= c.attn_scale);
    }
    ops::round_f16_slice(qs);
}

thread_local! {
    /// Queries and scores of the attention task a thread runs, kept for its next one (a task per
    /// row, KV head and layer would otherwise allocate both, thousands of times a step).
    static ATTENTION_SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Causal attention of each new query row over its own session's cached K/V (which already holds
/// the row's own position).
/// Q and the softmax weights are rounded to f16 as llama.cpp does against its f16 cache.
#[allow(clippy::too_many_arguments)]
fn attention(m: &Model, kvs: &[&mut KvCache], il: usize, rows: &[(usize, usize)], window: usize, q: &[f32], out: &mut [f32], team: &Team) {
    let c = &m.config;
    let (hdim, qd) = (c.head_dim, c.q_dim());
    let group = c.n_heads / c.n_kv_heads;
    let n = rows.len();
    // One task per (row, KV head): the query heads sharing that KV head are contiguous in `q` and
    // `out`, so each K and V row is decoded once for all of them.
    let one = |idx: usize, o: &mut [f32]| {
        let (t, kvh) = (idx / c.n_kv_heads, idx % c.n_kv_heads);
        let (si, pos) = rows[t];
        let lv = kvs[si].layer(il);
        let codec = lv.codec();
        let start = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
        let nk = pos + 1 - start;
        let base = t * qd + kvh * group * hdim;
        // Rows come in runs that share a page (contiguous per head); a batch's KV outgrows L3,
        // so the next run (after the last K run, the first V run) is fetched while one is read.
        let fetch = |v: bool, from: usize| {
            let next = lv.rows(v, kvh, from, pos + 1).next().or_else(|| if v { None } else { lv.rows(true, kvh, start, pos + 1).next() });
            if let Some((_, run)) = next {
                ops::prefetch(run);
            }
        };
        fetch(false, start);
        ATTENTION_SCRATCH.with_borrow_mut(|(qs, sc)| {
            f16_queries(c, &q[base..base + group * hdim], qs);
            codec.prepare_query(qs, hdim);
            sc.clear();
            sc.resize(group * nk, 0.0);
            for (first, run) in lv.rows(false, kvh, start, pos + 1) {
                let cnt = run.len() / codec.bytes(hdim);
                fetch(false, first + cnt);
                codec.dot_rows(qs, hdim, run, cnt, &mut sc[first - start..], nk);
            }
            for sg in sc.chunks_exact_mut(nk) {
                ops::attention_weights(sg, c.score_scale());
            }
            o.fill(0.0);
            for (first, run) in lv.rows(true, kvh, start, pos + 1) {
                let cnt = run.len() / codec.bytes(hdim);
                fetch(true, first + cnt);
                codec.axpy_rows(o, hdim, &sc[first - start..], nk, run, cnt);
            }
            codec.finish_output(o, hdim);
        });
    };
    let work: usize = rows.iter().map(|r| r.1 + 1).sum::<usize>() * c.n_heads;
    let width = group * hdim;
    if work * hdim > 1 << 16 {
        team.for_each_chunk_mut(&mut out[..n * qd], width, &one);
    } else {
        out[..n * qd].chunks_exact_mut(width).enumerate().for_each(|(i, o)| one(i, o));
    }
}

/// Attention in ggml's order (`Numerics::Ggml`), as llama.cpp computes it without flash attention
/// against an f16 cache: Q and the softmax weights rounded to f16; a session evaluating several
/// tokens goes through tinyBLAS (lane dots), one evaluating a single token through
/// `ggml_vec_dot_f16`; softmax over whole groups of eight cells with the masked ones at -inf.
/// Plain loops over decoded rows: this is the conformance path, not the fast one.
#[allow(clippy::too_many_arguments)]
fn attention_ggml(m: &Model, kvs: &[&mut KvCache], il: usize, rows: &[(usize, usize)], counts: &[usize], window: usize, q: &[f32], out: &mut [f32], team: &Team) {
    use crate::quant::ggml::{lane_dot, vec_dot_f16};
    let c = &m.config;
    let (hdim, qd) = (c.head_dim, c.q_dim());
    let group = c.n_heads / c.n_kv_heads;
    let one = |idx: usize, o: &mut [f32]| {
        let (t, kvh) = (idx / c.n_kv_heads, idx % c.n_kv_heads);
        let (si, pos) = rows[t];
        let single = counts[si] == 1;
        let lv = kvs[si].layer(il);
        assert_eq!(lv.codec(), crate::kv::KvCodec::F16, "ggml numerics run on an f16 cache (checked at pool creation)");
        let start = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
        // K and V of cells 0..=pos as f32 (cells before the window stay zero: their weight is 0).
        let cells = (pos + 1).next_multiple_of(32);
        let mut kf = vec![0.0f32; cells * hdim];
        let mut vt = vec![0.0f32; hdim * cells]; // transposed, as llama.cpp stores V
        for (v, dst) in [(false, &mut kf), (true, &mut vt)] {
            for (first, run) in lv.rows(v, kvh, start, pos + 1) {
                for (r, row) in run.chunks_exact(2 * hdim).enumerate() {
                    for i in 0..hdim {
                        let x = crate::quant::rd_f16(row, 2 * i);
                        if v {
                            dst[i * cells + first + r] = x;
                        } else {
                            dst[(first + r) * hdim + i] = x;
                        }
                    }
                }
            }
        }
        let dot = if single { vec_dot_f16 } else { lane_dot };
        let mut sc = vec![0.0f32; cells];
        for g in 0..group {
            let base = t * qd + (kvh * group + g) * hdim;
            let mut qs = Vec::new();
            f16_queries(c, &q[base..base + hdim], &mut qs);
            sc.fill(f32::NEG_INFINITY);
            for j in start..=pos {
                sc[j] = dot(&kf[j * hdim..(j + 1) * hdim], &qs) * c.score_scale();
            }
            let live = (pos + 1).next_multiple_of(8);
            ops::softmax(&mut sc[..live]);
            sc[live..].fill(0.0);
            ops::round_f16_slice(&mut sc);
            for (i, ov) in o[g * hdim..(g + 1) * hdim].iter_mut().enumerate() {
                *ov = dot(&vt[i * cells..(i + 1) * cells], &sc);
            }
        }
    };
    if rows.len() * c.n_kv_heads > 1 {
        team.for_each_chunk_mut(&mut out[..rows.len() * qd], group * hdim, &one);
    } else {
        one(0, &mut out[..qd]);
    }
}
