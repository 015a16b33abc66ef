//! What the forward pass needs to know about a model: the sizes every layer shares, and one
//! description per layer (its token mixer and its FFN), built by the family's file from typed
//! metadata. The skeleton walks the layer list; it never tests a family name.

use super::meta::{MetaValue, Metadata};
use crate::backend::AttnShape;
pub use crate::backend::{Activation, Gating};
pub use crate::backend::{DeltaNet, HeadMap, Mrope, Rope};
use crate::{Error, Result};

/// Causal self-attention over the session's K/V pages of this layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Attention {
    pub rope: Rope,
    /// This layer's own head geometry where it differs from the model's (`Config::n_heads`,
    /// `n_kv_heads`, `head_dim`): gemma4's full-attention layers.
    pub heads: Option<Heads>,
    /// RMS-norm each value head, without a weight (gemma4).
    pub v_norm: bool,
    /// A file without `attn_v` for this layer takes K's projection as V (gemma4's
    /// `attention_k_eq_v`); elsewhere `attn_v` is required.
    pub v_optional: bool,
    /// Read the K/V of that earlier layer instead of keeping any (gemma4's E-series: the last
    /// `attention.shared_kv_layers` layers project queries only).
    pub kv_from: Option<usize>,
    /// Keys older than this many positions are not attended (0: the whole context).
    pub window: usize,
    /// RMS-norm each query and key head (weights `attn_q_norm`, `attn_k_norm`).
    pub qk_norm: bool,
    /// Where `qk_norm` is off: RMS-norm the queries (keys) if the file has `attn_q_norm`
    /// (`attn_k_norm`), each on its own, as llama.cpp's glm4moe graph does.
    pub qk_norm_if_present: bool,
    pub scale: f32,
    /// `scale` multiplies the queries (before their f16 rounding) instead of the scores, as
    /// llama.cpp's gemma and phi3 graphs do; it matters where small queries round to f16 subnormals.
    pub scale_query: bool,
    /// Soft-cap the raw q.k scores to (-cap, cap) with cap * tanh(s / cap) before the softmax
    /// (gemma2's `attn_logit_softcapping`).
    pub softcap: Option<f32>,
    /// The Q projection gives each head its queries and as many gate values after them
    /// (2 * head_dim rows a head); the attention output is multiplied by their sigmoid before
    /// `attn_output` (qwen35, qwen3next).
    pub gated: bool,
    /// Llama 4's attention temperature (mistral3's `attention.temperature_scale`): each query is
    /// multiplied by a factor that grows with its position's distance in original contexts.
    pub temp: Option<AttnTemp>,
}

/// A layer's attention heads: `n_heads` query heads and `n_kv_heads` K/V heads of `head_dim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl Heads {
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// Queries at position p are multiplied by 1 + scale * ln(floor(p / floor) + 1), as llama.cpp's
/// `llm_graph_input_attn_temp` computes it (in f64, rounded to f32): 1 in the first `floor`
/// positions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnTemp {
    pub scale: f32,
    pub floor: usize,
}

impl AttnTemp {
    pub fn factor(&self, pos: usize) -> f32 {
        ((((pos as f32) / self.floor as f32).floor() as f64 + 1.0).ln() * self.scale as f64 + 1.0) as f32
    }
}

impl Attention {
    /// Global attention with the shared RoPE and scale, no QK-norm or soft-capping: what most
    /// families start from.
    pub(crate) fn plain(s: &Shared) -> Attention {
        Attention {
            rope: s.rope,
            heads: None,
            v_norm: false,
            v_optional: false,
            kv_from: None,
            window: 0,
            qk_norm: false,
            qk_norm_if_present: false,
            scale: s.scale,
            scale_query: false,
            softcap: None,
            gated: false,
            temp: None,
        }
    }

    /// This layer's heads: its own, or the model's.
    pub fn heads(&self, c: &Config) -> Heads {
        self.heads.unwrap_or(Heads { n_heads: c.n_heads, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim })
    }

    /// What the backend needs to know of this layer's attention (its sinks are weights: the
    /// forward pass adds them).
    pub fn shape(&self, c: &Config) -> AttnShape<'static> {
        let h = self.heads(c);
        AttnShape {
            n_heads: h.n_heads,
            n_kv_heads: h.n_kv_heads,
            head_dim: h.head_dim,
            window: self.window,
            scale: self.scale,
            scale_query: self.scale_query,
            softcap: self.softcap,
            sinks: None,
        }
    }
}

/// How a family's `ssm.*` keys describe its DeltaNet layers (the geometry is the seam's:
/// `backend::DeltaNet`).
impl DeltaNet {
    /// A family's DeltaNet layers as the `ssm.*` keys describe them, checked against each other.
    pub(crate) fn read(m: &Metadata, k_of_v: HeadMap, fused_ba: bool) -> Result<DeltaNet> {
        let bad = |key: &str, msg: String| Err(Error::Gguf(format!("metadata key '{}' {msg}", m.key(key))));
        let conv_kernel = m.req_positive("ssm.conv_kernel")?;
        let head_dim = m.req_positive("ssm.state_size")?;
        let n_v_heads = m.req_positive("ssm.time_step_rank")?;
        let n_k_heads = m.req_positive("ssm.group_count")?;
        let inner = m.req_positive("ssm.inner_size")?;
        if conv_kernel < 2 {
            return bad("ssm.conv_kernel", format!("is {conv_kernel}; a causal convolution needs at least 2 taps"));
        }
        if !n_v_heads.is_multiple_of(n_k_heads) {
            return bad("ssm.time_step_rank", format!("(value heads) is {n_v_heads}, not a multiple of ssm.group_count (key heads, {n_k_heads})"));
        }
        if inner != n_v_heads * head_dim {
            return bad(
                "ssm.inner_size",
                format!("is {inner} but ssm.time_step_rank ({n_v_heads} value heads) x ssm.state_size ({head_dim}) is {}", n_v_heads * head_dim),
            );
        }
        // llama.cpp reads the epsilon as required for these families; it norms Q and K too.
        let eps = m
            .float("attention.layer_norm_rms_epsilon")?
            .ok_or_else(|| Error::Gguf(format!("metadata key '{}' is missing", m.key("attention.layer_norm_rms_epsilon"))))?;
        Ok(DeltaNet { conv_kernel, n_k_heads, n_v_heads, head_dim, k_of_v, fused_ba, eps: eps as f32 })
    }

