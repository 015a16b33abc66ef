//! The device seam: what the forward pass asks of whatever runs it. The skeleton
//! (`model::forward`) is written once against `Ops`; the CPU executes each op as it comes
//! (`cpu::pass`), a Vulkan device records the same ops into one dispatch chain per step
//! (`vulkan::ops`). Activations are views (`Act`) into the pass's buffers (`Buf`), which the
//! device holds: host vectors on the CPU, device buffers on a GPU. Everything that varies
//! between two steps of one shape (tokens, positions, RoPE tables, which rows get logits) is in
//! the pass's inputs (`PassIn`), never in the ops' arguments, so a device may record a step's
//! ops once and replay them for every later step of that shape.

use super::{Activation, AttnShape, DeltaNet, DnParams, Rope, Route};
use crate::quant::Weight;

/// The pass's activation buffers, by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Buf {
    /// The residual stream.
    X,
    /// A normed copy of it (a mixer's or an FFN's input), and the rows that get logits.
    H,
    Q,
    K,
    V,
    Att,
    O,
    Gate,
    Up,
    /// A gated attention layer's interleaved queries and gates, then its gates.
    Qg,
    AttnGate,
    DnQkv,
    DnZ,
    DnBeta,
    DnAlpha,
    DnBa,
    DnOut,
    /// gemma4: the routed half of a `DenseMoe` FFN, and its router's input.
    O2,
    Rin,
    /// gemma4: every row's per-layer inputs, and one layer's share of them.
    Ple,
    PleOne,
    /// Router logits, a shared expert's gate.
    Router,
    /// A shared expert's output.
    Shared,
    /// Every row's hidden state after the final norm, where kept (what an MTP head reads).
    Hidden,
    Logits,
}

impl Buf {
    pub const COUNT: usize = Buf::Logits as usize + 1;
}

/// `len` values of buffer `buf` from value `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Act {
    pub buf: Buf,
    pub off: usize,
    pub len: usize,
}

impl Act {
    /// Rows `from..to` of this view taken as rows of `width` values.
    pub fn rows(self, from: usize, to: usize, width: usize) -> Act {
        debug_assert!(to * width <= self.len, "rows {from}..{to} of {width} past a view of {}", self.len);
        Act { buf: self.buf, off: self.off + from * width, len: (to - from) * width }
    }
}

/// What one pass reads besides the weights: session i takes `counts[i]` of `tokens`; row t of
/// the batch is `rows[t]` = (session, position); `picked` are the rows that get logits.
pub struct PassIn<'a> {
    pub tokens: &'a [u32],
    pub counts: &'a [usize],
    pub rows: Vec<(usize, usize)>,
    pub picked: Vec<usize>,
    /// Every distinct RoPE of the model and its sines and cosines for each row (dim/2 pairs a row).
    pub ropes: Vec<Rope>,
    pub tables: Vec<Vec<(f32, f32)>>,
    /// Per-row factors (`Ops::scale_rows`), one value a row: one table for each key, a
    /// family's own description of the factor (mistral3's attention temperature: scale, floor).
    pub row_scales: Vec<Vec<f32>>,
    pub row_scale_keys: Vec<(f32, usize)>,
    /// Sessions whose recurrent layers record their raw inputs (`kv::Journal`).
    pub journal: Vec<bool>,
    /// Rows whose input is given instead of their token's embedding (an image's rows).
    pub embeds: Option<RowEmbeds<'a>>,
    /// Per batch row, the end (exclusive) of the positions it attends, where some row attends
    /// past its own (the rows of one image see each other); empty: causal, each row up to its own.
    pub key_ends: Vec<usize>,
    /// `key_ends` applies to the sliding-window layers only (`Config::image_spans_sliding_only`):
    /// a full layer's rows stay causal.
    pub key_ends_sliding_only: bool,
}

/// Input rows given as values (`PassIn::embeds`): batch row `rows[i]` takes the first `dim` of
/// its `width()` values as it stands (no embedding scale); a model with deepstack layers reads
/// the slices after them (`Ops::add_given`).
#[derive(Clone, Copy, Debug)]
pub struct RowEmbeds<'a> {
    pub rows: &'a [usize],
    pub values: &'a [f32],
}

