//! The CPU backend: the thread pool, the quantized matmul and the elementwise ops of the forward
//! pass. Ops that llama.cpp computes in a particular precision (f64 sums in norms and softmax,
//! f16 rounding of GELU inputs and attention operands) do the same here so results agree.

pub mod backend;
pub mod deltanet;
pub mod dense;
mod kv_dot;
pub mod ops;
pub mod pass;
pub mod spin;

pub use spin::Session as Team;

use crate::quant::switches::{self, Choice};
use crate::quant::tile::{self, TILE_ROWS};
use crate::quant::{act_row_bytes, float_act_bytes, kernels, quantize_row, widen_row, GgmlType, Kernels};
use crate::quant::{amx, arena::Arena};
pub use crate::quant::{Bytes, Weight};
use rayon::prelude::*;
use std::sync::{Arc, OnceLock};

/// The CPU backend of one runtime: the thread team the forward pass runs on, the rayon pool for
/// load-time work (tiling, conversions), and the arena its tiled weights live in. Each starts on
/// first use; nothing here is shared with another runtime's CPU backend, so two models served by
/// two runtimes never wait for each other's passes.
pub struct Cpu {
    threads: usize,
    /// The kernels this runtime runs: its threads carry the choice, and its weights are laid out
    /// for them.
    kernels: Choice,
    team: OnceLock<spin::Team>,
    pool: OnceLock<rayon::ThreadPool>,
    arena: Arena,
}

impl Cpu {
    /// A backend of `threads` threads (0: one per physical core) on the process's default kernels.
    pub fn new(threads: usize) -> Cpu {
        Cpu::with_kernels(threads, Choice::default())
    }

    /// A backend of `threads` threads running the kernels `kernels` chooses.
    pub fn with_kernels(threads: usize, kernels: Choice) -> Cpu {
        let threads = if threads == 0 { num_cpus::get_physical() } else { threads };
        Cpu { threads, kernels, team: OnceLock::new(), pool: OnceLock::new(), arena: Arena::new() }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    pub fn kernels(&self) -> Choice {
        self.kernels
    }

    /// The forward pass's team (started on first use).
    pub fn team(&self) -> &spin::Team {
        self.team.get_or_init(|| spin::Team::with_kernels(self.threads, self.kernels))
    }

    /// The rayon pool for load-time work; the forward pass runs on `team`.
    pub fn pool(&self) -> &rayon::ThreadPool {
        self.pool.get_or_init(|| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(self.threads)
                .thread_name(|i| format!("dasllama-{i}"))
                .start_handler({
                    let kernels = self.kernels;
                    move |_| switches::adopt(kernels)
                })
                .build()
                .unwrap_or_else(|e| panic!("failed to start the dasllama thread pool ({} threads): {e}", self.threads))
        })
    }

    pub fn arena(&self) -> &Arena {
        &self.arena
    }
}

/// The CPU's layout of a weight: what `backend::Host::prepare` gives the loader.
impl Weight {
    /// A matrix of pseudo-random blocks with every f16 field finite, in the kernels' layout: what
    /// the kernel benches (`benches/matmul.rs`, `examples/gemm_rate.rs`) multiply by.
    #[doc(hidden)]
    pub fn random_blocks(ty: GgmlType, rows: usize, cols: usize, cpu: &Cpu) -> Weight {
        let mut state = 0x9E37_79B9u64;
        let mut data: Vec<u8> = (0..ty.row_bytes(cols) * rows)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                (state >> 56) as u8
            })
            .collect();
        // Clear the exponent's top bit of every second byte.
        for b in data.iter_mut().skip(1).step_by(2) {
            *b &= 0x3B;
        }
        // MXFP4's scale is a power of two in a byte of its own: keep it near 1 (no infinities, and
        // no subnormals, which some CPUs multiply slowly).
        if ty == GgmlType::MXFP4 {
            data.chunks_exact_mut(ty.block_bytes()).for_each(|b| b[0] = 120 + b[0] % 8);
        }
        Weight { ty, rows, cols, data: Bytes::Owned(std::sync::Arc::new(data)), tiled: false, ggml_dot: None }.for_kernels(cpu)
    }

    /// Put the rows in the layout the kernels of `cpu`'s runtime read (a copy in its arena, when
    /// that means tiling).
    pub fn for_kernels(self, cpu: &Cpu) -> Weight {
        if self.tiled || !matches!(switches::with(cpu.kernels, || kernels(self.ty)), Kernels::Tiles(_)) {
            return self;
        }
        let (rb, tb) = (self.row_bytes(), tile::tile_bytes(self.ty, self.cols));
        let mut data = cpu.arena().alloc(tb * self.rows.div_ceil(TILE_ROWS));
        let src = self.data.as_slice();
        cpu.pool().install(|| {
            data.as_mut_slice().par_chunks_exact_mut(tb).enumerate().for_each(|(ti, o)| {
                let rows: Vec<&[u8]> = (ti * TILE_ROWS..((ti + 1) * TILE_ROWS).min(self.rows)).map(|r| &src[r * rb..(r + 1) * rb]).collect();
                tile::tile_rows(self.ty, &rows, o)
            })
        });
        Weight { data: Bytes::Arena(data.freeze()), tiled: true, ..self }
    }
}

