//! Idefics3's projector (SmolVLM, Idefics3; llama.cpp's `clip_graph_siglip` for
//! `PROJECTOR_TYPE_IDEFICS3`): the SigLIP tower over one tile, then a pixel shuffle that folds
//! each `scale` x `scale` block of patches into one token of `scale * scale * dim` values
//! (`build_patch_merge_permute`), and one linear map to the text width (`mm.model.fc.weight`, no
//! bias). The image's tiles and its overview each go through this on their own; the Python side
//! cuts them and lays them out in the prompt.

use super::vit::matmul;
use super::VitConfig;
use crate::backend::HostOps;
use crate::model::{Metadata, TensorTable};
use crate::quant::Weight;
use crate::{Error, Result};

pub(crate) struct Idefics3 {
    scale: usize,
    /// text_dim x (dim * scale * scale).
    fc: Weight,
}

impl Idefics3 {
    pub(crate) fn matrices(&self) -> Vec<&Weight> {
        vec![&self.fc]
    }

    pub(crate) fn load(t: &TensorTable<'_>, meta: &Metadata, c: &VitConfig) -> Result<Idefics3> {
        // clip.cpp asserts a merge above 1 and has no default for this projector.
        let scale = meta
            .size("vision.projector.scale_factor")?
            .ok_or_else(|| Error::Gguf("an idefics3 mmproj needs clip.vision.projector.scale_factor (its pixel shuffle)".into()))?;
        if scale < 2 || !c.grid().is_multiple_of(scale) {
            return Err(Error::Gguf(format!("idefics3's scale factor {scale} must be at least 2 and divide its {} patches per side", c.grid())));
        }
        let text = t.raw("mm.model.fc.weight")?.rows;
        Ok(Idefics3 { scale, fc: t.matrix("mm.model.fc.weight", text, c.dim * scale * scale)? })
    }

    pub(crate) fn n_tokens(&self, c: &VitConfig) -> usize {
        (c.grid() / self.scale).pow(2)
    }

    pub(crate) fn text_dim(&self) -> usize {
        self.fc.rows
    }

    pub(crate) fn forward(&self, ops: &mut dyn HostOps, c: &VitConfig, feats: &[f32]) -> Vec<f32> {
        let (d, g, s) = (c.dim, c.grid(), self.scale);
        let side = g / s;
        let n = side * side;
        // Token (ty, tx) holds patch (ty * s + dy, tx * s + dx)'s features at (dy * s + dx) * d:
        // ggml's reshape / permute order, rows of the block outermost.
        let mut shuffled = vec![0.0f32; n * d * s * s];
        for (ti, row) in shuffled.chunks_exact_mut(d * s * s).enumerate() {
            let (ty, tx) = (ti / side, ti % side);
            for dy in 0..s {
                for dx in 0..s {
                    let p = (ty * s + dy) * g + tx * s + dx;
                    row[(dy * s + dx) * d..(dy * s + dx + 1) * d].copy_from_slice(&feats[p * d..(p + 1) * d]);
                }
            }
        }
        let mut out = vec![0.0f32; n * self.fc.rows];
        matmul(ops, &mut [(&self.fc, &mut out)], &shuffled, n);
        out
    }
}
