//! AVX2+FMA dot products. Each has a scalar twin in `scalar.rs` and a test that they agree.
//! Integer block sums are exact in both, so the twins differ only in f32 summation order.

use super::{GgmlType, Kernels, TileFn};
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

/// AVX-512 VL/BW/VNNI for the tile kernels; `DASLLAMA_NO_AVX512` (or `DASLLAMA_NO_VNNI`) turns it off.
fn has_avx512() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        std::env::var_os("DASLLAMA_NO_AVX512").is_none()
            && std::env::var_os("DASLLAMA_NO_VNNI").is_none()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
    })
}

/// The AVX2 kernels for `ty`, when this CPU has AVX2+FMA+F16C and they are written for `ty`.
pub fn kernels(ty: GgmlType) -> Option<Kernels> {
    if !has_avx2() {
        return None;
    }
    if let Some(&(_, best)) = tile_variants(ty).last() {
        return Some(Kernels::Tiles(best));
    }
    Some(match ty {
        GgmlType::Q4K => Kernels::Rows { dot: dot_q4_k, dot4: Some(dot4_q4_k) },
        GgmlType::Q6K => Kernels::Rows { dot: dot_q6_k, dot4: Some(dot4_q6_k) },
        GgmlType::F32 => Kernels::Rows { dot: dot_f32, dot4: None },
        _ => return None,
    })
}

/// SIMD twin of `scalar::q8_block`: the same f32 products, rounded half to even by the FPU.
pub fn q8_block(x: &[f32], q: &mut [u8]) -> (f32, i32) {
    assert!(x.len() >= 32 && q.len() >= 32);
    // SAFETY: handed out only after detecting AVX2; the assert bounds the loads and the store.
    unsafe { q8_block_impl(x.as_ptr(), q.as_mut_ptr()) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_block_impl(x: *const f32, q: *mut u8) -> (f32, i32) {
    let v: [__m256; 4] = std::array::from_fn(|k| _mm256_loadu_ps(x.add(8 * k)));
    let sign = _mm256_set1_ps(-0.0);
    let abs = |a: __m256| _mm256_andnot_ps(sign, a);
    let m = _mm256_max_ps(_mm256_max_ps(abs(v[0]), abs(v[1])), _mm256_max_ps(abs(v[2]), abs(v[3])));
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    let d = amax / 127.0;
    let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
    let i: [__m256i; 4] = std::array::from_fn(|k| {
        _mm256_cvtps_epi32(_mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(v[k], id)))
    });
    let s = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01)));
    // Packing works per 128-bit lane; the permute puts the four groups back in order.
    let packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    let ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q as *mut __m256i, ordered);
    (d, sum)
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

// ---- The 32-value formats, on tiles of eight interleaved rows (see `tile`) ----------------
//
// One vpdpbusd multiplies four values of all eight rows by the same four activation bytes
// (broadcast), so the integer dot of a block lands in eight lanes, one per row, with no
// horizontal sums. Per block and activation row what is left is one conversion and one fma (two
// with Q4_1's mins). Every output is the same sequence of fmas over its blocks whatever the
// number of activation rows, so all batch sizes give bit-identical results.
//
// vpdpbusd multiplies unsigned by signed bytes. 4- and 5-bit values are stored unsigned with an
// implicit zero point z (8 or 16): the block's integer sum starts at -z * sum(activations), exact.
// Q8_0 is signed: |w| against sign(w) * a.

/// Which 32-value format, and where its fields live in a tile of `nb` blocks per row.
trait Fmt {
    /// Activation block bytes (q8_0: 34, q8_1: 36) and the offset of their quants.
    const ABYTES: usize;
    const AQ: usize;
    /// GGUF block bytes.
    const WBYTES: usize;
    /// Q4_1: mins applied through the activation sums `s`.
    const MIN: bool;
    /// Q8_0: signed weights.
    const SIGNED: bool;
    /// log2 of the zero point, 0 for none.
    const ZSHIFT: i32;
    /// Offset of the quants in a tile of `nb` blocks, and their bytes per block (eight rows).
    const QAT: usize;
    const QBYTES: usize;
    /// Weights for values 4p..4p+4 and 16+4p..16+4p+4 of block `i`, eight rows each.
    unsafe fn pair<const ISA: u8>(t: *const u8, nb: usize, i: usize, p: usize) -> (__m256i, __m256i);
}

