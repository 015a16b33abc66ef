//! gemma3: GELU-tanh GLU, QK-norm, post-norms, scaled embeddings, NEOX RoPE, and five
//! sliding-window layers (RoPE base 10k) for every global one (the file's base, 1M).

use super::{opt, req, Activation, Config, Metadata};
use crate::Result;

pub fn configure(m: &Metadata) -> Result<Config> {
    let dim = req(m, "embedding_length")? as usize;
    let n_heads = req(m, "attention.head_count")? as usize;
    let head_dim = opt(m, "attention.key_length", (dim / n_heads.max(1)) as f64) as usize;
    Ok(Config {
        arch: "gemma3".into(),
        dim,
        hidden_dim: req(m, "feed_forward_length")? as usize,
        n_layers: req(m, "block_count")? as usize,
        n_heads,
        n_kv_heads: opt(m, "attention.head_count_kv", n_heads as f64) as usize,
        head_dim,
        vocab_size: 0,
        seq_len: req(m, "context_length")? as usize,
        rope_dim: opt(m, "rope.dimension_count", head_dim as f64) as usize,
        rope_base: opt(m, "rope.freq_base", 1_000_000.0) as f32,
        rope_base_swa: 10_000.0,
        rope_neox: true,
        norm_eps: opt(m, "attention.layer_norm_rms_epsilon", 1e-6) as f32,
        activation: Activation::GeluTanh,
        embed_scale: Some((dim as f32).sqrt()),
        qk_norm: true,
        post_norms: true,
        sliding_window: opt(m, "attention.sliding_window", 0.0) as usize,
        swa_pattern: 6,
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
    })
}
