//! AVX-512 tile kernels on pairs of tiles: the same scheme as the 256-bit kernels in `avx2`, with
//! two consecutive tiles (sixteen weight rows) side by side in one 512-bit register, lanes 0-7
//! the first tile's rows and 8-15 the second's. A `vpdpbusd` then does twice the multiply-adds,
//! and the nibble unpacking, sign flips, scale conversions and per-block float steps are paid once
//! per sixteen rows instead of per eight. Every lane does the integer sums and the f32 steps of
//! the 256-bit AVX-512 kernel in the same order, so results are bit-identical to it (and so to
//! every batch size).
//!
//! The tiled layout is the one in `tile`: a pair is two tiles `gap` bytes apart, each half of a
//! 512-bit operand loaded from its own tile (`pair_load`).

use super::avx2::{prefetch, prefetch_block, prefetch_superblock, Fmt, Prefetch, Q4K, Q5K, Q6K};
use super::avx2::{K_BSUMS, K_BYTES, K_QS};
use super::tile::{K45_DMIN, K45_M, K45_SC, Q4K_QS, Q4K_TILE_BLOCK, Q5K_QH, Q5K_QS, Q5K_TILE_BLOCK, Q6K_QH, Q6K_QL, Q6K_SC, Q6K_TILE_BLOCK};
use std::arch::x86_64::*;

/// Bytes ahead of the block being read that the batch kernels prefetch, per weight stream (one
/// row, decode, follows `prefetch`).
const PREFETCH: usize = 4096;

/// 32 bytes at `p` of the first tile and at `p + gap` of the second, as one vector.
#[inline(always)]
pub(super) unsafe fn pair_load(p: *const u8, gap: usize) -> __m512i {
    let lo = _mm256_loadu_si256(p as *const __m256i);
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), _mm256_loadu_si256(p.add(gap) as *const __m256i))
}

/// Eight f16 per tile (one per row) as sixteen f32.
#[inline(always)]
pub(super) unsafe fn pair_f16(p: *const u8, gap: usize) -> __m512 {
    let lo = _mm_loadu_si128(p as *const __m128i);
    _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), _mm_loadu_si128(p.add(gap) as *const __m128i)))
}

/// Eight bytes per tile (one per row), as sixteen bytes in lane order.
#[inline(always)]
pub(super) unsafe fn pair_bytes(p: *const u8, gap: usize) -> __m128i {
    _mm_unpacklo_epi64(_mm_loadl_epi64(p as *const __m128i), _mm_loadl_epi64(p.add(gap) as *const __m128i))
}

/// Eight E8M0 bytes per tile (one per row) as sixteen f32, each `mxfp4::e8m0_half` (see
/// `avx2::e8m0_half8`).
#[inline(always)]
unsafe fn pair_e8m0_half(p: *const u8, gap: usize) -> __m512 {
    let e = _mm512_cvtepu8_epi32(pair_bytes(p, gap));
    let normal = _mm512_slli_epi32::<23>(_mm512_sub_epi32(e, _mm512_set1_epi32(1)));
    let sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x0020_0000), e);
    _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, sub))
}

/// Four activation bytes in every lane.
#[inline(always)]
unsafe fn bcast4(p: *const u8) -> __m512i {
    _mm512_set1_epi32((p as *const i32).read_unaligned())
}

#[inline(always)]
unsafe fn prefetch_ahead(p: *const u8, bytes: usize) {
    for line in (0..bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH + line) as *const i8);
    }
}

