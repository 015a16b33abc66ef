//! MTP (multi-token prediction, "NextN") heads, as Qwen3.5 and Qwen3-Next define them: one more
//! block after the trunk's (`blk.{n_layers}`: full gated attention and the family's FFN) that
//! predicts the token after next. Its input at position p pairs the trunk's hidden state at p
//! (after the final norm) with the embedding of the token at p + 1: each RMS-normed (`hnorm`,
//! `enorm`), concatenated as [embedding, hidden] and projected back to the model's width
//! (`eh_proj`). After the block, `shared_head_norm` (else the trunk's `output_norm`) gives the
//! head's own hidden state, and `shared_head_head` (else the trunk's output matrix) its logits.
//! Drafting chains it: the next step pairs that hidden state with the token just drafted.
//!
//! The head keeps K/V of its own (one attention layer) per stream. The file carries it after the
//! trunk (`<arch>.nextn_predict_layers` counts it in `block_count`), or a sidecar holds it alone
//! (`mtp-<stem>.gguf`, as llama.cpp's converter writes with `--mtp`).

use super::forward::{block, pass_inputs, take_rows, LogitRows};
use super::{lookup_arch, Config, Layer, LayerDesc, Metadata, Mixer, Model, QuantMode, TensorInfo, TensorTable};
use crate::backend::{Buf, Given, HostActs};
use crate::kv::{Geometry, KvCache, KvCodec, PRIVATE_PAGE_ROWS};
use crate::quant::Weight;
use crate::{Error, Result};
use std::path::Path;
use std::sync::Arc;

pub struct MtpHead {
    /// The block: a full attention layer with the family's FFN.
    pub desc: LayerDesc,
    layer: Layer,
    /// dim x 2 * dim: [normed embedding, normed hidden] to the block's input.
    eh_proj: Weight,
    enorm: Vec<f32>,
    hnorm: Vec<f32>,
    /// The head's own embeddings, output norm and output matrix where the file has them (else
    /// the trunk's).
    embed: Option<Weight>,
    head_norm: Option<Vec<f32>>,
    head: Option<Weight>,
    /// The file it came from.
    pub source: String,
}

impl MtpHead {
    /// The head after the trunk in the file `table` reads, if the metadata declares one and the
    /// file holds its tensors (converters may leave them out).
    pub(super) fn in_file(table: &TensorTable, config: &Config) -> Result<Option<MtpHead>> {
        if config.nextn.is_empty() || !table.has(&format!("blk.{}.nextn.eh_proj.weight", config.n_layers)) {
            return Ok(None);
        }
        Self::load(table, config).map(Some)
    }

    fn load(table: &TensorTable, config: &Config) -> Result<MtpHead> {
        let il = config.n_layers;
        let desc = config.nextn[0].clone();
        if !matches!(desc.mixer, Mixer::Attention(_)) {
            return Err(Error::Internal(format!("the {} family described its MTP block without attention", config.arch)));
        }
        let n = |s: &str| format!("blk.{il}.nextn.{s}.weight");
        let (d, v) = (config.dim, config.vocab_size);
        let embed = if table.has(&n("embed_tokens")) {
            let w = table.raw(&n("embed_tokens"))?;
            if (w.rows, w.cols) != (v, d) {
                return Err(Error::Gguf(format!("{}: tensor '{}' is {}x{} but the model implies {v}x{d}", table.file, n("embed_tokens"), w.rows, w.cols)));
            }
            Some(w)
        } else {
            None
        };
        Ok(MtpHead {
            layer: table.layer(config, il, &desc)?,
            desc,
            eh_proj: table.matrix(&n("eh_proj"), d, 2 * d)?,
            enorm: table.vector(&n("enorm"), d)?,
            hnorm: table.vector(&n("hnorm"), d)?,
            embed,
            head_norm: table.opt_vector(&n("shared_head_norm"), d)?,
            head: if table.has(&n("shared_head_head")) { Some(table.matrix(&n("shared_head_head"), v, d)?) } else { None },
            source: table.file.to_string(),
        })
    }

