//! Qwen2-VL and Qwen2.5-VL's tower and projector (llama.cpp's `clip_graph_qwen2vl`, projector
//! types `qwen2vl` and `qwen25vl`): the image at its own size in patches, taken 2 x 2 patches at
//! a time (each block's four patches consecutive, blocks row by row), two patch kernels added (a
//! still image is both frames of the temporal pair), a multi-axis RoPE in the attention (ggml's
//! vision mode: the first quarter of a head's pairs turned by the patch's row, the second by its
//! column, each pair with its partner half a head away), then LayerNorm and a GELU MLP
//! (Qwen2-VL) or RMS norms and a gated SiLU MLP (Qwen2.5-VL), where every layer but each
//! `n_wa_pattern`-th attends within its window of 112 x 112 pixels only. After the post
//! norm each block's four patches become one row of four times the width, and a two-layer GELU
//! MLP (`mm.0`, `mm.2`) takes it to the text width: one token per block, row by row. Qwen3-VL
//! (`qwen3vl_merger`) is this tower with LayerNorms, a GELU MLP, no windows, a patch bias,
//! learned positions and deepstack mergers (`qwen3vl`).
//!
//! llama.cpp runs the windowed layers over the patches regrouped window by window with a
//! block-diagonal mask and puts the tokens back in order at the end; attention is the same for
//! any order of its rows, so this runs each window's rows on their own in block order instead.

use super::qwen3vl::Qwen3vl;
use super::vit::{activate, full_attention, layer_norm, matmul, LayerBufs, Vit, VitAct};
use super::{f32_weight, tensor_f32, VitConfig};
use crate::backend::HostOps;
use crate::model::{Metadata, TensorTable};
use crate::quant::Weight;
use crate::{Error, Result};

/// ggml_rope_multi's base for the tower (clip.cpp passes 10000).
const ROPE_BASE: f32 = 10000.0;
/// A window's side in pixels (clip.cpp's default, which it uses for these projectors).
const WINDOW_PX: usize = 112;

pub(crate) struct Qwen2vl {
    /// Every layer but each `wa_pattern`-th attends within its window (0: every layer attends
    /// every patch, as Qwen2-VL).
    wa_pattern: usize,
    /// A window's side in tokens (2 x 2 patch blocks).
    window: usize,
    /// hidden x (4 * dim).
    mm0: Weight,
    mm0_b: Vec<f32>,
    /// text_dim x hidden.
    mm2: Weight,
    mm2_b: Vec<f32>,
    /// Qwen3-VL's positions and deepstack mergers.
    v3: Option<Qwen3vl>,
}

/// Which of the family a file is (its projector type).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Version {
    Qwen2,
    Qwen25,
    Qwen3,
}

impl Qwen2vl {
    /// The merger's matrices and Qwen3-VL's deepstack mergers'.
    pub(crate) fn matrices(&self) -> Vec<&Weight> {
        let deep = self.v3.iter().flat_map(|v| &v.deepstack).flat_map(|d| d.matrices());
        [&self.mm0, &self.mm2].into_iter().chain(deep).collect()
    }

