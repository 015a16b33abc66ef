//! The only code that knows PyO3: thin wrappers over the core, the GIL released around every
//! call that runs the model, and one mapping from core errors to Python exceptions.

// pyo3 0.22's #[pyfunction] expansion converts PyErr into itself, which clippy flags on every
// function returning PyResult.
#![allow(clippy::useless_conversion)]

use dasllama::embed::Pooling;
use dasllama::kv::{KvCodec, KvPool, PoolStats};
use dasllama::model::forward::LogitRows;
use dasllama::model::{Assistant, Attention, MetaValue, Metadata, Mixer, Model, MtpHead, Numerics, QuantMode, TensorInfo};
use dasllama::quant::switches::{self, Switches};
use dasllama::runtime::{self, Runtime};
use dasllama::sampling::SamplingParams;
use dasllama::sched::{EventKind, Finish, Nothink, PendingReq, PromptImage, SchedEvent, Scheduler};
use dasllama::session::{BatchWorkspace, Session};
use dasllama::spec::Drafter;
use dasllama::tokenizer::{Tokenizer, Utf8Stream, Vocab};
use dasllama::Error;
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::collections::HashMap;
use std::sync::Arc;

create_exception!(dasllama._native, DasllamaError, PyException, "Base of every dasllama error.");
create_exception!(dasllama._native, GgufError, DasllamaError, "The GGUF file is missing, malformed or truncated.");
create_exception!(
    dasllama._native,
    UnsupportedModelError,
    DasllamaError,
    "The model uses an architecture, tokenizer or tensor type dasllama does not implement."
);
create_exception!(dasllama._native, ContextOverflowError, DasllamaError, "A session would run past the model's context window.");
create_exception!(dasllama._native, KvPoolFullError, DasllamaError, "The paged KV pool has no free page: retry when streams finish, or use a bigger pool.");
create_exception!(
    dasllama._native,
    EngineError,
    DasllamaError,
    "A bug inside the engine (a caught panic). The call was abandoned; the model and other sessions are intact."
);

create_exception!(dasllama._native, DeviceError, DasllamaError, "The GPU device failed (lost mid-step, out of memory, or unusable); the call was abandoned.");

mod gpu;

fn map_err(e: Error) -> PyErr {
    match e {
        Error::Gguf(m) => GgufError::new_err(m),
        Error::UnsupportedModel(m) => UnsupportedModelError::new_err(m),
        Error::ContextOverflow(m) => ContextOverflowError::new_err(m),
        Error::InvalidArgument(m) => PyValueError::new_err(m),
        Error::PoolFull(m) => KvPoolFullError::new_err(m),
        Error::Internal(m) => EngineError::new_err(m),
        Error::Device(m) | Error::DeviceLost(m) => DeviceError::new_err(m),
        Error::Io(e) => DasllamaError::new_err(e.to_string()),
    }
}

/// Every call into the core goes through here: the GIL released, a panic turned into
/// `EngineError` naming `what`, and core errors mapped to their Python classes.
fn native<T: Send>(py: Python<'_>, what: &str, f: impl FnOnce() -> dasllama::Result<T> + Send) -> PyResult<T> {
    py.allow_threads(|| dasllama::error::catch(what, f)).map_err(map_err)
}

/// A metadata value as the Python loader passes it (numpy arrays and scalars made plain first).
#[derive(FromPyObject)]
enum PyMeta {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    List(Vec<PyMeta>),
}

impl From<PyMeta> for MetaValue {
    fn from(v: PyMeta) -> MetaValue {
        match v {
            PyMeta::Bool(b) => MetaValue::Bool(b),
            PyMeta::Int(i) => MetaValue::Int(i),
            PyMeta::Float(f) => MetaValue::Float(f),
            PyMeta::Str(s) => MetaValue::Str(s),
            PyMeta::List(l) => MetaValue::Array(l.into_iter().map(Into::into).collect()),
        }
    }
}

/// A loaded model. Shared, immutable: any number of sessions may use it.
#[pyclass(module = "dasllama._native", name = "Model", frozen)]
struct PyModel {
    inner: Arc<Model>,
    #[pyo3(get)]
    arch: String,
    #[pyo3(get)]
    path: String,
}

#[pymethods]
impl PyModel {
    /// Configuration as a dict (dim, embd_inp, n_layers, n_heads, ..., seq_len, vocab_size).
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.inner.config;
        let d = PyDict::new_bound(py);
        d.set_item("arch", &c.arch)?;
        d.set_item("dim", c.dim)?;
        // The values of an image's row (the input and Qwen3-VL's deepstack slices).
        d.set_item("embd_inp", c.embd_inp())?;
        d.set_item("hidden_dim", c.max_hidden())?;
        d.set_item("n_layers", c.n_layers)?;
        d.set_item("n_heads", c.n_heads)?;
        d.set_item("n_kv_heads", c.n_kv_heads)?;
        d.set_item("head_dim", c.head_dim)?;
        d.set_item("vocab_size", c.vocab_size)?;
        d.set_item("seq_len", c.seq_len)?;
        let attn: Vec<&Attention> = c
            .layers
            .iter()
            .filter_map(|l| match &l.mixer {
                Mixer::Attention(a) => Some(a),
                Mixer::DeltaNet(_) => None,
            })
            .collect();
        // Hybrids: how many layers keep a recurrent (DeltaNet) state instead of K/V.
        d.set_item("recurrent_layers", c.rec_layers().len())?;
        // MTP (NextN) blocks the file carries with their tensors (0: none, or not loaded).
        d.set_item("mtp_layers", usize::from(self.inner.mtp.is_some()))?;
        // The global layers' base; the widest window of the sliding ones (0: none slide).
        d.set_item("rope_freq_base", attn.iter().find(|a| a.window == 0).or(attn.first()).map_or(0.0, |a| a.rope.base))?;
        d.set_item("sliding_window", attn.iter().map(|a| a.window).max().unwrap_or(0))?;
        d.set_item("norm_eps", c.norm_eps)?;
        Ok(d)
    }

    #[getter]
    fn n_vocab(&self) -> usize {
        self.inner.tokenizer.n_vocab()
    }

    #[getter]
    fn bos_id(&self) -> Option<u32> {
        self.inner.tokenizer.bos()
    }

    #[getter]
    fn eos_id(&self) -> Option<u32> {
        self.inner.tokenizer.eos()
    }

    /// Ids that end a generation (eos and end-of-turn tokens).
    #[getter]
    fn eog_ids(&self) -> Vec<u32> {
        self.inner.tokenizer.eog_ids()
    }

    /// Text of a vocabulary entry as stored (for finding special tokens by name).
    fn token_text(&self, id: u32) -> PyResult<String> {
        check_id(&self.inner, id)?;
        Ok(self.inner.tokenizer.token_text(id).to_string())
    }

    fn token_type(&self, id: u32) -> PyResult<i32> {
        check_id(&self.inner, id)?;
        Ok(self.inner.tokenizer.token_type(id))
    }

    fn __repr__(&self) -> String {
        let c = &self.inner.config;
        format!("Model(arch={:?}, layers={}, dim={}, vocab={}, path={:?})", c.arch, c.n_layers, c.dim, c.vocab_size, self.path)
    }
}

