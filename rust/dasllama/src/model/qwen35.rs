//! qwen35 (Qwen3.5 dense): a hybrid of gated DeltaNet layers (recurrent linear attention, no K/V)
//! and, every `full_attention_interval`-th layer (4 by default), gated full attention: QK-norm,
//! partial NEOX RoPE, and a sigmoid gate from the Q projection on the output. Value heads read
//! the key heads tiled (j % n_k). The FFN (dense SwiGLU) is normed by `post_attention_norm`.

use super::config::{base_config, recurrent_layers, Activation, Attention, Config, DeltaNet, Ffn, HeadMap, LayerDesc, Mixer, Rope};
use super::meta::{MetaValue, Metadata};
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
    if let Some(r) = c.ropes().first() {
        check_text_sections(m, r.dim)?;
    }
    Ok(c)
}

/// Qwen3.5's multi-axis RoPE (`rope.dimension_sections`, interleaved) gives a text token the same
/// position on its first three axes and 0 on the fourth, so it is plain NEOX RoPE wherever every
/// rotated pair falls on one of the first three, as in the released models. A file whose sections
/// leave pairs on the fourth axis is refused rather than read another way.
fn check_text_sections(m: &Metadata, n_rot: usize) -> Result<()> {
    let key = "rope.dimension_sections";
    let Some(v) = m.get(key) else { return Ok(()) };
    let bad = || Error::Gguf(format!("metadata key '{}' must be an array of up to 4 non-negative integers", m.key(key)));
    let MetaValue::Array(a) = v else { return Err(bad()) };
    let mut sec = [0usize; 4];
    if a.len() > 4 {
        return Err(bad());
    }
    for (i, x) in a.iter().enumerate() {
        match x {
            MetaValue::Int(n) if *n >= 0 => sec[i] = *n as usize,
            _ => return Err(bad()),
        }
    }
    let total: usize = sec.iter().sum();
    if total == 0 {
        return Err(Error::Gguf(format!("metadata key '{}' is all zeros", m.key(key))));
    }
    // ggml's interleaved M-RoPE: pair i's sector is i % total; sectors cycle t, h, w while each
    // axis has sectors left, and the rest take the fourth axis.
    for i in 0..n_rot / 2 {
        let s = i % total;
        let text = (s.is_multiple_of(3) && s < 3 * sec[0]) || (s % 3 == 1 && s < 3 * sec[1]) || (s % 3 == 2 && s < 3 * sec[2]);
        if !text {
            return Err(Error::UnsupportedModel(format!(
                "metadata key '{}' is {sec:?}: rotary pair {i} of {} would take the fourth (non-text) position axis, which is not supported",
                m.key(key),
                n_rot / 2
            )));
        }
    }
    Ok(())
}
