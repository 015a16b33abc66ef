//! The runtime: one value that owns what the engine keeps between calls and would otherwise keep
//! process-wide. Models hold it (`Model::rt`), and sessions, pools and schedulers reach it through
//! their model, so two runtimes in one process (two servers, two models with their own thread
//! counts) share nothing mutable: each has its own
//! - CPU backend (`cpu::Cpu`): the thread team the forward pass runs on, the rayon pool for
//!   load-time work, the arena the tiled weights live in, and the kernels they run
//!   (`quant::switches::Choice`: the scalar twins or the vector kernels, AMX on or off, within
//!   what the process switches allow; its weights are laid out at load for them);
//! - bin of dropped K/V page buffers (`kv::PageBin`), which its pools and private caches reuse;
//! - scratch for single-session evaluations (`backend::Scratch`);
//! - configuration, parsed once at the edge (the Python bindings read the environment and the
//!   caller's arguments; nothing below them reads the environment).
//!
//! What stays process-wide, and why (`grep -rn static rust/dasllama/src`):
//! - the process's kernel switches and CPU-feature detection (`quant::switches::get`,
//!   `quant::avx2::process_avx2` and the other `has_*` caches, `quant::amx::status`, the prefetch
//!   distances): set once before the first kernel runs and read-only after; they bound what a
//!   runtime may choose. A runtime's own choice travels on its threads (`switches::with`);
//! - `cpu::ops`' f16 table (computed once, read-only) and the architecture registry (a constant);
//! - `Model::uid`'s counter: unique over the process, so the prefix cache can never mistake one
//!   model's pages for another's, whichever runtimes they belong to;
//! - thread-local scratch of the attention and DeltaNet kernels: per thread, so never shared,
//!   and a team's worker threads belong to that team alone.
//!
//! A model's grammar environment (`Model::grammar_env`) lives with its model, not here: it is
//! keyed by the model anyway, and goes when the model goes.

use crate::backend::{Host, Scratch};
use crate::cpu::Cpu;
use crate::kv::PageBin;
use crate::quant::switches::Choice;
use std::sync::{Arc, Mutex, MutexGuard};

/// The scheduler's default step budget: decoding streams' gap between tokens, and what a long
/// prompt's chunk gets of a step (with nothing decoding, how long an arriving request waits).
pub const STEP_BUDGET_S: f64 = 0.060;

/// A runtime's settings. The Python side builds it from `dasllama.Runtime(...)`'s arguments and
/// the `DASLLAMA_*` environment (`python/dasllama/runtime.py`).
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Threads of the CPU backend (0: one per physical core).
    pub threads: usize,
    /// Each scheduler step's time budget in seconds (None: fixed prefill chunks of
    /// `chunk_tokens`).
    pub step_budget: Option<f64>,
    /// The kernels its models run (the default: the process's).
    pub kernels: Choice,
}

impl Default for Config {
    fn default() -> Config {
        Config { threads: 0, step_budget: Some(STEP_BUDGET_S), kernels: Choice::default() }
    }
}

pub struct Runtime {
    config: Config,
    cpu: Cpu,
    pages: Arc<PageBin>,
    scratch: Mutex<Scratch>,
}

impl Runtime {
    pub fn new(config: Config) -> Arc<Runtime> {
        Arc::new(Runtime { cpu: Cpu::with_kernels(config.threads, config.kernels), config, pages: PageBin::new(), scratch: Mutex::new(Scratch::new()) })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The host backend every pass over host rows runs on.
    pub fn host(&self) -> &dyn Host {
        &self.cpu
    }

    pub fn cpu(&self) -> &Cpu {
        &self.cpu
    }

    /// The bin its K/V pools and private caches recycle page buffers through.
    pub fn pages(&self) -> &Arc<PageBin> {
        &self.pages
    }

    /// The forward pass's scratch for single-session evals. Passes take turns on the runtime's
    /// thread team anyway, so one set of buffers serves every session of every model it holds,
    /// and a new session's first prompt does not fault in fresh memory.
    pub fn scratch(&self) -> MutexGuard<'_, Scratch> {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }
}
