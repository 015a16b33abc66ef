//! x86 kernels: tile kernels (eight weight rows against up to eight activation rows) for the
//! quantized formats in AVX2, AVX-VNNI and AVX-512 variants, the f32 dot, q8 activation
//! rounding. Each has a scalar twin in `scalar.rs` and a test that they agree: integer block sums
//! are exact in both, so the twins differ only in f32 summation order.

use super::tile::{K45_DMIN, K45_M, K45_SC, Q4K_QS, Q5K_QH, Q5K_QS, Q6K_QH, Q6K_QL, Q6K_SC};
use super::{GgmlType, Kernels, TileFn};
use std::arch::x86_64::*;
use std::sync::OnceLock;

/// AVX2+FMA+F16C, unless the process switches or this thread's runtime (the scalar twins) say no.
pub(crate) fn has_avx2() -> bool {
    process_avx2() && !super::switches::scalar()
}

/// What the CPU and the process switches allow, decided once (read-only after, as detection is).
fn process_avx2() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        !super::switches::get().no_simd && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    })
}

/// AVX-VNNI (vpdpbusd on 256-bit vectors); `DASLLAMA_NO_VNNI` turns it off for comparisons.
fn has_vnni() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| !super::switches::get().no_vnni && is_x86_feature_detected!("avxvnni"))
}

/// AVX-512 F/VL/BW/VNNI for the tile kernels (and the p·v attention kernel);
/// `DASLLAMA_NO_AVX512` (or `DASLLAMA_NO_VNNI`, or `DASLLAMA_NO_SIMD`) turns it off, as does a
/// runtime on the scalar twins.
pub(crate) fn has_avx512() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    let process = *HAS.get_or_init(|| {
        process_avx2()
            && !super::switches::get().no_avx512
            && !super::switches::get().no_vnni
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
    });
    process && !super::switches::scalar()
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
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => Kernels::Floats(float_variants(ty).last()?.1),
        GgmlType::IQ4NL | GgmlType::IQ4XS => Kernels::Rows(super::iq4::dot_fn(ty)),
        _ => return None,
    })
}

/// The largest lane.
#[inline(always)]
unsafe fn hmax(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
}

/// The sum of the i32 lanes.
#[inline(always)]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01)))
}

/// Round half to even (as the scalar path's magic-number rounding does) and convert.
#[inline(always)]
unsafe fn round_i32(v: __m256) -> __m256i {
    _mm256_cvtps_epi32(_mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v))
}

/// Four vectors of i32 within i8 range -> 32 bytes in order (packing works per 128-bit lane; the
/// permute puts the four groups back in order).
#[inline(always)]
unsafe fn pack_i8(q: &[__m256i; 4]) -> __m256i {
    let packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
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
    let amax = hmax(_mm256_max_ps(_mm256_max_ps(abs(v[0]), abs(v[1])), _mm256_max_ps(abs(v[2]), abs(v[3]))));
    let d = amax / 127.0;
    let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
    let i: [__m256i; 4] = std::array::from_fn(|k| round_i32(_mm256_mul_ps(v[k], id)));
    let sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3])));
    _mm256_storeu_si256(q as *mut __m256i, pack_i8(&i));
    (d, sum)
}

/// SIMD twin of `scalar::q8k_block`: the same products and rounding, the same first value of
/// largest magnitude.
pub fn q8k_block(x: &[f32], b: &mut [u8]) {
    assert!(x.len() >= 256 && b.len() >= 292);
    // SAFETY: handed out only after detecting AVX2; the assert bounds the loads and stores.
    unsafe { q8k_block_impl(x.as_ptr(), b.as_mut_ptr()) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8k_block_impl(x: *const f32, b: *mut u8) {
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_setzero_ps();
    for i in (0..256).step_by(8) {
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x.add(i))));
    }
    let amax = hmax(m);
    if amax == 0.0 {
        std::ptr::write_bytes(b, 0, 292);
        return;
    }
    // The first value whose magnitude is the largest gives the scale its sign.
    let target = _mm256_set1_ps(amax);
    let mut max = 0.0f32;
    for i in (0..256).step_by(8) {
        let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_andnot_ps(sign, _mm256_loadu_ps(x.add(i))), target));
        if hit != 0 {
            max = *x.add(i + hit.trailing_zeros() as usize);
            break;
        }
    }
    let iscale = -127.0 / max;
    let (is, cap) = (_mm256_set1_ps(iscale), _mm256_set1_epi32(127));
    for g in 0..8 {
        // 32 values as four vectors of i32; two groups of 16 for the sums.
        let q: [__m256i; 4] = std::array::from_fn(|k| _mm256_min_epi32(round_i32(_mm256_mul_ps(is, _mm256_loadu_ps(x.add(32 * g + 8 * k)))), cap));
        _mm256_storeu_si256(b.add(4 + 32 * g) as *mut __m256i, pack_i8(&q));
        for half in 0..2 {
            let s = hsum_i32(_mm256_add_epi32(q[2 * half], q[2 * half + 1]));
            (b.add(260 + 2 * (2 * g + half)) as *mut i16).write_unaligned(s as i16);
        }
    }
    (b as *mut f32).write_unaligned(1.0 / iscale);
}

#[inline(always)]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Sum of u8*i8 products as 8 i32 lanes.
#[inline(always)]
unsafe fn dot_u8_i8(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// The float formats: eight values at element `i` as f32, and one.
trait Floats {
    const BYTES: usize;
    unsafe fn eight(p: *const u8, i: usize) -> __m256;
    unsafe fn one(p: *const u8, i: usize) -> f32;
}
struct F32s;
struct F16s;
struct BF16s;
impl Floats for F32s {
    const BYTES: usize = 4;
    #[inline(always)]
    unsafe fn eight(p: *const u8, i: usize) -> __m256 {
        _mm256_loadu_ps((p as *const f32).add(i))
    }
    #[inline(always)]
    unsafe fn one(p: *const u8, i: usize) -> f32 {
        (p as *const f32).add(i).read_unaligned()
    }
}
impl Floats for F16s {
    const BYTES: usize = 2;
    #[inline(always)]
    unsafe fn eight(p: *const u8, i: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * i) as *const __m128i))
    }
    #[inline(always)]
    unsafe fn one(p: *const u8, i: usize) -> f32 {
        half::f16::from_bits((p.add(2 * i) as *const u16).read_unaligned()).to_f32()
    }
}
impl Floats for BF16s {
    const BYTES: usize = 2;
    #[inline(always)]
    unsafe fn eight(p: *const u8, i: usize) -> __m256 {
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(2 * i) as *const __m128i)), 16))
    }
    #[inline(always)]
    unsafe fn one(p: *const u8, i: usize) -> f32 {
        half::bf16::from_bits((p.add(2 * i) as *const u16).read_unaligned()).to_f32()
    }
}

