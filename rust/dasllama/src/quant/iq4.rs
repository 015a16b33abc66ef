//! The non-linear 4-bit formats IQ4_NL and IQ4_XS: each 4-bit index picks one of sixteen
//! fixed int8 levels (`KVALUES`, denser near zero than a uniform grid), times a block scale.
//!
//! - IQ4_NL (18 bytes per 32 values): `d` f16, then `qs[16]`: value `j` is the low nibble of
//!   `qs[j]`, value `16 + j` its high nibble. Activations are rounded to `q8_0`, as ggml pairs them.
//! - IQ4_XS (136 bytes per 256 values): `d` f16, `scales_h` u16, `scales_l[4]`, `qs[128]`: eight
//!   sub-blocks of 32 values laid out as IQ4_NL's quants, each with a 6-bit scale `ls` (low four
//!   bits from `scales_l`, high two from `scales_h`) meaning `d * (ls - 32)`. Activations are
//!   rounded to `q8_K`.
//!
//! The levels are int8, so a block's dot with q8 activations is an exact integer sum; the SIMD
//! kernels differ from their scalar twins only in the order the f32 block results are added.

use super::{rd_f16, rd_f32};

/// ggml's `kvalues_iq4nl`.
pub const KVALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

pub const NL_BLOCK_BYTES: usize = 18;
pub const XS_BLOCK_BYTES: usize = 136;

/// The level of value `j` (0..32) of a 32-value group of nibbles.
#[inline(always)]
fn level(qs: &[u8], j: usize) -> i32 {
    let byte = qs[j % 16];
    KVALUES[if j < 16 { byte & 0xF } else { byte >> 4 } as usize] as i32
}

