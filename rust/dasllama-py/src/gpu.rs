//! Devices and placements (`dasllama.devices` and the tutorial's `dasllama.gpu` facade are the
//! Python faces): an opened Vulkan device is an object, a model is placed on one, and device-home
//! sessions live in its placement. No state here outlives the objects; the GIL is released around
//! everything that touches a device.

use super::{map_err, native, PyModel, PyScheduler, PySession, PyVision};
use dasllama::backend::{DevKv, PlacementStatus, TowerStatus};
use dasllama::kv::KvCodec;
use dasllama::session::Session;
use dasllama::vulkan::{self, DeviceInfo};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Arc;

fn info_dict<'py>(py: Python<'py>, d: &DeviceInfo) -> PyResult<Bound<'py, PyDict>> {
    let o = PyDict::new_bound(py);
    o.set_item("index", d.index)?;
    o.set_item("name", &d.name)?;
    o.set_item("kind", d.kind)?;
    o.set_item("api_version", &d.api_version)?;
    o.set_item("vram_bytes", d.vram_bytes)?;
    Ok(o)
}

/// (available, device name or the reason there is none, device kind) for the device `pick`
/// names, else the best one (CPU-type ones only where `allow_cpu`). It enumerates each call: the
/// Python `Runtime` keeps the verdict.
#[pyfunction]
#[pyo3(signature = (pick, allow_cpu))]
fn vk_witness(py: Python<'_>, pick: Option<String>, allow_cpu: bool) -> (bool, String, &'static str) {
    py.allow_threads(|| match vulkan::witness(pick.as_deref(), allow_cpu) {
        Ok(d) => (true, d.name, d.kind),
        Err(e) => (false, e, ""),
    })
}

/// Every Vulkan device the loader reports, as dicts.
#[pyfunction]
fn vk_devices<'py>(py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
    let devs = py.allow_threads(vulkan::devices).map_err(dasllama::Error::Device).map_err(map_err)?;
    devs.iter().map(|d| info_dict(py, d)).collect()
}

/// An opened Vulkan device, shared by the models placed on it.
#[pyclass(module = "dasllama._native", name = "VulkanDevice", frozen)]
pub struct PyDevice {
    inner: Arc<vulkan::Device>,
}

#[pymethods]
impl PyDevice {
    /// Open the device `pick` names (an index or part of its name), else the best kind;
    /// CPU-type ones only where `allow_cpu`.
    #[new]
    #[pyo3(signature = (pick, allow_cpu))]
    fn open(py: Python<'_>, pick: Option<String>, allow_cpu: bool) -> PyResult<Self> {
        let inner = native(py, "opening a Vulkan device", || vulkan::Device::open(pick.as_deref(), allow_cpu))?;
        Ok(PyDevice { inner })
    }

    /// index, name, kind, api_version, vram_bytes.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        info_dict(py, self.inner.info())
    }

    /// (budget, usage) of device-local memory in bytes.
    fn memory(&self, py: Python<'_>) -> (u64, u64) {
        py.allow_threads(|| self.inner.memory())
    }

    /// Device memory dasllama's allocator holds on this device.
    fn allocated(&self, py: Python<'_>) -> u64 {
        py.allow_threads(|| self.inner.allocated())
    }

    /// Bytes a model placed now may take (`vram_mb` caps it where not 0).
    #[pyo3(signature = (vram_mb=0))]
    fn budget(&self, py: Python<'_>, vram_mb: u64) -> u64 {
        py.allow_threads(|| self.inner.budget(vram_mb))
    }

    fn lost(&self) -> bool {
        self.inner.lost()
    }

    /// Test hook: the next step on this device reports it lost.
    #[cfg(feature = "fault-injection")]
    fn _inject_fault(&self) {
        self.inner.inject_fault()
    }
}

