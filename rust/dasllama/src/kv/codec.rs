//! KV codecs: how one row of K or V (all KV heads of one position) is stored in a page, and read
//! back. Storage only: the products attention takes over stored rows (q·k, o += p·v) are the CPU
//! backend's (`cpu::kv_dot`).
//!
//! - `F16`: IEEE half, what llama.cpp's default cache holds. Reads convert with F16C.
//! - `Q8_0`: 32-value blocks of i8 with an f16 scale (about half of f16), quantized as ggml's
//!   reference `quantize_row_q8_0` does.
//! - `Tq4`: a rotated 4-bit cache (18 bytes per 32 values, a quarter of f16). Each head vector is
//!   multiplied by a fixed ±1 sign vector and rotated by an orthonormal fast Walsh–Hadamard
//!   transform, which spreads outliers over the whole head so 4-bit blocks (ggml's q4_0 layout and
//!   rounding) lose little. Rotations preserve dot products, so attention runs in the rotated
//!   basis: the query is rotated once (`prepare_query`), and the head's output is rotated back
//!   once (`finish_output`). Needs a power-of-two head size.

use crate::quant::{rd_f16, wr_f16};
use half::f16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvCodec {
    F16,
    Q8_0,
    Tq4,
}

impl KvCodec {
    pub fn parse(name: &str) -> Option<KvCodec> {
        match name {
            "f16" => Some(KvCodec::F16),
            "q8_0" => Some(KvCodec::Q8_0),
            "tq4" => Some(KvCodec::Tq4),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvCodec::F16 => "f16",
            KvCodec::Q8_0 => "q8_0",
            KvCodec::Tq4 => "tq4",
        }
    }

    /// Bytes of `n` values.
    pub fn bytes(self, n: usize) -> usize {
        match self {
            KvCodec::F16 => 2 * n,
            KvCodec::Q8_0 => n / 32 * 34,
            KvCodec::Tq4 => n / 32 * 18,
        }
    }

    /// What this codec needs of a head size, for error messages.
    pub fn requirement(self) -> &'static str {
        match self {
            KvCodec::F16 => "any head size",
            KvCodec::Q8_0 => "a head size that is a multiple of 32",
            KvCodec::Tq4 => "a head size that is a power of two, at least 32",
        }
    }

    /// Whether heads of `head_dim` values fit this codec.
    pub fn supports(self, head_dim: usize) -> bool {
        match self {
            KvCodec::F16 => true,
            KvCodec::Q8_0 => head_dim.is_multiple_of(32),
            KvCodec::Tq4 => head_dim.is_power_of_two() && head_dim >= 32,
        }
    }

    pub fn encode(self, src: &[f32], dst: &mut [u8]) {
        match self {
            KvCodec::F16 => {
                let mut i = 0;
                #[cfg(target_arch = "x86_64")]
                if crate::quant::avx2::has_avx2() {
                    assert!(dst.len() >= 2 * src.len());
                    // SAFETY: F16C detected; `dst` holds two bytes per value (asserted).
                    i = unsafe { simd::encode_f16(src, dst.as_mut_ptr()) };
                }
                for (j, &v) in src.iter().enumerate().skip(i) {
                    wr_f16(dst, 2 * j, v);
                }
            }
            KvCodec::Q8_0 => crate::quant::quantize_weights_q8_0(src, dst),
            KvCodec::Tq4 => {
                let mut x = src.to_vec();
                rotate(&mut x);
                quantize_q4_0(&x, dst);
            }
        }
    }

    /// Values of one head (the scalar path's reference; SIMD paths never materialize rows).
    pub fn decode(self, src: &[u8], dst: &mut [f32]) {
        assert!(src.len() >= self.bytes(dst.len()));
        match self {
            KvCodec::F16 => {
                for (i, d) in dst.iter_mut().enumerate() {
                    *d = f16::from_bits(u16::from_le_bytes([src[2 * i], src[2 * i + 1]])).to_f32();
                }
            }
            KvCodec::Q8_0 => {
                for (b, out) in dst.chunks_exact_mut(32).enumerate() {
                    let d = rd_f16(src, 34 * b);
                    for (j, o) in out.iter_mut().enumerate() {
                        *o = src[34 * b + 2 + j] as i8 as f32 * d;
                    }
                }
            }
            // Values in the rotated basis (what attention works in).
            KvCodec::Tq4 => crate::quant::dequantize_row(crate::quant::GgmlType::Q4_0, &src[..self.bytes(dst.len())], dst),
        }
    }
}

/// The fixed ±1 signs of the tq4 rotation (an LCG from seed 0xC0FFEE, one sign per top bit).
fn tq4_signs(n: usize) -> impl Iterator<Item = f32> {
    let mut state = 0xC0FFEEu64;
    (0..n).map(move |_| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        if state >> 63 == 1 {
            -1.0
        } else {
            1.0
        }
    })
}

/// The tq4 signs of a head of `n` values, as the device's shaders take them.
pub(crate) fn tq4_sign_vector(n: usize) -> Vec<f32> {
    tq4_signs(n).collect()
}