    /// The head in the sidecar `path` (its metadata and tensor table as the Python loader read
    /// them) for `target`: Ok(Err(why)) when it was made for another model or is incomplete;
    /// nothing of it is kept then.
    pub fn sidecar(target: &Model, path: &Path, arch: &str, meta: &Metadata, tensors: &[TensorInfo]) -> Result<std::result::Result<Arc<MtpHead>, String>> {
        let tc = &target.config;
        if arch != tc.arch {
            return Ok(Err(format!("it is a {arch} file, and the model is {}", tc.arch)));
        }
        let desc = lookup_arch(arch).ok_or_else(|| Error::Internal(format!("architecture {arch} has no description")))?;
        let mut config = match (desc.configure)(meta) {
            Ok(c) => c,
            Err(e) => return Ok(Err(e.to_string())),
        };
        if config.nextn.is_empty() {
            return Ok(Err(format!("it declares no MTP layers ({arch}.nextn_predict_layers is missing or 0)")));
        }
        let theirs = [
            ("width", config.dim),
            ("heads", config.n_heads),
            ("K/V heads", config.n_kv_heads),
            ("head size", config.head_dim),
            ("trunk blocks", config.n_layers),
        ];
        let ours = [tc.dim, tc.n_heads, tc.n_kv_heads, tc.head_dim, tc.n_layers];
        for ((what, a), b) in theirs.iter().zip(ours) {
            if *a != b {
                return Ok(Err(format!("it was made for a model of {what} {a}; this one has {b}")));
            }
        }
        let file = path.display().to_string();
        let f = std::fs::File::open(path).map_err(|e| Error::Gguf(format!("{file}: cannot open: {e}")))?;
        // SAFETY: as for model files (`Model::load`): mapped read-only and never written through.
        let map = Arc::new(unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::Gguf(format!("{file}: cannot map: {e}")))?);
        let table = TensorTable::new(&file, map, tensors, QuantMode::Native, target.numerics, target.rt.host())?;
        let il = config.n_layers;
        for name in ["token_embd.weight".to_string(), format!("blk.{il}.nextn.embed_tokens.weight"), format!("blk.{il}.nextn.shared_head_head.weight")] {
            if let Some(t) = tensors.iter().find(|t| t.name == name) {
                let rows = t.shape.get(1).copied().unwrap_or(1) as usize;
                if rows != tc.vocab_size {
                    return Ok(Err(format!("its '{name}' has {rows} rows: a vocabulary of {rows}, and the model's is {}", tc.vocab_size)));
                }
            }
        }
        config.vocab_size = tc.vocab_size;
        Ok(Self::load(&table, &config).map(Arc::new).map_err(|e| e.to_string()))
    }

    /// A stream's K/V store for the head (one attention layer, private pages).
    pub fn new_kv(&self, m: &Model) -> KvCache {
        let c = &m.config;
        KvCache::private(
            Geometry { n_layers: 1, kv_dim: c.kv_dim(), head_dim: c.head_dim, page_rows: PRIVATE_PAGE_ROWS, codec: KvCodec::F16, slots: None },
            m.rt.pages(),
        )
    }
}

/// Reused buffers of the head's passes.
#[derive(Default)]
pub struct MtpScratch {
    acts: HostActs,
}

/// Run `head` (of target `m`) over a batch: session i (`kvs[i]`, the head's K/V) takes the next
/// `counts[i]` rows at its next positions; row t pairs `hidden` row t (the trunk's hidden state
/// after its final norm, or the head's own from a previous step) with `tokens[t]`, the token
/// after it. The rows `want` names get their logits in `logits` and the head's hidden state in
/// `hidden_out`, in order. Every row is computed as when its session runs alone.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    m: &Model,
    head: &MtpHead,
    kvs: &mut [&mut KvCache],
    counts: &[usize],
    tokens: &[u32],
    hidden: &[f32],
    want: LogitRows<'_>,
    ws: &mut MtpScratch,
    logits: &mut Vec<f32>,
    hidden_out: &mut Vec<f32>,
) -> Result<()> {
    let c = &m.config;
    let (d, n) = (c.dim, tokens.len());
    super::forward::check(m, kvs.iter().map(|kv| kv.len()), counts, tokens, want)?;
    if hidden.len() != n * d {
        return Err(Error::InvalidArgument(format!("an MTP head needs one hidden state of {d} values per token: got {} values for {n} tokens", hidden.len())));
    }
    for (kv, &cnt) in kvs.iter_mut().zip(counts) {
        let want = kv.len() + cnt;
        kv.reserve(want)?;
    }
    let lens: Vec<usize> = kvs.iter().map(|kv| kv.len()).collect();
    let inp = pass_inputs(m, std::slice::from_ref(&head.desc), &lens, counts, tokens, want);
    let acts = &mut ws.acts;
    let mut out = None;
    m.rt.host().pass(m.numerics, acts, kvs, &inp, None, &mut |b| {
        // The embedding and the hidden state, each normed, side by side: [e, h] per row.
        let (e, h) = (b.alloc(Buf::Q, n * d), b.alloc(Buf::K, n * d));
        b.embed(head.embed.as_ref().unwrap_or(&m.tok_embd), 1.0, Given::Values, e);
        b.rms_norm(e, e, Some(&head.enorm), d, c.norm_eps);
        b.load(hidden, h);
        b.rms_norm(h, h, Some(&head.hnorm), d, c.norm_eps);
        let cat = b.alloc(Buf::Gate, n * 2 * d);
        b.copy_cols(e, d, 0, cat, 2 * d, 0, d);
        b.copy_cols(h, d, 0, cat, 2 * d, d, d);
        let x = b.alloc(Buf::X, n * d);
        b.matmul(&[(&head.eh_proj, x)], cat, false);
        block(m, b, &inp, &head.desc, &head.layer, 0, x);
        let last = b.alloc(Buf::Hidden, inp.picked.len() * d);
        b.gather_rows(x, last, d);
        b.rms_norm(last, last, Some(head.head_norm.as_deref().unwrap_or(&m.output_norm)), d, c.norm_eps);
        let lg = b.alloc(Buf::Logits, inp.picked.len() * c.vocab_size);
        b.matmul(&[(head.head.as_ref().unwrap_or(&m.output), lg)], last, true);
        out = Some((last, lg));
    });
    let (last, lg) = out.ok_or_else(|| Error::Internal("the host ran no pass".into()))?;
    take_rows(acts, last, hidden_out);
    take_rows(acts, lg, logits);
    for (kv, &cnt) in kvs.iter_mut().zip(counts) {
        let len = kv.len() + cnt;
        kv.commit(len);
    }
    Ok(())
}
