//! gemma4 (Gemma 4: the dense 12B/31B, the 26B-A4B MoE and the E2B/E4B edge models) as
//! llama.cpp's gemma4 graph computes it. Sliding layers (`attention.sliding_window_pattern`, one
//! boolean per layer) and full layers have their own heads (`attention.key_length_swa` and
//! `key_length`, `head_count_kv` per layer), RoPE (`rope.freq_base_swa` and `dimension_count_swa`;
//! the full layers' `freq_base`, scaling and p-RoPE frequency factors `rope_freqs`) and window.
//! Queries and keys are RMS-normed with weights and values without (V is K's projection where a
//! layer has no `attn_v`), scores are not scaled (the norms set their size), both halves of each
//! block carry post-norms, embeddings are scaled by sqrt(dim), and the logits soft-capped where
//! the file says. GELU-tanh GLUs; where the file has experts, every layer runs a dense GLU beside
//! them (`Ffn::DenseMoe`). The E-series adds per-layer embeddings (`embedding_length_per_layer_input`:
//! each layer mixes a per-token input into its output, `forward::per_layer_inputs`), lets the
//! last `attention.shared_kv_layers` layers read the K/V of the last earlier layer of their kind
//! instead of keeping their own, and gives layers their own FFN widths
//! (`feed_forward_length` per layer). `blk.N.layer_output_scale` scales a layer's output where
//! the file has it.

use super::config::{bare_config, no_yarn, read_rope, swa_layers, Activation, Attention, Config, Ffn, Heads, LayerDesc, Mixer, Rope};
use super::meta::{MetaValue, Metadata};
use crate::{Error, Result};

