//! ggml's x86 AVX2 summation order, for `Numerics::Ggml`: the same products as our fast kernels,
//! added up in the order llama.cpp's AVX2 CPU build adds them, so logits agree bit for bit.
//!
//! Why this exists: the models are chaotic at the level of float rounding. Q8 activation rounding
//! and f16 casts turn a one-ulp difference in a dot product into different integer quants further
//! on, and by the last layer into tenths of a nat. llama.cpp's own AVX-512 build differs from its
//! AVX2 build by that much on the golden prompts. Matching a reference therefore means matching its
//! summation order exactly; these row dots do, at a fraction of the tiled kernels' speed.
//!
//! The orders (ggml-cpu `arch/x86/quants.c` and `repack.cpp`, `vec.cpp`, `llamafile/sgemm.cpp`,
//! `tiled/`; AVX2 + FMA), checked bit for bit by `scripts/ggml_conformance.py`:
//! - 32-value block formats: eight f32 lanes, lane l holding the integer sum of values 4l..4l+4 of
//!   each block, accumulated as `fma(d_w * d_a, lane, acc)` block after block, then `hsum8`; the
//!   Q4_1/Q5_1 minimum terms are a separate scalar `fma(m, s, summs)` added last. tinyBLAS (prefill)
//!   uses the same arithmetic for the formats it covers.
//! - Repacked Q4_0, MXFP4 and Q4_K (8-row blocks): exact integer block or superblock sums, one
//!   `fma` each (MXFP4's scale `e8m0_half(e) * d_a`, as `gemv/gemm_mxfp4_8x8_q8_0` form it).
//! - Q5_K/Q6_K: lanes as above per superblock below eight rows, ggml's tiled path from eight.
//! - F32/F16 (weights, and f16 attention): tinyBLAS<8> for two rows or more (lane l sums elements
//!   l, l+8, ... by fma), `ggml_vec_dot_*` for one (four 8-lane accumulators over steps of 32,
//!   reduced pairwise).

use super::scalar::{a8k, bsum, high5, nib};
use super::{rd_f16, rd_f32, scale_min_k4, GgmlType};

/// The 32-value formats with AVX2 intrinsics where the CPU has them (ggml's own loops: integer
/// lane sums, `fmadd` per block, the same horizontal sum), else their scalar twins.
macro_rules! block32 {
    ($($name:ident = $fmt:expr, $body:ident;)*) => {$(
        fn $name(w: &[u8], a: &[u8], n: usize) -> f32 {
            #[cfg(target_arch = "x86_64")]
            if super::avx2::has_avx2() {
                // SAFETY: AVX2 and FMA were detected; the kernel reads n/32 blocks of each row,
                // which the callers' row lengths guarantee.
                return unsafe { simd::dot_32::<{ $fmt }>(w, a, n) };
            }
            $body(w, a, n)
        }
    )*};
}

