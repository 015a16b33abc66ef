//! AVX2+FMA dot products. Each has a scalar twin in `scalar.rs` and a test that they agree.
//! Integer block sums are exact in both, so the twins differ only in f32 summation order.

use super::GgmlType;
use std::arch::x86_64::*;
use std::sync::OnceLock;

fn has_avx2() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        std::env::var_os("DASLLAMA_NO_SIMD").is_none()
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

/// The 1-row x 4-activation kernel for `ty`: unpacks each weight block once for four rows of
/// activations, and computes each of the four results with exactly the single-row arithmetic.
pub fn dot4_fn(ty: GgmlType) -> Option<super::Dot4Fn> {
    if !has_avx2() {
        return None;
    }
    Some(match ty {
        GgmlType::Q4_0 => dot4_q4_0,
        GgmlType::Q4_1 => dot4_q4_1,
        GgmlType::Q5_0 => dot4_q5_0,
        GgmlType::Q8_0 => dot4_q8_0,
        _ => return None,
    })
}

macro_rules! safe_entry4 {
    ($name:ident, $inner:ident, $wb:expr, $ab:expr) => {
        pub fn $name(w: &[u8], a: [&[u8]; 4], n: usize) -> [f32; 4] {
            let nb = n / 32;
            assert!(w.len() >= nb * $wb && a.iter().all(|r| r.len() >= nb * $ab));
            // SAFETY: handed out only after detecting AVX2, FMA and F16C; the assert bounds every load.
            unsafe { $inner(w.as_ptr(), [a[0].as_ptr(), a[1].as_ptr(), a[2].as_ptr(), a[3].as_ptr()], nb) }
        }
    };
}

safe_entry4!(dot4_q4_0, q4_0_x4, 18, 34);
safe_entry4!(dot4_q4_1, q4_1_x4, 20, 36);
safe_entry4!(dot4_q5_0, q5_0_x4, 22, 34);
safe_entry4!(dot4_q8_0, q8_0_x4, 34, 34);

/// Four weight rows against one activation row, for decode: four independent accumulation chains
/// instead of one, each computed exactly as the single-row kernel computes it.
pub fn rows4_fn(ty: GgmlType) -> Option<super::Rows4Fn> {
    if !has_avx2() {
        return None;
    }
    Some(match ty {
        GgmlType::Q4_0 => rows4_q4_0,
        GgmlType::Q4_1 => rows4_q4_1,
        GgmlType::Q5_0 => rows4_q5_0,
        GgmlType::Q8_0 => rows4_q8_0,
        _ => return None,
    })
}

macro_rules! safe_rows4 {
    ($name:ident, $inner:ident, $wb:expr, $ab:expr) => {
        pub fn $name(w: [&[u8]; 4], a: &[u8], n: usize) -> [f32; 4] {
            let nb = n / 32;
            assert!(a.len() >= nb * $ab && w.iter().all(|r| r.len() >= nb * $wb));
            // SAFETY: handed out only after detecting AVX2, FMA and F16C; the assert bounds every load.
            unsafe { $inner([w[0].as_ptr(), w[1].as_ptr(), w[2].as_ptr(), w[3].as_ptr()], a.as_ptr(), nb) }
        }
    };
}

safe_rows4!(rows4_q4_0, q4_0_r4, 18, 34);
safe_rows4!(rows4_q4_1, q4_1_r4, 20, 36);
safe_rows4!(rows4_q5_0, q5_0_r4, 22, 34);
safe_rows4!(rows4_q8_0, q8_0_r4, 34, 34);

