//! The vision transformer of a `clip` file, as llama.cpp's `clip_graph::build_vit` builds it:
//! patch embedding (a strided convolution, run as one matrix over the patches), then position
//! information (SigLIP's learned embeddings, or Pixtral's 2-D RoPE on Q and K), pre-norm layers
//! (LayerNorm with bias or RMS norm, as the projector's graph says), full (non-causal) multi-head
//! attention and an MLP (gated where the file has `ffn_gate`), then the post norm where there is
//! one. Where AVX-512 is there, the float matrices, the attention and the activations run on
//! `cpu::dense` (a register-blocked GEMM over the image's thousands of rows, on the runtime's
//! threads); elsewhere the matrices go through the host's kernels and the rest is plain f32.

use super::{f32_weight, tensor_f32};
use crate::backend::HostOps;
use crate::cpu::dense;
use crate::model::{Metadata, TensorTable};
use crate::quant::Weight;
use crate::{Error, Result};

/// The MLP's activation (`clip.use_gelu` / `clip.use_silu`, else GELU-quick, as llama.cpp).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VitAct {
    /// GELU, tanh form.
    Gelu,
    /// x * sigmoid(1.702 x).
    GeluQuick,
    Silu,
}

/// The tower's shape, from `clip.vision.*`.
#[derive(Clone, Debug)]
pub struct VitConfig {
    pub image_size: usize,
    pub patch_size: usize,
    pub dim: usize,
    pub ff: usize,
    pub n_heads: usize,
    pub n_layers: usize,
    pub eps: f32,
    pub act: VitAct,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
}

impl VitConfig {
    pub(crate) fn from_meta(m: &Metadata) -> Result<VitConfig> {
        let image_size = m.req_positive("vision.image_size")?;
        let patch_size = m.req_positive("vision.patch_size")?;
        // Not necessarily a multiple (SmolVLM2: 384 in patches of 14): the patch convolution
        // leaves the rest out.
        if image_size < patch_size {
            return Err(Error::Gguf(format!("clip.vision.image_size {image_size} is smaller than clip.vision.patch_size {patch_size}")));
        }
        let dim = m.req_positive("vision.embedding_length")?;
        let n_heads = m.req_positive("vision.attention.head_count")?;
        if !dim.is_multiple_of(n_heads) {
            return Err(Error::Gguf(format!("clip.vision.embedding_length {dim} is not a multiple of clip.vision.attention.head_count {n_heads}")));
        }
        let (gelu, silu) = (m.flag("use_gelu")?.unwrap_or(false), m.flag("use_silu")?.unwrap_or(false));
        let act = match (gelu, silu) {
            (true, true) => return Err(Error::Gguf("clip.use_gelu and clip.use_silu are both true".into())),
            (true, false) => VitAct::Gelu,
            (false, true) => VitAct::Silu,
            (false, false) => VitAct::GeluQuick,
        };
        let triple = |key: &str| -> Result<[f32; 3]> {
            match m.get(key) {
                Some(crate::model::MetaValue::Array(a)) if a.len() >= 3 => {
                    let mut out = [0.0f32; 3];
                    for (o, v) in out.iter_mut().zip(a) {
                        *o = match v {
                            crate::model::MetaValue::Float(f) => *f as f32,
                            crate::model::MetaValue::Int(i) => *i as f32,
                            _ => return Err(Error::Gguf(format!("metadata key 'clip.{key}' must hold numbers"))),
                        };
                    }
                    Ok(out)
                }
                _ => Err(Error::Gguf(format!("metadata key 'clip.{key}' must be an array of at least 3 numbers"))),
            }
        };
        let image_std = triple("vision.image_std")?;
        if image_std.contains(&0.0) {
            return Err(Error::Gguf("clip.vision.image_std holds a 0".into()));
        }
        Ok(VitConfig {
            image_size,
            patch_size,
            dim,
            ff: m.req_positive("vision.feed_forward_length")?,
            n_heads,
            n_layers: m.req_positive("vision.block_count")?,
            eps: m.positive_or("vision.attention.layer_norm_epsilon", 1e-6)? as f32,
            act,
            image_mean: triple("vision.image_mean")?,
            image_std,
        })
    }

