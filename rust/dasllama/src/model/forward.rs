//! The forward pass shared by every family: embed, then each layer as its description says
//! (mixer, FFN, norms), then the final norm and the logits of the rows asked for. It owns the
//! activation rows and no kernel: every op goes through the backend boundary (`backend::Ops`).
//! Multi-token calls (prefill, verify chunks, batches) run every matmul as one GEMM over all rows.

use super::{AttnTemp, BetaAlpha, Experts, Ffn, FfnWeights, LayerDesc, Mixer, MixerWeights, Model, Rope};
use crate::backend::Gating;
pub use crate::backend::LogitRows;
pub use crate::backend::Scratch;
use crate::backend::{
    rope_cache, Act, Activation, Buf, DevKv, DnParams, ExpertSet, Given, HostActs, MatmulOffload, Numerics, Ops, PassIn, Placeable, Placement, Route, RowEmbeds,
};
use crate::kv::{Grid, Grids, KvCache};
use crate::quant::Weight;
use crate::{Error, Result};

/// What the skeleton leaves in the pass's buffers: the rows asked for (logits, or hidden states
/// for `LogitRows::Hidden`), and every row's hidden state after the final norm where kept.
#[derive(Clone, Copy, Debug)]
pub struct PassOut {
    pub out: Act,
    pub hidden: Option<Act>,
}

/// A gated DeltaNet layer over the batch's rows `h` into `Buf::O` (`config::DeltaNet`).
#[allow(clippy::too_many_arguments)]
fn delta_net(b: &mut dyn Ops, dn: &super::DeltaNet, w: &super::DeltaNetWeights, slot: usize, h: Act, n: usize, d: usize, eps: f32) -> Act {
    let (cd, vd, nv) = (dn.conv_dim(), dn.value_dim(), dn.n_v_heads);
    let qkv = b.alloc(Buf::DnQkv, n * cd);
    let z = b.alloc(Buf::DnZ, n * vd);
    let beta = b.alloc(Buf::DnBeta, n * nv);
    let alpha = b.alloc(Buf::DnAlpha, n * nv);
    match &w.ba {
        BetaAlpha::Split { beta: wb, alpha: wa } => b.matmul(&[(&w.qkv, qkv), (&w.gate, z), (wb, beta), (wa, alpha)], h, false),
        BetaAlpha::Fused(ba) => {
            let pairs = b.alloc(Buf::DnBa, n * 2 * nv);
            b.matmul(&[(&w.qkv, qkv), (&w.gate, z), (ba, pairs)], h, false);
            // Per key head: its value heads' betas, then their alphas.
            let r = nv / dn.n_k_heads;
            b.copy_cols(pairs, 2 * r, 0, beta, r, 0, r);
            b.copy_cols(pairs, 2 * r, r, alpha, r, 0, r);
        }
    }
    let p = DnParams { conv: &w.conv, dt_bias: &w.dt_bias, a: &w.a };
    let out = b.alloc(Buf::DnOut, n * vd);
    b.delta_net(dn, &p, slot, qkv, beta, alpha, out);
    // Each head RMS-normed, then gated by SiLU of z (the product lands in z).
    b.rms_norm(out, out, Some(&w.norm), w.norm.len(), eps);
    b.glu(z, out, vd, Activation::Silu);
    let o = b.alloc(Buf::O, n * d);
    b.matmul(&[(&w.out, o)], z, false);
    o
}

/// How a layer's experts run beyond their routing: the router's input where it is not the
/// experts' (gemma4), the GLU's activation, and each expert's output scale, if any.
struct ExpertRun<'a> {
    router_in: Option<Act>,
    act: Activation,
    expert_scale: Option<&'a [f32]>,
}

/// The routed experts of one layer over the `n` rows of `h` into `o`, then the shared expert,
/// if any, over every row under its gate.
#[allow(clippy::too_many_arguments)]
fn moe(b: &mut dyn Ops, e: &Experts, h: Act, n: usize, d: usize, r: &Route<'_>, hd: usize, run: &ExpertRun<'_>, o: Act) {
    let logits = b.alloc(Buf::Router, n * r.n_expert);
    b.matmul(&[(&e.router, logits)], run.router_in.unwrap_or(h), true);
    if let Some(eb) = &e.biases {
        b.add_bias(logits, &eb.router);
    }
    let set = ExpertSet {
        gate: &e.gate,
        up: &e.up,
        down: &e.down,
        biases: e.biases.as_ref().map(|eb| [&eb.gate[..], &eb.up[..], &eb.down[..]]),
        act: run.act,
        expert_scale: run.expert_scale,
        hidden: hd,
    };
    b.experts(&set, r, logits, h, o);
    if let Some(sh) = &e.shared {
        let hs = sh.gate.rows;
        let (gate, up) = (b.alloc(Buf::Gate, n * hs), b.alloc(Buf::Up, n * hs));
        b.matmul(&[(&sh.gate, gate), (&sh.up, up)], h, true);
        b.glu(gate, up, hs, Activation::Silu);
        let out = b.alloc(Buf::Shared, n * d);
        b.matmul(&[(&sh.down, out)], gate, true);
        match &sh.gate_inp {
            Some(gi) => {
                let g = b.alloc(Buf::Router, n);
                b.matmul(&[(gi, g)], h, true);
                b.sigmoid(g);
                b.add_scaled_rows(o, out, g, d);
            }
            // Ungated (glm4moe): the routed output plus the shared one.
            None => b.add(o, out),
        }
    }
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
    forward_batch_with(m, kvs, counts, tokens, Span::whole(m), None, want, s, logits, offload)
}

