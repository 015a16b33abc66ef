//! One step: admit, attach cached prefixes, plan the pass, reserve pages, evaluate, and hand
//! each stream its rows' logits.

use super::{SchedEvent, Scheduler, Stream};
use crate::model::Model;
use crate::spec::Drafter;
use crate::Result;
use std::time::Instant;

impl Scheduler {
    /// One tick: admit, then one pass that advances every decoding stream by a token and prefills
    /// at most `chunk_tokens` prompt tokens. Returns whether any request is still queued or running.
    /// A stream that cannot be evaluated ends alone with `Finish::Error`; the others go on.
    pub fn step(&mut self, events: &mut Vec<SchedEvent>) -> Result<bool> {
        let model = self.model.clone();
        let m = &*model;
        self.admit(m, events);
        // The streams come out whole for the step: a stream that ends in it stays in place,
        // marked, until the step is over, so every index the step holds names a stream.
        let mut streams = std::mem::take(&mut self.streams);
        self.step_streams(m, &mut streams, events);
        streams.retain(|s| !s.ended);
        self.streams = streams;
        Ok(self.n_active() > 0 || !self.queue.is_empty())
    }

    /// The step's pass over `streams` (the live streams, in slot order).
    fn step_streams(&mut self, m: &Model, streams: &mut [Stream], events: &mut Vec<SchedEvent>) {
        let decoding: Vec<usize> = (0..streams.len()).filter(|&i| streams[i].next.is_some()).collect();
        let mut prefilling: Vec<usize> = (0..streams.len()).filter(|&i| streams[i].fed < streams[i].req.prompt.len()).collect();
        prefilling.sort_by_key(|&i| streams[i].order);
        self.attach_prefixes(streams, &prefilling);
        // (slot, token count) of this pass: decode rows first (with their drafts), then the
        // prefill chunk's pieces.
        let mut plan: Vec<(usize, usize)> = decoding.iter().map(|&i| (i, 1)).collect();
        let t_step = Instant::now();
        // Under a step budget a verify row takes the place of a prompt row, which advances the
        // prompt surely where a draft is only sometimes accepted: no drafts while a prompt waits
        // (SmolLM2 135M, 8 decoders drafting by prompt lookup, a 3,775-token prompt: its first
        // token after 21.7 s, 12.4 s without drafts; the decoders keep a token a step).
        let prompt_waiting = self.step_budget.is_some() && !prefilling.is_empty();
        let drafted = self.draft(streams, &decoding, &plan, prompt_waiting);
        for p in plan.iter_mut() {
            p.1 += streams[p.0].spec.drafts.len();
        }
        self.plan_prefill(streams, &prefilling, &mut plan);
        self.reserve_pages(streams, &mut plan, events);
        if plan.is_empty() {
            return;
        }
        for &(i, _) in plan.iter() {
            let s = &streams[i];
            if s.req.progress && s.next.is_none() && s.fed == s.cached {
                events.push(super::emit::progress_event(s));
            }
        }
        let t_pass = Instant::now();
        let (pass_rows, pass_keys) = self.pass_size(streams, &plan);
        let logits = match self.eval_plan(m, streams, &plan) {
            Ok(()) => {
                self.step_cost.observe(pass_rows, pass_keys, t_pass.elapsed().as_secs_f64());
                // Verify rows are priced in decode passes, which read the weights for a few rows;
                // a prefill chunk's rows are compute-bound and cost more each, so they would
                // teach the cost model sizes that starve speculation.
                let decode_only = plan.iter().all(|&(i, _)| streams[i].next.is_some());
                if let (Some(sp), true) = (&mut self.spec, decode_only) {
                    let rows = sp.pass_rows(plan.iter().map(|p| p.1).sum(), self.ws.logits.len() / m.config.vocab_size);
                    sp.target_cost.observe(rows, t_pass.elapsed().as_secs_f64());
                }
                std::mem::take(&mut self.ws.logits)
            }
            Err(_) => self.eval_isolated(m, streams, &mut plan, events),
        };
        // Counted over the streams the pass advanced (a failed one has left the plan).
        let n_decoding = plan.iter().filter(|&&(i, _)| !streams[i].ended && streams[i].next.is_some()).count();
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
            let s = &mut streams[i];
            if let Some(t) = s.next.take() {
                s.in_kv.push(t);
                let before = s.in_kv.len() - 1;
                emitted += self.verify(m, s, &logits[r * v..(r + k) * v], events);
                r += k;
                if !s.ended {
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
            if s.req.progress {
                events.push(super::emit::progress_event(s));
            }
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
                self.sample_and_emit(m, s, row, events);
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
    }
}