/// Sub-block `ib`'s signed scale `ls - 32` of an IQ4_XS block.
#[inline(always)]
fn xs_scale(b: &[u8], ib: usize) -> i32 {
    let sh = u16::from_le_bytes([b[2], b[3]]) as i32;
    let ls = ((b[4 + ib / 2] as i32 >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
    ls - 32
}

pub fn dequantize_nl(src: &[u8], out: &mut [f32]) {
    for (b, y) in src.chunks_exact(NL_BLOCK_BYTES).zip(out.chunks_exact_mut(32)) {
        let d = rd_f16(b, 0);
        for (j, y) in y.iter_mut().enumerate() {
            *y = d * level(&b[2..], j) as f32;
        }
    }
}

pub fn dequantize_xs(src: &[u8], out: &mut [f32]) {
    for (b, y) in src.chunks_exact(XS_BLOCK_BYTES).zip(out.chunks_exact_mut(256)) {
        let d = rd_f16(b, 0);
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let dl = d * xs_scale(b, ib) as f32;
            for (j, y) in y.iter_mut().enumerate() {
                *y = dl * level(&b[8 + 16 * ib..], j) as f32;
            }
        }
    }
}

/// Scalar IQ4_NL x q8_0: the exact integer sum per block, scaled by `d_w * d_a`.
pub fn dot_nl_scalar(w: &[u8], a: &[u8], n: usize) -> f32 {
    let mut sum = 0.0f32;
    for ib in 0..n / 32 {
        let (wb, ab) = (&w[ib * NL_BLOCK_BYTES..], &a[ib * 34..]);
        let isum: i32 = (0..32).map(|j| level(&wb[2..], j) * ab[2 + j] as i8 as i32).sum();
        sum += rd_f16(wb, 0) * rd_f16(ab, 0) * isum as f32;
    }
    sum
}

/// Scalar IQ4_XS x q8_K: the exact integer sum per superblock (sub-block sums times their
/// scales), scaled by `d_w * d_a`.
pub fn dot_xs_scalar(w: &[u8], a: &[u8], n: usize) -> f32 {
    let mut sum = 0.0f32;
    for ibl in 0..n / 256 {
        let (wb, ab) = (&w[ibl * XS_BLOCK_BYTES..], &a[ibl * 292..]);
        let isum: i32 = (0..8)
            .map(|ib| {
                let s: i32 = (0..32).map(|j| level(&wb[8 + 16 * ib..], j) * ab[4 + 32 * ib + j] as i8 as i32).sum();
                xs_scale(wb, ib) * s
            })
            .sum();
        sum += rd_f16(wb, 0) * rd_f32(ab, 0) * isum as f32;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
pub use simd::{dot_nl_avx2, dot_xs_avx2};

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{KVALUES, NL_BLOCK_BYTES, XS_BLOCK_BYTES};
    use std::arch::x86_64::*;

    /// Sixteen nibbles -> their 32 levels as i8: low nibbles (values 0..16) in the low lane,
    /// high nibbles (16..32) in the high one. One `pshufb` per half is the table lookup.
    #[inline(always)]
    unsafe fn levels(p: *const u8) -> __m256i {
        let table = _mm_loadu_si128(KVALUES.as_ptr() as *const __m128i);
        let m4 = _mm_set1_epi8(0xF);
        let q = _mm_loadu_si128(p as *const __m128i);
        let lo = _mm_shuffle_epi8(table, _mm_and_si128(q, m4));
        let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), m4));
        _mm256_set_m128i(hi, lo)
    }

    /// i8 x i8 -> i16 pair sums: |w| against sign(w) * a, so maddubs sees an unsigned operand.
    /// No saturation: |level| <= 127 and |a| <= 127, so a pair is at most 32258.
    #[inline(always)]
    unsafe fn pairs(w: __m256i, a: __m256i) -> __m256i {
        _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w))
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        crate::quant::avx2::hsum(v)
    }

    #[inline(always)]
    unsafe fn f16(p: *const u8) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128((p as *const u16).read_unaligned() as i32)))
    }

    pub fn dot_nl_avx2(w: &[u8], a: &[u8], n: usize) -> f32 {
        assert!(w.len() >= n / 32 * NL_BLOCK_BYTES && a.len() >= n / 32 * 34);
        // SAFETY: handed out only after `has_avx2` detected AVX2, FMA and F16C; the assert bounds
        // every load (16 quant bytes and 32 activation bytes per block, within the block).
        unsafe { nl_impl(w.as_ptr(), a.as_ptr(), n / 32) }
    }

    /// Sixteen nibbles of each of two groups -> their levels as i8, by one 256-bit `pshufb` per
    /// half: (group 0's values 0..16 | group 1's), then (16..32 of each). Half the lookups and no
    /// lane insert per group, against `levels`.
    #[inline(always)]
    unsafe fn levels2(q: __m256i, table: __m256i, m4: __m256i) -> (__m256i, __m256i) {
        let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(q, m4));
        let hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
        (lo, hi)
    }

    /// The i32 sums of two groups of 32 (levels from `levels2`) against their activations `a0`,
    /// `a1`, lined up with them: group 0's in lanes 0..4, group 1's in lanes 4..8.
    #[inline(always)]
    unsafe fn sums2(lo: __m256i, hi: __m256i, a0: __m256i, a1: __m256i) -> (__m256i, __m256i) {
        let alo = _mm256_permute2x128_si256::<0x20>(a0, a1);
        let ahi = _mm256_permute2x128_si256::<0x31>(a0, a1);
        (pairs(lo, alo), pairs(hi, ahi))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nl_impl(w: *const u8, a: *const u8, nb: usize) -> f32 {
        let ones = _mm256_set1_epi16(1);
        let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES.as_ptr() as *const __m128i));
        let m4 = _mm256_set1_epi8(0xF);
        // Two accumulators: consecutive pairs' fmas do not wait on each other.
        let mut acc = [_mm256_setzero_ps(); 2];
        let pf = crate::quant::avx2::prefetch();
        for ib in (0..nb - nb % 2).step_by(2) {
            let (wb, ab) = (w.add(ib * NL_BLOCK_BYTES), a.add(ib * 34));
            if ib % 4 == 0 {
                // Rows lie one after another, so bytes ahead in this row run on into the next
                // rows, which the caller dots next: decode's weight stream in its order. Four
                // blocks are 72 bytes, at most two lines.
                crate::quant::avx2::prefetch_lines(wb.wrapping_add(pf.block32), 4 * NL_BLOCK_BYTES + 63, pf.hint);
            }
            // Blocks ib and ib + 1 side by side, one per 128-bit lane.
            let q = _mm256_set_m128i(_mm_loadu_si128(wb.add(NL_BLOCK_BYTES + 2) as *const __m128i), _mm_loadu_si128(wb.add(2) as *const __m128i));
            let (lo, hi) = levels2(q, table, m4);
            let (plo, phi) = sums2(lo, hi, _mm256_loadu_si256(ab.add(2) as *const __m256i), _mm256_loadu_si256(ab.add(36) as *const __m256i));
            let lanes = _mm256_add_epi32(_mm256_madd_epi16(plo, ones), _mm256_madd_epi16(phi, ones));
            let d0 = _mm_set1_ps(f16(wb) * f16(ab));
            let d1 = _mm_set1_ps(f16(wb.add(NL_BLOCK_BYTES)) * f16(ab.add(34)));
            acc[ib / 2 % 2] = _mm256_fmadd_ps(_mm256_set_m128(d1, d0), _mm256_cvtepi32_ps(lanes), acc[ib / 2 % 2]);
        }
        if nb % 2 == 1 {
            let (wb, ab) = (w.add((nb - 1) * NL_BLOCK_BYTES), a.add((nb - 1) * 34));
            let q8 = _mm256_loadu_si256(ab.add(2) as *const __m256i);
            let lanes = _mm256_madd_epi16(pairs(levels(wb.add(2)), q8), ones);
            acc[0] = _mm256_fmadd_ps(_mm256_set1_ps(f16(wb) * f16(ab)), _mm256_cvtepi32_ps(lanes), acc[0]);
        }
        hsum(_mm256_add_ps(acc[0], acc[1]))
    }

    pub fn dot_xs_avx2(w: &[u8], a: &[u8], n: usize) -> f32 {
        assert!(w.len() >= n / 256 * XS_BLOCK_BYTES && a.len() >= n / 256 * 292);
        // SAFETY: as `dot_nl_avx2`; per superblock the kernel reads 136 weight bytes and the
        // first 260 bytes of the 292-byte q8_K block.
        unsafe { xs_impl(w.as_ptr(), a.as_ptr(), n / 256) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn xs_impl(w: *const u8, a: *const u8, nb: usize) -> f32 {
        let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES.as_ptr() as *const __m128i));
        let m4 = _mm256_set1_epi8(0xF);
        // Sub-block ib's 6-bit scale: its low four bits at bit 4ib of scales_l, its high two at
        // bit 2ib of scales_h; all eight at once, one per i32 lane.
        let (lo_at, hi_at) = (_mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
        let mut acc = _mm256_setzero_ps();
        let pf = crate::quant::avx2::prefetch();
        for ibl in 0..nb {
            let (wb, ab) = (w.add(ibl * XS_BLOCK_BYTES), a.add(ibl * 292));
            // As in `nl_impl`: the stream of rows, in the order the caller dots them.
            crate::quant::avx2::prefetch_lines(wb.wrapping_add(pf.kquant), XS_BLOCK_BYTES, pf.hint);
            let sl = _mm256_set1_epi32((wb.add(4) as *const i32).read_unaligned());
            let sh = _mm256_set1_epi32((wb.add(2) as *const u16).read_unaligned() as i32);
            let low = _mm256_and_si256(_mm256_srlv_epi32(sl, lo_at), _mm256_set1_epi32(0xF));
            let high = _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srlv_epi32(sh, hi_at), _mm256_set1_epi32(3)));
            let ls = _mm256_sub_epi32(_mm256_or_si256(low, high), _mm256_set1_epi32(32));
            // Each scale twice as an i16 pair, the `vpmaddwd` operand that scales a pair sum
            // while widening it: |pair| <= 32258 and |ls| <= 32, exact in the i32 lanes.
            let ls2 = _mm256_or_si256(_mm256_and_si256(ls, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32::<16>(ls));
            let mut isum = _mm256_setzero_si256();
            for p in 0..4 {
                // Sub-blocks 2p and 2p + 1: their quants are 32 bytes in a row.
                let (lo, hi) = levels2(_mm256_loadu_si256(wb.add(8 + 32 * p) as *const __m256i), table, m4);
                let act = ab.add(4 + 64 * p);
                let (plo, phi) = sums2(lo, hi, _mm256_loadu_si256(act as *const __m256i), _mm256_loadu_si256(act.add(32) as *const __m256i));
                let at = (2 * p) as i32;
                let sc = _mm256_permutevar8x32_epi32(ls2, _mm256_setr_epi32(at, at, at, at, at + 1, at + 1, at + 1, at + 1));
                isum = _mm256_add_epi32(isum, _mm256_add_epi32(_mm256_madd_epi16(plo, sc), _mm256_madd_epi16(phi, sc)));
            }
            let d = _mm256_set1_ps(f16(wb) * (ab as *const f32).read_unaligned());
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), acc);
        }
        hsum(acc)
    }
}

