//! Multiply-adds per second of the quantized matmul at Llama-3.2-1B's FFN shapes (2048 -> 8192 and
//! 8192 -> 2048), per weight format and number of activation rows: the GEMM kernels' rate for
//! `--peak-gmacs` and for A/B comparisons of kernels. Threads: `DASLLAMA_THREADS`.
//!
//!     cargo run --release -p dasllama --example gemm_rate [FORMAT ...] [-- rows ...]
//!
//! With `GEMM_RATE_VARIANTS=1`: every tile kernel variant of each format, one thread, side by side,
//! and the AMX kernel's line (or why it does not run here). Without it, a first line says whether
//! AMX runs; `DASLLAMA_NO_AMX=1` gives the vector kernels' rate on an AMX box.
//! With `GEMM_RATE_SHAPE=ROWSxCOLS`: that shape instead of the second (one larger than the caches
//! gives a decode row's rate from memory).

use dasllama::cpu::{matmul, Cpu, Weight};
use dasllama::quant::GgmlType;
use std::time::Instant;

fn parse(name: &str) -> GgmlType {
    GgmlType::WEIGHT_FORMATS.into_iter().find(|t| t.name().eq_ignore_ascii_case(name)).unwrap_or_else(|| panic!("unknown format {name}"))
}

fn main() {
    let cpu = cpu();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let split = args.iter().position(|a| a == "--").unwrap_or(args.len());
    let mut types: Vec<GgmlType> = args[..split].iter().map(|a| parse(a)).collect();
    if types.is_empty() {
        types = vec![GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K];
    }
    let mut ns: Vec<usize> = args.get(split + 1..).unwrap_or(&[]).iter().map(|a| a.parse().expect("rows must be numbers")).collect();
    if ns.is_empty() {
        ns = vec![1, 16, 64];
    }
    #[cfg(target_arch = "x86_64")]
    if std::env::var_os("GEMM_RATE_PEAK").is_some() && is_x86_feature_detected!("avx2") {
        return peak();
    }
    if std::env::var_os("GEMM_RATE_VARIANTS").is_some() {
        #[cfg(target_arch = "x86_64")]
        for &ty in &types {
            for &n in &ns {
                variants(ty, n);
            }
        }
        return;
    }
    let shape = std::env::var("GEMM_RATE_SHAPE").ok().map(|s| {
        let (r, c) = s.split_once('x').expect("GEMM_RATE_SHAPE is ROWSxCOLS");
        (r.parse::<usize>().expect("rows"), c.parse::<usize>().expect("cols"))
    });
    let (rows2, cols2) = shape.unwrap_or((2048, 8192));
    let (amx_on, amx_why) = dasllama::quant::amx::status();
    println!("amx: {amx_why}");
    if *amx_on {
        // The walk below goes through AMX for the formats it covers from 32 rows (amx::worth); DASLLAMA_NO_AMX=1
        // gives the vector kernels' rate on the same box for comparison.
        let covered: Vec<&str> = types.iter().filter(|t| dasllama::quant::amx::supports(**t)).map(|t| t.name()).collect();
        println!("amx: the lines of {covered:?} with 32 rows or more are AMX's");
    }
    println!("{:<6} {:>5} {:>12} {:>12}", "format", "rows", "2048->8192", format!("{cols2}->{rows2}"));
    for ty in types {
        let ws = [Weight::random_blocks(ty, 8192, 2048, &cpu), Weight::random_blocks(ty, rows2, cols2, &cpu)];
        for &n in &ns {
            let mut rates = Vec::new();
            for w in &ws {
                let x: Vec<f32> = (0..n * w.cols).map(|i| ((i % 97) as f32 - 48.0) * 0.01).collect();
                let (mut out, mut act) = (vec![0.0f32; n * w.rows], Vec::new());
                let macs = (w.rows * w.cols * n) as f64;
                let reps = ((4e9 / macs) as usize).clamp(3, 2000);
                let mut best = f64::MAX;
                for _ in 0..3 {
                    let t0 = Instant::now();
                    for _ in 0..reps {
                        cpu.team().session(|t| matmul(w, &x, n, &mut out, &mut act, t));
                    }
                    best = best.min(t0.elapsed().as_secs_f64() / reps as f64);
                }
                rates.push(macs / best / 1e9);
            }
            println!("{:<6} {:>5} {:>10.1} G {:>10.1} G", ty.name(), n, rates[0], rates[1]);
        }
    }
}

