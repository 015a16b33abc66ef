//! The Vulkan device as a device of the forward pass: every op of `backend::Ops` records its
//! kernels into the step's chain over the engine's buffers, resident weights and K/V regions.
//! Activations are rounded per weight format exactly as the CPU rounds them, so device and CPU
//! feed the same values to their products and differ only in summation order; every row's sums
//! run in one fixed order whatever the batch, so batched and single-stream results are equal.
//!
//! Barriers go where an op touches a buffer an earlier op since the last barrier wrote (or
//! writes one an earlier op read): independent ops (Q's and K's RoPE) share a stage.

use super::engine::{Engine, MetaAt};
use super::kernels::{Kernels, Runner};
use super::moe::{elt, eltwise, round, round_mode};
use super::shaders::{self as sh, u, Shader};
use crate::backend::{Act, Activation, AttnShape, Buf, DeltaNet, DnParams, ExpertSet, Given, Ops, PassIn, Route};
use crate::kv::KvCodec;
use crate::quant::{GgmlType, Weight};
use crate::{Error, Result};

/// Hazard bits beyond the pass's buffers (one bit each): the K/V regions, the rounded input.
const KV: u64 = 1 << 62;
const XQ: u64 = 1 << 61;
const STATE: u64 = 1 << 60;

fn bit(a: Act) -> u64 {
    1 << a.buf as u64
}

/// A weight as the kernels address it.
#[derive(Clone, Copy)]
pub(super) struct W {
    addr: u64,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_words: usize,
}

pub struct Recorder<'e, 'i> {
    e: &'e mut Engine,
    at: &'e MetaAt,
    inp: &'e PassIn<'i>,
    err: Option<Error>,
    /// Buffers written, and read, since the last barrier.
    written: u64,
    read: u64,
}

fn missing(what: &str) -> Error {
    Error::UnsupportedModel(format!("the Vulkan device has no kernel for {what} yet"))
}

/// The matrix product over `n` activation rows: one workgroup per weight row on GPUs
/// (`mul_mat`), one invocation per weight row on CPU-type devices (`mul_mat_rows`), where
/// lavapipe's barriers cost more than the arithmetic.
fn matmul(r: &mut Runner, k: &mut Kernels, w: W, x: u64, y: u64, n: usize) -> Result<()> {
    const ROWS_PER_Z: usize = 32768;
    let per_thread = r.cpu_device();
    let groups = if per_thread { w.rows.div_ceil(64) } else { w.rows };
    let (gx, gz) = if groups > ROWS_PER_Z { (ROWS_PER_Z, groups.div_ceil(ROWS_PER_Z)) } else { (groups, 1) };
    let rows_per_z = if per_thread { ROWS_PER_Z * 64 } else { ROWS_PER_Z };
    let shader = if per_thread { Shader::MulMatRows(w.ty) } else { Shader::MulMat(w.ty) };
    let push = sh::MulMatPush {
        w: w.addr,
        x,
        y,
        rows: u(w.rows),
        cols: u(w.cols),
        n: u(n),
        row_words: u(w.row_words),
        x_stride: u(w.cols),
        y_stride: u(w.rows),
        rows_per_z: u(rows_per_z),
        _pad: 0,
    };
    r.dispatch(k, shader, push, [gx as u32, n.div_ceil(8) as u32, gz as u32])
}

impl W {
    pub(super) fn of(d: &super::weights::DevWeight) -> W {
        W { addr: d.buf.addr, ty: d.ty, rows: d.rows, cols: d.cols, row_words: d.row_words }
    }
}

