//! Routed experts on the device: the router's logits to each row's (expert, weight) pairs
//! (`route`, `moe_route.comp`), each row's chosen experts' matmul rows over the layer's experts
//! stored as one stacked weight (`matmul_id`, `mul_mat_id.comp` / `mul_mat_id_rows.comp`), and
//! the weighted sum of each row's expert outputs (`combine`, `moe_combine.comp`); `moe_ffn` runs
//! the whole routed half of an FFN as `model::forward`'s `moe` does on the CPU, each row on its
//! own: gate and up, their biases, the GLU, down and its bias, then the sum in expert order.
//!
//! Buffers (all f32 unless said):
//! - route pairs: n * n_used pairs of u32 words (expert id, weight bits), row t's at
//!   `2 * (t * n_used + j)`, highest score first (the CPU's `Ops::route` order);
//! - slot rows: n * n_used rows, slot `s = t * n_used + j` is row t's j-th chosen expert.

use super::buffer::Buffer;
use super::kernels::{Kernels, Runner};
use super::shaders::{self as sh, u, Shader};
use super::weights::DevWeight;
use crate::backend::{Activation, Gating};
use crate::quant::GgmlType;
use crate::Result;

/// Experts the route kernel chooses among at most (its shared arrays).
pub const MAX_EXPERT: usize = 512;
/// Experts a row takes at most.
pub const MAX_USED: usize = 32;

/// The element-wise op codes of `eltwise.comp` (its header says what each does); the recorder
/// names every op by these, tests name some.
#[allow(dead_code)]
pub mod elt {
    pub const ADD: u32 = 0;
    pub const SILU_GLU: u32 = 1;
    pub const GELU_GLU: u32 = 2;
    pub const SOFTCAP: u32 = 3;
    pub const COPY: u32 = 4;
    pub const SWIGLU_OAI: u32 = 5;
    pub const MUL: u32 = 6;
    pub const SIGMOID: u32 = 7;
    pub const SCALE: u32 = 8;
    pub const ADD_SCALED: u32 = 9;
    pub const COL_SCALE: u32 = 10;
    pub const ROW_AXPY: u32 = 11;
    pub const ROW_SCALE: u32 = 12;

    /// The GLU op of an activation.
    pub fn glu(act: crate::backend::Activation) -> u32 {
        match act {
            crate::backend::Activation::Silu => SILU_GLU,
            crate::backend::Activation::GeluTanh => GELU_GLU,
            crate::backend::Activation::SwigluOai => SWIGLU_OAI,
        }
    }
}

/// `eltwise.comp` op `op` over `count` values at address `x` (in place), with `y`, the scalar
/// `a`, the per-row values `z` (ROW_AXPY, ROW_SCALE) and `width` (ADD: y's length; COL_SCALE:
/// the row width y covers; ROW_AXPY, ROW_SCALE: the row width z[i / width] covers). Addresses, so a caller may
/// point into a buffer; unused ones 0.
#[allow(clippy::too_many_arguments)]
pub fn eltwise(r: &mut Runner, k: &mut Kernels, op: u32, x: u64, y: u64, z: u64, count: usize, width: usize, a: f32) -> Result<()> {
    r.dispatch_flat(k, Shader::Eltwise, sh::EltwisePush { x, y, count: u(count), width: u(width.max(1)), op, a, z }, count)
}

/// How a layer routes (the device form of `backend::Route`; the selection bias is a buffer).
#[derive(Clone, Copy)]
pub struct RouteSpec<'a> {
    pub n_expert: usize,
    pub n_used: usize,
    pub gating: Gating,
    /// n_expert values added to the scores to choose only (`exp_probs_b`).
    pub bias: Option<&'a Buffer>,
    pub norm: bool,
    pub scale: f32,
}

/// Route `n` rows of router logits (`logits`: n x n_expert) into `pairs` (n x n_used word
/// pairs, see the module doc), exactly as `cpu/backend.rs` `Ops::route` chooses and weights.
pub fn route(r: &mut Runner, k: &mut Kernels, spec: &RouteSpec<'_>, logits: &Buffer, pairs: &Buffer, n: usize) -> Result<()> {
    assert!(spec.n_expert <= MAX_EXPERT && spec.n_used <= MAX_USED && spec.n_used <= spec.n_expert, "routing {} of {} experts", spec.n_used, spec.n_expert);
    assert!(n <= 65535, "routing {n} rows in one dispatch");
    let gating = match spec.gating {
        Gating::Softmax => 0,
        Gating::Sigmoid => 1,
        Gating::SoftmaxWeight => 2,
    };
    let push = sh::MoeRoutePush {
        logits: logits.addr,
        out_: pairs.addr,
        bias: spec.bias.map_or(0, |b| b.addr),
        n_expert: u(spec.n_expert),
        n_used: u(spec.n_used),
        gating,
        has_bias: spec.bias.is_some() as u32,
        norm: spec.norm as u32,
        scale: spec.scale,
    };
    r.dispatch(k, Shader::MoeRoute, push, [n as u32, 1, 1])
}

