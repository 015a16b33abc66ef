//! Sessions: one conversation's KV store, position, logits, sampling state.

use crate::backend::DevKv;
pub use crate::kv::KvCache;
use crate::kv::{KvCodec, KvPool, PRIVATE_PAGE_ROWS};
use crate::model::forward::{forward_batch_with, Injected, LogitRows, Scratch, Span};
use crate::model::Model;
use crate::record::TokenRecord;
use crate::{Error, Result};

pub struct Session {
    /// Host K/V (empty for a device-home session).
    pub kv: KvCache,
    /// A device-home session's K/V region (its model's placement): set, every eval runs on the
    /// device.
    pub dev: Option<DevKv>,
    pub logits: Vec<f32>,
    /// What this session sampled, with the sampler state to take it back.
    pub record: TokenRecord,
    /// Test hook (`Scheduler::inject_fault`): every evaluation including this session panics in
    /// a kernel task, as a bug would.
    #[cfg(feature = "fault-injection")]
    pub fault: bool,
}

impl Session {
    /// A session with a private KV store.
    pub fn new(m: &Model) -> Self {
        Self::with_kv(m, KvCache::private(m.kv_geometry(PRIVATE_PAGE_ROWS, KvCodec::F16), m.rt.pages()))
    }

    /// A session whose KV pages come from `pool`.
    pub fn paged(m: &Model, pool: &KvPool) -> Result<Self> {
        m.check_kv(&pool.geometry())?;
        Ok(Self::with_kv(m, KvCache::paged(pool).owned_by(m.uid)))
    }

    /// A hybrid's session keeps its DeltaNet layers' recurrent state beside its K/V pages.
    fn with_kv(m: &Model, kv: KvCache) -> Self {
        let kv = kv.with_recurrent(m.config.rec_layers().iter().map(|d| (d.conv_state(), d.ssm_state())).collect());
        Session {
            kv,
            dev: None,
            logits: Vec::new(),
            record: TokenRecord::new(crate::sampling::DEFAULT_SEED),
            #[cfg(feature = "fault-injection")]
            fault: false,
        }
    }

    /// A device-home session: its K/V in a region of the device that holds `m` (the driver
    /// serves no recurrent model, so there is no state to keep beside it). Its host cache, filled
    /// only when the session is hydrated, takes the device's codec, so hydrating loses nothing.
    pub fn on_device(m: &Model) -> Result<Self> {
        let p = m.placement().ok_or_else(|| {
            Error::InvalidArgument(
                "this model is not on the device; place it on one first (load_model(..., device=\"vulkan\"), or arm the GPU tier before the load: gpu_tier_status() says why not)".into(),
            )
        })?;
        // A placement that cannot hold device K/V (the per-op rails, a lost device) says why.
        let dev = p.create_kv()?;
        let codec = p.status().codec.unwrap_or(KvCodec::F16);
        let mut s = Self::with_kv(m, KvCache::private(m.kv_geometry(PRIVATE_PAGE_ROWS, codec), m.rt.pages()));
        s.dev = Some(dev);
        Ok(s)
    }

    pub fn n_past(&self) -> usize {
        self.dev.as_ref().map_or(self.kv.len(), DevKv::len)
    }

    /// Row `row`'s position on the M-RoPE axes, as the images recorded where its K/V lives place it.
    pub fn mrope_pos(&self, row: usize) -> [usize; 3] {
        self.dev.as_ref().map_or(self.kv.grids(), DevKv::grids).pos(row)
    }

    /// Go back to position `pos`, wherever the K/V lives: K/V past it is forgotten, and a
    /// hybrid's recurrent state replayed over the rows of its last pass it keeps (a hybrid goes
    /// back no further than the start of its last pass: `KvCache::rewind_floor`).
    pub fn rewind(&mut self, m: &Model, pos: usize) {
        if let Some(d) = &mut self.dev {
            d.truncate(pos);
        }
        // A device session of a split model keeps its later layers' rows here (elsewhere a
        // device session's host cache is empty).
        crate::model::forward::rewind(m, &mut self.kv, pos);
    }

    /// Run `tokens` at the current position; logits after the last one land in `self.logits`.
    pub fn eval(&mut self, m: &Model, tokens: &[u32]) -> Result<()> {
        self.eval_rows(m, tokens, LogitRows::Last)
    }

