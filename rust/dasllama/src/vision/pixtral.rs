//! Pixtral's projector (llama.cpp's `clip_graph_pixtral`, Pixtral 12B and Mistral Small 3.x):
//! the tower runs at the image's own size (2-D RoPE, RMS norms, a SiLU-gated MLP), then, where
//! the file has `mm.patch_merger.weight` (Mistral Small 3.1), the patches are RMS-normed with
//! `mm.input_norm.weight` and each `merge` x `merge` block of them (torch's `unfold` order:
//! channel, row, column) is projected back to the tower's width. A two-layer GELU MLP
//! (`mm.1`, `mm.2`) takes the tokens to the text width, and `v.token_embd.img_break` goes after
//! every row of tokens but the last (`[IMG_BREAK]`).

use super::vit::{activate, matmul, VitAct};
use super::VitConfig;
use crate::backend::HostOps;
use crate::model::{Metadata, TensorTable};
use crate::quant::Weight;
use crate::{Error, Result};

pub(crate) struct Pixtral {
    merge: usize,
    input_norm: Option<Vec<f32>>,
    /// dim x (dim * merge * merge).
    merger: Option<Weight>,
    /// hidden x dim.
    mm1: Weight,
    mm1_b: Option<Vec<f32>>,
    /// text_dim x hidden.
    mm2: Weight,
    mm2_b: Option<Vec<f32>>,
    img_break: Option<Vec<f32>>,
}

impl Pixtral {
    pub(crate) fn matrices(&self) -> Vec<&Weight> {
        self.merger.iter().chain([&self.mm1, &self.mm2]).collect()
    }

    pub(crate) fn load(t: &TensorTable<'_>, meta: &Metadata, c: &VitConfig) -> Result<Pixtral> {
        let merge = meta.size("vision.spatial_merge_size")?.unwrap_or(1);
        let d = c.dim;
        let merger = if t.has("mm.patch_merger.weight") { Some(t.matrix("mm.patch_merger.weight", d, d * merge * merge)?) } else { None };
        if merge == 0 || (merge > 1 && merger.is_none()) {
            return Err(Error::Gguf(format!(
                "clip.vision.spatial_merge_size is {merge}, but a merge of patches needs 'mm.patch_merger.weight' and a merge of at least 1"
            )));
        }
        let hidden = t.raw("mm.1.weight")?.rows;
        let mm1 = t.matrix("mm.1.weight", hidden, d)?;
        let text = t.raw("mm.2.weight")?.rows;
        let mm2 = t.matrix("mm.2.weight", text, hidden)?;
        Ok(Pixtral {
            merge,
            input_norm: if merger.is_some() { t.opt_vector("mm.input_norm.weight", d)? } else { None },
            merger,
            mm1,
            mm1_b: t.opt_vector("mm.1.bias", hidden)?,
            mm2,
            mm2_b: t.opt_vector("mm.2.bias", text)?,
            img_break: t.opt_vector("v.token_embd.img_break", text)?,
        })
    }

    /// Patches per side of one token.
    pub(crate) fn merge(&self) -> usize {
        self.merge
    }

    /// Rows an image of gw x gh patches becomes: its tokens, and a break after each row but the
    /// last.
    pub(crate) fn n_tokens(&self, gw: usize, gh: usize) -> usize {
        let (px, py) = (gw / self.merge, gh / self.merge);
        px * py + if self.img_break.is_some() { py.saturating_sub(1) } else { 0 }
    }

    pub(crate) fn text_dim(&self) -> usize {
        self.mm2.rows
    }

    pub(crate) fn forward(&self, ops: &mut dyn HostOps, c: &VitConfig, feats: &[f32], gw: usize, gh: usize) -> Vec<f32> {
        let (d, k) = (c.dim, self.merge);
        let (px, py) = (gw / k, gh / k);
        let n = px * py;
        let mut x = feats.to_vec();
        if let Some(m) = &self.merger {
            if let Some(w) = &self.input_norm {
                ops.rms_norm(&mut x, w, c.eps);
            }
            // im2col over the patch grid: a token's features are channel, then row, then column
            // within its block.
            let mut cols = vec![0.0f32; n * d * k * k];
            for (ti, row) in cols.chunks_exact_mut(d * k * k).enumerate() {
                let (oy, ox) = (ti / px, ti % px);
                for ky in 0..k {
                    for kx in 0..k {
                        let p = (oy * k + ky) * gw + ox * k + kx;
                        for (ch, &v) in x[p * d..(p + 1) * d].iter().enumerate() {
                            row[ch * k * k + ky * k + kx] = v;
                        }
                    }
                }
            }
            x = vec![0.0f32; n * d];
            matmul(ops, &mut [(m, &mut x)], &cols, n);
        }
        let mut h = vec![0.0f32; n * self.mm1.rows];
        matmul(ops, &mut [(&self.mm1, &mut h)], &x, n);
        if let Some(b) = &self.mm1_b {
            ops.add_bias(&mut h, b);
        }
        activate(&mut h, VitAct::Gelu);
        let text = self.text_dim();
        let mut tok = vec![0.0f32; n * text];
        matmul(ops, &mut [(&self.mm2, &mut tok)], &h, n);
        if let Some(b) = &self.mm2_b {
            ops.add_bias(&mut tok, b);
        }
        let Some(brk) = &self.img_break else { return tok };
        let mut out = Vec::with_capacity(self.n_tokens(gw, gh) * text);
        for (r, row) in tok.chunks_exact(px * text).enumerate() {
            out.extend_from_slice(row);
            if r + 1 < py {
                out.extend_from_slice(brk);
            }
        }
        out
    }
}
