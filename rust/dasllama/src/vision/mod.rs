//! Vision towers from llama.cpp's `mmproj` files (its `clip` architecture): the ViT that turns
//! a preprocessed image into patch features (`vit`), and the projector that turns those into rows
//! of the text model's embedding width (one module each: `gemma3`, `gemma4v`, `pixtral`,
//! `qwen2vl` with `qwen3vl`, `idefics3`). The result enters
//! the text model's input in place of token embeddings (`backend::PassIn::embeds`).
//!
//! Preprocessing (decode, resize, normalize) is the Python side's: the tower takes planar f32
//! pixels, channel by channel, `image_size` square (Gemma 3) or any multiple of
//! `patch_size * merge` on each side (Gemma 4, Pixtral, Qwen-VL); each tile of Idefics3 is
//! `image_size` square.

mod gemma3;
mod gemma4v;
mod idefics3;
mod pixtral;
mod qwen2vl;
mod qwen3vl;
mod vit;

use crate::backend::{MatmulOffload, TowerPlacement, TowerStatus};
use crate::model::{MetaValue, Metadata, Numerics, QuantMode, TensorInfo, TensorTable};
use crate::quant::{Bytes, GgmlType, Weight};
use crate::runtime::Runtime;
use crate::{Error, Result};
use std::path::Path;
use std::sync::{Arc, Mutex};

pub use vit::{VitAct, VitConfig};

/// The projector types this build runs (llama.cpp's `clip.projector_type`).
pub const PROJECTORS: &[&str] = &["gemma3", "gemma4v", "idefics3", "pixtral", "qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger"];

/// What follows the ViT.
pub(crate) enum Projector {
    /// Average pooling of the patch grid by `merge` per side, an RMS norm (`soft_emb_norm`),
    /// then the projection to the text width.
    Gemma3(gemma3::Gemma3),
    /// Gemma 4: its own tower at the image's own size (learned column and row tables, a 2-D
    /// NeoX RoPE, per-head Q/K/V norms, post norms), average pooling by `merge` per side, a
    /// standardisation, an RMS norm and the projection to the text width.
    Gemma4v(Box<gemma4v::Gemma4v>),
    /// The tower at the image's own size, a patch merger where the file has one, a GELU MLP,
    /// and a break row after each row of tokens.
    Pixtral(Box<pixtral::Pixtral>),
    /// Qwen2-VL / Qwen2.5-VL / Qwen3-VL: the tower at the image's own size over 2 x 2 patch
    /// blocks (M-RoPE, windows in 2.5, learned positions and deepstack in 3), each block merged
    /// into one token by a GELU MLP.
    Qwen2vl(Box<qwen2vl::Qwen2vl>),
    /// A pixel shuffle of `scale` x `scale` patches into one token, then a linear map to the text
    /// width (SmolVLM; one tile of a tiled image at a time).
    Idefics3(idefics3::Idefics3),
}

