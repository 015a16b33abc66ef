//! The products attention takes over K/V rows stored in a codec's format (`kv::KvCodec`): q·k and
//! o += p·v for one head, and the same over runs of consecutive rows for the query heads sharing a
//! KV head (each row read once for all of them). F16 rows are read with F16C, eight keys' scores
//! finished at once; q8_0 and tq4 rows a head at a time. The scalar path decodes and multiplies.

use crate::kv::codec::{rotate, unrotate};
use crate::kv::KvCodec;
use half::f16;

impl KvCodec {
    /// Query heads (`hd` values each) into the basis K is stored in.
    pub fn prepare_query(self, q: &mut [f32], hd: usize) {
        if self == KvCodec::Tq4 {
            q.chunks_exact_mut(hd).for_each(rotate);
        }
    }

    /// Attention output heads (`hd` values each, summed in the stored basis) back to the model's.
    pub fn finish_output(self, o: &mut [f32], hd: usize) {
        if self == KvCodec::Tq4 {
            o.chunks_exact_mut(hd).for_each(unrotate);
        }
    }

    /// q · k for one head (`k` holds that head's bytes). `q` is already rounded to f16.
    #[inline]
    pub fn dot(self, q: &[f32], k: &[u8]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if crate::quant::avx2::has_avx2() {
            // SAFETY: AVX2/FMA/F16C detected; `k` holds `bytes(q.len())` bytes (asserted).
            assert!(k.len() >= self.bytes(q.len()));
            return unsafe {
                match self {
                    KvCodec::F16 => simd::dot_f16(q, k.as_ptr()),
                    KvCodec::Q8_0 => simd::dot_q8(q, k.as_ptr()),
                    KvCodec::Tq4 => simd::dot_q4(q, k.as_ptr()),
                }
            };
        }
        let mut acc = [0.0f32; 8];
        let mut tmp = vec![0.0f32; q.len()];
        self.decode(k, &mut tmp);
        for (i, (a, b)) in q.iter().zip(&tmp).enumerate() {
            acc[i % 8] += a * b;
        }
        ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
    }

    /// o += p · v for one head.
    #[inline]
    pub fn axpy(self, o: &mut [f32], p: f32, v: &[u8]) {
        #[cfg(target_arch = "x86_64")]
        if crate::quant::avx2::has_avx2() {
            assert!(v.len() >= self.bytes(o.len()));
            // SAFETY: AVX2/FMA/F16C detected; `v` holds enough bytes (asserted).
            return unsafe {
                match self {
                    KvCodec::F16 => simd::axpy_f16(o, p, v.as_ptr()),
                    KvCodec::Q8_0 => simd::axpy_q8(o, p, v.as_ptr()),
                    KvCodec::Tq4 => simd::axpy_q4(o, p, v.as_ptr()),
                }
            };
        }
        let mut tmp = vec![0.0f32; o.len()];
        self.decode(v, &mut tmp);
        o.iter_mut().zip(&tmp).for_each(|(a, b)| *a += p * b);
    }

