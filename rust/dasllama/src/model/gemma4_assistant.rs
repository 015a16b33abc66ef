//! Gemma 4's assistant drafter (`general.architecture = gemma4-assistant`), as llama.cpp's
//! src/models/gemma4-assistant.cpp computes it. A small model of its own width that drafts for a
//! gemma4 target: a row pairs the target's embedding of the token (times the square root of the
//! target's width) with a hidden state of the target's width (the target's after its final norm
//! for a step's first draft, the assistant's own `nextn.post_projection` output after that),
//! projects the pair to its width (`nextn.pre_projection`), and runs layers that keep no K/V:
//! their queries attend to the target's own K/V, the sliding layers' to the target's
//! second-to-last layer and the global layers' to its last (llama.cpp's `share`). Every draft of a
//! step sits at the position after the target's K/V (llama.cpp's speculative driver keeps the
//! position for a shared-memory drafter). Its logits come from its own `token_embd`.

use super::forward::rope_tables_with;
use super::{Config, Metadata, Mixer, Model, QuantMode, TensorInfo, TensorTable};
use crate::backend::{Activation, AttnShape, Rope, RopeTable};
use crate::kv::KvCache;
use crate::quant::Weight;
use crate::{Error, Result};
use std::path::Path;
use std::sync::Arc;

struct Layer {
    swa: bool,
    n_heads: usize,
    head_dim: usize,
    ff: usize,
    attn_norm: Vec<f32>,
    wq: Weight,
    q_norm: Vec<f32>,
    wo: Weight,
    post_attn_norm: Vec<f32>,
    out_scale: f32,
    ffn_norm: Vec<f32>,
    gate: Weight,
    up: Weight,
    down: Weight,
    post_ffn_norm: Vec<f32>,
}

pub struct Assistant {
    width: usize,
    layers: Vec<Layer>,
    /// vocab x width: the output matrix (llama.cpp ties it to the assistant's `token_embd`).
    output: Weight,
    output_norm: Vec<f32>,
    /// width x 2 * target width, and target width x width.
    pre: Weight,
    post: Weight,
    rope_swa: Rope,
    rope_full: Rope,
    /// The global layers' p-RoPE frequency divisors (`rope_freqs`).
    factors: Option<Vec<f32>>,
    /// The sliding layers' window, and the target's K/V slots the two kinds of layers read.
    window: usize,
    slot_swa: usize,
    slot_full: usize,
    /// K/V heads of those slots.
    kv_heads_swa: usize,
    kv_heads_full: usize,
    eps: f32,
    /// The file it came from.
    pub source: String,
}

impl Assistant {
    /// The assistant in `path` (its metadata and tensor table as the Python loader read them) for
    /// `target`: Ok(Err(why)) when it does not fit the target.
    pub fn sidecar(target: &Model, path: &Path, meta: &Metadata, tensors: &[TensorInfo]) -> Result<std::result::Result<Arc<Assistant>, String>> {
        match Self::load(target, path, meta, tensors) {
            Ok(a) => Ok(Ok(Arc::new(a))),
            Err(Error::Gguf(why) | Error::UnsupportedModel(why)) => Ok(Err(why)),
            Err(e) => Err(e),
        }
    }

