//! Every kernel against the CPU code it mirrors, on whatever Vulkan device this machine has
//! (Mesa's lavapipe in CI, with DASLLAMA_VK_ALLOW_CPU=1). Without a device each test prints
//! `skipped: <test>: <reason>` and returns, so the CPU-only build still tests everything else;
//! where a device is expected (lavapipe installed, or DASLLAMA_VK_REQUIRE=1) it fails instead.

use super::buffer::Buffer;
use super::device::Gpu;
use super::kernels::{Kernels, Runner};
use super::shaders::{self as sh, u, PushBlock, Shader};
use super::weights::{upload_f32, upload_weight};
use crate::kv::KvCodec;
use crate::quant::{dequantize_row, quantize_row, GgmlType};
use crate::quant::{Bytes, Weight};
use gpu_allocator::MemoryLocation;
use std::sync::{Arc, OnceLock};

/// The device, its kernels and a runner; `None` (the test returns) where no Vulkan device
/// answers and none is expected, having printed `skipped: <test>: <reason>`. Where one is
/// expected (Mesa's lavapipe installed, or DASLLAMA_VK_REQUIRE=1) a missing device fails the test:
/// a broken loader or driver must not pass as "no device".
pub(super) fn gpu() -> Option<(Arc<Gpu>, Kernels, Runner)> {
    static G: OnceLock<Result<Arc<Gpu>, String>> = OnceLock::new();
    let allow_cpu = std::env::var("DASLLAMA_VK_ALLOW_CPU").is_ok_and(|v| v == "1");
    let g = G.get_or_init(|| Gpu::open(None, allow_cpu).map(Arc::new).map_err(|e| e.to_string()));
    let test = std::thread::current().name().unwrap_or("?").to_string();
    let g = match g {
        Ok(g) => g,
        Err(e) => {
            match device_expected() {
                Some(why) => panic!("{test}: no Vulkan device although {why}: {e}"),
                None => eprintln!("skipped: {test}: no Vulkan device (no lavapipe installed, DASLLAMA_VK_REQUIRE unset): {e}"),
            }
            return None;
        }
    };
    Some((g.clone(), Kernels::new(g).unwrap(), Runner::new(g).unwrap()))
}

/// Why this machine must have a Vulkan device, if it must.
fn device_expected() -> Option<String> {
    if std::env::var("DASLLAMA_VK_REQUIRE").is_ok_and(|v| v == "1") {
        return Some("DASLLAMA_VK_REQUIRE=1".into());
    }
    let icds = std::fs::read_dir("/usr/share/vulkan/icd.d").ok()?;
    let lvp: Vec<String> = icds.filter_map(|e| e.ok()?.file_name().into_string().ok()).filter(|f| f.starts_with("lvp_icd") && f.ends_with(".json")).collect();
    (!lvp.is_empty()).then(|| format!("lavapipe is installed (/usr/share/vulkan/icd.d/{})", lvp.join(", ")))
}

pub(super) fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        })
        .collect()
}

