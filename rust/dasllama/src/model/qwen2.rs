//! qwen2 (Qwen2, Qwen2.5): llama's layers with NEOX RoPE and biases on Q, K and V (the loader
//! takes biases wherever a file has them, as llama.cpp does).

use super::config::{base_config, Activation, Attention, Config, Ffn, LayerDesc, Mixer, Rope};
use super::meta::Metadata;
use crate::Result;

pub fn configure(m: &Metadata) -> Result<Config> {
    configure_as(m, "qwen2")
}

/// qwen2's layers under another architecture name (qwen2vl's text tower).
pub(crate) fn configure_as(m: &Metadata, arch: &str) -> Result<Config> {
    base_config(m, arch, |_, s| LayerDesc {
        mixer: Mixer::Attention(Attention { rope: Rope { neox: true, ..s.rope }, ..Attention::plain(s) }),
        ffn: Ffn::Dense { hidden: s.hidden, act: Activation::Silu, fused: false },
        post_norms: false,
    })
}
