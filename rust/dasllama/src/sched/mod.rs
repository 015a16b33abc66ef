//! The continuous-batching scheduler: requests wait as token lists (no KV), are admitted FIFO into
//! free streams, and every `step` advances every decoding stream by one token and prefills at most
//! ONE chunk of prompt tokens (from the oldest admitted streams), all in ONE pass over the
//! weights, so a long prompt delays the others by one chunk, never by its whole length. The chunk
//! is sized by a time budget for the step (`budget`: the step's measured cost beside its decode
//! rows), at most `chunk_tokens`; under ggml numerics (whose sums depend on how a prompt is
//! chunked) it is `chunk_tokens`.
//! Rows are computed with the same arithmetic whatever the batch, so a request's output does not
//! depend on what else runs beside it.
//!
//! With a drafter (`set_drafter`), decoding streams speculate: each proposes up to k tokens and
//! its decode row becomes a verify chunk of k+1 rows in the same pass (`spec`); how many each
//! proposes follows the measured cost of the pass's rows (`spec::policy`).

mod admission;
mod budget;
mod emit;
mod plan;
mod speculate;
mod step;
#[cfg(test)]
mod tests;

use crate::backend::Numerics;
use crate::constrain::Constraint;
use crate::kv::{KvCodec, KvPool};
use crate::model::Model;
use crate::sampling::SamplingParams;
use crate::session::{BatchWorkspace, Session};
use crate::spec::policy::{CostModel, Guard};
use crate::spec::{Drafter, StreamSpec};
use crate::{Error, Result};
use budget::StepCost;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

pub use emit::{EventKind, Finish, SchedEvent};

/// A request: everything needed to run it, and no KV.
#[derive(Clone, Debug)]
pub struct PendingReq {
    pub id: i64,
    pub prompt: Vec<u32>,
    /// Tokens that close the turn after the reply (kept for the prefix cache).
    pub close_toks: Vec<u32>,
    /// Tokens that end the stream (besides the model's end-of-generation tokens); not emitted.
    pub stop_ids: Vec<u32>,
    pub params: SamplingParams,
    pub max_new: usize,
    pub seed: u64,
    /// Report each sampled token's log-probability and this many alternatives (None: off).
    pub logprobs: Option<usize>,
    /// Keep going past end-of-generation tokens until `max_new` (benchmarks send this).
    pub ignore_eos: bool,
    /// Constrain the output to this llguidance grammar (`constrain::GrammarEnv::compile`): every
    /// token is sampled from those the grammar allows next, the stream stops when the grammar is
    /// complete, and it never speculates. None: unconstrained.
    pub grammar: Option<String>,
    /// The thinking-off guard of a non-thinking turn (`make_nothink_guard`): None for a turn
    /// that may think, or a template that cannot.
    pub nothink: Option<Nothink>,
    /// Images in the prompt, in order: their rows take the images' embeddings instead of the
    /// placeholder tokens there; a non-causal image's rows go into one pass and see each other.
    pub images: Vec<PromptImage>,
    /// Report the prefill's progress: a `Progress` event before its first chunk and after each.
    pub progress: bool,
}

/// An image's rows in a prompt (`PendingReq::images`): prompt rows `at..at + n` take `values`
/// (n rows of the model's width). The placeholder tokens at those rows key the prefix cache, so
/// the caller derives them from the image (a hash of it), and a later turn about the same image
/// attaches its pages.
#[derive(Clone, Debug)]
pub struct PromptImage {
    pub at: usize,
    pub n: usize,
    pub values: std::sync::Arc<Vec<f32>>,
    /// The rows see each other (Gemma 3's images); otherwise they are causal as text (Pixtral's).
    pub non_causal: bool,
    /// Tokens per row and rows where the image takes M-RoPE positions (Qwen-VL: `kv::Grid`).
    pub grid: Option<(usize, usize)>,
}

