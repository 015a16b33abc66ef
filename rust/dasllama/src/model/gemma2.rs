//! gemma2: GELU-tanh GLU, post-norms, scaled embeddings, NEOX RoPE, soft-capped attention scores
//! and logits, and sliding-window layers alternating with global ones (the even layers slide).

use super::config::{base_config, no_yarn, swa_layers, Activation, Attention, Config, Ffn, LayerDesc, Mixer, Rope};
use super::meta::Metadata;
use crate::Result;

pub fn configure(m: &Metadata) -> Result<Config> {
    let n_layers = m.req_positive("block_count")?;
    let swa = swa_layers(m, n_layers, 2)?;
    let window = m.size("attention.sliding_window")?.unwrap_or(4096);
    let attn_cap = m.positive_or("attn_logit_softcapping", 50.0)? as f32;
    let final_cap = m.positive_or("final_logit_softcapping", 30.0)? as f32;
    let base = m.positive_or("rope.freq_base", 10_000.0)? as f32;
    let swa_base = m.positive_or("rope.freq_base_swa", base as f64)? as f32;
    let n_heads = m.req_positive("attention.head_count")?;
    let dim = m.req_positive("embedding_length")?;
    let mut c = base_config(m, "gemma2", |il, s| {
        // llama.cpp scales queries by 1/sqrt(dim / n_heads) for the 27B (46 layers; its
        // query_pre_attn_scalar) and by 1/sqrt(head_dim) otherwise.
        let scale = if n_layers == 46 { 1.0 / ((dim / n_heads) as f32).sqrt() } else { s.scale };
        LayerDesc {
            mixer: Mixer::Attention(Attention {
                heads: None,
                v_norm: false,
                v_optional: false,
                kv_from: None,
                rope: Rope { base: if swa[il] { swa_base } else { base }, neox: true, ..s.rope },
                window: if swa[il] { window } else { 0 },
                qk_norm: false,
                qk_norm_if_present: false,
                scale,
                scale_query: true,
                softcap: Some(attn_cap),
                gated: false,
                temp: None,
            }),
            ffn: Ffn::Dense { hidden: s.hidden, act: Activation::GeluTanh, fused: false },
            post_norms: true,
        }
    })?;
    no_yarn(m, &c)?;
    c.norm_eps = m.positive_or("attention.layer_norm_rms_epsilon", 1e-6)? as f32;
    c.embed_scale = Some((c.dim as f32).sqrt());
    c.final_softcap = Some(final_cap);
    Ok(c)
}