#[inline(always)]
unsafe fn signed_r4(w: [*const u8; 4], a: *const u8, nb: usize, wbytes: usize, unpack: impl Fn(*const u8) -> __m256i) -> [f32; 4] {
    let mut acc = [_mm256_setzero_ps(); 4];
    for i in 0..nb {
        let ab = a.add(i * 34);
        let da = f16_at(ab);
        let y = _mm256_loadu_si256(ab.add(2) as *const __m256i);
        for k in 0..4 {
            let wb = w[k].add(i * wbytes);
            let q = unpack(wb);
            let d = _mm256_set1_ps(f16_at(wb) * da);
            acc[k] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot_i8_i8(q, y)), acc[k]);
        }
    }
    [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])]
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_r4(w: [*const u8; 4], a: *const u8, nb: usize) -> [f32; 4] {
    let eight = _mm256_set1_epi8(8);
    signed_r4(w, a, nb, 18, |wb| _mm256_sub_epi8(nibbles(wb.add(2)), eight))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0_r4(w: [*const u8; 4], a: *const u8, nb: usize) -> [f32; 4] {
    let f0 = _mm256_set1_epi8(0xF0u8 as i8);
    signed_r4(w, a, nb, 22, |wb| _mm256_or_si256(nibbles(wb.add(6)), _mm256_andnot_si256(bytes_from_bits(wb.add(2)), f0)))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_r4(w: [*const u8; 4], a: *const u8, nb: usize) -> [f32; 4] {
    signed_r4(w, a, nb, 34, |wb| _mm256_loadu_si256(wb.add(2) as *const __m256i))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1_r4(w: [*const u8; 4], a: *const u8, nb: usize) -> [f32; 4] {
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut summs = [0.0f32; 4];
    for i in 0..nb {
        let ab = a.add(i * 36);
        let (da, sa) = (f16_at(ab), f16_at(ab.add(2)));
        let y = _mm256_loadu_si256(ab.add(4) as *const __m256i);
        for k in 0..4 {
            let wb = w[k].add(i * 20);
            summs[k] += f16_at(wb.add(2)) * sa;
            let d = _mm256_set1_ps(f16_at(wb) * da);
            acc[k] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot_u8_i8(nibbles(wb.add(4)), y)), acc[k]);
        }
    }
    [hsum(acc[0]) + summs[0], hsum(acc[1]) + summs[1], hsum(acc[2]) + summs[2], hsum(acc[3]) + summs[3]]
}

/// Signed weights (|q| <= 127) against four q8_0 activation rows; `unpack` yields the block's
/// i8 weights. Mirrors the single-row kernels: per row, acc = fma(dw*da, dot, acc), then hsum.
#[inline(always)]
unsafe fn signed_x4(w: *const u8, a: [*const u8; 4], nb: usize, wbytes: usize, unpack: impl Fn(*const u8) -> __m256i) -> [f32; 4] {
    let mut acc = [_mm256_setzero_ps(); 4];
    for i in 0..nb {
        let wb = w.add(i * wbytes);
        let dw = f16_at(wb);
        let q = unpack(wb);
        let qa = _mm256_sign_epi8(q, q);
        for k in 0..4 {
            let ab = a[k].add(i * 34);
            let d = _mm256_set1_ps(dw * f16_at(ab));
            let y = _mm256_sign_epi8(_mm256_loadu_si256(ab.add(2) as *const __m256i), q);
            acc[k] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot_u8_i8(qa, y)), acc[k]);
        }
    }
    [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])]
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_x4(w: *const u8, a: [*const u8; 4], nb: usize) -> [f32; 4] {
    let eight = _mm256_set1_epi8(8);
    signed_x4(w, a, nb, 18, |wb| _mm256_sub_epi8(nibbles(wb.add(2)), eight))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0_x4(w: *const u8, a: [*const u8; 4], nb: usize) -> [f32; 4] {
    let f0 = _mm256_set1_epi8(0xF0u8 as i8);
    signed_x4(w, a, nb, 22, |wb| _mm256_or_si256(nibbles(wb.add(6)), _mm256_andnot_si256(bytes_from_bits(wb.add(2)), f0)))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_x4(w: *const u8, a: [*const u8; 4], nb: usize) -> [f32; 4] {
    signed_x4(w, a, nb, 34, |wb| _mm256_loadu_si256(wb.add(2) as *const __m256i))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1_x4(w: *const u8, a: [*const u8; 4], nb: usize) -> [f32; 4] {
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut summs = [0.0f32; 4];
    for i in 0..nb {
        let wb = w.add(i * 20);
        let (dw, mw) = (f16_at(wb), f16_at(wb.add(2)));
        let q = nibbles(wb.add(4));
        for k in 0..4 {
            let ab = a[k].add(i * 36);
            summs[k] += mw * f16_at(ab.add(2));
            let d = _mm256_set1_ps(dw * f16_at(ab));
            let y = _mm256_loadu_si256(ab.add(4) as *const __m256i);
            acc[k] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot_u8_i8(q, y)), acc[k]);
        }
    }
    [hsum(acc[0]) + summs[0], hsum(acc[1]) + summs[1], hsum(acc[2]) + summs[2], hsum(acc[3]) + summs[3]]
}

/// The AVX2 kernel for `ty`, when this CPU has AVX2+FMA+F16C and one is written for `ty`.
pub fn dot_fn(ty: GgmlType) -> Option<super::DotFn> {
    if !has_avx2() {
        return None;
    }
    Some(match ty {
        GgmlType::Q4_0 => dot_q4_0,
        GgmlType::Q4_1 => dot_q4_1,
        GgmlType::Q5_0 => dot_q5_0,
        GgmlType::Q8_0 => dot_q8_0,
        GgmlType::Q4K => dot_q4_k,
        GgmlType::Q6K => dot_q6_k,
        GgmlType::F32 => dot_f32,
        _ => return None,
    })
}

macro_rules! safe_entry {
    ($name:ident, $inner:ident, $wb:expr, $ab:expr, $blk:expr) => {
        pub fn $name(w: &[u8], a: &[u8], n: usize) -> f32 {
            assert!(w.len() >= n / $blk * $wb && a.len() >= n / $blk * $ab);
            // SAFETY: dot_fn hands these out only after detecting AVX2, FMA and F16C, and the
            // assert above bounds every load the kernel makes.
            unsafe { $inner(w.as_ptr(), a.as_ptr(), n / $blk) }
        }
    };
}

safe_entry!(dot_q4_0, q4_0_impl, 18, 34, 32);
safe_entry!(dot_q4_1, q4_1_impl, 20, 36, 32);
safe_entry!(dot_q5_0, q5_0_impl, 22, 34, 32);
safe_entry!(dot_q8_0, q8_0_impl, 34, 34, 32);
safe_entry!(dot_q4_k, q4_k_impl, 144, 292, 256);
safe_entry!(dot_q6_k, q6_k_impl, 210, 292, 256);
safe_entry!(dot_f32, f32_impl, 4, 4, 1);

#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128((p as *const u16).read_unaligned() as i32)))
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// 16 bytes of nibbles -> 32 bytes: low nibbles first, then high nibbles (ggml's order).
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> __m256i {
    let t = _mm_loadu_si128(p as *const __m128i);
    let m = _mm_set1_epi8(0xF);
    let lo = _mm_and_si128(t, m);
    let hi = _mm_and_si128(_mm_srli_epi16(t, 4), m);
    _mm256_set_m128i(hi, lo)
}

/// 32 bits -> 32 bytes of 0xFF where the bit is set.
#[inline(always)]
unsafe fn bytes_from_bits(p: *const u8) -> __m256i {
    let x = (p as *const u32).read_unaligned() as i32;
    let shuf = _mm256_set_epi64x(
        0x0303030303030303,
        0x0202020202020202,
        0x0101010101010101,
        0x0000000000000000,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x), shuf);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
}