/// W float weight rows against R f32 activation rows (`widen_row`), an 8-lane accumulator for
/// each pair: value i goes to lane i mod 8, one chain per pair (W chains in flight at one
/// activation row, so decode streams at memory speed), then `hsum`, then the last n mod 8 values
/// one by one: one order per pair whatever W and R are.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // the indices pick accumulators, which are the summation order
unsafe fn float_dots<F: Floats, const W: usize, const R: usize>(w: [*const u8; W], a: [*const u8; R], n: usize) -> [[f32; R]; W] {
    let mut acc = [[_mm256_setzero_ps(); R]; W];
    let mut i = 0;
    while i + 8 <= n {
        if i % 32 == 0 {
            for wi in 0..W {
                _mm_prefetch::<_MM_HINT_T0>(w[wi].wrapping_add(i * F::BYTES + PREFETCH) as *const i8);
            }
        }
        let av: [__m256; R] = std::array::from_fn(|r| F32s::eight(a[r], i));
        for wi in 0..W {
            let wv = F::eight(w[wi], i);
            for r in 0..R {
                acc[wi][r] = _mm256_fmadd_ps(wv, av[r], acc[wi][r]);
            }
        }
        i += 8;
    }
    std::array::from_fn(|wi| {
        std::array::from_fn(|r| {
            let mut s = hsum(acc[wi][r]);
            for j in i..n {
                s += F::one(w[wi], j) * F32s::one(a[r], j);
            }
            s
        })
    })
}

/// A `DotsFn` call's bounds, checked before any kernel loads: (weight rows, activation rows).
pub(super) fn check_floats(w: &[&[u8]], a: &[&[u8]], n: usize, out: &[f32], weight_bytes: usize) -> (usize, usize) {
    let (nw, nt) = (w.len(), a.len());
    assert!((1..=4).contains(&nw) && (1..=4).contains(&nt) && out.len() >= nw * nt, "one to four weight and activation rows");
    assert!(w.iter().all(|r| r.len() >= n * weight_bytes) && a.iter().all(|r| r.len() >= n * 4), "rows shorter than {n} values");
    (nw, nt)
}

macro_rules! float_entry {
    ($name:ident, $fmt:ty) => {
        pub fn $name(w: &[&[u8]], a: &[&[u8]], n: usize, out: &mut [f32]) {
            let (nw, nt) = check_floats(w, a, n, out, <$fmt>::BYTES);
            // Sixteen ymm registers: up to four weight rows against two activation rows a call.
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn k<const W: usize, const R: usize>(w: &[&[u8]], a: &[&[u8]], n: usize, out: &mut [f32], nt: usize, t: usize) {
                let sums = float_dots::<$fmt, W, R>(std::array::from_fn(|i| w[i].as_ptr()), std::array::from_fn(|r| a[t + r].as_ptr()), n);
                for (o, s) in out.chunks_exact_mut(nt).zip(&sums) {
                    o[t..t + R].copy_from_slice(s);
                }
            }
            macro_rules! by_rows {
                ($W:literal, $t:expr) => {
                    if nt - $t >= 2 {
                        k::<$W, 2>(w, a, n, out, nt, $t)
                    } else {
                        k::<$W, 1>(w, a, n, out, nt, $t)
                    }
                };
            }
            for t in (0..nt).step_by(2) {
                // SAFETY: handed out only after detecting AVX2, FMA and F16C; `check_floats` bounds
                // every load (the prefetches are hints).
                unsafe {
                    match nw {
                        1 => by_rows!(1, t),
                        2 => by_rows!(2, t),
                        3 => by_rows!(3, t),
                        _ => by_rows!(4, t),
                    }
                }
            }
        }
    };
}

float_entry!(dots_f32, F32s);
float_entry!(dots_f16, F16s);
float_entry!(dots_bf16, BF16s);

/// The float kernels (F32, F16, BF16 weights) this CPU can run, slowest first: the AVX2 one,
/// then AVX-512's (sixteen lanes a chain instead of eight: a different summation order, so the
/// two differ in the last bits, and each alone is the same for any number of rows).
pub fn float_variants(ty: GgmlType) -> Vec<(&'static str, super::DotsFn)> {
    let (avx2, avx512): (super::DotsFn, super::DotsFn) = match ty {
        GgmlType::F32 => (dots_f32, super::avx512::dots_f32),
        GgmlType::F16 => (dots_f16, super::avx512::dots_f16),
        GgmlType::BF16 => (dots_bf16, super::avx512::dots_bf16),
        _ => return Vec::new(),
    };
    let mut v = Vec::new();
    if has_avx2() {
        v.push(("avx2", avx2));
    }
    if has_avx512() {
        v.push(("avx512", avx512));
    }
    v
}

/// The kernel variants of `ty` (`float_variants` or `tile_variants`) that do not run here, each
/// with why: the CPU features it lacks, or the switch that turned it off. For the kernel tests,
/// which must say what they could not test.
pub fn skipped_variants(ty: GgmlType) -> Vec<(&'static str, String)> {
    let (all, have): (Vec<&str>, Vec<&str>) = match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => (vec!["avx2", "avx512"], float_variants(ty).iter().map(|v| v.0).collect()),
        _ if !tile_variants_exist(ty) => return Vec::new(),
        _ => {
            let i16 = super::avx2_kquant::tile_fn(ty).map(|_| "avx2-i16");
            (["avx2"].into_iter().chain(i16).chain(["avx-vnni", "avx512"]).collect(), tile_variants(ty).iter().map(|v| v.0).collect())
        }
    };
    all.into_iter().filter(|n| !have.contains(n)).map(|n| (n, unavailable(n))).collect()
}

fn tile_variants_exist(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 | GgmlType::MXFP4 | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K
    )
}

