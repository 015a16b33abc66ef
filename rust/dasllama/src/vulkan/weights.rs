//! Weights on the device: each matrix repacked at upload so every block starts on a 32-bit word
//! (the quants first, then the f16 scale and min, padded to a word), which is what
//! `shaders/dequant.glsl` reads.

use super::buffer::Buffer;
use super::device::Gpu;
use super::kernels::Runner;
use crate::quant::GgmlType;
use crate::quant::Weight;
use crate::{Error, Result};
use gpu_allocator::MemoryLocation;
use std::sync::Arc;

pub struct DevWeight {
    pub buf: Buffer,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub row_words: usize,
}

/// Device bytes of one GGUF block after repacking.
fn packed_block_bytes(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => 20,
        GgmlType::Q5_0 | GgmlType::Q5_1 => 24,
        GgmlType::Q8_0 => 36,
        GgmlType::Q6K => 212,
        // [e][qs16] and [d][qs16] -> [qs16][e or d][pad]; IQ4_XS's 136 bytes are 34 words as stored.
        GgmlType::MXFP4 | GgmlType::IQ4NL => 20,
        t => t.block_bytes(),
    }
}

/// Bytes `w` takes on the device, its blocks repacked to start on words.
pub fn device_bytes(w: &Weight) -> u64 {
    (w.rows * (w.cols / w.ty.block_len()) * packed_block_bytes(w.ty)) as u64
}

/// Why a matrix cannot go to the device, if it cannot.
pub fn unsupported(w: &Weight) -> Option<String> {
    if !super::shaders::reads_format(w.ty) {
        return Some(format!("{} matrices", w.ty.name()));
    }
    if !w.cols.is_multiple_of(16) {
        return Some(format!("rows of {} values (the device kernels read 16 at a time)", w.cols));
    }
    None
}

/// One row, GGUF bytes in, device layout out.
fn repack_row(ty: GgmlType, src: &[u8], out: &mut Vec<u8>) {
    let bb = ty.block_bytes();
    for b in src.chunks_exact(bb) {
        match ty {
            // [d][qs16] -> [qs16][d][pad]; [d][m][qs16] -> [qs16][d][m]
            GgmlType::Q4_0 => out.extend_from_slice(&[&b[2..18], &b[0..2], &[0, 0]].concat()),
            GgmlType::Q4_1 => out.extend_from_slice(&[&b[4..20], &b[0..4]].concat()),
            // [d][qh4][qs16] -> [qs16][qh4][d][pad]; [d][m][qh4][qs16] -> [qs16][qh4][d][m]
            GgmlType::Q5_0 => out.extend_from_slice(&[&b[6..22], &b[2..6], &b[0..2], &[0, 0]].concat()),
            GgmlType::Q5_1 => out.extend_from_slice(&[&b[8..24], &b[4..8], &b[0..4]].concat()),
            // [d][qs32] -> [qs32][d][pad]
            GgmlType::Q8_0 => out.extend_from_slice(&[&b[2..34], &b[0..2], &[0, 0]].concat()),
            GgmlType::Q6K => out.extend_from_slice(&[b, &[0, 0]].concat()),
            // [e][qs16] -> [qs16][e][pad3]
            GgmlType::MXFP4 => out.extend_from_slice(&[&b[1..17], &b[0..1], &[0, 0, 0]].concat()),
            // [d][qs16] -> [qs16][d][pad]
            GgmlType::IQ4NL => out.extend_from_slice(&[&b[2..18], &b[0..2], &[0, 0]].concat()),
            _ => out.extend_from_slice(b),
        }
    }
}

/// Copy host bytes into a device-local buffer through a host-visible staging buffer.
pub fn upload(gpu: &Arc<Gpu>, run: &mut Runner, name: &str, bytes: &[u8]) -> Result<Buffer> {
    let dst = Buffer::new(gpu, name, bytes.len() as u64, MemoryLocation::GpuOnly)?;
    upload_into(gpu, run, &dst, 0, bytes)?;
    Ok(dst)
}

pub fn upload_into(gpu: &Arc<Gpu>, run: &mut Runner, dst: &Buffer, off: u64, bytes: &[u8]) -> Result<()> {
    const CHUNK: usize = 16 << 20;
    let mut stage = Buffer::new(gpu, "staging", CHUNK.min(bytes.len()).max(16) as u64, MemoryLocation::CpuToGpu)?;
    for (i, c) in bytes.chunks(CHUNK).enumerate() {
        stage.mapped()[..c.len()].copy_from_slice(c);
        run.copy(&stage, 0, dst, off + (i * CHUNK) as u64, c.len() as u64)?;
        run.submit()?;
    }
    Ok(())
}

pub fn upload_f32(gpu: &Arc<Gpu>, run: &mut Runner, name: &str, v: &[f32]) -> Result<Buffer> {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    upload(gpu, run, name, &bytes)
}

pub fn upload_weight(gpu: &Arc<Gpu>, run: &mut Runner, name: &str, w: &Weight) -> Result<DevWeight> {
    upload_stacked(gpu, run, name, &[w])
}

/// Several matrices of one format and shape (a layer's experts) as one device weight, one after
/// the other: matrix e's row r is row `e * ws[0].rows + r` of the result, whose `rows` counts
/// them all (`mul_mat_id.comp` reads it so).
pub fn upload_stacked(gpu: &Arc<Gpu>, run: &mut Runner, name: &str, ws: &[&Weight]) -> Result<DevWeight> {
    let w0 = ws.first().ok_or_else(|| Error::Internal(format!("{name}: no matrices to upload")))?;
    for w in ws {
        if let Some(why) = unsupported(w) {
            return Err(Error::UnsupportedModel(format!("{name}: the Vulkan kernels do not read {why}")));
        }
        if (w.ty, w.rows, w.cols) != (w0.ty, w0.rows, w0.cols) {
            return Err(Error::Internal(format!("{name}: stacked matrices differ in format or shape")));
        }
    }
    let blocks = w0.cols / w0.ty.block_len();
    let row_bytes = blocks * packed_block_bytes(w0.ty);
    let rows = w0.rows * ws.len();
    let mut packed = Vec::with_capacity(row_bytes * rows);
    let mut raw = vec![0u8; w0.row_bytes()];
    for w in ws {
        for r in 0..w.rows {
            w.gguf_row(r, &mut raw);
            repack_row(w.ty, &raw, &mut packed);
        }
    }
    let buf = upload(gpu, run, name, &packed)?;
    Ok(DevWeight { buf, ty: w0.ty, rows, cols: w0.cols, row_words: row_bytes / 4 })
}
