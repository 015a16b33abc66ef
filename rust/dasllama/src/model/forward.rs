//! The forward pass shared by every family: embed, then each layer as its description says
//! (mixer, FFN, norms), then the final norm and the logits of the rows asked for. It owns the
//! activation rows and no kernel: every op goes through the backend boundary (`backend::Ops`).
//! Multi-token calls (prefill, verify chunks, batches) run every matmul as one GEMM over all rows.

use super::{BetaAlpha, Experts, Ffn, FfnWeights, LayerDesc, Mixer, MixerWeights, Model, Rope};
use crate::backend::Gating;
pub use crate::backend::LogitRows;
use crate::backend::{host, rope_cache, Activation, DnParams, MatmulOffload, Ops, RopeTable, Route};
use crate::kv::KvCache;
use crate::kv::RecIo;
use crate::{Error, Result};

/// Activation rows reused across calls so decode does not allocate per token.
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
    /// A gated attention layer's Q projection (queries and gates interleaved per head), then
    /// its gates.
    qg: Vec<f32>,
    attn_gate: Vec<f32>,
    dn: DnScratch,
    moe: MoeScratch,
    /// gemma4: the routed half of a `DenseMoe` FFN and its router's input; every row's
    /// per-layer inputs (n_layers * per_layer_input each) and one layer's share of them.
    o2: Vec<f32>,
    rin: Vec<f32>,
    ple: Vec<f32>,
    ple_one: Vec<f32>,
    /// The backend's own buffer (the CPU's quantized activations).
    act: Vec<u8>,
    /// Keep every row's hidden state after the final norm in `hidden` (rows of `dim`, in batch
    /// order): what an MTP head reads beside the next token.
    pub keep_hidden: bool,
    pub hidden: Vec<f32>,
}

impl Scratch {
    pub const fn new() -> Scratch {
        Scratch {
            x: Vec::new(),
            h: Vec::new(),
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            att: Vec::new(),
            o: Vec::new(),
            gate: Vec::new(),
            up: Vec::new(),
            qg: Vec::new(),
            attn_gate: Vec::new(),
            dn: DnScratch { qkv: Vec::new(), z: Vec::new(), beta: Vec::new(), alpha: Vec::new(), ba: Vec::new(), out: Vec::new() },
            moe: MoeScratch { route: Vec::new(), rows: Vec::new(), x: Vec::new(), gate: Vec::new(), up: Vec::new(), out: Vec::new() },
            o2: Vec::new(),
            rin: Vec::new(),
            ple: Vec::new(),
            ple_one: Vec::new(),
            act: Vec::new(),
            keep_hidden: false,
            hidden: Vec::new(),
        }
    }
}

/// A DeltaNet layer's rows: its projections and its output before the gated norm.
#[derive(Default)]
struct DnScratch {
    qkv: Vec<f32>,
    z: Vec<f32>,
    beta: Vec<f32>,
    alpha: Vec<f32>,
    ba: Vec<f32>,
    out: Vec<f32>,
}

