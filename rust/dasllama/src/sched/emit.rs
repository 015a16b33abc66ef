//! Events out: sampling a stream's next token and emitting it as a piece, or ending the stream
//! (stop, length, eviction, error) with its finished event.

use super::{PendingReq, Scheduler, Stream};
use crate::model::Model;
use crate::sampling;
use crate::{error, Error};
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Piece,
    Finished,
    /// Prefill progress, for a request that asked for it (`PendingReq::progress`): `n_prompt`
    /// the prompt's rows, `n_cached` those that came from the prefix cache, `n_gen` those whose
    /// K/V the stream holds now (cached ones included).
    Progress,
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

impl Scheduler {
    /// Sample from the stream's logits and emit its piece, or finish it; the token if the
    /// stream goes on. `row`: the stream's logits after its last token in `in_kv`.
    pub(super) fn sample_and_emit(&mut self, m: &Model, s: &mut Stream, row: &[f32], events: &mut Vec<SchedEvent>) -> Option<u32> {
        let ctx = self.ctx();
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
                    let ev = self.fail_stream(s, e);
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
            let ev = self.finish_stream(s, Finish::Stop, tok as i64);
            events.push(ev);
            return None;
        }
        // The grammar advances over what is emitted only; complete, it ends the stream.
        let complete = match s.constraint.as_mut().map(|c| c.advance(tok)) {
            None | Some(Ok(false)) => false,
            Some(Ok(true)) => true,
            Some(Err(e)) => {
                let ev = self.fail_stream(s, e);
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
            stream: s.slot,
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
            let ev = self.finish_stream(s, if complete { Finish::Stop } else { Finish::Length }, -1);
            events.push(ev);
            None
        } else {
            s.next = Some(tok);
            Some(tok)
        }
    }

    /// End a stream that failed: its KV is dropped (not donated: it may hold rows of a failed
    /// pass), and the event carries the error.
    pub(super) fn fail_stream(&mut self, s: &mut Stream, e: Error) -> SchedEvent {
        let mut ev = self.finish_stream(s, Finish::Error, -1);
        ev.error = Some((e.kind(), e.to_string()));
        ev
    }

    /// End a stream: its event, its K/V given back (or donated to the prefix cache, or parked on
    /// the device), and the stream marked `ended` (the step drops it; `evict` has already).
    pub(super) fn finish_stream(&mut self, s: &mut Stream, finish: Finish, token: i64) -> SchedEvent {
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
            let claim = s.session.dev.as_mut().map_or(0, |dev| {
                dev.truncate(s.in_kv.len());
                dev.park()
            });
            if claim > 0 {
                self.parked.push_back((std::mem::take(&mut s.in_kv), claim));
                // Claims of regions taken since are stale anyway; keep the list short.
                while self.parked.len() > 4 * self.max_streams {
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
        s.ended = true;
        let mut ev = finished_event(s.slot, &s.req, finish, token, s.generated, ttft, gen);
        ev.n_cached = s.cached;
        ev
    }
}

pub(super) fn finished_event(stream: usize, req: &PendingReq, finish: Finish, token: i64, n_gen: usize, ttft_us: u64, gen_us: u64) -> SchedEvent {
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

/// Where the prefill of `s` stands (an `EventKind::Progress` event).
pub(super) fn progress_event(s: &Stream) -> SchedEvent {
    SchedEvent {
        stream: s.slot,
        id: s.req.id,
        kind: EventKind::Progress,
        token: -1,
        text: String::new(),
        finish: Finish::None,
        n_prompt: s.req.prompt.len(),
        n_gen: s.fed,
        n_cached: s.cached,
        ttft_us: s.t_submit.elapsed().as_micros() as u64,
        gen_us: 0,
        logprob: None,
        top: Vec::new(),
        error: None,
    }
}

/// log-sum-exp of the logits and the `k` most likely tokens with their log-probabilities.
pub(super) fn log_softmax_top(logits: &[f32], k: usize) -> (f32, Vec<(u32, f32)>) {
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