/// A pair of tiles of a 32-value format against R activation rows.
#[inline(always)]
unsafe fn pair_kernel<F: Fmt, const R: usize>(t: *const u8, a: [*const u8; R], nb: usize) -> [__m512; R] {
    let gap = 8 * nb * F::WBYTES;
    let tails: [*const f32; R] = std::array::from_fn(|r| a[r].add(nb * F::ABYTES) as *const f32);
    let mut acc = [_mm512_setzero_ps(); R];
    // Signed weights are flipped to unsigned (w + 128) and 128 x the activation sum taken back.
    let zshift = if F::SIGNED { 7 } else { F::ZSHIFT };
    let (m4, top, b) = (_mm512_set1_epi8(0xF), _mm512_set1_epi8(0x80u8 as i8), _mm512_set1_epi8(0x10));
    // MXFP4: the biased levels in every 128-bit lane, for one `vpshufb` per 64 nibbles.
    let table = _mm512_broadcast_i32x4(_mm_loadu_si128(super::mxfp4::BIASED.as_ptr() as *const __m128i));
    let Prefetch { block32: ahead, hint, .. } = prefetch();
    let steps = ahead / (2 * gap / nb);
    for i in 0..nb {
        let qs = t.add(8 * F::HEAD * nb + 8 * F::QROW * i);
        if R > 1 {
            prefetch_ahead(qs, 8 * F::QROW);
            prefetch_ahead(qs.add(gap), 8 * F::QROW);
        } else {
            prefetch_block::<F>(t, nb, 2, i + steps, hint);
        }
        let mut isum = [_mm512_setzero_si512(); R];
        if zshift > 0 {
            for r in 0..R {
                let s = (tails[r].add(nb + i) as *const i32).read_unaligned();
                isum[r] = _mm512_set1_epi32(-(s << zshift));
            }
        }
        let mut isum2 = [_mm512_setzero_si512(); R];
        for p in 0..4 {
            let (u0, u1) = if F::SIGNED {
                (_mm512_xor_si512(pair_load(qs.add(32 * p), gap), top), _mm512_xor_si512(pair_load(qs.add(128 + 32 * p), gap), top))
            } else {
                let raw = pair_load(qs.add(32 * p), gap);
                let (lo, hi) = (_mm512_and_si512(raw, m4), _mm512_and_si512(_mm512_srli_epi16::<4>(raw), m4));
                if F::FIVE {
                    // The fifth bits: bit h of each byte lane for chunk h, in both tiles.
                    let qh = pair_load(t.add(8 * (F::HEAD - 4) * nb + 32 * i), gap);
                    let bit = |h: usize| _mm512_test_epi8_mask(qh, _mm512_set1_epi8(1 << h));
                    (_mm512_mask_add_epi8(lo, bit(p), lo, b), _mm512_mask_add_epi8(hi, bit(4 + p), hi, b))
                } else if F::MX {
                    (_mm512_shuffle_epi8(table, lo), _mm512_shuffle_epi8(table, hi))
                } else {
                    (lo, hi)
                }
            };
            for r in 0..R {
                let q = a[r].add(i * F::ABYTES + F::AQ + 4 * p);
                isum[r] = _mm512_dpbusd_epi32(isum[r], u0, bcast4(q));
                isum2[r] = _mm512_dpbusd_epi32(isum2[r], u1, bcast4(q.add(16)));
            }
        }
        let dw = if F::MX { pair_e8m0_half(t.add(8 * i), gap) } else { pair_f16(t.add(16 * i), gap) };
        for r in 0..R {
            let d = _mm512_mul_ps(dw, _mm512_set1_ps(tails[r].add(i).read_unaligned()));
            acc[r] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_add_epi32(isum[r], isum2[r])), acc[r]);
        }
        if F::MIN {
            let mw = pair_f16(t.add(16 * nb + 16 * i), gap);
            for r in 0..R {
                acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(tails[r].add(nb + i).read_unaligned()), acc[r]);
            }
        }
    }
    acc
}

/// The K-quants' superblock walk (`avx2::kquant_tiles`) on a pair of tiles.
#[inline(always)]
unsafe fn kquant_pair<const R: usize>(
    t: *const u8,
    a: [*const u8; R],
    nsb: usize,
    sb_bytes: usize,
    body: impl Fn(*const u8, usize, &[*const u8; R]) -> ([__m512i; R], Option<[__m512i; R]>),
) -> [__m512; R] {
    let gap = nsb * sb_bytes;
    let mut acc = [_mm512_setzero_ps(); R];
    let Prefetch { kquant: ahead, hint, .. } = prefetch();
    let steps = ahead / (2 * sb_bytes);
    for i in 0..nsb {
        let ab: [*const u8; R] = std::array::from_fn(|r| a[r].add(i * K_BYTES));
        let sb = t.add(i * sb_bytes);
        if R > 1 {
            prefetch_ahead(sb, sb_bytes);
            prefetch_ahead(sb.add(gap), sb_bytes);
        } else {
            prefetch_superblock(t, nsb, sb_bytes, 2, i + steps, hint);
        }
        let (total, mins) = body(sb, gap, &ab);
        let dw = pair_f16(sb, gap);
        for r in 0..R {
            let da = _mm512_set1_ps((ab[r] as *const f32).read_unaligned());
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, da), _mm512_cvtepi32_ps(total[r]), acc[r]);
        }
        if let Some(mins) = mins {
            let dmin = pair_f16(sb.add(K45_DMIN), gap);
            for r in 0..R {
                let da = _mm512_set1_ps((ab[r] as *const f32).read_unaligned());
                acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, da), _mm512_cvtepi32_ps(mins[r]), acc[r]);
            }
        }
    }
    acc
}