    /// The projector's weights; also adds the second patch kernel (`v.patch_embd.weight.1`) into
    /// the tower's.
    pub(crate) fn load(t: &TensorTable<'_>, meta: &Metadata, c: &VitConfig, version: Version, vit: &mut Vit) -> Result<Qwen2vl> {
        let (qwen25, qwen3) = (version == Version::Qwen25, version == Version::Qwen3);
        let (d, p) = (c.dim, c.patch_size);
        let merge = meta.size("vision.spatial_merge_size")?.unwrap_or(2);
        if merge != 2 {
            return Err(Error::UnsupportedModel(format!("clip.vision.spatial_merge_size is {merge}; Qwen-VL's projector merges 2 x 2 patches")));
        }
        let hd = d / c.n_heads;
        if !hd.is_multiple_of(4) {
            return Err(Error::Gguf(format!("the tower's head width {hd} is not a multiple of 4, which its 2-D RoPE needs")));
        }
        if qwen3 && vit.patch_bias.is_none() {
            return Err(Error::Gguf("tensor 'v.patch_embd.bias' is missing; Qwen3-VL's tower has a patch bias".into()));
        }
        // (Learned positions, where a Qwen2-VL file has them, go unused, as in llama.cpp's graph.)
        if !qwen3 && vit.patch_bias.is_some() {
            return Err(Error::Gguf("tensor 'v.patch_embd.bias' is present; a Qwen2-VL tower has no patch bias".into()));
        }
        let mut kernel = tensor_f32(t, "v.patch_embd.weight", &[p, p, 3, d])?;
        if t.has("v.patch_embd.weight.1") {
            let second = tensor_f32(t, "v.patch_embd.weight.1", &[p, p, 3, d])?;
            kernel.iter_mut().zip(&second).for_each(|(a, b)| *a += b);
        }
        vit.patch = f32_weight(&kernel, d, 3 * p * p);
        // Qwen3-VL's graph attends every patch in every layer, whatever the file says.
        let wa_pattern = if qwen3 { 0 } else { meta.size("vision.n_wa_pattern")?.unwrap_or(0) };
        if qwen25 && wa_pattern == 0 {
            return Err(Error::Gguf("metadata key 'clip.vision.n_wa_pattern' is missing or 0; Qwen2.5-VL's tower needs it".into()));
        }
        // clip.cpp reads no window size for these projectors: 112 pixels, Qwen2.5-VL's.
        let window = WINDOW_PX / p / merge;
        if wa_pattern > 0 && window == 0 {
            return Err(Error::UnsupportedModel(format!("the tower's {p}-pixel patches are too large for Qwen2.5-VL's windows of {WINDOW_PX} pixels")));
        }
        let hidden = t.raw("mm.0.weight")?.rows;
        let text = t.raw("mm.2.weight")?.rows;
        let v3 = if qwen3 { Some(Qwen3vl::load(t, c, text)?) } else { None };
        Ok(Qwen2vl {
            v3,
            wa_pattern,
            window,
            mm0: t.matrix("mm.0.weight", hidden, 4 * d)?,
            mm0_b: t.vector("mm.0.bias", hidden)?,
            mm2: t.matrix("mm.2.weight", text, hidden)?,
            mm2_b: t.vector("mm.2.bias", text)?,
        })
    }

    /// Rows an image of gw x gh patches becomes: one per 2 x 2 block.
    pub(crate) fn n_tokens(&self, gw: usize, gh: usize) -> usize {
        (gw / 2) * (gh / 2)
    }

    /// The values of an image's row: the text width, times 1 + the deepstack mergers.
    pub(crate) fn text_dim(&self) -> usize {
        self.v3.as_ref().map_or(self.mm2.rows, |v| v.row_width(self.mm2.rows))
    }