struct Q4_0;
struct Q4_1;
struct Q5_0;
struct Q8_0;

/// Low and high nibbles of 32 bytes.
#[inline(always)]
unsafe fn nibble_pair(p: *const u8) -> (__m256i, __m256i) {
    let raw = _mm256_loadu_si256(p as *const __m256i);
    let m4 = _mm256_set1_epi8(0xF);
    (_mm256_and_si256(raw, m4), _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4))
}

impl Fmt for Q4_0 {
    const WBYTES: usize = 18;
    const QAT: usize = 16;
    const QBYTES: usize = 128;
    const ABYTES: usize = 34;
    const AQ: usize = 2;
    const MIN: bool = false;
    const SIGNED: bool = false;
    const ZSHIFT: i32 = 3;
    #[inline(always)]
    unsafe fn pair<const ISA: u8>(t: *const u8, nb: usize, i: usize, p: usize) -> (__m256i, __m256i) {
        nibble_pair(t.add(Self::QAT * nb + 128 * i + 32 * p))
    }
}
impl Fmt for Q4_1 {
    const WBYTES: usize = 20;
    const QAT: usize = 32;
    const QBYTES: usize = 128;
    const ABYTES: usize = 36;
    const AQ: usize = 4;
    const MIN: bool = true;
    const SIGNED: bool = false;
    const ZSHIFT: i32 = 0;
    #[inline(always)]
    unsafe fn pair<const ISA: u8>(t: *const u8, nb: usize, i: usize, p: usize) -> (__m256i, __m256i) {
        nibble_pair(t.add(Self::QAT * nb + 128 * i + 32 * p))
    }
}
impl Fmt for Q5_0 {
    const WBYTES: usize = 22;
    const QAT: usize = 48;
    const QBYTES: usize = 128;
    const ABYTES: usize = 34;
    const AQ: usize = 2;
    const MIN: bool = false;
    const SIGNED: bool = false;
    const ZSHIFT: i32 = 4;
    #[inline(always)]
    unsafe fn pair<const ISA: u8>(t: *const u8, nb: usize, i: usize, p: usize) -> (__m256i, __m256i) {
        let (lo, hi) = nibble_pair(t.add(Self::QAT * nb + 128 * i + 32 * p));
        let qh = t.add(16 * nb + 32 * i);
        let b = _mm256_set1_epi8(0x10);
        if ISA == AVX512 {
            let bits = |at: usize| (qh.add(at) as *const u32).read_unaligned();
            return (_mm256_mask_add_epi8(lo, bits(4 * p), lo, b), _mm256_mask_add_epi8(hi, bits(4 * p + 16), hi, b));
        }
        let h0 = _mm256_and_si256(bytes_from_bits(qh.add(4 * p)), b);
        let h1 = _mm256_and_si256(bytes_from_bits(qh.add(4 * p + 16)), b);
        (_mm256_or_si256(lo, h0), _mm256_or_si256(hi, h1))
    }
}
impl Fmt for Q8_0 {
    const WBYTES: usize = 34;
    const QAT: usize = 16;
    const QBYTES: usize = 256;
    const ABYTES: usize = 34;
    const AQ: usize = 2;
    const MIN: bool = false;
    const SIGNED: bool = true;
    const ZSHIFT: i32 = 0;
    #[inline(always)]
    unsafe fn pair<const ISA: u8>(t: *const u8, nb: usize, i: usize, p: usize) -> (__m256i, __m256i) {
        let q = t.add(Self::QAT * nb + 256 * i + 32 * p);
        (_mm256_loadu_si256(q as *const __m256i), _mm256_loadu_si256(q.add(128) as *const __m256i))
    }
}

/// Instruction sets of the tile kernels: AVX2+FMA+F16C; plus AVX-VNNI (vpdpbusd); plus
/// AVX-512 VL/BW/VNNI (sixteen more vector registers, byte masks). All give identical results.
const AVX2: u8 = 0;
const VNNI: u8 = 1;
const AVX512: u8 = 2;