    /// Patches per side.
    pub fn grid(&self) -> usize {
        self.image_size / self.patch_size
    }
}

/// How a projector's graph builds its tower (what the file's tensors do not say).
#[derive(Clone, Copy, Debug)]
pub(crate) struct VitStyle {
    /// RMS norms (Pixtral) instead of LayerNorms (SigLIP).
    pub rms: bool,
    /// 2-D RoPE of this base on Q and K (`clip_graph::build_rope_2d`), instead of learned
    /// position embeddings.
    pub rope_2d: Option<f32>,
}

/// A norm's weight and optional bias; RMS or LayerNorm as the tower's style says.
pub(crate) struct Norm {
    w: Vec<f32>,
    b: Option<Vec<f32>>,
    rms: bool,
}

pub(crate) struct VitLayer {
    pub(super) ln1: Norm,
    pub(super) q: Weight,
    pub(super) k: Weight,
    pub(super) v: Weight,
    pub(super) bq: Option<Vec<f32>>,
    pub(super) bk: Option<Vec<f32>>,
    pub(super) bv: Option<Vec<f32>>,
    pub(super) o: Weight,
    pub(super) bo: Option<Vec<f32>>,
    pub(super) ln2: Norm,
    pub(super) gate: Option<Weight>,
    pub(super) b_gate: Option<Vec<f32>>,
    pub(super) up: Weight,
    pub(super) b_up: Option<Vec<f32>>,
    pub(super) down: Weight,
    pub(super) b_down: Option<Vec<f32>>,
}

impl VitLayer {
    pub(super) fn matrices(&self) -> Vec<&Weight> {
        [&self.q, &self.k, &self.v, &self.o].into_iter().chain(&self.gate).chain([&self.up, &self.down]).collect()
    }
}

pub(crate) struct Vit {
    /// dim x (3 * patch * patch): each output channel's kernel, channel, row, column.
    pub(super) patch: Weight,
    pub(super) patch_bias: Option<Vec<f32>>,
    /// n_patches x dim (a fixed grid), where the tower learned its positions.
    pub(super) pos: Option<Vec<f32>>,
    pub(super) rope_2d: Option<f32>,
    pub(super) pre_ln: Option<Norm>,
    pub(super) layers: Vec<VitLayer>,
    pub(super) post_ln: Option<Norm>,
}

pub(crate) fn norm(t: &TensorTable<'_>, prefix: &str, d: usize, rms: bool) -> Result<Norm> {
    Ok(Norm { w: t.vector(&format!("{prefix}.weight"), d)?, b: t.opt_vector(&format!("{prefix}.bias"), d)?, rms })
}

fn opt_norm(t: &TensorTable<'_>, prefix: &str, d: usize, rms: bool) -> Result<Option<Norm>> {
    if t.has(&format!("{prefix}.weight")) {
        norm(t, prefix, d, rms).map(Some)
    } else {
        Ok(None)
    }
}

