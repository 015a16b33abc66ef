//! GGUF block formats: layouts, dequantization, activation quantization and dot products.
//!
//! Weights stay in their stored blocks. Activations are rounded to the block format llama.cpp pairs
//! with each weight format (`q8_0` for Q4_0/Q5_0/Q8_0/IQ4_NL/MXFP4, `q8_1` for Q4_1/Q5_1, `q8_K` for the K-quants,
//! f16/bf16 for half-precision weights): that rounding is part of the numbers llama.cpp produces, so
//! matching it is what lets us agree with llama.cpp to a few hundredths of a nat.

pub mod amx;
pub mod arena;
#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx2_kquant;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod ggml;
pub mod iq4;
pub mod mxfp4;
pub mod scalar;
pub mod switches;
pub mod tile;
mod weight;

pub use weight::{Bytes, Weight};

use crate::{Error, Result};
use half::{bf16, f16};

/// ggml tensor types we understand, with their GGUF ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    BF16,
    IQ4NL,
    IQ4XS,
    MXFP4,
}

impl GgmlType {
    /// Floats, the 32-value formats (MXFP4 among them) and the K-quants: the weight formats whose
    /// matmul kernels the tests and benches go through one by one.
    pub const WEIGHT_FORMATS: [GgmlType; 12] =
        [Self::F32, Self::F16, Self::BF16, Self::Q4_0, Self::Q4_1, Self::Q5_0, Self::Q5_1, Self::Q8_0, Self::MXFP4, Self::Q4K, Self::Q5K, Self::Q6K];

    pub fn from_id(id: u32) -> Result<Self> {
        Ok(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            9 => Self::Q8_1,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            15 => Self::Q8K,
            20 => Self::IQ4NL,
            23 => Self::IQ4XS,
            30 => Self::BF16,
            39 => Self::MXFP4,
            _ => {
                return Err(Error::UnsupportedModel(format!(
                    "tensor type id {id} is not supported (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4)"
                )))
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q8_1 => "Q8_1",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
            Self::Q8K => "Q8_K",
            Self::BF16 => "BF16",
            Self::IQ4NL => "IQ4_NL",
            Self::IQ4XS => "IQ4_XS",
            Self::MXFP4 => "MXFP4",
        }
    }

    /// Values per block.
    pub fn block_len(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 | Self::Q8_1 | Self::IQ4NL | Self::MXFP4 => 32,
            Self::Q4K | Self::Q5K | Self::Q6K | Self::Q8K | Self::IQ4XS => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q8_1 => 36,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
            Self::Q8K => 292,
            Self::IQ4NL => iq4::NL_BLOCK_BYTES,
            Self::IQ4XS => iq4::XS_BLOCK_BYTES,
            Self::MXFP4 => mxfp4::BLOCK_BYTES,
        }
    }

    pub fn row_bytes(self, n: usize) -> usize {
        n / self.block_len() * self.block_bytes()
    }

    /// Byte offsets of a block's f16 scale fields (d, and dmin or m where the format has one):
    /// what a test overwrites with small finite values to make random bytes a sane block. MXFP4
    /// has none: its scale is the E8M0 byte at 0 (`mxfp4::e8m0_half`).
    pub fn f16_scale_offsets(self) -> &'static [usize] {
        match self {
            Self::Q4_0 | Self::Q5_0 | Self::Q8_0 | Self::IQ4NL | Self::IQ4XS => &[0],
            Self::Q4_1 | Self::Q5_1 | Self::Q4K | Self::Q5K => &[0, 2],
            Self::Q6K => &[208],
            _ => &[],
        }
    }

    /// The format activations are rounded to before a dot product with weights of this type.
    pub fn vec_dot_type(self) -> GgmlType {
        match self {
            Self::F32 => Self::F32,
            Self::F16 => Self::F16,
            Self::BF16 => Self::BF16,
            Self::Q4_0 | Self::Q5_0 | Self::Q8_0 | Self::IQ4NL | Self::MXFP4 => Self::Q8_0,
            Self::Q4_1 | Self::Q5_1 => Self::Q8_1,
            Self::Q4K | Self::Q5K | Self::Q6K | Self::IQ4XS => Self::Q8K,
            Self::Q8_1 | Self::Q8K => self,
        }
    }
}

