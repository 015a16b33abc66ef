//! A draft model: a smaller (or more coarsely quantized) model with the target's vocabulary
//! decodes a few tokens greedily ahead of each stream. Every drafting stream advances in the same
//! batched passes of the draft model, one pass per draft depth, so drafting for sixteen streams
//! costs about what drafting for one does while the draft is bound by reading its weights.

use crate::model::Model;
use crate::sampling;
use crate::session::{eval_multi, BatchWorkspace, Session};
use crate::Result;

/// One stream's drafting this step.
pub struct Job<'a> {
    /// The stream's draft session: it holds a prefix of the stream's context.
    pub session: &'a mut Session,
    /// The context tokens it does not hold yet, the stream's next token last.
    pub feed: &'a [u32],
    pub k: usize,
    pub out: &'a mut Vec<u32>,
}

/// Draft `job.k` tokens for every job, greedily, in max(k) batched passes.
pub fn propose(draft: &Model, ws: &mut BatchWorkspace, jobs: &mut [Job<'_>]) -> Result<()> {
    let v = draft.config.vocab_size;
    let depth = jobs.iter().map(|j| j.k).max().unwrap_or(0);
    for d in 0..depth {
        let live: Vec<usize> = (0..jobs.len()).filter(|&i| jobs[i].k > d).collect();
        let mut tokens = Vec::new();
        let mut counts = Vec::with_capacity(live.len());
        for &i in &live {
            // The first pass catches each session up (its next token included); later ones feed
            // the previous draft.
            let feed: &[u32] = if d == 0 { jobs[i].feed } else { std::slice::from_ref(jobs[i].out.last().expect("drafted at depth d-1")) };
            tokens.extend_from_slice(feed);
            counts.push(feed.len());
        }
        let mut by_job: Vec<Option<&mut Session>> = jobs.iter_mut().map(|j| Some(&mut *j.session)).collect();
        let mut sessions: Vec<&mut Session> = live.iter().map(|&i| by_job[i].take().expect("each job once")).collect();
        eval_multi(draft, ws, &mut sessions, &counts, &tokens)?;
        for (r, &i) in live.iter().enumerate() {
            jobs[i].out.push(sampling::argmax(&ws.logits[r * v..(r + 1) * v]));
        }
    }
    Ok(())
}
