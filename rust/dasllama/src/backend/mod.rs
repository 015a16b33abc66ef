//! The backend boundary: everything the forward pass asks of the hardware. The skeleton
//! (`model::forward`) holds no kernel; it calls these on activation rows it owns, and a backend
//! (the CPU in `cpu::backend`) decides how each runs. A model placed on a device (`Placement`,
//! the Vulkan driver's) runs whole passes there over device-home K/V, and hands the host its
//! matrix products (`MatmulOffload`) where it holds the weights but not the K/V.
//!
//! Rows: a batch is a matrix of `n` activation rows, `counts[i]` of them for session i, in order.
//! Every op computes each row with the same arithmetic whatever else is in the batch, which is
//! what makes batched, chunked and speculative results equal to one token at a time.

mod pass;
mod placement;
mod recurrent;

pub use pass::{Act, Buf, ExpertSet, Given, HostActs, Ops, PassIn, RowEmbeds, Scratch};

pub use placement::{DevKv, KvHome, Placeable, Placement, PlacementStatus, TowerPlacement, TowerStatus};
pub use recurrent::{DeltaNet, DnParams, HeadMap};

use crate::kv::{KvCache, RecIo};
use crate::quant::{GgmlType, Weight};

/// How a router turns its logits into scores (llama.cpp's `expert_gating_func`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    Softmax,
    Sigmoid,
    /// The experts chosen by their raw logits, weighted by a softmax over the chosen ones only
    /// (llama.cpp's `SOFTMAX_WEIGHT`, gpt-oss).
    SoftmaxWeight,
}

/// One layer's routing, for `Ops::route`.
#[derive(Clone, Copy, Debug)]
pub struct Route<'a> {
    pub n_expert: usize,
    pub n_used: usize,
    pub gating: Gating,
    /// Added to the scores to choose the experts only (`exp_probs_b`, one per expert).
    pub bias: Option<&'a [f32]>,
    pub norm: bool,
    /// Multiplies the weights (1: none).
    pub scale: f32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    GeluTanh,
    /// gpt-oss's clamped GLU (ggml's `swiglu_oai`): min(g, 7) * sigmoid(1.702 * min(g, 7)) *
    /// (clamp(u, -7, 7) + 1), with llama.cpp's constants.
    SwigluOai,
}

/// How dot products are added up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Numerics {
    /// Our tiled SIMD kernels: the same rounding of activations as llama.cpp, our own order.
    Fast,
    /// ggml's x86 AVX2 order in every matmul and attention product (`quant::ggml`): logits equal
    /// llama.cpp's AVX2 CPU build bit for bit, several times slower. For conformance checks.
    Ggml,
}

/// Where a backend may hand its matrix products (the Vulkan driver's per-op rails): `matmul`
/// runs `segs[i].1 = x · segs[i].0ᵀ` over `n` rows when it holds every weight of the call and
/// returns true; false leaves the call to the backend (nothing was written).
pub trait MatmulOffload {
    fn matmul(&mut self, segs: &mut [(&Weight, &mut [f32])], x: &[f32], n: usize) -> bool;

    /// A vision tower's attention on the device: per head, each of the n rows attends every
    /// row of its window, the windows being runs of consecutive rows of the lengths `spans`
    /// gives (empty: one window of all n). False leaves it to the host (nothing was written).
    #[allow(clippy::too_many_arguments)]
    fn full_attention(&mut self, _q: &[f32], _k: &[f32], _v: &[f32], _n: usize, _heads: usize, _hd: usize, _spans: &[usize], _out: &mut [f32]) -> bool {
        false
    }
}

/// One attention layer as the kernels see it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnShape<'a> {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Keys older than this many positions are not attended (0: the whole context).
    pub window: usize,
    pub scale: f32,
    /// `scale` multiplies the queries (before their f16 rounding) instead of the scores, as
    /// llama.cpp's gemma graphs do; it matters where small queries round to f16 subnormals.
    pub scale_query: bool,
    /// cap * tanh(s / cap) on each raw q.k score before the softmax's scaling (gemma2).
    pub softcap: Option<f32>,
    /// One learned logit per query head that joins the softmax's denominator with no value
    /// behind it (gpt-oss's `attn_sinks`): a head may put weight on "nothing". Unscaled, as
    /// ggml's `soft_max_ext` takes it.
    pub sinks: Option<&'a [f32]>,
}