/// Where a prefill piece of `k` prompt rows from `fed` may end: never inside a non-causal image
/// (its rows see each other, so they run in one pass): before the image where the piece reaches
/// into it, or at its end where the piece starts inside it (`forward::span_cut`).
fn image_cut(images: &[PromptImage], fed: usize, k: usize) -> usize {
    crate::model::forward::span_cut(images.iter().filter(|im| im.non_causal).map(|im| (im.at, im.n)), fed, k, true)
}

/// The channel markers of a thinking template (Qwen3's `<think>` and `</think>`), for a turn
/// rendered with thinking off. A marker before the reply's first content is a leading thought:
/// it is emitted, and the reply's reader splits it off. A marker after content ends the stream
/// (a stop, the marker not emitted): the model has started to think where it was told not to.
#[derive(Clone, Debug, Default)]
pub struct Nothink {
    pub open: Vec<u32>,
    pub close: Vec<u32>,
}

struct Stream {
    /// The stream's number (what events name it by): the free slot it took at admission.
    slot: usize,
    /// Finished during this step (its event is out and its K/V given back): the step drops it
    /// when it ends, and nothing in the step touches it after.
    ended: bool,
    req: PendingReq,
    session: Session,
    /// Tokens whose K/V the session holds, in order (for donating pages to the prefix cache).
    in_kv: Vec<u32>,
    /// Prompt positions that came from the prefix cache.
    cached: usize,
    /// A hybrid's prompt matched cached pages up to here with no recurrent-state snapshot past
    /// `cached`: its prefill ends a pass here and offers the state, for the next prompt with this
    /// prefix (a shared system prompt). 0: none.
    share_at: usize,
    /// Prompt tokens already evaluated.
    fed: usize,
    generated: usize,
    /// The last sampled token, to be fed by the next decode step.
    next: Option<u32>,
    t_submit: Instant,
    t_first: Option<Instant>,
    /// Admission order: prefill chunks go to the oldest admitted stream first.
    order: u64,
    spec: StreamSpec,
    constraint: Option<Box<Constraint>>,
    /// For the nothink guard: whether the reply has shown content (text outside a thought that is
    /// not only whitespace), and whether it is inside a leading thought.
    seen_content: bool,
    in_thought: bool,
}

#[derive(Clone, Debug, Default)]
pub struct SchedStats {
    pub decode_steps: u64,
    /// Sum over decode steps of the streams each advanced (average batch = this / decode_steps).
    pub decode_rows: u64,
    pub prefill_chunks: u64,
    pub prefill_tokens: u64,
    pub cached_tokens: u64,
    pub finished: u64,
    pub ttft_us_sum: u64,
    /// Speculation: verify chunks run, drafts proposed in them, drafts accepted.
    pub spec_verifies: u64,
    pub spec_drafted: u64,
    pub spec_accepted: u64,
}

/// The scheduler's speculation: its drafter and what its passes cost.
struct Speculation {
    drafter: Drafter,
    /// What a row's logits cost beside the row itself (the vocabulary matmul against the layers'):
    /// a verify row has logits, a prefill row does not, so passes are measured in rows weighted so.
    logit_weight: f64,
    /// Draft this many tokens wherever a drafter can, instead of the policy's choice (measuring
    /// the cost of k+1 rows, tests that need rejections).
    fixed_k: Option<usize>,
    target_cost: CostModel,
    draft_cost: CostModel,
    guard: Guard,
    draft_ws: BatchWorkspace,
    mtp_ws: crate::model::mtp::MtpScratch,
    assistant_ws: crate::model::gemma4_assistant::AssistantScratch,
}