/// Rows of a pass given as values instead of tokens (`PassIn::embeds`), with the spans of
/// rows that see each other (an image's rows, non-causal among themselves as llama.cpp's mtmd
/// decodes Gemma 3's images): `spans` holds (first row, rows) in the pass's rows, each span
/// inside one session's rows.
#[derive(Clone, Copy, Debug)]
pub struct Injected<'a> {
    pub embeds: RowEmbeds<'a>,
    pub spans: &'a [(usize, usize)],
    /// Images on M-RoPE axes (Qwen-VL): (session index in the batch, its `Grid` in that
    /// session's rows), recorded in the session's K/V before the pass (an image of an earlier
    /// pass may come again: a prefix-cache hit holds its rows but not their layout).
    pub grids: &'a [(usize, Grid)],
}

/// `forward_batch` over `span` of the model's layers (the host's share of a split model: the
/// sessions' host K/V holds rows for those layers only), with some rows' inputs given
/// (`Injected`; host K/V only).
#[allow(clippy::too_many_arguments)]
pub fn forward_batch_with(
    m: &Model,
    kvs: &mut [&mut KvCache],
    counts: &[usize],
    tokens: &[u32],
    span: Span<'_>,
    injected: Option<Injected<'_>>,
    want: LogitRows<'_>,
    s: &mut Scratch,
    logits: &mut Vec<f32>,
    offload: Option<&mut dyn MatmulOffload>,
) -> Result<()> {
    check(m, kvs.iter().map(|kv| kv.len()), counts, tokens, want)?;
    if let Some(inj) = injected {
        check_injected(m, counts, &inj)?;
    }
    for (kv, &cnt) in kvs.iter_mut().zip(counts) {
        let want = kv.len() + cnt;
        kv.reserve(want)?;
    }
    if let Some(inj) = injected {
        for &(si, g) in inj.grids {
            kvs[si].add_grid(g);
        }
    }
    let lens: Vec<usize> = kvs.iter().map(|kv| kv.len()).collect();
    let mut inp = pass_inputs(m, &m.config.layers, &lens, counts, tokens, want);
    if inp.ropes.iter().any(|r| r.mrope.is_some()) && kvs.iter().any(|kv| !kv.grids().is_empty()) {
        let grids: Vec<&Grids> = kvs.iter().map(|kv| kv.grids()).collect();
        inp.tables = mrope_tables(m, &inp.ropes, &inp.rows, &grids);
    }
    if let Some(inj) = injected {
        inp.embeds = Some(inj.embeds);
        if !inj.spans.is_empty() {
            inp.key_ends = key_ends(&inp.rows, inj.spans);
            inp.key_ends_sliding_only = m.config.image_spans_sliding_only;
        }
    }
    let keep = s.keep_hidden;
    let mut out = None;
    m.rt.host().pass(m.numerics, &mut s.acts, kvs, &inp, offload, &mut |b| out = Some(forward_span(m, b, &inp, span.clone(), want, keep)));
    let Some(out) = out else {
        // Nothing committed: forget the images recorded for rows the pass did not add.
        for kv in kvs.iter_mut() {
            let len = kv.len();
            kv.truncate(len);
        }
        return Err(Error::Internal("the host ran no pass".into()));
    };
    take_rows(&mut s.acts, out.out, logits);
    if let Some(h) = out.hidden {
        s.hidden.clear();
        s.hidden.extend_from_slice(s.acts.get(h));
    }
    for (kv, &cnt) in kvs.iter_mut().zip(counts) {
        let len = kv.len() + cnt;
        kv.commit(len);
    }
    Ok(())
}

/// A pass's result rows out of the host's buffers into `out`: the logits buffer changes places
/// with `out` (a vocabulary's rows are not copied), anything else is copied.
pub(super) fn take_rows(acts: &mut HostActs, a: Act, out: &mut Vec<f32>) {
    if a.buf == Buf::Logits && a.off == 0 {
        std::mem::swap(out, &mut acts.bufs[Buf::Logits as usize]);
        out.truncate(a.len);
    } else {
        out.clear();
        out.extend_from_slice(acts.get(a));
    }
}

