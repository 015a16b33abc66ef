//! AVX2 tile kernels for the K-quants (Q4_K, Q5_K, Q6_K) whose inner loop is the same
//! `vpmaddubsw` stream as the 32-value formats', with the sub-block scales folded in for free.
//!
//! Without VNNI a u8 x i8 dot of four bytes is `vpmaddubsw` (pairs to i16) then `vpmaddwd` against
//! ones (pairs to i32) then an add. Here the i16 pair sums of several chunks of a sub-block are
//! added as i16 first, and the one `vpmaddwd` per run multiplies by the rows' sub-block scales
//! instead of by ones: scale x (sum over the run) lands in each row's i32 lane, so the per
//! sub-block `vpmulld` of the generic kernel and two thirds of its widening work go away.
//!
//! The i16 sums stay exact because a run is short enough for its weights' range: with activations
//! |a| <= 128 one `vpmaddubsw` pair is at most 2·15·128 = 3840 for 4-bit weights (a run of eight
//! chunks: 30720), 2·31·128 = 7936 for Q5_K (four: 31744), 2·63·128 = 16128 for Q6_K (two: 32256),
//! all below 2^15. So every integer sum equals the generic kernel's, and the superblock's f32 step
//! is that kernel's own (`avx2::kquant_tiles`): the results are bit-identical to the other
//! variants, and through them within the tested tolerance of the scalar twins (`scalar.rs`).

use super::avx2::{bcast4, check_kquant, kquant_tiles, per_part, q45k_chunk, q6k_chunk, Ahead, Checked, K_BSUMS, K_QS};
use super::tile::{K45_M, K45_SC, Q4K_TILE_BLOCK, Q5K_TILE_BLOCK, Q6K_QH, Q6K_QL, Q6K_SC, Q6K_TILE_BLOCK};
use super::{GgmlType, TileFn};
use std::arch::x86_64::*;

/// Activation rows per kernel: each needs an i16 run sum, an i32 superblock sum and an f32
/// accumulator, and sixteen vector registers hold those of four.
const MAX_R: usize = 4;

/// The kernel of `ty` in this module, if it has one.
pub fn tile_fn(ty: GgmlType) -> Option<TileFn> {
    Some(match ty {
        GgmlType::Q4K => tile_q4_k,
        GgmlType::Q5K => tile_q5_k,
        GgmlType::Q6K => tile_q6_k,
        _ => return None,
    })
}

/// Per-format integer sums of one superblock of a tile: per activation row, the scale-weighted
/// sum and (Q4_K, Q5_K) the mins' sum, as `kquant_tiles` takes them.
trait KSums {
    const TILE_BLOCK: usize;
    /// With no prefetch distance, decode asks for each superblock as it starts
    /// (`avx2::kquant_tiles`' `scattered`).
    const SCATTERED: bool = false;
    /// `pf`: the superblock to ask for meanwhile, in parts over the body's steps (`Ahead`).
    unsafe fn sums<const R: usize>(sb: *const u8, pf: Ahead, ab: &[*const u8; R]) -> ([__m256i; R], Option<[__m256i; R]>);
}

struct Q4K;
struct Q5K;
struct Q6K;

/// Eight scale bytes (one per row) -> sixteen i16, each row's twice: the `vpmaddwd` operand that
/// puts scale_r x (both i16 halves of lane r) in i32 lane r.
#[inline(always)]
unsafe fn scale_pairs<const SIGNED: bool>(p: *const u8) -> __m256i {
    let dup = _mm_shuffle_epi8(_mm_loadl_epi64(p as *const __m128i), _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
    if SIGNED {
        _mm256_cvtepi8_epi16(dup)
    } else {
        _mm256_cvtepu8_epi16(dup)
    }
}

/// Sub-block `sub` of a Q4_K/Q5_K superblock against R activation rows, into `total`.
#[inline(always)]
unsafe fn q45k_sub<const R: usize, const FIVE: bool>(sb: *const u8, ab: &[*const u8; R], sub: usize, total: &mut [__m256i; R], m4: __m256i, b4: __m256i) {
    let (j, high, run) = (sub / 2, sub % 2 == 1, if FIVE { 4 } else { 8 });
    let sc = scale_pairs::<false>(sb.add(K45_SC + 8 * sub));
    for c0 in (0..8).step_by(run) {
        let mut acc = [_mm256_setzero_si256(); R];
        for c in c0..c0 + run {
            let w = q45k_chunk::<FIVE>(sb, sub, c, m4, b4);
            for r in 0..R {
                let y = bcast4(ab[r].add(K_QS + 64 * j + 32 * high as usize + 4 * c));
                acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(w, y));
            }
        }
        for r in 0..R {
            total[r] = _mm256_add_epi32(total[r], _mm256_madd_epi16(acc[r], sc));
        }
    }
}

