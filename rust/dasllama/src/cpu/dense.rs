//! Dense f32 kernels for the vision towers, where every product is large (thousands of patch
//! rows a matrix) and no text-model invariant ties the order of the sums: a register-blocked
//! GEMM (twelve activation rows by thirty-two output columns in zmm accumulators, the weights
//! widened to f32 panels once per call), non-causal attention as tiles of that GEMM (scores,
//! softmax, weighted sum per head and block of queries), and the softmax's and activations'
//! exp as an AVX-512 polynomial. Each output of the GEMM tile is one sequential chain of fused
//! multiply-adds over k, whatever the blocking, so `tile_twin` (the scalar twin) gives the same
//! bits; `exp_twin` likewise for the exp.
//!
//! Where AVX-512 is not there (or a runtime runs the scalar twins), `fast()` is false and the
//! tower keeps the host's matmul kernels.

use crate::backend::HostOps;
use crate::quant::{GgmlType, Weight};
use std::cell::RefCell;

/// Activation rows of one GEMM tile.
pub const TR: usize = 12;
/// Output columns of one GEMM tile (two zmm).
pub const TC: usize = 32;
/// Activation rows per GEMM task: the rows' block of k stays in L2 while every panel passes.
const TASK_ROWS: usize = 4 * TR;
/// k per pass over the panels: a panel's block (KC x TC f32) stays in L1.
const KC: usize = 256;
/// Query rows per attention task (their scores stay in L2).
const QB: usize = 4 * TR;

/// Whether these kernels run here (AVX-512 on this thread's kernel choice).
pub fn fast() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::quant::avx2::has_avx512()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// c[r][j] += sum over kk < kc of a[kk * TR + r] * w[kk * TC + j], each sum in order of kk: the
/// activations packed as kc steps of TR rows' values, so the kernel's broadcasts all read one
/// stream at fixed offsets.
pub type TileFn = fn(&[f32], &[f32], usize, &mut [[f32; TC]; TR]);

/// The scalar twin of the tile kernel.
pub fn tile_twin(a: &[f32], w: &[f32], kc: usize, c: &mut [[f32; TC]; TR]) {
    for (r, row) in c.iter_mut().enumerate() {
        for (j, acc) in row.iter_mut().enumerate() {
            for kk in 0..kc {
                *acc = a[kk * TR + r].mul_add(w[kk * TC + j], *acc);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub fn tile_avx512(a: &[f32], w: &[f32], kc: usize, c: &mut [[f32; TC]; TR]) {
    assert!(a.len() >= kc * TR && w.len() >= kc * TC, "GEMM tile out of bounds");
    #[target_feature(enable = "avx512f")]
    unsafe fn k(a: *const f32, w: *const f32, kc: usize, c: &mut [[f32; TC]; TR]) {
        use std::arch::x86_64::*;
        let mut acc = [[_mm512_setzero_ps(); 2]; TR];
        for r in 0..TR {
            acc[r] = [_mm512_loadu_ps(c[r].as_ptr()), _mm512_loadu_ps(c[r].as_ptr().add(16))];
        }
        for kk in 0..kc {
            let w0 = _mm512_loadu_ps(w.add(kk * TC));
            let w1 = _mm512_loadu_ps(w.add(kk * TC + 16));
            for (r, acc) in acc.iter_mut().enumerate() {
                let b = _mm512_set1_ps(*a.add(kk * TR + r));
                acc[0] = _mm512_fmadd_ps(b, w0, acc[0]);
                acc[1] = _mm512_fmadd_ps(b, w1, acc[1]);
            }
        }
        for r in 0..TR {
            _mm512_storeu_ps(c[r].as_mut_ptr(), acc[r][0]);
            _mm512_storeu_ps(c[r].as_mut_ptr().add(16), acc[r][1]);
        }
    }
    // SAFETY: the assert bounds every read (kc steps of TR activations and of TC weights);
    // rows of TC); the caller checked AVX-512 (`fast`).
    unsafe { k(a.as_ptr(), w.as_ptr(), kc, c) }
}

fn tile_fn() -> TileFn {
    #[cfg(target_arch = "x86_64")]
    if fast() {
        return tile_avx512;
    }
    tile_twin
}

/// exp(x) for x in [-87, 88] (clamped to it): 2^k times a degree-6 polynomial of the remainder
/// (Cephes' expf), within 2 ulp of the true value.
pub fn exp_twin(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    let k = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = k.mul_add(-0.693_359_4, x);
    let r = k.mul_add(2.121_944_4e-4, r);
    let mut p = 1.987_569_1e-4f32;
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        p = p.mul_add(r, c);
    }
    let y = (p * r).mul_add(r, r) + 1.0;
    y * f32::from_bits(((k as i32 + 127) as u32) << 23)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0)), _mm512_set1_ps(88.0));
    let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)));
    let r = _mm512_fmadd_ps(k, _mm512_set1_ps(-0.693_359_4), x);
    let r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0));
    let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)));
    _mm512_mul_ps(y, _mm512_castsi512_ps(e))
}