/// What a pass over `descs` (the model's layers, or a head's) reads besides the weights, for
/// sessions at positions `lens` taking `counts` of `tokens`.
pub fn pass_inputs<'a>(m: &Model, descs: &[LayerDesc], lens: &[usize], counts: &'a [usize], tokens: &'a [u32], want: LogitRows<'_>) -> PassIn<'a> {
    let mut rows = Vec::with_capacity(tokens.len());
    for (si, (&len, &cnt)) in lens.iter().zip(counts).enumerate() {
        rows.extend((0..cnt).map(|j| (si, len + j)));
    }
    let mut ropes: Vec<Rope> = Vec::new();
    let mut temps: Vec<AttnTemp> = Vec::new();
    for d in descs {
        if let Mixer::Attention(a) = &d.mixer {
            if !ropes.contains(&a.rope) {
                ropes.push(a.rope);
            }
            if let Some(t) = a.temp.filter(|t| !temps.contains(t)) {
                temps.push(t);
            }
        }
    }
    let tables = rope_tables(m, &ropes, &rows);
    PassIn {
        tokens,
        counts,
        picked: want.picked(counts),
        ropes,
        tables,
        row_scales: temps.iter().map(|t| rows.iter().map(|&(_, pos)| t.factor(pos)).collect()).collect(),
        row_scale_keys: temps.iter().map(|t| (t.scale, t.floor)).collect(),
        journal: counts.iter().enumerate().map(|(i, &cnt)| want != LogitRows::Hidden && want.tail(i, cnt) > 1).collect(),
        rows,
        embeds: None,
        key_ends: Vec::new(),
        key_ends_sliding_only: false,
    }
}

/// `forward_batch` for sessions whose K/V lives on `p`'s device, with some rows' inputs given
/// (`Injected`, as `forward_batch_with` takes them): the call runs in windows of the device's
/// size (a session's rows in order, so a later window reads the K/V an earlier one wrote), each
/// one device pass of the same skeleton. A span of rows that see each other goes into one
/// window whole (a window holds a longer one alone). A pass that fails leaves every session's
/// length as it was.
#[allow(clippy::too_many_arguments)]
pub fn forward_device(
    m: &Model,
    p: &dyn Placement,
    kvs: &mut [&mut DevKv],
    counts: &[usize],
    tokens: &[u32],
    injected: Option<Injected<'_>>,
    want: LogitRows<'_>,
    out: &mut Vec<f32>,
) -> Result<()> {
    check(m, kvs.iter().map(|kv| kv.len()), counts, tokens, want)?;
    if let Some(inj) = injected {
        check_injected(m, counts, &inj)?;
    }
    if kvs.iter().any(|kv| !p.owns(kv)) {
        return Err(Error::Device(
            "this device session's model is no longer on the device (it was dropped, switched out, or the device was lost); create a new session".into(),
        ));
    }
    let ctx = p.session_ctx();
    for (kv, &c) in kvs.iter().zip(counts) {
        if kv.len() + c > ctx {
            return Err(Error::ContextOverflow(format!(
                "{c} tokens at position {} would run past the {ctx} positions a device region holds; start a new session or raise set_gpu_ctx_max",
                kv.len()
            )));
        }
    }
    let inj = injected.unwrap_or(Injected { embeds: RowEmbeds { rows: &[], values: &[] }, spans: &[], grids: &[] });
    for &(si, g) in inj.grids {
        kvs[si].add_grid(g);
    }
    let done = device_windows(m, p, kvs, counts, tokens, &inj, want, out);
    for (kv, &c) in kvs.iter_mut().zip(counts) {
        match done {
            Ok(()) => kv.advance(c),
            // Forget the images recorded for rows the call did not add.
            Err(_) => {
                let len = kv.len();
                kv.truncate(len);
            }
        }
    }
    done
}

