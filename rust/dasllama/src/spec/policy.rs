//! How many tokens each stream drafts in a step. A verify row costs what any other row of the
//! pass costs, so the answer depends on where the pass is: at one stream a step is bound by
//! reading the weights and the first extra rows ride along almost free; at sixteen the step is
//! bound by arithmetic and every row is paid for. The scheduler measures its own passes (time by
//! size) and adds draft tokens, most promising first, only while each one's expected tokens per
//! second beat the step's as planned so far. Speculation thus shrinks and switches off by itself
//! as the batch grows or a stream's drafts stop being accepted.

use std::collections::BTreeMap;

/// Older passes fade: the line follows a machine whose load changes.
const FORGET: f64 = 0.98;
/// Until rows have varied enough to fit a slope: assume a pass of this many rows costs twice
/// an empty one (weights read once, then arithmetic), a middle guess the fit soon replaces.
const PRIOR_ROWS: f64 = 32.0;
/// A size's cost is the mean of about this many of its latest passes.
const SIZE_MEMORY: f64 = 8.0;

/// Seconds of one pass by its size in rows. Not a line: the kernels take activation rows in
/// groups, and a pass stays bound by reading the weights until its arithmetic outgrows that, so
/// on a CPU the second and third row of a pass cost little and the fourth a lot (1, 3, 4, 5
/// tokens of SmolLM2 on two AVX2 cores: 5.9, 7.5, 10.1, 14.9 ms). Each size measured is its own
/// recent mean; between measured sizes the cost is interpolated, and past them it follows a
/// line fitted to every pass.
#[derive(Clone, Debug, Default)]
pub struct CostModel {
    w: f64,
    r: f64,
    rr: f64,
    t: f64,
    rt: f64,
    /// Size (rows, rounded) -> (mean seconds, passes counted, at most `SIZE_MEMORY`).
    sizes: BTreeMap<u32, (f64, f64)>,
}

impl CostModel {
    pub fn observe(&mut self, rows: f64, secs: f64) {
        let r = rows;
        for v in [&mut self.w, &mut self.r, &mut self.rr, &mut self.t, &mut self.rt] {
            *v *= FORGET;
        }
        self.w += 1.0;
        self.r += r;
        self.rr += r * r;
        self.t += secs;
        self.rt += r * secs;
        let (mean, n) = self.sizes.entry(size(rows)).or_insert((0.0, 0.0));
        *n = (*n + 1.0).min(SIZE_MEMORY);
        *mean += (secs - *mean) / *n;
    }

    /// (a, b) of the fitted line seconds = a + b * rows, or None before the first pass.
    pub fn line(&self) -> Option<(f64, f64)> {
        if self.w < 1e-9 {
            return None;
        }
        let (mr, mt) = (self.r / self.w, self.t / self.w);
        let var = self.rr / self.w - mr * mr;
        let prior = mt / (mr + PRIOR_ROWS);
        // A slope from rows that barely varied is noise: keep the prior then. Otherwise keep it
        // physical: rows are never free, and never cost more than the whole mean pass.
        let b = if var < 4.0 { prior } else { ((self.rt / self.w - mr * mt) / var).clamp(mt / (mr + 4096.0), mt / mr.max(1.0)) };
        Some(((mt - b * mr).max(b), b))
    }

    /// Seconds of a pass of `rows` rows, or None before the first pass.
    pub fn cost(&self, rows: f64) -> Option<f64> {
        let (a, b) = self.line()?;
        let key = size(rows);
        let below = self.sizes.range(..=key).next_back();
        let above = self.sizes.range(key..).next();
        Some(match (below, above) {
            (Some((&k, &(t, _))), Some((&k1, _))) if k == k1 => t,
            (Some((&k0, &(t0, _))), Some((&k1, &(t1, _)))) => t0 + (t1 - t0) * (rows - k0 as f64) / (k1 - k0) as f64,
            (Some((&k0, &(t0, _))), None) => t0 + b * (rows - k0 as f64),
            (None, Some((&k1, &(t1, _)))) => (t1 - b * (k1 as f64 - rows)).max(b * rows),
            (None, None) => a + b * rows,
        })
    }
}

fn size(rows: f64) -> u32 {
    rows.round().max(0.0) as u32
}

/// A stream that may draft: the estimated chances that its first draft is accepted (`first`)
/// and that each later one is, given the one before was (`alpha`), and the most it may draft.
#[derive(Clone, Copy, Debug)]
pub struct Candidate {
    pub first: f64,
    pub alpha: f64,
    pub cap: usize,
}