fn check_id(m: &Model, id: u32) -> PyResult<()> {
    if (id as usize) < m.tokenizer.n_vocab() {
        Ok(())
    } else {
        Err(PyValueError::new_err(format!("token id {id} is out of range for a vocabulary of {}", m.tokenizer.n_vocab())))
    }
}

/// One conversation's state: KV store, logits, sampling RNG.
#[pyclass(module = "dasllama._native", name = "Session")]
struct PySession {
    model: Arc<Model>,
    inner: Session,
}

#[pymethods]
impl PySession {
    #[getter]
    fn n_past(&self) -> usize {
        self.inner.n_past()
    }

    /// The position the next row takes: n_past, unless an image on M-RoPE axes (Qwen-VL) took
    /// fewer positions than rows.
    #[getter]
    fn n_pos(&self) -> usize {
        self.inner.mrope_pos(self.inner.n_past())[0]
    }

    /// Seed this session's sampling RNG.
    fn set_seed(&mut self, seed: u64) {
        self.inner.record.reseed(seed);
    }

    /// Forget everything (KV, logits, penalty window).
    fn reset(&mut self) {
        self.inner.reset();
    }

    fn __repr__(&self) -> String {
        format!("Session(n_past={})", self.inner.n_past())
    }
}

/// A runtime: the thread team, page bin, scratch and settings its models run with (the Python
/// `dasllama.Runtime` builds it from its arguments and the environment).
#[pyclass(module = "dasllama._native", name = "Runtime", frozen)]
pub struct PyRuntime {
    inner: Arc<Runtime>,
}

#[pymethods]
impl PyRuntime {
    /// `threads` (0: one per physical core); `step_budget` in seconds (None: fixed chunks);
    /// `scalar`: the scalar twins for every kernel; `amx`: the AMX GEMM on (True), off (False) or
    /// as the process switches say (None).
    #[new]
    #[pyo3(signature = (threads, step_budget, scalar=false, amx=None))]
    fn new(threads: usize, step_budget: Option<f64>, scalar: bool, amx: Option<bool>) -> PyResult<Self> {
        if let Some(s) = step_budget.filter(|s| !(s.is_finite() && *s > 0.0)) {
            return Err(PyValueError::new_err(format!("step budget must be a positive, finite number of seconds (got {s}); pass None for fixed chunks")));
        }
        let kernels = switches::Choice { scalar, amx };
        Ok(PyRuntime { inner: Runtime::new(runtime::Config { threads, step_budget, kernels }) })
    }

    /// Whether its models' matmuls run the scalar twins.
    #[getter]
    fn scalar(&self) -> bool {
        self.inner.config().kernels.scalar
    }

    /// Whether its models' GEMMs run on Intel AMX, and why (or why not), in words.
    fn amx_status(&self) -> (bool, String) {
        dasllama::quant::amx::status_for(self.inner.config().kernels)
    }

    #[getter]
    fn threads(&self) -> usize {
        self.inner.cpu().threads()
    }

    #[getter]
    fn step_budget(&self) -> Option<f64> {
        self.inner.config().step_budget
    }

    /// Bytes of dropped K/V page buffers waiting in this runtime's bin for reuse.
    fn page_bin_bytes(&self) -> usize {
        self.inner.pages().bytes()
    }

    /// Test hook: the next kernel task on this runtime's thread team panics.
    #[cfg(feature = "fault-injection")]
    fn _inject_kernel_fault(&self) {
        self.inner.cpu().team().inject_fault();
    }

    fn __repr__(&self) -> String {
        format!("Runtime(threads={}, step_budget={:?})", self.inner.cpu().threads(), self.inner.config().step_budget)
    }
}

#[allow(clippy::too_many_arguments)]
#[pyfunction]
#[pyo3(signature = (rt, path, arch, meta, tensors, tokenizer_model, tokenizer_pre, tokens, token_types, scores, merges, bos, eos, eog, add_bos, add_space_prefix, quant, numerics="fast"))]
fn load_model(
    py: Python<'_>,
    rt: &PyRuntime,
    path: String,
    arch: String,
    meta: HashMap<String, PyMeta>,
    tensors: Vec<(String, u32, Vec<u64>, u64)>,
    tokenizer_model: String,
    tokenizer_pre: String,
    tokens: Vec<String>,
    token_types: Vec<i32>,
    scores: Vec<f32>,
    merges: Vec<String>,
    bos: Option<u32>,
    eos: Option<u32>,
    eog: Vec<u32>,
    add_bos: bool,
    add_space_prefix: bool,
    quant: &str,
    numerics: &str,
) -> PyResult<PyModel> {
    let quant = match quant {
        "native" => QuantMode::Native,
        "q8" => QuantMode::Q8,
        "fp32" => QuantMode::Fp32,
        other => return Err(PyValueError::new_err(format!("unknown quant mode '{other}' (use native, q8 or fp32)"))),
    };
    let numerics = match numerics {
        "fast" => Numerics::Fast,
        "ggml" => Numerics::Ggml,
        other => return Err(PyValueError::new_err(format!("unknown numerics '{other}' (use fast or ggml)"))),
    };
    let meta = Metadata::new(&arch, meta.into_iter().map(|(k, v)| (k, v.into())).collect());
    let tensors: Vec<TensorInfo> = tensors.into_iter().map(|(name, ty, shape, offset)| TensorInfo { name, ty, shape, offset }).collect();
    let model = native(py, "loading the model", || {
        let vocab = Vocab { tokens, types: token_types, scores, merges, bos, eos, eog, add_bos, add_space_prefix };
        let tok = Tokenizer::new(&tokenizer_model, &tokenizer_pre, vocab).map_err(|e| match e {
            Error::UnsupportedModel(m) | Error::Gguf(m) => Error::UnsupportedModel(format!("{path}: {m}")),
            other => other,
        })?;
        Model::load(&rt.inner, std::path::Path::new(&path), &arch, &meta, &tensors, tok, quant, numerics)
    })?;
    Ok(PyModel { inner: Arc::new(model), arch, path })
}

#[pyfunction]
#[pyo3(signature = (m, text, add_bos=None, special=false))]
fn encode(py: Python<'_>, m: &PyModel, text: &str, add_bos: Option<bool>, special: bool) -> PyResult<Vec<u32>> {
    let model = &m.inner;
    native(py, "encoding text", || Ok(model.tokenizer.encode(text, add_bos, special)))
}

#[pyfunction]
#[pyo3(signature = (m, ids, special=false))]
fn decode(py: Python<'_>, m: &PyModel, ids: Vec<u32>, special: bool) -> PyResult<String> {
    for &id in &ids {
        check_id(&m.inner, id)?;
    }
    let model = &m.inner;
    native(py, "decoding tokens", || Ok(String::from_utf8_lossy(&model.tokenizer.decode(&ids, special)).into_owned()))
}

/// The bytes a token stands for (a token may hold part of a UTF-8 character).
#[pyfunction]
#[pyo3(signature = (m, id, special=false))]
fn token_piece_bytes<'py>(py: Python<'py>, m: &PyModel, id: u32, special: bool) -> PyResult<Bound<'py, PyBytes>> {
    check_id(&m.inner, id)?;
    Ok(PyBytes::new_bound(py, &m.inner.tokenizer.piece(id, special)))
}

