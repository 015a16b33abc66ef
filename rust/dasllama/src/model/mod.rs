//! The model: configuration, the architecture registry, weights and the forward pass.

mod arch;
pub mod forward;
mod gemma3;
mod llama;

pub use arch::{arch_names, lookup as lookup_arch, ArchDesc};

use crate::cpu::{convert_weight, Bytes, Weight};
use crate::quant::GgmlType;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// Numeric GGUF metadata with the `<arch>.` prefix removed (`block_count`, `rope.freq_base`, ...).
pub type Metadata = HashMap<String, f64>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    GeluTanh,
}

/// How to store weights after loading.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMode {
    /// As stored in the GGUF (memory-mapped).
    Native,
    /// Every matrix converted to Q8_0.
    Q8,
    /// Every matrix dequantized to f32: the exact-arithmetic reference.
    Fp32,
}

/// How dot products are added up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Numerics {
    /// Our tiled SIMD kernels: the same rounding of activations as llama.cpp, our own order.
    Fast,
    /// ggml's x86 AVX2 order in every matmul and attention product (`quant::ggml`): logits equal
    /// llama.cpp's AVX2 CPU build bit for bit, several times slower. For conformance checks.
    Ggml,
}

/// Everything the shared transformer skeleton needs to know about a family.
#[derive(Clone, Debug)]
pub struct Config {
    pub arch: String,
    pub dim: usize,
    pub hidden_dim: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub seq_len: usize,
    pub rope_dim: usize,
    pub rope_base: f32,
    /// RoPE base of the sliding-window layers (gemma3 uses 10k there, 1M on global layers).
    pub rope_base_swa: f32,
    pub rope_neox: bool,
    pub norm_eps: f32,
    pub activation: Activation,
    /// Multiply token embeddings by this (gemma: sqrt(dim)).
    pub embed_scale: Option<f32>,
    pub qk_norm: bool,
    /// RMS-norm the attention and FFN outputs before the residual add (gemma2/3).
    pub post_norms: bool,
    /// Window of the sliding-window layers, 0 for none.
    pub sliding_window: usize,
    /// Every `swa_pattern`-th layer is global; the others slide (0: all global).
    pub swa_pattern: usize,
    pub attn_scale: f32,
    /// `attn_scale` multiplies the queries (before their f16 rounding) instead of the scores, as
    /// llama.cpp's gemma graphs do; it matters where small queries round to f16 subnormals.
    pub scale_query: bool,
}

impl Config {
    /// What multiplies a q.k score: `attn_scale`, or 1 where it already scaled the queries.
    pub fn score_scale(&self) -> f32 {
        if self.scale_query {
            1.0
        } else {
            self.attn_scale
        }
    }

    pub fn is_swa_layer(&self, il: usize) -> bool {
        self.sliding_window > 0 && self.swa_pattern > 0 && (il % self.swa_pattern) < self.swa_pattern - 1
    }
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: Weight,
    pub wk: Weight,
    pub wv: Weight,
    pub wo: Weight,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Weight,
    pub w_up: Weight,
    pub w_down: Weight,
    pub post_ffn_norm: Option<Vec<f32>>,
}

pub struct Model {
    pub config: Config,
    pub tok_embd: Weight,
    pub layers: Vec<Layer>,
    pub output_norm: Vec<f32>,
    pub output: Weight,
    pub tokenizer: Tokenizer,
    pub numerics: Numerics,
}

/// One entry of the GGUF tensor table, as read by the Python loader.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub ty: u32,
    /// GGUF order: ne[0] (the contiguous dimension) first.
    pub shape: Vec<u64>,
    /// Absolute byte offset in the file.
    pub offset: u64,
}

struct TensorTable<'a> {
    file: &'a str,
    map: Arc<memmap2::Mmap>,
    by_name: HashMap<&'a str, &'a TensorInfo>,
    quant: QuantMode,
    numerics: Numerics,
}

