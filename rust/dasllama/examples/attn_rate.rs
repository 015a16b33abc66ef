//! Multiply-adds per second of the f16 attention kernels (`KvCodec::dot_rows` for q·k and
//! `axpy_rows` for p·v), one thread, as an attention task runs them: the query heads of one KV
//! head (a decode row's few, or a prefill block's many) against a prefix stored in pages.
//!
//!     cargo run --release -p dasllama --example attn_rate [-- heads ...]
//!
//! Heads of 64 values over 3,072 keys in pages of 16 rows, unless `ATTN_RATE_HD` and
//! `ATTN_RATE_PAGE` say otherwise (a session's own pages hold 256 rows).

use dasllama::kv::KvCodec;
use std::time::Instant;

fn main() {
    let mut heads: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("heads must be numbers")).collect();
    if heads.is_empty() {
        heads = vec![3, 4, 12, 30, 32];
    }
    let env = |name: &str, default: usize| std::env::var(name).ok().map_or(default, |v| v.parse().unwrap_or_else(|_| panic!("{name} must be a number")));
    let (hd, keys, page) = (env("ATTN_RATE_HD", 64), 3072, env("ATTN_RATE_PAGE", 16));
    let codec = KvCodec::F16;
    let rb = codec.bytes(hd);
    let vals: Vec<f32> = (0..keys * hd).map(|i| ((i * 7919 % 2000) as f32 - 1000.0) * 0.001).collect();
    let mut kv = vec![0u8; keys * rb];
    for (src, dst) in vals.chunks_exact(hd).zip(kv.chunks_exact_mut(rb)) {
        codec.encode(src, dst);
    }
    println!("| query heads | q·k G MAC/s | p·v G MAC/s |");
    println!("|---:|---:|---:|");
    for &h in &heads {
        let q: Vec<f32> = (0..h * hd).map(|i| ((i * 31 % 97) as f32 - 48.0) * 0.02).collect();
        let mut sc = vec![0.0f32; h * keys];
        let mut o = vec![0.0f32; h * hd];
        let macs = (h * keys * hd) as f64;
        let (mut best_qk, mut best_pv) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..7 {
            let t = Instant::now();
            for first in (0..keys).step_by(page) {
                codec.dot_rows(&q, hd, &kv[first * rb..(first + page) * rb], page, &mut sc[first..], keys);
            }
            best_qk = best_qk.min(t.elapsed().as_secs_f64());
            sc.iter_mut().for_each(|s| *s *= 1e-3);
            let t = Instant::now();
            for first in (0..keys).step_by(page) {
                codec.axpy_rows(&mut o, hd, &sc[first..], keys, &kv[first * rb..(first + page) * rb], page);
            }
            best_pv = best_pv.min(t.elapsed().as_secs_f64());
        }
        println!("| {h} | {:.1} | {:.1} |", macs / best_qk / 1e9, macs / best_pv / 1e9);
    }
}
