//! Step planning: the prefill chunk under the step budget, what a pass costs, and evaluating
//! the planned rows in one pass (or each stream alone, to find the one at fault).

use super::{budget, SchedEvent, Scheduler, Stream, FIRST_CHUNK, MIN_CHUNK};
use crate::backend::RowEmbeds;
use crate::kv::Grid;
use crate::model::forward::{Injected, LogitRows};
use crate::model::Model;
use crate::session::{eval_rows_with, Session};
use crate::{error, Error, Result};

impl Scheduler {
    /// Add this step's prefill chunk to `plan` (which holds its decode rows): prompt tokens of
    /// the oldest admitted streams first, as many as the step budget leaves room for beside the
    /// decode rows by the measured cost of passes, at most `chunk_tokens` (and at least
    /// `MIN_CHUNK` for the first, so a prompt always advances).
    pub(super) fn plan_prefill(&self, streams: &[Stream], prefilling: &[usize], plan: &mut Vec<(usize, usize)>) {
        let (mut rows, mut keys) = self.pass_size(streams, plan);
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
            let s = &streams[i];
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
                    if plan.iter().all(|p| streams[p.0].next.is_some()) {
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
            let k = super::image_cut(&s.req.images, s.fed, k);
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
    pub(super) fn snapshot_boundary(&self, s: &Stream) -> Option<usize> {
        let pool = self.host_pool()?;
        if !s.session.kv.recurrent() {
            return None;
        }
        let r = pool.geometry().page_rows;
        Some(s.req.prompt.len() / r * r)
    }

    /// A pass's size as the step's cost model counts it: rows through the layers plus logit rows
    /// weighted (`logit_weight`), and the keys its rows attend. Every plan entry has one logit
    /// row except a decoding stream's verify chunk, which has one per row.
    pub(super) fn pass_size(&self, streams: &[Stream], plan: &[(usize, usize)]) -> (f64, f64) {
        let (mut rows, mut keys) = (0.0, 0.0);
        for &(i, k) in plan {
            let s = &streams[i];
            let logit_rows = if s.next.is_some() { k } else { 1 };
            let n = s.session.n_past();
            rows += k as f64 + self.logit_weight * logit_rows as f64;
            keys += (k * n + k * (k + 1) / 2) as f64;
        }
        (rows, keys)
    }

    /// Evaluate the planned streams' tokens in one pass; logits land in `self.ws.logits`: every
    /// row of a decoding stream (its next token, then its drafts), the last of a prefill chunk.
    pub(super) fn eval_plan(&mut self, m: &Model, streams: &mut [Stream], plan: &[(usize, usize)]) -> Result<()> {
        let mut tokens = Vec::with_capacity(plan.iter().map(|p| p.1).sum());
        let mut tails = Vec::with_capacity(plan.len());
        // Image rows of the prefill pieces: pass rows, their values, and each image's span.
        let (mut rows, mut values, mut spans, mut grids) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let d = m.config.embd_inp();
        for (si, &(i, k)) in plan.iter().enumerate() {
            let s = &streams[i];
            match s.next {
                Some(t) => {
                    tokens.push(t);
                    tokens.extend_from_slice(&s.spec.drafts);
                    tails.push(k);
                }
                None => {
                    let r0 = tokens.len();
                    for im in &s.req.images {
                        // Every M-RoPE image up to the piece's end, those in attached prefix
                        // pages too: they place the piece's rows.
                        if let Some((nx, ny)) = im.grid.filter(|_| im.at < s.fed + k) {
                            grids.push((si, Grid { at: im.at, nx, ny }));
                        }
                        let (a, e) = (im.at.max(s.fed), (im.at + im.n).min(s.fed + k));
                        if a < e {
                            if im.non_causal {
                                spans.push((r0 + a - s.fed, e - a));
                            }
                            rows.extend((a..e).map(|p| r0 + p - s.fed));
                            values.extend_from_slice(&im.values[(a - im.at) * d..(e - im.at) * d]);
                        }
                    }
                    tokens.extend_from_slice(&s.req.prompt[s.fed..s.fed + k]);
                    tails.push(1);
                }
            }
        }
        let mut sessions: Vec<&mut Session> = pick_mut(streams, plan.iter().copied()).into_iter().map(|(s, _)| &mut s.session).collect();
        if sessions.len() != plan.len() {
            return Err(Error::Internal(format!("a step planned {} entries for {} distinct live streams", plan.len(), sessions.len())));
        }
        let counts: Vec<usize> = plan.iter().map(|p| p.1).collect();
        let ws = &mut self.ws;
        let injected =
            (!rows.is_empty() || !grids.is_empty()).then(|| Injected { embeds: RowEmbeds { rows: &rows, values: &values }, spans: &spans, grids: &grids });
        error::catch("a scheduler step", || eval_rows_with(m, ws, &mut sessions, &counts, &tokens, injected, LogitRows::Tail(&tails)))
    }

    /// The batched pass failed: find the streams at fault by running each alone (rows compute the
    /// same whatever the batch, and a failed pass committed no position, so the survivors' results
    /// are what the batch would have given). Failed streams end with an error and leave `plan`;
    /// returns the survivors' logits, in the new plan's order.
    pub(super) fn eval_isolated(&mut self, m: &Model, streams: &mut [Stream], plan: &mut Vec<(usize, usize)>, events: &mut Vec<SchedEvent>) -> Vec<f32> {
        let v = m.config.vocab_size;
        let mut logits = Vec::with_capacity(plan.len() * v);
        let mut kept = Vec::with_capacity(plan.len());
        for &(i, k) in plan.iter() {
            match self.eval_plan(m, streams, &[(i, k)]) {
                Ok(()) => {
                    logits.extend_from_slice(&self.ws.logits);
                    kept.push((i, k));
                }
                Err(e) => {
                    events.push(self.fail_stream(&mut streams[i], e));
                }
            }
        }
        *plan = kept;
        logits
    }

    /// Pages first, per stream: a stream the pool cannot grow fails alone, before the pass (one
    /// that cannot grow for its drafts decodes without them), and leaves `plan`.
    pub(super) fn reserve_pages(&mut self, streams: &mut [Stream], plan: &mut Vec<(usize, usize)>, events: &mut Vec<SchedEvent>) {
        plan.retain_mut(|(i, k)| {
            let s = &mut streams[*i];
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
                    events.push(self.fail_stream(s, e));
                    false
                }
            }
        });
    }
}

/// Multiply-adds of one row's logits over those of one row through the layers.
pub(super) fn logit_weight(m: &Model) -> f64 {
    (m.config.vocab_size * m.config.dim) as f64 / m.config.macs_per_row().max(1.0)
}

/// The streams at the given indices, each with its count, in the order given; an index past the
/// streams, or one given again, is left out (the caller checks what it got).
pub(super) fn pick_mut(streams: &mut [Stream], chosen: impl Iterator<Item = (usize, usize)>) -> Vec<(&mut Stream, usize)> {
    let mut by_index: Vec<Option<&mut Stream>> = streams.iter_mut().map(Some).collect();
    chosen.filter_map(|(i, k)| by_index.get_mut(i)?.take().map(|s| (s, k))).collect()
}
