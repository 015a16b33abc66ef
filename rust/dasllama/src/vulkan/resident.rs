//! The resident driver: a whole model on the device and its forward pass as one dispatch chain
//! per step, over sessions whose K/V live in device regions. A step advances every session it is
//! given in one pass over the weights (true batched decode), and each row is computed with the
//! same arithmetic whatever else the batch holds, as on the CPU.
//!
//! This is the device's implementation of what `model::forward` does on the CPU: the same
//! per-layer description (`LayerDesc`) drives it, the same RoPE tables (computed on the host) feed
//! it, and it hands back the logits of the rows `LogitRows` asks for.

use super::buffer::Buffer;
use super::device::Gpu;
use super::kernels::{Chain, Kernels, Runner};
use super::regions::Regions;
use super::shaders::{self as sh, u, Shader};
use super::weights::{self, upload_f32, upload_weight, DevWeight};
use crate::backend::rope_cache;
use crate::backend::Activation;
use crate::kv::{KvCache, KvCodec};
use crate::model::forward::LogitRows;
use crate::model::{AttnWeights, Config, Ffn, FfnWeights, Mixer, MixerWeights, Model, Numerics, Rope};
use crate::quant::GgmlType;
use crate::{Error, Result};
use gpu_allocator::MemoryLocation;
use std::sync::Arc;

/// Positions the device prefills in one window (one dispatch chain): a host that feeds a prompt
/// in chunks makes them at least this long.
pub const PREFILL_WINDOW: usize = 256;
/// Logit rows one chain produces at most (a verify chunk or `eval_all` over a long prompt runs
/// in several windows).
const MAX_OUT: usize = 64;
/// Recorded chains kept for replay, one per shape of window (rows, output rows, hidden or
/// logits): decode steps at each batch size and the common prefill windows.
const MAX_CHAINS: usize = 64;

struct DevLayer {
    attn_norm: Buffer,
    wq: DevWeight,
    wk: DevWeight,
    wv: DevWeight,
    bias: [Option<Buffer>; 3],
    wo: DevWeight,
    q_norm: Option<Buffer>,
    k_norm: Option<Buffer>,
    post_attn_norm: Option<Buffer>,
    ffn_norm: Buffer,
    gate: DevWeight,
    up: DevWeight,
    down: DevWeight,
    post_ffn_norm: Option<Buffer>,
}

/// Activation buffers for one window.
struct Acts {
    /// Activations rounded as a matmul's weight format takes them (`round_act`).
    xq: Buffer,
    x: Buffer,
    h: Buffer,
    q: Buffer,
    k: Buffer,
    v: Buffer,
    att: Buffer,
    o: Buffer,
    gate: Buffer,
    up: Buffer,
    last: Buffer,
    logits: Buffer,
    meta: Buffer,
    readback: Buffer,
    /// The tq4 rotation's signs for one head (read by the tq4 kernels only).
    signs: Buffer,
}

pub struct Resident {
    pub gpu: Arc<Gpu>,
    kernels: Kernels,
    run: Runner,
    cfg: Config,
    tok_embd: DevWeight,
    layers: Vec<DevLayer>,
    output_norm: Buffer,
    output: DevWeight,
    acts: Acts,
    pub regions: Regions,
    pub weight_bytes: u64,
    /// Kept chains by window shape, least recently used first.
    chains: Vec<((usize, usize, bool), Chain)>,
    /// Windows that recorded their chain, and windows that replayed a kept one.
    pub recorded: u64,
    pub replayed: u64,
}