/// Where `matmul_id` reads each slot's input row: row t's j-th slot reads the `w.cols` floats
/// at `t * stride_t + j * stride_j` of `x` (gate and up: every slot of a row reads the row,
/// `(cols, 0)`; down: each slot its own GLU row, `(n_used * cols, cols)`).
#[derive(Clone, Copy, Debug)]
pub struct SlotInput {
    pub stride_t: usize,
    pub stride_j: usize,
}

/// Each of the `n * n_used` slots' chosen expert's matmul row: `y[s][r] = W_e[r] . x_s` (+
/// `bias[e * rows + r]` where given, an expert's bias after its product as the CPU adds it), for
/// the experts stacked in `w` (`weights::upload_stacked`: `w.rows = n_expert * rows`), the
/// experts read from `pairs`. `x` must already be rounded as the format takes activations
/// (`round_input`). `y` has rows of `rows` values, one per slot.
#[allow(clippy::too_many_arguments)]
pub fn matmul_id(
    r: &mut Runner,
    k: &mut Kernels,
    w: &DevWeight,
    rows: usize,
    x: &Buffer,
    input: SlotInput,
    pairs: &Buffer,
    n_used: usize,
    bias: Option<&Buffer>,
    y: &Buffer,
    n: usize,
) -> Result<()> {
    let per_thread = r.cpu_device();
    matmul_id_form(r, k, per_thread, w, rows, x, input, pairs, n_used, bias, y, n)
}

/// `matmul_id` in the form asked for: one invocation per weight row (`per_thread`, the form for
/// CPU-type devices) or one workgroup per weight row; both give the same bits as the dense
/// matmul of that form (tests run both on any device).
#[allow(clippy::too_many_arguments)]
pub(super) fn matmul_id_form(
    r: &mut Runner,
    k: &mut Kernels,
    per_thread: bool,
    w: &DevWeight,
    rows: usize,
    x: &Buffer,
    input: SlotInput,
    pairs: &Buffer,
    n_used: usize,
    bias: Option<&Buffer>,
    y: &Buffer,
    n: usize,
) -> Result<()> {
    const ROWS_PER_Z: usize = 32768;
    assert!(rows > 0 && w.rows.is_multiple_of(rows), "{} stacked rows are not whole experts of {rows}", w.rows);
    let slots = n * n_used;
    assert!(slots <= 65535, "{slots} expert slots in one dispatch");
    let groups = if per_thread { rows.div_ceil(64) } else { rows };
    let (gx, gz) = if groups > ROWS_PER_Z { (ROWS_PER_Z, groups.div_ceil(ROWS_PER_Z)) } else { (groups, 1) };
    let rows_per_z = if per_thread { ROWS_PER_Z * 64 } else { ROWS_PER_Z };
    let shader = if per_thread { Shader::MulMatIdRows(w.ty) } else { Shader::MulMatId(w.ty) };
    let push = sh::MulMatIdPush {
        w: w.buf.addr,
        x: x.addr,
        y: y.addr,
        ids: pairs.addr,
        bias: bias.map_or(0, |b| b.addr),
        rows: u(rows),
        cols: u(w.cols),
        n_used: u(n_used),
        row_words: u(w.row_words),
        x_stride_t: u(input.stride_t),
        x_stride_j: u(input.stride_j),
        y_stride: u(rows),
        has_bias: bias.is_some() as u32,
        rows_per_z: u(rows_per_z),
        _pad: 0,
    };
    r.dispatch(k, shader, push, [gx as u32, slots as u32, gz as u32])
}

/// `out[t] = sum over row t's experts, in ascending expert order, of (w * scale[e]) * y[slot]`
/// (rows of `width`; `scale`: one per expert, gemma4's per-expert output scale, where given), the
/// CPU's `add_scaled` order from zero.
#[allow(clippy::too_many_arguments)]
pub fn combine(
    r: &mut Runner,
    k: &mut Kernels,
    y: &Buffer,
    pairs: &Buffer,
    n_used: usize,
    scale: Option<&Buffer>,
    out: &Buffer,
    width: usize,
    n: usize,
) -> Result<()> {
    let push = sh::MoeCombinePush {
        y: y.addr,
        ids: pairs.addr,
        out_: out.addr,
        scale: scale.map_or(0, |b| b.addr),
        width: u(width),
        n_used: u(n_used),
        count: u(n * width),
        has_scale: scale.is_some() as u32,
    };
    r.dispatch_flat(k, Shader::MoeCombine, push, n * width)
}

/// How `round_act.comp` rounds activations for weights of `ty` (0: not at all), as the CPU
/// quantizes them for its products (`GgmlType::vec_dot_type`).
pub fn round_mode(ty: GgmlType) -> u32 {
    match ty.vec_dot_type() {
        GgmlType::Q8_0 | GgmlType::Q8_1 => 1,
        GgmlType::Q8K => 2,
        GgmlType::F16 => 3,
        GgmlType::BF16 => 4,
        _ => 0,
    }
}

