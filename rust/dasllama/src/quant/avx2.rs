//! AVX2+FMA dot products. Each has a scalar twin in `scalar.rs` and a test that they agree.
//! Integer block sums are exact in both, so the twins differ only in f32 summation order.

use super::{Dot4Fn, DotFn, GgmlType, Kernels, Rows4Fn};
use std::arch::x86_64::*;
use std::sync::OnceLock;

pub(crate) fn has_avx2() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        std::env::var_os("DASLLAMA_NO_SIMD").is_none()
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

/// AVX-VNNI (vpdpbusd on 256-bit vectors); `DASLLAMA_NO_VNNI` turns it off for comparisons.
fn has_vnni() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| std::env::var_os("DASLLAMA_NO_VNNI").is_none() && is_x86_feature_detected!("avxvnni"))
}

/// The AVX2 kernels for `ty`, when this CPU has AVX2+FMA+F16C and they are written for `ty`.
pub fn kernels(ty: GgmlType) -> Option<Kernels> {
    if !has_avx2() {
        return None;
    }
    let vnni = has_vnni();
    let k = |plain: (DotFn, Dot4Fn, Rows4Fn), with_vnni: (DotFn, Dot4Fn, Rows4Fn)| {
        let (dot, dot4, rows4) = if vnni { with_vnni } else { plain };
        Kernels { dot, dot4: Some(dot4), rows4: Some(rows4), repacked: true }
    };
    let single = |dot: DotFn| Kernels { dot, dot4: None, rows4: None, repacked: false };
    Some(match ty {
        GgmlType::Q4_0 => k((dot_q4_0, dot4_q4_0, rows4_q4_0), (vnni_dot_q4_0, vnni_dot4_q4_0, vnni_rows4_q4_0)),
        GgmlType::Q4_1 => k((dot_q4_1, dot4_q4_1, rows4_q4_1), (vnni_dot_q4_1, vnni_dot4_q4_1, vnni_rows4_q4_1)),
        GgmlType::Q5_0 => k((dot_q5_0, dot4_q5_0, rows4_q5_0), (vnni_dot_q5_0, vnni_dot4_q5_0, vnni_rows4_q5_0)),
        GgmlType::Q8_0 => k((dot_q8_0, dot4_q8_0, rows4_q8_0), (vnni_dot_q8_0, vnni_dot4_q8_0, vnni_rows4_q8_0)),
        GgmlType::Q4K => Kernels { dot4: Some(dot4_q4_k), ..single(dot_q4_k) },
        GgmlType::Q6K => Kernels { dot4: Some(dot4_q6_k), ..single(dot_q6_k) },
        GgmlType::F32 => single(dot_f32),
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

safe_entry!(dot_q4_k, q4_k_impl, 144, 292, 256);
safe_entry!(dot_q6_k, q6_k_impl, 210, 292, 256);
safe_entry!(dot_f32, f32_impl, 4, 4, 1);

#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128((p as *const u16).read_unaligned() as i32)))
}

#[inline(always)]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// 16 bytes of nibbles -> 32 bytes: low nibbles first, then high nibbles (ggml's order).
/// One broadcast load, one per-lane variable shift (0 for the low half, 4 for the high), one mask.
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> __m256i {
    let t = _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i));
    let shifted = _mm256_srlv_epi32(t, _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0));
    _mm256_and_si256(shifted, _mm256_set1_epi8(0xF))
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

