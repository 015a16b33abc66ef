//! The CPU implementation of the backend boundary: the forward pass's ops on the thread team.
//! Attention reads each session's K/V pages in place, decoding rows in the pool's codec.

use super::deltanet;
use super::{convert_weight, matmul_many, ops, Cpu, Team, Weight};
use crate::backend::{Activation, AttnShape, DeltaNet, DnParams, Gating, Host, HostActs, HostOps, MatmulOffload, Numerics, Ops, PassIn, RopeTable, Route};
use crate::kv::{KvCache, KvCodec, RecIo};
use crate::quant::GgmlType;

/// The CPU as the host backend (a runtime's `Runtime::host`).
impl Host for Cpu {
    fn prepare(&self, w: Weight, to: Option<GgmlType>, numerics: Numerics) -> Option<Weight> {
        // The layout and ggml's dot functions are picked here, for this runtime's kernels.
        crate::quant::switches::with(self.kernels(), || {
            let w = match to {
                Some(ty) => convert_weight(&w, ty, self.pool()),
                None => w,
            };
            match numerics {
                Numerics::Fast => Some(w.for_kernels(self)),
                Numerics::Ggml => w.for_ggml_order(),
            }
        })
    }

    fn run(&self, numerics: Numerics, act: &mut Vec<u8>, mut offload: Option<&mut dyn MatmulOffload>, f: &mut dyn FnMut(&mut dyn HostOps)) {
        self.team().session(|t| {
            let offload: Option<&mut dyn MatmulOffload> = match offload.as_mut() {
                Some(o) => Some(&mut **o),
                None => None,
            };
            f(&mut CpuOps { team: t, act, numerics, offload })
        })
    }

    fn pass(
        &self,
        numerics: Numerics,
        acts: &mut HostActs,
        kvs: &mut [&mut KvCache],
        inp: &PassIn<'_>,
        mut offload: Option<&mut dyn MatmulOffload>,
        f: &mut dyn FnMut(&mut dyn Ops),
    ) {
        self.team().session(|t| {
            // A reborrow, so the offload's trait object may live as briefly as the team's session.
            let offload: Option<&mut dyn MatmulOffload> = match offload.as_mut() {
                Some(o) => Some(&mut **o),
                None => None,
            };
            let mut act = std::mem::take(&mut acts.act);
            f(&mut super::pass::HostPass { ops: CpuOps { team: t, act: &mut act, numerics, offload }, acts, kvs, inp });
            acts.act = act;
        })
    }

    #[cfg(feature = "fault-injection")]
    fn panic_in_task(&self, why: &str) {
        self.team().session(|t| t.parallel_for(1, &|_| panic!("{why}")))
    }
}

/// The CPU ops of one forward pass: the team held spinning for it, the activation buffer its
/// matmuls quantize into, and where matmuls may go instead (the Vulkan rails).
pub struct CpuOps<'a> {
    pub team: &'a Team<'a>,
    pub act: &'a mut Vec<u8>,
    pub numerics: Numerics,
    pub offload: Option<&'a mut dyn MatmulOffload>,
}