    /// The key head value head `j` reads.
    pub fn k_head(&self, j: usize) -> usize {
        match self.k_of_v {
            HeadMap::Grouped => j / (self.n_v_heads / self.n_k_heads),
            HeadMap::Tiled => j % self.n_k_heads,
        }
    }
}

/// How a layer mixes positions: attention over the session's K/V pages, or a recurrent DeltaNet
/// whose state is the session's per-layer recurrent state.
#[derive(Clone, Debug, PartialEq)]
pub enum Mixer {
    Attention(Attention),
    DeltaNet(DeltaNet),
}

/// The position-wise network of a layer: a dense GLU or routed experts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Ffn {
    /// down(act(gate(x)) * up(x)). `fused`: gate and up are one tensor, `ffn_up`, of 2 * hidden
    /// rows, the gate's first (phi3); otherwise `ffn_gate` and `ffn_up`.
    Dense { hidden: usize, act: Activation, fused: bool },
    /// Routed experts (qwen2moe, qwen3moe, glm4moe): `gating` (softmax or sigmoid) over `n_expert`
    /// router logits (`ffn_gate_inp`) scores each expert; the `n_used` of the highest scores (plus
    /// the selection bias `exp_probs_b` where `sel_bias`) each run a SwiGLU of width `hidden`
    /// (3-D `ffn_{gate,up,down}_exps`) and their outputs are added, weighted by their scores
    /// (renormalised to sum to 1 where `norm_weights`, then multiplied by `scale`). `shared`: the
    /// width of an always-run SwiGLU expert (`ffn_*_shexp`) whose output joins them, scaled by
    /// the sigmoid of its own gate (`ffn_gate_inp_shexp`) where `shared_gated`.
    Moe {
        n_expert: usize,
        n_used: usize,
        hidden: usize,
        norm_weights: bool,
        shared: Option<usize>,
        gating: Gating,
        sel_bias: bool,
        scale: f32,
        shared_gated: bool,
    },
    /// gemma4's 26B-A4B: a dense GLU (`ffn_gate`/`ffn_up`/`ffn_down` of width `hidden`, input
    /// normed by `ffn_norm`, output by `post_ffw_norm_1`) beside routed experts (input normed by
    /// `pre_ffw_norm_2`, output by `post_ffw_norm_2`), their sum normed by `post_ffw_norm`. The
    /// router reads the residual RMS-normed without a weight, scaled by 1/sqrt(dim) and by
    /// `ffn_gate_inp.scale`; softmax scores, the `n_used` best renormalised, each expert's output
    /// scaled by its `ffn_down_exps.scale` where the file has it. `act` is every GLU's.
    DenseMoe { hidden: usize, n_expert: usize, n_used: usize, expert_hidden: usize, act: Activation },
}

#[derive(Clone, Debug, PartialEq)]
pub struct LayerDesc {
    pub mixer: Mixer,
    pub ffn: Ffn,
    /// RMS-norm the mixer's and the FFN's outputs before the residual add (gemma2/3).
    pub post_norms: bool,
}

/// Sizes every layer shares, and the layers.
#[derive(Clone, Debug)]
pub struct Config {
    pub arch: String,
    pub dim: usize,
    pub n_layers: usize,
    /// Attention geometry, shared by every attention layer (their K/V share one page layout).
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub seq_len: usize,
    pub norm_eps: f32,
    /// Multiply token embeddings by this (gemma: sqrt(dim)).
    pub embed_scale: Option<f32>,
    /// Soft-cap the logits with cap * tanh(logit / cap) (gemma2's `final_logit_softcapping`).
    pub final_softcap: Option<f32>,
    /// The tensor of per-frequency RoPE divisors every layer uses, where the file has it (phi3's
    /// longrope: `rope_factors_long` when the context outgrows the original one, else `_short`).
    pub rope_factors: Option<&'static str>,
    /// The file must have `rope_factors` (gemma4's full layers: llama.cpp requires `rope_freqs`);
    /// otherwise a file without it runs unscaled.
    pub rope_factors_required: bool,
    /// The tensor (`blk.N.<name>.weight`) that norms the FFN's input: `ffn_norm`, or
    /// `post_attention_norm` where the family names it so (qwen35, qwen3next).
    pub ffn_norm: &'static str,
    /// Values of each layer's own input per token (gemma4's per-layer embeddings,
    /// `embedding_length_per_layer_input`; 0: none).
    pub per_layer_input: usize,
    pub layers: Vec<LayerDesc>,
    /// The MTP (NextN) blocks the file declares after the trunk's (`nextn_predict_layers`):
    /// blocks n_layers.., which the forward pass does not run (`model::mtp`).
    pub nextn: Vec<LayerDesc>,
    /// Every attention layer has per-head sink logits (`attn_sinks`, required; gpt-oss).
    pub attn_sinks: bool,
    /// Biases on the attention output, the router and the routed experts are part of the model
    /// (required, as gpt-oss's graph adds them); elsewhere a file that has them is refused.
    pub extra_biases: bool,
    /// The routed experts' GLU (SiLU unless the family says otherwise).
    pub expert_act: Activation,
    /// Qwen3-VL's deepstack layers (`n_deepstack_layers`): a row given as values (an image's)
    /// carries this many extra slices of `dim` after its input, slice k added to the output of
    /// layer k - 1 (llama.cpp's `n_embd_inp`); a token's row has none.
    pub deepstack: usize,
    /// An image's non-causal rows (`Injected::spans`) see each other in the sliding-window
    /// layers only; the full layers stay causal (gemma4: llama.cpp's
    /// `LLAMA_NON_CAUSAL_TYPE_SWA_ONLY`). Otherwise every layer lets them (gemma3).
    pub image_spans_sliding_only: bool,
}