/// Q4_K against R activation rows (q8_K); the weight block's scales and nibbles are decoded once.
#[inline(always)]
unsafe fn q4_k_acts<const R: usize>(w: *const u8, a: [*const u8; R], nb: usize) -> [f32; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    let mut accm = [0.0f32; R];
    let m4 = _mm256_set1_epi8(0xF);
    for i in 0..nb {
        let wb = w.add(i * 144);
        let (dw, dminw) = (f16_at(wb), f16_at(wb.add(2)));
        let sc = std::slice::from_raw_parts(wb.add(4), 12);
        let mut sumi = [_mm256_setzero_si256(); R];
        let mut msum = [0i32; R];
        for j in 0..4 {
            let (s1, m1) = super::scale_min_k4(2 * j, sc);
            let (s2, m2) = super::scale_min_k4(2 * j + 1, sc);
            let q = _mm256_loadu_si256(wb.add(16 + 32 * j) as *const __m256i);
            let lo = _mm256_and_si256(q, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            for k in 0..R {
                let ab = a[k].add(i * 292);
                let bs = ab.add(260) as *const i16;
                msum[k] += m1 as i32 * (bs.add(4 * j).read_unaligned() as i32 + bs.add(4 * j + 1).read_unaligned() as i32);
                msum[k] += m2 as i32 * (bs.add(4 * j + 2).read_unaligned() as i32 + bs.add(4 * j + 3).read_unaligned() as i32);
                let y1 = _mm256_loadu_si256(ab.add(4 + 64 * j) as *const __m256i);
                let y2 = _mm256_loadu_si256(ab.add(4 + 64 * j + 32) as *const __m256i);
                let p1 = _mm256_mullo_epi32(dot_u8_i8(lo, y1), _mm256_set1_epi32(s1 as i32));
                let p2 = _mm256_mullo_epi32(dot_u8_i8(hi, y2), _mm256_set1_epi32(s2 as i32));
                sumi[k] = _mm256_add_epi32(sumi[k], _mm256_add_epi32(p1, p2));
            }
        }
        for k in 0..R {
            let d8 = (a[k].add(i * 292) as *const f32).read_unaligned();
            acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d8 * dw), _mm256_cvtepi32_ps(sumi[k]), acc[k]);
            accm[k] += d8 * dminw * msum[k] as f32;
        }
    }
    let mut out = [0.0f32; R];
    for k in 0..R {
        out[k] = hsum(acc[k]) - accm[k];
    }
    out
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_impl(w: *const u8, a: *const u8, nb: usize) -> f32 {
    q4_k_acts::<1>(w, [a], nb)[0]
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_x4(w: *const u8, a: [*const u8; 4], nb: usize) -> [f32; 4] {
    q4_k_acts::<4>(w, a, nb)
}

/// Q6_K against R activation rows (q8_K); the weight block is decoded once.
#[inline(always)]
unsafe fn q6_k_acts<const R: usize>(w: *const u8, a: [*const u8; R], nb: usize) -> [f32; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    let m4 = _mm256_set1_epi8(0xF);
    let m2 = _mm256_set1_epi8(3);
    let m32 = _mm256_set1_epi8(32);
    for i in 0..nb {
        let wb = w.add(i * 210);
        let dw = f16_at(wb.add(208));
        let mut sumi = [_mm256_setzero_si256(); R];
        for half in 0..2 {
            let ql = wb.add(64 * half);
            let qh = _mm256_loadu_si256(wb.add(128 + 32 * half) as *const __m256i);
            let sc = wb.add(192 + 8 * half) as *const i8;
            let ql0 = _mm256_loadu_si256(ql as *const __m256i);
            let ql1 = _mm256_loadu_si256(ql.add(32) as *const __m256i);
            let qs = [
                _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4)),
                _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4)),
            ];
            for (c, q) in qs.iter().enumerate() {
                // lanes 0..7 (the low 128 bits) take scale 2c, the high half scale 2c+1.
                let scv = _mm256_set_m128i(_mm_set1_epi16(*sc.add(2 * c + 1) as i16), _mm_set1_epi16(*sc.add(2 * c) as i16));
                for k in 0..R {
                    // q in 0..63 unsigned; (q-32)*y = q*y - 32*y.
                    let y = _mm256_loadu_si256(a[k].add(i * 292 + 4 + 128 * half + 32 * c) as *const __m256i);
                    let p = _mm256_sub_epi16(_mm256_maddubs_epi16(*q, y), _mm256_maddubs_epi16(m32, y));
                    sumi[k] = _mm256_add_epi32(sumi[k], _mm256_madd_epi16(p, scv));
                }
            }
        }
        for k in 0..R {
            let d = (a[k].add(i * 292) as *const f32).read_unaligned() * dw;
            acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[k]), acc[k]);
        }
    }
    let mut out = [0.0f32; R];
    for k in 0..R {
        out[k] = hsum(acc[k]);
    }
    out
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_impl(w: *const u8, a: *const u8, nb: usize) -> f32 {
    q6_k_acts::<1>(w, [a], nb)[0]
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_x4(w: *const u8, a: [*const u8; 4], nb: usize) -> [f32; 4] {
    q6_k_acts::<4>(w, a, nb)
}

pub fn dot4_q4_k(w: &[u8], a: [&[u8]; 4], n: usize) -> [f32; 4] {
    let nb = n / 256;
    assert!(w.len() >= nb * 144 && a.iter().all(|r| r.len() >= nb * 292));
    // SAFETY: handed out only after detecting AVX2, FMA and F16C; the assert bounds every load.
    unsafe { q4_k_x4(w.as_ptr(), [a[0].as_ptr(), a[1].as_ptr(), a[2].as_ptr(), a[3].as_ptr()], nb) }
}

pub fn dot4_q6_k(w: &[u8], a: [&[u8]; 4], n: usize) -> [f32; 4] {
    let nb = n / 256;
    assert!(w.len() >= nb * 210 && a.iter().all(|r| r.len() >= nb * 292));
    // SAFETY: as above.
    unsafe { q6_k_x4(w.as_ptr(), [a[0].as_ptr(), a[1].as_ptr(), a[2].as_ptr(), a[3].as_ptr()], nb) }
}

// ---- The 32-value formats, on repacked weight rows (see `repack`) --------------------------
//
// Per group of eight blocks the weight scales (and mins) convert with one vcvtph2ps and meet the
// activation scales (the f32 tail `quantize_row` writes) in one multiply; per block what is left
// is the integer dot, its conversion, a lane broadcast and one fma. Every variant (1x1, 1x4, 4x1)
// runs this same per-output arithmetic, so their results are bit-identical.

/// Which 32-value format: how to read block `i` of a repacked row of `nb` blocks.
trait Fmt {
    /// Activation block bytes (q8_0: 34, q8_1: 36) and weight block bytes.
    const ABYTES: usize;
    const WBYTES: usize;
    /// Weights are unsigned (Q4_1) and carry a min applied through the activation sums.
    const MIN: bool;
    unsafe fn quants(row: *const u8, nb: usize, i: usize) -> __m256i;
}

struct Q4_0;
struct Q4_1;
struct Q5_0;
struct Q8_0;

impl Fmt for Q4_0 {
    const ABYTES: usize = 34;
    const WBYTES: usize = 18;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn quants(row: *const u8, nb: usize, i: usize) -> __m256i {
        _mm256_sub_epi8(nibbles(row.add(2 * nb + 16 * i)), _mm256_set1_epi8(8))
    }
}
impl Fmt for Q4_1 {
    const ABYTES: usize = 36;
    const WBYTES: usize = 20;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn quants(row: *const u8, nb: usize, i: usize) -> __m256i {
        nibbles(row.add(4 * nb + 16 * i))
    }
}
impl Fmt for Q5_0 {
    const ABYTES: usize = 34;
    const WBYTES: usize = 22;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn quants(row: *const u8, nb: usize, i: usize) -> __m256i {
        // (q | h<<4) - 16 as i8 is q where the high bit is set and q|0xF0 where it is not.
        let hi = _mm256_andnot_si256(bytes_from_bits(row.add(2 * nb + 4 * i)), _mm256_set1_epi8(0xF0u8 as i8));
        _mm256_or_si256(nibbles(row.add(6 * nb + 16 * i)), hi)
    }
}
impl Fmt for Q8_0 {
    const ABYTES: usize = 34;
    const WBYTES: usize = 34;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn quants(row: *const u8, nb: usize, i: usize) -> __m256i {
        _mm256_loadu_si256(row.add(2 * nb + 32 * i) as *const __m256i)
    }
}

/// Lanes 0..cnt set.
#[inline(always)]
unsafe fn lanes(cnt: usize) -> __m256 {
    _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(cnt as i32), _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0)))
}