impl RowEmbeds<'_> {
    /// Values per given row (the model's `Config::embd_inp`, checked before the pass).
    pub fn width(&self) -> usize {
        self.values.len() / self.rows.len().max(1)
    }
}

/// The routed experts of one layer as `Ops::experts` takes them.
pub struct ExpertSet<'a> {
    pub gate: &'a [Weight],
    pub up: &'a [Weight],
    pub down: &'a [Weight],
    /// gpt-oss: biases of every expert's gate, up and down rows (expert e's at e * rows).
    pub biases: Option<[&'a [f32]; 3]>,
    pub act: Activation,
    /// Multiplies expert e's output (gemma4's `ffn_down_exps.scale`).
    pub expert_scale: Option<&'a [f32]>,
    /// Rows of each expert's gate and up.
    pub hidden: usize,
}

/// What `Ops::embed` writes in the rows given as values (`PassIn::embeds`, an image's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Given {
    /// Their given values (the token embedding's place).
    Values,
    /// Row `id` of the table, times the scale, as if that were their token (gemma4's per-layer
    /// inputs of an image's rows: llama.cpp reads the padding token's, 0).
    Token(u32),
}

/// The ops of one forward pass. Each computes every row with the same arithmetic whatever else
/// the batch holds. A device that cannot run an op remembers why, runs nothing more, and says
/// so when the pass ends; ops return nothing, so the skeleton reads as the arithmetic it is.
pub trait Ops {
    /// The first `len` values of `buf` (contents unspecified until an op writes them).
    fn alloc(&mut self, buf: Buf, len: usize) -> Act;

    /// Row t of `out` = row `tokens[t]` of `w`, times `scale`; the rows `PassIn::embeds` names
    /// take what `given` says instead.
    fn embed(&mut self, w: &Weight, scale: f32, given: Given, out: Act);

    /// out_j = x · W_jᵀ for several weights of one input (Q/K/V, gate/up) in one pass over the
    /// rows. `alone`: every row is a matrix of its own to ggml's summation order (expert rows,
    /// logits); else each session's rows are one.
    fn matmul(&mut self, segs: &[(&Weight, Act)], x: Act, alone: bool);

    /// `out` = each row of `x` (rows of `width`) RMS-normed, times `w` where given; `out` may be `x`.
    fn rms_norm(&mut self, x: Act, out: Act, w: Option<&[f32]>, width: usize, eps: f32);

    /// Per head of each row (`width` values per row, heads of `head_dim`): the optional RMS norm
    /// (QK-norm), then the rotary embedding of the row's position from the pass's table `rope`.
    fn norm_rope(&mut self, x: Act, width: usize, head_dim: usize, norm: Option<&[f32]>, eps: f32, rope: usize);

    /// gate = act(gate) * up, rows of `width`.
    fn glu(&mut self, gate: Act, up: Act, width: usize, act: Activation);

    /// x += y.
    fn add(&mut self, x: Act, y: Act);

    /// Add slice `slice` (values `slice * width..(slice + 1) * width` of the given row) to each
    /// row of `x` that `PassIn::embeds` names (Qwen3-VL's deepstack: an image row's features
    /// for the output of layer `slice - 1`); rows of `width`, the other rows untouched.
    fn add_given(&mut self, x: Act, width: usize, slice: usize);

    /// Add `bias` to every row of `x` (rows of `bias.len()` values).
    fn add_bias(&mut self, x: Act, bias: &[f32]);

    /// x *= a, each value.
    fn scale(&mut self, x: Act, a: f32);

    /// Each row of `x` (rows of `v.len()`): x[j] = x[j] * a * v[j].
    fn scale_cols(&mut self, x: Act, a: f32, v: &[f32]);

    /// Row t of `x` (rows of `width`) times the pass's `row_scales[table][t]`.
    fn scale_rows(&mut self, x: Act, width: usize, table: usize);