/// Why the variant `name` does not run on this machine.
fn unavailable(name: &str) -> String {
    let (switches, features): (&[&str], &[&str]) = match name {
        "avx2" | "avx2-i16" => (&["DASLLAMA_NO_SIMD"], &["avx2", "fma", "f16c"]),
        "avx-vnni" => (&["DASLLAMA_NO_SIMD", "DASLLAMA_NO_VNNI"], &["avx2", "fma", "f16c", "avxvnni"]),
        _ => (&["DASLLAMA_NO_SIMD", "DASLLAMA_NO_AVX512", "DASLLAMA_NO_VNNI"], &["avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw", "avx512vnni"]),
    };
    let detected = |f: &str| match f {
        "avx2" => is_x86_feature_detected!("avx2"),
        "fma" => is_x86_feature_detected!("fma"),
        "f16c" => is_x86_feature_detected!("f16c"),
        "avxvnni" => is_x86_feature_detected!("avxvnni"),
        "avx512f" => is_x86_feature_detected!("avx512f"),
        "avx512vl" => is_x86_feature_detected!("avx512vl"),
        "avx512bw" => is_x86_feature_detected!("avx512bw"),
        _ => is_x86_feature_detected!("avx512vnni"),
    };
    let lacking: Vec<&str> = features.iter().copied().filter(|f| !detected(f)).collect();
    let set: Vec<&str> = switches.iter().copied().filter(|s| super::switches::get().set.contains(s)).collect();
    match (lacking.is_empty(), set.is_empty()) {
        (false, _) => format!("this CPU lacks {}", lacking.join(", ")),
        (true, false) => format!("turned off by {}", set.join(", ")),
        (true, true) if super::switches::scalar() => "turned off: this runtime runs the scalar twins".to_string(),
        (true, true) => "not handed out on this CPU".to_string(),
    }
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
// Q8_0 is signed: |w| against sign(w) * a. MXFP4's codes are looked up (one `pshufb` per 32
// nibbles) in its table of levels plus 16 (0..=28), and 16 * sum(activations) taken back.

/// Which 32-value format. Block bytes, where each field of a tile lives (see `tile`) and the
/// activation format all follow from these three.
pub(super) trait Fmt {
    /// Q4_1, Q5_1: mins applied through the activation sums `s` (activations are q8_1).
    const MIN: bool;
    /// Q5_0, Q5_1: a fifth bit per value from the tile's qh words.
    const FIVE: bool;
    /// Q8_0: signed 8-bit weights.
    const SIGNED: bool;
    /// MXFP4: nibbles are codes into `mxfp4::BIASED`, and the block scale an E8M0 byte.
    const MX: bool = false;
    /// Bytes per block and row of the fields before the quants (d, m, qh), and of the quants.
    const HEAD: usize = if Self::MX { 1 } else { 2 + if Self::MIN { 2 } else { 0 } + if Self::FIVE { 4 } else { 0 } };
    const QROW: usize = if Self::SIGNED { 32 } else { 16 };
    /// GGUF block bytes.
    const WBYTES: usize = Self::HEAD + Self::QROW;
    /// log2 of the zero point of unsigned values without mins (Q4_0: 8, Q5_0 and MXFP4's biased
    /// levels: 16), 0 for none.
    const ZSHIFT: i32 = if Self::MIN || Self::SIGNED {
        0
    } else if Self::FIVE || Self::MX {
        4
    } else {
        3
    };
    /// Activation block bytes (q8_1: 36, q8_0: 34) and the offset of their quants.
    const ABYTES: usize = if Self::MIN { 36 } else { 34 };
    const AQ: usize = Self::ABYTES - 32;
}

pub(super) struct Q4_0;
pub(super) struct Q4_1;
pub(super) struct Q5_0;
pub(super) struct Q5_1;
pub(super) struct Q8_0;
pub(super) struct Mxfp4;

impl Fmt for Q4_0 {
    const MIN: bool = false;
    const FIVE: bool = false;
    const SIGNED: bool = false;
}
impl Fmt for Q4_1 {
    const MIN: bool = true;
    const FIVE: bool = false;
    const SIGNED: bool = false;
}
impl Fmt for Q5_0 {
    const MIN: bool = false;
    const FIVE: bool = true;
    const SIGNED: bool = false;
}
impl Fmt for Q5_1 {
    const MIN: bool = true;
    const FIVE: bool = true;
    const SIGNED: bool = false;
}
impl Fmt for Q8_0 {
    const MIN: bool = false;
    const FIVE: bool = false;
    const SIGNED: bool = true;
}
impl Fmt for Mxfp4 {
    const MIN: bool = false;
    const FIVE: bool = false;
    const SIGNED: bool = false;
    const MX: bool = true;
}

/// Eight E8M0 bytes (one block's scales of a tile's rows) as f32, each `mxfp4::e8m0_half`:
/// the bits (e - 1) << 23, or below e = 2 the subnormals 0x00200000 << e, as ggml builds them.
#[inline(always)]
pub(super) unsafe fn e8m0_half8(p: *const u8) -> __m256 {
    let e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
    let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, _mm256_set1_epi32(1)));
    let sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
    _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)))
}

/// The eight rows' scales of block `i` of the tile at `t` (its first region, `tile`), as f32.
#[inline(always)]
unsafe fn scales8<F: Fmt>(t: *const u8, i: usize) -> __m256 {
    if F::MX {
        e8m0_half8(t.add(8 * i))
    } else {
        _mm256_cvtph_ps(_mm_loadu_si128(t.add(16 * i) as *const __m128i))
    }
}

/// Low and high nibbles of 32 bytes.
#[inline(always)]
unsafe fn nibble_pair(p: *const u8) -> (__m256i, __m256i) {
    let raw = _mm256_loadu_si256(p as *const __m256i);
    let m4 = _mm256_set1_epi8(0xF);
    (_mm256_and_si256(raw, m4), _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4))
}

/// Weights for values 4p..4p+4 and 16+4p..16+4p+4 of block `i` of a tile of `nb` blocks per
/// row, eight rows each.
#[inline(always)]
unsafe fn pair<F: Fmt, const ISA: u8>(t: *const u8, nb: usize, i: usize, p: usize) -> (__m256i, __m256i) {
    let qs = t.add(8 * F::HEAD * nb + 8 * F::QROW * i + 32 * p);
    if F::SIGNED {
        return (_mm256_loadu_si256(qs as *const __m256i), _mm256_loadu_si256(qs.add(128) as *const __m256i));
    }
    let (lo, hi) = nibble_pair(qs);
    if F::MX {
        let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(super::mxfp4::BIASED.as_ptr() as *const __m128i));
        return (_mm256_shuffle_epi8(table, lo), _mm256_shuffle_epi8(table, hi));
    }
    if !F::FIVE {
        return (lo, hi);
    }
    // The fifth bits come right before the quants, bit h of each byte for chunk h (`tile`).
    let qh = _mm256_loadu_si256(t.add(8 * (F::HEAD - 4) * nb + 32 * i) as *const __m256i);
    let b = _mm256_set1_epi8(0x10);
    if ISA == AVX512 {
        let bit = |h: usize| _mm256_test_epi8_mask(qh, _mm256_set1_epi8(1 << h));
        return (_mm256_mask_add_epi8(lo, bit(p), lo, b), _mm256_mask_add_epi8(hi, bit(4 + p), hi, b));
    }
    (_mm256_or_si256(lo, _mm256_and_si256(bit_to_16(qh, p), b)), _mm256_or_si256(hi, _mm256_and_si256(bit_to_16(qh, 4 + p), b)))
}

/// Bit `h` of each byte moved to bit 4 (the other bits are left for the caller to mask): 16-bit
/// shifts, whose bits 4 of either byte come from the same byte for any shift of up to four.
/// Taking chunk h's fifth bits so costs two operations where spreading a word's 32 bits over 32
/// bytes cost five; Q5_0's one-row kernel read 12.7 GB/s in L3 that way (AMD EPYC Zen 3).
#[inline(always)]
unsafe fn bit_to_16(x: __m256i, h: usize) -> __m256i {
    match h {
        0 => _mm256_slli_epi16::<4>(x),
        1 => _mm256_slli_epi16::<3>(x),
        2 => _mm256_slli_epi16::<2>(x),
        3 => _mm256_slli_epi16::<1>(x),
        4 => x,
        5 => _mm256_srli_epi16::<1>(x),
        6 => _mm256_srli_epi16::<2>(x),
        _ => _mm256_srli_epi16::<3>(x),
    }
}

