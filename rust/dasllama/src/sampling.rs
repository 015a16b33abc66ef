//! Sampling as llama.cpp's default chain (common/sampling.cpp): penalties, top-k, top-p, min-p,
//! temperature, then a draw from the survivors' softmax with the session's own RNG; greedy when
//! temp <= 0. Temperature comes last, so top-p and min-p judge the model's own distribution.

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
    /// Added to a token's logit before anything else in the chain (llama.cpp's `logit_bias`
    /// sampler, first in its chain); -inf bans the token.
    pub logit_bias: Vec<(u32, f32)>,
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
            logit_bias: Vec::new(),
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
        if self.logit_bias.iter().any(|&(_, b)| b.is_nan() || b == f32::INFINITY) {
            return bad("a logit bias must be a finite number or -inf (never this token)");
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
    p.temp <= 0.0 && !penalties_active(p) && p.logit_bias.is_empty()
}

fn penalties_active(p: &SamplingParams) -> bool {
    (p.penalty > 0.0 && p.penalty != 1.0) || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
}

/// Pick the next token from `logits` (modified in place: penalties) given the recent tokens.
///
/// No filter sorts the whole vocabulary unless llama.cpp's would too (a top-k at least the
/// vocabulary's size): top-k is a linear-time selection, min-p a filter, and top-p sorts only as
/// many of the most likely tokens as it takes to reach its mass (selected in growing batches), so
/// sampling from a 262k vocabulary costs a few linear passes over it.
pub fn sample(logits: &mut [f32], recent: &[u32], p: &SamplingParams, rng: &mut Rng) -> u32 {
    apply_bias(logits, p);
    apply_penalties(logits, recent, p);
    if p.temp <= 0.0 {
        return argmax(logits);
    }
    let kept = filter(logits, p);
    let (ids, weights, total) = weigh(logits, kept, p.temp);
    // llama.cpp's `dist`: the first token whose running weight reaches the target. A zero weight
    // (an exponential that underflowed) never wins, not even a target of exactly zero.
    let target = rng.next_f64() * total;
    let mut run = 0.0f64;
    for (&t, &w) in ids.iter().zip(&weights) {
        run += w as f64;
        if w > 0.0 && run >= target {
            return t;
        }
    }
    ids.last().copied().unwrap_or_else(|| argmax(logits))
}

/// The tokens llama.cpp's default chain keeps from `logits` (modified in place: penalties), in the
/// chain's order, with the probabilities `dist` draws from: the candidate set before the draw.
///
/// The order is by logit, highest first (ties by token id), once any filter has sorted, and by
/// token id otherwise, as llama.cpp leaves its array. Tokens whose logit is -inf (a grammar's mask)
/// are left out: they have probability 0. `temp <= 0` keeps the argmax alone.
pub fn candidates(logits: &mut [f32], recent: &[u32], p: &SamplingParams) -> Vec<(u32, f32)> {
    apply_bias(logits, p);
    apply_penalties(logits, recent, p);
    if p.temp <= 0.0 {
        return vec![(argmax(logits), 1.0)];
    }
    let kept = filter(logits, p);
    let (ids, weights, total) = weigh(logits, kept, p.temp);
    if ids.len() == 1 {
        return vec![(ids[0], 1.0)];
    }
    ids.into_iter().zip(weights).map(|(t, w)| (t, (w as f64 / total) as f32)).collect()
}

/// Candidates in llama.cpp's array order; `sorted` as its flag: by logit, highest first.
struct Kept {
    ids: Vec<u32>,
    sorted: bool,
}

/// top-k, top-p, min-p on the (penalized) logits, in llama.cpp's order and f32 arithmetic, so that
/// a cut falls where llama.cpp's does even when a cumulative sum lands within rounding of top-p.
fn filter(logits: &[f32], p: &SamplingParams) -> Kept {
    // Strict (ids are unique), so every selection and sort below agrees on one order; llama.cpp
    // breaks ties between equal logits arbitrarily, this breaks them by token id.
    let desc = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let mut k = Kept { ids: (0..logits.len() as u32).collect(), sorted: false };
    if p.top_k > 0 {
        // llama.cpp sorts what it keeps even when k covers every candidate.
        let n = (p.top_k as usize).min(k.ids.len());
        if n < k.ids.len() {
            k.ids.select_nth_unstable_by(n - 1, desc);
            k.ids.truncate(n);
        }
        k.ids.sort_unstable_by(desc);
        k.sorted = true;
    }
    if p.top_p < 1.0 && !k.ids.is_empty() {
        top_p(logits, &mut k, p.top_p, desc);
    }
    if p.min_p > 0.0 && !k.ids.is_empty() {
        min_p(logits, &mut k, p.min_p, desc);
    }
    k
}

