//! KV storage: fixed pages of `page_rows` positions for every layer, a session's page table, the
//! shared pool that owns pages and recycles them, and the prefix cache of finished streams' pages.
//!
//! A page is reference-counted by `Arc`: session tables and the prefix cache hold it; when the last
//! holder lets go, its id returns to the pool. A hybrid's cached page can carry a snapshot of the
//! recurrent state after its last position (`RecSnapshot`), without which its K/V is no use. A page held by more than one holder is never written:
//! a session about to write into a shared page copies it first (copy-on-write). Rows are stored in
//! the pool's codec (`codec.rs`: f16 or q8_0).

pub(crate) mod codec;
pub use codec::KvCodec;

use crate::{Error, Result};
use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, Weak};

/// Positions per page of a session without a pool (its pages are private).
pub const PRIVATE_PAGE_ROWS: usize = 256;

pub struct Page {
    buf: UnsafeCell<Box<[u8]>>,
    /// Pool slot, returned to the pool when the page drops.
    slot: Option<(u32, Weak<PoolShared>)>,
    /// Where the buffer goes when the page drops.
    bin: Arc<PageBin>,
}

// SAFETY: a page is written only through `KvCache::append`, by the one session whose table holds
// the only reference to it (`Arc::strong_count == 1`, checked before every write, copy-on-write
// otherwise); every other access is a read.
unsafe impl Sync for Page {}
unsafe impl Send for Page {}

impl Drop for Page {
    fn drop(&mut self) {
        if let Some((slot, pool)) = &self.slot {
            if let Some(pool) = pool.upgrade() {
                pool.state.lock().unwrap_or_else(|e| e.into_inner()).free.push(*slot);
            }
        }
        self.bin.recycle(std::mem::take(self.buf.get_mut()));
    }
}

/// Buffers of dropped pages, for the next pages of the same size: a new session then writes to
/// memory that is already mapped instead of faulting in (and zeroing) fresh pages on the clock of
/// its first prompt. A recycled buffer keeps its old bytes; no row is read before it is written.
/// A runtime has one (`Runtime::pages`) for all its pools and private caches; two runtimes share
/// none.
#[derive(Default)]
pub struct PageBin {
    /// Bytes waiting, and the buffers.
    bin: Mutex<(usize, Vec<Box<[u8]>>)>,
}

/// At most this many bytes wait in a `PageBin`.
const RECYCLE_BYTES: usize = 64 << 20;

impl PageBin {
    pub fn new() -> Arc<PageBin> {
        Arc::new(PageBin::default())
    }

    /// Bytes waiting for reuse.
    pub fn bytes(&self) -> usize {
        self.bin.lock().unwrap_or_else(|e| e.into_inner()).0
    }

    fn recycle(&self, buf: Box<[u8]>) {
        let mut bin = self.bin.lock().unwrap_or_else(|e| e.into_inner());
        if !buf.is_empty() && bin.0 + buf.len() <= RECYCLE_BYTES {
            bin.0 += buf.len();
            bin.1.push(buf);
        }
    }

    fn reuse(&self, len: usize) -> Option<Box<[u8]>> {
        let mut bin = self.bin.lock().unwrap_or_else(|e| e.into_inner());
        let i = bin.1.iter().rposition(|b| b.len() == len)?;
        bin.0 -= len;
        Some(bin.1.swap_remove(i))
    }
}

impl Page {
    fn new(len: usize, slot: Option<(u32, Weak<PoolShared>)>, bin: &Arc<PageBin>) -> Arc<Page> {
        let buf = bin.reuse(len).unwrap_or_else(|| vec![0u8; len].into_boxed_slice());
        Arc::new(Page { buf: UnsafeCell::new(buf), slot, bin: bin.clone() })
    }

    fn data(&self) -> &[u8] {
        // SAFETY: see the Sync impl: no write is in progress while a shared reference is read.
        unsafe { &*self.buf.get() }
    }

    /// # Safety
    /// The caller holds the only reference to this page.
    #[allow(clippy::mut_from_ref)]
    unsafe fn data_mut(&self) -> &mut [u8] {
        &mut *self.buf.get()
    }
}

/// Geometry shared by a pool and its sessions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub n_layers: usize,
    pub kv_dim: usize,
    pub head_dim: usize,
    pub page_rows: usize,
    pub codec: KvCodec,
    /// Each K/V slot's own heads where slots differ (gemma4's sliding and full layers); None:
    /// every slot holds `kv_dim / head_dim` heads of `head_dim`.
    pub slots: Option<Arc<[Slot]>>,
}

/// One layer's K/V in a page of a geometry whose layers differ: `n_kv_heads` heads of
/// `head_dim`, K then V, from byte `offset` of the page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub head_dim: usize,
    pub n_kv_heads: usize,
    offset: usize,
}

impl Geometry {
    /// A page of layers with their own (head_dim, n_kv_heads) each, laid one after another.
    pub fn layered(layers: &[(usize, usize)], page_rows: usize, codec: KvCodec) -> Geometry {
        let mut offset = 0;
        let slots: Arc<[Slot]> = layers
            .iter()
            .map(|&(head_dim, n_kv_heads)| {
                let s = Slot { head_dim, n_kv_heads, offset };
                offset += 2 * page_rows * n_kv_heads * codec.bytes(head_dim);
                s
            })
            .collect();
        let (head_dim, n) = layers.iter().copied().max_by_key(|&(hd, n)| hd * n).unwrap_or((0, 0));
        Geometry { n_layers: layers.len(), kv_dim: head_dim * n, head_dim, page_rows, codec, slots: Some(slots) }
    }

    /// Slot `il`'s (head_dim, n_kv_heads).
    pub fn heads(&self, il: usize) -> (usize, usize) {
        match &self.slots {
            Some(s) => (s[il].head_dim, s[il].n_kv_heads),
            None => (self.head_dim, self.kv_dim / self.head_dim),
        }
    }
    fn head_bytes(&self, il: usize) -> usize {
        self.codec.bytes(self.heads(il).0)
    }
    /// Bytes of one page: every layer's K and V rows.
    pub fn page_bytes(&self) -> usize {
        match &self.slots {
            Some(s) => s.iter().map(|s| 2 * self.page_rows * s.n_kv_heads * self.codec.bytes(s.head_dim)).sum(),
            None => self.n_layers * 2 * self.page_rows * self.codec.bytes(self.kv_dim),
        }
    }
    /// Byte offset of (layer, K or V, KV head, row) inside a page. A head's rows are contiguous,
    /// so attention reads each head as one sequential stream the hardware prefetches.
    fn at(&self, il: usize, v: bool, h: usize, row: usize) -> usize {
        match &self.slots {
            Some(s) => {
                let s = s[il];
                let hb = self.codec.bytes(s.head_dim);
                s.offset + ((v as usize * s.n_kv_heads + h) * self.page_rows + row) * hb
            }
            None => {
                let heads = self.kv_dim / self.head_dim;
                (((il * 2 + v as usize) * heads + h) * self.page_rows + row) * self.head_bytes(il)
            }
        }
    }
}