/// Q4_K and Q5_K (`FIVE`): `avx2::q45k_sums` on a pair of tiles.
#[inline(always)]
unsafe fn q45k_sums<const R: usize, const FIVE: bool>(sb: *const u8, gap: usize, ab: &[*const u8; R]) -> ([__m512i; R], Option<[__m512i; R]>) {
    let (m4, b4) = (_mm512_set1_epi8(0xF), _mm512_set1_epi8(0x10));
    let qs = if FIVE { Q5K_QS } else { Q4K_QS };
    let mut total = [_mm512_setzero_si512(); R];
    for sub in 0..8 {
        let (j, high) = (sub / 2, sub % 2 == 1);
        let mut isum = [_mm512_setzero_si512(); R];
        for c in 0..8 {
            let raw = pair_load(sb.add(qs + 256 * j + 32 * c), gap);
            let mut w = if high { _mm512_and_si512(_mm512_srli_epi16::<4>(raw), m4) } else { _mm512_and_si512(raw, m4) };
            if FIVE {
                let qh = pair_load(sb.add(Q5K_QH + 32 * c), gap);
                let bit = match sub {
                    0 => _mm512_slli_epi16::<4>(qh),
                    1 => _mm512_slli_epi16::<3>(qh),
                    2 => _mm512_slli_epi16::<2>(qh),
                    3 => _mm512_slli_epi16::<1>(qh),
                    4 => qh,
                    5 => _mm512_srli_epi16::<1>(qh),
                    6 => _mm512_srli_epi16::<2>(qh),
                    _ => _mm512_srli_epi16::<3>(qh),
                };
                w = _mm512_or_si512(w, _mm512_and_si512(bit, b4));
            }
            for r in 0..R {
                isum[r] = _mm512_dpbusd_epi32(isum[r], w, bcast4(ab[r].add(K_QS + 64 * j + 32 * high as usize + 4 * c)));
            }
        }
        let sc = _mm512_cvtepu8_epi32(pair_bytes(sb.add(K45_SC + 8 * sub), gap));
        for r in 0..R {
            total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(isum[r], sc));
        }
    }
    // Mins: i16 pairs (m_s, m_s+1) of each row against (sum_s, sum_s+1) of the activations.
    let mut mins = [_mm512_setzero_si512(); R];
    for p in 0..4 {
        let m = |at: usize| _mm_unpacklo_epi8(_mm_loadl_epi64(sb.add(at) as *const __m128i), _mm_loadl_epi64(sb.add(at + 8) as *const __m128i));
        let (m0, m1) = (m(K45_M + 16 * p), m(gap + K45_M + 16 * p));
        let mm = _mm512_cvtepu8_epi16(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(m0), m1));
        for r in 0..R {
            let bs = ab[r].add(K_BSUMS) as *const i16;
            let pair = |s: usize| bs.add(2 * s).read_unaligned() as i32 + bs.add(2 * s + 1).read_unaligned() as i32;
            let both = (pair(2 * p) & 0xFFFF) | (pair(2 * p + 1) << 16);
            mins[r] = _mm512_add_epi32(mins[r], _mm512_madd_epi16(mm, _mm512_set1_epi32(both)));
        }
    }
    (total, Some(mins))
}

/// The activation sums of a q8_K block's eight 32-value sub-blocks as i16 pairs: dword p holds
/// (sum_2p, sum_2p+1), the operand `vpmaddwd` takes against a row's mins (m_2p, m_2p+1).
#[inline(always)]
pub(super) unsafe fn q8k_sub_sums(a: *const u8) -> __m256i {
    let s32 = _mm256_madd_epi16(_mm256_loadu_si256(a.add(K_BSUMS) as *const __m256i), _mm256_set1_epi16(1));
    _mm256_castsi128_si256(_mm_packs_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256::<1>(s32)))
}