    pub(crate) fn forward(&self, ops: &mut dyn HostOps, c: &VitConfig, vit: &Vit, pixels: &[f32], gw: usize, gh: usize) -> Vec<f32> {
        let (d, p) = (c.dim, c.patch_size);
        let (n, w, h) = (gw * gh, gw * p, gh * p);
        let (bw, bh) = (gw / 2, gh / 2);
        // Patch i of the sequence: block i / 4 (blocks row by row), then row and column in it.
        let at = |i: usize| {
            let (b, r) = (i / 4, i % 4);
            (2 * (b / bw) + r / 2, 2 * (b % bw) + r % 2)
        };
        let mut cols = vec![0.0f32; n * 3 * p * p];
        for (i, row) in cols.chunks_exact_mut(3 * p * p).enumerate() {
            let (py, px) = at(i);
            for ch in 0..3 {
                for ky in 0..p {
                    let src = ch * w * h + (py * p + ky) * w + px * p;
                    row[(ch * p + ky) * p..(ch * p + ky + 1) * p].copy_from_slice(&pixels[src..src + p]);
                }
            }
        }
        let mut x = vec![0.0f32; n * d];
        matmul(ops, &mut [(&vit.patch, &mut x)], &cols, n);
        if let Some(b) = &vit.patch_bias {
            ops.add_bias(&mut x, b);
        }
        if let Some(v3) = &self.v3 {
            let pos = v3.positions(d, gw, gh);
            for (i, row) in x.chunks_exact_mut(d).enumerate() {
                let (py, px) = at(i);
                row.iter_mut().zip(&pos[(py * gw + px) * d..(py * gw + px + 1) * d]).for_each(|(a, b)| *a += b);
            }
        }
        // Each deepstack merger's rows, in layer order.
        let mut deep: Vec<Vec<f32>> = Vec::new();
        if let Some(ln) = &vit.pre_ln {
            layer_norm(&mut x, ln, c.eps);
        }
        let hd = d / c.n_heads;
        let rope = rope_table(hd, n, at);
        // The windows (each its sequence rows), where some layer attends within them.
        let windows = if self.wa_pattern > 0 { windows(bw, bh, self.window) } else { Vec::new() };
        let mut b = LayerBufs::new(vit, c, n);
        for (il, l) in vit.layers.iter().enumerate() {
            b.qkv(ops, l, c, &x, n);
            apply_rope(&mut b.q, &rope, hd);
            apply_rope(&mut b.k, &rope, hd);
            let full = self.wa_pattern == 0 || (il + 1).is_multiple_of(self.wa_pattern);
            if full {
                full_attention(ops, &b.q, &b.k, &b.v, n, c.n_heads, hd, &mut b.att);
            } else {
                windowed_attention(ops, &b.q, &b.k, &b.v, &windows, c.n_heads, hd, &mut b.att);
            }
            b.tail(ops, l, c, &mut x, n);
            if let Some(ds) = self.v3.as_ref().and_then(|v| v.deepstack.iter().find(|ds| ds.layer == il)) {
                deep.push(ds.forward(ops, &x, n / 4, c.eps));
            }
        }
        if let Some(ln) = &vit.post_ln {
            layer_norm(&mut x, ln, c.eps);
        }
        // A block's four patches are consecutive rows: as one row of 4 * dim they are the
        // merger's input.
        let tokens = n / 4;
        let mut hid = vec![0.0f32; tokens * self.mm0.rows];
        matmul(ops, &mut [(&self.mm0, &mut hid)], &x, tokens);
        ops.add_bias(&mut hid, &self.mm0_b);
        activate(&mut hid, VitAct::Gelu);
        let mut out = vec![0.0f32; tokens * self.mm2.rows];
        matmul(ops, &mut [(&self.mm2, &mut out)], &hid, tokens);
        ops.add_bias(&mut out, &self.mm2_b);
        if deep.is_empty() {
            return out;
        }
        // Each token's row: the merger's values, then each deepstack's (ggml_concat on dim 0).
        let text = self.mm2.rows;
        let mut rows = Vec::with_capacity(tokens * text * (1 + deep.len()));
        for tk in 0..tokens {
            rows.extend_from_slice(&out[tk * text..(tk + 1) * text]);
            for f in &deep {
                rows.extend_from_slice(&f[tk * text..(tk + 1) * text]);
            }
        }
        rows
    }
}

/// Each sequence row's (cos, sin) per pair of a head (hd / 2 pairs): ggml's M-RoPE cache in
/// vision mode with sections of hd / 4 and `n_dims` hd / 2: pair j < hd / 4 turns by the
/// patch's row times base^(-4j / hd), pair j >= hd / 4 by its column times
/// base^(-4(j - hd/4) / hd), each angle the previous times the step in f32, as ggml builds them.
fn rope_table(hd: usize, n: usize, at: impl Fn(usize) -> (usize, usize)) -> Vec<(f32, f32)> {
    let (half, quarter) = (hd / 2, hd / 4);
    let step = ROPE_BASE.powf(-2.0 / half as f32);
    let mut cs = Vec::with_capacity(n * half);
    for i in 0..n {
        let (row, col) = at(i);
        for pos in [row, col] {
            let mut theta = pos as f32;
            for _ in 0..quarter {
                let (s, c) = theta.sin_cos();
                cs.push((c, s));
                theta *= step;
            }
        }
    }
    cs
}

