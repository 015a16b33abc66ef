//! The per-op rails: for a model the resident driver declines (routed experts, DeltaNet
//! hybrids, gated attention), its matrices go to the device as far as the budget allows, and
//! the CPU backend hands each matmul over those weights to the device: the activations go up,
//! are rounded there as the CPU rounds them, multiplied, and come back. Everything else
//! (attention over host K/V pages, routing, the recurrence, norms) stays on the CPU, so every
//! session keeps its K/V in host memory and the scheduler, prefix cache and speculation work as
//! on the CPU. Dense matrices go first and routed experts last, so a model larger than the
//! budget still sends every row's common work to the device.

use super::buffer::Buffer;
use super::device::Gpu;
use super::kernels::{Kernels, Runner};
use super::ops::{mm, W};
use super::vit_attention::VitAttention;
use super::weights::{device_bytes, unsupported, upload_weight, DevWeight};
use crate::backend::{MatmulOffload, TowerPlacement, TowerStatus};
use crate::quant::Weight;
use crate::{Error, Result};
use gpu_allocator::MemoryLocation;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Buffers for one matmul call, grown to the largest call seen.
struct Io {
    /// Host-visible input, copied once to device memory (the kernels read x once per weight row).
    up: Buffer,
    x: Buffer,
    xq: Buffer,
    ys: Vec<Buffer>,
    back: Buffer,
    in_floats: usize,
    out_floats: usize,
}

pub struct Rails {
    gpu: Arc<Gpu>,
    kernels: Kernels,
    run: Runner,
    /// Device copies by the address of the model's `Weight` (stable while the model lives).
    weights: HashMap<usize, DevWeight>,
    io: Option<Io>,
    pub weight_bytes: u64,
    /// Matrices left on the CPU: over the budget, or in a format the device kernels do not read.
    pub left_on_cpu: usize,
    /// Of those, the ones in a format the device kernels do not read (MXFP4, IQ4): by format.
    pub unread: BTreeMap<&'static str, usize>,
    /// Matmuls run on the device.
    pub matmuls: u64,
    /// A vision tower's attention (`MatmulOffload::full_attention`), and the calls it ran.
    attn: VitAttention,
    attentions: u64,
    /// Why the device stopped taking matmuls (the tier lets go of the rails after the pass).
    pub failed: Option<Error>,
}

impl MatmulOffload for Rails {
    fn matmul(&mut self, segs: &mut [(&Weight, &mut [f32])], x: &[f32], n: usize) -> bool {
        if self.failed.is_some() {
            return false;
        }
        // A failed call wrote nothing the CPU will not overwrite: it runs the call instead.
        self.offload(segs, x, n).unwrap_or_else(|e| {
            self.failed = Some(e);
            false
        })
    }

    fn full_attention(&mut self, q: &[f32], k: &[f32], v: &[f32], n: usize, heads: usize, hd: usize, spans: &[usize], out: &mut [f32]) -> bool {
        if self.failed.is_some() {
            return false;
        }
        match self.attn.run(&self.gpu, &mut self.run, &mut self.kernels, q, k, v, n, heads, hd, spans, out) {
            Ok(()) => {
                self.attentions += 1;
                true
            }
            // A head size the shader does not take: this call runs on the host, the next may not.
            Err(Error::UnsupportedModel(_)) => false,
            Err(e) => {
                self.failed = Some(e);
                false
            }
        }
    }
}

/// A vision tower's matrices on the rails (`super::place_tower`).
pub struct TowerRails {
    pub rails: Rails,
    pub device: String,
}

impl MatmulOffload for TowerRails {
    fn matmul(&mut self, segs: &mut [(&Weight, &mut [f32])], x: &[f32], n: usize) -> bool {
        self.rails.matmul(segs, x, n)
    }

    fn full_attention(&mut self, q: &[f32], k: &[f32], v: &[f32], n: usize, heads: usize, hd: usize, spans: &[usize], out: &mut [f32]) -> bool {
        self.rails.full_attention(q, k, v, n, heads, hd, spans, out)
    }
}

impl TowerPlacement for TowerRails {
    fn status(&self) -> TowerStatus {
        let r = &self.rails;
        TowerStatus {
            device: self.device.clone(),
            matrices: r.matrices(),
            left_on_cpu: r.left_on_cpu,
            weight_bytes: r.weight_bytes,
            matmuls: r.matmuls,
            attentions: r.attentions,
            failed: r.failed.as_ref().map(|e| e.to_string()),
        }
    }
}