/// `forward_device`'s windows, after its checks.
#[allow(clippy::too_many_arguments)]
fn device_windows(
    m: &Model,
    p: &dyn Placement,
    kvs: &[&mut DevKv],
    counts: &[usize],
    tokens: &[u32],
    inj: &Injected<'_>,
    want: LogitRows<'_>,
    out: &mut Vec<f32>,
) -> Result<()> {
    let hidden = want == LogitRows::Hidden;
    let (max_rows, max_out) = p.window();
    out.clear();
    // Where each row of the call stops attending, where some rows see past their own.
    let ends = (!inj.spans.is_empty()).then(|| {
        let all: Vec<(usize, usize)> = counts.iter().enumerate().flat_map(|(i, &c)| (0..c).map(move |j| (i, kvs[i].len() + j))).collect();
        key_ends(&all, inj.spans)
    });
    let width = inj.embeds.width();
    // Pieces of the window being gathered: (session, first row, rows, rows before its first logit row).
    let mut win: Vec<(usize, usize, usize, usize)> = Vec::new();
    let (mut rows, mut outs, mut tok_at) = (0, 0, Vec::with_capacity(counts.len()));
    let mut t = 0;
    for &cnt in counts {
        tok_at.push(t);
        t += cnt;
    }
    let run = |win: &mut Vec<(usize, usize, usize, usize)>, out: &mut Vec<f32>| -> Result<()> {
        let regions: Vec<usize> = win.iter().map(|&(i, ..)| kvs[i].region()).collect();
        let lens: Vec<usize> = win.iter().map(|&(i, done, ..)| kvs[i].len() + done).collect();
        let wc: Vec<usize> = win.iter().map(|w| w.2).collect();
        // The window's rows by their index in the call.
        let at: Vec<usize> = win.iter().flat_map(|&(i, done, len, _)| tok_at[i] + done..tok_at[i] + done + len).collect();
        let toks: Vec<u32> = at.iter().map(|&g| tokens[g]).collect();
        let mut picked = Vec::new();
        let mut r0 = 0;
        for &(_, _, len, from) in win.iter() {
            picked.extend(r0 + from..r0 + len);
            r0 += len;
        }
        let mut inp = m.pass_in(&lens, &wc, &toks, picked);
        if inp.ropes.iter().any(|r| r.mrope.is_some()) && win.iter().any(|&(i, ..)| !kvs[i].grids().is_empty()) {
            let grids: Vec<&Grids> = win.iter().map(|&(i, ..)| kvs[i].grids()).collect();
            inp.tables = mrope_tables(m, &inp.ropes, &inp.rows, &grids);
        }
        // The window's given rows, renumbered, and their values.
        let (mut given, mut values) = (Vec::new(), Vec::new());
        for (r, &g) in at.iter().enumerate().filter(|_| !inj.embeds.rows.is_empty()) {
            if let Ok(k) = inj.embeds.rows.binary_search(&g) {
                given.push(r);
                values.extend_from_slice(&inj.embeds.values[k * width..(k + 1) * width]);
            }
        }
        if !given.is_empty() {
            inp.embeds = Some(RowEmbeds { rows: &given, values: &values });
        }
        // Only a window holding a span (whole, `span_cut`) takes a chain that reads the ends.
        if let Some(ends) = ends.as_ref().filter(|_| inj.spans.iter().any(|&(a, _)| at.contains(&a))) {
            inp.key_ends = at.iter().map(|&g| ends[g]).collect();
            inp.key_ends_sliding_only = m.config.image_spans_sliding_only;
        }
        win.clear();
        p.forward(m, &regions, &inp, hidden, out)
    };
    for (i, &cnt) in counts.iter().enumerate() {
        let out_from = cnt - want.tail(i, cnt);
        let mut done = 0;
        while done < cnt {
            let first_out = out_from.max(done);
            let room = max_rows.saturating_sub(rows).min((max_out + first_out - done).saturating_sub(outs));
            let take = span_cut(inj.spans.iter().copied(), tok_at[i] + done, (cnt - done).min(room), win.is_empty());
            if take == 0 {
                run(&mut win, out)?;
                (rows, outs) = (0, 0);
                continue;
            }
            win.push((i, done, take, first_out - done));
            rows += take;
            outs += (done + take).saturating_sub(first_out);
            done += take;
        }
    }
    if !win.is_empty() {
        run(&mut win, out)?;
    }
    Ok(())
}

/// How many of `take` rows from row `from` a pass takes so that no span of rows that see each
/// other, (first row, rows), is cut: up to the span the cut falls in, or, where the pass would
/// start with it (`empty`) or already holds its first rows, to its end, however long; 0: close
/// the pass first. A device call's windows and the scheduler's prefill pieces cut so.
pub(crate) fn span_cut(spans: impl IntoIterator<Item = (usize, usize)>, from: usize, take: usize, empty: bool) -> usize {
    let to = from + take;
    match spans.into_iter().find(|&(a, n)| a < to && to < a + n) {
        Some((a, _)) if a > from => a - from,
        Some((a, n)) if empty => a + n - from,
        Some(_) => 0,
        None => take,
    }
}

impl Placeable for Model {
    fn arch(&self) -> &str {
        &self.config.arch
    }

    fn host_only(&self) -> Option<String> {
        (self.numerics == Numerics::Ggml).then(|| "numerics='ggml' reproduces llama.cpp's CPU order and runs on the CPU only".to_string())
    }

    fn matrices(&self) -> Vec<&Weight> {
        Model::matrices(self)
    }

