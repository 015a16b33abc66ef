//! Elementwise and per-row ops of the forward pass.

use half::f16;

/// RMS norm with llama.cpp's f64 sum of squares; `w` multiplies afterwards, as ggml_mul does.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let scale = 1.0 / ((sum / x.len() as f64) as f32 + eps).sqrt();
    for (v, g) in x.iter_mut().zip(w) {
        *v = *v * scale * g;
    }
}

/// Rotary embedding of one head at `pos`. `neox` pairs (i, i+d/2); otherwise (2i, 2i+1).
/// theta advances by repeated f32 multiplication as in ggml's rope cache.
pub fn rope(x: &mut [f32], n_dims: usize, pos: usize, base: f32, neox: bool) {
    let theta_scale = base.powf(-2.0 / n_dims as f32);
    let mut theta = pos as f32;
    for i in 0..n_dims / 2 {
        let (s, c) = theta.sin_cos();
        let (a, b) = if neox { (i, i + n_dims / 2) } else { (2 * i, 2 * i + 1) };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * c - x1 * s;
        x[b] = x0 * s + x1 * c;
        theta *= theta_scale;
    }
}

/// In-place softmax with an f64 sum.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut sum = 0.0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
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

fn gelu_table() -> &'static [f16] {
    static TABLE: std::sync::OnceLock<Vec<f16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        const SQRT_2_OVER_PI: f32 = 0.797_884_6;
        (0..=u16::MAX)
            .map(|bits| {
                let h = f16::from_bits(bits).to_f32();
                f16::from_f32(0.5 * h * (1.0 + (SQRT_2_OVER_PI * h * (1.0 + 0.044715 * h * h)).tanh()))
            })
            .collect()
    })
}

#[inline]
pub fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// f32 dot product: AVX2+FMA with four 8-wide accumulators where the CPU has it, else eight
/// partial sums (which the compiler vectorizes for the baseline target).
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    #[cfg(target_arch = "x86_64")]
    if crate::quant::avx2::has_avx2() {
        // SAFETY: AVX2 and FMA were detected; both slices hold at least n floats.
        return unsafe { simd::dot(a.as_ptr(), b.as_ptr(), n) };
    }
    let mut acc = [0.0f32; 8];
    for (i, (x, y)) in a[..n].iter().zip(&b[..n]).enumerate() {
        acc[i % 8] += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// y += a * x.
#[inline]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    let n = y.len().min(x.len());
    #[cfg(target_arch = "x86_64")]
    if crate::quant::avx2::has_avx2() {
        // SAFETY: AVX2 and FMA were detected; both slices hold at least n floats.
        return unsafe { simd::axpy(y.as_mut_ptr(), a, x.as_ptr(), n) };
    }
    y.iter_mut().zip(x).for_each(|(v, b)| *v += a * b);
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use crate::quant::avx2::hsum;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: *const f32, b: *const f32, n: usize) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (k, ac) in acc.iter_mut().enumerate() {
                *ac = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i + 8 * k)), _mm256_loadu_ps(b.add(i + 8 * k)), *ac);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), acc[0]);
            i += 8;
        }
        let mut s = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
        while i < n {
            s += *a.add(i) * *b.add(i);
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(y: *mut f32, a: f32, x: *const f32, n: usize) {
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(y.add(i), _mm256_fmadd_ps(av, _mm256_loadu_ps(x.add(i)), _mm256_loadu_ps(y.add(i))));
            i += 8;
        }
        while i < n {
            *y.add(i) += a * *x.add(i);
            i += 1;
        }
    }
}