/// A paged KV pool: sessions created over it take fixed pages on demand.
#[pyclass(module = "dasllama._native", name = "KvPool", frozen)]
struct PyKvPool {
    model: Arc<Model>,
    inner: KvPool,
}

fn codec(name: &str) -> PyResult<KvCodec> {
    KvCodec::parse(name).ok_or_else(|| PyValueError::new_err(format!("unknown KV codec '{name}' (use f16, q8_0 or tq4)")))
}

#[pyfunction]
#[pyo3(signature = (m, page_rows, max_pages, kv_dtype="f16"))]
fn create_kv_pool(py: Python<'_>, m: &PyModel, page_rows: usize, max_pages: usize, kv_dtype: &str) -> PyResult<PyKvPool> {
    let geo = m.inner.kv_geometry(page_rows, codec(kv_dtype)?);
    let model = &m.inner;
    let inner = native(py, "create_kv_pool", || {
        model.check_kv(&geo)?;
        KvPool::new(geo, max_pages, 0, model.rt.pages())
    })?;
    Ok(PyKvPool { model: m.inner.clone(), inner })
}

#[pyfunction]
#[pyo3(signature = (m, pool=None))]
fn create_session(m: &PyModel, pool: Option<&PyKvPool>) -> PyResult<PySession> {
    let inner = match pool {
        Some(p) if !Arc::ptr_eq(&p.model, &m.inner) => return Err(PyValueError::new_err("this KV pool was created for a different model")),
        Some(p) => Session::paged(&m.inner, &p.inner).map_err(map_err)?,
        None => Session::new(&m.inner),
    };
    Ok(PySession { model: m.inner.clone(), inner })
}

/// Give a session's KV pages back to their pool; the session starts over at position 0.
#[pyfunction]
fn release_kv_pages(s: &mut PySession) {
    s.inner.reset();
}

fn stats_dict<'py>(py: Python<'py>, st: PoolStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new_bound(py);
    d.set_item("pages_total", st.pages_total)?;
    d.set_item("pages_free", st.pages_free)?;
    d.set_item("pages_used", st.pages_used)?;
    d.set_item("pages_shared", st.pages_shared)?;
    d.set_item("pages_cached", st.pages_cached)?;
    d.set_item("bytes_per_page", st.bytes_per_page)?;
    d.set_item("bytes_allocated", st.bytes_allocated)?;
    d.set_item("cache_chains", st.cache_chains)?;
    d.set_item("cache_hits", st.cache_hits)?;
    d.set_item("snapshots", st.snapshots)?;
    d.set_item("snapshot_bytes", st.snapshot_bytes)?;
    d.set_item("cache_stateless", st.cache_stateless)?;
    Ok(d)
}

/// Bytes one KV page of `page_rows` positions takes for this model.
#[pyfunction]
#[pyo3(signature = (m, page_rows, kv_dtype="f16"))]
fn kv_page_bytes(m: &PyModel, page_rows: usize, kv_dtype: &str) -> PyResult<usize> {
    Ok(m.inner.kv_geometry(page_rows, codec(kv_dtype)?).page_bytes())
}

#[pyfunction]
fn kv_pool_stats<'py>(py: Python<'py>, pool: &PyKvPool) -> PyResult<Bound<'py, PyDict>> {
    stats_dict(py, pool.inner.stats())
}

/// The scheduler's pool statistics, or None without a paged pool.
#[pyfunction]
fn scheduler_pool_stats<'py>(py: Python<'py>, sch: &PyScheduler) -> PyResult<Option<Bound<'py, PyDict>>> {
    sch.inner.pool().map(|p| stats_dict(py, p.stats())).transpose()
}

fn same_model(m: &PyModel, s: &PySession) -> PyResult<()> {
    if Arc::ptr_eq(&m.inner, &s.model) {
        Ok(())
    } else {
        Err(PyValueError::new_err("this session was created for a different model"))
    }
}

/// Run `ids` at the session's position; returns the float32 logits after the last id.
#[pyfunction]
fn eval<'py>(py: Python<'py>, m: &PyModel, s: &mut PySession, ids: Vec<u32>) -> PyResult<Bound<'py, PyArray1<f32>>> {
    same_model(m, s)?;
    let model = &m.inner;
    let sess = &mut s.inner;
    native(py, "eval", || sess.eval(model, &ids))?;
    Ok(PyArray1::from_slice_bound(py, &s.inner.logits))
}

/// Run `ids` at the session's position; returns a (len(ids), vocab) float32 array: row i holds
/// the logits after ids[i] (a speculative verify chunk's rows). The session keeps the last row.
#[pyfunction]
fn eval_all<'py>(py: Python<'py>, m: &PyModel, s: &mut PySession, ids: Vec<u32>) -> PyResult<Bound<'py, PyArray2<f32>>> {
    same_model(m, s)?;
    let model = &m.inner;
    let sess = &mut s.inner;
    let mut rows = Vec::new();
    native(py, "eval_all", || sess.eval_all(model, &ids, &mut rows))?;
    PyArray1::from_vec_bound(py, rows).reshape([ids.len(), model.config.vocab_size])
}

/// Run `ids` at the session's position with the rows `rows` taking `values` (a (len(rows), dim)
/// float32 array) instead of their tokens' embeddings, and each (first, count) of `spans` seeing
/// each other (an image's rows). Returns the logits after every row ((len(ids), vocab)) where
/// `all`, else after the last ((vocab,)).
#[allow(clippy::too_many_arguments)]
#[pyfunction]
#[pyo3(signature = (m, s, ids, rows, values, spans, all=false, grids=Vec::new()))]
fn eval_embeds<'py>(
    py: Python<'py>,
    m: &PyModel,
    s: &mut PySession,
    ids: Vec<u32>,
    rows: Vec<usize>,
    values: PyReadonlyArray2<'py, f32>,
    spans: Vec<(usize, usize)>,
    all: bool,
    grids: Vec<(usize, usize, usize)>,
) -> PyResult<Bound<'py, PyAny>> {
    same_model(m, s)?;
    let model = &m.inner;
    let sess = &mut s.inner;
    let vals = values.as_slice()?.to_vec();
    let mut out = Vec::new();
    // (first row of `ids`, tokens per row, rows) per image on M-RoPE axes, placed after the
    // session's rows.
    let base = sess.n_past();
    let grids: Vec<(usize, dasllama::kv::Grid)> = grids.into_iter().map(|(at, nx, ny)| (0, dasllama::kv::Grid { at: base + at, nx, ny })).collect();
    native(py, "eval_embeds", || {
        let inj = dasllama::model::forward::Injected { embeds: dasllama::backend::RowEmbeds { rows: &rows, values: &vals }, spans: &spans, grids: &grids };
        sess.eval_injected(model, &ids, inj, all, &mut out)
    })?;
    let v = model.config.vocab_size;
    if all {
        Ok(PyArray1::from_vec_bound(py, out).reshape([ids.len(), v])?.into_any())
    } else {
        Ok(PyArray1::from_vec_bound(py, out[out.len() - v..].to_vec()).into_any())
    }
}