impl HostOps for CpuOps<'_> {
    fn matmul(&mut self, segs: &mut [(&Weight, &mut [f32])], x: &[f32], counts: &[usize]) {
        if let Some(o) = self.offload.as_deref_mut() {
            if o.matmul(segs, x, counts.iter().sum()) {
                return;
            }
        }
        // One parallel pass when the weights share an input format, else one pass each.
        let vt = segs[0].0.ty.vec_dot_type();
        if segs.iter().all(|(w, _)| w.ty.vec_dot_type() == vt) {
            matmul_many(segs, x, counts, self.act, self.team);
        } else {
            for (w, out) in segs.iter_mut() {
                matmul_many(&mut [(w, out)], x, counts, self.act, self.team);
            }
        }
    }

    fn rms_norm(&mut self, x: &mut [f32], w: &[f32], eps: f32) {
        x.chunks_exact_mut(w.len()).for_each(|r| ops::rms_norm(r, w, eps));
    }

    fn norm_rope(&mut self, x: &mut [f32], width: usize, head_dim: usize, norm: Option<&[f32]>, eps: f32, rope: &RopeTable) {
        let each = |t: usize, row: &mut [f32]| {
            let cache = rope.row(t);
            for hv in row.chunks_exact_mut(head_dim) {
                if let Some(w) = norm {
                    ops::rms_norm(hv, w, eps);
                }
                ops::rope(hv, cache, rope.neox);
            }
        };
        if x.len() / width >= 16 {
            self.team.for_each_row_mut(x, width, &each);
        } else {
            x.chunks_exact_mut(width).enumerate().for_each(|(t, r)| each(t, r));
        }
    }

    fn glu(&mut self, gate: &mut [f32], up: &[f32], width: usize, act: Activation) {
        let glu = |t: usize, g: &mut [f32]| {
            let u = &up[t * g.len()..(t + 1) * g.len()];
            match act {
                Activation::Silu => ops::swiglu(g, u),
                Activation::GeluTanh => ops::geglu(g, u),
                Activation::SwigluOai => ops::swiglu_oai(g, u),
            }
        };
        if gate.len() / width >= 16 {
            self.team.for_each_row_mut(gate, width, &glu);
        } else {
            glu(0, gate);
        }
    }

    fn add(&mut self, x: &mut [f32], y: &[f32]) {
        x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
    }

    fn parallel_for(&mut self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        self.team.parallel_for(n, f)
    }

    fn offload_matmul(&mut self, segs: &mut [(&Weight, &mut [f32])], x: &[f32], n: usize) -> bool {
        self.offload.as_deref_mut().is_some_and(|o| o.matmul(segs, x, n))
    }

    fn offload_attention(&mut self, q: &[f32], k: &[f32], v: &[f32], n: usize, heads: usize, hd: usize, spans: &[usize], out: &mut [f32]) -> bool {
        self.offload.as_deref_mut().is_some_and(|o| o.full_attention(q, k, v, n, heads, hd, spans, out))
    }

    fn add_bias(&mut self, x: &mut [f32], bias: &[f32]) {
        x.chunks_exact_mut(bias.len()).for_each(|r| r.iter_mut().zip(bias).for_each(|(a, b)| *a += b));
    }

    fn softcap(&mut self, x: &mut [f32], cap: f32) {
        ops::softcap(x, cap);
    }

    fn route(&mut self, logits: &[f32], r: &Route<'_>, out: &mut Vec<(usize, f32)>) {
        out.clear();
        let n_expert = r.n_expert;
        let mut p = vec![0.0f32; n_expert];
        let mut sel = vec![0.0f32; n_expert];
        let mut order: Vec<usize> = (0..n_expert).collect();
        for row in logits.chunks_exact(n_expert) {
            p.copy_from_slice(row);
            match r.gating {
                Gating::Softmax => ops::softmax(&mut p),
                Gating::Sigmoid => p.iter_mut().for_each(|v| *v = 1.0 / (1.0 + (-*v).exp())),
                // Chosen by the logits themselves; the softmax over the chosen ones follows.
                Gating::SoftmaxWeight => {}
            }
            // The selection bias moves the choice only; the weights are the unbiased scores.
            match r.bias {
                Some(b) => sel.iter_mut().zip(p.iter().zip(b)).for_each(|(s, (p, b))| *s = p + b),
                None => sel.copy_from_slice(&p),
            }
            // Highest first; ties to the lower index.
            order.sort_by(|&a, &b| sel[b].total_cmp(&sel[a]).then(a.cmp(&b)));
            let first = out.len();
            out.extend(order[..r.n_used].iter().map(|&e| (e, p[e])));
            if r.gating == Gating::SoftmaxWeight {
                let mut w: Vec<f32> = out[first..].iter().map(|&(_, w)| w).collect();
                ops::softmax(&mut w);
                out[first..].iter_mut().zip(w).for_each(|((_, x), w)| *x = w);
            }
            if r.norm {
                // llama.cpp clamps the sum below at the smallest normal f16.
                let sum = out[first..].iter().map(|&(_, w)| w).sum::<f32>().max(6.103_515_6e-5);
                out[first..].iter_mut().for_each(|(_, w)| *w /= sum);
            }
            if r.scale != 1.0 {
                out[first..].iter_mut().for_each(|(_, w)| *w *= r.scale);
            }
        }
    }

    fn add_scaled(&mut self, x: &mut [f32], y: &[f32], a: f32) {
        x.iter_mut().zip(y).for_each(|(x, y)| *x += a * y);
    }

    fn sigmoid(&mut self, x: &mut [f32]) {
        x.iter_mut().for_each(|v| *v = 1.0 / (1.0 + (-*v).exp()));
    }

    fn delta_net(
        &mut self,
        dn: &DeltaNet,
        p: &DnParams,
        states: &mut [RecIo],
        counts: &[usize],
        qkv: &mut [f32],
        beta: &mut [f32],
        alpha: &mut [f32],
        out: &mut [f32],
    ) {
        deltanet::delta_net(dn, p, states, counts, qkv, beta, alpha, out, Some(self.team));
    }

    fn attention(
        &mut self,
        a: &AttnShape,
        slot: usize,
        kvs: &[&mut KvCache],
        rows: &[(usize, usize)],
        ends: &[usize],
        counts: &[usize],
        q: &[f32],
        out: &mut [f32],
    ) {
        match self.numerics {
            Numerics::Fast => attention(a, kvs, slot, rows, ends, q, out, self.team),
            Numerics::Ggml => attention_ggml(a, kvs, slot, rows, ends, counts, q, out, self.team),
        }
    }
}

/// Query heads as llama.cpp's attention takes them against an f16 cache: scaled first where the
/// family scales queries, then rounded to f16.
fn f16_queries(a: &AttnShape, q: &[f32], qs: &mut Vec<f32>) {
    qs.clear();
    qs.extend_from_slice(q);
    round_queries(a, qs);
}

/// `f16_queries` in place.
fn round_queries(a: &AttnShape, qs: &mut [f32]) {
    if a.scale_query {
        qs.iter_mut().for_each(|v| *v *= a.scale);
    }
    ops::round_f16_slice(qs);
}

thread_local! {
    /// Queries (as given and paired), scores, outputs and widened K/V rows of the attention task a
    /// thread runs, kept for its next one (a task per block of rows, KV head and layer would
    /// otherwise allocate them thousands of times a step).
    static ATTENTION_SCRATCH: std::cell::RefCell<[Vec<f32>; 5]> = const { std::cell::RefCell::new([Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new()]) };
}