/// A gated DeltaNet layer over the batch's rows `h` into `o` (`config::DeltaNet`).
#[allow(clippy::too_many_arguments)]
fn delta_net(
    b: &mut dyn Ops,
    dn: &super::DeltaNet,
    w: &super::DeltaNetWeights,
    slot: usize,
    kvs: &mut [&mut KvCache],
    counts: &[usize],
    journal: &[bool],
    h: &[f32],
    d: usize,
    eps: f32,
    s: &mut DnScratch,
    o: &mut Vec<f32>,
) {
    let n = h.len() / d;
    let (cd, vd, nv) = (dn.conv_dim(), dn.value_dim(), dn.n_v_heads);
    grow(&mut s.qkv, n * cd);
    grow(&mut s.z, n * vd);
    grow(&mut s.beta, n * nv);
    grow(&mut s.alpha, n * nv);
    match &w.ba {
        BetaAlpha::Split { beta, alpha } => b.matmul(
            &mut [(&w.qkv, &mut s.qkv[..n * cd]), (&w.gate, &mut s.z[..n * vd]), (beta, &mut s.beta[..n * nv]), (alpha, &mut s.alpha[..n * nv])],
            h,
            counts,
        ),
        BetaAlpha::Fused(ba) => {
            grow(&mut s.ba, n * 2 * nv);
            b.matmul(&mut [(&w.qkv, &mut s.qkv[..n * cd]), (&w.gate, &mut s.z[..n * vd]), (ba, &mut s.ba[..n * 2 * nv])], h, counts);
            // Per key head: its value heads' betas, then their alphas.
            let r = nv / dn.n_k_heads;
            for t in 0..n {
                let row = &s.ba[t * 2 * nv..(t + 1) * 2 * nv];
                for (g, pair) in row.chunks_exact(2 * r).enumerate() {
                    s.beta[t * nv + g * r..t * nv + (g + 1) * r].copy_from_slice(&pair[..r]);
                    s.alpha[t * nv + g * r..t * nv + (g + 1) * r].copy_from_slice(&pair[r..]);
                }
            }
        }
    }
    let mut first = 0;
    for ((kv, &cnt), &rec) in kvs.iter_mut().zip(counts).zip(journal) {
        if rec {
            let r = first..first + cnt;
            kv.journal(slot, &s.qkv[r.start * cd..r.end * cd], &s.beta[r.start * nv..r.end * nv], &s.alpha[r.start * nv..r.end * nv], cnt);
        }
        first += cnt;
    }
    let mut states: Vec<RecIo> = kvs.iter_mut().map(|kv| kv.rec_io(slot)).collect();
    let p = DnParams { conv: &w.conv, dt_bias: &w.dt_bias, a: &w.a };
    let out = grow(&mut s.out, n * vd);
    b.delta_net(dn, &p, &mut states, counts, &mut s.qkv[..n * cd], &mut s.beta[..n * nv], &mut s.alpha[..n * nv], out);
    // Each head RMS-normed, then gated by SiLU of z (the product lands in z).
    b.rms_norm(&mut s.out[..n * vd], &w.norm, eps);
    b.glu(&mut s.z[..n * vd], &s.out[..n * vd], vd, Activation::Silu);
    let o = grow(o, n * d);
    b.matmul(&mut [(&w.out, o)], &s.z[..n * vd], counts);
}

/// Rows of a batch gathered per expert.
#[derive(Default)]
struct MoeScratch {
    route: Vec<(usize, f32)>,
    rows: Vec<(usize, f32)>,
    x: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    out: Vec<f32>,
}

/// How a layer's experts run beyond their routing: the router's input where it is not the
/// experts' (gemma4), the GLU's activation, and each expert's output scale, if any.
struct ExpertRun<'a> {
    router_in: Option<&'a [f32]>,
    act: Activation,
    expert_scale: Option<&'a [f32]>,
}

