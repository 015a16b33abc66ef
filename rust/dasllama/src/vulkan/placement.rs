//! The Vulkan driver as a model's placement (`backend::Placement`): the resident driver, whose
//! one dispatch chain per step is the whole forward pass, and the per-op rails. Each holds its
//! device state behind a lock only its own model's passes take, and publishes a status snapshot
//! after every step. A device that fails under a placement is let go of there: the placement
//! frees what it held and stops serving, and every later pass of its model runs on the host.

use super::engine::{Engine, MAX_OUT, PREFILL_WINDOW};
use super::rails::Rails;
use super::regions::Book;
use super::Device;
use crate::backend::{DevKv, KvHome, MatmulOffload, PassIn, Placeable, Placement, PlacementStatus};
use crate::kv::KvCache;
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the placement says once its device failed under it.
fn ended(e: &Error, lost: bool) -> String {
    if lost {
        format!("the device was lost while serving ({e}); the model runs on the CPU (place it again to use the device)")
    } else {
        format!("the device failed under the per-op rails ({e}); the model runs on the CPU")
    }
}

pub struct ResidentPlacement {
    dev: Arc<Device>,
    /// None once the device failed under it (what it held is freed then).
    engine: Mutex<Option<Engine>>,
    book: Arc<Book>,
    /// The layers the device runs where it holds only the first ones (`Placement::split`).
    split: Option<usize>,
    serving: AtomicBool,
    status: Mutex<PlacementStatus>,
    passes: Mutex<BTreeMap<String, u64>>,
}

impl ResidentPlacement {
    /// `why`: why the device holds only the first `r.layers` layers ("" when it holds them all).
    pub fn new(dev: Arc<Device>, r: Engine, why: String) -> ResidentPlacement {
        let status = PlacementStatus {
            tier: if r.split { "gpu:partial" } else { "gpu:resident" },
            device: dev.info().name.clone(),
            reason: why,
            serving: true,
            resident_layers: r.layers,
            weight_bytes: r.weight_bytes,
            kv_bytes: r.regions.bytes(),
            regions: r.regions.count(),
            session_ctx: r.regions.ctx,
            codec: Some(r.regions.codec),
            chains_recorded: 0,
            chains_replayed: 0,
        };
        ResidentPlacement {
            dev,
            book: Arc::new(Book::new(r.regions.count(), r.recurrent(), !r.split)),
            split: r.split.then_some(r.layers),
            engine: Mutex::new(Some(r)),
            serving: AtomicBool::new(true),
            status: Mutex::new(status),
            passes: Mutex::new(BTreeMap::new()),
        }
    }

    fn stale(&self) -> Error {
        let st = lock(&self.status);
        // A serving placement's reason says why it is split, not why it stopped.
        let why = if st.serving || st.reason.is_empty() { "it was dropped or switched out".to_string() } else { st.reason.clone() };
        Error::Device(format!("this device session's model is no longer on the device ({why}); create a new session"))
    }
}

impl Placement for ResidentPlacement {
    fn status(&self) -> PlacementStatus {
        lock(&self.status).clone()
    }

    fn resident(&self) -> bool {
        self.serving.load(Ordering::SeqCst)
    }

    fn host_pass(&self, f: &mut dyn FnMut(Option<&mut dyn MatmulOffload>)) {
        if self.resident() {
            let words =
                "paged or private sessions keep their K/V in host memory, so their calls ran on the CPU (create_device_session for device-home streams)";
            *lock(&self.passes).entry(words.to_string()).or_default() += 1;
        }
        f(None)
    }

    fn create_kv(&self) -> Result<DevKv> {
        if !self.resident() {
            return Err(self.stale());
        }
        let region = self.book.take().ok_or_else(|| {
            Error::PoolFull(format!(
                "all {} device regions are held by live sessions; finish or park one first (set_gpu_resident_regions for more)",
                lock(&self.status).regions
            ))
        })?;
        let home: Weak<dyn KvHome> = Arc::downgrade(&self.book) as Weak<dyn KvHome>;
        Ok(DevKv::new(region, home))
    }

    fn window(&self) -> (usize, usize) {
        (PREFILL_WINDOW, MAX_OUT)
    }

    fn owns(&self, kv: &DevKv) -> bool {
        kv.is_in(&self.book)
    }

    fn session_ctx(&self) -> usize {
        lock(&self.status).session_ctx
    }

    fn split(&self) -> Option<usize> {
        self.split
    }

