//! Sessions: one conversation's KV store, position, logits, sampling state.

use crate::model::forward::{forward, forward_batch, Scratch};
use crate::model::Model;
use crate::sampling::Rng;
use crate::{Error, Result};

/// Private KV store of one session, grown on demand (never sized by the context up front).
/// Values are held as f32 already rounded to f16: the same numbers as llama.cpp's f16 cache.
pub struct KvCache {
    kv_dim: usize,
    len: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl KvCache {
    pub fn new(n_layers: usize, kv_dim: usize) -> Self {
        KvCache { kv_dim, len: 0, k: vec![Vec::new(); n_layers], v: vec![Vec::new(); n_layers] }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub(crate) fn reserve(&mut self, positions: usize) {
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            let want = positions * self.kv_dim;
            if buf.capacity() < want {
                buf.reserve(want.next_power_of_two().max(64 * self.kv_dim) - buf.len());
            }
        }
    }
    /// Append rows for layer `il` (positions len.. until commit).
    pub(crate) fn append(&mut self, il: usize, k: &[f32], v: &[f32]) {
        self.k[il].truncate(self.len * self.kv_dim);
        self.v[il].truncate(self.len * self.kv_dim);
        self.k[il].extend(k.iter().map(|&x| crate::cpu::ops::round_f16(x)));
        self.v[il].extend(v.iter().map(|&x| crate::cpu::ops::round_f16(x)));
    }
    pub(crate) fn commit(&mut self, len: usize) {
        self.len = len;
    }
    pub(crate) fn layer(&self, il: usize) -> (&[f32], &[f32]) {
        (&self.k[il], &self.v[il])
    }
    /// Forget positions from `pos` on.
    pub fn truncate(&mut self, pos: usize) {
        self.len = self.len.min(pos);
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            buf.truncate(self.len * self.kv_dim);
        }
    }
}

pub struct Session {
    pub kv: KvCache,
    pub logits: Vec<f32>,
    /// Sampled tokens: the repetition-penalty window reads its tail.
    pub recent: Vec<u32>,
    pub rng: Rng,
    scratch: Scratch,
}

impl Session {
    pub fn new(m: &Model) -> Self {
        Session {
            kv: KvCache::new(m.config.n_layers, m.config.kv_dim()),
            logits: Vec::new(),
            recent: Vec::new(),
            rng: Rng::new(crate::sampling::DEFAULT_SEED),
            scratch: Scratch::default(),
        }
    }

    pub fn n_past(&self) -> usize {
        self.kv.len()
    }

    /// Run `tokens` at the current position; logits after the last one land in `self.logits`.
    pub fn eval(&mut self, m: &Model, tokens: &[u32]) -> Result<()> {
        forward(m, &mut self.kv, tokens, &mut self.scratch, &mut self.logits)
    }

    pub fn reset(&mut self) {
        self.kv.truncate(0);
        self.recent.clear();
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

/// Advance every session by one token (`tokens[i]` for `sessions[i]`) in one pass over the
/// weights. Each session's logits are bit-identical to what `Session::eval` would give it alone.
/// Nothing is evaluated if any session would pass the context window.
pub fn eval_batch(m: &Model, ws: &mut BatchWorkspace, sessions: &mut [&mut Session], tokens: &[u32]) -> Result<()> {
    if sessions.len() != tokens.len() {
        return Err(Error::InvalidArgument(format!("eval_batch got {} sessions but {} tokens; pass one token per session", sessions.len(), tokens.len())));
    }
    eval_multi(m, ws, sessions, &vec![1; tokens.len()], tokens)
}

/// Advance `sessions[i]` by `counts[i]` tokens taken in order from `tokens` (decode steps and
/// prefill chunks in one pass over the weights); each session's logits after its last token land
/// in the session and in `ws.logits` (row i).
pub fn eval_multi(m: &Model, ws: &mut BatchWorkspace, sessions: &mut [&mut Session], counts: &[usize], tokens: &[u32]) -> Result<()> {
    if sessions.is_empty() || sessions.len() != counts.len() {
        return Err(Error::InvalidArgument("eval_batch needs at least one session, and one count per session".into()));
    }
    let mut kvs: Vec<&mut KvCache> = sessions.iter_mut().map(|s| &mut s.kv).collect();
    forward_batch(m, &mut kvs, counts, tokens, &mut ws.scratch, &mut ws.logits)?;
    let v = m.config.vocab_size;
    for (i, s) in sessions.iter_mut().enumerate() {
        s.logits.clear();
        s.logits.extend_from_slice(&ws.logits[i * v..(i + 1) * v]);
    }
    Ok(())
}
