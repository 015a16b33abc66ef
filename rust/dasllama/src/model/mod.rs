//! The model: configuration, the architecture registry, weights and the forward pass.

mod arch;
mod config;
pub mod forward;
mod gemma2;
mod gemma3;
mod gemma4;
pub mod gemma4_assistant;
mod glm4moe;
mod gptoss;
mod llama;
mod meta;
mod mistral3;
pub mod mtp;
mod phi3;
mod qwen2;
mod qwen2moe;
mod qwen2vl;
mod qwen3;
mod qwen35;
mod qwen35moe;
mod qwen3moe;
mod qwen3next;
mod qwen3vl;
mod qwen3vlmoe;

pub use crate::backend::{Activation, Numerics};
use crate::backend::{Host, Placement};
use crate::constrain::GrammarEnv;
pub use arch::{arch_names, lookup as lookup_arch, ArchDesc};
pub use config::{Attention, AttnTemp, Config, DeltaNet, Ffn, HeadMap, Heads, LayerDesc, Mixer, Mrope, Rope};
pub use gemma4_assistant::Assistant;
pub use meta::{MetaValue, Metadata};
pub use mtp::MtpHead;

use crate::kv::{Geometry, KvCodec};
use crate::quant::GgmlType;
use crate::quant::{Bytes, Weight};
use crate::runtime::Runtime;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

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

pub struct Layer {
    pub attn_norm: Vec<f32>,
    /// The token mixer's weights, as the layer's `Mixer` says.
    pub mixer: MixerWeights,
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub ffn: FfnWeights,
    pub post_ffn_norm: Option<Vec<f32>>,
    /// What mixes this layer's per-layer input into its output (gemma4's E-series).
    pub ple: Option<PleLayer>,
    /// Multiplies the layer's output, residual included (`layer_output_scale`, gemma4).
    pub out_scale: Option<f32>,
}

/// A layer's use of its per-layer input (`Model::ple`): its output x becomes
/// x + post_norm(proj(gelu(inp_gate(x)) * input)).
pub struct PleLayer {
    /// per_layer_input x dim (`inp_gate`).
    pub gate: Weight,
    /// dim x per_layer_input (`proj`).
    pub proj: Weight,
    pub post_norm: Vec<f32>,
}

/// gemma4's per-layer embeddings: each token's input to every layer, its row of
/// `per_layer_token_embd` (scaled by sqrt(per_layer_input)) plus the scaled embedding projected
/// by `per_layer_model_proj` (scaled by 1/sqrt(dim), each layer's part RMS-normed by
/// `per_layer_proj_norm`), the sum scaled by 1/sqrt(2).
pub struct Ple {
    /// vocab x (n_layers * per_layer_input): gathered, as the token embedding.
    pub tok_embd: Weight,
    /// (n_layers * per_layer_input) x dim.
    pub proj: Weight,
    pub proj_norm: Vec<f32>,
}

// One per layer, and attention is the common case: boxing it would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum MixerWeights {
    Attention(AttnWeights),
    DeltaNet(Box<DeltaNetWeights>),
}

pub struct AttnWeights {
    /// Q, K and V: three tensors, or row ranges of a fused `attn_qkv` (the same dots either way).
    /// A gated layer's Q has 2 * head_dim rows a head: its queries, then its gate. K and V have
    /// no rows where the layer reads an earlier layer's K/V (`Attention::kv_from`), V none where
    /// it takes K's projection as V (`Attention::v_optional` and no `attn_v` in the file).
    pub wq: Weight,
    pub wk: Weight,
    pub wv: Weight,
    /// Biases of Q, K and V where the file has them (qwen2).
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub wo: Weight,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// The output projection's bias (`attn_output.bias`, where `Config::extra_biases`).
    pub bo: Option<Vec<f32>>,
    /// One sink logit per query head (`attn_sinks`, where `Config::attn_sinks`).
    pub sinks: Option<Vec<f32>>,
}

/// A gated DeltaNet layer's weights (see `config::DeltaNet`).
pub struct DeltaNetWeights {
    /// conv_dim x dim: the Q, K and V channels before the convolution (`attn_qkv`).
    pub qkv: Weight,
    /// value_dim x dim: the output gate z (`attn_gate`).
    pub gate: Weight,
    /// Beta and alpha (one of each per value head).
    pub ba: BetaAlpha,
    /// The convolution as `conv_kernel` rows of conv_dim: row j holds every channel's weight of
    /// tap j (the file's `ssm_conv1d` is conv_dim rows of conv_kernel taps; transposed so a tap
    /// runs over contiguous channels).
    pub conv: Vec<f32>,
    /// Per value head: `ssm_dt.bias` and `ssm_a` (-exp(A_log), as the converters store it).
    pub dt_bias: Vec<f32>,
    pub a: Vec<f32>,
    /// head_dim: the RMS norm of each output head (`ssm_norm`).
    pub norm: Vec<f32>,
    /// dim x value_dim (`ssm_out`).
    pub out: Weight,
}

pub enum BetaAlpha {
    /// `ssm_beta` and `ssm_alpha`, n_v x dim each (qwen35).
    Split { beta: Weight, alpha: Weight },
    /// `ssm_ba`, 2 * n_v x dim: per key head, its value heads' betas then their alphas (qwen3next).
    Fused(Weight),
}

// One per layer, and dense is the common case: boxing it would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum FfnWeights {
    /// Gate and up: two tensors, or the two halves of a fused `ffn_up` (phi3).
    Dense {
        gate: Weight,
        up: Weight,
        down: Weight,
    },
    Moe(Box<Experts>),
    /// gemma4's dense GLU beside routed experts (`Ffn::DenseMoe`).
    DenseMoe(Box<DenseAndExperts>),
}