/// Place `m` on `dev` (taking it off any device first): "gpu:resident" or "gpu:rails", and the
/// reason it is not resident; ("cpu", reason) when it stays on the CPU.
#[pyfunction]
#[pyo3(signature = (m, dev, regions, ctx_max, ctx_strict, kv_dtype=None, vram_mb=0, log=false))]
#[allow(clippy::too_many_arguments)]
fn place_model(
    py: Python<'_>,
    m: &PyModel,
    dev: &PyDevice,
    regions: usize,
    ctx_max: usize,
    ctx_strict: bool,
    kv_dtype: Option<&str>,
    vram_mb: u64,
    log: bool,
) -> PyResult<(String, String)> {
    let codec = kv_dtype.map(|n| KvCodec::parse(n).ok_or_else(|| PyValueError::new_err(format!("unknown K/V dtype '{n}' (f16, q8_0 or tq4)")))).transpose()?;
    let opts = vulkan::Options { regions, ctx_max, ctx_strict, codec, vram_mb, log };
    let (model, device) = (m.inner.clone(), dev.inner.clone());
    py.allow_threads(|| {
        // What the model held counts as free for its new place.
        drop(model.set_placement(None));
        match vulkan::place(&device, &*model, &opts) {
            Ok(p) => {
                let st = p.status();
                model.set_placement(Some(p));
                Ok((st.tier.to_string(), st.reason))
            }
            Err(why) => Ok(("cpu".to_string(), why)),
        }
    })
}

/// Take `m` off its device; what the device held for it is freed (once a pass running now ends).
/// False when it was on none.
#[pyfunction]
fn unplace_model(py: Python<'_>, m: &PyModel) -> bool {
    let model = m.inner.clone();
    py.allow_threads(|| model.set_placement(None).is_some())
}

fn status_dict<'py>(py: Python<'py>, s: PlacementStatus) -> PyResult<Bound<'py, PyDict>> {
    let o = PyDict::new_bound(py);
    o.set_item("tier", s.tier)?;
    o.set_item("device", s.device)?;
    o.set_item("reason", s.reason)?;
    o.set_item("serving", s.serving)?;
    o.set_item("resident_layers", s.resident_layers)?;
    o.set_item("weight_bytes", s.weight_bytes)?;
    o.set_item("kv_bytes", s.kv_bytes)?;
    o.set_item("regions", s.regions)?;
    o.set_item("session_ctx", s.session_ctx)?;
    o.set_item("kv_dtype", s.codec.map(KvCodec::name))?;
    o.set_item("chains_recorded", s.chains_recorded)?;
    o.set_item("chains_replayed", s.chains_replayed)?;
    Ok(o)
}

/// Put vision tower `v`'s matrices on `dev` (its matmuls and attention run there), or back on
/// the host (`dev` None). Returns the reason when the device takes none of them (the tower
/// stays on the host), else "".
#[pyfunction]
#[pyo3(signature = (v, dev, vram_mb=0))]
fn place_vision(py: Python<'_>, v: &PyVision, dev: Option<&PyDevice>, vram_mb: u64) -> String {
    let (vision, device) = (v.inner.clone(), dev.map(|d| d.inner.clone()));
    py.allow_threads(|| {
        // What the tower held counts as free for its new place.
        drop(vision.place(None));
        match device.map(|d| vulkan::place_tower(&d, &vision.matrices(), vram_mb)) {
            None => String::new(),
            Some(Ok(p)) => {
                vision.place(Some(p));
                String::new()
            }
            Some(Err(why)) => why,
        }
    })
}

fn tower_dict<'py>(py: Python<'py>, s: TowerStatus) -> PyResult<Bound<'py, PyDict>> {
    let o = PyDict::new_bound(py);
    o.set_item("device", s.device)?;
    o.set_item("matrices", s.matrices)?;
    o.set_item("left_on_cpu", s.left_on_cpu)?;
    o.set_item("weight_bytes", s.weight_bytes)?;
    o.set_item("matmuls", s.matmuls)?;
    o.set_item("attentions", s.attentions)?;
    o.set_item("failed", s.failed)?;
    Ok(o)
}

/// What vision tower `v`'s device holds and has done; None on the host. Waits for an encode
/// running now.
#[pyfunction]
fn vision_placement<'py>(py: Python<'py>, v: &PyVision) -> PyResult<Option<Bound<'py, PyDict>>> {
    let vision = v.inner.clone();
    let st = py.allow_threads(|| vision.device_status());
    st.map(|s| tower_dict(py, s)).transpose()
}