/// Eight f16 at `p` as f32, lanes past `cnt` zeroed. Reads all 16 bytes: a repacked row's scale
/// regions are always followed by more of the same row, so the read stays inside it. (A stack
/// copy of a partial group would stall on store forwarding in the hottest loop.)
#[inline(always)]
unsafe fn f16x8(p: *const u8, cnt: usize) -> __m256 {
    let v = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
    if cnt == 8 {
        v
    } else {
        _mm256_and_ps(v, lanes(cnt))
    }
}

/// Eight f32 at `p`, lanes past `cnt` zeroed. Activation rows end with `ACT_PAD` spare bytes, so
/// reading a whole vector past the last scale stays inside the buffer.
#[inline(always)]
unsafe fn f32x8(p: *const f32, cnt: usize) -> __m256 {
    let v = _mm256_loadu_ps(p);
    if cnt == 8 {
        v
    } else {
        _mm256_and_ps(v, lanes(cnt))
    }
}

/// Activation scales of a row: `d[nb]` then (q8_1) `s[nb]`, after the blocks.
#[inline(always)]
unsafe fn act_tail<F: Fmt>(a: *const u8, nb: usize) -> *const f32 {
    a.add(nb * F::ABYTES) as *const f32
}

/// u8 x i8 dot of 32 bytes into 8 i32 lanes: one vpdpbusd where AVX-VNNI exists, else
/// maddubs + madd. The integer results are identical.
#[inline(always)]
unsafe fn dot_u8_i8_v<const VNNI: bool>(u: __m256i, s: __m256i) -> __m256i {
    if VNNI {
        _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s)
    } else {
        dot_u8_i8(u, s)
    }
}

