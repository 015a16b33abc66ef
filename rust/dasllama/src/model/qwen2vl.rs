//! qwen2vl (Qwen2-VL, Qwen2.5-VL, Qwen2.5-Omni's thinker): the text tower only (the vision and
//! audio encoders live in a separate mmproj file, which is not loaded). qwen2's layers with
//! multi-axis RoPE (`rope.dimension_sections`: consecutive runs of pairs reading the time,
//! height, width and a fourth position). llama.cpp gives a text token the same position on the
//! first three axes and 0 on the fourth, so this is qwen2's NEOX RoPE of the position, the pairs
//! of a fourth section (none in the released models) not turning.

use super::config::{mrope, Config};
use super::meta::Metadata;
use crate::{Error, Result};

pub fn configure(m: &Metadata) -> Result<Config> {
    text_mrope(m, super::qwen2::configure_as(m, "qwen2vl")?, false)
}

/// A VL text tower's RoPE: multi-axis (`interleaved` as Qwen3-VL's) over the whole head, which
/// llama.cpp's graphs for these families assert.
pub(crate) fn text_mrope(m: &Metadata, mut c: Config, interleaved: bool) -> Result<Config> {
    let hd = c.head_dim;
    c.map_ropes(|r| {
        if r.dim != hd {
            return Err(Error::Gguf(format!("metadata key '{}' is {}; this architecture turns the whole head ({hd})", m.key("rope.dimension_count"), r.dim)));
        }
        mrope(m, r, hd, interleaved)
    })?;
    Ok(c)
}

/// Qwen3-VL's "deepstack": llama.cpp adds visual features, carried in extra columns of an image
/// row's input, to the outputs of the first `n_deepstack_layers` layers (`Config::deepstack`).
/// A text token's embedding is zero-padded to that width, so for text they add nothing.
pub(crate) fn deepstack(m: &Metadata, mut c: Config) -> Result<Config> {
    c.deepstack = m.size("n_deepstack_layers")?.unwrap_or(0);
    if c.deepstack > c.n_layers {
        return Err(Error::Gguf(format!("metadata key '{}' is {} but the model has {} layers", m.key("n_deepstack_layers"), c.deepstack, c.n_layers)));
    }
    Ok(c)
}