impl Config {
    /// Weight multiply-adds of one row through the layers (what the scheduler's cost model
    /// weighs a row's logits and its attended keys against).
    pub fn macs_per_row(&self) -> f64 {
        let c = self;
        let attn = c.dim * (c.q_dim() + 2 * c.kv_dim()) + c.q_dim() * c.dim;
        let body: usize = c
            .layers
            .iter()
            .map(|l| {
                attn + match l.ffn {
                    Ffn::Dense { hidden, .. } => 3 * c.dim * hidden,
                    // A row runs the router, its chosen experts and the shared one.
                    Ffn::Moe { n_expert, n_used, hidden, shared, shared_gated, .. } => {
                        c.dim * n_expert + n_used * 3 * c.dim * hidden + shared.map_or(0, |s| 3 * c.dim * s + if shared_gated { c.dim } else { 0 })
                    }
                    // The dense GLU, the router and the chosen experts.
                    Ffn::DenseMoe { hidden, n_expert, n_used, expert_hidden, .. } => 3 * c.dim * hidden + c.dim * n_expert + n_used * 3 * c.dim * expert_hidden,
                }
            })
            .sum();
        body as f64
    }

    /// The width of a row given as values (an image's): the input and any deepstack slices.
    pub fn embd_inp(&self) -> usize {
        self.dim * (1 + self.deepstack)
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Where layer `il` keeps its K/V in a session's pages: its index among the layers that keep
    /// K/V (pages hold attention layers only; a recurrent layer keeps its state beside them, and a
    /// layer that reads an earlier layer's K/V reads that layer's slot).
    pub fn kv_slot(&self, il: usize) -> Option<usize> {
        match &self.layers[il].mixer {
            Mixer::Attention(Attention { kv_from: Some(src), .. }) => self.kv_slot(*src),
            Mixer::Attention(_) => Some(self.layers[..il].iter().filter(|l| keeps_kv(l)).count()),
            Mixer::DeltaNet(_) => None,
        }
    }

    /// How many layers keep K/V.
    pub fn kv_layers(&self) -> usize {
        self.layers.iter().filter(|l| keeps_kv(l)).count()
    }

    /// The heads of each layer that keeps K/V, in slot order, where they differ between layers
    /// (None: every slot has the model's).
    pub fn kv_heads(&self) -> Option<Vec<Heads>> {
        let h: Vec<Heads> =
            self.layers.iter().filter(|l| keeps_kv(l)).filter_map(|l| if let Mixer::Attention(a) = &l.mixer { Some(a.heads(self)) } else { None }).collect();
        h.iter().any(|x| x.kv_dim() != self.kv_dim() || x.head_dim != self.head_dim).then_some(h)
    }

    /// Every attention layer's heads (the model's and those of layers with their own).
    pub fn all_heads(&self) -> Vec<Heads> {
        self.layers.iter().filter_map(|l| if let Mixer::Attention(a) = &l.mixer { Some(a.heads(self)) } else { None }).collect()
    }

    /// Where layer `il` keeps its recurrent state in a session: its index among the DeltaNet layers.
    pub fn rec_slot(&self, il: usize) -> Option<usize> {
        match self.layers[il].mixer {
            Mixer::DeltaNet(_) => Some(self.layers[..il].iter().filter(|l| matches!(l.mixer, Mixer::DeltaNet(_))).count()),
            Mixer::Attention(_) => None,
        }
    }

    /// The DeltaNet layers, in order (what a session's recurrent state holds).
    pub fn rec_layers(&self) -> Vec<DeltaNet> {
        self.layers.iter().filter_map(|l| if let Mixer::DeltaNet(d) = l.mixer { Some(d) } else { None }).collect()
    }

    /// Whether any layer keeps a recurrent state: such a model's sessions cannot go back to an
    /// earlier position by truncation, nor take K/V pages from the prefix cache.
    pub fn recurrent(&self) -> bool {
        self.layers.iter().any(|l| matches!(l.mixer, Mixer::DeltaNet(_)))
    }

    /// Replace every attention layer's RoPE by `f` of it.
    pub(crate) fn map_ropes(&mut self, f: impl Fn(Rope) -> Result<Rope>) -> Result<()> {
        for l in self.layers.iter_mut().chain(self.nextn.iter_mut()) {
            if let Mixer::Attention(a) = &mut l.mixer {
                a.rope = f(a.rope)?;
            }
        }
        Ok(())
    }

    /// Every distinct RoPE of the attention layers (the forward pass tabulates each once).
    pub fn ropes(&self) -> Vec<Rope> {
        let mut out: Vec<Rope> = Vec::new();
        for l in &self.layers {
            if let Mixer::Attention(a) = &l.mixer {
                if !out.contains(&a.rope) {
                    out.push(a.rope);
                }
            }
        }
        out
    }

    /// The largest FFN width (scratch sizing).
    pub fn max_hidden(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l.ffn {
                Ffn::Dense { hidden, .. } => hidden,
                Ffn::Moe { hidden, shared, .. } => hidden.max(shared.unwrap_or(0)),
                Ffn::DenseMoe { hidden, expert_hidden, .. } => hidden.max(expert_hidden),
            })
            .max()
            .unwrap_or(0)
    }

