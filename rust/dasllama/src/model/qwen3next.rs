//! qwen3next (Qwen3-Next-80B-A3B): qwen35's hybrid layers (gated DeltaNet, every fourth layer
//! gated full attention with plain partial NEOX RoPE), value heads grouped per key head (j /
//! (n_v / n_k)), beta and alpha from one projection `ssm_ba`, and an FFN of routed experts
//! (softmax router, top-k weights renormalised) plus a shared expert under a sigmoid gate.

use super::config::{Config, Ffn, Gating, HeadMap};
use super::meta::Metadata;
use crate::Result;

pub fn configure(m: &Metadata) -> Result<Config> {
    with_experts(m, "qwen3next", HeadMap::Grouped, true)
}

/// The hybrid layers under routed experts plus a sigmoid-gated shared expert (qwen3next, and
/// qwen35moe with its own head map and separate beta/alpha).
pub(super) fn with_experts(m: &Metadata, arch: &str, heads: HeadMap, fused_ba: bool) -> Result<Config> {
    let n_expert = m.req_positive("expert_count")?;
    let n_used = m.req_positive("expert_used_count")?;
    let ff = m.req_positive("feed_forward_length")?;
    // llama.cpp's defaults: the routed width splits the dense one, the shared one is the dense one.
    let hidden = m.size("expert_feed_forward_length")?.filter(|&h| h > 0).unwrap_or(ff / n_used);
    let shared = m.size("expert_shared_feed_forward_length")?.filter(|&h| h > 0).unwrap_or(ff);
    super::qwen35::hybrid(m, arch, heads, fused_ba, |_| Ffn::Moe {
        n_expert,
        n_used,
        hidden,
        norm_weights: true,
        shared: Some(shared),
        gating: Gating::Softmax,
        sel_bias: false,
        scale: 1.0,
        shared_gated: true,
    })
}
