//! Elementwise and per-row ops of the forward pass.

use half::f16;

/// RMS norm with llama.cpp's f64 sum of (f32) squares; `w` multiplies afterwards, as ggml_mul does.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let sum = sum_squares(x);
    let scale = 1.0 / ((sum / x.len() as f64) as f32 + eps).sqrt();
    for (v, g) in x.iter_mut().zip(w) {
        *v = *v * scale * g;
    }
}

/// Σ x² with each square rounded in f32 and summed in f64 (four f64 lanes where AVX2 exists:
/// the order of f64 additions of f32 values moves the result by far less than an f32 ulp).
fn sum_squares(x: &[f32]) -> f64 {
    let mut i = 0;
    let mut sum = 0.0f64;
    #[cfg(target_arch = "x86_64")]
    if crate::quant::avx2::has_avx2() {
        // SAFETY: AVX2 detected; the kernel stays inside `x`.
        (i, sum) = unsafe { simd::sum_squares(x) };
    }
    sum + x[i..].iter().map(|&v| (v * v) as f64).sum::<f64>()
}

pub use crate::backend::rope_cache;

twice! {
    /// Rotary embedding of one head with a `rope_cache`. `neox` pairs (i, i+d/2); otherwise
    /// (2i, 2i+1).
    pub fn rope(x: &mut [f32], cache: &[(f32, f32)], neox: bool) = rope_body;
}

#[inline(always)]
fn rope_body(x: &mut [f32], cache: &[(f32, f32)], neox: bool) {
    let half = cache.len();
    for (i, &(s, c)) in cache.iter().enumerate() {
        let (a, b) = if neox { (i, i + half) } else { (2 * i, 2 * i + 1) };
        let (x0, x1) = (x[a], x[b]);
        // The fused multiply-adds GCC makes of ggml's `x0*cos - x1*sin` and `x0*sin + x1*cos`.
        x[a] = x0.mul_add(c, -(x1 * s));
        x[b] = x0.mul_add(s, x1 * c);
    }
}

/// In-place softmax as ggml's CPU path computes it: exponentials eight at a time with ggml's
/// vector expf where the CPU has AVX2 (each group's f32 sum added to an f64 total); a last
/// partial group is padded with -inf, as ggml's padded KV rows are. libm's `exp` without AVX2.
pub fn softmax(x: &mut [f32]) {
    softmax_sink(x, None);
}