/// The smallest run of most likely tokens whose probabilities add up to `top_p`, with llama.cpp's
/// softmax: on the logits before temperature, the denominator summed in f32 in array order.
fn top_p(logits: &[f32], k: &mut Kept, top_p: f32, desc: impl Fn(&u32, &u32) -> std::cmp::Ordering + Copy) {
    let l = |t: u32| logits[t as usize];
    let max = if k.sorted { l(k.ids[0]) } else { k.ids.iter().fold(l(k.ids[0]), |m, &t| m.max(l(t))) };
    let mut sum = 0.0f32;
    for &t in &k.ids {
        sum += (l(t) - max).exp();
    }
    let prob = |t: u32| (l(t) - max).exp() / sum;
    // Sorted up to `n`; unsorted, the best 256 first, then four times as many until the mass is
    // reached (the set reached is the same however many were sorted first).
    let mut n = if k.sorted { k.ids.len() } else { 256.min(k.ids.len()) };
    loop {
        if !k.sorted {
            if n < k.ids.len() {
                k.ids.select_nth_unstable_by(n - 1, desc);
            }
            k.ids[..n].sort_unstable_by(desc);
        }
        let mut cum = 0.0f32;
        let reached = k.ids[..n].iter().position(|&t| {
            cum += prob(t);
            cum >= top_p
        });
        if let Some(i) = reached {
            k.ids.truncate(i + 1);
            break;
        }
        if n == k.ids.len() {
            // Rounding kept the sum under top_p: llama.cpp then keeps everything, sorted.
            break;
        }
        n = (n * 4).min(k.ids.len());
    }
    k.sorted = true;
}

/// Tokens at least `min_p` times as likely as the best, compared as logits (max + ln min_p), as
/// llama.cpp does on both its paths; unsorted candidates keep their order.
fn min_p(logits: &[f32], k: &mut Kept, min_p: f32, desc: impl Fn(&u32, &u32) -> std::cmp::Ordering) {
    let l = |t: u32| logits[t as usize];
    if k.sorted {
        let floor = l(k.ids[0]) + min_p.ln();
        let n = 1 + k.ids[1..].iter().take_while(|&&t| l(t) >= floor).count();
        k.ids.truncate(n);
        return;
    }
    let max = k.ids.iter().fold(-f32::MAX, |m, &t| m.max(l(t)));
    let floor = max + min_p.ln();
    let before = std::mem::take(&mut k.ids);
    k.ids = before.iter().copied().filter(|&t| l(t) >= floor).collect();
    if k.ids.is_empty() {
        // min_p > 1 (nothing reaches the floor): llama.cpp's sorted path keeps the best alone.
        k.ids = before.into_iter().min_by(|a, b| desc(a, b)).into_iter().collect();
        k.sorted = true;
    }
}

/// llama.cpp's temperature and `dist` softmax over the kept tokens: the logits divided by `temp`
/// in f32, `exp(l - max)` in f32, their sum in f64. Returns the tokens with a finite logit, their
/// weights and the weights' sum.
fn weigh(logits: &[f32], k: Kept, temp: f32) -> (Vec<u32>, Vec<f32>, f64) {
    let scaled = |t: u32| logits[t as usize] / temp;
    let ids: Vec<u32> = k.ids.into_iter().filter(|&t| scaled(t) != f32::NEG_INFINITY).collect();
    let Some(&first) = ids.first() else { return (ids, Vec::new(), 0.0) };
    let max = if k.sorted { scaled(first) } else { ids.iter().fold(scaled(first), |m, &t| m.max(scaled(t))) };
    let weights: Vec<f32> = ids.iter().map(|&t| (scaled(t) - max).exp()).collect();
    let total = weights.iter().map(|&w| w as f64).sum();
    (ids, weights, total)
}

