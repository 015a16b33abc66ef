//! A model resident on the device: what the one forward pass records into (`ops::Recorder`)
//! and replays. Weights and norm vectors go to the device the first time a pass reads them (so
//! the placement's first, one-row pass uploads the model whole), the pass's buffers grow to
//! the largest window seen, and each shape of window keeps its recorded dispatch chain: a
//! later step of that shape only rewrites the metadata buffer (tokens, each row's region and
//! position, the rows that get logits, RoPE tables, per-row factors) and replays it.

use super::buffer::Buffer;
use super::deltanet::{self, meta_words, DevDnParams, META_WORDS};
use super::device::Gpu;
use super::kernels::{Chain, Kernels, Runner};
use super::moe::{moe_ffn, DevExperts, MoeScratch, RouteSpec};
use super::ops::Recorder;
use super::regions::Regions;
use super::weights::{upload_f32, upload_stacked, upload_weight, DevWeight};
use crate::backend::{Act, Buf, DeltaNet, DnParams, ExpertSet, PassIn, Placeable, Route};
use crate::kv::{KvCache, KvCodec};
use crate::quant::Weight;
use crate::{Error, Result};
use gpu_allocator::MemoryLocation;
use std::collections::HashMap;
use std::sync::Arc;

/// Rows one window (one dispatch chain) takes at most: a host that feeds a prompt in chunks
/// makes them at least this long.
pub const PREFILL_WINDOW: usize = 256;
/// Logit rows one chain produces at most (a verify chunk or `eval_all` over a long prompt runs
/// in several windows).
pub const MAX_OUT: usize = 64;
/// Recorded chains kept for replay, one per shape of window (rows, output rows, hidden or
/// logits): decode steps at each batch size and the common prefill windows.
const MAX_CHAINS: usize = 64;

/// The shape of a window, which one recorded chain serves: its rows and output rows, whether
/// it leaves hidden states, its sessions (a recurrent layer's kernels take one workgroup each;
/// 0 for other models), and whether some rows are given as values or attend past their own
/// position (an image's: the chain then reads the metadata buffer's parts for them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Shape {
    rows: usize,
    out: usize,
    hidden: bool,
    sessions: usize,
    given: bool,
    ends: bool,
}

/// A kept chain: the window shape it serves, and the rows it leaves (read back after each run).
struct Kept {
    key: Shape,
    chain: Chain,
    out: Act,
}

pub struct Engine {
    pub gpu: Arc<Gpu>,
    pub(super) kernels: Kernels,
    /// Steps record and run here; uploads take their own runner, so a weight read for the first
    /// time while a chain is being recorded goes up at once.
    pub(super) run: Runner,
    up: Runner,
    /// Weights by the address of their bytes, vectors by (address, length): both live as long
    /// as the model, which owns this engine through its placement.
    weights: HashMap<usize, DevWeight>,
    vecs: HashMap<(usize, usize), Buffer>,
    /// Weightless norms' weights of ones, by width.
    ones: HashMap<usize, Buffer>,
    /// Each layer's routed experts, stacked per projection, by the address of its gate matrices.
    experts: HashMap<usize, DevExperts>,
    /// The routed experts' scratch: route pairs, rounded input, gate, up, down.
    moe: [Option<Buffer>; 5],
    /// The pass's buffers (`Buf`), the matmuls' rounded input, the step metadata and readback.
    bufs: Vec<Option<Buffer>>,
    pub(super) xq: Option<Buffer>,
    pub(super) meta: Option<Buffer>,
    readback: Option<Buffer>,
    /// Buffers outgrown while a chain was being recorded, which it may still name.
    retired: Vec<Buffer>,
    grew: bool,
    /// The tq4 rotation's signs, by head size.
    signs: HashMap<usize, Buffer>,
    pub regions: Regions,
    /// A hybrid's recurrent state per region, after its K/V (the device's `kv::RecIo`): per
    /// recurrent slot its conv state then its SSM state, updated in place by each pass.
    rec: Vec<DeltaNet>,
    /// Per recurrent slot: (conv, SSM) word offsets in a region's state; words a region's state takes.
    rec_at: Vec<(usize, usize)>,
    rec_words: usize,
    states: Option<Buffer>,
    dn_params: HashMap<usize, DevDnParams>,
    chains: Vec<Kept>,
    /// The model's layers this device runs (the first ones; all of them unless split).
    pub layers: usize,
    /// Whether the model's later layers run elsewhere (`Placement::split`).
    pub split: bool,
    pub weight_bytes: u64,
    pub recorded: u64,
    pub replayed: u64,
}

