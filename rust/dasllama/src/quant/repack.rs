//! The repacked row layout the AVX2 kernels of the 32-value formats read: the same bytes as the
//! GGUF row, regrouped so that the scales of consecutive blocks are contiguous —
//! `[d; nb] [m; nb]? [qh; nb]? [qs; nb]` — and eight of them convert with one instruction.
//! Rows keep their size, so a repacked weight costs no extra memory.

use super::GgmlType;

/// (bytes of d, of m, of qh, of qs) per block, for the formats that have a repacked layout.
fn parts(ty: GgmlType) -> Option<[usize; 4]> {
    Some(match ty {
        GgmlType::Q4_0 => [2, 0, 0, 16],
        GgmlType::Q4_1 => [2, 2, 0, 16],
        GgmlType::Q5_0 => [2, 0, 4, 16],
        GgmlType::Q8_0 => [2, 0, 0, 32],
        _ => return None,
    })
}

pub fn has_layout(ty: GgmlType) -> bool {
    parts(ty).is_some()
}

/// GGUF row -> repacked row.
pub fn repack_row(ty: GgmlType, src: &[u8], dst: &mut [u8]) {
    shuffle(ty, src, dst, true);
}

/// Repacked row -> GGUF row.
pub fn unpack_row(ty: GgmlType, src: &[u8], dst: &mut [u8]) {
    shuffle(ty, src, dst, false);
}

/// Move each block field between its place in the block and its place in its region.
fn shuffle(ty: GgmlType, src: &[u8], dst: &mut [u8], to_repacked: bool) {
    let p = parts(ty).expect("format has a repacked layout");
    let bb = ty.block_bytes();
    let nb = src.len() / bb;
    let (mut field_at, mut region) = (0, 0);
    for &w in &p {
        for i in 0..nb {
            let in_block = i * bb + field_at..i * bb + field_at + w;
            let in_region = region + i * w..region + (i + 1) * w;
            if to_repacked {
                dst[in_region].copy_from_slice(&src[in_block]);
            } else {
                dst[in_block].copy_from_slice(&src[in_region]);
            }
        }
        field_at += w;
        region += w * nb;
    }
}