/// Instruction sets of the tile kernels: AVX2+FMA+F16C; plus AVX-VNNI (vpdpbusd); plus
/// AVX-512 VL/BW/VNNI (sixteen more vector registers, byte masks). All give identical results.
const AVX2: u8 = 0;
const VNNI: u8 = 1;
const AVX512: u8 = 2;

/// acc + the u8 x i8 dot of each group of four bytes: one vpdpbusd where AVX-VNNI exists, else
/// maddubs + madd (no i16 saturation: unsigned weights are < 32, or |w| <= 127 against |a| <= 127;
/// the flipped Q8_0 weights, up to 255, only ever meet vpdpbusd).
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
pub(super) unsafe fn bcast4(p: *const u8) -> __m256i {
    _mm256_set1_epi32((p as *const i32).read_unaligned())
}

/// Bytes ahead of the block being read that the AVX2 kernels prefetch, per weight stream (the
/// K-quants' in batches; see `kquant_tiles`): measured on a Zen 3 (AMD EPYC, two cores) in
/// decode, 8 KB beat 4 KB by 3-5% on a 1B model (Q4_0, Q4_K_M) and equalled 16 KB. The AVX-512
/// kernels keep their own.
pub(super) const PREFETCH: usize = 8192;

/// How decode prefetches: bytes ahead of the walk for the K-quants and for the 32-value formats,
/// and into which cache (0: L1, 1: L2). Measured with `examples/decode_rate` over 1 GB of
/// weights, one thread, interleaved runs: on a Xeon with AMX (2.6 GHz, 2 vCPUs) L1 and 6 KB
/// ahead gave Q4_K 14.8 GB/s and Q6_K 14.3 (4 KB within the tile, as before: 12.7 and 11.2;
/// 16 KB into L2: 13.3 and 12.1), and L1 and 4 KB gave Q4_0 16.1 (before: 14.0). On AMD Zen 4
/// an earlier round measured 16 KB into L2 best; that is the default there, unmeasured since.
/// On an AMD EPYC without AVX-512 (Zen 2/3, 2 vCPUs; interleaved runs) the K-quants ran best
/// with no distance: Q4_K 14.4-15.4 GB/s (16 KB into L2: 10.8-11.3; one superblock pair ahead:
/// 8.7-10.6), Q5_K 14.4-15.0 with no prefetch at all (12.7-13.0 asking for the superblock being
/// read), and Q6_K 12.7-13.8 asking for the superblock being read (none: 8.3; 16 KB into L2:
/// 7.4-7.9; `kquant_tiles`' `scattered`). Q4_0 was alike either way (16.5-19.3), so the 32-value
/// formats keep 16 KB into L2 there. Those K-quant figures asked for a superblock all at once;
/// spread over the body's steps (`Ahead`), 6-12 KB ahead gave Q4_K 19.1 GB/s, Q6_K 16.7-17.1 and
/// Q5_K 15.9-17.0 on that box (no distance: 13.8, 12.0, 13.9; probe 20-21), L1 and L2 alike, so
/// it takes 12 KB into L2. A K-quant distance of 0 prefetches nothing ahead.
/// `DASLLAMA_PREFETCH=BYTES[:l1|l2]` sets both distances and the cache, for such measurements.
#[derive(Clone, Copy)]
pub(super) struct Prefetch {
    pub kquant: usize,
    pub block32: usize,
    pub hint: u8,
}

pub(super) fn prefetch() -> Prefetch {
    static P: std::sync::OnceLock<Prefetch> = std::sync::OnceLock::new();
    *P.get_or_init(|| {
        let id = __cpuid(0);
        let amd = [id.ebx, id.edx, id.ecx] == [0x6874_7541, 0x6974_6e65, 0x444d_4163]; // "AuthenticAMD"
        let zen4 = amd && is_x86_feature_detected!("avx512f");
        let mut p = match (amd, zen4) {
            (true, true) => Prefetch { kquant: 16384, block32: 16384, hint: 1 },
            (true, false) => Prefetch { kquant: 12288, block32: 16384, hint: 1 },
            _ => Prefetch { kquant: 6144, block32: 4096, hint: 0 },
        };
        if let Some((b, hint)) = super::switches::get().prefetch {
            (p.kquant, p.block32) = (b, b);
            p.hint = hint.unwrap_or(p.hint);
        }
        p
    })
}

/// Prefetch `bytes` from `p` (line by line) into the cache `hint` names.
#[inline(always)]
pub(super) unsafe fn prefetch_lines(p: *const u8, bytes: usize, hint: u8) {
    for line in (0..bytes).step_by(64) {
        let q = p.wrapping_add(line) as *const i8;
        match hint {
            0 => _mm_prefetch::<_MM_HINT_T0>(q),
            _ => _mm_prefetch::<_MM_HINT_T1>(q),
        }
    }
}

/// Decode's prefetch for a 32-value format: every field of block `j` of the `tiles` tiles at `t`
/// that one call reads side by side (the blocks counted on into the tiles after them, which the
/// caller walks next), each region of a tile (`tile`: scales, mins, high bits, quants) its own
/// stream. A region with less than a line a block is asked for once per line.
#[inline(always)]
pub(super) unsafe fn prefetch_block<F: Fmt>(t: *const u8, nb: usize, tiles: usize, j: usize, hint: u8) {
    let tb = 8 * nb * F::WBYTES;
    let (group, j) = (j / nb, j % nb);
    let base = t.wrapping_add(tiles * tb * group);
    let dw = if F::MX { 1 } else { 2 };
    let mw = if F::MIN { 2 } else { 0 };
    let hw = if F::FIVE { 4 } else { 0 };
    for k in 0..tiles {
        let tile = base.wrapping_add(k * tb);
        prefetch_lines(tile.wrapping_add(8 * F::HEAD * nb + 8 * F::QROW * j), 8 * F::QROW, hint);
        let mut at = 0;
        for per in [8 * dw, 8 * mw, 8 * hw] {
            if per > 0 && (per * j) % 64 < per {
                prefetch_lines(tile.wrapping_add(at + per * j), 1, hint);
            }
            at += per * nb;
        }
    }
}

/// Decode's prefetch for a K-quant: superblock `j` of the `tiles` tiles at `t` that one call
/// reads side by side, counted on into the tiles after them as `prefetch_block` does.
#[inline(always)]
pub(super) unsafe fn prefetch_superblock(t: *const u8, nsb: usize, sb_bytes: usize, tiles: usize, j: usize, hint: u8) {
    for k in 0..tiles {
        prefetch_lines(superblock_at(t, nsb, sb_bytes, tiles, j, k), sb_bytes, hint);
    }
}