/// Where the pass's inputs lie in the metadata buffer (device addresses).
pub(super) struct MetaAt {
    pub tokens: u64,
    pub rows: u64,
    pub picked: u64,
    pub ropes: Vec<u64>,
    pub scales: Vec<u64>,
    /// Per recurrent slot: each session's record (`deltanet::meta_words`).
    pub dn: Vec<u64>,
    /// Rows given as values (`PassIn::embeds`; 0 where none): per batch row the given row it
    /// takes or u32::MAX, the tokens with those rows' set to 0 (`Given::Token(0)`), the values.
    pub given: u64,
    pub pad_tokens: u64,
    pub values: u64,
    /// Per batch row the end of the positions it attends (`PassIn::key_ends`; 0 where causal).
    pub ends: u64,
}

impl Engine {
    /// `m`'s first `layers` layers on the device (all of them where `layers` is its count), with
    /// `n_regions` K/V regions of `ctx` positions for them.
    pub fn new(gpu: &Arc<Gpu>, m: &dyn Placeable, n_regions: usize, ctx: usize, codec: KvCodec, layers: usize) -> Result<Engine> {
        let split = layers < m.n_layers();
        let heads = m.kv_heads();
        // A split model keeps K/V in slot order, one slot per layer (`Placeable::splits`).
        let heads = if split { &heads[..layers] } else { &heads[..] };
        let regions = Regions::new(gpu, n_regions, ctx, heads, codec)?;
        let rec = m.rec_layers();
        let mut rec_at = Vec::with_capacity(rec.len());
        let mut rec_words = 0;
        for dn in &rec {
            let conv = (dn.conv_kernel - 1) * dn.conv_dim();
            rec_at.push((rec_words, rec_words + conv));
            rec_words += conv + dn.n_v_heads * dn.head_dim * dn.head_dim;
        }
        let states =
            if rec.is_empty() { None } else { Some(Buffer::new(gpu, "recurrent states", (4 * n_regions * rec_words) as u64, MemoryLocation::GpuOnly)?) };
        Ok(Engine {
            gpu: gpu.clone(),
            kernels: Kernels::new(gpu)?,
            run: Runner::new(gpu)?,
            up: Runner::new(gpu)?,
            weights: HashMap::new(),
            vecs: HashMap::new(),
            ones: HashMap::new(),
            experts: HashMap::new(),
            moe: [None, None, None, None, None],
            bufs: (0..Buf::COUNT).map(|_| None).collect(),
            xq: None,
            meta: None,
            readback: None,
            retired: Vec::new(),
            grew: false,
            signs: HashMap::new(),
            regions,
            rec,
            rec_at,
            rec_words,
            states,
            dn_params: HashMap::new(),
            chains: Vec::new(),
            layers,
            split,
            weight_bytes: 0,
            recorded: 0,
            replayed: 0,
        })
    }

    /// `w` on the device, uploaded the first time it is asked for.
    pub(super) fn weight(&mut self, w: &Weight) -> Result<&DevWeight> {
        let key = w.data.as_slice().as_ptr() as usize;
        if !self.weights.contains_key(&key) {
            if let Some(why) = super::weights::unsupported(w) {
                return Err(Error::UnsupportedModel(format!("the Vulkan kernels do not read {why} yet")));
            }
            let d = upload_weight(&self.gpu, &mut self.up, "weight", w)?;
            self.weight_bytes += d.buf.size;
            self.weights.insert(key, d);
        }
        Ok(&self.weights[&key])
    }

