//! Sampling in llama.cpp's order: penalties, greedy if temp <= 0, temperature, top-k on logits,
//! softmax, top-p then min-p on probabilities, draw from the session's own RNG.

use crate::{Error, Result};

pub const DEFAULT_SEED: u64 = 0x5EED_DA51;

#[derive(Clone, Debug)]
pub struct SamplingParams {
    pub temp: f32,
    pub top_k: i64,
    pub top_p: f32,
    pub min_p: f32,
    pub penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub penalty_last_n: i64,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temp: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: None,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::InvalidArgument(what.to_string()));
        if !self.temp.is_finite() {
            return bad("temp must be a finite number");
        }
        if !(self.top_p.is_finite() && self.top_p >= 0.0) {
            return bad("top_p must be a number >= 0");
        }
        if !(self.min_p.is_finite() && self.min_p >= 0.0) {
            return bad("min_p must be a number >= 0");
        }
        if !(self.penalty.is_finite() && self.presence_penalty.is_finite() && self.frequency_penalty.is_finite()) {
            return bad("penalties must be finite numbers");
        }
        Ok(())
    }
}

/// xoshiro256** seeded through splitmix64: small, fast, and the same on every platform.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^ (x >> 31)
        };
        Rng { s: [next(), next(), next(), next()] }
    }

    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// The first index of the largest value (NaNs never win, unless at index 0).
pub fn argmax(x: &[f32]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if x.len() >= 8 && !x[0].is_nan() && crate::quant::avx2::has_avx2() {
        // SAFETY: AVX2 detected; the kernel reads x in bounds.
        return unsafe { argmax_avx2(x) };
    }
    argmax_scalar(x)
}

fn argmax_scalar(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Two passes, eight at a time: the largest value, then its first index.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn argmax_avx2(x: &[f32]) -> u32 {
    use std::arch::x86_64::*;
    let n8 = x.len() / 8 * 8;
    let p = x.as_ptr();
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    for i in (0..n8).step_by(8) {
        // max_ps returns its second operand when either is NaN: a NaN never replaces the max.
        m = _mm256_max_ps(_mm256_loadu_ps(p.add(i)), m);
    }
    let mut lanes = [0.0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), m);
    let max = x[n8..].iter().chain(&lanes).fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
    let target = _mm256_set1_ps(max);
    for i in (0..n8).step_by(8) {
        let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_loadu_ps(p.add(i)), target));
        if hit != 0 {
            return (i + hit.trailing_zeros() as usize) as u32;
        }
    }
    (n8 + x[n8..].iter().position(|&v| v == max).unwrap_or(0)) as u32
}

/// Whether `sample` is a plain argmax for these settings (it then leaves the logits unchanged).
pub fn is_plain_greedy(p: &SamplingParams) -> bool {
    p.temp <= 0.0 && !penalties_active(p)
}

fn penalties_active(p: &SamplingParams) -> bool {
    (p.penalty > 0.0 && p.penalty != 1.0) || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
}

/// Pick the next token from `logits` (modified in place) given the recent tokens.
///
/// No step sorts the whole vocabulary: top-k is a linear-time selection, min-p a filter, and top-p
/// sorts only as many of the most likely tokens as it takes to reach its mass (selected in growing
/// batches), so sampling from a 262k vocabulary costs about one pass over it.
pub fn sample(logits: &mut [f32], recent: &[u32], p: &SamplingParams, rng: &mut Rng) -> u32 {
    apply_penalties(logits, recent, p);
    if p.temp <= 0.0 {
        return argmax(logits);
    }
    let by_logit_desc = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let mut cand: Vec<u32> = (0..logits.len() as u32).collect();
    if p.top_k > 0 && (p.top_k as usize) < cand.len() {
        let k = p.top_k as usize;
        cand.select_nth_unstable_by(k - 1, by_logit_desc);
        cand.truncate(k);
    }
    // Unnormalized probabilities exp((l - max) / temp): the most likely token has weight 1.
    let max = cand.iter().map(|&t| logits[t as usize]).fold(f32::NEG_INFINITY, f32::max);
    let weight = |t: u32| (((logits[t as usize] - max) / p.temp) as f64).exp();
    let total: f64 = cand.iter().map(|&t| weight(t)).sum();
    if p.top_p < 1.0 {
        // The smallest set of most likely tokens holding `top_p` of the mass.
        let want = p.top_p as f64 * total;
        let mut k = 64.min(cand.len());
        loop {
            if k < cand.len() {
                cand.select_nth_unstable_by(k - 1, by_logit_desc);
            }
            cand[..k].sort_unstable_by(by_logit_desc);
            let mut acc = 0.0;
            let reached = cand[..k].iter().position(|&t| {
                acc += weight(t);
                acc >= want
            });
            if let Some(i) = reached {
                cand.truncate(i + 1);
                break;
            }
            if k == cand.len() {
                break;
            }
            k = (k * 4).min(cand.len());
        }
    }
    if p.min_p > 0.0 {
        // Relative to the most likely token, whose weight is 1.
        let floor = p.min_p as f64;
        let top = cand.iter().copied().max_by(|a, b| by_logit_desc(b, a)).expect("candidates are never empty");
        cand.retain(|&t| t == top || weight(t) >= floor);
    }
    let kept: f64 = cand.iter().map(|&t| weight(t)).sum();
    let mut r = rng.next_f64() * kept;
    for &t in &cand {
        r -= weight(t);
        if r < 0.0 {
            return t;
        }
    }
    *cand.last().expect("candidates are never empty")
}

