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

mod budget;

use crate::backend::Numerics;
use crate::backend::RowEmbeds;
use crate::constrain::{self, Constraint};
use crate::kv::{KvCodec, KvPool};
use crate::model::forward::{Injected, LogitRows};
use crate::model::{Ffn, Model};
use crate::sampling::{self, SamplingParams};
use crate::session::{eval_rows_with, BatchWorkspace, Session};
use crate::spec::policy::{self, Candidate, CostModel, Guard};
use crate::spec::{assistant, draft, mtp, ngram, Drafter, StreamSpec};
use crate::{error, Error, Result};
use budget::StepCost;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

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
    /// placeholder tokens there, and each image's rows go into one pass and see each other.
    pub images: Vec<PromptImage>,
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
}

/// Where a prefill piece of `k` prompt rows from `fed` may end: never inside an image (its rows
/// see each other, so they run in one pass): before the image where the piece reaches into it,
/// or at its end where the piece starts inside it.
fn image_cut(images: &[PromptImage], fed: usize, k: usize) -> usize {
    let end = fed + k;
    for im in images {
        let (a, e) = (im.at, im.at + im.n);
        if a < end && end < e {
            return if a > fed { a - fed } else { e - fed };
        }
    }
    k
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Piece,
    Finished,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// Not finished (a piece event).
    None,
    Stop,
    Length,
    Evicted,
    /// The stream failed alone (its KV could not grow, or the engine hit a bug evaluating it);
    /// the event's `error` says why. The other streams go on.
    Error,
}