/// Draft lengths, one per candidate. `decoding` streams emit one token each without drafts and
/// the pass already has `rows` rows, of which a verify row counts `row`; `target` prices a pass
/// by its rows, `draft` a draft model's pass by its rows (None for drafters that cost nothing,
/// such as prompt lookup).
pub fn choose(cands: &[Candidate], decoding: usize, rows: f64, row: f64, target: &dyn Fn(f64) -> f64, draft: Option<&dyn Fn(f64) -> f64>) -> Vec<usize> {
    let mut ks = vec![0usize; cands.len()];
    let (mut tokens, mut rows, mut pass) = (decoding as f64, rows, target(rows));
    let mut secs = pass;
    // A draft model runs one batched pass per depth: how many streams draft at each.
    let mut at_depth: Vec<usize> = Vec::new();
    loop {
        let grown = target(rows + row);
        let verify = grown - pass;
        let cost = |k: usize| {
            let n = at_depth.get(k).copied().unwrap_or(0) as f64;
            let drafting = draft.map_or(0.0, |d| d(n + 1.0) - if n > 0.0 { d(n) } else { 0.0 });
            (verify + drafting).max(1e-9)
        };
        // The (k+1)-th draft is emitted when it and all before it are accepted: first * alpha^k.
        let best = (0..cands.len())
            .filter(|&i| ks[i] < cands[i].cap)
            .map(|i| (i, cands[i].first * cands[i].alpha.powi(ks[i] as i32), cost(ks[i])))
            .max_by(|x, y| (x.1 / x.2).total_cmp(&(y.1 / y.2)));
        let Some((i, gain, c)) = best else { break };
        if gain * secs <= c * tokens {
            break;
        }
        if at_depth.len() <= ks[i] {
            at_depth.push(0);
        }
        at_depth[ks[i]] += 1;
        ks[i] += 1;
        tokens += gain;
        secs += c;
        rows += row;
        pass = grown;
    }
    ks
}

/// One drafting step in sixteen tries one draft fewer, and another one more, than chosen: the
/// sizes next to the chosen one stay measured, so the costs `choose` reads between measured
/// sizes (guesses there) cannot keep it from a better size. Each probe costs its step a little;
/// one in eight cost prompt lookup a few percent against the best fixed length.
pub fn probe(ks: &mut [usize], cands: &[Candidate], step: u64) {
    match step % 16 {
        3 => {
            if let Some(k) = ks.iter_mut().filter(|k| **k > 0).max() {
                *k -= 1;
            }
        }
        11 => {
            if let Some((k, _)) = ks.iter_mut().zip(cands).filter(|(k, c)| **k > 0 && **k < c.cap).min_by_key(|(k, _)| **k) {
                *k += 1;
            }
        }
        _ => {}
    }
}

/// A step runs without drafts when none has for this many steps, so that plain decoding's speed
/// stays measured. Steps that had nothing to draft (prompt lookup found no match) measure it as
/// well, so where those are common no step gives up its drafts for it.
const EXPLORE: u64 = 16;
/// Speculation must deliver at least this fraction of plain decoding's tokens per second, or
/// it is held off...
const LOSS: f64 = 0.95;
/// ...for this many steps (a few sentences, not a whole reply), and then measured afresh.
const HOLD: u64 = 64;

/// Tokens per second over recent steps of one kind, older ones fading by `forget` per step of
/// that kind; a verdict needs `min_steps` of them.
#[derive(Clone, Debug)]
struct Rate {
    forget: f64,
    min_steps: f64,
    tokens: f64,
    secs: f64,
    steps: f64,
}

impl Rate {
    fn new(forget: f64, min_steps: f64) -> Self {
        Rate { forget, min_steps, tokens: 0.0, secs: 0.0, steps: 0.0 }
    }

    fn add(&mut self, tokens: usize, secs: f64) {
        self.tokens = self.tokens * self.forget + tokens as f64;
        self.secs = self.secs * self.forget + secs;
        self.steps = self.steps * self.forget + 1.0;
    }

    fn per_sec(&self) -> Option<f64> {
        (self.steps >= self.min_steps).then(|| self.tokens / self.secs.max(1e-9))
    }

    fn reset(&mut self) {
        *self = Rate::new(self.forget, self.min_steps);
    }
}