/// `floats` activations of `x` rounded into `xq` as weights of `ty` take them; returns the
/// buffer the matmul reads (`x` itself where the format takes f32). No barrier after it.
pub fn round_input<'a>(r: &mut Runner, k: &mut Kernels, ty: GgmlType, x: &'a Buffer, xq: &'a Buffer, floats: usize) -> Result<&'a Buffer> {
    match round_mode(ty) {
        0 => Ok(x),
        mode => {
            round(r, k, mode, x.addr, xq.addr, floats)?;
            Ok(xq)
        }
    }
}

/// `floats` activations at `x` rounded into `xq` in `round_act.comp`'s `mode` (not 0). No
/// barrier after it.
pub fn round(r: &mut Runner, k: &mut Kernels, mode: u32, x: u64, xq: u64, floats: usize) -> Result<()> {
    let blocks = match mode {
        1 => floats / 32,
        2 => floats / 256,
        _ => floats,
    };
    r.dispatch_flat(k, Shader::RoundAct, sh::RoundActPush { x, out_: xq, blocks: u(blocks), mode }, blocks)
}

/// One layer's routed experts on the device: each of gate, up and down stacked over the experts
/// (`weights::upload_stacked`), gpt-oss's per-expert biases (n_expert x hidden for gate and up,
/// n_expert x dim for down, as `model::ExpertBiases` holds them), gemma4's per-expert output
/// scale (n_expert).
pub struct DevExperts {
    pub n_expert: usize,
    /// Each expert's hidden width (gate's and up's rows, down's columns).
    pub hidden: usize,
    pub gate: DevWeight,
    pub up: DevWeight,
    pub down: DevWeight,
    pub gate_bias: Option<Buffer>,
    pub up_bias: Option<Buffer>,
    pub down_bias: Option<Buffer>,
    pub scale: Option<Buffer>,
}

/// Scratch for `moe_ffn` over up to `n` rows of `dim` with `n_used` experts each (floats unless
/// said): `pairs` n * n_used * 2 words; `xq` n * n_used * max(dim, hidden); `gate`, `up`
/// n * n_used * hidden; `down` n * n_used * dim.
pub struct MoeScratch<'a> {
    pub pairs: &'a Buffer,
    pub xq: &'a Buffer,
    pub gate: &'a Buffer,
    pub up: &'a Buffer,
    pub down: &'a Buffer,
}

/// The routed experts of one layer over `n` rows of `h` (n x dim) into `out` (n x dim),
/// given the router's logits (n x n_expert, its bias already added): route, gate and up of each
/// row's chosen experts (with their biases), the GLU `act`, down (with its bias), then each row's
/// weighted sum in expert order, as `model::forward`'s `moe`. Records barriers between its own
/// steps, none after the last (the caller's next op needs one).
#[allow(clippy::too_many_arguments)]
pub fn moe_ffn(
    r: &mut Runner,
    k: &mut Kernels,
    e: &DevExperts,
    spec: &RouteSpec<'_>,
    act: Activation,
    logits: &Buffer,
    h: &Buffer,
    out: &Buffer,
    s: &MoeScratch<'_>,
    dim: usize,
    n: usize,
) -> Result<()> {
    let (hd, nu) = (e.hidden, spec.n_used);
    assert_eq!(spec.n_expert, e.n_expert, "the route's experts and the layer's");
    route(r, k, spec, logits, s.pairs, n)?;
    // Gate and up read each row as the CPU's matmul rounds it (both weights take the same format).
    let x = round_input(r, k, e.gate.ty, h, s.xq, n * dim)?;
    r.barrier()?;
    let row = SlotInput { stride_t: dim, stride_j: 0 };
    matmul_id(r, k, &e.gate, hd, x, row, s.pairs, nu, e.gate_bias.as_ref(), s.gate, n)?;
    if round_mode(e.up.ty) != round_mode(e.gate.ty) {
        r.barrier()?;
        let x = round_input(r, k, e.up.ty, h, s.xq, n * dim)?;
        r.barrier()?;
        matmul_id(r, k, &e.up, hd, x, row, s.pairs, nu, e.up_bias.as_ref(), s.up, n)?;
    } else {
        matmul_id(r, k, &e.up, hd, x, row, s.pairs, nu, e.up_bias.as_ref(), s.up, n)?;
    }
    r.barrier()?;
    eltwise(r, k, elt::glu(act), s.gate.addr, s.up.addr, 0, n * nu * hd, n * nu * hd, 0.0)?;
    r.barrier()?;
    let x = round_input(r, k, e.down.ty, s.gate, s.xq, n * nu * hd)?;
    r.barrier()?;
    matmul_id(r, k, &e.down, dim, x, SlotInput { stride_t: nu * hd, stride_j: hd }, s.pairs, nu, e.down_bias.as_ref(), s.down, n)?;
    r.barrier()?;
    combine(r, k, s.down, s.pairs, nu, e.scale.as_ref(), out, dim, n)
}
