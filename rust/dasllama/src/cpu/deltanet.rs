//! The gated DeltaNet recurrence (qwen35, qwen3next) on the CPU: the causal depthwise
//! convolution over each session's last inputs, the L2 norms of Q and K, and the delta rule's
//! update of every value head's state, token after token. Each session's tokens run in order with
//! the same arithmetic however they are split into passes or batched beside other sessions, so a
//! chunked prefill ends in the state of a whole one and a row's output never depends on its batch.

use super::{ops, Team};
use crate::backend::{DeltaNet, DnParams};
use crate::kv::RecIo;

/// One DeltaNet layer over a batch: session i owns the next `counts[i]` rows and `states[i]`.
/// `qkv` (rows of conv_dim: the Q, K, V projection) is overwritten with the convolved, activated
/// and normalised channels; `beta` and `alpha` (rows of n_v: their projections) with the sigmoid
/// of beta and the decay exponent g; `out` gets each row's S^T q per value head (rows of value_dim).
#[allow(clippy::too_many_arguments)]
pub fn delta_net(
    dn: &DeltaNet,
    p: &DnParams,
    states: &mut [RecIo],
    counts: &[usize],
    qkv: &mut [f32],
    beta: &mut [f32],
    alpha: &mut [f32],
    out: &mut [f32],
    team: Option<&Team>,
) {
    let (cd, nv) = (dn.conv_dim(), dn.n_v_heads);
    let mut first = 0;
    for (st, &cnt) in states.iter_mut().zip(counts) {
        conv(dn, p.conv, st, &mut qkv[first * cd..(first + cnt) * cd]);
        first += cnt;
    }
    // Q and K heads (the first 2 * n_k heads of a row) to unit length, as ggml's
    // rms_norm(x, eps / n) / sqrt(n) makes them: x / sqrt(sum x^2 + eps).
    let qk = 2 * dn.key_dim();
    for row in qkv.chunks_exact_mut(cd) {
        for h in row[..qk].chunks_exact_mut(dn.head_dim) {
            let sum: f64 = h.iter().map(|&v| (v * v) as f64).sum();
            let n = dn.head_dim as f32;
            let scale = 1.0 / ((sum / n as f64) as f32 + dn.eps / n).sqrt() / n.sqrt();
            h.iter_mut().for_each(|v| *v *= scale);
        }
    }
    for (b, a) in beta.chunks_exact_mut(nv).zip(alpha.chunks_exact_mut(nv)) {
        for h in 0..nv {
            b[h] = 1.0 / (1.0 + (-b[h]).exp());
            a[h] = softplus(a[h] + p.dt_bias[h]) * p.a[h];
        }
    }
    recurrence(dn, states, counts, qkv, beta, alpha, out, team);
}

/// ggml's softplus: log(1 + e^x), and x itself past 20.
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (1.0 + x.exp()).ln()
    }
}

/// The causal depthwise convolution of one session's rows over its last `conv_kernel - 1` inputs,
/// then SiLU; the state keeps the last inputs. Channel c of row t: sum over taps j of
/// input[t + j - (K - 1)][c] * w[j][c], added tap by tap from the oldest (ggml's order).
fn conv(dn: &DeltaNet, w: &[f32], st: &mut RecIo, rows: &mut [f32]) {
    let (cd, hist) = (dn.conv_dim(), dn.conv_kernel - 1);
    let n = rows.len() / cd;
    CONV_SCRATCH.with_borrow_mut(|win| {
        // The window: the state's inputs, then this pass's.
        win.clear();
        win.extend_from_slice(st.conv_in);
        win.extend_from_slice(rows);
        for t in 0..n {
            let out = &mut rows[t * cd..(t + 1) * cd];
            out.fill(0.0);
            for j in 0..=hist {
                let x = &win[(t + j) * cd..(t + j + 1) * cd];
                let wj = &w[j * cd..(j + 1) * cd];
                out.iter_mut().zip(x.iter().zip(wj)).for_each(|(o, (x, w))| *o += x * w);
            }
            out.iter_mut().for_each(|v| *v = ops::silu(*v));
        }
        st.conv_out.copy_from_slice(&win[n * cd..]);
    });
}