    /// Check the sizes against each other, naming the metadata key that is wrong. `blocks`: how
    /// many `blk.N.` blocks the tensor table holds.
    pub fn validate(&self, meta: &Metadata, blocks: usize) -> Result<()> {
        let bad = |key: &str, msg: String| Err(Error::Gguf(format!("metadata key '{}' {msg}", meta.key(key))));
        if self.n_layers > blocks {
            return bad("block_count", format!("is {} but the file holds tensors for {blocks} blocks", self.n_layers));
        }
        for (il, l) in self.layers.iter().enumerate() {
            let a = match &l.mixer {
                Mixer::Attention(a) => a,
                Mixer::DeltaNet(_) => continue,
            };
            let h = a.heads(self);
            if !h.n_heads.is_multiple_of(h.n_kv_heads) {
                return bad("attention.head_count_kv", format!("is {}, which does not divide attention.head_count ({})", h.n_kv_heads, h.n_heads));
            }
            // A layer with its own heads has them from the family's own key (gemma4's `_swa`).
            let hd_key = if a.heads.is_some_and(|x| x.head_dim != self.head_dim) { "attention.key_length_swa" } else { "attention.key_length" };
            if h.head_dim < 2 || !h.head_dim.is_multiple_of(2) {
                return bad(hd_key, format!("is {}; a head needs an even size of at least 2", h.head_dim));
            }
            if a.rope.dim > h.head_dim || a.rope.dim < 2 || !a.rope.dim.is_multiple_of(2) {
                return bad("rope.dimension_count", format!("is {}; it must be even, at least 2 and at most the head size {}", a.rope.dim, h.head_dim));
            }
            if !(a.rope.base.is_finite() && a.rope.base > 0.0) {
                return bad("rope.freq_base", format!("gives a RoPE base of {}", a.rope.base));
            }
            if let Some(cap) = a.softcap {
                if !(cap.is_finite() && cap > 0.0) {
                    return bad("attn_logit_softcapping", format!("is {cap}; it must be a positive number"));
                }
            }
            if let Some(src) = a.kv_from {
                let owner = match self.layers.get(src).map(|l| &l.mixer) {
                    Some(Mixer::Attention(s)) if src < il && s.kv_from.is_none() => s,
                    _ => return Err(Error::Internal(format!("layer {il} of {} reads the K/V of layer {src}, which keeps none before it", self.arch))),
                };
                if owner.heads(self) != h {
                    return Err(Error::Internal(format!("layer {il} of {} reads the K/V of layer {src}, whose heads differ", self.arch)));
                }
            }
        }
        if let Some(v) = meta.size("attention.value_length")? {
            if v != self.head_dim {
                return Err(Error::UnsupportedModel(format!(
                    "metadata key '{}' is {v} but attention.key_length is {}: heads with different K and V sizes are not supported",
                    meta.key("attention.value_length"),
                    self.head_dim
                )));
            }
        }
        if self.layers.len() != self.n_layers {
            return Err(Error::Internal(format!("the {} family described {} layers of {}", self.arch, self.layers.len(), self.n_layers)));
        }
        for l in &self.layers {
            if let Ffn::Moe { n_expert, n_used, .. } | Ffn::DenseMoe { n_expert, n_used, .. } = l.ffn {
                if n_used == 0 || n_used > n_expert {
                    return bad("expert_used_count", format!("is {n_used}; it must be between 1 and expert_count ({n_expert})"));
                }
            }
        }
        if let Some(cap) = self.final_softcap {
            if !(cap.is_finite() && cap > 0.0) {
                return bad("final_logit_softcapping", format!("is {cap}; it must be a positive number"));
            }
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return bad("attention.layer_norm_rms_epsilon", format!("is {}; it must be a small positive number", self.norm_eps));
        }
        Ok(())
    }
}

/// Whether a layer keeps K/V of its own in the session's pages.
fn keeps_kv(l: &LayerDesc) -> bool {
    matches!(l.mixer, Mixer::Attention(Attention { kv_from: None, .. }))
}

/// The fields every family reads the same way, with llama's conventions for the rest; a family
/// starts from this and overrides what differs.
pub(crate) fn base_config(m: &Metadata, arch: &str, layer: impl Fn(usize, &Shared) -> LayerDesc) -> Result<Config> {
    let dim = m.req_positive("embedding_length")?;
    let n_heads = m.req_positive("attention.head_count")?;
    let n_layers = m.req_positive("block_count")?;
    let n_kv_heads = match m.sizes_per_layer("attention.head_count_kv", n_layers)? {
        None => n_heads,
        Some(v) if v.iter().all(|&x| x == v[0]) && v[0] > 0 => v[0],
        Some(v) if v.contains(&0) => {
            return Err(Error::Gguf(format!("metadata key '{}' is 0; it must be at least 1", m.key("attention.head_count_kv"))));
        }
        Some(_) => return Err(Error::UnsupportedModel(format!("metadata key '{}' varies by layer, which is not supported", m.key("attention.head_count_kv")))),
    };
    let head_dim = match m.size("attention.key_length")? {
        Some(h) => h,
        None if dim.is_multiple_of(n_heads) => dim / n_heads,
        None => {
            return Err(Error::Gguf(format!(
                "metadata key '{}' ({dim}) is not a multiple of '{}' ({n_heads}) and attention.key_length is absent",
                m.key("embedding_length"),
                m.key("attention.head_count")
            )))
        }
    };
    let hidden = m.req_positive("feed_forward_length")?;
    let seq_len = m.req_positive("context_length")?;
    let shared = Shared {
        hidden,
        rope: read_rope(m, m.size("rope.dimension_count")?.unwrap_or(head_dim), seq_len, false)?,
        scale: 1.0 / (head_dim as f32).sqrt(),
        window: m.size("attention.sliding_window")?.unwrap_or(0),
    };
    let layers = (0..n_layers).map(|il| layer(il, &shared)).collect();
    bare_config(m, arch, Heads { n_heads, n_kv_heads, head_dim }, layers)
}

/// A config of these layers and model-wide heads, with the sizes every family reads alike
/// (`embedding_length`, `context_length`, the norm epsilon) and llama's conventions for the rest:
/// what a family whose layers `base_config` cannot describe starts from (gemma4).
pub(crate) fn bare_config(m: &Metadata, arch: &str, heads: Heads, layers: Vec<LayerDesc>) -> Result<Config> {
    Ok(Config {
        arch: arch.into(),
        dim: m.req_positive("embedding_length")?,
        n_layers: layers.len(),
        n_heads: heads.n_heads,
        n_kv_heads: heads.n_kv_heads,
        head_dim: heads.head_dim,
        vocab_size: 0,
        seq_len: m.req_positive("context_length")?,
        norm_eps: m.positive_or("attention.layer_norm_rms_epsilon", 1e-5)? as f32,
        embed_scale: None,
        final_softcap: None,
        rope_factors: None,
        rope_factors_required: false,
        ffn_norm: "ffn_norm",
        per_layer_input: 0,
        layers,
        nextn: Vec::new(),
        attn_sinks: false,
        extra_biases: false,
        expert_act: Activation::Silu,
        deepstack: 0,
        image_spans_sliding_only: false,
    })
}

/// Per-layer values read once by `base_config`, for the family's layer builder.
pub(crate) struct Shared {
    pub hidden: usize,
    pub rope: Rope,
    pub scale: f32,
    /// `attention.sliding_window` (0 if absent).
    pub window: usize,
}