    /// `v` on the device (a norm's weight, a bias), uploaded the first time; None: ones of `width`.
    pub(super) fn vector(&mut self, v: Option<&[f32]>, width: usize) -> Result<u64> {
        let Some(v) = v else {
            if !self.ones.contains_key(&width) {
                let b = upload_f32(&self.gpu, &mut self.up, "ones", &vec![1.0; width])?;
                self.ones.insert(width, b);
            }
            return Ok(self.ones[&width].addr);
        };
        let key = (v.as_ptr() as usize, v.len());
        if !self.vecs.contains_key(&key) {
            let b = upload_f32(&self.gpu, &mut self.up, "vector", v)?;
            self.weight_bytes += b.size;
            self.vecs.insert(key, b);
        }
        Ok(self.vecs[&key].addr)
    }

    /// Route each row of `logits` and run its chosen experts over its row of `x` into `out`
    /// (`Ops::experts`): the layer's experts go up stacked the first time.
    pub(super) fn experts(&mut self, e: &ExpertSet<'_>, r: &Route<'_>, logits: Act, x: Act, out: Act) -> Result<()> {
        let (d, hd, nu) = (e.gate[0].cols, e.hidden, r.n_used);
        let n = x.len / d;
        if logits.off != 0 || x.off != 0 || out.off != 0 {
            return Err(Error::Internal("routed experts take whole pass buffers".into()));
        }
        let key = e.gate.as_ptr() as usize;
        if !self.experts.contains_key(&key) {
            let (g, u, dn): (Vec<&Weight>, Vec<&Weight>, Vec<&Weight>) = (e.gate.iter().collect(), e.up.iter().collect(), e.down.iter().collect());
            let mut vec = |v: Option<&[f32]>| v.map(|v| upload_f32(&self.gpu, &mut self.up, "expert vector", v)).transpose();
            let dev = DevExperts {
                n_expert: e.gate.len(),
                hidden: hd,
                gate_bias: vec(e.biases.map(|b| b[0]))?,
                up_bias: vec(e.biases.map(|b| b[1]))?,
                down_bias: vec(e.biases.map(|b| b[2]))?,
                scale: vec(e.expert_scale)?,
                gate: upload_stacked(&self.gpu, &mut self.up, "expert gates", &g)?,
                up: upload_stacked(&self.gpu, &mut self.up, "expert ups", &u)?,
                down: upload_stacked(&self.gpu, &mut self.up, "expert downs", &dn)?,
            };
            self.weight_bytes += [&dev.gate, &dev.up, &dev.down].iter().map(|w| w.buf.size).sum::<u64>();
            self.experts.insert(key, dev);
        }
        // The selection bias goes up as any vector; the route kernel reads it as a buffer.
        if let Some(b) = r.bias {
            self.vector(Some(b), b.len())?;
        }
        let slots = n * nu;
        let sizes = [2 * slots, slots * d.max(hd), slots * hd, slots * hd, slots * d];
        for (slot, floats) in self.moe.iter_mut().zip(sizes) {
            Engine::ensure(&self.gpu, slot, 4 * floats as u64, MemoryLocation::GpuOnly, "expert scratch", &mut self.retired, &mut self.grew)?;
        }
        let [Some(pairs), Some(xq), Some(gate), Some(up), Some(down)] = &self.moe else { unreachable!("ensured above") };
        let buf = |a: Act| self.bufs[a.buf as usize].as_ref().ok_or_else(|| Error::Internal("a pass buffer used before it was allocated".into()));
        let (lg, h, o) = (buf(logits)?, buf(x)?, buf(out)?);
        let bias_buf = r.bias.map(|b| &self.vecs[&(b.as_ptr() as usize, b.len())]);
        let spec = RouteSpec { n_expert: r.n_expert, n_used: nu, gating: r.gating, bias: bias_buf, norm: r.norm, scale: r.scale };
        let scratch = MoeScratch { pairs, xq, gate, up, down };
        moe_ffn(&mut self.run, &mut self.kernels, &self.experts[&key], &spec, e.act, lg, h, o, &scratch, d, n)
    }

    /// Whether regions hold a recurrent state (a hybrid's).
    pub fn recurrent(&self) -> bool {
        !self.rec.is_empty()
    }

