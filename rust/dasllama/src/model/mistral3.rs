//! mistral3 (Ministral 3, Mistral Medium 3.5): the text tower of llama's layers (NORM RoPE over
//! the whole head), read as llama.cpp's mistral3 graph reads it: YaRN with the file's
//! `rope.scaling.yarn_*` keys, Llama 4's attention temperature (`attention.temperature_scale`:
//! queries past each original context's length scaled up), llama3-style frequency factors
//! (`rope_freqs`) where the file has them. The vision encoder is not loaded; nor are routed
//! experts (a mistral3 file with `expert_count` is refused).

use super::config::{read_rope, AttnTemp, Config, Mixer};
use super::meta::{MetaValue, Metadata};
use crate::{Error, Result};

pub fn configure(m: &Metadata) -> Result<Config> {
    if m.size("expert_count")?.unwrap_or(0) > 0 {
        return Err(Error::UnsupportedModel(format!("metadata key '{}' is set: mistral3 with routed experts is not supported", m.key("expert_count"))));
    }
    if m.float("attention.layer_norm_rms_epsilon")?.is_none() {
        return Err(Error::Gguf(format!("metadata key '{}' is missing", m.key("attention.layer_norm_rms_epsilon"))));
    }
    if matches!(m.get("rope.scaling.type"), Some(MetaValue::Str(s)) if s == "longrope") {
        return Err(Error::UnsupportedModel(format!("metadata key '{}' is \"longrope\", which is not supported for mistral3", m.key("rope.scaling.type"))));
    }
    let mut c = super::llama::configure_as(m, "mistral3")?;
    let (hd, ctx) = (c.head_dim, c.seq_len);
    c.map_ropes(|r| {
        if r.dim != hd {
            return Err(Error::Gguf(format!("metadata key '{}' is {}; mistral3 turns the whole head ({hd})", m.key("rope.dimension_count"), r.dim)));
        }
        read_rope(m, r.dim, ctx, true)
    })?;
    c.rope_factors = Some("rope_freqs.weight");
    let scale = m.float("attention.temperature_scale")?.unwrap_or(0.0) as f32;
    if scale != 0.0 {
        // llama.cpp's floor is the original context YaRN reads.
        let floor = m.size("rope.scaling.original_context_length")?.unwrap_or(ctx);
        if floor == 0 {
            return Err(Error::Gguf(format!(
                "metadata key '{}' is 0; attention temperature scaling needs the original context",
                m.key("rope.scaling.original_context_length")
            )));
        }
        if !scale.is_finite() {
            return Err(Error::Gguf(format!("metadata key '{}' is {scale}; it must be a finite number", m.key("attention.temperature_scale"))));
        }
        for l in &mut c.layers {
            if let Mixer::Attention(a) = &mut l.mixer {
                a.temp = Some(AttnTemp { scale, floor });
            }
        }
    }
    Ok(c)
}
