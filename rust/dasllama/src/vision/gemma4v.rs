//! Gemma 4's vision tower and projector (llama.cpp's `clip_graph_gemma4v`,
//! `PROJECTOR_TYPE_GEMMA4V`). The tower runs at the image's own size (a multiple of
//! patch x `merge` on each side, `merge` = `clip.vision.projector.scale_factor`, 3 by default):
//!
//! - the pixels are taken to 2x - 1 after the file's mean and std, then patch-embedded (no bias);
//! - each patch adds two learned rows, `v.position_embd.weight` being two tables (GGUF shape
//!   [dim, positions, 2]): the first by the patch's column, the second by its row;
//! - pre-norm layers with RMS norms: Q and K RMS-normed per head (`attn_q_norm`, `attn_k_norm`),
//!   then a 2-D NeoX RoPE of base 100 (the first half of each head turned by the column, the
//!   second by the row), V RMS-normed without a weight, attention unscaled (scale 1), the output
//!   RMS-normed (`attn_post_norm`) before its residual; the MLP (gated, the file's activation:
//!   GELU-quick unless `clip.use_gelu`) likewise (`ffn_post_norm`), and the layer's output times
//!   `out_scale` where the file has it;
//! - every matrix product clamps its input and output where the file has the scalars
//!   `<weight>.input_min/input_max/output_min/output_max` (Gemma4ClippableLinear);
//! - the patch grid average-pooled by `merge` per side, times sqrt(dim), then
//!   `(x - v.std_bias) * v.std_scale` where the file has them, an RMS norm without a weight, and
//!   `mm.input_projection.weight` to the text width.

use super::vit::{activate, avg_pool, full_attention, layer_norm, matmul, patch_rows, Vit};
use super::VitConfig;
use crate::backend::HostOps;
use crate::model::{Metadata, TensorTable};
use crate::quant::Weight;
use crate::{Error, Result};

/// A matrix and its Gemma4ClippableLinear bounds: (min, max) of its input and of its output,
/// where the file has them.
pub(crate) struct Lin {
    w: Weight,
    inp: Option<(f32, f32)>,
    out: Option<(f32, f32)>,
}

impl Lin {
    /// `w` (the tower's copy of `<name>.weight`) with its bounds.
    fn new(t: &TensorTable<'_>, name: &str, w: &Weight) -> Result<Lin> {
        Ok(Lin { w: w.clone(), inp: bounds(t, name, "input")?, out: bounds(t, name, "output")? })
    }
}

/// `<name>.<side>_min` and `_max` (one value each), as clip.cpp reads them: a missing one is
/// -/+ f32::MAX, and neither there: no clamp.
fn bounds(t: &TensorTable<'_>, name: &str, side: &str) -> Result<Option<(f32, f32)>> {
    let (lo, hi) = (format!("{name}.{side}_min"), format!("{name}.{side}_max"));
    if !t.has(&lo) && !t.has(&hi) {
        return Ok(None);
    }
    let one = |n: &str, default: f32| -> Result<f32> { Ok(t.opt_vector(n, 1)?.map_or(default, |v| v[0])) };
    Ok(Some((one(&lo, -f32::MAX)?, one(&hi, f32::MAX)?)))
}

fn clamp(x: &mut [f32], (lo, hi): (f32, f32)) {
    x.iter_mut().for_each(|v| *v = v.clamp(lo, hi));
}

/// out = clamp(W clamp(x)) for n rows of x.
fn lin(ops: &mut dyn HostOps, l: &Lin, x: &[f32], n: usize, out: &mut [f32]) {
    match l.inp {
        Some(b) => {
            let mut xc = x.to_vec();
            clamp(&mut xc, b);
            matmul(ops, &mut [(&l.w, out)], &xc, n);
        }
        None => matmul(ops, &mut [(&l.w, out)], x, n),
    }
    if let Some(b) = l.out {
        clamp(out, b);
    }
}

/// What a Gemma 4 layer has beyond `vit::VitLayer`'s: its matrices with their bounds, the
/// per-head Q/K norms, the post norms and the output scale.
struct Layer {
    q: Lin,
    k: Lin,
    v: Lin,
    o: Lin,
    gate: Option<Lin>,
    up: Lin,
    down: Lin,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    attn_post: Option<Vec<f32>>,
    ffn_post: Option<Vec<f32>>,
    /// One value (Gemma 4's `layer_scalar`) or one per channel.
    out_scale: Option<Vec<f32>>,
}