/// The RoPE of `dim` rotated values the file asks for (NORM pairing; a family sets its own),
/// read as llama.cpp reads it: `rope.freq_base`, `rope.scaling.type` (linear when absent),
/// `rope.scaling.factor`, `rope.scaling.attn_factor`, and for YaRN the original context
/// (`rope.scaling.original_context_length`, else `context_length`) and, where the family's
/// llama.cpp graph reads them (`yarn_keys`), `rope.scaling.yarn_beta_fast`, `_beta_slow` and
/// `_log_multiplier` (else ggml's 32, 1 and 0).
pub(crate) fn read_rope(m: &Metadata, dim: usize, n_ctx_train: usize, yarn_keys: bool) -> Result<Rope> {
    let base = m.positive_or("rope.freq_base", 10000.0)? as f32;
    let kind = match m.get("rope.scaling.type") {
        None => "linear".to_string(),
        Some(MetaValue::Str(s)) => s.clone(),
        Some(_) => return Err(Error::Gguf(format!("metadata key '{}' must be a string", m.key("rope.scaling.type")))),
    };
    // A factor of 0 (or none) means no scaling; the older key name still counts.
    let factor = match m.float("rope.scaling.factor")? {
        Some(f) => Some(f),
        None => m.float("rope.scale_linear")?,
    };
    let factor = match factor {
        None => 1.0,
        Some(0.0) => 1.0,
        Some(f) if f > 0.0 => f as f32,
        Some(f) => return Err(Error::Gguf(format!("metadata key '{}' is {f}; it must be greater than 0", m.key("rope.scaling.factor")))),
    };
    let attn_factor = m.positive_or("rope.scaling.attn_factor", 1.0)? as f32;
    let rope = Rope { dim, base, neox: false, freq_scale: 1.0 / factor, mscale: attn_factor, yarn: None, mrope: None, factors: true };
    match kind.as_str() {
        "none" => Ok(Rope { freq_scale: 1.0, ..rope }),
        "linear" | "longrope" => Ok(rope),
        "yarn" => yarn(m, rope, n_ctx_train, yarn_keys),
        other => Err(Error::UnsupportedModel(format!(
            "metadata key '{}' is {other:?}, which is not supported (supported: none, linear, longrope, yarn)",
            m.key("rope.scaling.type")
        ))),
    }
}

/// YaRN as llama.cpp sets it up (`llama_context`'s attention factor, ggml's correction dims),
/// in the same f32 steps: the sines and cosines end up scaled by attn_factor * yarn_attn_factor
/// * (1 + 0.1 ln(1 / freq_scale)).
fn yarn(m: &Metadata, rope: Rope, n_ctx_train: usize, yarn_keys: bool) -> Result<Rope> {
    let key = |k: &str, default: f32| -> Result<f32> {
        match m.float(k)? {
            Some(v) if yarn_keys => {
                if !v.is_finite() {
                    return Err(Error::Gguf(format!("metadata key '{}' is {v}; it must be a finite number", m.key(k))));
                }
                Ok(v as f32)
            }
            _ => Ok(default),
        }
    };
    let (beta_fast, beta_slow, log_mul) =
        (key("rope.scaling.yarn_beta_fast", 32.0)?, key("rope.scaling.yarn_beta_slow", 1.0)?, key("rope.scaling.yarn_log_multiplier", 0.0)?);
    let n_ctx_orig = match m.size("rope.scaling.original_context_length")? {
        Some(0) | None => n_ctx_train,
        Some(n) => n,
    };
    let mscale_of = |scale: f32, mscale: f32| if scale <= 1.0 { 1.0 } else { 0.1 * mscale * scale.ln() + 1.0 };
    let factor = 1.0 / rope.freq_scale;
    let mut attn = if log_mul != 0.0 { mscale_of(factor, 1.0) / mscale_of(factor, log_mul) } else { mscale_of(factor, 1.0) };
    attn *= 1.0 / (1.0 + 0.1 * factor.ln());
    attn *= rope.mscale;
    // ggml's rope_yarn: every pair's magnitude correction.
    let mscale = attn * (1.0 + 0.1 * (1.0 / rope.freq_scale).ln());
    let corr = |beta: f32| rope.dim as f32 * (n_ctx_orig as f32 / (beta * 2.0 * std::f32::consts::PI)).ln() / (2.0 * rope.base.ln());
    let low = corr(beta_fast).floor().max(0.0);
    let high = corr(beta_slow).ceil().min(rope.dim as f32 - 1.0);
    Ok(Rope { mscale, yarn: Some([low, high]), ..rope })
}

/// Refuse YaRN where a family gives some layers another base than the one its correction dims
/// were worked out for (gemma2/3's sliding layers).
pub(crate) fn no_yarn(m: &Metadata, c: &Config) -> Result<()> {
    if c.ropes().iter().any(|r| r.yarn.is_some()) {
        return Err(Error::UnsupportedModel(format!("metadata key '{}' is \"yarn\", which is not supported for {}", m.key("rope.scaling.type"), c.arch)));
    }
    Ok(())
}

/// A multi-axis RoPE's `rope.dimension_sections` (required: four pair counts, or one for all
/// four, as llama.cpp reads it), checked as ggml checks it: some pairs on the first three axes,
/// no more pairs than the head has values. A text token has one position on the first three axes and 0 on the
/// fourth, so the pairs there do not turn (`Mrope::axis`).
pub(crate) fn mrope(m: &Metadata, rope: Rope, head_dim: usize, interleaved: bool) -> Result<Rope> {
    let key = "rope.dimension_sections";
    let bad = || Error::Gguf(format!("metadata key '{}' must be an array of 4 non-negative integers", m.key(key)));
    let mut sections = [0usize; 4];
    match m.get(key) {
        None => return Err(Error::Gguf(format!("metadata key '{}' is missing", m.key(key)))),
        Some(MetaValue::Array(a)) => {
            if a.len() != 4 {
                return Err(Error::Gguf(format!("metadata key '{}' has {} values; it must have 4", m.key(key), a.len())));
            }
            for (i, x) in a.iter().enumerate() {
                match x {
                    MetaValue::Int(n) if *n >= 0 => sections[i] = *n as usize,
                    _ => return Err(bad()),
                }
            }
        }
        Some(MetaValue::Int(n)) if *n >= 0 => sections = [*n as usize; 4],
        Some(_) => return Err(bad()),
    }
    if sections[..3].iter().all(|&n| n == 0) {
        return Err(Error::Gguf(format!("metadata key '{}' is {sections:?}; the first three axes have no pairs", m.key(key))));
    }
    let total: usize = sections.iter().sum();
    if total > head_dim {
        return Err(Error::Gguf(format!("metadata key '{}' is {sections:?}: {total} pairs, more than the head has values ({head_dim})", m.key(key))));
    }
    Ok(Rope { mrope: Some(Mrope { sections, interleaved }), ..rope })
}

