//! How many tokens each stream drafts in a step. A verify row costs what any other row of the
//! pass costs, so the answer depends on where the pass is: at one stream a step is bound by
//! reading the weights and extra rows ride along almost free; at sixteen the step is bound by
//! arithmetic and every row is paid for. The scheduler measures its own passes (time against
//! rows, fitted to a line) and adds draft tokens, most promising first, only while each one's
//! expected tokens per second beat the step's as planned so far. Speculation thus shrinks and
//! switches off by itself as the batch grows or a stream's drafts stop being accepted.

/// Older passes fade: the line follows a machine whose load changes.
const FORGET: f64 = 0.98;
/// Until rows have varied enough to fit a slope: assume a pass of this many rows costs twice
/// an empty one (weights read once, then arithmetic), a middle guess the fit soon replaces.
const PRIOR_ROWS: f64 = 32.0;

/// Seconds of one pass as a + b * rows, fitted online by least squares.
#[derive(Clone, Debug, Default)]
pub struct CostModel {
    w: f64,
    r: f64,
    rr: f64,
    t: f64,
    rt: f64,
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
    }

    /// (a, b), or None before the first pass.
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
}

/// A stream that may draft: its estimated per-token acceptance and the most it may draft.
#[derive(Clone, Copy, Debug)]
pub struct Candidate {
    pub alpha: f64,
    pub cap: usize,
}

/// Draft lengths, one per candidate. `decoding` streams emit one token each without drafts and
/// the pass already has `rows` rows; `target` is the target's cost line, `draft` the draft
/// model's (None for drafters that cost nothing, such as prompt lookup).
pub fn choose(cands: &[Candidate], decoding: usize, rows: f64, target: (f64, f64), draft: Option<(f64, f64)>) -> Vec<usize> {
    let (a, b) = target;
    let mut ks = vec![0usize; cands.len()];
    let (mut tokens, mut secs) = (decoding as f64, a + b * rows);
    // Draft passes already paid for: a draft model runs one batched pass per depth.
    let mut depth = 0;
    loop {
        let cost = |k: usize| b + draft.map_or(0.0, |(ad, bd)| bd + if k + 1 > depth { ad } else { 0.0 });
        // Under a geometric acceptance model the (k+1)-th draft is emitted with probability alpha^(k+1).
        let best = (0..cands.len())
            .filter(|&i| ks[i] < cands[i].cap)
            .map(|i| (i, cands[i].alpha.powi(ks[i] as i32 + 1), cost(ks[i])))
            .max_by(|x, y| (x.1 / x.2).total_cmp(&(y.1 / y.2)));
        let Some((i, gain, c)) = best else { break };
        if gain * secs <= c * tokens {
            break;
        }
        ks[i] += 1;
        depth = depth.max(ks[i]);
        tokens += gain;
        secs += c;
    }
    ks
}

/// Every this-many-th step runs without drafts, so plain decoding's speed stays measured.
const EXPLORE: u64 = 16;
/// Speculation must deliver at least this fraction of plain decoding's tokens per second...
const LOSS: f64 = 0.97;
/// ...measured over at least this many (decayed) steps of each kind, or it is held off...
const MIN_STEPS: f64 = 3.0;
/// ...for this many steps, and then measured afresh.
const HOLD: u64 = 256;

#[derive(Clone, Debug, Default)]
struct Rate {
    tokens: f64,
    secs: f64,
    steps: f64,
}

impl Rate {
    fn add(&mut self, tokens: usize, secs: f64) {
        const FORGET: f64 = 0.9;
        self.tokens = self.tokens * FORGET + tokens as f64;
        self.secs = self.secs * FORGET + secs;
        self.steps = self.steps * FORGET + 1.0;
    }

    fn per_sec(&self) -> f64 {
        self.tokens / self.secs.max(1e-9)
    }
}

/// The cost model is a model: this checks it against what speculation delivers. Decode-only
/// steps are timed whole (drafting, the pass, acceptance) and their tokens per second kept apart
/// for steps with drafts and steps without (one step in `EXPLORE` runs without, so both stay
/// measured on the same traffic); when drafting delivers less, speculation is held off for a
/// while, then tried again.
#[derive(Clone, Debug, Default)]
pub struct Guard {
    spec: Rate,
    plain: Rate,
    step: u64,
    off_until: u64,
}

impl Guard {
    /// Whether this step may draft.
    pub fn allow(&mut self) -> bool {
        self.step += 1;
        self.step >= self.off_until && !self.step.is_multiple_of(EXPLORE)
    }

    /// A decode-only step took `secs` and emitted `tokens`, with drafts or without.
    pub fn observe(&mut self, drafted: bool, tokens: usize, secs: f64) {
        if drafted { &mut self.spec } else { &mut self.plain }.add(tokens, secs);
        if self.spec.steps >= MIN_STEPS && self.plain.steps >= MIN_STEPS && self.spec.per_sec() < LOSS * self.plain.per_sec() {
            self.off_until = self.step + HOLD;
            self.spec = Rate::default();
        }
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
        assert!(held > 200, "{held}");
        // Afterwards it drafts again; a winning speculation is never held.
        let mut g = Guard::default();
        for _ in 0..400 {
            let drafted = g.allow();
            g.observe(drafted, if drafted { 15 } else { 10 }, 1.0);
        }
        assert!(!g.holding());
    }

    #[test]
    fn speculation_shrinks_as_the_batch_grows_and_acceptance_falls() {
        // Weights cost as much as 16 rows.
        let line = (0.016, 0.001);
        let good = Candidate { alpha: 0.8, cap: 8 };
        let one = choose(&[good], 1, 1.0, line, None);
        assert!(one[0] >= 4, "{one:?}");
        let sixteen = choose(&[good; 16], 16, 16.0, line, None);
        let total: usize = sixteen.iter().sum();
        assert!(total < 16 * one[0] / 2, "{sixteen:?}");
        let bad = choose(&[Candidate { alpha: 0.05, cap: 8 }; 16], 16, 16.0, line, None);
        assert_eq!(bad.iter().sum::<usize>(), 0, "{bad:?}");
        // An expensive draft model must earn its own passes.
        let costly = choose(&[Candidate { alpha: 0.3, cap: 8 }], 1, 1.0, line, Some((0.02, 0.001)));
        assert_eq!(costly, vec![0]);
        let cheap = choose(&[Candidate { alpha: 0.8, cap: 8 }], 1, 1.0, line, Some((0.002, 0.0001)));
        assert!(cheap[0] >= 3, "{cheap:?}");
        assert_eq!(choose(&[Candidate { alpha: 0.99, cap: 0 }], 1, 1.0, line, None), vec![0]);
    }
}