#[inline(always)]
pub(crate) fn rd_f16(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

#[inline(always)]
pub(crate) fn wr_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

#[inline(always)]
pub(crate) fn rd_f32(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Unpack the 6-bit scale and min of sub-block `j` of a Q4_K/Q5_K block.
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// The 256 (quant, scale) pairs of a Q6_K block, in value order (quants already minus 32).
pub(crate) fn q6_k_values(b: &[u8]) -> [(i32, i32); 256] {
    let mut v = [(0, 0); 256];
    for half in 0..2 {
        let ql = &b[64 * half..];
        let qh = &b[128 + 32 * half..];
        let sc = &b[192 + 8 * half..];
        let o = 128 * half;
        for l in 0..32 {
            let is = l / 16;
            v[o + l] = (((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32, sc[is] as i8 as i32);
            v[o + l + 32] = (((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32, sc[is + 2] as i8 as i32);
            v[o + l + 64] = (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32, sc[is + 4] as i8 as i32);
            v[o + l + 96] = (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32, sc[is + 6] as i8 as i32);
        }
    }
    v
}

/// Dequantize one row of `n` values.
pub fn dequantize_row(ty: GgmlType, src: &[u8], out: &mut [f32]) {
    let n = out.len();
    let bb = ty.block_bytes();
    match ty {
        GgmlType::F32 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = rd_f32(src, 4 * i);
            }
        }
        GgmlType::F16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = rd_f16(src, 2 * i);
            }
        }
        GgmlType::BF16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = bf16::from_bits(u16::from_le_bytes([src[2 * i], src[2 * i + 1]])).to_f32();
            }
        }
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (has_min, has_high) = match ty {
                GgmlType::Q4_0 => (false, false),
                GgmlType::Q4_1 => (true, false),
                GgmlType::Q5_0 => (false, true),
                _ => (true, true),
            };
            for ib in 0..n / 32 {
                let b = &src[ib * bb..(ib + 1) * bb];
                let d = rd_f16(b, 0);
                let mut off = 2;
                let m = if has_min {
                    off += 2;
                    rd_f16(b, 2)
                } else {
                    0.0
                };
                let qh = if has_high {
                    off += 4;
                    u32::from_le_bytes([b[off - 4], b[off - 3], b[off - 2], b[off - 1]])
                } else {
                    0
                };
                let qs = &b[off..off + 16];
                let bias = match (has_min, has_high) {
                    (true, _) => 0,
                    (false, false) => 8,
                    (false, true) => 16,
                };
                for j in 0..16 {
                    let h0 = ((qh >> j) & 1) << 4;
                    let h1 = ((qh >> (j + 16)) & 1) << 4;
                    let v0 = ((qs[j] & 0xF) as u32 | h0) as i32 - bias;
                    let v1 = ((qs[j] >> 4) as u32 | h1) as i32 - bias;
                    out[ib * 32 + j] = v0 as f32 * d + m;
                    out[ib * 32 + j + 16] = v1 as f32 * d + m;
                }
            }
        }
        GgmlType::Q8_0 | GgmlType::Q8_1 => {
            let off = if ty == GgmlType::Q8_0 { 2 } else { 4 };
            for ib in 0..n / 32 {
                let b = &src[ib * bb..(ib + 1) * bb];
                let d = rd_f16(b, 0);
                for j in 0..32 {
                    out[ib * 32 + j] = b[off + j] as i8 as f32 * d;
                }
            }
        }
        GgmlType::Q8K => {
            for ib in 0..n / 256 {
                let b = &src[ib * bb..(ib + 1) * bb];
                let d = rd_f32(b, 0);
                for j in 0..256 {
                    out[ib * 256 + j] = b[4 + j] as i8 as f32 * d;
                }
            }
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            let five = ty == GgmlType::Q5K;
            for ib in 0..n / 256 {
                let b = &src[ib * bb..(ib + 1) * bb];
                let d = rd_f16(b, 0);
                let dmin = rd_f16(b, 2);
                let scales = &b[4..16];
                let (qh, qs) = if five { (&b[16..48], &b[48..176]) } else { (&b[0..0], &b[16..144]) };
                let y = &mut out[ib * 256..(ib + 1) * 256];
                for j in 0..4 {
                    let (sc1, m1) = scale_min_k4(2 * j, scales);
                    let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
                    let (d1, mm1) = (d * sc1 as f32, dmin * m1 as f32);
                    let (d2, mm2) = (d * sc2 as f32, dmin * m2 as f32);
                    let q = &qs[32 * j..32 * j + 32];
                    for l in 0..32 {
                        let (mut lo, mut hi) = ((q[l] & 0xF) as u32, (q[l] >> 4) as u32);
                        if five {
                            lo |= (((qh[l] >> (2 * j)) & 1) as u32) << 4;
                            hi |= (((qh[l] >> (2 * j + 1)) & 1) as u32) << 4;
                        }
                        y[64 * j + l] = d1 * lo as f32 - mm1;
                        y[64 * j + 32 + l] = d2 * hi as f32 - mm2;
                    }
                }
            }
        }
        GgmlType::IQ4NL => iq4::dequantize_nl(src, out),
        GgmlType::IQ4XS => iq4::dequantize_xs(src, out),
        GgmlType::MXFP4 => mxfp4::dequantize(src, out),
        GgmlType::Q6K => {
            for ib in 0..n / 256 {
                let b = &src[ib * bb..(ib + 1) * bb];
                let d = rd_f16(b, 208);
                for (j, (q, sc)) in q6_k_values(b).into_iter().enumerate() {
                    out[ib * 256 + j] = d * sc as f32 * q as f32;
                }
            }
        }
    }
}