/// Which layers are recurrent (DeltaNet) in a hybrid, as llama.cpp reads it:
/// `attention.recurrent_layers` (one boolean per layer), else every layer but each
/// `full_attention_interval`-th (default 4) is.
pub(crate) fn recurrent_layers(m: &Metadata, n_layers: usize) -> Result<Vec<bool>> {
    let key = "attention.recurrent_layers";
    if let Some(v) = m.get(key) {
        let MetaValue::Array(a) = v else {
            return Err(Error::Gguf(format!("metadata key '{}' must be an array of booleans, one per layer", m.key(key))));
        };
        if a.len() != n_layers {
            return Err(Error::Gguf(format!("metadata key '{}' has {} values but the model has {n_layers} layers", m.key(key), a.len())));
        }
        return a
            .iter()
            .map(|v| match v {
                MetaValue::Bool(b) => Ok(*b),
                MetaValue::Int(i) => Ok(*i != 0),
                _ => Err(Error::Gguf(format!("metadata key '{}' must be an array of booleans, one per layer", m.key(key)))),
            })
            .collect();
    }
    let every = match m.size("full_attention_interval")? {
        None => 4,
        Some(0) => return Err(Error::Gguf(format!("metadata key '{}' is 0; it must be at least 1", m.key("full_attention_interval")))),
        Some(n) => n,
    };
    Ok((0..n_layers).map(|il| (il + 1) % every != 0).collect())
}