impl Vit {
    pub(crate) fn load(t: &TensorTable<'_>, c: &VitConfig, style: VitStyle) -> Result<Vit> {
        let (d, p, g, rms) = (c.dim, c.patch_size, c.grid(), style.rms);
        let patch = tensor_f32(t, "v.patch_embd.weight", &[p, p, 3, d])?;
        let pos = match style.rope_2d {
            None => Some(tensor_f32(t, "v.position_embd.weight", &[d, g * g])?),
            Some(_) => None,
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        for il in 0..c.n_layers {
            let n = |s: &str| format!("v.blk.{il}.{s}");
            let bias = |s: &str, len: usize| t.opt_vector(&n(s), len);
            // Older conversions swapped the MLP's up and down (llama.cpp swaps them back where
            // ffn_down reads the embedding width); a gated MLP never was.
            let gated = t.has(&n("ffn_gate.weight"));
            let (mut up, mut down) = ("ffn_up", "ffn_down");
            if !gated && c.ff != d && t.raw(&n("ffn_down.weight")).is_ok_and(|w| w.cols == d) {
                (up, down) = (down, up);
            }
            // Q, K and V: three tensors, or row ranges of one fused `attn_qkv` (Qwen3-VL).
            let ([q, k, v], [bq, bk, bv]) = if t.has(&n("attn_qkv.weight")) {
                let mut p = t.matrix_parts(&n("attn_qkv.weight"), &[d, d, d], d)?.into_iter();
                let ws = std::array::from_fn(|_| p.next().expect("three parts"));
                let bs = match bias("attn_qkv.bias", 3 * d)? {
                    Some(b) => std::array::from_fn(|i| Some(b[i * d..(i + 1) * d].to_vec())),
                    None => [None, None, None],
                };
                (ws, bs)
            } else {
                let ws = [t.matrix(&n("attn_q.weight"), d, d)?, t.matrix(&n("attn_k.weight"), d, d)?, t.matrix(&n("attn_v.weight"), d, d)?];
                (ws, [bias("attn_q.bias", d)?, bias("attn_k.bias", d)?, bias("attn_v.bias", d)?])
            };
            layers.push(VitLayer {
                ln1: norm(t, &n("ln1"), d, rms)?,
                q,
                k,
                v,
                bq,
                bk,
                bv,
                o: t.matrix(&n("attn_out.weight"), d, d)?,
                bo: bias("attn_out.bias", d)?,
                ln2: norm(t, &n("ln2"), d, rms)?,
                gate: if gated { Some(t.matrix(&n("ffn_gate.weight"), c.ff, d)?) } else { None },
                b_gate: bias("ffn_gate.bias", c.ff)?,
                up: t.matrix(&n(&format!("{up}.weight")), c.ff, d)?,
                b_up: bias(&format!("{up}.bias"), c.ff)?,
                down: t.matrix(&n(&format!("{down}.weight")), d, c.ff)?,
                b_down: bias(&format!("{down}.bias"), d)?,
            });
        }
        Ok(Vit {
            patch: f32_weight(&patch, d, 3 * p * p),
            patch_bias: t.opt_vector("v.patch_embd.bias", d)?,
            pos,
            rope_2d: style.rope_2d,
            pre_ln: opt_norm(t, "v.pre_ln", d, rms)?,
            layers,
            post_ln: opt_norm(t, "v.post_ln", d, rms)?,
        })
    }

    /// Patch features after the post norm: gw x gh rows of `dim`, patches row by row, from
    /// planar pixels of gw x gh patches. A tower with learned positions takes its own grid only.
    pub(crate) fn forward(&self, ops: &mut dyn HostOps, c: &VitConfig, pixels: &[f32], gw: usize, gh: usize) -> Vec<f32> {
        let (d, n) = (c.dim, gw * gh);
        let cols = patch_rows(pixels, gw, gh, c.patch_size);
        let mut x = vec![0.0f32; n * d];
        matmul(ops, &mut [(&self.patch, &mut x)], &cols, n);
        if let Some(b) = &self.patch_bias {
            ops.add_bias(&mut x, b);
        }
        if let Some(pos) = &self.pos {
            debug_assert_eq!(pos.len(), n * d, "learned positions are for the tower's own grid");
            ops.add(&mut x, pos);
        }
        let hd = d / c.n_heads;
        let rope = self.rope_2d.map(|base| rope_2d_table(base, hd, gw, gh));
        if let Some(ln) = &self.pre_ln {
            layer_norm(&mut x, ln, c.eps);
        }
        let mut b = LayerBufs::new(self, c, n);
        for l in &self.layers {
            b.qkv(ops, l, c, &x, n);
            if let Some(r) = &rope {
                apply_rope_2d(&mut b.q, r, hd);
                apply_rope_2d(&mut b.k, r, hd);
            }
            full_attention(ops, &b.q, &b.k, &b.v, n, c.n_heads, hd, &mut b.att);
            b.tail(ops, l, c, &mut x, n);
        }
        if let Some(ln) = &self.post_ln {
            layer_norm(&mut x, ln, c.eps);
        }
        x
    }
}

/// One layer's working rows, reused from layer to layer: the normed input, Q, K, V, the
/// attention's output, a projection's output and the MLP's.
pub(super) struct LayerBufs {
    h: Vec<f32>,
    pub(super) q: Vec<f32>,
    pub(super) k: Vec<f32>,
    pub(super) v: Vec<f32>,
    /// The attention writes here; `tail` reads it.
    pub(super) att: Vec<f32>,
    o: Vec<f32>,
    up: Vec<f32>,
    gate: Vec<f32>,
}

impl LayerBufs {
    pub(super) fn new(vit: &Vit, c: &VitConfig, n: usize) -> LayerBufs {
        let d = c.dim;
        let gated = vit.layers.iter().any(|l| l.gate.is_some());
        LayerBufs {
            h: vec![0.0; n * d],
            q: vec![0.0; n * d],
            k: vec![0.0; n * d],
            v: vec![0.0; n * d],
            att: vec![0.0; n * d],
            o: vec![0.0; n * d],
            up: vec![0.0; n * c.ff],
            gate: vec![0.0; if gated { n * c.ff } else { 0 }],
        }
    }