/// Sum of u8*i8 products as 8 i32 lanes.
#[inline(always)]
unsafe fn dot_u8_i8(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// Sum of i8*i8 products as 8 i32 lanes.
#[inline(always)]
unsafe fn dot_i8_i8(x: __m256i, y: __m256i) -> __m256i {
    dot_u8_i8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_impl(w: *const u8, a: *const u8, nb: usize) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let eight = _mm256_set1_epi8(8);
    for i in 0..nb {
        let (wb, ab) = (w.add(i * 18), a.add(i * 34));
        let d = _mm256_set1_ps(f16_at(wb) * f16_at(ab));
        let q = _mm256_sub_epi8(nibbles(wb.add(2)), eight);
        let y = _mm256_loadu_si256(ab.add(2) as *const __m256i);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot_i8_i8(q, y)), acc);
    }
    hsum(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1_impl(w: *const u8, a: *const u8, nb: usize) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut summs = 0.0f32;
    for i in 0..nb {
        let (wb, ab) = (w.add(i * 20), a.add(i * 36));
        summs += f16_at(wb.add(2)) * f16_at(ab.add(2));
        let d = _mm256_set1_ps(f16_at(wb) * f16_at(ab));
        let q = nibbles(wb.add(4));
        let y = _mm256_loadu_si256(ab.add(4) as *const __m256i);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot_u8_i8(q, y)), acc);
    }
    hsum(acc) + summs
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0_impl(w: *const u8, a: *const u8, nb: usize) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let f0 = _mm256_set1_epi8(0xF0u8 as i8);
    for i in 0..nb {
        let (wb, ab) = (w.add(i * 22), a.add(i * 34));
        let d = _mm256_set1_ps(f16_at(wb) * f16_at(ab));
        // (q | h<<4) - 16 as i8 is q where the high bit is set and q|0xF0 where it is not.
        let hi = _mm256_andnot_si256(bytes_from_bits(wb.add(2)), f0);
        let q = _mm256_or_si256(nibbles(wb.add(6)), hi);
        let y = _mm256_loadu_si256(ab.add(2) as *const __m256i);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot_i8_i8(q, y)), acc);
    }
    hsum(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_impl(w: *const u8, a: *const u8, nb: usize) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for i in 0..nb {
        let (wb, ab) = (w.add(i * 34), a.add(i * 34));
        let d = _mm256_set1_ps(f16_at(wb) * f16_at(ab));
        let q = _mm256_loadu_si256(wb.add(2) as *const __m256i);
        let y = _mm256_loadu_si256(ab.add(2) as *const __m256i);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot_i8_i8(q, y)), acc);
    }
    hsum(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f32_impl(w: *const u8, a: *const u8, n: usize) -> f32 {
    let (w, a) = (w as *const f32, a as *const f32);
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(w.add(i)), _mm256_loadu_ps(a.add(i)), acc);
        i += 8;
    }
    let mut s = hsum(acc);
    while i < n {
        s += w.add(i).read_unaligned() * a.add(i).read_unaligned();
        i += 1;
    }
    s
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_impl(w: *const u8, a: *const u8, nb: usize) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut accm = 0.0f32;
    let m4 = _mm256_set1_epi8(0xF);
    for i in 0..nb {
        let (wb, ab) = (w.add(i * 144), a.add(i * 292));
        let d8 = (ab as *const f32).read_unaligned();
        let d = d8 * f16_at(wb);
        let dmin = d8 * f16_at(wb.add(2));
        let sc = std::slice::from_raw_parts(wb.add(4), 12);
        let mut sumi = _mm256_setzero_si256();
        let mut msum = 0i32;
        let bs = ab.add(260) as *const i16;
        for j in 0..4 {
            let (s1, m1) = super::scale_min_k4(2 * j, sc);
            let (s2, m2) = super::scale_min_k4(2 * j + 1, sc);
            msum += m1 as i32 * (bs.add(4 * j).read_unaligned() as i32 + bs.add(4 * j + 1).read_unaligned() as i32);
            msum += m2 as i32 * (bs.add(4 * j + 2).read_unaligned() as i32 + bs.add(4 * j + 3).read_unaligned() as i32);
            let q = _mm256_loadu_si256(wb.add(16 + 32 * j) as *const __m256i);
            let lo = _mm256_and_si256(q, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            let y1 = _mm256_loadu_si256(ab.add(4 + 64 * j) as *const __m256i);
            let y2 = _mm256_loadu_si256(ab.add(4 + 64 * j + 32) as *const __m256i);
            let p1 = _mm256_mullo_epi32(dot_u8_i8(lo, y1), _mm256_set1_epi32(s1 as i32));
            let p2 = _mm256_mullo_epi32(dot_u8_i8(hi, y2), _mm256_set1_epi32(s2 as i32));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p1, p2));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
        accm += dmin * msum as f32;
    }
    hsum(acc) - accm
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_impl(w: *const u8, a: *const u8, nb: usize) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let m4 = _mm256_set1_epi8(0xF);
    let m2 = _mm256_set1_epi8(3);
    let m32 = _mm256_set1_epi8(32);
    for i in 0..nb {
        let (wb, ab) = (w.add(i * 210), a.add(i * 292));
        let d = (ab as *const f32).read_unaligned() * f16_at(wb.add(208));
        let mut sumi = _mm256_setzero_si256();
        for half in 0..2 {
            let ql = wb.add(64 * half);
            let qh = _mm256_loadu_si256(wb.add(128 + 32 * half) as *const __m256i);
            let sc = wb.add(192 + 8 * half) as *const i8;
            let ql0 = _mm256_loadu_si256(ql as *const __m256i);
            let ql1 = _mm256_loadu_si256(ql.add(32) as *const __m256i);
            let qs = [
                _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4)),
                _mm256_or_si256(
                    _mm256_and_si256(ql1, m4),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4),
                ),
            ];
            for (k, q) in qs.iter().enumerate() {
                // q in 0..63 unsigned; (q-32)*y = q*y - 32*y.
                let y = _mm256_loadu_si256(ab.add(4 + 128 * half + 32 * k) as *const __m256i);
                let p = _mm256_maddubs_epi16(*q, y);
                let p32 = _mm256_maddubs_epi16(m32, y);
                let p = _mm256_sub_epi16(p, p32);
                // lanes 0..7 (i16 pairs 0..15 of the low 128) belong to scale is, high half to is+1.
                let s_lo = *sc.add(2 * k) as i16;
                let s_hi = *sc.add(2 * k + 1) as i16;
                let scv = _mm256_set_m128i(_mm_set1_epi16(s_hi), _mm_set1_epi16(s_lo));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, scv));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum(acc)
}
