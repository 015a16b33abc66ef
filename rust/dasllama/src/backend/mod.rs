//! The backend boundary: everything the forward pass asks of the hardware. The skeleton
//! (`model::forward`) holds no kernel; it calls these on activation rows it owns, and a backend
//! (the CPU in `cpu::backend`; the Vulkan driver next) decides how each runs.
//!
//! Rows: a batch is a matrix of `n` activation rows, `counts[i]` of them for session i, in order.
//! Every op computes each row with the same arithmetic whatever else is in the batch, which is
//! what makes batched, chunked and speculative results equal to one token at a time.

use crate::cpu::deltanet::DnParams;
use crate::cpu::Weight;
use crate::kv::{KvCache, RecIo};
use crate::model::DeltaNet;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    GeluTanh,
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
}

/// One attention layer as the kernels see it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnShape {
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
}

impl AttnShape {
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

pub trait Ops {
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

    /// Route each row of router logits (rows of `n_expert`): softmax, the `n_used` most probable
    /// experts (most probable first), their probabilities as weights, renormalised to sum to 1
    /// where `norm`. `out` gets n_used (expert, weight) pairs per row.
    fn route(&mut self, logits: &[f32], n_expert: usize, n_used: usize, norm: bool, out: &mut Vec<(usize, f32)>);

    /// x += a * y.
    fn add_scaled(&mut self, x: &mut [f32], y: &[f32], a: f32);

    /// x = sigmoid(x), each value.
    fn sigmoid(&mut self, x: &mut [f32]);

    /// x *= y, each value.
    fn mul(&mut self, x: &mut [f32], y: &[f32]) {
        x.iter_mut().zip(y).for_each(|(a, b)| *a *= b);
    }

    /// One gated DeltaNet layer over the batch's rows (`cpu::deltanet::delta_net` says what each
    /// buffer holds before and after): session i owns `counts[i]` rows and `states[i]`, its
    /// recurrent state in this layer. A backend without a kernel of its own runs the CPU's here,
    /// on the calling thread.
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
    ) {
        crate::cpu::deltanet::delta_net(dn, p, states, counts, qkv, beta, alpha, out, None);
    }

    /// Causal attention of each query row over its session's K/V in page slot `slot` (which
    /// already holds the row's own position). `rows[t]` = (session, position) of batch row t.
    #[allow(clippy::too_many_arguments)]
    fn attention(&mut self, a: &AttnShape, slot: usize, kvs: &[&mut KvCache], rows: &[(usize, usize)], counts: &[usize], q: &[f32], out: &mut [f32]);
}
