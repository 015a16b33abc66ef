//! The tiled weight layout the SIMD kernels of the 32-value formats read: eight consecutive rows
//! interleaved four bytes at a time, so one 256-bit register holds the same four values of all
//! eight rows and one `vpdpbusd` against four broadcast activation bytes yields eight outputs.
//! Per block (32 values) a tile stores, region by region:
//!
//! - `d[nb][8]` f16 scales (one `vcvtph2ps` converts the eight rows' scales of a block); for
//!   MXFP4 `e[nb][8]`, the rows' E8M0 scale bytes,
//! - `m[nb][8]` f16 mins (Q4_1, Q5_1),
//! - `qh[nb][32]` high bits (Q5_0, Q5_1): byte `4r+e` bit `h` is row `r`'s bit for value
//!   `4h+e` (h < 4) or `16+4(h-4)+e` (h >= 4), matching the quant chunks below: the byte sits
//!   in the lane its value's quant byte takes, so a shift and a mask place a chunk's fifth bits,
//!   as Q5_K's do,
//! - quants `[nb][chunks][8 rows][4 bytes]`: for 4-bit formats chunk `c` (of 4) holds the GGUF
//!   bytes `4c..4c+4` of each row, whose low nibbles are values `4c..` and high nibbles `16+4c..`;
//!   for Q8_0 chunk `c` (of 8) holds values `4c..4c+4`. MXFP4's codes are nibbles in Q4_0's
//!   order, so they take Q4_0's chunks.
//!
//! Such a tile is exactly eight GGUF rows long, so tiling costs no memory beyond padding.
//!
//! The K-quants keep each superblock (256 values) of the eight rows together instead:
//!
//! - Q4_K (1184 bytes): `d[8]`, `dmin[8]` f16; the 6-bit scales and mins unpacked to bytes,
//!   `sc[8 sub-blocks][8 rows]`, `m[8][8]`; quants `[32 chunks][8 rows][4 bytes]`, chunk `c`
//!   holding the GGUF bytes `4c..4c+4` (low nibbles: sub-block `2(c/8)`, high: the next one).
//! - Q5_K (1440 bytes): as Q4_K, plus the high bits `qh` as `[8 chunks][8 rows][4 bytes]` (chunk
//!   `c`: the GGUF qh bytes `4c..4c+4`, bit `s` for sub-block `s`) before the quants.
//! - Q6_K (1680 bytes, eight rows exactly): `d[8]` f16; `sc[16 sub-blocks][8 rows]` i8; `ql` as
//!   `[32 chunks][8][4]`; `qh` as `[16 chunks][8][4]`.

use super::GgmlType;

/// Rows per tile.
pub const TILE_ROWS: usize = 8;

/// (bytes of d, of m, of qh, of qs) per block and row, for the formats that have a tiled layout.
fn parts(ty: GgmlType) -> Option<[usize; 4]> {
    Some(match ty {
        GgmlType::Q4_0 => [2, 0, 0, 16],
        GgmlType::Q4_1 => [2, 2, 0, 16],
        GgmlType::Q5_0 => [2, 0, 4, 16],
        GgmlType::Q5_1 => [2, 2, 4, 16],
        GgmlType::Q8_0 => [2, 0, 0, 32],
        GgmlType::MXFP4 => [1, 0, 0, 16],
        _ => return None,
    })
}

/// Bytes of one superblock of eight rows in a K-quant tile.
pub const Q4K_TILE_BLOCK: usize = 1184;
pub const Q5K_TILE_BLOCK: usize = 1440;

/// Where the fields of a K-quant superblock tile start (bytes from its start; `d[8]` at 0).
pub const K45_DMIN: usize = 16;
pub const K45_SC: usize = 32;
pub const K45_M: usize = 96;
pub const Q4K_QS: usize = 160;
pub const Q5K_QH: usize = 160;
pub const Q5K_QS: usize = 416;
pub const Q6K_SC: usize = 16;
pub const Q6K_QL: usize = 144;
pub const Q6K_QH: usize = 1168;
pub const Q6K_TILE_BLOCK: usize = 1680;

pub fn has_layout(ty: GgmlType) -> bool {
    parts(ty).is_some() || matches!(ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K)
}

/// Bytes of one tile of rows `cols` long.
pub fn tile_bytes(ty: GgmlType, cols: usize) -> usize {
    match ty {
        GgmlType::Q4K => cols / 256 * Q4K_TILE_BLOCK,
        GgmlType::Q5K => cols / 256 * Q5K_TILE_BLOCK,
        GgmlType::Q6K => cols / 256 * Q6K_TILE_BLOCK,
        _ => TILE_ROWS * ty.row_bytes(cols),
    }
}

/// K-quants: (offset in the GGUF block, offset in the tile's superblock, length) of every byte
/// field of row `r` (the packed 6-bit scales of Q4_K and Q5_K excepted).
fn kquant_moves(ty: GgmlType, r: usize) -> Vec<(usize, usize, usize)> {
    let mut v = Vec::new();
    match ty {
        GgmlType::Q4K => {
            v.extend([(0, 2 * r, 2), (2, K45_DMIN + 2 * r, 2)]);
            v.extend((0..32).map(|c| (16 + 4 * c, Q4K_QS + 32 * c + 4 * r, 4)));
        }
        GgmlType::Q5K => {
            v.extend([(0, 2 * r, 2), (2, K45_DMIN + 2 * r, 2)]);
            v.extend((0..8).map(|c| (16 + 4 * c, Q5K_QH + 32 * c + 4 * r, 4)));
            v.extend((0..32).map(|c| (48 + 4 * c, Q5K_QS + 32 * c + 4 * r, 4)));
        }
        GgmlType::Q6K => {
            v.push((208, 2 * r, 2));
            v.extend((0..16).map(|s| (192 + s, Q6K_SC + 8 * s + r, 1)));
            v.extend((0..32).map(|c| (4 * c, Q6K_QL + 32 * c + 4 * r, 4)));
            v.extend((0..16).map(|c| (128 + 4 * c, Q6K_QH + 32 * c + 4 * r, 4)));
        }
        _ => unreachable!("not a tiled K-quant"),
    }
    v
}

