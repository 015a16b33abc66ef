//! Speculation: choosing the drafter, drafting for the decoding streams, and verifying the
//! drafts against the pass's rows (accepting the longest run the target agrees with).

use super::plan::pick_mut;
use super::{SchedEvent, Scheduler, Speculation, Stream};
use crate::backend::Numerics;
use crate::model::Model;
use crate::session::{BatchWorkspace, Session};
use crate::spec::policy::{self, Candidate, CostModel, Guard};
use crate::spec::{assistant, draft, mtp, ngram, Drafter, StreamSpec};
use crate::{error, Error, Result};
use std::time::Instant;

impl Scheduler {
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
        for s in self.streams.iter_mut() {
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

    /// Propose this step's drafts for the decoding streams (`Stream::spec.drafts`), as many as
    /// the policy finds worth their rows in the pass `plan` makes without them; none while
    /// `prompt_waiting` (`step_streams` says why). Whether any stream drafts.
    pub(super) fn draft(&mut self, all: &mut [Stream], decoding: &[usize], plan: &[(usize, usize)], prompt_waiting: bool) -> bool {
        let ctx = self.ctx();
        let Some(sp) = self.spec.as_mut() else { return false };
        for &i in decoding {
            all[i].spec.drafts.clear();
        }
        if prompt_waiting || (!sp.guard.allow() && sp.fixed_k.is_none()) {
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
            let s = &mut all[i];
            // A draft would be verified against unmasked rows: a constrained stream decodes plainly.
            if s.constraint.is_some() {
                continue;
            }
            // Never draft past max_new or the context: the verify chunk writes at in_kv.len()..
            let room = ctx.saturating_sub(s.in_kv.len() + 1);
            let mut cap = max_draft.min(s.req.max_new - s.generated - 1).min(room);
            match &sp.drafter {
                Drafter::Ngram { .. } => {
                    let Some(next) = s.next else { continue };
                    s.in_kv.push(next);
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
        // (Measured: `line` is known above.)
        let target = |r: f64| target_cost.cost(r).unwrap_or(f64::INFINITY);
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
            all[i].spec.idle();
        }
        let drafting = ks.iter().any(|&k| k > 0);
        if let Drafter::Mtp { head, .. } = &sp.drafter {
            let mut streams = pick_mut(all, who.iter().copied().zip(ks.iter().copied()).filter(|p| p.1 > 0));
            let t_draft = Instant::now();
            let d = self.model.config.dim;
            let draft_rows: usize = streams.iter().map(|(s, k)| k - 1 + s.spec.mtp.as_ref().map_or(0, |st| st.pending.len() / d)).sum();
            let mut jobs: Vec<mtp::Job<'_>> = streams
                .iter_mut()
                .filter_map(|(s, k)| {
                    let Stream { spec, in_kv, next, .. } = &mut **s;
                    let StreamSpec { mtp, drafts, .. } = spec;
                    // (A candidate has both: `covers` above, and it decodes.)
                    Some(mtp::Job { state: mtp.as_mut()?, ctx: in_kv, next: (*next)?, k: *k, out: drafts })
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
            let mut streams = pick_mut(all, who.iter().copied().zip(ks.iter().copied()).filter(|p| p.1 > 0));
            let t_draft = Instant::now();
            let draft_rows: usize = streams.iter().map(|(_, k)| *k).sum();
            let mut jobs: Vec<assistant::Job<'_>> = streams
                .iter_mut()
                .filter_map(|(s, k)| {
                    let Stream { spec, session, next, .. } = &mut **s;
                    let StreamSpec { last_h, drafts, .. } = spec;
                    Some(assistant::Job { kv: &mut session.kv, hidden: last_h, next: (*next)?, k: *k, out: drafts })
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
                all[i].spec.drafts.truncate(k);
            }
            return drafting;
        };
        // Each draft session holds a prefix of its stream's context: feed it the rest.
        let mut streams = pick_mut(all, who.iter().copied().zip(ks.iter().copied()).filter(|p| p.1 > 0));
        let mut feeds = Vec::with_capacity(streams.len());
        for (s, _) in streams.iter_mut() {
            let ds = s.spec.draft.get_or_insert_with(|| Session::new(draft));
            ds.kv.truncate(s.in_kv.len());
            let mut feed = s.in_kv[ds.n_past()..].to_vec();
            feed.extend(s.next);
            feeds.push(feed);
        }
        let t_draft = Instant::now();
        let mut jobs: Vec<draft::Job<'_>> = streams
            .iter_mut()
            .zip(&feeds)
            .filter_map(|((s, k), feed)| {
                let StreamSpec { draft, drafts, .. } = &mut s.spec;
                // (Made above.)
                Some(draft::Job { session: draft.as_mut()?, feed, k: *k, out: drafts })
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
    pub(super) fn verify(&mut self, m: &Model, s: &mut Stream, rows: &[f32], events: &mut Vec<SchedEvent>) -> usize {
        let v = m.config.vocab_size;
        let drafts = std::mem::take(&mut s.spec.drafts);
        let (mut accepted, mut emitted) = (0, 0);
        for j in 0..=drafts.len() {
            if j > 0 {
                s.in_kv.push(drafts[j - 1]);
            }
            emitted += 1;
            let Some(tok) = self.sample_and_emit(m, s, &rows[j * v..(j + 1) * v], events) else { break };
            if j < drafts.len() && tok == drafts[j] {
                accepted += 1;
                continue;
            }
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
        if !s.ended {
            // Its buffer, for the next step's drafts.
            s.spec.drafts = drafts;
            s.spec.drafts.clear();
        }
        emitted
    }
}

impl Speculation {
    /// A new stream's MTP state, when the drafter is an MTP head.
    pub(super) fn new_mtp_stream(&self, m: &Model) -> Option<mtp::MtpStream> {
        match &self.drafter {
            Drafter::Mtp { head, .. } => Some(mtp::MtpStream::new(m, head)),
            _ => None,
        }
    }

    /// A pass's size as its cost model counts it: its rows, plus its logit rows weighted.
    pub(super) fn pass_rows(&self, rows: usize, logit_rows: usize) -> f64 {
        rows as f64 + self.logit_weight * logit_rows as f64
    }
}