impl AttnShape<'_> {
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// What multiplies a q.k score: `scale`, or 1 where it already scaled the queries.
    pub fn score_scale(&self) -> f32 {
        if self.scale_query {
            1.0
        } else {
            self.scale
        }
    }
}

/// Which rows of a batch get logits (the vocabulary matmul is the largest one: decode wants each
/// session's last row, a speculative verify chunk every row).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows<'a> {
    /// After each session's last token: one row per session.
    Last,
    /// After every token: one row per token of the batch, in order.
    All,
    /// After each session's last `tails[i]` tokens (1 for a decode row or a prefill chunk, k+1
    /// for a verify chunk of k drafts), in batch order.
    Tail(&'a [usize]),
    /// No logits: every row's hidden state after the final norm (`dim` values per token), what
    /// embeddings pool.
    Hidden,
}

impl LogitRows<'_> {
    /// How many of session i's last rows (of its `cnt`) get logits.
    pub fn tail(self, i: usize, cnt: usize) -> usize {
        match self {
            LogitRows::Last => 1,
            LogitRows::All | LogitRows::Hidden => cnt,
            LogitRows::Tail(t) => t[i].clamp(1, cnt),
        }
    }

    /// The batch rows that get logits, in order.
    pub(crate) fn picked(self, counts: &[usize]) -> Vec<usize> {
        let mut out = Vec::new();
        let mut end = 0;
        for (i, &cnt) in counts.iter().enumerate() {
            end += cnt;
            out.extend(end - self.tail(i, cnt)..end);
        }
        out
    }
}

/// The sines and cosines of every batch row's position for one RoPE (dim/2 pairs per row).
pub struct RopeTable<'a> {
    pub pairs: &'a [(f32, f32)],
    pub half: usize,
    /// NEOX pairing (i, i + dim/2) instead of adjacent pairs (2i, 2i + 1).
    pub neox: bool,
}

impl RopeTable<'_> {
    pub fn row(&self, t: usize) -> &[(f32, f32)] {
        &self.pairs[t * self.half..(t + 1) * self.half]
    }
}

/// One rotary embedding: which values of a head rotate, and how a position becomes each pair's
/// angle. Text positions only: a multi-axis (M-RoPE) token has the same position on its first
/// three axes and 0 on the fourth, as llama.cpp gives a text token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// Leading values of each head that rotate (the rest pass through).
    pub dim: usize,
    pub base: f32,
    /// NEOX pairing (i, i + dim/2) instead of adjacent pairs (2i, 2i + 1).
    pub neox: bool,
    /// Multiplies every angle (`1 / rope.scaling.factor` under linear, longrope or YaRN scaling).
    pub freq_scale: f32,
    /// Multiplies every sine and cosine (`rope.scaling.attn_factor`; longrope files carry one;
    /// under YaRN, ggml's magnitude correction too), so it scales queries and keys alike, as
    /// ggml's RoPE does.
    pub mscale: f32,
    /// YaRN's correction range (ggml's `corr_dims`: the first and last pair of the ramp between
    /// extrapolated and interpolated angles).
    pub yarn: Option<[f32; 2]>,
    /// M-RoPE sections (`rope.dimension_sections`): which position axis each pair reads.
    pub mrope: Option<Mrope>,
    /// Divide the angles by the model's frequency factors (`Config::rope_factors`) where it has
    /// them: every layer's RoPE but gemma4's sliding layers', which the file's `rope_freqs` is not for.
    pub factors: bool,
}

/// The pairs' position axes of a multi-axis RoPE, as ggml's `ggml_mrope_cache_init` assigns them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mrope {
    /// Pairs per axis (time, height, width, extra).
    pub sections: [usize; 4],
    /// Qwen3-VL's interleaved layout (t, h, w cycling) instead of consecutive runs.
    pub interleaved: bool,
}

impl Mrope {
    /// The axis (0-3) pair `i` takes its position from.
    pub fn axis(&self, i: usize) -> usize {
        let s = self.sections;
        let sector = i % s.iter().sum::<usize>();
        if self.interleaved {
            match sector % 3 {
                1 if sector < 3 * s[1] => 1,
                2 if sector < 3 * s[2] => 2,
                0 if sector < 3 * s[0] => 0,
                _ => 3,
            }
        } else if sector < s[0] {
            0
        } else if sector < s[0] + s[1] {
            1
        } else if sector < s[0] + s[1] + s[2] {
            2
        } else {
            3
        }
    }
}