    /// out[g * stride + j] = q_g · k_j for the query heads `q` (`hd` values each) that share one KV
    /// head, over consecutive rows `k` of it (`n` rows). Each K row is read once for all of them.
    pub fn dot_rows(self, q: &[f32], hd: usize, k: &[u8], n: usize, out: &mut [f32], stride: usize) {
        let (rb, heads) = (self.bytes(hd), q.len() / hd);
        assert!(k.len() >= n * rb && out.len() >= (heads - 1) * stride + n, "KV rows or scores too short");
        #[cfg(target_arch = "x86_64")]
        if self == KvCodec::F16 && hd.is_multiple_of(8) && n >= 8 && heads >= Z_HEADS && crate::quant::avx2::has_avx512() {
            // SAFETY: AVX-512 F (and AVX2/FMA/F16C) detected; bounds asserted above.
            unsafe { simd::dot_rows_f16_z(q, hd, k, n, out, stride) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self == KvCodec::F16 && hd.is_multiple_of(8) && crate::quant::avx2::has_avx2() {
            for (g0, qg) in q.chunks(QK_GROUP * hd).enumerate() {
                // SAFETY: AVX2/FMA/F16C detected; bounds asserted above.
                unsafe { simd::dot_rows_f16(qg, hd, k.as_ptr(), n, &mut out[QK_GROUP * g0 * stride..], stride) };
            }
            return;
        }
        for (g, qg) in q.chunks_exact(hd).enumerate() {
            for j in 0..n {
                out[g * stride + j] = self.dot(qg, &k[j * rb..(j + 1) * rb]);
            }
        }
    }

    /// o_g += Σ_j p[g * stride + j] · v_j for the query heads of one KV head (`o`: heads of `hd`
    /// values), over `n` consecutive rows `v` of it. Each V row is read once for all heads; per
    /// output the sum runs over j in order, whatever the grouping.
    pub fn axpy_rows(self, o: &mut [f32], hd: usize, p: &[f32], stride: usize, v: &[u8], n: usize) {
        let (rb, heads) = (self.bytes(hd), o.len() / hd);
        assert!(v.len() >= n * rb && p.len() >= (heads - 1) * stride + n, "KV rows or weights too short");
        #[cfg(target_arch = "x86_64")]
        if self == KvCodec::F16 && hd.is_multiple_of(32) && crate::quant::avx2::has_avx512() {
            for (g0, og) in o.chunks_mut(PV_GROUP_512 * hd).enumerate() {
                // SAFETY: AVX-512 F (and AVX2/FMA/F16C) detected; bounds asserted above.
                unsafe { simd::axpy_rows_f16_z(og, hd, &p[PV_GROUP_512 * g0 * stride..], stride, v.as_ptr(), n) };
            }
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self == KvCodec::F16 && hd.is_multiple_of(16) && crate::quant::avx2::has_avx2() {
            for (g0, og) in o.chunks_mut(PV_GROUP * hd).enumerate() {
                // SAFETY: AVX2/FMA/F16C detected; bounds asserted above.
                unsafe { simd::axpy_rows_f16(og, hd, &p[PV_GROUP * g0 * stride..], stride, v.as_ptr(), n) };
            }
            return;
        }
        for (g, og) in o.chunks_exact_mut(hd).enumerate() {
            for j in 0..n {
                self.axpy(og, p[g * stride + j], &v[j * rb..(j + 1) * rb]);
            }
        }
    }

    /// Whether `axpy_cols` takes rows of `hd` values: f16 with AVX2, whose fused chains every
    /// p·v kernel of that codec shares, so that a part of the columns gets the whole rows' bits.
    pub fn splits_values(self, hd: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        return self == KvCodec::F16 && hd.is_multiple_of(16) && crate::quant::avx2::has_avx2();
        #[cfg(not(target_arch = "x86_64"))]
        return false;
    }

    /// `axpy_rows` over all the rows in `v` for values `cols` (multiples of 16) of each, into `o`
    /// holding `cols.len()` values a head, with the bits `axpy_rows` gives them (`splits_values`).
    pub fn axpy_cols(self, o: &mut [f32], hd: usize, cols: std::ops::Range<usize>, p: &[f32], stride: usize, v: &[u8]) {
        let (rb, w) = (self.bytes(hd), cols.len());
        let n = v.len() / rb;
        assert!(
            self.splits_values(hd) && w > 0 && cols.start.is_multiple_of(16) && w.is_multiple_of(16) && cols.end <= hd,
            "axpy_cols takes f16 rows, whole groups of 16 values, with AVX2"
        );
        let heads = o.len() / w;
        assert!(v.len() >= n * rb && p.len() >= (heads - 1) * stride + n, "KV rows or weights too short");
        #[cfg(target_arch = "x86_64")]
        for (g0, og) in o.chunks_mut(PV_GROUP * w).enumerate() {
            // SAFETY: AVX2/FMA/F16C detected (`splits_values`); bounds asserted above.
            unsafe { simd::axpy_cols_f16(og, hd, (cols.start, cols.end), &p[PV_GROUP * g0 * stride..], stride, v.as_ptr(), n) };
        }
    }
}

/// Rows widened to f32 for attention (`KvCodec::widens`): converted once for every query head
/// of a block instead of once per group of heads, a block at a time that stays in L1.
impl KvCodec {
    /// Whether attention over this codec's rows widens them to f32 first (`widen`,
    /// `dot_rows_wide`, `axpy_rows_wide`) for `heads` query heads of `hd` values: f16 on AVX-512,
    /// with enough heads that converting beats reading f16 (a decode row's few do not). The
    /// products keep `dot_rows`' and `axpy_rows`' bits, the conversion being exact.
    pub fn widens(self, hd: usize, heads: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        return self == KvCodec::F16 && hd.is_multiple_of(32) && heads >= Z_HEADS && crate::quant::avx2::has_avx512();
        #[cfg(not(target_arch = "x86_64"))]
        return false;
    }

    /// Rows that fit a widened block for rows of `hd` values: enough that a call's fixed work
    /// (the queries interleaved, the outputs loaded and stored) stays small beside its products.
    pub fn wide_block(hd: usize) -> usize {
        (WIDE_BLOCK_F32 / hd).max(32)
    }

    /// The rows in `run` (whole rows of this codec's bytes) as f32 into the front of `dst`.
    pub fn widen(self, run: &[u8], dst: &mut [f32]) {
        assert!(self == KvCodec::F16 && run.len().is_multiple_of(32) && dst.len() >= run.len() / 2, "widen takes whole f16 rows of 16 values");
        #[cfg(target_arch = "x86_64")]
        if crate::quant::avx2::has_avx512() {
            // SAFETY: AVX-512 F detected; `run` holds whole 16-value groups and `dst` room for them (asserted).
            unsafe { simd::widen_f16(run, dst) };
            return;
        }
        self.decode(run, &mut dst[..run.len() / 2]);
    }

    /// Query heads (`hd` values each, `hd` a multiple of 8) as the widened q·k reads them: in
    /// pairs, each pair's values interleaved by eight (eight of the first head, eight of the
    /// second), an odd last head paired with itself. Done once for all the blocks of a call.
    pub fn pair_queries(q: &[f32], hd: usize, qz: &mut Vec<f32>) {
        let heads = q.len() / hd;
        qz.clear();
        for pr in 0..heads.div_ceil(2) {
            let (lo, hi) = (2 * pr * hd, (2 * pr + 1).min(heads - 1) * hd);
            for c in (0..hd).step_by(8) {
                qz.extend_from_slice(&q[lo + c..lo + c + 8]);
                qz.extend_from_slice(&q[hi + c..hi + c + 8]);
            }
        }
    }

    /// `dot_rows` for `heads` query heads (paired by `pair_queries` into `qz`) over `n` rows
    /// already widened (`kf`, `hd` f32 each), with its bits.
    pub fn dot_rows_wide(qz: &[f32], heads: usize, hd: usize, kf: &[f32], n: usize, out: &mut [f32], stride: usize) {
        assert!(
            hd.is_multiple_of(8) && qz.len() >= heads.div_ceil(2) * 2 * hd && kf.len() >= n * hd && out.len() >= (heads - 1) * stride + n,
            "paired queries, widened keys or scores too short"
        );
        #[cfg(target_arch = "x86_64")]
        if crate::quant::avx2::has_avx512() {
            let n8 = n - n % 8;
            // SAFETY: AVX-512 F detected; bounds asserted above.
            unsafe { simd::scores_wide(qz, heads, hd, kf, n8, out, stride) };
            if n8 < n {
                // The last keys padded with zero keys to eight (a score depends on its own key
                // only), scored apart and copied out.
                let mut keys = vec![0.0f32; 8 * hd];
                keys[..(n - n8) * hd].copy_from_slice(&kf[n8 * hd..n * hd]);
                let mut sc = vec![0.0f32; heads * 8];
                // SAFETY: as above, on eight keys and a score row of eight per head.
                unsafe { simd::scores_wide(qz, heads, hd, &keys, 8, &mut sc, 8) };
                for (g, s8) in sc.chunks_exact(8).enumerate() {
                    out[g * stride + n8..g * stride + n].copy_from_slice(&s8[..n - n8]);
                }
            }
            return;
        }
        scores_wide_scalar(qz, heads, hd, kf, n, out, stride);
    }

    /// `axpy_rows` over `n` rows already widened (`vf`, `hd` f32 each), with its bits.
    pub fn axpy_rows_wide(o: &mut [f32], hd: usize, p: &[f32], stride: usize, vf: &[f32], n: usize) {
        let heads = o.len() / hd;
        assert!(vf.len() >= n * hd && p.len() >= (heads - 1) * stride + n, "widened values or weights too short");
        #[cfg(target_arch = "x86_64")]
        if hd.is_multiple_of(32) && crate::quant::avx2::has_avx512() {
            for (g0, og) in o.chunks_mut(PV_GROUP_512 * hd).enumerate() {
                // SAFETY: AVX-512 F detected; bounds asserted above.
                unsafe { simd::axpy_rows_wide(og, hd, &p[PV_GROUP_512 * g0 * stride..], stride, vf.as_ptr(), n) };
            }
            return;
        }
        for (g, og) in o.chunks_exact_mut(hd).enumerate() {
            for (j, v) in vf[..n * hd].chunks_exact(hd).enumerate() {
                let w = p[g * stride + j];
                og.iter_mut().zip(v).for_each(|(a, b)| *a = w.mul_add(*b, *a));
            }
        }
    }
}

/// The scalar twin of the widened q·k: keys `0..n` of `kf` against the paired queries `qz`, each
/// score `dot_f16`'s sum (eight lane chains of fused multiply-adds, then `hsum`'s order).
fn scores_wide_scalar(qz: &[f32], heads: usize, hd: usize, kf: &[f32], n: usize, out: &mut [f32], stride: usize) {
    for g in 0..heads {
        // Head g's eight values of step c sit at pair g / 2, half g % 2.
        let at = |c: usize| (g / 2) * 2 * hd + 2 * c + (g % 2) * 8;
        for j in 0..n {
            let mut a = [0.0f32; 8];
            for c in (0..hd).step_by(8) {
                for l in 0..8 {
                    a[l] = qz[at(c) + l].mul_add(kf[j * hd + c + l], a[l]);
                }
            }
            out[g * stride + j] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
        }
    }
}

/// Query heads the f16 kernels take per pass over the K or V rows: each head holds two
/// accumulators (two keys' scores, or 16 output values), so six heads plus the row being read
/// fill the sixteen AVX2 registers for q·k; p·v measured best at four. The AVX-512 p·v kernel
/// takes six (two 512-bit accumulators a head, twelve of its 32 registers).
#[cfg(target_arch = "x86_64")]
const QK_GROUP: usize = 6;
#[cfg(target_arch = "x86_64")]
const PV_GROUP: usize = 4;
/// Query heads from which q·k takes the AVX-512 pairs (same bits either way): below it (a decode
/// row's few heads) converting the keys to f32 first costs more than reloading the queries.
#[cfg(target_arch = "x86_64")]
const Z_HEADS: usize = 8;
#[cfg(target_arch = "x86_64")]
const PV_GROUP_512: usize = 6;
/// f32 values of the rows widened at a time (16 KiB): with a 48-head block's queries, as given
/// and paired (12 KiB each at head size 64), they fit a 48 KiB L1.
const WIDE_BLOCK_F32: usize = 4096;

#[cfg(target_arch = "x86_64")]
mod simd {
    use crate::quant::avx2::hsum;
    use std::arch::x86_64::*;

    /// Calls `$kernel::<G>` for the number of query heads sharing a KV head (1 to 6).
    macro_rules! per_group {
        ($kernel:ident, $g:expr, $($arg:expr),*) => {
            match $g {
                1 => $kernel::<1>($($arg),*),
                2 => $kernel::<2>($($arg),*),
                3 => $kernel::<3>($($arg),*),
                4 => $kernel::<4>($($arg),*),
                5 => $kernel::<5>($($arg),*),
                _ => $kernel::<6>($($arg),*),
            }
        };
    }

    #[inline(always)]
    unsafe fn f16x8(p: *const u8) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    /// q · k over one f16 row: one accumulator, its lane l summing q[d]·k[d] for d = l mod 8 in
    /// order, then `hsum`. Every f16 score is summed in this order (`dot_rows` too), so a score does
    /// not depend on how many heads or keys a call takes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f16(q: &[f32], k: *const u8) -> f32 {
        let n = q.len();
        let a = q.as_ptr();
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= n {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), f16x8(k.add(2 * i)), acc);
            i += 8;
        }
        let mut s = hsum(acc);
        while i < n {
            s += *a.add(i) * super::f16::from_bits((k.add(2 * i) as *const u16).read_unaligned()).to_f32();
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_f16(o: &mut [f32], p: f32, v: *const u8) {
        let n = o.len();
        let y = o.as_mut_ptr();
        let pv = _mm256_set1_ps(p);
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(y.add(i), _mm256_fmadd_ps(pv, f16x8(v.add(2 * i)), _mm256_loadu_ps(y.add(i))));
            i += 8;
        }
        while i < n {
            *y.add(i) += p * super::f16::from_bits((v.add(2 * i) as *const u16).read_unaligned()).to_f32();
            i += 1;
        }
    }

    /// Up to four query heads against each K row; per head the summation order is `dot_f16`'s,
    /// so scores do not depend on grouping. Keys go in pairs (p, p + 4), each pair's 2G chains
    /// interleaved: one accumulator per score keeps them all in registers.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_rows_f16(q: &[f32], hd: usize, k: *const u8, n: usize, out: &mut [f32], stride: usize) {
        per_group!(scores, q.len() / hd, q, hd, k, n, out, stride)
    }

