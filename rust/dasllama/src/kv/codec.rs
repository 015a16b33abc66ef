//! KV codecs: how one row of K or V (all KV heads of one position) is stored in a page, and the
//! two operations attention needs on one head of it: q·k and o += p·v.
//!
//! - `F16`: IEEE half, what llama.cpp's default cache holds. Reads convert with F16C.
//! - `Q8_0`: 32-value blocks of i8 with an f16 scale (about half of f16), quantized as ggml's
//!   reference `quantize_row_q8_0` does.

use crate::quant::{rd_f16, wr_f16};
use half::f16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvCodec {
    F16,
    Q8_0,
}

impl KvCodec {
    pub fn parse(name: &str) -> Option<KvCodec> {
        match name {
            "f16" => Some(KvCodec::F16),
            "q8_0" => Some(KvCodec::Q8_0),
            _ => None,
        }
    }

    /// Bytes of `n` values.
    pub fn bytes(self, n: usize) -> usize {
        match self {
            KvCodec::F16 => 2 * n,
            KvCodec::Q8_0 => n / 32 * 34,
        }
    }

    /// Whether rows of `kv_dim` values in heads of `head_dim` fit this codec.
    pub fn supports(self, head_dim: usize) -> bool {
        match self {
            KvCodec::F16 => true,
            KvCodec::Q8_0 => head_dim.is_multiple_of(32),
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
        }
    }

    /// q · k for one head (`k` holds that head's bytes). `q` is already rounded to f16.
    #[inline]
    pub fn dot(self, q: &[f32], k: &[u8]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if crate::quant::avx2::has_avx2() {
            // SAFETY: AVX2/FMA/F16C detected; `k` holds `bytes(q.len())` bytes (asserted).
            assert!(k.len() >= self.bytes(q.len()));
            return unsafe {
                match self {
                    KvCodec::F16 => simd::dot_f16(q, k.as_ptr()),
                    KvCodec::Q8_0 => simd::dot_q8(q, k.as_ptr()),
                }
            };
        }
        let mut acc = [0.0f32; 8];
        let mut tmp = vec![0.0f32; q.len()];
        self.decode(k, &mut tmp);
        for (i, (a, b)) in q.iter().zip(&tmp).enumerate() {
            acc[i % 8] += a * b;
        }
        ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
    }

    /// o += p · v for one head.
    #[inline]
    pub fn axpy(self, o: &mut [f32], p: f32, v: &[u8]) {
        #[cfg(target_arch = "x86_64")]
        if crate::quant::avx2::has_avx2() {
            assert!(v.len() >= self.bytes(o.len()));
            // SAFETY: AVX2/FMA/F16C detected; `v` holds enough bytes (asserted).
            return unsafe {
                match self {
                    KvCodec::F16 => simd::axpy_f16(o, p, v.as_ptr()),
                    KvCodec::Q8_0 => simd::axpy_q8(o, p, v.as_ptr()),
                }
            };
        }
        let mut tmp = vec![0.0f32; o.len()];
        self.decode(v, &mut tmp);
        o.iter_mut().zip(&tmp).for_each(|(a, b)| *a += p * b);
    }

    /// out[g * stride + j] = q_g · k_j for the query heads `q` (`hd` values each) that share one KV
    /// head, over consecutive rows `k` of it (`n` rows). Each K row is read once for all of them.
    pub fn dot_rows(self, q: &[f32], hd: usize, k: &[u8], n: usize, out: &mut [f32], stride: usize) {
        let (rb, heads) = (self.bytes(hd), q.len() / hd);
        assert!(k.len() >= n * rb && out.len() >= (heads - 1) * stride + n, "KV rows or scores too short");
        #[cfg(target_arch = "x86_64")]
        if self == KvCodec::F16 && hd.is_multiple_of(32) && crate::quant::avx2::has_avx2() {
            for (g0, qg) in q.chunks(3 * hd).enumerate() {
                // SAFETY: AVX2/FMA/F16C detected; bounds asserted above.
                unsafe { simd::dot_rows_f16(qg, hd, k.as_ptr(), n, &mut out[3 * g0 * stride..], stride) };
            }
            return;
        }
        for (g, qg) in q.chunks_exact(hd).enumerate() {
            for j in 0..n {
                out[g * stride + j] = self.dot(qg, &k[j * rb..(j + 1) * rb]);
            }
        }
    }