    fn load(target: &Model, path: &Path, meta: &Metadata, tensors: &[TensorInfo]) -> Result<Assistant> {
        let tc: &Config = &target.config;
        if tc.arch != "gemma4" {
            return Err(Error::UnsupportedModel(format!("a gemma4-assistant drafts for gemma4 models, and the model is {}", tc.arch)));
        }
        let n = match meta.size("nextn_predict_layers")? {
            Some(n) if n > 0 => n,
            _ => meta.req_positive("block_count")?,
        };
        let width = meta.req_positive("embedding_length")?;
        let tw = meta.req_positive("embedding_length_out")?;
        if tw != tc.dim {
            return Err(Error::Gguf(format!("metadata key '{}' is {tw}, and the model's width is {}", meta.key("embedding_length_out"), tc.dim)));
        }
        let swa = super::config::swa_layers(meta, n, 0)?;
        let heads = meta
            .sizes_per_layer("attention.head_count", n)?
            .ok_or_else(|| Error::Gguf(format!("metadata key '{}' is missing", meta.key("attention.head_count"))))?;
        let ffs = meta
            .sizes_per_layer("feed_forward_length", n)?
            .ok_or_else(|| Error::Gguf(format!("metadata key '{}' is missing", meta.key("feed_forward_length"))))?;
        let hd_full = meta.req_positive("attention.key_length")?;
        let hd_swa = meta.size("attention.key_length_swa")?.unwrap_or(hd_full);
        let window = meta.req_positive("attention.sliding_window")?;
        if window < 2 {
            return Err(Error::UnsupportedModel(format!(
                "metadata key '{}' is {window}: a draft row would see none of the target's K/V",
                meta.key("attention.sliding_window")
            )));
        }
        let seq_len = meta.size("context_length")?.unwrap_or(tc.seq_len);
        let (rope_full, rope_swa) = super::gemma4::ropes(meta, hd_full, seq_len)?;
        // The target's layers the assistant reads: its last two, a sliding then a full one.
        let nl = tc.n_layers;
        let target_layer = |il: usize| -> std::result::Result<(bool, usize, usize, usize), String> {
            let Mixer::Attention(a) = &tc.layers[il].mixer else { return Err(format!("the model's layer {il} has no attention")) };
            let h = a.heads(tc);
            let slot = tc.kv_slot(il).ok_or_else(|| format!("the model's layer {il} keeps no K/V"))?;
            Ok((a.window > 0, slot, h.n_kv_heads, h.head_dim))
        };
        let last = (nl >= 2).then(|| (target_layer(nl - 2), target_layer(nl - 1)));
        let ((swa_t, slot_swa, kv_heads_swa, thd_swa), (full_t, slot_full, kv_heads_full, thd_full)) = match last {
            Some((Ok(a), Ok(b))) => (a, b),
            Some((Err(e), _) | (_, Err(e))) => return Err(Error::UnsupportedModel(e)),
            None => return Err(Error::UnsupportedModel("the model has fewer than 2 layers".into())),
        };
        if !swa_t || full_t {
            return Err(Error::UnsupportedModel("the model's last two layers are not a sliding then a full one, which the assistant reads".into()));
        }
        for (what, mine, theirs) in [("attention.key_length", hd_full, thd_full), ("attention.key_length_swa", hd_swa, thd_swa)] {
            if mine != theirs {
                return Err(Error::Gguf(format!("metadata key '{}' is {mine}, and the model's keys there have {theirs} values", meta.key(what))));
            }
        }
        let file = path.display().to_string();
        let f = std::fs::File::open(path).map_err(|e| Error::Gguf(format!("{file}: cannot open: {e}")))?;
        // SAFETY: as for model files (`Model::load`): mapped read-only and never written through.
        let map = Arc::new(unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::Gguf(format!("{file}: cannot map: {e}")))?);
        let t = TensorTable::new(&file, map, tensors, QuantMode::Native, target.numerics, target.rt.host())?;
        let mut layers = Vec::with_capacity(n);
        for il in 0..n {
            let (hd, h, ff) = (if swa[il] { hd_swa } else { hd_full }, heads[il], ffs[il]);
            let kvh = if swa[il] { kv_heads_swa } else { kv_heads_full };
            if h % kvh != 0 {
                return Err(Error::Gguf(format!(
                    "metadata key '{}' gives layer {il} {h} heads, not a multiple of the model's {kvh} K/V heads there",
                    meta.key("attention.head_count")
                )));
            }
            let p = |s: &str| format!("blk.{il}.{s}.weight");
            let scale = t.vector(&p("layer_output_scale"), 1)?[0];
            layers.push(Layer {
                swa: swa[il],
                n_heads: h,
                head_dim: hd,
                ff,
                attn_norm: t.vector(&p("attn_norm"), width)?,
                wq: t.matrix(&p("attn_q"), h * hd, width)?,
                q_norm: t.vector(&p("attn_q_norm"), hd)?,
                wo: t.matrix(&p("attn_output"), width, h * hd)?,
                post_attn_norm: t.vector(&p("post_attention_norm"), width)?,
                out_scale: scale,
                ffn_norm: t.vector(&p("ffn_norm"), width)?,
                gate: t.matrix(&p("ffn_gate"), ff, width)?,
                up: t.matrix(&p("ffn_up"), ff, width)?,
                down: t.matrix(&p("ffn_down"), width, ff)?,
                post_ffn_norm: t.vector(&p("post_ffw_norm"), width)?,
            });
        }
        let factors = if swa.iter().take(n).all(|&s| s) { None } else { Some(t.vector("rope_freqs.weight", rope_full.dim / 2)?) };
        if let Some(bad) = factors.as_ref().and_then(|f| f.iter().find(|v| !(v.is_finite() && **v > 0.0))) {
            return Err(Error::Gguf(format!("{file}: tensor 'rope_freqs.weight' holds {bad}; RoPE frequency factors must be positive")));
        }
        Ok(Assistant {
            width,
            layers,
            output: t.matrix("token_embd.weight", tc.vocab_size, width)?,
            output_norm: t.vector("output_norm.weight", width)?,
            pre: t.matrix("nextn.pre_projection.weight", width, 2 * tw)?,
            post: t.matrix("nextn.post_projection.weight", tw, width)?,
            rope_swa,
            rope_full: Rope { factors: true, ..rope_full },
            factors,
            window,
            slot_swa,
            slot_full,
            kv_heads_swa,
            kv_heads_full,
            eps: meta.positive_or("attention.layer_norm_rms_epsilon", 1e-6)? as f32,
            source: file,
        })
    }
}

/// Reused buffers of the assistant's passes.
#[derive(Default)]
pub struct AssistantScratch {
    x: Vec<f32>,
    cat: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<u8>,
}