/// Raw pointer that rayon tasks may share because each writes a disjoint set of indices.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: `matmul_many` hands every task a disjoint range of output columns, so no two tasks
// write the same element and nothing reads the buffers until the parallel loop has joined.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

/// Activation rows dotted against one weight row per pass of the inner loop: at least this many
/// (a tile that stays in L1 while a task walks its weight rows for any width).
const TOKEN_TILE: usize = 16;
/// Activation bytes a tile kernel task keeps in L1 while it walks its weight rows.
const TOKEN_BYTES: usize = 24 << 10;

/// Activation rows per walk over a task's weight rows: as many as `TOKEN_BYTES` holds (at least
/// `TOKEN_TILE`), in walks of even length, so that a row or two past a walk (a verify chunk, a
/// seventeenth stream) do not walk the weights again alone: a task's share of a large matrix,
/// such as the output one, outgrows L2 and would come from memory a second time.
fn token_tile(n: usize, act_row_bytes: usize) -> usize {
    let fit = (TOKEN_BYTES / act_row_bytes.max(1)).max(TOKEN_TILE) / MAX_R * MAX_R;
    if n <= fit {
        n.max(1)
    } else {
        // Even walks: no short one at the end.
        n.div_ceil(n.div_ceil(fit)).next_multiple_of(MAX_R)
    }
}

/// Activation rows per tile kernel call.
const MAX_R: usize = 8;

/// out[t][r] = dot(w[r], x[t]) for `n` activation rows x (each `w.cols` long).
pub fn matmul(w: &Weight, x: &[f32], n: usize, out: &mut [f32], act: &mut Vec<u8>, team: &Team) {
    matmul_many(&mut [(w, out)], x, &[n], act, team);
}