/// One pooled vector per input (each its own sequence; all in one weight pass): (n, dim) float32.
#[pyfunction]
fn embed<'py>(py: Python<'py>, m: &PyModel, inputs: Vec<Vec<u32>>, pooling: &str, normalize: bool) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let pooling = Pooling::from_name(pooling).map_err(map_err)?;
    let model = &m.inner;
    let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
    let out = native(py, "embed", || dasllama::embed::embed(model, &refs, pooling, normalize))?;
    let d = model.config.dim;
    PyArray1::from_vec_bound(py, out.concat()).reshape([inputs.len(), d])
}

/// Scratch buffers for `eval_batch`, reused across steps.
#[pyclass(module = "dasllama._native", name = "BatchWorkspace")]
struct PyBatchWorkspace {
    model: Arc<Model>,
    inner: BatchWorkspace,
}

#[pyfunction]
fn create_batch_workspace(m: &PyModel) -> PyBatchWorkspace {
    PyBatchWorkspace { model: m.inner.clone(), inner: BatchWorkspace::default() }
}

/// Advance each session by one token in one pass over the weights; returns a (B, vocab) float32
/// array of logits, row i for sessions[i] (also left in each session for `sample`).
#[pyfunction]
fn eval_batch<'py>(
    py: Python<'py>,
    m: &PyModel,
    ws: &mut PyBatchWorkspace,
    sessions: Vec<Bound<'py, PySession>>,
    tokens: Vec<u32>,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    if !Arc::ptr_eq(&m.inner, &ws.model) {
        return Err(PyValueError::new_err("this workspace was created for a different model"));
    }
    let mut guards = Vec::with_capacity(sessions.len());
    for (i, s) in sessions.iter().enumerate() {
        let g = s
            .try_borrow_mut()
            .map_err(|_| PyValueError::new_err(format!("session {i} appears twice in the batch (or is in use elsewhere); pass each session once")))?;
        same_model(m, &g)?;
        guards.push(g);
    }
    let model = &m.inner;
    let mut refs: Vec<&mut Session> = guards.iter_mut().map(|g| &mut g.inner).collect();
    let work = &mut ws.inner;
    native(py, "eval_batch", || dasllama::session::eval_batch(model, work, &mut refs, &tokens))?;
    let v = model.config.vocab_size;
    let arr = PyArray1::from_slice_bound(py, &ws.inner.logits[..tokens.len() * v]);
    arr.reshape([tokens.len(), v])
}

#[allow(clippy::too_many_arguments)]
#[pyfunction]
#[pyo3(signature = (temp, top_k, top_p, min_p, penalty, presence_penalty, frequency_penalty, penalty_last_n, seed, logit_bias=Vec::new()))]
fn make_params(
    temp: f32,
    top_k: i64,
    top_p: f32,
    min_p: f32,
    penalty: f32,
    presence_penalty: f32,
    frequency_penalty: f32,
    penalty_last_n: i64,
    seed: Option<u64>,
    logit_bias: Vec<(u32, f32)>,
) -> PyResult<Params> {
    let p = SamplingParams { temp, top_k, top_p, min_p, penalty, presence_penalty, frequency_penalty, penalty_last_n, seed, logit_bias };
    p.validate().map_err(map_err)?;
    Ok(Params(p))
}

/// Validated sampling parameters (built by `dasllama.SamplingParams`).
#[pyclass(module = "dasllama._native", frozen)]
#[derive(Clone)]
struct Params(SamplingParams);

fn sample_next(py: Python<'_>, s: &mut Session, p: &SamplingParams) -> PyResult<u32> {
    if s.logits.is_empty() {
        return Err(PyValueError::new_err("the session has no logits yet: eval a prompt first"));
    }
    native(py, "sampling", || {
        let mut logits = std::mem::take(&mut s.logits);
        let tok = s.record.sample(&mut logits, p);
        s.logits = logits;
        Ok(tok)
    })
}

/// Sample the next token from the session's logits.
#[pyfunction]
fn sample(py: Python<'_>, s: &mut PySession, params: &Params) -> PyResult<u32> {
    if let Some(seed) = params.0.seed {
        if s.inner.record.is_empty() {
            s.inner.record.reseed(seed);
        }
    }
    sample_next(py, &mut s.inner, &params.0)
}

/// The tokens the sampler chain keeps from `logits` after `recent`, in the chain's order, and the
/// probabilities it would draw them with: `(ids, probs)`.
#[pyfunction]
fn sampler_candidates(logits: PyReadonlyArray1<'_, f32>, recent: Vec<u32>, params: &Params) -> PyResult<(Vec<u32>, Vec<f32>)> {
    let mut logits = logits.as_slice().map_err(|e| PyValueError::new_err(format!("logits: {e}")))?.to_vec();
    if logits.is_empty() {
        return Err(PyValueError::new_err("logits must not be empty"));
    }
    Ok(dasllama::sampling::candidates(&mut logits, &recent, &params.0).into_iter().unzip())
}

/// Prefill `ids`, then sample up to `max_new` tokens, stopping at end-of-generation.
/// `on_piece(id, text)` sees each token's text (never half a UTF-8 character); returning False stops.
#[pyfunction]
#[pyo3(signature = (m, s, ids, params, max_new, on_piece=None))]
fn generate(py: Python<'_>, m: &PyModel, s: &mut PySession, ids: Vec<u32>, params: &Params, max_new: i64, on_piece: Option<PyObject>) -> PyResult<Vec<u32>> {
    same_model(m, s)?;
    if max_new < 0 {
        return Err(PyValueError::new_err("max_new must be >= 0"));
    }
    if ids.is_empty() && s.inner.logits.is_empty() {
        return Err(PyValueError::new_err("generate needs a prompt (ids is empty and the session has no logits)"));
    }
    let model = &m.inner;
    if let Some(seed) = params.0.seed {
        s.inner.record.reseed(seed);
    }
    if !ids.is_empty() {
        let sess = &mut s.inner;
        native(py, "generate (prompt)", || sess.eval(model, &ids))?;
    }
    let mut out = Vec::new();
    let mut stream = Utf8Stream::default();
    while (out.len() as i64) < max_new {
        let tok = sample_next(py, &mut s.inner, &params.0)?;
        out.push(tok);
        let eog = model.tokenizer.is_eog(tok);
        if let Some(cb) = &on_piece {
            let mut text = stream.push(&model.tokenizer.piece(tok, false));
            if eog || out.len() as i64 == max_new {
                text.push_str(&stream.finish());
            }
            let keep = cb.call1(py, (tok, text))?;
            if !keep.is_none(py) && !keep.is_truthy(py)? {
                break;
            }
        }
        if eog || out.len() as i64 == max_new {
            break;
        }
        let sess = &mut s.inner;
        native(py, "generate (decode)", || sess.eval(model, &[tok]))?;
    }
    Ok(out)
}

/// The continuous-batching scheduler of one model.
#[pyclass(module = "dasllama._native", name = "Scheduler")]
struct PyScheduler {
    inner: Scheduler,
}