impl Rails {
    /// Upload `matrices`, in order, while they fit in `budget` bytes.
    pub fn upload(gpu: &Arc<Gpu>, matrices: &[&Weight], budget: u64) -> Result<Rails> {
        let mut run = Runner::new(gpu)?;
        let mut weights = HashMap::new();
        let (mut bytes, mut left) = (0u64, 0usize);
        let mut unread = BTreeMap::new();
        for (i, &w) in matrices.iter().enumerate() {
            let need = device_bytes(w);
            if !super::shaders::reads_format(w.ty) {
                *unread.entry(w.ty.name()).or_insert(0) += 1;
            }
            if unsupported(w).is_some() || bytes + need > budget {
                left += 1;
                continue;
            }
            let d = upload_weight(gpu, &mut run, &format!("matrix {i}"), w)?;
            bytes += d.buf.size;
            weights.insert(w as *const Weight as usize, d);
        }
        Ok(Rails {
            gpu: gpu.clone(),
            kernels: Kernels::new(gpu)?,
            run,
            weights,
            io: None,
            weight_bytes: bytes,
            left_on_cpu: left,
            unread,
            matmuls: 0,
            attn: VitAttention::new(),
            attentions: 0,
            failed: None,
        })
    }

    /// The formats whose matrices stay on the CPU because no shader reads them, in words (None
    /// when every matrix's format is read): what the placement's reason adds to the decline.
    pub fn unread_words(&self) -> Option<String> {
        if self.unread.is_empty() {
            return None;
        }
        let each: Vec<String> = self.unread.iter().map(|(f, n)| format!("{n} {f}")).collect();
        let formats: Vec<&str> = self.unread.keys().copied().collect();
        Some(format!("the device kernels do not read {} matrices, so those stay on the CPU ({})", formats.join(" or "), each.join(", ")))
    }

    pub fn matrices(&self) -> usize {
        self.weights.len()
    }

    /// `segs[i].1 = x · segs[i].0ᵀ` over `n` rows of `x` on the device, when every weight of the
    /// call is there (false: nothing ran, the CPU does it).
    fn offload(&mut self, segs: &mut [(&Weight, &mut [f32])], x: &[f32], n: usize) -> Result<bool> {
        if segs.iter().any(|(w, _)| !self.weights.contains_key(&(*w as *const Weight as usize))) {
            return Ok(false);
        }
        let in_floats = x.len();
        let out_floats = segs.iter().map(|(w, _)| n * w.rows).max().unwrap_or(0);
        self.reserve(in_floats, out_floats, segs.len())?;
        let io = self.io.as_mut().expect("reserved");
        io.up.put_f32s(0, x);
        let (r, k) = (&mut self.run, &mut self.kernels);
        r.copy(&io.up, 0, &io.x, 0, (in_floats * 4) as u64)?;
        r.barrier()?;
        let pairs: Vec<(W, u64)> = segs.iter().zip(&io.ys).map(|((w, _), y)| (W::of(&self.weights[&(*w as *const Weight as usize)]), y.addr)).collect();
        mm(r, k, &pairs, io.x.addr, io.xq.addr, n)?;
        r.barrier()?;
        for ((w, out), y) in segs.iter_mut().zip(&io.ys) {
            let floats = n * w.rows;
            debug_assert_eq!(out.len(), floats);
            r.copy(y, 0, &io.back, 0, (floats * 4) as u64)?;
            r.submit()?;
            io.back.get_f32s(0, out);
        }
        self.matmuls += 1;
        Ok(true)
    }

    fn reserve(&mut self, in_floats: usize, out_floats: usize, outs: usize) -> Result<()> {
        let fits = self.io.as_ref().is_some_and(|io| io.in_floats >= in_floats && io.out_floats >= out_floats && io.ys.len() >= outs);
        if fits {
            return Ok(());
        }
        // Grow to at least twice the old size, so a prompt's rising chunk sizes reallocate rarely.
        let old = self.io.take();
        let inf = in_floats.max(old.as_ref().map_or(0, |o| 2 * o.in_floats));
        let outf = out_floats.max(old.as_ref().map_or(0, |o| 2 * o.out_floats));
        let n_ys = outs.max(old.as_ref().map_or(0, |o| o.ys.len()));
        let g = &self.gpu;
        let b = |name: &str, floats: usize, loc| Buffer::new(g, name, (floats * 4) as u64, loc);
        self.io = Some(Io {
            up: b("rails input", inf, MemoryLocation::CpuToGpu)?,
            x: b("rails x", inf, MemoryLocation::GpuOnly)?,
            xq: b("rails xq", inf, MemoryLocation::GpuOnly)?,
            ys: (0..n_ys).map(|_| b("rails y", outf, MemoryLocation::GpuOnly)).collect::<Result<_>>()?,
            back: b("rails readback", outf, MemoryLocation::GpuToCpu)?,
            in_floats: inf,
            out_floats: outf,
        });
        Ok(())
    }
}