/// The routed experts of one layer over `n` rows of `h` into `o`: route every row, then run each
/// chosen expert once over the rows that chose it (gathered into one matrix), adding its output
/// to theirs with their weights; the shared expert, if any, over every row under its gate.
#[allow(clippy::too_many_arguments)]
fn moe(b: &mut dyn Ops, e: &Experts, h: &[f32], d: usize, r: &Route<'_>, hd: usize, run: &ExpertRun<'_>, s: &mut MoeScratch, o: &mut Vec<f32>) {
    let (n, n_expert, n_used) = (h.len() / d, r.n_expert, r.n_used);
    let logits = grow(&mut s.out, n * n_expert);
    b.matmul(&mut [(&e.router, logits)], run.router_in.unwrap_or(h), &vec![1; n]);
    if let Some(eb) = &e.biases {
        b.add_bias(&mut s.out[..n * n_expert], &eb.router);
    }
    b.route(&s.out[..n * n_expert], r, &mut s.route);
    let o = grow(o, n * d);
    o.fill(0.0);
    for ex in 0..n_expert {
        s.rows.clear();
        s.rows.extend(s.route.iter().enumerate().filter(|(_, &(x, _))| x == ex).map(|(i, &(_, w))| (i / n_used, w)));
        let m = s.rows.len();
        if m == 0 {
            continue;
        }
        let x = grow(&mut s.x, m * d);
        for (j, &(t, _)) in s.rows.iter().enumerate() {
            x[j * d..(j + 1) * d].copy_from_slice(&h[t * d..(t + 1) * d]);
        }
        grow(&mut s.gate, m * hd);
        grow(&mut s.up, m * hd);
        // Each gathered row on its own: a row's arithmetic never depends on what runs beside it.
        let ones = vec![1; m];
        b.matmul(&mut [(&e.gate[ex], &mut s.gate[..m * hd]), (&e.up[ex], &mut s.up[..m * hd])], &s.x[..m * d], &ones);
        if let Some(eb) = &e.biases {
            b.add_bias(&mut s.gate[..m * hd], &eb.gate[ex * hd..(ex + 1) * hd]);
            b.add_bias(&mut s.up[..m * hd], &eb.up[ex * hd..(ex + 1) * hd]);
        }
        b.glu(&mut s.gate[..m * hd], &s.up[..m * hd], hd, run.act);
        let out = grow(&mut s.out, m * d);
        b.matmul(&mut [(&e.down[ex], out)], &s.gate[..m * hd], &ones);
        if let Some(eb) = &e.biases {
            b.add_bias(&mut s.out[..m * d], &eb.down[ex * d..(ex + 1) * d]);
        }
        let es = run.expert_scale.map_or(1.0, |sc| sc[ex]);
        for (j, &(t, w)) in s.rows.iter().enumerate() {
            b.add_scaled(&mut o[t * d..(t + 1) * d], &s.out[j * d..(j + 1) * d], w * es);
        }
    }
    if let Some(sh) = &e.shared {
        let hs = sh.gate.rows;
        let ones = vec![1; n];
        grow(&mut s.gate, n * hs);
        grow(&mut s.up, n * hs);
        b.matmul(&mut [(&sh.gate, &mut s.gate[..n * hs]), (&sh.up, &mut s.up[..n * hs])], h, &ones);
        b.glu(&mut s.gate[..n * hs], &s.up[..n * hs], hs, Activation::Silu);
        let out = grow(&mut s.out, n * d);
        b.matmul(&mut [(&sh.down, out)], &s.gate[..n * hs], &ones);
        match &sh.gate_inp {
            Some(gi) => {
                let g = grow(&mut s.x, n);
                b.matmul(&mut [(gi, g)], h, &ones);
                b.sigmoid(&mut s.x[..n]);
                for t in 0..n {
                    b.add_scaled(&mut o[t * d..(t + 1) * d], &s.out[t * d..(t + 1) * d], s.x[t]);
                }
            }
            // Ungated (glm4moe): the routed output plus the shared one.
            None => b.add(&mut o[..n * d], &s.out[..n * d]),
        }
    }
}