/// Round half to even for |x| < 2^22 (quantized activations are within ±128): adding and
/// removing 1.5 * 2^23 leaves the FPU's own round-to-nearest-even, with no libm call.
#[inline(always)]
pub(crate) fn round_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (x + MAGIC) - MAGIC
}

/// Bytes of one row of `n` activations in `ty`: the GGUF blocks, then for q8_0/q8_1 a tail the
/// SIMD kernels read instead of the f16 fields: `d[nb]` as f32, then q8_1's `s[nb]` as f32 or
/// q8_0's integer block sums `sum(q)[nb]` as i32 (for weights with a zero point).
pub fn act_row_bytes(ty: GgmlType, n: usize) -> usize {
    ty.row_bytes(n) + act_tail_floats(ty) * 4 * (n / ty.block_len()) + ACT_PAD
}

/// Spare bytes after each activation row, so kernels may read a little past its end.
pub const ACT_PAD: usize = 32;

fn act_tail_floats(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q8_0 | GgmlType::Q8_1 => 2,
        _ => 0,
    }
}

/// 32 activations -> q8 values in `q`: scale amax/127, round half to even. Returns (scale, sum of
/// the values).
pub fn q8_block(x: &[f32], q: &mut [u8]) -> (f32, i32) {
    #[cfg(target_arch = "x86_64")]
    if avx2::has_avx2() {
        return avx2::q8_block(x, q);
    }
    scalar::q8_block(x, q)
}

/// 256 activations -> one q8_K block (d, 256 i8, 16 i16 sums): the scale comes from the signed
/// value of largest magnitude, as ggml's x86 path does.
pub fn q8k_block(x: &[f32], b: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if avx2::has_avx2() {
        return avx2::q8k_block(x, b);
    }
    scalar::q8k_block(x, b)
}