    fn gathered(&self) -> Vec<&Weight> {
        std::iter::once(&self.tok_embd).chain(self.ple.as_ref().map(|p| &p.tok_embd)).collect()
    }

    fn kv_heads(&self) -> Vec<(usize, usize)> {
        let g = self.kv_geometry(crate::kv::PRIVATE_PAGE_ROWS, crate::kv::KvCodec::F16);
        (0..g.n_layers).map(|il| g.heads(il)).collect()
    }

    fn rec_layers(&self) -> Vec<crate::backend::DeltaNet> {
        self.config.rec_layers()
    }

    fn seq_len(&self) -> usize {
        self.config.seq_len
    }

    fn pass_in<'a>(&self, lens: &[usize], counts: &'a [usize], tokens: &'a [u32], picked: Vec<usize>) -> PassIn<'a> {
        let mut inp = pass_inputs(self, &self.config.layers, lens, counts, tokens, LogitRows::Hidden);
        inp.picked = picked;
        inp
    }

    fn pass(&self, b: &mut dyn Ops, inp: &PassIn<'_>, hidden: bool, layers: usize) -> Act {
        let span = Span { layers: 0..layers, x: None };
        forward_span(self, b, inp, span, if hidden { LogitRows::Hidden } else { LogitRows::All }, false).out
    }

    fn n_layers(&self) -> usize {
        self.layers.len()
    }

    fn splits(&self) -> bool {
        let c = &self.config;
        self.ple.is_none() && c.rec_layers().is_empty() && (0..self.layers.len()).all(|il| c.kv_slot(il) == Some(il))
    }

    fn layer_matrices(&self, il: usize) -> Vec<&Weight> {
        Model::layer_matrices(self, il)
    }
}

/// What a pass with given rows refuses: rows out of the pass or out of order, values not a row of
/// the model's width each, a span that is empty, leaves the pass or crosses a session.
fn check_injected(m: &Model, counts: &[usize], inj: &Injected<'_>) -> Result<()> {
    let n: usize = counts.iter().sum();
    let e = &inj.embeds;
    if e.rows.windows(2).any(|w| w[0] >= w[1]) || e.rows.last().is_some_and(|&r| r >= n) {
        return Err(Error::InvalidArgument(format!("embedding rows must be increasing row numbers below {n}")));
    }
    let width = m.config.embd_inp();
    if e.values.len() != e.rows.len() * width {
        let (k, dim) = (m.config.deepstack, m.config.dim);
        let deep = if k > 0 { format!(": the input and {k} deepstack slice{} of {dim}", if k == 1 { "" } else { "s" }) } else { String::new() };
        return Err(Error::InvalidArgument(format!(
            "{} embedding rows need {} values ({width} each{deep}), got {}",
            e.rows.len(),
            e.rows.len() * width,
            e.values.len()
        )));
    }
    if inj.grids.iter().any(|&(si, g)| si >= counts.len() || g.nx == 0 || g.ny == 0) {
        return Err(Error::InvalidArgument("an image's M-RoPE grid must name a session of the batch and have rows and columns".into()));
    }
    // The session of each row, to keep a span inside one.
    let owner: Vec<usize> = counts.iter().enumerate().flat_map(|(i, &c)| std::iter::repeat_n(i, c)).collect();
    if inj.spans.iter().any(|&(first, len)| len == 0 || first + len > n || owner[first] != owner[first + len - 1]) {
        return Err(Error::InvalidArgument(format!("a span of rows that see each other must be non-empty, inside the pass's {n} rows and one session's")));
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

/// The skeleton, on whatever device runs `b`. K/V rows are written at each session's positions
/// (reserved by the caller), and committed by the caller once the pass has returned: a pass that
/// fails midway leaves every session as it was.
pub fn forward_rows(m: &Model, b: &mut dyn Ops, inp: &PassIn<'_>, want: LogitRows<'_>, keep_hidden: bool) -> PassOut {
    forward_span(m, b, inp, Span::whole(m), want, keep_hidden)
}

/// The layers a pass runs, when it runs some (a model split between devices): layers
/// `layers` of the model's, from the embedded tokens or, where `x` is given, from those rows
/// (every row's hidden state before `layers.start`). A span that stops before the last layer
/// leaves every row's hidden state, not the head's output.
#[derive(Clone)]
pub struct Span<'a> {
    pub layers: std::ops::Range<usize>,
    pub x: Option<&'a [f32]>,
}

impl Span<'_> {
    pub fn whole(m: &Model) -> Span<'static> {
        Span { layers: 0..m.layers.len(), x: None }
    }
}