/// Where superblock `j` of tile `k` of the `tiles` tiles at `t` is, with `j` past the last
/// superblock counted on into the tiles the caller walks next.
#[inline(always)]
fn superblock_at(t: *const u8, nsb: usize, sb_bytes: usize, tiles: usize, j: usize, k: usize) -> *const u8 {
    let tb = nsb * sb_bytes;
    t.wrapping_add(j / nsb * tiles * tb + k * tb + j % nsb * sb_bytes)
}

/// The superblock a K-quant body asks for while it reads its own (decode), in parts spread over
/// its steps: asked for all at once at each superblock's start, 18 lines a tile, the requests
/// queue behind each other and the walk waits on them, as with no prefetch at all (Q4_K, one
/// thread, AMD EPYC Zen 3: 11-14 GB/s at any distance that way), where the 32-value formats,
/// which ask for a block's few lines as they go, reach the probe's bandwidth.
#[derive(Clone, Copy)]
pub(super) struct Ahead {
    p: *const u8,
    bytes: usize,
    hint: u8,
}

impl Ahead {
    pub(super) const NONE: Ahead = Ahead { p: std::ptr::null(), bytes: 0, hint: 0 };

    /// Part `part` of `parts` of the superblock ahead: as many whole lines each as the largest
    /// part needs, so that with `parts` a constant the count is one too and the prefetches are
    /// spelled out (the last part runs on into the next superblock, asked for again later).
    /// Counted per call and walked in a loop they cost Q6_K's one-row kernel a quarter of its rate
    /// in L2 (0.63-0.83x the generic kernel's in the same run, now 0.98-1.08x) and Q4_K's a tenth;
    /// from memory Q6_K read 10-16 GB/s so and 13-19 now (one thread, AMD EPYC Zen 3).
    #[inline(always)]
    pub(super) unsafe fn part(self, part: usize, parts: usize) {
        if self.p.is_null() {
            return;
        }
        let n = self.bytes.div_ceil(64).div_ceil(parts);
        let q = self.p.wrapping_add(64 * n * part) as *const i8;
        if self.hint == 0 {
            (0..n).for_each(|i| _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(64 * i)));
        } else {
            (0..n).for_each(|i| _mm_prefetch::<_MM_HINT_T1>(q.wrapping_add(64 * i)));
        }
    }
}

/// T consecutive tiles (eight weight rows each) against R activation rows: T x R vectors of
/// eight outputs. Several tiles at once (decode) read several streams, which keeps more memory
/// requests in flight than one stream per core can.
#[inline(always)]
unsafe fn tile_kernel<F: Fmt, const T: usize, const R: usize, const ISA: u8>(t: *const u8, a: [*const u8; R], nb: usize) -> [[__m256; R]; T] {
    let tile_bytes = 8 * nb * F::WBYTES;
    let tiles: [*const u8; T] = std::array::from_fn(|k| t.add(k * tile_bytes));
    // Activation rows end with d[nb] (f32), then q8_1's s[nb] (f32) or q8_0's block sums (i32).
    let tails: [*const f32; R] = std::array::from_fn(|r| a[r].add(nb * F::ABYTES) as *const f32);
    let mut acc = [[_mm256_setzero_ps(); R]; T];
    // With vpdpbusd, signed weights are flipped to unsigned (w + 128) once per tile and the
    // 128 x activation block sum taken back, instead of two sign ops per activation row; plain
    // AVX2's maddubs would saturate on them, so it keeps the sign trick. Same integers either way.
    let flip = F::SIGNED && ISA != AVX2;
    let zshift = if flip { 7 } else { F::ZSHIFT };
    let Prefetch { block32: ahead, hint, .. } = prefetch();
    let steps = ahead / (T * tile_bytes / nb);
    for i in 0..nb {
        if R == 1 {
            // Decode: in the order the walk reads, scales included (`prefetch_block`).
            prefetch_block::<F>(t, nb, T, i + steps, hint);
        }
        let mut start = [_mm256_setzero_si256(); R];
        if zshift > 0 {
            for r in 0..R {
                let s = (tails[r].add(nb + i) as *const i32).read_unaligned();
                start[r] = _mm256_set1_epi32(-(s << zshift));
            }
        }
        for (k, &t) in tiles.iter().enumerate() {
            // Hardware prefetchers alone leave DRAM bandwidth unused when the weights do not fit
            // the caches (decode); ask for the bytes a few blocks ahead.
            if R > 1 {
                let qs = t.wrapping_add(8 * F::HEAD * nb + 8 * F::QROW * i + PREFETCH);
                for line in (0..8 * F::QROW).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(qs.wrapping_add(line) as *const i8);
                }
            }
            let mut isum = start;
            let mut isum2 = [_mm256_setzero_si256(); R];
            if ISA == AVX2 && !F::SIGNED {
                // maddubs pairs add as 16-bit numbers across the block before one madd widens
                // them: a pair is at most 2 * 31 * 128 (5-bit weights, MXFP4's biased levels up
                // to 28) or 2 * 15 * 128 (4-bit), so four pairs per half (5-bit, MXFP4) or all
                // eight (4-bit) stay below 2^15. The integers, and so the results, are the
                // generic loop's.
                let mut h0 = [_mm256_setzero_si256(); R];
                let mut h1 = [_mm256_setzero_si256(); R];
                for p in 0..4 {
                    let (w0, w1) = pair::<F, ISA>(t, nb, i, p);
                    for r in 0..R {
                        let q = a[r].add(i * F::ABYTES + F::AQ + 4 * p);
                        h0[r] = _mm256_add_epi16(h0[r], _mm256_maddubs_epi16(w0, bcast4(q)));
                        h1[r] = _mm256_add_epi16(h1[r], _mm256_maddubs_epi16(w1, bcast4(q.add(16))));
                    }
                }
                let ones = _mm256_set1_epi16(1);
                for r in 0..R {
                    isum[r] = if F::FIVE || F::MX {
                        _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(h0[r], ones), _mm256_madd_epi16(h1[r], ones)))
                    } else {
                        _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_add_epi16(h0[r], h1[r]), ones))
                    };
                }
            }
            for p in (0..4).filter(|_| ISA != AVX2 || F::SIGNED) {
                let (w0, w1) = pair::<F, ISA>(t, nb, i, p);
                let (u0, u1) = if flip {
                    let top = _mm256_set1_epi8(0x80u8 as i8);
                    (_mm256_xor_si256(w0, top), _mm256_xor_si256(w1, top))
                } else if F::SIGNED {
                    (_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(w1, w1))
                } else {
                    (w0, w1)
                };
                for r in 0..R {
                    let q = a[r].add(i * F::ABYTES + F::AQ + 4 * p);
                    let (mut y0, mut y1) = (bcast4(q), bcast4(q.add(16)));
                    if F::SIGNED && !flip {
                        y0 = _mm256_sign_epi8(y0, w0);
                        y1 = _mm256_sign_epi8(y1, w1);
                    }
                    isum[r] = dp::<ISA>(isum[r], u0, y0);
                    isum2[r] = dp::<ISA>(isum2[r], u1, y1);
                }
            }
            let dw = scales8::<F>(t, i);
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