pub(crate) struct Gemma4v {
    merge: usize,
    /// Rows per positional table (the largest column or row index plus one).
    pos_rows: usize,
    /// The column table's `pos_rows` rows of dim, then the row table's.
    pos: Vec<f32>,
    layers: Vec<Layer>,
    std_bias: Option<Vec<f32>>,
    std_scale: Option<Vec<f32>>,
    /// text_dim x dim.
    proj: Lin,
}

/// The RoPE base clip.cpp sets for Gemma 4's tower.
const ROPE_BASE: f32 = 100.0;

impl Gemma4v {
    /// Its layers' matrices (its own copies, which carry their bounds) and the projection.
    pub(crate) fn matrices(&self) -> Vec<&Weight> {
        fn layer(l: &Layer) -> impl Iterator<Item = &Weight> {
            [&l.q, &l.k, &l.v, &l.o].into_iter().chain(&l.gate).chain([&l.up, &l.down]).map(|x| &x.w)
        }
        self.layers.iter().flat_map(layer).chain([&self.proj.w]).collect()
    }

    /// `vit` holds the tower's tensors that every ViT has (patch embedding, norms, matrices,
    /// biases); this reads the rest, and the matrices' bounds.
    pub(crate) fn load(t: &TensorTable<'_>, meta: &Metadata, c: &VitConfig, vit: &Vit) -> Result<Gemma4v> {
        let merge = meta.size("vision.projector.scale_factor")?.unwrap_or(3);
        if merge == 0 {
            return Err(Error::Gguf("clip.vision.projector.scale_factor is 0; gemma4v pools the patches by at least 1".into()));
        }
        let (d, hd) = (c.dim, c.dim / c.n_heads);
        if !hd.is_multiple_of(4) {
            return Err(Error::Gguf(format!("gemma4v's 2-D RoPE turns pairs in each half of a head; a head of {hd} values is not a multiple of 4")));
        }
        let name = "v.position_embd.weight";
        let pw = t.raw_any(name)?;
        if pw.cols != d || pw.rows % 2 != 0 || pw.rows == 0 {
            return Err(Error::Gguf(format!(
                "tensor '{name}' has {} rows of {}; gemma4v expects two tables (a column's and a row's) of rows of {d}",
                pw.rows, pw.cols
            )));
        }
        let pos = pw.to_f32();
        let head_norm = |n: &str| -> Result<Option<Vec<f32>>> {
            if !t.has(n) {
                return Ok(None);
            }
            // Per head (clip.cpp's norm_per_head) or over the whole row.
            let len = t.raw(n)?.cols;
            if len != hd && len != d {
                return Err(Error::Gguf(format!("tensor '{n}' has {len} values; expected one head's {hd} or the row's {d}")));
            }
            t.vector(n, len).map(Some)
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        for (il, vl) in vit.layers.iter().enumerate() {
            let n = |s: &str| format!("v.blk.{il}.{s}");
            let out_scale = match t.has(&n("out_scale.weight")) {
                true => {
                    let w = t.raw(&n("out_scale.weight"))?;
                    let len = w.rows * w.cols;
                    if len != 1 && len != d {
                        return Err(Error::Gguf(format!("tensor '{}' has {len} values; expected 1 or {d}", n("out_scale.weight"))));
                    }
                    Some(w.to_f32())
                }
                false => None,
            };
            layers.push(Layer {
                q: Lin::new(t, &n("attn_q"), &vl.q)?,
                k: Lin::new(t, &n("attn_k"), &vl.k)?,
                v: Lin::new(t, &n("attn_v"), &vl.v)?,
                o: Lin::new(t, &n("attn_out"), &vl.o)?,
                gate: vl.gate.as_ref().map(|g| Lin::new(t, &n("ffn_gate"), g)).transpose()?,
                up: Lin::new(t, &n("ffn_up"), &vl.up)?,
                down: Lin::new(t, &n("ffn_down"), &vl.down)?,
                q_norm: head_norm(&n("attn_q_norm.weight"))?,
                k_norm: head_norm(&n("attn_k_norm.weight"))?,
                attn_post: t.opt_vector(&n("attn_post_norm.weight"), d)?,
                ffn_post: t.opt_vector(&n("ffn_post_norm.weight"), d)?,
                out_scale,
            });
        }
        let text = t.raw("mm.input_projection.weight")?.rows;
        // clip.cpp applies the two only together.
        let (std_bias, std_scale) = match (t.opt_vector("v.std_bias", d)?, t.opt_vector("v.std_scale", d)?) {
            (Some(b), Some(s)) => (Some(b), Some(s)),
            _ => (None, None),
        };
        Ok(Gemma4v {
            merge,
            pos_rows: pw.rows / 2,
            pos,
            layers,
            std_bias,
            std_scale,
            proj: Lin::new(t, "mm.input_projection", &t.matrix("mm.input_projection.weight", text, d)?)?,
        })
    }

    pub(crate) fn merge(&self) -> usize {
        self.merge
    }

    /// The most patches a side may have (the positional tables' rows).
    pub(crate) fn max_side(&self) -> usize {
        self.pos_rows
    }

    pub(crate) fn n_tokens(&self, gw: usize, gh: usize) -> usize {
        (gw / self.merge) * (gh / self.merge)
    }

    pub(crate) fn text_dim(&self) -> usize {
        self.proj.w.rows
    }

    /// The image's rows: gw x gh patches (multiples of `merge`, at most `max_side`) of planar
    /// normalized pixels in, (gw / merge) x (gh / merge) rows of `text_dim` out.
    pub(crate) fn forward(&self, ops: &mut dyn HostOps, c: &VitConfig, vit: &Vit, pixels: &[f32], gw: usize, gh: usize) -> Vec<f32> {
        let (d, p, nh) = (c.dim, c.patch_size, c.n_heads);
        let hd = d / nh;
        let n = gw * gh;
        // Each value v taken to 2v - 1 as the graph does (after the file's mean and std).
        let mut cols = patch_rows(pixels, gw, gh, p);
        cols.iter_mut().for_each(|v| *v = *v * 2.0 - 1.0);
        let mut x = vec![0.0f32; n * d];
        matmul(ops, &mut [(&vit.patch, &mut x)], &cols, n);
        let (tx, ty) = self.pos.split_at(self.pos_rows * d);
        for (i, row) in x.chunks_exact_mut(d).enumerate() {
            let (col, r) = (i % gw, i / gw);
            row.iter_mut().zip(&tx[col * d..(col + 1) * d]).for_each(|(a, &b)| *a += b);
            row.iter_mut().zip(&ty[r * d..(r + 1) * d]).for_each(|(a, &b)| *a += b);
        }
        if let Some(ln) = &vit.pre_ln {
            layer_norm(&mut x, ln, c.eps);
        }
        let rope = rope_table(hd, gw, gh);
        let sq = (hd as f32).sqrt();
        // The weightless RMS norms' weight (ggml_rms_norm without a ggml_mul).
        let ones_hd = vec![1.0f32; hd];
        // The normed input, Q, K, V, the attention's output and a projection's.
        let [mut hbuf, mut q, mut k, mut v, mut att, mut o]: [Vec<f32>; 6] = std::array::from_fn(|_| vec![0.0f32; n * d]);
        let mut up = vec![0.0f32; n * c.ff];
        let mut gate = vec![0.0f32; n * c.ff];
        for (l, vl) in self.layers.iter().zip(&vit.layers) {
            hbuf.copy_from_slice(&x);
            layer_norm(&mut hbuf, &vl.ln1, c.eps);
            for (m, b, out) in [(&l.q, &vl.bq, &mut q), (&l.k, &vl.bk, &mut k), (&l.v, &vl.bv, &mut v)] {
                lin(ops, m, &hbuf, n, out);
                if let Some(b) = b {
                    ops.add_bias(out, b);
                }
            }
            if let Some(wn) = &l.q_norm {
                ops.rms_norm(&mut q, wn, c.eps);
            }
            if let Some(wn) = &l.k_norm {
                ops.rms_norm(&mut k, wn, c.eps);
            }
            apply_rope(&mut q, &rope, hd);
            apply_rope(&mut k, &rope, hd);
            // V per head, no weight (clip.cpp's gemma4v branch of build_vit).
            ops.rms_norm(&mut v, &ones_hd, c.eps);
            // The graph's attention scale is 1; the shared attention scales by 1/sqrt(hd), so the
            // queries carry sqrt(hd) in.
            q.iter_mut().for_each(|a| *a *= sq);
            full_attention(ops, &q, &k, &v, n, nh, hd, &mut att);
            lin(ops, &l.o, &att, n, &mut o);
            if let Some(b) = &vl.bo {
                ops.add_bias(&mut o, b);
            }
            if let Some(wn) = &l.attn_post {
                ops.rms_norm(&mut o, wn, c.eps);
            }
            ops.add(&mut x, &o);
            hbuf.copy_from_slice(&x);
            layer_norm(&mut hbuf, &vl.ln2, c.eps);
            lin(ops, &l.up, &hbuf, n, &mut up);
            if let Some(b) = &vl.b_up {
                ops.add_bias(&mut up, b);
            }
            let hidden: &[f32] = match &l.gate {
                // act(gate) * up (ggml's geglu_split / swiglu_split).
                Some(gw_) => {
                    lin(ops, gw_, &hbuf, n, &mut gate);
                    if let Some(b) = &vl.b_gate {
                        ops.add_bias(&mut gate, b);
                    }
                    activate(&mut gate, c.act);
                    gate.iter_mut().zip(&up).for_each(|(g_, u)| *g_ *= u);
                    &gate
                }
                None => {
                    activate(&mut up, c.act);
                    &up
                }
            };
            lin(ops, &l.down, hidden, n, &mut o);
            if let Some(b) = &vl.b_down {
                ops.add_bias(&mut o, b);
            }
            if let Some(wn) = &l.ffn_post {
                ops.rms_norm(&mut o, wn, c.eps);
            }
            ops.add(&mut x, &o);
            if let Some(s) = &l.out_scale {
                for row in x.chunks_exact_mut(d) {
                    row.iter_mut().enumerate().for_each(|(i, a)| *a *= s[if s.len() == 1 { 0 } else { i }]);
                }
            }
        }
        if let Some(ln) = &vit.post_ln {
            layer_norm(&mut x, ln, c.eps);
        }
        // Average pooling of merge x merge patches, times sqrt(dim).
        let rows = self.n_tokens(gw, gh);
        let mut pooled = avg_pool(&x, gw, gh, self.merge, d);
        let up_scale = (d as f32).sqrt();
        pooled.iter_mut().for_each(|a| *a *= up_scale);
        if let (Some(b), Some(s)) = (&self.std_bias, &self.std_scale) {
            for row in pooled.chunks_exact_mut(d) {
                for (i, a) in row.iter_mut().enumerate() {
                    *a = (*a - b[i]) * s[i];
                }
            }
        }
        ops.rms_norm(&mut pooled, &vec![1.0; d], c.eps);
        let mut out = vec![0.0f32; rows * self.text_dim()];
        lin(ops, &self.proj, &pooled, rows, &mut out);
        out
    }
}

/// Each patch's (cos, sin) for the hd/4 pairs of a head's first half (turned by its column),
/// then its second half's (by its row): a NeoX RoPE of hd/2 dimensions on each half, the
/// angles as ggml's cache builds them (f32, each frequency the previous times base^(-4/hd)).
fn rope_table(hd: usize, gw: usize, gh: usize) -> Vec<(f32, f32)> {
    let quarter = hd / 4;
    let step = ROPE_BASE.powf(-2.0 / (hd / 2) as f32);
    let mut cs = Vec::with_capacity(gw * gh * 2 * quarter);
    for pi in 0..gw * gh {
        for pos in [pi % gw, pi / gw] {
            let mut theta = pos as f32;
            for _ in 0..quarter {
                cs.push((theta.cos(), theta.sin()));
                theta *= step;
            }
        }
    }
    cs
}

/// Rotate each head of every row: in each half, pair i with pair i + hd/4 (NeoX order).
fn apply_rope(x: &mut [f32], cs: &[(f32, f32)], hd: usize) {
    let quarter = hd / 4;
    let per_row = 2 * quarter;
    let n = cs.len() / per_row;
    let width = x.len() / n;
    for (t, row) in x.chunks_exact_mut(width).enumerate() {
        let cs = &cs[t * per_row..(t + 1) * per_row];
        for head in row.chunks_exact_mut(hd) {
            for (half, cs) in head.chunks_exact_mut(hd / 2).zip(cs.chunks_exact(quarter)) {
                let (a, b) = half.split_at_mut(quarter);
                for ((x0, x1), &(c, s)) in a.iter_mut().zip(b.iter_mut()).zip(cs) {
                    let (u, v) = (*x0, *x1);
                    *x0 = u * c - v * s;
                    *x1 = u * s + v * c;
                }
            }
        }
    }
}
