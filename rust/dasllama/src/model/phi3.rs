//! phi3 (Phi-3, Phi-3.5, Phi-4-mini): fused QKV (`attn_qkv`) and fused gate/up (`ffn_up` of
//! 2 * hidden rows, the gate first), NEOX RoPE (partial where `rope.dimension_count` says so),
//! queries scaled before attention, and longrope's per-frequency factors where the file has them.

use super::config::{base_config, Activation, Attention, Config, Ffn, LayerDesc, Mixer, Rope};
use super::meta::Metadata;
use crate::Result;

pub fn configure(m: &Metadata) -> Result<Config> {
    // llama.cpp disables Phi's sliding window (the converters do not record which layers slide),
    // so every layer attends globally here too: a file that declares a window is read as llama.cpp
    // reads it.
    let mut c = base_config(m, "phi3", |_, s| LayerDesc {
        mixer: Mixer::Attention(Attention { rope: Rope { neox: true, ..s.rope }, scale_query: true, ..Attention::plain(s) }),
        ffn: Ffn::Dense { hidden: s.hidden, act: Activation::Silu, fused: true },
        post_norms: false,
    })?;
    // A session spans the whole trained context, so the long factors apply whenever that context
    // is longer than the one the short factors were trained for (llama.cpp's choice for n_ctx).
    let orig = m.size("rope.scaling.original_context_length")?.unwrap_or(c.seq_len);
    c.rope_factors = Some(if c.seq_len > orig { "rope_factors_long.weight" } else { "rope_factors_short.weight" });
    Ok(c)
}