/// Several matmuls of the same input (Q/K/V, gate/up) as one parallel pass.
///
/// Weight-stationary: each task owns a slice of one weight's rows and dots every row against all
/// `n` activation rows, a tile at a time, while the row is hot in L1, so a batch of any size reads
/// the weights once. Each output element is computed by the same kernel arithmetic whatever `n`
/// is (the 4-row kernels are bit-identical to the 1-row ones), so results never depend on it.
///
/// `counts` splits the rows into sessions; only ggml's order (`Weight::ggml_dot`) looks at it.
pub fn matmul_many(segs: &mut [(&Weight, &mut [f32])], x: &[f32], counts: &[usize], act: &mut Vec<u8>, team: &Team) {
    let n: usize = counts.iter().sum();
    let k = segs[0].0.cols;
    let vt = segs[0].0.ty.vec_dot_type();
    for (w, out) in segs.iter() {
        assert!(w.cols == k && w.ty.vec_dot_type() == vt, "fused matmuls need the same input format");
        assert!(out.len() >= n * w.rows, "matmul output has the wrong size");
    }
    assert_eq!(x.len(), n * k, "matmul input has the wrong size");
    // The float kernels read f32 activations (rounded through `vt` as usual), widened here once
    // rather than in the kernel for every weight row. ggml's order reads `vt`'s own layout.
    let widen = matches!(kernels(segs[0].0.ty), Kernels::Floats(_)) && segs.iter().all(|(w, _)| w.ggml_dot.is_none());
    let arb = if widen { float_act_bytes(k) } else { act_row_bytes(vt, k) };
    let fill = |t: usize, a: &mut [u8]| {
        let xr = &x[t * k..(t + 1) * k];
        if widen {
            widen_row(vt, xr, a)
        } else {
            quantize_row(vt, xr, a)
        }
    };
    act.resize(n * arb, 0);
    if n >= 8 {
        team.for_each_row_mut(&mut act[..n * arb], arb, &fill);
    } else {
        for (t, a) in act.chunks_exact_mut(arb).enumerate() {
            fill(t, a);
        }
    }
    let act = &act[..];
    let positions = if segs.iter().any(|(w, _)| w.ggml_dot.is_some()) { crate::quant::ggml::row_positions(counts) } else { Vec::new() };
    let threads = team.threads();
    // Enough tasks to balance uneven cores, few enough that per-task overhead stays small. In
    // decode a core that another tenant slows holds the rest at the end of every matmul, and
    // with one task a thread nothing can take its share: eight, of 64 KB at least (Gemma 3
    // 270M's smallest matmul is 368 KB), cut the time spent waiting from 9% of samples to 4-5%
    // (1B Q4_K_M) and from 14-15% to 11% (Gemma 3 270M; 2 threads, AMD EPYC Zen 3, shared VM).
    let shares = if n < 4 {
        let bytes: usize = segs.iter().map(|(w, _)| w.rows * w.row_bytes()).sum();
        (threads * 8).min(bytes / (64 << 10)).max(threads)
    } else {
        threads * 4
    };
    let (pieces, tasks) = split_by_bytes(segs.iter().map(|(w, _)| (w.rows, w.row_bytes())), shares);
    let tt = token_tile(n, arb);
    let ptrs: Vec<(&Weight, SharedOut)> = segs.iter_mut().map(|(w, o)| (&**w, SharedOut(o.as_mut_ptr()))).collect();
    let run = |&(si, lo, hi): &(usize, usize, usize)| {
        let (w, dst) = (ptrs[si].0, ptrs[si].1);
        let m = w.rows;
        let wb = w.data.as_slice();
        let arow = |t: usize| &act[t * arb..(t + 1) * arb];
        // SAFETY (both writers): columns lo..hi of this segment belong to this task alone, and
        // t*m + r < n*m <= the output's length (asserted above).
        let put = |t: usize, r: usize, v: f32| unsafe { *dst.0.add(t * m + r) = v };
        // SAFETY: as `put`, for the eight columns r..r+8 (callers check r + 8 <= hi).
        let put_tile = |t: usize, r: usize, v: &[f32; TILE_ROWS]| unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), dst.0.add(t * m + r), TILE_ROWS) };
        if let Some(dots) = w.ggml_dot {
            let wrb = w.row_bytes();
            for r in lo..hi {
                let wr = &wb[r * wrb..(r + 1) * wrb];
                for (t, &(j, c)) in positions.iter().enumerate() {
                    let dot = if (dots.takes_grouped)(j, c) { dots.grouped } else { dots.single };
                    put(t, r, dot(wr, arow(t), k));
                }
            }
            return;
        }
        match kernels(w.ty) {
            Kernels::Tiles(tile_fn) => {
                assert!(w.tiled, "a {} weight in GGUF rows met the tile kernels: it was laid out for another runtime's kernels", w.ty.name());
                let tb = tile::tile_bytes(w.ty, k);
                if amx::worth(k, n) && amx::usable(w.ty) {
                    // AMX: a pair of tiles (sixteen weight rows) against up to `amx::MAX_ROWS`
                    // activation rows a call, bit-identical to the vector kernels (one-row decode
                    // stays on those).
                    let mut out = [[0.0f32; amx::COLS]; amx::MAX_ROWS];
                    // Walks of as many rows as L2 holds beside the weights (`amx::walk_rows`),
                    // evenly cut in whole A tiles: each pair's B tiles are unpacked once a walk,
                    // for every A tile of it (the A tiles load from L2 as well as L1).
                    let cap = amx::walk_rows(arb);
                    let tt = n.div_ceil(n.div_ceil(cap)).next_multiple_of(16).min(cap);
                    for t0 in (0..n).step_by(tt) {
                        let t1 = (t0 + tt).min(n);
                        // Tasks start on multiples of sixteen rows, so pairs of tiles line up.
                        for r0 in (lo..hi).step_by(amx::COLS) {
                            let tiles = if r0 + TILE_ROWS < hi { 2 } else { 1 };
                            let wt = &wb[r0 / TILE_ROWS * tb..][..tiles * tb];
                            for t in (t0..t1).step_by(amx::MAX_ROWS) {
                                let nt = (t1 - t).min(amx::MAX_ROWS);
                                amx::gemm(w.ty, wt, tiles, amx::Acts { bytes: &act[t * arb..], stride: arb, rows: nt }, k, &mut out[..nt]);
                                for (j, o) in out[..nt].iter().enumerate() {
                                    for (r, &v) in (r0..hi.min(r0 + amx::COLS)).zip(o) {
                                        put(t + j, r, v);
                                    }
                                }
                            }
                        }
                    }
                    return;
                }
                let mut out = [[0.0f32; TILE_ROWS]; 2 * MAX_R];
                for t0 in (0..n).step_by(tt) {
                    let t1 = (t0 + tt).min(n);
                    let mut r0 = lo;
                    while r0 < hi {
                        // Two tiles a call where the task has them: two memory streams in decode,
                        // and one 512-bit register across both tiles' rows where AVX-512 is there.
                        let tiles = if r0 + 2 * TILE_ROWS <= hi { 2 } else { 1 };
                        let wt = &wb[r0 / TILE_ROWS * tb..][..tiles * tb];
                        for t in (t0..t1).step_by(MAX_R) {
                            let nt = (t1 - t).min(MAX_R);
                            let acts: [&[u8]; MAX_R] = std::array::from_fn(|j| arow((t + j).min(t1 - 1)));
                            tile_fn(wt, &acts[..nt], k, &mut out[..tiles * nt]);
                            for (i, o) in out[..tiles * nt].iter().enumerate() {
                                let (rt, j) = (r0 + i / nt * TILE_ROWS, i % nt);
                                if rt + TILE_ROWS <= hi {
                                    put_tile(t + j, rt, o);
                                } else {
                                    for (r, &v) in (rt..hi).zip(o) {
                                        put(t + j, r, v);
                                    }
                                }
                            }
                        }
                        r0 += tiles * TILE_ROWS;
                    }
                }
            }
            Kernels::Floats(dots) => {
                let wrb = w.row_bytes();
                let mut o = [0.0f32; 16];
                for t0 in (0..n).step_by(tt) {
                    let t1 = (t0 + tt).min(n);
                    for r in (lo..hi).step_by(4) {
                        let nw = (hi - r).min(4);
                        let wrs: [&[u8]; 4] = std::array::from_fn(|i| &wb[(r + i.min(nw - 1)) * wrb..][..wrb]);
                        for t in (t0..t1).step_by(4) {
                            let nt = (t1 - t).min(4);
                            let acts: [&[u8]; 4] = std::array::from_fn(|j| arow((t + j).min(t1 - 1)));
                            dots(&wrs[..nw], &acts[..nt], k, &mut o[..nw * nt]);
                            for (i, row) in o[..nw * nt].chunks_exact(nt).enumerate() {
                                for (j, &v) in row.iter().enumerate() {
                                    put(t + j, r + i, v);
                                }
                            }
                        }
                    }
                }
            }
            Kernels::Rows(dot) => {
                assert!(!w.tiled, "a tiled {} weight met the row kernels: it was laid out for another runtime's kernels", w.ty.name());
                let wrb = w.row_bytes();
                for t0 in (0..n).step_by(tt) {
                    for r in lo..hi {
                        let wr = &wb[r * wrb..(r + 1) * wrb];
                        for t in t0..(t0 + tt).min(n) {
                            put(t, r, dot(wr, arow(t), k));
                        }
                    }
                }
            }
        }
    };
    let task = |i: usize| pieces[tasks[i]..tasks[i + 1]].iter().for_each(run);
    if threads == 1 || tasks.len() == 2 {
        (0..tasks.len() - 1).for_each(task);
    } else {
        team.parallel_for(tasks.len() - 1, &task);
    }
}