/// Q4_K and Q5_K (`FIVE`: a fifth bit per value from the tile's qh chunks, and runs of four).
#[inline(always)]
unsafe fn q45k_sums<const R: usize, const FIVE: bool>(sb: *const u8, pf: Ahead, ab: &[*const u8; R]) -> ([__m256i; R], Option<[__m256i; R]>) {
    let (m4, b4) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(0x10));
    let mut total = [_mm256_setzero_si256(); R];
    // LLVM keeps a loop over the sub-blocks rolled, branching per chunk on its nibble half
    // (and, Q5_K, a jump table for its bit's shift). Taken in pairs the half is a constant; all
    // eight spelled out, the shift too. Best of six interleaved runs (gemm_rate, one thread,
    // Zen 3) chose per case: Q4_K in pairs (16 rows 81 -> 89 G MAC/s, one row 47 -> 50; spelled
    // out 67 and 41), Q5_K spelled out for several rows (44 -> 72 G), in pairs for one (26 -> 30).
    if FIVE && R > 1 {
        pf.part(0, 1);
        q45k_sub::<R, FIVE>(sb, ab, 0, &mut total, m4, b4);
        q45k_sub::<R, FIVE>(sb, ab, 1, &mut total, m4, b4);
        q45k_sub::<R, FIVE>(sb, ab, 2, &mut total, m4, b4);
        q45k_sub::<R, FIVE>(sb, ab, 3, &mut total, m4, b4);
        q45k_sub::<R, FIVE>(sb, ab, 4, &mut total, m4, b4);
        q45k_sub::<R, FIVE>(sb, ab, 5, &mut total, m4, b4);
        q45k_sub::<R, FIVE>(sb, ab, 6, &mut total, m4, b4);
        q45k_sub::<R, FIVE>(sb, ab, 7, &mut total, m4, b4);
    } else {
        for j in 0..4 {
            pf.part(j, 4);
            q45k_sub::<R, FIVE>(sb, ab, 2 * j, &mut total, m4, b4);
            q45k_sub::<R, FIVE>(sb, ab, 2 * j + 1, &mut total, m4, b4);
        }
    }
    // Mins: over sub-blocks, m * (sum of the sub-block's activations), as i16 pairs
    // (m_s, m_s+1) against (sum_s, sum_s+1).
    // The eight sub-block sums (pairs of q8_K's sixteen block sums, |s| <= 32·127) as i16, so that
    // dword p holds (sum_2p, sum_2p+1): vpermd broadcasts it.
    let sums: [__m256i; R] = std::array::from_fn(|r| {
        let s32 = _mm256_madd_epi16(_mm256_loadu_si256(ab[r].add(K_BSUMS) as *const __m256i), _mm256_set1_epi16(1));
        _mm256_castsi128_si256(_mm_packs_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256::<1>(s32)))
    });
    let mut mins = [_mm256_setzero_si256(); R];
    for p in 0..4 {
        let m0 = _mm_loadl_epi64(sb.add(K45_M + 16 * p) as *const __m128i);
        let m1 = _mm_loadl_epi64(sb.add(K45_M + 8 + 16 * p) as *const __m128i);
        let mm = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m0, m1));
        let at = _mm256_set1_epi32(p as i32);
        for r in 0..R {
            mins[r] = _mm256_add_epi32(mins[r], _mm256_madd_epi16(mm, _mm256_permutevar8x32_epi32(sums[r], at)));
        }
    }
    (total, Some(mins))
}

impl KSums for Q4K {
    const TILE_BLOCK: usize = Q4K_TILE_BLOCK;
    #[inline(always)]
    unsafe fn sums<const R: usize>(sb: *const u8, pf: Ahead, ab: &[*const u8; R]) -> ([__m256i; R], Option<[__m256i; R]>) {
        q45k_sums::<R, false>(sb, pf, ab)
    }
}

