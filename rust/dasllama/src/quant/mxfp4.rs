//! MXFP4 (GGML type 39), the OCP microscaling 4-bit float format gpt-oss ships its experts in,
//! laid out as ggml's `block_mxfp4` (17 bytes per 32 values):
//!
//! - `e` u8: the block's E8M0 scale, a bare power-of-two exponent 2^(e - 127);
//! - `qs[16]`: E2M1 codes, value `j` the low nibble of `qs[j]`, value `16 + j` its high nibble
//!   (IQ4_NL's and Q4_0's order).
//!
//! As ggml does, a code is read through `KVALUES` (`kvalues_mxfp4`): twice the E2M1 value, so that
//! every level is a small integer (0, ±1, ±2, ±3, ±4, ±6, ±8, ±12), and the scale is halved to
//! make up for it (`e8m0_half`, ggml's `GGML_E8M0_TO_FP32_HALF`). Activations are rounded to
//! `q8_0`, as ggml pairs them (`ggml_vec_dot_mxfp4_q8_0`); a block's dot is then an exact integer
//! sum times `d_a * e8m0_half(e)`, so the SIMD tile kernels (`avx2`, `avx512`) differ from the
//! scalar twin here only in the order the f32 block results are added.

use super::rd_f16;

/// ggml's `kvalues_mxfp4`: the doubled E2M1 values of the sixteen codes.
pub const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

pub const BLOCK_BYTES: usize = 17;

/// The tile kernels add this to every level so that vpdpbusd sees unsigned weights (0..=28),
/// and take `BIAS * sum(activations)` back from each block's integer sum, exactly.
pub const BIAS: i8 = 16;

/// `KVALUES + BIAS`: the table the tile kernels look codes up in.
pub const BIASED: [i8; 16] = {
    let mut t = [0i8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = KVALUES[i] + BIAS;
        i += 1;
    }
    t
};

/// Half the E8M0 scale, 2^(e - 128), as ggml's `ggml_e8m0_to_fp32_half` builds it from bits:
/// `e` < 2 gives the subnormals 2^-128 and 2^-127; 255 (NaN in the OCP spec) gives 2^127, as in
/// ggml, which does not treat it apart either.
#[inline(always)]
pub fn e8m0_half(e: u8) -> f32 {
    f32::from_bits(if e < 2 { 0x0020_0000 << e } else { (e as u32 - 1) << 23 })
}

/// The level of value `j` (0..32) of a block's sixteen code bytes.
#[inline(always)]
fn level(qs: &[u8], j: usize) -> i32 {
    let byte = qs[j % 16];
    KVALUES[if j < 16 { byte & 0xF } else { byte >> 4 } as usize] as i32
}

/// `dequantize_row_mxfp4`: value = level * e8m0_half(e).
pub fn dequantize(src: &[u8], out: &mut [f32]) {
    for (b, y) in src.chunks_exact(BLOCK_BYTES).zip(out.chunks_exact_mut(32)) {
        let d = e8m0_half(b[0]);
        for (j, y) in y.iter_mut().enumerate() {
            *y = level(&b[1..], j) as f32 * d;
        }
    }
}

/// Scalar MXFP4 x q8_0, the twin the SIMD kernels are tested against: per block the exact
/// integer sum, times `d_a * e8m0_half(e)` as ggml's `ggml_vec_dot_mxfp4_q8_0` forms it.
pub fn dot_scalar(w: &[u8], a: &[u8], n: usize) -> f32 {
    let mut sum = 0.0f32;
    for ib in 0..n / 32 {
        let (wb, ab) = (&w[ib * BLOCK_BYTES..], &a[ib * 34..]);
        let isum: i32 = (0..32).map(|j| level(&wb[1..], j) * ab[2 + j] as i8 as i32).sum();
        sum += rd_f16(ab, 0) * e8m0_half(wb[0]) * isum as f32;
    }
    sum
}