/// The snapshot `m`'s placement published after its last step; None on the CPU.
#[pyfunction]
fn placement_status<'py>(py: Python<'py>, m: &PyModel) -> PyResult<Option<Bound<'py, PyDict>>> {
    m.inner.placement().map(|p| status_dict(py, p.status())).transpose()
}

/// The honesty counter of `m`'s placement: (count, reason) per kind of pass it left to the CPU.
#[pyfunction]
fn placement_cpu_passes(m: &PyModel) -> Vec<(u64, String)> {
    m.inner.placement().map_or_else(Vec::new, |p| p.cpu_passes())
}

#[pyfunction]
fn gpu_prefill_window() -> usize {
    vulkan::PREFILL_WINDOW
}

/// A device-home session of `m` (its K/V in a region of its placement).
#[pyfunction]
fn create_device_session(py: Python<'_>, m: &PyModel) -> PyResult<PySession> {
    let inner = m.inner.clone();
    let s = native(py, "create_device_session", || Session::on_device(&inner))?;
    Ok(PySession { model: m.inner.clone(), inner: s })
}

fn dev(s: &mut PySession) -> PyResult<&mut DevKv> {
    s.inner.dev.as_mut().ok_or_else(|| PyValueError::new_err("this is not a device-home session (create_device_session makes one)"))
}

/// Park a finished device session's rows; returns the claim (the session is left empty).
#[pyfunction]
fn gpu_park(s: &mut PySession) -> PyResult<u64> {
    Ok(dev(s)?.park())
}

#[pyfunction]
fn gpu_adopt(py: Python<'_>, s: &mut PySession, claim: u64, rows: usize) -> PyResult<bool> {
    let d = dev(s)?;
    native(py, "gpu_device_kv_adopt", || d.adopt(claim, rows))
}

/// Copy a device session's rows to host memory; the session is host-home afterwards.
#[pyfunction]
fn gpu_hydrate(py: Python<'_>, s: &mut PySession) -> PyResult<()> {
    let Some(d) = s.inner.dev.as_ref() else { return Ok(()) };
    let (model, kv) = (s.model.clone(), &mut s.inner.kv);
    native(py, "moe_gpu_hydrate_session", || {
        let p = model.placement().ok_or_else(|| {
            dasllama::Error::Device("this device session's model is no longer on the device (it was dropped or switched out); create a new session".into())
        })?;
        p.hydrate(d, kv)
    })?;
    s.inner.dev = None;
    Ok(())
}

#[pyfunction]
fn is_device_session(s: &PySession) -> bool {
    s.inner.dev.is_some()
}

/// Keep the scheduler's streams' K/V on the device (only an idle scheduler switches).
#[pyfunction]
fn set_device_kv(sch: &mut PyScheduler, on: bool) -> PyResult<()> {
    sch.inner.set_device_kv(on).map_err(map_err)
}

#[pyfunction]
fn device_kv(sch: &PyScheduler) -> bool {
    sch.inner.device_kv()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDevice>()?;
    for f in [
        wrap_pyfunction!(vk_witness, m)?,
        wrap_pyfunction!(vk_devices, m)?,
        wrap_pyfunction!(place_model, m)?,
        wrap_pyfunction!(unplace_model, m)?,
        wrap_pyfunction!(placement_status, m)?,
        wrap_pyfunction!(placement_cpu_passes, m)?,
        wrap_pyfunction!(place_vision, m)?,
        wrap_pyfunction!(vision_placement, m)?,
        wrap_pyfunction!(gpu_prefill_window, m)?,
        wrap_pyfunction!(create_device_session, m)?,
        wrap_pyfunction!(gpu_park, m)?,
        wrap_pyfunction!(gpu_adopt, m)?,
        wrap_pyfunction!(gpu_hydrate, m)?,
        wrap_pyfunction!(is_device_session, m)?,
        wrap_pyfunction!(set_device_kv, m)?,
        wrap_pyfunction!(device_kv, m)?,
    ] {
        m.add_function(f)?;
    }
    Ok(())
}
