//! The CPU as a device of the forward pass: each op of `backend::Ops` runs as it comes, on the
//! host kernels (`CpuOps`) over the pass's buffers in host memory and the sessions' paged K/V.

use super::backend::CpuOps;
use crate::backend::{Act, AttnShape, DeltaNet, DnParams, ExpertSet, Given, HostActs, HostOps, Ops, PassIn, RopeTable, Route};
use crate::kv::{KvCache, RecIo};
use crate::quant::Weight;

pub struct HostPass<'a, 'k> {
    pub ops: CpuOps<'a>,
    pub acts: &'a mut HostActs,
    pub kvs: &'a mut [&'k mut KvCache],
    pub inp: &'a PassIn<'a>,
}

fn grow(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

impl HostPass<'_, '_> {
    /// `f` over the values of `x`, taken out of its buffer meanwhile: `f` may read every other
    /// buffer through the pass (reading `x`'s own finds it empty, a bug caught at once).
    fn with(&mut self, x: Act, f: impl FnOnce(&mut Self, &mut [f32])) {
        let i = x.buf as usize;
        let mut v = std::mem::take(&mut self.acts.bufs[i]);
        f(self, &mut v[x.off..x.off + x.len]);
        self.acts.bufs[i] = v;
    }

    fn counts(&self, alone: bool, n: usize) -> Vec<usize> {
        if alone {
            vec![1; n]
        } else {
            self.inp.counts.to_vec()
        }
    }
}

impl Ops for HostPass<'_, '_> {
    fn alloc(&mut self, buf: crate::backend::Buf, len: usize) -> Act {
        grow(&mut self.acts.bufs[buf as usize], len);
        Act { buf, off: 0, len }
    }

    fn embed(&mut self, w: &Weight, scale: f32, given: Given, out: Act) {
        let (tokens, embeds) = (self.inp.tokens, self.inp.embeds);
        self.with(out, |_, x| {
            let look_up = |row: &mut [f32], tok: u32| {
                w.dequantize_row(tok as usize, row);
                if scale != 1.0 {
                    row.iter_mut().for_each(|v| *v *= scale);
                }
            };
            for (row, &tok) in x.chunks_exact_mut(w.cols).zip(tokens) {
                look_up(row, tok);
            }
            if let Some(e) = embeds {
                let stride = e.width();
                for (i, &r) in e.rows.iter().enumerate() {
                    let row = &mut x[r * w.cols..(r + 1) * w.cols];
                    match given {
                        Given::Values => row.copy_from_slice(&e.values[i * stride..i * stride + w.cols]),
                        Given::Token(id) => look_up(row, id),
                    }
                }
            }
        });
    }

    fn matmul(&mut self, segs: &[(&Weight, Act)], x: Act, alone: bool) {
        let n = x.len / segs[0].0.cols;
        let counts = self.counts(alone, n);
        let mut taken: Vec<Vec<f32>> = segs.iter().map(|(_, a)| std::mem::take(&mut self.acts.bufs[a.buf as usize])).collect();
        let mut outs: Vec<(&Weight, &mut [f32])> = taken.iter_mut().zip(segs).map(|(v, (w, a))| (*w, &mut v[a.off..a.off + a.len])).collect();
        self.ops.matmul(&mut outs, self.acts.get(x), &counts);
        drop(outs);
        for (v, (_, a)) in taken.into_iter().zip(segs) {
            self.acts.bufs[a.buf as usize] = v;
        }
    }

    fn rms_norm(&mut self, x: Act, out: Act, w: Option<&[f32]>, width: usize, eps: f32) {
        let ones;
        let w = match w {
            Some(w) => w,
            None => {
                // A weight of ones multiplies exactly.
                ones = vec![1.0; width];
                &ones
            }
        };
        self.with(out, |s, o| {
            if x != out {
                o.copy_from_slice(s.acts.get(x));
            }
            s.ops.rms_norm(o, w, eps);
        });
    }

    fn norm_rope(&mut self, x: Act, width: usize, head_dim: usize, norm: Option<&[f32]>, eps: f32, rope: usize) {
        let inp = self.inp;
        let table = RopeTable { pairs: &inp.tables[rope], half: inp.ropes[rope].dim / 2, neox: inp.ropes[rope].neox };
        self.with(x, |s, v| s.ops.norm_rope(v, width, head_dim, norm, eps, &table));
    }

    fn glu(&mut self, gate: Act, up: Act, width: usize, act: crate::backend::Activation) {
        self.with(gate, |s, g| s.ops.glu(g, s.acts.get(up), width, act));
    }

    fn add(&mut self, x: Act, y: Act) {
        self.with(x, |s, v| s.ops.add(v, s.acts.get(y)));
    }

    fn add_bias(&mut self, x: Act, bias: &[f32]) {
        self.with(x, |s, v| s.ops.add_bias(v, bias));
    }

    fn add_given(&mut self, x: Act, width: usize, slice: usize) {
        let Some(e) = self.inp.embeds else { return };
        let stride = e.width();
        self.with(x, |_, v| {
            for (i, &r) in e.rows.iter().enumerate() {
                let src = &e.values[i * stride + slice * width..i * stride + (slice + 1) * width];
                v[r * width..(r + 1) * width].iter_mut().zip(src).for_each(|(a, b)| *a += b);
            }
        });
    }

    fn scale(&mut self, x: Act, a: f32) {
        self.with(x, |_, v| v.iter_mut().for_each(|v| *v *= a));
    }

    fn scale_cols(&mut self, x: Act, a: f32, sc: &[f32]) {
        self.with(x, |_, v| {
            for row in v.chunks_exact_mut(sc.len()) {
                row.iter_mut().zip(sc).for_each(|(v, s)| *v = *v * a * s);
            }
        });
    }

    fn scale_rows(&mut self, x: Act, width: usize, table: usize) {
        let f = &self.inp.row_scales[table];
        self.with(x, |_, v| {
            for (row, &f) in v.chunks_exact_mut(width).zip(f) {
                row.iter_mut().for_each(|v| *v *= f);
            }
        });
    }

    fn softcap(&mut self, x: Act, cap: f32) {
        self.with(x, |s, v| s.ops.softcap(v, cap));
    }

    fn sigmoid(&mut self, x: Act) {
        self.with(x, |s, v| s.ops.sigmoid(v));
    }

    fn mul(&mut self, x: Act, y: Act) {
        self.with(x, |s, v| s.ops.mul(v, s.acts.get(y)));
    }

    fn add_scaled_rows(&mut self, x: Act, y: Act, sc: Act, width: usize) {
        self.with(x, |s, v| {
            let (y, sc) = (s.acts.get(y), s.acts.get(sc));
            for (t, row) in v.chunks_exact_mut(width).enumerate() {
                s.ops.add_scaled(row, &y[t * width..(t + 1) * width], sc[t]);
            }
        });
    }

    fn copy_cols(&mut self, src: Act, src_width: usize, src_col: usize, dst: Act, dst_width: usize, dst_col: usize, cols: usize) {
        self.with(dst, |s, d| {
            for (drow, srow) in d.chunks_exact_mut(dst_width).zip(s.acts.get(src).chunks_exact(src_width)) {
                drow[dst_col..dst_col + cols].copy_from_slice(&srow[src_col..src_col + cols]);
            }
        });
    }

    fn gather_rows(&mut self, src: Act, dst: Act, width: usize) {
        let picked = &self.inp.picked;
        self.with(dst, |s, d| {
            let src = s.acts.get(src);
            for (i, &t) in picked.iter().enumerate() {
                d[i * width..(i + 1) * width].copy_from_slice(&src[t * width..(t + 1) * width]);
            }
        });
    }

    fn kv_store(&mut self, slot: usize, k: Act, v: Act, kvd: usize) {
        let (k, v) = (self.acts.get(k), self.acts.get(v));
        let mut off = 0;
        for (kv, &cnt) in self.kvs.iter_mut().zip(self.inp.counts) {
            kv.append(slot, &k[off * kvd..(off + cnt) * kvd], &v[off * kvd..(off + cnt) * kvd]);
            off += cnt;
        }
    }

    fn attention(&mut self, a: &AttnShape, slot: usize, q: Act, out: Act) {
        let inp = self.inp;
        // A full layer of a model whose images see each other in the sliding layers only stays
        // causal (gemma4).
        let ends: &[usize] = if inp.key_ends_sliding_only && a.window == 0 { &[] } else { &inp.key_ends };
        self.with(out, |s, o| s.ops.attention(a, slot, s.kvs, &inp.rows, ends, inp.counts, s.acts.get(q), o));
    }

    /// Route every row, then run each chosen expert once over the rows that chose it (gathered
    /// into one matrix, each row a matrix of its own), adding its output to theirs with their
    /// weights, experts in order.
    fn experts(&mut self, e: &ExpertSet<'_>, r: &Route<'_>, logits: Act, x: Act, out: Act) {
        let (n_expert, n_used, hd) = (r.n_expert, r.n_used, e.hidden);
        let d = e.gate[0].cols;
        let mut route = std::mem::take(&mut self.acts.route);
        let mut rows = std::mem::take(&mut self.acts.picked);
        let [mut xs, mut gate, mut up, mut o] = std::mem::take(&mut self.acts.moe);
        self.ops.route(self.acts.get(logits), r, &mut route);
        self.with(out, |s, acc| {
            acc.fill(0.0);
            let h = s.acts.get(x);
            for ex in 0..n_expert {
                rows.clear();
                rows.extend(route.iter().enumerate().filter(|(_, &(x, _))| x == ex).map(|(i, &(_, w))| (i / n_used, w)));
                let m = rows.len();
                if m == 0 {
                    continue;
                }
                let xm = grow(&mut xs, m * d);
                for (j, &(t, _)) in rows.iter().enumerate() {
                    xm[j * d..(j + 1) * d].copy_from_slice(&h[t * d..(t + 1) * d]);
                }
                let ones = vec![1; m];
                grow(&mut gate, m * hd);
                grow(&mut up, m * hd);
                s.ops.matmul(&mut [(&e.gate[ex], &mut gate[..m * hd]), (&e.up[ex], &mut up[..m * hd])], &xs[..m * d], &ones);
                if let Some([bg, bu, _]) = e.biases {
                    s.ops.add_bias(&mut gate[..m * hd], &bg[ex * hd..(ex + 1) * hd]);
                    s.ops.add_bias(&mut up[..m * hd], &bu[ex * hd..(ex + 1) * hd]);
                }
                s.ops.glu(&mut gate[..m * hd], &up[..m * hd], hd, e.act);
                let om = grow(&mut o, m * d);
                s.ops.matmul(&mut [(&e.down[ex], om)], &gate[..m * hd], &ones);
                if let Some([_, _, bd]) = e.biases {
                    s.ops.add_bias(&mut o[..m * d], &bd[ex * d..(ex + 1) * d]);
                }
                let es = e.expert_scale.map_or(1.0, |sc| sc[ex]);
                for (j, &(t, w)) in rows.iter().enumerate() {
                    s.ops.add_scaled(&mut acc[t * d..(t + 1) * d], &o[j * d..(j + 1) * d], w * es);
                }
            }
        });
        self.acts.route = route;
        self.acts.picked = rows;
        self.acts.moe = [xs, gate, up, o];
    }

    fn delta_net(&mut self, dn: &DeltaNet, p: &DnParams, slot: usize, qkv: Act, beta: Act, alpha: Act, out: Act) {
        let (cd, nv) = (dn.conv_dim(), dn.n_v_heads);
        let bufs = [qkv, beta, alpha, out];
        let [mut q, mut b, mut a, mut o] = bufs.map(|x| std::mem::take(&mut self.acts.bufs[x.buf as usize]));
        let (qs, bs, als, os) = (
            &mut q[qkv.off..qkv.off + qkv.len],
            &mut b[beta.off..beta.off + beta.len],
            &mut a[alpha.off..alpha.off + alpha.len],
            &mut o[out.off..out.off + out.len],
        );
        let mut first = 0;
        for ((kv, &cnt), &rec) in self.kvs.iter_mut().zip(self.inp.counts).zip(&self.inp.journal) {
            if rec {
                let r = first..first + cnt;
                kv.journal(slot, &qs[r.start * cd..r.end * cd], &bs[r.start * nv..r.end * nv], &als[r.start * nv..r.end * nv], cnt);
            }
            first += cnt;
        }
        let mut states: Vec<RecIo> = self.kvs.iter_mut().map(|kv| kv.rec_io(slot)).collect();
        self.ops.delta_net(dn, p, &mut states, self.inp.counts, qs, bs, als, os);
        drop(states);
        for (x, v) in bufs.into_iter().zip([q, b, a, o]) {
            self.acts.bufs[x.buf as usize] = v;
        }
    }

    fn load(&mut self, src: &[f32], x: Act) {
        self.with(x, |_, v| v.copy_from_slice(src));
    }
}