/// Query heads one attention task takes together: a block of a session's consecutive rows times
/// the query heads of one KV head. Each K and V run (a page of one head) is read from memory once
/// for all of them and then from L1 for each group of heads, so a prefill chunk at depth d reads
/// the prefix once per block instead of once per row. Scores take 4 * heads * d bytes, which stay
/// in a 2 MB L2 at 48 heads and a few thousand keys. (32 measured 6-8% slower on a 4,000-token
/// prefill in the server's chunks of 24-32 rows: three reads of the prefix a chunk, not two.)
const BLOCK_HEADS: usize = 48;

/// o += weights · V rows `from..from + n`, for one row's heads or a block's: `(o, weights, from, n)`.
type RowsAxpy<'a> = &'a dyn Fn(&mut [f32], &[f32], usize, usize);

/// One attention task: rows `t0..t0 + n` of one session (consecutive in the pass), one KV head,
/// and the output slices those rows have for the query heads of that KV head.
struct AttnTask<'o> {
    t0: usize,
    kvh: usize,
    outs: Vec<&'o mut [f32]>,
}

/// The keys a task's block of rows (`t0..t0 + nb`, one session's, consecutive) reads and attends.
struct Block<'s> {
    t0: usize,
    nb: usize,
    /// The keys row t attends.
    span: &'s (dyn Fn(usize) -> (usize, usize) + Sync),
    /// Keys the block reads (kb..ke), and those every row of it attends (cs..ce).
    kb: usize,
    ke: usize,
    cs: usize,
    ce: usize,
}

impl<'s> Block<'s> {
    fn new(t0: usize, nb: usize, span: &'s (dyn Fn(usize) -> (usize, usize) + Sync)) -> Self {
        let (mut kb, mut ke, mut cs, mut ce) = (usize::MAX, 0, 0, usize::MAX);
        for t in t0..t0 + nb {
            let (s, e) = span(t);
            (kb, ke, cs, ce) = (kb.min(s), ke.max(e), cs.max(s), ce.min(e));
        }
        Block { t0, nb, span, kb, ke, cs, ce }
    }

    /// Each row's weights over its own keys, from its scores (`sc`: `group` heads a row, `nk`
    /// keys each from `kb`); the block's other keys are never read.
    fn weights(&self, a: &AttnShape, kvh: usize, group: usize, sc: &mut [f32]) {
        let nk = self.ke - self.kb;
        for (r, t) in (self.t0..self.t0 + self.nb).enumerate() {
            let (s, e) = (self.span)(t);
            for (g, sg) in sc[r * group * nk..(r + 1) * group * nk].chunks_exact_mut(nk).enumerate() {
                let sink = a.sinks.map(|sk| sk[kvh * group + g]);
                ops::attention_weights_sink(&mut sg[s - self.kb..e - self.kb], a.score_scale(), sink);
            }
        }
    }

    /// V rows `first..first + cnt` into the outputs (`os`: rows of `width` values, `group` heads
    /// each) through `axpy(o, weights, from, n)`: keys every row attends with all heads at once,
    /// the others row by row, in key order so that each head's sum runs over its keys in order.
    #[allow(clippy::too_many_arguments)]
    fn add_values(&self, os: &mut [f32], width: usize, group: usize, sc: &[f32], first: usize, cnt: usize, axpy: RowsAxpy) {
        let (kb, cs, ce, nk) = (self.kb, self.cs, self.ce, self.ke - self.kb);
        let (lo, hi) = (first.max(cs).min(first + cnt), (first + cnt).min(ce).max(first));
        let (lo, hi) = if cs < ce { (lo, hi.max(lo)) } else { (first + cnt, first + cnt) };
        let part = |os: &mut [f32], from: usize, to: usize| {
            for (r, t) in (self.t0..self.t0 + self.nb).enumerate() {
                let (s, e) = (self.span)(t);
                let (f, l) = (from.max(s), to.min(e));
                if f < l {
                    axpy(&mut os[r * width..(r + 1) * width], &sc[r * group * nk + f - kb..], f, l - f);
                }
            }
        };
        part(os, first, lo);
        if lo < hi {
            axpy(os, &sc[lo - kb..], lo, hi - lo);
        }
        part(os, hi, first + cnt);
    }
}