    /// The eight lanes each of G query heads sum against keys `x` and `y` (`dot_f16`'s chains).
    #[inline(always)]
    unsafe fn key_sums<const G: usize>(q: *const f32, hd: usize, x: *const u8, y: *const u8) -> ([__m256; G], [__m256; G]) {
        let (mut ax, mut ay) = ([_mm256_setzero_ps(); G], [_mm256_setzero_ps(); G]);
        for i in (0..hd).step_by(8) {
            let (kx, ky) = (f16x8(x.add(2 * i)), f16x8(y.add(2 * i)));
            for g in 0..G {
                let qv = _mm256_loadu_ps(q.add(g * hd + i));
                ax[g] = _mm256_fmadd_ps(qv, kx, ax[g]);
                ay[g] = _mm256_fmadd_ps(qv, ky, ay[g]);
            }
        }
        (ax, ay)
    }

    /// Eight keys' lanes, transposed: [a.lo + a.hi | b.lo + b.hi] (`hsum`'s first step for a and b).
    #[inline(always)]
    unsafe fn fold_halves(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(a, b), _mm256_permute2f128_ps::<0x31>(a, b))
    }

    /// Per 128-bit lane [a0 + a2, a1 + a3, b0 + b2, b1 + b3] (its second step).
    #[inline(always)]
    unsafe fn fold_pairs(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(_mm256_shuffle_ps::<0b01_00_01_00>(a, b), _mm256_shuffle_ps::<0b11_10_11_10>(a, b))
    }

    /// Per 128-bit lane [a0 + a1, a2 + a3, b0 + b1, b2 + b3] (its last step).
    #[inline(always)]
    unsafe fn fold_last(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(_mm256_shuffle_ps::<0b10_00_10_00>(a, b), _mm256_shuffle_ps::<0b11_01_11_01>(a, b))
    }

    /// out[g * stride + j] = q_g · k_j for keys 0..n. Eight keys at a time are finished together,
    /// transposed, in `hsum`'s order (lanes i and i+4; then 0+2 and 1+3; then the two): one vector
    /// op per step for all eight instead of a shuffle chain per key, and the same bits.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // g indexes two arrays in step
    unsafe fn scores<const G: usize>(q: &[f32], hd: usize, k: *const u8, n: usize, out: &mut [f32], stride: usize) {
        assert!(out.len() >= (G - 1) * stride + n, "score rows out of bounds");
        let (a, o) = (q.as_ptr(), out.as_mut_ptr());
        let row = |j: usize| k.add(2 * hd * j);
        let mut j = 0;
        while j + 8 <= n {
            // Keys p and p + 4 share a vector after the first step, so the last one lands in order.
            let mut t = [[_mm256_setzero_ps(); G]; 4];
            for (p, tp) in t.iter_mut().enumerate() {
                let (x, y) = key_sums::<G>(a, hd, row(j + p), row(j + p + 4));
                for g in 0..G {
                    tp[g] = fold_halves(x[g], y[g]);
                }
            }
            for g in 0..G {
                // SAFETY: g * stride + j + 8 <= (G - 1) * stride + n <= out.len() (asserted).
                _mm256_storeu_ps(o.add(g * stride + j), fold_last(fold_pairs(t[0][g], t[1][g]), fold_pairs(t[2][g], t[3][g])));
            }
            j += 8;
        }
        while j < n {
            let (x, y) = key_sums::<G>(a, hd, row(j), row((j + 1).min(n - 1)));
            for g in 0..G {
                out[g * stride + j] = hsum(x[g]);
                if j + 1 < n {
                    out[g * stride + j + 1] = hsum(y[g]);
                }
            }
            j += 2;
        }
    }

    /// Up to four heads' outputs, 16 values at a time, stay in registers while every V row
    /// (converted once for all of them) adds into them: 2G accumulators, two V vectors and a
    /// broadcast, so nothing spills.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_rows_f16(o: &mut [f32], hd: usize, p: &[f32], stride: usize, v: *const u8, n: usize) {
        per_group!(values_f16, o.len() / hd, o, hd, (0, hd), p, stride, v, n)
    }

    /// `axpy_rows_f16` over values `c0..c1` of each row only (multiples of 16), into `o` holding
    /// that many values a head: each output's chain of fmas is the whole rows' own.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_cols_f16(o: &mut [f32], hd: usize, (c0, c1): (usize, usize), p: &[f32], stride: usize, v: *const u8, n: usize) {
        per_group!(values_f16, o.len() / (c1 - c0), o, hd, (c0, c1), p, stride, v, n)
    }

    /// Values `c0..c1` of `hd`-value rows (`o`: `c1 - c0` a head), the rows a block at a time
    /// (`value_block`) so that every 16-value column walks them in L1.
    #[inline(always)]
    unsafe fn values_f16<const G: usize>(o: &mut [f32], hd: usize, (c0, c1): (usize, usize), p: &[f32], stride: usize, v: *const u8, n: usize) {
        let (y, w) = (o.as_mut_ptr(), c1 - c0);
        let block = value_block(2 * hd);
        for j0 in (0..n).step_by(block) {
            for c in (c0..c1).step_by(16) {
                let mut acc: [[__m256; 2]; G] = std::array::from_fn(|g| std::array::from_fn(|m| _mm256_loadu_ps(y.add(g * w + c - c0 + 8 * m))));
                for j in j0..(j0 + block).min(n) {
                    let row = v.add(2 * (hd * j + c));
                    let vv = [f16x8(row), f16x8(row.add(16))];
                    for (g, ac) in acc.iter_mut().enumerate() {
                        let pv = _mm256_set1_ps(*p.get_unchecked(g * stride + j));
                        ac[0] = _mm256_fmadd_ps(pv, vv[0], ac[0]);
                        ac[1] = _mm256_fmadd_ps(pv, vv[1], ac[1]);
                    }
                }
                for (g, ac) in acc.iter().enumerate() {
                    for (m, a) in ac.iter().enumerate() {
                        _mm256_storeu_ps(y.add(g * w + c - c0 + 8 * m), *a);
                    }
                }
            }
        }
    }

    /// Rows of `row_bytes` a p·v kernel takes at a time. Each column of the outputs walks every
    /// row, so without blocks every 16 (AVX-512: 32) columns fetched the rows again: from L2 for
    /// a 256-row page of 128-value heads (64 KB), from memory for a run larger than L2. A block
    /// that stays in L1 is fetched once; stopping the fma chains at its end (stored, reloaded)
    /// leaves each output's sum in the same order, so the same bits.
    /// `examples/attn_rate`, one thread, AMD EPYC Zen 3, G multiply-adds/s before -> after:
    /// - heads of 128 over 256-row pages: one head 8-12 -> 15-16, four 25-29 -> 37-38;
    /// - heads of 128 or 256 in one run of 3,072 rows: one head 5-6 -> 11-16, four 17-25 -> 30-38;
    /// - heads of 256 over 256-row pages (Gemma 3's four a K/V head) and heads of 64: the same
    ///   within the noise.
    ///
    /// Blocks of 8 and 16 KB measured alike.
    #[inline(always)]
    fn value_block(row_bytes: usize) -> usize {
        ((16 << 10) / row_bytes).max(8)
    }

    // ---- AVX-512 q·k for several query heads: two heads share a 512-bit register (each 256-bit
    // half one head's eight lane chains, `dot_f16`'s), against a key converted to f32 once per
    // call and broadcast to both halves. Eight keys' chains stay in registers while the queries
    // stream from L1, so an FMA serves 16 products with no query reload per key; the folds run
    // on both heads at once in `scores`' order, so a score keeps `dot_f16`'s bits.

    thread_local! {
        /// A block of a call's keys as f32 (`dot_rows_f16_z`).
        static WIDE_KEYS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
        /// Query heads paired for `scores_wide` (`dot_rows_f16_z`).
        static QUERY_PAIRS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// `dot_rows` for `Z_HEADS` or more heads and eight or more keys: the keys up to a multiple of
    /// eight widened a block at a time (`widen_f16`, `scores_wide`), the rest through `dot_rows_f16`.
    ///
    /// # Safety
    /// The CPU has AVX-512 F (and AVX2/FMA/F16C); `k` holds `n` f16 rows of `hd` values, `hd` is
    /// a multiple of 8 and `out` holds `(heads - 1) * stride + n` scores (`dot_rows` asserts both).
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    pub unsafe fn dot_rows_f16_z(q: &[f32], hd: usize, k: &[u8], n: usize, out: &mut [f32], stride: usize) {
        let n8 = n - n % 8;
        let block = super::KvCodec::wide_block(hd) / 8 * 8;
        let heads = q.len() / hd;
        QUERY_PAIRS.with_borrow_mut(|qz| {
            super::KvCodec::pair_queries(q, hd, qz);
            WIDE_KEYS.with_borrow_mut(|kf| {
                if kf.len() < block * hd {
                    kf.resize(block * hd, 0.0);
                }
                for j0 in (0..n8).step_by(block) {
                    let nb = block.min(n8 - j0);
                    // nb * hd is a multiple of 64: whole 16-value conversions.
                    widen_f16(&k[2 * hd * j0..2 * hd * (j0 + nb)], kf);
                    scores_wide(qz, heads, hd, kf, nb, &mut out[j0..], stride);
                }
            });
        });
        if n8 < n {
            for (g0, qg) in q.chunks(super::QK_GROUP * hd).enumerate() {
                dot_rows_f16(qg, hd, k.as_ptr().add(2 * hd * n8), n - n8, &mut out[super::QK_GROUP * g0 * stride + n8..], stride);
            }
        }
    }

    /// f16 values (`src`, whole groups of 16) as f32 into the front of `dst`.
    ///
    /// # Safety
    /// The CPU has AVX-512 F; `dst` holds `src.len() / 2` values (`KvCodec::widen` asserts it).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn widen_f16(src: &[u8], dst: &mut [f32]) {
        for (i, d) in dst[..src.len() / 2].chunks_exact_mut(16).enumerate() {
            _mm512_storeu_ps(d.as_mut_ptr(), _mm512_cvtph_ps(_mm256_loadu_si256(src.as_ptr().add(32 * i) as *const __m256i)));
        }
    }

    /// `dot_rows`' scores against `n` widened keys (`n` a multiple of 8): the query heads in
    /// pairs (`qz`, from `pair_queries`), two pairs a pass (`scores_z`).
    ///
    /// # Safety
    /// The CPU has AVX-512 F; `qz` holds the pairs of `heads` heads, `kf` `n` rows of `hd` values,
    /// `hd` is a multiple of 8 and `out` holds `(heads - 1) * stride + n` scores.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn scores_wide(qz: &[f32], heads: usize, hd: usize, kf: &[f32], n: usize, out: &mut [f32], stride: usize) {
        let (o, pairs) = (out.as_mut_ptr(), heads.div_ceil(2));
        let mut pr = 0;
        while pr < pairs {
            let take = (pairs - pr).min(2);
            let outs: [[Option<*mut f32>; 2]; 2] = std::array::from_fn(|i| {
                std::array::from_fn(|h| {
                    let head = 2 * (pr + i) + h;
                    // SAFETY (of the offset): head < heads, so head * stride + n <= out.len().
                    (i < take && head < heads).then(|| o.add(head * stride))
                })
            });
            let (qp, k) = (qz.as_ptr().add(pr * 2 * hd), kf.as_ptr());
            if take == 2 {
                scores_z::<2>(qp, hd, k, n, outs);
            } else {
                scores_z::<1>(qp, hd, k, n, outs);
            }
            pr += take;
        }
    }

    /// [a.i + b.i] of `fold_halves`, for two heads at once: lanes of 128 bits in, per head
    /// [x.L0 + x.L1 | y.L0 + y.L1], out as [lo.L0, hi.L0, lo.L1, hi.L1].
    #[inline(always)]
    unsafe fn fold_halves_z(x: __m512, y: __m512) -> __m512 {
        _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(x, y), _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y))
    }

    #[inline(always)]
    unsafe fn fold_pairs_z(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(_mm512_shuffle_ps::<0b01_00_01_00>(a, b), _mm512_shuffle_ps::<0b11_10_11_10>(a, b))
    }

    #[inline(always)]
    unsafe fn fold_last_z(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(_mm512_shuffle_ps::<0b10_00_10_00>(a, b), _mm512_shuffle_ps::<0b11_01_11_01>(a, b))
    }

    /// Scores of `P` head pairs (`qp`: their interleaved queries, `2 * hd` values a pair) against
    /// keys 0..n (`n` a multiple of 8, `kf` f32 rows of `hd`), stored through `outs[pair][half]`.
    #[inline(always)]
    unsafe fn scores_z<const P: usize>(qp: *const f32, hd: usize, kf: *const f32, n: usize, outs: [[Option<*mut f32>; 2]; 2]) {
        let mut j = 0;
        while j < n {
            let mut acc = [[_mm512_setzero_ps(); 8]; P];
            for c in (0..hd).step_by(8) {
                let kb: [__m512; 8] =
                    std::array::from_fn(|t| _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(kf.add((j + t) * hd + c) as *const f64))));
                for (p, ap) in acc.iter_mut().enumerate() {
                    let qv = _mm512_loadu_ps(qp.add(p * 2 * hd + 2 * c));
                    for t in 0..8 {
                        ap[t] = _mm512_fmadd_ps(qv, kb[t], ap[t]);
                    }
                }
            }
            for (p, ap) in acc.iter().enumerate() {
                let s: [__m512; 4] = std::array::from_fn(|t| fold_halves_z(ap[t], ap[t + 4]));
                let r = fold_last_z(fold_pairs_z(s[0], s[1]), fold_pairs_z(s[2], s[3]));
                // [lo.L0, hi.L0, lo.L1, hi.L1] -> [lo | hi]
                let r = _mm512_shuffle_f32x4::<0b11_01_10_00>(r, r);
                if let Some(lo) = outs[p][0] {
                    _mm256_storeu_ps(lo.add(j), _mm512_castps512_ps256(r));
                }
                if let Some(hi) = outs[p][1] {
                    _mm256_storeu_ps(hi.add(j), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(r))));
                }
            }
            j += 8;
        }
    }

    // ---- AVX-512 p·v: sixteen output values an instruction, each still summed over the rows in
    // order, so the outputs are `values_f16`'s bits. (q·k stays on 256 bits: two keys' chains in
    // one 512-bit register measured no faster, and slower for a decode row's few heads.)
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    pub unsafe fn axpy_rows_f16_z(o: &mut [f32], hd: usize, p: &[f32], stride: usize, v: *const u8, n: usize) {
        per_group!(values_z, o.len() / hd, o, hd, p, stride, v, n)
    }

    /// `values_f16` on 32 output values a step (two 512-bit accumulators a head).
    #[inline(always)]
    unsafe fn values_z<const G: usize>(o: &mut [f32], hd: usize, p: &[f32], stride: usize, v: *const u8, n: usize) {
        values_512::<G, true>(o, hd, p, stride, v, n)
    }

    /// `axpy_rows_f16_z` over widened rows (`vf`: f32 rows of `hd`).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn axpy_rows_wide(o: &mut [f32], hd: usize, p: &[f32], stride: usize, vf: *const f32, n: usize) {
        per_group!(values_wide, o.len() / hd, o, hd, p, stride, vf, n)
    }

    /// `values_z` with the rows already f32.
    #[inline(always)]
    unsafe fn values_wide<const G: usize>(o: &mut [f32], hd: usize, p: &[f32], stride: usize, vf: *const f32, n: usize) {
        values_512::<G, false>(o, hd, p, stride, vf as *const u8, n)
    }

    /// Sixteen values from `at` (in values) of f16 (`F16`) or f32 rows, as f32.
    #[inline(always)]
    unsafe fn value16<const F16: bool>(v: *const u8, at: usize) -> __m512 {
        if F16 {
            _mm512_cvtph_ps(_mm256_loadu_si256(v.add(2 * at) as *const __m256i))
        } else {
            _mm512_loadu_ps((v as *const f32).add(at))
        }
    }

    /// The 512-bit p·v over rows `v` of f16 (`F16`) or f32 values: each output summed over the
    /// rows in order, whichever they are (the conversion is exact), so both give the same bits.
    #[inline(always)]
    unsafe fn values_512<const G: usize, const F16: bool>(o: &mut [f32], hd: usize, p: &[f32], stride: usize, v: *const u8, n: usize) {
        let y = o.as_mut_ptr();
        // As `values_f16`: the rows a block at a time, for each 32-value column.
        let block = value_block(if F16 { 2 * hd } else { 4 * hd });
        for j0 in (0..n).step_by(block) {
            for c in (0..hd).step_by(32) {
                let mut acc: [[__m512; 2]; G] = std::array::from_fn(|g| std::array::from_fn(|m| _mm512_loadu_ps(y.add(g * hd + c + 16 * m))));
                for j in j0..(j0 + block).min(n) {
                    let vv = [value16::<F16>(v, hd * j + c), value16::<F16>(v, hd * j + c + 16)];
                    for (g, ac) in acc.iter_mut().enumerate() {
                        let pv = _mm512_set1_ps(*p.get_unchecked(g * stride + j));
                        ac[0] = _mm512_fmadd_ps(pv, vv[0], ac[0]);
                        ac[1] = _mm512_fmadd_ps(pv, vv[1], ac[1]);
                    }
                }
                for (g, ac) in acc.iter().enumerate() {
                    for (m, a) in ac.iter().enumerate() {
                        _mm512_storeu_ps(y.add(g * hd + c + 16 * m), *a);
                    }
                }
            }
        }
    }

    /// The 32 values of a q4_0 block (nibble - 8) as four vectors of eight f32, unscaled.
    #[inline(always)]
    unsafe fn q4_block(blk: *const u8) -> [__m256; 4] {
        let raw = _mm_loadu_si128(blk.add(2) as *const __m128i);
        let m4 = _mm_set1_epi8(0xF);
        let eight = _mm_set1_epi8(8);
        let lo = _mm_sub_epi8(_mm_and_si128(raw, m4), eight);
        let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), eight);
        let f = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
        [f(lo), f(_mm_srli_si128(lo, 8)), f(hi), f(_mm_srli_si128(hi, 8))]
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4(q: &[f32], k: *const u8) -> f32 {
        let a = q.as_ptr();
        let mut acc = _mm256_setzero_ps();
        for b in 0..q.len() / 32 {
            let blk = k.add(18 * b);
            let v = q4_block(blk);
            let mut t = _mm256_mul_ps(_mm256_loadu_ps(a.add(32 * b)), v[0]);
            for (j, vj) in v.iter().enumerate().skip(1) {
                t = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(32 * b + 8 * j)), *vj, t);
            }
            let d = _mm256_set1_ps(super::f16::from_bits((blk as *const u16).read_unaligned()).to_f32());
            acc = _mm256_fmadd_ps(d, t, acc);
        }
        hsum(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_q4(o: &mut [f32], p: f32, v: *const u8) {
        let y = o.as_mut_ptr();
        for b in 0..o.len() / 32 {
            let blk = v.add(18 * b);
            let pd = _mm256_set1_ps(p * super::f16::from_bits((blk as *const u16).read_unaligned()).to_f32());
            for (j, vj) in q4_block(blk).iter().enumerate() {
                let at = y.add(32 * b + 8 * j);
                _mm256_storeu_ps(at, _mm256_fmadd_ps(pd, *vj, _mm256_loadu_ps(at)));
            }
        }
    }

    /// 8 i8 at `p` as f32.
    #[inline(always)]
    unsafe fn i8x8(p: *const u8) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8(q: &[f32], k: *const u8) -> f32 {
        let a = q.as_ptr();
        let mut acc = _mm256_setzero_ps();
        for b in 0..q.len() / 32 {
            let blk = k.add(34 * b);
            let d = _mm256_set1_ps(super::f16::from_bits((blk as *const u16).read_unaligned()).to_f32());
            let mut t = _mm256_mul_ps(_mm256_loadu_ps(a.add(32 * b)), i8x8(blk.add(2)));
            for j in 1..4 {
                t = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(32 * b + 8 * j)), i8x8(blk.add(2 + 8 * j)), t);
            }
            acc = _mm256_fmadd_ps(d, t, acc);
        }
        hsum(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_q8(o: &mut [f32], p: f32, v: *const u8) {
        let y = o.as_mut_ptr();
        for b in 0..o.len() / 32 {
            let blk = v.add(34 * b);
            let pd = _mm256_set1_ps(p * super::f16::from_bits((blk as *const u16).read_unaligned()).to_f32());
            for j in 0..4 {
                let at = y.add(32 * b + 8 * j);
                _mm256_storeu_ps(at, _mm256_fmadd_ps(pd, i8x8(blk.add(2 + 8 * j)), _mm256_loadu_ps(at)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` f16 rows of `hd` values, the same on every call.
    fn f16_rows(n: usize, hd: usize) -> Vec<u8> {
        let vals: Vec<f32> = (0..n * hd).map(|i| ((i * 7919 % 2000) as f32 - 1000.0) * 0.003).collect();
        let mut rows = vec![0u8; 2 * n * hd];
        KvCodec::F16.encode(&vals, &mut rows);
        rows
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// What runs on this CPU (SIMD or not) against plain sums over the decoded rows, for every
    /// codec and for heads that take the grouped f16 kernels and heads that do not.
    #[test]
    fn row_products_match_the_decoded_rows() {
        for codec in [KvCodec::F16, KvCodec::Q8_0, KvCodec::Tq4] {
            for (hd, heads) in [(64, 4), (128, 3), (32, 1)] {
                let n = 23;
                let vals: Vec<f32> = (0..n * hd).map(|i| ((i * 7919 % 2000) as f32 - 1000.0) * 0.003).collect();
                let rb = codec.bytes(hd);
                let mut rows = vec![0u8; n * rb];
                for (src, dst) in vals.chunks_exact(hd).zip(rows.chunks_exact_mut(rb)) {
                    codec.encode(src, dst);
                }
                let mut dec = vec![0.0f32; n * hd];
                for (src, dst) in rows.chunks_exact(rb).zip(dec.chunks_exact_mut(hd)) {
                    codec.decode(src, dst);
                }
                let q: Vec<f32> = (0..heads * hd).map(|i| crate::cpu::ops::round_f16(((i * 31 % 97) as f32 - 48.0) * 0.02)).collect();
                let mut sc = vec![0.0f32; heads * n];
                codec.dot_rows(&q, hd, &rows, n, &mut sc, n);
                let p: Vec<f32> = (0..heads * n).map(|i| (i % 7) as f32 * 0.1).collect();
                let mut o = vec![0.0f32; heads * hd];
                codec.axpy_rows(&mut o, hd, &p, n, &rows, n);
                for g in 0..heads {
                    for j in 0..n {
                        let want: f64 = (0..hd).map(|i| q[g * hd + i] as f64 * dec[j * hd + i] as f64).sum();
                        assert!((sc[g * n + j] as f64 - want).abs() <= 1e-4 * want.abs().max(1.0), "{codec:?} hd {hd} head {g} key {j}");
                    }
                    for i in 0..hd {
                        let want: f64 = (0..n).map(|j| p[g * n + j] as f64 * dec[j * hd + i] as f64).sum();
                        assert!((o[g * hd + i] as f64 - want).abs() <= 1e-4 * want.abs().max(1.0), "{codec:?} hd {hd} head {g} value {i}");
                    }
                }
            }
        }
    }

    /// A head's p·v sum is the single-row axpy's bits, row after row, whatever the call takes
    /// with it (heads in groups, 256- or 512-bit kernels).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16_values_do_not_depend_on_grouping() {
        // The last three span several of the kernels' blocks of rows (`value_block`), the last
        // block partial.
        for (hd, n, heads) in [(128, 37, 4), (64, 19, 7), (96, 9, 3), (256, 70, 4), (128, 150, 3), (64, 300, 1)] {
            let rows = f16_rows(n, hd);
            let p: Vec<f32> = (0..heads * n).map(|i| ((i * 13 % 29) as f32) * 0.01).collect();
            let start: Vec<f32> = (0..heads * hd).map(|i| (i % 5) as f32 * 0.25).collect();
            let mut all = start.clone();
            KvCodec::F16.axpy_rows(&mut all, hd, &p, n, &rows, n);
            // Columns 16.. of each head alone, as the attention split takes them.
            let cols = 16..hd;
            let w = cols.len();
            let mut part: Vec<f32> = (0..heads).flat_map(|g| start[g * hd + 16..(g + 1) * hd].to_vec()).collect();
            if KvCodec::F16.splits_values(hd) {
                KvCodec::F16.axpy_cols(&mut part, hd, cols, &p, n, &rows);
            }
            for g in 0..heads {
                let mut one = start[g * hd..(g + 1) * hd].to_vec();
                for j in 0..n {
                    KvCodec::F16.axpy(&mut one, p[g * n + j], &rows[2 * hd * j..2 * hd * (j + 1)]);
                }
                assert_eq!(bits(&all[g * hd..(g + 1) * hd]), bits(&one), "hd {hd} head {g}");
                if KvCodec::F16.splits_values(hd) {
                    assert_eq!(bits(&part[g * w..(g + 1) * w]), bits(&one[16..]), "hd {hd} head {g}, columns 16..");
                }
            }
        }
    }

    /// Rows widened to f32 keep the f16 kernels' bits: a score is the single-query dot's (from
    /// the AVX-512 pairs and from their scalar twin), an output the single-row axpy's row after row.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn widened_rows_keep_the_f16_bits() {
        if !crate::quant::avx2::has_avx2() {
            eprintln!("this CPU has no AVX2: nothing widens, the f16 kernels run");
            return;
        }
        for (hd, n, heads) in [(64, 41, 30), (128, 19, 9), (256, 13, 8), (64, 8, 1), (96, 5, 3), (96, 29, 12), (128, 70, 9)] {
            let rows = f16_rows(n, hd);
            let mut wide = vec![0.0f32; n * hd];
            KvCodec::F16.widen(&rows, &mut wide);
            let q: Vec<f32> = (0..heads * hd).map(|i| crate::cpu::ops::round_f16(((i * 31 % 97) as f32 - 48.0) * 0.02)).collect();
            let (mut simd, mut scalar, mut qz) = (vec![0.0f32; heads * n], vec![0.0f32; heads * n], Vec::new());
            KvCodec::pair_queries(&q, hd, &mut qz);
            KvCodec::dot_rows_wide(&qz, heads, hd, &wide, n, &mut simd, n);
            scores_wide_scalar(&qz, heads, hd, &wide, n, &mut scalar, n);
            let p: Vec<f32> = (0..heads * n).map(|i| ((i * 13 % 29) as f32) * 0.01).collect();
            let start: Vec<f32> = (0..heads * hd).map(|i| (i % 5) as f32 * 0.25).collect();
            let mut all = start.clone();
            KvCodec::axpy_rows_wide(&mut all, hd, &p, n, &wide, n);
            for (g, qg) in q.chunks_exact(hd).enumerate() {
                let mut one = start[g * hd..(g + 1) * hd].to_vec();
                for j in 0..n {
                    let row = &rows[2 * hd * j..2 * hd * (j + 1)];
                    let want = KvCodec::F16.dot(qg, row).to_bits();
                    assert_eq!(simd[g * n + j].to_bits(), want, "hd {hd} head {g} key {j}");
                    assert_eq!(scalar[g * n + j].to_bits(), want, "hd {hd} head {g} key {j} (scalar)");
                    KvCodec::F16.axpy(&mut one, p[g * n + j], row);
                }
                assert_eq!(bits(&all[g * hd..(g + 1) * hd]), bits(&one), "hd {hd} head {g} values");
            }
        }
    }

    /// A score is the single-query dot's bits whatever the call takes with it (heads in groups of
    /// one to six or, with AVX-512, in pairs two pairs a pass, an odd head alone; keys eight at a
    /// time or in the tail), which is what keeps a row's attention independent of the rows
    /// batched beside it.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16_scores_do_not_depend_on_grouping() {
        if !crate::quant::avx2::has_avx2() {
            eprintln!("this CPU has no AVX2: the scalar products run, checked by row_products_match_the_decoded_rows");
            return;
        }
        for (hd, n, heads) in [(128, 37, 4), (64, 19, 7), (72, 9, 3), (64, 16, 9), (256, 24, 8), (64, 41, 30)] {
            let rows = f16_rows(n, hd);
            let q: Vec<f32> = (0..heads * hd).map(|i| ((i * 31 % 97) as f32 - 48.0) * 0.02).collect();
            let mut a = vec![0.0f32; heads * n];
            KvCodec::F16.dot_rows(&q, hd, &rows, n, &mut a, n);
            for (g, qg) in q.chunks_exact(hd).enumerate() {
                let mut one = vec![0.0f32; n];
                KvCodec::F16.dot_rows(qg, hd, &rows[2 * hd * 3..], n - 3, &mut one, n);
                for j in 0..n {
                    let want = KvCodec::F16.dot(qg, &rows[2 * hd * j..]).to_bits();
                    assert_eq!(a[g * n + j].to_bits(), want, "hd {hd} head {g} key {j}");
                    if j >= 3 {
                        assert_eq!(one[j - 3].to_bits(), want, "hd {hd} head {g} key {j} alone");
                    }
                }
            }
        }
    }
}