/// Products of several weights with the same input `x` (`n` rows, at `x`) into `ys[i].1`: the
/// input rounded once per activation format among them (into `xq`), as the CPU rounds it, then
/// one matmul each.
pub(super) fn mm(r: &mut Runner, k: &mut Kernels, ws: &[(W, u64)], x: u64, xq: u64, n: usize) -> Result<()> {
    let cols = ws[0].0.cols;
    let mut modes: Vec<u32> = ws.iter().map(|(w, _)| round_mode(w.ty)).collect();
    modes.sort_unstable();
    modes.dedup();
    for (i, &mode) in modes.iter().enumerate() {
        let src = if mode == 0 {
            x
        } else {
            if i > 0 {
                // The previous mode's matmuls still read xq.
                r.barrier()?;
            }
            round(r, k, mode, x, xq, n * cols)?;
            r.barrier()?;
            xq
        };
        for &(w, y) in ws.iter().filter(|(w, _)| round_mode(w.ty) == mode) {
            matmul(r, k, w, src, y, n)?;
        }
    }
    Ok(())
}

impl<'e, 'i> Recorder<'e, 'i> {
    pub(super) fn new(e: &'e mut Engine, at: &'e MetaAt, inp: &'e PassIn<'i>) -> Recorder<'e, 'i> {
        Recorder { e, at, inp, err: None, written: 0, read: 0 }
    }

    /// Whether the whole pass recorded: the first failure, if any.
    pub(super) fn finish(self) -> Result<()> {
        self.err.map_or(Ok(()), Err)
    }

    fn rows(&self) -> usize {
        self.inp.tokens.len()
    }

    /// Record one op that reads the buffers `reads` and writes `writes` (hazard bits), with a
    /// barrier first where it depends on what came before. Nothing more records after a failure.
    fn op(&mut self, reads: u64, writes: u64, f: impl FnOnce(&mut Self) -> Result<()>) {
        if self.err.is_some() {
            return;
        }
        if reads & self.written != 0 || writes & (self.written | self.read) != 0 {
            if let Err(e) = self.e.run.barrier() {
                self.err = Some(e);
                return;
            }
            (self.written, self.read) = (0, 0);
        }
        if let Err(e) = f(self) {
            self.err = Some(e);
        }
        self.written |= writes;
        self.read |= reads;
    }

    fn fail(&mut self, e: Error) {
        self.err.get_or_insert(e);
    }

    fn weight(&mut self, w: &Weight) -> Result<W> {
        Ok(W::of(self.e.weight(w)?))
    }

    fn a(&self, x: Act) -> u64 {
        self.e.addr(x)
    }

    /// The rows given as values (`PassIn::embeds`) into `x` (rows of `width`): columns
    /// `slice * width..` of each given row, in place of the row's own or added to it.
    fn given(&mut self, x: Act, width: usize, slice: usize, add: bool) {
        let n = self.rows();
        let src_width = self.inp.embeds.map_or(0, |e| e.width());
        self.op(bit(x), bit(x), |r| {
            let push = sh::GivenRowsPush {
                x: r.a(x),
                map: r.at.given,
                values: r.at.values,
                width: u(width),
                src_width: u(src_width),
                src_off: u(slice * width),
                n: u(n),
                add: add as u32,
                _pad: 0,
            };
            r.e.run.dispatch_flat(&mut r.e.kernels, Shader::GivenRows, push, n * width)
        });
    }

    /// `eltwise.comp` op `op` on `x` in place (`moe::elt`), with `y`, the per-row values `z`
    /// and the scalar `a` (addresses; 0 where unused); `reads`: the other buffers it reads.
    #[allow(clippy::too_many_arguments)]
    fn elt(&mut self, op: u32, x: Act, y: u64, z: u64, width: usize, a: f32, reads: u64) {
        self.op(reads | bit(x), bit(x), |r| {
            let xa = r.a(x);
            eltwise(&mut r.e.run, &mut r.e.kernels, op, xa, y, z, x.len, width, a)
        });
    }
}

impl Ops for Recorder<'_, '_> {
    fn alloc(&mut self, buf: Buf, len: usize) -> Act {
        if let Err(e) = self.e.buf(buf, len) {
            self.fail(e);
        }
        Act { buf, off: 0, len }
    }

