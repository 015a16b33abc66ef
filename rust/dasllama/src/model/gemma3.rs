//! gemma3: GELU-tanh GLU, QK-norm, post-norms, scaled embeddings, NEOX RoPE, and five
//! sliding-window layers (RoPE base 10k) for every global one (the file's base, 1M by default).

use super::config::{base_config, no_yarn, Activation, Attention, Config, Ffn, LayerDesc, Mixer, Rope};
use super::meta::Metadata;
use crate::Result;

/// Every sixth layer is global; the others slide.
const SWA_PATTERN: usize = 6;

pub fn configure(m: &Metadata) -> Result<Config> {
    let global_base = m.positive_or("rope.freq_base", 1_000_000.0)? as f32;
    let mut c = base_config(m, "gemma3", |il, s| {
        let swa = s.window > 0 && il % SWA_PATTERN < SWA_PATTERN - 1;
        LayerDesc {
            mixer: Mixer::Attention(Attention {
                // Sliding layers keep their own base and no scaling (llama.cpp's `_swa` defaults).
                rope: if swa { Rope { base: 10_000.0, neox: true, freq_scale: 1.0, ..s.rope } } else { Rope { base: global_base, neox: true, ..s.rope } },
                heads: None,
                v_norm: false,
                v_optional: false,
                kv_from: None,
                window: if swa { s.window } else { 0 },
                qk_norm: true,
                qk_norm_if_present: false,
                scale: s.scale,
                scale_query: true,
                softcap: None,
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
    c.final_softcap = m.float("final_logit_softcapping")?.filter(|&f| f != 0.0).map(|f| f as f32);
    Ok(c)
}