/// The row dot for IQ4 weights on this CPU: AVX2 where it exists, else the scalar twin.
pub fn dot_fn(ty: super::GgmlType) -> super::DotFn {
    let xs = ty == super::GgmlType::IQ4XS;
    #[cfg(target_arch = "x86_64")]
    if super::avx2::has_avx2() {
        return if xs { dot_xs_avx2 } else { dot_nl_avx2 };
    }
    if xs {
        dot_xs_scalar
    } else {
        dot_nl_scalar
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{act_row_bytes, dequantize_row, quantize_row, GgmlType};

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u32 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 33) as u32
        }
        fn f(&mut self) -> f32 {
            self.next() as f32 / u32::MAX as f32 * 2.0 - 1.0
        }
    }

    /// Random blocks: random quants and scale bytes (IQ4_XS's 6-bit scales span -32..31), the f16
    /// `d` small and finite; with `edge`, only the extreme nibbles and scale bits.
    fn random_blocks(ty: GgmlType, n: usize, rng: &mut Rng, edge: bool) -> Vec<u8> {
        let mut w: Vec<u8> = (0..ty.row_bytes(n)).map(|_| if edge { [0u8, 0xFF, 0x0F, 0xF0][rng.next() as usize % 4] } else { rng.next() as u8 }).collect();
        for b in w.chunks_exact_mut(ty.block_bytes()) {
            let d = half::f16::from_f32(if edge { 0.05 } else { 0.001 + (rng.next() % 100) as f32 * 1e-4 });
            b[..2].copy_from_slice(&d.to_bits().to_le_bytes());
        }
        w
    }

    fn acts(ty: GgmlType, x: &[f32]) -> Vec<u8> {
        let vt = ty.vec_dot_type();
        let mut a = vec![0u8; act_row_bytes(vt, x.len())];
        quantize_row(vt, x, &mut a);
        a
    }

    #[test]
    fn activations_are_rounded_as_ggml_pairs_them() {
        assert_eq!(GgmlType::IQ4NL.vec_dot_type(), GgmlType::Q8_0);
        assert_eq!(GgmlType::IQ4XS.vec_dot_type(), GgmlType::Q8K);
        assert_eq!((GgmlType::from_id(20).unwrap(), GgmlType::from_id(23).unwrap()), (GgmlType::IQ4NL, GgmlType::IQ4XS));
        assert_eq!((GgmlType::IQ4NL.row_bytes(64), GgmlType::IQ4XS.row_bytes(512)), (36, 272));
    }

    #[test]
    fn dequantization_follows_the_layout() {
        // IQ4_NL: d = 0.5, qs[j] = j | (15 - j) << 4: value j is level j, value 16 + j level 15 - j.
        let mut b = vec![0u8; 18];
        b[..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        (0..16).for_each(|j| b[2 + j] = j as u8 | ((15 - j as u8) << 4));
        let mut y = [0.0f32; 32];
        dequantize_row(GgmlType::IQ4NL, &b, &mut y);
        for j in 0..16 {
            assert_eq!(y[j], 0.5 * KVALUES[j] as f32);
            assert_eq!(y[16 + j], 0.5 * KVALUES[15 - j] as f32);
        }
        // IQ4_XS: d = 0.25, sub-block ib's 6-bit scale 2 * ib + 33 (low bits in scales_l, high in
        // scales_h), every nibble 15 (level 113).
        let mut b = vec![0xFFu8; 136];
        b[..2].copy_from_slice(&half::f16::from_f32(0.25).to_bits().to_le_bytes());
        let ls = |ib: usize| 2 * ib as u16 + 33;
        let sh: u16 = (0..8).map(|ib| (ls(ib) >> 4) << (2 * ib)).sum();
        b[2..4].copy_from_slice(&sh.to_le_bytes());
        (0..4).for_each(|i| b[4 + i] = (ls(2 * i) & 0xF) as u8 | (((ls(2 * i + 1) & 0xF) as u8) << 4));
        let mut y = [0.0f32; 256];
        dequantize_row(GgmlType::IQ4XS, &b, &mut y);
        for (j, v) in y.iter().enumerate() {
            assert_eq!(*v, 0.25 * (ls(j / 32) as f32 - 32.0) * 113.0, "value {j}");
        }
    }

    fn check(ty: GgmlType, edge: bool) {
        let simd = dot_fn(ty);
        let scalar: crate::quant::DotFn = if ty == GgmlType::IQ4XS { dot_xs_scalar } else { dot_nl_scalar };
        let mut rng = Rng(ty as u64 * 31 + edge as u64);
        // IQ4_NL's kernel takes blocks in pairs: odd counts (one block, nine) end on a single one.
        let ns: &[usize] = if ty == GgmlType::IQ4XS { &[256, 512, 2048] } else { &[32, 288, 512, 2048] };
        for &n in ns {
            for _ in 0..40 {
                let w = random_blocks(ty, n, &mut rng, edge);
                let x: Vec<f32> = (0..n).map(|_| if edge { [0.0, 1e-3, -3.0, 7.5][rng.next() as usize % 4] } else { rng.f() * 4.0 }).collect();
                let a = acts(ty, &x);
                let (got, want) = (simd(&w, &a, n), scalar(&w, &a, n));
                let vt = ty.vec_dot_type();
                let (mut wd, mut ad) = (vec![0.0f32; n], vec![0.0f32; n]);
                dequantize_row(ty, &w, &mut wd);
                dequantize_row(vt, &a[..vt.row_bytes(n)], &mut ad);
                let reference: f64 = wd.iter().zip(&ad).map(|(p, q)| *p as f64 * *q as f64).sum();
                let mag: f64 = wd.iter().zip(&ad).map(|(p, q)| (*p as f64 * *q as f64).abs()).sum::<f64>() + 1e-6;
                // The integer sums are exact in both; only the f32 summation of block results differs.
                assert!(((got - want) as f64).abs() <= 1e-5 * mag, "{}: simd {got} != scalar {want}", ty.name());
                assert!((want as f64 - reference).abs() <= 1e-4 * mag, "{}: scalar {want} != dequantized {reference}", ty.name());
                // And the dot of the f32 activations themselves: q8 rounding costs at most 1/254 of
                // the largest value per element.
                let exact: f64 = wd.iter().zip(&x).map(|(p, q)| *p as f64 * *q as f64).sum();
                let bound: f64 = wd.iter().map(|p| p.abs() as f64).sum::<f64>() * 7.5 / 127.0;
                assert!((want as f64 - exact).abs() <= bound, "{}: {want} too far from the f32 dot {exact}", ty.name());
            }
        }
    }

    #[test]
    fn simd_matches_scalar_and_the_dequantized_dot() {
        for ty in [GgmlType::IQ4NL, GgmlType::IQ4XS] {
            check(ty, false);
            check(ty, true);
        }
    }
}
