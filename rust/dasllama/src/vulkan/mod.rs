//! The GPU tier: an ash-based Vulkan driver that holds a whole model on the device and serves
//! device-home sessions (K/V in one device region per stream) with true batched decode.
//!
//! Process-wide state, as the serving tutorial's tier is: one model on the device at a time.
//! The order of a load is: `set_want` (what to ask), `arm` (open the device), load the model,
//! `install` (upload it, or say why not), `capture` (classify the outcome). A switch is
//! `hydrate` every live device session, `drop_model`, then install the next one.
//! On a machine without Vulkan every step is a cheap no-op that reports "cpu".
//!
//! Modules: `device` (loader, instance, device choice, allocator), `buffer`, `kernels`
//! (pipelines and the step's command buffer), `weights` (repack and upload), `regions` (device
//! K/V), `resident` (the model and its forward pass).

mod buffer;
mod device;
mod kernels;
mod rails;
mod regions;
mod resident;
mod shaders;
mod weights;

pub use device::DeviceInfo;
pub use resident::PREFILL_WINDOW;

use crate::backend::MatmulOffload;
use crate::kv::{KvCache, KvCodec};
use crate::model::forward::LogitRows;
use crate::model::Model;
use crate::{Error, Result};
use device::Gpu;
use rails::Rails;
use regions::Regions;
use resident::Resident;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// What a load should put on the device (the programmatic form of `DASLLAMA_GPU*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Want {
    /// Use the device when one is there: the whole model resident if it fits.
    pub auto_tier: bool,
    /// Cap on the weights' device memory in MiB (0: the device's budget).
    pub vram_mb: u64,
}

impl Want {
    /// The want with the environment applied: `DASLLAMA_GPU=0|off` keeps everything off the
    /// device, `=1|on|vulkan` asks for it; `DASLLAMA_GPU_VRAM_MB` caps the weights.
    fn with_env(mut self) -> Want {
        if let Ok(v) = std::env::var("DASLLAMA_GPU") {
            self.auto_tier = !matches!(v.to_lowercase().as_str(), "0" | "off" | "false" | "cpu" | "");
        }
        if let Some(mb) = std::env::var("DASLLAMA_GPU_VRAM_MB").ok().and_then(|v| v.parse().ok()) {
            self.vram_mb = mb;
        }
        self
    }

    pub fn is_zero(&self) -> bool {
        !self.auto_tier
    }
}

/// A snapshot for status pages.
#[derive(Clone, Debug, Default)]
pub struct Status {
    pub backend: String,
    pub device: String,
    pub supported: bool,
    pub reason: String,
    /// Device memory our allocator holds.
    pub vram_bytes: u64,
    /// The device's memory budget (VK_EXT_memory_budget where present, else its heaps).
    pub budget_bytes: u64,
    pub resident_layers: usize,
    pub weight_bytes: u64,
    pub kv_bytes: u64,
    /// Device steps (windows) that recorded their dispatch chain, and those that replayed one
    /// recorded for an earlier step of the same shape.
    pub chains_recorded: u64,
    pub chains_replayed: u64,
}

struct Tier {
    want: Want,
    armed: bool,
    gpu: Option<Arc<Gpu>>,
    /// Why the device is not used (empty while it is).
    reason: String,
    resident: Option<Resident>,
    /// A model the resident driver declined, its matrices on the device (the per-op rails).
    rails: Option<Rails>,
    /// Bumped whenever the resident model goes: device sessions of an older one are stale.
    generation: u64,
    /// "cpu" | "gpu:resident": what the last install did, and why "cpu".
    outcome: String,
    install_reason: String,
    regions: usize,
    ctx_max: usize,
    ctx_strict: bool,
    kv_dtype: Option<KvCodec>,
    prefill_allowed: bool,
    passes: BTreeMap<String, u64>,
}