/// Why the resident driver cannot serve this model, if it cannot.
pub fn decline(m: &Model) -> Option<String> {
    let c = &m.config;
    if m.numerics == Numerics::Ggml {
        return Some("numerics='ggml' reproduces llama.cpp's CPU order and runs on the CPU only".into());
    }
    if m.ple.is_some() {
        return Some("per-layer embeddings (embedding_length_per_layer_input), which the device driver does not run".into());
    }
    for (il, d) in c.layers.iter().enumerate() {
        match &d.mixer {
            Mixer::Attention(a) if a.heads.is_some() => {
                let h = a.heads(c);
                return Some(format!(
                    "layer {il} has heads of its own ({} of {} values, the model's {} of {}); the device driver keeps one head geometry for every layer",
                    h.n_heads, h.head_dim, c.n_heads, c.head_dim
                ));
            }
            Mixer::Attention(a) if a.kv_from.is_some() => {
                return Some(format!("layer {il} reads the K/V of layer {} (cross-layer KV sharing), which the device driver does not", a.kv_from.unwrap_or(0)))
            }
            Mixer::Attention(a) if a.v_norm => return Some(format!("layer {il} RMS-norms its values, which the device driver does not")),
            Mixer::Attention(a) if a.gated => return Some(format!("layer {il} is gated attention; the device driver runs plain attention only")),
            Mixer::Attention(_) if c.attn_sinks => {
                return Some(format!("layer {il} has attention sinks (a learned logit per head in the softmax), which the device attention does not take"))
            }
            Mixer::Attention(a) if a.temp.is_some() => {
                return Some(format!("layer {il} scales its queries by position (attention.temperature_scale), which the device driver does not"))
            }
            Mixer::Attention(_) => {}
            _ => return Some(format!("layer {il} is not an attention layer (a recurrent hybrid); the device driver runs attention models only")),
        }
        if c.extra_biases {
            return Some(format!("layer {il} has a bias on its attention output, which the device driver does not add"));
        }
        if matches!(d.ffn, Ffn::Dense { act: Activation::SwigluOai, .. }) {
            return Some(format!("layer {il}'s FFN is the clamped swiglu_oai, which the device kernels do not run"));
        }
        if !matches!(d.ffn, Ffn::Dense { .. }) {
            return Some(format!("layer {il} has routed experts; the device driver runs dense FFNs only (MoE models stay on the CPU)"));
        }
    }
    if c.head_dim > 256 || !c.head_dim.is_multiple_of(2) {
        return Some(format!("heads of {} values; the device attention takes even sizes up to 256", c.head_dim));
    }
    let mut ws = vec![("token_embd", &m.tok_embd), ("output", &m.output)];
    for l in &m.layers {
        let MixerWeights::Attention(a) = &l.mixer else { unreachable!("checked above") };
        ws.extend([("attn_q", &a.wq), ("attn_k", &a.wk), ("attn_v", &a.wv), ("attn_output", &a.wo)]);
        if let FfnWeights::Dense { gate, up, down } = &l.ffn {
            ws.extend([("ffn_gate", gate), ("ffn_up", up), ("ffn_down", down)]);
        }
    }
    ws.iter().find_map(|(n, w)| weights::unsupported(w).map(|why| format!("{n}: the device kernels do not read {why}")))
}

/// Bytes the weights take on the device.
pub fn weight_bytes(m: &Model) -> u64 {
    let mut n = m.tok_embd.row_bytes() * m.tok_embd.rows + m.output.row_bytes() * m.output.rows;
    for l in &m.layers {
        if let MixerWeights::Attention(a) = &l.mixer {
            n += [&a.wq, &a.wk, &a.wv, &a.wo].iter().map(|w| w.row_bytes() * w.rows).sum::<usize>();
        }
        if let FfnWeights::Dense { gate, up, down } = &l.ffn {
            n += [gate, up, down].iter().map(|w| w.row_bytes() * w.rows).sum::<usize>();
        }
    }
    // Padding of the 18/22/34/210-byte blocks.
    n as u64 * 9 / 8
}

fn act(gpu: &Arc<Gpu>, name: &str, floats: usize) -> Result<Buffer> {
    Buffer::new(gpu, name, (floats * 4) as u64, MemoryLocation::GpuOnly)
}

