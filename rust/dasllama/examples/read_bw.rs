//! The read bandwidth one and two threads get from memory: a streaming read (sum of 64-bit words)
//! over a buffer far larger than the caches, best of several passes. `benches/bench_decode.py`
//! prints each decode figure as a share of it, so a kernel's distance from the machine's limit
//! shows beside its tokens/s.
//!
//!     cargo run --release -p dasllama --example read_bw [MIB] [-- threads ...]
//!
//! Prints one line per thread count: `threads N GB/s X`.

use std::time::Instant;

/// Bytes summed as 64-bit words, eight independent sums so the adds never wait on each other.
fn sum_words(b: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { sum_words_avx2(b) };
    }
    sum_words_plain(b)
}

/// `sum_words_plain` compiled for AVX2: 256-bit loads, as the kernels read.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_words_avx2(b: &[u64]) -> u64 {
    sum_words_plain(b)
}

#[inline(always)]
fn sum_words_plain(b: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    for c in b.chunks_exact(8) {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(v);
        }
    }
    acc.iter().fold(0, |s, &a| s.wrapping_add(a))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let split = args.iter().position(|a| a == "--").unwrap_or(args.len());
    let mib: usize = args.first().filter(|_| split > 0).map(|a| a.parse().expect("MiB must be a number")).unwrap_or(2048);
    let mut threads: Vec<usize> = args.get(split + 1..).unwrap_or(&[]).iter().map(|a| a.parse().expect("threads must be numbers")).collect();
    if threads.is_empty() {
        threads = vec![1, 2];
    }
    let words = (mib << 20) / 8;
    // Written first, so that every page is backed by memory of its own (not the shared zero page).
    let buf: Vec<u64> = (0..words as u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
    for &nt in &threads {
        let part = words.div_ceil(nt).next_multiple_of(8);
        let mut best = f64::MAX;
        let mut check = 0u64;
        for _ in 0..5 {
            let t0 = Instant::now();
            check ^= std::thread::scope(|s| {
                let hs: Vec<_> = buf.chunks(part).map(|p| s.spawn(move || sum_words(p))).collect();
                hs.into_iter().fold(0u64, |x, h| x ^ h.join().expect("a reader thread panicked"))
            });
            best = best.min(t0.elapsed().as_secs_f64());
        }
        // The checksum keeps the reads from being optimised away.
        println!("threads {nt} GB/s {:.2} (check {:x})", (words * 8) as f64 / best / 1e9, check & 0xF);
    }
}
