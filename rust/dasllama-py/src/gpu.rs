//! The GPU tier's bindings (`dasllama.gpu` is the Python face): thin calls into
//! `dasllama::vulkan`, the GIL released around everything that touches the device.

use super::{map_err, native, PyModel, PySession};
use dasllama::kv::KvCodec;
use dasllama::session::Session;
use dasllama::vulkan;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// (available, device name or the reason there is none, device kind); enumerates once and caches.
#[pyfunction]
fn vk_witness(py: Python<'_>) -> (bool, String, &'static str) {
    py.allow_threads(|| match vulkan::witness() {
        Ok(d) => (true, d.name.clone(), d.kind),
        Err(e) => (false, e.clone(), ""),
    })
}

/// Every Vulkan device the loader reports, as dicts.
#[pyfunction]
fn vk_devices<'py>(py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
    let devs = py.allow_threads(vulkan::devices).map_err(dasllama::Error::Device).map_err(map_err)?;
    devs.into_iter()
        .map(|d| {
            let o = PyDict::new_bound(py);
            o.set_item("index", d.index)?;
            o.set_item("name", d.name)?;
            o.set_item("kind", d.kind)?;
            o.set_item("api_version", d.api_version)?;
            o.set_item("vram_bytes", d.vram_bytes)?;
            Ok(o)
        })
        .collect()
}

#[pyfunction]
fn gpu_set_want(auto_tier: bool, vram_mb: u64) {
    vulkan::set_want(vulkan::Want { auto_tier, vram_mb });
}

#[pyfunction]
fn gpu_arm(py: Python<'_>) -> bool {
    py.allow_threads(vulkan::arm)
}

#[pyfunction]
fn gpu_weight_budget(py: Python<'_>) -> u64 {
    py.allow_threads(vulkan::weight_budget)
}

#[pyfunction]
fn gpu_status<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
    let s = py.allow_threads(vulkan::status);
    let o = PyDict::new_bound(py);
    o.set_item("backend", s.backend)?;
    o.set_item("device", s.device)?;
    o.set_item("supported", s.supported)?;
    o.set_item("reason", s.reason)?;
    o.set_item("vram_bytes", s.vram_bytes)?;
    o.set_item("budget_bytes", s.budget_bytes)?;
    o.set_item("resident_layers", s.resident_layers)?;
    o.set_item("weight_bytes", s.weight_bytes)?;
    o.set_item("kv_bytes", s.kv_bytes)?;
    o.set_item("chains_recorded", s.chains_recorded)?;
    o.set_item("chains_replayed", s.chains_replayed)?;
    Ok(o)
}

/// Put the model on the armed device if it fits: "gpu:resident", else "cpu" (reason in the status).
#[pyfunction]
fn gpu_install(py: Python<'_>, m: &PyModel) -> String {
    let inner = m.inner.clone();
    py.allow_threads(|| vulkan::install(&inner))
}

/// (outcome of the last load, why it stayed on the CPU).
#[pyfunction]
fn gpu_outcome() -> (String, String) {
    vulkan::outcome()
}

#[pyfunction]
fn gpu_drop_model(py: Python<'_>) {
    py.allow_threads(vulkan::drop_model)
}

#[pyfunction]
fn gpu_holds(m: &PyModel) -> bool {
    vulkan::holds(&m.inner)
}

#[pyfunction]
fn gpu_set_regions(n: usize) {
    vulkan::set_regions(n)
}

#[pyfunction]
fn gpu_set_ctx_max(n: usize) {
    vulkan::set_ctx_max(n)
}

#[pyfunction]
fn gpu_set_ctx_strict(b: bool) {
    vulkan::set_ctx_strict(b)
}

#[pyfunction]
fn gpu_ctx_pins() -> (usize, bool) {
    vulkan::ctx_pins()
}

#[pyfunction]
#[pyo3(signature = (name=None))]
fn gpu_set_kv_dtype(name: Option<&str>) -> PyResult<()> {
    let c = name.map(|n| KvCodec::parse(n).ok_or_else(|| PyValueError::new_err(format!("unknown K/V dtype '{n}' (f16, q8_0 or tq4)")))).transpose()?;
    vulkan::set_kv_dtype(c);
    Ok(())
}

#[pyfunction]
fn gpu_kv_dtype_pin() -> Option<&'static str> {
    vulkan::kv_dtype_pin().map(KvCodec::name)
}

#[pyfunction]
fn gpu_session_dtype() -> &'static str {
    vulkan::session_dtype().name()
}

#[pyfunction]
fn gpu_set_prefill_allowed(b: bool) {
    vulkan::set_prefill_allowed(b)
}

