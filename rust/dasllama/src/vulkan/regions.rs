//! The device's K/V memory, split into one region per stream. A region holds, for every
//! attention layer, K then V as [ctx][row] in the region's codec (`row_words`; the shaders'
//! `kv.glsl` describes the layouts). A finished stream parks its region: the rows
//! stay, named by a claim, until another stream needs the region; the conversation's next turn
//! adopts them and prefills only its new tokens.

use super::buffer::Buffer;
use super::device::Gpu;
use crate::backend::KvHome;
use crate::kv::{Grids, KvCodec};
use crate::Result;
use gpu_allocator::MemoryLocation;
use std::sync::{Arc, Mutex};

#[derive(Clone, Debug, PartialEq, Eq)]
enum Slot {
    Free,
    Held,
    /// Rows kept for a later turn; `claim` names them, and the oldest parked region is reused
    /// first when no region is free. `grids`: their images on M-RoPE axes, which place the rows
    /// after them.
    Parked {
        claim: u64,
        rows: usize,
        grids: Grids,
    },
}

/// Words one position's K (or V) takes on the device: the host's blocks padded to whole words
/// (q8_0: 36 bytes per 32 values, tq4: 20), so the shaders read them aligned.
pub fn row_words(codec: KvCodec, kvd: usize) -> usize {
    match codec {
        KvCodec::F16 => kvd.div_ceil(2),
        KvCodec::Q8_0 => kvd / 32 * 9,
        KvCodec::Tq4 => kvd / 32 * 5,
    }
}

/// The regions' memory and layout (what a step reads and writes). Each K/V slot (an attention
/// layer that keeps its own) has its own row width, its heads' (Gemma 4's sliding and full
/// layers differ).
pub struct Regions {
    pub buf: Buffer,
    pub ctx: usize,
    pub codec: KvCodec,
    n: usize,
    /// Per slot: its heads (head_dim, n_kv_heads), row words, and word offset in a region.
    slots: Vec<((usize, usize), usize, usize)>,
    region_words: usize,
}

/// Which stream holds which region, and the parked rows' claims: booked apart from the memory,
/// behind a lock of its own, so a session that ends or parks never waits for a step.
pub struct Book {
    slots: Mutex<(Vec<Slot>, u64)>,
    /// Regions hold a recurrent state after their last row: claims are adopted whole.
    whole: bool,
    /// Whether rows can be parked: not where a session's later layers live in its host K/V
    /// (a split model), which parking would leave behind.
    parks: bool,
}

impl Regions {
    /// `n` regions of `ctx` positions for K/V slots of `heads` (head_dim, n_kv_heads) each.
    pub fn new(gpu: &Arc<Gpu>, n: usize, ctx: usize, heads: &[(usize, usize)], codec: KvCodec) -> Result<Regions> {
        let buf = Buffer::new(gpu, "K/V regions", Regions::bytes_for(n, ctx, heads, codec), MemoryLocation::GpuOnly)?;
        let mut slots = Vec::with_capacity(heads.len());
        let mut at = 0;
        for &(hd, nkv) in heads {
            let rw = row_words(codec, hd * nkv);
            slots.push(((hd, nkv), rw, at));
            at += 2 * ctx * rw;
        }
        Ok(Regions { buf, ctx, codec, n, slots, region_words: at })
    }

    /// Device bytes of `n` regions (what the install checks against the budget).
    pub fn bytes_for(n: usize, ctx: usize, heads: &[(usize, usize)], codec: KvCodec) -> u64 {
        let per_pos: usize = heads.iter().map(|&(hd, nkv)| 2 * row_words(codec, hd * nkv)).sum();
        (n * ctx * per_pos * 4) as u64
    }

    /// Words one position of slot `slot` takes (K or V).
    pub fn row_words(&self, slot: usize) -> usize {
        self.slots[slot].1
    }

    /// Slot `slot`'s heads: (head_dim, n_kv_heads).
    pub fn heads(&self, slot: usize) -> (usize, usize) {
        self.slots[slot].0
    }

    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    pub fn count(&self) -> usize {
        self.n
    }

    pub fn bytes(&self) -> u64 {
        self.buf.size
    }

    pub fn base_word(&self, region: usize) -> usize {
        region * self.region_words
    }

    /// Word offsets of layer slot `slot`'s K from a region's start, and of its V from its K.
    pub fn slot_offsets(&self, slot: usize) -> (usize, usize) {
        let (_, rw, at) = self.slots[slot];
        (at, self.ctx * rw)
    }

    /// Byte range of layer slot `slot`'s K (v = false) or V rows 0..rows in `region`.
    pub fn rows_bytes(&self, region: usize, slot: usize, v: bool, rows: usize) -> (u64, u64) {
        let (so, vo) = self.slot_offsets(slot);
        let w = self.base_word(region) + so + if v { vo } else { 0 };
        (4 * w as u64, (rows * self.row_words(slot) * 4) as u64)
    }
}

impl Book {
    pub fn new(n: usize, whole: bool, parks: bool) -> Book {
        Book { slots: Mutex::new((vec![Slot::Free; n], 1)), whole, parks }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, (Vec<Slot>, u64)> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A region for a new stream: a free one, else the oldest parked one (its rows are lost).
    pub fn take(&self) -> Option<usize> {
        let (slots, _) = &mut *self.slots();
        let i = slots.iter().position(|s| *s == Slot::Free).or_else(|| {
            slots.iter().enumerate().filter_map(|(i, s)| if let Slot::Parked { claim, .. } = s { Some((*claim, i)) } else { None }).min().map(|(_, i)| i)
        })?;
        slots[i] = Slot::Held;
        Some(i)
    }
}

impl KvHome for Book {
    fn whole(&self) -> bool {
        self.whole
    }

    fn release(&self, region: usize) {
        if let Some(s) = self.slots().0.get_mut(region) {
            *s = Slot::Free;
        }
    }

    fn park(&self, region: usize, rows: usize, grids: Grids) -> u64 {
        let (slots, next) = &mut *self.slots();
        if !self.parks {
            slots[region] = Slot::Free;
            return 0;
        }
        let claim = *next;
        *next += 1;
        slots[region] = Slot::Parked { claim, rows, grids };
        claim
    }

    fn adopt(&self, claim: u64) -> Option<(usize, usize, Grids)> {
        let (slots, _) = &mut *self.slots();
        let i = slots.iter().position(|s| matches!(s, Slot::Parked { claim: c, .. } if *c == claim))?;
        let Slot::Parked { rows, grids, .. } = std::mem::replace(&mut slots[i], Slot::Held) else { unreachable!() };
        Some((i, rows, grids))
    }
}