/// One scheduler event: a token's text (`kind == "piece"`) or the end of a request
/// (`kind == "finished"`, `finish` one of stop, length, evicted, error). Times in microseconds.
#[pyclass(module = "dasllama._native", name = "SchedEvent", frozen, get_all)]
struct PySchedEvent {
    /// The request's id (the tutorial's stream), as `id`.
    stream: i64,
    /// The slot the request ran in (-1 if it never left the queue).
    slot: i64,
    id: i64,
    kind: &'static str,
    token: i64,
    text: String,
    finish: &'static str,
    n_prompt: usize,
    n_gen: usize,
    n_cached: usize,
    ttft_us: u64,
    gen_us: u64,
    logprob: Option<f32>,
    top: Vec<(u32, f32)>,
    /// For finish == "error": the error's kind (e.g. "kv_pool_full", "internal") and message.
    error_type: Option<&'static str>,
    error: Option<String>,
}

#[pymethods]
impl PySchedEvent {
    fn __repr__(&self) -> String {
        match self.kind {
            "piece" => format!("SchedEvent(piece, id={}, slot={}, token={}, text={:?})", self.id, self.slot, self.token, self.text),
            "progress" => format!("SchedEvent(progress, id={}, {} of {} prompt rows, {} cached)", self.id, self.n_gen, self.n_prompt, self.n_cached),
            _ => format!(
                "SchedEvent(finished, id={}, finish={}, n_prompt={}, n_gen={}{})",
                self.id,
                self.finish,
                self.n_prompt,
                self.n_gen,
                self.error.as_ref().map_or(String::new(), |e| format!(", error={e:?}"))
            ),
        }
    }
}

impl From<SchedEvent> for PySchedEvent {
    fn from(e: SchedEvent) -> Self {
        let kind = match e.kind {
            EventKind::Piece => "piece",
            EventKind::Finished => "finished",
            EventKind::Progress => "progress",
        };
        let finish = match e.finish {
            Finish::None => "",
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Evicted => "evicted",
            Finish::Error => "error",
        };
        let (error_type, error) = e.error.map_or((None, None), |(k, m)| (Some(k), Some(m)));
        PySchedEvent {
            stream: e.id,
            slot: if e.stream == usize::MAX { -1 } else { e.stream as i64 },
            id: e.id,
            kind,
            token: e.token,
            text: e.text,
            finish,
            n_prompt: e.n_prompt,
            n_gen: e.n_gen,
            n_cached: e.n_cached,
            ttft_us: e.ttft_us,
            gen_us: e.gen_us,
            logprob: e.logprob,
            top: e.top,
            error_type,
            error,
        }
    }
}

fn check_sched(m: &PyModel, sch: &PyScheduler) -> PyResult<()> {
    if Arc::ptr_eq(&m.inner, sch.inner.model()) {
        Ok(())
    } else {
        Err(PyValueError::new_err("this scheduler was created for a different model"))
    }
}

/// What proposes drafts for speculative decoding; a scheduler created with one speculates.
#[pyclass(module = "dasllama._native", name = "Drafter", frozen)]
struct PyDrafter {
    inner: Drafter,
}

#[pymethods]
impl PyDrafter {
    /// "ngram" (prompt lookup), "draft" (a draft model) or "mtp" (an MTP head).
    #[getter]
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    #[getter]
    fn max_draft(&self) -> usize {
        self.inner.max_draft()
    }

    fn __repr__(&self) -> String {
        format!("Drafter({}, max_draft={})", self.inner.kind(), self.inner.max_draft())
    }
}

/// Prompt lookup over each stream's own tokens.
#[pyfunction]
fn ngram_drafter(max_draft: usize) -> PyResult<PyDrafter> {
    Ok(PyDrafter { inner: Drafter::ngram(max_draft).map_err(map_err)? })
}

/// A draft model for `m`: (drafter, "") or (None, why its vocabulary does not fit).
#[pyfunction]
fn model_drafter(m: &PyModel, draft: &PyModel, max_draft: usize) -> PyResult<(Option<PyDrafter>, String)> {
    Ok(match Drafter::model(&m.inner, draft.inner.clone(), max_draft).map_err(map_err)? {
        Ok(inner) => (Some(PyDrafter { inner }), String::new()),
        Err(why) => (None, why),
    })
}

/// The MTP head of `m`'s own file, as a drafter (None when the file has none).
#[pyfunction]
fn own_mtp_drafter(m: &PyModel, max_draft: usize) -> PyResult<Option<PyDrafter>> {
    match &m.inner.mtp {
        Some(head) => Ok(Some(PyDrafter { inner: Drafter::mtp(head.clone(), max_draft).map_err(map_err)? })),
        None => Ok(None),
    }
}

/// The MTP head in the sidecar `path` (its header as the Python loader read it) for `m`:
/// (drafter, "") or (None, why it does not fit).
#[allow(clippy::too_many_arguments)]
#[pyfunction]
fn sidecar_mtp_drafter(
    py: Python<'_>,
    m: &PyModel,
    path: String,
    arch: String,
    meta: HashMap<String, PyMeta>,
    tensors: Vec<(String, u32, Vec<u64>, u64)>,
    max_draft: usize,
) -> PyResult<(Option<PyDrafter>, String)> {
    let meta = Metadata::new(&arch, meta.into_iter().map(|(k, v)| (k, v.into())).collect());
    let tensors: Vec<TensorInfo> = tensors.into_iter().map(|(name, ty, shape, offset)| TensorInfo { name, ty, shape, offset }).collect();
    let target = m.inner.clone();
    if arch == "gemma4-assistant" {
        let asst = native(py, "loading a Gemma 4 assistant", || Assistant::sidecar(&target, std::path::Path::new(&path), &meta, &tensors))?;
        return Ok(match asst {
            Ok(a) => (Some(PyDrafter { inner: Drafter::assistant(a, max_draft).map_err(map_err)? }), String::new()),
            Err(why) => (None, why),
        });
    }
    let head = native(py, "loading an MTP sidecar", || MtpHead::sidecar(&target, std::path::Path::new(&path), &arch, &meta, &tensors))?;
    Ok(match head {
        Ok(head) => (Some(PyDrafter { inner: Drafter::mtp(head, max_draft).map_err(map_err)? }), String::new()),
        Err(why) => (None, why),
    })
}

