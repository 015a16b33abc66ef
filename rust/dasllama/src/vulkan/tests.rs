//! Every kernel against the CPU code it mirrors, on whatever Vulkan device this machine has
//! (Mesa's lavapipe in CI, with DASLLAMA_VK_ALLOW_CPU=1). Without a device each test says so and
//! passes: the CPU-only build must still test everything else.

use super::buffer::Buffer;
use super::device::Gpu;
use super::kernels::{Kernels, Push, Runner};
use super::weights::{upload_f32, upload_weight};
use crate::cpu::{ops, Bytes, Weight};
use crate::quant::{dequantize_row, quantize_row, GgmlType};
use gpu_allocator::MemoryLocation;
use std::sync::{Arc, OnceLock};

fn gpu() -> Option<(Arc<Gpu>, Kernels, Runner)> {
    static G: OnceLock<Option<Arc<Gpu>>> = OnceLock::new();
    let g = G.get_or_init(|| match Gpu::open() {
        Ok(g) => Some(Arc::new(g)),
        Err(e) => {
            eprintln!("no Vulkan device, kernel tests skipped: {e}");
            None
        }
    });
    let g = g.as_ref()?;
    Some((g.clone(), Kernels::new(g).unwrap(), Runner::new(g).unwrap()))
}

fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn read(g: &Arc<Gpu>, run: &mut Runner, b: &Buffer, floats: usize) -> Vec<f32> {
    let mut back = Buffer::new(g, "back", (floats * 4) as u64, MemoryLocation::GpuToCpu).unwrap();
    run.barrier().unwrap();
    run.copy(b, 0, &back, 0, (floats * 4) as u64).unwrap();
    run.submit().unwrap();
    back.mapped()[..floats * 4].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// A weight of random blocks: every bit pattern of the quants is a valid block, so random bytes
/// with sane f16 scales exercise every path of a format's decoding.
fn weight(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Weight {
    let x = rand(rows * cols, seed);
    let rb = ty.row_bytes(cols);
    let mut data = vec![0u8; rb * rows];
    if matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
        for r in 0..rows {
            quantize_row(ty, &x[r * cols..(r + 1) * cols], &mut data[r * rb..(r + 1) * rb]);
        }
    } else {
        data.iter_mut().zip(&x).for_each(|(b, v)| *b = ((v + 1.0) * 127.9) as u8);
        let halves: &[usize] = match ty {
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
            GgmlType::Q6K => &[208],
            _ => &[0],
        };
        let bb = ty.block_bytes();
        for (i, b) in data.chunks_exact_mut(bb).enumerate() {
            for (j, &at) in halves.iter().enumerate() {
                let v = half::f16::from_f32(0.01 + 0.05 * x[(i * 7 + j) % x.len()].abs()).to_le_bytes();
                b[at..at + 2].copy_from_slice(&v);
            }
        }
    }
    Weight { ty, rows, cols, data: Bytes::Owned(Arc::new(data)), tiled: false, ggml_dot: None }
}

const FORMATS: [GgmlType; 11] = [
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
    GgmlType::Q6K,
];

#[allow(clippy::too_many_arguments)]
fn check_matmul(ty: GgmlType, w: &Weight, x: &[f32], y: &[f32], rows: usize, cols: usize, n: usize, variant: &str) {
    let mut row = vec![0f32; cols];
    for r in 0..rows {
        dequantize_row(ty, &w.data.as_slice()[r * ty.row_bytes(cols)..(r + 1) * ty.row_bytes(cols)], &mut row);
        for t in 0..n {
            let xr = &x[t * cols..(t + 1) * cols];
            let want: f64 = row.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum();
            let mag: f64 = row.iter().zip(xr).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            let got = y[t * rows + r] as f64;
            assert!((got - want).abs() <= 1e-5 * mag + 1e-6, "{variant} {} row {r} col {t}: {got} vs {want}", ty.name());
        }
    }
}

/// mul_mat (both forms) and get_rows of every format against the CPU's dequantization (an f64 dot of the
/// dequantized row): relative error 1e-5 of the row's absolute sum.
#[test]
fn matmul_and_gather_match_dequantized_rows() {
    let Some((g, mut k, mut run)) = gpu() else { return };
    let (rows, cols) = (70, 512);
    for ty in FORMATS {
        let w = weight(ty, rows, cols, ty as u64 + 1);
        let dw = upload_weight(&g, &mut run, "w", &w).unwrap();
        for n in [1usize, 3, 8, 11] {
            let x = rand(n * cols, 99 + n as u64);
            let xb = upload_f32(&g, &mut run, "x", &x).unwrap();
            let yb = Buffer::new(&g, "y", (n * rows * 4) as u64, MemoryLocation::GpuOnly).unwrap();
            for variant in ["mul_mat", "mul_mat_rows"] {
                let groups = if variant == "mul_mat" { rows } else { rows.div_ceil(64) };
                run.dispatch(
                    &mut k,
                    &format!("{variant}_{}", super::kernels::format_suffix(ty).unwrap()),
                    Push::default().addr(dw.buf.addr).addr(xb.addr).addr(yb.addr).u(rows).u(cols).u(n).u(dw.row_words).u(cols).u(rows).u(32768),
                    [groups as u32, n.div_ceil(8) as u32, 1],
                )
                .unwrap();
                let y = read(&g, &mut run, &yb, n * rows);
                check_matmul(ty, &w, &x, &y, rows, cols, n, variant);
            }
        }
        // get_rows: three token ids, scaled.
        let ids = [5u32, 0, 69];
        let idb = Buffer::new(&g, "ids", 12, MemoryLocation::CpuToGpu).unwrap();
        let mut idb = idb;
        idb.mapped()[..12].copy_from_slice(&ids.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<_>>());
        let out = Buffer::new(&g, "out", (3 * cols * 4) as u64, MemoryLocation::GpuOnly).unwrap();
        run.dispatch(
            &mut k,
            &format!("get_rows_{}", super::kernels::format_suffix(ty).unwrap()),
            Push::default().addr(dw.buf.addr).addr(out.addr).addr(idb.addr).u(cols).u(dw.row_words).f(0.5),
            [(cols / 16).div_ceil(64) as u32, 3, 1],
        )
        .unwrap();
        let got = read(&g, &mut run, &out, 3 * cols);
        let mut row = vec![0f32; cols];
        for (j, &id) in ids.iter().enumerate() {
            let rb = ty.row_bytes(cols);
            dequantize_row(ty, &w.data.as_slice()[id as usize * rb..(id as usize + 1) * rb], &mut row);
            for i in 0..cols {
                assert_eq!(got[j * cols + i], row[i] * 0.5, "{} get_rows id {id} value {i}", ty.name());
            }
        }
    }
}