pub(super) fn read(g: &Arc<Gpu>, run: &mut Runner, b: &Buffer, floats: usize) -> Vec<f32> {
    let mut back = Buffer::new(g, "back", (floats * 4) as u64, MemoryLocation::GpuToCpu).unwrap();
    run.barrier().unwrap();
    run.copy(b, 0, &back, 0, (floats * 4) as u64).unwrap();
    run.submit().unwrap();
    back.mapped()[..floats * 4].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// A weight of random blocks: every bit pattern of the quants is a valid block, so random bytes
/// with sane f16 scales exercise every path of a format's decoding.
pub(super) fn weight(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Weight {
    let x = rand(rows * cols, seed);
    let rb = ty.row_bytes(cols);
    let mut data = vec![0u8; rb * rows];
    if matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
        for r in 0..rows {
            quantize_row(ty, &x[r * cols..(r + 1) * cols], &mut data[r * rb..(r + 1) * rb]);
        }
    } else {
        data.iter_mut().zip(&x).for_each(|(b, v)| *b = ((v + 1.0) * 127.9) as u8);
        let bb = ty.block_bytes();
        if ty == GgmlType::MXFP4 {
            // Its scale is the E8M0 byte at 0: random bytes reach 2^127, whose products overflow.
            data.chunks_exact_mut(bb).enumerate().for_each(|(i, b)| b[0] = 118 + (i % 16) as u8);
        }
        for (i, b) in data.chunks_exact_mut(bb).enumerate() {
            for (j, &at) in ty.f16_scale_offsets().iter().enumerate() {
                let v = half::f16::from_f32(0.01 + 0.05 * x[(i * 7 + j) % x.len()].abs()).to_le_bytes();
                b[at..at + 2].copy_from_slice(&v);
            }
        }
    }
    Weight { ty, rows, cols, data: Bytes::Owned(Arc::new(data)), tiled: false, ggml_dot: None }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn check_matmul(ty: GgmlType, w: &Weight, x: &[f32], y: &[f32], rows: usize, cols: usize, n: usize, variant: &str) {
    let mut row = vec![0f32; cols];
    for r in 0..rows {
        dequantize_row(ty, &w.data.as_slice()[r * ty.row_bytes(cols)..(r + 1) * ty.row_bytes(cols)], &mut row);
        for t in 0..n {
            let xr = &x[t * cols..(t + 1) * cols];
            let want: f64 = row.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum();
            let mag: f64 = row.iter().zip(xr).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            let got = y[t * rows + r] as f64;
            assert!((got - want).abs() <= 1e-5 * mag + 1e-6, "{variant} {} row {r} col {t}: {got} vs {want}", ty.name());
        }
    }
}

/// mul_mat (both forms) and get_rows of every format against the CPU's dequantization (an f64 dot of the
/// dequantized row): relative error 1e-5 of the row's absolute sum.
#[test]
fn matmul_and_gather_match_dequantized_rows() {
    let Some((g, mut k, mut run)) = gpu() else { return };
    let (rows, cols) = (70, 512);
    // The formats the shaders read (MXFP4 stays on the CPU: `weights::unsupported`).
    for ty in GgmlType::WEIGHT_FORMATS.into_iter().filter(|&ty| sh::reads_format(ty)) {
        let w = weight(ty, rows, cols, ty as u64 + 1);
        let dw = upload_weight(&g, &mut run, "w", &w).unwrap();
        for n in [1usize, 3, 8, 11] {
            let x = rand(n * cols, 99 + n as u64);
            let xb = upload_f32(&g, &mut run, "x", &x).unwrap();
            let yb = Buffer::new(&g, "y", (n * rows * 4) as u64, MemoryLocation::GpuOnly).unwrap();
            for shader in [Shader::MulMat(ty), Shader::MulMatRows(ty)] {
                let groups = if shader == Shader::MulMat(ty) { rows } else { rows.div_ceil(64) };
                let push = sh::MulMatPush {
                    w: dw.buf.addr,
                    x: xb.addr,
                    y: yb.addr,
                    rows: u(rows),
                    cols: u(cols),
                    n: u(n),
                    row_words: u(dw.row_words),
                    x_stride: u(cols),
                    y_stride: u(rows),
                    rows_per_z: 32768,
                    _pad: 0,
                };
                run.dispatch(&mut k, shader, push, [groups as u32, n.div_ceil(8) as u32, 1]).unwrap();
                let y = read(&g, &mut run, &yb, n * rows);
                check_matmul(ty, &w, &x, &y, rows, cols, n, &format!("{shader:?}"));
            }
        }
        // get_rows: three token ids, scaled.
        let ids = [5u32, 0, 69];
        let idb = Buffer::new(&g, "ids", 12, MemoryLocation::CpuToGpu).unwrap();
        let mut idb = idb;
        idb.mapped()[..12].copy_from_slice(&ids.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<_>>());
        let out = Buffer::new(&g, "out", (3 * cols * 4) as u64, MemoryLocation::GpuOnly).unwrap();
        run.dispatch(
            &mut k,
            Shader::GetRows(ty),
            sh::GetRowsPush { w: dw.buf.addr, out_: out.addr, ids: idb.addr, cols: u(cols), row_words: u(dw.row_words), scale: 0.5, _pad: 0 },
            [(cols / 16).div_ceil(64) as u32, 3, 1],
        )
        .unwrap();
        let got = read(&g, &mut run, &out, 3 * cols);
        let mut row = vec![0f32; cols];
        for (j, &id) in ids.iter().enumerate() {
            let rb = ty.row_bytes(cols);
            dequantize_row(ty, &w.data.as_slice()[id as usize * rb..(id as usize + 1) * rb], &mut row);
            for i in 0..cols {
                assert_eq!(got[j * cols + i], row[i] * 0.5, "{} get_rows id {id} value {i}", ty.name());
            }
        }
    }
}

/// Run one kernel over host vectors: the buffers are uploaded, the kernel dispatched with
/// `push(addresses)`, and buffer `out` read back.
pub(super) fn run_op<P: PushBlock>(shader: Shader, bufs: &[&[f32]], out: usize, push: impl Fn(&[u64]) -> P, count: usize) -> Option<Vec<f32>> {
    let (g, mut k, mut run) = gpu()?;
    let bs: Vec<Buffer> = bufs.iter().map(|b| upload_f32(&g, &mut run, "op", b).unwrap()).collect();
    let addrs: Vec<u64> = bs.iter().map(|b| b.addr).collect();
    run.dispatch_flat(&mut k, shader, push(&addrs), count).unwrap();
    Some(read(&g, &mut run, &bs[out], bufs[out].len()))
}

pub(super) fn close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!((a - b).abs() <= tol * (1.0 + b.abs()), "{what} [{i}]: {a} vs {b}");
    }
}