/// Asserts a tile kernel call is well formed and every load it makes is in bounds: `tile_bytes`
/// per tile, `act_bytes` per activation row. Returns the number of tiles.
fn check_call(t: &[u8], tile_bytes: usize, a: &[&[u8]], act_bytes: usize, out: &[[f32; 8]]) -> usize {
    let tiles = out.len() / a.len().max(1);
    assert!((1..=8).contains(&a.len()) && out.len() == tiles * a.len(), "out must hold tiles x activation rows");
    assert!(matches!(tiles, 1 | 2), "tile kernels take one or two tiles");
    assert!(t.len() >= tiles * tile_bytes, "weight tile too short");
    assert!(a.iter().all(|r| r.len() >= act_bytes), "activation row too short (size it with act_row_bytes)");
    tiles
}

/// A checked call with more activation rows than a kernel holds accumulators for: each tile
/// against runs of at most `rows` rows, `one(tile, rows, out)` (the same arithmetic per output).
/// The entry points used to call themselves per tile and again per run, checking every part:
/// seven checks for two tiles and eight rows, which on SmolLM2's 576-wide matrices (18 blocks a
/// row) took a tenth as long as the kernels themselves in a batch of sixteen.
pub(super) fn per_part(
    t: &[u8],
    tile_bytes: usize,
    tiles: usize,
    a: &[&[u8]],
    rows: usize,
    out: &mut [[f32; 8]],
    mut one: impl FnMut(*const u8, &[&[u8]], &mut [[f32; 8]]),
) {
    for (k, out) in out.chunks_exact_mut(a.len()).take(tiles).enumerate() {
        for (a, out) in a.chunks(rows).zip(out.chunks_mut(rows)) {
            one(t[k * tile_bytes..].as_ptr(), a, out);
        }
    }
}

/// A tile kernel call that passed its bounds check: blocks (superblocks) per row, tiles, and
/// the bytes of one tile.
pub(super) struct Checked {
    pub nb: usize,
    pub tiles: usize,
    pub tile_bytes: usize,
}

/// `check_call` for a row of `nb` blocks and tiles of `tile_bytes`.
fn checked(nb: usize, t: &[u8], tile_bytes: usize, a: &[&[u8]], act_bytes: usize, out: &[[f32; 8]]) -> Checked {
    Checked { nb, tiles: check_call(t, tile_bytes, a, act_bytes, out), tile_bytes }
}

fn check<F: Fmt>(t: &[u8], a: &[&[u8]], n: usize, out: &[[f32; 8]]) -> Checked {
    let nb = n / 32;
    checked(nb, t, 8 * nb * F::WBYTES, a, nb * (F::ABYTES + 8) + super::ACT_PAD, out)
}

/// What the tile entry points need of a format: its kernel and its bounds check.
trait TileFormat {
    /// T consecutive tiles against R activation rows (T x R vectors of eight outputs).
    unsafe fn kernel<const T: usize, const R: usize, const ISA: u8>(t: *const u8, a: [*const u8; R], nb: usize) -> [[__m256; R]; T];
    /// Asserts every load the kernel will make is in bounds.
    fn check(t: &[u8], a: &[&[u8]], n: usize, out: &[[f32; 8]]) -> Checked;
}

impl<F: Fmt> TileFormat for F {
    #[inline(always)]
    unsafe fn kernel<const T: usize, const R: usize, const ISA: u8>(t: *const u8, a: [*const u8; R], nb: usize) -> [[__m256; R]; T] {
        tile_kernel::<F, T, R, ISA>(t, a, nb)
    }
    fn check(t: &[u8], a: &[&[u8]], n: usize, out: &[[f32; 8]]) -> Checked {
        check::<F>(t, a, n, out)
    }
}

// ---- K-quants on tiles: the same vpdpbusd scheme per 32- (Q4_K) or 16-value (Q6_K)
// sub-block, whose integer sums are then weighted by the sub-block scales of each row (vpmulld)
// before one conversion per superblock. Activations are q8_K: d (f32), 256 i8, 16 i16 sums.

pub(super) struct Q4K;
pub(super) struct Q5K;
pub(super) struct Q6K;

/// q8_K field offsets.
pub(super) const K_QS: usize = 4;
pub(super) const K_BSUMS: usize = 260;
pub(super) const K_BYTES: usize = 292;

pub(super) fn check_kquant(sb: usize, t: &[u8], a: &[&[u8]], n: usize, out: &[[f32; 8]]) -> Checked {
    let nsb = n / 256;
    checked(nsb, t, nsb * sb, a, nsb * K_BYTES, out)
}

/// The superblock walk both K-quant kernels share. For each superblock of each tile `body`
/// returns, per activation row, the scale-weighted integer sum and (Q4_K) the mins' sum; they
/// land in the accumulators as d_w·d_a·sum − dmin_w·d_a·mins (d_w at the superblock's start,
/// dmin_w at `K45_DMIN`).
#[inline(always)]
pub(super) unsafe fn kquant_tiles<const T: usize, const R: usize>(
    t: *const u8,
    a: [*const u8; R],
    nsb: usize,
    sb_bytes: usize,
    scattered: bool,
    body: impl Fn(*const u8, Ahead, &[*const u8; R]) -> ([__m256i; R], Option<[__m256i; R]>),
) -> [[__m256; R]; T] {
    let mut acc = [[_mm256_setzero_ps(); R]; T];
    // Decode reads the weights from memory, in the order `superblock_at` follows; batches
    // read them from cache, where a near distance within each tile is enough.
    let Prefetch { kquant: ahead, hint, .. } = prefetch();
    let steps = ahead / (T * sb_bytes);
    for i in 0..nsb {
        let ab: [*const u8; R] = std::array::from_fn(|r| a[r].add(i * K_BYTES));
        // With no distance (`Prefetch`), a `scattered` format still asks for the superblock it is
        // about to read, all of it at once: its body jumps between the superblock's regions
        // (Q6_K's low and high bits), which the hardware prefetcher does not follow.
        if R == 1 && ahead == 0 && scattered {
            prefetch_superblock(t, nsb, sb_bytes, T, i, hint);
        }
        for (k, acc) in acc.iter_mut().enumerate() {
            let sb = t.add((k * nsb + i) * sb_bytes);
            if R > 1 {
                for line in (0..sb_bytes).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(sb.wrapping_add(PREFETCH + line) as *const i8);
                }
            }
            let pf = if R == 1 && ahead > 0 { Ahead { p: superblock_at(t, nsb, sb_bytes, T, i + steps, k), bytes: sb_bytes, hint } } else { Ahead::NONE };
            let (total, mins) = body(sb, pf, &ab);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(sb as *const __m128i));
            for r in 0..R {
                let da = _mm256_set1_ps((ab[r] as *const f32).read_unaligned());
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, da), _mm256_cvtepi32_ps(total[r]), acc[r]);
            }
            if let Some(mins) = mins {
                let dmin = _mm256_cvtph_ps(_mm_loadu_si128(sb.add(K45_DMIN) as *const __m128i));
                for r in 0..R {
                    let da = _mm256_set1_ps((ab[r] as *const f32).read_unaligned());
                    acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(mins[r]), acc[r]);
                }
            }
        }
    }
    acc
}

