//! The forward pass shared by every family: embed, then each layer as its description says
//! (mixer, FFN, norms), then the final norm and the logits of the rows asked for. It owns the
//! activation rows and no kernel: every op goes through the backend boundary (`backend::Ops`).
//! Multi-token calls (prefill, verify chunks, batches) run every matmul as one GEMM over all rows.

use super::{BetaAlpha, Experts, Ffn, FfnWeights, LayerDesc, Mixer, MixerWeights, Model, Rope};
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

/// The routed experts of one layer over `n` rows of `h` into `o`: route every row, then run each
/// chosen expert once over the rows that chose it (gathered into one matrix), adding its output
/// to theirs with their weights; the shared expert, if any, over every row under its gate.
#[allow(clippy::too_many_arguments)]
fn moe(b: &mut dyn Ops, e: &Experts, h: &[f32], d: usize, r: &Route<'_>, hd: usize, act: Activation, s: &mut MoeScratch, o: &mut Vec<f32>) {
    let (n, n_expert, n_used) = (h.len() / d, r.n_expert, r.n_used);
    let logits = grow(&mut s.out, n * n_expert);
    b.matmul(&mut [(&e.router, logits)], h, &vec![1; n]);
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
        b.glu(&mut s.gate[..m * hd], &s.up[..m * hd], hd, act);
        let out = grow(&mut s.out, m * d);
        b.matmul(&mut [(&e.down[ex], out)], &s.gate[..m * hd], &ones);
        if let Some(eb) = &e.biases {
            b.add_bias(&mut s.out[..m * d], &eb.down[ex * d..(ex + 1) * d]);
        }
        for (j, &(t, w)) in s.rows.iter().enumerate() {
            b.add_scaled(&mut o[t * d..(t + 1) * d], &s.out[j * d..(j + 1) * d], w);
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
    for (il, (l, desc)) in m.layers.iter().zip(&c.layers).enumerate() {
        let slot = c.kv_slot(il).or(c.rec_slot(il)).expect("every layer keeps K/V or a recurrent state");
        block(m, b, desc, l, slot, kvs, counts, &rows, &ropes, &tables, x, &journal, s);
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

/// RoPE sines and cosines per row, once for every layer (one table per distinct RoPE).
pub(super) fn rope_tables(m: &Model, ropes: &[Rope], rows: &[(usize, usize)]) -> Vec<Vec<(f32, f32)>> {
    let mut tables = Vec::with_capacity(ropes.len());
    let mut one = Vec::new();
    for r in ropes {
        let mut tab = Vec::with_capacity(rows.len() * r.dim / 2);
        for &(_, pos) in rows {
            rope_cache(r, pos, m.rope_factors.as_deref(), &mut one);
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
    let (d, qd, kvd) = (c.dim, c.q_dim(), c.kv_dim());
    let LayerDesc { mixer, ffn, .. } = desc;
    let h = grow(&mut s.h, n * d);
    h.copy_from_slice(x);
    b.rms_norm(h, &l.attn_norm, c.norm_eps);
    match mixer {
        Mixer::Attention(a) => {
            let MixerWeights::Attention(w) = &l.mixer else { unreachable!("the loader builds each layer's mixer weights from its description") };
            grow(&mut s.q, n * qd);
            grow(&mut s.k, n * kvd);
            grow(&mut s.v, n * kvd);
            if a.gated {
                // Q and its gate come interleaved per head: split them.
                grow(&mut s.qg, n * 2 * qd);
                grow(&mut s.attn_gate, n * qd);
                b.matmul(&mut [(&w.wq, &mut s.qg[..n * 2 * qd]), (&w.wk, &mut s.k[..n * kvd]), (&w.wv, &mut s.v[..n * kvd])], &s.h[..n * d], counts);
                let hd = c.head_dim;
                for (i, pair) in s.qg[..n * 2 * qd].chunks_exact(2 * hd).enumerate() {
                    s.q[i * hd..(i + 1) * hd].copy_from_slice(&pair[..hd]);
                    s.attn_gate[i * hd..(i + 1) * hd].copy_from_slice(&pair[hd..]);
                }
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
            b.norm_rope(&mut s.q[..n * qd], qd, c.head_dim, w.q_norm.as_deref(), c.norm_eps, &rope);
            b.norm_rope(&mut s.k[..n * kvd], kvd, c.head_dim, w.k_norm.as_deref(), c.norm_eps, &rope);
            if let Some(temp) = a.temp {
                for (q, &(_, pos)) in s.q[..n * qd].chunks_exact_mut(qd).zip(rows) {
                    let f = temp.factor(pos);
                    q.iter_mut().for_each(|v| *v *= f);
                }
            }
            let mut off = 0;
            for (kv, &cnt) in kvs.iter_mut().zip(counts) {
                kv.append(slot, &s.k[off * kvd..(off + cnt) * kvd], &s.v[off * kvd..(off + cnt) * kvd]);
                off += cnt;
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
            moe(b, e, &s.h[..n * d], d, &r, hidden, c.expert_act, &mut s.moe, &mut s.o);
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