struct CacheEntry {
    page: Arc<Page>,
    tokens: Vec<u32>,
    last_used: u64,
    /// The first page of a chain.
    first: bool,
    /// Its page's place in the chain (0 first).
    depth: usize,
    /// A hybrid's recurrent state after this page's last position (see `RecSnapshot`); dropped
    /// with the entry.
    snap: Option<Arc<RecSnapshot>>,
}

/// A hybrid's recurrent state after its first `pos` positions (a page boundary): every DeltaNet
/// layer's convolution inputs and state matrices, as the session had committed them. K/V pages
/// give an attention layer its past; a DeltaNet layer's past is this state alone, so the prefix
/// cache gives a hybrid's session cached pages only up to a page that carries one, and puts the
/// state back with them. A snapshot is as big as a session's whole state (on Qwen3.6-35B-A3B
/// about 60 MiB against a 16-row page's 0.3 MiB), so the cache keeps few: a session keeps the one
/// of the last page boundary it committed, and offers that one when it donates (the scheduler
/// makes a prompt's last boundary and every decode step's a pass end; `KvPool` bounds their number
/// and counts their bytes against its page budget).
pub struct RecSnapshot {
    pos: usize,
    conv: Vec<Vec<f32>>,
    ssm: Vec<Vec<f32>>,
}

impl RecSnapshot {
    /// The position the state follows.
    pub fn pos(&self) -> usize {
        self.pos
    }
    pub fn bytes(&self) -> usize {
        4 * self.conv.iter().chain(&self.ssm).map(Vec::len).sum::<usize>()
    }
}

struct PoolState {
    free: Vec<u32>,
    created: u32,
    cache: HashMap<u64, CacheEntry>,
    clock: u64,
    hits: u64,
    /// Cached recurrent-state snapshots: how many, their bytes, and how many the cache keeps at
    /// most (0: none; `KvPool::keep_snapshots`).
    snaps: usize,
    snap_bytes: usize,
    max_snaps: usize,
    /// Hybrid prompts whose first cached page matched but no matched page carried a snapshot.
    stateless: u64,
}

impl PoolState {
    /// Take an entry out of the cache (its page and snapshot drop with it, after the lock).
    fn remove(&mut self, k: u64) -> CacheEntry {
        let e = self.cache.remove(&k).expect("the key is in the cache");
        if let Some(s) = &e.snap {
            self.snaps -= 1;
            self.snap_bytes -= s.bytes();
        }
        e
    }

    /// The least recently used entry whose page no session holds; of pages used together (a
    /// chain), the deepest first, so that a chain is cut from its end, not stranded behind a gap.
    fn victim(&self) -> Option<u64> {
        self.cache.iter().filter(|(_, e)| Arc::strong_count(&e.page) == 1).min_by_key(|(_, e)| (e.last_used, std::cmp::Reverse(e.depth))).map(|(k, _)| *k)
    }

    /// What the cache holds in pages: its pages, and its snapshots' bytes in pages of `page_bytes`.
    fn held(&self, page_bytes: usize) -> usize {
        self.cache.len() + self.snap_bytes.div_ceil(page_bytes.max(1))
    }
}

pub struct PoolShared {
    geo: Geometry,
    max_pages: u32,
    /// Cached pages kept at most (0: as many as the pool has room for).
    max_cached: usize,
    state: Mutex<PoolState>,
    bin: Arc<PageBin>,
}

/// The paged KV pool. Cheap to clone (a handle).
#[derive(Clone)]
pub struct KvPool(Arc<PoolShared>);

#[derive(Clone, Debug, Default)]
pub struct PoolStats {
    pub pages_total: usize,
    pub pages_free: usize,
    pub pages_used: usize,
    pub pages_shared: usize,
    pub pages_cached: usize,
    pub bytes_per_page: usize,
    pub bytes_allocated: usize,
    pub cache_chains: usize,
    pub cache_hits: u64,
    /// Recurrent-state snapshots the cache holds (hybrids), and their bytes.
    pub snapshots: usize,
    pub snapshot_bytes: usize,
    /// Hybrid prompts that matched cached pages none of which carried a snapshot (prefilled whole).
    pub cache_stateless: u64,
}

fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl KvPool {
    /// A pool of at most `max_pages` pages of `geo`, whose dropped pages' buffers go to `bin`.
    pub fn new(geo: Geometry, max_pages: usize, max_cached: usize, bin: &Arc<PageBin>) -> Result<KvPool> {
        if geo.page_rows == 0 || max_pages == 0 {
            return Err(Error::InvalidArgument("a KV pool needs page_rows >= 1 and at least one page".into()));
        }
        Ok(KvPool(Arc::new(PoolShared {
            geo,
            max_pages: max_pages.min(u32::MAX as usize) as u32,
            max_cached,
            state: Mutex::new(PoolState {
                free: Vec::new(),
                created: 0,
                cache: HashMap::new(),
                clock: 0,
                hits: 0,
                snaps: 0,
                snap_bytes: 0,
                max_snaps: 0,
                stateless: 0,
            }),
            bin: bin.clone(),
        })))
    }

    pub fn geometry(&self) -> Geometry {
        self.0.geo.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.0.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A fresh page, evicting least-recently-used cached pages nobody else holds if the pool is full.
    fn alloc(&self) -> Result<Arc<Page>> {
        loop {
            let mut evicted = Vec::new();
            {
                let mut st = self.lock();
                let slot = if let Some(s) = st.free.pop() {
                    Some(s)
                } else if st.created < self.0.max_pages {
                    st.created += 1;
                    Some(st.created - 1)
                } else {
                    None
                };
                if let Some(slot) = slot {
                    drop(st);
                    return Ok(Page::new(self.0.geo.page_bytes(), Some((slot, Arc::downgrade(&self.0))), &self.0.bin));
                }
                // Evict the least recently used cached page no session holds; its drop (after
                // the lock is released) returns its slot.
                match st.victim() {
                    Some(k) => evicted.push(st.remove(k)),
                    None => {
                        return Err(Error::PoolFull(format!(
                            "the KV pool is full ({} pages of {} positions, all in use); use fewer streams or a bigger pool",
                            self.0.max_pages, self.0.geo.page_rows
                        )))
                    }
                }
            }
            drop(evicted);
        }
    }

    /// Offer a finished stream's full pages (covering `tokens`) to the prefix cache. A hybrid's
    /// session offers its pages up to the last page boundary it kept a snapshot of, with that
    /// snapshot (the pages past it would be no use without the state there), and none if the
    /// cache keeps no snapshots.
    pub fn donate(&self, kv: &KvCache, tokens: &[u32]) {
        let r = self.0.geo.page_rows;
        let full = kv.len().min(tokens.len()) / r;
        let (full, snap) = match &kv.rec {
            None => (full, None),
            Some(rec) => match &rec.mark {
                Some(s) if s.pos <= full * r => (s.pos / r, Some(s.clone())),
                _ => return,
            },
        };
        let mut dropped = Vec::new();
        {
            let mut st = self.lock();
            if snap.is_some() && st.max_snaps == 0 {
                return;
            }
            st.clock += 1;
            let now = st.clock;
            let mut parent = kv.owner;
            for (i, page) in kv.pages.iter().take(full).enumerate() {
                let toks = &tokens[i * r..(i + 1) * r];
                let h = chain_hash(parent, toks);
                st.cache.entry(h).and_modify(|e| e.last_used = now).or_insert_with(|| CacheEntry {
                    page: page.clone(),
                    tokens: toks.to_vec(),
                    last_used: now,
                    first: i == 0,
                    depth: i,
                    snap: None,
                });
                parent = h;
            }
            // The snapshot goes with the page that ends where it was taken (one there already is
            // the same state: the same model after the same tokens).
            if let Some(s) = snap {
                let e = st.cache.get_mut(&parent).expect("the last page was just cached");
                if e.snap.is_none() {
                    let b = s.bytes();
                    e.snap = Some(s);
                    st.snaps += 1;
                    st.snap_bytes += b;
                }
            }
            // Beyond the limit, the least recently used snapshots go (their pages stay, good
            // for the snapshots deeper in their chains).
            while st.snaps > st.max_snaps {
                let Some(k) = st.cache.iter().filter(|(_, e)| e.snap.is_some()).min_by_key(|(_, e)| e.last_used).map(|(k, _)| *k) else { break };
                let s = st.cache.get_mut(&k).and_then(|e| e.snap.take()).expect("an entry with a snapshot");
                st.snaps -= 1;
                st.snap_bytes -= s.bytes();
                dropped.push(s);
            }
        }
        drop(dropped);
        self.trim();
    }

    /// Keep at most `n` recurrent-state snapshots in the cache (0, the default: none, and so no
    /// hybrid's pages either). The scheduler sets this for a hybrid's pool.
    pub fn keep_snapshots(&self, n: usize) {
        self.lock().max_snaps = n;
    }

    /// Forget every cached page and snapshot (pages sessions hold stay theirs); a later prompt
    /// attaches nothing donated before.
    pub fn clear_cache(&self) {
        let evicted = {
            let mut st = self.lock();
            (st.snaps, st.snap_bytes) = (0, 0);
            std::mem::take(&mut st.cache)
        };
        drop(evicted);
    }

    /// Enforce the cache's page limit (snapshots count as the pages their bytes would fill),
    /// evicting least recently used pages no session holds, with their snapshots. A page a
    /// session still holds stays until a later trim.
    pub fn trim(&self) {
        if self.0.max_cached == 0 {
            return;
        }
        let page_bytes = self.0.geo.page_bytes();
        let mut evicted = Vec::new();
        {
            let mut st = self.lock();
            while st.held(page_bytes) > self.0.max_cached {
                let Some(k) = st.victim() else { break };
                evicted.push(st.remove(k));
            }
        }
        drop(evicted);
    }

    /// Attach the longest cached chain of whole pages matching `prompt[..limit]` to `kv` (which
    /// must be empty). Returns the number of positions attached. A hybrid's session takes the
    /// chain only up to its deepest page that carries a recurrent-state snapshot, and that state.
    pub fn attach(&self, kv: &mut KvCache, prompt: &[u32], limit: usize) -> usize {
        self.attach_matched(kv, prompt, limit).0
    }

    /// `attach`, and how many positions of cached pages matched (more than attached where a
    /// hybrid's matched pages past the deepest snapshot had none: a pass ending there would
    /// leave the state the next prompt with that prefix needs).
    pub fn attach_matched(&self, kv: &mut KvCache, prompt: &[u32], limit: usize) -> (usize, usize) {
        assert!(kv.is_empty(), "attach needs an empty session");
        let r = self.0.geo.page_rows;
        let mut st = self.lock();
        st.clock += 1;
        let now = st.clock;
        // Chains start from the owner: a page (or state) of another model never matches.
        let mut parent = kv.owner;
        let mut chain = Vec::new();
        for i in 0..limit.min(prompt.len()) / r {
            let toks = &prompt[i * r..(i + 1) * r];
            let h = chain_hash(parent, toks);
            match st.cache.get(&h) {
                Some(e) if e.tokens == toks => chain.push(h),
                _ => break,
            }
            parent = h;
        }
        let matched = chain.len() * r;
        let mut snap = None;
        if let Some(rec) = &kv.rec {
            // The deepest page whose snapshot fits this session's layers.
            let fits = |s: &RecSnapshot| {
                s.conv.len() == rec.sizes.len() && rec.sizes.iter().zip(s.conv.iter().zip(&s.ssm)).all(|(&(c, m), (sc, sm))| sc.len() == c && sm.len() == m)
            };
            let deepest = chain.iter().rposition(|h| st.cache[h].snap.as_deref().is_some_and(fits));
            if deepest.is_none() && !chain.is_empty() {
                st.stateless += 1;
            }
            chain.truncate(deepest.map_or(0, |d| d + 1));
            snap = chain.last().and_then(|h| st.cache[h].snap.clone());
        }
        for h in &chain {
            let e = st.cache.get_mut(h).expect("matched above");
            e.last_used = now;
            kv.pages.push(e.page.clone());
        }
        let got = chain.len() * r;
        if got > 0 {
            st.hits += 1;
        }
        drop(st);
        kv.len = got;
        if let Some(s) = snap {
            kv.restore(s);
        }
        (got, matched)
    }

    pub fn stats(&self) -> PoolStats {
        let st = self.lock();
        let geo = &self.0.geo;
        let cached_in_use = st.cache.values().filter(|e| Arc::strong_count(&e.page) > 1).count();
        let live = st.created as usize - st.free.len();
        let bytes_per_page = geo.page_bytes();
        PoolStats {
            pages_total: self.0.max_pages as usize,
            pages_free: self.0.max_pages as usize - live,
            pages_used: live,
            pages_shared: cached_in_use,
            pages_cached: st.cache.len(),
            bytes_per_page,
            bytes_allocated: live * bytes_per_page,
            cache_chains: st.cache.values().filter(|e| e.first).count(),
            cache_hits: st.hits,
            snapshots: st.snaps,
            snapshot_bytes: st.snap_bytes,
            cache_stateless: st.stateless,
        }
    }
}

/// One session's KV: a table of pages (its own or the pool's) and the number of positions held,
/// and, for a hybrid model, the recurrent state of its DeltaNet layers.
pub struct KvCache {
    geo: Geometry,
    len: usize,
    pages: Vec<Arc<Page>>,
    pool: Option<KvPool>,
    rec: Option<RecState>,
    /// Whose K/V this is (`Model::uid`; 0 unknown): the prefix cache's chains start from it.
    owner: u64,
    /// Where private pages come from (a paged cache's come from its pool).
    bin: Arc<PageBin>,
    /// Images on M-RoPE axes in these rows: they set the rows' rotary positions.
    grids: Grids,
}

/// An image laid out on M-RoPE's axes (Qwen-VL, as llama.cpp's mtmd does it): its `nx` x `ny`
/// rows from row `at` all take the time position of row `at`, and their row and column added to
/// it on the height and width axes; the text after it goes on from that position plus
/// max(nx, ny), not from its row index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    pub at: usize,
    pub nx: usize,
    pub ny: usize,
}

