//! The GPU tier: an ash-based Vulkan driver. A `Device` is an opened Vulkan device, shared by
//! the models placed on it; `place` puts one model on it and returns the `Placement` the model
//! owns: the resident driver (the whole forward pass on the device, for device-home sessions
//! whose K/V lives in device regions, with true batched decode) or, for a model the resident
//! driver declines, the per-op rails (its matrices on the device, everything else on the CPU).
//! Nothing here is process-wide: a device's state lives in its `Device`, a model's in its
//! placement, and dropping either frees what it holds. On a machine without Vulkan, `Device::open`
//! says why.
//!
//! Modules: `device` (loader, instance, device choice, allocator), `buffer`, `kernels`
//! (pipelines and the step's command buffer), `weights` (repack and upload), `regions` (device
//! K/V), `ops` (the forward pass's ops, recorded), `engine` (a resident model: its uploads,
//! buffers and kept chains), `rails`, `placement` (both as the model sees them). Nothing here
//! knows a model: the forward pass comes through `backend::Placeable`.

mod buffer;
mod deltanet;
mod device;
mod engine;
mod kernels;
mod moe;
mod ops;
mod placement;
mod rails;
mod regions;
mod shaders;
mod vit_attention;
mod weights;

pub use device::DeviceInfo;
pub use engine::PREFILL_WINDOW;

use crate::backend::{Placeable, Placement, TowerPlacement};
use crate::kv::KvCodec;
use crate::Error;
use crate::Result;
use device::Gpu;
use engine::Engine;
use placement::{RailsPlacement, ResidentPlacement};
use rails::{Rails, TowerRails};
use regions::Regions;
use std::sync::Arc;

/// The backend's witness: whether a usable Vulkan device answers on this machine (`pick` and
/// `allow_cpu` as `Device::open` takes them), and the device or the reason. It enumerates every
/// call; a runtime keeps its verdict (the Python `Runtime`).
pub fn witness(pick: Option<&str>, allow_cpu: bool) -> std::result::Result<DeviceInfo, String> {
    match device::enumerate() {
        Ok(devs) => device::choose(&devs, pick, allow_cpu).map(|i| devs[i].clone()),
        Err(e) => Err(e.to_string()),
    }
}

/// Every Vulkan device the loader reports (empty, with the reason, where there is none).
pub fn devices() -> std::result::Result<Vec<DeviceInfo>, String> {
    device::enumerate().map_err(|e| e.to_string())
}

/// An opened Vulkan device. Models placed on it share it; each holds its own weights and K/V
/// regions there, and its own locks.
pub struct Device {
    gpu: Arc<Gpu>,
}

impl Device {
    /// Open the device `pick` names (an index or part of its name), else the best kind.
    /// CPU-type devices (lavapipe) only where `allow_cpu` (`DASLLAMA_VK_ALLOW_CPU=1`).
    pub fn open(pick: Option<&str>, allow_cpu: bool) -> Result<Arc<Device>> {
        Ok(Arc::new(Device { gpu: Arc::new(Gpu::open(pick, allow_cpu)?) }))
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.gpu.info
    }

    /// (budget, usage) of device-local memory in bytes.
    pub fn memory(&self) -> (u64, u64) {
        self.gpu.memory()
    }

    /// Device memory our allocator holds (every model's weights and regions on this device).
    pub fn allocated(&self) -> u64 {
        self.gpu.allocated()
    }

    /// Bytes a model placed now may take: what is free, less a margin for the driver, capped
    /// at `vram_mb` MiB where that is not 0.
    pub fn budget(&self, vram_mb: u64) -> u64 {
        let (total, used) = self.gpu.memory();
        let free = total.saturating_sub(used) / 10 * 9;
        if vram_mb > 0 {
            free.min(vram_mb << 20)
        } else {
            free
        }
    }

    /// Whether the device was lost: nothing on it answers again (open it anew).
    pub fn lost(&self) -> bool {
        self.gpu.is_lost()
    }