thread_local! {
    static CONV_SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Raw pointers handed to the parallel tasks, each of which touches its own head's state and its
/// own head's columns of `out`.
#[derive(Clone, Copy)]
struct Ptr(*mut f32);
// SAFETY: see `recurrence`: the tasks write disjoint ranges and parallel_for joins before the
// borrows the pointers came from end.
unsafe impl Send for Ptr {}
unsafe impl Sync for Ptr {}

/// The delta rule per (session, value head), one task each, token after token: with S the head's
/// state (row j of the stored matrix holds S[.][j], so every step reads rows contiguously),
/// S <- exp(g) S; d = beta (v - S^T k); S <- S + k d^T; o = S^T q / sqrt(head_dim).
/// The first token reads the committed copy and writes the other; later ones update it in place.
#[allow(clippy::too_many_arguments)]
fn recurrence(dn: &DeltaNet, states: &mut [RecIo], counts: &[usize], qkv: &[f32], beta: &[f32], g: &[f32], out: &mut [f32], team: Option<&Team>) {
    let (hd, nv, cd, kd, vd) = (dn.head_dim, dn.n_v_heads, dn.conv_dim(), dn.key_dim(), dn.value_dim());
    let mut starts = Vec::with_capacity(counts.len());
    let mut first = 0;
    for &c in counts {
        starts.push(first);
        first += c;
    }
    let ins: Vec<&[f32]> = states.iter().map(|s| s.ssm_in).collect();
    let outs: Vec<Ptr> = states.iter_mut().map(|s| Ptr(s.ssm_out.as_mut_ptr())).collect();
    let o = Ptr(out.as_mut_ptr());
    let task = |i: usize| {
        // Capture the whole (Sync) wrapper, not its raw-pointer field.
        #[allow(clippy::redundant_locals)]
        let o = o;
        let (si, h) = (i / nv, i % nv);
        let kh = dn.k_head(h);
        let src = &ins[si][h * hd * hd..(h + 1) * hd * hd];
        // SAFETY: task (si, h) alone writes head h of session si's state (its own slice of a
        // buffer no other session shares) and columns h * hd.. of its own session's rows of `out`;
        // both buffers outlive the parallel loop, which joins before returning.
        let dst = unsafe { std::slice::from_raw_parts_mut(outs[si].0.add(h * hd * hd), hd * hd) };
        for t in starts[si]..starts[si] + counts[si] {
            let row = &qkv[t * cd..(t + 1) * cd];
            let (q, k, v) = (&row[kh * hd..(kh + 1) * hd], &row[kd + kh * hd..kd + (kh + 1) * hd], &row[2 * kd + h * hd..2 * kd + (h + 1) * hd]);
            // SAFETY: as above: this row's head-h columns belong to this task only.
            let o_t = unsafe { std::slice::from_raw_parts_mut(o.0.add(t * vd + h * hd), hd) };
            let from = if t == starts[si] { Some(src) } else { None };
            step(dst, from, (q, k, v), beta[t * nv + h], g[t * nv + h].exp(), o_t);
        }
    };
    let n_tasks = counts.len() * nv;
    match team {
        Some(team) if n_tasks > 1 => team.parallel_for(n_tasks, &task),
        _ => (0..n_tasks).for_each(task),
    }
}

/// One token of one head: `s` (hd rows of hd) is the state, read from `from` when given (the
/// committed copy) and updated in place otherwise. AVX2 where the rows are whole vectors; the
/// same operations in the same order either way, so both give the same bits.
fn step(s: &mut [f32], from: Option<&[f32]>, qkv: (&[f32], &[f32], &[f32]), beta: f32, decay: f32, o: &mut [f32]) {
    let hd = qkv.1.len();
    assert!(s.len() >= hd * hd && from.is_none_or(|f| f.len() >= hd * hd) && qkv.0.len() >= hd && qkv.2.len() >= hd && o.len() >= hd);
    #[cfg(target_arch = "x86_64")]
    if crate::quant::avx2::has_avx2() && hd.is_multiple_of(8) {
        // SAFETY: AVX2 was detected; the assert above bounds every row, q, k, v and o access.
        return unsafe { simd::step(s, from, qkv, beta, decay, o) };
    }
    step_body(s, from, qkv, beta, decay, o)
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::lanes;
    use std::arch::x86_64::*;

    /// State rows taken through each pass side by side, so their accumulator chains overlap.
    const R: usize = 4;

    /// `step_body` on eight lanes: per row, the products added lane by lane over steps of eight,
    /// then `lanes` (the tail, empty here, adds 0.0 as the scalar code does).
    #[target_feature(enable = "avx2")]
    pub unsafe fn step(s: &mut [f32], from: Option<&[f32]>, (q, k, v): (&[f32], &[f32], &[f32]), beta: f32, decay: f32, o: &mut [f32]) {
        let hd = k.len();
        let scale = 1.0 / (hd as f32).sqrt();
        let dec = _mm256_set1_ps(decay);
        let sum = |a: __m256| {
            let mut x = [0.0f32; 8];
            _mm256_storeu_ps(x.as_mut_ptr(), a);
            lanes(x) + 0.0
        };
        let mut j = 0;
        while j < hd {
            let n = R.min(hd - j);
            let base = s.as_mut_ptr().add(j * hd);
            let mut acc = [_mm256_setzero_ps(); R];
            for i in (0..hd).step_by(8) {
                let k8 = _mm256_loadu_ps(k.as_ptr().add(i));
                for (r, acc) in acc.iter_mut().enumerate().take(n) {
                    let p = base.add(r * hd + i);
                    let x = match from {
                        Some(src) => _mm256_loadu_ps(src.as_ptr().add((j + r) * hd + i)),
                        None => _mm256_loadu_ps(p),
                    };
                    let x = _mm256_mul_ps(x, dec);
                    _mm256_storeu_ps(p, x);
                    *acc = _mm256_add_ps(*acc, _mm256_mul_ps(x, k8));
                }
            }
            let d: [f32; R] = std::array::from_fn(|r| if r < n { (v[j + r] - sum(acc[r])) * beta } else { 0.0 });
            let mut acc = [_mm256_setzero_ps(); R];
            for i in (0..hd).step_by(8) {
                let (k8, q8) = (_mm256_loadu_ps(k.as_ptr().add(i)), _mm256_loadu_ps(q.as_ptr().add(i)));
                for (r, acc) in acc.iter_mut().enumerate().take(n) {
                    let p = base.add(r * hd + i);
                    let x = _mm256_add_ps(_mm256_loadu_ps(p), _mm256_mul_ps(_mm256_set1_ps(d[r]), k8));
                    _mm256_storeu_ps(p, x);
                    *acc = _mm256_add_ps(*acc, _mm256_mul_ps(x, q8));
                }
            }
            for r in 0..n {
                o[j + r] = sum(acc[r]) * scale;
            }
            j += n;
        }
    }
}

#[inline(always)]
fn step_body(s: &mut [f32], from: Option<&[f32]>, (q, k, v): (&[f32], &[f32], &[f32]), beta: f32, decay: f32, o: &mut [f32]) {
    let hd = k.len();
    let scale = 1.0 / (hd as f32).sqrt();
    for j in 0..hd {
        let row = &mut s[j * hd..(j + 1) * hd];
        // Decay the row and take its dot with k in one pass.
        let sk = match from {
            Some(src) => decay_dot(row, &src[j * hd..(j + 1) * hd], decay, k),
            None => decay_dot_in_place(row, decay, k),
        };
        let d = (v[j] - sk) * beta;
        o[j] = add_dot(row, d, k, q) * scale;
    }
}

/// row = src * decay; returns row . k (eight lanes, then their sum).
#[inline(always)]
fn decay_dot(row: &mut [f32], src: &[f32], decay: f32, k: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut i = 0;
    while i + 8 <= row.len() {
        for l in 0..8 {
            let x = src[i + l] * decay;
            row[i + l] = x;
            acc[l] += x * k[i + l];
        }
        i += 8;
    }
    let mut tail = 0.0;
    while i < row.len() {
        let x = src[i] * decay;
        row[i] = x;
        tail += x * k[i];
        i += 1;
    }
    lanes(acc) + tail
}

#[inline(always)]
fn decay_dot_in_place(row: &mut [f32], decay: f32, k: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut i = 0;
    while i + 8 <= row.len() {
        for l in 0..8 {
            let x = row[i + l] * decay;
            row[i + l] = x;
            acc[l] += x * k[i + l];
        }
        i += 8;
    }
    let mut tail = 0.0;
    while i < row.len() {
        let x = row[i] * decay;
        row[i] = x;
        tail += x * k[i];
        i += 1;
    }
    lanes(acc) + tail
}

/// row += d * k; returns row . q.
#[inline(always)]
fn add_dot(row: &mut [f32], d: f32, k: &[f32], q: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut i = 0;
    while i + 8 <= row.len() {
        for l in 0..8 {
            let x = row[i + l] + d * k[i + l];
            row[i + l] = x;
            acc[l] += x * q[i + l];
        }
        i += 8;
    }
    let mut tail = 0.0;
    while i < row.len() {
        let x = row[i] + d * k[i];
        row[i] = x;
        tail += x * q[i];
        i += 1;
    }
    lanes(acc) + tail
}

#[inline(always)]
fn lanes(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One row at a time, one pass after the other: the order `rows` keeps for every row.
    fn reference(s: &mut [f32], from: Option<&[f32]>, (q, k, v): (&[f32], &[f32], &[f32]), beta: f32, decay: f32, o: &mut [f32]) {
        let hd = k.len();
        let dot8 = |row: &[f32], x: &[f32]| {
            let n8 = hd / 8 * 8;
            let mut acc = [0.0f32; 8];
            for i in (0..n8).step_by(8) {
                for l in 0..8 {
                    acc[l] += row[i + l] * x[i + l];
                }
            }
            let mut tail = 0.0f32;
            for i in n8..hd {
                tail += row[i] * x[i];
            }
            lanes(acc) + tail
        };
        for j in 0..hd {
            let row = &mut s[j * hd..(j + 1) * hd];
            if let Some(src) = from {
                row.copy_from_slice(&src[j * hd..(j + 1) * hd]);
            }
            row.iter_mut().for_each(|x| *x *= decay);
            let d = (v[j] - dot8(row, k)) * beta;
            row.iter_mut().zip(k).for_each(|(x, k)| *x += d * k);
            o[j] = dot8(row, q) * (1.0 / (hd as f32).sqrt());
        }
    }

    #[test]
    fn interleaved_rows_give_each_row_its_own_bits() {
        let mut seed = 7u64;
        let mut f = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        };
        for hd in [128, 64, 24, 20, 6] {
            let src: Vec<f32> = (0..hd * hd).map(|_| f()).collect();
            let (q, k, v): (Vec<f32>, Vec<f32>, Vec<f32>) = ((0..hd).map(|_| f()).collect(), (0..hd).map(|_| f()).collect(), (0..hd).map(|_| f()).collect());
            let (mut want, mut got, mut plain) = (vec![0.0f32; hd * hd], vec![0.0f32; hd * hd], vec![0.0f32; hd * hd]);
            let (mut ow, mut og, mut op) = (vec![0.0f32; hd], vec![0.0f32; hd], vec![0.0f32; hd]);
            for t in 0..3 {
                let from = if t == 0 { Some(&src[..]) } else { None };
                reference(&mut want, from, (&q, &k, &v), 0.7, 0.9, &mut ow);
                step(&mut got, from, (&q, &k, &v), 0.7, 0.9, &mut og);
                step_body(&mut plain, from, (&q, &k, &v), 0.7, 0.9, &mut op);
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                let (simd_ok, scalar_ok) = (bits(&got) == bits(&want) && bits(&og) == bits(&ow), bits(&plain) == bits(&want) && bits(&op) == bits(&ow));
                let same = bits(&got) == bits(&plain);
                assert!(simd_ok && scalar_ok, "head dim {hd}, step {t}: simd {simd_ok} scalar {scalar_ok} simd==scalar {same}");
            }
        }
    }
}