    fn embed(&mut self, w: &Weight, scale: f32, given: Given, out: Act) {
        let n = self.rows();
        let images = self.at.given != 0;
        let ids = match given {
            Given::Token(0) if images => self.at.pad_tokens,
            // The metadata holds the tokens with an image's rows set to 0 (gemma4's padding), no other.
            Given::Token(id) if images => return self.fail(missing(&format!("an image row's embedding taken from token {id}"))),
            _ => self.at.tokens,
        };
        self.op(0, bit(out), |r| {
            let w = r.weight(w)?;
            let push = sh::GetRowsPush { w: w.addr, out_: r.a(out), ids, cols: u(w.cols), row_words: u(w.row_words), scale, _pad: 0 };
            r.e.run.dispatch(&mut r.e.kernels, Shader::GetRows(w.ty), push, [(w.cols / 16).div_ceil(64) as u32, n as u32, 1])
        });
        if images && given == Given::Values {
            let width = out.len / n;
            self.given(out, width, 0, false);
        }
    }

    fn matmul(&mut self, segs: &[(&Weight, Act)], x: Act, _alone: bool) {
        // Every row is a matrix of its own on the device: the sessions' grouping changes nothing.
        let ws: Vec<(W, Act)> = match segs.iter().map(|&(w, y)| Ok((self.weight(w)?, y))).collect::<Result<_>>() {
            Ok(ws) => ws,
            Err(e) => return self.fail(e),
        };
        let n = x.len / ws[0].0.cols;
        let writes = ws.iter().fold(XQ, |m, (_, y)| m | bit(*y));
        self.op(bit(x), writes, |r| {
            let xq = r.e.xq(x.len)?;
            let ys: Vec<(W, u64)> = ws.iter().map(|&(w, y)| (w, r.a(y))).collect();
            let xa = r.a(x);
            mm(&mut r.e.run, &mut r.e.kernels, &ys, xa, xq, n)
        });
    }

    fn rms_norm(&mut self, x: Act, out: Act, w: Option<&[f32]>, width: usize, eps: f32) {
        let rows = x.len / width;
        self.op(bit(x), bit(out), |r| {
            let w = r.e.vector(w, width)?;
            let push = sh::RmsNormPush { x: r.a(x), w, out_: r.a(out), width: u(width), eps };
            r.e.run.dispatch(&mut r.e.kernels, Shader::RmsNorm, push, [u(rows), 1, 1])
        });
    }

    fn norm_rope(&mut self, x: Act, width: usize, head_dim: usize, norm: Option<&[f32]>, eps: f32, rope: usize) {
        if norm.is_some() {
            self.rms_norm(x, x, norm, head_dim, eps);
        }
        let rp = self.inp.ropes[rope];
        let half = rp.dim / 2;
        let total = x.len / head_dim * half;
        self.op(bit(x), bit(x), |r| {
            let push = sh::RopePush {
                x: r.a(x),
                tab: r.at.ropes[rope],
                width: u(width),
                head_dim: u(head_dim),
                half_: u(half),
                neox: rp.neox as u32,
                total: u(total),
                _pad: 0,
            };
            r.e.run.dispatch_flat(&mut r.e.kernels, Shader::Rope, push, total)
        });
    }

    fn glu(&mut self, gate: Act, up: Act, _width: usize, act: Activation) {
        let op = elt::glu(act);
        let y = self.a(up);
        self.elt(op, gate, y, 0, gate.len, 0.0, bit(up));
    }

    fn add(&mut self, x: Act, y: Act) {
        let ya = self.a(y);
        self.elt(elt::ADD, x, ya, 0, x.len, 0.0, bit(y));
    }

    fn add_bias(&mut self, x: Act, bias: &[f32]) {
        match self.e.vector(Some(bias), bias.len()) {
            Ok(b) => self.elt(elt::ADD, x, b, 0, bias.len(), 0.0, 0),
            Err(e) => self.fail(e),
        }
    }

