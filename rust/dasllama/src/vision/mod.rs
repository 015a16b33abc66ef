//! Vision towers from llama.cpp's `mmproj` files (its `clip` architecture): the ViT that turns
//! a preprocessed image into patch features (`vit`), and the projector that turns those into rows
//! of the text model's embedding width (`gemma3`). The result enters the text model's input in
//! place of token embeddings (`backend::PassIn::embeds`).
//!
//! Preprocessing (decode, resize, normalize) is the Python side's: the tower takes planar f32
//! pixels, channel by channel, `image_size` square.

mod gemma3;
mod vit;

use crate::model::{MetaValue, Metadata, Numerics, QuantMode, TensorInfo, TensorTable};
use crate::quant::{Bytes, GgmlType, Weight};
use crate::runtime::Runtime;
use crate::{Error, Result};
use std::path::Path;
use std::sync::Arc;

pub use vit::{VitAct, VitConfig};

/// The projector types this build runs (llama.cpp's `clip.projector_type`).
pub const PROJECTORS: &[&str] = &["gemma3"];

/// What follows the ViT.
pub(crate) enum Projector {
    /// Average pooling of the patch grid by `merge` per side, an RMS norm (`soft_emb_norm`),
    /// then the projection to the text width.
    Gemma3(gemma3::Gemma3),
}

/// A loaded vision tower and its projector.
pub struct Vision {
    pub config: VitConfig,
    pub projector_type: String,
    pub(crate) vit: vit::Vit,
    pub(crate) projector: Projector,
    /// Runs the tower's passes.
    rt: Arc<Runtime>,
}

impl Vision {
    /// Map `path` (an mmproj GGUF) and build the tower from its `clip.*` metadata (`meta`, keys
    /// without the `clip.` prefix) and tensor table.
    pub fn load(rt: &Arc<Runtime>, path: &Path, meta: &Metadata, tensors: &[TensorInfo]) -> Result<Vision> {
        let file = path.display().to_string();
        let in_file = |e: Error| match e {
            Error::Gguf(m) => Error::Gguf(format!("{file}: {m}")),
            Error::UnsupportedModel(m) => Error::UnsupportedModel(format!("{file}: {m}")),
            other => other,
        };
        let ptype = match meta.get("vision.projector_type").or(meta.get("projector_type")) {
            Some(MetaValue::Str(s)) => s.clone(),
            Some(_) => return Err(Error::Gguf(format!("{file}: metadata key 'clip.projector_type' must be a string"))),
            None => return Err(Error::Gguf(format!("{file}: metadata key 'clip.projector_type' is missing; this is not an mmproj file"))),
        };
        if !PROJECTORS.contains(&ptype.as_str()) {
            return Err(Error::UnsupportedModel(format!("{file}: projector type '{ptype}' is not supported (supported: {})", PROJECTORS.join(", "))));
        }
        if meta.flag("has_vision_encoder").map_err(in_file)? == Some(false) {
            return Err(Error::UnsupportedModel(format!("{file}: the mmproj file has no vision encoder")));
        }
        let config = VitConfig::from_meta(meta).map_err(in_file)?;
        let f = std::fs::File::open(path).map_err(|e| Error::Gguf(format!("{file}: cannot open: {e}")))?;
        // SAFETY: read-only map, never written through (as `Model::load`).
        let map = Arc::new(unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::Gguf(format!("{file}: cannot map: {e}")))?);
        let table = TensorTable::new(&file, map, tensors, QuantMode::Native, Numerics::Fast, rt.host())?;
        let vit = vit::Vit::load(&table, &config)?;
        let projector = match ptype.as_str() {
            "gemma3" => Projector::Gemma3(gemma3::Gemma3::load(&table, meta, &config).map_err(in_file)?),
            _ => unreachable!("checked against PROJECTORS above"),
        };
        Ok(Vision { config, projector_type: ptype, vit, projector, rt: rt.clone() })
    }

    /// How many rows one image becomes in the text model's input.
    pub fn n_tokens(&self) -> usize {
        match &self.projector {
            Projector::Gemma3(g) => g.n_tokens(&self.config),
        }
    }

    /// The text model's embedding width the projector writes.
    pub fn text_dim(&self) -> usize {
        match &self.projector {
            Projector::Gemma3(g) => g.text_dim(),
        }
    }

    /// One image's embeddings (`n_tokens()` rows of `text_dim()`), from planar normalized pixels
    /// (3 x image_size x image_size, channel by channel).
    pub fn encode(&self, pixels: &[f32]) -> Result<Vec<f32>> {
        let s = self.config.image_size;
        if pixels.len() != 3 * s * s {
            return Err(Error::InvalidArgument(format!("the vision tower takes 3 x {s} x {s} pixels, got {} values", pixels.len())));
        }
        let mut out = Vec::new();
        self.rt.host().run(Numerics::Fast, &mut Vec::new(), &mut |ops| {
            let feats = self.vit.forward(ops, &self.config, pixels);
            out = match &self.projector {
                Projector::Gemma3(g) => g.forward(ops, &self.config, &feats),
            };
        });
        Ok(out)
    }
}

/// An f32 matrix of our own (`rows` x `cols`, row-major) as the host's kernels read it: the
/// fast kernels read f32 rows as they are (`Kernels::Floats`, never tiled), so no runtime's
/// arena is involved.
pub(crate) fn f32_weight(values: &[f32], rows: usize, cols: usize) -> Weight {
    debug_assert_eq!(values.len(), rows * cols);
    debug_assert!(!matches!(crate::quant::kernels(GgmlType::F32), crate::quant::Kernels::Tiles(_)));
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    Weight { ty: GgmlType::F32, rows, cols, data: Bytes::Owned(Arc::new(bytes)), tiled: false, ggml_dot: None }
}

/// A tensor's values as f32 with its GGUF shape checked.
pub(crate) fn tensor_f32(t: &TensorTable<'_>, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let n: usize = shape.iter().product();
    let w = t.raw_any(name)?;
    if w.rows * w.cols != n || w.cols != shape[0] {
        return Err(Error::Gguf(format!("tensor '{name}' has {} values in rows of {}; expected shape {shape:?}", w.rows * w.cols, w.cols)));
    }
    Ok(w.to_f32())
}
