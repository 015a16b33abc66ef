//! KV codecs: how one row of K or V (all KV heads of one position) is stored in a page, and the
//! two operations attention needs on one head of it: q·k and o += p·v.
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

    /// Query heads (`hd` values each) into the basis K is stored in.
    pub fn prepare_query(self, q: &mut [f32], hd: usize) {
        if self == KvCodec::Tq4 {
            q.chunks_exact_mut(hd).for_each(rotate);
        }
    }

    /// Attention output heads (`hd` values each, summed in the stored basis) back to the model's.
    pub fn finish_output(self, o: &mut [f32], hd: usize) {
        if self == KvCodec::Tq4 {
            o.chunks_exact_mut(hd).for_each(unrotate);
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
                    KvCodec::Tq4 => simd::dot_q4(q, k.as_ptr()),
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
                    KvCodec::Tq4 => simd::axpy_q4(o, p, v.as_ptr()),
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
            for (g0, qg) in q.chunks(GROUP * hd).enumerate() {
                // SAFETY: AVX2/FMA/F16C detected; bounds asserted above.
                unsafe { simd::dot_rows_f16(qg, hd, k.as_ptr(), n, &mut out[GROUP * g0 * stride..], stride) };
            }
            return;
        }
        for (g, qg) in q.chunks_exact(hd).enumerate() {
            for j in 0..n {
                out[g * stride + j] = self.dot(qg, &k[j * rb..(j + 1) * rb]);
            }
        }
    }

    /// o_g += Σ_j p[g * stride + j] · v_j for the query heads of one KV head (`o`: heads of `hd`
    /// values), over `n` consecutive rows `v` of it. Each V row is read once for all heads; per
    /// output the sum runs over j in order, whatever the grouping.
    pub fn axpy_rows(self, o: &mut [f32], hd: usize, p: &[f32], stride: usize, v: &[u8], n: usize) {
        let (rb, heads) = (self.bytes(hd), o.len() / hd);
        assert!(v.len() >= n * rb && p.len() >= (heads - 1) * stride + n, "KV rows or weights too short");
        #[cfg(target_arch = "x86_64")]
        if self == KvCodec::F16 && hd.is_multiple_of(32) && crate::quant::avx2::has_avx2() {
            for (g0, og) in o.chunks_mut(GROUP * hd).enumerate() {
                // SAFETY: AVX2/FMA/F16C detected; bounds asserted above.
                unsafe { simd::axpy_rows_f16(og, hd, &p[GROUP * g0 * stride..], stride, v.as_ptr(), n) };
            }
            return;
        }
        for (g, og) in o.chunks_exact_mut(hd).enumerate() {
            for j in 0..n {
                self.axpy(og, p[g * stride + j], &v[j * rb..(j + 1) * rb]);
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
fn rotate(x: &mut [f32]) {
    let n = x.len();
    x.iter_mut().zip(tq4_signs(n)).for_each(|(v, s)| *v *= s);
    fwht(x);
}

/// y -> s ⊙ (H y), the inverse of `rotate` (H is symmetric and orthonormal).
fn unrotate(y: &mut [f32]) {
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

/// Query heads the f16 attention kernels take per pass over the K or V rows (Gemma 3 and Llama 3
/// group four query heads per KV head).
#[cfg(target_arch = "x86_64")]
const GROUP: usize = 4;

#[cfg(target_arch = "x86_64")]
mod simd {
    use crate::quant::avx2::hsum;
    use std::arch::x86_64::*;

    /// Calls `$kernel::<G>` for the number of query heads sharing a KV head (1 to 4).
    macro_rules! per_group {
        ($kernel:ident, $g:expr, $($arg:expr),*) => {
            match $g {
                1 => $kernel::<1>($($arg),*),
                2 => $kernel::<2>($($arg),*),
                3 => $kernel::<3>($($arg),*),
                _ => $kernel::<4>($($arg),*),
            }
        };
    }

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

    /// Up to four query heads against each K row, converted once; per head the summation order
    /// is `dot_f16`'s (four accumulators, 32 values apart), so scores do not depend on grouping.
    pub unsafe fn dot_rows_f16(q: &[f32], hd: usize, k: *const u8, n: usize, out: &mut [f32], stride: usize) {
        if crate::quant::avx2::has_avx512() {
            dot_rows_f16_512(q, hd, k, n, out, stride)
        } else {
            dot_rows_f16_256(q, hd, k, n, out, stride)
        }
    }

    /// The AVX-512 build: each 16-wide register holds two of the 8-wide accumulators of the AVX2
    /// build (the same lanes, the same chains), so a K row and a query take half the loads and
    /// the scores are bit for bit the same.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    pub(super) unsafe fn dot_rows_f16_512(q: &[f32], hd: usize, k: *const u8, n: usize, out: &mut [f32], stride: usize) {
        if !hd.is_multiple_of(32) {
            return dot_rows_any(q, hd, k, n, out, stride);
        }
        per_group!(heads_f16_512, q.len() / hd, q, hd, k, n, out, stride)
    }

    #[inline(always)]
    unsafe fn heads_f16_512<const G: usize>(q: &[f32], hd: usize, k: *const u8, n: usize, out: &mut [f32], stride: usize) {
        scores::<G, Keys512>(q, hd, k, n, out, stride)
    }

    /// What `hsum` finishes for one key and each of G query heads: the eight lanes of its
    /// partial sums. The two builds differ only here, in how they get them.
    trait KeySums {
        unsafe fn sums<const G: usize>(q: *const f32, hd: usize, row: *const u8) -> [__m256; G];
    }

    struct Keys512;
    impl KeySums for Keys512 {
        #[inline(always)]
        unsafe fn sums<const G: usize>(q: *const f32, hd: usize, row: *const u8) -> [__m256; G] {
            // acc[g][h]: lanes 0..8 are the AVX2 build's accumulator 2h, lanes 8..16 its 2h+1.
            let mut acc = [[_mm512_setzero_ps(); 2]; G];
            for i in (0..hd).step_by(32) {
                let kv: [__m512; 2] = std::array::from_fn(|h| _mm512_cvtph_ps(_mm256_loadu_si256(row.add(2 * (i + 16 * h)) as *const __m256i)));
                for (g, ac) in acc.iter_mut().enumerate() {
                    for h in 0..2 {
                        ac[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(g * hd + i + 16 * h)), kv[h], ac[h]);
                    }
                }
            }
            let mut v = [_mm256_setzero_ps(); G];
            for g in 0..G {
                v[g] = _mm256_add_ps(half512(acc[g][0]), half512(acc[g][1]));
            }
            v
        }
    }

    #[inline(always)]
    unsafe fn half512(v: __m512) -> __m256 {
        _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))))
    }

    struct Keys256;
    impl KeySums for Keys256 {
        #[inline(always)]
        unsafe fn sums<const G: usize>(q: *const f32, hd: usize, row: *const u8) -> [__m256; G] {
            let mut acc = [[_mm256_setzero_ps(); 4]; G];
            for i in (0..hd).step_by(32) {
                let kv: [__m256; 4] = std::array::from_fn(|m| f16x8(row.add(2 * (i + 8 * m))));
                for (g, ac) in acc.iter_mut().enumerate() {
                    for m in 0..4 {
                        ac[m] = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(g * hd + i + 8 * m)), kv[m], ac[m]);
                    }
                }
            }
            let mut v = [_mm256_setzero_ps(); G];
            for g in 0..G {
                v[g] = _mm256_add_ps(_mm256_add_ps(acc[g][0], acc[g][1]), _mm256_add_ps(acc[g][2], acc[g][3]));
            }
            v
        }
    }

    /// Eight keys' lanes, transposed: [a.lo + a.hi | b.lo + b.hi] (`hsum`'s first step for a and b).
    #[inline(always)]
    unsafe fn fold_halves(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(a, b), _mm256_permute2f128_ps::<0x31>(a, b))
    }

    /// Per 128-bit lane [a0 + a2, a1 + a3, b0 + b2, b1 + b3] (its second step).
    #[inline(always)]
    unsafe fn fold_pairs(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(_mm256_shuffle_ps::<0b01_00_01_00>(a, b), _mm256_shuffle_ps::<0b11_10_11_10>(a, b))
    }

    /// Per 128-bit lane [a0 + a1, a2 + a3, b0 + b1, b2 + b3] (its last step).
    #[inline(always)]
    unsafe fn fold_last(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(_mm256_shuffle_ps::<0b10_00_10_00>(a, b), _mm256_shuffle_ps::<0b11_01_11_01>(a, b))
    }

    /// out[g * stride + j] = q_g · k_j for keys 0..n. Eight keys at a time are finished together,
    /// transposed, in `hsum`'s order (lanes i and i+4; then 0+2 and 1+3; then the two): one vector
    /// op per step for all eight instead of a shuffle chain per key, and the same bits.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // g indexes two arrays in step
    unsafe fn scores<const G: usize, K: KeySums>(q: &[f32], hd: usize, k: *const u8, n: usize, out: &mut [f32], stride: usize) {
        assert!(out.len() >= (G - 1) * stride + n, "score rows out of bounds");
        let (a, o) = (q.as_ptr(), out.as_mut_ptr());
        let mut j = 0;
        while j + 8 <= n {
            // Keys p and p + 4 share a vector after the first step, so the last one lands in order.
            let mut t = [[_mm256_setzero_ps(); G]; 4];
            for (p, tp) in t.iter_mut().enumerate() {
                let (x, y) = (K::sums::<G>(a, hd, k.add(2 * hd * (j + p))), K::sums::<G>(a, hd, k.add(2 * hd * (j + p + 4))));
                for g in 0..G {
                    tp[g] = fold_halves(x[g], y[g]);
                }
            }
            for g in 0..G {
                // SAFETY: g * stride + j + 8 <= (G - 1) * stride + n <= out.len() (asserted).
                _mm256_storeu_ps(o.add(g * stride + j), fold_last(fold_pairs(t[0][g], t[1][g]), fold_pairs(t[2][g], t[3][g])));
            }
            j += 8;
        }
        for j in j..n {
            let v = K::sums::<G>(a, hd, k.add(2 * hd * j));
            for g in 0..G {
                out[g * stride + j] = hsum(v[g]);
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_rows_f16_256(q: &[f32], hd: usize, k: *const u8, n: usize, out: &mut [f32], stride: usize) {
        dot_rows_any(q, hd, k, n, out, stride)
    }

    #[inline(always)]
    unsafe fn dot_rows_any(q: &[f32], hd: usize, k: *const u8, n: usize, out: &mut [f32], stride: usize) {
        per_group!(heads_f16, q.len() / hd, q, hd, k, n, out, stride)
    }

    #[inline(always)]
    unsafe fn heads_f16<const G: usize>(q: &[f32], hd: usize, k: *const u8, n: usize, out: &mut [f32], stride: usize) {
        scores::<G, Keys256>(q, hd, k, n, out, stride)
    }

    /// Up to four heads' outputs, 32 values at a time, stay in registers while every V row
    /// (converted once for all of them) adds into them.
    pub unsafe fn axpy_rows_f16(o: &mut [f32], hd: usize, p: &[f32], stride: usize, v: *const u8, n: usize) {
        if crate::quant::avx2::has_avx512() {
            axpy_rows_f16_512(o, hd, p, stride, v, n)
        } else {
            axpy_rows_f16_256(o, hd, p, stride, v, n)
        }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    pub(super) unsafe fn axpy_rows_f16_512(o: &mut [f32], hd: usize, p: &[f32], stride: usize, v: *const u8, n: usize) {
        axpy_rows_any(o, hd, p, stride, v, n)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn axpy_rows_f16_256(o: &mut [f32], hd: usize, p: &[f32], stride: usize, v: *const u8, n: usize) {
        axpy_rows_any(o, hd, p, stride, v, n)
    }

    #[inline(always)]
    unsafe fn axpy_rows_any(o: &mut [f32], hd: usize, p: &[f32], stride: usize, v: *const u8, n: usize) {
        per_group!(values_f16, o.len() / hd, o, hd, p, stride, v, n)
    }

    #[inline(always)]
    unsafe fn values_f16<const G: usize>(o: &mut [f32], hd: usize, p: &[f32], stride: usize, v: *const u8, n: usize) {
        for c in (0..hd).step_by(32) {
            let y = o.as_mut_ptr();
            let mut acc: [[__m256; 4]; G] = std::array::from_fn(|g| std::array::from_fn(|m| _mm256_loadu_ps(y.add(g * hd + c + 8 * m))));
            for j in 0..n {
                let row = v.add(2 * (hd * j + c));
                let vv: [__m256; 4] = std::array::from_fn(|m| f16x8(row.add(16 * m)));
                for (g, ac) in acc.iter_mut().enumerate() {
                    let pv = _mm256_set1_ps(p[g * stride + j]);
                    for (a, x) in ac.iter_mut().zip(&vv) {
                        *a = _mm256_fmadd_ps(pv, *x, *a);
                    }
                }
            }
            for (g, ac) in acc.iter().enumerate() {
                for (m, a) in ac.iter().enumerate() {
                    _mm256_storeu_ps(y.add(g * hd + c + 8 * m), *a);
                }
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

    /// The 32 values of a q4_0 block (nibble - 8) as four vectors of eight f32, unscaled.
    #[inline(always)]
    unsafe fn q4_block(blk: *const u8) -> [__m256; 4] {
        let raw = _mm_loadu_si128(blk.add(2) as *const __m128i);
        let m4 = _mm_set1_epi8(0xF);
        let eight = _mm_set1_epi8(8);
        let lo = _mm_sub_epi8(_mm_and_si128(raw, m4), eight);
        let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), eight);
        let f = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
        [f(lo), f(_mm_srli_si128(lo, 8)), f(hi), f(_mm_srli_si128(hi, 8))]
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4(q: &[f32], k: *const u8) -> f32 {
        let a = q.as_ptr();
        let mut acc = _mm256_setzero_ps();
        for b in 0..q.len() / 32 {
            let blk = k.add(18 * b);
            let v = q4_block(blk);
            let mut t = _mm256_mul_ps(_mm256_loadu_ps(a.add(32 * b)), v[0]);
            for (j, vj) in v.iter().enumerate().skip(1) {
                t = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(32 * b + 8 * j)), *vj, t);
            }
            let d = _mm256_set1_ps(super::f16::from_bits((blk as *const u16).read_unaligned()).to_f32());
            acc = _mm256_fmadd_ps(d, t, acc);
        }
        hsum(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_q4(o: &mut [f32], p: f32, v: *const u8) {
        let y = o.as_mut_ptr();
        for b in 0..o.len() / 32 {
            let blk = v.add(18 * b);
            let pd = _mm256_set1_ps(p * super::f16::from_bits((blk as *const u16).read_unaligned()).to_f32());
            for (j, vj) in q4_block(blk).iter().enumerate() {
                let at = y.add(32 * b + 8 * j);
                _mm256_storeu_ps(at, _mm256_fmadd_ps(pd, *vj, _mm256_loadu_ps(at)));
            }
        }
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

    /// The AVX2 and AVX-512VL builds of the f16 attention kernels run the same operations.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16_attention_kernels_agree_across_instruction_sets() {
        if !crate::quant::avx2::has_avx512() {
            eprintln!("skipped: this CPU has no AVX-512VL, so only one build of the kernels runs");
            return;
        }
        let (hd, n, heads) = (128, 37, 4);
        let vals: Vec<f32> = (0..n * hd).map(|i| ((i * 7919 % 2000) as f32 - 1000.0) * 0.003).collect();
        let mut rows = vec![0u8; 2 * n * hd];
        KvCodec::F16.encode(&vals, &mut rows);
        let q: Vec<f32> = (0..heads * hd).map(|i| ((i * 31 % 97) as f32 - 48.0) * 0.02).collect();
        let (mut a, mut b) = (vec![0.0f32; heads * n], vec![0.0f32; heads * n]);
        let (mut oa, mut ob) = (vec![0.5f32; heads * hd], vec![0.5f32; heads * hd]);
        // SAFETY: AVX-512VL (and so AVX2/FMA/F16C) detected; buffers sized for n rows and 4 heads.
        unsafe {
            simd::dot_rows_f16_512(&q, hd, rows.as_ptr(), n, &mut a, n);
            simd::dot_rows_f16_256(&q, hd, rows.as_ptr(), n, &mut b, n);
            simd::axpy_rows_f16_512(&mut oa, hd, &a, n, rows.as_ptr(), n);
            simd::axpy_rows_f16_256(&mut ob, hd, &a, n, rows.as_ptr(), n);
        }
        assert_eq!(a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), b.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        // Eight keys finished at once (transposed) or one at a time: the single-query dot's bits.
        for (g, qg) in q.chunks_exact(hd).enumerate() {
            for j in 0..n {
                assert_eq!(a[g * n + j].to_bits(), KvCodec::F16.dot(qg, &rows[2 * hd * j..]).to_bits(), "head {g} key {j}");
            }
        }
        assert_eq!(oa.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), ob.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
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
