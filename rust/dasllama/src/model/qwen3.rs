//! qwen3 (dense Qwen3): qwen2 without the biases and with QK-norm; heads may be wider than
//! dim / n_heads (`attention.key_length`), so Q is n_heads * head_dim wide.

use super::config::{base_config, Activation, Attention, Config, Ffn, LayerDesc, Mixer, Rope};
use super::meta::Metadata;
use crate::Result;

pub fn configure(m: &Metadata) -> Result<Config> {
    base_config(m, "qwen3", |_, s| LayerDesc {
        mixer: Mixer::Attention(Attention { rope: Rope { neox: true, ..s.rope }, qk_norm: true, ..Attention::plain(s) }),
        ffn: Ffn::Dense { hidden: s.hidden, act: Activation::Silu, fused: false },
        post_norms: false,
    })
}