/// Causal attention of each new query row over its own session's cached K/V (which already holds
/// the row's own position).
/// Q and the softmax weights are rounded to f16 as llama.cpp does against its f16 cache.
///
/// A session's rows are taken in blocks (`BLOCK_HEADS`): scores of every query head of the block
/// against each run of keys, then each row's softmax over its own keys, then each V run added
/// into every head whose row attends it. A row's scores, weights and sums are computed by the
/// same kernels in the same order whatever its block (the kernels treat heads independently and
/// sum a head's values over keys in order, split into runs or not), so a row's result does not
/// depend on the rows beside it.
#[allow(clippy::too_many_arguments)]
fn attention(a: &AttnShape, kvs: &[&mut KvCache], il: usize, rows: &[(usize, usize)], ends: &[usize], q: &[f32], out: &mut [f32], team: &Team) {
    let window = a.window;
    let (hdim, qd) = (a.head_dim, a.q_dim());
    let group = a.n_heads / a.n_kv_heads;
    let width = group * hdim;
    let n = rows.len();
    let block = (BLOCK_HEADS / group).max(1);
    // Blocks: runs of consecutive rows of one session, split into blocks of at most `block` rows
    // and as equal as they can be (each block reads the session's whole prefix, so a chunk of
    // 24 rows costs two reads in blocks of 12, where 10 + 10 + 4 cost three).
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (t, r) in rows.iter().enumerate() {
        match runs.last_mut() {
            Some((t0, len)) if rows[*t0].0 == r.0 => *len += 1,
            _ => runs.push((t, 1)),
        }
    }
    let mut blocks: Vec<(usize, usize)> = Vec::new();
    for (t0, len) in runs {
        let size = len.div_ceil(len.div_ceil(block));
        blocks.extend((t0..t0 + len).step_by(size).map(|t| (t, size.min(t0 + len - t))));
    }
    let mut tasks: Vec<AttnTask> = Vec::with_capacity(blocks.len() * a.n_kv_heads);
    let mut row_outs = out[..n * qd].chunks_exact_mut(qd);
    for &(t0, len) in &blocks {
        let first = tasks.len();
        tasks.extend((0..a.n_kv_heads).map(|kvh| AttnTask { t0, kvh, outs: Vec::with_capacity(len) }));
        for _ in 0..len {
            let row = row_outs.next().expect("a block's rows are rows of the pass");
            for (kvh, o) in row.chunks_exact_mut(width).enumerate() {
                tasks[first + kvh].outs.push(o);
            }
        }
    }
    // One KV head's blocks one after another: a thread reads that head's K/V run again while it
    // is still in L2 (block-major order walked every head's prefix between two reads of one).
    tasks.sort_by_key(|t| t.kvh);
    // The keys row t attends.
    let span = |t: usize| {
        let pos = rows[t].1;
        (if window > 0 { (pos + 1).saturating_sub(window) } else { 0 }, ends.get(t).copied().unwrap_or(pos + 1))
    };
    let one = |_: usize, task: &mut [AttnTask]| {
        let AttnTask { t0, kvh, outs } = &mut task[0];
        let (t0, kvh, nb) = (*t0, *kvh, outs.len());
        let si = rows[t0].0;
        let lv = kvs[si].layer(il);
        let codec = lv.codec();
        let block = Block::new(t0, nb, &span);
        let (kb, ke) = (block.kb, block.ke);
        let nk = ke - kb;
        let heads = nb * group;
        // Runs come in pages (contiguous per head); a batch's KV outgrows L3, so the next run
        // (after the last K run, the first V run) is fetched while one is read.
        let fetch = |v: bool, from: usize| {
            let next = lv.rows(v, kvh, from, ke).next().or_else(|| if v { None } else { lv.rows(true, kvh, kb, ke).next() });
            if let Some((_, run)) = next {
                ops::prefetch(run);
            }
        };
        fetch(false, kb);
        // Rows widened to f32 a block at a time (across pages), converted once for every head.
        let wide = codec.widens(hdim, heads);
        let blk = KvCodec::wide_block(hdim);
        let widen = |v: bool, b0: usize, b1: usize, wf: &mut [f32]| {
            for (first, run) in lv.rows(v, kvh, b0, b1) {
                codec.widen(run, &mut wf[(first - b0) * hdim..]);
            }
            // The next block's rows (after the last K block, the first V block) are fetched
            // while this one is scored: pages are scattered, so no hardware prefetcher follows.
            let (nv, from) = if b1 < ke { (v, b1) } else { (true, kb) };
            if b1 < ke || !v {
                lv.rows(nv, kvh, from, (from + blk).min(ke)).for_each(|(_, run)| ops::prefetch(run));
            }
        };
        ATTENTION_SCRATCH.with_borrow_mut(|[qs, qz, sc, os, wf]| {
            qs.clear();
            for t in t0..t0 + nb {
                let base = t * qd + kvh * width;
                qs.extend_from_slice(&q[base..base + width]);
            }
            round_queries(a, qs);
            codec.prepare_query(qs, hdim);
            // Every score of the block's keys is written below before it is read.
            if sc.len() < heads * nk {
                sc.resize(heads * nk, 0.0);
            }
            let sc = &mut sc[..heads * nk];
            if wide {
                if wf.len() < blk * hdim {
                    wf.resize(blk * hdim, 0.0);
                }
                KvCodec::pair_queries(qs, hdim, qz);
                for b0 in (kb..ke).step_by(blk) {
                    let b1 = (b0 + blk).min(ke);
                    widen(false, b0, b1, wf);
                    KvCodec::dot_rows_wide(qz, heads, hdim, wf, b1 - b0, &mut sc[b0 - kb..], nk);
                }
            } else {
                for (first, run) in lv.rows(false, kvh, kb, ke) {
                    let cnt = run.len() / codec.bytes(hdim);
                    fetch(false, first + cnt);
                    codec.dot_rows(qs, hdim, run, cnt, &mut sc[first - kb..], nk);
                }
            }
            if let Some(cap) = a.softcap {
                ops::softcap(sc, cap);
            }
            block.weights(a, kvh, group, sc);
            os.clear();
            os.resize(heads * hdim, 0.0);
            let rb = codec.bytes(hdim);
            let add = |os: &mut [f32], first: usize, cnt: usize, axpy: RowsAxpy| block.add_values(os, width, group, sc, first, cnt, axpy);
            if wide {
                for b0 in (kb..ke).step_by(blk) {
                    let b1 = (b0 + blk).min(ke);
                    widen(true, b0, b1, wf);
                    let wf = &wf[..];
                    add(os, b0, b1 - b0, &|o, p, from, n| KvCodec::axpy_rows_wide(o, hdim, p, nk, &wf[(from - b0) * hdim..], n));
                }
            } else {
                for (first, run) in lv.rows(true, kvh, kb, ke) {
                    let cnt = run.len() / rb;
                    fetch(true, first + cnt);
                    add(os, first, cnt, &|o, p, from, n| codec.axpy_rows(o, hdim, p, nk, &run[(from - first) * rb..(from - first + n) * rb], n));
                }
            }
            codec.finish_output(os, hdim);
            for (o, src) in outs.iter_mut().zip(os.chunks_exact(width)) {
                o.copy_from_slice(src);
            }
        });
    };
    // At most half as many tasks as threads (a decode row over few KV heads: Gemma 3's one):
    // deep enough, a task's keys and values are split across the team instead of leaving threads
    // idle. (With more tasks the idle share is under half, and a split's two parallel loops a
    // task could cost more than it saves.)
    let splits = |task: &AttnTask| {
        let block = Block::new(task.t0, task.outs.len(), &span);
        kvs[rows[task.t0].0].layer(il).codec().splits_values(hdim) && (block.ke - block.kb) * task.outs.len() * width >= SPLIT_WORK
    };
    if team.threads() >= 2 * tasks.len() && tasks.iter().all(splits) {
        for task in tasks.iter_mut() {
            let (t0, kvh, nb) = (task.t0, task.kvh, task.outs.len());
            let qs: Vec<f32> = (t0..t0 + nb).flat_map(|t| &q[t * qd + kvh * width..][..width]).copied().collect();
            let os = attend_split(a, &kvs[rows[t0].0].layer(il), kvh, &Block::new(t0, nb, &span), qs, team);
            for (o, src) in task.outs.iter_mut().zip(os.chunks_exact(width)) {
                o.copy_from_slice(src);
            }
        }
        return;
    }
    let work: usize = rows.iter().enumerate().map(|(t, r)| ends.get(t).copied().unwrap_or(r.1 + 1)).sum::<usize>() * a.n_heads;
    if work * hdim > 1 << 16 && tasks.len() > 1 {
        team.for_each_chunk_mut(&mut tasks, 1, &one);
    } else {
        tasks.chunks_mut(1).enumerate().for_each(|(i, t)| one(i, t));
    }
}