impl Resident {
    /// Upload `m` whole, with `regions` K/V regions of `ctx` positions each in `codec`.
    pub fn upload(gpu: &Arc<Gpu>, m: &Model, n_regions: usize, ctx: usize, codec: KvCodec) -> Result<Resident> {
        if let Some(why) = decline(m) {
            return Err(Error::UnsupportedModel(why));
        }
        let c = &m.config;
        let mut run = Runner::new(gpu)?;
        let opt = |run: &mut Runner, n: &str, v: &Option<Vec<f32>>| v.as_ref().map(|v| upload_f32(gpu, run, n, v)).transpose();
        let mut layers = Vec::with_capacity(m.layers.len());
        for (il, l) in m.layers.iter().enumerate() {
            let FfnWeights::Dense { gate, up, down } = &l.ffn else { unreachable!("declined above") };
            let MixerWeights::Attention(AttnWeights { wq, wk, wv, bq, bk, bv, wo, q_norm, k_norm, .. }) = &l.mixer else { unreachable!("declined above") };
            let w = |run: &mut Runner, n: &str, x| upload_weight(gpu, run, &format!("blk.{il}.{n}"), x);
            layers.push(DevLayer {
                attn_norm: upload_f32(gpu, &mut run, "attn_norm", &l.attn_norm)?,
                wq: w(&mut run, "attn_q", wq)?,
                wk: w(&mut run, "attn_k", wk)?,
                wv: w(&mut run, "attn_v", wv)?,
                bias: [opt(&mut run, "bq", bq)?, opt(&mut run, "bk", bk)?, opt(&mut run, "bv", bv)?],
                wo: w(&mut run, "attn_output", wo)?,
                q_norm: opt(&mut run, "q_norm", q_norm)?,
                k_norm: opt(&mut run, "k_norm", k_norm)?,
                post_attn_norm: opt(&mut run, "post_attn_norm", &l.post_attn_norm)?,
                ffn_norm: upload_f32(gpu, &mut run, "ffn_norm", &l.ffn_norm)?,
                gate: w(&mut run, "ffn_gate", gate)?,
                up: w(&mut run, "ffn_up", up)?,
                down: w(&mut run, "ffn_down", down)?,
                post_ffn_norm: opt(&mut run, "post_ffn_norm", &l.post_ffn_norm)?,
            });
        }
        let tok_embd = upload_weight(gpu, &mut run, "token_embd", &m.tok_embd)?;
        let output = upload_weight(gpu, &mut run, "output", &m.output)?;
        let output_norm = upload_f32(gpu, &mut run, "output_norm", &m.output_norm)?;
        let wn = PREFILL_WINDOW;
        let (d, qd, kvd, hd) = (c.dim, c.q_dim(), c.kv_dim(), c.max_hidden());
        let ropes = c.ropes().len();
        let half = c.ropes().iter().map(|r| r.dim / 2).max().unwrap_or(0);
        let meta_words = wn * 3 + MAX_OUT + ropes * wn * half * 2;
        let out_floats = (MAX_OUT * c.vocab_size).max(wn * d);
        let acts = Acts {
            xq: act(gpu, "xq", wn * d.max(qd).max(hd))?,
            x: act(gpu, "x", wn * d)?,
            h: act(gpu, "h", wn * d)?,
            q: act(gpu, "q", wn * qd)?,
            k: act(gpu, "k", wn * kvd)?,
            v: act(gpu, "v", wn * kvd)?,
            att: act(gpu, "att", wn * qd)?,
            o: act(gpu, "o", wn * d)?,
            gate: act(gpu, "gate", wn * hd)?,
            up: act(gpu, "up", wn * hd)?,
            last: act(gpu, "last", wn * d)?,
            logits: act(gpu, "logits", MAX_OUT * c.vocab_size)?,
            meta: Buffer::new(gpu, "step metadata", (meta_words * 4) as u64, MemoryLocation::CpuToGpu)?,
            readback: Buffer::new(gpu, "readback", (out_floats * 4) as u64, MemoryLocation::GpuToCpu)?,
            signs: upload_f32(gpu, &mut run, "tq4 signs", &crate::kv::codec::tq4_sign_vector(c.head_dim))?,
        };
        let regions = Regions::new(gpu, n_regions, ctx, c.kv_layers(), kvd, codec)?;
        let mut kernels = Kernels::new(gpu)?;
        // Compile every pipeline the model uses now, not in its first request.
        let per_thread = run.cpu_device();
        let weights =
            std::iter::once(&tok_embd).chain(layers.iter().flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down])).chain(std::iter::once(&output));
        let fixed = [Shader::RmsNorm, Shader::Rope, Shader::Eltwise, Shader::GatherRows, Shader::RoundAct, Shader::KvStore(codec), Shader::Attention(codec)];
        // `get` makes each pipeline once, however many weights ask for it.
        let matmuls = weights.map(|w| if per_thread { Shader::MulMatRows(w.ty) } else { Shader::MulMat(w.ty) });
        for s in fixed.into_iter().chain(matmuls).chain([Shader::GetRows(tok_embd.ty)]) {
            kernels.get(s)?;
        }
        Ok(Resident {
            gpu: gpu.clone(),
            kernels,
            run,
            cfg: c.clone(),
            tok_embd,
            layers,
            output_norm,
            output,
            acts,
            regions,
            weight_bytes: weight_bytes(m),
            chains: Vec::new(),
            recorded: 0,
            replayed: 0,
        })
    }

    /// Advance the sessions holding `regions[i]` (at positions `lens[i]`) by `counts[i]` tokens
    /// each, taken in order from `tokens`; `logits` gets the rows `want` names, in order.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        regions: &[usize],
        lens: &[usize],
        counts: &[usize],
        tokens: &[u32],
        want: LogitRows<'_>,
        logits: &mut Vec<f32>,
        factors: Option<&[f32]>,
    ) -> Result<()> {
        let width = if want == LogitRows::Hidden { self.cfg.dim } else { self.cfg.vocab_size };
        logits.clear();
        // Split into windows of at most PREFILL_WINDOW rows and MAX_OUT logit rows; a session's
        // rows run in order, so its K/V holds every earlier row when a later window reads it.
        let mut win: Vec<Piece> = Vec::new();
        let (mut rows, mut outs, mut tok_at) = (0, 0, 0);
        for (i, &cnt) in counts.iter().enumerate() {
            // Logit rows of this session are its last tails[i] tokens.
            let out_from = cnt - want.tail(i, cnt);
            let mut done = 0;
            while done < cnt {
                let first_out = out_from.max(done);
                let take = (cnt - done).min(PREFILL_WINDOW - rows).min(MAX_OUT - outs + first_out - done);
                if take == 0 {
                    self.window(&win, tokens, want, width, factors, logits)?;
                    win.clear();
                    (rows, outs) = (0, 0);
                    continue;
                }
                win.push(Piece { region: regions[i], pos: lens[i] + done, tok: tok_at + done, len: take, out_from: first_out - done });
                rows += take;
                outs += (done + take).saturating_sub(first_out);
                done += take;
            }
            tok_at += cnt;
        }
        if !win.is_empty() {
            self.window(&win, tokens, want, width, factors, logits)?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn window(&mut self, pieces: &[Piece], tokens: &[u32], want: LogitRows<'_>, width: usize, factors: Option<&[f32]>, logits: &mut Vec<f32>) -> Result<()> {
        let c = &self.cfg;
        let n: usize = pieces.iter().map(|p| p.len).sum();
        // Step metadata: tokens, (region word, position) per row, the rows that get logits, and
        // the RoPE tables.
        let mut words: Vec<u32> = Vec::with_capacity(n * 3 + MAX_OUT);
        let mut rowmeta = Vec::with_capacity(2 * n);
        let mut picked = Vec::new();
        let mut t = 0;
        for p in pieces {
            words.extend_from_slice(&tokens[p.tok..p.tok + p.len]);
            for j in 0..p.len {
                rowmeta.extend_from_slice(&[self.regions.base_word(p.region) as u32, (p.pos + j) as u32]);
                if j >= p.out_from {
                    picked.push((t + j) as u32);
                }
            }
            t += p.len;
        }
        let n_out = picked.len();
        let rowmeta_at = words.len();
        words.extend_from_slice(&rowmeta);
        let picked_at = words.len();
        words.extend_from_slice(&picked);
        let ropes = c.ropes();
        let mut rope_at = Vec::with_capacity(ropes.len());
        let mut one = Vec::new();
        for r in &ropes {
            rope_at.push(words.len());
            for p in pieces {
                for j in 0..p.len {
                    rope_cache(r, p.pos + j, factors, &mut one);
                    words.extend(one.iter().flat_map(|&(s, c)| [s.to_bits(), c.to_bits()]));
                }
            }
        }
        let meta = self.acts.meta.mapped();
        for (i, w) in words.iter().enumerate() {
            meta[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
        }
        let mw = |i: usize| self.acts.meta.at(4 * i as u64);
        let (tok_a, row_a, pick_a) = (mw(0), mw(rowmeta_at), mw(picked_at));
        let rope_a: Vec<u64> = rope_at.iter().map(|&i| mw(i)).collect();

        let hidden = want == LogitRows::Hidden;
        let floats = n_out * width;
        let key = (n, n_out, hidden);
        if let Some(i) = self.chains.iter().position(|(k, _)| *k == key) {
            // Most recently used last: the front is what goes when the cache is full.
            let entry = self.chains.remove(i);
            let replayed = self.run.replay(&entry.1);
            self.chains.push(entry);
            replayed?;
            self.replayed += 1;
        } else {
            self.run.record_chain()?;
            if let Err(e) = self.record(n, n_out, hidden, [tok_a, row_a, pick_a], &rope_a, &ropes) {
                self.run.abandon();
                return Err(e);
            }
            let chain = self.run.keep()?;
            if self.chains.len() == MAX_CHAINS {
                let (_, old) = self.chains.remove(0);
                self.run.free(old);
            }
            self.chains.push((key, chain));
            self.recorded += 1;
            self.run.replay(&self.chains.last().expect("just pushed").1)?;
        }
        let back = self.acts.readback.mapped();
        logits.extend(back[..floats * 4].chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
        Ok(())
    }
    /// Record the dispatch chain of a window of `n` rows with `n_out` output rows (`hidden`: the
    /// final hidden states, else logits). Everything that varies between steps of one shape is
    /// in the metadata buffer at the addresses given (`meta`: tokens, row metadata, picked rows;
    /// `rope_a`: each RoPE table), so the chain is replayed for every later step of that shape.
    #[allow(clippy::too_many_arguments)]
    fn record(&mut self, n: usize, n_out: usize, hidden: bool, meta: [u64; 3], rope_a: &[u64], ropes: &[Rope]) -> Result<()> {
        let c = &self.cfg;
        let (d, qd, kvd) = (c.dim, c.q_dim(), c.kv_dim());
        let width = if hidden { d } else { c.vocab_size };
        let [tok_a, row_a, pick_a] = meta;
        let a = &self.acts;
        let (k, r) = (&mut self.kernels, &mut self.run);
        let eps = c.norm_eps;
        let e = &self.tok_embd;
        r.dispatch(
            k,
            Shader::GetRows(e.ty),
            sh::GetRowsPush {
                w: e.buf.addr,
                out_: a.x.addr,
                ids: tok_a,
                cols: u(e.cols),
                row_words: u(e.row_words),
                scale: c.embed_scale.unwrap_or(1.0),
                _pad: 0,
            },
            [(e.cols / 16).div_ceil(64) as u32, n as u32, 1],
        )?;
        r.barrier()?;
        for (il, (l, desc)) in self.layers.iter().zip(&c.layers).enumerate() {
            let Mixer::Attention(at) = &desc.mixer else { unreachable!("declined at upload") };
            rms_norm(r, k, &a.x, &a.h, &l.attn_norm, d, n, eps)?;
            r.barrier()?;
            mm(r, k, &[(&l.wq, &a.q), (&l.wk, &a.k), (&l.wv, &a.v)], &a.h, &a.xq, n)?;
            r.barrier()?;
            if l.bias.iter().any(Option::is_some) {
                for (b, (out, w)) in l.bias.iter().zip([(&a.q, qd), (&a.k, kvd), (&a.v, kvd)]) {
                    if let Some(b) = b {
                        eltwise(r, k, out, b, n * w, w, 0, 0.0)?;
                    }
                }
                r.barrier()?;
            }
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                rms_norm(r, k, &a.q, &a.q, qn, c.head_dim, n * c.n_heads, eps)?;
                rms_norm(r, k, &a.k, &a.k, kn, c.head_dim, n * c.n_kv_heads, eps)?;
                r.barrier()?;
            }
            let ri = ropes.iter().position(|x| *x == at.rope).expect("every layer's RoPE is tabulated");
            let half = at.rope.dim / 2;
            for (buf, w) in [(&a.q, qd), (&a.k, kvd)] {
                let total = n * (w / c.head_dim) * half;
                r.dispatch_flat(
                    k,
                    Shader::Rope,
                    sh::RopePush {
                        x: buf.addr,
                        tab: rope_a[ri],
                        width: u(w),
                        head_dim: u(c.head_dim),
                        half_: u(half),
                        neox: at.rope.neox as u32,
                        total: u(total),
                        _pad: 0,
                    },
                    total,
                )?;
            }
            r.barrier()?;
            let slot = c.kv_slot(il).expect("an attention layer has a K/V slot");
            let (slot_off, v_off) = self.regions.slot_offsets(slot);
            let codec = self.regions.codec;
            let rscale = 1.0 / (c.head_dim as f32).sqrt();
            let store = sh::KvStorePush {
                k: a.k.addr,
                v: a.v.addr,
                kv: self.regions.buf.addr,
                meta: row_a,
                signs: a.signs.addr,
                kvd: u(kvd),
                n: u(n),
                slot_off: u(slot_off),
                v_off: u(v_off),
                head_dim: u(c.head_dim),
                rscale,
            };
            let kv_store = Shader::KvStore(codec);
            match codec {
                KvCodec::F16 => r.dispatch_flat(k, kv_store, store, n * kvd / 2)?,
                KvCodec::Q8_0 => r.dispatch_flat(k, kv_store, store, n * kvd / 32)?,
                // A workgroup per KV head of each row: the rotation needs the whole head.
                KvCodec::Tq4 => r.dispatch(k, kv_store, store, [c.n_kv_heads as u32, n as u32, 1])?,
            }
            r.barrier()?;
            let sh = at.shape(c);
            r.dispatch(
                k,
                Shader::Attention(codec),
                sh::AttentionPush {
                    q: a.q.addr,
                    out_: a.att.addr,
                    kv: self.regions.buf.addr,
                    meta: row_a,
                    signs: a.signs.addr,
                    n_heads: u(sh.n_heads),
                    n_kv_heads: u(sh.n_kv_heads),
                    head_dim: u(sh.head_dim),
                    window: u(sh.window),
                    qmul: if sh.scale_query { sh.scale } else { 1.0 },
                    smul: sh.score_scale(),
                    softcap: sh.softcap.unwrap_or(0.0),
                    slot_off: u(slot_off),
                    v_off: u(v_off),
                    row_words: u(self.regions.row_words()),
                    rscale,
                    _pad: 0,
                    ..Default::default()
                },
                // One workgroup per KV head (per eight of the query heads sharing it) and row.
                [(sh.n_kv_heads * (sh.n_heads / sh.n_kv_heads).div_ceil(8)) as u32, n as u32, 1],
            )?;
            r.barrier()?;
            mm(r, k, &[(&l.wo, &a.o)], &a.att, &a.xq, n)?;
            r.barrier()?;
            if let Some(w) = &l.post_attn_norm {
                rms_norm(r, k, &a.o, &a.o, w, d, n, eps)?;
                r.barrier()?;
            }
            eltwise(r, k, &a.x, &a.o, n * d, n * d, 0, 0.0)?;
            r.barrier()?;
            rms_norm(r, k, &a.x, &a.h, &l.ffn_norm, d, n, eps)?;
            r.barrier()?;
            let Ffn::Dense { hidden, act, .. } = desc.ffn else { unreachable!("declined at upload") };
            mm(r, k, &[(&l.gate, &a.gate), (&l.up, &a.up)], &a.h, &a.xq, n)?;
            r.barrier()?;
            let op = match act {
                Activation::Silu => 1,
                Activation::GeluTanh => 2,
                Activation::SwigluOai => unreachable!("declined at upload"),
            };
            eltwise(r, k, &a.gate, &a.up, n * hidden, n * hidden, op, 0.0)?;
            r.barrier()?;
            mm(r, k, &[(&l.down, &a.o)], &a.gate, &a.xq, n)?;
            r.barrier()?;
            if let Some(w) = &l.post_ffn_norm {
                rms_norm(r, k, &a.o, &a.o, w, d, n, eps)?;
                r.barrier()?;
            }
            eltwise(r, k, &a.x, &a.o, n * d, n * d, 0, 0.0)?;
            r.barrier()?;
        }
        r.dispatch_flat(k, Shader::GatherRows, sh::GatherRowsPush { src: a.x.addr, dst: a.last.addr, idx: pick_a, width: u(d), count: u(n_out) }, n_out * d)?;
        r.barrier()?;
        rms_norm(r, k, &a.last, &a.last, &self.output_norm, d, n_out, eps)?;
        r.barrier()?;
        let (src, floats) = if hidden {
            (&a.last, n_out * d)
        } else {
            mm(r, k, &[(&self.output, &a.logits)], &a.last, &a.xq, n_out)?;
            r.barrier()?;
            if let Some(cap) = c.final_softcap {
                eltwise(r, k, &a.logits, &a.logits, n_out * width, n_out * width, 3, cap)?;
                r.barrier()?;
            }
            (&a.logits, n_out * width)
        };
        r.copy(src, 0, &a.readback, 0, (floats * 4) as u64)?;
        Ok(())
    }
}

impl Resident {
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// Copy rows 0..len of `region` into the empty host cache `kv` (decoded from the device's
    /// codec and re-encoded in the cache's).
    pub fn read_rows(&mut self, region: usize, len: usize, kv: &mut KvCache) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let (kvd, hd, codec) = (self.cfg.kv_dim(), self.cfg.head_dim, self.regions.codec);
        let (_, bytes) = self.regions.rows_bytes(region, 0, false, len);
        let mut back = Buffer::new(&self.gpu, "hydrate", 2 * bytes, MemoryLocation::GpuToCpu)?;
        kv.reserve(len)?;
        let mut k = vec![0f32; len * kvd];
        let mut v = vec![0f32; len * kvd];
        let row_bytes = bytes as usize / len;
        for slot in 0..self.cfg.kv_layers() {
            let (ko, _) = self.regions.rows_bytes(region, slot, false, len);
            let (vo, _) = self.regions.rows_bytes(region, slot, true, len);
            self.run.copy(&self.regions.buf, ko, &back, 0, bytes)?;
            self.run.copy(&self.regions.buf, vo, &back, bytes, bytes)?;
            self.run.submit()?;
            let m = back.mapped();
            for (x, src) in [(&mut k, &m[..bytes as usize]), (&mut v, &m[bytes as usize..2 * bytes as usize])] {
                for (row, out) in src.chunks_exact(row_bytes).zip(x.chunks_exact_mut(kvd)) {
                    decode_row(codec, row, hd, out);
                }
            }
            kv.append(slot, &k, &v);
        }
        kv.commit(len);
        Ok(())
    }
}

/// One position's K or V as the device stores it (`regions::row_words`) back to the model's
/// basis, f32.
pub(crate) fn decode_row(codec: KvCodec, row: &[u8], hd: usize, out: &mut [f32]) {
    match codec {
        KvCodec::F16 => {
            for (i, x) in out.iter_mut().enumerate() {
                *x = half::f16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32();
            }
        }
        // Device blocks are the host's with the scale padded to a word: drop the padding and
        // decode as the host codec does.
        KvCodec::Q8_0 | KvCodec::Tq4 => {
            let (dev, host) = if codec == KvCodec::Q8_0 { (36, 34) } else { (20, 18) };
            let mut blocks = Vec::with_capacity(out.len() / 32 * host);
            for b in row.chunks_exact(dev) {
                blocks.extend_from_slice(&b[..2]);
                blocks.extend_from_slice(&b[4..]);
            }
            codec.decode(&blocks, out);
            if codec == KvCodec::Tq4 {
                out.chunks_exact_mut(hd).for_each(crate::kv::codec::unrotate);
            }
        }
    }
}

/// A run of one session's rows inside a window.
struct Piece {
    region: usize,
    pos: usize,
    /// Index of its first token in the call's `tokens`.
    tok: usize,
    len: usize,
    /// Rows from this one on get logits.
    out_from: usize,
}

/// How `round_act` rounds activations for weights of `ty` (0: not at all).
fn round_mode(ty: GgmlType) -> usize {
    match ty.vec_dot_type() {
        GgmlType::Q8_0 | GgmlType::Q8_1 => 1,
        GgmlType::Q8K => 2,
        GgmlType::F16 => 3,
        GgmlType::BF16 => 4,
        _ => 0,
    }
}

/// Products of several weights with the same input `x` (`n` rows): the input rounded once per
/// activation format among them (into `xq`), as the CPU rounds it, then one matmul each.
pub(super) fn mm(r: &mut Runner, k: &mut Kernels, ws: &[(&DevWeight, &Buffer)], x: &Buffer, xq: &Buffer, n: usize) -> Result<()> {
    let cols = ws[0].0.cols;
    let mut modes: Vec<usize> = ws.iter().map(|(w, _)| round_mode(w.ty)).collect();
    modes.sort_unstable();
    modes.dedup();
    for (i, &mode) in modes.iter().enumerate() {
        let src = if mode == 0 {
            x
        } else {
            if i > 0 {
                // The previous mode's matmuls still read xq.
                r.barrier()?;
            }
            let blocks = match mode {
                1 => n * cols / 32,
                2 => n * cols / 256,
                _ => n * cols,
            };
            r.dispatch_flat(k, Shader::RoundAct, sh::RoundActPush { x: x.addr, out_: xq.addr, blocks: u(blocks), mode: u(mode) }, blocks)?;
            r.barrier()?;
            xq
        };
        for (w, y) in ws.iter().filter(|(w, _)| round_mode(w.ty) == mode) {
            matmul(r, k, w, src, y, n)?;
        }
    }
    Ok(())
}

/// The matrix product over `n` activation rows: one workgroup per weight row on a GPU
/// (`mul_mat`), one invocation per weight row on a CPU-type device (`mul_mat_rows`).
pub fn matmul(r: &mut Runner, k: &mut Kernels, w: &DevWeight, x: &Buffer, y: &Buffer, n: usize) -> Result<()> {
    const ROWS_PER_Z: usize = 32768;
    let per_thread = r.cpu_device();
    let groups = if per_thread { w.rows.div_ceil(64) } else { w.rows };
    let (gx, gz) = if groups > ROWS_PER_Z { (ROWS_PER_Z, groups.div_ceil(ROWS_PER_Z)) } else { (groups, 1) };
    let rows_per_z = if per_thread { ROWS_PER_Z * 64 } else { ROWS_PER_Z };
    let shader = if per_thread { Shader::MulMatRows(w.ty) } else { Shader::MulMat(w.ty) };
    r.dispatch(
        k,
        shader,
        sh::MulMatPush {
            w: w.buf.addr,
            x: x.addr,
            y: y.addr,
            rows: u(w.rows),
            cols: u(w.cols),
            n: u(n),
            row_words: u(w.row_words),
            x_stride: u(w.cols),
            y_stride: u(w.rows),
            rows_per_z: u(rows_per_z),
            _pad: 0,
        },
        [gx as u32, n.div_ceil(8) as u32, gz as u32],
    )
}

#[allow(clippy::too_many_arguments)]
fn rms_norm(r: &mut Runner, k: &mut Kernels, x: &Buffer, out: &Buffer, w: &Buffer, width: usize, rows: usize, eps: f32) -> Result<()> {
    // A window has at most PREFILL_WINDOW rows of at most 128 heads: well inside one dimension.
    assert!(rows <= 65535, "rms_norm over {rows} rows");
    r.dispatch(k, Shader::RmsNorm, sh::RmsNormPush { x: x.addr, w: w.addr, out_: out.addr, width: u(width), eps }, [rows as u32, 1, 1])
}

#[allow(clippy::too_many_arguments)]
fn eltwise(r: &mut Runner, k: &mut Kernels, x: &Buffer, y: &Buffer, count: usize, width: usize, op: usize, a: f32) -> Result<()> {
    r.dispatch_flat(k, Shader::Eltwise, sh::EltwisePush { x: x.addr, y: y.addr, count: u(count), width: u(width), op: u(op), a, z: 0 }, count)
}