    /// o += Σ_j p[j] · v_j for consecutive rows `v` of one head (`o.len()` values each).
    pub fn axpy_rows(self, o: &mut [f32], p: &[f32], v: &[u8]) {
        let rb = self.bytes(o.len());
        assert!(v.len() >= p.len() * rb, "KV rows too short");
        #[cfg(target_arch = "x86_64")]
        if self == KvCodec::F16 && o.len().is_multiple_of(64) && crate::quant::avx2::has_avx2() {
            // SAFETY: AVX2/FMA/F16C detected; `v` holds p.len() rows of o.len() halves (asserted).
            return unsafe { simd::axpy_rows_f16(o, p, v.as_ptr()) };
        }
        for (j, &pj) in p.iter().enumerate() {
            self.axpy(o, pj, &v[j * rb..(j + 1) * rb]);
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
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use crate::quant::avx2::hsum;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn f16x8(p: *const u8) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f16(q: &[f32], k: *const u8) -> f32 {
        let n = q.len();
        let a = q.as_ptr();
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (j, ac) in acc.iter_mut().enumerate() {
                *ac = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i + 8 * j)), f16x8(k.add(2 * (i + 8 * j))), *ac);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), f16x8(k.add(2 * i)), acc[0]);
            i += 8;
        }
        let mut s = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
        while i < n {
            s += *a.add(i) * super::f16::from_bits((k.add(2 * i) as *const u16).read_unaligned()).to_f32();
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_f16(o: &mut [f32], p: f32, v: *const u8) {
        let n = o.len();
        let y = o.as_mut_ptr();
        let pv = _mm256_set1_ps(p);
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(y.add(i), _mm256_fmadd_ps(pv, f16x8(v.add(2 * i)), _mm256_loadu_ps(y.add(i))));
            i += 8;
        }
        while i < n {
            *y.add(i) += p * super::f16::from_bits((v.add(2 * i) as *const u16).read_unaligned()).to_f32();
            i += 1;
        }
    }

    /// Up to three query heads against each K row, converted once; per head the summation order
    /// is `dot_f16`'s (four accumulators, 32 values apart), so scores do not depend on grouping.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_rows_f16(q: &[f32], hd: usize, k: *const u8, n: usize, out: &mut [f32], stride: usize) {
        match q.len() / hd {
            1 => heads_f16::<1>(q, hd, k, n, out, stride),
            2 => heads_f16::<2>(q, hd, k, n, out, stride),
            _ => heads_f16::<3>(q, hd, k, n, out, stride),
        }
    }

    #[inline(always)]
    unsafe fn heads_f16<const G: usize>(q: &[f32], hd: usize, k: *const u8, n: usize, out: &mut [f32], stride: usize) {
        let a = q.as_ptr();
        for j in 0..n {
            let row = k.add(2 * hd * j);
            let mut acc = [[_mm256_setzero_ps(); 4]; G];
            for i in (0..hd).step_by(32) {
                let kv: [__m256; 4] = std::array::from_fn(|m| f16x8(row.add(2 * (i + 8 * m))));
                for (g, ac) in acc.iter_mut().enumerate() {
                    for m in 0..4 {
                        ac[m] = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(g * hd + i + 8 * m)), kv[m], ac[m]);
                    }
                }
            }
            for (g, ac) in acc.iter().enumerate() {
                out[g * stride + j] = hsum(_mm256_add_ps(_mm256_add_ps(ac[0], ac[1]), _mm256_add_ps(ac[2], ac[3])));
            }
        }
    }

    /// 64 outputs at a time stay in eight registers while every row adds into them.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_rows_f16(o: &mut [f32], p: &[f32], v: *const u8) {
        let rb = 2 * o.len();
        for c in (0..o.len()).step_by(64) {
            let y = o.as_mut_ptr().add(c);
            let mut acc: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(y.add(8 * i)));
            for (j, &pj) in p.iter().enumerate() {
                let pv = _mm256_set1_ps(pj);
                for (i, ac) in acc.iter_mut().enumerate() {
                    *ac = _mm256_fmadd_ps(pv, f16x8(v.add(j * rb + 2 * (c + 8 * i))), *ac);
                }
            }
            for (i, ac) in acc.iter().enumerate() {
                _mm256_storeu_ps(y.add(8 * i), *ac);
            }
        }
    }

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

    /// 8 i8 at `p` as f32.
    #[inline(always)]
    unsafe fn i8x8(p: *const u8) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8(q: &[f32], k: *const u8) -> f32 {
        let a = q.as_ptr();
        let mut acc = _mm256_setzero_ps();
        for b in 0..q.len() / 32 {
            let blk = k.add(34 * b);
            let d = _mm256_set1_ps(super::f16::from_bits((blk as *const u16).read_unaligned()).to_f32());
            let mut t = _mm256_mul_ps(_mm256_loadu_ps(a.add(32 * b)), i8x8(blk.add(2)));
            for j in 1..4 {
                t = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(32 * b + 8 * j)), i8x8(blk.add(2 + 8 * j)), t);
            }
            acc = _mm256_fmadd_ps(d, t, acc);
        }
        hsum(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_q8(o: &mut [f32], p: f32, v: *const u8) {
        let y = o.as_mut_ptr();
        for b in 0..o.len() / 32 {
            let blk = v.add(34 * b);
            let pd = _mm256_set1_ps(p * super::f16::from_bits((blk as *const u16).read_unaligned()).to_f32());
            for j in 0..4 {
                let at = y.add(32 * b + 8 * j);
                _mm256_storeu_ps(at, _mm256_fmadd_ps(pd, i8x8(blk.add(2 + 8 * j)), _mm256_loadu_ps(at)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