/// `q45k_sums` for one activation row (decode), the same integers by a shorter walk: each 32
/// bytes of quants are loaded once for both their nibbles (sub-blocks 2j and 2j + 1), and in Q5_K
/// the fifth bits are a byte mask (`vptestmb`) that adds 16, so no shift depends on the
/// sub-block. The mins take the activation's sub-block sums from one `vpmaddwd` over its block
/// sums instead of sixteen scalar loads.
#[inline(always)]
unsafe fn q45k_one<const R: usize, const FIVE: bool>(sb: *const u8, gap: usize, ab: &[*const u8; R]) -> ([__m512i; R], Option<[__m512i; R]>) {
    let a = ab[0];
    let (m4, b16) = (_mm512_set1_epi8(0xF), _mm512_set1_epi8(0x10));
    let qs = if FIVE { Q5K_QS } else { Q4K_QS };
    let mut total = _mm512_setzero_si512();
    for j in 0..4 {
        let (mut lo_acc, mut hi_acc) = (_mm512_setzero_si512(), _mm512_setzero_si512());
        for c in 0..8 {
            let raw = pair_load(sb.add(qs + 256 * j + 32 * c), gap);
            let (mut lo, mut hi) = (_mm512_and_si512(raw, m4), _mm512_and_si512(_mm512_srli_epi16::<4>(raw), m4));
            if FIVE {
                let qh = pair_load(sb.add(Q5K_QH + 32 * c), gap);
                lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh, _mm512_set1_epi8(1 << (2 * j))), lo, b16);
                hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(qh, _mm512_set1_epi8(2 << (2 * j))), hi, b16);
            }
            let y = a.add(K_QS + 64 * j + 4 * c);
            lo_acc = _mm512_dpbusd_epi32(lo_acc, lo, bcast4(y));
            hi_acc = _mm512_dpbusd_epi32(hi_acc, hi, bcast4(y.add(32)));
        }
        let sc_lo = _mm512_cvtepu8_epi32(pair_bytes(sb.add(K45_SC + 16 * j), gap));
        let sc_hi = _mm512_cvtepu8_epi32(pair_bytes(sb.add(K45_SC + 16 * j + 8), gap));
        total = _mm512_add_epi32(total, _mm512_add_epi32(_mm512_mullo_epi32(lo_acc, sc_lo), _mm512_mullo_epi32(hi_acc, sc_hi)));
    }
    let sums = _mm512_castsi256_si512(q8k_sub_sums(a));
    let mut mins = _mm512_setzero_si512();
    for p in 0..4 {
        let m = |at: usize| _mm_unpacklo_epi8(_mm_loadl_epi64(sb.add(at) as *const __m128i), _mm_loadl_epi64(sb.add(at + 8) as *const __m128i));
        let (m0, m1) = (m(K45_M + 16 * p), m(gap + K45_M + 16 * p));
        let mm = _mm512_cvtepu8_epi16(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(m0), m1));
        let both = _mm512_permutexvar_epi32(_mm512_set1_epi32(p as i32), sums);
        mins = _mm512_add_epi32(mins, _mm512_madd_epi16(mm, both));
    }
    (std::array::from_fn(|_| total), Some(std::array::from_fn(|_| mins)))
}

