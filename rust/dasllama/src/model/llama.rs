//! llama family (Llama 2/3, Mistral, SmolLM2): pre-norm, SwiGLU, interleaved RoPE, every layer
//! global attention and a dense FFN.

use super::config::{base_config, Activation, Attention, Config, Ffn, LayerDesc, Mixer};
use super::meta::Metadata;
use crate::Result;

pub fn configure(m: &Metadata) -> Result<Config> {
    configure_as(m, "llama")
}

/// llama's layers under another architecture name (mistral3).
pub(crate) fn configure_as(m: &Metadata, arch: &str) -> Result<Config> {
    base_config(m, arch, |_, s| LayerDesc {
        mixer: Mixer::Attention(Attention::plain(s)),
        ffn: Ffn::Dense { hidden: s.hidden, act: Activation::Silu, fused: false },
        post_norms: false,
    })
}
