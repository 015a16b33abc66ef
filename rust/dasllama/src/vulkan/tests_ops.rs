//! The device ops the one forward pass needs beyond the dense path's (attention sinks, the
//! element-wise ops, routed experts, MXFP4 and IQ4 weights, gated DeltaNet), each against the CPU
//! code it mirrors, with its tolerance stated. As `tests.rs`: without a Vulkan device each test
//! prints `skipped: ..` and returns.

use super::buffer::Buffer;
use super::moe::{self, elt, DevExperts, MoeScratch, RouteSpec};
use super::shaders::{self as sh, u, Shader};
use super::tests::{check_matmul, close, gpu, rand, read, run_op, weight};
use super::weights::{upload_f32, upload_stacked, upload_weight};
use crate::backend::{Activation, Gating, Host, Numerics, Route};
use crate::cpu::Cpu;
use crate::kv::KvCodec;
use crate::quant::{GgmlType, Weight};
use gpu_allocator::MemoryLocation;

/// Attention with sinks (gpt-oss): each query head's sink logit joins its softmax's max and
/// normalizer with no value, unscaled, as `cpu/backend.rs` attention takes `AttnShape::sinks`;
/// against an f64 reference over the f16 K/V the device stores, the query rounded to f16 as the
/// CPU rounds it: 1e-4 relative (as `kv_store_and_attention_match_a_reference`). GQA 4 on 2 and
/// 18 on 1, with and without a window; and has_sinks = 0 is the plain softmax.
#[test]
fn attention_with_sinks_matches_a_reference() {
    for (nh, nkv) in [(4usize, 2usize), (18, 1)] {
        let Some((g, mut k, mut run)) = gpu() else { return };
        let codec = KvCodec::F16;
        let (hd, ctx) = (64usize, 40usize);
        let kvd = nkv * hd;
        let regions = super::regions::Regions::new(&g, 2, ctx, &[(hd, nkv)], codec).unwrap();
        let plan: Vec<(usize, usize)> = (0..23).map(|p| (0, p)).chain((0..9).map(|p| (1, p))).collect();
        let n = plan.len();
        let kx = rand(n * kvd, 20);
        let vx = rand(n * kvd, 21);
        let q: Vec<f32> = rand(n * nh * hd, 22).iter().map(|v| v * 3.0).collect();
        // Sinks around the scores' size, some above them all.
        let sinks: Vec<f32> = rand(nh, 23).iter().map(|v| v * 4.0).collect();
        let meta: Vec<f32> = plan.iter().flat_map(|&(r, p)| [f32::from_bits(regions.base_word(r) as u32), f32::from_bits(p as u32)]).collect();
        let up = |run: &mut super::kernels::Runner, v: &[f32]| upload_f32(&g, run, "t", v).unwrap();
        let (kb, vb, qb, mb, snb) = (up(&mut run, &kx), up(&mut run, &vx), up(&mut run, &q), up(&mut run, &meta), up(&mut run, &sinks));
        let signs = up(&mut run, &vec![1.0; hd]);
        let ob = Buffer::new(&g, "o", (n * nh * hd * 4) as u64, MemoryLocation::GpuOnly).unwrap();
        let (so, vo) = regions.slot_offsets(0);
        let rscale = 1.0 / (hd as f32).sqrt();
        let store = sh::KvStorePush {
            k: kb.addr,
            v: vb.addr,
            kv: regions.buf.addr,
            meta: mb.addr,
            signs: signs.addr,
            kvd: u(kvd),
            n: u(n),
            slot_off: u(so),
            v_off: u(vo),
            head_dim: u(hd),
            rscale,
        };
        run.dispatch_flat(&mut k, Shader::KvStore(codec), store, n * kvd / 2).unwrap();
        run.barrier().unwrap();
        let f16 = |v: f32| half::f16::from_f32(v).to_f32() as f64;
        for (window, with_sinks) in [(0usize, true), (8, true), (0, false)] {
            let scale = 1.0 / (hd as f32).sqrt();
            let push = sh::AttentionPush {
                q: qb.addr,
                out_: ob.addr,
                kv: regions.buf.addr,
                meta: mb.addr,
                signs: signs.addr,
                n_heads: u(nh),
                n_kv_heads: u(nkv),
                head_dim: u(hd),
                window: u(window),
                qmul: 1.0,
                smul: scale,
                softcap: 0.0,
                slot_off: u(so),
                v_off: u(vo),
                row_words: u(regions.row_words(0)),
                rscale,
                _pad: 0,
                sinks: if with_sinks { snb.addr } else { 0 },
                has_sinks: with_sinks as u32,
                has_ends: 0,
                ends: 0,
            };
            run.dispatch(&mut k, Shader::Attention(codec), push, [(nkv * (nh / nkv).div_ceil(8)) as u32, n as u32, 1]).unwrap();
            let got = read(&g, &mut run, &ob, n * nh * hd);
            for (t, &(r, pos)) in plan.iter().enumerate() {
                let rows: Vec<usize> = plan.iter().enumerate().filter(|(_, &(r2, p2))| r2 == r && p2 <= pos).map(|(i, _)| i).collect();
                let start = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
                for h in 0..nh {
                    let kvh = h / (nh / nkv);
                    let qh: Vec<f64> = (0..hd).map(|d| f16(q[(t * nh + h) * hd + d])).collect();
                    let sc: Vec<(f64, usize)> = rows
                        .iter()
                        .filter(|&&i| plan[i].1 >= start)
                        .map(|&i| ((0..hd).map(|d| qh[d] * f16(kx[i * kvd + kvh * hd + d])).sum::<f64>() * scale as f64, i))
                        .collect();
                    let sink = with_sinks.then(|| sinks[h] as f64);
                    let mx = sc.iter().map(|s| s.0).fold(sink.unwrap_or(f64::MIN), f64::max);
                    let z: f64 = sc.iter().map(|s| (s.0 - mx).exp()).sum::<f64>() + sink.map_or(0.0, |s| (s - mx).exp());
                    for d in 0..hd {
                        let want: f64 = sc.iter().map(|&(s, i)| (s - mx).exp() / z * f16(vx[i * kvd + kvh * hd + d])).sum();
                        let got = got[(t * nh + h) * hd + d] as f64;
                        assert!(
                            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{nh}/{nkv} heads, row {t} head {h} dim {d} (window {window}, sinks {with_sinks}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

/// The element-wise ops the one pass adds, against their CPU forms (`cpu/ops.rs`, `Ops`):
/// swiglu_oai 1e-5 (the device's exp against libm's); sigmoid 1e-6 (the same); mul, scale,
/// add_scaled, col scale, row axpy and row scale exact (one rounding each, no fma: `precise`).
#[test]
fn eltwise_new_ops_match_cpu() {
    let (n, width) = (1000usize, 40usize);
    let x: Vec<f32> = rand(n, 30).iter().map(|v| v * 9.0).collect();
    let y: Vec<f32> = rand(n, 31).iter().map(|v| v * 9.0).collect();
    let z = rand(n / width, 32);
    let col = rand(width, 33);
    let op = |o: u32, yv: &[f32], w: usize, a: f32| {
        run_op(Shader::Eltwise, &[&x, yv, &z], 0, |ad| sh::EltwisePush { x: ad[0], y: ad[1], count: u(n), width: u(w), op: o, a, z: ad[2] }, n)
    };
    let Some(got) = op(elt::SWIGLU_OAI, &y, n, 0.0) else { return };
    let mut want = x.clone();
    crate::cpu::ops::swiglu_oai(&mut want, &y);
    close(&got, &want, 1e-5, "swiglu_oai");
    // Both sides of the clamps are exercised.
    assert!(x.iter().any(|&v| v > 7.0) && y.iter().any(|&v| v < -7.0) && y.iter().any(|&v| v > 7.0));
    let want: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a * b).collect();
    close(&op(elt::MUL, &y, n, 0.0).unwrap(), &want, 0.0, "mul");
    let want: Vec<f32> = x.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect();
    close(&op(elt::SIGMOID, &y, n, 0.0).unwrap(), &want, 1e-6, "sigmoid");
    let want: Vec<f32> = x.iter().map(|v| v * 0.37).collect();
    close(&op(elt::SCALE, &y, n, 0.37).unwrap(), &want, 0.0, "scale");
    let mut want = x.clone();
    want.iter_mut().zip(&y).for_each(|(a, b)| *a += 0.37 * b);
    close(&op(elt::ADD_SCALED, &y, n, 0.37).unwrap(), &want, 0.0, "add_scaled");
    let want: Vec<f32> = x.iter().enumerate().map(|(i, v)| v * col[i % width]).collect();
    close(&op(elt::COL_SCALE, &col, width, 0.0).unwrap(), &want, 0.0, "col scale");
    let mut want = x.clone();
    for (t, row) in want.chunks_exact_mut(width).enumerate() {
        row.iter_mut().zip(&y[t * width..]).for_each(|(a, b)| *a += z[t] * b);
    }
    close(&op(elt::ROW_AXPY, &y, width, 0.0).unwrap(), &want, 0.0, "row axpy");
    let want: Vec<f32> = x.iter().enumerate().map(|(i, v)| v * z[i / width]).collect();
    close(&op(elt::ROW_SCALE, &y, width, 0.0).unwrap(), &want, 0.0, "row scale");
}

/// The CPU's route of `logits` (`Ops::route` through the CPU backend).
fn cpu_route(logits: &[f32], r: &Route<'_>) -> Vec<(usize, f32)> {
    let mut out = Vec::new();
    Cpu::new(2).run(Numerics::Fast, &mut Vec::new(), None, &mut |ops| ops.route(logits, r, &mut out));
    out
}

fn pairs_of(words: &[f32]) -> Vec<(usize, f32)> {
    words.chunks_exact(2).map(|p| (p[0].to_bits() as usize, p[1])).collect()
}

/// moe_route against `Ops::route` on random logits, for every gating, with and without the
/// selection bias, renormalisation and a scale; 64 and 300 experts: the same experts in the same
/// order, weights within 2e-6 relative (the device's exp against the CPU's).
#[test]
fn moe_route_matches_cpu() {
    let Some((g, mut k, mut run)) = gpu() else { return };
    let n = 13;
    for (n_expert, n_used) in [(8usize, 3usize), (64, 4), (300, 8)] {
        let logits: Vec<f32> = rand(n * n_expert, n_expert as u64).iter().map(|v| v * 4.0).collect();
        let bias: Vec<f32> = rand(n_expert, 7).iter().map(|v| v * 0.5).collect();
        let lb = upload_f32(&g, &mut run, "logits", &logits).unwrap();
        let bb = upload_f32(&g, &mut run, "bias", &bias).unwrap();
        let pb = Buffer::new(&g, "pairs", (n * n_used * 8) as u64, MemoryLocation::GpuOnly).unwrap();
        for gating in [Gating::Softmax, Gating::Sigmoid, Gating::SoftmaxWeight] {
            for (with_bias, norm, scale) in [(false, false, 1.0f32), (true, true, 2.5), (false, true, 1.0), (true, false, 0.5)] {
                let spec = RouteSpec { n_expert, n_used, gating, bias: with_bias.then_some(&bb), norm, scale };
                moe::route(&mut run, &mut k, &spec, &lb, &pb, n).unwrap();
                let got = pairs_of(&read(&g, &mut run, &pb, n * n_used * 2));
                let want = cpu_route(&logits, &Route { n_expert, n_used, gating, bias: with_bias.then_some(&bias[..]), norm, scale });
                let what = format!("{n_expert} experts, {gating:?}, bias {with_bias}, norm {norm}, scale {scale}");
                assert_eq!(got.iter().map(|p| p.0).collect::<Vec<_>>(), want.iter().map(|p| p.0).collect::<Vec<_>>(), "{what}: experts");
                let (gw, ww): (Vec<f32>, Vec<f32>) = (got.iter().map(|p| p.1).collect(), want.iter().map(|p| p.1).collect());
                close(&gw, &ww, 2e-6, &format!("{what}: weights"));
            }
        }
    }
}

/// A layer's experts as the CPU holds them (a Weight each) and their biases and scales.
struct HostExperts {
    gate: Vec<Weight>,
    up: Vec<Weight>,
    down: Vec<Weight>,
    biases: Option<[Vec<f32>; 3]>,
    scale: Option<Vec<f32>>,
}

/// `model::forward`'s `moe` (its routed half) on the CPU backend's ops: route, then each expert
/// over the rows that chose it, each gathered row on its own, biases, GLU, down, bias, and the
/// weighted `add_scaled` into the rows in expert order.
#[allow(clippy::too_many_arguments)]
fn cpu_moe(e: &HostExperts, logits: &[f32], r: &Route<'_>, act: Activation, h: &[f32], d: usize, hd: usize) -> (Vec<(usize, f32)>, Vec<f32>) {
    let n = h.len() / d;
    let (mut route, mut o) = (Vec::new(), vec![0.0f32; n * d]);
    Cpu::new(2).run(Numerics::Fast, &mut Vec::new(), None, &mut |b| {
        b.route(logits, r, &mut route);
        for ex in 0..r.n_expert {
            let rows: Vec<(usize, f32)> = route.iter().enumerate().filter(|(_, &(x, _))| x == ex).map(|(i, &(_, w))| (i / r.n_used, w)).collect();
            let m = rows.len();
            if m == 0 {
                continue;
            }
            let x: Vec<f32> = rows.iter().flat_map(|&(t, _)| h[t * d..(t + 1) * d].to_vec()).collect();
            let (mut gate, mut up, mut out) = (vec![0.0f32; m * hd], vec![0.0f32; m * hd], vec![0.0f32; m * d]);
            let ones = vec![1; m];
            b.matmul(&mut [(&e.gate[ex], &mut gate[..]), (&e.up[ex], &mut up[..])], &x, &ones);
            if let Some([bg, bu, _]) = &e.biases {
                b.add_bias(&mut gate, &bg[ex * hd..(ex + 1) * hd]);
                b.add_bias(&mut up, &bu[ex * hd..(ex + 1) * hd]);
            }
            b.glu(&mut gate, &up, hd, act);
            b.matmul(&mut [(&e.down[ex], &mut out[..])], &gate, &ones);
            if let Some([_, _, bd]) = &e.biases {
                b.add_bias(&mut out, &bd[ex * d..(ex + 1) * d]);
            }
            let es = e.scale.as_ref().map_or(1.0, |s| s[ex]);
            for (j, &(t, w)) in rows.iter().enumerate() {
                b.add_scaled(&mut o[t * d..(t + 1) * d], &out[j * d..(j + 1) * d], w * es);
            }
        }
    });
    (route, o)
}

/// One MoE configuration of `moe_ffn_matches_cpu`.
struct MoeCase {
    ty: [GgmlType; 3],
    n_expert: usize,
    n_used: usize,
    gating: Gating,
    norm: bool,
    act: Activation,
    biases: bool,
    scale: bool,
}

fn moe_case(c: &MoeCase) {
    let Some((g, mut k, mut run)) = gpu() else { return };
    let (d, hd, n) = (256usize, 256usize, 7usize);
    let mk = |ty: GgmlType, rows: usize, cols: usize, seed: u64| {
        (0..c.n_expert).map(|e| weight(ty, rows, cols, seed * 100 + e as u64).for_kernels(&Cpu::new(2))).collect::<Vec<_>>()
    };
    let host = HostExperts {
        gate: mk(c.ty[0], hd, d, 1),
        up: mk(c.ty[1], hd, d, 2),
        down: mk(c.ty[2], d, hd, 3),
        biases: c.biases.then(|| [rand(c.n_expert * hd, 4), rand(c.n_expert * hd, 5), rand(c.n_expert * d, 6)]),
        scale: c.scale.then(|| rand(c.n_expert, 8).iter().map(|v| 1.0 + v * 0.5).collect()),
    };
    let h: Vec<f32> = rand(n * d, 9).iter().map(|v| v * 2.0).collect();
    let logits: Vec<f32> = rand(n * c.n_expert, 10).iter().map(|v| v * 3.0).collect();
    let r = Route { n_expert: c.n_expert, n_used: c.n_used, gating: c.gating, bias: None, norm: c.norm, scale: 1.0 };
    let (want_route, want) = cpu_moe(&host, &logits, &r, c.act, &h, d, hd);
    let stack = |run: &mut super::kernels::Runner, name: &str, ws: &[Weight]| upload_stacked(&g, run, name, &ws.iter().collect::<Vec<_>>()).unwrap();
    let opt = |run: &mut super::kernels::Runner, v: Option<&Vec<f32>>| v.map(|v| upload_f32(&g, run, "b", v).unwrap());
    let dev = DevExperts {
        n_expert: c.n_expert,
        hidden: hd,
        gate: stack(&mut run, "gate", &host.gate),
        up: stack(&mut run, "up", &host.up),
        down: stack(&mut run, "down", &host.down),
        gate_bias: opt(&mut run, host.biases.as_ref().map(|b| &b[0])),
        up_bias: opt(&mut run, host.biases.as_ref().map(|b| &b[1])),
        down_bias: opt(&mut run, host.biases.as_ref().map(|b| &b[2])),
        scale: opt(&mut run, host.scale.as_ref()),
    };
    let floats = |name: &str, f: usize| Buffer::new(&g, name, (f * 4) as u64, MemoryLocation::GpuOnly).unwrap();
    let slots = n * c.n_used;
    let (pairs, xq, gate, up, down, out) = (
        floats("pairs", 2 * slots),
        floats("xq", slots * d.max(hd)),
        floats("gate", slots * hd),
        floats("up", slots * hd),
        floats("down", slots * d),
        floats("out", n * d),
    );
    let (hb, lb) = (upload_f32(&g, &mut run, "h", &h).unwrap(), upload_f32(&g, &mut run, "logits", &logits).unwrap());
    let spec = RouteSpec { n_expert: c.n_expert, n_used: c.n_used, gating: c.gating, bias: None, norm: c.norm, scale: 1.0 };
    let s = MoeScratch { pairs: &pairs, xq: &xq, gate: &gate, up: &up, down: &down };
    moe::moe_ffn(&mut run, &mut k, &dev, &spec, c.act, &lb, &hb, &out, &s, d, n).unwrap();
    let what = format!("{:?} {:?} {:?}", c.ty, c.gating, c.act);
    let got_route = pairs_of(&read(&g, &mut run, &pairs, 2 * slots));
    assert_eq!(got_route.iter().map(|p| p.0).collect::<Vec<_>>(), want_route.iter().map(|p| p.0).collect::<Vec<_>>(), "{what}: experts");
    let got = read(&g, &mut run, &out, n * d);
    // Batch invariance: row 2 alone gives the bits it got beside the others.
    let (h1, l1) =
        (upload_f32(&g, &mut run, "h1", &h[2 * d..3 * d]).unwrap(), upload_f32(&g, &mut run, "l1", &logits[2 * c.n_expert..3 * c.n_expert]).unwrap());
    moe::moe_ffn(&mut run, &mut k, &dev, &spec, c.act, &l1, &h1, &out, &s, d, 1).unwrap();
    let alone = read(&g, &mut run, &out, d);
    assert!(alone.iter().zip(&got[2 * d..3 * d]).all(|(a, b)| a.to_bits() == b.to_bits()), "{:?}: row 2 alone differs from row 2 in the batch", c.ty);
    assert!(want.iter().filter(|v| v.abs() > 1e-3).count() > n * d / 2, "{what}: a degenerate case");
    // Every expert output is a sum of products of up to 256 terms twice over: relative to the
    // output's own magnitude plus its row's scale.
    let row_max: Vec<f32> = want.chunks_exact(d).map(|r| r.iter().fold(0.0f32, |a, v| a.max(v.abs()))).collect();
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!((a - b).abs() <= 1e-4 * (b.abs() + row_max[i / d]), "{what} [{i}]: {a} vs {b}");
    }
}

/// A whole routed FFN (`moe::moe_ffn`) against `model::forward`'s `moe` arithmetic on the CPU
/// backend's ops: the same experts chosen per row, each output within 1e-4 of its row's largest
/// value (the matmuls' 1e-5 relative error, through the GLU and the down projection).
/// qwen-style (softmax, renormalised, SiLU; q8_0 gate/up, q4_K down) and gpt-oss-style
/// (SOFTMAX_WEIGHT, swiglu_oai, per-expert biases; MXFP4, and f16 with gemma4's per-expert
/// output scale). A row run alone gives the bits it gets in the batch.
#[test]
fn moe_ffn_matches_cpu() {
    moe_case(&MoeCase {
        ty: [GgmlType::Q8_0, GgmlType::Q8_0, GgmlType::Q4K],
        n_expert: 8,
        n_used: 3,
        gating: Gating::Softmax,
        norm: true,
        act: Activation::Silu,
        biases: false,
        scale: false,
    });
    moe_case(&MoeCase {
        ty: [GgmlType::MXFP4, GgmlType::MXFP4, GgmlType::MXFP4],
        n_expert: 8,
        n_used: 4,
        gating: Gating::SoftmaxWeight,
        norm: false,
        act: Activation::SwigluOai,
        biases: true,
        scale: false,
    });
    moe_case(&MoeCase {
        ty: [GgmlType::F16, GgmlType::F16, GgmlType::F16],
        n_expert: 6,
        n_used: 2,
        gating: Gating::SoftmaxWeight,
        norm: false,
        act: Activation::SwigluOai,
        biases: true,
        scale: true,
    });
}

/// MXFP4, IQ4_NL and IQ4_XS weights: both matmul forms against the CPU's dequantization (an f64
/// dot of the dequantized row, relative error 1e-5 of the row's absolute sum, as
/// `matmul_and_gather_match_dequantized_rows`), the expert matmul (each slot's expert row, the
/// same bound, and equal to the dense matmul's bits for that row, both forms on any device), and
/// get_rows exact.
#[test]
fn mxfp4_and_iq4_weights_match_dequantized_rows() {
    let Some((g, mut k, mut run)) = gpu() else { return };
    let (rows, cols) = (70, 512);
    for ty in [GgmlType::MXFP4, GgmlType::IQ4NL, GgmlType::IQ4XS] {
        assert!(sh::reads_format(ty), "{}", ty.name());
        let w = weight(ty, rows, cols, ty as u64 + 40);
        let dw = upload_weight(&g, &mut run, "w", &w).unwrap();
        for n in [1usize, 3, 11] {
            let x = rand(n * cols, 50 + n as u64);
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
        // The expert matmul over the same rows as 5 experts of 14 rows: slot (t, j) picks expert
        // (t + 2j) % 5 and reads row t.
        let (n, n_used, er) = (3usize, 2usize, 14usize);
        let x = rand(n * cols, 60);
        let xb = upload_f32(&g, &mut run, "x", &x).unwrap();
        let pairs: Vec<f32> = (0..n * n_used).flat_map(|s| [f32::from_bits(((s / n_used + 2 * (s % n_used)) % 5) as u32), 1.0]).collect();
        let pb = upload_f32(&g, &mut run, "pairs", &pairs).unwrap();
        let yb = Buffer::new(&g, "y", (n * n_used * er * 4) as u64, MemoryLocation::GpuOnly).unwrap();
        // Both forms on any device, each against the dense matmul of its own form.
        for per_thread in [false, true] {
            let dense_shader = if per_thread { Shader::MulMatRows(ty) } else { Shader::MulMat(ty) };
            let db = Buffer::new(&g, "dense", (n * rows * 4) as u64, MemoryLocation::GpuOnly).unwrap();
            let push = sh::MulMatPush {
                w: dw.buf.addr,
                x: xb.addr,
                y: db.addr,
                rows: u(rows),
                cols: u(cols),
                n: u(n),
                row_words: u(dw.row_words),
                x_stride: u(cols),
                y_stride: u(rows),
                rows_per_z: if per_thread { 32768 * 64 } else { 32768 },
                _pad: 0,
            };
            let groups = if per_thread { rows.div_ceil(64) } else { rows };
            run.dispatch(&mut k, dense_shader, push, [groups as u32, n.div_ceil(8) as u32, 1]).unwrap();
            let dense = read(&g, &mut run, &db, n * rows);
            let input = moe::SlotInput { stride_t: cols, stride_j: 0 };
            moe::matmul_id_form(&mut run, &mut k, per_thread, &dw, er, &xb, input, &pb, n_used, None, &yb, n).unwrap();
            let got = read(&g, &mut run, &yb, n * n_used * er);
            for s in 0..n * n_used {
                let (t, e) = (s / n_used, pairs[2 * s].to_bits() as usize);
                for r in 0..er {
                    let want = dense[t * rows + e * er + r];
                    let got = got[s * er + r];
                    assert_eq!(got.to_bits(), want.to_bits(), "{} matmul_id (per thread {per_thread}) slot {s} row {r}: {got} vs the dense {want}", ty.name());
                }
            }
        }
        let ids = [5u32, 0, 69];
        let mut idb = Buffer::new(&g, "ids", 12, MemoryLocation::CpuToGpu).unwrap();
        idb.mapped()[..12].copy_from_slice(&ids.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<_>>());
        let out = Buffer::new(&g, "out", (3 * cols * 4) as u64, MemoryLocation::GpuOnly).unwrap();
        let push = sh::GetRowsPush { w: dw.buf.addr, out_: out.addr, ids: idb.addr, cols: u(cols), row_words: u(dw.row_words), scale: 0.5, _pad: 0 };
        run.dispatch(&mut k, Shader::GetRows(ty), push, [(cols / 16).div_ceil(64) as u32, 3, 1]).unwrap();
        let got = read(&g, &mut run, &out, 3 * cols);
        let mut row = vec![0f32; cols];
        for (j, &id) in ids.iter().enumerate() {
            let rb = ty.row_bytes(cols);
            crate::quant::dequantize_row(ty, &w.data.as_slice()[id as usize * rb..(id as usize + 1) * rb], &mut row);
            for i in 0..cols {
                assert_eq!(got[j * cols + i], row[i] * 0.5, "{} get_rows id {id} value {i}", ty.name());
            }
        }
    }
}

/// One DeltaNet geometry of `delta_net_matches_cpu`.
fn delta_net_case(hd: usize, k_of_v: crate::backend::HeadMap) {
    use super::deltanet::{self as dnk, DevDnParams};
    use crate::kv::RecIo;
    let Some((g, mut k, mut run)) = gpu() else { return };
    let dn = crate::backend::DeltaNet { conv_kernel: 4, n_k_heads: 2, n_v_heads: 4, head_dim: hd, k_of_v, fused_ba: false, eps: 1e-6 };
    let (cd, nv, vd) = (dn.conv_dim(), dn.n_v_heads, dn.value_dim());
    let (cs, ss) = (dn.conv_state(), dn.ssm_state());
    let conv_w = rand(dn.conv_kernel * cd, 70);
    let dt_bias = rand(nv, 71);
    let a: Vec<f32> = rand(nv, 72).iter().map(|v| -(v.abs() + 0.1)).collect();
    let p = DevDnParams {
        conv: upload_f32(&g, &mut run, "conv", &conv_w).unwrap(),
        dt_bias: upload_f32(&g, &mut run, "dt", &dt_bias).unwrap(),
        a: upload_f32(&g, &mut run, "a", &a).unwrap(),
    };
    // Two sessions, each with its conv and SSM state in two copies (the one read, the one
    // written), at `base` in one buffer on the device; random states to start from.
    let base = |s: usize| s * 2 * (cs + ss);
    let mut host: Vec<[Vec<f32>; 4]> = (0..2)
        .map(|s| {
            let st = rand(ss, 73 + s as u64).iter().map(|v| v * 0.5).collect();
            [rand(cs, 75 + s as u64), vec![0.0; cs], st, vec![0.0; ss]]
        })
        .collect();
    let mut all = vec![0.0f32; base(2)];
    for (s, h) in host.iter().enumerate() {
        all[base(s)..base(s) + cs].copy_from_slice(&h[0]);
        all[base(s) + 2 * cs..base(s) + 2 * cs + ss].copy_from_slice(&h[2]);
    }
    let state = upload_f32(&g, &mut run, "state", &all).unwrap();
    for (pass, counts) in [[3usize, 2usize], [1, 4]].iter().enumerate() {
        let n: usize = counts.iter().sum();
        let qkv = rand(n * cd, 80 + pass as u64);
        let beta: Vec<f32> = rand(n * nv, 82 + pass as u64).iter().map(|v| v * 2.0).collect();
        let alpha: Vec<f32> = rand(n * nv, 84 + pass as u64).iter().map(|v| v * 2.0).collect();
        // Pass 0 reads copy 0 and writes copy 1; pass 1 the other way round, as the CPU's cache
        // flips its committed copy.
        let (rd, wr) = if pass == 0 { (0, 1) } else { (1, 0) };
        let mut meta = Vec::new();
        let mut first = 0;
        for (s, &cnt) in counts.iter().enumerate() {
            let b = base(s);
            meta.extend(dnk::meta_words(first, cnt, b + rd * cs, b + wr * cs, b + 2 * cs + rd * ss, b + 2 * cs + wr * ss).map(f32::from_bits));
            first += cnt;
        }
        let up = |run: &mut super::kernels::Runner, v: &[f32]| upload_f32(&g, run, "t", v).unwrap();
        let (qb, bb, ab, mb) = (up(&mut run, &qkv), up(&mut run, &beta), up(&mut run, &alpha), up(&mut run, &meta));
        let ob = Buffer::new(&g, "out", (n * vd * 4) as u64, MemoryLocation::GpuOnly).unwrap();
        dnk::delta_net(&mut run, &mut k, &dn, &p, &qb, &bb, &ab, &ob, mb.addr, state.addr, 2).unwrap();
        let got_out = read(&g, &mut run, &ob, n * vd);
        let got_qkv = read(&g, &mut run, &qb, n * cd);
        let got_state = read(&g, &mut run, &state, base(2));
        {
            // The other form of the recurrence, from the same conv output and states: the same bits.
            let other = !run.cpu_device();
            let st2 = Buffer::new(&g, "state2", (base(2) * 4) as u64, MemoryLocation::GpuOnly).unwrap();
            let o2 = Buffer::new(&g, "out2", (n * vd * 4) as u64, MemoryLocation::GpuOnly).unwrap();
            // The states after the first run: the copies it read are as they were.
            run.copy(&state, 0, &st2, 0, (base(2) * 4) as u64).unwrap();
            let conv_done = up(&mut run, &got_qkv);
            let (bb2, ab2) = (up(&mut run, &beta), up(&mut run, &alpha));
            dnk::recurrence_form(&mut run, &mut k, other, &dn, &p, &conv_done, &bb2, &ab2, &o2, mb.addr, st2.addr, 2).unwrap();
            // Equal bits on lavapipe; NVIDIA's compiler gives the two an ulp or a few apart
            // (seen on an H200), so a GPU is held to the CPU's tolerance between them.
            let tol = if run.cpu_device() { 0.0 } else { 1e-5 };
            close(&read(&g, &mut run, &o2, n * vd), &got_out, tol, &format!("hd {hd} pass {pass}: the other form's out"));
            close(&read(&g, &mut run, &st2, base(2)), &got_state, tol, &format!("hd {hd} pass {pass}: the other form's states"));
        }
        if pass == 0 {
            // Batch invariance: session 1 alone, from the same states, gives the same bits.
            let alone_state = upload_f32(&g, &mut run, "alone", &all).unwrap();
            let b1 = base(1);
            let m1: Vec<f32> = dnk::meta_words(0, counts[1], b1, b1 + cs, b1 + 2 * cs, b1 + 2 * cs + ss).map(f32::from_bits).to_vec();
            let r1 = counts[0]..n;
            let (q1, be1, al1, mb1) = (
                up(&mut run, &qkv[r1.start * cd..r1.end * cd]),
                up(&mut run, &beta[r1.start * nv..r1.end * nv]),
                up(&mut run, &alpha[r1.start * nv..r1.end * nv]),
                up(&mut run, &m1),
            );
            let o1 = Buffer::new(&g, "out1", (counts[1] * vd * 4) as u64, MemoryLocation::GpuOnly).unwrap();
            dnk::delta_net(&mut run, &mut k, &dn, &p, &q1, &be1, &al1, &o1, mb1.addr, alone_state.addr, 1).unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&read(&g, &mut run, &o1, counts[1] * vd)), bits(&got_out[r1.start * vd..]), "hd {hd}: session 1 alone, out");
            let st1 = read(&g, &mut run, &alone_state, base(2));
            assert_eq!(bits(&st1[b1..b1 + base(1)]), bits(&got_state[b1..b1 + base(1)]), "hd {hd}: session 1 alone, states");
        }
        // The CPU: the same rows, each session's states as RecIo.
        let (mut cq, mut cb, mut ca, mut cout) = (qkv.clone(), beta.clone(), alpha.clone(), vec![0.0f32; n * vd]);
        {
            let mut ios: Vec<RecIo> = host
                .iter_mut()
                .map(|h| {
                    let [c0, c1, s0, s1] = h;
                    let ((ci, co), (si, so)) = if rd == 0 { ((&*c0, c1), (&*s0, s1)) } else { ((&*c1, c0), (&*s1, s0)) };
                    RecIo { conv_in: ci, conv_out: co, ssm_in: si, ssm_out: so }
                })
                .collect();
            let dp = crate::backend::DnParams { conv: &conv_w, dt_bias: &dt_bias, a: &a };
            crate::cpu::deltanet::delta_net(&dn, &dp, &mut ios, &counts[..], &mut cq, &mut cb, &mut ca, &mut cout, None);
        }
        let what = format!("hd {hd} {k_of_v:?} pass {pass}");
        close(&got_out, &cout, 1e-5, &format!("{what}: out"));
        // V channels: convolved and activated only (Q and K the CPU also normalises in place).
        let v_of = |x: &[f32]| x.chunks_exact(cd).flat_map(|r| r[2 * dn.key_dim()..].to_vec()).collect::<Vec<f32>>();
        close(&v_of(&got_qkv), &v_of(&cq), 1e-6, &format!("{what}: convolved V"));
        for (s, h) in host.iter().enumerate() {
            let b = base(s);
            close(&got_state[b + wr * cs..b + wr * cs + cs], &h[wr], 0.0, &format!("{what}: session {s} conv state"));
            close(&got_state[b + 2 * cs + wr * ss..b + 2 * cs + wr * ss + ss], &h[2 + wr], 1e-5, &format!("{what}: session {s} SSM state"));
        }
    }
}

/// The DeltaNet convolution and recurrence (`deltanet::delta_net`) against
/// `cpu::deltanet::delta_net` over two sessions of several rows each, two passes (the second from
/// the states the first left, the copies flipped): outputs and SSM states within 1e-5 relative
/// (the device's exp and f32 L2 sums against libm's and the CPU's f64 sums; the dots add in the
/// CPU's order), the convolved V channels 1e-6 (SiLU's exp), the conv states exact. Key heads
/// grouped and tiled; a head of 20 values takes the dots' tail path. Session 1 run alone gives the
/// bits it gets beside session 0 (batch invariance); the recurrence's two forms (a thread per row,
/// a thread per lane) give the same bits on a CPU-type device, and agree within 1e-5 on a GPU
/// (NVIDIA's compiler puts them an ulp or a few apart).
#[test]
fn delta_net_matches_cpu() {
    use crate::backend::HeadMap;
    delta_net_case(32, HeadMap::Grouped);
    delta_net_case(32, HeadMap::Tiled);
    delta_net_case(20, HeadMap::Grouped);
}

/// `round_f16` (common.glsl, through round_act's f16 mode) against `half`'s rounding, bit for
/// bit, where it is hardest: ties both ways, f16 subnormals and their ties, the edge of the range
/// and past it, signed zeros. (NVIDIA's compiler folded the old pack/unpack form into nothing.)
#[test]
fn round_f16_matches_half_at_the_edges() {
    let mut x: Vec<f32> = vec![0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, -65520.0, 1e6, 6.1035156e-5, 6.0e-5, -3.0e-6, 1.0e-8, 3.0e-8, 2.9802322e-8];
    // Exact ties: halfway between neighbouring f16 values, at even and odd mantissas.
    for m in [0x3C00u32, 0x3C01, 0x0001, 0x0002, 0x03FF, 0x7BFE] {
        let (a, b) = (half::f16::from_bits(m as u16).to_f32() as f64, half::f16::from_bits(m as u16 + 1).to_f32() as f64);
        x.push(((a + b) / 2.0) as f32);
        x.push(-((a + b) / 2.0) as f32);
    }
    x.extend(rand(256, 90).iter().enumerate().map(|(i, v)| v * 2f32.powi(i as i32 % 40 - 26)));
    x.resize(x.len().next_multiple_of(64), 0.5);
    let n = x.len();
    let out = vec![0f32; n];
    let Some(got) = run_op(Shader::RoundAct, &[&x, &out], 1, |a| sh::RoundActPush { x: a[0], out_: a[1], blocks: u(n), mode: 3 }, n) else { return };
    for (i, (&g, &v)) in got.iter().zip(&x).enumerate() {
        let want = half::f16::from_f32(v).to_f32();
        assert_eq!(g.to_bits(), want.to_bits(), "[{i}] {v:e}: {g:e} vs {want:e}");
    }
}
