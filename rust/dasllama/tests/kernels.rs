//! Every SIMD dot equals its scalar twin, and both equal the dot of the dequantized rows, on
//! random blocks and on edge values. SIMD kernels read weights in the layout `kernels(ty)` asks
//! for (repacked or not); the scalar twins read the GGUF rows, so the repack is checked too.

use dasllama::quant::{act_row_bytes, dequantize_row, kernels, quantize_row, repack, scalar, GgmlType};

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
    fn f(&mut self) -> f32 {
        self.next() as f32 / u32::MAX as f32 * 2.0 - 1.0
    }
}

const WEIGHTS: [GgmlType; 10] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
];

/// Random weight blocks with sane (small, finite) f16 scales.
fn random_weights(ty: GgmlType, n: usize, rng: &mut Lcg, edge: bool) -> Vec<u8> {
    let mut vals = vec![0.0f32; n];
    for v in vals.iter_mut() {
        *v = if edge { [-1.0, 1.0, 0.0, -0.999, 0.5][rng.next() as usize % 5] } else { rng.f() };
    }
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            let mut out = vec![0u8; ty.row_bytes(n)];
            quantize_row(ty, &vals, &mut out);
            out
        }
        _ => {
            // Random bytes everywhere, then overwrite the f16 scales with small finite values.
            let mut out: Vec<u8> = (0..ty.row_bytes(n)).map(|_| if edge { [0u8, 0xFF, 0x0F, 0xF0][rng.next() as usize % 4] } else { rng.byte() }).collect();
            let bb = ty.block_bytes();
            let scale_at: &[usize] = match ty {
                GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
                GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
                GgmlType::Q6K => &[208],
                _ => &[],
            };
            for b in out.chunks_exact_mut(bb) {
                for &at in scale_at {
                    let s = half::f16::from_f32(0.01 + (rng.next() % 100) as f32 * 0.001);
                    b[at..at + 2].copy_from_slice(&s.to_bits().to_le_bytes());
                }
            }
            out
        }
    }
}

fn check(ty: GgmlType, edge: bool) {
    let mut rng = Lcg(ty as u64 * 7919 + edge as u64);
    let n = 512;
    for _ in 0..50 {
        let w = random_weights(ty, n, &mut rng, edge);
        let x: Vec<f32> = (0..n).map(|_| if edge { [0.0, 1e-3, -3.0, 7.5][rng.next() as usize % 4] } else { rng.f() * 4.0 }).collect();
        let vt = ty.vec_dot_type();
        let a = act(ty, &x);
        let simd = (kernels(ty).dot)(&for_kernels(ty, &w), &a, n);
        let sc = scalar::dot_fn(ty)(&w, &a, n);
        let (mut wd, mut ad) = (vec![0.0f32; n], vec![0.0f32; n]);
        dequantize_row(ty, &w, &mut wd);
        dequantize_row(vt, &a[..vt.row_bytes(n)], &mut ad);
        let reference: f64 = wd.iter().zip(&ad).map(|(p, q)| *p as f64 * *q as f64).sum();
        let mag: f64 = wd.iter().zip(&ad).map(|(p, q)| (*p as f64 * *q as f64).abs()).sum::<f64>() + 1e-6;
        assert!(((simd - sc) as f64).abs() <= 1e-4 * mag, "{}: simd {simd} != scalar {sc} (edge={edge})", ty.name());
        assert!(((sc as f64) - reference).abs() <= 2e-3 * mag, "{}: scalar {sc} != dequantized reference {reference} (edge={edge})", ty.name());
    }
}

#[test]
fn simd_matches_scalar_random() {
    for ty in WEIGHTS.iter().copied().chain([GgmlType::Q6K]) {
        check(ty, false);
    }
}

#[test]
fn simd_matches_scalar_edges() {
    for ty in WEIGHTS.iter().copied().chain([GgmlType::Q6K]) {
        check(ty, true);
    }
}

#[test]
fn activation_rounding_is_ggml_x86() {
    // Half-way values round to even, as _mm256_round_ps does; q8_1 carries d * sum(q).
    let mut x = vec![0.0f32; 32];
    x[0] = 127.0;
    x[1] = 2.5;
    x[2] = -3.5;
    let mut a = vec![0u8; act_row_bytes(GgmlType::Q8_1, 32)];
    quantize_row(GgmlType::Q8_1, &x, &mut a);
    assert_eq!(a[4] as i8, 127);
    assert_eq!(a[5] as i8, 2);
    assert_eq!(a[6] as i8, -4);
    let s = half::f16::from_bits(u16::from_le_bytes([a[2], a[3]])).to_f32();
    assert_eq!(s, 125.0);
}

#[test]
fn multi_row_kernels_are_bit_identical_to_single_row() {
    for ty in WEIGHTS.iter().copied().chain([GgmlType::Q6K]) {
        let k = kernels(ty);
        let mut rng = Lcg(ty as u64 + 99);
        for n in [576, 256, 2048] {
            for _ in 0..10 {
                let ws: Vec<Vec<u8>> = (0..4).map(|_| for_kernels(ty, &random_weights(ty, n, &mut rng, false))).collect();
                let acts: Vec<Vec<u8>> = (0..4).map(|_| act(ty, &(0..n).map(|_| rng.f() * 3.0).collect::<Vec<_>>())).collect();
                if let Some(d4) = k.dot4 {
                    let got = d4(&ws[0], [&acts[0], &acts[1], &acts[2], &acts[3]], n);
                    for j in 0..4 {
                        assert_eq!(got[j].to_bits(), (k.dot)(&ws[0], &acts[j], n).to_bits(), "{} dot4 row {j}", ty.name());
                    }
                }
                if let Some(r4) = k.rows4 {
                    let got = r4([&ws[0], &ws[1], &ws[2], &ws[3]], &acts[0], n);
                    for j in 0..4 {
                        assert_eq!(got[j].to_bits(), (k.dot)(&ws[j], &acts[0], n).to_bits(), "{} rows4 row {j}", ty.name());
                    }
                }
            }
        }
    }
}

/// A weight row in the layout this CPU's kernels for `ty` read.
fn for_kernels(ty: GgmlType, w: &[u8]) -> Vec<u8> {
    if kernels(ty).repacked {
        let mut r = vec![0u8; w.len()];
        repack::repack_row(ty, w, &mut r);
        let mut back = vec![0u8; w.len()];
        repack::unpack_row(ty, &r, &mut back);
        assert_eq!(back, w, "{}: repack does not round-trip", ty.name());
        r
    } else {
        w.to_vec()
    }
}

fn act(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let vt = ty.vec_dot_type();
    let mut a = vec![0u8; act_row_bytes(vt, x.len())];
    quantize_row(vt, x, &mut a);
    a
}