/// Rotate each head's pairs (j, j + hd / 2) of every row by the row's table.
fn apply_rope(x: &mut [f32], cs: &[(f32, f32)], hd: usize) {
    let half = hd / 2;
    let n = cs.len() / half;
    let width = x.len() / n;
    for (t, row) in x.chunks_exact_mut(width).enumerate() {
        let cs = &cs[t * half..(t + 1) * half];
        for head in row.chunks_exact_mut(hd) {
            let (a, b) = head.split_at_mut(half);
            for ((x0, x1), &(c, s)) in a.iter_mut().zip(b.iter_mut()).zip(cs) {
                let (u, v) = (*x0, *x1);
                *x0 = u * c - v * s;
                *x1 = u * s + v * c;
            }
        }
    }
}

/// The sequence rows of each window (`side` x `side` blocks, windows row by row, the last ones
/// cut at the image's edge), as clip.cpp groups them.
fn windows(bw: usize, bh: usize, side: usize) -> Vec<Vec<usize>> {
    let mut out = Vec::new();
    for wy in (0..bh).step_by(side) {
        for wx in (0..bw).step_by(side) {
            let mut rows = Vec::new();
            for by in wy..(wy + side).min(bh) {
                for bx in wx..(wx + side).min(bw) {
                    rows.extend((0..4).map(|r| 4 * (by * bw + bx) + r));
                }
            }
            out.push(rows);
        }
    }
    out
}

/// Attention within each window: the rows gathered window after window, attended within their
/// windows (by a device in one call, else window by window on the host), put back.
#[allow(clippy::too_many_arguments)]
fn windowed_attention(ops: &mut dyn HostOps, q: &[f32], k: &[f32], v: &[f32], windows: &[Vec<usize>], heads: usize, hd: usize, out: &mut [f32]) {
    let d = heads * hd;
    let order: Vec<usize> = windows.concat();
    let gather = |src: &[f32]| order.iter().flat_map(|&r| src[r * d..(r + 1) * d].iter().copied()).collect::<Vec<f32>>();
    let (wq, wk, wv) = (gather(q), gather(k), gather(v));
    let spans: Vec<usize> = windows.iter().map(Vec::len).collect();
    let mut wo = vec![0.0f32; order.len() * d];
    if !ops.offload_attention(&wq, &wk, &wv, order.len(), heads, hd, &spans, &mut wo) {
        let mut at = 0;
        for &m in &spans {
            let rows = at * d..(at + m) * d;
            full_attention(ops, &wq[rows.clone()], &wk[rows.clone()], &wv[rows.clone()], m, heads, hd, &mut wo[rows]);
            at += m;
        }
    }
    for (i, &r) in order.iter().enumerate() {
        out[r * d..(r + 1) * d].copy_from_slice(&wo[i * d..(i + 1) * d]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_cover_every_block_once_and_cut_at_the_edge() {
        // 5 x 3 blocks in windows of 2: 3 x 2 windows, the right column and bottom row narrower.
        let w = windows(5, 3, 2);
        assert_eq!(w.len(), 6);
        assert_eq!(w.iter().map(Vec::len).collect::<Vec<_>>(), vec![16, 16, 8, 8, 8, 4]);
        let mut all: Vec<usize> = w.concat();
        all.sort_unstable();
        assert_eq!(all, (0..60).collect::<Vec<_>>());
        // The first window: blocks (0,0), (0,1), (1,0), (1,1).
        assert_eq!(&w[0][..8], &[0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(&w[0][8..], &[20, 21, 22, 23, 24, 25, 26, 27]);
    }

    #[test]
    fn rope_turns_the_first_quarter_by_row_and_the_second_by_column() {
        let cs = rope_table(8, 1, |_| (3, 5));
        // hd 8: pairs 0-1 by the row, 2-3 by the column; the step is base^(-2/4).
        let step = ROPE_BASE.powf(-0.5);
        let want = [3.0f32, 3.0 * step, 5.0, 5.0 * step];
        for (&(c, s), a) in cs.iter().zip(want) {
            assert!((c - a.cos()).abs() < 1e-6 && (s - a.sin()).abs() < 1e-6);
        }
    }
}