/// The weights of `Ffn::DenseMoe`: the dense GLU (normed in by `ffn_norm`, which the layer
/// holds), the experts (without a shared one), and the norms and scales of the routed half.
pub struct DenseAndExperts {
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
    /// Norms the dense GLU's output (`post_ffw_norm_1`), the experts' input (`pre_ffw_norm_2`)
    /// and their output (`post_ffw_norm_2`).
    pub post_norm_1: Vec<f32>,
    pub pre_norm_2: Vec<f32>,
    pub post_norm_2: Vec<f32>,
    /// dim: multiplies the router's normed input (`ffn_gate_inp.scale`).
    pub router_scale: Vec<f32>,
    /// n_expert: multiplies each expert's output (`ffn_down_exps.scale`), where the file has it.
    pub expert_scale: Option<Vec<f32>>,
    pub experts: Experts,
}

/// A layer's routed experts, each its own matrices (row windows of the 3-D stacks), so a step
/// reads only the experts its rows chose, each once for all of them.
pub struct Experts {
    /// n_expert x dim.
    pub router: Weight,
    /// n_expert: added to the router's scores to choose experts (`exp_probs_b`), where the
    /// family routes so.
    pub sel_bias: Option<Vec<f32>>,
    pub gate: Vec<Weight>,
    pub up: Vec<Weight>,
    pub down: Vec<Weight>,
    pub shared: Option<SharedExpert>,
    /// Where `Config::extra_biases`: the router's bias (n_expert, added to its logits) and each
    /// expert's gate, up (n_expert x hidden) and down (n_expert x dim) biases.
    pub biases: Option<ExpertBiases>,
}

pub struct ExpertBiases {
    pub router: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
}

pub struct SharedExpert {
    /// 1 x dim: the logit of the shared expert's sigmoid gate, where it has one.
    pub gate_inp: Option<Weight>,
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
}

pub struct Model {
    pub config: Config,
    pub tok_embd: Weight,
    pub layers: Vec<Layer>,
    pub output_norm: Vec<f32>,
    pub output: Weight,
    /// The RoPE frequency divisors every layer uses (`Config::rope_factors`), where the file has them.
    pub rope_factors: Option<Vec<f32>>,
    /// Per-layer embeddings (`Config::per_layer_input` > 0).
    pub ple: Option<Ple>,
    pub tokenizer: Tokenizer,
    pub numerics: Numerics,
    /// The MTP head the file carries after the trunk's blocks, if any (`mtp`).
    pub mtp: Option<Arc<MtpHead>>,
    /// What a device holds for this model, if it is placed on one. The lock is held only to
    /// read or swap the handle, never across a pass; dropping the model (or the placement)
    /// frees the device's memory for it.
    placement: Mutex<Option<Arc<dyn Placement>>>,
    /// This load's own number (never reused in the process): what the prefix cache keys a
    /// model's pages and recurrent states by, so that another model never takes them.
    pub uid: u64,
    /// The runtime the model runs on: its thread team, page bin and scratch.
    pub rt: Arc<Runtime>,
    /// The grammar environment (`grammar_env`), made on first use.
    grammar: Mutex<Option<Arc<GrammarEnv>>>,
}

/// The next `Model::uid`.
fn next_model_uid() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
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

pub(crate) struct TensorTable<'a> {
    file: &'a str,
    map: Arc<memmap2::Mmap>,
    by_name: HashMap<&'a str, &'a TensorInfo>,
    quant: QuantMode,
    numerics: Numerics,
    /// Lays matrices out for its kernels (`prepare`).
    host: &'a dyn Host,
}

impl<'a> TensorTable<'a> {
    /// Index the table, refusing what no model file can hold: 0-D tensors, and the block formats
    /// that exist only for activations (Q8_1, Q8_K).
    pub(crate) fn new(
        file: &'a str,
        map: Arc<memmap2::Mmap>,
        tensors: &'a [TensorInfo],
        quant: QuantMode,
        numerics: Numerics,
        host: &'a dyn Host,
    ) -> Result<Self> {
        for t in tensors {
            if t.shape.is_empty() || t.shape.contains(&0) {
                return Err(Error::Gguf(format!(
                    "{file}: tensor '{}' has shape {:?}; a weight needs at least one dimension and no empty one",
                    t.name, t.shape
                )));
            }
            if let Ok(ty @ (GgmlType::Q8_1 | GgmlType::Q8K)) = GgmlType::from_id(t.ty) {
                return Err(Error::Gguf(format!(
                    "{file}: tensor '{}' is stored as {}, a format llama.cpp uses only for activations, never for weights: the file is corrupt",
                    t.name,
                    ty.name()
                )));
            }
        }
        Ok(TensorTable { file, map, by_name: tensors.iter().map(|t| (t.name.as_str(), t)).collect(), quant, numerics, host })
    }

    /// How many transformer blocks the table holds tensors for (`blk.N.*`, N < blocks).
    fn blocks(&self) -> usize {
        self.by_name.keys().filter_map(|n| n.strip_prefix("blk.")?.split('.').next()?.parse::<usize>().ok()).map(|i| i + 1).max().unwrap_or(0)
    }

