//! llama family (Llama 2/3, Mistral, SmolLM2): pre-norm, SwiGLU, interleaved RoPE.

use super::{opt, req, Activation, Config, Metadata};
use crate::Result;

pub fn configure(m: &Metadata) -> Result<Config> {
    let dim = req(m, "embedding_length")? as usize;
    let n_heads = req(m, "attention.head_count")? as usize;
    let head_dim = opt(m, "attention.key_length", (dim / n_heads.max(1)) as f64) as usize;
    Ok(Config {
        arch: "llama".into(),
        dim,
        hidden_dim: req(m, "feed_forward_length")? as usize,
        n_layers: req(m, "block_count")? as usize,
        n_heads,
        n_kv_heads: opt(m, "attention.head_count_kv", n_heads as f64) as usize,
        head_dim,
        vocab_size: 0,
        seq_len: req(m, "context_length")? as usize,
        rope_dim: opt(m, "rope.dimension_count", head_dim as f64) as usize,
        rope_base: opt(m, "rope.freq_base", 10000.0) as f32,
        rope_base_swa: opt(m, "rope.freq_base", 10000.0) as f32,
        rope_neox: false,
        norm_eps: opt(m, "attention.layer_norm_rms_epsilon", 1e-5) as f32,
        activation: Activation::Silu,
        embed_scale: None,
        qk_norm: false,
        post_norms: false,
        sliding_window: 0,
        swa_pattern: 0,
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
    })
}