pub struct Scheduler {
    model: Arc<Model>,
    /// With page_rows > 0: the paged pool and its prefix cache.
    pool: Option<KvPool>,
    /// The live streams, in slot order. A step takes them out whole (`step`), so nothing in it
    /// looks a stream up by a slot that might be empty.
    streams: Vec<Stream>,
    /// Streams at most (slots `0..max_streams`).
    max_streams: usize,
    /// Waiting requests, with their grammars compiled at submission.
    queue: VecDeque<(PendingReq, Instant, Option<Box<Constraint>>)>,
    max_queue: usize,
    chunk_tokens: usize,
    ws: BatchWorkspace,
    admitted: u64,
    spec: Option<Speculation>,
    /// Streams keep their K/V in device regions (`set_device_kv`): a finished conversation parks
    /// its rows on the device and its next turn adopts them.
    device_kv: bool,
    /// Parked conversations, oldest first: the tokens whose rows a claim names.
    parked: VecDeque<(Vec<u32>, u64)>,
    /// Seconds a step should take (None: fixed `chunk_tokens` chunks).
    step_budget: Option<f64>,
    step_cost: StepCost,
    /// What a logit row costs beside a row through the layers (`logit_weight`).
    logit_weight: f64,
    pub stats: SchedStats,
}

/// A prefilling stream gets at least this many tokens a step, however full the step is already,
/// so that a budget too small for any piece still lets the prompt advance. Kept small: deep in a
/// long prompt a row's attention makes it dear, and a floor of 16 there had held every step over
/// the budget (SmolLM2 135M, 8 decoders, a 3,775-token prompt, 60 ms: steps of 75-88 ms from
/// depth 2,800 on, 16 rows each; the budget's half for the prompt, `plan_prefill`, already keeps
/// it from starving).
const MIN_CHUNK: usize = 4;
/// Until the step's cost is measured, chunks are at most this long.
const FIRST_CHUNK: usize = 64;
/// A hybrid's prefix cache keeps at most this many recurrent-state snapshots per stream.
const SNAPSHOTS_PER_STREAM: usize = 4;

impl Scheduler {
    /// `page_rows > 0` gives the streams a paged pool with a prefix cache of at most
    /// `prefix_groups` pages (0: as many as the pool has room for).
    pub fn new(
        model: Arc<Model>,
        max_streams: usize,
        max_queue: usize,
        chunk_tokens: usize,
        page_rows: usize,
        prefix_groups: usize,
        codec: KvCodec,
    ) -> Result<Self> {
        if max_streams == 0 || chunk_tokens == 0 {
            return Err(Error::InvalidArgument("max_streams and chunk_tokens must be at least 1".into()));
        }
        let m = &*model;
        let pool = if page_rows > 0 {
            let per_stream = m.config.seq_len.div_ceil(page_rows);
            // Room for every stream's whole context plus as much again for the cache; pages are
            // only allocated when written, so this bounds memory rather than reserving it.
            let geo = m.kv_geometry(page_rows, codec);
            m.check_kv(&geo)?;
            let pool = KvPool::new(geo, 2 * max_streams * per_stream, prefix_groups, m.rt.pages())?;
            if m.config.recurrent() {
                // A hybrid's cached pages are of use only with a snapshot of its recurrent state
                // (`kv::RecSnapshot`), each as big as a session's state: a few per stream (a
                // conversation's last turn and its prompt's end), at most.
                pool.keep_snapshots(SNAPSHOTS_PER_STREAM * max_streams);
            }
            Some(pool)
        } else if codec != KvCodec::F16 {
            return Err(Error::InvalidArgument("a KV codec other than f16 needs the paged pool (page_rows > 0)".into()));
        } else {
            None
        };
        let (step_budget, step_cost, logit_weight) =
            (if m.numerics == Numerics::Ggml { None } else { m.rt.config().step_budget }, StepCost::new(m), plan::logit_weight(m));
        Ok(Scheduler {
            model,
            pool,
            streams: Vec::with_capacity(max_streams),
            max_streams,
            queue: VecDeque::new(),
            max_queue,
            chunk_tokens,
            ws: BatchWorkspace::default(),
            admitted: 0,
            spec: None,
            device_kv: false,
            parked: VecDeque::new(),
            step_budget,
            step_cost,
            logit_weight,
            stats: SchedStats::default(),
        })
    }