/// The MTP head's logits over `ids` (rows x vocab): the trunk runs the ids, and row p of the
/// head pairs the trunk's hidden state at p with ids[p + 1], at position p (what its K/V holds
/// while drafting). For comparisons with llama.cpp.
#[pyfunction]
fn mtp_head_logits<'py>(py: Python<'py>, m: &PyModel, drafter: &PyDrafter, ids: Vec<u32>) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let Drafter::Mtp { head, .. } = &drafter.inner else {
        return Err(PyValueError::new_err(format!("this drafter is {}, not an MTP head", drafter.inner.kind())));
    };
    if ids.len() < 2 {
        return Err(PyValueError::new_err("the MTP head needs at least two ids: each row pairs a position with the token after it"));
    }
    let (model, head) = (m.inner.clone(), head.clone());
    let v = model.config.vocab_size;
    let logits = native(py, "running the MTP head", || {
        let mut ws = BatchWorkspace::default();
        ws.keep_hidden(true);
        let mut s = Session::new(&model);
        dasllama::session::eval_multi(&model, &mut ws, &mut [&mut s], &[ids.len()], &ids)?;
        let hidden = ws.take_hidden();
        let n = ids.len() - 1;
        let d = model.config.dim;
        let mut kv = head.new_kv(&model);
        let (mut logits, mut out) = (Vec::new(), Vec::new());
        let mut scratch = dasllama::model::mtp::MtpScratch::default();
        dasllama::model::mtp::forward(&model, &head, &mut [&mut kv], &[n], &ids[1..], &hidden[..n * d], LogitRows::All, &mut scratch, &mut logits, &mut out)?;
        Ok(logits)
    })?;
    let rows = logits.len() / v;
    PyArray1::from_vec_bound(py, logits).reshape([rows, v])
}

/// Gemma 4's assistant over `ids`: the target runs the ids, then the assistant drafts `k` rows
/// from there as the scheduler does (the first pairs ids' greedy next token, `first`, with the
/// target's hidden state at the last id; each next, the previous row's greedy token with the
/// assistant's own hidden state; all at position len(ids)). Rows x (vocab logits, then the
/// hidden state handed on). For comparisons with the float64 reference.
#[pyfunction]
fn assistant_rows<'py>(py: Python<'py>, m: &PyModel, drafter: &PyDrafter, ids: Vec<u32>, first: u32, k: usize) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let Drafter::Assistant { asst, .. } = &drafter.inner else {
        return Err(PyValueError::new_err(format!("this drafter is {}, not a Gemma 4 assistant", drafter.inner.kind())));
    };
    if ids.is_empty() || k == 0 {
        return Err(PyValueError::new_err("the assistant needs at least one id and one row"));
    }
    let (model, asst) = (m.inner.clone(), asst.clone());
    let (v, d) = (model.config.vocab_size, model.config.dim);
    let rows = native(py, "running the Gemma 4 assistant", || {
        let mut ws = BatchWorkspace::default();
        ws.keep_hidden(true);
        let mut s = Session::new(&model);
        dasllama::session::eval_multi(&model, &mut ws, &mut [&mut s], &[ids.len()], &ids)?;
        let hidden = ws.take_hidden();
        let mut state = hidden[hidden.len() - d..].to_vec();
        let mut tok = first;
        let mut scratch = dasllama::model::gemma4_assistant::AssistantScratch::default();
        let (mut logits, mut out, mut rows) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..k {
            dasllama::model::gemma4_assistant::step(&model, &asst, &mut [&mut s.kv], &[tok], &state, &mut scratch, &mut logits, &mut out)?;
            rows.extend_from_slice(&logits);
            rows.extend_from_slice(&out);
            tok = dasllama::sampling::argmax(&logits);
            state.clone_from(&out);
        }
        Ok(rows)
    })?;
    PyArray1::from_vec_bound(py, rows).reshape([k, v + d])
}

/// Per live stream: (request id, context tokens, positions its session holds, positions the MTP
/// head's K/V holds plus the hidden states waiting for it; -1 without a head). A test hook.
#[pyfunction]
fn scheduler_streams(sch: &PyScheduler) -> Vec<(i64, usize, usize, i64)> {
    sch.inner.stream_positions()
}

#[allow(clippy::too_many_arguments)]
#[pyfunction]
#[pyo3(signature = (m, max_streams, max_queue, chunk_tokens, page_rows, prefix_groups, kv_dtype="f16", drafter=None))]
fn create_scheduler(
    m: &PyModel,
    max_streams: usize,
    max_queue: usize,
    chunk_tokens: usize,
    page_rows: usize,
    prefix_groups: usize,
    kv_dtype: &str,
    drafter: Option<&PyDrafter>,
) -> PyResult<PyScheduler> {
    let mut inner = Scheduler::new(m.inner.clone(), max_streams, max_queue, chunk_tokens, page_rows, prefix_groups, codec(kv_dtype)?).map_err(map_err)?;
    inner.set_drafter(drafter.map(|d| d.inner.clone())).map_err(map_err)?;
    Ok(PyScheduler { inner })
}

/// One prompt image as `submit` takes it: (first prompt row, (rows, width) embeddings, whether
/// its rows see each other, its M-RoPE grid).
type SubmitImage<'py> = (usize, PyReadonlyArray2<'py, f32>, bool, Option<(usize, usize)>);

#[allow(clippy::too_many_arguments)]
#[pyfunction]
#[pyo3(signature = (m, sch, id, prompt, close_toks, stop_ids, params, max_new, seed, logprobs=None, ignore_eos=false, grammar=None, nothink=None, images=Vec::new(), progress=false))]
fn submit(
    py: Python<'_>,
    m: &PyModel,
    sch: &mut PyScheduler,
    id: i64,
    prompt: Vec<u32>,
    close_toks: Vec<u32>,
    stop_ids: Vec<u32>,
    params: &Params,
    max_new: i64,
    seed: u64,
    logprobs: Option<usize>,
    ignore_eos: bool,
    grammar: Option<String>,
    nothink: Option<(Vec<u32>, Vec<u32>)>,
    images: Vec<SubmitImage<'_>>,
    progress: bool,
) -> PyResult<bool> {
    check_sched(m, sch)?;
    // (first prompt row, (rows, width) float32 embeddings, whether its rows see each other, its
    // M-RoPE grid (tokens per row, rows) or None) per image.
    let images = images
        .into_iter()
        .map(|(at, v, non_causal, grid)| {
            let n = v.as_array().nrows();
            if grid.is_some_and(|(nx, ny)| nx * ny != n) {
                return Err(PyValueError::new_err(format!("request {id}: an image's M-RoPE grid {grid:?} does not hold its {n} rows")));
            }
            Ok(PromptImage { at, n, values: Arc::new(v.as_slice()?.to_vec()), non_causal, grid })
        })
        .collect::<PyResult<Vec<_>>>()?;
    if max_new < 1 {
        return Err(PyValueError::new_err(format!("request {id}: max_new must be at least 1")));
    }
    let nothink = nothink.map(|(open, close)| Nothink { open, close });
    let req = PendingReq {
        id,
        prompt,
        close_toks,
        stop_ids,
        params: params.0.clone(),
        max_new: max_new as usize,
        seed,
        logprobs,
        ignore_eos,
        grammar,
        nothink,
        images,
        progress,
    };
    let inner = &mut sch.inner;
    // Compiling a grammar takes milliseconds (the first one indexes the vocabulary: more).
    native(py, "submit", || inner.submit(req))
}

/// Compile `grammar` for `m` (indexing its vocabulary the first time), to refuse a bad one early
/// and to spend the indexing away from the engine thread.
#[pyfunction]
fn check_grammar(py: Python<'_>, m: &PyModel, grammar: &str) -> PyResult<()> {
    let model = &m.inner;
    native(py, "check_grammar", || model.grammar_env()?.compile(grammar).map(drop))
}