    fn forward(&self, m: &dyn Placeable, regions: &[usize], inp: &PassIn<'_>, hidden: bool, out: &mut Vec<f32>) -> Result<()> {
        let mut engine = lock(&self.engine);
        let Some(r) = engine.as_mut() else { return Err(self.stale()) };
        if let Err(e) = r.forward(m, regions, inp, hidden, out) {
            self.dev.gpu.note(&e);
            if self.dev.lost() {
                // Nothing on a lost device answers again: free what it held, serve on the host.
                *engine = None;
                self.serving.store(false, Ordering::SeqCst);
                let mut st = lock(&self.status);
                st.reason = ended(&e, true);
                st.serving = false;
            }
            return Err(e);
        }
        let (recorded, replayed, weight_bytes) = (r.recorded, r.replayed, r.weight_bytes);
        drop(engine);
        let mut st = lock(&self.status);
        (st.chains_recorded, st.chains_replayed, st.weight_bytes) = (recorded, replayed, weight_bytes);
        Ok(())
    }

    fn hydrate(&self, kv: &DevKv, host: &mut KvCache) -> Result<()> {
        if !kv.is_in(&self.book) {
            return Err(self.stale());
        }
        let mut engine = lock(&self.engine);
        let Some(r) = engine.as_mut() else { return Err(self.stale()) };
        let out = r.read_rows(kv.region(), kv.len(), host);
        match &out {
            Ok(()) => kv.grids().as_slice().iter().for_each(|&g| host.add_grid(g)),
            Err(e) => self.dev.gpu.note(e),
        }
        out
    }

    fn cpu_passes(&self) -> Vec<(u64, String)> {
        lock(&self.passes).iter().map(|(w, &n)| (n, w.clone())).collect()
    }
}

pub struct RailsPlacement {
    dev: Arc<Device>,
    /// None once the device failed under it.
    engine: Mutex<Option<Rails>>,
    serving: AtomicBool,
    status: Mutex<PlacementStatus>,
}

impl RailsPlacement {
    /// `why`: the resident driver's reason to decline the model, which the status keeps.
    pub fn new(dev: Arc<Device>, r: Rails, why: String) -> RailsPlacement {
        let status = PlacementStatus {
            tier: "gpu:rails",
            device: dev.info().name.clone(),
            reason: why,
            serving: true,
            weight_bytes: r.weight_bytes,
            ..Default::default()
        };
        RailsPlacement { dev, engine: Mutex::new(Some(r)), serving: AtomicBool::new(true), status: Mutex::new(status) }
    }

    fn declined(&self) -> Error {
        Error::InvalidArgument(format!(
            "this model runs on the per-op rails (its matrices on the device, K/V in host memory); device-home sessions need the whole model on the device, which it does not hold: {}",
            lock(&self.status).reason
        ))
    }
}

impl Placement for RailsPlacement {
    fn status(&self) -> PlacementStatus {
        lock(&self.status).clone()
    }

    fn resident(&self) -> bool {
        false
    }

    fn host_pass(&self, f: &mut dyn FnMut(Option<&mut dyn MatmulOffload>)) {
        if !self.serving.load(Ordering::SeqCst) {
            return f(None);
        }
        let mut engine = lock(&self.engine);
        let Some(r) = engine.as_mut() else { return f(None) };
        f(Some(r));
        if let Some(e) = r.failed.take() {
            // The pass finished on the CPU; so does every later one.
            self.dev.gpu.note(&e);
            *engine = None;
            self.serving.store(false, Ordering::SeqCst);
            let mut st = lock(&self.status);
            st.reason = ended(&e, self.dev.lost());
            st.serving = false;
        }
    }

    fn create_kv(&self) -> Result<DevKv> {
        Err(self.declined())
    }

    fn window(&self) -> (usize, usize) {
        (PREFILL_WINDOW, MAX_OUT)
    }

    fn owns(&self, _: &DevKv) -> bool {
        false
    }

    fn session_ctx(&self) -> usize {
        0
    }

    fn forward(&self, _: &dyn Placeable, _: &[usize], _: &PassIn<'_>, _: bool, _: &mut Vec<f32>) -> Result<()> {
        Err(self.declined())
    }

    fn hydrate(&self, _: &DevKv, _: &mut KvCache) -> Result<()> {
        Err(self.declined())
    }

    fn cpu_passes(&self) -> Vec<(u64, String)> {
        Vec::new()
    }
}