/// Chunk `c` of sub-block `sub` of a Q4_K/Q5_K tile as unsigned 4- (5-) bit values: sub-block
/// 2j takes the low nibbles of chunks 8j.., 2j+1 the high ones; in Q5_K (`FIVE`) the fifth bits
/// are bit `sub` of the qh bytes of the same values.
#[inline(always)]
pub(super) unsafe fn q45k_chunk<const FIVE: bool>(sb: *const u8, sub: usize, c: usize, m4: __m256i, b4: __m256i) -> __m256i {
    let (j, high) = (sub / 2, sub % 2 == 1);
    let qs = if FIVE { Q5K_QS } else { Q4K_QS };
    let raw = _mm256_loadu_si256(sb.add(qs + 256 * j + 32 * c) as *const __m256i);
    let w = if high { _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4) } else { _mm256_and_si256(raw, m4) };
    if !FIVE {
        return w;
    }
    let qh = _mm256_loadu_si256(sb.add(Q5K_QH + 32 * c) as *const __m256i);
    let bit = match sub {
        0 => _mm256_slli_epi16(qh, 4),
        1 => _mm256_slli_epi16(qh, 3),
        2 => _mm256_slli_epi16(qh, 2),
        3 => _mm256_slli_epi16(qh, 1),
        4 => qh,
        5 => _mm256_srli_epi16(qh, 1),
        6 => _mm256_srli_epi16(qh, 2),
        _ => _mm256_srli_epi16(qh, 3),
    };
    _mm256_or_si256(w, _mm256_and_si256(bit, b4))
}

/// Chunk `c` of quarter `q` of half `h` of a Q6_K tile as unsigned 6-bit values: four bits from
/// ql (low nibbles for q < 2, high ones after), two from qh.
#[inline(always)]
pub(super) unsafe fn q6k_chunk(sb: *const u8, h: usize, q: usize, c: usize, m4: __m256i, m30: __m256i) -> __m256i {
    let qh = _mm256_loadu_si256(sb.add(Q6K_QH + 256 * h + 32 * c) as *const __m256i);
    let ql = _mm256_loadu_si256(sb.add(Q6K_QL + 512 * h + 32 * (c + 8 * (q % 2))) as *const __m256i);
    let lo = if q < 2 { _mm256_and_si256(ql, m4) } else { _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4) };
    let hi = match q {
        0 => _mm256_slli_epi16(qh, 4),
        1 => _mm256_slli_epi16(qh, 2),
        2 => qh,
        _ => _mm256_srli_epi16(qh, 2),
    };
    _mm256_or_si256(lo, _mm256_and_si256(hi, m30))
}

/// Quarter `Q` of half `h` of a Q6_K superblock against R activation rows, into `total`: value
/// 128h + 32Q + l (l = 4c + e) is in sub-block 8h + 2Q + c/4.
#[inline(always)]
unsafe fn q6k_quarter<const Q: usize, const R: usize, const ISA: u8>(
    sb: *const u8,
    ab: &[*const u8; R],
    h: usize,
    total: &mut [__m256i; R],
    m4: __m256i,
    m30: __m256i,
) {
    for half in 0..2 {
        let sub = 8 * h + 2 * Q + half;
        // The (q - 32) offset: start from -32 * (sum of the sub-block's activations).
        let mut isum: [__m256i; R] = std::array::from_fn(|r| {
            let bs = (ab[r].add(K_BSUMS + 2 * sub) as *const i16).read_unaligned() as i32;
            _mm256_set1_epi32(-32 * bs)
        });
        for c in 4 * half..4 * half + 4 {
            let w = q6k_chunk(sb, h, Q, c, m4, m30);
            for r in 0..R {
                isum[r] = dp::<ISA>(isum[r], w, bcast4(ab[r].add(K_QS + 128 * h + 32 * Q + 4 * c)));
            }
        }
        let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(sb.add(Q6K_SC + 8 * sub) as *const __m128i));
        for r in 0..R {
            total[r] = _mm256_add_epi32(total[r], _mm256_mullo_epi32(isum[r], sc));
        }
    }
}

/// Q4_K and Q5_K (`FIVE`: a fifth bit per value from the tile's qh chunks) share everything but
/// where the quants start and that bit.
#[inline(always)]
unsafe fn q45k_sums<const R: usize, const ISA: u8, const FIVE: bool>(sb: *const u8, ab: &[*const u8; R]) -> ([__m256i; R], Option<[__m256i; R]>) {
    let (m4, b4) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(0x10));
    let mut total = [_mm256_setzero_si256(); R];
    for sub in 0..8 {
        let (j, high) = (sub / 2, sub % 2 == 1);
        let mut isum = [_mm256_setzero_si256(); R];
        for c in 0..8 {
            let w = q45k_chunk::<FIVE>(sb, sub, c, m4, b4);
            for r in 0..R {
                isum[r] = dp::<ISA>(isum[r], w, bcast4(ab[r].add(K_QS + 64 * j + 32 * high as usize + 4 * c)));
            }
        }
        let sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(sb.add(K45_SC + 8 * sub) as *const __m128i));
        for r in 0..R {
            total[r] = _mm256_add_epi32(total[r], _mm256_mullo_epi32(isum[r], sc));
        }
    }
    // Mins: over sub-blocks, m * (sum of the sub-block's activations), as i16 pairs
    // (m_s, m_s+1) against (sum_s, sum_s+1).
    let mut mins = [_mm256_setzero_si256(); R];
    for p in 0..4 {
        let m0 = _mm_loadl_epi64(sb.add(K45_M + 16 * p) as *const __m128i);
        let m1 = _mm_loadl_epi64(sb.add(K45_M + 8 + 16 * p) as *const __m128i);
        let mm = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m0, m1));
        for r in 0..R {
            let bs = ab[r].add(K_BSUMS) as *const i16;
            let pair = |s: usize| bs.add(2 * s).read_unaligned() as i32 + bs.add(2 * s + 1).read_unaligned() as i32;
            let both = (pair(2 * p) & 0xFFFF) | (pair(2 * p + 1) << 16);
            mins[r] = _mm256_add_epi32(mins[r], _mm256_madd_epi16(mm, _mm256_set1_epi32(both)));
        }
    }
    (total, Some(mins))
}

