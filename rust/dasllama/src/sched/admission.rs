//! Admission: requests queue as token lists (no KV), are checked at submission, and are admitted
//! FIFO into free streams; eviction removes one wherever it is.

use super::emit::finished_event;
use super::{Finish, PendingReq, SchedEvent, Scheduler, Stream};
use crate::model::Model;
use crate::session::Session;
use crate::spec::StreamSpec;
use crate::{Error, Result};
use std::time::Instant;

impl Scheduler {
    /// A fresh device stream takes over the parked rows of the longest earlier conversation its
    /// prompt continues (one token short of the prompt, whose last token gives the first logits).
    fn adopt_parked(&mut self, s: &mut Stream) {
        let limit = s.req.prompt.len() - 1;
        let best = self.parked.iter().enumerate().map(|(j, (toks, _))| (toks.iter().zip(&s.req.prompt[..limit]).take_while(|(a, b)| a == b).count(), j)).max();
        let Some((rows, j)) = best.filter(|&(rows, _)| rows > 0) else { return };
        let Some((_, claim)) = self.parked.remove(j) else { return };
        let Some(dev) = s.session.dev.as_mut() else { return };
        if let Ok(true) = dev.adopt(claim, rows) {
            (s.cached, s.fed) = (rows, rows);
            s.in_kv = s.req.prompt[..rows].to_vec();
            self.stats.cached_tokens += rows as u64;
        }
    }

    pub(super) fn known(&self, id: i64) -> bool {
        self.queue.iter().any(|(r, _, _)| r.id == id) || self.streams.iter().any(|s| s.req.id == id)
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
            if im.n == 0 || im.at < after || im.at + im.n > req.prompt.len() || im.values.len() != im.n * m.config.embd_inp() {
                return bad(format!(
                    "an image's rows must be non-empty, in order, inside the prompt's {} rows, with {} values a row",
                    req.prompt.len(),
                    m.config.embd_inp()
                ));
            }
            after = im.at + im.n;
        }
        if self.known(req.id) {
            return bad("this id is already queued or running; ids must be unique".into());
        }
        // The queue limit counts requests waiting for a stream: one submitted while a slot is free
        // is not waiting, though the next step admits it. (Counting it made a burst into an idle
        // server with one stream and a queue of one refuse its second request.)
        let free = self.max_streams.saturating_sub(self.streams.len());
        if self.queue.len() >= self.max_queue + free {
            return Ok(false);
        }
        let constraint = match &req.grammar {
            Some(g) => {
                let env = self.model.grammar_env()?;
                Some(Box::new(env.compile(g).map_err(|e| Error::InvalidArgument(format!("request {}: {e}", req.id)))?))
            }
            None => None,
        };
        self.queue.push_back((req, Instant::now(), constraint));
        Ok(true)
    }

    /// Remove a request wherever it is; its stream (and KV) is freed at once.
    pub fn evict(&mut self, id: i64, events: &mut Vec<SchedEvent>) -> bool {
        if let Some((req, _, _)) = self.queue.iter().position(|(r, _, _)| r.id == id).and_then(|i| self.queue.remove(i)) {
            events.push(finished_event(usize::MAX, &req, Finish::Evicted, -1, 0, 0, 0));
            self.stats.finished += 1;
            return true;
        }
        if let Some(i) = self.streams.iter().position(|s| s.req.id == id) {
            let mut s = self.streams.remove(i);
            events.push(self.finish_stream(&mut s, Finish::Evicted, -1));
            return true;
        }
        false
    }

    pub(super) fn admit(&mut self, m: &Model, events: &mut Vec<SchedEvent>) {
        if self.device_kv && m.resident().is_none() {
            // The model left the device (lost, or dropped): new streams keep their K/V on the host.
            self.device_kv = false;
            self.parked.clear();
        }
        for slot in 0..self.max_streams {
            // Streams are kept in slot order: this slot's place, and whether it is taken.
            let at = self.streams.partition_point(|s| s.slot < slot);
            if self.streams.get(at).is_some_and(|s| s.slot == slot) {
                continue;
            }
            let Some((req, t_submit, constraint)) = self.queue.pop_front() else { break };
            self.admitted += 1;
            let session = match (&self.pool, self.device_kv) {
                (_, true) => Session::on_device(m),
                (Some(p), false) => Session::paged(m, p),
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
            let stream = Stream {
                slot,
                ended: false,
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
            };
            self.streams.insert(at, stream);
        }
    }

    /// A stream that has evaluated nothing yet attaches the longest cached prefix (one token
    /// short of the prompt, so that its last token is evaluated and gives the first logits).
    /// Looking until its first chunk, not only at admission, lets it find what streams admitted
    /// with it have prefilled since (a shared system prompt).
    pub(super) fn attach_prefixes(&mut self, streams: &mut [Stream], prefilling: &[usize]) {
        if self.device_kv {
            for &i in prefilling {
                if streams[i].fed == 0 {
                    self.adopt_parked(&mut streams[i]);
                }
            }
        }
        if let Some(pool) = self.pool.as_ref().filter(|_| !self.device_kv) {
            for &i in prefilling {
                let s = &mut streams[i];
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
    }
}