/// The images on M-RoPE axes in a session's rows, in order (`Grid`): they set the rows' rotary
/// positions, which are then no longer the row indices. Host and device K/V keep them alike.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Grids(Vec<Grid>);

impl Grids {
    /// Record an image at its rows; it replaces any recorded from its first row on, so
    /// recording a prompt's images again in order is harmless.
    pub fn add(&mut self, g: Grid) {
        self.0.retain(|o| o.at < g.at);
        self.0.push(g);
    }

    /// Forget the images that start at or past row `len`.
    pub fn truncate(&mut self, len: usize) {
        self.0.retain(|g| g.at < len);
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }

    pub fn as_slice(&self) -> &[Grid] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Row `row`'s position on the time, height and width axes: the row index where no image
    /// is recorded before it (the same on all three), else as `Grid` says.
    pub fn pos(&self, row: usize) -> [usize; 3] {
        let mut shift = 0isize;
        for g in &self.0 {
            if row < g.at {
                break;
            }
            let (t0, n) = ((g.at as isize + shift) as usize, g.nx * g.ny);
            if row < g.at + n {
                let i = row - g.at;
                return [t0, t0 + i / g.nx, t0 + i % g.nx];
            }
            shift += g.nx.max(g.ny) as isize - n as isize;
        }
        [(row as isize + shift) as usize; 3]
    }
}

/// The recurrent state of a session's DeltaNet layers after its `len` positions: per layer the
/// convolution's last inputs and every value head's state matrix, in f32. It has two copies: a
/// pass reads the committed one and writes the other, and `commit` makes the written one current,
/// so a pass that fails midway leaves the session as it was (as K/V rows past `len` do). Unlike
/// K/V it cannot go back to an earlier position by forgetting rows: it is the sum of every
/// position so far. It goes back by replay instead (`Journal`).
pub struct RecState {
    /// (conv, ssm) floats of each layer.
    sizes: Vec<(usize, usize)>,
    /// Per layer, [copy 0, copy 1] of each; empty until the first pass (all zeros).
    conv: Vec<[Vec<f32>; 2]>,
    ssm: Vec<[Vec<f32>; 2]>,
    /// The committed copy.
    cur: usize,
    journal: Journal,
    /// Keep a snapshot of the committed state at every page boundary a pass ends on (for the
    /// prefix cache), and the last one kept (dropped when the session goes back before it).
    marks: bool,
    mark: Option<Arc<RecSnapshot>>,
}

/// How a hybrid's session takes back rows of its last pass (a speculative verify chunk whose
/// later drafts were rejected). Keeping a copy of the whole state after every row of the chunk
/// would cost k+1 state copies a step (megabytes per layer on real models); instead the pass
/// records each DeltaNet layer's raw inputs of those rows (the Q/K/V projection before the
/// convolution, beta and alpha: a few thousand floats a row), and the state before the pass is
/// still there, in the copy the pass did not write. Going back to m rows replays the recurrence
/// over the first m recorded rows from that copy, with the very arithmetic of the pass (rows are
/// computed alike however they are split into passes), so the result is the state plain
/// decoding of those m rows would have left.
#[derive(Default)]
struct Journal {
    /// The first recorded position, and how many rows from there can be replayed.
    from: usize,
    rows: usize,
    /// Recorded by the pass now running (`commit` makes it the one to replay)...
    fresh: bool,
    /// ...and by the last committed pass: only then is the state before it the other copy.
    valid: bool,
    /// Per DeltaNet layer: rows of raw Q/K/V (conv_dim each), beta and alpha (n_v each).
    layers: Vec<[Vec<f32>; 3]>,
}

/// One layer's recurrent state in a pass: the committed copy to read and the other to write.
pub struct RecIo<'a> {
    pub conv_in: &'a [f32],
    pub conv_out: &'a mut [f32],
    pub ssm_in: &'a [f32],
    pub ssm_out: &'a mut [f32],
}

impl RecState {
    fn grow(&mut self) {
        if self.conv.is_empty() {
            self.conv = self.sizes.iter().map(|&(c, _)| [vec![0.0; c], vec![0.0; c]]).collect();
            self.ssm = self.sizes.iter().map(|&(_, s)| [vec![0.0; s], vec![0.0; s]]).collect();
            self.cur = 0;
        }
    }

    /// Bytes this state takes once a session has run (both copies).
    pub fn bytes(&self) -> usize {
        self.sizes.iter().map(|&(c, s)| 2 * 4 * (c + s)).sum()
    }

    /// The position of the last page-boundary snapshot this session kept, if any.
    pub fn mark_pos(&self) -> Option<usize> {
        self.mark.as_ref().map(|s| s.pos)
    }

    /// Keep the committed state as the snapshot at `pos`, reusing the last one's buffers where
    /// the cache does not hold it.
    fn take_mark(&mut self, pos: usize) {
        if self.conv.is_empty() {
            return;
        }
        let cur = self.cur;
        let mut m = self.mark.take().and_then(|a| Arc::try_unwrap(a).ok()).unwrap_or(RecSnapshot { pos, conv: Vec::new(), ssm: Vec::new() });
        m.pos = pos;
        for (dst, src) in [(&mut m.conv, &self.conv), (&mut m.ssm, &self.ssm)] {
            dst.resize_with(src.len(), Vec::new);
            for (d, s) in dst.iter_mut().zip(src) {
                d.clear();
                d.extend_from_slice(&s[cur]);
            }
        }
        self.mark = Some(Arc::new(m));
    }
}

/// Read access to one layer of a session's KV during attention.
pub struct LayerView<'a> {
    cache: &'a KvCache,
    il: usize,
}

impl LayerView<'_> {
    pub fn codec(&self) -> KvCodec {
        self.cache.geo.codec
    }
    /// K (or V) of KV head `h` at positions `from..to`, as runs of consecutive rows that share a
    /// page: (first position of the run, the run's bytes, contiguous).
    pub fn rows(&self, v: bool, h: usize, from: usize, to: usize) -> impl Iterator<Item = (usize, &[u8])> + '_ {
        let g = &self.cache.geo;
        let hb = g.head_bytes(self.il);
        let mut pos = from;
        std::iter::from_fn(move || {
            if pos >= to {
                return None;
            }
            let end = to.min((pos / g.page_rows + 1) * g.page_rows);
            let at = g.at(self.il, v, h, pos % g.page_rows);
            let run = (pos, &self.cache.pages[pos / g.page_rows].data()[at..at + (end - pos) * hb]);
            pos = end;
            Some(run)
        })
    }
}

impl KvCache {
    /// A session's private store of `geo` (its pages grown on demand, their buffers from `bin`).
    pub fn private(geo: Geometry, bin: &Arc<PageBin>) -> Self {
        KvCache { geo, len: 0, pages: Vec::new(), pool: None, rec: None, owner: 0, bin: bin.clone(), grids: Grids::default() }
    }

    pub fn paged(pool: &KvPool) -> Self {
        KvCache {
            geo: pool.geometry(),
            len: 0,
            pages: Vec::new(),
            pool: Some(pool.clone()),
            rec: None,
            owner: 0,
            bin: pool.0.bin.clone(),
            grids: Grids::default(),
        }
    }