impl TensorTable<'_> {
    fn raw(&self, name: &str) -> Result<Weight> {
        let t = self.by_name.get(name).ok_or_else(|| {
            Error::Gguf(format!("{}: tensor '{name}' is missing; the file is incomplete or not a model of this architecture", self.file))
        })?;
        let ty = GgmlType::from_id(t.ty).map_err(|e| Error::Gguf(format!("{}: tensor '{name}': {e}", self.file)))?;
        let cols = t.shape[0] as usize;
        let rows: usize = t.shape[1..].iter().product::<u64>() as usize;
        if !cols.is_multiple_of(ty.block_len()) {
            return Err(Error::Gguf(format!("{}: tensor '{name}' has {cols} columns, not a multiple of the {} block", self.file, ty.name())));
        }
        let len = ty.row_bytes(cols) * rows;
        let offset = t.offset as usize;
        if offset + len > self.map.len() {
            return Err(Error::Gguf(format!(
                "{}: tensor '{name}' ends at byte {} but the file has {} bytes: the file is truncated (download it again)",
                self.file,
                offset + len,
                self.map.len()
            )));
        }
        Ok(Weight { ty, rows, cols, data: Bytes::Mapped { map: self.map.clone(), offset, len }, tiled: false, ggml_dot: None })
    }

    fn ty_name(&self, name: &str) -> &'static str {
        self.by_name.get(name).and_then(|t| GgmlType::from_id(t.ty).ok()).map_or("?", |t| t.name())
    }

    fn has(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// A matrix, converted per QuantMode, checked against the shape the config implies.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Weight> {
        let w = self.raw(name)?;
        if w.rows != rows || w.cols != cols {
            return Err(Error::Gguf(format!(
                "{}: tensor '{name}' is {}x{} but the model's metadata implies {rows}x{cols}",
                self.file, w.rows, w.cols
            )));
        }
        let w = match self.quant {
            QuantMode::Q8 if w.cols % 32 == 0 && w.ty != GgmlType::Q8_0 => convert_weight(&w, GgmlType::Q8_0),
            QuantMode::Fp32 if w.ty != GgmlType::F32 => convert_weight(&w, GgmlType::F32),
            _ => w,
        };
        match self.numerics {
            Numerics::Fast => Ok(w.for_kernels()),
            Numerics::Ggml => w.for_ggml_order().ok_or_else(|| {
                Error::UnsupportedModel(format!(
                    "{}: tensor '{name}' is {}, for which numerics='ggml' does not reproduce ggml's order (it covers F32 and F16 rows of a multiple of 32 values, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q5_K, Q6_K, and Q4_K with a multiple of 8 rows); load with numerics='fast'",
                    self.file,
                    self.ty_name(name)
                ))
            }),
        }
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let w = self.raw(name)?;
        if w.rows * w.cols != len {
            return Err(Error::Gguf(format!("{}: tensor '{name}' has {} values, expected {len}", self.file, w.rows * w.cols)));
        }
        Ok(w.to_f32())
    }

    fn opt_vector(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
        if self.has(name) {
            self.vector(name, len).map(Some)
        } else {
            Ok(None)
        }
    }
}

impl Model {
    /// Map `path` and build the model from the tensor table and metadata the Python loader read.
    pub fn load(
        path: &Path,
        arch: &str,
        meta: &Metadata,
        tensors: &[TensorInfo],
        tokenizer: Tokenizer,
        quant: QuantMode,
        numerics: Numerics,
    ) -> Result<Model> {
        let desc = lookup_arch(arch).ok_or_else(|| {
            Error::UnsupportedModel(format!(
                "{}: architecture '{arch}' is not supported (supported: {})",
                path.display(),
                arch_names().join(", ")
            ))
        })?;
        let file = path.display().to_string();
        let mut config = (desc.configure)(meta).map_err(|e| match e {
            Error::Gguf(m) => Error::Gguf(format!("{file}: {m}")),
            other => other,
        })?;
        let f = std::fs::File::open(path).map_err(|e| Error::Gguf(format!("{file}: cannot open: {e}")))?;
        // SAFETY: the file is opened read-only and we never write through the map; a concurrent
        // truncation by another process is outside what any mmap-based loader can guard against.
        let map = Arc::new(unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::Gguf(format!("{file}: cannot map: {e}")))?);
        let table = TensorTable { file: &file, map, by_name: tensors.iter().map(|t| (t.name.as_str(), t)).collect(), quant, numerics };

