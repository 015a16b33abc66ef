//! A stream's token record: the tokens it sampled, and the sampler state before each one (the
//! RNG, the UTF-8 bytes held back by the incremental detokenizer), so that the last n tokens can
//! be taken back, as speculative decoding does with rejected drafts, and sampling then goes on
//! exactly as if they had never been drawn.

use crate::sampling::{self, Rng, SamplingParams};
use crate::tokenizer::{Utf8Mark, Utf8Stream};

#[derive(Clone, Debug)]
struct Mark {
    rng: Rng,
    utf8: Utf8Mark,
}

pub struct TokenRecord {
    ids: Vec<u32>,
    /// `marks[i]`: the state just before `ids[i]` was sampled.
    marks: Vec<Mark>,
    rng: Rng,
    utf8: Utf8Stream,
}

impl TokenRecord {
    pub fn new(seed: u64) -> Self {
        TokenRecord { ids: Vec::new(), marks: Vec::new(), rng: Rng::new(seed), utf8: Utf8Stream::default() }
    }

    /// The sampled tokens, oldest first (repetition penalties read the tail).
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Seed the RNG anew (what was sampled stays).
    pub fn reseed(&mut self, seed: u64) {
        self.rng = Rng::new(seed);
    }

    /// Forget what was sampled; the RNG goes on where it is.
    pub fn clear(&mut self) {
        self.ids.clear();
        self.marks.clear();
        self.utf8 = Utf8Stream::default();
    }

    /// Sample the next token from `logits` (rewritten by penalties and truncation) and record it.
    pub fn sample(&mut self, logits: &mut [f32], p: &SamplingParams) -> u32 {
        let mark = self.mark();
        let tok = sampling::sample(logits, &self.ids, p, &mut self.rng);
        self.marks.push(mark);
        self.ids.push(tok);
        tok
    }

    /// Record a token chosen without the RNG (greedy decoding, an accepted draft).
    pub fn push(&mut self, tok: u32) {
        self.marks.push(self.mark());
        self.ids.push(tok);
    }

    /// The text a token's bytes complete (never half a character; the rest is held back).
    pub fn text(&mut self, piece: &[u8]) -> String {
        self.utf8.push(piece)
    }

    /// What is still held back, at the end of the stream.
    pub fn finish_text(&mut self) -> String {
        self.utf8.finish()
    }

    /// Take back the last `n` tokens (at most all of them): the RNG and the held-back bytes
    /// return to what they were before the first of them was sampled.
    pub fn rollback(&mut self, n: usize) {
        let keep = self.ids.len().saturating_sub(n);
        if let Some(m) = self.marks.get(keep).cloned() {
            self.rng = m.rng;
            self.utf8.restore(m.utf8);
        }
        self.ids.truncate(keep);
        self.marks.truncate(keep);
    }

    fn mark(&self) -> Mark {
        Mark { rng: self.rng.clone(), utf8: self.utf8.mark() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits(step: usize) -> Vec<f32> {
        (0..50).map(|i| (((i * 7919 + step * 104729) % 97) as f32) / 20.0).collect()
    }

    /// Sample `n` tokens and the text their (multi-byte) pieces make.
    fn run(r: &mut TokenRecord, from: usize, n: usize, p: &SamplingParams) -> (Vec<u32>, String) {
        let mut text = String::new();
        let mut ids = Vec::new();
        for step in from..from + n {
            let t = r.sample(&mut logits(step), p);
            ids.push(t);
            // A piece of one byte of a 3-byte character or an ASCII byte, by token.
            text.push_str(&r.text(if t.is_multiple_of(3) { "€".as_bytes() } else { &"€".as_bytes()[(t as usize % 3)..][..1] }));
        }
        (ids, text)
    }

    #[test]
    fn rolled_back_tokens_are_drawn_again_identically() {
        let p = SamplingParams {
            temp: 1.0,
            top_k: 0,
            top_p: 0.95,
            min_p: 0.0,
            penalty: 1.1,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: None,
            logit_bias: Vec::new(),
        };
        let mut a = TokenRecord::new(7);
        let (first, _) = run(&mut a, 0, 20, &p);
        let (rest, text) = run(&mut a, 20, 9, &p);
        a.rollback(9);
        assert_eq!(a.ids(), &first[..]);
        let (again, text_again) = run(&mut a, 20, 9, &p);
        assert_eq!(again, rest, "the RNG and penalty history came back");
        assert_eq!(text_again, text, "so did the held-back UTF-8 bytes");
        a.rollback(100);
        assert!(a.is_empty());
        assert_eq!(run(&mut a, 0, 20, &p).0, first);
    }
}
