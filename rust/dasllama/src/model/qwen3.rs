//! qwen3 (dense Qwen3): qwen2 without the biases and with QK-norm; heads may be wider than
//! dim / n_heads (`attention.key_length`), so Q is n_heads * head_dim wide.

use super::config::{base_config, Activation, Attention, Config, Ffn, LayerDesc, Mixer, Rope};
use super::meta::Metadata;
use crate::Result;

pub fn configure(m: &Metadata) -> Result<Config> {
    configure_as(m, "qwen3")
}

/// qwen3's layers under another architecture name (qwen3vl's text tower).
pub(crate) fn configure_as(m: &Metadata, arch: &str) -> Result<Config> {
    base_config(m, arch, |_, s| LayerDesc {
        mixer: Mixer::Attention(Attention { rope: Rope { neox: true, ..s.rope }, qk_norm: true, ..Attention::plain(s) }),
        ffn: Ffn::Dense { hidden: s.hidden, act: Activation::Silu, fused: false },
        post_norms: false,
    })
}
