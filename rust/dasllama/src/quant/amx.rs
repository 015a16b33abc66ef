//! Intel AMX (Advanced Matrix Extensions, Xeon 4th generation on) for the GEMM of the 32-value
//! formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the K-quants (Q4_K, Q5_K, Q6_K) against two or
//! more activation rows.
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
//! The K-quants fold each sub-block's scale into the weights instead (`b_tiles_k`): value x scale
//! (Q4_K, Q5_K: up to 31 x 63; Q6_K: (q - 32) x an i8 scale) is cut into 128 hi + lo, each a signed
//! byte (lo 0..127), so a superblock is four steps of 64 values with a low and a high B tile each,
//! and one tile product per step and tile sums the sub-blocks already weighed by their scales.
//! The C tiles then hold, per row and weight row, the vector kernels' integer per superblock
//! exactly (128 hi + lo, far inside i32): one store per superblock and A tile instead of one per
//! sub-block, and no per-sub-block vector weighing. The mins and the f32 steps are
//! `avx512::kquant_pair`'s. `gemm_k_twin` is their scalar twin, reading the GGUF superblocks back
//! out of the tiles (the same integers by the plain sum; a test holds the folded tiles to it).
//!
//! Using AMX takes, once per process: CPUID leaf 7 (AMX-TILE, AMX-INT8), the OS enabling the
//! tile state (XCR0 bits 17 and 18), and on Linux the permission to use tile data
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`). It is then on; `DASLLAMA_AMX=0` (or
//! `DASLLAMA_NO_AMX=1`, or `DASLLAMA_NO_SIMD=1`) turns it off; `status()` says which and why, and
//! `DASLLAMA_AMX_LOG=1` prints that once to stderr. Stable Rust has no AMX intrinsics, so the
//! tile instructions are inline assembly.

use super::tile::{tile_bytes, TILE_ROWS};
use super::GgmlType;
use std::borrow::Cow;
use std::sync::OnceLock;

/// Weight rows per B tile: a pair of the CPU's tiles side by side.
pub const COLS: usize = 2 * TILE_ROWS;
/// Activation rows per A tile.
const A_ROWS: usize = 16;
/// Activation rows per kernel call at most. A call unpacks its pair's B tiles once for all its
/// rows: 128 rather than 64 a call gave 6-8% more (Q4_K, one thread's CPU time, the Xeon of
/// docs/benchmarks.md).
pub const MAX_ROWS: usize = 128;
/// Activation bytes a walk of `walk_rows` keeps in L2 (2 MB a core on that Xeon) beside the
/// weights streaming through.
const WALK_BYTES: usize = 1 << 20;

/// Activation rows per walk over a task's weight rows (and so per call), for rows `arb` bytes
/// apart: as many as `WALK_BYTES` holds, in whole pairs of A tiles, 32 to `MAX_ROWS`.
pub fn walk_rows(arb: usize) -> usize {
    (WALK_BYTES / arb.max(1)).clamp(2 * A_ROWS, MAX_ROWS) / (2 * A_ROWS) * (2 * A_ROWS)
}
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
    Fmt::of(ty).is_some() || KQuant::of(ty).is_some()
}

/// A K-quant as these kernels see it (superblocks of 256 values, `tile`'s K-quant layout).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum KQuant {
    /// Eight 32-value sub-blocks, unsigned nibbles, 6-bit scales and mins.
    Q4K,
    /// Q4_K plus a fifth bit per value.
    Q5K,
    /// Sixteen 16-value sub-blocks, six bits less 32 (signed), i8 scales, no mins.
    Q6K,
}

impl KQuant {
    fn of(ty: GgmlType) -> Option<KQuant> {
        match ty {
            GgmlType::Q4K => Some(KQuant::Q4K),
            GgmlType::Q5K => Some(KQuant::Q5K),
            GgmlType::Q6K => Some(KQuant::Q6K),
            _ => None,
        }
    }
    fn ty(self) -> GgmlType {
        match self {
            KQuant::Q4K => GgmlType::Q4K,
            KQuant::Q5K => GgmlType::Q5K,
            KQuant::Q6K => GgmlType::Q6K,
        }
    }
    /// Bytes of one superblock of a tile (eight rows).
    fn sb_bytes(self) -> usize {
        tile_bytes(self.ty(), 256)
    }
}

/// Whether `matmul` runs `ty` on AMX here: the CPU and OS allow it and the format has a kernel.
pub fn usable(ty: GgmlType) -> bool {
    supports(ty) && has_amx()
}

/// Whether a product of `rows` activation rows against weights `k` wide goes to the tiles. Below
/// these sizes the per-call costs (tile configuration, accumulators, a B tile unpacked per block)
/// outweigh the tile unit: on the Xeon with AMX, SmolLM2's 576-wide matrices prefilled 30-40%
/// slower through AMX, and at 16 rows the kernels gain 0-15% against 30-70% at 64
/// (docs/benchmarks.md). The results are the same either way, bit for bit.
pub fn worth(k: usize, rows: usize) -> bool {
    k >= 2048 && rows >= 32
}

/// Whether the GEMM runs on AMX on this thread: as its runtime chose (`switches::Choice`), within
/// what the CPU, the OS and the process switches allow.
pub fn has_amx() -> bool {
    let c = super::switches::current();
    match c.amx {
        _ if c.scalar => false,
        None => status().0,
        Some(on) => on && allowed().0,
    }
}

/// Whether AMX runs for a runtime that chose `choice`, and why (or why not), in words.
pub fn status_for(choice: super::switches::Choice) -> (bool, String) {
    match choice.amx {
        _ if choice.scalar => (false, "off: this runtime runs the scalar kernels".into()),
        None => status().clone(),
        Some(false) => (false, "off: this runtime turned it off (amx=False)".into()),
        Some(true) => allowed().clone(),
    }
}

/// Whether AMX runs by default in this process (a runtime that chose nothing), and why (or why
/// not), in words: decided once.
pub fn status() -> &'static (bool, String) {
    static S: OnceLock<(bool, String)> = OnceLock::new();
    S.get_or_init(|| {
        let s = if super::switches::get().amx == Some(false) { (false, "off: DASLLAMA_AMX=0".into()) } else { allowed().clone() };
        if super::switches::get().amx_log {
            eprintln!("dasllama amx: {}", s.1);
        }
        s
    })
}

/// Whether the CPU, the OS and the process's hard switches (`DASLLAMA_NO_AMX`,
/// `DASLLAMA_NO_SIMD`) allow AMX, whatever the default: decided once.
fn allowed() -> &'static (bool, String) {
    static A: OnceLock<(bool, String)> = OnceLock::new();
    A.get_or_init(detect)
}

fn detect() -> (bool, String) {
    let sw = super::switches::get();
    if sw.no_amx {
        return (false, "off: DASLLAMA_NO_AMX is set".into());
    }
    if sw.no_simd {
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
    let vector = ["avx512f", "avx512bw", "avx512vl", "avx512vnni", "f16c", "fma"];
    let has = |f: &str| match f {
        "avx512vnni" => is_x86_feature_detected!("avx512vnni"),
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
    (true, format!("on: amx_tile, amx_int8{bf16}; tile data permitted; GEMM of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K for 32 or more activation rows against weights 2048 or more wide (DASLLAMA_AMX=0 turns it off)"))
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
    Call { f, pair: pair_of(tiles, ntiles, tb), gap: tb, nb }
}

/// Two tiles `tb` bytes each: borrowed, or the one there is and a zero one after it.
fn pair_of(tiles: &[u8], ntiles: usize, tb: usize) -> Cow<'_, [u8]> {
    if ntiles == 2 {
        Cow::Borrowed(&tiles[..2 * tb])
    } else {
        let mut p = vec![0u8; 2 * tb];
        p[..tb].copy_from_slice(&tiles[..tb]);
        Cow::Owned(p)
    }
}

/// A q8_K activation block: d (f32), 256 quants, then 16 i16 sums of sixteen quants each.
const K_QS: usize = 4;
const K_BSUMS: usize = 260;
const K_BYTES: usize = 292;

/// A checked K-quant call: the format, the pair of tiles, the distance of the second tile from
/// the first, superblocks per row.
struct KCall<'a> {
    kq: KQuant,
    pair: Cow<'a, [u8]>,
    gap: usize,
    nsb: usize,
}

/// `check` for the K-quants: activation rows of q8_K blocks.
fn check_k<'a>(kq: KQuant, tiles: &'a [u8], ntiles: usize, acts: Acts, k: usize, out: &[[f32; COLS]]) -> KCall<'a> {
    let Acts { bytes: act, stride: arb, rows } = acts;
    assert!(k.is_multiple_of(256), "rows of whole superblocks");
    let (nsb, tb) = (k / 256, tile_bytes(kq.ty(), k));
    assert!(matches!(ntiles, 1 | 2) && tiles.len() >= ntiles * tb, "one or two whole tiles");
    assert!((1..=MAX_ROWS).contains(&rows) && out.len() >= rows, "1 to {MAX_ROWS} activation rows, an output for each");
    assert!(arb >= nsb * K_BYTES && act.len() >= (rows - 1) * arb + nsb * K_BYTES, "activation rows too short (size them with act_row_bytes)");
    KCall { kq, pair: pair_of(tiles, ntiles, tb), gap: tb, nsb }
}

/// One GGUF superblock of a K-quant as integers: the 256 values (Q6_K's less 32), the
/// sub-blocks' scales (8 of 32 values, or Q6_K's 16 of 16), the mins (Q4_K, Q5_K), d and dmin.
fn kq_ints(kq: KQuant, b: &[u8]) -> ([i32; 256], Vec<i32>, [i32; 8], f32, f32) {
    let f16 = |at: usize| super::rd_f16(b, at);
    let mut w = [0i32; 256];
    match kq {
        KQuant::Q4K | KQuant::Q5K => {
            let (qh, qs) = if kq == KQuant::Q5K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
            for (v, w) in w.iter_mut().enumerate() {
                // Bytes 32j..32j+32 hold values 64j.. in their low nibbles, 64j+32.. in their high.
                let (j, high, l) = (v / 64, v % 64 >= 32, v % 32);
                let byte = qs[32 * j + l];
                *w = if high { byte >> 4 } else { byte & 0xF } as i32;
                if let Some(qh) = qh {
                    *w += 16 * ((qh[l] >> (v / 32)) & 1) as i32;
                }
            }
            let (sc, m): (Vec<i32>, Vec<i32>) = (0..8).map(|s| super::scale_min_k4(s, &b[4..16])).map(|(s, m)| (s as i32, m as i32)).unzip();
            (w, sc, m.try_into().unwrap(), f16(0), f16(2))
        }
        KQuant::Q6K => {
            let (ql, qh) = (&b[..128], &b[128..192]);
            for (v, w) in w.iter_mut().enumerate() {
                // ggml's order: half n, quarter q of 32 values, l within it.
                let (n, q, l) = (v / 128, v % 128 / 32, v % 32);
                let byte = ql[64 * n + l + 32 * (q % 2)];
                let low = if q < 2 { byte & 0xF } else { byte >> 4 };
                *w = (low | ((qh[32 * n + l] >> (2 * q)) & 3) << 4) as i32 - 32;
            }
            (w, b[192..208].iter().map(|&s| s as i8 as i32).collect(), [0; 8], f16(208), 0.0)
        }
    }
}

/// The scalar twin of the K-quant kernel: the vector kernels' integers per superblock (the
/// scales times the sub-blocks' exact sums, the mins times the activations' sub-block sums) and
/// their f32 steps, `fma(d_w * d_a, total, acc)` then `fnmadd(dmin_w * d_a, mins, acc)`.
fn gemm_k_twin(call: KCall, acts: Acts, out: &mut [[f32; COLS]]) {
    let KCall { kq, pair, gap, nsb } = call;
    let Acts { bytes: act, stride: arb, rows } = acts;
    let (ty, sub) = (kq.ty(), if kq == KQuant::Q6K { 16 } else { 32 });
    let bb = ty.block_bytes();
    let mut acc = [[0.0f32; COLS]; MAX_ROWS];
    let mut g = vec![0u8; ty.row_bytes(256 * nsb)];
    for j in 0..COLS {
        let (base, row) = if j < TILE_ROWS { (0, j) } else { (gap, j - TILE_ROWS) };
        super::tile::untile_row(ty, &pair[base..base + gap], row, &mut g);
        for i in 0..nsb {
            let (w, sc, m, d, dmin) = kq_ints(kq, &g[i * bb..(i + 1) * bb]);
            for (r, acc) in acc[..rows].iter_mut().enumerate() {
                let a = &act[r * arb + i * K_BYTES..][..K_BYTES];
                let q = |v: usize| a[K_QS + v] as i8 as i32;
                let bsum = |s: usize| i16::from_le_bytes([a[K_BSUMS + 2 * s], a[K_BSUMS + 2 * s + 1]]) as i32;
                let total: i32 = sc.iter().enumerate().map(|(s, &sc)| sc * (s * sub..(s + 1) * sub).map(|v| w[v] * q(v)).sum::<i32>()).sum();
                let da = super::rd_f32(a, 0);
                acc[j] = (d * da).mul_add(total as f32, acc[j]);
                if kq != KQuant::Q6K {
                    let mins: i32 = (0..8).map(|s| m[s] * (bsum(2 * s) + bsum(2 * s + 1))).sum();
                    acc[j] = (-(dmin * da)).mul_add(mins as f32, acc[j]);
                }
            }
        }
    }
    out[..rows].copy_from_slice(&acc[..rows]);
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
                        // qh byte 4r+e, bit g: the fifth bit of the same value (`tile`).
                        v |= ((pair[base + qh + 4 * r + e] >> g) & 1) << 4;
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
    if let Some(kq) = KQuant::of(ty) {
        return gemm_k_twin(check_k(kq, tiles, ntiles, acts, k, out), acts, out);
    }
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
    if let Some(kq) = KQuant::of(ty) {
        let call = check_k(kq, tiles, ntiles, acts, k, out);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as below; `check_k` bounds every load of the K-quant kernel.
        unsafe {
            x86::kernel_k(&call, acts.bytes.as_ptr(), acts.stride, acts.rows, out.as_mut_ptr())
        };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no AMX off x86_64 ({:?})", call.nsb);
        return;
    }
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
    use super::super::avx512::{pair_bytes, pair_f16, pair_load, q8k_sub_sums};
    use super::super::tile::{K45_DMIN, K45_M, K45_SC, Q4K_QS, Q5K_QH, Q5K_QS, Q6K_QH, Q6K_QL, Q6K_SC};
    use super::{Call, Fmt, KCall, KQuant, A_ROWS, B_TILE_BYTES, COLS, K_BYTES, K_QS, MAX_ROWS};
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
                    let qh = pair_load(t.add(8 * (f.head() - 4) * nb + 32 * i), gap);
                    let bit = |h: usize| _mm512_test_epi8_mask(qh, _mm512_set1_epi8(1 << h));
                    lo = _mm512_mask_add_epi8(lo, bit(p), lo, b);
                    hi = _mm512_mask_add_epi8(hi, bit(4 + p), hi, b);
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
    /// Bytes of the folded B tiles of one superblock of a pair: four steps of 64 values, each a
    /// low and a high tile of sixteen k-groups by sixteen weight rows by four bytes.
    pub(super) const SB_TILES: usize = 4 * 2 * 1024;

    /// One 64-byte row of a B tile (sixteen weight rows by four values of one sub-block, signed
    /// where `signed`) times each weight row's scale of that sub-block (`sc16`: the scale in both
    /// 16-bit halves of the row's dword), cut into its low seven bits (`lo`, 0..127) and the rest
    /// (`hi`, arithmetic): value x scale = 128 hi + lo, both signed bytes.
    #[inline(always)]
    unsafe fn fold(x: __m512i, sc16: __m512i, signed: bool, lo: *mut u8, hi: *mut u8) {
        let (even, odd) = if signed {
            (_mm512_srai_epi16::<8>(_mm512_slli_epi16::<8>(x)), _mm512_srai_epi16::<8>(x))
        } else {
            (_mm512_and_si512(x, _mm512_set1_epi16(0xFF)), _mm512_srli_epi16::<8>(x))
        };
        let (pe, po) = (_mm512_mullo_epi16(even, sc16), _mm512_mullo_epi16(odd, sc16));
        let (m7, m8) = (_mm512_set1_epi16(0x7F), _mm512_set1_epi16(0xFF));
        let l = _mm512_or_si512(_mm512_and_si512(pe, m7), _mm512_slli_epi16::<8>(_mm512_and_si512(po, m7)));
        let h = _mm512_or_si512(_mm512_and_si512(_mm512_srai_epi16::<7>(pe), m8), _mm512_slli_epi16::<8>(_mm512_srai_epi16::<7>(po)));
        _mm512_store_si512(lo as *mut __m512i, l);
        _mm512_store_si512(hi as *mut __m512i, h);
    }

    /// Sixteen scales (one per weight row, as 32-bit lanes) in both 16-bit halves of each lane.
    #[inline(always)]
    unsafe fn sc16(sc32: __m512i) -> __m512i {
        _mm512_or_si512(_mm512_and_si512(sc32, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32::<16>(sc32))
    }

    /// A superblock of a pair of tiles as folded B tiles (`SB_TILES` bytes at `out`): step s
    /// covers values 64s..64s+64 (the activation's quants in the same order), its low tile at
    /// `out + 2048 s` and its high one 1024 bytes on; k-group g of a step is row g. Each value is
    /// the sub-block's scale times the value (Q6_K's less 32), so one tile product over 64 values
    /// is the vector kernels' scale-weighed sum of their sub-blocks, as 128 hi + lo.
    #[inline(always)]
    unsafe fn b_tiles_k(kq: KQuant, sb: *const u8, gap: usize, out: *mut u8) {
        let (m4, b16) = (_mm512_set1_epi8(0xF), _mm512_set1_epi8(0x10));
        match kq {
            KQuant::Q4K | KQuant::Q5K => {
                let five = kq == KQuant::Q5K;
                let qs = if five { Q5K_QS } else { Q4K_QS };
                for j in 0..4 {
                    // Sub-blocks 2j (low nibbles, k-groups 0..8) and 2j + 1 (high, 8..16).
                    let sc = |s: usize| sc16(_mm512_cvtepu8_epi32(pair_bytes(sb.add(K45_SC + 8 * s), gap)));
                    let (s0, s1) = (sc(2 * j), sc(2 * j + 1));
                    let o = out.add(2048 * j);
                    for c in 0..8 {
                        let raw = pair_load(sb.add(qs + 256 * j + 32 * c), gap);
                        let (mut lo, mut hi) = (_mm512_and_si512(raw, m4), _mm512_and_si512(_mm512_srli_epi16::<4>(raw), m4));
                        if five {
                            let qh = pair_load(sb.add(Q5K_QH + 32 * c), gap);
                            lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh, _mm512_set1_epi8(1 << (2 * j))), lo, b16);
                            hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(qh, _mm512_set1_epi8(2 << (2 * j))), hi, b16);
                        }
                        fold(lo, s0, false, o.add(64 * c), o.add(1024 + 64 * c));
                        fold(hi, s1, false, o.add(64 * (8 + c)), o.add(1024 + 64 * (8 + c)));
                    }
                }
            }
            KQuant::Q6K => {
                let (m30, z) = (_mm512_set1_epi8(0x30), _mm512_set1_epi8(32));
                for s in 0..4 {
                    // Quarters 2(s % 2) and 2(s % 2) + 1 of half s / 2: four sub-blocks of
                    // sixteen values, four k-groups each (`avx512::q6k_quarter`'s unpacking).
                    let h = s / 2;
                    let o = out.add(2048 * s);
                    for g in 0..16 {
                        let (q, c) = (2 * (s % 2) + g / 8, g % 8);
                        let qh = pair_load(sb.add(Q6K_QH + 256 * h + 32 * c), gap);
                        let ql = pair_load(sb.add(Q6K_QL + 512 * h + 32 * (c + 8 * (q % 2))), gap);
                        let low = if q < 2 { _mm512_and_si512(ql, m4) } else { _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4) };
                        let high = match q {
                            0 => _mm512_slli_epi16::<4>(qh),
                            1 => _mm512_slli_epi16::<2>(qh),
                            2 => qh,
                            _ => _mm512_srli_epi16::<2>(qh),
                        };
                        let v = _mm512_sub_epi8(_mm512_or_si512(low, _mm512_and_si512(high, m30)), z);
                        let sub = 8 * h + 4 * (s % 2) + g / 4;
                        let sc = sc16(_mm512_cvtepi8_epi32(pair_bytes(sb.add(Q6K_SC + 8 * sub), gap)));
                        fold(v, sc, true, o.add(64 * g), o.add(1024 + 64 * g));
                    }
                }
            }
        }
    }

    /// The folding alone, for the test against the GGUF values (runs on any AVX-512 CPU).
    #[cfg(test)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn b_tiles_k_for_test(kq: KQuant, sb: *const u8, gap: usize, out: &mut Aligned<SB_TILES>) {
        b_tiles_k(kq, sb, gap, out.0.as_mut_ptr())
    }

    /// The K-quant kernel's tile configuration: tmm0..tmm3 the C tiles (low and high sums of two
    /// A tiles, `rows` x 16 i32), tmm4, tmm5 the A tiles (`rows` x 64 activation bytes), tmm6,
    /// tmm7 a step's low and high B tiles (16 x 64 bytes).
    fn config_k(rows: usize) -> Aligned<64> {
        let mut c = [0u8; 64];
        c[0] = 1;
        let full = (rows, 64u16);
        for (tmm, (r, colsb)) in [full, full, full, full, full, full, (16, 64), (16, 64)].into_iter().enumerate() {
            c[16 + 2 * tmm..18 + 2 * tmm].copy_from_slice(&colsb.to_le_bytes());
            c[48 + tmm] = r as u8;
        }
        Aligned(c)
    }

    /// Bytes of one buffer of C tiles (two A tiles' low and high sums).
    const C_SLOT: usize = 4 * 64 * A_ROWS;

    /// A superblock's sums of up to two A tiles, stored in a slot and not yet scaled into `acc`.
    #[derive(Clone, Copy)]
    struct Pending {
        slot: usize,
        r0: usize,
        /// A tiles (1 or 2) and rows in each.
        tiles: usize,
        mr: usize,
        sb: *const u8,
        i: usize,
    }

    /// The f32 steps of a superblock for `p`'s rows: each row's exact integer (128 hi + lo) and
    /// mins as `avx512::kquant_pair` scales them.
    #[inline(always)]
    unsafe fn scale_rows(acc: &mut [__m512; MAX_ROWS], c: *const u8, p: Pending, six: bool, gap: usize, act: *const u8, arb: usize) {
        let cb = c.add(p.slot * C_SLOT);
        let sb = p.sb;
        let dw = pair_f16(sb, gap);
        // Mins: i16 pairs (m_2p, m_2p+1) of each weight row against the activations'
        // sub-block sums (`avx512::q45k_one`).
        let mm: [__m512i; 4] = std::array::from_fn(|q| {
            let m = |at: usize| _mm_unpacklo_epi8(_mm_loadl_epi64(sb.add(at) as *const __m128i), _mm_loadl_epi64(sb.add(at + 8) as *const __m128i));
            _mm512_cvtepu8_epi16(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(m(K45_M + 16 * q)), m(gap + K45_M + 16 * q)))
        });
        let dmin = if six { _mm512_setzero_ps() } else { pair_f16(sb.add(K45_DMIN), gap) };
        for a in 0..p.tiles {
            for m in 0..p.mr {
                let row = p.r0 + A_ROWS * a + m;
                let lo = _mm512_load_si512(cb.add(2048 * a + 64 * m) as *const __m512i);
                let hi = _mm512_load_si512(cb.add(2048 * a + 1024 + 64 * m) as *const __m512i);
                let total = _mm512_add_epi32(lo, _mm512_slli_epi32::<7>(hi));
                let ab = act.add(row * arb + p.i * K_BYTES);
                let da = _mm512_set1_ps((ab as *const f32).read_unaligned());
                acc[row] = _mm512_fmadd_ps(_mm512_mul_ps(dw, da), _mm512_cvtepi32_ps(total), acc[row]);
                if !six {
                    let sums = _mm512_castsi256_si512(q8k_sub_sums(ab));
                    let mut mins = _mm512_setzero_si512();
                    for (q, mm) in mm.iter().enumerate() {
                        mins = _mm512_dpwssd_epi32(mins, *mm, _mm512_permutexvar_epi32(_mm512_set1_epi32(q as i32), sums));
                    }
                    acc[row] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, da), _mm512_cvtepi32_ps(mins), acc[row]);
                }
            }
        }
    }

    /// `gemm` of a K-quant on a checked call. Per superblock, its sixteen weight rows are
    /// unpacked once for all the activation rows into folded B tiles (`b_tiles_k`: scale times
    /// value, as a low and a high byte), so each A tile takes four 64-value steps of two tile
    /// products each and one store of its two C tiles per superblock, which hold the vector
    /// kernels' integer per row exactly (128 hi + lo); the mins and f32 steps then follow
    /// `avx512::kquant_pair`. Two A tiles go together (one B load for both), and a superblock's
    /// f32 steps run while the next A tiles' products are under way.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
    pub(super) unsafe fn kernel_k(call: &KCall, act: *const u8, arb: usize, rows: usize, out: *mut [f32; COLS]) {
        let (kq, t, gap, nsb) = (call.kq, call.pair.as_ptr(), call.gap, call.nsb);
        let (sbb, six) = (kq.sb_bytes(), kq == KQuant::Q6K);
        let mut acc = [_mm512_setzero_ps(); MAX_ROWS];
        // Written before each read (unpacked per superblock; stored by the tiles), so not
        // cleared: a call is short and these are 16 KB.
        let mut b = std::mem::MaybeUninit::<Aligned<SB_TILES>>::uninit();
        let mut c = std::mem::MaybeUninit::<Aligned<{ 2 * C_SLOT }>>::uninit();
        let (b, c) = (b.as_mut_ptr() as *mut u8, c.as_mut_ptr() as *mut u8);
        let (mut slot, mut pending): (usize, Option<Pending>) = (0, None);
        let full = rows / A_ROWS * A_ROWS;
        for (lo, hi) in [(0, full), (full, rows)] {
            if lo == hi {
                continue;
            }
            let mr = (hi - lo).min(A_ROWS);
            let cfg = config_k(mr);
            // SAFETY (this and every asm block below): AMX is enabled and permitted (`has_amx`);
            // the configuration is 64 bytes; tileloadd reads `mr` rows of 64 activation bytes
            // `arb` apart inside the rows `check_k` bounded (a superblock's quants), or 16 rows
            // of 64 bytes of `b`; tilestored writes `mr` x 64 bytes into each C tile's 1 KB of
            // `c`. Only tile registers and that memory are touched.
            asm!("ldtilecfg [{cfg}]", cfg = in(reg) cfg.0.as_ptr(), options(nostack));
            for i in 0..nsb {
                let sb = t.add(i * sbb);
                b_tiles_k(kq, sb, gap, b);
                let mut r0 = lo;
                while r0 < hi {
                    let tiles = if r0 + 2 * A_ROWS <= hi { 2 } else { 1 };
                    let a = act.add(r0 * arb + i * K_BYTES + K_QS);
                    let cb = c.add(slot * C_SLOT);
                    // Step s: B tiles at 2048 s and 2048 s + 1024, A quants 64 s bytes on.
                    macro_rules! step1 {
                        ($blo:literal, $bhi:literal, $a:literal) => {
                            concat!(
                                "tileloadd tmm6, [{b} + {st}*1 + ",
                                $blo,
                                "]\n",
                                "tileloadd tmm7, [{b} + {st}*1 + ",
                                $bhi,
                                "]\n",
                                "tileloadd tmm4, [{a} + {arb}*1 + ",
                                $a,
                                "]\n",
                                "tdpbssd tmm0, tmm4, tmm6\n",
                                "tdpbssd tmm1, tmm4, tmm7\n",
                            )
                        };
                    }
                    macro_rules! step2 {
                        ($blo:literal, $bhi:literal, $a:literal) => {
                            concat!(
                                "tileloadd tmm6, [{b} + {st}*1 + ",
                                $blo,
                                "]\n",
                                "tileloadd tmm7, [{b} + {st}*1 + ",
                                $bhi,
                                "]\n",
                                "tileloadd tmm4, [{a} + {arb}*1 + ",
                                $a,
                                "]\n",
                                "tileloadd tmm5, [{a2} + {arb}*1 + ",
                                $a,
                                "]\n",
                                "tdpbssd tmm0, tmm4, tmm6\n",
                                "tdpbssd tmm1, tmm4, tmm7\n",
                                "tdpbssd tmm2, tmm5, tmm6\n",
                                "tdpbssd tmm3, tmm5, tmm7\n",
                            )
                        };
                    }
                    if tiles == 2 {
                        asm!(
                            "tilezero tmm0",
                            "tilezero tmm1",
                            "tilezero tmm2",
                            "tilezero tmm3",
                            step2!("0", "1024", "0"),
                            step2!("2048", "3072", "64"),
                            step2!("4096", "5120", "128"),
                            step2!("6144", "7168", "192"),
                            "tilestored [{c} + {st}*1], tmm0",
                            "tilestored [{c} + {st}*1 + 1024], tmm1",
                            "tilestored [{c} + {st}*1 + 2048], tmm2",
                            "tilestored [{c} + {st}*1 + 3072], tmm3",
                            b = in(reg) b,
                            a = in(reg) a,
                            a2 = in(reg) a.add(A_ROWS * arb),
                            arb = in(reg) arb,
                            c = in(reg) cb,
                            st = in(reg) 64usize,
                            out("tmm0") _,
                            out("tmm1") _,
                            out("tmm2") _,
                            out("tmm3") _,
                            out("tmm4") _,
                            out("tmm5") _,
                            out("tmm6") _,
                            out("tmm7") _,
                            options(nostack),
                        );
                    } else {
                        asm!(
                            "tilezero tmm0",
                            "tilezero tmm1",
                            step1!("0", "1024", "0"),
                            step1!("2048", "3072", "64"),
                            step1!("4096", "5120", "128"),
                            step1!("6144", "7168", "192"),
                            "tilestored [{c} + {st}*1], tmm0",
                            "tilestored [{c} + {st}*1 + 1024], tmm1",
                            b = in(reg) b,
                            a = in(reg) a,
                            arb = in(reg) arb,
                            c = in(reg) cb,
                            st = in(reg) 64usize,
                            out("tmm0") _,
                            out("tmm1") _,
                            out("tmm4") _,
                            out("tmm6") _,
                            out("tmm7") _,
                            options(nostack),
                        );
                    }
                    // The previous tiles' f32 steps while these products run.
                    if let Some(p) = pending.take() {
                        scale_rows(&mut acc, c, p, six, gap, act, arb);
                    }
                    pending = Some(Pending { slot, r0, tiles, mr, sb, i });
                    slot ^= 1;
                    r0 += tiles * A_ROWS;
                }
            }
            if let Some(p) = pending.take() {
                scale_rows(&mut acc, c, p, six, gap, act, arb);
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
    /// The K-quants' folded B tiles hold, for every value of a superblock of each of the sixteen
    /// weight rows, its sub-block's scale times the value (Q6_K's less 32) as 128 hi + lo with lo
    /// in 0..127, at the byte `tdpbssd` multiplies with the activation's quant of that value.
    #[test]
    fn folded_k_tiles_hold_scale_times_value() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vl")) {
            eprintln!("skipped: amx K-quant folding: this CPU has no AVX-512 F/BW/VL");
            return;
        }
        let mut state = 777u64;
        for kq in [KQuant::Q4K, KQuant::Q5K, KQuant::Q6K] {
            let ty = kq.ty();
            let tb = tile_bytes(ty, 512);
            for _ in 0..4 {
                // Random GGUF rows (any bytes are a row), tiled as the loader tiles them.
                let rows: Vec<Vec<u8>> = (0..COLS)
                    .map(|_| {
                        (0..ty.row_bytes(512))
                            .map(|_| {
                                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                                (state >> 56) as u8
                            })
                            .collect()
                    })
                    .collect();
                let mut pair = vec![0u8; 2 * tb];
                for (t, half) in pair.chunks_exact_mut(tb).enumerate() {
                    let rs: Vec<&[u8]> = rows[t * TILE_ROWS..(t + 1) * TILE_ROWS].iter().map(|r| &r[..]).collect();
                    super::super::tile::tile_rows(ty, &rs, half);
                }
                let mut g = vec![0u8; ty.row_bytes(512)];
                let bb = ty.block_bytes();
                for i in 0..2 {
                    let mut got = x86::Aligned([0u8; x86::SB_TILES]);
                    // SAFETY: AVX-512 F/BW/VL checked above; the pair holds two whole tiles of two superblocks.
                    unsafe { x86::b_tiles_k_for_test(kq, pair.as_ptr().add(i * kq.sb_bytes()), tb, &mut got) };
                    for j in 0..COLS {
                        let (base, row) = if j < TILE_ROWS { (0, j) } else { (tb, j - TILE_ROWS) };
                        super::super::tile::untile_row(ty, &pair[base..base + tb], row, &mut g);
                        let (w, sc, ..) = kq_ints(kq, &g[i * bb..(i + 1) * bb]);
                        let sub = if kq == KQuant::Q6K { 16 } else { 32 };
                        for v in 0..256 {
                            let at = 2048 * (v / 64) + 64 * (v % 64 / 4) + 4 * j + v % 4;
                            let (lo, hi) = (got.0[at] as i8 as i32, got.0[at + 1024] as i8 as i32);
                            assert!((0..128).contains(&lo), "{kq:?} row {j} value {v}: low part {lo}");
                            assert_eq!(128 * hi + lo, w[v] * sc[v / sub], "{kq:?} superblock {i} row {j} value {v}");
                        }
                    }
                }
            }
        }
    }
}