block32! {
    dot_q4_0 = simd::Q4_0, dot_q4_0_body;
    dot_q4_1 = simd::Q4_1, dot_q4_1_body;
    dot_q5_0 = simd::Q5_0, dot_q5_0_body;
    dot_q5_1 = simd::Q5_1, dot_q5_1_body;
    dot_q8_0 = simd::Q8_0, dot_q8_0_body;
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    // The formats, as const parameters so each gets its own loop.
    pub const Q4_1: u8 = 0;
    pub const Q5_1: u8 = 1;
    pub const Q8_0: u8 = 2;
    pub const Q5_0: u8 = 3;
    pub const Q4_0: u8 = 4;

    #[inline(always)]
    unsafe fn f16(b: &[u8], at: usize) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le_bytes([b[at], b[at + 1]]) as i32)))
    }

    /// 32 bits to 32 bytes of 0xFF (bit set) or 0 (`bytes_from_bits_32`).
    #[inline(always)]
    unsafe fn bits_to_bytes(p: *const u8) -> __m256i {
        let x = _mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32));
        let shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
        let bytes = _mm256_or_si256(_mm256_shuffle_epi8(x, shuf), _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
        _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
    }

    /// 16 bytes of nibbles to 32 bytes: low nibbles first, then high ones (`bytes_from_nibbles_32`).
    #[inline(always)]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        let t = _mm_loadu_si128(p as *const __m128i);
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0xF))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_32<const F: u8>(w: &[u8], a: &[u8], n: usize) -> f32 {
        let wbytes = [20, 24, 34, 22, 18][F as usize];
        let abytes = if F <= Q5_1 { 36 } else { 34 };
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        let mut summs = 0.0f32;
        for ib in 0..n / 32 {
            let (wb, ab) = (&w[ib * wbytes..(ib + 1) * wbytes], &a[ib * abytes..(ib + 1) * abytes]);
            let q = _mm256_loadu_si256(ab[abytes - 32..].as_ptr() as *const __m256i);
            // Integer lane sums of four products each: exact whatever the instructions.
            let lanes = match F {
                Q4_1 | Q5_1 => {
                    let x = if F == Q4_1 {
                        nibbles(wb[4..].as_ptr())
                    } else {
                        _mm256_or_si256(nibbles(wb[8..].as_ptr()), _mm256_and_si256(bits_to_bytes(wb[4..].as_ptr()), _mm256_set1_epi8(0x10)))
                    };
                    summs = f16(wb, 2).mul_add(f16(ab, 2), summs);
                    _mm256_madd_epi16(_mm256_maddubs_epi16(x, q), ones)
                }
                _ => {
                    let x = match F {
                        Q8_0 => _mm256_loadu_si256(wb[2..].as_ptr() as *const __m256i),
                        Q4_0 => _mm256_sub_epi8(nibbles(wb[2..].as_ptr()), _mm256_set1_epi8(8)),
                        _ => _mm256_or_si256(nibbles(wb[6..].as_ptr()), _mm256_andnot_si256(bits_to_bytes(wb[2..].as_ptr()), _mm256_set1_epi8(0xF0u8 as i8))),
                    };
                    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(q, x)), ones)
                }
            };
            let d = _mm256_set1_ps(f16(wb, 0) * f16(ab, 0));
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lanes), acc);
        }
        let r = _mm_add_ps(_mm256_extractf128_ps(acc, 1), _mm256_castps256_ps128(acc));
        let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        let r = _mm_add_ss(r, _mm_movehdup_ps(r));
        _mm_cvtss_f32(r) + summs
    }
}

twice! {
    fn dot_q4_0_repacked(w: &[u8], a: &[u8], n: usize) -> f32 = dot_q4_0_repacked_body;
    fn dot_mxfp4_repacked(w: &[u8], a: &[u8], n: usize) -> f32 = dot_mxfp4_repacked_body;
    fn dot_q4_k_gemv(w: &[u8], a: &[u8], n: usize) -> f32 = dot_q4_k_body::<false>;
    fn dot_q4_k_gemm(w: &[u8], a: &[u8], n: usize) -> f32 = dot_q4_k_body::<true>;
    fn dot_f16_batch(w: &[u8], a: &[u8], n: usize) -> f32 = dot_f16_batch_body;
    fn dot_f16_single(w: &[u8], a: &[u8], n: usize) -> f32 = dot_f16_single_body;
    fn dot_f32_batch(w: &[u8], a: &[u8], n: usize) -> f32 = dot_f32_batch_body;
    fn dot_f32_single(w: &[u8], a: &[u8], n: usize) -> f32 = dot_f32_single_body;
    fn dot_q5_k(w: &[u8], a: &[u8], n: usize) -> f32 = dot_q5_k_body;
    fn dot_q5_k_tiled(w: &[u8], a: &[u8], n: usize) -> f32 = dot_q5_k_tiled_body;
    fn dot_q6_k(w: &[u8], a: &[u8], n: usize) -> f32 = dot_q6_k_body;
    fn dot_q6_k_tiled(w: &[u8], a: &[u8], n: usize) -> f32 = dot_q6_k_tiled_body;
    /// tinyBLAS<8> f16 dot (several query rows): lane l sums elements l, l+8, ... (`a.len()` a
    /// multiple of 8).
    pub fn lane_dot(a: &[f32], b: &[f32]) -> f32 = lane_dot_body;
    /// `ggml_vec_dot_f16` (one query row): four 8-lane accumulators over steps of 32 (`a.len()` a
    /// multiple of 32), folded (0+2) + (1+3) lane-wise, halves added, then pairs.
    pub fn vec_dot_f16(a: &[f32], b: &[f32]) -> f32 = vec_dot_f16_body;
}

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