#[inline(always)]
unsafe fn block_dot<F: Fmt, const VNNI: bool>(q: __m256i, y: __m256i) -> __m256i {
    if F::MIN {
        dot_u8_i8_v::<VNNI>(q, y)
    } else {
        dot_u8_i8_v::<VNNI>(_mm256_sign_epi8(q, q), _mm256_sign_epi8(y, q))
    }
}

/// R weight rows against one activation row.
#[inline(always)]
unsafe fn rows<F: Fmt, const R: usize, const VNNI: bool>(w: [*const u8; R], a: *const u8, nb: usize) -> [f32; R] {
    let tail = act_tail::<F>(a, nb);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut g = 0;
    while g < nb {
        let cnt = (nb - g).min(8);
        let da = f32x8(tail.add(g), cnt);
        let mut dp = [_mm256_setzero_ps(); R];
        for k in 0..R {
            dp[k] = _mm256_mul_ps(f16x8(w[k].add(2 * g), cnt), da);
            if F::MIN {
                // The mins' term, m_w * s_a per block, joins the same accumulator.
                acc[k] = _mm256_fmadd_ps(f16x8(w[k].add(2 * nb + 2 * g), cnt), f32x8(tail.add(nb + g), cnt), acc[k]);
            }
        }
        for j in 0..cnt {
            let y = _mm256_loadu_si256(a.add((g + j) * F::ABYTES + F::ABYTES - 32) as *const __m256i);
            let lane = _mm256_set1_epi32(j as i32);
            for k in 0..R {
                let q = F::quants(w[k], nb, g + j);
                let d = _mm256_permutevar8x32_ps(dp[k], lane);
                acc[k] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(block_dot::<F, VNNI>(q, y)), acc[k]);
            }
        }
        g += 8;
    }
    let mut out = [0.0f32; R];
    for k in 0..R {
        out[k] = hsum(acc[k]);
    }
    out
}

/// One weight row against four activation rows: the weight block is unpacked once.
#[inline(always)]
unsafe fn acts4<F: Fmt, const VNNI: bool>(w: *const u8, a: [*const u8; 4], nb: usize) -> [f32; 4] {
    let tails = [act_tail::<F>(a[0], nb), act_tail::<F>(a[1], nb), act_tail::<F>(a[2], nb), act_tail::<F>(a[3], nb)];
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut g = 0;
    while g < nb {
        let cnt = (nb - g).min(8);
        let dw = f16x8(w.add(2 * g), cnt);
        let mut dp = [_mm256_setzero_ps(); 4];
        for k in 0..4 {
            dp[k] = _mm256_mul_ps(dw, f32x8(tails[k].add(g), cnt));
            if F::MIN {
                acc[k] = _mm256_fmadd_ps(f16x8(w.add(2 * nb + 2 * g), cnt), f32x8(tails[k].add(nb + g), cnt), acc[k]);
            }
        }
        for j in 0..cnt {
            let q = F::quants(w, nb, g + j);
            let lane = _mm256_set1_epi32(j as i32);
            for k in 0..4 {
                let y = _mm256_loadu_si256(a[k].add((g + j) * F::ABYTES + F::ABYTES - 32) as *const __m256i);
                let d = _mm256_permutevar8x32_ps(dp[k], lane);
                acc[k] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(block_dot::<F, VNNI>(q, y)), acc[k]);
            }
        }
        g += 8;
    }
    [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])]
}