/// The sines and cosines of one position's rotary angles, computed once and applied to every
/// head (as ggml's rope cache): theta advances by repeated f32 multiplication; pair i's angle is
/// divided by `factors[i]` (longrope) and multiplied by `freq_scale` (YaRN: blended with the
/// unscaled angle along its ramp), its sine and cosine by `mscale`. A text token's pairs on the
/// fourth M-RoPE axis see position 0.
pub fn rope_cache(r: &Rope, pos: usize, factors: Option<&[f32]>, out: &mut Vec<(f32, f32)>) {
    rope_cache_axes(r, [pos; 3], factors, out)
}

/// `rope_cache` for a row with its own position on each of the first three M-RoPE axes (time,
/// height, width: an image's rows in Qwen-VL, as llama.cpp's mtmd positions them); a RoPE
/// without axes reads the first.
pub fn rope_cache_axes(r: &Rope, pos: [usize; 3], factors: Option<&[f32]>, out: &mut Vec<(f32, f32)>) {
    let factors = factors.filter(|_| r.factors);
    let theta_scale = r.base.powf(-2.0 / r.dim as f32);
    let mut theta = pos.map(|p| p as f32);
    let mut theta_e = 0.0f32;
    out.clear();
    for i in 0..r.dim / 2 {
        let ff = factors.map_or(1.0, |f| f[i]);
        let axis = r.mrope.map_or(0, |m| m.axis(i));
        let extrap = (if axis == 3 { theta_e } else { theta[axis] }) / ff;
        let interp = r.freq_scale * extrap;
        let angle = match r.yarn {
            // ggml's rope_yarn with ext_factor 1: the ramp runs from 1 (extrapolate) to 0.
            Some([low, high]) => {
                let y = ((i as f32) - low) / (high - low).max(0.001);
                let mix = 1.0 - y.clamp(0.0, 1.0);
                interp * (1.0 - mix) + extrap * mix
            }
            None => interp,
        };
        let (s, c) = angle.sin_cos();
        out.push((s * r.mscale, c * r.mscale));
        theta.iter_mut().for_each(|t| *t *= theta_scale);
        theta_e *= theta_scale;
    }
}

/// The CPU's kernels over host rows: what `cpu::pass` runs the pass's ops on, and what the
/// host-only passes (drafters, a hybrid's replay) call directly.
pub trait HostOps {
    /// out_j[t] = W_j x[t] for several weights of the same input (Q/K/V, gate/up) in one pass.
    fn matmul(&mut self, segs: &mut [(&Weight, &mut [f32])], x: &[f32], counts: &[usize]);

    /// RMS-norm each row of `x` (rows of `w.len()` values) and multiply by `w`.
    fn rms_norm(&mut self, x: &mut [f32], w: &[f32], eps: f32);

    /// Per head of each row (`width` values per row, heads of `head_dim`): the optional RMS norm
    /// (QK-norm), then the rotary embedding of the row's position.
    fn norm_rope(&mut self, x: &mut [f32], width: usize, head_dim: usize, norm: Option<&[f32]>, eps: f32, rope: &RopeTable);

    /// gate = act(gate) * up, rows of `width`.
    fn glu(&mut self, gate: &mut [f32], up: &[f32], width: usize, act: Activation);

    /// x += y.
    fn add(&mut self, x: &mut [f32], y: &[f32]);

    /// Add `bias` to every row of `x` (rows of `bias.len()` values).
    fn add_bias(&mut self, x: &mut [f32], bias: &[f32]);

    /// x = cap * tanh(x / cap), each value (logit soft-capping).
    fn softcap(&mut self, x: &mut [f32], cap: f32);

