//! qwen35moe (Qwen3.5/3.6 MoE: Qwen3.6-35B-A3B, Qwen3.5-122B-A10B): qwen35's hybrid layers (gated
//! DeltaNet with value heads tiled over key heads, separate `ssm_beta`/`ssm_alpha`, every
//! `full_attention_interval`-th layer gated full attention with interleaved multi-axis RoPE) and
//! qwen3next's FFN: routed experts (softmax router, top-k weights renormalised; llama.cpp reads no
//! weight scale for this family) plus a shared expert under a sigmoid gate (`ffn_gate_inp_shexp`,
//! required). MTP (NextN) blocks after the trunk carry the same MoE FFN (`model::mtp`).

use super::config::{Config, Ffn, Gating, HeadMap};
use super::meta::Metadata;
use crate::Result;

pub fn configure(m: &Metadata) -> Result<Config> {
    let n_expert = m.req_positive("expert_count")?;
    let n_used = m.req_positive("expert_used_count")?;
    let ff = m.req_positive("feed_forward_length")?;
    // llama.cpp's defaults: the routed width splits the dense one, the shared one is the dense one.
    let hidden = m.size("expert_feed_forward_length")?.filter(|&h| h > 0).unwrap_or(ff / n_used);
    let shared = m.size("expert_shared_feed_forward_length")?.filter(|&h| h > 0).unwrap_or(ff);
    super::qwen35::hybrid(m, "qwen35moe", HeadMap::Tiled, false, |_| Ffn::Moe {
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
