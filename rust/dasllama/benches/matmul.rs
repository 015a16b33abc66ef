//! Criterion benches of the matmul kernels, per weight format: one 576-wide row-block of
//! SmolLM2's shape, decode (1 activation row) and prefill (64 rows).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use dasllama::cpu::{matmul, Cpu, Weight};
use dasllama::quant::GgmlType;

fn bench(c: &mut Criterion) {
    let (rows, cols) = (1536, 768);
    let mut g = c.benchmark_group("matmul");
    let cpu = Cpu::new(0);
    for ty in GgmlType::WEIGHT_FORMATS {
        let w = Weight::random_blocks(ty, rows, cols, &cpu);
        for n in [1usize, 16, 64] {
            let x: Vec<f32> = (0..n * cols).map(|i| ((i % 97) as f32 - 48.0) * 0.01).collect();
            let mut out = vec![0.0f32; n * rows];
            let mut act = Vec::new();
            g.throughput(Throughput::Elements((rows * cols * n) as u64));
            g.bench_with_input(BenchmarkId::new(ty.name(), n), &n, |b, &n| b.iter(|| cpu.team().session(|t| matmul(&w, &x, n, &mut out, &mut act, t))));
        }
    }
    // Gemma 3's tied output head: 178 MB of Q8_0, far past the caches: decode is a memory stream.
    let (rows, cols) = (262144, 640);
    let w = Weight::random_blocks(GgmlType::Q8_0, rows, cols, &cpu);
    let x: Vec<f32> = (0..cols).map(|i| ((i % 97) as f32 - 48.0) * 0.01).collect();
    let (mut out, mut act) = (vec![0.0f32; rows], Vec::new());
    g.throughput(Throughput::Bytes(GgmlType::Q8_0.row_bytes(cols) as u64 * rows as u64));
    g.bench_function("Q8_0/head-262144x640/1", |b| b.iter(|| cpu.team().session(|t| matmul(&w, &x, 1, &mut out, &mut act, t))));
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(1)).warm_up_time(std::time::Duration::from_millis(300));
    targets = bench
}
criterion_main!(benches);