    /// Run `tokens` and put the logits after every one of them in `rows` (row i after token i):
    /// what a speculative verify chunk needs. Row i equals what evaluating the tokens one at a
    /// time gives after token i. The session keeps the last row, as after `eval`.
    pub fn eval_all(&mut self, m: &Model, tokens: &[u32], rows: &mut Vec<f32>) -> Result<()> {
        run(m, &mut [self], &[tokens.len()], tokens, None, LogitRows::All, &mut m.rt.scratch(), rows)?;
        self.logits.clear();
        self.logits.extend_from_slice(&rows[rows.len() - m.config.vocab_size..]);
        Ok(())
    }

    /// Run `tokens` with some rows' inputs given (`Injected`: an image's embeddings in place of
    /// its placeholder tokens, its rows seeing each other). Logits after every row land in
    /// `rows` where `all`, else after the last only; the session keeps the last row's either way.
    pub fn eval_injected(&mut self, m: &Model, tokens: &[u32], inj: Injected<'_>, all: bool, rows: &mut Vec<f32>) -> Result<()> {
        let want = if all { LogitRows::All } else { LogitRows::Last };
        run(m, &mut [self], &[tokens.len()], tokens, Some(inj), want, &mut m.rt.scratch(), rows)?;
        self.logits.clear();
        self.logits.extend_from_slice(&rows[rows.len() - m.config.vocab_size..]);
        Ok(())
    }

    fn eval_rows(&mut self, m: &Model, tokens: &[u32], want: LogitRows<'_>) -> Result<()> {
        let mut logits = std::mem::take(&mut self.logits);
        let r = run(m, &mut [self], &[tokens.len()], tokens, None, want, &mut m.rt.scratch(), &mut logits);
        self.logits = logits;
        r
    }

    /// Forget everything (KV, logits, penalty window); the KV pages go back to their pool.
    pub fn reset(&mut self) {
        self.kv.release();
        if let Some(d) = &mut self.dev {
            d.reset();
        }
        self.record.clear();
        self.logits.clear();
    }
}

/// Scratch for `eval_batch`, reused across decode steps.
#[derive(Default)]
pub struct BatchWorkspace {
    scratch: Scratch,
    /// Logits of the last step, one row of `vocab_size` per session.
    pub logits: Vec<f32>,
}

impl BatchWorkspace {
    /// Keep every row's hidden state after the final norm (host passes), for an MTP head.
    pub fn keep_hidden(&mut self, on: bool) {
        self.scratch.keep_hidden = on;
        if !on {
            self.scratch.hidden = Vec::new();
        }
    }

    /// The last pass's hidden states (rows of `dim` in batch order; empty unless kept), taken
    /// out; `put_hidden` gives the buffer back.
    pub fn take_hidden(&mut self) -> Vec<f32> {
        if self.scratch.keep_hidden {
            std::mem::take(&mut self.scratch.hidden)
        } else {
            Vec::new()
        }
    }

    pub fn put_hidden(&mut self, mut h: Vec<f32>) {
        if self.scratch.keep_hidden {
            h.clear();
            self.scratch.hidden = h;
        }
    }
}

/// Advance every session by one token (`tokens[i]` for `sessions[i]`) in one pass over the
/// weights. Each session's logits are bit-identical to what `Session::eval` would give it alone.
/// Nothing is evaluated if any session would pass the context window.
pub fn eval_batch(m: &Model, ws: &mut BatchWorkspace, sessions: &mut [&mut Session], tokens: &[u32]) -> Result<()> {
    if sessions.len() != tokens.len() {
        return Err(Error::InvalidArgument(format!("eval_batch got {} sessions but {} tokens; pass one token per session", sessions.len(), tokens.len())));
    }
    eval_multi(m, ws, sessions, &vec![1; tokens.len()], tokens)
}

/// `eval_multi` with the logits of the rows `want` names left in `ws.logits` only, in order:
/// the scheduler samples from there without a copy per stream.
pub fn eval_rows(m: &Model, ws: &mut BatchWorkspace, sessions: &mut [&mut Session], counts: &[usize], tokens: &[u32], want: LogitRows<'_>) -> Result<()> {
    eval_rows_with(m, ws, sessions, counts, tokens, None, want)
}