/// `q6k_sums` for one activation row (decode), walked by chunk position as `avx2_kquant`'s
/// `q6k_one` is: the four quarters of a chunk share its qh vector and pairs of them an ql vector,
/// each loaded once, and every shift is a constant. Eight sub-block sums of each half are kept
/// apart until their scales weigh them, so the integers are the general kernel's.
#[inline(always)]
unsafe fn q6k_one<const R: usize>(sb: *const u8, gap: usize, ab: &[*const u8; R]) -> ([__m512i; R], Option<[__m512i; R]>) {
    let a = ab[0];
    let (m4, m30) = (_mm512_set1_epi8(0xF), _mm512_set1_epi8(0x30));
    let mut total = _mm512_setzero_si512();
    for h in 0..2 {
        // acc[2q + c/4] is sub-block 8h + 2q + c/4; the (q - 32) offset starts it at -32 x the
        // sub-block's activation sum, as in `q6k_quarter`.
        let mut acc: [__m512i; 8] = std::array::from_fn(|s| {
            let bs = (a.add(K_BSUMS + 2 * (8 * h + s)) as *const i16).read_unaligned() as i32;
            _mm512_set1_epi32(-32 * bs)
        });
        for c in 0..8 {
            let qh = pair_load(sb.add(Q6K_QH + 256 * h + 32 * c), gap);
            let qa = pair_load(sb.add(Q6K_QL + 512 * h + 32 * c), gap);
            let qb = pair_load(sb.add(Q6K_QL + 512 * h + 32 * (c + 8)), gap);
            let w = [
                _mm512_or_si512(_mm512_and_si512(qa, m4), _mm512_and_si512(_mm512_slli_epi16::<4>(qh), m30)),
                _mm512_or_si512(_mm512_and_si512(qb, m4), _mm512_and_si512(_mm512_slli_epi16::<2>(qh), m30)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(qa), m4), _mm512_and_si512(qh, m30)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(qb), m4), _mm512_and_si512(_mm512_srli_epi16::<2>(qh), m30)),
            ];
            for (q, w) in w.into_iter().enumerate() {
                let s = 2 * q + c / 4;
                acc[s] = _mm512_dpbusd_epi32(acc[s], w, bcast4(a.add(K_QS + 128 * h + 32 * q + 4 * c)));
            }
        }
        for (s, acc) in acc.into_iter().enumerate() {
            let sc = _mm512_cvtepi8_epi32(pair_bytes(sb.add(Q6K_SC + 8 * (8 * h + s)), gap));
            total = _mm512_add_epi32(total, _mm512_mullo_epi32(acc, sc));
        }
    }
    (std::array::from_fn(|_| total), None)
}

/// Q6_K: the 256-bit Q6_K kernel's sums on a pair of tiles.
#[inline(always)]
unsafe fn q6k_sums<const R: usize>(sb: *const u8, gap: usize, ab: &[*const u8; R]) -> ([__m512i; R], Option<[__m512i; R]>) {
    let (m4, m30) = (_mm512_set1_epi8(0xF), _mm512_set1_epi8(0x30));
    let mut total = [_mm512_setzero_si512(); R];
    // Each quarter a constant, for its shifts (see `avx2_kquant`'s Q6_K: a quarter taken from a
    // rolled loop cost the AVX2 kernels a jump table per chunk).
    for h in 0..2 {
        q6k_quarter::<0, R>(sb, gap, ab, h, &mut total, m4, m30);
        q6k_quarter::<1, R>(sb, gap, ab, h, &mut total, m4, m30);
        q6k_quarter::<2, R>(sb, gap, ab, h, &mut total, m4, m30);
        q6k_quarter::<3, R>(sb, gap, ab, h, &mut total, m4, m30);
    }
    (total, None)
}

/// Quarter `Q` of half `h` of a pair of Q6_K superblocks against R activation rows, into
/// `total`: value 128h + 32Q + l (l = 4c + e) is in sub-block 8h + 2Q + c/4.
#[inline(always)]
unsafe fn q6k_quarter<const Q: usize, const R: usize>(
    sb: *const u8,
    gap: usize,
    ab: &[*const u8; R],
    h: usize,
    total: &mut [__m512i; R],
    m4: __m512i,
    m30: __m512i,
) {
    for half in 0..2 {
        let sub = 8 * h + 2 * Q + half;
        // The (q - 32) offset: start from -32 * (sum of the sub-block's activations).
        let mut isum: [__m512i; R] = std::array::from_fn(|r| {
            let bs = (ab[r].add(K_BSUMS + 2 * sub) as *const i16).read_unaligned() as i32;
            _mm512_set1_epi32(-32 * bs)
        });
        for c in 4 * half..4 * half + 4 {
            let qh = pair_load(sb.add(Q6K_QH + 256 * h + 32 * c), gap);
            let ql = pair_load(sb.add(Q6K_QL + 512 * h + 32 * (c + 8 * (Q % 2))), gap);
            let lo = if Q < 2 { _mm512_and_si512(ql, m4) } else { _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4) };
            let hi = match Q {
                0 => _mm512_slli_epi16::<4>(qh),
                1 => _mm512_slli_epi16::<2>(qh),
                2 => qh,
                _ => _mm512_srli_epi16::<2>(qh),
            };
            let w = _mm512_or_si512(lo, _mm512_and_si512(hi, m30));
            for r in 0..R {
                isum[r] = _mm512_dpbusd_epi32(isum[r], w, bcast4(ab[r].add(K_QS + 128 * h + 32 * Q + 4 * c)));
            }
        }
        let sc = _mm512_cvtepi8_epi32(pair_bytes(sb.add(Q6K_SC + 8 * sub), gap));
        for r in 0..R {
            total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(isum[r], sc));
        }
    }
}