fn tier() -> MutexGuard<'static, Tier> {
    static TIER: Mutex<Tier> = Mutex::new(Tier {
        want: Want { auto_tier: false, vram_mb: 0 },
        armed: false,
        gpu: None,
        reason: String::new(),
        resident: None,
        rails: None,
        generation: 0,
        outcome: String::new(),
        install_reason: String::new(),
        regions: 4,
        ctx_max: 4096,
        ctx_strict: false,
        kv_dtype: None,
        prefill_allowed: true,
        passes: BTreeMap::new(),
    });
    TIER.lock().unwrap_or_else(|e| e.into_inner())
}

/// The backend's witness: whether a usable Vulkan device answers on this machine (enumerated
/// once, cached), and the device or the reason.
pub fn witness() -> &'static std::result::Result<DeviceInfo, String> {
    static W: OnceLock<std::result::Result<DeviceInfo, String>> = OnceLock::new();
    W.get_or_init(|| match device::enumerate() {
        Ok(devs) => device::choose(&devs).map(|i| devs[i].clone()),
        Err(e) => Err(e.to_string()),
    })
}

/// Every Vulkan device the loader reports (empty, with the reason, where there is none).
pub fn devices() -> std::result::Result<Vec<DeviceInfo>, String> {
    device::enumerate().map_err(|e| e.to_string())
}

pub fn set_want(w: Want) {
    tier().want = w;
}

/// Arm the recorded want (env applied): open the device so the next load can go there. False
/// when the want is zero or no device answers (the reason in `status().reason`).
pub fn arm() -> bool {
    let mut t = tier();
    let want = t.want.with_env();
    t.armed = false;
    if want.is_zero() {
        t.reason = "the GPU tier is off (zero want, --gpu off or DASLLAMA_GPU=0)".into();
        return false;
    }
    if t.gpu.is_none() {
        if let Err(why) = witness() {
            t.reason = why.clone();
            return false;
        }
        match Gpu::open() {
            Ok(g) => t.gpu = Some(Arc::new(g)),
            Err(e) => {
                t.reason = e.to_string();
                return false;
            }
        }
    }
    t.armed = true;
    t.reason.clear();
    true
}

/// Bytes of weights the armed device will hold (0 when not armed).
pub fn weight_budget() -> u64 {
    let t = tier();
    budget(&t)
}

fn budget(t: &Tier) -> u64 {
    let Some(g) = t.gpu.as_ref().filter(|_| t.armed) else { return 0 };
    let want = t.want.with_env();
    let (total, used) = g.memory();
    // What is free now plus what the resident model holds, less a margin for the driver.
    let held = t.resident.as_ref().map_or(0, |r| r.weight_bytes + r.regions.bytes()) + t.rails.as_ref().map_or(0, |r| r.weight_bytes);
    let free = (total.saturating_sub(used) + held) / 10 * 9;
    if want.vram_mb > 0 {
        free.min(want.vram_mb << 20)
    } else {
        free
    }
}

pub fn status() -> Status {
    let t = tier();
    let mut s = Status { backend: "cpu".into(), supported: witness().is_ok(), ..Default::default() };
    if let Some(g) = &t.gpu {
        s.device = g.info.name.clone();
        let (total, _) = g.memory();
        s.budget_bytes = total;
        s.vram_bytes = g.allocated();
    }
    if let Some(r) = &t.resident {
        s.backend = "vulkan".into();
        s.resident_layers = r.layers();
        s.weight_bytes = r.weight_bytes;
        s.kv_bytes = r.regions.bytes();
        (s.chains_recorded, s.chains_replayed) = (r.recorded, r.replayed);
    }
    if let Some(r) = &t.rails {
        s.backend = "vulkan".into();
        s.weight_bytes = r.weight_bytes;
    }
    s.reason = match (&t.resident, witness()) {
        (Some(_), _) => String::new(),
        (None, _) if t.rails.is_some() => String::new(),
        (None, Err(w)) => w.clone(),
        (None, Ok(_)) if !t.reason.is_empty() => t.reason.clone(),
        (None, Ok(_)) => "no model is on the device".into(),
    };
    s
}