/// `eval_rows` with some rows' inputs given (`Injected`, rows and spans in the pass's rows).
pub fn eval_rows_with(
    m: &Model,
    ws: &mut BatchWorkspace,
    sessions: &mut [&mut Session],
    counts: &[usize],
    tokens: &[u32],
    injected: Option<Injected<'_>>,
    want: LogitRows<'_>,
) -> Result<()> {
    if sessions.is_empty() || sessions.len() != counts.len() {
        return Err(Error::InvalidArgument("eval_batch needs at least one session, and one count per session".into()));
    }
    #[cfg(feature = "fault-injection")]
    if sessions.iter().any(|s| s.fault) {
        m.rt.host().panic_in_task("injected fault in a session's evaluation");
    }
    run(m, sessions, counts, tokens, injected, want, &mut ws.scratch, &mut ws.logits)
}

/// One forward pass where the sessions' K/V lives: all on the device, or all on the host (the
/// model's placement takes the host pass's matrix products where it holds them, and counts a
/// host pass of a model it holds whole).
#[allow(clippy::too_many_arguments)]
fn run(
    m: &Model,
    sessions: &mut [&mut Session],
    counts: &[usize],
    tokens: &[u32],
    injected: Option<Injected<'_>>,
    want: LogitRows<'_>,
    scratch: &mut Scratch,
    logits: &mut Vec<f32>,
) -> Result<()> {
    let on_device = sessions.iter().filter(|s| s.dev.is_some()).count();
    if on_device == 0 {
        let mut kvs: Vec<&mut KvCache> = sessions.iter_mut().map(|s| &mut s.kv).collect();
        let Some(p) = m.placement() else {
            return forward_batch_with(m, &mut kvs, counts, tokens, Span::whole(m), injected, want, scratch, logits, None);
        };
        let mut out = Ok(());
        p.host_pass(&mut |offload| out = forward_batch_with(m, &mut kvs, counts, tokens, Span::whole(m), injected, want, scratch, logits, offload));
        return out;
    }
    if on_device != sessions.len() {
        return Err(Error::InvalidArgument("a batch mixes device-home and host sessions; evaluate them in separate batches".into()));
    }
    crate::model::forward::check(m, sessions.iter().map(|s| s.n_past()), counts, tokens, want)?;
    let p = m
        .placement()
        .ok_or_else(|| Error::Device("this device session's model is no longer on the device (it was dropped or switched out); create a new session".into()))?;
    let Some(layers) = p.split() else {
        let mut kvs: Vec<&mut DevKv> = sessions.iter_mut().filter_map(|s| s.dev.as_mut()).collect();
        return crate::model::forward::forward_device(m, &*p, &mut kvs, counts, tokens, injected, want, logits);
    };
    // A split model: the device runs the first layers and leaves every row's hidden state; the
    // CPU runs the rest and the head over the sessions' host K/V.
    let (mut devs, mut hosts): (Vec<&mut DevKv>, Vec<&mut KvCache>) = sessions.iter_mut().filter_map(|s| s.dev.as_mut().map(|d| (d, &mut s.kv))).unzip();
    let lens: Vec<usize> = devs.iter().map(|d| d.len()).collect();
    if hosts.iter().zip(&lens).any(|(h, &l)| h.len() != l) {
        return Err(Error::Internal("a split device session's host rows and device rows differ in number".into()));
    }
    let mut x = std::mem::take(&mut scratch.split);
    let mut done = crate::model::forward::forward_device(m, &*p, &mut devs, counts, tokens, injected, LogitRows::All, &mut x);
    if done.is_ok() {
        let span = Span { layers: layers..m.layers.len(), x: Some(&x) };
        done = forward_batch_with(m, &mut hosts, counts, tokens, span, injected, want, scratch, logits, None);
    }
    scratch.split = x;
    if done.is_err() {
        // Neither part counts: the device's rows are overwritten by the next pass.
        for (d, &l) in devs.iter_mut().zip(&lens) {
            d.truncate(l);
        }
    }
    done
}

/// Advance `sessions[i]` by `counts[i]` tokens taken in order from `tokens` (decode steps and
/// prefill chunks in one pass over the weights); each session's logits after its last token land
/// in the session and in `ws.logits` (row i).
pub fn eval_multi(m: &Model, ws: &mut BatchWorkspace, sessions: &mut [&mut Session], counts: &[usize], tokens: &[u32]) -> Result<()> {
    eval_rows(m, ws, sessions, counts, tokens, LogitRows::Last)?;
    let v = m.config.vocab_size;
    for (i, s) in sessions.iter_mut().enumerate() {
        s.logits.clear();
        s.logits.extend_from_slice(&ws.logits[i * v..(i + 1) * v]);
    }
    Ok(())
}
