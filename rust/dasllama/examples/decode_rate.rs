//! One activation row (decode) through `matmul` over a weight larger than the caches: the bytes of
//! weights read per second, per format, for A/B comparisons of the one-row kernels against the
//! read bandwidth (`read_bw`). Threads: `DASLLAMA_THREADS`.
//!
//!     cargo run --release -p dasllama --example decode_rate [FORMAT ...] [-- ROWS COLS MIB]
//!
//! The matrix is copied until the copies hold MIB (default 1024) MiB, and a pass multiplies each
//! in turn, as a decode step walks its layers: no copy is still in the caches when its turn comes.
//! `DASLLAMA_PREFETCH=BYTES[:l1|l2]` sets decode's prefetch distance and cache, as it does for
//! the Python package. With one thread the rate is also given per second of the thread's CPU time, which another
//! process on a shared box does not stretch. Under valgrind (which has no AVX-512: the AVX2
//! kernels run) `--toggle-collect='*matmul_many*'` with a small MIB counts the instructions.

use dasllama::cpu::{matmul, Bytes, Cpu, Weight};
use dasllama::quant::GgmlType;
use std::time::Instant;

fn parse(name: &str) -> GgmlType {
    [GgmlType::IQ4NL, GgmlType::IQ4XS]
        .into_iter()
        .chain(GgmlType::WEIGHT_FORMATS)
        .find(|t| t.name().eq_ignore_ascii_case(name))
        .unwrap_or_else(|| panic!("unknown format {name}"))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let split = args.iter().position(|a| a == "--").unwrap_or(args.len());
    let mut types: Vec<GgmlType> = args[..split].iter().map(|a| parse(a)).collect();
    if types.is_empty() {
        types = vec![GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q4_0, GgmlType::Q8_0];
    }
    let nums: Vec<usize> = args.get(split + 1..).unwrap_or(&[]).iter().map(|a| a.parse().expect("ROWS COLS REPS are numbers")).collect();
    let (rows, cols, mib) = match nums[..] {
        [r, c, m] => (r, c, m),
        [] => (8192, 2048, 1024),
        _ => panic!("give ROWS COLS MIB"),
    };
    // `DASLLAMA_PREFETCH=BYTES[:l1|l2]`, as the Python edge reads it: decode's prefetch distance.
    if let Some((b, cache)) = std::env::var("DASLLAMA_PREFETCH").ok().and_then(|v| {
        let (b, c) = v.split_once(':').unwrap_or((&v, ""));
        Some((b.parse().ok()?, [("l1", 0), ("l2", 1)].iter().find(|(n, _)| *n == c).map(|p| p.1)))
    }) {
        let s = dasllama::quant::switches::Switches { prefetch: Some((b, cache)), ..Default::default() };
        dasllama::quant::switches::set(s).expect("the switches are set before any kernel runs");
    }
    let cpu = cpu();
    let one_thread = cpu.threads() == 1;
    for ty in types {
        let w = Weight::random_blocks(ty, rows, cols, &cpu);
        let src = w.data.as_slice();
        let copies = ((mib << 20) / src.len()).max(1);
        let ws: Vec<Weight> = (0..copies)
            .map(|_| {
                let mut span = cpu.arena().alloc(src.len());
                span.as_mut_slice().copy_from_slice(src);
                Weight { data: Bytes::Arena(span.freeze()), ..w.clone() }
            })
            .collect();
        let x: Vec<f32> = (0..cols).map(|i| ((i % 97) as f32 - 48.0) * 0.01).collect();
        let (mut out, mut act) = (vec![0.0f32; rows], Vec::new());
        let bytes = (ty.row_bytes(cols) * rows * copies) as f64;
        let (mut best, mut best_cpu) = (f64::MAX, f64::MAX);
        for _ in 0..7 {
            let (t0, c0) = (Instant::now(), thread_cpu_s());
            for w in &ws {
                cpu.team().session(|t| matmul(w, &x, 1, &mut out, &mut act, t));
            }
            best = best.min(t0.elapsed().as_secs_f64());
            best_cpu = best_cpu.min(thread_cpu_s() - c0);
        }
        let cpu = if one_thread { format!(", {:.2} GB/s of CPU time", bytes / best_cpu / 1e9) } else { String::new() };
        println!("{:<6} {rows}x{cols} x{copies}: {:.2} GB/s{cpu} (best of 7, {:.0} MB)", ty.name(), bytes / best / 1e9, bytes / 1e6);
    }
}

/// The CPU backend the example runs on: `DASLLAMA_THREADS` threads, else one per physical core.
fn cpu() -> Cpu {
    Cpu::new(std::env::var("DASLLAMA_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(0))
}

/// This thread's CPU time in seconds.
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