/// The activations `x / (1 + exp(z(x)))`: GELU's tanh form (0.5 x (1 + tanh(y)) is x over
/// 1 + exp(-2y)), GELU-quick and SiLU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    GeluTanh,
    GeluQuick,
    Silu,
}

impl Act {
    fn z(self, x: f32) -> f32 {
        match self {
            Act::GeluTanh => -2.0 * 0.797_884_6 * x.mul_add(0.044_715 * (x * x), x),
            Act::GeluQuick => -1.702 * x,
            Act::Silu => -x,
        }
    }
}

/// The scalar twin of `activate`.
pub fn activate_twin(x: &mut [f32], act: Act) {
    x.iter_mut().for_each(|v| *v /= 1.0 + exp_twin(act.z(*v)));
}

/// x = act(x), each value.
pub fn activate(x: &mut [f32], act: Act) {
    #[cfg(target_arch = "x86_64")]
    if fast() {
        #[target_feature(enable = "avx512f")]
        unsafe fn k(x: &mut [f32], act: Act) {
            use std::arch::x86_64::*;
            let mut chunks = x.chunks_exact_mut(16);
            for c in &mut chunks {
                let v = _mm512_loadu_ps(c.as_ptr());
                let z = match act {
                    Act::GeluTanh => {
                        let inner = _mm512_fmadd_ps(v, _mm512_mul_ps(_mm512_set1_ps(0.044_715), _mm512_mul_ps(v, v)), v);
                        _mm512_mul_ps(_mm512_set1_ps(-2.0 * 0.797_884_6), inner)
                    }
                    Act::GeluQuick => _mm512_mul_ps(_mm512_set1_ps(-1.702), v),
                    Act::Silu => _mm512_sub_ps(_mm512_setzero_ps(), v),
                };
                let d = _mm512_add_ps(_mm512_set1_ps(1.0), exp16(z));
                _mm512_storeu_ps(c.as_mut_ptr(), _mm512_div_ps(v, d));
            }
            activate_twin(chunks.into_remainder(), act);
        }
        // SAFETY: `fast` checked AVX-512; the loads and stores are the chunks' own 16 values.
        return unsafe { k(x, act) };
    }
    activate_twin(x, act)
}

/// The scalar twin of `softmax_row`.
pub fn softmax_twin(s: &mut [f32], scale: f32) -> f32 {
    let m = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
    let mut lanes = [0.0f32; 16];
    for (i, v) in s.iter_mut().enumerate() {
        *v = exp_twin(v.mul_add(scale, -m));
        lanes[i % 16] += *v;
    }
    lanes.iter().sum()
}

/// s = exp(s * scale - max(s * scale)), in place; returns the sum of the new values (sixteen
/// lane totals, then those in order: `softmax_twin`'s sum too).
pub fn softmax_row(s: &mut [f32], scale: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if fast() {
        #[target_feature(enable = "avx512f")]
        unsafe fn k(s: &mut [f32], scale: f32) -> f32 {
            use std::arch::x86_64::*;
            let n = s.len();
            let mask = |i: usize| -> __mmask16 {
                if i + 16 <= n {
                    0xffff
                } else {
                    (1u16 << (n - i)) - 1
                }
            };
            let sc = _mm512_set1_ps(scale);
            let mut mv = _mm512_set1_ps(f32::NEG_INFINITY);
            for i in (0..n).step_by(16) {
                let x = _mm512_mask_loadu_ps(mv, mask(i), s.as_ptr().add(i));
                mv = _mm512_max_ps(mv, _mm512_mul_ps(x, sc));
            }
            let mut lanes = [0.0f32; 16];
            _mm512_storeu_ps(lanes.as_mut_ptr(), mv);
            let nm = _mm512_set1_ps(-lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)));
            let mut total = _mm512_setzero_ps();
            for i in (0..n).step_by(16) {
                let m = mask(i);
                let e = exp16(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, s.as_ptr().add(i)), sc, nm));
                _mm512_mask_storeu_ps(s.as_mut_ptr().add(i), m, e);
                total = _mm512_mask_add_ps(total, m, total, e);
            }
            _mm512_storeu_ps(lanes.as_mut_ptr(), total);
            lanes.iter().sum()
        }
        // SAFETY: `fast` checked AVX-512; the masks keep every load and store inside the slice.
        return unsafe { k(s, scale) };
    }
    softmax_twin(s, scale)
}