/// After a load: put `m` on the device if the tier is armed and the model fits. Returns the
/// outcome: "gpu:resident" (the whole forward pass on the device), "gpu:rails" (a model the
/// resident driver declines: its matrices on the device, the rest on the CPU; `decline()` says
/// why not resident) or "cpu" (the reason is in `status().reason` and `decline()`).
pub fn install(m: &Model) -> String {
    let mut t = tier();
    let outcome = install_locked(&mut t, m);
    t.outcome = outcome.clone();
    t.install_reason = if outcome == "gpu:resident" { String::new() } else { t.reason.clone() };
    if t.resident.is_some() {
        // The device goes on serving the model it holds.
        t.reason.clear();
    }
    outcome
}

fn install_locked(t: &mut Tier, m: &Model) -> String {
    if !t.armed {
        if t.reason.is_empty() {
            t.reason = "the GPU tier was not armed before the load".into();
        }
        return "cpu".into();
    }
    if t.resident.is_some() || t.rails.is_some() {
        t.reason = "the device still holds another model: hydrate its sessions and drop it first (the switch order)".into();
        return "cpu".into();
    }
    if let Some(why) = resident::decline(m) {
        t.reason = why;
        if m.numerics == crate::model::Numerics::Ggml {
            return "cpu".into();
        }
        return install_rails(t, m);
    }
    let ctx = if t.ctx_max == 0 { m.config.seq_len } else { t.ctx_max.min(m.config.seq_len) };
    if t.ctx_strict && t.ctx_max > m.config.seq_len {
        t.reason = format!("a strict context of {} positions was asked, past the model's {}", t.ctx_max, m.config.seq_len);
        return "cpu".into();
    }
    let codec = match wanted_codec(t) {
        Ok(c) => c,
        Err(why) => {
            t.reason = why;
            return "cpu".into();
        }
    };
    if !codec.supports(m.config.head_dim) {
        t.reason = format!(
            "device K/V in {} needs {}; this model's heads have {} values (pin f16 with set_gpu_kv_dtype)",
            codec.name(),
            codec.requirement(),
            m.config.head_dim
        );
        return "cpu".into();
    }
    let kv_bytes = Regions::bytes_for(t.regions, ctx, m.config.kv_layers(), m.config.kv_dim(), codec);
    let weight_bytes = resident::weight_bytes(m);
    let need = weight_bytes + kv_bytes;
    let have = budget(t);
    if need > have {
        t.reason = format!(
            "the model needs {} MiB on the device ({} MiB of weights, {} MiB of K/V for {} regions of {ctx} positions) but the budget is {} MiB; lower --gpu-regions or the context, or serve on the CPU",
            need >> 20,
            weight_bytes >> 20,
            kv_bytes >> 20,
            t.regions,
            have >> 20
        );
        return "cpu".into();
    }
    let gpu = t.gpu.clone().expect("armed means a device");
    match Resident::upload(&gpu, m, t.regions, ctx, codec) {
        Ok(r) => {
            log(&format!(
                "{} on '{}': {} MiB of weights, {} regions of {ctx} positions, K/V in {}",
                m.config.arch,
                gpu.info.name,
                r.weight_bytes >> 20,
                t.regions,
                codec.name()
            ));
            t.resident = Some(r);
            t.reason.clear();
            // The counter speaks of the model on the device.
            t.passes.clear();
            "gpu:resident".into()
        }
        Err(e) => {
            t.reason = format!("uploading the model failed: {e}");
            "cpu".into()
        }
    }
}

/// The per-op rails for a model the resident driver declined (`t.reason` says why, and stays).
fn install_rails(t: &mut Tier, m: &Model) -> String {
    let gpu = t.gpu.clone().expect("armed means a device");
    match Rails::upload(&gpu, m, budget(t)) {
        Ok(r) if r.matrices() > 0 => {
            log(&format!(
                "{} on '{}' on the per-op rails: {} matrices ({} MiB) on the device, {} on the CPU; {}",
                m.config.arch,
                gpu.info.name,
                r.matrices(),
                r.weight_bytes >> 20,
                r.left_on_cpu,
                t.reason
            ));
            t.rails = Some(r);
            // The counter speaks of the model on the device.
            t.passes.clear();
            "gpu:rails".into()
        }
        Ok(_) => {
            t.reason = format!("{}; and no matrix fits the device budget of {} MiB for the per-op rails", t.reason, budget(t) >> 20);
            "cpu".into()
        }
        Err(e) => {
            t.reason = format!("{}; and uploading its matrices for the per-op rails failed: {e}", t.reason);
            "cpu".into()
        }
    }
}