#[pyfunction]
fn gpu_prefill_allowed() -> bool {
    vulkan::prefill_allowed()
}

#[pyfunction]
fn gpu_device_sessions() -> usize {
    vulkan::device_sessions()
}

#[pyfunction]
fn gpu_session_ctx() -> usize {
    vulkan::session_ctx()
}

#[pyfunction]
fn gpu_decline() -> String {
    vulkan::decline()
}

#[pyfunction]
fn gpu_prefill_window() -> usize {
    vulkan::PREFILL_WINDOW
}

#[pyfunction]
fn gpu_cpu_passes() -> Vec<(u64, String)> {
    vulkan::cpu_passes()
}

/// A device-home session of `m` (its K/V in a device region).
#[pyfunction]
fn create_device_session(py: Python<'_>, m: &PyModel) -> PyResult<PySession> {
    let inner = m.inner.clone();
    let s = native(py, "create_device_session", || Session::on_device(&inner))?;
    Ok(PySession { model: m.inner.clone(), inner: s })
}

fn dev(s: &mut PySession) -> PyResult<&mut vulkan::DevKv> {
    s.inner.dev.as_mut().ok_or_else(|| PyValueError::new_err("this is not a device-home session (create_device_session makes one)"))
}

/// Park a finished device session's rows; returns the claim (the session is left empty).
#[pyfunction]
fn gpu_park(s: &mut PySession) -> PyResult<u64> {
    Ok(vulkan::park(dev(s)?))
}

#[pyfunction]
fn gpu_adopt(py: Python<'_>, s: &mut PySession, claim: u64, rows: usize) -> PyResult<bool> {
    let d = dev(s)?;
    native(py, "gpu_device_kv_adopt", || vulkan::adopt(d, claim, rows))
}

/// Copy a device session's rows to host memory; the session is host-home afterwards.
#[pyfunction]
fn gpu_hydrate(py: Python<'_>, s: &mut PySession) -> PyResult<()> {
    let Some(d) = s.inner.dev.as_ref() else { return Ok(()) };
    let kv = &mut s.inner.kv;
    native(py, "moe_gpu_hydrate_session", || vulkan::hydrate(d, kv))?;
    s.inner.dev = None;
    Ok(())
}

#[pyfunction]
fn is_device_session(s: &PySession) -> bool {
    s.inner.dev.is_some()
}

/// Keep the scheduler's streams' K/V on the device (only an idle scheduler switches).
#[pyfunction]
fn set_device_kv(sch: &mut super::PyScheduler, on: bool) -> PyResult<()> {
    sch.inner.set_device_kv(on).map_err(map_err)
}

#[pyfunction]
fn device_kv(sch: &super::PyScheduler) -> bool {
    sch.inner.device_kv()
}

/// Test hook: the next device step reports a lost device.
#[cfg(feature = "fault-injection")]
#[pyfunction]
fn _inject_device_fault() {
    vulkan::fault::inject()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    for f in [
        wrap_pyfunction!(vk_witness, m)?,
        wrap_pyfunction!(vk_devices, m)?,
        wrap_pyfunction!(gpu_set_want, m)?,
        wrap_pyfunction!(gpu_arm, m)?,
        wrap_pyfunction!(gpu_weight_budget, m)?,
        wrap_pyfunction!(gpu_status, m)?,
        wrap_pyfunction!(gpu_install, m)?,
        wrap_pyfunction!(gpu_outcome, m)?,
        wrap_pyfunction!(gpu_drop_model, m)?,
        wrap_pyfunction!(gpu_holds, m)?,
        wrap_pyfunction!(gpu_set_regions, m)?,
        wrap_pyfunction!(gpu_set_ctx_max, m)?,
        wrap_pyfunction!(gpu_set_ctx_strict, m)?,
        wrap_pyfunction!(gpu_ctx_pins, m)?,
        wrap_pyfunction!(gpu_set_kv_dtype, m)?,
        wrap_pyfunction!(gpu_kv_dtype_pin, m)?,
        wrap_pyfunction!(gpu_session_dtype, m)?,
        wrap_pyfunction!(gpu_set_prefill_allowed, m)?,
        wrap_pyfunction!(gpu_prefill_allowed, m)?,
        wrap_pyfunction!(gpu_device_sessions, m)?,
        wrap_pyfunction!(gpu_session_ctx, m)?,
        wrap_pyfunction!(gpu_decline, m)?,
        wrap_pyfunction!(gpu_prefill_window, m)?,
        wrap_pyfunction!(gpu_cpu_passes, m)?,
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
    #[cfg(feature = "fault-injection")]
    m.add_function(wrap_pyfunction!(_inject_device_fault, m)?)?;
    Ok(())
}
