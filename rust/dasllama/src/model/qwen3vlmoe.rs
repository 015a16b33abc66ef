//! qwen3vlmoe (Qwen3-VL-30B-A3B, Qwen3-Omni's thinker): the text tower only. qwen3moe's layers
//! with qwen3vl's interleaved multi-axis RoPE and deepstack layers (for text, inert).

use super::config::Config;
use super::meta::Metadata;
use super::qwen2vl::{deepstack, text_mrope};
use crate::Result;

pub fn configure(m: &Metadata) -> Result<Config> {
    deepstack(m, text_mrope(m, super::qwen3moe::configure_as(m, "qwen3vlmoe")?, true)?)
}
