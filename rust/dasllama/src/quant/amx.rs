//! Intel AMX (Advanced Matrix Extensions, Xeon 4th generation on) for the GEMM of the 32-value
//! formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 against two or more activation rows.
//!
//! The weights stay in the CPU's tiles of eight interleaved rows (`tile`); nothing is stored
//! twice and one-row decode keeps its vector kernels. Per 32-value block, a pair of consecutive
//! tiles (sixteen weight rows) is unpacked into one AMX B tile in L1 (`b_tile`): eight rows of
//! 64 bytes, row `g` holding values `4g..4g+4` of each of the sixteen weight rows as signed
//! bytes, zero point taken off (Q4_0: nibble - 8, Q5_0: 5-bit value - 16; Q4_1/Q5_1 keep their
//! unsigned values, < 32; Q8_0 is copied). That is the "VNNI" order `tdpbssd` reads B in, and the
//! same bytes the AVX-512 kernel feeds `vpdpbusd` (`avx512::pair_load`). The activation rows'
//! q8 quants of the block are loaded straight from the activation buffer as the A tile (up to
//! sixteen rows of 32 bytes, the rows' stride apart). One `tdpbssd` per block and sixteen
//! activation rows gives the block's exact integer sums, 16 x 16 of them; they are stored and
//! scaled in f32 with AVX-512 exactly as the vector kernels scale theirs:
//!
//! ```text
//! acc = fma(d_w * d_a, (f32) isum, acc)        every format, blocks in order
//! acc = fma(m_w, s_a, acc)                     Q4_1, Q5_1 (s_a: q8_1's d * sum)
//! ```
//!
//! The integer sums are the vector kernels' integers (theirs fold the zero point in through the
//! activation block sums, which is the same integer), so every output is bit-identical to the
//! AVX2/AVX-VNNI/AVX-512 tile kernels, and so to one-row decode. `gemm_twin` is the scalar
//! twin: the same unpacking, the same dot product per k-group as `tdpbssd` defines it, the same
//! f32 steps (`mul_add` is the fused multiply-add).
//!
//! Using AMX takes, once per process: CPUID leaf 7 (AMX-TILE, AMX-INT8), the OS enabling the
//! tile state (XCR0 bits 17 and 18), and on Linux the permission to use tile data
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`). `DASLLAMA_NO_AMX=1` (or
//! `DASLLAMA_NO_SIMD=1`) turns it off; `status()` says which and why, and `DASLLAMA_AMX_LOG=1`
//! prints that once to stderr. Stable Rust has no AMX intrinsics, so the tile instructions are
//! inline assembly.

use super::tile::{tile_bytes, TILE_ROWS};
use super::GgmlType;
use std::borrow::Cow;
use std::sync::OnceLock;

/// Weight rows per B tile: a pair of the CPU's tiles side by side.
pub const COLS: usize = 2 * TILE_ROWS;
/// Activation rows per A tile.
const A_ROWS: usize = 16;
/// Activation rows per kernel call at most.
pub const MAX_ROWS: usize = 64;
/// Bytes of one B tile: eight k-groups of sixteen weight rows by four values.
pub const B_TILE_BYTES: usize = 8 * COLS * 4;

/// A 32-value format as these kernels see it.
#[derive(Clone, Copy)]
struct Fmt {
    /// Q4_1, Q5_1: mins, applied through q8_1's `s`.
    min: bool,
    /// Q5_0, Q5_1: a fifth bit per value.
    five: bool,
    /// Q8_0: signed bytes, 32 of them per block and row.
    signed: bool,
    /// Taken off every value (Q4_0: 8, Q5_0: 16).
    zero: i8,
}

impl Fmt {
    fn of(ty: GgmlType) -> Option<Fmt> {
        let f = |min, five, signed, zero| Some(Fmt { min, five, signed, zero });
        match ty {
            GgmlType::Q4_0 => f(false, false, false, 8),
            GgmlType::Q4_1 => f(true, false, false, 0),
            GgmlType::Q5_0 => f(false, true, false, 16),
            GgmlType::Q5_1 => f(true, true, false, 0),
            GgmlType::Q8_0 => f(false, false, true, 0),
            _ => None,
        }
    }
    /// Bytes per block and row before the quants in a tile (d, m, qh), and of the quants.
    fn head(self) -> usize {
        2 + if self.min { 2 } else { 0 } + if self.five { 4 } else { 0 }
    }
    fn qrow(self) -> usize {
        if self.signed {
            32
        } else {
            16
        }
    }
    /// Activation block bytes (q8_1: 36, q8_0: 34) and where their quants start.
    fn abytes(self) -> usize {
        if self.min {
            36
        } else {
            34
        }
    }
    fn aq(self) -> usize {
        self.abytes() - 32
    }
}

/// Whether `ty` has an AMX kernel (whatever this CPU has).
pub fn supports(ty: GgmlType) -> bool {
    Fmt::of(ty).is_some()
}

/// Whether `matmul` runs `ty` on AMX here: the CPU and OS allow it and the format has a kernel.
pub fn usable(ty: GgmlType) -> bool {
    supports(ty) && has_amx()
}

pub fn has_amx() -> bool {
    status().0
}

/// Whether AMX runs in this process, and why (or why not), in words: decided once.
pub fn status() -> &'static (bool, String) {
    static S: OnceLock<(bool, String)> = OnceLock::new();
    S.get_or_init(|| {
        let s = detect();
        if super::switches::get().amx_log {
            eprintln!("dasllama amx: {}", s.1);
        }
        s
    })
}

fn detect() -> (bool, String) {
    if super::switches::get().no_amx {
        return (false, "off: DASLLAMA_NO_AMX is set".into());
    }
    if super::switches::get().no_simd {
        return (false, "off: DASLLAMA_NO_SIMD is set".into());
    }
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    return detect_x86_linux();
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    (false, "off: the AMX kernels are built for x86_64 Linux only".into())
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect_x86_linux() -> (bool, String) {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    if __cpuid(0).eax < 7 {
        return (false, "off: this CPU has no AMX (amx_int8/amx_tile missing in cpuid: no leaf 7)".into());
    }
    // Leaf 0 lists leaf 7.
    let (leaf1, leaf7) = (__cpuid(1), __cpuid_count(7, 0));
    let bit = |r: u32, b: u32| (r >> b) & 1 == 1;
    let (tile, int8, bf16) = (bit(leaf7.edx, 24), bit(leaf7.edx, 25), bit(leaf7.edx, 22));
    if !(tile && int8) {
        return (false, "off: this CPU has no AMX (amx_int8/amx_tile missing in cpuid)".into());
    }
    let vector = ["avx512f", "avx512bw", "avx512vl", "f16c", "fma"];
    let has = |f: &str| match f {
        "avx512f" => is_x86_feature_detected!("avx512f"),
        "avx512bw" => is_x86_feature_detected!("avx512bw"),
        "avx512vl" => is_x86_feature_detected!("avx512vl"),
        "f16c" => is_x86_feature_detected!("f16c"),
        _ => is_x86_feature_detected!("fma"),
    };
    if let Some(missing) = vector.iter().find(|f| !has(f)) {
        return (false, format!("off: AMX is there but {missing} (the kernels' scale steps) is not"));
    }
    if !bit(leaf1.ecx, 27) {
        return (false, "off: the OS has not enabled XSAVE (cpuid 1 OSXSAVE), so no tile state".into());
    }
    // SAFETY: OSXSAVE is set (checked above), so xgetbv is enabled.
    let xcr0 = unsafe { xcr0() };
    if (xcr0 >> 17) & 3 != 3 {
        return (false, format!("off: the OS has not enabled the tile state (XCR0 = {xcr0:#x}, bits 17 and 18 needed)"));
    }
    if let Err(e) = request_tile_data() {
        return (false, format!("off: Linux refused the tile data (arch_prctl ARCH_REQ_XCOMP_PERM: {e})"));
    }
    let bf16 = if bf16 { ", amx_bf16" } else { "" };
    // The tile kernel has not yet run on an AMX machine in this project's tests (none was at
    // hand); until it has, it runs only when asked for, so a wrong tile sequence cannot reach a
    // user or CI unasked. Its scalar twin is checked bit for bit against the vector kernels.
    if super::switches::get().amx != Some(true) {
        return (false, format!("off: amx_tile, amx_int8{bf16} are here, but the tile kernel is opt-in until verified on an AMX machine (DASLLAMA_AMX=1)"));
    }
    (true, format!("on: amx_tile, amx_int8{bf16}; tile data permitted; GEMM of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 from two activation rows on"))
}

/// XCR0, the state components the OS saves and restores.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    std::arch::x86_64::_xgetbv(0)
}

/// Linux hands out the 8 KB of tile data per thread only to processes that ask, once.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_data() -> std::io::Result<()> {
    extern "C" {
        fn syscall(num: std::ffi::c_long, ...) -> std::ffi::c_long;
    }
    const SYS_ARCH_PRCTL: std::ffi::c_long = 158;
    const ARCH_REQ_XCOMP_PERM: std::ffi::c_long = 0x1023;
    const XFEATURE_XTILEDATA: std::ffi::c_long = 18;
    // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM takes two integers and touches no memory of ours.
    let rc = unsafe { syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Activation rows as `matmul` lays them out: `rows` (1 to `MAX_ROWS`) rows `stride` bytes apart
/// from the start of `bytes`, each made by `quantize_row` for the weight's vec_dot_type.
#[derive(Clone, Copy)]
pub struct Acts<'a> {
    pub bytes: &'a [u8],
    pub stride: usize,
    pub rows: usize,
}

/// One AMX GEMM call `(ty, tiles, ntiles, acts, k, out)`: `out[r][j]` = the dot of weight row
/// `j` of a pair of tiles (rows 8..16 of the second; zero where `ntiles` is 1) with activation
/// row `r`, rows `k` values long.
pub type GemmFn = fn(GgmlType, &[u8], usize, Acts, usize, &mut [[f32; COLS]]);

/// A checked call: the format, the pair of tiles (a copy with a zero second tile where there is
/// one tile), the distance of the second tile from the first, blocks per row.
struct Call<'a> {
    f: Fmt,
    pair: Cow<'a, [u8]>,
    gap: usize,
    nb: usize,
}

/// Asserts a `GemmFn` call is well formed and every load it makes is in bounds.
fn check<'a>(ty: GgmlType, tiles: &'a [u8], ntiles: usize, acts: Acts, k: usize, out: &[[f32; COLS]]) -> Call<'a> {
    let Acts { bytes: act, stride: arb, rows } = acts;
    let f = Fmt::of(ty).unwrap_or_else(|| panic!("{} has no AMX kernel", ty.name()));
    assert!(k.is_multiple_of(32), "rows of whole blocks");
    let (nb, tb) = (k / 32, tile_bytes(ty, k));
    assert!(matches!(ntiles, 1 | 2) && tiles.len() >= ntiles * tb, "one or two whole tiles");
    assert!((1..=MAX_ROWS).contains(&rows) && out.len() >= rows, "1 to {MAX_ROWS} activation rows, an output for each");
    // Quants, then the tail: d[nb] f32 and q8_1's s[nb] f32 (q8_0's block sums, unread here).
    assert!(arb >= nb * (f.abytes() + 8) && act.len() >= (rows - 1) * arb + nb * (f.abytes() + 8), "activation rows too short (size them with act_row_bytes)");
    let pair = if ntiles == 2 {
        Cow::Borrowed(&tiles[..2 * tb])
    } else {
        let mut p = vec![0u8; 2 * tb];
        p[..tb].copy_from_slice(&tiles[..tb]);
        Cow::Owned(p)
    };
    Call { f, pair, gap: tb, nb }
}

/// Block `i`'s B tile of a pair of tiles: byte `64g + 4j + e` is value `4g + e` of weight row `j`
/// (rows 8..16 from the tile `gap` bytes on), as a signed byte with the zero point taken off.
fn b_tile_scalar(f: Fmt, pair: &[u8], gap: usize, nb: usize, i: usize, out: &mut [u8; B_TILE_BYTES]) {
    let qs = 8 * f.head() * nb + 8 * f.qrow() * i;
    let qh = 8 * (f.head() - 4 * f.five as usize) * nb + 32 * i;
    for g in 0..8 {
        for j in 0..COLS {
            let (base, r) = if j < TILE_ROWS { (0, j) } else { (gap, j - TILE_ROWS) };
            for e in 0..4 {
                let v = if f.signed {
                    pair[base + qs + 32 * g + 4 * r + e] as i8
                } else {
                    // Chunk g % 4 holds GGUF bytes 4c..4c+4: low nibbles values 4c.., high 16+4c...
                    let byte = pair[base + qs + 32 * (g % 4) + 4 * r + e];
                    let mut v = if g < 4 { byte & 0xF } else { byte >> 4 };
                    if f.five {
                        // qh word g, bit 4r+e: the fifth bit of the same value (`tile`).
                        let w = u32::from_le_bytes(pair[base + qh + 4 * g..][..4].try_into().unwrap());
                        v |= (((w >> (4 * r + e)) & 1) as u8) << 4;
                    }
                    v as i8 - f.zero
                };
                out[64 * g + 4 * j + e] = v as u8;
            }
        }
    }
}

/// The scalar twin of `gemm`: what its instruction sequence computes, step by step.
pub fn gemm_twin(ty: GgmlType, tiles: &[u8], ntiles: usize, acts: Acts, k: usize, out: &mut [[f32; COLS]]) {
    let Call { f, pair, gap, nb } = check(ty, tiles, ntiles, acts, k, out);
    let Acts { bytes: act, stride: arb, rows } = acts;
    let f16 = |at: usize| super::rd_f16(&pair, at);
    let f32_at = |at: usize| super::rd_f32(act, at);
    let mut acc = [[0.0f32; COLS]; MAX_ROWS];
    let mut b = [0u8; B_TILE_BYTES];
    for i in 0..nb {
        b_tile_scalar(f, &pair, gap, nb, i, &mut b);
        // A tile row r: the 32 quants of activation row r's block i.
        for (r, acc) in acc[..rows].iter_mut().enumerate() {
            let a = &act[r * arb + i * f.abytes() + f.aq()..][..32];
            let tail = r * arb + nb * f.abytes();
            // tdpbssd: C[r][j] += sum over k-groups g of the dot of A's dword g and B's row g, dword j.
            let c: [i32; COLS] = std::array::from_fn(|j| (0..32).map(|kk| a[kk] as i8 as i32 * b[64 * (kk / 4) + 4 * j + kk % 4] as i8 as i32).sum());
            for (j, acc) in acc.iter_mut().enumerate() {
                let (base, row) = if j < TILE_ROWS { (0, j) } else { (gap, j - TILE_ROWS) };
                let d = f16(base + 16 * i + 2 * row) * f32_at(tail + 4 * i);
                *acc = d.mul_add(c[j] as f32, *acc);
                if f.min {
                    *acc = f16(base + 16 * nb + 16 * i + 2 * row).mul_add(f32_at(tail + 4 * (nb + i)), *acc);
                }
            }
        }
    }
    out[..rows].copy_from_slice(&acc[..rows]);
}

/// The AMX kernel (see the module notes). Only where `has_amx()`; panics elsewhere.
pub fn gemm(ty: GgmlType, tiles: &[u8], ntiles: usize, acts: Acts, k: usize, out: &mut [[f32; COLS]]) {
    assert!(has_amx(), "the AMX kernel called on a CPU or process without AMX ({})", status().1);
    let call = check(ty, tiles, ntiles, acts, k, out);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `has_amx` found AMX-TILE/INT8, AVX-512 F/BW/VL, F16C and FMA, the OS's tile state
    // and Linux's permission; `check` bounds every load (tiles, activation rows and tails) and
    // `out` holds `rows` rows.
    unsafe {
        x86::kernel(&call, acts.bytes.as_ptr(), acts.stride, acts.rows, out.as_mut_ptr())
    };
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("no AMX off x86_64 ({:?})", call.nb);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::avx512::{pair_f16, pair_load};
    use super::{Call, Fmt, A_ROWS, B_TILE_BYTES, COLS, MAX_ROWS};
    use std::arch::asm;
    use std::arch::x86_64::*;

    /// Block `i`'s B tile into `out` (64-byte aligned): `b_tile_scalar`'s bytes, built as the
    /// AVX-512 kernel builds its `vpdpbusd` operands. Row p is chunk p's low nibbles (values
    /// 4p..), row 4+p its high ones (values 16+4p..); Q8_0's chunks p and 4+p are those values.
    #[inline(always)]
    unsafe fn b_tile(f: Fmt, t: *const u8, gap: usize, nb: usize, i: usize, out: *mut u8) {
        let qs = t.add(8 * f.head() * nb + 8 * f.qrow() * i);
        let (m4, b, z) = (_mm512_set1_epi8(0xF), _mm512_set1_epi8(0x10), _mm512_set1_epi8(f.zero));
        for p in 0..4 {
            let (u0, u1) = if f.signed {
                (pair_load(qs.add(32 * p), gap), pair_load(qs.add(128 + 32 * p), gap))
            } else {
                let raw = pair_load(qs.add(32 * p), gap);
                let (mut lo, mut hi) = (_mm512_and_si512(raw, m4), _mm512_and_si512(_mm512_srli_epi16::<4>(raw), m4));
                if f.five {
                    let qh = t.add(8 * (f.head() - 4) * nb + 32 * i);
                    let bits =
                        |at: usize| (qh.add(at) as *const u32).read_unaligned() as u64 | ((qh.add(gap + at) as *const u32).read_unaligned() as u64) << 32;
                    lo = _mm512_mask_add_epi8(lo, bits(4 * p), lo, b);
                    hi = _mm512_mask_add_epi8(hi, bits(4 * p + 16), hi, b);
                }
                (_mm512_sub_epi8(lo, z), _mm512_sub_epi8(hi, z))
            };
            _mm512_store_si512(out.add(64 * p) as *mut __m512i, u0);
            _mm512_store_si512(out.add(64 * (4 + p)) as *mut __m512i, u1);
        }
    }

    /// The unpacking alone, for the test against `b_tile_scalar` (runs on any AVX-512 CPU).
    #[cfg(test)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn b_tile_for_test(f: Fmt, t: *const u8, gap: usize, nb: usize, i: usize, out: &mut Aligned<B_TILE_BYTES>) {
        b_tile(f, t, gap, nb, i, out.0.as_mut_ptr())
    }

    #[repr(C, align(64))]
    pub(super) struct Aligned<const N: usize>(pub [u8; N]);

    /// The tile configuration: palette 1; tmm0 the C tile (`rows` x 16 i32), tmm1 the A tile
    /// (`rows` x 32 activation bytes), tmm2 the B tile (8 x 64 bytes). Bytes 16.. hold each
    /// tile's bytes per row (u16), bytes 48.. its rows.
    fn config(rows: usize) -> Aligned<64> {
        let mut c = [0u8; 64];
        c[0] = 1;
        for (tmm, r, colsb) in [(0, rows, 64u16), (1, rows, 32), (2, 8, 64)] {
            c[16 + 2 * tmm..18 + 2 * tmm].copy_from_slice(&colsb.to_le_bytes());
            c[48 + tmm] = r as u8;
        }
        Aligned(c)
    }

    /// `gemm` on a checked call: `rows` activation rows `arb` bytes apart from `act`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    pub(super) unsafe fn kernel(call: &Call, act: *const u8, arb: usize, rows: usize, out: *mut [f32; COLS]) {
        let (f, t, gap, nb) = (call.f, call.pair.as_ptr(), call.gap, call.nb);
        let mut acc = [_mm512_setzero_ps(); MAX_ROWS];
        let mut b = Aligned([0u8; B_TILE_BYTES]);
        let mut c = Aligned([0u8; 64 * A_ROWS]);
        // Whole A tiles in one walk over the blocks, a last partial one (fewer rows) in another:
        // a tile configuration holds one row count. Each row's blocks go in order either way.
        let full = rows / A_ROWS * A_ROWS;
        for (lo, hi) in [(0, full), (full, rows)] {
            if lo == hi {
                continue;
            }
            let mr = (hi - lo).min(A_ROWS);
            let cfg = config(mr);
            // SAFETY (this and every asm block below): AMX is enabled and permitted (`has_amx`);
            // the configuration is 64 bytes; tileloadd reads `mr` rows of 32 activation bytes
            // `arb` apart, inside the rows `gemm` checked, or the 8 x 64 bytes of `b`; tilestored
            // writes `mr` x 64 bytes of `c`. Only tile registers and that memory are touched.
            asm!("ldtilecfg [{cfg}]", cfg = in(reg) cfg.0.as_ptr(), options(nostack));
            for i in 0..nb {
                b_tile(f, t, gap, nb, i, b.0.as_mut_ptr());
                asm!("tileloadd tmm2, [{b} + {stride}*1]", b = in(reg) b.0.as_ptr(), stride = in(reg) 64usize, out("tmm2") _, options(nostack));
                let dw = pair_f16(t.add(16 * i), gap);
                let mw = if f.min { pair_f16(t.add(16 * nb + 16 * i), gap) } else { _mm512_setzero_ps() };
                for r0 in (lo..hi).step_by(A_ROWS) {
                    let a = act.add(r0 * arb + i * f.abytes() + f.aq());
                    asm!(
                        "tilezero tmm0",
                        "tileloadd tmm1, [{a} + {arb}*1]",
                        "tdpbssd tmm0, tmm1, tmm2",
                        "tilestored [{c} + {cstride}*1], tmm0",
                        a = in(reg) a,
                        arb = in(reg) arb,
                        c = in(reg) c.0.as_mut_ptr(),
                        cstride = in(reg) 64usize,
                        out("tmm0") _,
                        out("tmm1") _,
                        options(nostack),
                    );
                    for m in 0..mr {
                        let row = r0 + m;
                        let tail = act.add(row * arb + nb * f.abytes()) as *const f32;
                        let isum = _mm512_load_si512(c.0.as_ptr().add(64 * m) as *const __m512i);
                        let d = _mm512_mul_ps(dw, _mm512_set1_ps(tail.add(i).read_unaligned()));
                        acc[row] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(isum), acc[row]);
                        if f.min {
                            acc[row] = _mm512_fmadd_ps(mw, _mm512_set1_ps(tail.add(nb + i).read_unaligned()), acc[row]);
                        }
                    }
                }
            }
            asm!("tilerelease", options(nostack));
        }
        for (r, a) in acc[..rows].iter().enumerate() {
            _mm512_storeu_ps(out.add(r) as *mut f32, *a);
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// The AVX-512 unpacking equals the scalar one, on any CPU with AVX-512 (no AMX needed).
    #[test]
    fn b_tile_unpacking_matches_the_scalar_twin() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vl")) {
            eprintln!("skipped: amx B-tile unpacking: this CPU has no AVX-512 F/BW/VL");
            return;
        }
        let mut state = 12345u64;
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0] {
            let f = Fmt::of(ty).unwrap();
            let k = 256;
            let nb = k / 32;
            let tb = tile_bytes(ty, k);
            let pair: Vec<u8> = (0..2 * tb + 64)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    (state >> 56) as u8
                })
                .collect();
            for i in 0..nb {
                let mut want = [0u8; B_TILE_BYTES];
                b_tile_scalar(f, &pair, tb, nb, i, &mut want);
                let mut got = x86::Aligned([0u8; B_TILE_BYTES]);
                // SAFETY: AVX-512 F/BW/VL checked above; the pair holds two whole tiles.
                unsafe { x86::b_tile_for_test(f, pair.as_ptr(), tb, nb, i, &mut got) };
                assert_eq!(got.0, want, "{} block {i}", ty.name());
            }
        }
    }
}
