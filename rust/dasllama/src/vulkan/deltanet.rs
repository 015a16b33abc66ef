//! A gated DeltaNet layer's recurrent core on the device (qwen3next, qwen35): the short causal
//! convolution with its rolling state (`conv`, `dn_conv.comp`) and the delta-rule recurrence
//! with its state (`recurrence`: `dn_recur.comp` on GPUs, `dn_recur_rows.comp` on CPU-type
//! devices), as `cpu/deltanet.rs` `delta_net` computes them;
//! `delta_net` runs both. The projections before, and the gated norm and output projection
//! after, are the recorder's ordinary ops (matmul, rms_norm, the SiLU GLU), as in
//! `model::forward`'s `delta_net`.
//!
//! Layouts (f32 unless said), those of the CPU (`kv::RecIo`):
//! - `qkv`: rows of conv_dim = 2 * key_dim + value_dim (Q heads, K heads, V heads); `beta`,
//!   `alpha`: rows of n_v_heads; `out`: rows of value_dim. A pass's rows are its sessions' rows in
//!   order, session i's `counts[i]` of them from `first`.
//! - a session's conv state: its last `conv_kernel - 1` inputs, oldest first, rows of conv_dim
//!   ((K - 1) * conv_dim floats); its SSM state: per value head h, hd rows of hd (row j holds
//!   S[.][j]) at `h * hd * hd` (n_v_heads * hd * hd floats).
//! - both states live in one device buffer `state` (all sessions, all DeltaNet layers, both
//!   copies: the CPU keeps a committed copy and the one a pass writes); `meta` holds per session
//!   `META_WORDS` u32 words: first row, rows, then the word offsets in `state` of its conv state
//!   in, conv state out, SSM state in and SSM state out (in and out may be the same: the kernels
//!   read each value before they overwrite it).
//!
//! After `delta_net`, `qkv` holds the convolved, SiLU-activated channels (the CPU also
//! L2-normalises Q and K there; the device normalises them on the fly and leaves them), `beta` and
//! `alpha` are as they were (the CPU leaves their sigmoid and decay exponent there). Nothing
//! downstream of the layer reads any of the three.

use super::buffer::Buffer;
use super::kernels::{Kernels, Runner};
use super::shaders::{self as sh, u, Shader};
use crate::backend::{DeltaNet, HeadMap};
use crate::Result;

/// Words of one session's record in `meta`.
pub const META_WORDS: usize = 6;
/// The convolution's taps at most, and the head size at most.
pub const MAX_KERNEL: usize = 8;
pub const MAX_HEAD_DIM: usize = 256;

/// One session's record in `meta`: its rows `first..first + rows` of the pass, and the word
/// offsets in `state` of its conv state (read, written) and SSM state (read, written).
pub fn meta_words(first: usize, rows: usize, conv_in: usize, conv_out: usize, ssm_in: usize, ssm_out: usize) -> [u32; META_WORDS] {
    [u(first), u(rows), u(conv_in), u(conv_out), u(ssm_in), u(ssm_out)]
}

/// A DeltaNet layer's parameters on the device (`backend::DnParams`): the convolution
/// (conv_kernel rows of conv_dim, tap 0 oldest), `ssm_dt.bias` and `ssm_a` (n_v_heads each).
pub struct DevDnParams {
    pub conv: Buffer,
    pub dt_bias: Buffer,
    pub a: Buffer,
}

fn check(dn: &DeltaNet, sessions: usize) {
    assert!(dn.conv_kernel >= 1 && dn.conv_kernel <= MAX_KERNEL, "a convolution of {} taps", dn.conv_kernel);
    assert!(dn.head_dim <= MAX_HEAD_DIM, "DeltaNet heads of {}", dn.head_dim);
    assert!(dn.n_v_heads.is_multiple_of(dn.n_k_heads), "{} value heads over {} key heads", dn.n_v_heads, dn.n_k_heads);
    assert!(sessions <= 65535, "{sessions} sessions in one dispatch");
}

