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

/// In-place softmax with an f64 sum (exponentials first, so the sum is not one long chain
/// through every `exp` call).
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    x.iter_mut().for_each(|v| *v = (*v - max).exp());
    let sum: f64 = x.iter().map(|&v| v as f64).sum();
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
mod simd {
    use std::arch::x86_64::*;

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