fn check<F: Fmt>(w: &[&[u8]], a: &[&[u8]], n: usize) -> usize {
    let nb = n / 32;
    let tail = if F::MIN { 8 } else { 4 };
    assert!(w.iter().all(|r| r.len() >= nb * F::WBYTES), "weight row too short");
    assert!(
        a.iter().all(|r| r.len() >= nb * (F::ABYTES + tail) + super::ACT_PAD),
        "activation row too short (size it with act_row_bytes)"
    );
    nb
}

macro_rules! repacked_entries {
    ($fmt:ident, $dot:ident, $dot4:ident, $rows4:ident, $vdot:ident, $vdot4:ident, $vrows4:ident) => {
        repacked_entries!(@one $fmt, false, "avx2,fma,f16c", $dot, $dot4, $rows4);
        repacked_entries!(@one $fmt, true, "avx2,fma,f16c,avxvnni", $vdot, $vdot4, $vrows4);
    };
    (@one $fmt:ident, $vnni:expr, $features:literal, $dot:ident, $dot4:ident, $rows4:ident) => {
        pub fn $dot(w: &[u8], a: &[u8], n: usize) -> f32 {
            #[target_feature(enable = $features)]
            unsafe fn k(w: *const u8, a: *const u8, nb: usize) -> f32 {
                rows::<$fmt, 1, $vnni>([w], a, nb)[0]
            }
            let nb = check::<$fmt>(&[w], &[a], n);
            // SAFETY: handed out only after detecting these features; `check` bounds every load.
            unsafe { k(w.as_ptr(), a.as_ptr(), nb) }
        }
        pub fn $dot4(w: &[u8], a: [&[u8]; 4], n: usize) -> [f32; 4] {
            #[target_feature(enable = $features)]
            unsafe fn k(w: *const u8, a: [*const u8; 4], nb: usize) -> [f32; 4] {
                acts4::<$fmt, $vnni>(w, a, nb)
            }
            let nb = check::<$fmt>(&[w], &a, n);
            // SAFETY: as above.
            unsafe { k(w.as_ptr(), [a[0].as_ptr(), a[1].as_ptr(), a[2].as_ptr(), a[3].as_ptr()], nb) }
        }
        pub fn $rows4(w: [&[u8]; 4], a: &[u8], n: usize) -> [f32; 4] {
            #[target_feature(enable = $features)]
            unsafe fn k(w: [*const u8; 4], a: *const u8, nb: usize) -> [f32; 4] {
                rows::<$fmt, 4, $vnni>(w, a, nb)
            }
            let nb = check::<$fmt>(&w, &[a], n);
            // SAFETY: as above.
            unsafe { k([w[0].as_ptr(), w[1].as_ptr(), w[2].as_ptr(), w[3].as_ptr()], a.as_ptr(), nb) }
        }
    };
}

repacked_entries!(Q4_0, dot_q4_0, dot4_q4_0, rows4_q4_0, vnni_dot_q4_0, vnni_dot4_q4_0, vnni_rows4_q4_0);
repacked_entries!(Q4_1, dot_q4_1, dot4_q4_1, rows4_q4_1, vnni_dot_q4_1, vnni_dot4_q4_1, vnni_rows4_q4_1);
repacked_entries!(Q5_0, dot_q5_0, dot4_q5_0, rows4_q5_0, vnni_dot_q5_0, vnni_dot4_q5_0, vnni_rows4_q5_0);
repacked_entries!(Q8_0, dot_q8_0, dot4_q8_0, rows4_q8_0, vnni_dot_q8_0, vnni_dot4_q8_0, vnni_rows4_q8_0);