pub fn configure(m: &Metadata) -> Result<Config> {
    let n = m.req_positive("block_count")?;
    let bad = |key: &str, msg: String| Error::Gguf(format!("metadata key '{}' {msg}", m.key(key)));
    // llama.cpp reads the pattern as an array only (one boolean per layer).
    if !matches!(m.get("attention.sliding_window_pattern"), Some(MetaValue::Array(_))) {
        return Err(bad("attention.sliding_window_pattern", "must be an array of booleans, one per layer".into()));
    }
    let swa = swa_layers(m, n, 0)?;
    let window = m.req_positive("attention.sliding_window")?;
    let per_layer = |key: &str| -> Result<Vec<usize>> {
        let v = m.sizes_per_layer(key, n)?.ok_or_else(|| bad(key, "is missing".into()))?;
        if let Some(il) = v.iter().position(|&x| x == 0) {
            return Err(bad(key, format!("is 0 for layer {il}; it must be at least 1")));
        }
        Ok(v)
    };
    let n_heads = per_layer("attention.head_count")?;
    let n_kv_heads = match m.get("attention.head_count_kv") {
        None => n_heads.clone(),
        Some(_) => per_layer("attention.head_count_kv")?,
    };
    let hd_full = m.req_positive("attention.key_length")?;
    let hd_swa = m.req_positive("attention.key_length_swa")?;
    for (key, k) in [("attention.value_length", hd_full), ("attention.value_length_swa", hd_swa)] {
        if let Some(v) = m.size(key)? {
            if v != k {
                return Err(Error::UnsupportedModel(format!(
                    "metadata key '{}' is {v} but the key heads have {k} values: Gemma 4 needs K and V heads of one size",
                    m.key(key)
                )));
            }
        }
    }
    let hidden = per_layer("feed_forward_length")?;
    let seq_len = m.req_positive("context_length")?;
    let (full_rope, swa_rope) = ropes(m, hd_full, seq_len)?;
    let shared = m.size("attention.shared_kv_layers")?.unwrap_or(0);
    // The first `first_shared` layers keep K/V; each later one reads the last of those of its
    // kind (llama.cpp's reuse: the one before last for a sliding layer, the last for a full one).
    let first_shared = n
        .checked_sub(shared)
        .filter(|&k| shared == 0 || k >= 2)
        .ok_or_else(|| bad("attention.shared_kv_layers", format!("is {shared} but the model has {n} layers; at least 2 must keep their own K/V")))?;
    let source = |il: usize| -> Result<Option<usize>> {
        if il < first_shared {
            return Ok(None);
        }
        let src = first_shared - if swa[il] { 2 } else { 1 };
        if swa[src] != swa[il] {
            return Err(bad(
                "attention.sliding_window_pattern",
                format!("makes layer {src} {} but layer {il}, which reads its K/V (attention.shared_kv_layers), {}", kind(swa[src]), kind(swa[il])),
            ));
        }
        Ok(Some(src))
    };
    let n_expert = m.size("expert_count")?.unwrap_or(0);
    let experts = if n_expert > 0 {
        let n_used = m.req_positive("expert_used_count")?;
        // llama.cpp reads the width as a scalar or one per layer and uses the first for all.
        let widths = per_layer("expert_feed_forward_length")?;
        if widths.iter().any(|&w| w != widths[0]) {
            return Err(Error::UnsupportedModel(format!("metadata key '{}' varies by layer, which is not supported", m.key("expert_feed_forward_length"))));
        }
        Some((n_used, widths[0]))
    } else {
        None
    };
    let heads = |il: usize| Heads { n_heads: n_heads[il], n_kv_heads: n_kv_heads[il], head_dim: if swa[il] { hd_swa } else { hd_full } };
    // The model's heads: its first full layer's (its value_length is theirs).
    let model_heads = heads((0..n).find(|&il| !swa[il]).unwrap_or(0));
    let mut layers = Vec::with_capacity(n);
    for il in 0..n {
        let h = heads(il);
        layers.push(LayerDesc {
            mixer: Mixer::Attention(Attention {
                rope: if swa[il] { swa_rope } else { full_rope },
                heads: (h != model_heads).then_some(h),
                v_norm: true,
                v_optional: true,
                kv_from: source(il)?,
                window: if swa[il] { window } else { 0 },
                qk_norm: true,
                qk_norm_if_present: false,
                // Gemma 4 does not scale scores: the Q and K norms set their size.
                scale: 1.0,
                scale_query: false,
                softcap: None,
                gated: false,
                temp: None,
            }),
            ffn: match experts {
                Some((n_used, expert_hidden)) => Ffn::DenseMoe { hidden: hidden[il], n_expert, n_used, expert_hidden, act: Activation::GeluTanh },
                None => Ffn::Dense { hidden: hidden[il], act: Activation::GeluTanh, fused: false },
            },
            post_norms: true,
        });
    }
    let mut c = bare_config(m, "gemma4", model_heads, layers)?;
    no_yarn(m, &c)?;
    c.norm_eps = m.float("attention.layer_norm_rms_epsilon")?.ok_or_else(|| bad("attention.layer_norm_rms_epsilon", "is missing".into()))? as f32;
    c.embed_scale = Some((c.dim as f32).sqrt());
    // Image rows see each other in the sliding layers only (llama.cpp: LLAMA_NON_CAUSAL_TYPE_SWA_ONLY).
    c.image_spans_sliding_only = true;
    c.final_softcap = m.float("final_logit_softcapping")?.filter(|&f| f != 0.0).map(|f| f as f32);
    c.rope_factors = Some("rope_freqs.weight");
    c.rope_factors_required = swa.contains(&false);
    c.per_layer_input = m.req_size("embedding_length_per_layer_input")?;
    Ok(c)
}

fn kind(swa: bool) -> &'static str {
    if swa {
        "sliding"
    } else {
        "full"
    }
}

/// The full and the sliding layers' RoPE (Gemma 4 and its assistant read the same keys): the
/// full layers' as the file's keys give it; the sliding layers' base and size their own, unscaled
/// (llama.cpp's `_swa` defaults: base 10000, the full layers' size).
pub(super) fn ropes(m: &Metadata, hd_full: usize, seq_len: usize) -> Result<(Rope, Rope)> {
    let n_rot = m.size("rope.dimension_count")?.unwrap_or(hd_full);
    let full = Rope { neox: true, ..read_rope(m, n_rot, seq_len, false)? };
    let swa = Rope {
        dim: m.size("rope.dimension_count_swa")?.unwrap_or(n_rot),
        base: m.positive_or("rope.freq_base_swa", 10_000.0)? as f32,
        freq_scale: 1.0,
        factors: false,
        ..full
    };
    Ok((full, swa))
}
