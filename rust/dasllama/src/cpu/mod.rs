//! The CPU backend: the thread pool, the quantized matmul and the elementwise ops of the forward
//! pass. Ops that llama.cpp computes in a particular precision (f64 sums in norms and softmax,
//! f16 rounding of GELU inputs and attention operands) do the same here so results agree.

pub mod ops;

use crate::quant::{dequantize_row, dot_fn, quantize_row, GgmlType};
use rayon::prelude::*;
use std::sync::{Arc, OnceLock};

/// Threads to use: `DASLLAMA_THREADS`, else the number of physical cores.
pub fn n_threads() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("DASLLAMA_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(num_cpus::get_physical)
    })
}

/// The one rayon pool every kernel runs on.
pub fn pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n_threads())
            .thread_name(|i| format!("dasllama-{i}"))
            .build()
            .expect("failed to start the dasllama thread pool")
    })
}

/// Bytes of a weight: a window of the memory-mapped GGUF, or a buffer we converted at load.
#[derive(Clone)]
pub enum Bytes {
    Mapped { map: Arc<memmap2::Mmap>, offset: usize, len: usize },
    Owned(Arc<Vec<u8>>),
}

impl Bytes {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped { map, offset, len } => &map[*offset..*offset + *len],
            Bytes::Owned(v) => v,
        }
    }
}

/// A 2-D weight matrix of `rows` rows of `cols` values, stored row-major in GGUF blocks.
#[derive(Clone)]
pub struct Weight {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: Bytes,
}

impl Weight {
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols)
    }

    pub fn row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.data.as_slice()[r * rb..(r + 1) * rb]
    }

    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        dequantize_row(self.ty, self.row(r), &mut out[..self.cols]);
    }

    /// All values as f32 (norm vectors, QuantMode.fp32).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, o) in out.chunks_exact_mut(self.cols).enumerate() {
            self.dequantize_row(r, o);
        }
        out
    }
}

/// Raw pointer that rayon tasks may share because each writes a disjoint set of indices.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: `matmul` hands every task a disjoint range of output columns, so no two tasks
// write the same element and nothing reads the buffer until the parallel loop has joined.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

/// out[t][r] = dot(w[r], x[t]) for `n` activation rows x (each `w.cols` long).
///
/// Weight-stationary: each task walks a slice of weight rows and dots every row against all `n`
/// activation rows while it is hot in L1, so a batch of any size reads the weights once. Each
/// output element is computed by the same kernel whatever `n` is, so results do not depend on it.
pub fn matmul(w: &Weight, x: &[f32], n: usize, out: &mut [f32], act: &mut Vec<u8>) {
    let (k, m) = (w.cols, w.rows);
    assert_eq!(x.len(), n * k, "matmul input has the wrong size");
    assert!(out.len() >= n * m, "matmul output has the wrong size");
    let vt = w.ty.vec_dot_type();
    let arb = vt.row_bytes(k);
    act.resize(n * arb, 0);
    if n >= 8 {
        pool().install(|| {
            act.par_chunks_exact_mut(arb)
                .zip(x.par_chunks_exact(k))
                .for_each(|(a, xr)| quantize_row(vt, xr, a));
        });
    } else {
        for (a, xr) in act.chunks_exact_mut(arb).zip(x.chunks_exact(k)) {
            quantize_row(vt, xr, a);
        }
    }
    let dot = dot_fn(w.ty);
    let wb = w.data.as_slice();
    let wrb = w.row_bytes();
    let act = &act[..];
    let dst = SharedOut(out.as_mut_ptr());
    let threads = n_threads();
    // Enough tasks to balance the two halves of a big-core/little-core split, few enough that
    // the per-task overhead stays small against a 576-wide row.
    let chunk = (m / (threads * 4)).max(16).min(m.max(1));
    let run = |c: usize| {
        let dst = dst;
        let (lo, hi) = (c * chunk, ((c + 1) * chunk).min(m));
        for r in lo..hi {
            let wr = &wb[r * wrb..(r + 1) * wrb];
            for t in 0..n {
                let v = dot(wr, &act[t * arb..(t + 1) * arb], k);
                // SAFETY: column r belongs to this task alone; t*m + r < n*m <= out.len().
                unsafe { *dst.0.add(t * m + r) = v };
            }
        }
    };
    let n_chunks = m.div_ceil(chunk);
    if threads == 1 || n_chunks == 1 {
        (0..n_chunks).for_each(run);
    } else {
        pool().install(|| (0..n_chunks).into_par_iter().for_each(run));
    }
}

/// Convert a weight to another storage format at load (QuantMode.q8 / fp32).
pub fn convert_weight(w: &Weight, to: GgmlType) -> Weight {
    let rb = to.row_bytes(w.cols);
    let mut data = vec![0u8; rb * w.rows];
    pool().install(|| {
        data.par_chunks_exact_mut(rb).enumerate().for_each(|(r, o)| {
            let mut tmp = vec![0.0f32; w.cols];
            w.dequantize_row(r, &mut tmp);
            match to {
                GgmlType::Q8_0 => crate::quant::quantize_weights_q8_0(&tmp, o),
                GgmlType::F32 => quantize_row(GgmlType::F32, &tmp, o),
                other => panic!("cannot convert weights to {}", other.name()),
            }
        })
    });
    Weight { ty: to, rows: w.rows, cols: w.cols, data: Bytes::Owned(Arc::new(data)) }
}