/// rms_norm against `ops::rms_norm` (which sums squares in f64): 1e-5 relative.
#[test]
fn rms_norm_matches_cpu() {
    let Some((g, mut k, mut run)) = gpu() else { return };
    let (width, rows) = (576, 5);
    let x = rand(width * rows, 3);
    let w = rand(width, 4);
    let (xb, wb) = (upload_f32(&g, &mut run, "x", &x).unwrap(), upload_f32(&g, &mut run, "w", &w).unwrap());
    let push = sh::RmsNormPush { x: xb.addr, w: wb.addr, out_: xb.addr, width: u(width), eps: 1e-6 };
    run.dispatch(&mut k, Shader::RmsNorm, push, [rows as u32, 1, 1]).unwrap();
    let got = read(&g, &mut run, &xb, x.len());
    let mut want = x.clone();
    want.chunks_exact_mut(width).for_each(|r| crate::cpu::ops::rms_norm(r, &w, 1e-6));
    close(&got, &want, 1e-5, "rms_norm");
}

/// RoPE, both pairings, partial rotation (rope dim < head dim), against `ops::rope` on the same
/// table: the same fused multiply-adds, within an ulp (a driver may contract differently).
#[test]
fn rope_matches_cpu() {
    for neox in [false, true] {
        let (hd, heads, rows, rdim) = (64, 3, 4, 32);
        let x = rand(hd * heads * rows, 5);
        let mut tab = Vec::new();
        let mut one = Vec::new();
        for t in 0..rows {
            let r = crate::model::Rope { dim: rdim, base: 10000.0, neox, freq_scale: 1.0, mscale: 1.0, yarn: None, mrope: None, factors: true };
            crate::cpu::ops::rope_cache(&r, 7 + 3 * t, None, &mut one);
            tab.extend(one.iter().flat_map(|&(s, c)| [s, c]));
        }
        let total = rows * heads * rdim / 2;
        let push = |a: &[u64]| sh::RopePush {
            x: a[0],
            tab: a[1],
            width: u(hd * heads),
            head_dim: u(hd),
            half_: u(rdim / 2),
            neox: neox as u32,
            total: u(total),
            _pad: 0,
        };
        let Some(got) = run_op(Shader::Rope, &[&x, &tab], 0, push, total) else { return };
        let mut want = x.clone();
        for (t, row) in want.chunks_exact_mut(hd * heads).enumerate() {
            let pairs: Vec<(f32, f32)> = tab[t * rdim..(t + 1) * rdim].chunks_exact(2).map(|p| (p[0], p[1])).collect();
            row.chunks_exact_mut(hd).for_each(|h| crate::cpu::ops::rope(h, &pairs, neox));
        }
        close(&got, &want, 1e-6, "rope");
    }
}