/// A loaded vision tower and its projector.
pub struct Vision {
    pub config: VitConfig,
    pub projector_type: String,
    pub(crate) vit: vit::Vit,
    pub(crate) projector: Projector,
    /// Runs the tower's passes.
    rt: Arc<Runtime>,
    /// The device holding its matrices (`place`), which takes its matmuls and attention; held
    /// by an encode for its whole pass, so encodes on a device run one at a time.
    device: Mutex<Option<Box<dyn TowerPlacement>>>,
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
        // llama.cpp's graph per projector: SigLIP's LayerNorms and learned positions for Gemma 3,
        // RMS norms and a 2-D RoPE of base 10000 (clip.cpp sets it) for Pixtral.
        let style = match ptype.as_str() {
            "pixtral" => vit::VitStyle { rms: true, rope_2d: Some(10000.0) },
            // Its positions (tables by column and row, a NeoX RoPE of base 100) are the
            // projector's own (`gemma4v`), as is its layer loop.
            "gemma4v" => vit::VitStyle { rms: true, rope_2d: Some(100.0) },
            // No learned positions (the RoPE is the projector's own, `qwen2vl`); Qwen2-VL's
            // norms are LayerNorms, Qwen2.5-VL's RMS.
            "qwen2vl_merger" => vit::VitStyle { rms: false, rope_2d: Some(10000.0) },
            "qwen2.5vl_merger" => vit::VitStyle { rms: true, rope_2d: Some(10000.0) },
            // Qwen3-VL's learned positions are a grid of their own, interpolated (`qwen3vl`).
            "qwen3vl_merger" => vit::VitStyle { rms: false, rope_2d: Some(10000.0) },
            _ => vit::VitStyle { rms: false, rope_2d: None },
        };
        let mut vit = vit::Vit::load(&table, &config, style).map_err(in_file)?;
        let projector = match ptype.as_str() {
            "gemma3" => Projector::Gemma3(gemma3::Gemma3::load(&table, meta, &config).map_err(in_file)?),
            "gemma4v" => Projector::Gemma4v(Box::new(gemma4v::Gemma4v::load(&table, meta, &config, &vit).map_err(in_file)?)),
            "pixtral" => Projector::Pixtral(Box::new(pixtral::Pixtral::load(&table, meta, &config).map_err(in_file)?)),
            "qwen2vl_merger" | "qwen2.5vl_merger" | "qwen3vl_merger" => {
                let version = match ptype.as_str() {
                    "qwen2vl_merger" => qwen2vl::Version::Qwen2,
                    "qwen2.5vl_merger" => qwen2vl::Version::Qwen25,
                    _ => qwen2vl::Version::Qwen3,
                };
                Projector::Qwen2vl(Box::new(qwen2vl::Qwen2vl::load(&table, meta, &config, version, &mut vit).map_err(in_file)?))
            }
            "idefics3" => Projector::Idefics3(idefics3::Idefics3::load(&table, meta, &config).map_err(in_file)?),
            _ => unreachable!("checked against PROJECTORS above"),
        };
        Ok(Vision { config, projector_type: ptype, vit, projector, rt: rt.clone(), device: Mutex::new(None) })
    }

    /// Every matrix an encode multiplies by, the tower's layers first (a device short of memory
    /// takes the first that fit): what `place` puts on a device.
    pub fn matrices(&self) -> Vec<&Weight> {
        let mut m = Vec::new();
        match &self.projector {
            // Its layer loop multiplies by its own copies of the layers' matrices.
            Projector::Gemma4v(g) => m.extend(g.matrices()),
            p => {
                m.extend(self.vit.layers.iter().flat_map(vit::VitLayer::matrices));
                m.extend(match p {
                    Projector::Gemma3(g) => g.matrices(),
                    Projector::Pixtral(x) => x.matrices(),
                    Projector::Qwen2vl(x) => x.matrices(),
                    Projector::Idefics3(x) => x.matrices(),
                    Projector::Gemma4v(_) => unreachable!("matched above"),
                });
            }
        }
        m.push(&self.vit.patch);
        m
    }

    /// Run the tower's matmuls and attention on a device (`vulkan::place_tower` over
    /// `matrices()`), or on the host again (None); returns the place it had. Waits for an encode
    /// running now.
    pub fn place(&self, p: Option<Box<dyn TowerPlacement>>) -> Option<Box<dyn TowerPlacement>> {
        std::mem::replace(&mut *self.device.lock().unwrap_or_else(|e| e.into_inner()), p)
    }

    /// What its device holds and has done (None on the host); waits for an encode running now.
    pub fn device_status(&self) -> Option<TowerStatus> {
        self.device.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|p| p.status())
    }

    /// Whether the tower takes an image of any size (a multiple of `patch_size * merge()` on each
    /// side) rather than its fixed `image_size` square.
    pub fn dynamic_size(&self) -> bool {
        matches!(self.projector, Projector::Gemma4v(_) | Projector::Pixtral(_) | Projector::Qwen2vl(_))
    }

    /// Patches per side of one output token (the size an image's sides are a multiple of, in
    /// patches).
    pub fn merge(&self) -> usize {
        match &self.projector {
            Projector::Gemma3(_) | Projector::Idefics3(_) => 1,
            Projector::Gemma4v(g) => g.merge(),
            Projector::Pixtral(p) => p.merge(),
            Projector::Qwen2vl(_) => 2,
        }
    }

    /// Where an image's rows take multi-axis positions in the text model (Qwen-VL's M-RoPE): its
    /// tokens per row and rows, for an image of `width` x `height` pixels; None where its rows
    /// are positioned as text.
    pub fn mrope_grid(&self, width: usize, height: usize) -> Option<(usize, usize)> {
        let u = self.config.patch_size * 2;
        matches!(self.projector, Projector::Qwen2vl(_)).then_some((width / u, height / u))
    }

    /// Whether an image's rows see each other in the text model (llama.cpp's
    /// `mtmd_decode_use_non_causal`: Gemma 3's do, and Gemma 4's but for E2B and E4B, which
    /// mtmd tells by their text width, 1536 and 2560; Pixtral's are causal as text). Gemma 4's
    /// text model lets them in its sliding layers only (`Config::image_spans_sliding_only`).
    pub fn non_causal(&self) -> bool {
        match &self.projector {
            Projector::Gemma3(_) => true,
            Projector::Gemma4v(g) => !matches!(g.text_dim(), 1536 | 2560),
            _ => false,
        }
    }

    /// How many rows one image of the tower's own size becomes in the text model's input.
    pub fn n_tokens(&self) -> usize {
        let s = self.config.image_size;
        self.n_tokens_for(s, s)
    }

    /// How many rows an image of `width` x `height` pixels (as preprocessed) becomes.
    pub fn n_tokens_for(&self, width: usize, height: usize) -> usize {
        let p = self.config.patch_size;
        match &self.projector {
            Projector::Gemma3(g) => g.n_tokens(&self.config),
            Projector::Gemma4v(x) => x.n_tokens(width / p, height / p),
            Projector::Pixtral(x) => x.n_tokens(width / p, height / p),
            Projector::Qwen2vl(x) => x.n_tokens(width / p, height / p),
            Projector::Idefics3(x) => x.n_tokens(&self.config),
        }
    }

    /// The values of each row the projector writes: the text model's embedding width (times
    /// 1 + its deepstack mergers for Qwen3-VL, as llama.cpp's `clip_n_mmproj_embd`).
    pub fn text_dim(&self) -> usize {
        match &self.projector {
            Projector::Gemma3(g) => g.text_dim(),
            Projector::Gemma4v(g) => g.text_dim(),
            Projector::Pixtral(p) => p.text_dim(),
            Projector::Qwen2vl(p) => p.text_dim(),
            Projector::Idefics3(x) => x.text_dim(),
        }
    }

    /// One image's embeddings (`n_tokens_for(width, height)` rows of `text_dim()`), from planar
    /// normalized pixels (3 x height x width, channel by channel). A fixed-size tower takes
    /// `image_size` square only; a dynamic one sides that are multiples of patch x merge.
    pub fn encode(&self, pixels: &[f32], width: usize, height: usize) -> Result<Vec<f32>> {
        let (s, p) = (self.config.image_size, self.config.patch_size);
        if !self.dynamic_size() && (width, height) != (s, s) {
            return Err(Error::InvalidArgument(format!("this vision tower takes {s} x {s} pixels, got {width} x {height}")));
        }
        let unit = p * self.merge();
        if self.dynamic_size() && (width == 0 || height == 0 || !width.is_multiple_of(unit) || !height.is_multiple_of(unit)) {
            return Err(Error::InvalidArgument(format!("an image's sides must be positive multiples of {unit} pixels, got {width} x {height}")));
        }
        if pixels.len() != 3 * width * height {
            return Err(Error::InvalidArgument(format!("a {width} x {height} image takes 3 x {height} x {width} values, got {}", pixels.len())));
        }
        let (gw, gh) = (width / p, height / p);
        if let Projector::Gemma4v(g) = &self.projector {
            if gw.max(gh) > g.max_side() {
                return Err(Error::InvalidArgument(format!(
                    "this vision tower's position tables cover {} patches a side; a {width} x {height} image has {gw} x {gh}",
                    g.max_side()
                )));
            }
        }
        // A fixed size that is not a whole number of patches (SmolVLM2's 384 in patches of 14):
        // the patch convolution (stride one patch, no padding) never reads the last columns and
        // rows, so they are dropped here, as ggml's conv does.
        let cropped: Vec<f32>;
        let pixels = if width == gw * p && height == gh * p {
            pixels
        } else {
            let (cw, ch) = (gw * p, gh * p);
            cropped = pixels.chunks_exact(width).enumerate().filter(|(r, _)| r % height < ch).flat_map(|(_, row)| &row[..cw]).copied().collect();
            &cropped[..]
        };
        let mut out = Vec::new();
        let mut device = self.device.lock().unwrap_or_else(|e| e.into_inner());
        let offload: Option<&mut dyn MatmulOffload> = match device.as_mut() {
            Some(p) => Some(&mut **p),
            None => None,
        };
        self.rt.host().run(Numerics::Fast, &mut Vec::new(), offload, &mut |ops| {
            out = match &self.projector {
                Projector::Gemma3(g) => {
                    let feats = self.vit.forward(ops, &self.config, pixels, gw, gh);
                    g.forward(ops, &self.config, &feats)
                }
                // Its own layer loop and positions: the tower's layers run there.
                Projector::Gemma4v(x) => x.forward(ops, &self.config, &self.vit, pixels, gw, gh),
                Projector::Pixtral(x) => {
                    let feats = self.vit.forward(ops, &self.config, pixels, gw, gh);
                    x.forward(ops, &self.config, &feats, gw, gh)
                }
                // Its own order of patches and RoPE: the tower's layers run there.
                Projector::Qwen2vl(x) => x.forward(ops, &self.config, &self.vit, pixels, gw, gh),
                Projector::Idefics3(x) => {
                    let feats = self.vit.forward(ops, &self.config, pixels, gw, gh);
                    x.forward(ops, &self.config, &feats)
                }
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