/// Float weights, sixteen values at element `i` as f32 (all of them, or the lanes of `m`).
pub(super) trait WideFloat {
    const BYTES: usize;
    unsafe fn sixteen(p: *const u8, i: usize) -> __m512;
    unsafe fn sixteen_masked(p: *const u8, i: usize, m: __mmask16) -> __m512;
}
pub(super) struct F32w;
pub(super) struct F16w;
pub(super) struct BF16w;
impl WideFloat for F32w {
    const BYTES: usize = 4;
    #[inline(always)]
    unsafe fn sixteen(p: *const u8, i: usize) -> __m512 {
        _mm512_loadu_ps((p as *const f32).add(i))
    }
    #[inline(always)]
    unsafe fn sixteen_masked(p: *const u8, i: usize, m: __mmask16) -> __m512 {
        _mm512_maskz_loadu_ps(m, (p as *const f32).add(i))
    }
}
impl WideFloat for F16w {
    const BYTES: usize = 2;
    #[inline(always)]
    unsafe fn sixteen(p: *const u8, i: usize) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.add(2 * i) as *const __m256i))
    }
    #[inline(always)]
    unsafe fn sixteen_masked(p: *const u8, i: usize, m: __mmask16) -> __m512 {
        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p.add(2 * i) as *const i16))
    }
}
impl WideFloat for BF16w {
    const BYTES: usize = 2;
    #[inline(always)]
    unsafe fn sixteen(p: *const u8, i: usize) -> __m512 {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.add(2 * i) as *const __m256i))))
    }
    #[inline(always)]
    unsafe fn sixteen_masked(p: *const u8, i: usize, m: __mmask16) -> __m512 {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p.add(2 * i) as *const i16))))
    }
}

/// W float weight rows against R f32 activation rows, a 16-lane accumulator for each pair: value
/// i goes to lane i mod 16, one chain per pair (W chains in flight at one activation row, so
/// decode streams at memory speed), the tail masked in. Each weight vector serves R rows and each
/// activation vector W rows, so a batch reads both from registers. The accumulator's halves are
/// added, then `hsum`'s eight lanes: one order per pair whatever W and R are.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // the indices pick accumulators, which are the summation order
unsafe fn float_dots<F: WideFloat, const W: usize, const R: usize>(w: [*const u8; W], a: [*const f32; R], n: usize) -> [[f32; R]; W] {
    let mut acc = [[_mm512_setzero_ps(); R]; W];
    let mut i = 0;
    while i + 16 <= n {
        if i % 32 == 0 {
            for wi in 0..W {
                prefetch_ahead(w[wi].add(i * F::BYTES), 32 * F::BYTES);
            }
        }
        let av: [__m512; R] = std::array::from_fn(|r| _mm512_loadu_ps(a[r].add(i)));
        for wi in 0..W {
            let wv = F::sixteen(w[wi], i);
            for r in 0..R {
                acc[wi][r] = _mm512_fmadd_ps(wv, av[r], acc[wi][r]);
            }
        }
        i += 16;
    }
    if i < n {
        let m: __mmask16 = (1u16 << (n - i)) - 1;
        let av: [__m512; R] = std::array::from_fn(|r| _mm512_maskz_loadu_ps(m, a[r].add(i)));
        for wi in 0..W {
            let wv = F::sixteen_masked(w[wi], i, m);
            for r in 0..R {
                acc[wi][r] = _mm512_fmadd_ps(wv, av[r], acc[wi][r]);
            }
        }
    }
    std::array::from_fn(|wi| {
        std::array::from_fn(|r| {
            let s = acc[wi][r];
            super::avx2::hsum(_mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(s)))))
        })
    })
}