/// Multiply-adds of q·k (and as many of p·v) from which a task's attention is split across the
/// team (`attend_split`): a parallel loop costs a few microseconds.
const SPLIT_WORK: usize = 1 << 18;

/// Where the team's tasks of `attend_split` write: each writes elements no other task does.
#[derive(Clone, Copy)]
struct Scatter(*mut f32);
// SAFETY: `attend_split`'s tasks write disjoint elements, and nothing reads the buffer until the
// parallel loop has joined.
unsafe impl Send for Scatter {}
unsafe impl Sync for Scatter {}

/// A task's attention (one KV head, a block of rows, the queries `qs` of its heads row by row)
/// on the whole team: the scores a run of keys per task, the softmax on this thread, then the
/// values a range of columns per task, each over every key in order. Every score, weight and
/// output is computed by the kernels `attention` uses, in the same order, so the outputs
/// (returned row by row) are bit for bit what one thread gives (`KvCodec::splits_values`).
fn attend_split(a: &AttnShape, lv: &crate::kv::LayerView, kvh: usize, block: &Block, mut qs: Vec<f32>, team: &Team) -> Vec<f32> {
    let (hdim, codec, threads) = (a.head_dim, lv.codec(), team.threads());
    let (kb, ke, heads, rb) = (block.kb, block.ke, qs.len() / hdim, codec.bytes(hdim));
    let (nk, group) = (ke - kb, heads / block.nb);
    round_queries(a, &mut qs);
    codec.prepare_query(&mut qs, hdim);
    let mut sc = vec![0.0f32; heads * nk];
    let dst = Scatter(sc.as_mut_ptr());
    let parts = (2 * threads).min(nk.div_ceil(64));
    team.parallel_for(parts, &|i| {
        #[allow(clippy::redundant_locals)]
        let dst = dst;
        let (k0, k1) = (kb + nk * i / parts, kb + nk * (i + 1) / parts);
        let mut part = vec![0.0f32; heads * (k1 - k0)];
        for (first, run) in lv.rows(false, kvh, k0, k1) {
            codec.dot_rows(&qs, hdim, run, run.len() / rb, &mut part[first - k0..], k1 - k0);
        }
        for (g, row) in part.chunks_exact(k1 - k0).enumerate() {
            // SAFETY: keys k0..k1 of head g are this task's alone, inside `sc` (heads * nk).
            unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), dst.0.add(g * nk + k0 - kb), row.len()) };
        }
    });
    if let Some(cap) = a.softcap {
        ops::softcap(&mut sc, cap);
    }
    block.weights(a, kvh, group, &mut sc);
    let mut os = vec![0.0f32; heads * hdim];
    let dst = Scatter(os.as_mut_ptr());
    let groups = hdim / 16;
    let parts = threads.min(groups);
    team.parallel_for(parts, &|i| {
        #[allow(clippy::redundant_locals)]
        let dst = dst;
        let (c0, c1) = (16 * (groups * i / parts), 16 * (groups * (i + 1) / parts));
        let mut part = vec![0.0f32; heads * (c1 - c0)];
        for (first, run) in lv.rows(true, kvh, kb, ke) {
            let axpy: RowsAxpy = &|o, p, from, n| codec.axpy_cols(o, hdim, c0..c1, p, nk, &run[(from - first) * rb..(from - first + n) * rb]);
            block.add_values(&mut part, group * (c1 - c0), group, &sc, first, run.len() / rb, axpy);
        }
        for (g, row) in part.chunks_exact(c1 - c0).enumerate() {
            // SAFETY: columns c0..c1 of head g are this task's alone, inside `os` (heads * hdim).
            unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), dst.0.add(g * hdim + c0), row.len()) };
        }
    });
    codec.finish_output(&mut os, hdim);
    os
}

