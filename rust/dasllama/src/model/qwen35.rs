//! qwen35 (Qwen3.5 dense): a hybrid of gated DeltaNet layers (recurrent linear attention, no K/V)
//! and, every `full_attention_interval`-th layer (4 by default), gated full attention: QK-norm,
//! partial NEOX RoPE, and a sigmoid gate from the Q projection on the output. Value heads read
//! the key heads tiled (j % n_k). The FFN (dense SwiGLU) is normed by `post_attention_norm`.

use super::config::{base_config, mrope, recurrent_layers, Activation, Attention, Config, DeltaNet, Ffn, HeadMap, LayerDesc, Mixer, Rope};
use super::meta::Metadata;
use crate::{Error, Result};

pub fn configure(m: &Metadata) -> Result<Config> {
    hybrid(m, "qwen35", HeadMap::Tiled, false, |s| Ffn::Dense { hidden: s.hidden, act: Activation::Silu, fused: false })
}

/// The layers both hybrids share; `ffn` gives each layer's FFN.
pub(crate) fn hybrid(m: &Metadata, arch: &str, k_of_v: HeadMap, fused_ba: bool, ffn: impl Fn(&super::config::Shared) -> Ffn) -> Result<Config> {
    let all = m.req_positive("block_count")?;
    // MTP (NextN) blocks follow the trunk's in the file; the forward pass does not run them.
    let nextn = m.size("nextn_predict_layers")?.unwrap_or(0);
    if nextn >= all {
        return Err(Error::Gguf(format!("metadata key '{}' is {nextn} but the model has {all} blocks", m.key("nextn_predict_layers"))));
    }
    let recr = recurrent_layers(m, all)?;
    let dn = DeltaNet::read(m, k_of_v, fused_ba)?;
    let mut c = base_config(m, arch, |il, s| LayerDesc {
        mixer: if recr[il] && il < all - nextn {
            Mixer::DeltaNet(dn)
        } else {
            Mixer::Attention(Attention { rope: Rope { neox: true, ..s.rope }, qk_norm: true, gated: true, ..Attention::plain(s) })
        },
        ffn: ffn(s),
        post_norms: false,
    })?;
    c.n_layers = all - nextn;
    c.nextn = c.layers.split_off(c.n_layers);
    c.ffn_norm = "post_attention_norm";
    // Qwen3.5's interleaved multi-axis RoPE, where the file has its sections.
    if m.get("rope.dimension_sections").is_some() {
        let head_dim = c.head_dim;
        c.map_ropes(|r| mrope(m, r, head_dim, true))?;
    }
    Ok(c)
}