    /// Route each row of router logits (rows of `r.n_expert`) as `r` says (llama.cpp's
    /// `build_moe_ffn`): scores by softmax or sigmoid, the `n_used` experts of the highest scores
    /// plus `r.bias` (highest first), their unbiased scores as weights, renormalised to sum to 1
    /// where `r.norm`, then multiplied by `r.scale`. `out` gets n_used (expert, weight) pairs per row.
    fn route(&mut self, logits: &[f32], r: &Route<'_>, out: &mut Vec<(usize, f32)>);

    /// x += a * y.
    fn add_scaled(&mut self, x: &mut [f32], y: &[f32], a: f32);

    /// x = sigmoid(x), each value.
    fn sigmoid(&mut self, x: &mut [f32]);

    /// x *= y, each value.
    fn mul(&mut self, x: &mut [f32], y: &[f32]) {
        x.iter_mut().zip(y).for_each(|(a, b)| *a *= b);
    }

    /// Hand `segs[i].1 = x · segs[i].0ᵀ` over `n` rows to the pass's offload (a device holding
    /// a vision tower's matrices) where it takes the call: false leaves it to the caller, whose
    /// own kernels (the tower's dense GEMM) run it instead.
    fn offload_matmul(&mut self, _segs: &mut [(&Weight, &mut [f32])], _x: &[f32], _n: usize) -> bool {
        false
    }

    /// `MatmulOffload::full_attention` on the pass's offload, where there is one that takes it.
    #[allow(clippy::too_many_arguments)]
    fn offload_attention(&mut self, _q: &[f32], _k: &[f32], _v: &[f32], _n: usize, _heads: usize, _hd: usize, _spans: &[usize], _out: &mut [f32]) -> bool {
        false
    }

    /// Call `f(i)` for every i in 0..n, across the host's threads where it has them (work of
    /// a pass's own, such as the vision tower's attention tiles); returns when all are done.
    fn parallel_for(&mut self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        (0..n).for_each(f)
    }

    /// One gated DeltaNet layer over the batch's rows (`cpu::deltanet::delta_net` says what each
    /// buffer holds before and after): session i owns `counts[i]` rows and `states[i]`, its
    /// recurrent state in this layer.
    #[allow(clippy::too_many_arguments)]
    fn delta_net(
        &mut self,
        dn: &DeltaNet,
        p: &DnParams,
        states: &mut [RecIo],
        counts: &[usize],
        qkv: &mut [f32],
        beta: &mut [f32],
        alpha: &mut [f32],
        out: &mut [f32],
    );

    /// Causal attention of each query row over its session's K/V in page slot `slot` (which
    /// already holds the row's own position). `rows[t]` = (session, position) of batch row t;
    /// `ends[t]`, where given (`PassIn::key_ends`), ends row t's keys instead of its position + 1.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &mut self,
        a: &AttnShape,
        slot: usize,
        kvs: &[&mut KvCache],
        rows: &[(usize, usize)],
        ends: &[usize],
        counts: &[usize],
        q: &[f32],
        out: &mut [f32],
    );
}

/// The host: the CPU backend every model has, whatever device it is also placed on. The loader
/// lays weights out for it, and every pass over host activation rows runs on its ops.
pub trait Host: Sync {
    /// `w` as the host's kernels read it under `numerics`, converted to `to` first where given;
    /// None where ggml's summation order (`Numerics::Ggml`) is not reproduced for its format.
    fn prepare(&self, w: Weight, to: Option<GgmlType>, numerics: Numerics) -> Option<Weight>;

    /// Run `f` with the host's kernels over activation rows (`act` is their scratch); matmuls
    /// over weights `offload` holds go there (a vision tower placed on a device).
    fn run(&self, numerics: Numerics, act: &mut Vec<u8>, offload: Option<&mut dyn MatmulOffload>, f: &mut dyn FnMut(&mut dyn HostOps));

    /// Run `f`, a forward pass, with the host executing its ops over `acts` and the sessions'
    /// K/V `kvs`; matmuls over weights `offload` holds go there.
    #[allow(clippy::too_many_arguments)]
    fn pass(
        &self,
        numerics: Numerics,
        acts: &mut HostActs,
        kvs: &mut [&mut KvCache],
        inp: &PassIn<'_>,
        offload: Option<&mut dyn MatmulOffload>,
        f: &mut dyn FnMut(&mut dyn Ops),
    );

    /// Test hook: a task on the host's worker threads panics, as a bug in a kernel would.
    #[cfg(feature = "fault-injection")]
    fn panic_in_task(&self, why: &str);
}