/// Whether `m` runs on the per-op rails.
pub fn on_rails(m: &Model) -> bool {
    tier().rails.as_ref().is_some_and(|r| r.model_id == m as *const Model as usize)
}

/// Run `f` with `m`'s rails as the CPU backend's matmul offload (None when `m` is not on them).
/// A device that fails under the rails is let go of: that pass and every later one run on the
/// CPU, and the reason says what happened.
pub fn with_rails<R>(m: &Model, f: impl FnOnce(Option<&mut dyn MatmulOffload>) -> R) -> R {
    let mut t = tier();
    let Some(r) = t.rails.as_mut().filter(|r| r.model_id == m as *const Model as usize) else {
        drop(t);
        return f(None);
    };
    let out = f(Some(r));
    if let Some(e) = r.failed.take() {
        let lost = device::take_lost();
        t.rails = None;
        t.outcome = "cpu".into();
        t.reason = format!("the per-op rails failed ({e}); the model runs on the CPU{}", if lost { " (the device was lost)" } else { "" });
        if lost {
            t.gpu = None;
            t.armed = false;
        }
    }
    out
}

fn log(msg: &str) {
    if std::env::var("DASLLAMA_VK_LOG").is_ok_and(|v| v == "1") {
        eprintln!("dasllama vulkan: {msg}");
    }
}

/// The outcome of the last install ("cpu" before any) and, for "cpu", why.
pub fn outcome() -> (String, String) {
    let t = tier();
    if t.outcome.is_empty() {
        ("cpu".into(), decline_locked(&t))
    } else {
        (t.outcome.clone(), t.install_reason.clone())
    }
}

/// Free the resident model's whole device state. Device sessions of it become stale: their
/// calls fail with a clear error (hydrate them first to keep their rows).
pub fn drop_model() {
    let mut t = tier();
    if t.resident.take().is_some() {
        t.generation += 1;
    }
    t.rails = None;
    t.outcome = "cpu".into();
}

/// A model is going away: whatever the device holds for it goes too (its identity is its
/// address, which a later model may reuse).
pub fn forget(m: &Model) {
    let id = m as *const Model as usize;
    let mut t = tier();
    if t.resident.as_ref().is_some_and(|r| r.model_id == id) {
        t.resident = None;
        t.generation += 1;
        t.outcome = "cpu".into();
    }
    if t.rails.as_ref().is_some_and(|r| r.model_id == id) {
        t.rails = None;
        t.outcome = "cpu".into();
    }
}

/// Whether `m` is the model on the device.
pub fn holds(m: &Model) -> bool {
    tier().resident.as_ref().is_some_and(|r| r.model_id == m as *const Model as usize)
}

pub fn set_regions(n: usize) {
    tier().regions = n;
}
pub fn set_ctx_max(n: usize) {
    tier().ctx_max = n;
}
pub fn set_ctx_strict(b: bool) {
    tier().ctx_strict = b;
}
/// (ctx_max, strict) as pinned.
pub fn ctx_pins() -> (usize, bool) {
    let t = tier();
    (t.ctx_max, t.ctx_strict)
}
/// Pin the device K/V codec (None: unpinned; `DASLLAMA_GPU_KV` decides).
pub fn set_kv_dtype(c: Option<KvCodec>) {
    tier().kv_dtype = c;
}
pub fn kv_dtype_pin() -> Option<KvCodec> {
    tier().kv_dtype
}
/// The codec device-home sessions carry: the installed model's, else what the next install
/// would use (f16 when the environment names no valid codec).
pub fn session_dtype() -> KvCodec {
    let t = tier();
    t.resident.as_ref().map_or_else(|| wanted_codec(&t).unwrap_or(KvCodec::F16), |r| r.regions.codec)
}