/// One draft row per stream: stream i's row pairs `tokens[i]` with `hidden` row i (target width)
/// at position `kvs[i].len()`, its queries over the target's K/V in `kvs[i]` (not written). Gives
/// each row's logits and the assistant's next hidden state (target width), in order.
#[allow(clippy::too_many_arguments)]
pub fn step(
    m: &Model,
    a: &Assistant,
    kvs: &mut [&mut KvCache],
    tokens: &[u32],
    hidden: &[f32],
    ws: &mut AssistantScratch,
    logits: &mut Vec<f32>,
    hidden_out: &mut Vec<f32>,
) -> Result<()> {
    let c = &m.config;
    let (tw, w, n) = (c.dim, a.width, tokens.len());
    if kvs.len() != n || hidden.len() != n * tw {
        return Err(Error::InvalidArgument(format!(
            "an assistant step needs one session and one hidden state of {tw} values per token: {} sessions, {} values, {n} tokens",
            kvs.len(),
            hidden.len()
        )));
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
        return Err(Error::InvalidArgument(format!("token {t} is outside the vocabulary of {}", c.vocab_size)));
    }
    if kvs.iter().any(|kv| kv.is_empty()) {
        return Err(Error::InvalidArgument("an assistant drafts after the target's K/V holds the prompt".into()));
    }
    let counts = vec![1; n];
    // Queries rotate at the draft's position; the backend's causal attention takes the row's own
    // position as the last it may see, so it is told the one before (the target's last), and the
    // window shrinks by one to keep llama.cpp's (pos - p < window).
    let q_rows: Vec<(usize, usize)> = kvs.iter().enumerate().map(|(i, kv)| (i, kv.len())).collect();
    let att_rows: Vec<(usize, usize)> = q_rows.iter().map(|&(i, p)| (i, p - 1)).collect();
    let tables = rope_tables_with(&[a.rope_swa, a.rope_full], &q_rows, a.factors.as_deref());
    let AssistantScratch { x, cat, h, q, att, o, gate, up, act } = ws;
    m.rt.host().run(m.numerics, act, None, &mut |b| {
        cat.clear();
        let mut row = vec![0f32; tw];
        let scale = (tw as f32).sqrt();
        for (i, &tok) in tokens.iter().enumerate() {
            m.tok_embd.dequantize_row(tok as usize, &mut row);
            cat.extend(row.iter().map(|v| v * scale));
            cat.extend_from_slice(&hidden[i * tw..(i + 1) * tw]);
        }
        x.clear();
        x.resize(n * w, 0.0);
        b.matmul(&mut [(&a.pre, &mut x[..])], cat, &counts);
        for l in &a.layers {
            let (qd, hd) = (l.n_heads * l.head_dim, l.head_dim);
            h.clear();
            h.extend_from_slice(x);
            b.rms_norm(h, &l.attn_norm, a.eps);
            q.clear();
            q.resize(n * qd, 0.0);
            b.matmul(&mut [(&l.wq, &mut q[..])], h, &counts);
            let (rope, ti) = if l.swa { (&a.rope_swa, 0) } else { (&a.rope_full, 1) };
            let table = RopeTable { pairs: &tables[ti], half: rope.dim / 2, neox: rope.neox };
            b.norm_rope(q, qd, hd, Some(&l.q_norm), a.eps, &table);
            let shape = AttnShape {
                n_heads: l.n_heads,
                n_kv_heads: if l.swa { a.kv_heads_swa } else { a.kv_heads_full },
                head_dim: hd,
                window: if l.swa { a.window - 1 } else { 0 },
                scale: 1.0,
                scale_query: false,
                softcap: None,
                sinks: None,
            };
            att.clear();
            att.resize(n * qd, 0.0);
            b.attention(&shape, if l.swa { a.slot_swa } else { a.slot_full }, kvs, &att_rows, &[], &counts, q, att);
            o.clear();
            o.resize(n * w, 0.0);
            b.matmul(&mut [(&l.wo, &mut o[..])], att, &counts);
            b.rms_norm(o, &l.post_attn_norm, a.eps);
            b.add(x, o);
            h.clear();
            h.extend_from_slice(x);
            b.rms_norm(h, &l.ffn_norm, a.eps);
            gate.clear();
            gate.resize(n * l.ff, 0.0);
            up.clear();
            up.resize(n * l.ff, 0.0);
            b.matmul(&mut [(&l.gate, &mut gate[..]), (&l.up, &mut up[..])], h, &counts);
            b.glu(gate, up, l.ff, Activation::GeluTanh);
            b.matmul(&mut [(&l.down, &mut o[..])], gate, &counts);
            b.rms_norm(o, &l.post_ffn_norm, a.eps);
            b.add(x, o);
            x.iter_mut().for_each(|v| *v *= l.out_scale);
        }
        b.rms_norm(x, &a.output_norm, a.eps);
        logits.clear();
        logits.resize(n * c.vocab_size, 0.0);
        b.matmul(&mut [(&a.output, &mut logits[..])], x, &counts);
        hidden_out.clear();
        hidden_out.resize(n * tw, 0.0);
        b.matmul(&mut [(&a.post, &mut hidden_out[..])], x, &counts);
    });
    Ok(())
}