/// Q4_K's twelve bytes of 6-bit scales and mins, from the sixteen values (`scale_min_k4`'s inverse).
fn pack_scale_min_k4(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4);
    }
    q
}

/// Up to eight GGUF rows -> one tile (missing rows are zero).
pub fn tile_rows(ty: GgmlType, rows: &[&[u8]], tile: &mut [u8]) {
    assert!(rows.len() <= TILE_ROWS);
    tile.fill(0);
    for (r, row) in rows.iter().enumerate() {
        for_each_field(ty, row.len(), r, |at, tat, len| tile[tat..tat + len].copy_from_slice(&row[at..at + len]));
        for (row_at, words) in high_bits(ty, row.len()) {
            let qh = u32::from_le_bytes(row[row_at..row_at + 4].try_into().unwrap());
            for j in 0..32 {
                let (at, bit) = high_bit_place(words, r, j);
                tile[at] |= (((qh >> j) & 1) as u8) << bit;
            }
        }
        for (row_at, sb) in packed_scales(ty, row.len()) {
            for s in 0..8 {
                (tile[sb + K45_SC + 8 * s + r], tile[sb + K45_M + 8 * s + r]) = super::scale_min_k4(s, &row[row_at..row_at + 12]);
            }
        }
    }
}

/// Row `r` (0..8) of a tile -> its GGUF bytes.
pub fn untile_row(ty: GgmlType, tile: &[u8], r: usize, row: &mut [u8]) {
    for_each_field(ty, row.len(), r, |at, tat, len| row[at..at + len].copy_from_slice(&tile[tat..tat + len]));
    for (row_at, words) in high_bits(ty, row.len()) {
        let mut qh = 0u32;
        for j in 0..32 {
            let (at, bit) = high_bit_place(words, r, j);
            qh |= (((tile[at] >> bit) & 1) as u32) << j;
        }
        row[row_at..row_at + 4].copy_from_slice(&qh.to_le_bytes());
    }
    for (row_at, sb) in packed_scales(ty, row.len()) {
        let field = |at: usize| std::array::from_fn(|s| tile[sb + at + 8 * s + r]);
        row[row_at..row_at + 12].copy_from_slice(&pack_scale_min_k4(&field(K45_SC), &field(K45_M)));
    }
}

/// Calls `f(offset in the GGUF row, offset in the tile, length)` for every byte field of row `r`
/// (plain loops: this runs over every weight at load).
#[inline(always)]
fn for_each_field(ty: GgmlType, row_len: usize, r: usize, mut f: impl FnMut(usize, usize, usize)) {
    let bb = ty.block_bytes();
    let Some([dw, mw, hw, qw]) = parts(ty) else {
        // K-quants: superblocks stay together.
        let (moves, sb) = (kquant_moves(ty, r), tile_bytes(ty, 256));
        for i in 0..row_len / bb {
            for &(at, tat, len) in &moves {
                f(i * bb + at, i * sb + tat, len);
            }
        }
        return;
    };
    let bb = ty.block_bytes();
    let nb = row_len / bb;
    let (m_at, q_at) = (dw * TILE_ROWS * nb, (dw + mw + hw) * TILE_ROWS * nb);
    for i in 0..nb {
        let b = i * bb;
        f(b, TILE_ROWS * dw * i + dw * r, dw);
        if mw > 0 {
            f(b + dw, m_at + TILE_ROWS * mw * i + mw * r, mw);
        }
        for c in 0..qw / 4 {
            f(b + dw + mw + hw + 4 * c, q_at + TILE_ROWS * qw * i + 32 * c + 4 * r, 4);
        }
    }
}

/// Q4_K, Q5_K: (offset of the block's twelve packed scale bytes in the GGUF row, offset of its
/// superblock in the tile) per block; nothing for other formats.
fn packed_scales(ty: GgmlType, row_len: usize) -> impl Iterator<Item = (usize, usize)> {
    let (bb, sb) = (ty.block_bytes(), tile_bytes(ty, 256));
    let n = if matches!(ty, GgmlType::Q4K | GgmlType::Q5K) { row_len / bb } else { 0 };
    (0..n).map(move |i| (i * bb + 4, i * sb))
}

/// Q5_0, Q5_1: (offset of the block's qh in the GGUF row, offset of its eight words in the tile)
/// per block; nothing for other formats.
fn high_bits(ty: GgmlType, row_len: usize) -> impl Iterator<Item = (usize, usize)> {
    let [dw, mw, hw, _] = parts(ty).unwrap_or([0; 4]);
    let bb = ty.block_bytes();
    let nb = row_len / bb;
    let h_at = (dw + mw) * TILE_ROWS * nb;
    (0..if hw > 0 { nb } else { 0 }).map(move |i| (i * bb + dw + mw, h_at + 32 * i))
}

/// Where value `j`'s high bit of row `r` lives: (byte offset, bit in the byte).
fn high_bit_place(words: usize, r: usize, j: usize) -> (usize, usize) {
    let h = if j < 16 { j / 4 } else { 4 + (j - 16) / 4 };
    (words + 4 * r + j % 4, h)
}