#[inline(always)]
fn dot_q4_0_body(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_32(w, a, n, 18, 34, None, |b, j| nib(&b[2..], j) - 8)
}

#[inline(always)]
fn dot_q4_1_body(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_32(w, a, n, 20, 36, Some(2), |b, j| nib(&b[4..], j))
}

#[inline(always)]
fn dot_q5_0_body(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_32(w, a, n, 22, 34, None, |b, j| (nib(&b[6..], j) | high5(b, 2, j)) - 16)
}

#[inline(always)]
fn dot_q5_1_body(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_32(w, a, n, 24, 36, Some(2), |b, j| nib(&b[8..], j) | high5(b, 4, j))
}

#[inline(always)]
fn dot_q8_0_body(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_32(w, a, n, 34, 34, None, |b, j| b[2 + j] as i8 as i32)
}

/// Q4_0 as llama.cpp's x86 build runs it: repacked into 8-row blocks (`gemv/gemm_q4_0_8x8_q8_0`),
/// each block's exact integer sum scaled and added by one `fma` per row.
#[inline(always)]
fn dot_q4_0_repacked_body(w: &[u8], a: &[u8], n: usize) -> f32 {
    let mut acc = 0.0f32;
    for ib in 0..n / 32 {
        let (wb, ab) = (&w[ib * 18..(ib + 1) * 18], &a[ib * 34..(ib + 1) * 34]);
        let isum: i32 = (0..32).map(|j| (nib(&wb[2..], j) - 8) * ab[2 + j] as i8 as i32).sum();
        acc = (isum as f32).mul_add(rd_f16(wb, 0) * rd_f16(ab, 0), acc);
    }
    acc
}

/// MXFP4 as llama.cpp's x86 build runs it: repacked into 8-row blocks (`gemv/gemm_mxfp4_8x8_q8_0`,
/// the Q4_0 template with the levels looked up), each block's exact integer sum scaled by
/// `e8m0_half(e) * d_a` and added by one `fma` per row.
#[inline(always)]
fn dot_mxfp4_repacked_body(w: &[u8], a: &[u8], n: usize) -> f32 {
    use super::mxfp4::{e8m0_half, BLOCK_BYTES, KVALUES};
    let mut acc = 0.0f32;
    for ib in 0..n / 32 {
        let (wb, ab) = (&w[ib * BLOCK_BYTES..(ib + 1) * BLOCK_BYTES], &a[ib * 34..(ib + 1) * 34]);
        let isum: i32 = (0..32).map(|j| KVALUES[nib(&wb[1..], j) as usize] as i32 * ab[2 + j] as i8 as i32).sum();
        acc = (isum as f32).mul_add(e8m0_half(wb[0]) * rd_f16(ab, 0), acc);
    }
    acc
}

/// Q4_K as llama.cpp's x86 build runs it: repacked into 8-row blocks. Integer sums stay exact
/// and the scaled totals go to two f32 accumulators (scales and minimums, subtracted at the end):
/// once per superblock in `gemv_q4_K_8x8_q8_K` (single rows), once per 64 values in
/// `gemm_q4_K_8x8_q8_K` (rows in groups of four).
#[inline(always)]
fn dot_q4_k_body<const PER_64: bool>(w: &[u8], a: &[u8], n: usize) -> f32 {
    let (mut acc, mut acc_min) = (0.0f32, 0.0f32);
    for ib in 0..n / 256 {
        let wb = &w[ib * 144..(ib + 1) * 144];
        let ab = &a[ib * 292..(ib + 1) * 292];
        let (d, dmin) = (rd_f16(wb, 0) * rd_f32(ab, 0), rd_f16(wb, 2) * rd_f32(ab, 0));
        let (mut isum, mut msum) = (0i32, 0i32);
        for sb in 0..8 {
            let (sc, m) = scale_min_k4(sb, &wb[4..16]);
            let s: i32 = (0..32).map(|l| nib_k(&wb[16..144], sb, l) * a8k(ab, 32 * sb + l)).sum();
            isum += sc as i32 * s;
            msum += m as i32 * (bsum(ab, 2 * sb) + bsum(ab, 2 * sb + 1));
            if PER_64 && sb % 2 == 1 {
                acc = (isum as f32).mul_add(d, acc);
                acc_min = (msum as f32).mul_add(dmin, acc_min);
                (isum, msum) = (0, 0);
            }
        }
        if !PER_64 {
            acc = (isum as f32).mul_add(d, acc);
            acc_min = (msum as f32).mul_add(dmin, acc_min);
        }
    }
    acc - acc_min
}