impl KSums for Q5K {
    const TILE_BLOCK: usize = Q5K_TILE_BLOCK;
    #[inline(always)]
    unsafe fn sums<const R: usize>(sb: *const u8, pf: Ahead, ab: &[*const u8; R]) -> ([__m256i; R], Option<[__m256i; R]>) {
        q45k_sums::<R, true>(sb, pf, ab)
    }
}

impl KSums for Q6K {
    const TILE_BLOCK: usize = Q6K_TILE_BLOCK;
    const SCATTERED: bool = true;
    #[inline(always)]
    unsafe fn sums<const R: usize>(sb: *const u8, pf: Ahead, ab: &[*const u8; R]) -> ([__m256i; R], Option<[__m256i; R]>) {
        let (m4, m30) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(0x30));
        let mut total = [_mm256_setzero_si256(); R];
        if R == 1 {
            total[0] = q6k_one(sb, pf, ab[0], m4, m30);
            return (q6k_offset(sb, ab, total), None);
        }
        pf.part(0, 1);
        // The quarter is a constant in each call, so that its shifts are too: LLVM leaves this
        // nest rolled, and a quarter taken from the loop became a jump table per chunk (16 rows:
        // 40 G MAC/s so, 63 G now; gemm_rate, one thread, Zen 3).
        for h in 0..2 {
            q6k_quarter::<0, R>(sb, ab, h, &mut total, m4, m30);
            q6k_quarter::<1, R>(sb, ab, h, &mut total, m4, m30);
            q6k_quarter::<2, R>(sb, ab, h, &mut total, m4, m30);
            q6k_quarter::<3, R>(sb, ab, h, &mut total, m4, m30);
        }
        (q6k_offset(sb, ab, total), None)
    }
}

/// Quarter `Q` of half `h` of a Q6_K superblock against R activation rows, into `total`: value
/// 128h + 32Q + l (l = 4c + e) is in sub-block 8h + 2Q + c/4; runs of two chunks.
#[inline(always)]
unsafe fn q6k_quarter<const Q: usize, const R: usize>(sb: *const u8, ab: &[*const u8; R], h: usize, total: &mut [__m256i; R], m4: __m256i, m30: __m256i) {
    for half in 0..2 {
        let sc = scale_pairs::<true>(sb.add(Q6K_SC + 8 * (8 * h + 2 * Q + half)));
        for c0 in (4 * half..4 * half + 4).step_by(2) {
            let mut acc = [_mm256_setzero_si256(); R];
            for c in c0..c0 + 2 {
                let w = q6k_chunk(sb, h, Q, c, m4, m30);
                for r in 0..R {
                    let y = bcast4(ab[r].add(K_QS + 128 * h + 32 * Q + 4 * c));
                    acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(w, y));
                }
            }
            for r in 0..R {
                total[r] = _mm256_add_epi32(total[r], _mm256_madd_epi16(acc[r], sc));
            }
        }
    }
}

/// A Q6_K superblock's scale-weighted sum against one activation row (decode), walked by chunk
/// position: quarters 0 and 2 of a chunk take the low and high nibbles of one ql vector, 1 and
/// 3 of another, each pair with the chunk's qh vector, and every shift is a constant. A pair at
/// a time keeps its accumulators, scales and vectors in the sixteen registers (all four
/// quarters at once spilled to the stack). The same runs (two chunks of a sub-block) and
/// integers as the general loop.
#[inline(always)]
unsafe fn q6k_one(sb: *const u8, pf: Ahead, a: *const u8, m4: __m256i, m30: __m256i) -> __m256i {
    let mut total = _mm256_setzero_si256();
    for h in 0..2 {
        for cp in 0..4 {
            pf.part(4 * h + cp, 8);
            total = q6k_one_pair::<0>(sb, a, h, cp, total, m4, m30);
            total = q6k_one_pair::<1>(sb, a, h, cp, total, m4, m30);
        }
    }
    total
}

