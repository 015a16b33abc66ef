//! A vision tower's full attention on the device (`shaders/vit_attention.comp`): the host's
//! q, k and v go up, every head's softmax(q kᵀ / sqrt(hd)) v is computed there tile by tile
//! (nothing n x n is ever stored), and the result comes back.

use super::buffer::Buffer;
use super::device::Gpu;
use super::kernels::{Kernels, Runner};
use super::shaders::{u, Shader, VitAttentionPush};
use crate::{Error, Result};
use gpu_allocator::MemoryLocation;
use std::sync::Arc;

/// Query rows per workgroup (`BQ` in the shader).
const ROWS_PER_GROUP: usize = 32;
/// Values per head the shader's shared memory holds (`HD4 * 4`).
const MAX_HEAD: usize = 128;
/// Workgroups per dimension every device takes.
const MAX_GROUPS: usize = 65535;

/// Buffers for one call, grown to the largest call seen.
struct Io {
    /// q, k and v as written by the host, one after the other, then the rows' window bounds.
    up: Buffer,
    /// q, k, v and out, one after the other, then the bounds: the shader reads device-local memory.
    dev: Buffer,
    back: Buffer,
    floats: usize,
    rows: usize,
}

/// Device buffers for a tower's attention calls, grown to the largest call.
pub(crate) struct VitAttention {
    io: Option<Io>,
}

impl VitAttention {
    /// Allocates nothing until the first `run`.
    pub(crate) fn new() -> VitAttention {
        VitAttention { io: None }
    }

