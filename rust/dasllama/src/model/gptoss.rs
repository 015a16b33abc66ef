//! gpt-oss (gpt-oss-20b, gpt-oss-120b) as llama.cpp's openai-moe graph reads it: attention with
//! biases on Q, K, V and the output, per-head sink logits in the softmax (`attn_sinks`), NEOX
//! RoPE (YaRN in the real files: factor 32 over an original context of 4096), sliding-window
//! layers (`attention.sliding_window`, required) alternating with global ones (the even layers
//! slide, or as `attention.sliding_window_pattern` says); the FFN normed by
//! `post_attention_norm` and all routed: the router's biased logits choose the top
//! `expert_used_count` experts, weighted by a softmax over the chosen ones, each a clamped
//! `swiglu_oai` with biases on its gate, up and down projections.

use super::config::{base_config, swa_layers, Activation, Attention, Config, Ffn, Gating, LayerDesc, Mixer, Rope};
use super::meta::Metadata;
use crate::{Error, Result};

pub fn configure(m: &Metadata) -> Result<Config> {
    let n_layers = m.req_positive("block_count")?;
    // Required, as llama.cpp reads them for this family.
    if m.float("attention.layer_norm_rms_epsilon")?.is_none() {
        return Err(Error::Gguf(format!("metadata key '{}' is missing", m.key("attention.layer_norm_rms_epsilon"))));
    }
    let window = m.req_positive("attention.sliding_window")?;
    let swa = swa_layers(m, n_layers, 2)?;
    let n_expert = m.req_positive("expert_count")?;
    let n_used = m.req_positive("expert_used_count")?;
    let hidden = match m.sizes_per_layer("expert_feed_forward_length", n_layers)? {
        None => return Err(Error::Gguf(format!("metadata key '{}' is missing", m.key("expert_feed_forward_length")))),
        Some(v) if v.iter().all(|&h| h == v[0]) && v[0] > 0 => v[0],
        Some(v) if v.contains(&0) => return Err(Error::Gguf(format!("metadata key '{}' is 0; it must be at least 1", m.key("expert_feed_forward_length")))),
        Some(_) => {
            return Err(Error::UnsupportedModel(format!("metadata key '{}' varies by layer, which is not supported", m.key("expert_feed_forward_length"))))
        }
    };
    // llama.cpp turns the sliding layers with `rope.freq_base_swa` where the file has one; YaRN's
    // correction range is worked out per base, and no gpt-oss file has another: refuse one.
    if let (Some(swa_base), base) = (m.float("rope.freq_base_swa")?, m.positive_or("rope.freq_base", 10_000.0)?) {
        if swa_base != base {
            return Err(Error::UnsupportedModel(format!(
                "metadata key '{}' is {swa_base} but rope.freq_base is {base}: another RoPE base on the sliding layers is not supported for gpt-oss",
                m.key("rope.freq_base_swa")
            )));
        }
    }
    let mut c = base_config(m, "gpt-oss", |il, s| LayerDesc {
        mixer: Mixer::Attention(Attention { rope: Rope { neox: true, ..s.rope }, window: if swa[il] { window } else { 0 }, ..Attention::plain(s) }),
        ffn: Ffn::Moe {
            n_expert,
            n_used,
            hidden,
            norm_weights: false,
            shared: None,
            gating: Gating::SoftmaxWeight,
            sel_bias: false,
            scale: 1.0,
            shared_gated: false,
        },
        post_norms: false,
    })?;
    // llama.cpp sizes the heads by the rotated width (n_rot): the whole head turns.
    let hd = c.head_dim;
    if let Some(r) = c.ropes().into_iter().find(|r| r.dim != hd) {
        return Err(Error::Gguf(format!("metadata key '{}' is {}; gpt-oss turns the whole head ({hd})", m.key("rope.dimension_count"), r.dim)));
    }
    c.ffn_norm = "post_attention_norm";
    c.attn_sinks = true;
    c.extra_biases = true;
    c.expert_act = Activation::SwigluOai;
    Ok(c)
}