/// One tick; returns (work remains, events).
#[pyfunction]
fn scheduler_step(py: Python<'_>, m: &PyModel, sch: &mut PyScheduler) -> PyResult<(bool, Vec<PySchedEvent>)> {
    check_sched(m, sch)?;
    let inner = &mut sch.inner;
    let mut events = Vec::new();
    let more = native(py, "scheduler_step", || inner.step(&mut events))?;
    Ok((more, events.into_iter().map(PySchedEvent::from).collect()))
}

#[pyfunction]
fn evict(py: Python<'_>, m: &PyModel, sch: &mut PyScheduler, id: i64) -> PyResult<(bool, Vec<PySchedEvent>)> {
    check_sched(m, sch)?;
    let inner = &mut sch.inner;
    let mut events = Vec::new();
    let found = native(py, "evict", || Ok(inner.evict(id, &mut events)))?;
    Ok((found, events.into_iter().map(PySchedEvent::from).collect()))
}

/// Test hook: the next evaluation that includes request `id` fails inside the engine.
#[cfg(feature = "fault-injection")]
#[pyfunction]
fn _inject_stream_fault(sch: &mut PyScheduler, id: i64) -> bool {
    sch.inner.inject_fault(id)
}

/// Draft exactly `k` tokens per stream where the drafter can (None: adaptive).
#[pyfunction]
#[pyo3(signature = (sch, k=None))]
fn fix_draft_len(sch: &mut PyScheduler, k: Option<usize>) -> PyResult<()> {
    sch.inner.fix_draft_len(k).map_err(map_err)
}

/// Size each step's prefill so the step takes about `secs` (None: fixed chunks); returns the
/// budget in force, which stays None under ggml numerics.
#[pyfunction]
#[pyo3(signature = (sch, secs=None))]
fn set_step_budget(sch: &mut PyScheduler, secs: Option<f64>) -> PyResult<Option<f64>> {
    if let Some(s) = secs.filter(|s| !(s.is_finite() && *s > 0.0)) {
        return Err(PyValueError::new_err(format!("step budget must be a positive, finite number of seconds (got {s}); pass None for fixed chunks")));
    }
    sch.inner.set_step_budget(secs);
    Ok(sch.inner.step_budget())
}

#[pyfunction]
fn step_budget(sch: &PyScheduler) -> Option<f64> {
    sch.inner.step_budget()
}

/// Forget every page and recurrent-state snapshot the scheduler's prefix cache holds.
#[pyfunction]
fn clear_prefix_cache(sch: &mut PyScheduler) {
    sch.inner.clear_prefix_cache();
}

#[pyfunction]
fn scheduler_counts(sch: &PyScheduler) -> (usize, usize) {
    (sch.inner.n_active(), sch.inner.n_queued())
}

#[pyfunction]
fn scheduler_stats<'py>(py: Python<'py>, sch: &PyScheduler) -> PyResult<Bound<'py, PyDict>> {
    let s = &sch.inner.stats;
    let d = PyDict::new_bound(py);
    d.set_item("decode_steps", s.decode_steps)?;
    d.set_item("avg_batch", if s.decode_steps > 0 { s.decode_rows as f64 / s.decode_steps as f64 } else { 0.0 })?;
    d.set_item("prefill_chunks", s.prefill_chunks)?;
    d.set_item("prefill_tokens", s.prefill_tokens)?;
    d.set_item("cached_tokens", s.cached_tokens)?;
    d.set_item("finished", s.finished)?;
    d.set_item("avg_ttft_ms", if s.finished > 0 { s.ttft_us_sum as f64 / s.finished as f64 / 1000.0 } else { 0.0 })?;
    d.set_item("spec_verifies", s.spec_verifies)?;
    d.set_item("spec_drafted", s.spec_drafted)?;
    d.set_item("spec_accepted", s.spec_accepted)?;
    if let Some((a, b)) = sch.inner.pass_cost() {
        d.set_item("spec_pass_us", a * 1e6)?;
        d.set_item("spec_row_us", b * 1e6)?;
    }
    Ok(d)
}

/// Names of the architectures this build implements.
#[pyfunction]
fn arch_names() -> Vec<&'static str> {
    dasllama::model::arch_names()
}

/// Fix the kernel switches for this process, before any kernel runs (`dasllama.runtime` does,
/// from the DASLLAMA_NO_* variables, at import). Raises once a kernel has read other switches.
#[pyfunction]
#[pyo3(signature = (no_simd, no_avx512, no_vnni, no_amx, amx, amx_log, prefetch))]
fn configure_kernels(
    no_simd: bool,
    no_avx512: bool,
    no_vnni: bool,
    no_amx: bool,
    amx: Option<bool>,
    amx_log: bool,
    prefetch: Option<(usize, Option<u8>)>,
) -> PyResult<()> {
    let names = [("DASLLAMA_NO_SIMD", no_simd), ("DASLLAMA_NO_AVX512", no_avx512), ("DASLLAMA_NO_VNNI", no_vnni), ("DASLLAMA_NO_AMX", no_amx)];
    let set = names.iter().filter(|(_, on)| *on).map(|(n, _)| *n).collect();
    switches::set(Switches { no_simd, no_avx512, no_vnni, no_amx, amx, amx_log, prefetch, set }).map_err(|now| {
        PyValueError::new_err(format!("the kernel switches are fixed for this process once a kernel has run ({now:?}); set them before loading a model"))
    })
}

/// Whether the GEMM runs on Intel AMX in this process, and why (or why not), in words.
#[pyfunction]
fn amx_status() -> (bool, String) {
    let (on, why) = dasllama::quant::amx::status();
    (*on, why.clone())
}

/// A vision tower and projector loaded from an mmproj file (`dasllama::vision`).
#[pyclass(module = "dasllama._native", name = "Vision", frozen)]
pub(crate) struct PyVision {
    pub(crate) inner: Arc<dasllama::vision::Vision>,
    #[pyo3(get)]
    path: String,
}

#[pymethods]
impl PyVision {
    #[getter]
    fn projector_type(&self) -> String {
        self.inner.projector_type.clone()
    }

    #[getter]
    fn image_size(&self) -> usize {
        self.inner.config.image_size
    }

    #[getter]
    fn n_tokens(&self) -> usize {
        self.inner.n_tokens()
    }

    /// Values of each image row: the text width (times 1 + the deepstack mergers for Qwen3-VL,
    /// the model's `embd_inp`).
    #[getter]
    fn text_dim(&self) -> usize {
        self.inner.text_dim()
    }

    #[getter]
    fn patch_size(&self) -> usize {
        self.inner.config.patch_size
    }

    /// Patches per side of one output token.
    #[getter]
    fn merge(&self) -> usize {
        self.inner.merge()
    }

    /// Whether the tower takes any size (multiples of patch_size * merge) rather than image_size.
    #[getter]
    fn dynamic_size(&self) -> bool {
        self.inner.dynamic_size()
    }

    /// Whether an image's rows see each other in the text model.
    #[getter]
    fn non_causal(&self) -> bool {
        self.inner.non_causal()
    }

    /// Rows an image preprocessed to `width` x `height` pixels becomes.
    fn n_tokens_for(&self, width: usize, height: usize) -> usize {
        self.inner.n_tokens_for(width, height)
    }