/// The cost model is a model: this checks it against what speculation delivers. Decode-only
/// steps are timed whole (drafting, the pass, acceptance) and their tokens per second kept apart
/// for steps with drafts and steps without (at least one step in `EXPLORE` runs without, so both
/// stay measured on the same traffic); when drafting delivers less, speculation is held off for
/// a while, then tried again.
#[derive(Clone, Debug)]
pub struct Guard {
    spec: Rate,
    plain: Rate,
    step: u64,
    off_until: u64,
    /// The step that last ran without drafts.
    last_plain: u64,
}

impl Default for Guard {
    fn default() -> Self {
        Guard {
            // Acceptance comes in bursts (a drafter is often wholly right or wholly wrong for a
            // stretch), so drafting steps are judged over a long window lest one unlucky stretch
            // decide; plain steps cost the same every time and are rarer (one in `EXPLORE` while
            // drafting), so a few recent ones suffice.
            spec: Rate::new(0.97, 12.0),
            plain: Rate::new(0.9, 3.0),
            step: 0,
            off_until: 0,
            last_plain: 0,
        }
    }
}

impl Guard {
    /// Whether this step may draft.
    pub fn allow(&mut self) -> bool {
        self.step += 1;
        if self.step - self.last_plain >= EXPLORE {
            // Counted as run here, not when observed: a step that also prefills is never
            // observed, and must not keep the next ones plain too.
            self.last_plain = self.step;
            return false;
        }
        self.step >= self.off_until
    }

    /// A decode-only step took `secs` and emitted `tokens`, with drafts or without.
    pub fn observe(&mut self, drafted: bool, tokens: usize, secs: f64) {
        if !drafted {
            self.last_plain = self.step;
        }
        if drafted { &mut self.spec } else { &mut self.plain }.add(tokens, secs);
        if let (Some(spec), Some(plain)) = (self.spec.per_sec(), self.plain.per_sec()) {
            if spec < LOSS * plain {
                self.off_until = self.step + HOLD;
                self.spec.reset();
            }
        }
    }