    /// Test hook: the next step submitted to this device reports it lost, as a GPU fault would.
    #[cfg(feature = "fault-injection")]
    pub fn inject_fault(&self) {
        self.gpu.fault.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// How to place a model (the programmatic form of `--gpu-regions`, `--ctx`, the K/V codec and
/// `DASLLAMA_GPU_VRAM_MB`).
#[derive(Clone, Debug)]
pub struct Options {
    /// Device-home streams to serve (one K/V region each).
    pub regions: usize,
    /// Positions one region holds (0: the model's context).
    pub ctx_max: usize,
    /// `ctx_max` is the context asked for: held for every region, or the resident driver declines.
    pub ctx_strict: bool,
    /// The device K/V codec (None: f16; the Python side passes `DASLLAMA_GPU_KV` where the
    /// caller pins none).
    pub codec: Option<KvCodec>,
    /// Cap on the model's device memory in MiB (0: the device's budget).
    pub vram_mb: u64,
    /// Say on stderr where the model went and why (`DASLLAMA_VK_LOG=1`).
    pub log: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options { regions: 4, ctx_max: 4096, ctx_strict: false, codec: None, vram_mb: 0, log: false }
    }
}

impl Options {
    /// The codec asked for, else f16.
    pub fn codec(&self) -> std::result::Result<KvCodec, String> {
        Ok(self.codec.unwrap_or(KvCodec::F16))
    }
}

/// How many of `m`'s first layers fit in `have` bytes with the token table and their K/V regions.
fn split_point(m: &dyn Placeable, regions: usize, ctx: usize, heads: &[(usize, usize)], codec: KvCodec, have: u64) -> usize {
    let mut used: u64 = m.gathered().into_iter().map(weights::device_bytes).sum();
    for il in 0..m.n_layers() {
        used += m.layer_matrices(il).into_iter().map(weights::device_bytes).sum::<u64>() + Regions::bytes_for(regions, ctx, &heads[il..il + 1], codec);
        if used > have {
            return il;
        }
    }
    m.n_layers()
}

fn log(o: &Options, msg: &str) {
    if o.log {
        eprintln!("dasllama vulkan: {msg}");
    }
}

/// Put `m` on `dev`: the whole model with its K/V regions when the device runs every op of its
/// pass and it fits, else its matrices on the per-op rails; Err with the reason, in words a
/// person can act on, when neither. The caller owns the placement (a model keeps it with
/// `Model::set_placement`); `m` must not be placed elsewhere meanwhile.
pub fn place(dev: &Arc<Device>, m: &dyn Placeable, o: &Options) -> std::result::Result<Arc<dyn Placement>, String> {
    if dev.lost() {
        return Err(format!("the device '{}' was lost; open it again", dev.info().name));
    }
    if let Some(why) = m.host_only() {
        return Err(why);
    }
    let seq_len = m.seq_len();
    let ctx = if o.ctx_max == 0 { seq_len } else { o.ctx_max.min(seq_len) };
    if o.ctx_strict && o.ctx_max > seq_len {
        return Err(format!("a strict context of {} positions was asked, past the model's {seq_len}", o.ctx_max));
    }
    let codec = o.codec()?;
    let heads = m.kv_heads();
    if let Some(&(hd, _)) = heads.iter().find(|&&(hd, _)| !codec.supports(hd)) {
        return Err(format!(
            "device K/V in {} needs {}; this model's heads have {hd} values (pin f16 with set_gpu_kv_dtype)",
            codec.name(),
            codec.requirement()
        ));
    }
    if o.regions == 0 {
        return Err("the device needs at least one K/V region".into());
    }
    let kv_bytes = Regions::bytes_for(o.regions, ctx, &heads, codec);
    let weight_bytes: u64 = m.matrices().into_iter().chain(m.gathered()).map(weights::device_bytes).sum();
    let need = weight_bytes + kv_bytes;
    let have = dev.budget(o.vram_mb);
    let mut layers = m.n_layers();
    let mut split_why = String::new();
    if need > have {
        let why = format!(
            "the model needs {} MiB on the device ({} MiB of weights, {} MiB of K/V for {} regions of {ctx} positions) but the budget is {} MiB",
            need >> 20,
            weight_bytes >> 20,
            kv_bytes >> 20,
            o.regions,
            have >> 20
        );
        // The first layers that fit, with their K/V, as llama.cpp's -ngl: the rest and the head run on the CPU.
        let fit = if m.splits() { split_point(m, o.regions, ctx, &heads, codec, have) } else { 0 };
        if fit == 0 || m.n_layers() < 2 {
            let how = if m.splits() {
                "not even one layer fits"
            } else {
                "its layers cannot be split between devices (shared K/V, per-layer inputs or a recurrent state)"
            };
            return Err(format!("{why}, and {how}; lower --gpu-regions or the context, or serve on the CPU"));
        }
        // All the layers but not the head: the last layer goes with it to the CPU.
        layers = fit.min(m.n_layers() - 1);
        let fit = layers;
        split_why = format!("{why}: {fit} of its {} layers run on the device, the rest on the CPU", m.n_layers());
    }
    let mut e = Engine::new(&dev.gpu, m, o.regions, ctx, codec, layers).map_err(|e| format!("placing the model failed: {e}"))?;
    // One row through the whole pass: every weight goes up, every pipeline compiles, and an op
    // the device cannot run says so now rather than in the first request.
    let inp = m.pass_in(&[0], &[1], &[0], vec![0]);
    match e.forward(m, &[0], &inp, false, &mut Vec::new()) {
        Ok(()) => {}
        Err(Error::UnsupportedModel(why)) => {
            drop(e);
            return place_rails(dev, m, o, why);
        }
        Err(err) => return Err(format!("uploading the model failed: {err}")),
    }
    log(
        o,
        &format!(
            "{} on '{}': {} of {} layers, {} MiB of weights, {} regions of {ctx} positions, K/V in {}",
            m.arch(),
            dev.info().name,
            layers,
            m.n_layers(),
            e.weight_bytes >> 20,
            o.regions,
            codec.name()
        ),
    );
    Ok(Arc::new(ResidentPlacement::new(dev.clone(), e, split_why)))
}

/// The per-op rails for a model the device does not hold whole (`why`, which its status keeps).
fn place_rails(dev: &Arc<Device>, m: &dyn Placeable, o: &Options, why: String) -> std::result::Result<Arc<dyn Placement>, String> {
    let budget = dev.budget(o.vram_mb);
    match Rails::upload(&dev.gpu, &m.matrices(), budget) {
        Ok(r) if r.matrices() > 0 => {
            // A format no shader reads (MXFP4 experts) keeps matmuls on the CPU: say which.
            let why = match r.unread_words() {
                Some(words) => format!("{why}; {words}"),
                None => why,
            };
            log(
                o,
                &format!(
                    "{} on '{}' on the per-op rails: {} matrices ({} MiB) on the device, {} on the CPU; {why}",
                    m.arch(),
                    dev.info().name,
                    r.matrices(),
                    r.weight_bytes >> 20,
                    r.left_on_cpu
                ),
            );
            Ok(Arc::new(RailsPlacement::new(dev.clone(), r, why)))
        }
        Ok(r) => match r.unread_words() {
            // Every matrix in a format no shader reads: the budget is not why.
            Some(words) if r.unread.values().sum::<usize>() == r.left_on_cpu => Err(format!("{why}; and no matrix for the per-op rails: {words}")),
            Some(words) => Err(format!("{why}; and no matrix fits the device budget of {} MiB for the per-op rails ({words})", budget >> 20)),
            None => Err(format!("{why}; and no matrix fits the device budget of {} MiB for the per-op rails", budget >> 20)),
        },
        Err(e) => Err(format!("{why}; and uploading its matrices for the per-op rails failed: {e}")),
    }
}

/// Put a vision tower's matrices on `dev` (`Vision::place`), as many as fit its budget (capped
/// at `vram_mb` MiB where that is not 0): its matmuls and attention run there, the rest of the
/// tower on the host. Err with the reason where no matrix goes.
pub fn place_tower(dev: &Arc<Device>, matrices: &[&crate::quant::Weight], vram_mb: u64) -> std::result::Result<Box<dyn TowerPlacement>, String> {
    if dev.lost() {
        return Err(format!("the device '{}' was lost; open it again", dev.info().name));
    }
    let budget = dev.budget(vram_mb);
    let r = Rails::upload(&dev.gpu, matrices, budget).map_err(|e| format!("uploading the vision tower's matrices failed: {e}"))?;
    if r.matrices() == 0 {
        return Err(match r.unread_words() {
            Some(words) => format!("no matrix of the vision tower goes to the device: {words}"),
            None => format!("no matrix of the vision tower fits the device budget of {} MiB", budget >> 20),
        });
    }
    Ok(Box::new(TowerRails { rails: r, device: dev.info().name.clone() }))
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_ops;