/// acc + the u8 x i8 dot of each group of four bytes: one vpdpbusd where AVX-VNNI exists, else
/// maddubs + madd (no i16 saturation: unsigned weights are < 32, or |w| <= 127 against |a| <= 127).
#[inline(always)]
unsafe fn dp<const ISA: u8>(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    if ISA == AVX512 {
        _mm256_dpbusd_epi32(acc, u, s)
    } else if ISA == VNNI {
        _mm256_dpbusd_avx_epi32(acc, u, s)
    } else {
        _mm256_add_epi32(acc, dot_u8_i8(u, s))
    }
}

#[inline(always)]
unsafe fn bcast4(p: *const u8) -> __m256i {
    _mm256_set1_epi32((p as *const i32).read_unaligned())
}

/// Bytes ahead of the block being read that the tile kernels prefetch.
const PREFETCH: usize = 16384;

/// T consecutive tiles (eight weight rows each) against R activation rows: T x R vectors of
/// eight outputs. Several tiles at once (decode) read several streams, which keeps more memory
/// requests in flight than one stream per core can.
#[inline(always)]
unsafe fn tile_kernel<F: Fmt, const T: usize, const R: usize, const ISA: u8>(
    t: *const u8,
    a: [*const u8; R],
    nb: usize,
) -> [[__m256; R]; T] {
    let tile_bytes = 8 * nb * F::WBYTES;
    let tiles: [*const u8; T] = std::array::from_fn(|k| t.add(k * tile_bytes));
    // Activation rows end with d[nb] (f32), then q8_1's s[nb] (f32) or q8_0's block sums (i32).
    let tails: [*const f32; R] = std::array::from_fn(|r| a[r].add(nb * F::ABYTES) as *const f32);
    let mut acc = [[_mm256_setzero_ps(); R]; T];
    for i in 0..nb {
        let mut start = [_mm256_setzero_si256(); R];
        if F::ZSHIFT > 0 {
            for r in 0..R {
                let s = (tails[r].add(nb + i) as *const i32).read_unaligned();
                start[r] = _mm256_set1_epi32(-(s << F::ZSHIFT));
            }
        }
        for (k, &t) in tiles.iter().enumerate() {
            // Hardware prefetchers alone leave DRAM bandwidth unused when the weights do not fit
            // the caches (decode); ask for the bytes a few blocks ahead.
            let qs = t.add(F::QAT * nb + F::QBYTES * i + PREFETCH);
            for line in (0..F::QBYTES).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(qs.add(line) as *const i8);
            }
            let mut isum = start;
            let mut isum2 = [_mm256_setzero_si256(); R];
            for p in 0..4 {
                let (w0, w1) = F::pair::<ISA>(t, nb, i, p);
                let (u0, u1) = if F::SIGNED { (_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(w1, w1)) } else { (w0, w1) };
                for r in 0..R {
                    let q = a[r].add(i * F::ABYTES + F::AQ + 4 * p);
                    let (mut y0, mut y1) = (bcast4(q), bcast4(q.add(16)));
                    if F::SIGNED {
                        y0 = _mm256_sign_epi8(y0, w0);
                        y1 = _mm256_sign_epi8(y1, w1);
                    }
                    isum[r] = dp::<ISA>(isum[r], u0, y0);
                    isum2[r] = dp::<ISA>(isum2[r], u1, y1);
                }
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(t.add(16 * i) as *const __m128i));
            for r in 0..R {
                let d = _mm256_mul_ps(dw, _mm256_set1_ps(tails[r].add(i).read_unaligned()));
                acc[k][r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_add_epi32(isum[r], isum2[r])), acc[k][r]);
            }
            if F::MIN {
                let mw = _mm256_cvtph_ps(_mm_loadu_si128(t.add(16 * nb + 16 * i) as *const __m128i));
                for r in 0..R {
                    acc[k][r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(tails[r].add(nb + i).read_unaligned()), acc[k][r]);
                }
            }
        }
    }
    acc
}

fn check<F: Fmt>(t: &[u8], a: &[&[u8]], n: usize, out: &[[f32; 8]]) -> (usize, usize) {
    let nb = n / 32;
    let tiles = out.len() / a.len().max(1);
    assert!((1..=8).contains(&a.len()) && out.len() == tiles * a.len(), "out must hold tiles x activation rows");
    assert!(matches!((tiles, a.len()), (1, _) | (2, 1 | 2)), "tile kernels take 1 tile x 1..8 rows or 2 tiles x 1..2 rows");
    assert!(t.len() >= tiles * 8 * nb * F::WBYTES, "weight tile too short");
    assert!(a.iter().all(|r| r.len() >= nb * (F::ABYTES + 8) + super::ACT_PAD), "activation row too short (size it with act_row_bytes)");
    (nb, tiles)
}

