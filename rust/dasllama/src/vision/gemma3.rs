//! Gemma 3's projector (llama.cpp's `clip_graph_siglip` for `PROJECTOR_TYPE_GEMMA3`): the ViT's
//! patch grid average-pooled by `merge` per side (4 unless `clip.vision.projector.scale_factor`
//! says otherwise: 64 x 64 patches become 256 tokens), each token RMS-normed with
//! `mm.soft_emb_norm.weight`, then projected to the text width by `mm.input_projection.weight`.

use super::{f32_weight, tensor_f32, VitConfig};
use crate::backend::HostOps;
use crate::model::{Metadata, TensorTable};
use crate::quant::Weight;
use crate::{Error, Result};

pub(crate) struct Gemma3 {
    merge: usize,
    soft_norm: Vec<f32>,
    /// text_dim x dim.
    proj: Weight,
}

impl Gemma3 {
    pub(crate) fn matrices(&self) -> Vec<&Weight> {
        vec![&self.proj]
    }

    pub(crate) fn load(t: &TensorTable<'_>, meta: &Metadata, c: &VitConfig) -> Result<Gemma3> {
        let merge = meta.size("vision.projector.scale_factor")?.unwrap_or(4);
        if merge == 0 || !c.grid().is_multiple_of(merge) {
            return Err(Error::Gguf(format!("gemma3's pooling of {merge} does not divide its {} patches per side", c.grid())));
        }
        let w = t.raw("mm.input_projection.weight")?;
        if w.rows != c.dim {
            return Err(Error::Gguf(format!("tensor 'mm.input_projection.weight' reads rows of {} values, but the tower is {} wide", w.rows, c.dim)));
        }
        let text = w.cols;
        // The file holds it as dim rows of text values; the kernels want text rows of dim values.
        let raw = tensor_f32(t, "mm.input_projection.weight", &[text, c.dim])?;
        let mut tr = vec![0.0f32; raw.len()];
        for (i, row) in raw.chunks_exact(text).enumerate() {
            for (j, &v) in row.iter().enumerate() {
                tr[j * c.dim + i] = v;
            }
        }
        Ok(Gemma3 { merge, soft_norm: t.vector("mm.soft_emb_norm.weight", c.dim)?, proj: f32_weight(&tr, text, c.dim) })
    }

    pub(crate) fn n_tokens(&self, c: &VitConfig) -> usize {
        (c.grid() / self.merge).pow(2)
    }

    pub(crate) fn text_dim(&self) -> usize {
        self.proj.rows
    }

    pub(crate) fn forward(&self, ops: &mut dyn HostOps, c: &VitConfig, feats: &[f32]) -> Vec<f32> {
        let (g, k) = (c.grid(), self.merge);
        let side = g / k;
        let mut pooled = super::vit::avg_pool(feats, g, g, k, c.dim);
        ops.rms_norm(&mut pooled, &self.soft_norm, c.eps);
        let mut out = vec![0.0f32; side * side * self.proj.rows];
        super::vit::matmul(ops, &mut [(&self.proj, &mut out)], &pooled, side * side);
        out
    }
}