    /// out = per-head softmax(q kᵀ / sqrt(hd)) v over n rows of heads*hd values (the CPU's
    /// `vision::vit::full_attention`), on the device: q, k, v go up, out comes back. With
    /// `spans`, a row attends only the rows of its window, the windows being runs of
    /// consecutive rows of those lengths (Qwen2.5-VL's, every window in one call).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &mut self,
        gpu: &Arc<Gpu>,
        run: &mut Runner,
        kernels: &mut Kernels,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        heads: usize,
        hd: usize,
        spans: &[usize],
        out: &mut [f32],
    ) -> Result<()> {
        // Checked before anything is recorded, so that the caller can run this call on the host.
        if hd == 0 || hd > MAX_HEAD || !hd.is_multiple_of(4) {
            return Err(Error::UnsupportedModel(format!("vision attention heads of {hd} values; the device attention takes multiples of 4 up to {MAX_HEAD}")));
        }
        let floats = n * heads * hd;
        for (name, len) in [("q", q.len()), ("k", k.len()), ("v", v.len()), ("out", out.len())] {
            if len != floats {
                return Err(Error::Internal(format!("vision attention: {name} has {len} values for {n} rows of {heads} x {hd}")));
            }
        }
        if !spans.is_empty() && spans.iter().sum::<usize>() != n {
            return Err(Error::Internal(format!("vision attention: windows of {} rows in all for {n} rows", spans.iter().sum::<usize>())));
        }
        if floats == 0 {
            return Ok(());
        }
        // The shader indexes vec4s in 32 bits; workgroups go by query tile (x) and head (y).
        let groups = n.div_ceil(ROWS_PER_GROUP);
        if floats / 4 > u32::MAX as usize || groups > MAX_GROUPS || heads > MAX_GROUPS {
            return Err(Error::UnsupportedModel(format!("vision attention over {n} rows of {heads} x {hd} values is too large for the device kernel")));
        }
        // Each row's window as [start, end) (u32 pairs after q, k and v); none: every row.
        let bounds: Vec<u32> = spans
            .iter()
            .scan(0usize, |at, &len| {
                *at += len;
                Some(std::iter::repeat_n([u(*at - len), u(*at)], len))
            })
            .flatten()
            .flatten()
            .collect();
        self.reserve(gpu, floats, n)?;
        let io = self.io.as_mut().expect("reserved");
        let bytes = (floats * 4) as u64;
        for (i, src) in [q, k, v].into_iter().enumerate() {
            io.up.put_f32s(i * floats * 4, src);
        }
        // Where the bounds go: after q, k, v in `up`, after q, k, v and out on the device.
        let (up_bounds, dev_bounds) = (3 * 4 * io.floats, 4 * 4 * io.floats as u64);
        io.up.mapped()[up_bounds..up_bounds + 4 * bounds.len()].copy_from_slice(bytemuck::cast_slice(&bounds));
        run.copy(&io.up, 0, &io.dev, 0, 3 * bytes)?;
        if !bounds.is_empty() {
            run.copy(&io.up, up_bounds as u64, &io.dev, dev_bounds, 4 * bounds.len() as u64)?;
        }
        run.barrier()?;
        let push = VitAttentionPush {
            q: io.dev.at(0),
            k: io.dev.at(bytes),
            v: io.dev.at(2 * bytes),
            out_: io.dev.at(3 * bytes),
            bounds: io.dev.at(dev_bounds),
            n: u(n),
            heads: u(heads),
            hd: u(hd),
            scale: 1.0 / (hd as f32).sqrt(),
            windowed: u32::from(!bounds.is_empty()),
            _pad: 0,
        };
        run.dispatch(kernels, Shader::VitAttention, push, [u(groups), u(heads), 1])?;
        run.barrier()?;
        run.copy(&io.dev, 3 * bytes, &io.back, 0, bytes)?;
        run.submit()?;
        io.back.get_f32s(0, out);
        Ok(())
    }

    fn reserve(&mut self, gpu: &Arc<Gpu>, floats: usize, rows: usize) -> Result<()> {
        if self.io.as_ref().is_some_and(|io| io.floats >= floats && io.rows >= rows) {
            return Ok(());
        }
        // Free the old buffers first: at a tower's largest image they are the bulk of the need.
        let (old, old_rows) = self.io.take().map_or((0, 0), |io| (io.floats, io.rows));
        // A tower's calls share one shape per image size: grow with headroom, but not twice over.
        let (floats, rows) = (floats.max(old + old / 2), rows.max(old_rows + old_rows / 2));
        let b = |name: &str, n: usize, loc| Buffer::new(gpu, name, (n * 4) as u64, loc);
        // After q, k, v (and out on the device): two u32s a row, its window's bounds.
        self.io = Some(Io {
            up: b("vision attention input", 3 * floats + 2 * rows, MemoryLocation::CpuToGpu)?,
            dev: b("vision attention q/k/v/out", 4 * floats + 2 * rows, MemoryLocation::GpuOnly)?,
            back: b("vision attention readback", floats, MemoryLocation::GpuToCpu)?,
            floats,
            rows,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{gpu, rand};
    use super::*;

    /// The attention in f64, head by head, straight from its definition.
    fn reference(q: &[f32], k: &[f32], v: &[f32], n: usize, heads: usize, hd: usize) -> Vec<f64> {
        let d = heads * hd;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut out = vec![0.0f64; n * d];
        let mut s = vec![0.0f64; n];
        for h in 0..heads {
            for i in 0..n {
                let qi = &q[i * d + h * hd..][..hd];
                for (j, sj) in s.iter_mut().enumerate() {
                    let kj = &k[j * d + h * hd..][..hd];
                    *sj = qi.iter().zip(kj).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale;
                }
                let max = s.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
                let total: f64 = s
                    .iter_mut()
                    .map(|x| {
                        *x = (*x - max).exp();
                        *x
                    })
                    .sum();
                let o = &mut out[i * d + h * hd..][..hd];
                for (j, &w) in s.iter().enumerate() {
                    for (oc, &vc) in o.iter_mut().zip(&v[j * d + h * hd..][..hd]) {
                        *oc += w / total * vc as f64;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn vit_attention_matches_f64() {
        let Some((g, mut k, mut r)) = gpu() else { return };
        let mut attn = VitAttention::new();
        // Every head size and a tail in both tiles (32 query rows, 16 keys); the last shape
        // walks many key tiles, so the running max has to move.
        for (i, &(n, heads, hd)) in [(1, 1, 64), (37, 3, 72), (300, 2, 80), (129, 4, 128), (17, 2, 4), (45, 1, 88), (2000, 1, 64)].iter().enumerate() {
            let len = n * heads * hd;
            let seed = 100 * i as u64;
            // Queries scaled up so that the softmax is peaked, not near uniform.
            let q: Vec<f32> = rand(len, seed).iter().map(|x| 4.0 * x).collect();
            let (kk, v) = (rand(len, seed + 1), rand(len, seed + 2));
            let mut out = vec![f32::NAN; len];
            attn.run(&g, &mut r, &mut k, &q, &kk, &v, n, heads, hd, &[], &mut out).unwrap();
            let want = reference(&q, &kk, &v, n, heads, hd);
            let vmax = v.iter().fold(0.0f32, |m, x| m.max(x.abs())) as f64;
            let err = out.iter().zip(&want).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max);
            let tol = 1e-4 * vmax + 1e-5;
            assert!(err <= tol, "n {n}, heads {heads}, hd {hd}: max error {err:e} over {tol:e}");
        }
    }

    #[test]
    fn windows_attend_only_their_own_rows() {
        let Some((g, mut k, mut r)) = gpu() else { return };
        let mut attn = VitAttention::new();
        // Qwen2.5-VL's windows: full ones and the narrower ones at the image's edge; windows
        // that start inside a query tile, tiles whose first key tiles hold none of a row's keys,
        // and a window of one row.
        for (i, spans) in [vec![16, 16, 8, 8, 8, 4], vec![64, 64, 40, 64, 1, 37, 5], vec![200]].iter().enumerate() {
            let (n, heads, hd) = (spans.iter().sum::<usize>(), 2, 80);
            let (d, len) = (heads * hd, spans.iter().sum::<usize>() * heads * hd);
            let seed = 900 + 10 * i as u64;
            let q: Vec<f32> = rand(len, seed).iter().map(|x| 4.0 * x).collect();
            let (kk, v) = (rand(len, seed + 1), rand(len, seed + 2));
            let mut out = vec![f32::NAN; len];
            attn.run(&g, &mut r, &mut k, &q, &kk, &v, n, heads, hd, spans, &mut out).unwrap();
            let mut at = 0;
            for &m in spans {
                let rows = at * d..(at + m) * d;
                let want = reference(&q[rows.clone()], &kk[rows.clone()], &v[rows.clone()], m, heads, hd);
                let err = out[rows].iter().zip(&want).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max);
                assert!(err <= 1e-4, "spans {spans:?}: the window at row {at} of {m} rows is {err:e} off");
                at += m;
            }
        }
    }

    #[test]
    fn vit_attention_declines_head_sizes_it_does_not_take() {
        let Some((g, mut k, mut r)) = gpu() else { return };
        let mut attn = VitAttention::new();
        for hd in [66, 132, 256] {
            let x = vec![0.0f32; 2 * hd];
            let mut out = vec![0.0f32; 2 * hd];
            match attn.run(&g, &mut r, &mut k, &x, &x, &x, 2, 1, hd, &[], &mut out) {
                Err(Error::UnsupportedModel(m)) => assert!(m.contains(&hd.to_string()), "{m}"),
                other => panic!("hd {hd}: {other:?}"),
            }
        }
        assert_eq!(r.dispatches, 0, "nothing recorded for a declined call");
    }
}