    /// The first norm and Q, K, V (biases added) of `x`'s n rows.
    pub(super) fn qkv(&mut self, ops: &mut dyn HostOps, l: &VitLayer, c: &VitConfig, x: &[f32], n: usize) {
        self.h.copy_from_slice(x);
        layer_norm(&mut self.h, &l.ln1, c.eps);
        matmul(ops, &mut [(&l.q, &mut self.q), (&l.k, &mut self.k), (&l.v, &mut self.v)], &self.h, n);
        for (bias, out) in [(&l.bq, &mut self.q), (&l.bk, &mut self.k), (&l.bv, &mut self.v)] {
            if let Some(b) = bias {
                ops.add_bias(out, b);
            }
        }
    }

    /// After the attention (in `att`): its projection into the residual, the second norm, the
    /// MLP and its residual.
    pub(super) fn tail(&mut self, ops: &mut dyn HostOps, l: &VitLayer, c: &VitConfig, x: &mut [f32], n: usize) {
        let (h, o, up, gate) = (&mut self.h, &mut self.o, &mut self.up, &mut self.gate);
        matmul(ops, &mut [(&l.o, o)], &self.att, n);
        if let Some(b) = &l.bo {
            ops.add_bias(o, b);
        }
        ops.add(x, o);
        h.copy_from_slice(x);
        layer_norm(h, &l.ln2, c.eps);
        matmul(ops, &mut [(&l.up, up)], h, n);
        if let Some(b) = &l.b_up {
            ops.add_bias(up, b);
        }
        let hidden: &[f32] = match &l.gate {
            // act(gate) * up (ggml's swiglu_split / geglu_split).
            Some(gate_w) => {
                matmul(ops, &mut [(gate_w, gate)], h, n);
                if let Some(b) = &l.b_gate {
                    ops.add_bias(gate, b);
                }
                activate(gate, c.act);
                gate.iter_mut().zip(up.iter()).for_each(|(g_, u)| *g_ *= u);
                gate
            }
            None => {
                activate(up, c.act);
                up
            }
        };
        matmul(ops, &mut [(&l.down, o)], hidden, n);
        if let Some(b) = &l.b_down {
            ops.add_bias(o, b);
        }
        ops.add(x, o);
    }
}

/// out_j = W_j x for n rows of x: the device where the tower is placed on one that holds the
/// weights, else the dense GEMM where it runs and takes them, else the host's kernels.
pub(super) fn matmul(ops: &mut dyn HostOps, segs: &mut [(&Weight, &mut [f32])], x: &[f32], n: usize) {
    if ops.offload_matmul(segs, x, n) {
        return;
    }
    if dense::fast() && segs.iter().all(|(w, _)| dense::gemm_takes(w)) {
        for (w, out) in segs.iter_mut() {
            dense::gemm(ops, w, x, n, out);
        }
    } else {
        ops.matmul(segs, x, &[n]);
    }
}

/// LayerNorm (or RMS norm) of each row (rows of the weight's length): mean and variance in f64,
/// as ggml_norm's f32 sums to within rounding.
pub(crate) fn layer_norm(x: &mut [f32], n: &Norm, eps: f32) {
    let d = n.w.len();
    if n.rms {
        for row in x.chunks_exact_mut(d) {
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
            let inv = (1.0 / (ms + eps as f64).sqrt()) as f32;
            for (i, v) in row.iter_mut().enumerate() {
                *v = *v * inv * n.w[i] + n.b.as_ref().map_or(0.0, |b| b[i]);
            }
        }
        return;
    }
    for row in x.chunks_exact_mut(d) {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / d as f64;
        let inv = 1.0 / (var + eps as f64).sqrt();
        for (i, v) in row.iter_mut().enumerate() {
            let y = ((*v as f64 - mean) * inv) as f32 * n.w[i];
            *v = match &n.b {
                Some(b) => y + b[i],
                None => y,
            };
        }
    }
}

/// Each patch's (cos, sin) per rotated pair of a head: `hd / 4` pairs turned by the patch's row,
/// then `hd / 4` by its column (a patch's position on each axis, row by row over the grid).
pub(crate) struct Rope2d {
    cs: Vec<(f32, f32)>,
}

/// `clip_graph::build_rope_2d` with interleaved frequencies (Pixtral): two adjacent-pair RoPEs of
/// hd/2 dimensions each, the first half of a head over the row index with frequencies
/// base^(-4i/hd), the second over the column with base^(-(4i+2)/hd), the angles as ggml's cache
/// builds them (f32, each frequency the previous times the step).
fn rope_2d_table(base: f32, hd: usize, gw: usize, gh: usize) -> Rope2d {
    let half = hd / 2;
    let step = base.powf(-2.0 / half as f32);
    let odd = base.powf(-2.0 / hd as f32);
    let mut cs = Vec::with_capacity(gw * gh * half);
    for pi in 0..gw * gh {
        for (axis, pos) in [(0, pi / gw), (1, pi % gw)] {
            let mut theta = pos as f32;
            for _ in 0..half / 2 {
                let a = if axis == 0 { theta } else { odd * theta };
                cs.push((a.cos(), a.sin()));
                theta *= step;
            }
        }
    }
    Rope2d { cs }
}

/// Rotate each head's adjacent pairs of every row by the row's (cos, sin) pairs.
fn apply_rope_2d(x: &mut [f32], r: &Rope2d, hd: usize) {
    let pairs = hd / 2;
    let n = r.cs.len() / pairs;
    let width = x.len() / n;
    for (t, row) in x.chunks_exact_mut(width).enumerate() {
        let cs = &r.cs[t * pairs..(t + 1) * pairs];
        for head in row.chunks_exact_mut(hd) {
            for (pair, &(c, s)) in head.chunks_exact_mut(2).zip(cs) {
                let (x0, x1) = (pair[0], pair[1]);
                pair[0] = x0 * c - x1 * s;
                pair[1] = x0 * s + x1 * c;
            }
        }
    }
}

pub(crate) fn activate(x: &mut [f32], act: VitAct) {
    // All three are x / (1 + exp(z)), vectorised there.
    dense::activate(
        x,
        match act {
            VitAct::Gelu => dense::Act::GeluTanh,
            VitAct::GeluQuick => dense::Act::GeluQuick,
            VitAct::Silu => dense::Act::Silu,
        },
    )
}

/// Every row attends every row (an image's patches see each other), per head: on the device
/// where the tower is placed on one, else scores and the weighted sum as matrices over the
/// host's kernels, the softmax in f32 with an f64 total.
#[allow(clippy::too_many_arguments)]
pub(super) fn full_attention(ops: &mut dyn HostOps, q: &[f32], k: &[f32], v: &[f32], n: usize, heads: usize, hd: usize, out: &mut [f32]) {
    if ops.offload_attention(q, k, v, n, heads, hd, &[], out) {
        return;
    }
    if dense::fast() {
        return dense::attention(ops, q, k, v, n, heads, hd, out);
    }
    let d = heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let one = [n];
    let (mut qh, mut kh, mut vt) = (vec![0.0f32; n * hd], vec![0.0f32; n * hd], vec![0.0f32; hd * n]);
    let (mut sc, mut oh) = (vec![0.0f32; n * n], vec![0.0f32; n * hd]);
    for h in 0..heads {
        for t in 0..n {
            qh[t * hd..(t + 1) * hd].copy_from_slice(&q[t * d + h * hd..t * d + (h + 1) * hd]);
            kh[t * hd..(t + 1) * hd].copy_from_slice(&k[t * d + h * hd..t * d + (h + 1) * hd]);
            for j in 0..hd {
                vt[j * n + t] = v[t * d + h * hd + j];
            }
        }
        let kw = f32_weight(&kh, n, hd);
        ops.matmul(&mut [(&kw, &mut sc)], &qh, &one);
        for row in sc.chunks_exact_mut(n) {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s * scale));
            let mut total = 0.0f64;
            for s in row.iter_mut() {
                *s = (*s * scale - max).exp();
                total += *s as f64;
            }
            let inv = (1.0 / total) as f32;
            row.iter_mut().for_each(|s| *s *= inv);
        }
        let vw = f32_weight(&vt, hd, n);
        ops.matmul(&mut [(&vw, &mut oh)], &sc, &one);
        for t in 0..n {
            out[t * d + h * hd..t * d + (h + 1) * hd].copy_from_slice(&oh[t * hd..(t + 1) * hd]);
        }
    }
}