    fn scale(&mut self, x: Act, a: f32) {
        self.elt(elt::SCALE, x, 0, 0, 1, a, 0);
    }

    fn scale_cols(&mut self, x: Act, a: f32, v: &[f32]) {
        // (x * a) * v[j], in the CPU's order: two rounding steps, two ops.
        match self.e.vector(Some(v), v.len()) {
            Ok(va) => {
                self.elt(elt::SCALE, x, 0, 0, 1, a, 0);
                self.elt(elt::COL_SCALE, x, va, 0, v.len(), 0.0, 0);
            }
            Err(e) => self.fail(e),
        }
    }

    fn scale_rows(&mut self, x: Act, width: usize, table: usize) {
        let s = self.at.scales[table];
        self.elt(elt::ROW_SCALE, x, 0, s, width, 0.0, 0);
    }

    fn softcap(&mut self, x: Act, cap: f32) {
        self.elt(elt::SOFTCAP, x, 0, 0, x.len, cap, 0);
    }

    fn sigmoid(&mut self, x: Act) {
        self.elt(elt::SIGMOID, x, 0, 0, 1, 0.0, 0);
    }

    fn mul(&mut self, x: Act, y: Act) {
        let ya = self.a(y);
        self.elt(elt::MUL, x, ya, 0, x.len, 0.0, bit(y));
    }

    fn add_scaled_rows(&mut self, x: Act, y: Act, s: Act, width: usize) {
        let (ya, sa) = (self.a(y), self.a(s));
        self.elt(elt::ROW_AXPY, x, ya, sa, width, 0.0, bit(y) | bit(s));
    }

    fn copy_cols(&mut self, src: Act, src_width: usize, src_col: usize, dst: Act, dst_width: usize, dst_col: usize, cols: usize) {
        let rows = src.len / src_width;
        self.op(bit(src), bit(dst), |r| {
            let push = sh::CopyColsPush {
                src: r.a(src),
                dst: r.a(dst),
                src_width: u(src_width),
                src_col: u(src_col),
                dst_width: u(dst_width),
                dst_col: u(dst_col),
                cols: u(cols),
                rows: u(rows),
            };
            r.e.run.dispatch_flat(&mut r.e.kernels, Shader::CopyCols, push, rows * cols)
        });
    }

    fn gather_rows(&mut self, src: Act, dst: Act, width: usize) {
        let count = self.inp.picked.len();
        self.op(bit(src), bit(dst), |r| {
            let push = sh::GatherRowsPush { src: r.a(src), dst: r.a(dst), idx: r.at.picked, width: u(width), count: u(count) };
            r.e.run.dispatch_flat(&mut r.e.kernels, Shader::GatherRows, push, count * width)
        });
    }

    fn kv_store(&mut self, slot: usize, k: Act, v: Act, kvd: usize) {
        let n = self.rows();
        self.op(bit(k) | bit(v), KV, |r| {
            let (hd, nkv) = r.e.regions.heads(slot);
            if hd * nkv != kvd {
                return Err(Error::Internal(format!("K/V rows of {kvd} values for slot {slot} of {hd} x {nkv}")));
            }
            let (slot_off, v_off) = r.e.regions.slot_offsets(slot);
            let codec = r.e.regions.codec;
            let push = sh::KvStorePush {
                k: r.a(k),
                v: r.a(v),
                kv: r.e.regions.buf.addr,
                meta: r.at.rows,
                signs: r.e.signs(hd)?,
                kvd: u(kvd),
                n: u(n),
                slot_off: u(slot_off),
                v_off: u(v_off),
                head_dim: u(hd),
                rscale: 1.0 / (hd as f32).sqrt(),
            };
            let shader = Shader::KvStore(codec);
            match codec {
                KvCodec::F16 => r.e.run.dispatch_flat(&mut r.e.kernels, shader, push, n * kvd / 2),
                KvCodec::Q8_0 => r.e.run.dispatch_flat(&mut r.e.kernels, shader, push, n * kvd / 32),
                // A workgroup per KV head of each row: the rotation needs the whole head.
                KvCodec::Tq4 => r.e.run.dispatch(&mut r.e.kernels, shader, push, [nkv as u32, n as u32, 1]),
            }
        });
    }