    /// One gated DeltaNet layer's recurrent core over the pass's sessions (`Ops::delta_net`),
    /// each session's state in its region; `meta`: the sessions' records for this slot.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn delta_net(&mut self, dn: &DeltaNet, p: &DnParams, bufs: [Act; 4], meta: u64, sessions: usize) -> Result<()> {
        let key = p.conv.as_ptr() as usize;
        if !self.dn_params.contains_key(&key) {
            let params = DevDnParams {
                conv: upload_f32(&self.gpu, &mut self.up, "DeltaNet conv", p.conv)?,
                dt_bias: upload_f32(&self.gpu, &mut self.up, "DeltaNet dt bias", p.dt_bias)?,
                a: upload_f32(&self.gpu, &mut self.up, "DeltaNet a", p.a)?,
            };
            self.weight_bytes += params.conv.size + params.dt_bias.size + params.a.size;
            self.dn_params.insert(key, params);
        }
        let states = self.states.as_ref().ok_or_else(|| Error::Internal("a DeltaNet layer in a model placed without recurrent slots".into()))?;
        let buf = |a: Act| match &self.bufs[a.buf as usize] {
            Some(b) if a.off == 0 => Ok(b),
            _ => Err(Error::Internal("a DeltaNet layer takes whole pass buffers".into())),
        };
        let [qkv, beta, alpha, out] = bufs;
        let (q, b, al, o) = (buf(qkv)?, buf(beta)?, buf(alpha)?, buf(out)?);
        deltanet::delta_net(&mut self.run, &mut self.kernels, dn, &self.dn_params[&key], q, b, al, o, meta, states.addr, sessions)
    }

    pub(super) fn signs(&mut self, head_dim: usize) -> Result<u64> {
        if !self.signs.contains_key(&head_dim) {
            let b = upload_f32(&self.gpu, &mut self.up, "tq4 signs", &crate::kv::codec::tq4_sign_vector(head_dim))?;
            self.signs.insert(head_dim, b);
        }
        Ok(self.signs[&head_dim].addr)
    }

    /// A buffer of at least `bytes`, replaced by a larger one when it is short (the old one is
    /// retired: a chain being recorded may name it, so that chain is recorded again).
    fn ensure(
        gpu: &Arc<Gpu>,
        slot: &mut Option<Buffer>,
        bytes: u64,
        loc: MemoryLocation,
        what: &str,
        retired: &mut Vec<Buffer>,
        grew: &mut bool,
    ) -> Result<u64> {
        if slot.as_ref().is_none_or(|b| b.size < bytes) {
            // Round up so a window a few rows longer does not outgrow it again.
            let size = bytes.max(1024).next_multiple_of(1 << 16);
            if let Some(old) = slot.replace(Buffer::new(gpu, what, size, loc)?) {
                retired.push(old);
                *grew = true;
            }
        }
        Ok(slot.as_ref().map_or(0, |b| b.addr))
    }

    /// The address of `len` values of `buf` from the start, growing it where short.
    pub(super) fn buf(&mut self, buf: Buf, len: usize) -> Result<u64> {
        Engine::ensure(&self.gpu, &mut self.bufs[buf as usize], 4 * len as u64, MemoryLocation::GpuOnly, "pass buffer", &mut self.retired, &mut self.grew)
    }

    /// The device address of a view.
    pub(super) fn addr(&self, a: Act) -> u64 {
        self.bufs[a.buf as usize].as_ref().map_or(0, |b| b.addr) + 4 * a.off as u64
    }

    pub(super) fn xq(&mut self, len: usize) -> Result<u64> {
        Engine::ensure(&self.gpu, &mut self.xq, 4 * len as u64, MemoryLocation::GpuOnly, "rounded activations", &mut self.retired, &mut self.grew)
    }

    /// Write the pass's inputs into the metadata buffer: where each part lies.
    fn write_meta(&mut self, regions: &[usize], inp: &PassIn<'_>) -> Result<MetaAt> {
        let mut words: Vec<u32> = Vec::with_capacity(inp.tokens.len() * 4);
        words.extend_from_slice(inp.tokens);
        let rows_at = words.len();
        for &(s, pos) in &inp.rows {
            words.extend_from_slice(&[self.regions.base_word(regions[s]) as u32, pos as u32]);
        }
        let picked_at = words.len();
        words.extend(inp.picked.iter().map(|&t| t as u32));
        let mut ropes = Vec::with_capacity(inp.tables.len());
        for t in &inp.tables {
            ropes.push(words.len());
            words.extend(t.iter().flat_map(|&(s, c)| [s.to_bits(), c.to_bits()]));
        }
        let mut scales = Vec::with_capacity(inp.row_scales.len());
        for t in &inp.row_scales {
            scales.push(words.len());
            words.extend(t.iter().map(|v| v.to_bits()));
        }
        let mut dn = Vec::with_capacity(self.rec_at.len());
        for &(conv, ssm) in &self.rec_at {
            dn.push(words.len());
            let mut first = 0;
            for (&region, &cnt) in regions.iter().zip(inp.counts) {
                // Each state is read and written in place: the kernels read a value before they overwrite it.
                let base = region * self.rec_words;
                words.extend(meta_words(first, cnt, base + conv, base + conv, base + ssm, base + ssm));
                first += cnt;
            }
            debug_assert_eq!(words.len() - dn.last().copied().unwrap_or(0), META_WORDS * regions.len());
        }
        // What only a window with images has; the values go last, so every part before them
        // lies where the chain of this shape reads it whatever the images' sizes.
        let (mut given, mut pad_tokens, mut ends, mut values) = (None, None, None, None);
        if let Some(e) = &inp.embeds {
            let mut map = vec![u32::MAX; inp.tokens.len()];
            for (k, &r) in e.rows.iter().enumerate() {
                map[r] = k as u32;
            }
            pad_tokens = Some(words.len());
            words.extend(inp.tokens.iter().zip(&map).map(|(&t, &k)| if k == u32::MAX { t } else { 0 }));
            given = Some(words.len());
            words.extend(map);
        }
        if !inp.key_ends.is_empty() {
            ends = Some(words.len());
            words.extend(inp.key_ends.iter().map(|&e| e as u32));
        }
        if let Some(e) = &inp.embeds {
            values = Some(words.len());
            words.extend(e.values.iter().map(|v| v.to_bits()));
        }
        let bytes = 4 * words.len() as u64;
        Engine::ensure(&self.gpu, &mut self.meta, bytes, MemoryLocation::CpuToGpu, "step metadata", &mut self.retired, &mut self.grew)?;
        let meta = self.meta.as_mut().expect("ensured above");
        for (dst, w) in meta.mapped().chunks_exact_mut(4).zip(&words) {
            dst.copy_from_slice(&w.to_le_bytes());
        }
        let at = |i: usize| meta.at(4 * i as u64);
        Ok(MetaAt {
            tokens: at(0),
            rows: at(rows_at),
            picked: at(picked_at),
            ropes: ropes.into_iter().map(at).collect(),
            scales: scales.into_iter().map(at).collect(),
            dn: dn.into_iter().map(at).collect(),
            given: given.map_or(0, at),
            pad_tokens: pad_tokens.map_or(0, at),
            values: values.map_or(0, at),
            ends: ends.map_or(0, at),
        })
    }

    /// Forget every kept chain (a buffer they name was replaced).
    fn drop_chains(&mut self) {
        for k in self.chains.drain(..) {
            self.run.free(k.chain);
        }
        self.retired.clear();
    }

    /// One window of `m`'s pass: session i of `inp` in region `regions[i]`. The rows the pass
    /// leaves are appended to `out`.
    pub fn forward(&mut self, m: &dyn Placeable, regions: &[usize], inp: &PassIn<'_>, hidden: bool, out: &mut Vec<f32>) -> Result<()> {
        let key = Shape {
            rows: inp.tokens.len(),
            out: inp.picked.len(),
            hidden,
            sessions: if self.rec.is_empty() { 0 } else { inp.counts.len() },
            given: inp.embeds.is_some(),
            ends: !inp.key_ends.is_empty(),
        };
        let at = self.write_meta(regions, inp)?;
        if let Some(states) = &self.states {
            // A session at its first position starts from a zero state.
            let mut first = 0;
            for (&region, &cnt) in regions.iter().zip(inp.counts) {
                if inp.rows[first].1 == 0 {
                    self.up.zero(states, (4 * region * self.rec_words) as u64, (4 * self.rec_words) as u64)?;
                }
                first += cnt;
            }
            self.up.submit()?;
        }
        if self.grew {
            // The metadata buffer itself moved: every kept chain names the old one.
            self.grew = false;
            self.drop_chains();
        }
        let i = match self.chains.iter().position(|k| k.key == key) {
            Some(i) => {
                self.replayed += 1;
                i
            }
            None => {
                self.record(m, inp, hidden, key, &at)?;
                self.recorded += 1;
                self.chains.len() - 1
            }
        };
        // Most recently used last: the front is what goes when the cache is full.
        let k = self.chains.remove(i);
        let ran = self.run.replay(&k.chain);
        let res = k.out;
        self.chains.push(k);
        ran?;
        let back = self.readback.as_mut().expect("a recorded chain reads back");
        out.extend(back.mapped()[..4 * res.len].chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
        Ok(())
    }

    /// Record the chain of a window of this shape, keeping it. A recording that outgrew a
    /// buffer is thrown away and done again over the grown buffers.
    fn record(&mut self, m: &dyn Placeable, inp: &PassIn<'_>, hidden: bool, key: Shape, at: &MetaAt) -> Result<()> {
        for _ in 0..3 {
            self.run.record_chain()?;
            let layers = self.layers;
            let mut rec = Recorder::new(self, at, inp);
            let res = m.pass(&mut rec, inp, hidden, layers);
            let failed = rec.finish();
            let bytes = 4 * res.len as u64;
            let copied = failed.and_then(|()| {
                Engine::ensure(&self.gpu, &mut self.readback, bytes, MemoryLocation::GpuToCpu, "readback", &mut self.retired, &mut self.grew)?;
                let src = self.bufs[res.buf as usize].as_ref().ok_or_else(|| Error::Internal("a pass left a buffer it never allocated".into()))?;
                self.run.copy(src, 4 * res.off as u64, self.readback.as_ref().expect("ensured above"), 0, bytes)
            });
            if let Err(e) = copied {
                self.run.abandon();
                return Err(e);
            }
            if std::mem::take(&mut self.grew) {
                self.run.abandon();
                self.drop_chains();
                continue;
            }
            let chain = self.run.keep()?;
            if self.chains.len() == MAX_CHAINS {
                let old = self.chains.remove(0);
                self.run.free(old.chain);
            }
            self.chains.push(Kept { key, chain, out: res });
            return Ok(());
        }
        Err(Error::Internal("a pass kept outgrowing its device buffers".into()))
    }

    /// Copy rows 0..len of `region` into the host cache `kv` (decoded from the device's codec
    /// and re-encoded in the cache's): an empty one, or, for a split model, the session's own,
    /// which holds the later layers' rows already.
    pub fn read_rows(&mut self, region: usize, len: usize, kv: &mut KvCache) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        if self.recurrent() {
            return Err(Error::InvalidArgument(
                "a hybrid's device session keeps its recurrent state on the device and cannot move to host memory; start a host session and prefill it".into(),
            ));
        }
        let codec = self.regions.codec;
        if !kv.is_empty() && kv.len() != len {
            return Err(Error::Internal(format!("a host cache of {} rows for a device session of {len}", kv.len())));
        }
        kv.reserve(len)?;
        for slot in 0..self.regions.slots() {
            let (hd, nkv) = self.regions.heads(slot);
            let kvd = hd * nkv;
            let (ko, bytes) = self.regions.rows_bytes(region, slot, false, len);
            let (vo, _) = self.regions.rows_bytes(region, slot, true, len);
            let mut back = Buffer::new(&self.gpu, "hydrate", 2 * bytes, MemoryLocation::GpuToCpu)?;
            self.up.copy(&self.regions.buf, ko, &back, 0, bytes)?;
            self.up.copy(&self.regions.buf, vo, &back, bytes, bytes)?;
            self.up.submit()?;
            let row_bytes = bytes as usize / len;
            let mut k = vec![0f32; len * kvd];
            let mut v = vec![0f32; len * kvd];
            let mapped = back.mapped();
            for (x, src) in [(&mut k, &mapped[..bytes as usize]), (&mut v, &mapped[bytes as usize..2 * bytes as usize])] {
                for (row, out) in src.chunks_exact(row_bytes).zip(x.chunks_exact_mut(kvd)) {
                    decode_row(codec, row, hd, out);
                }
            }
            kv.write(slot, 0, &k, &v);
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