/// A raw pointer shared by tasks that write disjoint parts of one buffer.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: every user hands each task a disjoint set of elements and joins before the buffer is
// read again (`HostOps::parallel_for`).
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

thread_local! {
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// The weight's rows as f32 panels: panel p holds rows p*TC.. (zero past the last row) as
/// `cols` steps of TC values, one from each row.
fn panels(ops: &mut dyn HostOps, w: &Weight) -> Vec<f32> {
    let (m, k) = (w.rows, w.cols);
    let np = m.div_ceil(TC);
    let mut out = vec![0.0f32; np * k * TC];
    let dst = Out(out.as_mut_ptr());
    ops.parallel_for(np, &|p| {
        #[allow(clippy::redundant_locals)]
        let dst = dst;
        let mut row = vec![0.0f32; k];
        for r in p * TC..(p * TC + TC).min(m) {
            w.dequantize_row(r, &mut row);
            for (kk, &v) in row.iter().enumerate() {
                // SAFETY: panel p's values (p*k*TC..(p+1)*k*TC) are this task's alone.
                unsafe { *dst.0.add((p * k + kk) * TC + r % TC) = v };
            }
        }
    });
    out
}

/// Whether `gemm` takes this weight (the float formats; the rest keep the host's kernels, whose
/// activation quantization is ggml's).
pub fn gemm_takes(w: &Weight) -> bool {
    matches!(w.ty, GgmlType::F16 | GgmlType::BF16 | GgmlType::F32) && w.ggml_dot.is_none() && !w.tiled
}

/// out[t * w.rows + r] = w row r . x row t for n rows of x (w.cols each), the activations first
/// rounded through the weight's activation format as ggml rounds them (f16 for an f16 weight).
pub fn gemm(ops: &mut dyn HostOps, w: &Weight, x: &[f32], n: usize, out: &mut [f32]) {
    let (m, k) = (w.rows, w.cols);
    assert!(gemm_takes(w) && x.len() == n * k && out.len() >= n * m, "dense GEMM: wrong shapes or format");
    let wp = panels(ops, w);
    let round: fn(f32) -> f32 = match w.ty {
        GgmlType::F16 => |v| half::f16::from_f32(v).to_f32(),
        GgmlType::BF16 => |v| half::bf16::from_f32(v).to_f32(),
        _ => |v| v,
    };
    let tile = tile_fn();
    let dst = Out(out.as_mut_ptr());
    let (wp, np) = (&wp[..], m.div_ceil(TC));
    ops.parallel_for(n.div_ceil(TASK_ROWS), &|ti| {
        #[allow(clippy::redundant_locals)]
        let dst = dst;
        let (t0, t1) = (ti * TASK_ROWS, (ti * TASK_ROWS + TASK_ROWS).min(n));
        let rows = (t1 - t0).next_multiple_of(TR);
        SCRATCH.with_borrow_mut(|(a, _, _)| {
            // The block's rows rounded and packed a group of TR rows at a time (zero rows past
            // n, so tiles are whole).
            a.clear();
            a.resize(rows * k, 0.0);
            for (i, xr) in x[t0 * k..t1 * k].chunks_exact(k).enumerate() {
                let (g, r) = (i / TR, i % TR);
                xr.iter().enumerate().for_each(|(kk, &v)| a[(g * k + kk) * TR + r] = round(v));
            }
            for p in 0..np {
                let cols = (m - p * TC).min(TC);
                for g in (0..rows).step_by(TR) {
                    let mut c = [[0.0f32; TC]; TR];
                    for k0 in (0..k).step_by(KC) {
                        let kc = (k - k0).min(KC);
                        tile(&a[(g / TR * k + k0) * TR..], &wp[(p * k + k0) * TC..], kc, &mut c);
                    }
                    for (r, cr) in c.iter().enumerate().take((t1 - t0).saturating_sub(g)) {
                        let t = t0 + g + r;
                        // SAFETY: rows t0..t1 of the output are this task's alone; t < n and
                        // p*TC + cols <= m, so every write is inside out[..n * m].
                        unsafe { std::ptr::copy_nonoverlapping(cr.as_ptr(), dst.0.add(t * m + p * TC), cols) };
                    }
                }
            }
        });
    });
}

/// Every row attends every row (an image's patches see each other), per head: q, k, v and out
/// are n rows of heads x hd. Tasks are a head and a block of queries: the block's scores against
/// all keys (tiles of the GEMM over the head's keys packed as panels), the softmax of each row,
/// then the rows' sum of values (tiles over the head's values packed as panels), divided by the
/// softmax's total.
#[allow(clippy::too_many_arguments)]
pub fn attention(ops: &mut dyn HostOps, q: &[f32], k: &[f32], v: &[f32], n: usize, heads: usize, hd: usize, out: &mut [f32]) {
    let d = heads * hd;
    let (kp, vp) = (n.div_ceil(TC), hd.div_ceil(TC));
    let np = kp * TC;
    // Per head: K as kp panels of hd steps, V as vp panels of np steps (zeros past n and hd).
    let (hk, hv) = (kp * hd * TC, vp * np * TC);
    let mut packed = vec![0.0f32; heads * (hk + hv)];
    let pk = Out(packed.as_mut_ptr());
    ops.parallel_for(heads, &|h| {
        #[allow(clippy::redundant_locals)]
        let pk = pk;
        // SAFETY: head h's share of `packed` is this task's alone.
        let mine = unsafe { std::slice::from_raw_parts_mut(pk.0.add(h * (hk + hv)), hk + hv) };
        let (ks, vs) = mine.split_at_mut(hk);
        for t in 0..n {
            let (kr, vr) = (&k[t * d + h * hd..][..hd], &v[t * d + h * hd..][..hd]);
            for (j, (&kv, &vv)) in kr.iter().zip(vr).enumerate() {
                ks[((t / TC) * hd + j) * TC + t % TC] = kv;
                vs[((j / TC) * np + t) * TC + j % TC] = vv;
            }
        }
    });
    let scale = 1.0 / (hd as f32).sqrt();
    let tile = tile_fn();
    let dst = Out(out.as_mut_ptr());
    let packed = &packed[..];
    let blocks = n.div_ceil(QB);
    ops.parallel_for(heads * blocks, &|i| {
        #[allow(clippy::redundant_locals)]
        let dst = dst;
        let (h, b) = (i / blocks, i % blocks);
        let (ks, vs) = packed[h * (hk + hv)..][..hk + hv].split_at(hk);
        let (t0, t1) = (b * QB, (b * QB + QB).min(n));
        let rows = (t1 - t0).next_multiple_of(TR);
        SCRATCH.with_borrow_mut(|(a, s, pk)| {
            a.clear();
            a.resize(rows * hd, 0.0);
            for (i, t) in (t0..t1).enumerate() {
                let (g, r) = (i / TR, i % TR);
                q[t * d + h * hd..][..hd].iter().enumerate().for_each(|(j, &v)| a[(g * hd + j) * TR + r] = v);
            }
            s.clear();
            s.resize(rows * np, 0.0);
            for p in 0..kp {
                for g in (0..rows).step_by(TR) {
                    let mut c = [[0.0f32; TC]; TR];
                    tile(&a[g / TR * hd * TR..], &ks[p * hd * TC..], hd, &mut c);
                    for (r, cr) in c.iter().enumerate() {
                        s[(g + r) * np + p * TC..][..TC].copy_from_slice(cr);
                    }
                }
            }
            let mut inv = [0.0f32; QB];
            for (r, row) in s.chunks_exact_mut(np).take(t1 - t0).enumerate() {
                inv[r] = 1.0 / softmax_row(&mut row[..n], scale);
                row[n..].fill(0.0);
            }
            // The weights as the next tiles' activations: packed, TR rows a step.
            pk.clear();
            pk.resize(rows * np, 0.0);
            for (i, row) in s.chunks_exact(np).enumerate() {
                let (g, r) = (i / TR, i % TR);
                row.iter().enumerate().for_each(|(j, &v)| pk[(g * np + j) * TR + r] = v);
            }
            for p in 0..vp {
                let cols = (hd - p * TC).min(TC);
                for g in (0..rows).step_by(TR) {
                    let mut c = [[0.0f32; TC]; TR];
                    for k0 in (0..np).step_by(KC) {
                        let kc = (np - k0).min(KC);
                        tile(&pk[(g / TR * np + k0) * TR..], &vs[(p * np + k0) * TC..], kc, &mut c);
                    }
                    for (r, cr) in c.iter().enumerate().take((t1 - t0).saturating_sub(g)) {
                        let t = t0 + g + r;
                        let mut o = [0.0f32; TC];
                        o.iter_mut().zip(cr).for_each(|(o, &x)| *o = x * inv[g + r]);
                        // SAFETY: query rows t0..t1 of head h are this task's alone, and
                        // p*TC + cols <= hd keeps the write inside the head's columns of row t.
                        unsafe { std::ptr::copy_nonoverlapping(o.as_ptr(), dst.0.add(t * d + h * hd + p * TC), cols) };
                    }
                }
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn exp_is_within_two_ulp_and_activations_match_their_twin() {
        for i in -8700..8800 {
            let x = i as f32 * 0.01 + 0.003;
            let (got, want) = (exp_twin(x), (x as f64).exp());
            assert!(((got as f64 - want) / want).abs() < 2.5e-7, "exp({x}) = {got}, want {want}");
        }
        let x: Vec<f32> = rand(1000, 3).iter().map(|v| v * 12.0).collect();
        for act in [Act::GeluTanh, Act::GeluQuick, Act::Silu] {
            let (mut fast_, mut twin) = (x.clone(), x.clone());
            activate(&mut fast_, act);
            activate_twin(&mut twin, act);
            assert_eq!(fast_, twin, "{act:?}: the SIMD activation differs from its twin");
            for (&u, &y) in x.iter().zip(&twin) {
                let u = u as f64;
                let want = match act {
                    Act::GeluTanh => 0.5 * u * (1.0 + (0.797_884_6 * (u + 0.044_715 * u * u * u)).tanh()),
                    Act::GeluQuick => u / (1.0 + (-1.702 * u).exp()),
                    Act::Silu => u / (1.0 + (-u).exp()),
                };
                assert!((y as f64 - want).abs() <= 1e-6 * want.abs().max(1.0), "{act:?}({u}) = {y}, want {want}");
            }
        }
        let mut s = rand(93, 5);
        let mut t = s.clone();
        let (a, b) = (softmax_row(&mut s, 0.3), softmax_twin(&mut t, 0.3));
        assert_eq!((s, a), (t, b), "the SIMD softmax differs from its twin");
    }

    #[test]
    fn tile_matches_its_twin_bit_for_bit() {
        for kc in [1, 7, 72, 256] {
            let (a, w) = (rand(TR * kc, 1), rand(kc * TC, 2));
            let (mut c1, mut c2) = ([[0.5f32; TC]; TR], [[0.5f32; TC]; TR]);
            tile_fn()(&a, &w, kc, &mut c1);
            tile_twin(&a, &w, kc, &mut c2);
            assert_eq!(c1, c2, "kc {kc}: the tile kernel differs from its twin");
        }
    }

    /// The GEMM and the attention against plain f64 sums, with a serial HostOps.
    #[test]
    fn gemm_and_attention_match_plain_sums() {
        let team = crate::cpu::spin::Team::new(2);
        team.session(|t| {
            let mut act = Vec::new();
            let mut ops = crate::cpu::backend::CpuOps { team: t, act: &mut act, numerics: crate::backend::Numerics::Fast, offload: None };
            let (n, m, k) = (29, 45, 300);
            let (wv, x) = (rand(m * k, 7), rand(n * k, 8));
            let w = crate::vision::f32_weight(&wv, m, k);
            let mut out = vec![0.0f32; n * m];
            gemm(&mut ops, &w, &x, n, &mut out);
            for t in 0..n {
                for r in 0..m {
                    let want: f64 = (0..k).map(|i| wv[r * k + i] as f64 * x[t * k + i] as f64).sum();
                    assert!((out[t * m + r] as f64 - want).abs() < 1e-4, "gemm [{t}][{r}] = {}, want {want}", out[t * m + r]);
                }
            }
            let (n, heads, hd) = (70, 3, 40);
            let d = heads * hd;
            let (q, kk, v) = (rand(n * d, 11), rand(n * d, 12), rand(n * d, 13));
            let mut out = vec![0.0f32; n * d];
            attention(&mut ops, &q, &kk, &v, n, heads, hd, &mut out);
            for h in 0..heads {
                for t in 0..n {
                    let sc: Vec<f64> = (0..n)
                        .map(|j| (0..hd).map(|i| q[t * d + h * hd + i] as f64 * kk[j * d + h * hd + i] as f64).sum::<f64>() / (hd as f64).sqrt())
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = sc.iter().map(|s| (s - mx).exp()).collect();
                    let tot: f64 = e.iter().sum();
                    for i in 0..hd {
                        let want: f64 = (0..n).map(|j| e[j] * v[j * d + h * hd + i] as f64).sum::<f64>() / tot;
                        let got = out[t * d + h * hd + i] as f64;
                        assert!((got - want).abs() < 1e-5, "attention head {h} row {t} [{i}] = {got}, want {want}");
                    }
                }
            }
        });
    }
}