/// Every tile kernel variant of `ty` on one thread, walked as `matmul` walks them (sixteen
/// activation rows per pass over a pair of tiles, eight per call): the kernels' own rate, for A/B.
#[cfg(target_arch = "x86_64")]
fn variants(ty: GgmlType, n: usize) {
    use dasllama::quant::tile::{tile_bytes, TILE_ROWS};
    use dasllama::quant::{act_row_bytes, quantize_row};
    // GEMM_RATE_AMX_ONLY=1: the AMX line alone at the two FFN shapes (quicker A/B of its kernel).
    let amx_only = std::env::var_os("GEMM_RATE_AMX_ONLY").is_some();
    let shapes: &[(usize, usize)] = if amx_only { &[(8192, 2048), (2048, 8192)] } else { &[(8192, 2048), (2048, 8192), (64, 256), (256, 2048)] };
    for &(rows, cols) in shapes {
        let w = Weight::random_blocks(ty, rows, cols, &Cpu::new(1));
        let vt = ty.vec_dot_type();
        let arb = act_row_bytes(vt, cols);
        let mut act = vec![0u8; n * arb];
        for (t, a) in act.chunks_exact_mut(arb).enumerate() {
            let x: Vec<f32> = (0..cols).map(|i| (((i + 7 * t) % 97) as f32 - 48.0) * 0.01).collect();
            quantize_row(vt, &x, a);
        }
        let tb = tile_bytes(ty, cols);
        let wb = w.data.as_slice();
        // This thread's CPU time, interleaved, best of many: the box is shared.
        let vs = if amx_only { Vec::new() } else { dasllama::quant::avx2::tile_variants(ty) };
        let mut best = vec![f64::MAX; vs.len()];
        let mut out = [[0.0f32; TILE_ROWS]; 16];
        for _ in 0..15 {
            for (i, (_, f)) in vs.iter().enumerate() {
                let t0 = thread_cpu_s();
                for t0 in (0..n).step_by(16) {
                    let t1 = (t0 + 16).min(n);
                    for pair in wb.chunks_exact(2 * tb) {
                        for t in (t0..t1).step_by(8) {
                            let nt = (t1 - t).min(8);
                            let acts: Vec<&[u8]> = (t..t + nt).map(|j| &act[j * arb..(j + 1) * arb]).collect();
                            f(pair, &acts, cols, &mut out[..2 * nt]);
                        }
                    }
                }
                best[i] = best[i].min(thread_cpu_s() - t0);
            }
        }
        for ((name, _), b) in vs.iter().zip(best) {
            println!("{:<6} {:>5} {:>5}x{:<5} {:<9} {:>8.1} G", ty.name(), n, rows, cols, name, (rows * cols * n) as f64 / b / 1e9);
        }
        amx_variant(ty, n, &w, &act, arb);
    }
}

/// The AMX kernel on the same walk (a pair of tiles against up to 64 activation rows a call), or
/// a line saying why it does not run here.
#[cfg(target_arch = "x86_64")]
fn amx_variant(ty: GgmlType, n: usize, w: &Weight, act: &[u8], arb: usize) {
    use dasllama::quant::amx;
    use dasllama::quant::tile::tile_bytes;
    let (rows, cols) = (w.rows, w.cols);
    if !amx::supports(ty) {
        return println!("{:<6} {:>5} {:>5}x{:<5} {:<9} no AMX kernel for this format", ty.name(), n, rows, cols, "amx");
    }
    let (on, why) = amx::status();
    if !*on || n < 2 {
        let why = if *on { "one row runs on the vector kernels" } else { why.trim_start_matches("off: ") };
        return println!("{:<6} {:>5} {:>5}x{:<5} {:<9} {why}", ty.name(), n, rows, cols, "amx");
    }
    let tb = tile_bytes(ty, cols);
    let wb = w.data.as_slice();
    let mut out = vec![[0.0f32; amx::COLS]; amx::MAX_ROWS];
    let mut best = f64::MAX;
    for _ in 0..15 {
        let t0 = thread_cpu_s();
        for pair in wb.chunks(2 * tb) {
            for t in (0..n).step_by(amx::MAX_ROWS) {
                let nt = (n - t).min(amx::MAX_ROWS);
                amx::gemm(ty, pair, pair.len() / tb, amx::Acts { bytes: &act[t * arb..], stride: arb, rows: nt }, cols, &mut out[..nt]);
            }
        }
        best = best.min(thread_cpu_s() - t0);
    }
    println!("{:<6} {:>5} {:>5}x{:<5} {:<9} {:>8.1} G", ty.name(), n, rows, cols, "amx", (rows * cols * n) as f64 / best / 1e9);
}