/// Cuts the rows of several matrices ((rows, bytes a row) each) into about `shares` tasks of
/// equal bytes of weights: one row step reads its weights once, so bytes, not rows, are its
/// time, and fused matrices of different formats (Q4_K_M's Q6_K V beside a Q4_K Q and K) or
/// shapes would leave a core idle if cut by rows. A task is a run of pieces (matrix, first row,
/// end row), each starting on a multiple of sixteen rows, so pairs of tiles line up. Returns the
/// pieces and the bounds of the tasks' runs in them (task i: pieces[b[i]..b[i + 1]]).
fn split_by_bytes(mats: impl Iterator<Item = (usize, usize)>, shares: usize) -> (Vec<(usize, usize, usize)>, Vec<usize>) {
    const STEP: usize = 2 * TILE_ROWS;
    let mats: Vec<(usize, usize)> = mats.collect();
    let total: usize = mats.iter().map(|&(rows, rb)| rows * rb).sum();
    let share = total.div_ceil(shares.max(1)).max(1);
    let (mut pieces, mut bounds) = (Vec::new(), vec![0]);
    let mut filled = 0;
    for (si, &(rows, rb)) in mats.iter().enumerate() {
        let mut lo = 0;
        while lo < rows {
            // The rows left in this share, to the nearest step (a whole step at least, so an
            // empty share still takes some).
            let room = share.saturating_sub(filled);
            let take = ((room + STEP / 2 * rb) / (STEP * rb) * STEP).max(STEP);
            let hi = (lo + take).min(rows);
            pieces.push((si, lo, hi));
            filled += (hi - lo) * rb;
            lo = hi;
            if filled + STEP / 2 * rb > share {
                bounds.push(pieces.len());
                filled = 0;
            }
        }
    }
    if bounds.last() != Some(&pieces.len()) {
        bounds.push(pieces.len());
    }
    (pieces, bounds)
}