/// The average of each k x k block of a gw x gh grid of rows of `d` values: (gw / k) x (gh / k)
/// rows, row by row over the pooled grid (ggml's 2-D average pooling of the patch grid).
pub(crate) fn avg_pool(x: &[f32], gw: usize, gh: usize, k: usize, d: usize) -> Vec<f32> {
    let (ox, oy) = (gw / k, gh / k);
    let mut pooled = vec![0.0f32; ox * oy * d];
    let inv = 1.0 / (k * k) as f32;
    for (ti, row) in pooled.chunks_exact_mut(d).enumerate() {
        let (ty, tx) = (ti / ox, ti % ox);
        for ky in 0..k {
            for kx in 0..k {
                let p = (ty * k + ky) * gw + tx * k + kx;
                row.iter_mut().zip(&x[p * d..(p + 1) * d]).for_each(|(a, &b)| *a += b);
            }
        }
        row.iter_mut().for_each(|a| *a *= inv);
    }
    pooled
}

/// Each of gw x gh patches of planar pixels as a row of channel, row, column: the patch
/// convolution's kernel order, so the convolution is one matmul.
pub(crate) fn patch_rows(pixels: &[f32], gw: usize, gh: usize, p: usize) -> Vec<f32> {
    let (n, w, h) = (gw * gh, gw * p, gh * p);
    debug_assert_eq!(pixels.len(), 3 * w * h);
    let mut cols = vec![0.0f32; n * 3 * p * p];
    for (pi, row) in cols.chunks_exact_mut(3 * p * p).enumerate() {
        let (py, px) = (pi / gw, pi % gw);
        for ch in 0..3 {
            for ky in 0..p {
                let src = ch * w * h + (py * p + ky) * w + px * p;
                row[(ch * p + ky) * p..(ch * p + ky + 1) * p].copy_from_slice(&pixels[src..src + p]);
            }
        }
    }
    cols
}