/// Which layers slide: `attention.sliding_window_pattern` as llama.cpp reads it (an array of
/// booleans, one per layer, or a period n where every n-th layer is global), else `period`.
/// A period of 0 makes every layer slide.
pub(crate) fn swa_layers(m: &Metadata, n_layers: usize, period: usize) -> Result<Vec<bool>> {
    let key = "attention.sliding_window_pattern";
    let period = match m.get(key) {
        Some(MetaValue::Array(a)) => {
            if a.len() != n_layers {
                return Err(Error::Gguf(format!("metadata key '{}' has {} values but the model has {n_layers} layers", m.key(key), a.len())));
            }
            return a
                .iter()
                .map(|v| match v {
                    MetaValue::Bool(b) => Ok(*b),
                    _ => Err(Error::Gguf(format!("metadata key '{}' must be an array of booleans or an integer", m.key(key)))),
                })
                .collect();
        }
        Some(_) => m.req_size(key)?,
        None => period,
    };
    Ok((0..n_layers).map(|il| period == 0 || il % period < period - 1).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lookup_arch;

    fn meta(arch: &str, extra: &[(&str, MetaValue)]) -> Metadata {
        let mut map: std::collections::HashMap<String, MetaValue> = [
            ("block_count", MetaValue::Int(4)),
            ("embedding_length", MetaValue::Int(256)),
            ("feed_forward_length", MetaValue::Int(512)),
            ("attention.head_count", MetaValue::Int(4)),
            ("context_length", MetaValue::Int(64)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        map.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
        Metadata::new(arch, map)
    }

    fn configure(arch: &str, extra: &[(&str, MetaValue)]) -> Result<Config> {
        (lookup_arch(arch).unwrap().configure)(&meta(arch, extra))
    }

    fn attn(c: &Config, il: usize) -> &Attention {
        let Mixer::Attention(a) = &c.layers[il].mixer else { panic!("layer {il} is not attention") };
        a
    }

    #[test]
    fn gemma2_alternates_sliding_layers_and_caps() {
        let c = configure("gemma2", &[("attention.sliding_window", MetaValue::Int(8)), ("rope.freq_base_swa", MetaValue::Float(500.0))]).unwrap();
        let windows: Vec<usize> = (0..4).map(|il| attn(&c, il).window).collect();
        assert_eq!(windows, [8, 0, 8, 0]);
        assert_eq!((attn(&c, 0).rope.base, attn(&c, 1).rope.base), (500.0, 10_000.0));
        assert_eq!((attn(&c, 1).softcap, c.final_softcap), (Some(50.0), Some(30.0)));
        assert!(attn(&c, 0).scale_query && c.layers[0].post_norms && attn(&c, 0).rope.neox);
        let c = configure("gemma2", &[("attention.sliding_window_pattern", MetaValue::Int(4))]).unwrap();
        assert_eq!((0..4).map(|il| attn(&c, il).window > 0).collect::<Vec<_>>(), [true, true, true, false]);
    }

    #[test]
    fn rope_scaling_as_llamacpp_reads_it() {
        let c = configure("qwen2", &[("rope.scaling.type", MetaValue::Str("linear".into())), ("rope.scaling.factor", MetaValue::Float(4.0))]).unwrap();
        assert_eq!((attn(&c, 0).rope.freq_scale, attn(&c, 0).rope.mscale), (0.25, 1.0));
        let c = configure("qwen2", &[("rope.scaling.type", MetaValue::Str("none".into())), ("rope.scaling.factor", MetaValue::Float(4.0))]).unwrap();
        assert_eq!(attn(&c, 0).rope.freq_scale, 1.0);
        let e = configure("qwen2", &[("rope.scaling.type", MetaValue::Str("dynamic".into()))]).unwrap_err().to_string();
        assert!(e.contains("'qwen2.rope.scaling.type' is \"dynamic\""), "{e}");
        // YaRN: ggml's correction dims from the original context (32 here), the magnitude
        // 1 + 0.1 ln(factor) (ggml's, with llama.cpp's attention factor cancelling its own), the beta keys
        // read only where the family's graph reads them (mistral3, not qwen2).
        let yarn = [
            ("rope.scaling.type", MetaValue::Str("yarn".into())),
            ("rope.scaling.factor", MetaValue::Float(4.0)),
            ("rope.scaling.original_context_length", MetaValue::Int(32)),
            ("rope.scaling.yarn_beta_fast", MetaValue::Float(2.0)),
            ("attention.layer_norm_rms_epsilon", MetaValue::Float(1e-5)),
        ];
        let r = attn(&configure("qwen2", &yarn).unwrap(), 0).rope;
        assert_eq!((r.freq_scale, r.yarn), (0.25, Some([0.0, 6.0])));
        assert!((r.mscale - (1.0 + 0.1 * 4f32.ln())).abs() < 1e-6, "{}", r.mscale);
        let r = attn(&configure("mistral3", &yarn).unwrap(), 0).rope;
        assert_eq!((r.yarn, r.neox), (Some([3.0, 6.0]), false));
        // phi3: long factors when the context outgrows the original one.
        let long =
            configure("phi3", &[("rope.scaling.original_context_length", MetaValue::Int(32)), ("rope.scaling.attn_factor", MetaValue::Float(1.5))]).unwrap();
        assert_eq!((long.rope_factors, attn(&long, 0).rope.mscale), (Some("rope_factors_long.weight"), 1.5));
        let short = configure("phi3", &[("rope.scaling.original_context_length", MetaValue::Int(64))]).unwrap();
        assert_eq!(short.rope_factors, Some("rope_factors_short.weight"));
        assert!(matches!(short.layers[0].ffn, Ffn::Dense { fused: true, .. }));
    }

    #[test]
    fn vl_towers_read_multi_axis_rope_for_text() {
        let sec = |v: &[i64]| ("rope.dimension_sections", MetaValue::Array(v.iter().map(|&n| MetaValue::Int(n)).collect()));
        let r = attn(&configure("qwen2vl", &[sec(&[16, 8, 8, 0])]).unwrap(), 0).rope;
        assert!(r.neox);
        assert_eq!(r.mrope, Some(Mrope { sections: [16, 8, 8, 0], interleaved: false }));
        assert_eq!((r.mrope.unwrap().axis(15), r.mrope.unwrap().axis(16), r.mrope.unwrap().axis(31)), (0, 1, 2));
        let c = configure("qwen3vl", &[sec(&[11, 11, 10, 0]), ("n_deepstack_layers", MetaValue::Int(2))]).unwrap();
        // An image row carries the input and two deepstack slices.
        assert_eq!((c.deepstack, c.embd_inp()), (2, 3 * c.dim));
        let r = attn(&c, 0).rope;
        assert_eq!(r.mrope, Some(Mrope { sections: [11, 11, 10, 0], interleaved: true }));
        // Qwen3-VL's own sections over 64 pairs put two on the fourth axis in ggml's layout: a
        // text token sees position 0 there, so they do not turn; the others turn as plain RoPE.
        let m = Mrope { sections: [24, 20, 20, 0], interleaved: true };
        assert_eq!((0..64).filter(|&i| m.axis(i) == 3).collect::<Vec<_>>(), [61, 62]);
        let plain = Rope { dim: 128, base: 5e6, neox: true, freq_scale: 1.0, mscale: 1.0, yarn: None, mrope: None, factors: true };
        let (mut a, mut b) = (Vec::new(), Vec::new());
        crate::backend::rope_cache(&plain, 37, None, &mut a);
        crate::backend::rope_cache(&Rope { mrope: Some(m), ..plain }, 37, None, &mut b);
        for i in 0..64 {
            assert_eq!(b[i], if i == 61 || i == 62 { (0.0, 1.0) } else { a[i] }, "pair {i}");
        }
        // An image row's own position on each axis (Qwen2-VL's consecutive sections): each
        // pair turns by its axis's position, as a plain RoPE of that position would turn it.
        let r = Rope { mrope: Some(Mrope { sections: [16, 24, 24, 0], interleaved: false }), ..plain };
        let mut c = Vec::new();
        crate::backend::rope_cache_axes(&r, [5, 9, 12], None, &mut c);
        for (pos, range) in [(5, 0..16), (9, 16..40), (12, 40..64)] {
            crate::backend::rope_cache(&plain, pos, None, &mut a);
            for i in range {
                assert_eq!(c[i], a[i], "pair {i}");
            }
        }
        let err = |arch: &str, extra: &[(&str, MetaValue)]| configure(arch, extra).unwrap_err().to_string();
        assert!(err("qwen3vl", &[]).contains("'qwen3vl.rope.dimension_sections' is missing"));
        assert!(err("qwen2vl", &[sec(&[16, 8, 8])]).contains("'qwen2vl.rope.dimension_sections' has 3 values; it must have 4"));
        assert!(err("qwen2vl", &[sec(&[0, 0, 0, 8])]).contains("the first three axes have no pairs"));
        assert!(err("qwen2vl", &[sec(&[40, 20, 20, 0])]).contains("80 pairs, more than the head has values (64)"));
        assert!(err("qwen2vl", &[sec(&[8, 8, 8, 0]), ("rope.dimension_count", MetaValue::Int(32))]).contains("'qwen2vl.rope.dimension_count' is 32"));
        let e = err("qwen3vl", &[sec(&[8, 8, 8, 0]), ("n_deepstack_layers", MetaValue::Int(-1))]);
        assert!(e.contains("qwen3vl.n_deepstack_layers"), "{e}");
        let e = err("qwen3vl", &[sec(&[8, 8, 8, 0]), ("n_deepstack_layers", MetaValue::Int(99))]);
        assert!(e.contains("'qwen3vl.n_deepstack_layers' is 99 but the model has"), "{e}");
    }

    #[test]
    fn gemma4_layers_have_their_own_heads_ropes_and_kv_sources() {
        let arr = |v: &[i64]| MetaValue::Array(v.iter().map(|&n| MetaValue::Int(n)).collect());
        let swa = MetaValue::Array([true, true, false, true].iter().map(|&b| MetaValue::Bool(b)).collect());
        let keys = |shared: i64| {
            vec![
                ("attention.sliding_window_pattern", swa.clone()),
                ("attention.sliding_window", MetaValue::Int(8)),
                ("attention.head_count_kv", arr(&[2, 2, 1, 2])),
                ("attention.key_length", MetaValue::Int(128)),
                ("attention.key_length_swa", MetaValue::Int(64)),
                ("rope.dimension_count_swa", MetaValue::Int(64)),
                ("rope.freq_base", MetaValue::Float(1e6)),
                ("attention.layer_norm_rms_epsilon", MetaValue::Float(1e-6)),
                ("embedding_length_per_layer_input", MetaValue::Int(0)),
                ("attention.shared_kv_layers", MetaValue::Int(shared)),
                ("feed_forward_length", arr(&[512, 512, 512, 1024])),
            ]
        };
        let c = configure("gemma4", &keys(0)).unwrap();
        let (a0, a2) = (attn(&c, 0), attn(&c, 2));
        assert_eq!((c.head_dim, c.n_kv_heads), (128, 1), "the model's heads are its full layers'");
        assert_eq!(a0.heads, Some(Heads { n_heads: 4, n_kv_heads: 2, head_dim: 64 }));
        assert_eq!((a2.heads, a0.window, a2.window, a0.scale), (None, 8, 0, 1.0));
        assert_eq!((a0.rope.dim, a0.rope.base, a0.rope.factors, a2.rope.dim, a2.rope.base, a2.rope.factors), (64, 10_000.0, false, 128, 1e6, true));
        assert!(a0.v_norm && a0.v_optional && a0.qk_norm && a0.rope.neox);
        assert!(matches!(c.layers[3].ffn, Ffn::Dense { hidden: 1024, act: Activation::GeluTanh, .. }));
        assert_eq!((c.kv_layers(), c.kv_heads().unwrap().len()), (4, 4));
        // The last 2 layers read the K/V of the last earlier layer of their kind (llama.cpp's
        // reuse: the one before last keeping K/V for a sliding layer, the last for a full one).
        let e = configure("gemma4", &keys(2)).unwrap_err().to_string();
        assert!(e.contains("'gemma4.attention.sliding_window_pattern' makes layer 1 sliding but layer 2"), "{e}");
        let mut alt = keys(2);
        alt[0].1 = MetaValue::Array([true, false, true, false].iter().map(|&b| MetaValue::Bool(b)).collect());
        alt[2].1 = arr(&[2, 1, 2, 1]);
        let c = configure("gemma4", &alt).unwrap();
        assert_eq!((attn(&c, 2).kv_from, attn(&c, 3).kv_from, c.kv_layers()), (Some(0), Some(1), 2));
        assert_eq!((c.kv_slot(2), c.kv_slot(3)), (Some(0), Some(1)));
        c.validate(&meta("gemma4", &alt), 4).unwrap();
        let e = configure("gemma4", &keys(3)).unwrap_err().to_string();
        assert!(e.contains("'gemma4.attention.shared_kv_layers' is 3 but the model has 4 layers"), "{e}");
    }

    #[test]
    fn gpt_oss_reads_its_window_pattern_yarn_and_experts() {
        let keys = [
            ("attention.layer_norm_rms_epsilon", MetaValue::Float(1e-5)),
            ("attention.sliding_window", MetaValue::Int(128)),
            ("attention.key_length", MetaValue::Int(64)),
            ("expert_count", MetaValue::Int(32)),
            ("expert_used_count", MetaValue::Int(4)),
            ("expert_feed_forward_length", MetaValue::Int(128)),
            ("rope.scaling.type", MetaValue::Str("yarn".into())),
            ("rope.scaling.factor", MetaValue::Float(32.0)),
            ("rope.scaling.original_context_length", MetaValue::Int(4096)),
            ("rope.freq_base", MetaValue::Float(150000.0)),
        ];
        let c = configure("gpt-oss", &keys).unwrap();
        assert_eq!((0..4).map(|il| attn(&c, il).window).collect::<Vec<_>>(), [128, 0, 128, 0]);
        let r = attn(&c, 1).rope;
        assert!(r.neox && r.yarn.is_some() && r.freq_scale == 1.0 / 32.0, "{r:?}");
        assert!((r.mscale - (1.0 + 0.1 * 32f32.ln())).abs() < 1e-6);
        assert!(c.attn_sinks && c.extra_biases && c.expert_act == Activation::SwigluOai && c.ffn_norm == "post_attention_norm");
        let Ffn::Moe { n_expert, n_used, hidden, gating, norm_weights, shared, .. } = c.layers[0].ffn else { panic!("routed") };
        assert_eq!((n_expert, n_used, hidden, gating, norm_weights, shared), (32, 4, 128, Gating::SoftmaxWeight, false, None));
        // Other families keep SiLU experts, no sinks, no extra biases.
        let q = configure("qwen3moe", &[("expert_count", MetaValue::Int(8)), ("expert_used_count", MetaValue::Int(2))]).unwrap();
        assert!(!q.attn_sinks && !q.extra_biases && q.expert_act == Activation::Silu);
        let without = |k: &str| keys.iter().filter(|(n, _)| *n != k).cloned().collect::<Vec<_>>();
        for key in ["attention.sliding_window", "expert_feed_forward_length", "attention.layer_norm_rms_epsilon", "expert_count"] {
            let e = configure("gpt-oss", &without(key)).unwrap_err().to_string();
            assert!(e.contains(&format!("'gpt-oss.{key}' is missing")), "{e}");
        }
        let mut swa = keys.to_vec();
        swa.push(("rope.freq_base_swa", MetaValue::Float(10000.0)));
        assert!(configure("gpt-oss", &swa).unwrap_err().to_string().contains("'gpt-oss.rope.freq_base_swa' is 10000"));
        let mut rot = keys.to_vec();
        rot.push(("rope.dimension_count", MetaValue::Int(32)));
        assert!(configure("gpt-oss", &rot).unwrap_err().to_string().contains("'gpt-oss.rope.dimension_count' is 32"));
    }

    #[test]
    fn mistral3_reads_temperature_scaling() {
        let eps = ("attention.layer_norm_rms_epsilon", MetaValue::Float(1e-5));
        let c = configure(
            "mistral3",
            &[eps.clone(), ("attention.temperature_scale", MetaValue::Float(0.1)), ("rope.scaling.original_context_length", MetaValue::Int(16))],
        )
        .unwrap();
        let t = attn(&c, 0).temp.unwrap();
        assert_eq!((t.factor(0), t.factor(15)), (1.0, 1.0));
        assert_eq!(t.factor(16), (2f64.ln() * 0.1f32 as f64 + 1.0) as f32);
        assert_eq!(c.rope_factors, Some("rope_freqs.weight"));
        assert_eq!(attn(&configure("mistral3", std::slice::from_ref(&eps)).unwrap(), 0).temp, None);
        let e = configure("mistral3", &[]).unwrap_err().to_string();
        assert!(e.contains("'mistral3.attention.layer_norm_rms_epsilon' is missing"), "{e}");
        let e = configure("mistral3", &[eps, ("expert_count", MetaValue::Int(8))]).unwrap_err().to_string();
        assert!(e.contains("'mistral3.expert_count' is set"), "{e}");
    }
}