impl TileFormat for Q4K {
    #[inline(always)]
    unsafe fn kernel<const T: usize, const R: usize, const ISA: u8>(t: *const u8, a: [*const u8; R], nsb: usize) -> [[__m256; R]; T] {
        kquant_tiles::<T, R>(t, a, nsb, super::tile::Q4K_TILE_BLOCK, false, |sb, pf, ab| {
            pf.part(0, 1);
            q45k_sums::<R, ISA, false>(sb, ab)
        })
    }
    fn check(t: &[u8], a: &[&[u8]], n: usize, out: &[[f32; 8]]) -> Checked {
        check_kquant(super::tile::Q4K_TILE_BLOCK, t, a, n, out)
    }
}

impl TileFormat for Q5K {
    #[inline(always)]
    unsafe fn kernel<const T: usize, const R: usize, const ISA: u8>(t: *const u8, a: [*const u8; R], nsb: usize) -> [[__m256; R]; T] {
        kquant_tiles::<T, R>(t, a, nsb, super::tile::Q5K_TILE_BLOCK, false, |sb, pf, ab| {
            pf.part(0, 1);
            q45k_sums::<R, ISA, true>(sb, ab)
        })
    }
    fn check(t: &[u8], a: &[&[u8]], n: usize, out: &[[f32; 8]]) -> Checked {
        check_kquant(super::tile::Q5K_TILE_BLOCK, t, a, n, out)
    }
}

impl TileFormat for Q6K {
    #[inline(always)]
    unsafe fn kernel<const T: usize, const R: usize, const ISA: u8>(t: *const u8, a: [*const u8; R], nsb: usize) -> [[__m256; R]; T] {
        let (m4, m30) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(0x30));
        kquant_tiles::<T, R>(t, a, nsb, super::tile::Q6K_TILE_BLOCK, true, |sb, pf, ab| {
            pf.part(0, 1);
            let mut total = [_mm256_setzero_si256(); R];
            // Each quarter a constant, for its shifts (see `avx2_kquant`'s Q6_K).
            for h in 0..2 {
                q6k_quarter::<0, R, ISA>(sb, ab, h, &mut total, m4, m30);
                q6k_quarter::<1, R, ISA>(sb, ab, h, &mut total, m4, m30);
                q6k_quarter::<2, R, ISA>(sb, ab, h, &mut total, m4, m30);
                q6k_quarter::<3, R, ISA>(sb, ab, h, &mut total, m4, m30);
            }
            (total, None)
        })
    }
    fn check(t: &[u8], a: &[&[u8]], n: usize, out: &[[f32; 8]]) -> Checked {
        check_kquant(super::tile::Q6K_TILE_BLOCK, t, a, n, out)
    }
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
                let acc = <$fmt as TileFormat>::kernel::<T, R, { $isa }>(t, std::array::from_fn(|r| a[r].as_ptr()), nb);
                for (k, tile) in acc.iter().enumerate() {
                    for (r, v) in tile.iter().enumerate() {
                        _mm256_storeu_ps(out[k * R + r].as_mut_ptr(), *v);
                    }
                }
            }
            let Checked { nb, tiles, tile_bytes } = <$fmt as TileFormat>::check(t, a, n, out);
            if $isa == AVX512 && tiles == 2 {
                // SAFETY: handed out only after detecting AVX-512; `check` bounds every load.
                return unsafe { super::avx512::run::<$fmt>(t, a, nb, out) };
            }
            if a.len() > 4 || (tiles == 2 && a.len() > 2) {
                // Sixteen vector registers hold the accumulators of at most four rows (AVX-512's
                // 32, eight: the tiles one at a time).
                let rows = if $isa == AVX512 { 8 } else { 4 };
                // SAFETY: as below; each part is a tile and rows of the checked call.
                return per_part(t, tile_bytes, tiles, a, rows, out, |t, a, out| unsafe {
                    match a.len() {
                        1 => k::<1, 1>(t, a, nb, out),
                        2 => k::<1, 2>(t, a, nb, out),
                        3 => k::<1, 3>(t, a, nb, out),
                        4 => k::<1, 4>(t, a, nb, out),
                        5 => k::<1, 5>(t, a, nb, out),
                        6 => k::<1, 6>(t, a, nb, out),
                        7 => k::<1, 7>(t, a, nb, out),
                        _ => k::<1, 8>(t, a, nb, out),
                    }
                });
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
tile_entries!(Q5_1, tile_q5_1, vnni_tile_q5_1, avx512_tile_q5_1);
tile_entries!(Q8_0, tile_q8_0, vnni_tile_q8_0, avx512_tile_q8_0);
tile_entries!(Mxfp4, tile_mxfp4, vnni_tile_mxfp4, avx512_tile_mxfp4);
tile_entries!(Q4K, tile_q4_k, vnni_tile_q4_k, avx512_tile_q4_k);
tile_entries!(Q5K, tile_q5_k, vnni_tile_q5_k, avx512_tile_q5_k);
tile_entries!(Q6K, tile_q6_k, vnni_tile_q6_k, avx512_tile_q6_k);

/// Every tile kernel variant this CPU can run for `ty`, named, best last (tests compare them).
pub fn tile_variants(ty: GgmlType) -> Vec<(&'static str, TileFn)> {
    let all: [TileFn; 3] = match ty {
        GgmlType::Q4_0 => [tile_q4_0, vnni_tile_q4_0, avx512_tile_q4_0],
        GgmlType::Q4_1 => [tile_q4_1, vnni_tile_q4_1, avx512_tile_q4_1],
        GgmlType::Q5_0 => [tile_q5_0, vnni_tile_q5_0, avx512_tile_q5_0],
        GgmlType::Q5_1 => [tile_q5_1, vnni_tile_q5_1, avx512_tile_q5_1],
        GgmlType::Q8_0 => [tile_q8_0, vnni_tile_q8_0, avx512_tile_q8_0],
        GgmlType::MXFP4 => [tile_mxfp4, vnni_tile_mxfp4, avx512_tile_mxfp4],
        GgmlType::Q4K => [tile_q4_k, vnni_tile_q4_k, avx512_tile_q4_k],
        GgmlType::Q5K => [tile_q5_k, vnni_tile_q5_k, avx512_tile_q5_k],
        GgmlType::Q6K => [tile_q6_k, vnni_tile_q6_k, avx512_tile_q6_k],
        _ => return Vec::new(),
    };
    let usable = [has_avx2(), has_avx2() && has_vnni(), has_avx2() && has_avx512()];
    let mut v: Vec<_> = ["avx2", "avx-vnni", "avx512"].into_iter().zip(all).zip(usable).filter(|(_, ok)| *ok).map(|(v, _)| v).collect();
    // K-quants without VNNI: scales folded into the i16 stage beats the generic AVX2 kernel.
    if let Some(k) = super::avx2_kquant::tile_fn(ty).filter(|_| has_avx2()) {
        v.insert(1, ("avx2-i16", k));
    }
    v
}