/// A Q5_K value: sub-block `sb`, index `l`: a nibble and a fifth bit from `qh`.
fn q5k(wb: &[u8], sb: usize, l: usize) -> i32 {
    nib_k(&wb[48..176], sb, l) | ((((wb[16 + l] >> sb) & 1) as i32) << 4)
}

/// (scales, minimums) sums of one Q5_K superblock against q8_K activations: the exact integers.
fn q5k_sums(wb: &[u8], ab: &[u8]) -> ([i32; 8], i32) {
    let (mut lanes, mut msum) = ([0i32; 8], 0i32);
    for sb in 0..8 {
        let (sc, m) = scale_min_k4(sb, &wb[4..16]);
        for (l, lane) in lanes.iter_mut().enumerate() {
            *lane += sc as i32 * (4 * l..4 * l + 4).map(|j| q5k(wb, sb, j) * a8k(ab, 32 * sb + j)).sum::<i32>();
        }
        msum += m as i32 * (bsum(ab, 2 * sb) + bsum(ab, 2 * sb + 1));
    }
    (lanes, msum)
}

/// Q5_K (`ggml_vec_dot_q5_K_q8_K`, not repacked on x86): eight lanes of bytes 4l..4l+4 of every
/// 32-value sub-block, `fma(d, lane, acc)` per superblock; the minimums as one scalar `fma`.
#[inline(always)]
fn dot_q5_k_body(w: &[u8], a: &[u8], n: usize) -> f32 {
    let (mut acc, mut summs) = ([0.0f32; 8], 0.0f32);
    for ib in 0..n / 256 {
        let (wb, ab) = (&w[ib * 176..(ib + 1) * 176], &a[ib * 292..(ib + 1) * 292]);
        let (lanes, msum) = q5k_sums(wb, ab);
        let d = rd_f32(ab, 0) * rd_f16(wb, 0);
        let dmin = -rd_f32(ab, 0) * rd_f16(wb, 2);
        summs = dmin.mul_add(msum as f32, summs);
        for (acc, l) in acc.iter_mut().zip(lanes) {
            *acc = d.mul_add(l as f32, *acc);
        }
    }
    hsum8(acc) + summs
}

/// Q5_K in a matmul of at least eight rows (ggml's tiled path): per superblock
/// `res = fma(-dmin_w, msum, d_w * isum)`, `acc = fma(res, d_a, acc)`.
#[inline(always)]
fn dot_q5_k_tiled_body(w: &[u8], a: &[u8], n: usize) -> f32 {
    let mut acc = 0.0f32;
    for ib in 0..n / 256 {
        let (wb, ab) = (&w[ib * 176..(ib + 1) * 176], &a[ib * 292..(ib + 1) * 292]);
        let (lanes, msum) = q5k_sums(wb, ab);
        let res = (-rd_f16(wb, 2)).mul_add(msum as f32, rd_f16(wb, 0) * lanes.iter().sum::<i32>() as f32);
        acc = res.mul_add(rd_f32(ab, 0), acc);
    }
    acc
}

/// Q6_K (`ggml_vec_dot_q6_K_q8_K`, not repacked on x86): eight lanes, lane l holding bytes 4l..4l+4
/// of every 32-value chunk with the unsigned 6-bit values (each with its 16-value scale), minus 32
/// times the scaled activation sums of chunk l; `fma(d, lane, acc)` per superblock.
#[inline(always)]
fn dot_q6_k_body(w: &[u8], a: &[u8], n: usize) -> f32 {
    let mut acc = [0.0f32; 8];
    for ib in 0..n / 256 {
        let wb = &w[ib * 210..(ib + 1) * 210];
        let ab = &a[ib * 292..(ib + 1) * 292];
        let mut lanes = [0i32; 8];
        for (j, (q, sc)) in super::q6_k_values(wb).into_iter().enumerate() {
            lanes[(j % 32) / 4] += sc * (q + 32) * a8k(ab, j);
        }
        for (l, lane) in lanes.iter_mut().enumerate() {
            let sc = |g: usize| wb[192 + g] as i8 as i32;
            *lane -= 32 * (bsum(ab, 2 * l) * sc(2 * l) + bsum(ab, 2 * l + 1) * sc(2 * l + 1));
        }
        let d = rd_f32(ab, 0) * rd_f16(wb, 208);
        for (acc, l) in acc.iter_mut().zip(lanes) {
            *acc = d.mul_add(l as f32, *acc);
        }
    }
    hsum8(acc)
}