    fn attention(&mut self, a: &AttnShape, slot: usize, q: Act, out: Act) {
        let sinks = match a.sinks.map(|s| self.e.vector(Some(s), s.len())).transpose() {
            Ok(s) => s,
            Err(e) => return self.fail(e),
        };
        if a.head_dim > 256 || !a.head_dim.is_multiple_of(2) {
            return self.fail(Error::UnsupportedModel(format!("heads of {} values; the device attention takes even sizes up to 256", a.head_dim)));
        }
        let n = self.rows();
        // An image's rows attend past their own position, except in the full layers of a
        // family whose images see each other in the sliding ones only.
        let ends = if self.inp.key_ends_sliding_only && a.window == 0 { 0 } else { self.at.ends };
        self.op(bit(q) | KV, bit(out), |r| {
            let (slot_off, v_off) = r.e.regions.slot_offsets(slot);
            let push = sh::AttentionPush {
                q: r.a(q),
                out_: r.a(out),
                kv: r.e.regions.buf.addr,
                meta: r.at.rows,
                signs: r.e.signs(a.head_dim)?,
                n_heads: u(a.n_heads),
                n_kv_heads: u(a.n_kv_heads),
                head_dim: u(a.head_dim),
                window: u(a.window),
                qmul: if a.scale_query { a.scale } else { 1.0 },
                smul: a.score_scale(),
                softcap: a.softcap.unwrap_or(0.0),
                slot_off: u(slot_off),
                v_off: u(v_off),
                row_words: u(r.e.regions.row_words(slot)),
                rscale: 1.0 / (a.head_dim as f32).sqrt(),
                _pad: 0,
                sinks: sinks.unwrap_or(0),
                has_sinks: sinks.is_some() as u32,
                has_ends: (ends != 0) as u32,
                ends,
            };
            // One workgroup per KV head (per eight of the query heads sharing it) and row.
            let groups = (a.n_kv_heads * (a.n_heads / a.n_kv_heads).div_ceil(8)) as u32;
            r.e.run.dispatch(&mut r.e.kernels, Shader::Attention(r.e.regions.codec), push, [groups, n as u32, 1])
        });
    }

    fn experts(&mut self, e: &ExpertSet<'_>, r: &Route<'_>, logits: Act, x: Act, out: Act) {
        // moe_ffn records barriers between its own steps; its scratch is its own.
        self.op(bit(logits) | bit(x) | XQ, bit(out) | XQ, |rec| rec.e.experts(e, r, logits, x, out));
    }

    fn delta_net(&mut self, dn: &DeltaNet, p: &DnParams, slot: usize, qkv: Act, beta: Act, alpha: Act, out: Act) {
        let sessions = self.inp.counts.len();
        let meta = self.at.dn[slot];
        // The conv and the recurrence record their own barrier between them.
        self.op(bit(qkv) | bit(beta) | bit(alpha) | STATE, bit(qkv) | bit(out) | STATE, |r| r.e.delta_net(dn, p, [qkv, beta, alpha, out], meta, sessions));
    }

    fn add_given(&mut self, x: Act, width: usize, slice: usize) {
        // A window without image rows has nothing to add.
        if self.at.given != 0 {
            self.given(x, width, slice, true);
        }
    }

    fn load(&mut self, _src: &[f32], _x: Act) {
        self.fail(missing("host rows fed into a pass (an MTP head's hidden states)"));
    }
}