/// `softmax` with an attention sink where given: a logit that joins the max and the normalizer
/// (as e^(sink - max), ggml's expf) with no value of its own, so the weights sum to less than 1
/// (ggml's `soft_max_ext` with sinks).
pub fn softmax_sink(x: &mut [f32], sink: Option<f32>) {
    let max = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let max = sink.map_or(max, |s| max.max(s));
    let inv = (1.0 / (exp_total(x, max) + sink_term(sink, max))) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// What a sink adds to a softmax's normalizer at `max`.
fn sink_term(sink: Option<f32>, max: f32) -> f64 {
    sink.map_or(0.0, |s| (s - max).exp() as f64)
}

/// x = cap * tanh(x / cap), as ggml's scale, tanh, scale (soft-capped scores and logits).
pub fn softcap(x: &mut [f32], cap: f32) {
    let inv = 1.0 / cap;
    x.iter_mut().for_each(|v| *v = (*v * inv).tanh() * cap);
}

/// Attention's weights from raw scores in one call: `x * scale`, `softmax`, each weight rounded
/// to f16 (as llama.cpp casts them against an f16 cache), with the scaling fused into the max
/// and the rounding into the normalizing. The exponentials are `softmax`'s; their sum is kept in
/// eight f32 lanes (two vectors, reduced in f64 at the end) rather than `softmax`'s f64 total of
/// each group's sum: a weight may differ from those three steps' by one f16 rounding step where
/// the normalizer's last bits decide it. `numerics="ggml"` attends with `softmax` itself. The
/// per-group reduction was a serial chain that made the exponentials 8% of a 4,000-token prefill.
pub fn attention_weights(x: &mut [f32], scale: f32) {
    attention_weights_sink(x, scale, None);
}

/// `attention_weights` with a head's sink logit where it has one (`softmax_sink`; the sink is
/// not scaled, as ggml adds it after the scaling).
pub fn attention_weights_sink(x: &mut [f32], scale: f32, sink: Option<f32>) {
    #[cfg(target_arch = "x86_64")]
    if crate::quant::avx2::has_avx512() {
        // SAFETY: AVX-512 F (and AVX2/FMA/F16C) detected; the kernels stay inside `x`.
        unsafe {
            let max = simd::scale_max_z(x, scale);
            let max = sink.map_or(max, |s| max.max(s));
            let total = simd::exp_sub_total_z(x, max) + sink_term(sink, max);
            simd::scale_round_f16_z(x, (1.0 / total) as f32);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::quant::avx2::has_avx2() {
        // SAFETY: AVX2/FMA/F16C detected; the kernels stay inside `x`.
        unsafe {
            let max = simd::scale_max(x, scale);
            let max = sink.map_or(max, |s| max.max(s));
            let total = simd::exp_sub_total(x, max) + sink_term(sink, max);
            simd::scale_round_f16(x, (1.0 / total) as f32);
        }
        return;
    }
    x.iter_mut().for_each(|v| *v *= scale);
    softmax_sink(x, sink);
    round_f16_slice(x);
}

/// x[i] = e^(x[i] - max); returns Σ x[i] (summed as `softmax` documents).
fn exp_total(x: &mut [f32], max: f32) -> f64 {
    let mut sum = 0.0f64;
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::quant::avx2::has_avx2() {
        // SAFETY: AVX2/FMA detected; the kernel stays inside `x`.
        (i, sum) = unsafe { simd::exp_sub_sum(x, max) };
        if i < x.len() {
            let mut tail = [f32::NEG_INFINITY; 8];
            tail[..x.len() - i].copy_from_slice(&x[i..]);
            // SAFETY: as above, on an array of exactly eight.
            let (_, s) = unsafe { simd::exp_sub_sum(&mut tail, max) };
            let n = x.len() - i;
            x[i..].copy_from_slice(&tail[..n]);
            (i, sum) = (x.len(), sum + s);
        }
    }
    for v in &mut x[i..] {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    sum
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// ggml's `swiglu_oai` with llama.cpp's constants (alpha 1.702, limit 7): the gate clamped
/// above, the up value both ways and shifted by 1: g = x * sigmoid(alpha * x) * (y + 1) with
/// x = min(g, 7), y = clamp(u, -7, 7). Scalar expf, as ggml's CPU op.
pub fn swiglu_oai(g: &mut [f32], u: &[f32]) {
    const ALPHA: f32 = 1.702;
    const LIMIT: f32 = 7.0;
    for (a, &b) in g.iter_mut().zip(u) {
        let x = a.min(LIMIT);
        let y = b.clamp(-LIMIT, LIMIT);
        *a = x / (1.0 + (ALPHA * -x).exp()) * (y + 1.0);
    }
}

/// g[i] = silu(g[i]) * u[i], with ggml's vector expf where the CPU has AVX2 (as its SwiGLU).
pub fn swiglu(g: &mut [f32], u: &[f32]) {
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::quant::avx2::has_avx2() {
        // SAFETY: AVX2/FMA detected; the kernel stays inside both slices.
        i = unsafe { simd::swiglu(g, u) };
    }
    g[i..].iter_mut().zip(&u[i..]).for_each(|(a, b)| *a = silu(*a) * b);
}

/// GELU (tanh form) as ggml's CPU path computes it: inputs rounded to f16 and looked up in a
/// table of f16 results (65536 entries, built once), so both the values and the speed match.
#[inline]
pub fn gelu_tanh_f16(x: f32) -> f32 {
    if x <= -10.0 {
        return 0.0;
    }
    if x >= 10.0 {
        return x;
    }
    gelu_table()[f16::from_f32(x).to_bits() as usize].to_f32()
}

/// g[i] = gelu_tanh_f16(g[i]) * u[i] (GeGLU), eight at a time with F16C and a table gather
/// where the CPU has AVX2; bit-identical to the scalar form.
pub fn geglu(g: &mut [f32], u: &[f32]) {
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::quant::avx2::has_avx2() {
        // SAFETY: AVX2/F16C detected; the kernel stays inside both slices and the table.
        i = unsafe { simd::geglu(g, u, gelu_table()) };
    }
    g[i..].iter_mut().zip(&u[i..]).for_each(|(a, b)| *a = gelu_tanh_f16(*a) * b);
}

/// 65536 results, one per f16 input, and one spare entry so a 4-byte gather at the last one
/// stays inside the table.
fn gelu_table() -> &'static [f16] {
    static TABLE: std::sync::OnceLock<Vec<f16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        const SQRT_2_OVER_PI: f32 = 0.797_884_6;
        (0..=u16::MAX)
            .map(|bits| {
                let h = f16::from_bits(bits).to_f32();
                // `1.0f + GELU_COEF_A*x*x` is one fused multiply-add in ggml's build.
                let inner = (0.044715 * h).mul_add(h, 1.0);
                f16::from_f32(0.5 * h * (1.0 + (SQRT_2_OVER_PI * h * inner).tanh()))
            })
            .chain([f16::ZERO])
            .collect()
    })
}

#[inline]
pub fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// Round every value to f16 precision in place (F16C eight at a time where the CPU has it; both
/// round to nearest even).
pub fn round_f16_slice(x: &mut [f32]) {
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::quant::avx2::has_avx2() {
        // SAFETY: F16C was detected; the kernel stays inside `x`.
        i = unsafe { simd::round_f16(x) };
    }
    x[i..].iter_mut().for_each(|v| *v = round_f16(*v));
}

/// Ask for the cache lines of `p` ahead of their use (a hint: no effect on results).
#[inline(always)]
pub fn prefetch(p: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..p.len()).step_by(64) {
        // SAFETY: prefetch is a hint that never faults, and the address is inside `p`.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.as_ptr().add(line) as *const i8) };
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod simd {
    use std::arch::x86_64::*;

    /// e^x, eight at a time: ggml's AVX2 `ggml_v_expf` (ARM's optimized-routines method: x =
    /// n ln2 + b, a degree-5 polynomial in b, scaled by 2^n; max error about 1.5 ulp), so
    /// softmax and SiLU round as llama.cpp's do. Outside +-126 ln2 the scale is split in two.
    #[inline(always)]
    pub unsafe fn expf(x: __m256) -> __m256 {
        let f = _mm256_set1_ps;
        let r = f(f32::from_bits(0x4b40_0000)); // 0x1.8p23: adding it rounds to an integer
        let z = _mm256_fmadd_ps(x, f(f32::from_bits(0x3fb8_aa3b)), r); // log2(e)
        let n = _mm256_sub_ps(z, r);
        // b = x - n ln2, with ln2 split in a high and a low part
        let b = _mm256_fnmadd_ps(n, f(f32::from_bits(0x35bf_be8e)), _mm256_fnmadd_ps(n, f(f32::from_bits(0x3f31_7200)), x));
        let e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
        let k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(f(1.0))));
        let abs_n = _mm256_andnot_ps(f(-0.0), n);
        let c = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, f(126.0));
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_fmadd_ps(f(f32::from_bits(0x3c07_2010)), b, f(f32::from_bits(0x3d2b_9f17))),
                u,
                _mm256_fmadd_ps(f(f32::from_bits(0x3e2a_af33)), b, f(f32::from_bits(0x3efffedb))),
            ),
            u,
            _mm256_mul_ps(f(f32::from_bits(0x3f7f_fff6)), b),
        );
        if _mm256_movemask_ps(c) == 0 {
            return _mm256_fmadd_ps(j, k, k);
        }
        let g = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps())), _mm256_set1_epi32(0x8200_0000u32 as i32));
        let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
        let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
        let d = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, f(192.0));
        let scaled = _mm256_blendv_ps(_mm256_fmadd_ps(k, j, k), _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1), c);
        _mm256_blendv_ps(scaled, _mm256_mul_ps(s1, s1), d)
    }

    /// `expf` sixteen at a time, lane for lane the same operations (and so the same bits).
    #[inline(always)]
    pub unsafe fn expf_z(x: __m512) -> __m512 {
        let f = _mm512_set1_ps;
        let r = f(f32::from_bits(0x4b40_0000));
        let z = _mm512_fmadd_ps(x, f(f32::from_bits(0x3fb8_aa3b)), r);
        let n = _mm512_sub_ps(z, r);
        let b = _mm512_fnmadd_ps(n, f(f32::from_bits(0x35bf_be8e)), _mm512_fnmadd_ps(n, f(f32::from_bits(0x3f31_7200)), x));
        let e = _mm512_slli_epi32::<23>(_mm512_castps_si512(z));
        let k = _mm512_castsi512_ps(_mm512_add_epi32(e, _mm512_castps_si512(f(1.0))));
        let abs_n = _mm512_abs_ps(n);
        let c = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(abs_n, f(126.0));
        let u = _mm512_mul_ps(b, b);
        let j = _mm512_fmadd_ps(
            _mm512_fmadd_ps(
                _mm512_fmadd_ps(f(f32::from_bits(0x3c07_2010)), b, f(f32::from_bits(0x3d2b_9f17))),
                u,
                _mm512_fmadd_ps(f(f32::from_bits(0x3e2a_af33)), b, f(f32::from_bits(0x3efffedb))),
            ),
            u,
            _mm512_mul_ps(f(f32::from_bits(0x3f7f_fff6)), b),
        );
        if c == 0 {
            return _mm512_fmadd_ps(j, k, k);
        }
        let le = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, _mm512_setzero_ps());
        let g = _mm512_maskz_mov_epi32(le, _mm512_set1_epi32(0x8200_0000u32 as i32));
        let s1 = _mm512_castsi512_ps(_mm512_add_epi32(g, _mm512_set1_epi32(0x7f00_0000)));
        let s2 = _mm512_castsi512_ps(_mm512_sub_epi32(e, g));
        let d = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(abs_n, f(192.0));
        let scaled = _mm512_mask_blend_ps(c, _mm512_fmadd_ps(k, j, k), _mm512_mul_ps(_mm512_fmadd_ps(s2, j, s2), s1));
        _mm512_mask_blend_ps(d, scaled, _mm512_mul_ps(s1, s1))
    }

    /// `exp_sub_total` sixteen at a time: a vector's low half is what `exp_sub_total` adds into its
    /// first accumulator and its high half into its second, so the lanes sum alike.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn exp_sub_total_z(x: &mut [f32], max: f32) -> f64 {
        let (n, m) = (x.len() / 16 * 16, _mm512_set1_ps(max));
        let mut acc = _mm512_setzero_ps();
        for i in (0..n).step_by(16) {
            let p = x.as_mut_ptr().add(i);
            let v = expf_z(_mm512_sub_ps(_mm512_loadu_ps(p), m));
            _mm512_storeu_ps(p, v);
            acc = _mm512_add_ps(acc, v);
        }
        // The rest (under sixteen) goes to the first accumulator, as `exp_sub_total`'s last
        // group of eight and its partial group do: padded with -inf, whose exponential is 0 (and
        // adding 0 to a sum of exponentials leaves it as it is).
        if n < x.len() {
            let (mut tail, rest) = ([f32::NEG_INFINITY; 16], x.len() - n);
            tail[..rest].copy_from_slice(&x[n..]);
            let v = expf_z(_mm512_sub_ps(_mm512_loadu_ps(tail.as_ptr()), m));
            _mm512_storeu_ps(tail.as_mut_ptr(), v);
            x[n..].copy_from_slice(&tail[..rest]);
            // Its eight and then the rest into the first accumulator, in that order.
            acc = _mm512_mask_add_ps(acc, 0x00ff, acc, v);
            acc = _mm512_mask_add_ps(acc, 0x00ff, acc, _mm512_shuffle_f32x4::<0b01_00_11_10>(v, v));
        }
        let mut lanes = [0.0f32; 16];
        _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
        lanes.iter().map(|&v| v as f64).sum::<f64>()
    }

    /// `scale_max` sixteen at a time.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn scale_max_z(x: &mut [f32], scale: f32) -> f32 {
        let n = x.len() / 16 * 16;
        let (sv, mut m) = (_mm512_set1_ps(scale), _mm512_set1_ps(f32::NEG_INFINITY));
        for i in (0..n).step_by(16) {
            let p = x.as_mut_ptr().add(i);
            let v = _mm512_mul_ps(_mm512_loadu_ps(p), sv);
            _mm512_storeu_ps(p, v);
            m = _mm512_max_ps(m, v);
        }
        let mut max = _mm512_reduce_max_ps(m);
        for v in &mut x[n..] {
            *v *= scale;
            max = max.max(*v);
        }
        max
    }

    /// `scale_round_f16` sixteen at a time.
    #[target_feature(enable = "avx512f,avx2,f16c")]
    pub unsafe fn scale_round_f16_z(x: &mut [f32], inv: f32) {
        let n = x.len() / 16 * 16;
        let iv = _mm512_set1_ps(inv);
        for i in (0..n).step_by(16) {
            let p = x.as_mut_ptr().add(i);
            _mm512_storeu_ps(p, _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm512_mul_ps(_mm512_loadu_ps(p), iv))));
        }
        scale_round_f16(&mut x[n..], inv);
    }

    /// x[i] = e^(x[i] - max) for whole groups of eight; returns (values done, their f64 sum).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_sub_sum(x: &mut [f32], max: f32) -> (usize, f64) {
        let n = x.len() / 8 * 8;
        let mut sum = 0.0f64;
        for i in (0..n).step_by(8) {
            let p = x.as_mut_ptr().add(i);
            let v = expf(_mm256_sub_ps(_mm256_loadu_ps(p), _mm256_set1_ps(max)));
            _mm256_storeu_ps(p, v);
            sum += crate::quant::avx2::hsum(v) as f64;
        }
        (n, sum)
    }

    /// x[i] = e^(x[i] - max) for all of `x`; returns Σ x[i], summed in f32 lanes (see
    /// `attention_weights`). A last partial group is padded with -inf, whose exponential is 0.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_sub_total(x: &mut [f32], max: f32) -> f64 {
        let (n, m) = (x.len() / 8 * 8, _mm256_set1_ps(max));
        let mut acc = [_mm256_setzero_ps(); 2];
        for (k, i) in (0..n).step_by(8).enumerate() {
            let p = x.as_mut_ptr().add(i);
            let v = expf(_mm256_sub_ps(_mm256_loadu_ps(p), m));
            _mm256_storeu_ps(p, v);
            acc[k % 2] = _mm256_add_ps(acc[k % 2], v);
        }
        if n < x.len() {
            let (mut tail, rest) = ([f32::NEG_INFINITY; 8], x.len() - n);
            tail[..rest].copy_from_slice(&x[n..]);
            let v = expf(_mm256_sub_ps(_mm256_loadu_ps(tail.as_ptr()), m));
            _mm256_storeu_ps(tail.as_mut_ptr(), v);
            x[n..].copy_from_slice(&tail[..rest]);
            acc[0] = _mm256_add_ps(acc[0], v);
        }
        let mut lanes = [0.0f32; 16];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc[0]);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[1]);
        lanes.iter().map(|&v| v as f64).sum::<f64>()
    }

    /// g = g / (1 + e^-g) * u for whole groups of eight; returns how many.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn swiglu(g: &mut [f32], u: &[f32]) -> usize {
        let n = g.len().min(u.len()) / 8 * 8;
        for i in (0..n).step_by(8) {
            let p = g.as_mut_ptr().add(i);
            let x = _mm256_loadu_ps(p);
            let e = expf(_mm256_sub_ps(_mm256_setzero_ps(), x));
            let silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e));
            _mm256_storeu_ps(p, _mm256_mul_ps(silu, _mm256_loadu_ps(u.as_ptr().add(i))));
        }
        n
    }

    /// Σ x² over whole groups of eight (squares in f32, sums in four f64 lanes); returns (count, sum).
    #[target_feature(enable = "avx2")]
    pub unsafe fn sum_squares(x: &[f32]) -> (usize, f64) {
        let n = x.len() / 8 * 8;
        let (mut a, mut b) = (_mm256_setzero_pd(), _mm256_setzero_pd());
        for i in (0..n).step_by(8) {
            let v = _mm256_loadu_ps(x.as_ptr().add(i));
            let sq = _mm256_mul_ps(v, v);
            a = _mm256_add_pd(a, _mm256_cvtps_pd(_mm256_castps256_ps128(sq)));
            b = _mm256_add_pd(b, _mm256_cvtps_pd(_mm256_extractf128_ps(sq, 1)));
        }
        let mut lanes = [0.0f64; 4];
        _mm256_storeu_pd(lanes.as_mut_ptr(), _mm256_add_pd(a, b));
        (n, (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
    }

    /// GeGLU on whole groups of eight; returns how many. Inputs are rounded to f16 (nearest even,
    /// as `half`), their table entries gathered four bytes at a time (the low two are the entry).
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn geglu(g: &mut [f32], u: &[f32], table: &[super::f16]) -> usize {
        assert!(table.len() > u16::MAX as usize + 1);
        let n = g.len().min(u.len()) / 8 * 8;
        let base = table.as_ptr() as *const i32;
        let (lo, hi, zero) = (_mm256_set1_ps(-10.0), _mm256_set1_ps(10.0), _mm256_setzero_ps());
        for i in (0..n).step_by(8) {
            let p = g.as_mut_ptr().add(i);
            let x = _mm256_loadu_ps(p);
            let idx = _mm256_cvtepu16_epi32(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
            let raw = _mm256_and_si256(_mm256_i32gather_epi32::<2>(base, idx), _mm256_set1_epi32(0xFFFF));
            let halves = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(raw, raw));
            let mut y = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
            y = _mm256_blendv_ps(y, zero, _mm256_cmp_ps::<_CMP_LE_OQ>(x, lo));
            y = _mm256_blendv_ps(y, x, _mm256_cmp_ps::<_CMP_GE_OQ>(x, hi));
            _mm256_storeu_ps(p, _mm256_mul_ps(y, _mm256_loadu_ps(u.as_ptr().add(i))));
        }
        n
    }

    /// x[i] *= scale; returns the largest (scores hold no NaN).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scale_max(x: &mut [f32], scale: f32) -> f32 {
        let n = x.len() / 8 * 8;
        let (sv, mut m) = (_mm256_set1_ps(scale), _mm256_set1_ps(f32::NEG_INFINITY));
        for i in (0..n).step_by(8) {
            let p = x.as_mut_ptr().add(i);
            let v = _mm256_mul_ps(_mm256_loadu_ps(p), sv);
            _mm256_storeu_ps(p, v);
            m = _mm256_max_ps(m, v);
        }
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        let mut max = lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        for v in &mut x[n..] {
            *v *= scale;
            max = max.max(*v);
        }
        max
    }

    /// x[i] = f16(x[i] * inv) for all of `x`.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn scale_round_f16(x: &mut [f32], inv: f32) {
        let n = x.len() / 8 * 8;
        let iv = _mm256_set1_ps(inv);
        for i in (0..n).step_by(8) {
            let p = x.as_mut_ptr().add(i);
            _mm256_storeu_ps(p, _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_mul_ps(_mm256_loadu_ps(p), iv))));
        }
        for v in &mut x[n..] {
            *v = super::round_f16(*v * inv);
        }
    }

    /// Rounds the whole groups of eight; returns how many values it did.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn round_f16(x: &mut [f32]) -> usize {
        let n = x.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            let p = x.as_mut_ptr().add(i);
            _mm256_storeu_ps(p, _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(p))));
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Rope;

    /// The AVX-512 softmax steps give the AVX2 ones' bits (lane for lane the same operations, the
    /// sum's lanes in the same accumulators) at every length's tail and on exponents that take
    /// expf's slow paths (below -126 ln 2 and -192 ln 2).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn softmax_steps_on_512_bits_are_the_256_bit_ones() {
        if !crate::quant::avx2::has_avx512() {
            eprintln!("this CPU has no AVX-512: the AVX2 steps run, tested by the other softmax tests");
            return;
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for len in 1..80 {
            for spread in [3.0f32, 60.0, 2000.0] {
                let x: Vec<f32> = (0..len).map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * spread).collect();
                let (mut a, mut b) = (x.clone(), x);
                // SAFETY: AVX-512 F (and AVX2/FMA/F16C) detected; the kernels stay inside their slices.
                unsafe {
                    let (ma, mb) = (simd::scale_max(&mut a, 0.125), simd::scale_max_z(&mut b, 0.125));
                    assert_eq!((ma.to_bits(), bits(&a)), (mb.to_bits(), bits(&b)), "scale_max, {len} values of spread {spread}");
                    let (ta, tb) = (simd::exp_sub_total(&mut a, ma), simd::exp_sub_total_z(&mut b, mb));
                    assert_eq!((ta.to_bits(), bits(&a)), (tb.to_bits(), bits(&b)), "exp_sub_total, {len} values of spread {spread}");
                    simd::scale_round_f16(&mut a, (1.0 / ta) as f32);
                    simd::scale_round_f16_z(&mut b, (1.0 / tb) as f32);
                    assert_eq!(bits(&a), bits(&b), "scale_round_f16, {len} values of spread {spread}");
                }
            }
        }
    }

    #[test]
    fn rope_cache_scaling_is_the_identity_when_off_and_divides_angles_when_on() {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let r = Rope { dim: 64, base: 10000.0, neox: true, freq_scale: 1.0, mscale: 1.0, yarn: None, mrope: None, factors: true };
        rope_cache(&r, 37, None, &mut a);
        let theta_scale = 10000f32.powf(-2.0 / 64.0);
        let mut theta = 37.0f32;
        for &(s, c) in &a {
            assert_eq!((s, c), theta.sin_cos());
            theta *= theta_scale;
        }
        let f: Vec<f32> = (0..32).map(|i| 1.0 + i as f32 * 0.1).collect();
        rope_cache(&Rope { freq_scale: 0.5, mscale: 2.0, ..r }, 37, Some(&f), &mut b);
        let mut theta = 37.0f32;
        for (i, &(s, c)) in b.iter().enumerate() {
            let (s0, c0) = (0.5 * (theta / f[i])).sin_cos();
            assert_eq!((s, c), (s0 * 2.0, c0 * 2.0));
            theta *= theta_scale;
        }
    }

    #[test]
    fn a_sink_takes_its_share_of_the_softmax_and_none_changes_nothing() {
        let raw: Vec<f32> = (0..37).map(|i| ((i * 7919 % 211) as f32 - 105.0) * 0.037).collect();
        let (mut plain, mut none) = (raw.clone(), raw.clone());
        attention_weights(&mut plain, 0.5);
        attention_weights_sink(&mut none, 0.5, None);
        assert_eq!(plain, none);
        // The sink as one more (unscaled) score whose weight is dropped: the rest are the softmax
        // of all 38 (within one f16 step), and sum to 1 minus the sink's share.
        let sink = 1.5f32;
        let mut with = raw.clone();
        attention_weights_sink(&mut with, 0.5, Some(sink));
        let all: Vec<f64> = raw.iter().map(|&v| v as f64 * 0.5).chain([sink as f64]).collect();
        let m = all.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = all.iter().map(|v| (v - m).exp()).sum();
        for (i, &w) in with.iter().enumerate() {
            let want = (all[i] - m).exp() / z;
            assert!((w as f64 - want).abs() <= want * 1e-3 + 1e-7, "weight {i}: {w} against {want}");
        }
        let share = (sink as f64 - m).exp() / z;
        let total: f64 = with.iter().map(|&w| w as f64).sum();
        assert!(share > 0.05 && (total - (1.0 - share)).abs() < 1e-2, "{total} {share}");
        // A sink far below the scores is no sink; the scalar softmax agrees.
        let mut low = raw.clone();
        attention_weights_sink(&mut low, 0.5, Some(-1e30));
        assert_eq!(low, plain);
        let (mut a, mut b) = (raw.clone(), raw.clone());
        softmax_sink(&mut a, Some(2.0));
        b.push(2.0);
        softmax(&mut b);
        a.iter().zip(&b).for_each(|(x, y)| assert!((x - y).abs() < 1e-6, "{x} {y}"));
    }

    #[test]
    fn swiglu_oai_clamps_the_gate_above_and_the_up_value_both_ways() {
        let g = [-8.0f32, -1.0, 0.5, 6.0, 9.0];
        let u = [0.5f32, -9.0, 2.0, 8.0, -0.25];
        let mut got = g;
        swiglu_oai(&mut got, &u);
        for i in 0..5 {
            let x = (g[i] as f64).min(7.0);
            let y = (u[i] as f64).clamp(-7.0, 7.0);
            let want = x / (1.0 + (-1.702 * x).exp()) * (y + 1.0);
            assert!((got[i] as f64 - want).abs() < 1e-5 * want.abs().max(1.0), "{i}: {} against {want}", got[i]);
        }
        // The gate at 9 acts as 7; the up value -9 as -7 (so the product's sign flips).
        assert_eq!(got[4], {
            let mut a = [7.0f32];
            swiglu_oai(&mut a, &[-0.25]);
            a[0]
        });
        assert!(got[1] > 0.0);
    }

    #[test]
    fn attention_weights_are_the_three_steps_within_one_f16_step() {
        for n in [1usize, 7, 8, 9, 37, 130, 4001] {
            let raw: Vec<f32> = (0..n).map(|i| ((i * 7919 % 211) as f32 - 105.0) * 0.37).collect();
            let (mut a, mut b) = (raw.clone(), raw.clone());
            attention_weights(&mut a, 0.125);
            b.iter_mut().for_each(|v| *v *= 0.125);
            softmax(&mut b);
            round_f16_slice(&mut b);
            let (mut differ, mut total) = (0, 0.0f64);
            for (i, (&x, &y)) in a.iter().zip(&b).enumerate() {
                let (hx, hy) = (f16::from_f32(x), f16::from_f32(y));
                assert_eq!(hx.to_f32(), x, "n = {n}, weight {i} is not an f16");
                assert!((hx.to_bits() as i32 - hy.to_bits() as i32).abs() <= 1, "n = {n}, weight {i}: {x} against {y}");
                differ += (x != y) as usize;
                total += x as f64;
            }
            assert!(differ * 50 <= n.max(50), "n = {n}: {differ} weights differ");
            assert!((total - 1.0).abs() < 1e-2, "n = {n}: the weights sum to {total}");
        }
    }

    #[test]
    fn vector_exp_is_within_two_ulp_of_exact_and_handles_the_ends() {
        if !crate::quant::avx2::has_avx2() {
            eprintln!("skipped: this CPU has no AVX2, so the vector expf is never used");
            return;
        }
        let xs: Vec<f32> = (0..80_000).map(|i| -104.0 + i as f32 * 0.0024).chain([0.0, -0.0, 88.5, -110.0, 1e-30]).collect();
        let mut y = xs.clone();
        // softmax's kernel with max 0 is plain exp on whole groups of eight.
        // SAFETY: AVX2/FMA checked above.
        let (done, _) = unsafe { simd::exp_sub_sum(&mut y, 0.0) };
        for (x, got) in xs[..done].iter().zip(&y) {
            let want = (*x as f64).exp();
            if want > f32::MAX as f64 {
                assert!(got.is_infinite(), "exp({x}) = {got}, want inf");
            } else if want < 1e-38 {
                assert!(*got < 1e-37, "exp({x}) = {got}, want ~0");
            } else {
                let ulp = (want as f32).abs() * f32::EPSILON;
                assert!(((*got as f64) - want).abs() <= 2.0 * ulp as f64, "exp({x}) = {got}, want {want}");
            }
        }
    }

    #[test]
    fn geglu_is_bit_identical_to_the_scalar_form() {
        let x: Vec<f32> = (0..20_000).map(|i| (i as f32 - 10_000.0) * 0.0013).chain([-10.0, 10.0, -9.999, 65504.0, -1e-8, 0.0]).collect();
        let u: Vec<f32> = (0..x.len()).map(|i| 1.0 + (i % 5) as f32 * 0.25).collect();
        let mut g = x.clone();
        geglu(&mut g, &u);
        for ((a, v), b) in g.iter().zip(&x).zip(&u) {
            assert_eq!(a.to_bits(), (gelu_tanh_f16(*v) * b).to_bits(), "geglu({v})");
        }
    }

    #[test]
    fn rms_norm_matches_a_sequential_f64_sum() {
        for n in [64usize, 576, 577, 2048] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 0.0137).collect();
            let seq: f64 = x.iter().map(|&v| (v * v) as f64).sum();
            let got = sum_squares(&x);
            assert!((got - seq).abs() <= 1e-12 * seq, "n={n}: {got} vs {seq}");
        }
    }

    #[test]
    fn swiglu_and_softmax_agree_with_their_scalar_forms() {
        let g0: Vec<f32> = (0..203).map(|i| (i as f32 - 100.0) * 0.173).collect();
        let u: Vec<f32> = (0..203).map(|i| (i % 7) as f32 - 3.0).collect();
        let mut g = g0.clone();
        swiglu(&mut g, &u);
        for ((a, x), b) in g.iter().zip(&g0).zip(&u) {
            let want = silu(*x) * b;
            assert!((a - want).abs() <= 1e-6 * want.abs().max(1.0), "swiglu({x}, {b}) = {a}, want {want}");
        }
        let mut p = g0.clone();
        softmax(&mut p);
        let max = g0.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
        let total: f64 = g0.iter().map(|&v| (v as f64 - max).exp()).sum();
        for (a, x) in p.iter().zip(&g0) {
            let want = ((*x as f64 - max).exp() / total) as f32;
            assert!((a - want).abs() <= 1e-6 * want.max(1e-30) + 1e-12, "softmax at {x}: {a}, want {want}");
        }
    }
}