/// `forward_rows` over `span` of the model's layers.
pub fn forward_span(m: &Model, b: &mut dyn Ops, inp: &PassIn<'_>, span: Span<'_>, want: LogitRows<'_>, keep_hidden: bool) -> PassOut {
    let c = &m.config;
    let (n, d) = (inp.tokens.len(), c.dim);
    let x = b.alloc(Buf::X, n * d);
    match span.x {
        // A model split between devices has no per-layer inputs (`Placeable::splits`), which
        // are made from the embedding.
        Some(rows) => b.load(rows, x),
        None => {
            b.embed(&m.tok_embd, c.embed_scale.unwrap_or(1.0), Given::Values, x);
            if let Some(p) = &m.ple {
                per_layer_inputs(m, b, p, x, n);
            }
        }
    }
    for (il, (l, desc)) in m.layers.iter().zip(&c.layers).enumerate().take(span.layers.end).skip(span.layers.start) {
        let slot = c.kv_slot(il).or(c.rec_slot(il)).expect("every layer keeps K/V or a recurrent state");
        block(m, b, inp, desc, l, slot, x);
        if let Some(p) = &l.ple {
            per_layer_mix(m, b, p, il, x, n);
        }
        if let Some(sc) = l.out_scale {
            b.scale(x, sc);
        }
        // Qwen3-VL's deepstack: an image row's slice il + 1 joins the layer's output (a token's
        // row has zeros there in llama.cpp, so nothing is added to it).
        if il < c.deepstack && inp.embeds.is_some() {
            b.add_given(x, d, il + 1);
        }
    }
    if span.layers.end < m.layers.len() {
        return PassOut { out: x, hidden: None };
    }
    let hidden = keep_hidden.then(|| {
        // Every row's hidden state after the final norm, for a drafter that reads it (MTP).
        let hid = b.alloc(Buf::Hidden, n * d);
        b.rms_norm(x, hid, Some(&m.output_norm), d, c.norm_eps);
        hid
    });
    let out_rows = inp.picked.len();
    let last = b.alloc(Buf::H, out_rows * d);
    b.gather_rows(x, last, d);
    b.rms_norm(last, last, Some(&m.output_norm), d, c.norm_eps);
    if want == LogitRows::Hidden {
        return PassOut { out: last, hidden };
    }
    let logits = b.alloc(Buf::Logits, out_rows * c.vocab_size);
    // One row per output: each is a row on its own to ggml's order.
    b.matmul(&[(&m.output, logits)], last, true);
    if let Some(cap) = c.final_softcap {
        b.softcap(logits, cap);
    }
    PassOut { out: logits, hidden }
}

/// gemma4's per-layer inputs of the batch's rows into `Buf::Ple` (each row n_layers *
/// per_layer_input values, layer by layer), as llama.cpp's `project_per_layer_inputs`: the token's
/// row of `per_layer_token_embd` scaled by sqrt(per_layer_input), plus the scaled embedding `x`
/// projected, scaled by 1/sqrt(dim) and RMS-normed per layer, the sum scaled by 1/sqrt(2).
fn per_layer_inputs(m: &Model, b: &mut dyn Ops, p: &super::Ple, x: Act, n: usize) {
    let c = &m.config;
    let np = c.per_layer_input;
    let width = np * c.n_layers;
    let proj = b.alloc(Buf::Ple, n * width);
    b.matmul(&[(&p.proj, proj)], x, false);
    b.scale(proj, 1.0 / (c.dim as f32).sqrt());
    b.rms_norm(proj, proj, Some(&p.proj_norm), np, c.norm_eps);
    let tok = b.alloc(Buf::PleOne, n * width);
    // An image's rows take the padding token's (0) row, as llama.cpp's gemma4 graph does for
    // rows given as embeddings.
    b.embed(&p.tok_embd, (np as f32).sqrt(), Given::Token(0), tok);
    b.add(proj, tok);
    b.scale(proj, 1.0 / 2f32.sqrt());
}

/// Layer `il`'s use of its per-layer input (`PleLayer`), added to the rows `x`.
fn per_layer_mix(m: &Model, b: &mut dyn Ops, p: &super::PleLayer, il: usize, x: Act, n: usize) {
    let c = &m.config;
    let (d, np) = (c.dim, c.per_layer_input);
    let width = np * c.n_layers;
    // This layer's share of every row's inputs, as one matrix.
    let ple = b.alloc(Buf::Ple, n * width);
    let inp = b.alloc(Buf::PleOne, n * np);
    b.copy_cols(ple, width, il * np, inp, np, 0, np);
    let g = b.alloc(Buf::Gate, n * np);
    b.matmul(&[(&p.gate, g)], x, false);
    // gelu(gate) times the input: a GLU with the input as its up half.
    b.glu(g, inp, np, Activation::GeluTanh);
    let o = b.alloc(Buf::O, n * d);
    b.matmul(&[(&p.proj, o)], g, false);
    b.rms_norm(o, o, Some(&p.post_norm), d, c.norm_eps);
    b.add(x, o);
}

