//! Drafting with Gemma 4's assistant (`model::gemma4_assistant`). It keeps nothing per stream but
//! the target's hidden state at the stream's last position (`StreamSpec::last_h`): a step's first
//! draft pairs it with the stream's next token, each further one pairs the draft before with the
//! assistant's own next hidden state, all at the position after the target's K/V, which the
//! assistant reads and never writes. So there is nothing to take back when drafts are rejected.

use crate::kv::KvCache;
use crate::model::gemma4_assistant::{step, AssistantScratch};
use crate::model::{Assistant, Model};
use crate::sampling;
use crate::Result;

/// One stream's drafting this step.
pub struct Job<'a> {
    /// The stream's K/V in the target (read only).
    pub kv: &'a mut KvCache,
    /// The target's hidden state at the last position `kv` holds.
    pub hidden: &'a [f32],
    pub next: u32,
    pub k: usize,
    pub out: &'a mut Vec<u32>,
}

/// Draft `job.k` tokens for every job, greedily, in max(k) batched passes of the assistant.
pub fn propose(m: &Model, a: &Assistant, ws: &mut AssistantScratch, jobs: &mut [Job<'_>]) -> Result<()> {
    let (d, v) = (m.config.dim, m.config.vocab_size);
    let depth = jobs.iter().map(|j| j.k).max().unwrap_or(0);
    let mut states: Vec<Vec<f32>> = jobs.iter().map(|j| j.hidden.to_vec()).collect();
    let mut toks: Vec<u32> = jobs.iter().map(|j| j.next).collect();
    let (mut logits, mut hidden_out) = (Vec::new(), Vec::new());
    for dep in 0..depth {
        let live: Vec<usize> = (0..jobs.len()).filter(|&i| jobs[i].k > dep).collect();
        let tokens: Vec<u32> = live.iter().map(|&i| toks[i]).collect();
        let hidden: Vec<f32> = live.iter().flat_map(|&i| states[i].iter().copied()).collect();
        {
            let mut by_job: Vec<Option<&mut KvCache>> = jobs.iter_mut().map(|j| Some(&mut *j.kv)).collect();
            let mut kvs: Vec<&mut KvCache> = live.iter().map(|&i| by_job[i].take().expect("each job once")).collect();
            step(m, a, &mut kvs, &tokens, &hidden, ws, &mut logits, &mut hidden_out)?;
        }
        for (r, &i) in live.iter().enumerate() {
            let t = sampling::argmax(&logits[r * v..(r + 1) * v]);
            jobs[i].out.push(t);
            toks[i] = t;
            states[i].clear();
            states[i].extend_from_slice(&hidden_out[r * d..(r + 1) * d]);
        }
    }
    Ok(())
}