    /// Size prefill chunks so that a step takes about `secs` (None: fixed
    /// chunks of `chunk_tokens`). Under ggml numerics chunks stay fixed whatever is asked, since
    /// there a prompt's results depend on how it is chunked.
    pub fn set_step_budget(&mut self, secs: Option<f64>) {
        self.step_budget = secs.filter(|&s| s > 0.0 && self.model.numerics != Numerics::Ggml);
    }

    /// The step budget in force, in seconds (None: fixed chunks).
    pub fn step_budget(&self) -> Option<f64> {
        self.step_budget
    }

    /// Keep every stream's K/V on the device that holds the model (or back in host memory). Only
    /// an idle scheduler switches, and only on when the device has a region for every stream.
    pub fn set_device_kv(&mut self, on: bool) -> Result<()> {
        if on == self.device_kv {
            return Ok(());
        }
        if self.n_active() > 0 || !self.queue.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "set_device_kv switches an idle scheduler only; {} streams are live and {} requests queued: drain it first",
                self.n_active(),
                self.queue.len()
            )));
        }
        if on {
            let Some(p) = self.model.resident() else {
                let why = self.model.placement().map_or_else(|| "it is on no device".to_string(), |p| p.status().reason);
                return Err(Error::InvalidArgument(format!("the model is not held whole by a device: {why}")));
            };
            let regions = p.status().regions;
            if regions < self.max_streams {
                return Err(Error::InvalidArgument(format!(
                    "the device has {regions} K/V regions for {} streams; set_gpu_resident_regions({}) before the load, or make a scheduler with fewer streams",
                    self.max_streams, self.max_streams
                )));
            }
        }
        self.device_kv = on;
        self.parked.clear();
        Ok(())
    }

    pub fn device_kv(&self) -> bool {
        self.device_kv
    }

    /// The pool and prefix cache of host-home streams (none while streams live on the device).
    fn host_pool(&self) -> Option<&KvPool> {
        self.pool.as_ref().filter(|_| !self.device_kv)
    }

    /// Positions a stream may hold: the model's context, or a device region's.
    fn ctx(&self) -> usize {
        match self.model.resident().filter(|_| self.device_kv) {
            Some(p) => p.status().session_ctx.min(self.model.config.seq_len),
            None => self.model.config.seq_len,
        }
    }

    /// Per live stream: (request id, context tokens, positions its session holds, positions
    /// the MTP head's K/V holds plus the trunk's hidden states waiting for it, or -1).
    pub fn stream_positions(&self) -> Vec<(i64, usize, usize, i64)> {
        let d = self.model.config.dim;
        self.streams
            .iter()
            .map(|s| (s.req.id, s.in_kv.len(), s.session.n_past(), s.spec.mtp.as_ref().map_or(-1, |st| (st.kv.len() + st.pending.len() / d) as i64)))
            .collect()
    }

    pub fn n_active(&self) -> usize {
        self.streams.len()
    }

    pub fn n_queued(&self) -> usize {
        self.queue.len()
    }

    pub fn pool(&self) -> Option<&KvPool> {
        self.pool.as_ref()
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Make the next evaluation that includes request `id` fail inside the engine (a test hook
    /// for the failure paths). False if no such request runs.
    #[cfg(feature = "fault-injection")]
    pub fn inject_fault(&mut self, id: i64) -> bool {
        match self.streams.iter_mut().find(|s| s.req.id == id) {
            Some(s) => {
                s.session.fault = true;
                true
            }
            None => false,
        }
    }

    /// Forget every page and recurrent-state snapshot the prefix cache holds: no later prompt
    /// attaches anything donated before.
    pub fn clear_prefix_cache(&mut self) {
        if let Some(p) = &self.pool {
            p.clear_cache();
        }
    }
}
