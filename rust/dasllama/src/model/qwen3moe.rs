//! qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): qwen3's attention (QK-norm, NEOX RoPE) and an FFN
//! of routed experts only: softmax router, the top-k weights renormalised to sum to 1.

use super::config::{base_config, Attention, Config, Ffn, Gating, LayerDesc, Mixer, Rope};
use super::meta::Metadata;
use crate::Result;

pub fn configure(m: &Metadata) -> Result<Config> {
    configure_as(m, "qwen3moe")
}

/// qwen3moe's layers under another architecture name (qwen3vlmoe's text tower).
pub(crate) fn configure_as(m: &Metadata, arch: &str) -> Result<Config> {
    let n_expert = m.req_positive("expert_count")?;
    let n_used = m.req_positive("expert_used_count")?;
    let hidden = match m.size("expert_feed_forward_length")?.filter(|&h| h > 0) {
        Some(h) => h,
        None => m.req_positive("feed_forward_length")? / n_used,
    };
    base_config(m, arch, |_, s| LayerDesc {
        mixer: Mixer::Attention(Attention { rope: Rope { neox: true, ..s.rope }, qk_norm: true, ..Attention::plain(s) }),
        ffn: Ffn::Moe { n_expert, n_used, hidden, norm_weights: true, shared: None, gating: Gating::Softmax, sel_bias: false, scale: 1.0, shared_gated: true },
        post_norms: false,
    })
}