/// The pin, else `DASLLAMA_GPU_KV`, else f16.
fn wanted_codec(t: &Tier) -> std::result::Result<KvCodec, String> {
    if let Some(c) = t.kv_dtype {
        return Ok(c);
    }
    match std::env::var("DASLLAMA_GPU_KV") {
        Ok(v) if !v.is_empty() => KvCodec::parse(&v).ok_or_else(|| format!("DASLLAMA_GPU_KV={v:?} is not a K/V codec; use f16, q8_0 or tq4")),
        _ => Ok(KvCodec::F16),
    }
}
pub fn set_prefill_allowed(b: bool) {
    tier().prefill_allowed = b;
}
pub fn prefill_allowed() -> bool {
    tier().prefill_allowed
}

/// Regions the resident driver serves (0 when no model is on the device).
pub fn device_sessions() -> usize {
    tier().resident.as_ref().map_or(0, |r| r.regions.count())
}

/// Positions one region holds (0 when no model is on the device).
pub fn session_ctx() -> usize {
    tier().resident.as_ref().map_or(0, |r| r.regions.ctx)
}

/// Why the resident driver does not serve (empty while it does).
pub fn decline() -> String {
    decline_locked(&tier())
}

fn decline_locked(t: &Tier) -> String {
    if t.resident.is_some() {
        return String::new();
    }
    match witness() {
        Err(w) => w.clone(),
        Ok(_) if !t.reason.is_empty() => t.reason.clone(),
        Ok(_) => "no model was installed on the device (arm the tier before the load)".into(),
    }
}

/// Count a call that ran on the CPU although a model is on the device.
pub fn cpu_pass(words: &str) {
    let mut t = tier();
    if t.resident.is_some() {
        *t.passes.entry(words.to_string()).or_default() += 1;
    }
}

/// The honesty counter: (count, reason) for every kind of call handed back to the CPU.
pub fn cpu_passes() -> Vec<(u64, String)> {
    tier().passes.iter().map(|(w, &n)| (n, w.clone())).collect()
}

/// A session's K/V in a device region.
#[derive(Debug)]
pub struct DevKv {
    region: usize,
    len: usize,
    generation: u64,
}

impl DevKv {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forget positions from `pos` on (a speculative rollback): the rows stay but are
    /// overwritten by the next ones.
    pub fn truncate(&mut self, pos: usize) {
        self.len = self.len.min(pos);
    }

    pub fn reset(&mut self) {
        self.len = 0;
    }
}

impl Drop for DevKv {
    fn drop(&mut self) {
        let mut t = tier();
        let g = t.generation;
        if let Some(r) = t.resident.as_mut().filter(|_| g == self.generation) {
            r.regions.release(self.region);
        }
    }
}

fn stale(t: &Tier) -> Error {
    let why = if t.reason.is_empty() { "it was dropped or switched out".to_string() } else { t.reason.clone() };
    Error::Device(format!("this device session's model is no longer on the device ({why}); create a new session"))
}

/// A region for a new device-home session of `m`.
pub fn create_session(m: &Model) -> Result<DevKv> {
    let mut t = tier();
    let generation = t.generation;
    if t.rails.as_ref().is_some_and(|r| r.model_id == m as *const Model as usize) {
        return Err(Error::InvalidArgument(format!(
            "this model runs on the per-op rails (its matrices on the device, K/V in host memory); device-home sessions need the resident driver, which declined it: {}",
            t.reason
        )));
    }
    let r = t.resident.as_mut().filter(|r| r.model_id == m as *const Model as usize).ok_or_else(|| {
        Error::InvalidArgument("this model is not on the device; arm the GPU tier before loading it (gpu_tier_status() says why not)".to_string())
    })?;
    let region = r.regions.take().ok_or_else(|| {
        Error::PoolFull(format!(
            "all {} device regions are held by live sessions; finish or park one first (set_gpu_resident_regions for more)",
            r.regions.count()
        ))
    })?;
    Ok(DevKv { region, len: 0, generation })
}