    /// x = cap * tanh(x / cap), each value.
    fn softcap(&mut self, x: Act, cap: f32);

    /// x = sigmoid(x), each value.
    fn sigmoid(&mut self, x: Act);

    /// x *= y, each value.
    fn mul(&mut self, x: Act, y: Act);

    /// Row t of `x` (rows of `width`) += s[t] * row t of `y`.
    fn add_scaled_rows(&mut self, x: Act, y: Act, s: Act, width: usize);

    /// Columns `src_col..src_col + cols` of each row of `src` (rows of `src_width`) into columns
    /// `dst_col..` of the same row of `dst` (rows of `dst_width`); different buffers.
    #[allow(clippy::too_many_arguments)]
    fn copy_cols(&mut self, src: Act, src_width: usize, src_col: usize, dst: Act, dst_width: usize, dst_col: usize, cols: usize);

    /// The pass's picked rows of `src` (rows of `width`), in order, into `dst`.
    fn gather_rows(&mut self, src: Act, dst: Act, width: usize);

    /// Write every row's K and V (rows of `kvd`) at its position in its session's K/V slot `slot`.
    fn kv_store(&mut self, slot: usize, k: Act, v: Act, kvd: usize);

    /// Causal attention of each query row over its session's K/V in slot `slot` (which already
    /// holds the row's own position).
    fn attention(&mut self, a: &AttnShape, slot: usize, q: Act, out: Act);

    /// Route each row of router `logits` as `r` says and run its chosen experts over its row of
    /// `x`, their outputs weighted and summed into `out` (llama.cpp's `build_moe_ffn`).
    fn experts(&mut self, e: &ExpertSet<'_>, r: &Route<'_>, logits: Act, x: Act, out: Act);

    /// One gated DeltaNet layer over the batch's projections (`cpu::deltanet::delta_net` says
    /// what each holds before and after) with each session's state in recurrent slot `slot`.
    #[allow(clippy::too_many_arguments)]
    fn delta_net(&mut self, dn: &DeltaNet, p: &DnParams, slot: usize, qkv: Act, beta: Act, alpha: Act, out: Act);

    /// Host rows into `x`.
    fn load(&mut self, src: &[f32], x: Act);
}

/// The host's storage of a pass's buffers, kept by the caller between passes so decode does
/// not allocate per token; the caller reads a pass's results from it.
pub struct HostActs {
    pub bufs: [Vec<f32>; Buf::COUNT],
    /// The CPU's quantized activations.
    pub act: Vec<u8>,
    /// The routed experts' gathered rows (input, gate, up, output) and routing.
    pub moe: [Vec<f32>; 4],
    pub route: Vec<(usize, f32)>,
    pub picked: Vec<(usize, f32)>,
}

impl HostActs {
    pub const fn new() -> HostActs {
        HostActs { bufs: [const { Vec::new() }; Buf::COUNT], act: Vec::new(), moe: [const { Vec::new() }; 4], route: Vec::new(), picked: Vec::new() }
    }

    pub fn get(&self, a: Act) -> &[f32] {
        &self.bufs[a.buf as usize][a.off..a.off + a.len]
    }
}

impl Default for HostActs {
    fn default() -> HostActs {
        HostActs::new()
    }
}

/// The host's buffers of a pass, reused across calls so decode does not allocate per token.
pub struct Scratch {
    pub acts: HostActs,
    /// Keep every row's hidden state after the final norm in `hidden` (rows of `dim`, in batch
    /// order): what an MTP head reads beside the next token.
    pub keep_hidden: bool,
    pub hidden: Vec<f32>,
    /// A split model's hidden states between the device's layers and the host's.
    pub split: Vec<f32>,
}

impl Scratch {
    pub const fn new() -> Scratch {
        Scratch { acts: HostActs::new(), keep_hidden: false, hidden: Vec::new(), split: Vec::new() }
    }
}

impl Default for Scratch {
    fn default() -> Scratch {
        Scratch::new()
    }
}
