//! ggml's x86 AVX2 summation order, for `Numerics::Ggml`: the same products as our fast kernels,
//! added up in the order llama.cpp's AVX2 CPU build adds them, so logits agree bit for bit.
//!
//! Why this exists: the models are chaotic at the level of float rounding. Q8 activation rounding
//! and f16 casts turn a one-ulp difference in a dot product into different integer quants further
//! on, and by the last layer into tenths of a nat. llama.cpp's own AVX-512 build differs from its
//! AVX2 build by that much on the golden prompts. Matching a reference therefore means matching its
//! summation order exactly; these scalar loops do, at a fraction of the fast kernels' speed.
//!
//! The orders (ggml-cpu `quants.c`, `vec.cpp`, `llamafile/sgemm.cpp`, AVX2 + FMA):
//! - 32-value block formats: eight f32 lanes, lane l holding the integer sum of values 4l..4l+4 of
//!   each block, accumulated as `fma(d_w * d_a, lane, acc)` block after block, then `hsum8`; the
//!   Q4_1/Q5_1 minimum terms are a separate scalar `fma(m, s, summs)` added last. tinyBLAS (prefill)
//!   uses the same arithmetic for the formats it covers.
//! - f16 attention with several query rows (tinyBLAS<8>): lane l sums elements l, l+8, ... by fma.
//! - f16 attention with one query row (`ggml_vec_dot_f16`): four 8-lane accumulators over steps of
//!   32, reduced pairwise.

use super::{rd_f16, GgmlType};

/// `hsum_float_8`: the high half added to the low half, then (0+2) + (1+3).
fn hsum8(a: [f32; 8]) -> f32 {
    let r: [f32; 4] = std::array::from_fn(|i| a[i + 4] + a[i]);
    (r[0] + r[2]) + (r[1] + r[3])
}

#[inline(always)]
fn dot_32<F: Fn(&[u8], usize) -> i32>(w: &[u8], a: &[u8], n: usize, wbytes: usize, abytes: usize, min_at: Option<usize>, wq: F) -> f32 {
    let aoff = abytes - 32;
    let mut acc = [0.0f32; 8];
    let mut summs = 0.0f32;
    for ib in 0..n / 32 {
        let wb = &w[ib * wbytes..(ib + 1) * wbytes];
        let ab = &a[ib * abytes..(ib + 1) * abytes];
        if let Some(m) = min_at {
            summs = rd_f16(wb, m).mul_add(rd_f16(ab, 2), summs);
        }
        let d = rd_f16(wb, 0) * rd_f16(ab, 0);
        for (l, acc) in acc.iter_mut().enumerate() {
            let isum: i32 = (4 * l..4 * l + 4).map(|j| wq(wb, j) * ab[aoff + j] as i8 as i32).sum();
            *acc = d.mul_add(isum as f32, *acc);
        }
    }
    hsum8(acc) + summs
}

fn nib(qs: &[u8], j: usize) -> i32 {
    if j < 16 {
        (qs[j] & 0xF) as i32
    } else {
        (qs[j - 16] >> 4) as i32
    }
}

fn high5(b: &[u8], at: usize, j: usize) -> i32 {
    let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    (((qh >> j) & 1) << 4) as i32
}

fn dot_q4_1(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_32(w, a, n, 20, 36, Some(2), |b, j| nib(&b[4..], j))
}

fn dot_q5_0(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_32(w, a, n, 22, 34, None, |b, j| (nib(&b[6..], j) | high5(b, 2, j)) - 16)
}

fn dot_q5_1(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_32(w, a, n, 24, 36, Some(2), |b, j| nib(&b[8..], j) | high5(b, 4, j))
}

fn dot_q8_0(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_32(w, a, n, 34, 34, None, |b, j| b[2 + j] as i8 as i32)
}

/// The row dot in ggml's order for `ty`, where we reproduce it. Q4_0 is left out on purpose:
/// llama.cpp repacks Q4_0 weights into interleaved blocks with yet another order.
pub fn dot_fn(ty: GgmlType) -> Option<super::DotFn> {
    Some(match ty {
        GgmlType::Q4_1 => dot_q4_1,
        GgmlType::Q5_0 => dot_q5_0,
        GgmlType::Q5_1 => dot_q5_1,
        GgmlType::Q8_0 => dot_q8_0,
        _ => return None,
    })
}

/// tinyBLAS<8> f16 dot (several query rows): lane l sums elements l, l+8, ... (`a.len()` a
/// multiple of 8).
pub fn lane_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] = ca[l].mul_add(cb[l], acc[l]);
        }
    }
    hsum8(acc)
}

/// `ggml_vec_dot_f16` (one query row): four 8-lane accumulators over steps of 32 (`a.len()` a
/// multiple of 32), folded (0+2) + (1+3) lane-wise, halves added, then pairs.
pub fn vec_dot_f16(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [[0.0f32; 8]; 4];
    for (ca, cb) in a.chunks_exact(32).zip(b.chunks_exact(32)) {
        for (j, acc) in acc.iter_mut().enumerate() {
            for l in 0..8 {
                acc[l] = ca[8 * j + l].mul_add(cb[8 * j + l], acc[l]);
            }
        }
    }
    let x: [f32; 8] = std::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
    let t: [f32; 4] = std::array::from_fn(|i| x[i] + x[i + 4]);
    (t[0] + t[1]) + (t[2] + t[3])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_differ_from_a_plain_sum_but_agree_on_exact_values() {
        // Small integers: every order gives the exact sum.
        let a: Vec<f32> = (0..64).map(|i| (i % 7) as f32).collect();
        let b: Vec<f32> = (0..64).map(|i| (i % 5) as f32 - 2.0).collect();
        let exact: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert_eq!(lane_dot(&a, &b), exact);
        assert_eq!(vec_dot_f16(&a, &b), exact);
        // Values whose sum depends on the order: the two orders are not interchangeable.
        let a: Vec<f32> = (0..64).map(|i| 1.0 + (i as f32) * 1e-3).collect();
        let b: Vec<f32> = (0..64).map(|i| if i % 9 == 0 { 1e4 } else { 1e-4 * i as f32 }).collect();
        assert_ne!(lane_dot(&a, &b), vec_dot_f16(&a, &b));
    }

    #[test]
    fn block_dot_matches_the_reference_integers() {
        // One Q8_0 block of weights 1..32 (d = 1) against activations of 1 (d = 0.5).
        let mut w = vec![0u8; 34];
        w[..2].copy_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
        (0..32).for_each(|j| w[2 + j] = (j as i8 + 1) as u8);
        let mut a = vec![1u8; 34];
        a[..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        assert_eq!(dot_q8_0(&w, &a, 32), 0.5 * (32 * 33 / 2) as f32);
    }
}