        let tok_embd = table.raw("token_embd.weight")?;
        if tok_embd.cols != config.dim {
            return Err(Error::Gguf(format!("{file}: token_embd.weight has width {} but embedding_length is {}", tok_embd.cols, config.dim)));
        }
        config.vocab_size = tok_embd.rows;
        let (d, qd, kvd, hd) = (config.dim, config.q_dim(), config.kv_dim(), config.hidden_dim);
        let mut layers = Vec::with_capacity(config.n_layers);
        for il in 0..config.n_layers {
            let n = |s: &str| format!("blk.{il}.{s}.weight");
            layers.push(Layer {
                attn_norm: table.vector(&n("attn_norm"), d)?,
                wq: table.matrix(&n("attn_q"), qd, d)?,
                wk: table.matrix(&n("attn_k"), kvd, d)?,
                wv: table.matrix(&n("attn_v"), kvd, d)?,
                wo: table.matrix(&n("attn_output"), d, qd)?,
                q_norm: if config.qk_norm { Some(table.vector(&n("attn_q_norm"), config.head_dim)?) } else { None },
                k_norm: if config.qk_norm { Some(table.vector(&n("attn_k_norm"), config.head_dim)?) } else { None },
                post_attn_norm: if config.post_norms { Some(table.vector(&n("post_attention_norm"), d)?) } else { table.opt_vector(&n("post_attention_norm"), d)? },
                ffn_norm: table.vector(&n("ffn_norm"), d)?,
                w_gate: table.matrix(&n("ffn_gate"), hd, d)?,
                w_up: table.matrix(&n("ffn_up"), hd, d)?,
                w_down: table.matrix(&n("ffn_down"), d, hd)?,
                post_ffn_norm: if config.post_norms { Some(table.vector(&n("post_ffw_norm"), d)?) } else { None },
            });
        }
        let output_norm = table.vector("output_norm.weight", d)?;
        let output = if table.has("output.weight") {
            table.matrix("output.weight", config.vocab_size, d)?
        } else {
            table.matrix("token_embd.weight", config.vocab_size, d)?
        };
        if tokenizer.n_vocab() != config.vocab_size {
            return Err(Error::Gguf(format!(
                "{file}: the tokenizer has {} tokens but token_embd.weight has {} rows",
                tokenizer.n_vocab(),
                config.vocab_size
            )));
        }
        if numerics == Numerics::Ggml && !config.head_dim.is_multiple_of(32) {
            return Err(Error::UnsupportedModel(format!(
                "{file}: head size {} is not a multiple of 32, which numerics='ggml' needs; load with numerics='fast'",
                config.head_dim
            )));
        }
        Ok(Model { config, tok_embd, layers, output_norm, output, tokenizer, numerics })
    }
}

/// The fields every family reads the same way, with llama's conventions for the rest; a family's
/// `configure` starts from this and overrides what differs.
pub(crate) fn base_config(m: &Metadata, arch: &str) -> crate::Result<Config> {
    let dim = req(m, "embedding_length")? as usize;
    let n_heads = req(m, "attention.head_count")? as usize;
    let head_dim = opt(m, "attention.key_length", (dim / n_heads.max(1)) as f64) as usize;
    let rope_base = opt(m, "rope.freq_base", 10000.0) as f32;
    Ok(Config {
        arch: arch.into(),
        dim,
        hidden_dim: req(m, "feed_forward_length")? as usize,
        n_layers: req(m, "block_count")? as usize,
        n_heads,
        n_kv_heads: opt(m, "attention.head_count_kv", n_heads as f64) as usize,
        head_dim,
        vocab_size: 0,
        seq_len: req(m, "context_length")? as usize,
        rope_dim: opt(m, "rope.dimension_count", head_dim as f64) as usize,
        rope_base,
        rope_base_swa: rope_base,
        rope_neox: false,
        norm_eps: opt(m, "attention.layer_norm_rms_epsilon", 1e-5) as f32,
        activation: Activation::Silu,
        embed_scale: None,
        qk_norm: false,
        post_norms: false,
        sliding_window: 0,
        swa_pattern: 0,
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        scale_query: false,
    })
}

/// Read a required metadata key, with a message naming it when it is missing.
pub(crate) fn req(meta: &Metadata, key: &str) -> Result<f64> {
    meta.get(key).copied().ok_or_else(|| Error::Gguf(format!("metadata key '{key}' is missing")))
}

pub(crate) fn opt(meta: &Metadata, key: &str, default: f64) -> f64 {
    meta.get(key).copied().unwrap_or(default)
}