    pub(crate) fn raw(&self, name: &str) -> Result<Weight> {
        let w = self.raw_any(name)?;
        let t = self.by_name[name];
        if t.shape.iter().skip(2).any(|&d| d > 1) {
            // Expert stacks stay 3-D: a family that has them reads them as such.
            return Err(Error::Gguf(format!("{}: tensor '{name}' has shape {:?} where a 2-D matrix belongs", self.file, t.shape)));
        }
        Ok(w)
    }

    /// A tensor of any rank as one matrix of rows of `shape[0]` values (an expert stack's
    /// matrices one after another).
    pub(crate) fn raw_any(&self, name: &str) -> Result<Weight> {
        let t = self
            .by_name
            .get(name)
            .ok_or_else(|| Error::Gguf(format!("{}: tensor '{name}' is missing; the file is incomplete or not a model of this architecture", self.file)))?;
        let ty = GgmlType::from_id(t.ty).map_err(|e| Error::Gguf(format!("{}: tensor '{name}': {e}", self.file)))?;
        let cols = t.shape[0] as usize;
        let rows = t
            .shape
            .iter()
            .skip(1)
            .try_fold(1usize, |a, &r| a.checked_mul(r as usize))
            .ok_or_else(|| Error::Gguf(format!("{}: tensor '{name}' has shape {:?}", self.file, t.shape)))?;
        if !cols.is_multiple_of(ty.block_len()) {
            return Err(Error::Gguf(format!("{}: tensor '{name}' has {cols} columns, not a multiple of the {} block", self.file, ty.name())));
        }
        let len = ty.row_bytes(cols).saturating_mul(rows);
        let offset = t.offset as usize;
        if offset.saturating_add(len) > self.map.len() {
            return Err(Error::Gguf(format!(
                "{}: tensor '{name}' ends at byte {} but the file has {} bytes: the file is truncated (download it again)",
                self.file,
                offset.saturating_add(len),
                self.map.len()
            )));
        }
        Ok(Weight { ty, rows, cols, data: Bytes::Mapped { map: self.map.clone(), offset, len }, tiled: false, ggml_dot: None })
    }