/// Seconds of CPU this thread has used (what the kernel costs, whatever else the box runs).
#[cfg(target_arch = "x86_64")]
fn thread_cpu_s() -> f64 {
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut ts = Timespec { sec: 0, nsec: 0 };
    // SAFETY: clock_gettime writes one timespec, which `ts` is (64-bit Linux layout).
    unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.sec as f64 + ts.nsec as f64 * 1e-9
}

/// Peak of the int8 multiply-add stream on one thread: `vpmaddubsw` of eight weight vectors
/// against four activation rows (broadcast from memory), summed as i16 (`i16`) or widened
/// with `vpmaddwd` and summed as i32 (`i32`), and with the activations already in registers.
#[cfg(target_arch = "x86_64")]
fn peak() {
    use std::arch::x86_64::*;
    #[target_feature(enable = "avx2")]
    unsafe fn stream<const MODE: u8>(a: &[u8], iters: usize) -> i32 {
        let mut w = [_mm256_setzero_si256(); 8];
        for (i, v) in w.iter_mut().enumerate() {
            *v = _mm256_set1_epi8(i as i8);
        }
        let mut acc = [_mm256_setzero_si256(); 4];
        let ones = _mm256_set1_epi16(1);
        let pre: [__m256i; 4] = std::array::from_fn(|r| _mm256_set1_epi32(r as i32));
        for it in 0..iters {
            let p = a.as_ptr().add((it & 63) * 128);
            for (c, wc) in w.iter().enumerate() {
                for r in 0..4 {
                    let y = if MODE == 2 { pre[r] } else { _mm256_set1_epi32((p.add(32 * r + 4 * c) as *const i32).read_unaligned()) };
                    let m = _mm256_maddubs_epi16(*wc, y);
                    acc[r] = if MODE == 1 { _mm256_add_epi32(acc[r], _mm256_madd_epi16(m, ones)) } else { _mm256_add_epi16(acc[r], m) };
                }
            }
        }
        let s = _mm256_add_epi32(_mm256_add_epi32(acc[0], acc[1]), _mm256_add_epi32(acc[2], acc[3]));
        _mm256_extract_epi32::<0>(s)
    }
    let a: Vec<u8> = (0..64 * 128 + 64).map(|i| (i % 7) as u8).collect();
    let iters = 2_000_000;
    for (name, mode) in [("i16, broadcast", 0u8), ("i32, broadcast", 1), ("i16, registers", 2)] {
        let mut best = f64::MAX;
        let mut sink = 0;
        for _ in 0..7 {
            let t0 = thread_cpu_s();
            // SAFETY: AVX2 is checked below; loads stay within `a`.
            sink += unsafe {
                match mode {
                    0 => stream::<0>(&a, iters),
                    1 => stream::<1>(&a, iters),
                    _ => stream::<2>(&a, iters),
                }
            };
            best = best.min(thread_cpu_s() - t0);
        }
        println!("peak {name:<16} {:>8.1} G int8 multiply-adds/s (one thread) [{sink}]", (iters * 32 * 32) as f64 / best / 1e9);
    }
}

/// The CPU backend the example runs on: `DASLLAMA_THREADS` threads, else one per physical core.
fn cpu() -> Cpu {
    Cpu::new(std::env::var("DASLLAMA_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(0))
}
