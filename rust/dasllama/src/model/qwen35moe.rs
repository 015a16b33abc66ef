//! qwen35moe (Qwen3.5/3.6 MoE: Qwen3.6-35B-A3B, Qwen3.5-122B-A10B): qwen35's hybrid layers (gated
//! DeltaNet with value heads tiled over key heads, separate `ssm_beta`/`ssm_alpha`, every
//! `full_attention_interval`-th layer gated full attention with interleaved multi-axis RoPE) and
//! qwen3next's FFN: routed experts (softmax router, top-k weights renormalised; llama.cpp reads no
//! weight scale for this family) plus a shared expert under a sigmoid gate (`ffn_gate_inp_shexp`,
//! required). MTP (NextN) blocks after the trunk carry the same MoE FFN (`model::mtp`).

use super::config::{Config, HeadMap};
use super::meta::Metadata;
use crate::Result;

pub fn configure(m: &Metadata) -> Result<Config> {
    super::qwen3next::with_experts(m, "qwen35moe", HeadMap::Tiled, false)
}