fn apply_penalties(logits: &mut [f32], recent: &[u32], p: &SamplingParams) {
    if !penalties_active(p) || p.penalty_last_n == 0 || recent.is_empty() {
        return;
    }
    let n = if p.penalty_last_n < 0 { recent.len() } else { (p.penalty_last_n as usize).min(recent.len()) };
    let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    for &t in &recent[recent.len() - n..] {
        *counts.entry(t).or_default() += 1;
    }
    for (&t, &cnt) in &counts {
        let Some(l) = logits.get_mut(t as usize) else { continue };
        if p.penalty > 0.0 && p.penalty != 1.0 {
            *l = if *l <= 0.0 { *l * p.penalty } else { *l / p.penalty };
        }
        *l -= cnt as f32 * p.frequency_penalty + p.presence_penalty;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vector_argmax_is_the_scalar_one() {
        let mut rng = Rng::new(3);
        for n in [8, 9, 31, 100, 49152] {
            // Few distinct values, so the maximum repeats; then NaNs, infinities and signed zeros.
            let mut x: Vec<f32> = (0..n).map(|_| (rng.next_u64() % 13) as f32 - 6.0).collect();
            assert_eq!(argmax(&x), argmax_scalar(&x), "n={n}");
            for (k, v) in [(3, f32::NAN), (n / 2, f32::INFINITY), (n - 1, f32::NAN)] {
                x[k] = v;
                assert_eq!(argmax(&x), argmax_scalar(&x), "n={n}, x[{k}]={v}");
            }
            let z: Vec<f32> = (0..n).map(|i| if i % 3 == 0 { 0.0 } else { -0.0 }).collect();
            assert_eq!(argmax(&z), argmax_scalar(&z));
        }
    }

    #[test]
    fn greedy_is_argmax_and_seeds_repeat() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let g = SamplingParams::default();
        assert_eq!(sample(&mut logits.clone(), &[], &g, &mut Rng::new(1)), argmax(&logits));
        let p = SamplingParams { temp: 0.9, top_k: 40, top_p: 0.95, ..Default::default() };
        let draw = |seed| {
            let mut rng = Rng::new(seed);
            (0..20).map(|_| sample(&mut logits.clone(), &[], &p, &mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn penalties_lower_repeated_tokens() {
        let mut l = vec![1.0f32, 1.0, -1.0];
        let p = SamplingParams { penalty: 2.0, frequency_penalty: 0.5, ..Default::default() };
        apply_penalties(&mut l, &[0, 0, 2], &p);
        assert_eq!(l, vec![1.0 / 2.0 - 1.0, 1.0, -2.0 - 0.5]);
    }

    #[test]
    fn draws_follow_the_softmax_and_cutoffs_restrict_support() {
        let logits = vec![2.0f32, 1.0, 0.5, 0.0, -1.0, -3.0];
        let probs: Vec<f64> = {
            let e: Vec<f64> = logits.iter().map(|&l| (l as f64).exp()).collect();
            let t: f64 = e.iter().sum();
            e.iter().map(|x| x / t).collect()
        };
        let mut rng = Rng::new(3);
        let p = SamplingParams { temp: 1.0, ..Default::default() };
        let n = 40_000;
        let mut counts = [0usize; 6];
        for _ in 0..n {
            counts[sample(&mut logits.clone(), &[], &p, &mut rng) as usize] += 1;
        }
        for (c, want) in counts.iter().zip(&probs) {
            assert!((*c as f64 / n as f64 - want).abs() < 0.01, "{counts:?} vs {probs:?}");
        }
        // top_p 0.8: the two most likely tokens hold 0.77, three hold 0.89.
        let p = SamplingParams { temp: 1.0, top_p: 0.8, ..Default::default() };
        let seen: std::collections::HashSet<u32> = (0..2000).map(|_| sample(&mut logits.clone(), &[], &p, &mut rng)).collect();
        assert_eq!(seen, [0, 1, 2].into_iter().collect());
        // min_p 0.3: keep tokens at least 0.3x as likely as the best: e^-1 = 0.37 yes, e^-1.5 = 0.22 no.
        let p = SamplingParams { temp: 1.0, min_p: 0.3, ..Default::default() };
        let seen: std::collections::HashSet<u32> = (0..2000).map(|_| sample(&mut logits.clone(), &[], &p, &mut rng)).collect();
        assert_eq!(seen, [0, 1].into_iter().collect());
        // top_k 2 at a high temperature still never leaves the two best.
        let p = SamplingParams { temp: 5.0, top_k: 2, ..Default::default() };
        assert!((0..2000).all(|_| sample(&mut logits.clone(), &[], &p, &mut rng) < 2));
    }

    #[test]
    fn top_k_one_is_greedy() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7).sin()).collect();
        let p = SamplingParams { temp: 1.5, top_k: 1, ..Default::default() };
        for seed in 0..10 {
            assert_eq!(sample(&mut logits.clone(), &[], &p, &mut Rng::new(seed)), argmax(&logits));
        }
    }
}