/// Round a row of activations to `ty` (a vec_dot_type), exactly as ggml's x86 path does:
/// q8_0/q8_1 scale by 127/amax and round half to even, q8_K keeps the sign of the largest value.
pub fn quantize_row(ty: GgmlType, x: &[f32], out: &mut [u8]) {
    match ty {
        GgmlType::F32 => {
            for (i, v) in x.iter().enumerate() {
                out[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (i, v) in x.iter().enumerate() {
                wr_f16(out, 2 * i, *v);
            }
        }
        GgmlType::BF16 => {
            for (i, v) in x.iter().enumerate() {
                out[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
        GgmlType::Q8_0 | GgmlType::Q8_1 => {
            let bb = ty.block_bytes();
            let off = if ty == GgmlType::Q8_0 { 2 } else { 4 };
            let nb = x.len() / 32;
            let (blocks, tail) = out.split_at_mut(nb * bb);
            assert!(tail.len() >= act_tail_floats(ty) * 4 * nb, "activation buffer lacks the scale tail (size it with act_row_bytes)");
            for (ib, xb) in x.chunks_exact(32).enumerate() {
                let b = &mut blocks[ib * bb..(ib + 1) * bb];
                let (d, sum) = q8_block(xb, &mut b[off..off + 32]);
                wr_f16(b, 0, d);
                let second = if ty == GgmlType::Q8_1 {
                    wr_f16(b, 2, d * sum as f32);
                    rd_f16(b, 2).to_le_bytes()
                } else {
                    sum.to_le_bytes()
                };
                tail[4 * ib..4 * ib + 4].copy_from_slice(&rd_f16(b, 0).to_le_bytes());
                tail[4 * (nb + ib)..4 * (nb + ib) + 4].copy_from_slice(&second);
            }
        }
        GgmlType::Q8K => {
            for (ib, xb) in x.chunks_exact(256).enumerate() {
                q8k_block(xb, &mut out[ib * 292..(ib + 1) * 292]);
            }
        }
        other => panic!("{} is not an activation format", other.name()),
    }
}

/// Bytes of one activation row as `Kernels::Floats` reads it (`widen_row`).
pub fn float_act_bytes(n: usize) -> usize {
    4 * n + ACT_PAD
}

/// Activations as the float kernels (`Kernels::Floats`) read them: f32, each value rounded
/// through `ty` (the weight's vec_dot_type: f16 or bf16, as llama.cpp rounds them; f32 as is).
/// The same values `quantize_row` stores, widened once per matmul instead of once per weight row.
pub fn widen_row(ty: GgmlType, x: &[f32], out: &mut [u8]) {
    let round: fn(f32) -> f32 = match ty {
        GgmlType::F32 => |v| v,
        GgmlType::F16 => |v| f16::from_f32(v).to_f32(),
        GgmlType::BF16 => |v| bf16::from_f32(v).to_f32(),
        other => panic!("{} is not a float activation format", other.name()),
    };
    for (o, &v) in out.chunks_exact_mut(4).zip(x) {
        o.copy_from_slice(&round(v).to_le_bytes());
    }
}

/// Quantize weights to Q8_0 with ggml's reference rounding (`roundf`, 1/d), for QuantMode.q8.
pub fn quantize_weights_q8_0(x: &[f32], out: &mut [u8]) {
    for (ib, xb) in x.chunks_exact(32).enumerate() {
        let b = &mut out[ib * 34..(ib + 1) * 34];
        let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        wr_f16(b, 0, d);
        for j in 0..32 {
            b[2 + j] = (xb[j] * id).round() as i8 as u8;
        }
    }
}

/// The kernels for one weight format on this CPU, and the weight layout they read.
#[derive(Clone, Copy)]
pub enum Kernels {
    /// GGUF rows, one dot product at a time (the scalar twins, IQ4 on AVX2).
    Rows(DotFn),
    /// Float rows (F32, F16, BF16 on AVX2): up to four weight rows against up to four activation
    /// rows, which come as f32 (`widen_row`).
    Floats(DotsFn),
    /// Weights in the `tile` layout: eight rows against one to four activation rows at once.
    Tiles(TileFn),
}

pub fn kernels(ty: GgmlType) -> Kernels {
    #[cfg(target_arch = "x86_64")]
    if let Some(k) = avx2::kernels(ty) {
        return k;
    }
    Kernels::Rows(scalar::dot_fn(ty))
}

/// `dot(weight_row, activation_row, n)`; the activation row is `act_row_bytes` long.
pub type DotFn = fn(&[u8], &[u8], usize) -> f32;
/// `dots(weight_rows, activation_rows, n, out)`: out[i * R + r] = dot(weight_rows[i],
/// activation_rows[r]) for one to four weight rows and R = one to four f32 activation rows
/// (`widen_row`), each the same sums whatever the numbers of rows.
pub type DotsFn = fn(&[&[u8]], &[&[u8]], usize, &mut [f32]);
/// `tile(weight_tiles, activation_rows, n, out)` for T = out.len() / activation_rows.len()
/// consecutive tiles (1 or 2, with up to 8 rows): out[k*R + r][j] = dot(row j of tile k, row r).
pub type TileFn = fn(&[u8], &[&[u8]], usize, &mut [[f32; 8]]);