/// Park a finished session's rows: its region is free for the next stream, and the claim names
/// the rows until another stream takes the region. The session is left empty.
pub fn park(s: &mut DevKv) -> u64 {
    let mut t = tier();
    let g = t.generation;
    let Some(r) = t.resident.as_mut().filter(|_| g == s.generation) else { return 0 };
    let claim = r.regions.park(s.region, s.len);
    // The handle no longer owns the region: point it at nothing so its drop releases nothing.
    s.generation = u64::MAX;
    s.len = 0;
    claim
}

/// Hand the first `rows` rows a claim names to the fresh session `s` (which gives up its own
/// region). False when the claim is stale (another stream took the region) or holds fewer rows.
pub fn adopt(s: &mut DevKv, claim: u64, rows: usize) -> Result<bool> {
    let mut t = tier();
    let g = t.generation;
    if s.generation != g {
        return Err(stale(&t));
    }
    if s.len != 0 {
        return Err(Error::InvalidArgument("adopt needs a fresh device session (n_past 0)".into()));
    }
    if t.resident.is_none() {
        return Err(stale(&t));
    }
    let r = t.resident.as_mut().expect("checked above");
    let Some((region, held)) = r.regions.adopt(claim) else { return Ok(false) };
    if rows > held {
        r.regions.park(region, held);
        return Ok(false);
    }
    r.regions.release(s.region);
    s.region = region;
    s.len = rows;
    Ok(true)
}

/// Run a forward pass over device-home sessions (see `model::forward::forward_batch`).
pub fn forward(m: &Model, kvs: &mut [&mut DevKv], counts: &[usize], tokens: &[u32], want: LogitRows<'_>, logits: &mut Vec<f32>) -> Result<()> {
    let mut t = tier();
    let g = t.generation;
    let ours = t.resident.as_ref().is_some_and(|r| r.model_id == m as *const Model as usize);
    if !ours || kvs.iter().any(|k| k.generation != g) {
        return Err(stale(&t));
    }
    let r = t.resident.as_mut().expect("checked above");
    for (k, &c) in kvs.iter().zip(counts) {
        if k.len + c > r.regions.ctx {
            return Err(Error::ContextOverflow(format!(
                "{c} tokens at position {} would run past the {} positions a device region holds; start a new session or raise set_gpu_ctx_max",
                k.len, r.regions.ctx
            )));
        }
    }
    let regions: Vec<usize> = kvs.iter().map(|k| k.region).collect();
    let lens: Vec<usize> = kvs.iter().map(|k| k.len).collect();
    if let Err(e) = r.forward(&regions, &lens, counts, tokens, want, logits, m.rope_factors.as_deref()) {
        if device::take_lost() {
            // Nothing on a lost device answers again: let go of it (a later arm opens a fresh one).
            t.resident = None;
            t.gpu = None;
            t.armed = false;
            t.generation += 1;
            t.outcome = "cpu".into();
            t.reason = format!("the device was lost while serving ({e}); re-arm the tier and reload to use it again");
        }
        return Err(e);
    }
    for (k, &c) in kvs.iter_mut().zip(counts) {
        k.len += c;
    }
    Ok(())
}

/// Copy a device session's rows into a host K/V cache (which must be empty), so the
/// conversation survives the model leaving the device.
pub fn hydrate(s: &DevKv, kv: &mut KvCache) -> Result<()> {
    let mut t = tier();
    if t.resident.is_none() || s.generation != t.generation {
        return Err(stale(&t));
    }
    t.resident.as_mut().expect("checked above").read_rows(s.region, s.len, kv)
}

/// Test hook: the next step's submission reports a lost device, as a GPU fault would.
#[cfg(feature = "fault-injection")]
pub mod fault {
    use std::sync::atomic::{AtomicBool, Ordering};
    static FAULT: AtomicBool = AtomicBool::new(false);
    pub fn inject() {
        FAULT.store(true, Ordering::SeqCst);
    }
    pub(crate) fn take() -> bool {
        FAULT.swap(false, Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests;