/// Quarters `P` and `P + 2` of chunks 2cp and 2cp + 1 of half `h` (`q6k_one`), added to `total`.
#[inline(always)]
unsafe fn q6k_one_pair<const P: usize>(sb: *const u8, a: *const u8, h: usize, cp: usize, total: __m256i, m4: __m256i, m30: __m256i) -> __m256i {
    // Chunks 4·half.. of quarter q are sub-block 8h + 2q + half.
    let sc = |q: usize| scale_pairs::<true>(sb.add(Q6K_SC + 8 * (8 * h + 2 * q + cp / 2)));
    let (mut lo, mut hi) = (_mm256_setzero_si256(), _mm256_setzero_si256());
    for c in 2 * cp..2 * cp + 2 {
        let qh = _mm256_loadu_si256(sb.add(Q6K_QH + 256 * h + 32 * c) as *const __m256i);
        let ql = _mm256_loadu_si256(sb.add(Q6K_QL + 512 * h + 32 * (c + 8 * P)) as *const __m256i);
        // The high bits of quarter q sit at bits 2q of each qh byte.
        let (bits_lo, bits_hi) = if P == 0 { (_mm256_slli_epi16(qh, 4), qh) } else { (_mm256_slli_epi16(qh, 2), _mm256_srli_epi16(qh, 2)) };
        let w_lo = _mm256_or_si256(_mm256_and_si256(ql, m4), _mm256_and_si256(bits_lo, m30));
        let w_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, 4), m4), _mm256_and_si256(bits_hi, m30));
        lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(w_lo, bcast4(a.add(K_QS + 128 * h + 32 * P + 4 * c))));
        hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(w_hi, bcast4(a.add(K_QS + 128 * h + 32 * (P + 2) + 4 * c))));
    }
    _mm256_add_epi32(total, _mm256_add_epi32(_mm256_madd_epi16(lo, sc(P)), _mm256_madd_epi16(hi, sc(P + 2))))
}

/// `total` less what the stored values' +32 added: 32 x the sum over sub-blocks of scale x (the
/// sub-block's activation sum), as i16 pairs (sc_s, sc_s+1) against the q8_K block sums
/// (b_s, b_s+1), which sit next to each other as one little-endian dword.
#[inline(always)]
unsafe fn q6k_offset<const R: usize>(sb: *const u8, ab: &[*const u8; R], mut total: [__m256i; R]) -> [__m256i; R] {
    let mut off = [_mm256_setzero_si256(); R];
    for p in 0..8 {
        let s0 = _mm_loadl_epi64(sb.add(Q6K_SC + 16 * p) as *const __m128i);
        let s1 = _mm_loadl_epi64(sb.add(Q6K_SC + 16 * p + 8) as *const __m128i);
        let ss = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s0, s1));
        for r in 0..R {
            off[r] = _mm256_add_epi32(off[r], _mm256_madd_epi16(ss, bcast4(ab[r].add(K_BSUMS + 4 * p))));
        }
    }
    for r in 0..R {
        total[r] = _mm256_sub_epi32(total[r], _mm256_slli_epi32(off[r], 5));
    }
    total
}

/// T tiles against R activation rows, stored to `out` as the tile kernels' contract says.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kernel<F: KSums, const T: usize, const R: usize>(t: *const u8, a: &[&[u8]], nsb: usize, out: &mut [[f32; 8]]) {
    let acc = kquant_tiles::<T, R>(t, std::array::from_fn(|r| a[r].as_ptr()), nsb, F::TILE_BLOCK, F::SCATTERED, |sb, pf, ab| F::sums::<R>(sb, pf, ab));
    for (k, tile) in acc.iter().enumerate() {
        for (r, v) in tile.iter().enumerate() {
            _mm256_storeu_ps(out[k * R + r].as_mut_ptr(), *v);
        }
    }
}

fn entry<F: KSums>(t: &[u8], a: &[&[u8]], n: usize, out: &mut [[f32; 8]]) {
    let Checked { nb: nsb, tiles, tile_bytes } = check_kquant(F::TILE_BLOCK, t, a, n, out);
    if a.len() > MAX_R || (tiles == 2 && a.len() > 2) {
        // SAFETY: as below; each part is a tile and rows of the checked call.
        return per_part(t, tile_bytes, tiles, a, MAX_R, out, |t, a, out| unsafe {
            match a.len() {
                1 => kernel::<F, 1, 1>(t, a, nsb, out),
                2 => kernel::<F, 1, 2>(t, a, nsb, out),
                3 => kernel::<F, 1, 3>(t, a, nsb, out),
                _ => kernel::<F, 1, 4>(t, a, nsb, out),
            }
        });
    }
    // SAFETY: handed out (`avx2::tile_variants`) only after detecting AVX2, FMA and F16C;
    // `check_kquant` bounds every load the kernel makes.
    unsafe {
        match (tiles, a.len()) {
            (1, 1) => kernel::<F, 1, 1>(t.as_ptr(), a, nsb, out),
            (1, 2) => kernel::<F, 1, 2>(t.as_ptr(), a, nsb, out),
            (1, 3) => kernel::<F, 1, 3>(t.as_ptr(), a, nsb, out),
            (1, _) => kernel::<F, 1, 4>(t.as_ptr(), a, nsb, out),
            (_, 1) => kernel::<F, 2, 1>(t.as_ptr(), a, nsb, out),
            _ => kernel::<F, 2, 2>(t.as_ptr(), a, nsb, out),
        }
    }
}