    /// Steps seen so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    #[cfg(test)]
    fn holding(&self) -> bool {
        self.step < self.off_until
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_is_fitted_and_the_prior_holds_until_rows_vary() {
        let mut m = CostModel::default();
        assert!(m.line().is_none());
        m.observe(1.0, 0.010);
        let (a, b) = m.line().unwrap();
        assert!((a + b - 0.010).abs() < 1e-9 && a > b, "{a} {b}");
        for i in 0..200 {
            let rows = 1 + (i % 5) * 8;
            m.observe(rows as f64, 0.010 + 0.0005 * rows as f64);
        }
        let (a, b) = m.line().unwrap();
        assert!((a - 0.010).abs() < 1e-4 && (b - 0.0005).abs() < 1e-5, "{a} {b}");
    }

    #[test]
    fn a_losing_speculation_is_held_off_and_retried() {
        let mut g = Guard::default();
        let mut allowed = 0;
        for _ in 0..100 {
            if g.holding() {
                break;
            }
            let drafted = g.allow();
            allowed += drafted as usize;
            // Drafting delivers 20% fewer tokens per second.
            g.observe(drafted, if drafted { 8 } else { 10 }, 1.0);
        }
        assert!(g.holding() && allowed < 100, "{allowed}");
        let mut held = 0;
        while g.holding() {
            held += !g.allow() as usize;
            g.observe(false, 10, 1.0);
        }
        assert!(held >= HOLD as usize - 4, "{held}");
        // Afterwards it drafts again; a winning speculation is never held.
        let mut g = Guard::default();
        for _ in 0..400 {
            let drafted = g.allow();
            g.observe(drafted, if drafted { 15 } else { 10 }, 1.0);
        }
        assert!(!g.holding());
    }

    #[test]
    fn steps_with_nothing_to_draft_measure_plain_decoding_so_none_gives_up_its_drafts() {
        let mut g = Guard::default();
        let mut withheld = 0;
        for step in 0..200 {
            // Prompt lookup finds a match in four steps of five.
            let can = step % 5 != 0;
            let allowed = g.allow();
            withheld += (can && !allowed) as usize;
            g.observe(can && allowed, if can && allowed { 2 } else { 1 }, 1.0);
        }
        assert_eq!(withheld, 0);
        // Where every step could draft, one in `EXPLORE` still runs plainly.
        let mut g = Guard::default();
        let plain = (0..160).filter(|_| {
            let allowed = g.allow();
            g.observe(allowed, if allowed { 2 } else { 1 }, 1.0);
            !allowed
        });
        assert_eq!(plain.count(), 10);
        // Steps that also prefill are not observed: still one in `EXPLORE` runs plainly.
        let mut g = Guard::default();
        assert_eq!((0..160).filter(|_| !g.allow()).count(), 10);
    }

    #[test]
    fn sizes_are_priced_as_measured_and_between_them_interpolated() {
        let mut m = CostModel::default();
        assert!(m.cost(1.0).is_none());
        for _ in 0..4 {
            m.observe(1.0, 0.006);
            m.observe(3.0, 0.007);
            m.observe(9.0, 0.020);
        }
        let c = |r: f64| m.cost(r).unwrap();
        assert!((c(1.0) - 0.006).abs() < 1e-9 && (c(3.0) - 0.007).abs() < 1e-9, "{} {}", c(1.0), c(3.0));
        // Between measured sizes: on the straight line between them; past them, on the fit's slope.
        assert!((c(6.0) - 0.0135).abs() < 1e-9, "{}", c(6.0));
        assert!(c(12.0) > c(9.0) && c(0.2) < c(1.0) && c(0.2) > 0.0);
        // A size's cost follows its latest passes.
        for _ in 0..40 {
            m.observe(3.0, 0.010);
        }
        assert!((m.cost(3.0).unwrap() - 0.010).abs() < 1e-4);
    }

    #[test]
    fn speculation_shrinks_as_the_batch_grows_and_acceptance_falls() {
        // Weights cost as much as 16 rows.
        let line = |r: f64| 0.016 + 0.001 * r;
        let good = Candidate { first: 0.8, alpha: 0.8, cap: 8 };
        let one = choose(&[good], 1, 1.0, 1.0, &line, None);
        assert!(one[0] >= 4, "{one:?}");
        let sixteen = choose(&[good; 16], 16, 16.0, 1.0, &line, None);
        let total: usize = sixteen.iter().sum();
        assert!(total < 16 * one[0] / 2, "{sixteen:?}");
        let bad = choose(&[Candidate { first: 0.05, alpha: 0.05, cap: 8 }; 16], 16, 16.0, 1.0, &line, None);
        assert_eq!(bad.iter().sum::<usize>(), 0, "{bad:?}");
        // An expensive draft model must earn its own passes.
        let costly = choose(&[Candidate { first: 0.3, alpha: 0.3, cap: 8 }], 1, 1.0, 1.0, &line, Some(&|r| 0.02 + 0.001 * r));
        assert_eq!(costly, vec![0]);
        let cheap = choose(&[Candidate { first: 0.8, alpha: 0.8, cap: 8 }], 1, 1.0, 1.0, &line, Some(&|r| 0.002 + 0.0001 * r));
        assert!(cheap[0] >= 3, "{cheap:?}");
        assert_eq!(choose(&[Candidate { first: 0.99, alpha: 0.99, cap: 0 }], 1, 1.0, 1.0, &line, None), vec![0]);
        // Acceptance in runs: a first draft that is often wrong, and later ones that are right
        // once it was, are worth more drafts than the same first chance at every position.
        let runs = choose(&[Candidate { first: 0.5, alpha: 0.95, cap: 8 }], 1, 1.0, 1.0, &line, None);
        let flat = choose(&[Candidate { first: 0.5, alpha: 0.5, cap: 8 }], 1, 1.0, 1.0, &line, None);
        assert!(runs[0] > flat[0] + 2, "{runs:?} {flat:?}");
        // Where the third row is cheap and the fourth dear (a CPU's kernels), stop at two drafts.
        let knee = |r: f64| if r <= 3.0 { 0.006 + 0.0007 * (r - 1.0) } else { 0.0074 + 0.0027 * (r - 3.0) };
        assert_eq!(choose(&[good], 1, 1.0, 1.0, &knee, None), vec![2]);
    }

    #[test]
    fn probes_try_the_sizes_beside_the_choice() {
        let cands = [Candidate { first: 0.8, alpha: 0.8, cap: 4 }; 3];
        let mut ks = vec![2, 0, 4];
        probe(&mut ks, &cands, 3);
        assert_eq!(ks, vec![2, 0, 3]);
        probe(&mut ks, &cands, 11);
        assert_eq!(ks, vec![3, 0, 3]);
        for step in [5, 7, 36] {
            probe(&mut ks, &cands, step);
        }
        assert_eq!(ks, vec![3, 0, 3]);
    }
}