#[derive(Clone, Debug)]
pub struct SchedEvent {
    pub stream: usize,
    pub id: i64,
    pub kind: EventKind,
    /// The sampled token (a piece's, or the stop token of a `Stop` finish); -1 if none.
    pub token: i64,
    pub text: String,
    pub finish: Finish,
    pub n_prompt: usize,
    pub n_gen: usize,
    pub n_cached: usize,
    pub ttft_us: u64,
    pub gen_us: u64,
    /// The sampled token's log-probability under the model (before sampling settings), and the
    /// top alternatives, when the request asked for them.
    pub logprob: Option<f32>,
    pub top: Vec<(u32, f32)>,
    /// For `Finish::Error`: the error's kind (`Error::kind`) and message.
    pub error: Option<(&'static str, String)>,
}

struct Stream {
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
    slots: Vec<Option<Stream>>,
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

/// The step budget: decoding streams' gap between tokens, and a long prompt gets what a step has
/// left (with nothing decoding, how long an arriving request waits to be admitted). `DASLLAMA_STEP_MS` overrides it (0: fixed chunks of `chunk_tokens`).
const STEP_BUDGET_S: f64 = 0.060;
/// A prefilling stream gets at least this many tokens a step, however full the step is already.
const MIN_CHUNK: usize = 16;
/// Until the step's cost is measured, chunks are at most this long.
const FIRST_CHUNK: usize = 64;
/// A hybrid's prefix cache keeps at most this many recurrent-state snapshots per stream.
const SNAPSHOTS_PER_STREAM: usize = 4;

fn default_step_budget() -> Option<f64> {
    match std::env::var("DASLLAMA_STEP_MS").ok().and_then(|v| v.trim().parse::<f64>().ok()) {
        Some(ms) if ms <= 0.0 => None,
        Some(ms) => Some(ms / 1000.0),
        None => Some(STEP_BUDGET_S),
    }
}

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
            let pool = KvPool::new(geo, 2 * max_streams * per_stream, prefix_groups)?;
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
            (if m.numerics == Numerics::Ggml { None } else { default_step_budget() }, StepCost::new(m), logit_weight(m));
        Ok(Scheduler {
            model,
            pool,
            slots: (0..max_streams).map(|_| None).collect(),
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

    /// Speculate with `drafter` from the next step on (None: stop). Streams drop what an earlier
    /// drafter kept for them.
    pub fn set_drafter(&mut self, drafter: Option<Drafter>) -> Result<()> {
        // A rejected draft is rolled back by truncating K/V, and a hybrid's DeltaNet state by
        // replaying the verify chunk's accepted rows (`kv::Journal`), which covers the last pass
        // only: a draft model runs a pass per draft, so a hybrid cannot be one.
        if let Some(Drafter::Model { draft, .. }) = &drafter {
            if draft.config.recurrent() {
                return Err(Error::InvalidArgument(
                    "this draft model has recurrent (DeltaNet) layers, whose state goes back only over its last pass, and a draft model takes one pass per draft; draft with an attention-only model, prompt lookup or an MTP head".into(),
                ));
            }
        }
        if drafter.is_some() && self.model.numerics == Numerics::Ggml {
            return Err(Error::InvalidArgument(
                "speculation needs numerics='fast': ggml's order sums a chunk's rows differently from single rows, so verified tokens could differ from plain decoding".into(),
            ));
        }
        for s in self.slots.iter_mut().flatten() {
            s.spec = drafter.as_ref().map_or_else(StreamSpec::default, |d| StreamSpec::new(d.bursty(), None));
        }
        // An MTP head reads the trunk's hidden state of every row (Gemma 4's assistant, the last).
        self.ws.keep_hidden(matches!(drafter, Some(Drafter::Mtp { .. } | Drafter::Assistant { .. })));
        let logit_weight = self.logit_weight;
        self.spec = drafter.map(|drafter| Speculation {
            drafter,
            fixed_k: None,
            logit_weight,
            target_cost: CostModel::default(),
            draft_cost: CostModel::default(),
            guard: Guard::default(),
            draft_ws: BatchWorkspace::default(),
            mtp_ws: Default::default(),
            assistant_ws: Default::default(),
        });
        Ok(())
    }

    /// Draft exactly `k` tokens wherever the drafter can (None: as the policy finds worth it).
    pub fn fix_draft_len(&mut self, k: Option<usize>) -> Result<()> {
        let sp =
            self.spec.as_mut().ok_or_else(|| Error::InvalidArgument("this scheduler has no drafter: create it with one to fix its draft length".into()))?;
        if let Some(k) = k {
            if k > sp.drafter.max_draft() {
                return Err(Error::InvalidArgument(format!("a draft length of {k} is past the drafter's max_draft of {}", sp.drafter.max_draft())));
            }
        }
        sp.fixed_k = k;
        Ok(())
    }

    /// The line fitted to this scheduler's passes, seconds = a + b * rows (None before the
    /// first pass, or without a drafter).
    pub fn pass_cost(&self) -> Option<(f64, f64)> {
        self.spec.as_ref().and_then(|s| s.target_cost.line())
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
            if regions < self.slots.len() {
                return Err(Error::InvalidArgument(format!(
                    "the device has {regions} K/V regions for {} streams; set_gpu_resident_regions({}) before the load, or make a scheduler with fewer streams",
                    self.slots.len(),
                    self.slots.len()
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

    /// A fresh device stream takes over the parked rows of the longest earlier conversation its
    /// prompt continues (one token short of the prompt, whose last token gives the first logits).
    fn adopt_parked(&mut self, i: usize) {
        let s = self.slots[i].as_mut().expect("prefilling stream");
        let limit = s.req.prompt.len() - 1;
        let best = self.parked.iter().enumerate().map(|(j, (toks, _))| (toks.iter().zip(&s.req.prompt[..limit]).take_while(|(a, b)| a == b).count(), j)).max();
        let Some((rows, j)) = best.filter(|&(rows, _)| rows > 0) else { return };
        let (_, claim) = self.parked.remove(j).expect("found above");
        let Some(dev) = s.session.dev.as_mut() else { return };
        if let Ok(true) = dev.adopt(claim, rows) {
            (s.cached, s.fed) = (rows, rows);
            s.in_kv = s.req.prompt[..rows].to_vec();
            self.stats.cached_tokens += rows as u64;
        }
    }

    /// Per live stream: (request id, context tokens, positions its session holds, positions
    /// the MTP head's K/V holds plus the trunk's hidden states waiting for it, or -1).
    pub fn stream_positions(&self) -> Vec<(i64, usize, usize, i64)> {
        let d = self.model.config.dim;
        self.slots
            .iter()
            .flatten()
            .map(|s| (s.req.id, s.in_kv.len(), s.session.n_past(), s.spec.mtp.as_ref().map_or(-1, |st| (st.kv.len() + st.pending.len() / d) as i64)))
            .collect()
    }

    pub fn n_active(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
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
        match self.slots.iter_mut().flatten().find(|s| s.req.id == id) {
            Some(s) => {
                s.session.fault = true;
                true
            }
            None => false,
        }
    }

    fn known(&self, id: i64) -> bool {
        self.queue.iter().any(|(r, _, _)| r.id == id) || self.slots.iter().flatten().any(|s| s.req.id == id)
    }

    /// Queue a request. Ok(false) when the queue is full; an error (and nothing queued) when the
    /// request cannot run at all.
    pub fn submit(&mut self, req: PendingReq) -> Result<bool> {
        let m = &*self.model;
        let bad = |msg: String| Err(Error::InvalidArgument(format!("request {}: {msg}", req.id)));
        if req.prompt.is_empty() {
            return bad("the prompt is empty".into());
        }
        if req.max_new < 1 {
            return bad("max_new must be at least 1".into());
        }
        if req.prompt.len() + 1 > self.ctx() {
            return Err(Error::ContextOverflow(format!(
                "request {}: the prompt has {} tokens but the context window is {}; shorten it",
                req.id,
                req.prompt.len(),
                self.ctx()
            )));
        }
        if let Some(&t) = req.prompt.iter().chain(&req.stop_ids).chain(&req.close_toks).find(|&&t| t as usize >= m.config.vocab_size) {
            return bad(format!("token id {t} is out of range for a vocabulary of {}", m.config.vocab_size));
        }
        req.params.validate()?;
        let mut after = 0;
        for im in &req.images {
            if im.n == 0 || im.at < after || im.at + im.n > req.prompt.len() || im.values.len() != im.n * m.config.dim {
                return bad(format!(
                    "an image's rows must be non-empty, in order, inside the prompt's {} rows, with {} values a row",
                    req.prompt.len(),
                    m.config.dim
                ));
            }
            after = im.at + im.n;
        }
        if !req.images.is_empty() && self.device_kv {
            return bad("image rows run over host K/V only for now; this scheduler keeps its K/V on the device".into());
        }
        if self.known(req.id) {
            return bad("this id is already queued or running; ids must be unique".into());
        }
        if self.queue.len() >= self.max_queue {
            return Ok(false);
        }
        let constraint = match &req.grammar {
            Some(g) => {
                let env = constrain::env_for(&self.model)?;
                Some(Box::new(env.compile(g).map_err(|e| Error::InvalidArgument(format!("request {}: {e}", req.id)))?))
            }
            None => None,
        };
        self.queue.push_back((req, Instant::now(), constraint));
        Ok(true)
    }

    /// Remove a request wherever it is; its stream (and KV) is freed at once.
    pub fn evict(&mut self, id: i64, events: &mut Vec<SchedEvent>) -> bool {
        if let Some(i) = self.queue.iter().position(|(r, _, _)| r.id == id) {
            let (req, _, _) = self.queue.remove(i).expect("index from position");
            events.push(finished_event(usize::MAX, &req, Finish::Evicted, -1, 0, 0, 0));
            self.stats.finished += 1;
            return true;
        }
        if let Some(slot) = self.slots.iter().position(|s| s.as_ref().is_some_and(|s| s.req.id == id)) {
            let s = self.slots[slot].take().expect("slot found above");
            events.push(self.finish_stream(slot, s, Finish::Evicted, -1));
            return true;
        }
        false
    }

    /// One tick: admit, then one pass that advances every decoding stream by a token and prefills
    /// at most `chunk_tokens` prompt tokens. Returns whether any request is still queued or running.
    /// A stream that cannot be evaluated ends alone with `Finish::Error`; the others go on.
    pub fn step(&mut self, events: &mut Vec<SchedEvent>) -> Result<bool> {
        let model = self.model.clone();
        let m = &*model;
        self.admit(m, events);
        let decoding: Vec<usize> = (0..self.slots.len()).filter(|&i| self.slots[i].as_ref().is_some_and(|s| s.next.is_some())).collect();
        let mut prefilling: Vec<usize> = (0..self.slots.len()).filter(|&i| self.slots[i].as_ref().is_some_and(|s| s.fed < s.req.prompt.len())).collect();
        prefilling.sort_by_key(|&i| self.slots[i].as_ref().map(|s| s.order));
        // A stream that has evaluated nothing yet attaches the longest cached prefix (one token
        // short of the prompt, so that its last token is evaluated and gives the first logits).
        // Looking until its first chunk, not only at admission, lets it find what streams admitted
        // with it have prefilled since (a shared system prompt).
        if self.device_kv {
            for &i in &prefilling {
                if self.slots[i].as_ref().is_some_and(|s| s.fed == 0) {
                    self.adopt_parked(i);
                }
            }
        }
        if let Some(pool) = self.pool.as_ref().filter(|_| !self.device_kv) {
            for &i in &prefilling {
                let s = self.slots[i].as_mut().expect("prefilling stream");
                // A hybrid's session takes the pages up to the deepest one that carries a
                // snapshot of its recurrent state, and that state (`KvPool::attach`).
                if s.fed == 0 {
                    let (got, matched) = pool.attach_matched(&mut s.session.kv, &s.req.prompt, s.req.prompt.len() - 1);
                    if matched > got && s.session.kv.recurrent() {
                        s.share_at = matched;
                    }
                    if got > 0 {
                        (s.cached, s.fed) = (got, got);
                        s.in_kv = s.req.prompt[..got].to_vec();
                        self.stats.cached_tokens += got as u64;
                    }
                }
            }
        }
        // (slot, token count) of this pass: decode rows first (with their drafts), then the
        // prefill chunk's pieces.
        let mut plan: Vec<(usize, usize)> = decoding.iter().map(|&i| (i, 1)).collect();
        let t_step = Instant::now();
        let drafted = self.draft(&decoding, &plan);
        for p in plan.iter_mut() {
            p.1 += self.slots[p.0].as_ref().expect("planned stream").spec.drafts.len();
        }
        self.plan_prefill(&prefilling, &mut plan);
        // Pages first, per stream: a stream the pool cannot grow fails alone, before the pass
        // (one that cannot grow for its drafts decodes without them).
        plan.retain_mut(|(i, k)| {
            let s = self.slots[*i].as_mut().expect("planned stream");
            if s.session.dev.is_some() {
                // A device region holds its whole context already.
                return true;
            }
            let mut res = s.session.kv.reserve(s.session.n_past() + *k);
            if res.is_err() && !s.spec.drafts.is_empty() {
                *k -= s.spec.drafts.len();
                s.spec.drafts.clear();
                res = s.session.kv.reserve(s.session.n_past() + *k);
            }
            match res {
                Ok(()) => true,
                Err(e) => {
                    let s = self.slots[*i].take().expect("planned stream");
                    events.push(self.fail_stream(*i, s, e));
                    false
                }
            }
        });
        if plan.is_empty() {
            return Ok(self.n_active() > 0 || !self.queue.is_empty());
        }
        let t_pass = Instant::now();
        let (pass_rows, pass_keys) = self.pass_size(&plan);
        let logits = match self.eval_plan(m, &plan) {
            Ok(()) => {
                self.step_cost.observe(pass_rows, pass_keys, t_pass.elapsed().as_secs_f64());
                // Verify rows are priced in decode passes, which read the weights for a few rows;
                // a prefill chunk's rows are compute-bound and cost more each, so they would
                // teach the cost model sizes that starve speculation.
                let decode_only = plan.iter().all(|&(i, _)| self.slots[i].as_ref().is_some_and(|s| s.next.is_some()));
                if let (Some(sp), true) = (&mut self.spec, decode_only) {
                    let rows = sp.pass_rows(plan.iter().map(|p| p.1).sum(), self.ws.logits.len() / m.config.vocab_size);
                    sp.target_cost.observe(rows, t_pass.elapsed().as_secs_f64());
                }
                std::mem::take(&mut self.ws.logits)
            }
            Err(_) => self.eval_isolated(m, &mut plan, events),
        };
        // Counted over the streams the pass advanced (a failed one has left the plan).
        let n_decoding = plan.iter().filter(|&&(i, _)| self.slots[i].as_ref().is_some_and(|s| s.next.is_some())).count();
        if n_decoding > 0 {
            self.stats.decode_steps += 1;
            self.stats.decode_rows += n_decoding as u64;
        }
        // The pass's logits in plan order (a verify chunk's k+1 rows, one row for the others);
        // taken out so streams can sample from them.
        let v = m.config.vocab_size;
        let mut prefilled = false;
        let mut r = 0;
        let mut emitted = 0;
        // The trunk's hidden states of the pass's rows, in plan order, for an MTP head.
        let hidden = self.ws.take_hidden();
        let d = m.config.dim;
        let hidden_ok = hidden.len() == plan.iter().map(|p| p.1).sum::<usize>() * d;
        let assist = matches!(self.spec.as_ref().map(|sp| &sp.drafter), Some(Drafter::Assistant { .. }));
        let mut hr = 0;
        for &(i, k) in plan.iter() {
            let hid = if hidden_ok { &hidden[hr * d..(hr + k) * d] } else { &[][..] };
            hr += k;
            let s = self.slots[i].as_mut().expect("planned stream");
            if let Some(t) = s.next.take() {
                s.in_kv.push(t);
                let before = s.in_kv.len() - 1;
                emitted += self.verify(m, i, &logits[r * v..(r + k) * v], events);
                r += k;
                if let Some(s) = self.slots[i].as_mut() {
                    // The rows the stream kept.
                    let kept = s.in_kv.len() - before;
                    if let Some(st) = &mut s.spec.mtp {
                        st.pending.extend_from_slice(&hid[..(kept * d).min(hid.len())]);
                    }
                    if assist {
                        // The last kept row's: the hidden state at the stream's last position.
                        s.spec.last_h.clear();
                        if kept > 0 && hid.len() >= kept * d {
                            s.spec.last_h.extend_from_slice(&hid[(kept - 1) * d..kept * d]);
                        }
                    }
                }
                continue;
            }
            if let Some(st) = &mut s.spec.mtp {
                st.pending.extend_from_slice(hid);
            }
            if assist {
                s.spec.last_h.clear();
                if k > 0 && hid.len() == k * d {
                    s.spec.last_h.extend_from_slice(&hid[(k - 1) * d..]);
                }
            }
            let row = &logits[r * v..(r + 1) * v];
            r += 1;
            prefilled = true;
            s.in_kv.extend_from_slice(&s.req.prompt[s.fed..s.fed + k]);
            s.fed += k;
            self.stats.prefill_tokens += k as u64;
            if s.fed == s.share_at && s.fed < s.req.prompt.len() {
                // The pass ended where the cached pages stopped having a state: give them one.
                s.share_at = 0;
                if let Some(pool) = self.pool.as_ref().filter(|_| !self.device_kv) {
                    pool.donate(&s.session.kv, &s.in_kv);
                }
            }
            if s.fed == s.req.prompt.len() {
                // Offer the prompt's full pages now, not only when the stream finishes, so that
                // the streams behind it with the same prefix skip it.
                if let Some(pool) = self.pool.as_ref().filter(|_| !self.device_kv) {
                    pool.donate(&s.session.kv, &s.in_kv);
                }
                self.sample_and_emit(m, i, row, events);
            }
        }
        self.ws.logits = logits;
        self.ws.put_hidden(hidden);
        if prefilled {
            self.stats.prefill_chunks += 1;
        }
        if let (Some(sp), false, true) = (&mut self.spec, prefilled, emitted > 0) {
            sp.guard.observe(drafted, emitted, t_step.elapsed().as_secs_f64());
        }
        Ok(self.n_active() > 0 || !self.queue.is_empty())
    }

    /// Add this step's prefill chunk to `plan` (which holds its decode rows): prompt tokens of
    /// the oldest admitted streams first, as many as the step budget leaves room for beside the
    /// decode rows by the measured cost of passes, at most `chunk_tokens` (and at least
    /// `MIN_CHUNK` for the first, so a prompt always advances).
    fn plan_prefill(&self, prefilling: &[usize], plan: &mut Vec<(usize, usize)>) {
        let (mut rows, mut keys) = self.pass_size(plan);
        // Seconds the pass may take; None: fixed chunks (no budget). Where the decode rows alone
        // overrun the budget, the prompt still gets half a budget a step: decoders wait that much
        // longer, and the prompt is not starved. With nothing decoding the budget holds too: a
        // step is when requests are admitted, so a short request arriving behind long prompts
        // waits one budget, not one long chunk.
        let (allow, mut left) = match self.step_budget {
            None => (None, self.chunk_tokens),
            Some(b) => match self.step_cost.predict(rows, keys) {
                Some(base) => (Some(b.max(base + b / 2.0)), self.chunk_tokens),
                // Nothing measured yet: a chunk of the old fixed size.
                None => (None, self.chunk_tokens.min(FIRST_CHUNK)),
            },
        };
        for &i in prefilling {
            if left == 0 {
                break;
            }
            let s = self.slots[i].as_ref().expect("prefilling stream");
            let (rest, depth) = ((s.req.prompt.len() - s.fed).min(left), s.session.n_past() as f64);
            // Rows and attended keys a piece of k tokens adds (and its one logit row).
            let size = |k: usize| (k as f64 + self.logit_weight, k as f64 * depth + (k * (k + 1) / 2) as f64);
            let k = match allow {
                None => rest,
                Some(allow) => {
                    let cost = |k: usize| {
                        let (r, kk) = size(k);
                        self.step_cost.predict(rows + r, keys + kk).unwrap_or(f64::INFINITY)
                    };
                    let k = budget::largest_within(rest, allow, cost);
                    // The first piece gets at least MIN_CHUNK tokens, so a prompt always advances.
                    if plan.iter().all(|p| self.slots[p.0].as_ref().is_some_and(|s| s.next.is_some())) {
                        k.max(MIN_CHUNK.min(rest))
                    } else {
                        k
                    }
                }
            };
            // A hybrid's piece that would cross its prompt's last page boundary, or the end of its
            // stateless match (`share_at`), stops there, so that the pass ends on it and the
            // session keeps the recurrent state there for the prefix cache (chunking does not
            // change the results: rows compute alike).
            let k = [self.snapshot_boundary(s), Some(s.share_at)]
                .into_iter()
                .flatten()
                .filter(|&b| s.fed < b && b < s.fed + k)
                .map(|b| b - s.fed)
                .fold(k, usize::min);
            // An image goes into one pass whole.
            let k = image_cut(&s.req.images, s.fed, k);
            if k == 0 {
                break;
            }
            plan.push((i, k));
            let (r, kk) = size(k);
            (rows, keys, left) = (rows + r, keys + kk, left.saturating_sub(k));
            if k < rest {
                break;
            }
        }
    }

    /// Where a hybrid stream's prompt prefill should end a pass: its last page boundary (None for
    /// attention-only models, or without a host prefix cache).
    fn snapshot_boundary(&self, s: &Stream) -> Option<usize> {
        let pool = self.host_pool()?;
        if !s.session.kv.recurrent() {
            return None;
        }
        let r = pool.geometry().page_rows;
        Some(s.req.prompt.len() / r * r)
    }

    /// Forget every page and recurrent-state snapshot the prefix cache holds: no later prompt
    /// attaches anything donated before.
    pub fn clear_prefix_cache(&mut self) {
        if let Some(p) = &self.pool {
            p.clear_cache();
        }
    }

    /// A pass's size as the step's cost model counts it: rows through the layers plus logit rows
    /// weighted (`logit_weight`), and the keys its rows attend. Every plan entry has one logit
    /// row except a decoding stream's verify chunk, which has one per row.
    fn pass_size(&self, plan: &[(usize, usize)]) -> (f64, f64) {
        let (mut rows, mut keys) = (0.0, 0.0);
        for &(i, k) in plan {
            let s = self.slots[i].as_ref().expect("planned stream");
            let logit_rows = if s.next.is_some() { k } else { 1 };
            let n = s.session.n_past();
            rows += k as f64 + self.logit_weight * logit_rows as f64;
            keys += (k * n + k * (k + 1) / 2) as f64;
        }
        (rows, keys)
    }

    /// Evaluate the planned streams' tokens in one pass; logits land in `self.ws.logits`: every
    /// row of a decoding stream (its next token, then its drafts), the last of a prefill chunk.
    fn eval_plan(&mut self, m: &Model, plan: &[(usize, usize)]) -> Result<()> {
        let mut tokens = Vec::with_capacity(plan.iter().map(|p| p.1).sum());
        let mut tails = Vec::with_capacity(plan.len());
        // Image rows of the prefill pieces: pass rows, their values, and each image's span.
        let (mut rows, mut values, mut spans) = (Vec::new(), Vec::new(), Vec::new());
        let d = m.config.dim;
        for &(i, k) in plan {
            let s = self.slots[i].as_ref().expect("planned stream");
            match s.next {
                Some(t) => {
                    tokens.push(t);
                    tokens.extend_from_slice(&s.spec.drafts);
                    tails.push(k);
                }
                None => {
                    let r0 = tokens.len();
                    for im in &s.req.images {
                        let (a, e) = (im.at.max(s.fed), (im.at + im.n).min(s.fed + k));
                        if a < e {
                            spans.push((r0 + a - s.fed, e - a));
                            rows.extend((a..e).map(|p| r0 + p - s.fed));
                            values.extend_from_slice(&im.values[(a - im.at) * d..(e - im.at) * d]);
                        }
                    }
                    tokens.extend_from_slice(&s.req.prompt[s.fed..s.fed + k]);
                    tails.push(1);
                }
            }
        }
        let mut by_slot: Vec<Option<&mut Session>> = self.slots.iter_mut().map(|s| s.as_mut().map(|s| &mut s.session)).collect();
        let mut sessions: Vec<&mut Session> = plan.iter().map(|&(i, _)| by_slot[i].take().expect("each slot planned once")).collect();
        let counts: Vec<usize> = plan.iter().map(|p| p.1).collect();
        let ws = &mut self.ws;
        let injected = (!rows.is_empty()).then(|| Injected { embeds: RowEmbeds { rows: &rows, values: &values }, spans: &spans });
        error::catch("a scheduler step", || eval_rows_with(m, ws, &mut sessions, &counts, &tokens, injected, LogitRows::Tail(&tails)))
    }

    /// The batched pass failed: find the streams at fault by running each alone (rows compute the
    /// same whatever the batch, and a failed pass committed no position, so the survivors' results
    /// are what the batch would have given). Failed streams end with an error and leave `plan`;
    /// returns the survivors' logits, in the new plan's order.
    fn eval_isolated(&mut self, m: &Model, plan: &mut Vec<(usize, usize)>, events: &mut Vec<SchedEvent>) -> Vec<f32> {
        let v = m.config.vocab_size;
        let mut logits = Vec::with_capacity(plan.len() * v);
        let mut kept = Vec::with_capacity(plan.len());
        for &(i, k) in plan.iter() {
            match self.eval_plan(m, &[(i, k)]) {
                Ok(()) => {
                    logits.extend_from_slice(&self.ws.logits);
                    kept.push((i, k));
                }
                Err(e) => {
                    let s = self.slots[i].take().expect("planned stream");
                    events.push(self.fail_stream(i, s, e));
                }
            }
        }
        *plan = kept;
        logits
    }

    fn admit(&mut self, m: &Model, events: &mut Vec<SchedEvent>) {
        if self.device_kv && m.resident().is_none() {
            // The model left the device (lost, or dropped): new streams keep their K/V on the host.
            self.device_kv = false;
            self.parked.clear();
        }
        for slot in 0..self.slots.len() {
            if self.slots[slot].is_some() {
                continue;
            }
            let Some((req, t_submit, constraint)) = self.queue.pop_front() else { break };
            self.admitted += 1;
            let session = match (&self.pool, self.device_kv) {
                (_, true) => Session::on_device(m),
                (Some(p), false) => Ok(Session::paged(m, p).expect("the pool was made for this model")),
                (None, false) => Ok(Session::new(m)),
            };
            let mut session = match session {
                Ok(s) => s,
                Err(e) => {
                    // No region (the device model left since set_device_kv): the request fails
                    // alone, with the reason.
                    let mut ev = finished_event(slot, &req, Finish::Error, -1, 0, 0, 0);
                    ev.error = Some((e.kind(), e.to_string()));
                    events.push(ev);
                    continue;
                }
            };
            session.record.reseed(req.seed);
            if self.pool.is_some() && !self.device_kv {
                // A hybrid's session keeps its recurrent state at the page boundaries its passes
                // end on, for the prefix cache (no-op for attention-only models).
                session.kv.keep_marks();
            }
            // The prefix cache is looked up in `step`, just before the stream's first chunk.
            self.slots[slot] = Some(Stream {
                in_kv: Vec::new(),
                cached: 0,
                share_at: 0,
                req,
                session,
                fed: 0,
                generated: 0,
                next: None,
                t_submit,
                t_first: None,
                order: self.admitted,
                spec: self.spec.as_ref().map_or_else(StreamSpec::default, |sp| StreamSpec::new(sp.drafter.bursty(), sp.new_mtp_stream(m))),
                constraint,
                seen_content: false,
                in_thought: false,
            });
        }
    }

    /// Propose this step's drafts for the decoding streams (`Stream::spec.drafts`), as many as
    /// the policy finds worth their rows in the pass `plan` makes without them.
    /// Whether any stream drafts.
    fn draft(&mut self, decoding: &[usize], plan: &[(usize, usize)]) -> bool {
        let ctx = self.ctx();
        let Some(sp) = self.spec.as_mut() else { return false };
        for &i in decoding {
            self.slots[i].as_mut().expect("decoding stream").spec.drafts.clear();
        }
        if !sp.guard.allow() && sp.fixed_k.is_none() {
            return false;
        }
        // Every plan entry has one logit row so far; each draft adds a row with logits.
        let row = 1.0 + sp.logit_weight;
        let rows = sp.pass_rows(plan.iter().map(|p| p.1).sum(), plan.len());
        // Nothing is known of this machine before the first pass: no drafts until it is measured.
        if sp.target_cost.line().is_none() {
            return false;
        }
        let max_draft = sp.drafter.max_draft();
        let (mut cands, mut who) = (Vec::new(), Vec::new());
        for &i in decoding {
            let s = self.slots[i].as_mut().expect("decoding stream");
            // A draft would be verified against unmasked rows: a constrained stream decodes plainly.
            if s.constraint.is_some() {
                continue;
            }
            // Never draft past max_new or the context: the verify chunk writes at in_kv.len()..
            let room = ctx.saturating_sub(s.in_kv.len() + 1);
            let mut cap = max_draft.min(s.req.max_new - s.generated - 1).min(room);
            match &sp.drafter {
                Drafter::Ngram { .. } => {
                    s.in_kv.push(s.next.expect("decoding stream"));
                    ngram::propose(&s.in_kv, cap, &mut s.spec.drafts);
                    s.in_kv.pop();
                    cap = s.spec.drafts.len();
                }
                Drafter::Model { draft, .. } => cap = cap.min(draft.config.seq_len.saturating_sub(s.in_kv.len() + 1)),
                Drafter::Mtp { .. } => {
                    if !s.spec.mtp.as_ref().is_some_and(|st| st.covers(s.in_kv.len(), self.model.config.dim)) {
                        cap = 0;
                    }
                }
                // The assistant reads the stream's K/V on the host, after its prompt.
                Drafter::Assistant { .. } => {
                    if self.device_kv || s.spec.last_h.len() != self.model.config.dim || s.in_kv.is_empty() {
                        cap = 0;
                    }
                }
            }
            // A hybrid's recurrent state on the device is updated in place: no rollback of rejected drafts.
            if self.device_kv && self.model.config.recurrent() {
                cap = 0;
            }
            if cap > 0 {
                let (first, alpha) = s.spec.acceptance();
                cands.push(Candidate { first, alpha, cap });
                who.push(i);
            }
        }
        if who.is_empty() {
            return false;
        }
        let (target_cost, draft_cost) = (&sp.target_cost, &sp.draft_cost);
        let target = |r: f64| target_cost.cost(r).expect("measured above");
        // Until the drafter's own passes are measured, guess: a draft model a quarter of the
        // target's cost, an MTP head (one block of the target's) a twentieth.
        let guess = match &sp.drafter {
            Drafter::Ngram { .. } => None,
            Drafter::Model { .. } => Some(4.0),
            Drafter::Mtp { .. } | Drafter::Assistant { .. } => Some(20.0),
        };
        let drafting = guess.map(|g| move |r: f64| draft_cost.cost(r).unwrap_or_else(|| target(r) / g));
        let ks = match sp.fixed_k {
            Some(k) => cands.iter().map(|c| c.cap.min(k)).collect(),
            None => {
                let mut ks = policy::choose(&cands, decoding.len(), rows, row, &target, drafting.as_ref().map(|d| d as &dyn Fn(f64) -> f64));
                policy::probe(&mut ks, &cands, sp.guard.step());
                ks
            }
        };
        for (&i, _) in who.iter().zip(&ks).filter(|p| *p.1 == 0) {
            self.slots[i].as_mut().expect("decoding stream").spec.idle();
        }
        let drafting = ks.iter().any(|&k| k > 0);
        if let Drafter::Mtp { head, .. } = &sp.drafter {
            let mut by_slot: Vec<Option<&mut Stream>> = self.slots.iter_mut().map(|s| s.as_mut()).collect();
            let mut streams: Vec<(&mut Stream, usize)> =
                who.iter().zip(&ks).filter(|p| *p.1 > 0).map(|(&i, &k)| (by_slot[i].take().expect("each stream once"), k)).collect();
            let t_draft = Instant::now();
            let d = self.model.config.dim;
            let draft_rows: usize = streams.iter().map(|(s, k)| k - 1 + s.spec.mtp.as_ref().map_or(0, |st| st.pending.len() / d)).sum();
            let mut jobs: Vec<mtp::Job<'_>> = streams
                .iter_mut()
                .map(|(s, k)| {
                    let Stream { spec, in_kv, next, .. } = &mut **s;
                    let StreamSpec { mtp, drafts, .. } = spec;
                    mtp::Job { state: mtp.as_mut().expect("checked in the candidates"), ctx: in_kv, next: next.expect("decoding stream"), k: *k, out: drafts }
                })
                .collect();
            let depth = jobs.iter().map(|j| j.k).max().unwrap_or(0);
            let (model, head, ws) = (&*self.model, &**head, &mut sp.mtp_ws);
            if error::catch("drafting with the MTP head", || mtp::propose(model, head, ws, &mut jobs)).is_ok() {
                sp.draft_cost.observe(draft_rows as f64 / depth.max(1) as f64, t_draft.elapsed().as_secs_f64() / depth.max(1) as f64);
                return drafting;
            }
            // A head that fails costs the streams their speculation, never their output.
            drop(jobs);
            for (s, _) in streams.iter_mut() {
                s.spec.drafts.clear();
                s.spec.mtp = None;
            }
            return false;
        }
        if let Drafter::Assistant { asst, .. } = &sp.drafter {
            let mut by_slot: Vec<Option<&mut Stream>> = self.slots.iter_mut().map(|s| s.as_mut()).collect();
            let mut streams: Vec<(&mut Stream, usize)> =
                who.iter().zip(&ks).filter(|p| *p.1 > 0).map(|(&i, &k)| (by_slot[i].take().expect("each stream once"), k)).collect();
            let t_draft = Instant::now();
            let draft_rows: usize = streams.iter().map(|(_, k)| *k).sum();
            let mut jobs: Vec<assistant::Job<'_>> = streams
                .iter_mut()
                .map(|(s, k)| {
                    let Stream { spec, session, next, .. } = &mut **s;
                    let StreamSpec { last_h, drafts, .. } = spec;
                    assistant::Job { kv: &mut session.kv, hidden: last_h, next: next.expect("decoding stream"), k: *k, out: drafts }
                })
                .collect();
            let depth = jobs.iter().map(|j| j.k).max().unwrap_or(0);
            let (model, asst, ws) = (&*self.model, &**asst, &mut sp.assistant_ws);
            if error::catch("drafting with the Gemma 4 assistant", || assistant::propose(model, asst, ws, &mut jobs)).is_ok() {
                sp.draft_cost.observe(draft_rows as f64 / depth.max(1) as f64, t_draft.elapsed().as_secs_f64() / depth.max(1) as f64);
                return drafting;
            }
            // An assistant that fails costs the streams their speculation, never their output.
            drop(jobs);
            for (s, _) in streams.iter_mut() {
                s.spec.drafts.clear();
                s.spec.last_h.clear();
            }
            return false;
        }
        let Drafter::Model { draft, .. } = &sp.drafter else {
            for (&i, &k) in who.iter().zip(&ks) {
                self.slots[i].as_mut().expect("decoding stream").spec.drafts.truncate(k);
            }
            return drafting;
        };
        // Each draft session holds a prefix of its stream's context: feed it the rest.
        let mut by_slot: Vec<Option<&mut Stream>> = self.slots.iter_mut().map(|s| s.as_mut()).collect();
        let mut streams: Vec<(&mut Stream, usize)> =
            who.iter().zip(&ks).filter(|p| *p.1 > 0).map(|(&i, &k)| (by_slot[i].take().expect("each stream once"), k)).collect();
        let mut feeds = Vec::with_capacity(streams.len());
        for (s, _) in streams.iter_mut() {
            let ds = s.spec.draft.get_or_insert_with(|| Session::new(draft));
            ds.kv.truncate(s.in_kv.len());
            let mut feed = s.in_kv[ds.n_past()..].to_vec();
            feed.push(s.next.expect("decoding stream"));
            feeds.push(feed);
        }
        let t_draft = Instant::now();
        let mut jobs: Vec<draft::Job<'_>> = streams
            .iter_mut()
            .zip(&feeds)
            .map(|((s, k), feed)| {
                let StreamSpec { draft, drafts, .. } = &mut s.spec;
                draft::Job { session: draft.as_mut().expect("made above"), feed, k: *k, out: drafts }
            })
            .collect();
        let depth = jobs.iter().map(|j| j.k).max().unwrap_or(0);
        let draft_rows: usize = jobs.iter().map(|j| j.k + j.feed.len() - 1).sum();
        let (dm, ws) = (&**draft, &mut sp.draft_ws);
        if error::catch("drafting", || draft::propose(dm, ws, &mut jobs)).is_ok() {
            sp.draft_cost.observe(draft_rows as f64 / depth.max(1) as f64, t_draft.elapsed().as_secs_f64() / depth.max(1) as f64);
        } else {
            // A draft model that fails costs the streams their speculation, never their output.
            drop(jobs);
            for (s, _) in streams.iter_mut() {
                s.spec.drafts.clear();
                s.spec.draft = None;
            }
            return false;
        }
        drafting
    }

    /// Take a decoding stream's tokens from its verify rows (`rows`: k+1 rows of logits, after
    /// its next token and after each draft): sample from each row in turn while the sampled token
    /// is the draft that row was fed; the first that is not, or the row after the last draft,
    /// gives the stream's next token. The KV keeps what was accepted. Returns the tokens emitted.
    fn verify(&mut self, m: &Model, i: usize, rows: &[f32], events: &mut Vec<SchedEvent>) -> usize {
        let v = m.config.vocab_size;
        let drafts = std::mem::take(&mut self.slots[i].as_mut().expect("decoding stream").spec.drafts);
        let (mut accepted, mut emitted) = (0, 0);
        for j in 0..=drafts.len() {
            if j > 0 {
                self.slots[i].as_mut().expect("decoding stream").in_kv.push(drafts[j - 1]);
            }
            emitted += 1;
            let Some(tok) = self.sample_and_emit(m, i, &rows[j * v..(j + 1) * v], events) else { break };
            if j < drafts.len() && tok == drafts[j] {
                accepted += 1;
                continue;
            }
            let s = self.slots[i].as_mut().expect("decoding stream");
            s.session.rewind(m, s.in_kv.len());
            if let Some(ds) = &mut s.spec.draft {
                ds.kv.truncate(s.in_kv.len());
            }
            if !drafts.is_empty() {
                s.spec.observe(drafts.len(), accepted);
            }
            break;
        }
        if !drafts.is_empty() {
            self.stats.spec_verifies += 1;
            self.stats.spec_drafted += drafts.len() as u64;
            self.stats.spec_accepted += accepted as u64;
        }
        if let Some(s) = self.slots[i].as_mut() {
            // Its buffer, for the next step's drafts.
            s.spec.drafts = drafts;
            s.spec.drafts.clear();
        }
        emitted
    }

    /// Sample from the stream's logits and emit its piece, or finish it; the token if the
    /// stream goes on. `row`: the stream's logits after its last token in `in_kv`.
    fn sample_and_emit(&mut self, m: &Model, i: usize, row: &[f32], events: &mut Vec<SchedEvent>) -> Option<u32> {
        let ctx = self.ctx();
        let s = self.slots[i].as_mut().expect("live stream");
        // Log-probabilities are the model's own, before penalties and sampling settings.
        let lp = s.req.logprobs.map(|k| log_softmax_top(row, k));
        let tok = if let Some(c) = s.constraint.as_mut() {
            let mut logits = std::mem::take(&mut s.session.logits);
            logits.clear();
            logits.extend_from_slice(row);
            let picked = c.mask(&mut logits).map(|()| {
                if sampling::is_plain_greedy(&s.req.params) {
                    let tok = sampling::argmax(&logits);
                    s.session.record.push(tok);
                    tok
                } else {
                    let tok = s.session.record.sample(&mut logits, &s.req.params);
                    if logits[tok as usize].is_finite() {
                        tok
                    } else {
                        // The draw's rounding fell past the last allowed token: take the likeliest.
                        s.session.record.rollback(1);
                        let tok = sampling::argmax(&logits);
                        s.session.record.push(tok);
                        tok
                    }
                }
            });
            s.session.logits = logits;
            match picked {
                Ok(tok) => tok,
                Err(e) => {
                    let s = self.slots[i].take().expect("live stream");
                    let ev = self.fail_stream(i, s, e);
                    events.push(ev);
                    return None;
                }
            }
        } else if sampling::is_plain_greedy(&s.req.params) {
            let tok = sampling::argmax(row);
            s.session.record.push(tok);
            tok
        } else {
            // Sampling rewrites its input: work on the session's own copy.
            let mut logits = std::mem::take(&mut s.session.logits);
            logits.clear();
            logits.extend_from_slice(row);
            let tok = s.session.record.sample(&mut logits, &s.req.params);
            s.session.logits = logits;
            tok
        };
        s.generated += 1;
        if s.t_first.is_none() {
            s.t_first = Some(Instant::now());
        }
        let marker = s.req.nothink.as_ref().map(|g| (g.open.contains(&tok), g.close.contains(&tok))).filter(|&(o, c)| o || c);
        if let (Some((open, _)), false) = (marker, s.seen_content) {
            s.in_thought = open;
        }
        let nothink_stop = marker.is_some() && s.seen_content;
        if (!s.req.ignore_eos && m.tokenizer.is_eog(tok)) || s.req.stop_ids.contains(&tok) || nothink_stop {
            let s = self.slots[i].take().expect("live stream");
            let ev = self.finish_stream(i, s, Finish::Stop, tok as i64);
            events.push(ev);
            return None;
        }
        // The grammar advances over what is emitted only; complete, it ends the stream.
        let complete = match s.constraint.as_mut().map(|c| c.advance(tok)) {
            None | Some(Ok(false)) => false,
            Some(Ok(true)) => true,
            Some(Err(e)) => {
                let s = self.slots[i].take().expect("live stream");
                let ev = self.fail_stream(i, s, e);
                events.push(ev);
                return None;
            }
        };
        let mut text = s.session.record.text(&m.tokenizer.piece(tok, false));
        if marker.is_none() && !s.in_thought && !text.trim().is_empty() {
            s.seen_content = true;
        }
        // The next decode step would evaluate `tok` at position n_past: stop where that would overflow.
        let done = complete || s.generated >= s.req.max_new || s.in_kv.len() >= ctx;
        if done {
            text.push_str(&s.session.record.finish_text());
        }
        events.push(SchedEvent {
            stream: i,
            id: s.req.id,
            kind: EventKind::Piece,
            token: tok as i64,
            text,
            finish: Finish::None,
            n_prompt: s.req.prompt.len(),
            n_gen: s.generated,
            n_cached: s.cached,
            ttft_us: 0,
            gen_us: 0,
            logprob: lp.as_ref().map(|(lse, _)| row[tok as usize] - lse),
            top: lp.map(|(_, top)| top).unwrap_or_default(),
            error: None,
        });
        if done {
            let s = self.slots[i].take().expect("live stream");
            let ev = self.finish_stream(i, s, if complete { Finish::Stop } else { Finish::Length }, -1);
            events.push(ev);
            None
        } else {
            s.next = Some(tok);
            Some(tok)
        }
    }

    /// End a stream that failed: its KV is dropped (not donated: it may hold rows of a failed
    /// pass), and the event carries the error.
    fn fail_stream(&mut self, slot: usize, s: Stream, e: Error) -> SchedEvent {
        let mut ev = self.finish_stream(slot, s, Finish::Error, -1);
        ev.error = Some((e.kind(), e.to_string()));
        ev
    }

    fn finish_stream(&mut self, slot: usize, mut s: Stream, finish: Finish, token: i64) -> SchedEvent {
        let m = &*self.model;
        // A stream that ends inside a verify chunk holds rows past what it emitted.
        s.session.rewind(m, s.in_kv.len());
        let ended_well = matches!(finish, Finish::Stop | Finish::Length);
        if s.session.dev.is_some() && ended_well {
            // Close the turn on the device and park the rows for the conversation's next turn.
            let close = s.req.close_toks.clone();
            let closed =
                close.is_empty() || (s.in_kv.len() + close.len() <= self.ctx() && error::catch("closing a turn", || s.session.eval(m, &close)).is_ok());
            if closed {
                s.in_kv.extend_from_slice(&close);
            }
            let dev = s.session.dev.as_mut().expect("a device stream");
            dev.truncate(s.in_kv.len());
            let claim = dev.park();
            if claim > 0 {
                self.parked.push_back((std::mem::take(&mut s.in_kv), claim));
                // Claims of regions taken since are stale anyway; keep the list short.
                while self.parked.len() > 4 * self.slots.len() {
                    self.parked.pop_front();
                }
            }
        }
        if let (Some(pool), true) = (self.pool.as_ref().filter(|_| !self.device_kv), ended_well) {
            // Close the turn in the KV (what the next turn's prompt will hold), then offer the
            // full pages. A close that does not fit the context is simply not donated.
            // A hybrid's close that crosses a page boundary runs in two passes split there, so the
            // session keeps its recurrent state at the boundary (`kv::RecSnapshot`).
            let close = s.req.close_toks.clone();
            let r = pool.geometry().page_rows;
            let at = s.in_kv.len();
            let split = if s.session.kv.recurrent() { ((at + close.len()) / r * r).saturating_sub(at).min(close.len()) } else { 0 };
            let closed = error::catch("closing a turn", || {
                for part in [&close[..split], &close[split..]] {
                    if !part.is_empty() {
                        s.session.eval(m, part)?;
                    }
                }
                Ok(())
            });
            if closed.is_ok() {
                s.in_kv.extend_from_slice(&close);
                pool.donate(&s.session.kv, &s.in_kv);
            }
        }
        s.session.reset();
        if let Some(pool) = self.host_pool() {
            pool.trim();
        }
        let now = Instant::now();
        let ttft = s.t_first.map_or(0, |t| (t - s.t_submit).as_micros() as u64);
        let gen = s.t_first.map_or(0, |t| (now - t).as_micros() as u64);
        self.stats.finished += 1;
        self.stats.ttft_us_sum += ttft;
        let mut ev = finished_event(slot, &s.req, finish, token, s.generated, ttft, gen);
        ev.n_cached = s.cached;
        ev
    }
}

impl Speculation {
    /// A new stream's MTP state, when the drafter is an MTP head.
    fn new_mtp_stream(&self, m: &Model) -> Option<mtp::MtpStream> {
        match &self.drafter {
            Drafter::Mtp { head, .. } => Some(mtp::MtpStream::new(m, head)),
            _ => None,
        }
    }

    /// A pass's size as its cost model counts it: its rows, plus its logit rows weighted.
    fn pass_rows(&self, rows: usize, logit_rows: usize) -> f64 {
        rows as f64 + self.logit_weight * logit_rows as f64
    }
}

/// Multiply-adds of one row's logits over those of one row through the layers.
fn logit_weight(m: &Model) -> f64 {
    (m.config.vocab_size * m.config.dim) as f64 / body_macs(m).max(1.0)
}

/// Weight multiply-adds of one row through the layers.
fn body_macs(m: &Model) -> f64 {
    let c = &m.config;
    let attn = c.dim * (c.q_dim() + 2 * c.kv_dim()) + c.q_dim() * c.dim;
    let body: usize = c
        .layers
        .iter()
        .map(|l| {
            attn + match l.ffn {
                Ffn::Dense { hidden, .. } => 3 * c.dim * hidden,
                // A row runs the router, its chosen experts and the shared one.
                Ffn::Moe { n_expert, n_used, hidden, shared, shared_gated, .. } => {
                    c.dim * n_expert + n_used * 3 * c.dim * hidden + shared.map_or(0, |s| 3 * c.dim * s + if shared_gated { c.dim } else { 0 })
                }
                // The dense GLU, the router and the chosen experts.
                Ffn::DenseMoe { hidden, n_expert, n_used, expert_hidden, .. } => 3 * c.dim * hidden + c.dim * n_expert + n_used * 3 * c.dim * expert_hidden,
            }
        })
        .sum();
    body as f64
}

fn finished_event(stream: usize, req: &PendingReq, finish: Finish, token: i64, n_gen: usize, ttft_us: u64, gen_us: u64) -> SchedEvent {
    SchedEvent {
        stream,
        id: req.id,
        kind: EventKind::Finished,
        token,
        text: String::new(),
        finish,
        n_prompt: req.prompt.len(),
        n_gen,
        n_cached: 0,
        ttft_us,
        gen_us,
        logprob: None,
        top: Vec::new(),
        error: None,
    }
}

/// log-sum-exp of the logits and the `k` most likely tokens with their log-probabilities.
fn log_softmax_top(logits: &[f32], k: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let lse = max + logits.iter().map(|&l| ((l - max) as f64).exp()).sum::<f64>().ln() as f32;
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(idx.len());
    if k > 0 {
        idx.select_nth_unstable_by(k - 1, |&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    }
    let mut top: Vec<(u32, f32)> = idx[..k].iter().map(|&t| (t, logits[t as usize] - lse)).collect();
    top.sort_by(|a, b| b.1.total_cmp(&a.1));
    (lse, top)
}