pub fn tile_q4_k(t: &[u8], a: &[&[u8]], n: usize, out: &mut [[f32; 8]]) {
    entry::<Q4K>(t, a, n, out)
}

pub fn tile_q5_k(t: &[u8], a: &[&[u8]], n: usize, out: &mut [[f32; 8]]) {
    entry::<Q5K>(t, a, n, out)
}

pub fn tile_q6_k(t: &[u8], a: &[&[u8]], n: usize, out: &mut [[f32; 8]]) {
    entry::<Q6K>(t, a, n, out)
}

#[cfg(test)]
mod tests {
    use super::super::tile::{tile_bytes, tile_rows, TILE_ROWS};
    use super::super::{act_row_bytes, avx2, quantize_row, scalar, GgmlType};

    /// The i16 runs at their worst: every weight at its largest value, every scale at its
    /// largest magnitude, every activation at -127 (or alternating ±127). Any i16 overflow would
    /// show against the generic AVX2 kernel (i32 sums throughout) and the scalar twin.
    #[test]
    fn largest_weights_and_activations_match_the_i32_kernel_and_the_scalar_twin() {
        if !avx2::has_avx2() {
            eprintln!("no AVX2 here (or DASLLAMA_NO_SIMD): these kernels never run");
            return;
        }
        let n = 512;
        for ty in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
            let variants = avx2::tile_variants(ty);
            let generic = variants.iter().find(|v| v.0 == "avx2").expect("the generic AVX2 kernel").1;
            let mine = super::tile_fn(ty).expect("a kernel for a K-quant");
            for scale_byte in [0xFFu8, 0x80, 0x7F] {
                // All bytes 0xFF: largest nibbles, high bits and (Q4_K/Q5_K) 6-bit scales and mins;
                // Q6_K's i8 scales take `scale_byte` (-128, 127 or -1).
                let mut row = vec![0xFFu8; ty.row_bytes(n)];
                for b in row.chunks_exact_mut(ty.block_bytes()) {
                    for &at in ty.f16_scale_offsets() {
                        b[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
                    }
                    if ty == GgmlType::Q6K {
                        b[192..208].fill(scale_byte);
                    }
                }
                let rows: Vec<&[u8]> = (0..TILE_ROWS).map(|_| &row[..]).collect();
                let mut t = vec![0u8; tile_bytes(ty, n)];
                tile_rows(ty, &rows, &mut t);
                let xs = [vec![1.0f32; n], (0..n).map(|i| if i % 2 == 0 { 1.0 } else { -1.0 }).collect(), vec![-1.0; n]];
                let acts: Vec<Vec<u8>> = xs
                    .iter()
                    .map(|x| {
                        let mut a = vec![0u8; act_row_bytes(GgmlType::Q8K, n)];
                        quantize_row(GgmlType::Q8K, x, &mut a);
                        a
                    })
                    .collect();
                let a: Vec<&[u8]> = acts.iter().map(|v| &v[..]).collect();
                let (mut got, mut want) = (vec![[0.0f32; TILE_ROWS]; 3], vec![[0.0f32; TILE_ROWS]; 3]);
                mine(&t, &a, n, &mut got);
                generic(&t, &a, n, &mut want);
                assert_eq!(got, want, "{}: i16 runs differ from i32 sums (scale byte {scale_byte:#x})", ty.name());
                for (r, out) in got.iter().enumerate() {
                    let s = scalar::dot_fn(ty)(&row, a[r], n);
                    assert!((out[0] - s).abs() <= 1e-4 * s.abs().max(1.0), "{}: {} != scalar {s}", ty.name(), out[0]);
                }
            }
        }
    }
}
