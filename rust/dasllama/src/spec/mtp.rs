//! Drafting with an MTP head (`model::mtp`). The head's K/V follows the stream's whole context:
//! its row at position p pairs the trunk's hidden state at p with the token at p + 1, so a row can
//! only be run once that token is known. The trunk's hidden states wait in `pending` until the
//! stream drafts; the first pass of a drafting step runs them (the last paired with the stream's
//! next token, whose logits give the first draft), and each further pass chains one draft with
//! the head's own hidden state. Those chained rows stand where the trunk's hidden states will
//! later be, so they are taken back at once: the head's K/V only ever holds rows of accepted
//! tokens, and rolls back with the stream by construction. All streams draft in the same
//! batched passes, one per draft depth.

use crate::kv::KvCache;
use crate::model::forward::LogitRows;
use crate::model::mtp::{forward, MtpScratch};
use crate::model::{Model, MtpHead};
use crate::sampling;
use crate::Result;

/// One stream's MTP state.
pub struct MtpStream {
    /// The head's K/V: positions 0.. of the stream's context.
    pub kv: KvCache,
    /// The trunk's hidden states (rows of `dim`) at the positions after the head's K/V, up to the
    /// stream's context length.
    pub pending: Vec<f32>,
}

impl MtpStream {
    pub fn new(m: &Model, head: &MtpHead) -> MtpStream {
        MtpStream { kv: head.new_kv(m), pending: Vec::new() }
    }

    /// Whether the head's K/V and the hidden states waiting cover exactly `ctx` positions, the
    /// last still waiting for the stream's next token (a stream whose hidden states were not all
    /// seen cannot draft with the head).
    pub fn covers(&self, ctx: usize, dim: usize) -> bool {
        !self.pending.is_empty() && self.kv.len() + self.pending.len() / dim == ctx
    }
}

/// One stream's drafting this step.
pub struct Job<'a> {
    pub state: &'a mut MtpStream,
    /// The stream's context (the tokens its K/V holds) and its next token.
    pub ctx: &'a [u32],
    pub next: u32,
    pub k: usize,
    pub out: &'a mut Vec<u32>,
}

/// Draft `job.k` tokens for every job, greedily, in max(k) batched passes of the head.
pub fn propose(m: &Model, head: &MtpHead, ws: &mut MtpScratch, jobs: &mut [Job<'_>]) -> Result<()> {
    let (d, v) = (m.config.dim, m.config.vocab_size);
    let depth = jobs.iter().map(|j| j.k).max().unwrap_or(0);
    let mut chained: Vec<Vec<f32>> = vec![Vec::new(); jobs.len()];
    let (mut logits, mut hidden_out) = (Vec::new(), Vec::new());
    let result = (|| {
        for dep in 0..depth {
            let live: Vec<usize> = (0..jobs.len()).filter(|&i| jobs[i].k > dep).collect();
            let (mut tokens, mut hidden, mut counts) = (Vec::new(), Vec::new(), Vec::with_capacity(live.len()));
            for &i in &live {
                let j = &jobs[i];
                if dep == 0 {
                    // Row p pairs the hidden state at p with the token at p + 1.
                    tokens.extend_from_slice(&j.ctx[j.state.kv.len() + 1..]);
                    tokens.push(j.next);
                    hidden.extend_from_slice(&j.state.pending);
                    counts.push(j.state.pending.len() / d);
                } else {
                    tokens.push(*j.out.last().expect("drafted at depth dep-1"));
                    hidden.extend_from_slice(&chained[i]);
                    counts.push(1);
                }
            }
            let mut by_job: Vec<Option<&mut KvCache>> = jobs.iter_mut().map(|j| Some(&mut j.state.kv)).collect();
            let mut kvs: Vec<&mut KvCache> = live.iter().map(|&i| by_job[i].take().expect("each job once")).collect();
            forward(m, head, &mut kvs, &counts, &tokens, &hidden, LogitRows::Last, ws, &mut logits, &mut hidden_out)?;
            for (r, &i) in live.iter().enumerate() {
                jobs[i].out.push(sampling::argmax(&logits[r * v..(r + 1) * v]));
                chained[i].clear();
                chained[i].extend_from_slice(&hidden_out[r * d..(r + 1) * d]);
                if dep == 0 {
                    jobs[i].state.pending.clear();
                }
            }
        }
        Ok(())
    })();
    for j in jobs.iter_mut() {
        // The head's K/V keeps the trunk-paired rows only (`pending` was cleared with them).
        let keep = j.ctx.len().min(j.state.kv.len());
        j.state.kv.truncate(keep);
    }
    result
}