/// RoPE sines and cosines per row, once for every layer (one table per distinct RoPE).
pub(super) fn rope_tables(m: &Model, ropes: &[Rope], rows: &[(usize, usize)]) -> Vec<Vec<(f32, f32)>> {
    rope_tables_with(ropes, rows, m.rope_factors.as_deref())
}

/// Where each of `rows` (session, position) stops attending: after its own position, or, in a
/// span of rows that see each other (`Injected::spans`), after the span's last.
fn key_ends(rows: &[(usize, usize)], spans: &[(usize, usize)]) -> Vec<usize> {
    let mut ends: Vec<usize> = rows.iter().map(|&(_, pos)| pos + 1).collect();
    for &(first, n) in spans {
        let end = rows[first + n - 1].1 + 1;
        ends[first..first + n].iter_mut().for_each(|e| *e = end);
    }
    ends
}

/// `rope_tables` for rows whose sessions hold images on M-RoPE axes: each row's three axis
/// positions from its session's images (`Grids::pos`).
fn mrope_tables(m: &Model, ropes: &[Rope], rows: &[(usize, usize)], grids: &[&Grids]) -> Vec<Vec<(f32, f32)>> {
    let factors = m.rope_factors.as_deref();
    let mut one = Vec::new();
    ropes
        .iter()
        .map(|r| {
            let mut tab = Vec::with_capacity(rows.len() * r.dim / 2);
            for &(si, pos) in rows {
                crate::backend::rope_cache_axes(r, grids[si].pos(pos), factors, &mut one);
                tab.extend_from_slice(&one);
            }
            tab
        })
        .collect()
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
/// `slot`, or a DeltaNet in recurrent slot `slot`), then its FFN, each with its residual.
pub(super) fn block(m: &Model, b: &mut dyn Ops, inp: &PassIn<'_>, desc: &LayerDesc, l: &super::Layer, slot: usize, x: Act) {
    let c = &m.config;
    let (n, d, eps) = (inp.tokens.len(), c.dim, c.norm_eps);
    let LayerDesc { mixer, ffn, .. } = desc;
    let h = b.alloc(Buf::H, n * d);
    b.rms_norm(x, h, Some(&l.attn_norm), d, eps);
    let o = match mixer {
        Mixer::Attention(a) => {
            let MixerWeights::Attention(w) = &l.mixer else { unreachable!("the loader builds each layer's mixer weights from its description") };
            let heads = a.heads(c);
            let (qd, kvd, hd) = (heads.q_dim(), heads.kv_dim(), heads.head_dim);
            // A layer that reads an earlier layer's K/V projects queries only.
            let own_kv = a.kv_from.is_none();
            let (q, k, v) = (b.alloc(Buf::Q, n * qd), b.alloc(Buf::K, n * kvd), b.alloc(Buf::V, n * kvd));
            let gate = a.gated.then(|| b.alloc(Buf::AttnGate, n * qd));
            if let Some(g) = gate {
                // Q and its gate come interleaved per head: split them.
                let qg = b.alloc(Buf::Qg, n * 2 * qd);
                b.matmul(&[(&w.wq, qg), (&w.wk, k), (&w.wv, v)], h, false);
                b.copy_cols(qg, 2 * hd, 0, q, hd, 0, hd);
                b.copy_cols(qg, 2 * hd, hd, g, hd, 0, hd);
            } else if !own_kv {
                b.matmul(&[(&w.wq, q)], h, false);
            } else if w.wv.rows == 0 {
                // No V projection (gemma4's attention_k_eq_v): V is K's, before K's norm and RoPE.
                b.matmul(&[(&w.wq, q), (&w.wk, k)], h, false);
                b.copy_cols(k, kvd, 0, v, kvd, 0, kvd);
            } else {
                b.matmul(&[(&w.wq, q), (&w.wk, k), (&w.wv, v)], h, false);
            }
            for (bias, out) in [(&w.bq, q), (&w.bk, k), (&w.bv, v)] {
                if let Some(bias) = bias {
                    b.add_bias(out, bias);
                }
            }
            let ri = inp.ropes.iter().position(|r| *r == a.rope).expect("every layer's RoPE is tabulated");
            b.norm_rope(q, qd, hd, w.q_norm.as_deref(), eps, ri);
            if own_kv {
                b.norm_rope(k, kvd, hd, w.k_norm.as_deref(), eps, ri);
                if a.v_norm {
                    // Each value head RMS-normed with no weight.
                    b.rms_norm(v, v, None, hd, eps);
                }
            }
            if let Some(t) = a.temp {
                let ti = inp.row_scale_keys.iter().position(|&k| k == (t.scale, t.floor)).expect("every layer's temperature is tabulated");
                b.scale_rows(q, qd, ti);
            }
            if own_kv {
                b.kv_store(slot, k, v, kvd);
            }
            let att = b.alloc(Buf::Att, n * qd);
            let shape = crate::backend::AttnShape { sinks: w.sinks.as_deref(), ..a.shape(c) };
            b.attention(&shape, slot, q, att);
            if let Some(g) = gate {
                b.sigmoid(g);
                b.mul(att, g);
            }
            let o = b.alloc(Buf::O, n * d);
            b.matmul(&[(&w.wo, o)], att, false);
            if let Some(bo) = &w.bo {
                b.add_bias(o, bo);
            }
            o
        }
        Mixer::DeltaNet(dn) => {
            let MixerWeights::DeltaNet(w) = &l.mixer else { unreachable!("the loader builds each layer's mixer weights from its description") };
            delta_net(b, dn, w, slot, h, n, d, eps)
        }
    };
    if let Some(w) = &l.post_attn_norm {
        b.rms_norm(o, o, Some(w), d, eps);
    }
    b.add(x, o);

    b.rms_norm(x, h, Some(&l.ffn_norm), d, eps);
    let o = b.alloc(Buf::O, n * d);
    match (*ffn, &l.ffn) {
        (Ffn::Dense { hidden: hd, act, .. }, FfnWeights::Dense { gate, up, down }) => {
            let (g, u) = (b.alloc(Buf::Gate, n * hd), b.alloc(Buf::Up, n * hd));
            b.matmul(&[(gate, g), (up, u)], h, false);
            b.glu(g, u, hd, act);
            b.matmul(&[(down, o)], g, false);
        }
        (Ffn::Moe { n_expert, n_used, hidden, norm_weights, gating, scale, .. }, FfnWeights::Moe(e)) => {
            let r = Route { n_expert, n_used, gating, bias: e.sel_bias.as_deref(), norm: norm_weights, scale };
            let run = ExpertRun { router_in: None, act: c.expert_act, expert_scale: None };
            moe(b, e, h, n, d, &r, hidden, &run, o);
        }
        (Ffn::DenseMoe { hidden: hd, n_expert, n_used, expert_hidden, act }, FfnWeights::DenseMoe(p)) => {
            // The dense GLU on the FFN-normed rows.
            let (g, u) = (b.alloc(Buf::Gate, n * hd), b.alloc(Buf::Up, n * hd));
            b.matmul(&[(&p.gate, g), (&p.up, u)], h, false);
            b.glu(g, u, hd, act);
            b.matmul(&[(&p.down, o)], g, false);
            b.rms_norm(o, o, Some(&p.post_norm_1), d, eps);
            // The router reads the residual normed without a weight, scaled by 1/sqrt(dim) and
            // per value; the experts read it normed by pre_ffw_norm_2.
            let rin = b.alloc(Buf::Rin, n * d);
            b.rms_norm(x, rin, None, d, eps);
            b.scale_cols(rin, 1.0 / (d as f32).sqrt(), &p.router_scale);
            b.rms_norm(x, h, Some(&p.pre_norm_2), d, eps);
            let r = Route { n_expert, n_used, gating: Gating::Softmax, bias: None, norm: true, scale: 1.0 };
            let run = ExpertRun { router_in: Some(rin), act, expert_scale: p.expert_scale.as_deref() };
            let o2 = b.alloc(Buf::O2, n * d);
            moe(b, &p.experts, h, n, d, &r, expert_hidden, &run, o2);
            b.rms_norm(o2, o2, Some(&p.post_norm_2), d, eps);
            b.add(o, o2);
        }
        _ => unreachable!("the loader builds each layer's FFN weights from its description"),
    }
    if let Some(w) = &l.post_ffn_norm {
        b.rms_norm(o, o, Some(w), d, eps);
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
    m.rt.host().run(m.numerics, &mut Vec::new(), None, &mut |ops| {
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

#[cfg(test)]
mod tests {
    use super::span_cut;

    #[test]
    fn a_window_never_cuts_a_span_of_rows_that_see_each_other() {
        let spans = [(10, 20), (40, 300)];
        // A cut outside every span stands.
        assert_eq!(span_cut(spans, 0, 10, false), 10);
        assert_eq!(span_cut(spans, 30, 10, false), 10);
        // A cut inside a span moves before it, or closes a window that would start with it ...
        assert_eq!(span_cut(spans, 5, 10, false), 5);
        assert_eq!(span_cut(spans, 10, 5, false), 0);
        // ... and a window that starts with it takes it whole, however long.
        assert_eq!(span_cut(spans, 10, 5, true), 20);
        assert_eq!(span_cut(spans, 40, 256, true), 300);
        // A pass that starts inside a span takes it to its end.
        assert_eq!(span_cut(spans, 45, 100, true), 295);
        assert_eq!(span_cut([], 3, 7, true), 7);
    }
}