/// Q6_K in a matmul of at least eight activation rows: ggml's tiled K-quant path
/// (`ggml-cpu/tiled`), one exact integer sum per superblock, `fma(d_w * sum, d_a, acc)`.
#[inline(always)]
fn dot_q6_k_tiled_body(w: &[u8], a: &[u8], n: usize) -> f32 {
    let mut acc = 0.0f32;
    for ib in 0..n / 256 {
        let wb = &w[ib * 210..(ib + 1) * 210];
        let ab = &a[ib * 292..(ib + 1) * 292];
        let isum: i32 = super::q6_k_values(wb).iter().enumerate().map(|(j, &(q, sc))| sc * q * a8k(ab, j)).sum();
        acc = (rd_f16(wb, 208) * isum as f32).mul_add(rd_f32(ab, 0), acc);
    }
    acc
}

fn nib_k(qs: &[u8], sb: usize, l: usize) -> i32 {
    let byte = qs[32 * (sb / 2) + l];
    if sb % 2 == 1 {
        (byte >> 4) as i32
    } else {
        (byte & 0xF) as i32
    }
}

/// The row dots of one format in ggml's order. Which one a row gets depends on the batch, as in
/// ggml: repacked formats run rows in groups of four through their gemm kernel and the rest through
/// gemv; K-quants that are not repacked go through the tiled path in matmuls of eight rows or more.
#[derive(Clone, Copy, Debug)]
pub struct Dots {
    pub single: super::DotFn,
    pub grouped: super::DotFn,
    /// Whether row `j` of a session's `count` rows takes `grouped`.
    pub takes_grouped: fn(usize, usize) -> bool,
}

fn never(_: usize, _: usize) -> bool {
    false
}

fn in_a_four(j: usize, count: usize) -> bool {
    j < count - count % 4
}

fn two_or_more(_: usize, count: usize) -> bool {
    count >= 2
}

fn eight_or_more(_: usize, count: usize) -> bool {
    count >= 8
}

/// ggml's row dots for a `ty` matrix of `rows` x `cols`, where we reproduce them. ggml repacks Q4_0
/// and Q4_K matrices whose row count is a multiple of 8 (the others take paths we do not
/// reproduce); float rows whose length is not a multiple of 32 leave ggml's vector loops.
pub fn dots(ty: GgmlType, rows: usize, cols: usize) -> Option<Dots> {
    let repacked = rows.is_multiple_of(8);
    let whole = cols.is_multiple_of(32);
    let same = |f: super::DotFn| Dots { single: f, grouped: f, takes_grouped: never };
    Some(match ty {
        GgmlType::Q4_1 => same(dot_q4_1),
        GgmlType::Q5_0 => same(dot_q5_0),
        GgmlType::Q5_1 => same(dot_q5_1),
        GgmlType::Q8_0 => same(dot_q8_0),
        // tinyBLAS for matmuls of two rows or more, ggml_vec_dot_* for one.
        GgmlType::F16 if whole => Dots { single: dot_f16_single, grouped: dot_f16_batch, takes_grouped: two_or_more },
        GgmlType::F32 if whole => Dots { single: dot_f32_single, grouped: dot_f32_batch, takes_grouped: two_or_more },
        GgmlType::Q4_0 if repacked => same(dot_q4_0_repacked),
        GgmlType::Q4_0 => same(dot_q4_0),
        // Below eight rows ggml's own vec_dot (two accumulators over pairs of blocks) would be
        // the order: not reproduced, so such a matrix is refused.
        GgmlType::MXFP4 if repacked => same(dot_mxfp4_repacked),
        GgmlType::Q4K if repacked => Dots { single: dot_q4_k_gemv, grouped: dot_q4_k_gemm, takes_grouped: in_a_four },
        GgmlType::Q5K => Dots { single: dot_q5_k, grouped: dot_q5_k_tiled, takes_grouped: eight_or_more },
        GgmlType::Q6K => Dots { single: dot_q6_k, grouped: dot_q6_k_tiled, takes_grouped: eight_or_more },
        _ => return None,
    })
}

