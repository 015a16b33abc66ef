//! Every SIMD dot equals its scalar twin, and both equal the dot of the dequantized rows, on
//! random blocks and on edge values. SIMD kernels read weights in the layout `kernels(ty)` asks
//! for (GGUF rows or tiles of eight); the scalar twins read the GGUF rows, so tiling is checked too.

use dasllama::quant::tile::{tile_bytes, tile_rows, untile_row, TILE_ROWS};
use dasllama::quant::{act_row_bytes, dequantize_row, float_act_bytes, kernels, quantize_row, scalar, widen_row, GgmlType, Kernels};

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

/// Random weight blocks with sane (small, finite) f16 scales, and MXFP4's E8M0 scales 2^-10..2^5
/// (edge: also e = 0 and 1, whose halves are the subnormals 2^-128 and 2^-127).
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
            for b in out.chunks_exact_mut(bb) {
                for &at in ty.f16_scale_offsets() {
                    let s = half::f16::from_f32(0.01 + (rng.next() % 100) as f32 * 0.001);
                    b[at..at + 2].copy_from_slice(&s.to_bits().to_le_bytes());
                }
                if ty == GgmlType::MXFP4 {
                    b[0] = if edge { [0u8, 1, 126, 127, 128, 129][rng.next() as usize % 6] } else { 118 + (rng.next() % 16) as u8 };
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
        let simd = simd_dot(ty, &w, &a, n, rng.next() as usize % TILE_ROWS);
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
    for ty in GgmlType::WEIGHT_FORMATS {
        check(ty, false);
    }
}

#[test]
fn simd_matches_scalar_edges() {
    for ty in GgmlType::WEIGHT_FORMATS {
        check(ty, true);
    }
}

#[test]
fn simd_q8_activation_blocks_match_scalar() {
    let mut rng = Lcg(3);
    for case in 0..2000 {
        let x: Vec<f32> = (0..32)
            .map(|_| match case % 4 {
                0 => rng.f() * 10.0,
                1 => [0.0, 0.5, -0.5, 1.5, 127.0, -2.5][rng.next() as usize % 6],
                2 => 0.0,
                _ => (rng.next() % 255) as f32 - 127.0,
            })
            .collect();
        let (mut a, mut b) = ([0u8; 32], [0u8; 32]);
        let got = dasllama::quant::q8_block(&x, &mut a);
        let want = scalar::q8_block(&x, &mut b);
        assert_eq!((got.0.to_bits(), got.1, a), (want.0.to_bits(), want.1, b), "block {x:?}");
    }
}

#[test]
fn simd_q8k_activation_blocks_match_scalar() {
    let mut rng = Lcg(11);
    for case in 0..400 {
        let x: Vec<f32> = (0..256)
            .map(|_| match case % 4 {
                0 => rng.f() * 10.0,
                1 => [0.0, 0.5, -0.5, 1.5, 127.0, -127.0, -2.5][rng.next() as usize % 7],
                2 => 0.0,
                _ => (rng.next() % 255) as f32 - 127.0,
            })
            .collect();
        let (mut a, mut b) = (vec![0u8; 292], vec![0u8; 292]);
        dasllama::quant::q8k_block(&x, &mut a);
        scalar::q8k_block(&x, &mut b);
        assert_eq!(a, b, "block {x:?}");
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
    for ty in GgmlType::WEIGHT_FORMATS {
        let mut rng = Lcg(ty as u64 + 99);
        for n in [576, 256, 2048] {
            for _ in 0..10 {
                let ws: Vec<Vec<u8>> = (0..TILE_ROWS).map(|_| random_weights(ty, n, &mut rng, false)).collect();
                let acts: Vec<Vec<u8>> = (0..8).map(|_| act(ty, &(0..n).map(|_| rng.f() * 3.0).collect::<Vec<_>>())).collect();
                let a: Vec<&[u8]> = acts.iter().map(|v| &v[..]).collect();
                match kernels(ty) {
                    Kernels::Rows(_) => {}
                    Kernels::Floats(dots) => {
                        let wide: Vec<Vec<u8>> = acts.iter().map(|v| widened(ty, v, n)).collect();
                        let a: Vec<&[u8]> = wide.iter().map(|v| &v[..]).collect();
                        let w: Vec<&[u8]> = ws[..4].iter().map(|v| &v[..]).collect();
                        float_pairs(dots, &w, &a[..4], n, ty.name(), |_, _, _| {});
                    }
                    Kernels::Tiles(tile_fn) => {
                        let t = tile(ty, &ws, n);
                        let mut one = [[0.0f32; TILE_ROWS]; 1];
                        for r in 1..=8 {
                            let mut many = vec![[0.0f32; TILE_ROWS]; r];
                            tile_fn(&t, &a[..r], n, &mut many);
                            for j in 0..r {
                                tile_fn(&t, &a[j..j + 1], n, &mut one);
                                assert_eq!(many[j].map(f32::to_bits), one[0].map(f32::to_bits), "{} tile of {r} rows, row {j}", ty.name());
                            }
                        }
                        // Two tiles at once (decode; AVX-512's 512-bit pairs) against one tile at a time.
                        let mut rng2 = Lcg(n as u64);
                        let t2 = [t.clone(), tile(ty, &(0..TILE_ROWS).map(|_| random_weights(ty, n, &mut rng2, false)).collect::<Vec<_>>(), n)].concat();
                        for r in 1..=8 {
                            let mut two = vec![[0.0f32; TILE_ROWS]; 2 * r];
                            tile_fn(&t2, &a[..r], n, &mut two);
                            for k in 0..2 {
                                for j in 0..r {
                                    tile_fn(&t2[k * t.len()..], &a[j..j + 1], n, &mut one);
                                    assert_eq!(two[k * r + j].map(f32::to_bits), one[0].map(f32::to_bits), "{} two tiles, tile {k} row {j}", ty.name());
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn tiles_round_trip() {
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::MXFP4, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
        let mut rng = Lcg(ty as u64 + 5);
        let n = 512;
        for rows in [1, 5, 8] {
            let ws: Vec<Vec<u8>> = (0..rows).map(|_| random_weights(ty, n, &mut rng, false)).collect();
            let t = tile(ty, &ws, n);
            for (r, w) in ws.iter().enumerate() {
                let mut back = vec![0u8; w.len()];
                untile_row(ty, &t, r, &mut back);
                assert_eq!(&back, w, "{}: row {r} of a tile of {rows} does not round-trip", ty.name());
            }
        }
    }
}

fn tile(ty: GgmlType, rows: &[Vec<u8>], n: usize) -> Vec<u8> {
    let mut t = vec![0u8; tile_bytes(ty, n)];
    tile_rows(ty, &rows.iter().map(|r| &r[..]).collect::<Vec<_>>(), &mut t);
    t
}

/// The SIMD kernel's dot of one GGUF row: for tiled formats, as row `lane` of a tile whose
/// other rows are noise.
fn simd_dot(ty: GgmlType, w: &[u8], a: &[u8], n: usize, lane: usize) -> f32 {
    match kernels(ty) {
        Kernels::Rows(dot) => dot(w, a, n),
        Kernels::Floats(dots) => {
            let mut out = [0.0f32];
            dots(&[w], &[&widened(ty, a, n)], n, &mut out);
            out[0]
        }
        Kernels::Tiles(tile_fn) => {
            let mut rng = Lcg(lane as u64);
            let mut rows: Vec<Vec<u8>> = (0..TILE_ROWS).map(|_| random_weights(ty, n, &mut rng, false)).collect();
            rows[lane] = w.to_vec();
            let mut out = [[0.0f32; TILE_ROWS]; 1];
            tile_fn(&tile(ty, &rows, n), &[a], n, &mut out);
            out[0][lane]
        }
    }
}

/// A float weight's activation row (`vt` bytes, as `act` makes it) as the float kernels read it:
/// the same values, widened to f32.
fn widened(ty: GgmlType, a: &[u8], n: usize) -> Vec<u8> {
    let vt = ty.vec_dot_type();
    let mut x = vec![0.0f32; n];
    dequantize_row(vt, &a[..vt.row_bytes(n)], &mut x);
    let mut out = vec![0u8; float_act_bytes(n)];
    widen_row(vt, &x, &mut out);
    out
}

/// A float kernel on every W x R sub-block of `w` x `a` (up to 4 x 4) gives each pair the bits it
/// gets alone; `check(i, j, value)` sees each pair's value.
fn float_pairs(dots: dasllama::quant::DotsFn, w: &[&[u8]], a: &[&[u8]], n: usize, label: &str, mut check: impl FnMut(usize, usize, f32)) {
    let mut one = [0.0f32];
    for nw in 1..=w.len() {
        for r in 1..=a.len() {
            let mut many = vec![0.0f32; nw * r];
            dots(&w[..nw], &a[..r], n, &mut many);
            for i in 0..nw {
                for j in 0..r {
                    dots(&w[i..i + 1], &a[j..j + 1], n, &mut one);
                    assert_eq!(many[i * r + j].to_bits(), one[0].to_bits(), "{label}: {nw} x {r} at once, pair {i} {j}, n={n}");
                    check(i, j, one[0]);
                }
            }
        }
    }
}

/// Every float kernel variant this CPU runs (AVX2, AVX-512) on F32, F16 and BF16 weights: the
/// same bits for one to four weight rows against one to four activation rows at once as for each
/// pair alone, and the scalar twin's sum up to f32 summation order, for lengths with and without
/// a tail.
#[cfg(target_arch = "x86_64")]
#[test]
fn float_kernel_variants_match_the_scalar_twin() {
    use dasllama::quant::avx2::float_variants;
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        let variants = float_variants(ty);
        if report_skipped(ty, variants.len()) {
            continue;
        }
        let mut rng = Lcg(ty as u64 + 41);
        for n in [576, 2048, 64, 100, 17, 3] {
            let ws: Vec<Vec<u8>> = (0..4).map(|_| random_weights(ty, n, &mut rng, false)).collect();
            let w: Vec<&[u8]> = ws.iter().map(|v| &v[..]).collect();
            let acts: Vec<Vec<u8>> = (0..4).map(|_| act(ty, &(0..n).map(|_| rng.f() * 3.0).collect::<Vec<_>>())).collect();
            let wide: Vec<Vec<u8>> = acts.iter().map(|v| widened(ty, v, n)).collect();
            let a: Vec<&[u8]> = wide.iter().map(|v| &v[..]).collect();
            for (name, dots) in &variants {
                float_pairs(*dots, &w, &a, n, &format!("{} {name}", ty.name()), |i, j, got| {
                    let want = scalar::dot_fn(ty)(w[i], &acts[j], n);
                    assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0), "{} {name}: {got} != scalar {want}, n={n}", ty.name());
                });
            }
        }
    }
}

/// Say on stderr which SIMD variants of `ty` this machine cannot test, and why (`skipped:
/// <format> <variant>: this CPU lacks <features>`); true when none at all can be (`tested` = 0).
#[cfg(target_arch = "x86_64")]
fn report_skipped(ty: GgmlType, tested: usize) -> bool {
    for (name, why) in dasllama::quant::avx2::skipped_variants(ty) {
        eprintln!("skipped: {} {name}: {why}", ty.name());
    }
    if tested == 0 {
        eprintln!("skipped: {}: no SIMD variant of this format could be tested here; only the scalar twin runs", ty.name());
    }
    tested == 0
}

fn act(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let vt = ty.vec_dot_type();
    let mut a = vec![0u8; act_row_bytes(vt, x.len())];
    quantize_row(vt, x, &mut a);
    a
}

/// Every tile kernel variant this CPU can run (AVX2, AVX-VNNI, AVX-512) against the scalar twin,
/// each on its own: integer block sums are exact in both, so they differ only in f32 summation
/// order. And the variants compute the same float operations, so they agree bit for bit.
#[cfg(target_arch = "x86_64")]
#[test]
fn tile_kernel_variants_match_the_scalar_twin() {
    use dasllama::quant::avx2::tile_variants;
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::MXFP4, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
        let variants = tile_variants(ty);
        if report_skipped(ty, variants.len()) {
            continue;
        }
        eprintln!("{}: comparing {:?} with the scalar twin", ty.name(), variants.iter().map(|v| v.0).collect::<Vec<_>>());
        let mut rng = Lcg(ty as u64 + 17);
        for edge in [false, true] {
            let n = 512;
            // Two tiles: the kernels take one or a pair (AVX-512 puts a pair in one register).
            let ws: Vec<Vec<u8>> = (0..2 * TILE_ROWS).map(|_| random_weights(ty, n, &mut rng, edge)).collect();
            let t = [tile(ty, &ws[..TILE_ROWS], n), tile(ty, &ws[TILE_ROWS..], n)].concat();
            let acts: Vec<Vec<u8>> = (0..7).map(|_| act(ty, &(0..n).map(|_| rng.f() * 5.0).collect::<Vec<_>>())).collect();
            let a: Vec<&[u8]> = acts.iter().map(|v| &v[..]).collect();
            let run = |f: dasllama::quant::TileFn| {
                let (mut one, mut pair) = (vec![[0.0f32; TILE_ROWS]; 7], vec![[0.0f32; TILE_ROWS]; 14]);
                f(&t, &a, n, &mut one);
                f(&t, &a, n, &mut pair);
                assert_eq!(one, pair[..7], "{}: a pair of tiles differs from its first tile alone", ty.name());
                // One activation row (decode's own kernels), over a tile and over a pair.
                let (mut row, mut rows) = (vec![[0.0f32; TILE_ROWS]; 1], vec![[0.0f32; TILE_ROWS]; 2]);
                f(&t[..t.len() / 2], &a[..1], n, &mut row);
                f(&t, &a[..1], n, &mut rows);
                assert_eq!((row[0], rows[0], rows[1]), (one[0], pair[0], pair[7]), "{}: one activation row differs from the batch's", ty.name());
                pair
            };
            let bits = |o: &[[f32; TILE_ROWS]]| o.iter().flatten().map(|v| v.to_bits()).collect::<Vec<_>>();
            let first = run(variants[0].1);
            for (name, f) in &variants {
                let out = run(*f);
                assert_eq!(bits(&out), bits(&first), "{}: {name} differs from {}", ty.name(), variants[0].0);
                for (i, row) in out.iter().enumerate() {
                    let (k, r) = (i / 7, i % 7);
                    for (j, &got) in row.iter().enumerate() {
                        let want = scalar::dot_fn(ty)(&ws[k * TILE_ROWS + j], a[r], n);
                        let mag = want.abs().max(1.0);
                        assert!((got - want).abs() <= 1e-4 * mag, "{}: {name} row {j} x act {r}: {got} != scalar {want} (edge={edge})", ty.name());
                    }
                }
            }
        }
    }
}

/// `matmul` walks a task's weight rows a tile or a pair of tiles at a time against up to eight
/// activation rows a call (on an AMX CPU, from 32 rows of 2048-wide weights, up to 64 a call on
/// the tiles); every batch size, and a row count that leaves a single tile or a partial one at a
/// task's end, gives each output the bits of that row evaluated alone.
#[test]
fn matmul_rows_are_bit_identical_whatever_the_batch() {
    use dasllama::cpu::{matmul, Cpu, Weight};
    let cpu = Cpu::new(2);
    let team = || cpu.team();
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::MXFP4,
        GgmlType::Q4K,
        GgmlType::Q6K,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::F32,
    ] {
        let (rows, cols, most) = (40, 2048, 65);
        let w = Weight::random_blocks(ty, rows, cols, &cpu);
        let mut rng = Lcg(ty as u64 + 5);
        let x: Vec<f32> = (0..most * cols).map(|_| rng.f()).collect();
        let mut act = Vec::new();
        let mut alone = vec![0.0f32; most * rows];
        for t in 0..most {
            team().session(|tm| matmul(&w, &x[t * cols..(t + 1) * cols], 1, &mut alone[t * rows..(t + 1) * rows], &mut act, tm));
        }
        for n in [2, 3, 5, 8, 9, 16, 17, 33, 64, 65] {
            let mut out = vec![0.0f32; n * rows];
            team().session(|tm| matmul(&w, &x[..n * cols], n, &mut out, &mut act, tm));
            for (i, (a, b)) in out.iter().zip(&alone).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{}: {n} rows at once, row {} output {}", ty.name(), i / rows, i % rows);
            }
        }
    }
}

/// The formats with an AMX kernel.
const AMX_FORMATS: [GgmlType; 8] =
    [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K];

fn is_kquant(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K)
}

/// Integer value `j` of a GGUF block of a 32-value format (zero point taken off).
fn block_int(ty: GgmlType, b: &[u8], j: usize) -> i32 {
    let nib = |qs: &[u8]| if j < 16 { (qs[j] & 0xF) as i32 } else { (qs[j - 16] >> 4) as i32 };
    let high = |at: usize| ((u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) >> j) & 1) as i32 * 16;
    match ty {
        GgmlType::Q4_0 => nib(&b[2..]) - 8,
        GgmlType::Q4_1 => nib(&b[4..]),
        GgmlType::Q5_0 => (nib(&b[6..]) | high(2)) - 16,
        GgmlType::Q5_1 => nib(&b[8..]) | high(4),
        GgmlType::Q8_0 => b[2 + j] as i8 as i32,
        _ => unreachable!(),
    }
}

/// The vector tile kernels' arithmetic for one output, from the GGUF row: per block, in order,
/// acc = fma(d_w * d_a, isum, acc), then (Q4_1, Q5_1) acc = fma(m_w, s_a, acc).
fn vector_order_dot(ty: GgmlType, w: &[u8], a: &[u8], n: usize) -> f32 {
    let (bb, ab, nb) = (ty.block_bytes(), ty.vec_dot_type().block_bytes(), n / 32);
    let f16 = |b: &[u8], at: usize| half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32();
    let tail = |i: usize| f32::from_le_bytes(a[nb * ab + 4 * i..][..4].try_into().unwrap());
    let mut acc = 0.0f32;
    for i in 0..nb {
        let (wb, q) = (&w[i * bb..(i + 1) * bb], &a[i * ab + ab - 32..(i + 1) * ab]);
        let isum: i32 = (0..32).map(|j| block_int(ty, wb, j) * q[j] as i8 as i32).sum();
        acc = (f16(wb, 0) * tail(i)).mul_add(isum as f32, acc);
        if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
            acc = f16(wb, 2).mul_add(tail(nb + i), acc);
        }
    }
    acc
}

/// Weights (16 or 12 rows: a pair of tiles, or one and a partial one), tiled, and `rows`
/// activation rows back to back, as `matmul` lays them out.
struct AmxCase {
    ws: Vec<Vec<u8>>,
    tiles: Vec<u8>,
    ntiles: usize,
    act: Vec<u8>,
    arb: usize,
}

fn amx_case(ty: GgmlType, n: usize, weight_rows: usize, rows: usize, rng: &mut Lcg, edge: bool) -> AmxCase {
    let ws: Vec<Vec<u8>> = (0..weight_rows).map(|_| random_weights(ty, n, rng, edge)).collect();
    let tiles: Vec<u8> = ws.chunks(TILE_ROWS).flat_map(|c| tile(ty, c, n)).collect();
    let arb = act_row_bytes(ty.vec_dot_type(), n);
    let act: Vec<u8> = (0..rows)
        .flat_map(|_| act(ty, &(0..n).map(|_| if edge { [0.0, 1e-3, -3.0, 7.5][rng.next() as usize % 4] } else { rng.f() * 5.0 }).collect::<Vec<_>>()))
        .collect();
    AmxCase { ws, ntiles: weight_rows.div_ceil(TILE_ROWS), tiles, act, arb }
}

/// The AMX kernel's scalar twin, tile by tile, gives every output the bits of the vector tile
/// kernels (each variant this CPU runs) and, for the 32-value formats, of their arithmetic
/// replayed on the GGUF rows; the K-quants' twin is also held to the scalar dot (which sums in
/// ggml's float order, so to within its rounding).
#[test]
fn amx_twin_is_bit_identical_to_the_vector_kernels() {
    use dasllama::quant::amx::{gemm_twin, Acts, COLS, MAX_ROWS};
    for ty in AMX_FORMATS {
        #[cfg(target_arch = "x86_64")]
        let variants = dasllama::quant::avx2::tile_variants(ty);
        #[cfg(not(target_arch = "x86_64"))]
        let variants: Vec<(&str, dasllama::quant::TileFn)> = Vec::new();
        if variants.is_empty() {
            eprintln!("{}: no vector tile kernel here (no AVX2, or DASLLAMA_NO_SIMD): the AMX twin is checked against their arithmetic replayed", ty.name());
        }
        let mut rng = Lcg(ty as u64 + 4242);
        for (n, weight_rows, rows, edge) in [(512, 16, 37, false), (256, 12, 64, false), (1024, 16, 5, true), (512, 9, 16, true), (256, 16, 1, false)] {
            let c = amx_case(ty, n, weight_rows, rows, &mut rng, edge);
            let mut out = vec![[0.0f32; COLS]; MAX_ROWS];
            gemm_twin(ty, &c.tiles, c.ntiles, Acts { bytes: &c.act, stride: c.arb, rows }, n, &mut out);
            for (r, o) in out[..rows].iter().enumerate() {
                let a = &c.act[r * c.arb..(r + 1) * c.arb];
                for (j, w) in c.ws.iter().enumerate() {
                    if is_kquant(ty) {
                        let want = scalar::dot_fn(ty)(w, a, n);
                        assert!(
                            (o[j] - want).abs() <= 1e-4 * want.abs().max(1.0),
                            "{}: twin {} != scalar {want}, act row {r}, weight row {j}",
                            ty.name(),
                            o[j]
                        );
                    } else {
                        let want = vector_order_dot(ty, w, a, n);
                        assert_eq!(o[j].to_bits(), want.to_bits(), "{}: twin {} != replay {want}, act row {r}, weight row {j}", ty.name(), o[j]);
                    }
                }
                for (name, f) in &variants {
                    let mut v = vec![[0.0f32; TILE_ROWS]; c.ntiles];
                    f(&c.tiles, &[a], n, &mut v);
                    for (j, got) in v.iter().flatten().take(weight_rows).enumerate() {
                        assert_eq!(o[j].to_bits(), got.to_bits(), "{}: twin {} != {name} {got}, act row {r}, weight row {j}", ty.name(), o[j]);
                    }
                }
            }
            // Rows past the weights (a missing or partial tile) come out zero.
            assert!(out[..rows].iter().all(|o| o[weight_rows..].iter().all(|&v| v == 0.0)), "{}: padding rows not zero", ty.name());
        }
    }
}

/// The AMX kernel equals its scalar twin bit for bit; where the CPU has no AMX this says so
/// (one line per format) and checks nothing.
#[test]
fn amx_kernel_matches_its_twin() {
    use dasllama::quant::amx::{gemm, gemm_twin, has_amx, status, Acts, COLS, MAX_ROWS};
    if !has_amx() {
        let why = status().1.trim_start_matches("off: ");
        for ty in AMX_FORMATS {
            eprintln!("skipped: amx {}: {why}", ty.name().to_lowercase());
        }
        return;
    }
    eprintln!("amx: {}", status().1);
    for ty in AMX_FORMATS {
        let mut rng = Lcg(ty as u64 + 777);
        for (n, weight_rows, edge) in [(512, 16, false), (256, 12, true), (2048, 8, false), (if is_kquant(ty) { 256 } else { 32 }, 16, true)] {
            let c = amx_case(ty, n, weight_rows, MAX_ROWS, &mut rng, edge);
            for rows in [1, 2, 15, 16, 17, 31, 33, 48, 63, 64, 65, 97, MAX_ROWS - 1, MAX_ROWS] {
                let (mut want, mut got) = (vec![[0.0f32; COLS]; rows], vec![[0.0f32; COLS]; rows]);
                gemm_twin(ty, &c.tiles, c.ntiles, Acts { bytes: &c.act, stride: c.arb, rows }, n, &mut want);
                gemm(ty, &c.tiles, c.ntiles, Acts { bytes: &c.act, stride: c.arb, rows }, n, &mut got);
                for r in 0..rows {
                    assert_eq!(got[r].map(f32::to_bits), want[r].map(f32::to_bits), "{} k={n} {weight_rows} weight rows, {rows} act rows: row {r}", ty.name());
                }
            }
        }
    }
}