/// ggml's `quantize_row_mxfp4_ref`: e = floor(log2(amax)) - 2 + 127 (so amax lands in the top
/// levels, 4..6 times the scale), then each value the nearest level, the first on a tie. For tests
/// and tools that write MXFP4 files; the engine never quantizes to it.
pub fn quantize_ref(x: &[f32], out: &mut [u8]) {
    for (xb, b) in x.chunks_exact(32).zip(out.chunks_exact_mut(BLOCK_BYTES)) {
        let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let e = if amax > 0.0 { (amax.log2().floor() - 2.0 + 127.0) as u8 } else { 0 };
        let d = e8m0_half(e);
        let best = |v: f32| {
            let mut best = (0usize, (KVALUES[0] as f32 * d - v).abs());
            for (i, &k) in KVALUES.iter().enumerate().skip(1) {
                let err = (k as f32 * d - v).abs();
                if err < best.1 {
                    best = (i, err);
                }
            }
            best.0 as u8
        };
        b[0] = e;
        for j in 0..16 {
            b[1 + j] = best(xb[j]) | (best(xb[16 + j]) << 4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{act_row_bytes, dequantize_row, quantize_row, GgmlType};

    #[test]
    fn format_facts() {
        let ty = GgmlType::from_id(39).unwrap();
        assert_eq!((ty, ty.name(), ty.block_len(), ty.block_bytes()), (GgmlType::MXFP4, "MXFP4", 32, 17));
        assert_eq!(ty.vec_dot_type(), GgmlType::Q8_0);
        assert_eq!(ty.row_bytes(2880), 90 * 17);
        assert!(BIASED.iter().all(|&v| (0..32).contains(&v)));
    }

    #[test]
    fn e8m0_half_is_ggmls() {
        // 2^(e - 128) for normal results; the two subnormal patterns; the top code.
        assert_eq!(e8m0_half(127), 0.5);
        assert_eq!(e8m0_half(128), 1.0);
        assert_eq!(e8m0_half(130), 4.0);
        assert_eq!(e8m0_half(2), 2f32.powi(-126));
        assert_eq!(e8m0_half(1).to_bits(), 0x0040_0000);
        assert_eq!(e8m0_half(0).to_bits(), 0x0020_0000);
        assert_eq!(e8m0_half(0), 2f32.powi(-128));
        assert_eq!(e8m0_half(255), 2f32.powi(127));
    }

    #[test]
    fn dequantization_follows_the_layout() {
        // e = 129 (half scale 2), qs[j] = j | (15 - j) << 4: value j is level j, 16 + j level 15 - j.
        let mut b = vec![129u8; 17];
        (0..16).for_each(|j| b[1 + j] = j as u8 | ((15 - j as u8) << 4));
        let mut y = [0.0f32; 32];
        dequantize_row(GgmlType::MXFP4, &b, &mut y);
        for j in 0..16 {
            assert_eq!(y[j], 2.0 * KVALUES[j] as f32);
            assert_eq!(y[16 + j], 2.0 * KVALUES[15 - j] as f32);
        }
        // The E2M1 values themselves: code 7 is 6.0, code 13 is -3.0, times 2^(e - 127).
        assert_eq!(y[7], 6.0 * 2.0 * 2.0);
        assert_eq!(y[13], -3.0 * 2.0 * 2.0);
    }

    #[test]
    fn quantize_ref_round_trips_representable_values() {
        // Every level times a power of two comes back exactly, and amax picks ggml's exponent.
        let x: Vec<f32> = (0..64).map(|j| KVALUES[j % 16] as f32 * 0.25 * if j < 32 { 1.0 } else { 8.0 }).collect();
        let mut b = vec![0u8; 34];
        quantize_ref(&x, &mut b);
        assert_eq!((b[0], b[17]), (126, 129));
        let mut y = vec![0.0f32; 64];
        dequantize(&b, &mut y);
        assert_eq!(x, y);
    }

    #[test]
    fn scalar_dot_is_the_dequantized_dot() {
        let mut state = 7u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as u32
        };
        for n in [32, 256, 2880] {
            let mut w: Vec<u8> = (0..n / 32 * 17).map(|_| next() as u8).collect();
            w.chunks_exact_mut(17).for_each(|b| b[0] = 118 + (next() % 16) as u8);
            let x: Vec<f32> = (0..n).map(|_| next() as f32 / u32::MAX as f32 * 4.0 - 2.0).collect();
            let mut a = vec![0u8; act_row_bytes(GgmlType::Q8_0, n)];
            quantize_row(GgmlType::Q8_0, &x, &mut a);
            let (mut wd, mut ad) = (vec![0.0f32; n], vec![0.0f32; n]);
            dequantize_row(GgmlType::MXFP4, &w, &mut wd);
            dequantize_row(GgmlType::Q8_0, &a[..GgmlType::Q8_0.row_bytes(n)], &mut ad);
            let want: f64 = wd.iter().zip(&ad).map(|(p, q)| *p as f64 * *q as f64).sum();
            let mag: f64 = wd.iter().zip(&ad).map(|(p, q)| (*p as f64 * *q as f64).abs()).sum::<f64>() + 1e-9;
            let got = dot_scalar(&w, &a, n) as f64;
            assert!((got - want).abs() <= 1e-5 * mag, "n={n}: {got} != {want}");
        }
    }
}