macro_rules! wide_float_entry {
    ($name:ident, $fmt:ty) => {
        /// `DotsFn` on AVX-512 (see `float_dots`).
        pub(super) fn $name(w: &[&[u8]], a: &[&[u8]], n: usize, out: &mut [f32]) {
            let (nw, nt) = super::avx2::check_floats(w, a, n, out, <$fmt>::BYTES);
            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
            unsafe fn k<const W: usize, const R: usize>(w: &[&[u8]], a: &[&[u8]], n: usize, out: &mut [f32]) {
                let sums = float_dots::<$fmt, W, R>(std::array::from_fn(|i| w[i].as_ptr()), std::array::from_fn(|r| a[r].as_ptr() as *const f32), n);
                for (o, s) in out.chunks_exact_mut(R).zip(&sums) {
                    o.copy_from_slice(s);
                }
            }
            macro_rules! by_rows {
                ($W:literal) => {
                    match nt {
                        1 => k::<$W, 1>(w, a, n, out),
                        2 => k::<$W, 2>(w, a, n, out),
                        3 => k::<$W, 3>(w, a, n, out),
                        _ => k::<$W, 4>(w, a, n, out),
                    }
                };
            }
            // SAFETY: handed out only where `has_avx512` holds; `check_floats` bounds every load
            // (the tail's are masked to the row, the prefetches are hints).
            unsafe {
                match nw {
                    1 => by_rows!(1),
                    2 => by_rows!(2),
                    3 => by_rows!(3),
                    _ => by_rows!(4),
                }
            }
        }
    };
}

wide_float_entry!(dots_f32, F32w);
wide_float_entry!(dots_f16, F16w);
wide_float_entry!(dots_bf16, BF16w);

/// A format's kernel on a pair of tiles (`nb`: blocks or superblocks per row).
pub(super) trait PairFormat {
    unsafe fn pair<const R: usize>(t: *const u8, a: [*const u8; R], nb: usize) -> [__m512; R];
}

impl<F: Fmt> PairFormat for F {
    #[inline(always)]
    unsafe fn pair<const R: usize>(t: *const u8, a: [*const u8; R], nb: usize) -> [__m512; R] {
        pair_kernel::<F, R>(t, a, nb)
    }
}

impl PairFormat for Q4K {
    #[inline(always)]
    unsafe fn pair<const R: usize>(t: *const u8, a: [*const u8; R], nsb: usize) -> [__m512; R] {
        if R == 1 {
            kquant_pair::<R>(t, a, nsb, Q4K_TILE_BLOCK, |sb, gap, ab| q45k_one::<R, false>(sb, gap, ab))
        } else {
            kquant_pair::<R>(t, a, nsb, Q4K_TILE_BLOCK, |sb, gap, ab| q45k_sums::<R, false>(sb, gap, ab))
        }
    }
}

impl PairFormat for Q5K {
    #[inline(always)]
    unsafe fn pair<const R: usize>(t: *const u8, a: [*const u8; R], nsb: usize) -> [__m512; R] {
        if R == 1 {
            kquant_pair::<R>(t, a, nsb, Q5K_TILE_BLOCK, |sb, gap, ab| q45k_one::<R, true>(sb, gap, ab))
        } else {
            kquant_pair::<R>(t, a, nsb, Q5K_TILE_BLOCK, |sb, gap, ab| q45k_sums::<R, true>(sb, gap, ab))
        }
    }
}

impl PairFormat for Q6K {
    #[inline(always)]
    unsafe fn pair<const R: usize>(t: *const u8, a: [*const u8; R], nsb: usize) -> [__m512; R] {
        if R == 1 {
            kquant_pair::<R>(t, a, nsb, Q6K_TILE_BLOCK, |sb, gap, ab| q6k_one::<R>(sb, gap, ab))
        } else {
            kquant_pair::<R>(t, a, nsb, Q6K_TILE_BLOCK, |sb, gap, ab| q6k_sums::<R>(sb, gap, ab))
        }
    }
}