/// Orthonormal fast Walsh–Hadamard transform in place (its own inverse).
fn fwht(x: &mut [f32]) {
    let n = x.len();
    let mut len = 1;
    while len < n {
        for i in (0..n).step_by(2 * len) {
            for j in i..i + len {
                let (a, b) = (x[j], x[j + len]);
                x[j] = a + b;
                x[j + len] = a - b;
            }
        }
        len *= 2;
    }
    let scale = 1.0 / (n as f32).sqrt();
    x.iter_mut().for_each(|v| *v *= scale);
}

/// x -> H (s ⊙ x).
pub(crate) fn rotate(x: &mut [f32]) {
    let n = x.len();
    x.iter_mut().zip(tq4_signs(n)).for_each(|(v, s)| *v *= s);
    fwht(x);
}

/// y -> s ⊙ (H y), the inverse of `rotate` (H is symmetric and orthonormal).
pub(crate) fn unrotate(y: &mut [f32]) {
    fwht(y);
    let n = y.len();
    y.iter_mut().zip(tq4_signs(n)).for_each(|(v, s)| *v *= s);
}

/// ggml's reference q4_0 rounding: the scale is the signed value of largest magnitude over -8.
fn quantize_q4_0(x: &[f32], out: &mut [u8]) {
    for (ib, xb) in x.chunks_exact(32).enumerate() {
        let b = &mut out[ib * 18..(ib + 1) * 18];
        let max = xb.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        wr_f16(b, 0, d);
        for j in 0..16 {
            let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
            b[2 + j] = q(xb[j]) | (q(xb[16 + j]) << 4);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// Whole groups of eight values to f16 (round to nearest even, as `half` does); returns how many.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn encode_f16(src: &[f32], dst: *mut u8) -> usize {
        let n = src.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(i)));
            _mm_storeu_si128(dst.add(2 * i) as *mut __m128i, h);
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tq4_rotation_is_orthonormal_and_its_blocks_are_close() {
        assert!(KvCodec::Tq4.supports(256) && !KvCodec::Tq4.supports(48) && !KvCodec::Tq4.supports(16));
        let hd = 64;
        let x: Vec<f32> = (0..hd).map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.3 + if i == 5 { 9.0 } else { 0.0 }).collect();
        let y: Vec<f32> = (0..hd).map(|i| ((i * 11 % 13) as f32 - 6.0) * 0.2).collect();
        let (mut rx, mut ry) = (x.clone(), y.clone());
        rotate(&mut rx);
        rotate(&mut ry);
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f32>();
        assert!((dot(&rx, &ry) - dot(&x, &y)).abs() < 1e-4, "rotation must keep dot products");
        let mut back = rx.clone();
        unrotate(&mut back);
        assert!(back.iter().zip(&x).all(|(a, b)| (a - b).abs() < 1e-5), "unrotate must invert rotate");
        // Stored K, a rotated query: the score is close to the exact one; V summed in the rotated
        // basis comes back close to the original after finish_output.
        let mut k = vec![0u8; KvCodec::Tq4.bytes(hd)];
        KvCodec::Tq4.encode(&x, &mut k);
        let mut q = y.clone();
        KvCodec::Tq4.prepare_query(&mut q, hd);
        let score = KvCodec::Tq4.dot(&q, &k);
        let norm = dot(&x, &x).sqrt() * dot(&y, &y).sqrt();
        assert!((score - dot(&x, &y)).abs() < 0.05 * norm, "score {score} vs {}", dot(&x, &y));
        let mut o = vec![0.0f32; hd];
        KvCodec::Tq4.axpy(&mut o, 1.0, &k);
        KvCodec::Tq4.finish_output(&mut o, hd);
        let err = o.iter().zip(&x).map(|(a, b)| (a - b) * (a - b)).sum::<f32>().sqrt();
        assert!(err < 0.1 * dot(&x, &x).sqrt(), "round trip error {err}");
    }

    #[test]
    fn tq4_blocks_round_like_ggml_q4_0() {
        let x: Vec<f32> = (0..32).map(|i| i as f32 - 12.0).collect();
        let mut b = vec![0u8; 18];
        quantize_q4_0(&x, &mut b);
        let mut back = vec![0.0f32; 32];
        crate::quant::dequantize_row(crate::quant::GgmlType::Q4_0, &b, &mut back);
        // max = 19 -> d = -19/8; every value within half a step.
        let d = 19.0f32 / 8.0;
        assert!(back.iter().zip(&x).all(|(a, v)| (a - v).abs() <= d / 2.0 + 1e-3), "{back:?}");
        assert_eq!(back[31], 19.0, "the value of largest magnitude is exact");
    }

    #[test]
    fn f16_encoding_rounds_like_half() {
        // Values exactly halfway between two halves, subnormals, and out of range.
        let mut src: Vec<f32> = (0..4096).map(|i| f16::from_bits(i as u16 * 16).to_f32() * 1.000_488_3).collect();
        src.extend([65520.0, -70000.0, 6e-8, 1e-9, 0.0, -0.0, 1.0 + 1.0 / 2048.0, 1.0 + 3.0 / 2048.0]);
        let mut dst = vec![0u8; 2 * src.len()];
        KvCodec::F16.encode(&src, &mut dst);
        for (i, v) in src.iter().enumerate() {
            let got = u16::from_le_bytes([dst[2 * i], dst[2 * i + 1]]);
            let want = f16::from_f32(*v).to_bits();
            assert!(got == want || (f16::from_bits(got).is_nan() && f16::from_bits(want).is_nan()), "{v}: {got:#x} != {want:#x}");
        }
    }
}
