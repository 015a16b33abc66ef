//! Memory for the weights converted at load (tiles), on transparent huge pages. Every decode step
//! streams all the weights, and on 4 KB pages that is a TLB miss and page walk every 4 KB (some
//! 25,000 a step for SmolLM2's 96 MB); a 2 MB page takes one. Most matrices are far smaller
//! than a huge page, so they are carved one after another out of 32 MB anonymous mappings
//! (slabs) instead of each getting its own: the only waste is the untouched tail of the last
//! slab, which is never faulted in. A slab is unmapped when the last weight in it is dropped.
//! Each runtime's CPU backend has an arena of its own (`cpu::Cpu`): two runtimes share no slab.

use memmap2::MmapMut;
use std::sync::{Arc, Mutex};

const HUGE_PAGE: usize = 2 << 20;
const SLAB: usize = 32 << 20;
/// Spans start on cache lines.
const ALIGN: usize = 64;

struct Slab {
    // Keeps the mapping alive; written only through `base`, region by region.
    _map: MmapMut,
    /// The first huge-page boundary in the mapping.
    base: *mut u8,
    len: usize,
}

// SAFETY: a slab's bytes are written only through a `SpanMut`, which owns its region alone,
// and read through `Span`s only after that (`freeze` consumes the `SpanMut`).
unsafe impl Send for Slab {}
unsafe impl Sync for Slab {}

impl Slab {
    fn new(len: usize) -> Slab {
        // One huge page more than asked, so the usable part can start on a boundary.
        let mut map = MmapMut::map_anon(len + HUGE_PAGE).expect("out of memory for the model's weights");
        #[cfg(target_os = "linux")]
        // Advice only: where the kernel has no huge pages (or THP is off) this is plain memory.
        let _ = map.advise(memmap2::Advice::HugePage);
        let skip = map.as_ptr().align_offset(HUGE_PAGE);
        // SAFETY: skip < HUGE_PAGE, so base..base+len lies inside the mapping.
        let base = unsafe { map.as_mut_ptr().add(skip) };
        Slab { _map: map, base, len }
    }
}

/// Where the weights of one CPU backend go: the current slab and its first free byte.
#[derive(Default)]
pub struct Arena {
    current: Mutex<Option<(Arc<Slab>, usize)>>,
}

impl Arena {
    pub fn new() -> Arena {
        Arena::default()
    }

    /// `len` zeroed bytes for a weight, to fill and then `freeze`.
    pub fn alloc(&self, len: usize) -> SpanMut {
        if len > SLAB / 4 {
            // A big matrix (an output head) gets a slab of its own, leaving the current one be.
            return SpanMut(Span { slab: Arc::new(Slab::new(len.next_multiple_of(HUGE_PAGE))), offset: 0, len });
        }
        let mut cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if !matches!(&*cur, Some((slab, used)) if used.next_multiple_of(ALIGN) + len <= slab.len) {
            *cur = None;
        }
        let (slab, used) = cur.get_or_insert_with(|| (Arc::new(Slab::new(SLAB)), 0));
        let offset = used.next_multiple_of(ALIGN);
        *used = offset + len;
        SpanMut(Span { slab: slab.clone(), offset, len })
    }
}

/// Read-only bytes of a slab, shared by the clones of a weight.
#[derive(Clone)]
pub struct Span {
    slab: Arc<Slab>,
    offset: usize,
    len: usize,
}

impl Span {
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: offset + len <= slab.len (alloc), and nothing writes a frozen span.
        unsafe { std::slice::from_raw_parts(self.slab.base.add(self.offset), self.len) }
    }
}

/// A span being filled: the only handle to its bytes until `freeze`.
pub struct SpanMut(Span);

impl SpanMut {
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: in bounds as in `Span::as_slice`; this handle is the only one to the region
        // (spans never overlap, and it is not Clone), and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.0.slab.base.add(self.0.offset), self.0.len) }
    }

    pub fn freeze(self) -> Span {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_are_zeroed_aligned_disjoint_and_outlive_their_slab_handle() {
        let arena = Arena::new();
        let mut spans: Vec<Span> = Vec::new();
        for (i, len) in [100usize, 5 << 20, 3, 9 << 20, 64, 12 << 20, 1].into_iter().enumerate() {
            let mut s = arena.alloc(len);
            let bytes = s.as_mut_slice();
            assert!(bytes.iter().all(|&b| b == 0), "span {i} not zeroed");
            assert_eq!(bytes.as_ptr() as usize % ALIGN, 0, "span {i} not aligned");
            bytes.fill(i as u8 + 1);
            spans.push(s.freeze());
        }
        // Each still holds its own fill: no span overlapped another.
        for (i, s) in spans.iter().enumerate() {
            assert!(s.as_slice().iter().all(|&b| b == i as u8 + 1), "span {i} was overwritten");
        }
        // A new slab replaces the current one; spans of the old one stay readable.
        drop(arena.current.lock().unwrap_or_else(|e| e.into_inner()).take());
        assert!(spans[0].as_slice().iter().all(|&b| b == 1));
    }
}
