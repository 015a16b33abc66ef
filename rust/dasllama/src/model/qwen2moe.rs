//! qwen2moe (Qwen1.5-MoE, Qwen2-57B-A14B): qwen2's attention (Q/K/V biases, NEOX RoPE), and an
//! FFN of routed experts (softmax router, top-k weights as they come) plus a shared expert under
//! a sigmoid gate.

use super::config::{base_config, Attention, Config, Ffn, Gating, LayerDesc, Mixer, Rope};
use super::meta::Metadata;
use crate::Result;

pub fn configure(m: &Metadata) -> Result<Config> {
    let n_expert = m.req_positive("expert_count")?;
    let n_used = m.req_positive("expert_used_count")?;
    let ff = m.req_positive("feed_forward_length")?;
    // llama.cpp's defaults: the routed width splits the dense one, the shared one is the dense one.
    let hidden = m.size("expert_feed_forward_length")?.filter(|&h| h > 0).unwrap_or(ff / n_used);
    let shared = m.size("expert_shared_feed_forward_length")?.filter(|&h| h > 0).unwrap_or(ff);
    base_config(m, "qwen2moe", |_, s| LayerDesc {
        mixer: Mixer::Attention(Attention { rope: Rope { neox: true, ..s.rope }, ..Attention::plain(s) }),
        ffn: Ffn::Moe {
            n_expert,
            n_used,
            hidden,
            norm_weights: false,
            shared: Some(shared),
            gating: Gating::Softmax,
            sel_bias: false,
            scale: 1.0,
            shared_gated: true,
        },
        post_norms: false,
    })
}
