//! A weight matrix as every backend reads it: GGUF blocks, row-major, in the mapped file or in
//! memory of our own, or in the CPU's tiles of interleaved rows (`tile`).

use super::arena;
use super::tile::{self, TILE_ROWS};
use super::{dequantize_row, GgmlType};
use std::sync::Arc;

/// Bytes of a weight: a window of the memory-mapped GGUF, a buffer we converted at load, or
/// tiles laid out at load on huge pages (`arena`).
#[derive(Clone)]
pub enum Bytes {
    Mapped { map: Arc<memmap2::Mmap>, offset: usize, len: usize },
    Owned(Arc<Vec<u8>>),
    Arena(arena::Span),
}

impl Bytes {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped { map, offset, len } => &map[*offset..*offset + *len],
            Bytes::Owned(v) => v,
            Bytes::Arena(span) => span.as_slice(),
        }
    }
}

/// A 2-D weight matrix of `rows` rows of `cols` values, stored row-major in GGUF blocks, or in
/// tiles of eight interleaved rows (`quant::tile`) when this CPU's kernels for its format read those.
#[derive(Clone)]
pub struct Weight {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: Bytes,
    pub tiled: bool,
    /// Set for `Numerics::Ggml`: the rows stay as stored and every dot adds up in ggml's order.
    pub ggml_dot: Option<crate::quant::ggml::Dots>,
}

impl Weight {
    /// Read with ggml's summation order (`Numerics::Ggml`), or None where we do not reproduce it
    /// for this format.
    pub fn for_ggml_order(self) -> Option<Weight> {
        assert!(!self.tiled, "ggml's order reads rows as stored");
        let dots = crate::quant::ggml::dots(self.ty, self.rows, self.cols)?;
        Some(Weight { ggml_dot: Some(dots), ..self })
    }

    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols)
    }

    /// Row `r` as the GGUF stores it (untiled where the CPU tiled it).
    pub fn gguf_row(&self, r: usize, out: &mut [u8]) {
        let rb = self.row_bytes();
        if self.tiled {
            let tb = tile::tile_bytes(self.ty, self.cols);
            tile::untile_row(self.ty, &self.data.as_slice()[r / TILE_ROWS * tb..][..tb], r % TILE_ROWS, &mut out[..rb]);
        } else {
            out[..rb].copy_from_slice(&self.data.as_slice()[r * rb..(r + 1) * rb]);
        }
    }

    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let rb = self.row_bytes();
        if self.tiled {
            let tb = tile::tile_bytes(self.ty, self.cols);
            let mut gguf = vec![0u8; rb];
            tile::untile_row(self.ty, &self.data.as_slice()[r / TILE_ROWS * tb..][..tb], r % TILE_ROWS, &mut gguf);
            dequantize_row(self.ty, &gguf, &mut out[..self.cols]);
        } else {
            dequantize_row(self.ty, &self.data.as_slice()[r * rb..(r + 1) * rb], &mut out[..self.cols]);
        }
    }

    /// All values as f32 (norm vectors, QuantMode.fp32).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, o) in out.chunks_exact_mut(self.cols).enumerate() {
            self.dequantize_row(r, o);
        }
        out
    }
}