    fn ty_name(&self, name: &str) -> &'static str {
        self.by_name.get(name).and_then(|t| GgmlType::from_id(t.ty).ok()).map_or("?", |t| t.name())
    }

    pub(crate) fn has(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// A matrix, converted per QuantMode, checked against the shape the config implies.
    pub(crate) fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Weight> {
        let mut parts = self.matrix_parts(name, &[rows], cols)?;
        Ok(parts.remove(0))
    }

    /// A fused matrix as consecutive row ranges of `parts` rows each (Q/K/V in `attn_qkv`, gate
    /// and up in phi3's `ffn_up`): each range is a matrix of its own, a window of the same bytes.
    pub(crate) fn matrix_parts(&self, name: &str, parts: &[usize], cols: usize) -> Result<Vec<Weight>> {
        let w = self.raw(name)?;
        let rows: usize = parts.iter().sum();
        if w.rows != rows || w.cols != cols {
            return Err(Error::Gguf(format!("{}: tensor '{name}' is {}x{} but the model's metadata implies {rows}x{cols}", self.file, w.rows, w.cols)));
        }
        self.split(w, name, parts)
    }

    fn split(&self, w: Weight, name: &str, parts: &[usize]) -> Result<Vec<Weight>> {
        let Bytes::Mapped { map, offset, .. } = &w.data else { unreachable!("raw tensors are windows of the map") };
        let rb = w.row_bytes();
        let mut first = 0;
        let mut out = Vec::with_capacity(parts.len());
        for &r in parts {
            let data = Bytes::Mapped { map: map.clone(), offset: offset + first * rb, len: r * rb };
            out.push(self.prepare(Weight { rows: r, data, ..w.clone() }, name)?);
            first += r;
        }
        Ok(out)
    }

    /// An expert stack (GGUF shape [cols, rows, n]) as n matrices of rows x cols.
    fn stack(&self, name: &str, n: usize, rows: usize, cols: usize) -> Result<Vec<Weight>> {
        let shape = &self
            .by_name
            .get(name)
            .ok_or_else(|| Error::Gguf(format!("{}: tensor '{name}' is missing; the file is incomplete or not a model of this architecture", self.file)))?
            .shape;
        if shape.len() != 3 || shape[..] != [cols as u64, rows as u64, n as u64] {
            return Err(Error::Gguf(format!(
                "{}: tensor '{name}' has shape {shape:?} but the model's metadata implies [{cols}, {rows}, {n}] ({n} experts)",
                self.file
            )));
        }
        let w = self.raw_any(name)?;
        self.split(w, name, &vec![rows; n])
    }

    /// A matrix as the kernels read it: converted per QuantMode, laid out for `numerics`.
    pub(crate) fn prepare(&self, w: Weight, name: &str) -> Result<Weight> {
        let to = match self.quant {
            QuantMode::Q8 if w.cols.is_multiple_of(32) && w.ty != GgmlType::Q8_0 => Some(GgmlType::Q8_0),
            QuantMode::Fp32 if w.ty != GgmlType::F32 => Some(GgmlType::F32),
            _ => None,
        };
        self.host.prepare(w, to, self.numerics).ok_or_else(|| {
            Error::UnsupportedModel(format!(
                "{}: tensor '{name}' is {}, for which numerics='ggml' does not reproduce ggml's order (it covers F32 and F16 rows of a multiple of 32 values, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q5_K, Q6_K, and Q4_K and MXFP4 with a multiple of 8 rows); load with numerics='fast'",
                self.file,
                self.ty_name(name)
            ))
        })
    }

    pub(crate) fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let w = self.raw(name)?;
        if w.rows * w.cols != len {
            return Err(Error::Gguf(format!("{}: tensor '{name}' has {} values, expected {len}", self.file, w.rows * w.cols)));
        }
        Ok(w.to_f32())
    }

    pub(crate) fn opt_vector(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
        if self.has(name) {
            self.vector(name, len).map(Some)
        } else {
            Ok(None)
        }
    }

    /// A stack of fused gate-and-up experts (GGUF shape [cols, 2 * rows, n]: each expert's gate
    /// rows, then its up rows) as n gates and n ups of rows x cols.
    fn stack_halves(&self, name: &str, n: usize, rows: usize, cols: usize) -> Result<(Vec<Weight>, Vec<Weight>)> {
        self.stack(name, n, 2 * rows, cols).map(|_| ())?;
        let parts = self.split(self.raw_any(name)?, name, &vec![rows; 2 * n])?;
        let (mut gate, mut up) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (i, w) in parts.into_iter().enumerate() {
            if i % 2 == 0 {
                gate.push(w)
            } else {
                up.push(w)
            }
        }
        Ok((gate, up))
    }

    /// Layer `il`'s expert gates and ups: two stacks, or the one `ffn_gate_up_exps` that newer
    /// converters write (Gemma 4, Qwen3.5-MoE, Qwen3-Next; llama.cpp takes either).
    fn expert_gate_up(&self, il: usize, n: usize, rows: usize, cols: usize) -> Result<(Vec<Weight>, Vec<Weight>)> {
        let name = |t: &str| format!("blk.{il}.{t}.weight");
        if self.has(&name("ffn_gate_up_exps")) {
            self.stack_halves(&name("ffn_gate_up_exps"), n, rows, cols)
        } else {
            Ok((self.stack(&name("ffn_gate_exps"), n, rows, cols)?, self.stack(&name("ffn_up_exps"), n, rows, cols)?))
        }
    }

    /// Layer `il`'s Q, K and V with their biases: separate `attn_q`/`attn_k`/`attn_v` or one fused
    /// `attn_qkv` (whichever the file has, as llama.cpp takes either for every family), each bias
    /// optional, a fused one (`attn_qkv.bias`) split like its matrix.
    #[allow(clippy::type_complexity)]
    fn qkv(&self, il: usize, sizes: [usize; 3], d: usize) -> Result<([Weight; 3], [Option<Vec<f32>>; 3])> {
        let name = |t: &str, kind: &str| format!("blk.{il}.{t}.{kind}");
        let sep = ["attn_q", "attn_k", "attn_v"];
        let fused = name("attn_qkv", "weight");
        let ws: [Weight; 3] = if self.has(&fused) {
            let mut p = self.matrix_parts(&fused, &sizes, d)?.into_iter();
            std::array::from_fn(|_| p.next().expect("three parts"))
        } else {
            let [q, k, v] = std::array::from_fn(|i| self.matrix(&name(sep[i], "weight"), sizes[i], d));
            [q?, k?, v?]
        };
        let fused_bias = name("attn_qkv", "bias");
        let bs: [Option<Vec<f32>>; 3] = if self.has(&fused_bias) {
            let b = self.vector(&fused_bias, sizes.iter().sum())?;
            let (q, rest) = b.split_at(sizes[0]);
            let (k, v) = rest.split_at(sizes[1]);
            [Some(q.to_vec()), Some(k.to_vec()), Some(v.to_vec())]
        } else {
            let [q, k, v] = std::array::from_fn(|i| self.opt_vector(&name(sep[i], "bias"), sizes[i]));
            [q?, k?, v?]
        };
        Ok((ws, bs))
    }

    /// Block `il`'s weights as `desc` describes them (a trunk layer, or an MTP block's).
    fn layer(&self, config: &Config, il: usize, desc: &LayerDesc) -> Result<Layer> {
        let (table, numerics, file) = (self, self.numerics, self.file);
        let d = config.dim;
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        let norm = |on: bool, name: &str, len: usize| if on { table.vector(&n(name), len).map(Some) } else { Ok(None) };
        // Biases llama.cpp would add where a file has them, which no family here applies: refuse
        // the file rather than ignore them. (The output's and the experts' are read where the
        // family's graph adds them.)
        let extra: &[&str] = if config.extra_biases { &[] } else { &["attn_output", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"] };
        for t in ["ffn_gate", "ffn_up", "ffn_down"].iter().chain(extra) {
            let b = format!("blk.{il}.{t}.bias");
            if table.has(&b) {
                return Err(Error::UnsupportedModel(format!("{file}: tensor '{b}' is not supported (no output or FFN biases)")));
            }
        }
        let qk_norm = |a: &config::Attention, name: &str, hd: usize| {
            if a.qk_norm_if_present && !a.qk_norm {
                table.opt_vector(&n(name), hd)
            } else {
                norm(a.qk_norm, name, hd)
            }
        };
        let mixer = match &desc.mixer {
            Mixer::Attention(a) => {
                if numerics == Numerics::Ggml && (a.v_norm || a.heads.is_some() || a.kv_from.is_some()) {
                    // Measured: 0.036 nats from llama.cpp's decode steps on the synthetic dense
                    // file (tests/golden/families/README.md), where the other families match to 1e-6.
                    return Err(Error::UnsupportedModel(format!(
                        "{file}: numerics='ggml' does not reproduce ggml's order for gemma4's layers (value norms, heads of their own, shared K/V); load with numerics='fast'"
                    )));
                }
                let h = a.heads(config);
                let (qd, kvd, hd) = (h.q_dim(), h.kv_dim(), h.head_dim);
                // A gated layer's Q projection carries each head's gate after its queries.
                let q_rows = if a.gated { 2 * qd } else { qd };
                let fused = table.has(&n("attn_qkv"));
                let ([wq, wk, wv], [bq, bk, bv]) = if a.kv_from.is_some() && !fused {
                    // A layer that reads an earlier layer's K/V projects queries only; K and V in
                    // its file, if any, are never used (llama.cpp does not require them).
                    ([table.matrix(&n("attn_q"), q_rows, d)?, no_rows(d), no_rows(d)], [None, None, None])
                } else if a.v_optional && !fused && !table.has(&n("attn_v")) {
                    // No V projection: V is K's (no rows here; the forward pass copies K).
                    ([table.matrix(&n("attn_q"), q_rows, d)?, table.matrix(&n("attn_k"), kvd, d)?, no_rows(d)], [None, None, None])
                } else {
                    let ([wq, wk, wv], b) = table.qkv(il, [q_rows, kvd, kvd], d)?;
                    if a.kv_from.is_some() {
                        ([wq, no_rows(d), no_rows(d)], [b[0].clone(), None, None])
                    } else {
                        ([wq, wk, wv], b)
                    }
                };
                MixerWeights::Attention(AttnWeights {
                    wq,
                    wk,
                    wv,
                    bq,
                    bk,
                    bv,
                    wo: table.matrix(&n("attn_output"), d, qd)?,
                    q_norm: qk_norm(a, "attn_q_norm", hd)?,
                    k_norm: if a.kv_from.is_some() { None } else { qk_norm(a, "attn_k_norm", hd)? },
                    bo: if config.extra_biases { Some(table.vector(&format!("blk.{il}.attn_output.bias"), d)?) } else { None },
                    sinks: if config.attn_sinks { Some(table.vector(&n("attn_sinks"), h.n_heads)?) } else { None },
                })
            }
            Mixer::DeltaNet(dn) => {
                if numerics == Numerics::Ggml {
                    return Err(Error::UnsupportedModel(format!(
                        "{file}: numerics='ggml' does not reproduce ggml's order for DeltaNet layers; load with numerics='fast'"
                    )));
                }
                MixerWeights::DeltaNet(Box::new(table.deltanet(il, dn, d)?))
            }
        };
        let ffn = match desc.ffn {
            Ffn::Dense { hidden: hd, fused, .. } => {
                let (gate, up) = if fused {
                    let mut p = table.matrix_parts(&n("ffn_up"), &[hd, hd], d)?.into_iter();
                    (p.next().expect("two parts"), p.next().expect("two parts"))
                } else {
                    (table.matrix(&n("ffn_gate"), hd, d)?, table.matrix(&n("ffn_up"), hd, d)?)
                };
                FfnWeights::Dense { gate, up, down: table.matrix(&n("ffn_down"), d, hd)? }
            }
            Ffn::Moe { n_expert, hidden: hd, shared, sel_bias, shared_gated, .. } => {
                if numerics == Numerics::Ggml {
                    return Err(Error::UnsupportedModel(format!(
                        "{file}: numerics='ggml' does not reproduce ggml's order for routed experts; load with numerics='fast'"
                    )));
                }
                let shared = match shared {
                    Some(sh) => Some(SharedExpert {
                        gate_inp: if shared_gated { Some(table.matrix(&n("ffn_gate_inp_shexp"), 1, d)?) } else { None },
                        gate: table.matrix(&n("ffn_gate_shexp"), sh, d)?,
                        up: table.matrix(&n("ffn_up_shexp"), sh, d)?,
                        down: table.matrix(&n("ffn_down_shexp"), d, sh)?,
                    }),
                    None => None,
                };
                // The router first: a wrong expert count is named at its smallest tensor.
                let router = table.matrix(&n("ffn_gate_inp"), n_expert, d)?;
                let (gate, up) = table.expert_gate_up(il, n_expert, hd, d)?;
                FfnWeights::Moe(Box::new(Experts {
                    router,
                    sel_bias: if sel_bias { Some(table.vector(&format!("blk.{il}.exp_probs_b.bias"), n_expert)?) } else { None },
                    gate,
                    up,
                    down: table.stack(&n("ffn_down_exps"), n_expert, d, hd)?,
                    shared,
                    biases: if config.extra_biases {
                        let b = |t: &str, len: usize| table.vector(&format!("blk.{il}.{t}.bias"), len);
                        Some(ExpertBiases {
                            router: b("ffn_gate_inp", n_expert)?,
                            gate: b("ffn_gate_exps", n_expert * hd)?,
                            up: b("ffn_up_exps", n_expert * hd)?,
                            down: b("ffn_down_exps", n_expert * d)?,
                        })
                    } else {
                        None
                    },
                }))
            }
            Ffn::DenseMoe { hidden: hd, n_expert, expert_hidden: eh, .. } => {
                if numerics == Numerics::Ggml {
                    return Err(Error::UnsupportedModel(format!(
                        "{file}: numerics='ggml' does not reproduce ggml's order for routed experts; load with numerics='fast'"
                    )));
                }
                let (gate, up) = table.expert_gate_up(il, n_expert, eh, d)?;
                FfnWeights::DenseMoe(Box::new(DenseAndExperts {
                    gate: table.matrix(&n("ffn_gate"), hd, d)?,
                    up: table.matrix(&n("ffn_up"), hd, d)?,
                    down: table.matrix(&n("ffn_down"), d, hd)?,
                    post_norm_1: table.vector(&n("post_ffw_norm_1"), d)?,
                    pre_norm_2: table.vector(&n("pre_ffw_norm_2"), d)?,
                    post_norm_2: table.vector(&n("post_ffw_norm_2"), d)?,
                    router_scale: table.vector(&format!("blk.{il}.ffn_gate_inp.scale"), d)?,
                    expert_scale: table.opt_vector(&format!("blk.{il}.ffn_down_exps.scale"), n_expert)?,
                    experts: Experts {
                        router: table.matrix(&n("ffn_gate_inp"), n_expert, d)?,
                        sel_bias: None,
                        gate,
                        up,
                        down: table.stack(&n("ffn_down_exps"), n_expert, d, eh)?,
                        shared: None,
                        biases: None,
                    },
                }))
            }
        };
        let ple = match config.per_layer_input {
            0 => None,
            np => Some(PleLayer {
                gate: table.matrix(&n("inp_gate"), np, d)?,
                proj: table.matrix(&n("proj"), d, np)?,
                post_norm: table.vector(&n("post_norm"), d)?,
            }),
        };
        let out_scale = table.opt_vector(&n("layer_output_scale"), 1)?.map(|v| v[0]);
        Ok(Layer {
            attn_norm: table.vector(&n("attn_norm"), d)?,
            mixer,
            post_attn_norm: if desc.post_norms {
                Some(table.vector(&n("post_attention_norm"), d)?)
            } else if config.ffn_norm == "post_attention_norm" {
                // The family's name for its FFN norm (qwen35): not a norm of the mixer's output.
                None
            } else {
                table.opt_vector(&n("post_attention_norm"), d)?
            },
            ffn_norm: table.vector(&n(config.ffn_norm), d)?,
            ffn,
            post_ffn_norm: norm(desc.post_norms, "post_ffw_norm", d)?,
            ple,
            out_scale,
        })
    }

    /// Older qwen3next files fuse Q, K, V and the output gate Z into one `ssm_in`, grouped per key
    /// head (its query, its key, its value heads' values, their gates). Rows are whole blocks, so
    /// they are gathered at load into `attn_qkv`'s order (every query, every key, every value) and
    /// `attn_gate`'s: the same products llama.cpp's legacy path computes, then reorders.
    fn legacy_qkvz(&self, name: &str, dn: &DeltaNet, d: usize) -> Result<(Weight, Weight)> {
        let (nk, hd, kd, vd) = (dn.n_k_heads, dn.head_dim, dn.key_dim(), dn.value_dim());
        let w = self.raw(name)?;
        if w.rows != 2 * kd + 2 * vd || w.cols != d || !vd.is_multiple_of(nk) {
            return Err(Error::Gguf(format!(
                "{}: tensor '{name}' is {}x{} but the model's metadata implies {}x{d} (the query, key, values and gates of {nk} key heads)",
                self.file,
                w.rows,
                w.cols,
                2 * kd + 2 * vd
            )));
        }
        let (rb, gv) = (w.row_bytes(), vd / nk);
        let group = 2 * hd + 2 * gv;
        let src = w.data.as_slice();
        let rows = |g: usize, at: usize, n: usize| &src[(g * group + at) * rb..(g * group + at + n) * rb];
        let mut qkv = Vec::with_capacity((2 * kd + vd) * rb);
        for (at, n) in [(0, hd), (hd, hd), (2 * hd, gv)] {
            (0..nk).for_each(|g| qkv.extend_from_slice(rows(g, at, n)));
        }
        let mut gate = Vec::with_capacity(vd * rb);
        (0..nk).for_each(|g| gate.extend_from_slice(rows(g, 2 * hd + gv, gv)));
        let owned = |data: Vec<u8>, rows: usize| Weight { rows, data: Bytes::Owned(Arc::new(data)), ..w.clone() };
        Ok((self.prepare(owned(qkv, 2 * kd + vd), name)?, self.prepare(owned(gate, vd), name)?))
    }

    /// Layer `il`'s DeltaNet weights, every shape checked against the `ssm.*` sizes.
    fn deltanet(&self, il: usize, dn: &DeltaNet, d: usize) -> Result<DeltaNetWeights> {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        let (nv, vd, cd, kk) = (dn.n_v_heads, dn.value_dim(), dn.conv_dim(), dn.conv_kernel);
        let (qkv, gate) = if !self.has(&n("attn_qkv")) && self.has(&n("ssm_in")) {
            self.legacy_qkvz(&n("ssm_in"), dn, d)?
        } else {
            (self.matrix(&n("attn_qkv"), cd, d)?, self.matrix(&n("attn_gate"), vd, d)?)
        };
        let ba = if dn.fused_ba {
            BetaAlpha::Fused(self.matrix(&n("ssm_ba"), 2 * nv, d)?)
        } else {
            BetaAlpha::Split { beta: self.matrix(&n("ssm_beta"), nv, d)?, alpha: self.matrix(&n("ssm_alpha"), nv, d)? }
        };
        let conv_name = n("ssm_conv1d");
        let raw = self.raw(&conv_name)?;
        if raw.rows != cd || raw.cols != kk {
            return Err(Error::Gguf(format!(
                "{}: tensor '{conv_name}' is {}x{} but the model's metadata implies {cd}x{kk} (ssm.conv_kernel taps for 2 * ssm.group_count * ssm.state_size + ssm.inner_size channels)",
                self.file, raw.rows, raw.cols
            )));
        }
        let file_conv = raw.to_f32();
        let mut conv = vec![0.0f32; kk * cd];
        for c in 0..cd {
            for j in 0..kk {
                conv[j * cd + c] = file_conv[c * kk + j];
            }
        }
        let a = self.vector(&format!("blk.{il}.ssm_a"), nv)?;
        Ok(DeltaNetWeights {
            qkv,
            gate,
            ba,
            conv,
            dt_bias: self.vector(&format!("blk.{il}.ssm_dt.bias"), nv)?,
            a,
            norm: self.vector(&n("ssm_norm"), dn.head_dim)?,
            out: self.matrix(&n("ssm_out"), d, vd)?,
        })
    }
}

/// A matrix of no rows: a layer's K or V projection where it has none (it reads another layer's
/// K/V, or takes V from K).
fn no_rows(cols: usize) -> Weight {
    Weight { ty: GgmlType::F32, rows: 0, cols, data: Bytes::Owned(Arc::new(Vec::new())), tiled: false, ggml_dot: None }
}

impl Model {
    /// Layer `il`'s matrices, dense ones first, as `matrices` takes them.
    pub fn layer_matrices(&self, il: usize) -> Vec<&Weight> {
        let (mut dense, experts) = self.layer_weights(il);
        dense.extend(experts);
        dense.retain(|w| w.rows > 0);
        dense
    }

    /// Layer `il`'s (dense, routed expert) matrices.
    fn layer_weights(&self, il: usize) -> (Vec<&Weight>, Vec<&Weight>) {
        let l = &self.layers[il];
        let mut dense = Vec::new();
        let mut experts = Vec::new();
        match &l.mixer {
            MixerWeights::Attention(a) => dense.extend([&a.wq, &a.wk, &a.wv, &a.wo]),
            MixerWeights::DeltaNet(d) => {
                dense.extend([&d.qkv, &d.gate, &d.out]);
                match &d.ba {
                    BetaAlpha::Split { beta, alpha } => dense.extend([beta, alpha]),
                    BetaAlpha::Fused(w) => dense.push(w),
                }
            }
        }
        match &l.ffn {
            FfnWeights::Dense { gate, up, down } => dense.extend([gate, up, down]),
            FfnWeights::Moe(e) => {
                dense.push(&e.router);
                if let Some(s) = &e.shared {
                    dense.extend(s.gate_inp.iter().chain([&s.gate, &s.up, &s.down]));
                }
                experts.extend(e.gate.iter().chain(&e.up).chain(&e.down));
            }
            FfnWeights::DenseMoe(p) => {
                dense.extend([&p.gate, &p.up, &p.down, &p.experts.router]);
                experts.extend(p.experts.gate.iter().chain(&p.experts.up).chain(&p.experts.down));
            }
        }
        if let Some(p) = &l.ple {
            dense.extend([&p.gate, &p.proj]);
        }
        (dense, experts)
    }

    /// Every matrix the layers and the head multiply by (not the token embedding, which is
    /// gathered), the ones every row reads first and the routed experts (which rows choose) last.
    pub fn matrices(&self) -> Vec<&Weight> {
        let mut dense = Vec::new();
        let mut experts = Vec::new();
        for il in 0..self.layers.len() {
            let (d, e) = self.layer_weights(il);
            dense.extend(d);
            experts.extend(e);
        }
        if let Some(p) = &self.ple {
            dense.push(&p.proj);
        }
        dense.push(&self.output);
        dense.extend(experts);
        // A layer without K/V of its own (or V of its own) holds matrices of no rows there.
        dense.retain(|w| w.rows > 0);
        dense
    }
}

impl Model {
    /// Map `path` and build the model from the tensor table and metadata the Python loader read.
    /// Its weights are laid out for `rt`'s CPU backend, and it runs there.
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        rt: &Arc<Runtime>,
        path: &Path,
        arch: &str,
        meta: &Metadata,
        tensors: &[TensorInfo],
        tokenizer: Tokenizer,
        quant: QuantMode,
        numerics: Numerics,
    ) -> Result<Model> {
        let desc = lookup_arch(arch).ok_or_else(|| {
            Error::UnsupportedModel(format!("{}: architecture '{arch}' is not supported (supported: {})", path.display(), arch_names().join(", ")))
        })?;
        let file = path.display().to_string();
        let in_file = |e: Error| match e {
            Error::Gguf(m) => Error::Gguf(format!("{file}: {m}")),
            Error::UnsupportedModel(m) => Error::UnsupportedModel(format!("{file}: {m}")),
            other => other,
        };
        let mut config = (desc.configure)(meta).map_err(in_file)?;
        let f = std::fs::File::open(path).map_err(|e| Error::Gguf(format!("{file}: cannot open: {e}")))?;
        // SAFETY: the file is opened read-only and we never write through the map; a concurrent
        // truncation by another process is outside what any mmap-based loader can guard against.
        let map = Arc::new(unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::Gguf(format!("{file}: cannot map: {e}")))?);
        let table = TensorTable::new(&file, map, tensors, quant, numerics, rt.host())?;
        config.validate(meta, table.blocks()).map_err(in_file)?;

        let tok_embd = table.raw("token_embd.weight")?;
        if tok_embd.cols != config.dim {
            return Err(Error::Gguf(format!(
                "{file}: metadata key '{}' is {} but token_embd.weight has rows of {} values",
                meta.key("embedding_length"),
                config.dim,
                tok_embd.cols
            )));
        }
        config.vocab_size = tok_embd.rows;
        let d = config.dim;
        let layers = config.layers.iter().enumerate().map(|(il, desc)| table.layer(&config, il, desc)).collect::<Result<Vec<_>>>()?;
        let mtp = MtpHead::in_file(&table, &config)?.map(Arc::new);
        let output_norm = table.vector("output_norm.weight", d)?;
        let ple = match config.per_layer_input {
            0 => None,
            np => {
                let width = np * config.n_layers;
                let tok = table.raw("per_layer_token_embd.weight")?;
                if tok.cols != width || tok.rows != config.vocab_size {
                    return Err(Error::Gguf(format!(
                        "{file}: tensor 'per_layer_token_embd.weight' is {}x{} but the model's metadata implies {}x{width} (embedding_length_per_layer_input x block_count per token)",
                        tok.rows, tok.cols, config.vocab_size
                    )));
                }
                Some(Ple {
                    tok_embd: tok,
                    proj: table.matrix("per_layer_model_proj.weight", width, d)?,
                    proj_norm: table.vector("per_layer_proj_norm.weight", np)?,
                })
            }
        };
        let output = if table.has("output.weight") {
            table.matrix("output.weight", config.vocab_size, d)?
        } else {
            table.matrix("token_embd.weight", config.vocab_size, d)?
        };
        let rope_factors = match config.rope_factors {
            Some(name) if table.has(name) || config.rope_factors_required => {
                let dim = config.ropes().iter().find(|r| r.factors).map_or(0, |r| r.dim);
                Some(table.vector(name, dim / 2)?)
            }
            _ => None,
        };
        if let Some(bad) = rope_factors.as_ref().and_then(|f| f.iter().find(|v| !(v.is_finite() && **v > 0.0))) {
            return Err(Error::Gguf(format!("{file}: tensor '{}' holds {bad}; RoPE frequency factors must be positive", config.rope_factors.unwrap_or("?"))));
        }
        if tokenizer.n_vocab() != config.vocab_size {
            return Err(Error::Gguf(format!("{file}: the tokenizer has {} tokens but token_embd.weight has {} rows", tokenizer.n_vocab(), config.vocab_size)));
        }
        if let Some(hd) = config.all_heads().iter().map(|h| h.head_dim).find(|hd| numerics == Numerics::Ggml && !hd.is_multiple_of(32)) {
            return Err(Error::UnsupportedModel(format!(
                "{file}: head size {hd} is not a multiple of 32, which numerics='ggml' needs; load with numerics='fast'"
            )));
        }
        Ok(Model {
            config,
            tok_embd,
            layers,
            output_norm,
            output,
            rope_factors,
            ple,
            tokenizer,
            numerics,
            mtp,
            placement: Mutex::new(None),
            uid: next_model_uid(),
            rt: rt.clone(),
            grammar: Mutex::new(None),
        })
    }
}