/// Ids outside the vocabulary are skipped (the Python edge refuses them with a message first).
fn apply_bias(logits: &mut [f32], p: &SamplingParams) {
    for &(t, b) in &p.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
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

    fn kept(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f32)> {
        candidates(&mut logits.to_vec(), &[], p)
    }

    #[test]
    fn temperature_comes_after_the_filters() {
        // Probabilities at temp 1: 0.665, 0.245, 0.090 (top_p 0.9 keeps two). At temp 3 they
        // would be 0.45, 0.32, 0.23, which top_p 0.9 would keep whole had temperature come first.
        let logits = [2.0f32, 1.0, 0.0];
        let p = SamplingParams { temp: 3.0, top_p: 0.9, ..Default::default() };
        let k = kept(&logits, &p);
        assert_eq!(k.iter().map(|c| c.0).collect::<Vec<_>>(), [0, 1]);
        // The survivors softmaxed at temp 3: e^(1/3) : 1.
        let r = (1.0f64 / 3.0).exp();
        assert!((k[0].1 as f64 - r / (1.0 + r)).abs() < 1e-6, "{k:?}");
        // min_p 0.3 judges the unscaled logits: e^-1 = 0.37 stays, e^-2 = 0.14 goes, at any temp.
        let p = SamplingParams { temp: 5.0, min_p: 0.3, ..Default::default() };
        assert_eq!(kept(&logits, &p).iter().map(|c| c.0).collect::<Vec<_>>(), [0, 1]);
    }

    #[test]
    fn candidates_keep_llama_cpp_s_order() {
        let logits = [0.5f32, 3.0, 1.0, 3.0, -2.0];
        // No filter sorts: token order, all of them.
        let p = SamplingParams { temp: 1.0, ..Default::default() };
        assert_eq!(kept(&logits, &p).iter().map(|c| c.0).collect::<Vec<_>>(), [0, 1, 2, 3, 4]);
        // min_p alone filters in place (sorted, it would be 1, 3, 2).
        let p = SamplingParams { temp: 1.0, min_p: 0.1, ..Default::default() };
        assert_eq!(kept(&logits, &p).iter().map(|c| c.0).collect::<Vec<_>>(), [1, 2, 3]);
        // top-k sorts, even when it keeps everything; ties by token id.
        let p = SamplingParams { temp: 1.0, top_k: 10, ..Default::default() };
        assert_eq!(kept(&logits, &p).iter().map(|c| c.0).collect::<Vec<_>>(), [1, 3, 2, 0, 4]);
        // min_p above 1: nothing reaches the floor, the best stays alone.
        let p = SamplingParams { temp: 1.0, min_p: 2.0, ..Default::default() };
        assert_eq!(kept(&logits, &p), [(1, 1.0)]);
        // Greedy: the first maximum alone.
        assert_eq!(kept(&logits, &SamplingParams::default()), [(1, 1.0)]);
        // A masked (-inf) token is no candidate.
        let masked = [f32::NEG_INFINITY, 1.0, 0.0];
        let p = SamplingParams { temp: 0.7, ..Default::default() };
        assert_eq!(kept(&masked, &p).iter().map(|c| c.0).collect::<Vec<_>>(), [1, 2]);
    }

    #[test]
    fn top_p_over_a_large_vocabulary_reaches_past_the_first_batch() {
        // Flat logits over 5,000 tokens: top_p 0.5 needs 2,500 of them, past the first 256 sorted.
        let logits: Vec<f32> = (0..5000).map(|i| ((i * 7919) % 5000) as f32 * 1e-6).collect();
        let p = SamplingParams { temp: 1.0, top_p: 0.5, ..Default::default() };
        let k = kept(&logits, &p);
        assert!((2490..2510).contains(&k.len()), "{}", k.len());
        assert!(k.windows(2).all(|w| logits[w[0].0 as usize] >= logits[w[1].0 as usize]));
        let total: f64 = k.iter().map(|c| c.1 as f64).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }

    #[test]
    fn top_k_one_is_greedy() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7).sin()).collect();
        let p = SamplingParams { temp: 1.5, top_k: 1, ..Default::default() };
        for seed in 0..10 {
            assert_eq!(sample(&mut logits.clone(), &[], &p, &mut Rng::new(seed)), argmax(&logits));
        }
    }

    #[test]
    fn a_banned_token_is_never_drawn_and_a_boosted_one_always() {
        let logits = vec![3.0f32, 2.9, 1.0, 0.5];
        let ban = SamplingParams { temp: 1.0, logit_bias: vec![(0, f32::NEG_INFINITY)], ..Default::default() };
        let mut rng = Rng::new(9);
        for _ in 0..200 {
            assert_ne!(sample(&mut logits.clone(), &[], &ban, &mut rng), 0);
        }
        let greedy_ban = SamplingParams { logit_bias: vec![(0, f32::NEG_INFINITY)], ..Default::default() };
        assert!(!is_plain_greedy(&greedy_ban));
        assert_eq!(sample(&mut logits.clone(), &[], &greedy_ban, &mut rng), 1);
        let boost = SamplingParams { temp: 1.0, logit_bias: vec![(3, 100.0), (99, 5.0)], ..Default::default() };
        for _ in 0..200 {
            assert_eq!(sample(&mut logits.clone(), &[], &boost, &mut rng), 3);
        }
        let c = candidates(&mut logits.clone(), &[], &ban);
        assert!(c.iter().all(|&(t, _)| t != 0), "{c:?}");
        assert!(SamplingParams { logit_bias: vec![(1, f32::NAN)], ..Default::default() }.validate().is_err());
    }
}