/// (index within its session, the session's row count) of each row of a batch of sessions with
/// `counts` rows each. Each session is its own ggml batch, so a row's order never depends on the
/// other sessions it is evaluated with.
pub fn row_positions(counts: &[usize]) -> Vec<(usize, usize)> {
    counts.iter().flat_map(|&c| (0..c).map(move |j| (j, c))).collect()
}

/// tinyBLAS<8>'s float dot of `n` values (a multiple of 8) read by `x` and `y`.
#[inline(always)]
fn lanes8(n: usize, x: impl Fn(usize) -> f32, y: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    for i in (0..n).step_by(8) {
        for (l, acc) in acc.iter_mut().enumerate() {
            *acc = x(i + l).mul_add(y(i + l), *acc);
        }
    }
    hsum8(acc)
}

/// `ggml_vec_dot_f16`/`_f32`'s dot of `n` values (a multiple of 32) read by `x` and `y`.
#[inline(always)]
fn four_accumulators(n: usize, x: impl Fn(usize) -> f32, y: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [[0.0f32; 8]; 4];
    for i in (0..n).step_by(32) {
        for (j, acc) in acc.iter_mut().enumerate() {
            for (l, acc) in acc.iter_mut().enumerate() {
                *acc = x(i + 8 * j + l).mul_add(y(i + 8 * j + l), *acc);
            }
        }
    }
    let x: [f32; 8] = std::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
    let t: [f32; 4] = std::array::from_fn(|i| x[i] + x[i + 4]);
    (t[0] + t[1]) + (t[2] + t[3])
}

#[inline(always)]
fn lane_dot_body(a: &[f32], b: &[f32]) -> f32 {
    lanes8(a.len(), |i| a[i], |i| b[i])
}

#[inline(always)]
fn vec_dot_f16_body(a: &[f32], b: &[f32]) -> f32 {
    four_accumulators(a.len(), |i| a[i], |i| b[i])
}

#[inline(always)]
fn dot_f16_batch_body(w: &[u8], a: &[u8], n: usize) -> f32 {
    lanes8(n, |i| rd_f16(w, 2 * i), |i| rd_f16(a, 2 * i))
}

#[inline(always)]
fn dot_f16_single_body(w: &[u8], a: &[u8], n: usize) -> f32 {
    four_accumulators(n, |i| rd_f16(w, 2 * i), |i| rd_f16(a, 2 * i))
}

#[inline(always)]
fn dot_f32_batch_body(w: &[u8], a: &[u8], n: usize) -> f32 {
    lanes8(n, |i| rd_f32(w, 4 * i), |i| rd_f32(a, 4 * i))
}

