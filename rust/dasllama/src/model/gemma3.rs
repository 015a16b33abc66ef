//! gemma3: GELU-tanh GLU, QK-norm, post-norms, scaled embeddings, NEOX RoPE, and five
//! sliding-window layers (RoPE base 10k) for every global one (the file's base, 1M).

use super::{base_config, opt, Activation, Config, Metadata};
use crate::Result;

pub fn configure(m: &Metadata) -> Result<Config> {
    let base = base_config(m, "gemma3")?;
    Ok(Config {
        rope_base: opt(m, "rope.freq_base", 1_000_000.0) as f32,
        rope_base_swa: 10_000.0,
        rope_neox: true,
        norm_eps: opt(m, "attention.layer_norm_rms_epsilon", 1e-6) as f32,
        activation: Activation::GeluTanh,
        embed_scale: Some((base.dim as f32).sqrt()),
        qk_norm: true,
        post_norms: true,
        sliding_window: opt(m, "attention.sliding_window", 0.0) as usize,
        swa_pattern: 6,
        scale_query: true,
        ..base
    })
}