/// The element-wise ops against their CPU forms: add and copy exact; SiLU-GLU 1e-5; GELU-GLU
/// 1e-3 (both round GELU's input and result to f16, as ggml does: a driver's tanh may land a
/// result on the next f16); soft-capping 1e-6.
#[test]
fn eltwise_ops_match_cpu() {
    let n = 1000;
    let x: Vec<f32> = rand(n, 6).iter().map(|v| v * 6.0).collect();
    let y = rand(n, 7);
    let bias = rand(10, 8);
    let op = |o: u32, yv: &[f32], width: usize, a: f32| {
        run_op(Shader::Eltwise, &[&x, yv], 0, |ad| sh::EltwisePush { x: ad[0], y: ad[1], count: u(n), width: u(width), op: o, a, z: 0 }, n)
    };
    let Some(got) = op(0, &bias, 10, 0.0) else { return };
    close(&got, &x.iter().enumerate().map(|(i, v)| v + bias[i % 10]).collect::<Vec<_>>(), 0.0, "add");
    let mut want = x.clone();
    crate::cpu::ops::swiglu(&mut want, &y);
    close(&op(1, &y, n, 0.0).unwrap(), &want, 1e-5, "silu glu");
    let mut want = x.clone();
    crate::cpu::ops::geglu(&mut want, &y);
    close(&op(2, &y, n, 0.0).unwrap(), &want, 1e-3, "gelu glu");
    let mut want = x.clone();
    crate::cpu::ops::softcap(&mut want, 3.0);
    close(&op(3, &y, n, 3.0).unwrap(), &want, 1e-6, "softcap");
    close(&op(4, &y, n, 0.0).unwrap(), &y, 0.0, "copy");
}

/// Activation rounding against the CPU's quantizers: q8_0 (f16 scale), q8_K, f16, bf16: equal bits.
#[test]
fn round_act_matches_cpu_quantizers() {
    let n = 512;
    let x: Vec<f32> = rand(n, 9).iter().enumerate().map(|(i, v)| v * (1.0 + (i % 37) as f32)).collect();
    for (mode, ty) in [(1, GgmlType::Q8_0), (2, GgmlType::Q8K), (3, GgmlType::F16), (4, GgmlType::BF16)] {
        let blocks = match mode {
            1 => n / 32,
            2 => n / 256,
            _ => n,
        };
        let out = vec![0f32; n];
        let Some(got) = run_op(Shader::RoundAct, &[&x, &out], 1, |a| sh::RoundActPush { x: a[0], out_: a[1], blocks: u(blocks), mode }, blocks) else { return };
        let mut bytes = vec![0u8; crate::quant::act_row_bytes(ty, n)];
        quantize_row(ty, &x, &mut bytes);
        let want: Vec<f32> = match ty {
            GgmlType::Q8_0 => bytes[..ty.row_bytes(n)]
                .chunks_exact(34)
                .flat_map(|b| {
                    let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                    b[2..34].iter().map(move |&q| q as i8 as f32 * d).collect::<Vec<_>>()
                })
                .collect(),
            GgmlType::Q8K => bytes
                .chunks_exact(292)
                .take(n / 256)
                .flat_map(|b| {
                    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    b[4..260].iter().map(move |&q| q as i8 as f32 * d).collect::<Vec<_>>()
                })
                .collect(),
            _ => {
                let mut v = vec![0f32; n];
                dequantize_row(ty, &bytes[..ty.row_bytes(n)], &mut v);
                v
            }
        };
        close(&got, &want, 0.0, ty.name());
    }
}

/// gather_rows, kv_store and attention: rows written into two regions at their positions, then
/// each query row attends over its own region, against an f64 reference on the K/V the CPU's
/// codec stores (decoded back to the model's basis) with the query rounded to f16: 1e-4 relative
/// (3e-4 for tq4, whose rotations add f32 rounding). The stored blocks themselves must be the
/// CPU codec's bytes. GQA (4 query heads on 2 KV heads; 18 on one), a window, soft-capping, for
/// every codec.
#[test]
fn kv_store_and_attention_match_a_reference() {
    for codec in [KvCodec::F16, KvCodec::Q8_0, KvCodec::Tq4] {
        for (nh, nkv) in [(4usize, 2usize), (18, 1)] {
            attention_case(codec, nh, nkv);
        }
    }
}