    /// (tokens per row, rows) of an image preprocessed to `width` x `height` pixels where its
    /// rows take M-RoPE positions in the text model (Qwen-VL), else None.
    fn mrope_grid(&self, width: usize, height: usize) -> Option<(usize, usize)> {
        self.inner.mrope_grid(width, height)
    }

    #[getter]
    fn image_mean(&self) -> Vec<f32> {
        self.inner.config.image_mean.to_vec()
    }

    #[getter]
    fn image_std(&self) -> Vec<f32> {
        self.inner.config.image_std.to_vec()
    }

    fn __repr__(&self) -> String {
        let c = &self.inner.config;
        format!(
            "Vision(projector={:?}, image_size={}, layers={}, dim={}, tokens={}, path={:?})",
            self.inner.projector_type,
            c.image_size,
            c.n_layers,
            c.dim,
            self.inner.n_tokens(),
            self.path
        )
    }
}

/// Load an mmproj file's vision tower: `meta` holds its `clip.*` keys without the prefix.
#[pyfunction]
fn load_vision(py: Python<'_>, rt: &PyRuntime, path: String, meta: HashMap<String, PyMeta>, tensors: Vec<(String, u32, Vec<u64>, u64)>) -> PyResult<PyVision> {
    let meta = Metadata::new("clip", meta.into_iter().map(|(k, v)| (k, v.into())).collect());
    let tensors: Vec<TensorInfo> = tensors.into_iter().map(|(name, ty, shape, offset)| TensorInfo { name, ty, shape, offset }).collect();
    let v = native(py, "loading the vision tower", || dasllama::vision::Vision::load(&rt.inner, std::path::Path::new(&path), &meta, &tensors))?;
    Ok(PyVision { inner: Arc::new(v), path })
}

/// One image's embeddings from its preprocessed pixels (3 x height x width float32, planar;
/// both default to the tower's image_size): a (n_tokens, text_dim) float32 array.
#[pyfunction]
#[pyo3(signature = (v, pixels, width=None, height=None))]
fn encode_image<'py>(
    py: Python<'py>,
    v: &PyVision,
    pixels: PyReadonlyArray1<'py, f32>,
    width: Option<usize>,
    height: Option<usize>,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let px = pixels.as_slice()?.to_vec();
    let vision = v.inner.clone();
    let s = vision.config.image_size;
    let (w, h) = (width.unwrap_or(s), height.unwrap_or(s));
    let out = native(py, "encoding an image", || vision.encode(&px, w, h))?;
    PyArray1::from_vec_bound(py, out).reshape([v.inner.n_tokens_for(w, h), v.inner.text_dim()])
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("DasllamaError", py.get_type_bound::<DasllamaError>())?;
    m.add("GgufError", py.get_type_bound::<GgufError>())?;
    m.add("UnsupportedModelError", py.get_type_bound::<UnsupportedModelError>())?;
    m.add("ContextOverflowError", py.get_type_bound::<ContextOverflowError>())?;
    m.add("KvPoolFullError", py.get_type_bound::<KvPoolFullError>())?;
    m.add("EngineError", py.get_type_bound::<EngineError>())?;
    m.add_class::<PySchedEvent>()?;
    #[cfg(feature = "fault-injection")]
    {
        m.add_function(wrap_pyfunction!(_inject_stream_fault, m)?)?;
    }
    m.add_class::<PyRuntime>()?;
    m.add_function(wrap_pyfunction!(configure_kernels, m)?)?;
    m.add_class::<PyModel>()?;
    m.add_class::<PySession>()?;
    m.add_class::<Params>()?;
    m.add_function(wrap_pyfunction!(load_model, m)?)?;
    m.add_class::<PyVision>()?;
    m.add_function(wrap_pyfunction!(load_vision, m)?)?;
    m.add_function(wrap_pyfunction!(encode_image, m)?)?;
    m.add_function(wrap_pyfunction!(encode, m)?)?;
    m.add_function(wrap_pyfunction!(decode, m)?)?;
    m.add_function(wrap_pyfunction!(token_piece_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(create_session, m)?)?;
    m.add_class::<PyKvPool>()?;
    m.add_function(wrap_pyfunction!(create_kv_pool, m)?)?;
    m.add_function(wrap_pyfunction!(release_kv_pages, m)?)?;
    m.add_function(wrap_pyfunction!(kv_pool_stats, m)?)?;
    m.add_function(wrap_pyfunction!(kv_page_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(scheduler_pool_stats, m)?)?;
    m.add_function(wrap_pyfunction!(eval, m)?)?;
    m.add_function(wrap_pyfunction!(eval_all, m)?)?;
    m.add_function(wrap_pyfunction!(eval_embeds, m)?)?;
    m.add_class::<PyBatchWorkspace>()?;
    m.add_function(wrap_pyfunction!(create_batch_workspace, m)?)?;
    m.add_function(wrap_pyfunction!(eval_batch, m)?)?;
    m.add_function(wrap_pyfunction!(make_params, m)?)?;
    m.add_function(wrap_pyfunction!(sample, m)?)?;
    m.add_function(wrap_pyfunction!(sampler_candidates, m)?)?;
    m.add_function(wrap_pyfunction!(generate, m)?)?;
    m.add_class::<PyScheduler>()?;
    m.add_function(wrap_pyfunction!(create_scheduler, m)?)?;
    m.add_function(wrap_pyfunction!(ngram_drafter, m)?)?;
    m.add_function(wrap_pyfunction!(embed, m)?)?;
    m.add_function(wrap_pyfunction!(fix_draft_len, m)?)?;
    m.add_function(wrap_pyfunction!(model_drafter, m)?)?;
    m.add_function(wrap_pyfunction!(own_mtp_drafter, m)?)?;
    m.add_function(wrap_pyfunction!(sidecar_mtp_drafter, m)?)?;
    m.add_function(wrap_pyfunction!(mtp_head_logits, m)?)?;
    m.add_function(wrap_pyfunction!(assistant_rows, m)?)?;
    m.add_function(wrap_pyfunction!(scheduler_streams, m)?)?;
    m.add_class::<PyDrafter>()?;
    m.add_function(wrap_pyfunction!(submit, m)?)?;
    m.add_function(wrap_pyfunction!(check_grammar, m)?)?;
    m.add_function(wrap_pyfunction!(scheduler_step, m)?)?;
    m.add_function(wrap_pyfunction!(evict, m)?)?;
    m.add_function(wrap_pyfunction!(scheduler_counts, m)?)?;
    m.add_function(wrap_pyfunction!(set_step_budget, m)?)?;
    m.add_function(wrap_pyfunction!(step_budget, m)?)?;
    m.add_function(wrap_pyfunction!(scheduler_stats, m)?)?;
    m.add_function(wrap_pyfunction!(clear_prefix_cache, m)?)?;
    m.add_function(wrap_pyfunction!(arch_names, m)?)?;
    m.add_function(wrap_pyfunction!(amx_status, m)?)?;
    m.add("DeviceError", py.get_type_bound::<DeviceError>())?;
    gpu::register(m)?;
    Ok(())
}
