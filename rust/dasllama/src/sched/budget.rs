//! How many prompt tokens a step prefills: as many as fit a time budget beside the step's decode
//! rows, so that decoding streams keep a bounded gap between tokens while a long prompt is
//! prefilled, and the prompt still gets the rest of each step. A pass's cost is measured, not
//! assumed: seconds = a + b * rows + c * keys, fitted online to the scheduler's own passes, where
//! `rows` counts the rows through the layers (a logit row weighted by what its vocabulary matmul
//! adds) and `keys` the keys the rows attend (a prefill chunk at depth d attends about d per row,
//! and at a few thousand positions that is most of its cost on a small model).

use crate::model::Model;

/// Older passes fade: the fit follows a machine whose load changes.
const FORGET: f64 = 0.97;
/// How strongly the fit is held to the prior ratio of a key's cost to a row's (`Model` shapes
/// times `KEY_OP_COST`) where the passes so far do not tell them apart: a fraction of the rows'
/// own weight in the normal equations.
const PRIOR_WEIGHT: f64 = 0.01;
/// An attention multiply-add (f32, against f16 keys) over a weight multiply-add (int8): what a
/// key costs beside a row before any pass has measured it.
const KEY_OP_COST: f64 = 2.5;

/// The fitted cost of a pass. Features are scaled so that both slopes are in row units: keys
/// count as `key_rows` rows each (the prior), and the fit finds how far that is off.
#[derive(Clone, Debug)]
pub struct StepCost {
    /// Normal equations of the weighted least squares over x = (1, rows, key_rows * keys):
    /// the upper 3x3 is Σ x xᵀ, the last column Σ x t.
    s: [[f64; 4]; 3],
    key_rows: f64,
}

impl StepCost {
    pub fn new(m: &Model) -> Self {
        StepCost { s: [[0.0; 4]; 3], key_rows: key_rows(m) }
    }

    pub fn observe(&mut self, rows: f64, keys: f64, secs: f64) {
        let x = [1.0, rows, self.key_rows * keys];
        for (i, si) in self.s.iter_mut().enumerate() {
            for (j, v) in si.iter_mut().enumerate() {
                *v = *v * FORGET + x[i] * if j < 3 { x[j] } else { secs };
            }
        }
    }

    /// Seconds of a pass of `rows` rows attending `keys` keys (None until a few passes are in).
    pub fn predict(&self, rows: f64, keys: f64) -> Option<f64> {
        let (a, b, c) = self.fit()?;
        Some(a + b * rows + c * self.key_rows * keys)
    }

    /// (a, b, c) with c per scaled key, each kept physical (none negative; rows never free).
    fn fit(&self) -> Option<(f64, f64, f64)> {
        let s = &self.s;
        if s[0][0] < 2.5 {
            return None;
        }
        let mut m = *s;
        // The prior: c = b, weighted as a small part of the rows' spread, so that passes which
        // all attend alike (decode at one depth) leave the keys' slope where the shapes put it.
        let var_r = (s[1][1] - s[0][1] * s[0][1] / s[0][0]).max(s[1][1] * 1e-3);
        let w = PRIOR_WEIGHT * var_r;
        m[1][1] += w;
        m[2][2] += w;
        m[1][2] -= w;
        m[2][1] -= w;
        // A little ridge on every coefficient keeps the system solvable with few passes.
        for (i, mi) in m.iter_mut().enumerate() {
            mi[i] += 1e-9 * (1.0 + s[i][i]);
        }
        let (a, b, c) = solve3(m)?;
        let mean_t = s[0][3] / s[0][0];
        let mean_r = s[0][1] / s[0][0];
        let b = b.max(mean_t / (mean_r + 4096.0));
        Some((a.max(0.0), b, c.max(0.0)))
    }
}

/// Gaussian elimination with partial pivoting on an augmented 3x4 system.
fn solve3(mut m: [[f64; 4]; 3]) -> Option<(f64, f64, f64)> {
    for col in 0..3 {
        let p = (col..3).max_by(|&i, &j| m[i][col].abs().total_cmp(&m[j][col].abs()))?;
        if m[p][col].abs() < 1e-300 {
            return None;
        }
        m.swap(col, p);
        let pivot = m[col];
        for (r, row) in m.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot[col];
                row.iter_mut().zip(&pivot).skip(col).for_each(|(v, p)| *v -= f * p);
            }
        }
    }
    let x = (m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2]);
    (x.0.is_finite() && x.1.is_finite() && x.2.is_finite()).then_some(x)
}

/// What one attended key costs in rows through the layers, by the shapes: the multiply-adds of a
/// key (q·k and p·v in every attention layer) over a row's weight multiply-adds, times the
/// relative cost of the attention's kind of multiply-add.
fn key_rows(m: &Model) -> f64 {
    let c = &m.config;
    let per_key = c.kv_layers() as f64 * 2.0 * c.q_dim() as f64;
    KEY_OP_COST * per_key / c.macs_per_row().max(1.0)
}

/// The largest k <= max with cost(k) <= budget, for a cost that grows with k (0 if none fits).
pub fn largest_within(max: usize, budget: f64, cost: impl Fn(usize) -> f64) -> usize {
    let (mut lo, mut hi) = (0, max);
    if cost(max) <= budget {
        return max;
    }
    // cost(lo) <= budget (or lo == 0) < cost(hi)
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if cost(mid) <= budget {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model_free(key_rows: f64) -> StepCost {
        StepCost { s: [[0.0; 4]; 3], key_rows }
    }

    #[test]
    fn fits_what_passes_cost() {
        // a = 5 ms, 1 ms a row, 2 us a key: decode steps at one depth and chunks at several.
        let mut c = model_free(1e-3);
        let t = |r: f64, k: f64| 0.005 + 0.001 * r + 2e-6 * k;
        for i in 0..60 {
            let (r, k) = if i % 3 == 0 { (72.0, 64.0 * (500.0 + 40.0 * i as f64)) } else { (8.0, 8.0 * 300.0) };
            c.observe(r, k, t(r, k));
        }
        for (r, k) in [(8.0, 2400.0), (40.0, 40.0 * 3000.0), (200.0, 1e5)] {
            let p = c.predict(r, k).unwrap();
            assert!((p - t(r, k)).abs() < 0.05 * t(r, k), "{r} {k}: {p} vs {}", t(r, k));
        }
    }

    #[test]
    fn keys_follow_the_prior_until_measured() {
        // Every pass alike in keys per row: the slope of keys is the prior's (c = b).
        let mut c = model_free(0.01);
        for i in 0..30 {
            let r = 1.0 + (i % 8) as f64;
            c.observe(r, 100.0 * r, 0.002 + 0.001 * r * 2.0);
        }
        let (_, b, k) = c.fit().unwrap();
        assert!(k > 0.0 && b > 0.0);
        assert!(c.predict(10.0, 1e4).unwrap() > c.predict(10.0, 0.0).unwrap());
    }

    #[test]
    fn largest_within_bisects() {
        assert_eq!(largest_within(100, 50.0, |k| k as f64), 50);
        assert_eq!(largest_within(100, 500.0, |k| k as f64), 100);
        assert_eq!(largest_within(100, -1.0, |k| k as f64), 0);
        assert_eq!(largest_within(100, 10.0, |k| (k * k) as f64), 3);
    }
}