    /// Mark this K/V as `owner`'s (a model's `uid`), so that the prefix cache never gives it
    /// another model's pages or state.
    pub fn owned_by(mut self, owner: u64) -> Self {
        self.owner = owner;
        self
    }

    /// For the prefix cache: a hybrid's session keeps a snapshot of its recurrent state at every
    /// page boundary a pass ends on (the last one only; `RecSnapshot`). No-op without a state.
    pub fn keep_marks(&mut self) {
        if let Some(r) = &mut self.rec {
            r.marks = true;
        }
    }

    /// Take the state of a cached snapshot at its position (`attach` has put the pages up to it
    /// in the table): it becomes the committed state, with nothing recorded to go back over.
    fn restore(&mut self, snap: Arc<RecSnapshot>) {
        let r = self.rec.as_mut().expect("a snapshot restores a recurrent state");
        r.grow();
        let cur = r.cur;
        for (dst, src) in r.conv.iter_mut().zip(&snap.conv).chain(r.ssm.iter_mut().zip(&snap.ssm)) {
            dst[cur].copy_from_slice(src);
        }
        r.journal = Journal::default();
        debug_assert_eq!(snap.pos, self.len);
        if r.marks {
            r.mark = Some(snap);
        }
    }

    /// After the session moved to `len`: forget a snapshot past it, and keep one at it if it is
    /// a page boundary.
    fn mark(&mut self) {
        let (len, rows) = (self.len, self.geo.page_rows);
        let Some(r) = self.rec.as_mut().filter(|r| r.marks) else { return };
        if r.mark.as_ref().is_some_and(|m| m.pos > len) {
            r.mark = None;
        }
        if len > 0 && len % rows == 0 && r.mark_pos() != Some(len) {
            r.take_mark(len);
        }
    }

    /// Keep a recurrent state of these (conv, ssm) sizes per DeltaNet layer beside the pages
    /// (none: a model of attention layers only). Allocated at the first pass, freed on release.
    pub fn with_recurrent(mut self, sizes: Vec<(usize, usize)>) -> Self {
        if !sizes.is_empty() {
            self.rec = Some(RecState { sizes, conv: Vec::new(), ssm: Vec::new(), cur: 0, journal: Journal::default(), marks: false, mark: None });
        }
        self
    }

    /// Whether this session keeps a recurrent state (a hybrid model's).
    pub fn recurrent(&self) -> bool {
        self.rec.is_some()
    }

    /// The recurrent state, if any.
    pub fn rec_state(&self) -> Option<&RecState> {
        self.rec.as_ref()
    }

