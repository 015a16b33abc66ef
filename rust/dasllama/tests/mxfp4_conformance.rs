//! MXFP4 against the `gguf` package's reference (gguf-py's quants.py, a port of ggml's), bit for
//! bit: dequantization of a block for every scale byte with every code in both nibbles, and the
//! reference quantizer on normal values, exact ties and zeros. The data comes from
//! `scripts/make_mxfp4_fixture.py`.

use dasllama::quant::{dequantize_row, mxfp4, GgmlType};

const FIXTURE: &[u8] = include_bytes!("data/mxfp4_gguf_py.bin");

fn u32_at(b: &[u8], at: usize) -> usize {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

#[test]
fn dequantization_matches_gguf_py_bit_for_bit() {
    let n = u32_at(FIXTURE, 0);
    let blocks = &FIXTURE[4..4 + 17 * n];
    let want = f32s(&FIXTURE[4 + 17 * n..4 + 17 * n + 128 * n]);
    let mut got = vec![0.0f32; 32 * n];
    dequantize_row(GgmlType::MXFP4, blocks, &mut got);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "block {} (e = {}) value {}: {g} != gguf-py's {w}", i / 32, blocks[17 * (i / 32)], i % 32);
    }
}

#[test]
fn quantizer_matches_gguf_py_bit_for_bit() {
    let n = u32_at(FIXTURE, 0);
    let at = 4 + 17 * n + 128 * n;
    let nq = u32_at(FIXTURE, at);
    let x = f32s(&FIXTURE[at + 4..at + 4 + 128 * nq]);
    let want = &FIXTURE[at + 4 + 128 * nq..at + 4 + 128 * nq + 17 * nq];
    let mut got = vec![0u8; 17 * nq];
    mxfp4::quantize_ref(&x, &mut got);
    for (b, (g, w)) in got.chunks_exact(17).zip(want.chunks_exact(17)).enumerate() {
        assert_eq!(g, w, "block {b} of {:?}", &x[32 * b..32 * b + 32]);
    }
}