/// Convert a weight to another storage format at load (QuantMode.q8 / fp32).
pub fn convert_weight(w: &Weight, to: GgmlType, pool: &rayon::ThreadPool) -> Weight {
    let rb = to.row_bytes(w.cols);
    let mut data = vec![0u8; rb * w.rows];
    pool.install(|| {
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
    Weight { ty: to, rows: w.rows, cols: w.cols, data: Bytes::Owned(Arc::new(data)), tiled: false, ggml_dot: None }
}

#[cfg(test)]
mod tests {
    use super::split_by_bytes;

    /// Every row in exactly one piece, pieces on multiples of sixteen rows, and the tasks' bytes
    /// within a step of rows of the largest (the last may be short).
    #[test]
    fn tasks_split_rows_by_bytes() {
        // Llama-3.2-1B's Q, K (Q4_K, 1152 bytes a row of 2048) and V (Q6_K, 1680), an FFN pair,
        // the Q6_K output head, and odd sizes.
        let cases: [&[(usize, usize)]; 5] =
            [&[(2048, 1152), (512, 1152), (512, 1680)], &[(8192, 1152), (8192, 1152)], &[(49152, 1680)], &[(40, 34), (8, 34), (100, 210)], &[(3, 18)]];
        for mats in cases {
            for shares in 1..=9 {
                let (pieces, bounds) = split_by_bytes(mats.iter().copied(), shares);
                for (si, &(rows, _)) in mats.iter().enumerate() {
                    let mut mine: Vec<(usize, usize)> = pieces.iter().filter(|p| p.0 == si).map(|p| (p.1, p.2)).collect();
                    mine.sort();
                    let mut at = 0;
                    for (lo, hi) in mine {
                        assert!(lo == at && lo % 16 == 0 && hi > lo, "{mats:?} / {shares}: piece {lo}..{hi} after {at}");
                        at = hi;
                    }
                    assert_eq!(at, rows, "{mats:?} / {shares}: rows left out");
                }
                let bytes: Vec<usize> = bounds.windows(2).map(|b| pieces[b[0]..b[1]].iter().map(|&(si, lo, hi)| (hi - lo) * mats[si].1).sum()).collect();
                let step = 16 * mats.iter().map(|m| m.1).max().unwrap_or(0);
                let most = *bytes.iter().max().unwrap_or(&0);
                // Rows come in steps, so a matrix end can leave a share a short piece over.
                assert!(bytes.len() <= shares + mats.len(), "{mats:?} / {shares}: {} tasks", bytes.len());
                assert!(bytes[..bytes.len() - 1].iter().all(|&b| b + step >= most), "{mats:?} / {shares}: uneven tasks {bytes:?}");
            }
        }
    }
}