/// The causal convolution and SiLU of `sessions` sessions' rows of `qkv` (in place), each over
/// its conv state (`meta` at its address, `state` the states' buffer address), writing each
/// session's updated conv state.
#[allow(clippy::too_many_arguments)]
pub fn conv(r: &mut Runner, k: &mut Kernels, dn: &DeltaNet, conv_w: &Buffer, qkv: &Buffer, meta: u64, state: u64, sessions: usize) -> Result<()> {
    check(dn, sessions);
    let cd = dn.conv_dim();
    let push = sh::DnConvPush { qkv: qkv.addr, conv_w: conv_w.addr, meta, state, cd: u(cd), kernel: u(dn.conv_kernel) };
    r.dispatch(k, Shader::DnConv, push, [cd.div_ceil(64) as u32, sessions as u32, 1])
}

/// The recurrence of `sessions` sessions over their convolved rows of `qkv`, with `beta` and
/// `alpha` as projected (the kernel takes their sigmoid and decay), into `out`; each session's
/// SSM state read from its `ssm_in` and left at its `ssm_out`.
#[allow(clippy::too_many_arguments)]
pub fn recurrence(
    r: &mut Runner,
    k: &mut Kernels,
    dn: &DeltaNet,
    p: &DevDnParams,
    qkv: &Buffer,
    beta: &Buffer,
    alpha: &Buffer,
    out: &Buffer,
    meta: u64,
    state: u64,
    sessions: usize,
) -> Result<()> {
    let per_thread = r.cpu_device();
    recurrence_form(r, k, per_thread, dn, p, qkv, beta, alpha, out, meta, state, sessions)
}

/// `recurrence` in the form asked for: a thread per state row (`per_thread`, `dn_recur_rows.comp`,
/// the form for CPU-type devices, no barriers inside a token) or a thread per lane of each row
/// (`dn_recur.comp`, for GPUs), the same operations in the same order: equal bits on lavapipe,
/// an ulp or a few apart on NVIDIA (tests run both on any device).
#[allow(clippy::too_many_arguments)]
pub(super) fn recurrence_form(
    r: &mut Runner,
    k: &mut Kernels,
    per_thread: bool,
    dn: &DeltaNet,
    p: &DevDnParams,
    qkv: &Buffer,
    beta: &Buffer,
    alpha: &Buffer,
    out: &Buffer,
    meta: u64,
    state: u64,
    sessions: usize,
) -> Result<()> {
    check(dn, sessions);
    // The CPU's own f32 constants (cpu/deltanet.rs): eps / n, sqrt(n), 1 / sqrt(n).
    let n = dn.head_dim as f32;
    let push = sh::DnRecurPush {
        qkv: qkv.addr,
        beta: beta.addr,
        alpha: alpha.addr,
        out_: out.addr,
        meta,
        state,
        dt_bias: p.dt_bias.addr,
        a: p.a.addr,
        hd: u(dn.head_dim),
        n_k_heads: u(dn.n_k_heads),
        n_v_heads: u(dn.n_v_heads),
        tiled: (dn.k_of_v == HeadMap::Tiled) as u32,
        eps_n: dn.eps / n,
        sqrt_n: n.sqrt(),
        scale: 1.0 / n.sqrt(),
        _pad: 0,
    };
    let shader = if per_thread { Shader::DnRecurRows } else { Shader::DnRecur };
    r.dispatch(k, shader, push, [dn.n_v_heads as u32, sessions as u32, 1])
}

/// The whole recurrent core of one DeltaNet layer (`Ops::delta_net`): `conv`, a barrier,
/// `recurrence`. No barrier after it.
#[allow(clippy::too_many_arguments)]
pub fn delta_net(
    r: &mut Runner,
    k: &mut Kernels,
    dn: &DeltaNet,
    p: &DevDnParams,
    qkv: &Buffer,
    beta: &Buffer,
    alpha: &Buffer,
    out: &Buffer,
    meta: u64,
    state: u64,
    sessions: usize,
) -> Result<()> {
    conv(r, k, dn, &p.conv, qkv, meta, state, sessions)?;
    r.barrier()?;
    recurrence(r, k, dn, p, qkv, beta, alpha, out, meta, state, sessions)
}