fn grow(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// Advance several sessions in one pass over the weights: session i takes `counts[i]` tokens from
/// `tokens` (in order: decode steps and prefill chunks alike). `logits` receives the rows `want`
/// asks for. Every row is computed with the same arithmetic as when its session runs alone.
/// `offload` takes the matmuls it can (the Vulkan rails); the CPU runs the rest.
#[allow(clippy::too_many_arguments)]
pub fn forward_batch(
    m: &Model,
    kvs: &mut [&mut KvCache],
    counts: &[usize],
    tokens: &[u32],
    want: LogitRows<'_>,
    s: &mut Scratch,
    logits: &mut Vec<f32>,
    offload: Option<&mut dyn MatmulOffload>,
) -> Result<()> {
    check(m, kvs.iter().map(|kv| kv.len()), counts, tokens, want)?;
    for (kv, &cnt) in kvs.iter_mut().zip(counts) {
        let want = kv.len() + cnt;
        kv.reserve(want)?;
    }
    let mut act = std::mem::take(&mut s.act);
    host().run(m.numerics, &mut act, offload, &mut |ops| forward_rows(m, ops, kvs, counts, tokens, want, s, logits));
    s.act = act;
    for (kv, &cnt) in kvs.iter_mut().zip(counts) {
        let len = kv.len() + cnt;
        kv.commit(len);
    }
    Ok(())
}

/// What every forward pass refuses, before anything runs: session `i` is at position `lens[i]`.
pub fn check(m: &Model, lens: impl ExactSizeIterator<Item = usize>, counts: &[usize], tokens: &[u32], want: LogitRows<'_>) -> Result<()> {
    let c = &m.config;
    if let LogitRows::Tail(t) = want {
        if t.len() != counts.len() {
            return Err(Error::InvalidArgument(format!("{} logit tails for {} sessions; pass one per session", t.len(), counts.len())));
        }
    }
    if lens.len() != counts.len() || tokens.is_empty() || counts.iter().sum::<usize>() != tokens.len() || counts.contains(&0) {
        return Err(Error::InvalidArgument("eval needs at least one token per session".into()));
    }
    for (len, &cnt) in lens.zip(counts) {
        if len + cnt > c.seq_len {
            return Err(Error::ContextOverflow(format!(
                "{cnt} tokens at position {len} would run past the context window of {} tokens; start a new session or shorten the prompt",
                c.seq_len
            )));
        }
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
        return Err(Error::InvalidArgument(format!("token id {bad} is out of range for a vocabulary of {}", c.vocab_size)));
    }
    Ok(())
}

/// The skeleton. K/V rows are written at each session's positions len.. (reserved by the
/// caller), and committed by the caller once the pass has returned: a pass that fails midway
/// leaves every session as it was.
#[allow(clippy::too_many_arguments)]
fn forward_rows(
    m: &Model,
    b: &mut dyn Ops,
    kvs: &mut [&mut KvCache],
    counts: &[usize],
    tokens: &[u32],
    want: LogitRows<'_>,
    s: &mut Scratch,
    logits: &mut Vec<f32>,
) {
    let c = &m.config;
    let n = tokens.len();
    // Row t of the batch: (its session, its position).
    let mut rows = Vec::with_capacity(n);
    for (si, (kv, &cnt)) in kvs.iter().zip(counts).enumerate() {
        rows.extend((0..cnt).map(|j| (si, kv.len() + j)));
    }
    let d = c.dim;
    let mut xbuf = std::mem::take(&mut s.x);
    let x = grow(&mut xbuf, n * d);
    for (t, &tok) in tokens.iter().enumerate() {
        let row = &mut x[t * d..(t + 1) * d];
        m.tok_embd.dequantize_row(tok as usize, row);
        if let Some(sc) = c.embed_scale {
            row.iter_mut().for_each(|v| *v *= sc);
        }
    }
    let ropes = c.ropes();
    let tables = rope_tables(m, &ropes, &rows);
    let journal: Vec<bool> = counts.iter().enumerate().map(|(i, &cnt)| want != LogitRows::Hidden && want.tail(i, cnt) > 1).collect();
    if let Some(p) = &m.ple {
        per_layer_inputs(m, b, p, tokens, counts, x, s);
    }
    for (il, (l, desc)) in m.layers.iter().zip(&c.layers).enumerate() {
        let slot = c.kv_slot(il).or(c.rec_slot(il)).expect("every layer keeps K/V or a recurrent state");
        block(m, b, desc, l, slot, kvs, counts, &rows, &ropes, &tables, x, &journal, s);
        if let Some(p) = &l.ple {
            per_layer_mix(m, b, p, il, counts, x, s);
        }
        if let Some(sc) = l.out_scale {
            x.iter_mut().for_each(|v| *v *= sc);
        }
    }
    if s.keep_hidden {
        // Every row's hidden state after the final norm, for a drafter that reads it (MTP).
        s.hidden.resize(n * d, 0.0);
        let hid = &mut s.hidden[..];
        hid.copy_from_slice(x);
        b.rms_norm(hid, &m.output_norm, c.norm_eps);
    }
    let picked = want.picked(counts);
    let out_rows = picked.len();
    let last = grow(&mut s.h, out_rows * d);
    for (i, &t) in picked.iter().enumerate() {
        last[i * d..(i + 1) * d].copy_from_slice(&x[t * d..(t + 1) * d]);
    }
    b.rms_norm(last, &m.output_norm, c.norm_eps);
    s.x = xbuf;
    if want == LogitRows::Hidden {
        logits.clear();
        logits.extend_from_slice(last);
        return;
    }
    logits.resize(out_rows * c.vocab_size, 0.0);
    // One row per output: each is a row on its own to ggml's order.
    b.matmul(&mut [(&m.output, &mut logits[..])], &s.h[..out_rows * d], &vec![1; out_rows]);
    if let Some(cap) = c.final_softcap {
        b.softcap(logits, cap);
    }
}

/// gemma4's per-layer inputs of the batch's rows into `s.ple` (each row n_layers * per_layer_input
/// values, layer by layer), as llama.cpp's `project_per_layer_inputs`: the token's row of
/// `per_layer_token_embd` scaled by sqrt(per_layer_input), plus the scaled embedding `x`
/// projected, scaled by 1/sqrt(dim) and RMS-normed per layer, the sum scaled by 1/sqrt(2).
fn per_layer_inputs(m: &Model, b: &mut dyn Ops, p: &super::Ple, tokens: &[u32], counts: &[usize], x: &[f32], s: &mut Scratch) {
    let c = &m.config;
    let (n, np) = (tokens.len(), c.per_layer_input);
    let width = np * c.n_layers;
    let proj = grow(&mut s.ple, n * width);
    b.matmul(&mut [(&p.proj, proj)], x, counts);
    let inv_dim = 1.0 / (c.dim as f32).sqrt();
    s.ple[..n * width].iter_mut().for_each(|v| *v *= inv_dim);
    b.rms_norm(&mut s.ple[..n * width], &p.proj_norm, c.norm_eps);
    let (tok_scale, half) = ((np as f32).sqrt(), 1.0 / 2f32.sqrt());
    let row = grow(&mut s.ple_one, width);
    for (t, &tok) in tokens.iter().enumerate() {
        p.tok_embd.dequantize_row(tok as usize, row);
        for (v, e) in s.ple[t * width..(t + 1) * width].iter_mut().zip(row.iter()) {
            *v = (*v + e * tok_scale) * half;
        }
    }
}

/// Layer `il`'s use of its per-layer input (`PleLayer`), added to the rows `x`.
fn per_layer_mix(m: &Model, b: &mut dyn Ops, p: &super::PleLayer, il: usize, counts: &[usize], x: &mut [f32], s: &mut Scratch) {
    let c = &m.config;
    let (d, np) = (c.dim, c.per_layer_input);
    let n = x.len() / d;
    let width = np * c.n_layers;
    // This layer's share of every row's inputs, as one matrix.
    let inp = grow(&mut s.ple_one, n * np);
    for t in 0..n {
        inp[t * np..(t + 1) * np].copy_from_slice(&s.ple[t * width + il * np..t * width + (il + 1) * np]);
    }
    let g = grow(&mut s.gate, n * np);
    b.matmul(&mut [(&p.gate, g)], x, counts);
    // gelu(gate) times the input: a GLU with the input as its up half.
    b.glu(&mut s.gate[..n * np], &s.ple_one[..n * np], np, Activation::GeluTanh);
    let o = grow(&mut s.o, n * d);
    b.matmul(&mut [(&p.proj, o)], &s.gate[..n * np], counts);
    b.rms_norm(&mut s.o[..n * d], &p.post_norm, c.norm_eps);
    b.add(x, &s.o[..n * d]);
}

/// RoPE sines and cosines per row, once for every layer (one table per distinct RoPE).
pub(super) fn rope_tables(m: &Model, ropes: &[Rope], rows: &[(usize, usize)]) -> Vec<Vec<(f32, f32)>> {
    rope_tables_with(ropes, rows, m.rope_factors.as_deref())
}

/// `rope_tables` with the frequency divisors given (a Gemma 4 assistant carries its own).
pub(super) fn rope_tables_with(ropes: &[Rope], rows: &[(usize, usize)], factors: Option<&[f32]>) -> Vec<Vec<(f32, f32)>> {
    let mut tables = Vec::with_capacity(ropes.len());
    let mut one = Vec::new();
    for r in ropes {
        let mut tab = Vec::with_capacity(rows.len() * r.dim / 2);
        for &(_, pos) in rows {
            rope_cache(r, pos, factors, &mut one);
            tab.extend_from_slice(&one);
        }
        tables.push(tab);
    }
    tables
}

/// One layer over the batch's rows `x` (updated in place): its mixer (attention in K/V slot
/// `slot`, or a DeltaNet in recurrent slot `slot`, recording the raw inputs of the sessions
/// `journal` marks), then its FFN, each with its residual. `rows[t]` = (session, position).
#[allow(clippy::too_many_arguments)]
pub(super) fn block(
    m: &Model,
    b: &mut dyn Ops,
    desc: &LayerDesc,
    l: &super::Layer,
    slot: usize,
    kvs: &mut [&mut KvCache],
    counts: &[usize],
    rows: &[(usize, usize)],
    ropes: &[Rope],
    tables: &[Vec<(f32, f32)>],
    x: &mut [f32],
    journal: &[bool],
    s: &mut Scratch,
) {
    let c = &m.config;
    let n = rows.len();
    let d = c.dim;
    let LayerDesc { mixer, ffn, .. } = desc;
    let h = grow(&mut s.h, n * d);
    h.copy_from_slice(x);
    b.rms_norm(h, &l.attn_norm, c.norm_eps);
    match mixer {
        Mixer::Attention(a) => {
            let MixerWeights::Attention(w) = &l.mixer else { unreachable!("the loader builds each layer's mixer weights from its description") };
            let heads = a.heads(c);
            let (qd, kvd, hd) = (heads.q_dim(), heads.kv_dim(), heads.head_dim);
            // A layer that reads an earlier layer's K/V projects queries only.
            let own_kv = a.kv_from.is_none();
            grow(&mut s.q, n * qd);
            grow(&mut s.k, n * kvd);
            grow(&mut s.v, n * kvd);
            if a.gated {
                // Q and its gate come interleaved per head: split them.
                grow(&mut s.qg, n * 2 * qd);
                grow(&mut s.attn_gate, n * qd);
                b.matmul(&mut [(&w.wq, &mut s.qg[..n * 2 * qd]), (&w.wk, &mut s.k[..n * kvd]), (&w.wv, &mut s.v[..n * kvd])], &s.h[..n * d], counts);
                for (i, pair) in s.qg[..n * 2 * qd].chunks_exact(2 * hd).enumerate() {
                    s.q[i * hd..(i + 1) * hd].copy_from_slice(&pair[..hd]);
                    s.attn_gate[i * hd..(i + 1) * hd].copy_from_slice(&pair[hd..]);
                }
            } else if !own_kv {
                b.matmul(&mut [(&w.wq, &mut s.q[..n * qd])], &s.h[..n * d], counts);
            } else if w.wv.rows == 0 {
                // No V projection (gemma4's attention_k_eq_v): V is K's, before K's norm and RoPE.
                b.matmul(&mut [(&w.wq, &mut s.q[..n * qd]), (&w.wk, &mut s.k[..n * kvd])], &s.h[..n * d], counts);
                s.v[..n * kvd].copy_from_slice(&s.k[..n * kvd]);
            } else {
                b.matmul(&mut [(&w.wq, &mut s.q[..n * qd]), (&w.wk, &mut s.k[..n * kvd]), (&w.wv, &mut s.v[..n * kvd])], &s.h[..n * d], counts);
            }
            for (bias, out) in [(&w.bq, &mut s.q[..n * qd]), (&w.bk, &mut s.k[..n * kvd]), (&w.bv, &mut s.v[..n * kvd])] {
                if let Some(bias) = bias {
                    b.add_bias(out, bias);
                }
            }
            let ri = ropes.iter().position(|r| *r == a.rope).expect("every layer's RoPE is tabulated");
            let rope = RopeTable { pairs: &tables[ri], half: a.rope.dim / 2, neox: a.rope.neox };
            b.norm_rope(&mut s.q[..n * qd], qd, hd, w.q_norm.as_deref(), c.norm_eps, &rope);
            if own_kv {
                b.norm_rope(&mut s.k[..n * kvd], kvd, hd, w.k_norm.as_deref(), c.norm_eps, &rope);
                if a.v_norm {
                    // Each value head RMS-normed with no weight (a weight of ones multiplies exactly).
                    b.rms_norm(&mut s.v[..n * kvd], &vec![1.0; hd], c.norm_eps);
                }
            }
            if let Some(temp) = a.temp {
                for (q, &(_, pos)) in s.q[..n * qd].chunks_exact_mut(qd).zip(rows) {
                    let f = temp.factor(pos);
                    q.iter_mut().for_each(|v| *v *= f);
                }
            }
            if own_kv {
                let mut off = 0;
                for (kv, &cnt) in kvs.iter_mut().zip(counts) {
                    kv.append(slot, &s.k[off * kvd..(off + cnt) * kvd], &s.v[off * kvd..(off + cnt) * kvd]);
                    off += cnt;
                }
            }
            let att = grow(&mut s.att, n * qd);
            let shape = crate::backend::AttnShape { sinks: w.sinks.as_deref(), ..a.shape(c) };
            b.attention(&shape, slot, kvs, rows, counts, &s.q[..n * qd], att);
            if a.gated {
                b.sigmoid(&mut s.attn_gate[..n * qd]);
                b.mul(&mut s.att[..n * qd], &s.attn_gate[..n * qd]);
            }
            let o = grow(&mut s.o, n * d);
            b.matmul(&mut [(&w.wo, o)], &s.att[..n * qd], counts);
            if let Some(bo) = &w.bo {
                b.add_bias(&mut s.o[..n * d], bo);
            }
        }
        Mixer::DeltaNet(dn) => {
            let MixerWeights::DeltaNet(w) = &l.mixer else { unreachable!("the loader builds each layer's mixer weights from its description") };
            delta_net(b, dn, w, slot, kvs, counts, journal, &s.h[..n * d], d, c.norm_eps, &mut s.dn, &mut s.o);
        }
    }
    let o = &mut s.o[..n * d];
    if let Some(w) = &l.post_attn_norm {
        b.rms_norm(o, w, c.norm_eps);
    }
    b.add(x, o);

    let h = grow(&mut s.h, n * d);
    h.copy_from_slice(x);
    b.rms_norm(h, &l.ffn_norm, c.norm_eps);
    match (*ffn, &l.ffn) {
        (Ffn::Dense { hidden: hd, act, .. }, FfnWeights::Dense { gate, up, down }) => {
            grow(&mut s.gate, n * hd);
            grow(&mut s.up, n * hd);
            b.matmul(&mut [(gate, &mut s.gate[..n * hd]), (up, &mut s.up[..n * hd])], &s.h[..n * d], counts);
            b.glu(&mut s.gate[..n * hd], &s.up[..n * hd], hd, act);
            let o = grow(&mut s.o, n * d);
            b.matmul(&mut [(down, o)], &s.gate[..n * hd], counts);
        }
        (Ffn::Moe { n_expert, n_used, hidden, norm_weights, gating, scale, .. }, FfnWeights::Moe(e)) => {
            let r = Route { n_expert, n_used, gating, bias: e.sel_bias.as_deref(), norm: norm_weights, scale };
            let run = ExpertRun { router_in: None, act: c.expert_act, expert_scale: None };
            moe(b, e, &s.h[..n * d], d, &r, hidden, &run, &mut s.moe, &mut s.o);
        }
        (Ffn::DenseMoe { hidden: hd, n_expert, n_used, expert_hidden, act }, FfnWeights::DenseMoe(p)) => {
            // The dense GLU on the FFN-normed rows.
            grow(&mut s.gate, n * hd);
            grow(&mut s.up, n * hd);
            b.matmul(&mut [(&p.gate, &mut s.gate[..n * hd]), (&p.up, &mut s.up[..n * hd])], &s.h[..n * d], counts);
            b.glu(&mut s.gate[..n * hd], &s.up[..n * hd], hd, act);
            let o = grow(&mut s.o, n * d);
            b.matmul(&mut [(&p.down, o)], &s.gate[..n * hd], counts);
            b.rms_norm(&mut s.o[..n * d], &p.post_norm_1, c.norm_eps);
            // The router reads the residual normed without a weight, scaled by 1/sqrt(dim) and
            // per value; the experts read it normed by pre_ffw_norm_2.
            let rin = grow(&mut s.rin, n * d);
            rin.copy_from_slice(x);
            b.rms_norm(rin, &vec![1.0; d], c.norm_eps);
            let inv = 1.0 / (d as f32).sqrt();
            for row in rin.chunks_exact_mut(d) {
                row.iter_mut().zip(&p.router_scale).for_each(|(v, sc)| *v = *v * inv * sc);
            }
            let h = grow(&mut s.h, n * d);
            h.copy_from_slice(x);
            b.rms_norm(h, &p.pre_norm_2, c.norm_eps);
            let r = Route { n_expert, n_used, gating: Gating::Softmax, bias: None, norm: true, scale: 1.0 };
            let run = ExpertRun { router_in: Some(&s.rin[..n * d]), act, expert_scale: p.expert_scale.as_deref() };
            moe(b, &p.experts, &s.h[..n * d], d, &r, expert_hidden, &run, &mut s.moe, &mut s.o2);
            b.rms_norm(&mut s.o2[..n * d], &p.post_norm_2, c.norm_eps);
            b.add(&mut s.o[..n * d], &s.o2[..n * d]);
        }
        _ => unreachable!("the loader builds each layer's FFN weights from its description"),
    }
    let o = &mut s.o[..n * d];
    if let Some(w) = &l.post_ffn_norm {
        b.rms_norm(o, w, c.norm_eps);
    }
    b.add(x, o);
}

/// Take a session back to position `pos`: K/V past it is forgotten, and a hybrid's recurrent
/// state is replayed from the state before its last pass over the rows it keeps (`kv::Journal`),
/// which must have recorded them (`pos >= kv.rewind_floor()`).
pub fn rewind(m: &Model, kv: &mut KvCache, pos: usize) {
    if !kv.recurrent() || pos >= kv.len() {
        kv.truncate(pos);
        return;
    }
    let dns = m.config.rec_layers();
    let weights: Vec<&super::DeltaNetWeights> = m
        .layers
        .iter()
        .filter_map(|l| match &l.mixer {
            MixerWeights::DeltaNet(w) => Some(&**w),
            MixerWeights::Attention(_) => None,
        })
        .collect();
    let (mut q, mut bt, mut al, mut out) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    host().run(m.numerics, &mut Vec::new(), None, &mut |ops| {
        kv.rewind(pos, |slot, io, qkv, beta, alpha, rows| {
            let (dn, w) = (&dns[slot], weights[slot]);
            // delta_net works in place: replay on copies, the journal keeps the raw rows.
            for (dst, src) in [(&mut q, qkv), (&mut bt, beta), (&mut al, alpha)] {
                dst.clear();
                dst.extend_from_slice(src);
            }
            out.resize(rows * dn.value_dim(), 0.0);
            let p = DnParams { conv: &w.conv, dt_bias: &w.dt_bias, a: &w.a };
            ops.delta_net(dn, &p, &mut [io], &[rows], &mut q, &mut bt, &mut al, &mut out);
        })
    });
}
