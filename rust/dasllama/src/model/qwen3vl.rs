//! qwen3vl (Qwen3-VL dense, Qwen3-ASR's decoder): the text tower only (no vision encoder).
//! qwen3's layers (QK-norm) with Qwen3-VL's interleaved multi-axis RoPE (pairs cycle through the
//! time, height and width axes; see `qwen2vl` for what a text token sees) and deepstack layers
//! (`qwen2vl::deepstack`: an image row's extra slices, added after the first layers; nothing for text).

use super::config::Config;
use super::meta::Metadata;
use super::qwen2vl::{deepstack, text_mrope};
use crate::Result;

pub fn configure(m: &Metadata) -> Result<Config> {
    deepstack(m, text_mrope(m, super::qwen3::configure_as(m, "qwen3vl")?, true)?)
}