/// One codec and GQA shape of `kv_store_and_attention_match_a_reference` (18 query heads on one
/// KV head take three workgroups of up to eight heads each).
fn attention_case(codec: KvCodec, nh: usize, nkv: usize) {
    let Some((g, mut k, mut run)) = gpu() else { return };
    let (hd, ctx) = (64usize, 40usize);
    let kvd = nkv * hd;
    let regions = super::regions::Regions::new(&g, 2, ctx, &[(hd, nkv)], codec).unwrap();
    // Session 0 writes positions 0..23 in one pass, session 1 positions 0..9; then query rows.
    let plan: Vec<(usize, usize)> = (0..23).map(|p| (0, p)).chain((0..9).map(|p| (1, p))).collect();
    let n = plan.len();
    let kx = rand(n * kvd, 10);
    let vx = rand(n * kvd, 11);
    let q: Vec<f32> = rand(n * nh * hd, 12).iter().map(|v| v * 3.0).collect();
    let meta: Vec<f32> = plan.iter().flat_map(|&(r, p)| [f32::from_bits(regions.base_word(r) as u32), f32::from_bits(p as u32)]).collect();
    let signs = crate::kv::codec::tq4_sign_vector(hd);
    let (kb, vb, qb, mb, sb) = (
        upload_f32(&g, &mut run, "k", &kx).unwrap(),
        upload_f32(&g, &mut run, "v", &vx).unwrap(),
        upload_f32(&g, &mut run, "q", &q).unwrap(),
        upload_f32(&g, &mut run, "m", &meta).unwrap(),
        upload_f32(&g, &mut run, "signs", &signs).unwrap(),
    );
    let ob = Buffer::new(&g, "o", (n * nh * hd * 4) as u64, MemoryLocation::GpuOnly).unwrap();
    let (so, vo) = regions.slot_offsets(0);
    let rscale = 1.0 / (hd as f32).sqrt();
    let store = sh::KvStorePush {
        k: kb.addr,
        v: vb.addr,
        kv: regions.buf.addr,
        meta: mb.addr,
        signs: sb.addr,
        kvd: u(kvd),
        n: u(n),
        slot_off: u(so),
        v_off: u(vo),
        head_dim: u(hd),
        rscale,
    };
    let kv_store = Shader::KvStore(codec);
    match codec {
        KvCodec::F16 => run.dispatch_flat(&mut k, kv_store, store, n * kvd / 2),
        KvCodec::Q8_0 => run.dispatch_flat(&mut k, kv_store, store, n * kvd / 32),
        KvCodec::Tq4 => run.dispatch(&mut k, kv_store, store, [nkv as u32, n as u32, 1]),
    }
    .unwrap();
    // What the CPU's codec stores for each row, and those rows decoded back to the model's basis.
    let rb = codec.bytes(kvd);
    let host = |x: &[f32]| -> (Vec<u8>, Vec<f64>) {
        let mut bytes = vec![0u8; n * rb];
        let mut back = vec![0f32; n * kvd];
        for ((src, dst), out) in x.chunks_exact(kvd).zip(bytes.chunks_exact_mut(rb)).zip(back.chunks_exact_mut(kvd)) {
            for ((s, d), o) in src.chunks_exact(hd).zip(dst.chunks_exact_mut(codec.bytes(hd))).zip(out.chunks_exact_mut(hd)) {
                codec.encode(s, d);
                codec.decode(d, o);
                if codec == KvCodec::Tq4 {
                    crate::kv::codec::unrotate(o);
                }
            }
        }
        (bytes, back.iter().map(|&v| v as f64).collect())
    };
    let ((kbytes, kref), (vbytes, vref)) = (host(&kx), host(&vx));
    if codec != KvCodec::F16 {
        let words = regions.row_words(0);
        let all = read(&g, &mut run, &regions.buf, regions.bytes() as usize / 4);
        for (t, &(r, pos)) in plan.iter().enumerate() {
            for (v, want) in [(0, &kbytes), (vo, &vbytes)] {
                let at = regions.base_word(r) + so + v + pos * words;
                let dev: Vec<u8> = all[at..at + words].iter().flat_map(|w| w.to_bits().to_le_bytes()).collect();
                let (db, hb) = if codec == KvCodec::Q8_0 { (36, 34) } else { (20, 18) };
                let got: Vec<u8> = dev.chunks_exact(db).flat_map(|b| b[..2].iter().chain(&b[4..]).copied().collect::<Vec<u8>>()).collect();
                assert_eq!(got.len(), rb);
                for (bi, (gb, wb)) in got.chunks_exact(hb).zip(want[t * rb..(t + 1) * rb].chunks_exact(hb)).enumerate() {
                    assert_eq!(gb, wb, "{} row {t} block {bi} ({})", codec.name(), if v == 0 { "K" } else { "V" });
                }
            }
        }
    }
    let tol = if codec == KvCodec::Tq4 { 3e-4 } else { 1e-4 };
    for (window, softcap) in [(0usize, 0.0f32), (8, 0.0), (0, 20.0)] {
        let scale = 1.0 / (hd as f32).sqrt();
        run.dispatch(
            &mut k,
            Shader::Attention(codec),
            sh::AttentionPush {
                q: qb.addr,
                out_: ob.addr,
                kv: regions.buf.addr,
                meta: mb.addr,
                signs: sb.addr,
                n_heads: u(nh),
                n_kv_heads: u(nkv),
                head_dim: u(hd),
                window: u(window),
                qmul: 1.0,
                smul: scale,
                softcap,
                slot_off: u(so),
                v_off: u(vo),
                row_words: u(regions.row_words(0)),
                rscale,
                _pad: 0,
                ..Default::default()
            },
            [(nkv * (nh / nkv).div_ceil(8)) as u32, n as u32, 1],
        )
        .unwrap();
        let got = read(&g, &mut run, &ob, n * nh * hd);
        let f16 = |v: f32| half::f16::from_f32(v).to_f32() as f64;
        for (t, &(r, pos)) in plan.iter().enumerate() {
            // The rows of this row's session at positions 0..=pos.
            let rows: Vec<usize> = plan.iter().enumerate().filter(|(_, &(r2, p2))| r2 == r && p2 <= pos).map(|(i, _)| i).collect();
            let start = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
            for h in 0..nh {
                let kvh = h / (nh / nkv);
                let qh: Vec<f64> = (0..hd).map(|d| f16(q[(t * nh + h) * hd + d])).collect();
                let sc: Vec<(f64, usize)> = rows
                    .iter()
                    .filter(|&&i| plan[i].1 >= start)
                    .map(|&i| {
                        let s: f64 = (0..hd).map(|d| qh[d] * kref[i * kvd + kvh * hd + d]).sum();
                        let s = if softcap > 0.0 { softcap as f64 * (s / softcap as f64).tanh() } else { s };
                        (s * scale as f64, i)
                    })
                    .collect();
                let mx = sc.iter().map(|s| s.0).fold(f64::MIN, f64::max);
                let z: f64 = sc.iter().map(|s| (s.0 - mx).exp()).sum();
                for d in 0..hd {
                    let want: f64 = sc.iter().map(|&(s, i)| (s - mx).exp() / z * vref[i * kvd + kvh * hd + d]).sum();
                    let got = got[(t * nh + h) * hd + d] as f64;
                    assert!(
                        (got - want).abs() <= tol * (1.0 + want.abs()),
                        "{} row {t} head {h} dim {d} (window {window}, cap {softcap}): {got} vs {want}",
                        codec.name()
                    );
                }
            }
        }
    }
    // gather_rows: rows 3, 0, 31 of q.
    let idx: Vec<f32> = [3u32, 0, 31].iter().map(|&i| f32::from_bits(i)).collect();
    let ib = upload_f32(&g, &mut run, "idx", &idx).unwrap();
    let width = nh * hd;
    let db = Buffer::new(&g, "d", (3 * width * 4) as u64, MemoryLocation::GpuOnly).unwrap();
    let push = sh::GatherRowsPush { src: qb.addr, dst: db.addr, idx: ib.addr, width: u(width), count: 3 };
    run.dispatch_flat(&mut k, Shader::GatherRows, push, 3 * width).unwrap();
    let got = read(&g, &mut run, &db, 3 * width);
    for (j, &r) in [3usize, 0, 31].iter().enumerate() {
        assert_eq!(&got[j * width..(j + 1) * width], &q[r * width..(r + 1) * width]);
    }
}