impl Model {
    /// The grammar environment of this model, made once and shared by all its schedulers:
    /// indexing a vocabulary takes about a second, which a caller can spend ahead of time (the
    /// server does, off its engine thread) so that no scheduler step waits for it.
    pub fn grammar_env(&self) -> Result<Arc<GrammarEnv>> {
        // A panic while building one left nothing half-made: the lock's data is sound.
        let mut env = self.grammar.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = &*env {
            return Ok(e.clone());
        }
        let e = Arc::new(GrammarEnv::new(&self.tokenizer)?);
        *env = Some(e.clone());
        Ok(e)
    }

    /// The model's place on a device, if it has one.
    pub fn placement(&self) -> Option<Arc<dyn Placement>> {
        self.placement.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Place the model on a device (Some) or take it off (None); returns the placement it had.
    /// A pass running meanwhile finishes on the placement it started with.
    pub fn set_placement(&self, p: Option<Arc<dyn Placement>>) -> Option<Arc<dyn Placement>> {
        std::mem::replace(&mut *self.placement.lock().unwrap_or_else(|e| e.into_inner()), p)
    }

    /// The placement that runs whole passes for device-home sessions, while its device answers.
    pub fn resident(&self) -> Option<Arc<dyn Placement>> {
        self.placement().filter(|p| p.resident())
    }

    /// The KV page layout of this model's attention layers.
    pub fn kv_geometry(&self, page_rows: usize, codec: KvCodec) -> Geometry {
        match self.config.kv_heads() {
            Some(h) => Geometry::layered(&h.iter().map(|h| (h.head_dim, h.n_kv_heads)).collect::<Vec<_>>(), page_rows, codec),
            None => Geometry { n_layers: self.config.kv_layers(), kv_dim: self.config.kv_dim(), head_dim: self.config.head_dim, page_rows, codec, slots: None },
        }
    }

    /// Check that a pool of `geo` can hold this model's K/V.
    pub fn check_kv(&self, geo: &Geometry) -> Result<()> {
        if geo != &self.kv_geometry(geo.page_rows, geo.codec) {
            return Err(Error::InvalidArgument("this KV pool was made for a model of another shape".into()));
        }
        if let Some(hd) = self.config.all_heads().iter().map(|h| h.head_dim).find(|&hd| !geo.codec.supports(hd)) {
            return Err(Error::InvalidArgument(format!(
                "the KV codec {:?} needs {}; this model's head size is {hd}: use f16",
                geo.codec,
                geo.codec.requirement()
            )));
        }
        if self.numerics == Numerics::Ggml && geo.codec != KvCodec::F16 {
            return Err(Error::InvalidArgument(format!(
                "the KV codec {:?} has no counterpart in ggml's order; a model loaded with numerics='ggml' needs an f16 KV cache",
                geo.codec
            )));
        }
        Ok(())
    }
}
