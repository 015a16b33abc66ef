//! glm4moe (GLM-4.5, GLM-4.5-Air, GLM-4.6): attention with Q/K/V biases, partial NEOX RoPE
//! (`rope.dimension_count`) and, where the file has `attn_q_norm`/`attn_k_norm`, QK-norm; the FFN
//! normed by `post_attention_norm`. The first `leading_dense_block_count` layers run a dense
//! SwiGLU, the rest routed experts: sigmoid scores (`expert_gating_func`), the experts chosen by
//! score plus a selection bias (`exp_probs_b`), weighted by their scores (renormalised where
//! `expert_weights_norm`, scaled by `expert_weights_scale`), plus an ungated shared expert of
//! `expert_shared_count` experts' width. The MTP (NextN) blocks after the trunk
//! (`nextn_predict_layers`) are not run by the forward pass (`model::mtp`).

use super::config::{base_config, mrope, Activation, Attention, Config, Ffn, Gating, LayerDesc, Mixer, Rope};
use super::meta::{MetaValue, Metadata};
use crate::{Error, Result};

pub fn configure(m: &Metadata) -> Result<Config> {
    let all = m.req_positive("block_count")?;
    let nextn = m.size("nextn_predict_layers")?.unwrap_or(0);
    if nextn >= all {
        return Err(Error::Gguf(format!("metadata key '{}' is {nextn} but the model has {all} blocks", m.key("nextn_predict_layers"))));
    }
    let n_expert = m.req_positive("expert_count")?;
    let n_used = m.req_positive("expert_used_count")?;
    let ff = m.req_positive("feed_forward_length")?;
    // llama.cpp reads the expert width as a scalar or one per block, and uses one for all.
    let hidden = match m.sizes_per_layer("expert_feed_forward_length", all)? {
        None => ff / n_used,
        Some(v) if v.iter().all(|&h| h == v[0]) => {
            if v[0] > 0 {
                v[0]
            } else {
                ff / n_used
            }
        }
        Some(_) => {
            return Err(Error::UnsupportedModel(format!("metadata key '{}' varies by layer, which is not supported", m.key("expert_feed_forward_length"))))
        }
    };
    // Required, as llama.cpp reads it; 0 means no shared expert.
    let n_shared = m.req_size("expert_shared_count")?;
    let shared = (n_shared > 0).then_some(hidden * n_shared);
    let lead = m.size("leading_dense_block_count")?.unwrap_or(0);
    // 0 (absent) and 1 leave the weights as they are.
    let scale = match m.float("expert_weights_scale")? {
        None | Some(0.0) => 1.0,
        Some(s) => s as f32,
    };
    let norm_weights = m.flag("expert_weights_norm")?.unwrap_or(false);
    // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE: 0 (none, glm4moe's default: sigmoid), 1 softmax, 2 sigmoid.
    let gating = match m.size("expert_gating_func")?.unwrap_or(0) {
        0 | 2 => Gating::Sigmoid,
        1 => Gating::Softmax,
        g => {
            return Err(Error::UnsupportedModel(format!(
                "metadata key '{}' is {g}, which is not supported (supported: 1 softmax, 2 sigmoid)",
                m.key("expert_gating_func")
            )))
        }
    };
    let mut c = base_config(m, "glm4moe", |il, s| LayerDesc {
        mixer: Mixer::Attention(Attention { rope: Rope { neox: true, ..s.rope }, qk_norm_if_present: true, ..Attention::plain(s) }),
        ffn: if il < lead {
            Ffn::Dense { hidden: s.hidden, act: Activation::Silu, fused: false }
        } else {
            Ffn::Moe { n_expert, n_used, hidden, norm_weights, shared, gating, sel_bias: true, scale, shared_gated: false }
        },
        post_norms: false,
    })?;
    c.n_layers = all - nextn;
    c.nextn = c.layers.split_off(c.n_layers);
    c.ffn_norm = "post_attention_norm";
    // Multi-axis RoPE where the file has sections whose first two are set (llama.cpp's
    // `use_mrope`): a text token has the same position on the first three axes.
    if let Some(MetaValue::Array(a)) = m.get("rope.dimension_sections") {
        if a.len() >= 2 && a[..2].iter().all(|x| matches!(x, MetaValue::Int(n) if *n > 0)) {
            let hd = c.head_dim;
            c.map_ropes(|r| mrope(m, r, hd, false))?;
        }
    }
    Ok(c)
}