macro_rules! tile_entries {
    ($fmt:ident, $avx2:ident, $vnni:ident, $avx512:ident) => {
        tile_entries!(@one $fmt, AVX2, "avx2,fma,f16c", $avx2);
        tile_entries!(@one $fmt, VNNI, "avx2,fma,f16c,avxvnni", $vnni);
        tile_entries!(@one $fmt, AVX512, "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni", $avx512);
    };
    (@one $fmt:ident, $isa:expr, $features:literal, $name:ident) => {
        pub fn $name(t: &[u8], a: &[&[u8]], n: usize, out: &mut [[f32; 8]]) {
            #[target_feature(enable = $features)]
            unsafe fn k<const T: usize, const R: usize>(t: *const u8, a: &[&[u8]], nb: usize, out: &mut [[f32; 8]]) {
                let acc = tile_kernel::<$fmt, T, R, { $isa }>(t, std::array::from_fn(|r| a[r].as_ptr()), nb);
                for (k, tile) in acc.iter().enumerate() {
                    for (r, v) in tile.iter().enumerate() {
                        _mm256_storeu_ps(out[k * R + r].as_mut_ptr(), *v);
                    }
                }
            }
            let (nb, tiles) = check::<$fmt>(t, a, n, out);
            if $isa != AVX512 && tiles == 1 && a.len() > 4 {
                // Sixteen vector registers hold the accumulators of at most four rows.
                let (lo, hi) = out.split_at_mut(4);
                $name(t, &a[..4], n, lo);
                return $name(t, &a[4..], n, hi);
            }
            // SAFETY: handed out only after detecting these features; `check` bounds every load.
            unsafe {
                match (tiles, a.len()) {
                    (1, 1) => k::<1, 1>(t.as_ptr(), a, nb, out),
                    (1, 2) => k::<1, 2>(t.as_ptr(), a, nb, out),
                    (1, 3) => k::<1, 3>(t.as_ptr(), a, nb, out),
                    (1, 4) => k::<1, 4>(t.as_ptr(), a, nb, out),
                    (1, 5) => k::<1, 5>(t.as_ptr(), a, nb, out),
                    (1, 6) => k::<1, 6>(t.as_ptr(), a, nb, out),
                    (1, 7) => k::<1, 7>(t.as_ptr(), a, nb, out),
                    (1, _) => k::<1, 8>(t.as_ptr(), a, nb, out),
                    (_, 1) => k::<2, 1>(t.as_ptr(), a, nb, out),
                    _ => k::<2, 2>(t.as_ptr(), a, nb, out),
                }
            }
        }
    };
}

tile_entries!(Q4_0, tile_q4_0, vnni_tile_q4_0, avx512_tile_q4_0);
tile_entries!(Q4_1, tile_q4_1, vnni_tile_q4_1, avx512_tile_q4_1);
tile_entries!(Q5_0, tile_q5_0, vnni_tile_q5_0, avx512_tile_q5_0);
tile_entries!(Q8_0, tile_q8_0, vnni_tile_q8_0, avx512_tile_q8_0);

/// Every tile kernel variant this CPU can run for `ty`, named, best last (tests compare them).
pub fn tile_variants(ty: GgmlType) -> Vec<(&'static str, TileFn)> {
    let all: [TileFn; 3] = match ty {
        GgmlType::Q4_0 => [tile_q4_0, vnni_tile_q4_0, avx512_tile_q4_0],
        GgmlType::Q4_1 => [tile_q4_1, vnni_tile_q4_1, avx512_tile_q4_1],
        GgmlType::Q5_0 => [tile_q5_0, vnni_tile_q5_0, avx512_tile_q5_0],
        GgmlType::Q8_0 => [tile_q8_0, vnni_tile_q8_0, avx512_tile_q8_0],
        _ => return Vec::new(),
    };
    let usable = [has_avx2(), has_avx2() && has_vnni(), has_avx2() && has_avx512()];
    ["avx2", "avx-vnni", "avx512"].into_iter().zip(all).zip(usable).filter(|(_, ok)| *ok).map(|(v, _)| v).collect()
}