/// Two tiles against `a.len()` (1..=8) activation rows: out[r] gets the first tile's eight
/// outputs for row r, out[R + r] the second's. The caller has bounds-checked the call (`check`).
///
/// # Safety
/// The CPU has AVX-512 F/VL/BW/VNNI, and every load the kernel makes is in bounds.
pub(super) unsafe fn run<P: PairFormat>(t: &[u8], a: &[&[u8]], nb: usize, out: &mut [[f32; 8]]) {
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
    unsafe fn k<P: PairFormat, const R: usize>(t: *const u8, a: &[&[u8]], nb: usize, out: &mut [[f32; 8]]) {
        let acc = P::pair::<R>(t, std::array::from_fn(|r| a[r].as_ptr()), nb);
        for (r, v) in acc.iter().enumerate() {
            _mm256_storeu_ps(out[r].as_mut_ptr(), _mm512_castps512_ps256(*v));
            _mm256_storeu_ps(out[R + r].as_mut_ptr(), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*v))));
        }
    }
    let t = t.as_ptr();
    match a.len() {
        1 => k::<P, 1>(t, a, nb, out),
        2 => k::<P, 2>(t, a, nb, out),
        3 => k::<P, 3>(t, a, nb, out),
        4 => k::<P, 4>(t, a, nb, out),
        5 => k::<P, 5>(t, a, nb, out),
        6 => k::<P, 6>(t, a, nb, out),
        7 => k::<P, 7>(t, a, nb, out),
        _ => k::<P, 8>(t, a, nb, out),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tile::{tile_bytes, tile_rows, TILE_ROWS};
    use super::super::{act_row_bytes, avx2, quantize_row, scalar, GgmlType};

    /// Sixteen K-quant rows: random bytes with small f16 scales, or (`edge`) every byte 0xFF (the
    /// largest nibbles, high bits and 6-bit scales and mins) with Q6_K's i8 scales at `sc6`.
    fn rows(ty: GgmlType, n: usize, seed: u64, edge: Option<u8>) -> Vec<Vec<u8>> {
        let mut state = seed;
        (0..2 * TILE_ROWS)
            .map(|_| {
                let mut row: Vec<u8> = (0..ty.row_bytes(n))
                    .map(|_| {
                        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        edge.map_or((state >> 56) as u8, |_| 0xFF)
                    })
                    .collect();
                for b in row.chunks_exact_mut(ty.block_bytes()) {
                    for &at in ty.f16_scale_offsets() {
                        b[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
                    }
                    if let (GgmlType::Q6K, Some(sc)) = (ty, edge) {
                        b[192..208].fill(sc);
                    }
                }
                row
            })
            .collect()
    }

    /// The one-row (decode) pair kernels of Q4_K, Q5_K and Q6_K against the general pair kernel
    /// (the same call with a second activation row) bit for bit, and against the scalar twin.
    #[test]
    fn one_row_pair_kernels_match_the_general_kernel_and_the_scalar_twin() {
        if !avx2::has_avx512() {
            eprintln!("skipped: no AVX-512 VNNI here (or turned off): the one-row pair kernels never run");
            return;
        }
        let n = 768;
        for ty in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
            let f = avx2::tile_variants(ty).into_iter().find(|v| v.0 == "avx512").expect("the AVX-512 kernel").1;
            for (seed, edge) in [(1, None), (2, None), (3, Some(0xFF)), (4, Some(0x80)), (5, Some(0x7F))] {
                let rows = rows(ty, n, seed, edge);
                let mut t = vec![0u8; 2 * tile_bytes(ty, n)];
                for (k, tile) in t.chunks_exact_mut(tile_bytes(ty, n)).enumerate() {
                    let refs: Vec<&[u8]> = rows[TILE_ROWS * k..TILE_ROWS * (k + 1)].iter().map(|r| &r[..]).collect();
                    tile_rows(ty, &refs, tile);
                }
                let xs: [Vec<f32>; 3] = [
                    (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.02).collect(),
                    (0..n).map(|i| if i % 2 == 0 { 1.0 } else { -1.0 }).collect(),
                    vec![-1.0; n],
                ];
                for x in &xs {
                    let mut a = vec![0u8; act_row_bytes(GgmlType::Q8K, n)];
                    quantize_row(GgmlType::Q8K, x, &mut a);
                    let (mut one, mut two) = ([[0.0f32; 8]; 2], [[0.0f32; 8]; 4]);
                    f(&t, &[&a], n, &mut one);
                    f(&t, &[&a, &a], n, &mut two);
                    // Two activation rows: out[r] is the first tile's row r, out[2 + r] the second's.
                    assert_eq!([one[0], one[1]].map(|o| o.map(f32::to_bits)), [two[0], two[2]].map(|o| o.map(f32::to_bits)), "{}: seed {seed}", ty.name());
                    for (j, row) in rows.iter().enumerate() {
                        let (got, want) = (one[j / TILE_ROWS][j % TILE_ROWS], scalar::dot_fn(ty)(row, &a, n));
                        assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0), "{} seed {seed} row {j}: {got} != scalar {want}", ty.name());
                    }
                }
            }
        }
    }
}