/// Attention in ggml's order (`Numerics::Ggml`), as llama.cpp computes it without flash attention
/// against an f16 cache: Q and the softmax weights rounded to f16; a session evaluating several
/// tokens goes through tinyBLAS (lane dots), one evaluating a single token through
/// `ggml_vec_dot_f16`; softmax over whole groups of eight cells with the masked ones at -inf.
/// Plain loops over decoded rows: this is the conformance path, not the fast one.
#[allow(clippy::too_many_arguments)]
fn attention_ggml(
    a: &AttnShape,
    kvs: &[&mut KvCache],
    il: usize,
    rows: &[(usize, usize)],
    ends: &[usize],
    counts: &[usize],
    q: &[f32],
    out: &mut [f32],
    team: &Team,
) {
    use crate::quant::ggml::{lane_dot, vec_dot_f16};
    let window = a.window;
    let (hdim, qd) = (a.head_dim, a.q_dim());
    let group = a.n_heads / a.n_kv_heads;
    let one = |idx: usize, o: &mut [f32]| {
        let (t, kvh) = (idx / a.n_kv_heads, idx % a.n_kv_heads);
        let (si, pos) = rows[t];
        let single = counts[si] == 1;
        let lv = kvs[si].layer(il);
        assert_eq!(lv.codec(), crate::kv::KvCodec::F16, "ggml numerics run on an f16 cache (checked at pool creation)");
        let start = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
        // Keys end after the row's own position, or where `ends` says (an image's rows).
        let end = ends.get(t).copied().unwrap_or(pos + 1);
        // K and V of cells 0..=pos as f32 (cells before the window stay zero: their weight is 0).
        let cells = end.next_multiple_of(32);
        let mut kf = vec![0.0f32; cells * hdim];
        let mut vt = vec![0.0f32; hdim * cells]; // transposed, as llama.cpp stores V
        for (v, dst) in [(false, &mut kf), (true, &mut vt)] {
            for (first, run) in lv.rows(v, kvh, start, end) {
                for (r, row) in run.chunks_exact(2 * hdim).enumerate() {
                    for i in 0..hdim {
                        let x = crate::quant::rd_f16(row, 2 * i);
                        if v {
                            dst[i * cells + first + r] = x;
                        } else {
                            dst[(first + r) * hdim + i] = x;
                        }
                    }
                }
            }
        }
        let dot = if single { vec_dot_f16 } else { lane_dot };
        let mut sc = vec![0.0f32; cells];
        for g in 0..group {
            let base = t * qd + (kvh * group + g) * hdim;
            let mut qs = Vec::new();
            f16_queries(a, &q[base..base + hdim], &mut qs);
            sc.fill(f32::NEG_INFINITY);
            for j in start..end {
                let s = dot(&kf[j * hdim..(j + 1) * hdim], &qs);
                let s = a.softcap.map_or(s, |cap| cap * (s * (1.0 / cap)).tanh());
                sc[j] = s * a.score_scale();
            }
            let live = end.next_multiple_of(8);
            ops::softmax_sink(&mut sc[..live], a.sinks.map(|sk| sk[kvh * group + g]));
            sc[live..].fill(0.0);
            ops::round_f16_slice(&mut sc);
            for (i, ov) in o[g * hdim..(g + 1) * hdim].iter_mut().enumerate() {
                *ov = dot(&vt[i * cells..(i + 1) * cells], &sc);
            }
        }
    };
    if rows.len() * a.n_kv_heads > 1 {
        team.for_each_chunk_mut(&mut out[..rows.len() * qd], group * hdim, &one);
    } else {
        one(0, &mut out[..qd]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(logits: &[f32], r: &Route<'_>) -> Vec<(usize, f32)> {
        let mut out = Vec::new();
        let mut act = Vec::new();
        Cpu::new(2).run(Numerics::Fast, &mut act, None, &mut |ops| ops.route(logits, r, &mut out));
        out
    }

    #[test]
    fn sigmoid_routing_chooses_by_biased_score_and_weights_by_the_unbiased_one() {
        let logits = [2.0f32, 0.0, -1.0, 1.0];
        let s = |x: f32| 1.0 / (1.0 + (-x).exp());
        // Expert 2's bias lifts it over experts 1 and 3; expert 0 stays first.
        let bias = [0.0f32, 0.0, 0.6, 0.0];
        let r = Route { n_expert: 4, n_used: 2, gating: Gating::Sigmoid, bias: Some(&bias), norm: false, scale: 1.0 };
        assert_eq!(route(&logits, &r), vec![(0, s(2.0)), (2, s(-1.0))]);
        // Renormalised, then scaled.
        let got = route(&logits, &Route { norm: true, scale: 2.5, ..r });
        let sum = s(2.0) + s(-1.0);
        assert_eq!(got, vec![(0, s(2.0) / sum * 2.5), (2, s(-1.0) / sum * 2.5)]);
        // Without the bias, the plain top 2.
        assert_eq!(route(&logits, &Route { bias: None, ..r }), vec![(0, s(2.0)), (3, s(1.0))]);
    }

    #[test]
    fn softmax_weight_routing_chooses_by_logit_and_weights_by_a_softmax_of_the_chosen() {
        let logits = [0.5f32, 2.0, -1.0, 1.0];
        let r = Route { n_expert: 4, n_used: 2, gating: Gating::SoftmaxWeight, bias: None, norm: false, scale: 1.0 };
        let got = route(&logits, &r);
        let (a, b) = (1.0f64.exp(), 0.0f64.exp()); // e^(2 - 2), e^(1 - 2) over their sum
        assert_eq!(got.iter().map(|&(e, _)| e).collect::<Vec<_>>(), vec![1, 3]);
        assert!((got[0].1 as f64 - a / (a + b)).abs() < 1e-6 && (got[1].1 as f64 - b / (a + b)).abs() < 1e-6, "{got:?}");
        // Over the chosen two only: a softmax over all four would weight them 0.61 and 0.22.
        assert!((got[0].1 + got[1].1 - 1.0).abs() < 1e-6);
    }

    /// Values in [-1, 1) from a fixed LCG stream: attention tests' K, V and Q.
    struct Draw(u64);

    impl Draw {
        fn values(&mut self, len: usize) -> Vec<f32> {
            (0..len)
                .map(|_| {
                    self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
                })
                .collect()
        }
    }

    #[test]
    fn attention_with_sinks_and_a_window_in_both_orders() {
        use crate::kv::{Geometry, KvCodec, PageBin};
        let (nh, nkv, hd, n) = (4usize, 2usize, 32usize, 12usize);
        let mut draw = Draw(0x2545_f491_4f6c_dd1d);
        let mut rnd = |len: usize| draw.values(len);
        let (k, v, q) = (rnd(n * nkv * hd), rnd(n * nkv * hd), rnd(n * nh * hd).iter().map(|x| x * 4.0).collect::<Vec<f32>>());
        let sinks = [0.5f32, -1.0, 2.0, 0.0];
        let rows: Vec<(usize, usize)> = (0..n).map(|p| (0, p)).collect();
        let run = |numerics: Numerics, window: usize, sinks: Option<&[f32]>| {
            let geo = Geometry { n_layers: 1, kv_dim: nkv * hd, head_dim: hd, page_rows: 8, codec: KvCodec::F16, slots: None };
            let mut kv = KvCache::private(geo, &PageBin::new());
            kv.reserve(n).unwrap();
            kv.append(0, &k, &v);
            let shape =
                AttnShape { n_heads: nh, n_kv_heads: nkv, head_dim: hd, window, scale: 1.0 / (hd as f32).sqrt(), scale_query: false, softcap: None, sinks };
            let mut out = vec![0.0f32; n * nh * hd];
            Cpu::new(2).run(numerics, &mut Vec::new(), None, &mut |ops| ops.attention(&shape, 0, &[&mut kv], &rows, &[], &[n], &q, &mut out));
            out
        };
        let f16 = |x: f32| half::f16::from_f32(x).to_f32() as f64;
        for window in [0, 5] {
            // Float64 over the f16 K/V the cache holds: each head's sink joins its softmax's
            // normalizer with no value, so its weights sum to less than 1.
            let mut want = vec![0.0f64; n * nh * hd];
            for t in 0..n {
                for h in 0..nh {
                    let kvh = h / (nh / nkv);
                    let lo = if window > 0 { (t + 1).saturating_sub(window) } else { 0 };
                    let sc: Vec<f64> = (lo..=t)
                        .map(|j| (0..hd).map(|i| q[(t * nh + h) * hd + i] as f64 * f16(k[(j * nkv + kvh) * hd + i])).sum::<f64>() / (hd as f64).sqrt())
                        .collect();
                    let m = sc.iter().cloned().fold(sinks[h] as f64, f64::max);
                    let z = sc.iter().map(|s| (s - m).exp()).sum::<f64>() + (sinks[h] as f64 - m).exp();
                    for (jj, s) in sc.iter().enumerate() {
                        for i in 0..hd {
                            want[(t * nh + h) * hd + i] += (s - m).exp() / z * f16(v[((lo + jj) * nkv + kvh) * hd + i]);
                        }
                    }
                }
            }
            for numerics in [Numerics::Fast, Numerics::Ggml] {
                let got = run(numerics, window, Some(&sinks));
                let err = got.iter().zip(&want).map(|(g, w)| (*g as f64 - w).abs()).fold(0.0, f64::max);
                assert!(err < 1e-2, "{numerics:?} window {window}: {err}");
                let plain = run(numerics, window, None);
                let off = plain.iter().zip(&want).map(|(g, w)| (*g as f64 - w).abs()).fold(0.0, f64::max);
                assert!(off > 0.1, "{numerics:?} window {window}: the sinks moved nothing ({off})");
            }
        }
    }

    /// One KV head's attention deep enough to be split across the team (`attend_split`), for a
    /// decode row and for a block of rows (a verify chunk: each row its own keys), gives one
    /// thread's bits, with a window, sinks and a softcap, and pages it starts and ends inside; and
    /// it is attention (against f64 over the cache's f16 K/V).
    #[test]
    fn split_attention_keeps_one_threads_bits() {
        use crate::kv::{Geometry, KvCodec, PageBin};
        let (nh, hd, n) = (4usize, 64usize, 1300usize);
        let mut draw = Draw(0x9e37_79b9_7f4a_7c15);
        let mut rnd = |len: usize| draw.values(len);
        let (k, v, q) = (rnd(n * hd), rnd(n * hd), rnd(5 * nh * hd).iter().map(|x| x * 4.0).collect::<Vec<f32>>());
        let sinks = [0.5f32, -1.0, 2.0, 0.0];
        assert!(!KvCodec::F16.splits_values(hd) || 1100 * nh * hd >= SPLIT_WORK, "the rows below must be deep enough to split");
        for rows in [1usize, 5] {
            let pos: Vec<(usize, usize)> = (n - rows..n).map(|p| (0, p)).collect();
            for (window, softcap, with_sinks) in [(0, None, false), (1100, Some(30.0), true)] {
                let run = |threads: usize| {
                    let geo = Geometry { n_layers: 1, kv_dim: hd, head_dim: hd, page_rows: 48, codec: KvCodec::F16, slots: None };
                    let mut kv = KvCache::private(geo, &PageBin::new());
                    kv.reserve(n).unwrap();
                    kv.append(0, &k, &v);
                    let shape = AttnShape {
                        n_heads: nh,
                        n_kv_heads: 1,
                        head_dim: hd,
                        window,
                        scale: 1.0 / (hd as f32).sqrt(),
                        scale_query: false,
                        softcap,
                        sinks: with_sinks.then_some(&sinks[..]),
                    };
                    let mut out = vec![0.0f32; rows * nh * hd];
                    let q = &q[..rows * nh * hd];
                    Cpu::new(threads)
                        .run(Numerics::Fast, &mut Vec::new(), None, &mut |ops| ops.attention(&shape, 0, &[&mut kv], &pos, &[], &[rows], q, &mut out));
                    out.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
                };
                let one = run(1);
                assert_eq!(run(2), one, "{rows} rows, window {window}");
                assert_eq!(run(3), one, "{rows} rows, window {window}, 3 threads");
                let f16 = |x: f32| half::f16::from_f32(x).to_f32() as f64;
                for (r, &(_, p)) in pos.iter().enumerate() {
                    let lo = if window > 0 { (p + 1).saturating_sub(window) } else { 0 };
                    for h in 0..nh {
                        let qh = &q[(r * nh + h) * hd..][..hd];
                        let sc: Vec<f64> = (lo..=p)
                            .map(|j| {
                                let s = (0..hd).map(|i| f16(qh[i]) * f16(k[j * hd + i])).sum::<f64>();
                                softcap.map_or(s, |c: f32| c as f64 * (s / c as f64).tanh()) / (hd as f64).sqrt()
                            })
                            .collect();
                        let sink = if with_sinks { sinks[h] as f64 } else { f64::NEG_INFINITY };
                        let m = sc.iter().cloned().fold(sink, f64::max);
                        let z = sc.iter().map(|s| (s - m).exp()).sum::<f64>() + (sink - m).exp();
                        for i in 0..hd {
                            let want: f64 = sc.iter().enumerate().map(|(jj, s)| (s - m).exp() / z * f16(v[(lo + jj) * hd + i])).sum();
                            let got = f32::from_bits(one[(r * nh + h) * hd + i]) as f64;
                            assert!((got - want).abs() < 1e-2, "{rows} rows, window {window}, row {r} head {h} value {i}: {got} vs {want}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn softmax_routing_is_unchanged() {
        let logits = [0.5f32, 1.5, -0.5, 1.0];
        let r = Route { n_expert: 4, n_used: 2, gating: Gating::Softmax, bias: None, norm: true, scale: 1.0 };
        let got = route(&logits, &r);
        assert_eq!(got.iter().map(|&(e, _)| e).collect::<Vec<_>>(), vec![1, 3]);
        assert!((got[0].1 + got[1].1 - 1.0).abs() < 1e-6);
    }
}
