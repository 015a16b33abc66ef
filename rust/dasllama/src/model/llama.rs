//! llama family (Llama 2/3, Mistral, SmolLM2): pre-norm, SwiGLU, interleaved RoPE. The shared
//! skeleton's defaults are llama's, so there is nothing to override.

use super::{base_config, Config, Metadata};
use crate::Result;

pub fn configure(m: &Metadata) -> Result<Config> {
    base_config(m, "llama")
}