    /// DeltaNet layer `slot`'s state for a pass (after `reserve`).
    pub(crate) fn rec_io(&mut self, slot: usize) -> RecIo<'_> {
        let r = self.rec.as_mut().expect("a DeltaNet layer's session keeps a recurrent state");
        let cur = r.cur;
        let [c0, c1] = &mut r.conv[slot];
        let [s0, s1] = &mut r.ssm[slot];
        let ((ci, co), (si, so)) = if cur == 0 { ((&*c0, c1), (&*s0, s1)) } else { ((&*c1, c0), (&*s1, s0)) };
        RecIo { conv_in: ci, conv_out: co, ssm_in: si, ssm_out: so }
    }

    /// Record DeltaNet layer `slot`'s raw inputs of this pass's `rows` rows (see `Journal`), so
    /// that the session can go back to any position inside them.
    pub(crate) fn journal(&mut self, slot: usize, qkv: &[f32], beta: &[f32], alpha: &[f32], rows: usize) {
        let len = self.len;
        let r = self.rec.as_mut().expect("a DeltaNet layer's session keeps a recurrent state");
        let j = &mut r.journal;
        if !j.fresh {
            j.fresh = true;
            j.from = len;
            j.rows = rows;
            j.layers.resize_with(r.sizes.len(), Default::default);
        }
        for (v, src) in j.layers[slot].iter_mut().zip([qkv, beta, alpha]) {
            v.clear();
            v.extend_from_slice(src);
        }
    }

    /// The earliest position this session can go back to: 0 for attention only, else the first
    /// row its last pass recorded (its length if that pass recorded none).
    pub fn rewind_floor(&self) -> usize {
        match &self.rec {
            None => 0,
            Some(r) if r.journal.valid => r.journal.from,
            Some(_) => self.len,
        }
    }

    /// Go back to `pos` (at least `rewind_floor`): K/V past it is forgotten as by `truncate`, and
    /// each DeltaNet layer's state is rebuilt from the state before the last pass by
    /// `replay(slot, state, raw Q/K/V, beta, alpha, rows)` over the recorded rows it keeps.
    pub(crate) fn rewind(&mut self, pos: usize, mut replay: impl FnMut(usize, RecIo<'_>, &[f32], &[f32], &[f32], usize)) {
        if pos >= self.len {
            return;
        }
        if let Some(r) = &mut self.rec {
            let j = &mut r.journal;
            assert!(j.valid && pos >= j.from, "a recurrent state cannot go back from position {} to {pos}: its last pass recorded no rows before it", self.len);
            let keep = pos - j.from;
            if keep == 0 {
                // The state before the pass is the other copy: make it the committed one again.
                r.cur ^= 1;
            } else {
                let cur = r.cur;
                for slot in 0..r.sizes.len() {
                    let [c0, c1] = &mut r.conv[slot];
                    let [s0, s1] = &mut r.ssm[slot];
                    // Read the copy before the pass, overwrite the committed one.
                    let ((ci, co), (si, so)) = if cur == 0 { ((&*c1, c0), (&*s1, s0)) } else { ((&*c0, c1), (&*s0, s1)) };
                    let [q, b, a] = &j.layers[slot];
                    let (wq, wb) = (q.len() / j.rows, b.len() / j.rows);
                    replay(slot, RecIo { conv_in: ci, conv_out: co, ssm_in: si, ssm_out: so }, &q[..keep * wq], &b[..keep * wb], &a[..keep * wb], keep);
                }
            }
            j.rows = keep;
        }
        self.len = pos;
        self.pages.truncate(pos.div_ceil(self.geo.page_rows));
        self.mark();
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn new_page(&self) -> Result<Arc<Page>> {
        match &self.pool {
            Some(p) => p.alloc(),
            None => Ok(Page::new(self.geo.page_bytes(), None, &self.bin)),
        }
    }

    /// Make room for positions up to `positions` (exclusive), and make sure the pages those
    /// positions will be written to are this session's alone. On error nothing has changed that
    /// matters: extra pages are simply held until release.
    pub(crate) fn reserve(&mut self, positions: usize) -> Result<()> {
        if let Some(rec) = &mut self.rec {
            rec.grow();
            // What a pass that failed midway recorded is not the next pass's.
            rec.journal.fresh = false;
        }
        let r = self.geo.page_rows;
        while self.pages.len() * r < positions {
            let p = self.new_page()?;
            self.pages.push(p);
        }
        // Copy-on-write: the first page to be written may be shared with the prefix cache.
        for pi in self.len / r..positions.div_ceil(r) {
            if Arc::strong_count(&self.pages[pi]) > 1 {
                let fresh = self.new_page()?;
                // SAFETY: `fresh` was just created and is referenced only here.
                unsafe { fresh.data_mut().copy_from_slice(self.pages[pi].data()) };
                self.pages[pi] = fresh;
            }
        }
        Ok(())
    }

    /// Write rows for layer `il` at positions len.. (made exclusive by `reserve`).
    pub(crate) fn append(&mut self, il: usize, k: &[f32], v: &[f32]) {
        self.write(il, self.len, k, v);
    }

    /// Write rows for layer `il` at positions `from`.. (reserved and this cache's alone).
    pub(crate) fn write(&mut self, il: usize, from: usize, k: &[f32], v: &[f32]) {
        let g = &self.geo;
        let (hd, heads) = g.heads(il);
        for (j, (kr, vr)) in k.chunks_exact(hd * heads).zip(v.chunks_exact(hd * heads)).enumerate() {
            let pos = from + j;
            let page = &self.pages[pos / g.page_rows];
            assert_eq!(Arc::strong_count(page), 1, "writing into a shared KV page");
            // SAFETY: the assert above: this session holds the only reference to the page.
            let data = unsafe { page.data_mut() };
            let (row, hb) = (pos % g.page_rows, g.head_bytes(il));
            for (h, (kh, vh)) in kr.chunks_exact(hd).zip(vr.chunks_exact(hd)).enumerate() {
                let (ka, va) = (g.at(il, false, h, row), g.at(il, true, h, row));
                g.codec.encode(kh, &mut data[ka..ka + hb]);
                g.codec.encode(vh, &mut data[va..va + hb]);
            }
        }
    }

    /// The pass that wrote positions up to `len` succeeded: they count, and the recurrent state
    /// it wrote becomes the committed one.
    pub(crate) fn commit(&mut self, len: usize) {
        if len > self.len {
            if let Some(r) = &mut self.rec {
                r.cur ^= 1;
                r.journal.valid = r.journal.fresh;
                r.journal.fresh = false;
            }
            self.len = len;
            self.mark();
        }
        self.len = len;
    }

    pub(crate) fn layer(&self, il: usize) -> LayerView<'_> {
        LayerView { cache: self, il }
    }

    /// Forget positions from `pos` on (pages past it go back; a later write into a page still
    /// shared is copied first). A recurrent state cannot go back by forgetting rows, so a hybrid's
    /// session only truncates at or past its length here (`model::forward::rewind` replays).
    pub fn truncate(&mut self, pos: usize) {
        assert!(self.rec.is_none() || pos >= self.len, "a recurrent state cannot go back from position {} to {pos}", self.len);
        self.len = self.len.min(pos);
        self.pages.truncate(self.len.div_ceil(self.geo.page_rows));
        self.grids.truncate(self.len);
    }

    /// Record an image on M-RoPE axes at its rows (`Grids::add`).
    pub fn add_grid(&mut self, g: Grid) {
        self.grids.add(g);
    }

    /// The images recorded on M-RoPE axes.
    pub fn grids(&self) -> &Grids {
        &self.grids
    }

    /// Row `row`'s position on the M-RoPE axes (`Grids::pos`).
    pub fn mrope_pos(&self, row: usize) -> [usize; 3] {
        self.grids.pos(row)
    }

    /// Forget every position and give all pages back.
    pub fn release(&mut self) {
        self.len = 0;
        self.pages.clear();
        self.grids.clear();
        if let Some(r) = &mut self.rec {
            (r.conv, r.ssm) = (Vec::new(), Vec::new());
            r.journal = Journal::default();
            r.mark = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(kv: &mut KvCache, n: usize, base: f32) {
        let g = kv.geo.clone();
        let len = kv.len();
        kv.reserve(len + n).unwrap();
        for il in 0..g.n_layers {
            let k: Vec<f32> = (0..n * g.kv_dim).map(|i| base + i as f32).collect();
            kv.append(il, &k, &k);
        }
        kv.commit(len + n);
    }

    #[test]
    fn shared_pages_are_copied_before_a_write_and_slots_come_back() {
        let geo = Geometry { n_layers: 2, kv_dim: 4, head_dim: 4, page_rows: 4, codec: KvCodec::F16, slots: None };
        let pool = KvPool::new(geo, 8, 0, &PageBin::new()).unwrap();
        let mut a = KvCache::paged(&pool);
        fill(&mut a, 8, 1.0);
        let toks: Vec<u32> = (0..8).collect();
        pool.donate(&a, &toks);
        let mut b = KvCache::paged(&pool);
        assert_eq!(pool.attach(&mut b, &toks, 7), 4, "one whole page, capped short of the prompt");
        // Layer `il`'s K of head 0 at `pos`.
        let k = |kv: &KvCache, il: usize, pos: usize| kv.layer(il).rows(false, 0, pos, pos + 1).next().unwrap().1.to_vec();
        let first = |kv: &KvCache, pos: usize| {
            let mut v = [0.0f32; 4];
            KvCodec::F16.decode(&k(kv, 0, pos), &mut v);
            v[0]
        };
        assert_eq!(k(&b, 1, 2), k(&a, 1, 2));
        b.truncate(2);
        fill(&mut b, 1, 100.0); // position 2 lies in the shared page: copy-on-write
        assert_eq!(first(&b, 2), 100.0);
        assert_eq!(first(&a, 2), 1.0 + 8.0);
        assert_eq!(k(&b, 0, 1), k(&a, 0, 1));
        drop(a);
        b.release();
        let st = pool.stats();
        assert_eq!(st.pages_free + st.pages_cached, st.pages_total, "{st:?}");
    }

    #[test]
    fn a_dropped_page_goes_back_to_its_own_bin_only() {
        let geo = Geometry::layered(&[(4, 2), (8, 1)], 2, KvCodec::F16);
        let page = geo.page_bytes();
        let (a, b) = (PageBin::new(), PageBin::new());
        let mut kv = KvCache::private(geo.clone(), &a);
        kv.reserve(3).unwrap();
        drop(kv);
        assert_eq!((a.bytes(), b.bytes()), (2 * page, 0), "two pages back in their own bin");
        let pool = KvPool::new(geo.clone(), 4, 0, &b).unwrap();
        let mut kv = KvCache::paged(&pool);
        kv.reserve(1).unwrap();
        assert_eq!(a.bytes(), 2 * page, "the other runtime's bin is not drawn from");
        let mut mine = KvCache::private(geo, &a);
        mine.reserve(1).unwrap();
        assert_eq!(a.bytes(), page, "a page of the same bin reuses a buffer");
        drop(kv);
        assert_eq!(b.bytes(), page);
    }

    #[test]
    fn images_on_mrope_axes_place_their_rows_and_the_text_after() {
        let geo = Geometry::layered(&[(4, 2)], 4, KvCodec::F16);
        let mut kv = KvCache::private(geo, &PageBin::new());
        assert_eq!(kv.mrope_pos(7), [7; 3]);
        // 3 text rows, a 4 x 2 image (8 rows, 4 positions), then text; a 1 x 3 image at row 13.
        kv.add_grid(Grid { at: 3, nx: 4, ny: 2 });
        kv.add_grid(Grid { at: 13, nx: 1, ny: 3 });
        assert_eq!(kv.mrope_pos(2), [2; 3]);
        assert_eq!(kv.mrope_pos(3), [3, 3, 3]);
        assert_eq!(kv.mrope_pos(6), [3, 3, 6]);
        assert_eq!(kv.mrope_pos(7), [3, 4, 3]);
        assert_eq!(kv.mrope_pos(10), [3, 4, 6]);
        assert_eq!(kv.mrope_pos(11), [7; 3]);
        assert_eq!(kv.mrope_pos(13), [9, 9, 9]);
        assert_eq!(kv.mrope_pos(15), [9, 11, 9]);
        assert_eq!(kv.mrope_pos(16), [12; 3]);
        // Going back before an image forgets it; recording one again replaces those after it.
        fill(&mut kv, 16, 0.0);
        kv.truncate(13);
        assert_eq!(kv.grids().as_slice(), &[Grid { at: 3, nx: 4, ny: 2 }]);
        kv.add_grid(Grid { at: 13, nx: 1, ny: 3 });
        kv.add_grid(Grid { at: 3, nx: 2, ny: 4 });
        assert_eq!(kv.grids().as_slice(), &[Grid { at: 3, nx: 2, ny: 4 }]);
        assert_eq!(kv.mrope_pos(11), [7; 3]);
        kv.release();
        assert!(kv.grids().is_empty());
    }

    #[test]
    fn layers_of_their_own_heads_keep_their_rows_apart() {
        // Slot 0: 2 heads of 4; slot 1: 1 head of 8 (gemma4's sliding and full layers).
        let geo = Geometry::layered(&[(4, 2), (8, 1)], 2, KvCodec::F16);
        assert_eq!(geo.page_bytes(), 2 * 2 * (8 + 8) * 2);
        let mut kv = KvCache::private(geo, &PageBin::new());
        kv.reserve(3).unwrap();
        let a: Vec<f32> = (0..3 * 8).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..3 * 8).map(|i| 100.0 + i as f32).collect();
        kv.append(0, &a, &b);
        kv.append(1, &b, &a);
        kv.commit(3);
        let row = |il: usize, v: bool, h: usize, pos: usize, n: usize| {
            let mut out = vec![0.0f32; n];
            KvCodec::F16.decode(kv.layer(il).rows(v, h, pos, pos + 1).next().unwrap().1, &mut out);
            out
        };
        assert_eq!(row(0, false, 1, 2, 4), [20.0, 21.0, 22.0, 23.0]);
        assert_eq!(row(0, true, 0, 1, 4), [108.0, 109.0, 110.0, 111.0]);
        assert_eq!(row(1, false, 0, 2, 8), (116..124).map(|i| i as f32).collect::<Vec<_>>());
        assert_eq!(row(1, true, 0, 0, 8), (0..8).map(|i| i as f32).collect::<Vec<_>>());
    }

    #[test]
    fn a_full_pool_evicts_cached_pages_then_refuses() {
        let geo = Geometry { n_layers: 1, kv_dim: 2, head_dim: 2, page_rows: 2, codec: KvCodec::F16, slots: None };
        let pool = KvPool::new(geo, 2, 0, &PageBin::new()).unwrap();
        let mut a = KvCache::paged(&pool);
        fill(&mut a, 4, 0.0);
        pool.donate(&a, &[1, 2, 3, 4]);
        a.release();
        let mut b = KvCache::paged(&pool);
        fill(&mut b, 4, 0.0); // both pages come from evicting the cache
        assert_eq!(pool.stats().pages_cached, 0);
        let mut c = KvCache::paged(&pool);
        assert!(c.reserve(1).is_err());
    }

    /// A hybrid's paged session (one DeltaNet layer of 2 + 3 floats) owned by `owner`, keeping
    /// page-boundary snapshots; `run` advances it by `rows` with its state set to `mark`.
    fn hybrid(pool: &KvPool, owner: u64) -> KvCache {
        let mut kv = KvCache::paged(pool).owned_by(owner).with_recurrent(vec![(2, 3)]);
        kv.keep_marks();
        kv
    }

    fn run(kv: &mut KvCache, rows: usize, mark: f32) {
        let len = kv.len();
        kv.reserve(len + rows).unwrap();
        let g = kv.geo.clone();
        for il in 0..g.n_layers {
            let k = vec![mark; rows * g.kv_dim];
            kv.append(il, &k, &k);
        }
        let io = kv.rec_io(0);
        io.conv_out.fill(mark);
        io.ssm_out.fill(mark);
        kv.commit(len + rows);
    }

    fn state(kv: &mut KvCache) -> (f32, f32) {
        let len = kv.len();
        kv.reserve(len).unwrap();
        let io = kv.rec_io(0);
        (io.conv_in[0], io.ssm_in[0])
    }

    #[test]
    fn a_hybrid_takes_cached_pages_up_to_a_snapshot_and_its_state() {
        let geo = Geometry { n_layers: 1, kv_dim: 2, head_dim: 2, page_rows: 4, codec: KvCodec::F16, slots: None };
        let pool = KvPool::new(geo, 16, 0, &PageBin::new()).unwrap();
        pool.keep_snapshots(4);
        let toks: Vec<u32> = (0..12).collect();
        let mut a = hybrid(&pool, 7);
        run(&mut a, 3, 1.0);
        run(&mut a, 1, 2.0); // ends on the boundary at 4: a snapshot of state 2
        run(&mut a, 5, 3.0); // crosses 8 without ending there: none
        assert_eq!(a.rec_state().unwrap().mark_pos(), Some(4));
        pool.donate(&a, &toks[..9]);
        // Only the page up to the snapshot is cached (the next would be no use without a state).
        let st = pool.stats();
        assert_eq!((st.pages_cached, st.snapshots, st.snapshot_bytes), (1, 1, 4 * 5), "{st:?}");
        let mut b = hybrid(&pool, 7);
        assert_eq!(pool.attach(&mut b, &toks, 11), 4);
        assert_eq!(state(&mut b), (2.0, 2.0));
        // It goes on from there as a session that ran those rows would.
        run(&mut b, 4, 5.0);
        assert_eq!((b.len(), state(&mut b), b.rec_state().unwrap().mark_pos()), (8, (5.0, 5.0), Some(8)));
        // Another model's session matches nothing; nor does anything after the cache is cleared.
        let mut c = hybrid(&pool, 8);
        assert_eq!(pool.attach(&mut c, &toks, 11), 0);
        pool.clear_cache();
        let st = pool.stats();
        assert_eq!((st.pages_cached, st.snapshots, st.snapshot_bytes), (0, 0, 0), "{st:?}");
        let mut d = hybrid(&pool, 7);
        assert_eq!(pool.attach(&mut d, &toks, 11), 0);
        assert_eq!(pool.stats().cache_hits, 1);
    }

    #[test]
    fn pages_without_a_snapshot_give_a_hybrid_nothing() {
        let geo = Geometry { n_layers: 1, kv_dim: 2, head_dim: 2, page_rows: 4, codec: KvCodec::F16, slots: None };
        let pool = KvPool::new(geo, 16, 0, &PageBin::new()).unwrap();
        let toks: Vec<u32> = (0..8).collect();
        let mut a = hybrid(&pool, 1);
        run(&mut a, 8, 1.0);
        // No snapshots kept (the default): a hybrid donates nothing.
        pool.donate(&a, &toks);
        assert_eq!(pool.stats().pages_cached, 0);
        // An attention-only session's pages, under the same owner, carry no state.
        let mut plain = KvCache::paged(&pool).owned_by(1);
        fill(&mut plain, 8, 0.0);
        pool.donate(&plain, &toks);
        let mut b = hybrid(&pool, 1);
        assert_eq!(pool.attach_matched(&mut b, &toks, 7), (0, 4));
        assert_eq!((b.len(), pool.stats().cache_stateless, pool.stats().cache_hits), (0, 1, 0));
    }

    #[test]
    fn a_snapshot_goes_with_its_page_and_within_the_limits() {
        let geo = Geometry { n_layers: 1, kv_dim: 2, head_dim: 2, page_rows: 2, codec: KvCodec::F16, slots: None };
        // A pool of 2 pages: the second stream's pages come from evicting the first's.
        let pool = KvPool::new(geo.clone(), 2, 0, &PageBin::new()).unwrap();
        pool.keep_snapshots(1);
        let mut a = hybrid(&pool, 1);
        run(&mut a, 2, 1.0);
        pool.donate(&a, &[1, 2]);
        a.release();
        assert_eq!(pool.stats().snapshots, 1);
        let mut b = hybrid(&pool, 1);
        run(&mut b, 4, 2.0);
        let st = pool.stats();
        assert_eq!((st.pages_cached, st.snapshots, st.snapshot_bytes), (0, 0, 0), "eviction frees the snapshot: {st:?}");
        // Beyond the limit the least recently used snapshot goes, and its page stays.
        let pool = KvPool::new(geo.clone(), 8, 0, &PageBin::new()).unwrap();
        pool.keep_snapshots(1);
        for (toks, mark) in [([1, 2], 1.0), ([3, 4], 2.0)] {
            let mut x = hybrid(&pool, 1);
            run(&mut x, 2, mark);
            pool.donate(&x, &toks);
        }
        let st = pool.stats();
        assert_eq!((st.pages_cached, st.snapshots), (2, 1), "{st:?}");
        let mut d = hybrid(&pool, 1);
        assert_eq!(pool.attach(&mut d, &[1, 2, 0], 2), 0, "the older snapshot went");
        assert_eq!(pool.attach(&mut d, &[3, 4, 0], 2), 2);
        assert_eq!(state(&mut d), (2.0, 2.0));
        // A page budget counts a snapshot as the pages its bytes fill (20 bytes: 2 of 16).
        let pool = KvPool::new(geo.clone(), 8, 2, &PageBin::new()).unwrap();
        pool.keep_snapshots(4);
        let mut e = hybrid(&pool, 1);
        run(&mut e, 2, 1.0);
        pool.donate(&e, &[1, 2]);
        e.release();
        pool.trim();
        let st = pool.stats();
        assert_eq!((geo.page_bytes(), st.pages_cached, st.snapshots), (16, 0, 0), "1 page + 2 for its snapshot > 2: {st:?}");
    }

    #[test]
    fn going_back_before_a_snapshot_forgets_it() {
        let geo = Geometry { n_layers: 1, kv_dim: 2, head_dim: 2, page_rows: 4, codec: KvCodec::F16, slots: None };
        let pool = KvPool::new(geo, 8, 0, &PageBin::new()).unwrap();
        let mut kv = hybrid(&pool, 1);
        run(&mut kv, 2, 1.0);
        // A verify chunk that ends on the boundary (recording its rows), taken back to inside it.
        let len = kv.len();
        kv.reserve(len + 2).unwrap();
        let io = kv.rec_io(0);
        io.conv_out.fill(2.0);
        io.ssm_out.fill(2.0);
        kv.journal(0, &[0.0; 8], &[0.0; 2], &[0.0; 2], 2);
        kv.commit(len + 2);
        assert_eq!(kv.rec_state().unwrap().mark_pos(), Some(4));
        kv.rewind(3, |_, io, _, _, _, _| {
            io.conv_out.fill(9.0);
            io.ssm_out.fill(9.0);
        });
        assert_eq!(kv.rec_state().unwrap().mark_pos(), None);
        run(&mut kv, 1, 4.0);
        assert_eq!(kv.rec_state().unwrap().mark_pos(), Some(4));
        kv.release();
        assert_eq!(kv.rec_state().unwrap().mark_pos(), None);
    }

    #[test]
    fn a_recurrent_state_goes_back_by_replaying_the_last_pass() {
        let geo = Geometry { n_layers: 1, kv_dim: 2, head_dim: 2, page_rows: 4, codec: KvCodec::F16, slots: None };
        let mut kv = KvCache::private(geo, &PageBin::new()).with_recurrent(vec![(2, 3)]);
        // Each pass writes its state as the copy it does not read; `committed` reads it back.
        let pass = |kv: &mut KvCache, rows: usize, mark: f32, journal: bool| {
            let len = kv.len();
            kv.reserve(len + rows).unwrap();
            let io = kv.rec_io(0);
            io.conv_out.fill(mark);
            io.ssm_out.fill(mark);
            if journal {
                let q: Vec<f32> = (0..rows * 4).map(|i| i as f32).collect();
                let b: Vec<f32> = (0..rows).map(|i| 100.0 + i as f32).collect();
                kv.journal(0, &q, &b, &b, rows);
            }
            kv.commit(len + rows);
        };
        let committed = |kv: &mut KvCache| {
            let len = kv.len();
            kv.reserve(len).unwrap();
            let io = kv.rec_io(0);
            (io.conv_in[0], io.ssm_in[0])
        };
        pass(&mut kv, 2, 1.0, false);
        assert_eq!(kv.rewind_floor(), 2, "a pass that recorded nothing cannot be taken back");
        pass(&mut kv, 3, 2.0, true);
        assert_eq!((kv.rewind_floor(), committed(&mut kv)), (2, (2.0, 2.0)));
        // Back to 4: the first 2 recorded rows replayed from the state before the pass.
        let mut calls = 0;
        kv.rewind(4, |slot, io, q, b, _a, rows| {
            calls += 1;
            assert_eq!((slot, rows, io.conv_in[0], io.ssm_in[0]), (0, 2, 1.0, 1.0));
            assert_eq!((q, b), (&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0][..], &[100.0, 101.0][..]));
            io.conv_out.fill(3.0);
            io.ssm_out.fill(3.0);
        });
        assert_eq!((calls, kv.len(), committed(&mut kv)), (1, 4, (3.0, 3.0)));
        // Back to the pass's start: the state before it, nothing to replay.
        kv.rewind(2, |_, _, _, _, _, _| panic!("nothing to replay"));
        assert_eq!((kv.len(), committed(&mut kv), kv.rewind_floor()), (2, (1.0, 1.0), 2));
        pass(&mut kv, 1, 4.0, false);
        assert_eq!(kv.rewind_floor(), 3);
    }
}