#[inline(always)]
fn dot_f32_single_body(w: &[u8], a: &[u8], n: usize) -> f32 {
    four_accumulators(n, |i| rd_f32(w, 4 * i), |i| rd_f32(a, 4 * i))
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
        // 1e8, 1 and -1e8 at elements 0, 8 and 16: tinyBLAS puts all three in lane 0 and loses
        // the 1 (1e8 + 1 rounds to 1e8); ggml_vec_dot_f16 spreads them over three accumulators
        // and folds 1e8 with -1e8 first.
        let mut a = vec![0.0f32; 32];
        (a[0], a[8], a[16]) = (1e8, 1.0, -1e8);
        let ones = vec![1.0f32; 32];
        assert_eq!(lane_dot(&a, &ones), 0.0);
        assert_eq!(vec_dot_f16(&a, &ones), 1.0);
    }

    #[test]
    fn both_builds_give_the_same_bits() {
        let mut rng = 12345u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let a: Vec<f32> = (0..256).map(|_| (next() % 20001) as f32 * 1e-4 - 1.0).collect();
        let b: Vec<f32> = (0..256).map(|_| (next() % 20001) as f32 * 1e-3 - 10.0).collect();
        assert_eq!(lane_dot(&a, &b).to_bits(), lane_dot_body(&a, &b).to_bits());
        assert_eq!(vec_dot_f16(&a, &b).to_bits(), vec_dot_f16_body(&a, &b).to_bits());
        let as_bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let as_f16 = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes()).collect() };
        let (wf, af) = (as_bytes(&a), as_bytes(&b));
        assert_eq!(dot_f32_single(&wf, &af, 256).to_bits(), dot_f32_single_body(&wf, &af, 256).to_bits());
        assert_eq!(dot_f32_batch(&wf, &af, 256).to_bits(), dot_f32_batch_body(&wf, &af, 256).to_bits());
        let (wh, ah) = (as_f16(&a), as_f16(&b));
        assert_eq!(dot_f16_single(&wh, &ah, 256).to_bits(), dot_f16_single_body(&wh, &ah, 256).to_bits());
        assert_eq!(dot_f16_batch(&wh, &ah, 256).to_bits(), dot_f16_batch_body(&wh, &ah, 256).to_bits());
        // Random weight and activation bytes with small, sane scales for every format.
        // (format, weight and activation block bytes, rows: Q4_0 with 7 rows is not repacked)
        let cases = [
            (GgmlType::Q4_0, 18, 34, 8),
            (GgmlType::Q4_0, 18, 34, 7),
            (GgmlType::Q4_1, 20, 36, 8),
            (GgmlType::Q5_0, 22, 34, 8),
            (GgmlType::Q5_1, 24, 36, 8),
            (GgmlType::Q8_0, 34, 34, 8),
            (GgmlType::Q4K, 144, 292, 8),
            (GgmlType::Q5K, 176, 292, 8),
            (GgmlType::Q6K, 210, 292, 8),
        ];
        for (ty, wb, ab, rows) in cases {
            let per = if wb >= 144 { 256 } else { 32 };
            // No -128: ggml's sign trick (as ours) wraps it, and no quantizer produces it.
            let byte = |v: u64| if v as u8 == 0x80 { 0x81 } else { v as u8 };
            let mut w: Vec<u8> = (0..wb * 8).map(|_| byte(next())).collect();
            let mut x: Vec<u8> = (0..ab * 8).map(|_| byte(next())).collect();
            for blk in 0..8 {
                let (wd, xd) = (&mut w[blk * wb..], &mut x[blk * ab..]);
                let h = half::f16::from_f32(0.01).to_bits().to_le_bytes();
                let at = if ty == GgmlType::Q6K { 208 } else { 0 };
                wd[at..at + 2].copy_from_slice(&h);
                if matches!(ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q4_1 | GgmlType::Q5_1) {
                    wd[2..4].copy_from_slice(&h); // dmin, or the 32-value formats' minimum
                }
                if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
                    xd[2..4].copy_from_slice(&h); // q8_1's sum term
                }
                if per == 256 {
                    xd[..4].copy_from_slice(&0.02f32.to_le_bytes());
                } else {
                    xd[..2].copy_from_slice(&h);
                }
            }
            let d = dots(ty, rows, 256).unwrap();
            let body: [super::super::DotFn; 2] = match (ty, rows) {
                (GgmlType::Q4_0, 8) => [dot_q4_0_repacked_body, dot_q4_0_repacked_body],
                (GgmlType::Q4_0, _) => [dot_q4_0_body, dot_q4_0_body],
                (GgmlType::Q4_1, _) => [dot_q4_1_body, dot_q4_1_body],
                (GgmlType::Q5_0, _) => [dot_q5_0_body, dot_q5_0_body],
                (GgmlType::Q5_1, _) => [dot_q5_1_body, dot_q5_1_body],
                (GgmlType::Q8_0, _) => [dot_q8_0_body, dot_q8_0_body],
                (GgmlType::Q4K, _) => [dot_q4_k_body::<false>, dot_q4_k_body::<true>],
                (GgmlType::Q5K, _) => [dot_q5_k_body, dot_q5_k_tiled_body],
                _ => [dot_q6_k_body, dot_q6_k_tiled_body],
            };
            let n = per * 8;
            assert_eq!((d.single)(&w, &x, n).to_bits(), body[0](&w, &x, n).to_bits(), "{ty:?}");
            assert_eq!((d.grouped)(&w, &x, n).to_bits(), body[1](&w, &x, n).to_bits(), "{ty:?}");
        }
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
