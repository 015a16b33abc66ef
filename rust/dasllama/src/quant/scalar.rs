//! Scalar dot products: the reference every SIMD kernel is tested against. Each one computes the
//! exact integer sum per block and applies the block scales in f32, as ggml's generic path does.

use super::{rd_f16, rd_f32, scale_min_k4, GgmlType};
use half::bf16;

/// The reference of `quant::q8_block`.
pub fn q8_block(x: &[f32], q: &mut [u8]) -> (f32, i32) {
    let amax = x[..32].iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for j in 0..32 {
        let v = super::round_even(x[j] * id) as i32;
        sum += v;
        q[j] = v as i8 as u8;
    }
    (d, sum)
}

/// The reference of `quant::q8k_block`.
pub fn q8k_block(xb: &[f32], b: &mut [u8]) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in &xb[..256] {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        b[..292].fill(0);
        return;
    }
    let iscale = -127.0 / max;
    for j in 0..256 {
        let q = (super::round_even(iscale * xb[j]) as i32).min(127);
        b[4 + j] = q as i8 as u8;
    }
    for g in 0..16 {
        let s: i32 = (0..16).map(|j| b[4 + 16 * g + j] as i8 as i32).sum();
        b[260 + 2 * g..262 + 2 * g].copy_from_slice(&(s as i16).to_le_bytes());
    }
    b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
}

pub fn dot_fn(ty: GgmlType) -> super::DotFn {
    match ty {
        GgmlType::F32 => dot_f32,
        GgmlType::F16 => dot_f16,
        GgmlType::BF16 => dot_bf16,
        GgmlType::Q4_0 => dot_q4_0,
        GgmlType::Q4_1 => dot_q4_1,
        GgmlType::Q5_0 => dot_q5_0,
        GgmlType::Q5_1 => dot_q5_1,
        GgmlType::Q8_0 => dot_q8_0,
        GgmlType::Q4K => dot_q4_k,
        GgmlType::Q5K => dot_q5_k,
        GgmlType::Q6K => dot_q6_k,
        GgmlType::IQ4NL => super::iq4::dot_nl_scalar,
        GgmlType::IQ4XS => super::iq4::dot_xs_scalar,
        GgmlType::MXFP4 => super::mxfp4::dot_scalar,
        GgmlType::Q8_1 | GgmlType::Q8K => unreachable!("activation-only format"),
    }
}

pub fn dot_f32(w: &[u8], a: &[u8], n: usize) -> f32 {
    (0..n).map(|i| rd_f32(w, 4 * i) * rd_f32(a, 4 * i)).sum()
}

pub fn dot_f16(w: &[u8], a: &[u8], n: usize) -> f32 {
    (0..n).map(|i| rd_f16(w, 2 * i) * rd_f16(a, 2 * i)).sum()
}

pub fn dot_bf16(w: &[u8], a: &[u8], n: usize) -> f32 {
    let r = |b: &[u8], i: usize| bf16::from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])).to_f32();
    (0..n).map(|i| r(w, i) * r(a, i)).sum()
}

/// Shared body of the 32-value formats: `wq(block, j)` yields the j-th integer weight.
#[inline(always)]
fn dot_32<F: Fn(&[u8], usize) -> i32>(w: &[u8], a: &[u8], n: usize, wbytes: usize, abytes: usize, min_at: Option<usize>, wq: F) -> f32 {
    let aoff = abytes - 32;
    let mut sum = 0.0f32;
    for ib in 0..n / 32 {
        let wb = &w[ib * wbytes..(ib + 1) * wbytes];
        let ab = &a[ib * abytes..(ib + 1) * abytes];
        let isum: i32 = (0..32).map(|j| wq(wb, j) * ab[aoff + j] as i8 as i32).sum();
        sum += rd_f16(wb, 0) * rd_f16(ab, 0) * isum as f32;
        if let Some(m) = min_at {
            sum += rd_f16(wb, m) * rd_f16(ab, 2);
        }
    }
    sum
}

#[inline(always)]
pub(super) fn nib(qs: &[u8], j: usize) -> i32 {
    if j < 16 {
        (qs[j] & 0xF) as i32
    } else {
        (qs[j - 16] >> 4) as i32
    }
}

#[inline(always)]
pub(super) fn high5(b: &[u8], at: usize, j: usize) -> i32 {
    let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    (((qh >> j) & 1) << 4) as i32
}

pub fn dot_q4_0(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_32(w, a, n, 18, 34, None, |b, j| nib(&b[2..], j) - 8)
}

pub fn dot_q4_1(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_32(w, a, n, 20, 36, Some(2), |b, j| nib(&b[4..], j))
}

pub fn dot_q5_0(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_32(w, a, n, 22, 34, None, |b, j| (nib(&b[6..], j) | high5(b, 2, j)) - 16)
}

pub fn dot_q5_1(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_32(w, a, n, 24, 36, Some(2), |b, j| nib(&b[8..], j) | high5(b, 4, j))
}

pub fn dot_q8_0(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_32(w, a, n, 34, 34, None, |b, j| b[2 + j] as i8 as i32)
}

#[inline(always)]
pub(super) fn a8k(ab: &[u8], j: usize) -> i32 {
    ab[4 + j] as i8 as i32
}

#[inline(always)]
pub(super) fn bsum(ab: &[u8], g: usize) -> i32 {
    i16::from_le_bytes([ab[260 + 2 * g], ab[261 + 2 * g]]) as i32
}

fn dot_qk45(w: &[u8], a: &[u8], n: usize, five: bool) -> f32 {
    let wbytes = if five { 176 } else { 144 };
    let mut sum = 0.0f32;
    for ib in 0..n / 256 {
        let wb = &w[ib * wbytes..(ib + 1) * wbytes];
        let ab = &a[ib * 292..(ib + 1) * 292];
        let scales = &wb[4..16];
        let qs = if five { &wb[48..176] } else { &wb[16..144] };
        let (mut isum, mut msum) = (0i32, 0i32);
        for sb in 0..8 {
            let (sc, m) = scale_min_k4(sb, scales);
            let (chunk, hi) = (sb / 2, sb % 2 == 1);
            let mut s = 0i32;
            for l in 0..32 {
                let byte = qs[32 * chunk + l];
                let mut q = if hi { (byte >> 4) as i32 } else { (byte & 0xF) as i32 };
                if five {
                    q |= (((wb[16 + l] >> sb) & 1) as i32) << 4;
                }
                s += q * a8k(ab, 32 * sb + l);
            }
            isum += sc as i32 * s;
            msum += m as i32 * (bsum(ab, 2 * sb) + bsum(ab, 2 * sb + 1));
        }
        let d8 = rd_f32(ab, 0);
        sum += d8 * rd_f16(wb, 0) * isum as f32 - d8 * rd_f16(wb, 2) * msum as f32;
    }
    sum
}

pub fn dot_q4_k(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_qk45(w, a, n, false)
}

pub fn dot_q5_k(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_qk45(w, a, n, true)
}

pub fn dot_q6_k(w: &[u8], a: &[u8], n: usize) -> f32 {
    let mut sum = 0.0f32;
    for ib in 0..n / 256 {
        let wb = &w[ib * 210..(ib + 1) * 210];
        let ab = &a[ib * 292..(ib + 1) * 292];
        let isum: i32 = super::q6_k_values(wb).iter().enumerate().map(|(j, &(q, sc))| sc * q * a8k(ab, j)).sum();
        sum += rd_f32(ab, 0) * rd_f16(wb, 208) * isum as f32;
    }
    sum
}
