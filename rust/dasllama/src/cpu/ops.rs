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

/// GELU (tanh form) as ggml's CPU path computes it: through an f16 lookup of f16 inputs.
#[inline]
pub fn gelu_tanh_f16(x: f32) -> f32 {
    if x <= -10.0 {
        return 0.0;
    }
    if x >= 10.0 {
        return x;
    }
    let h = f16::from_f32(x).to_f32();
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let g = 0.5 * h * (1.0 + (SQRT_2_OVER_PI * h * (1.0 + 0.044715 * h * h)).tanh());
    f16::from_f32(g).to_f32()
}

#[inline]
pub fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// Dot product with eight independent partial sums, so the compiler can vectorize it.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}
