"""Write rust/dasllama/tests/data/mxfp4_gguf_py.bin: MXFP4 blocks and what the `gguf` package's
reference (gguf-py's quants.py, a port of ggml's) makes of them, for the Rust test
`tests/mxfp4_conformance.rs`, which checks dasllama's dequantization and quantizer bit for bit.

Layout (little-endian): u32 n_deq, then n_deq blocks of 17 bytes and their n_deq * 32 values as
f32 (gguf's `dequantize`); u32 n_q, then n_q * 32 f32 inputs and gguf's `quantize` of them (n_q
blocks of 17 bytes).

The dequantized blocks are one per scale byte e = 0..255, code j and 15 - j in the two nibbles of
byte j (every code in both halves under every scale; e = 0, 1 are ggml's subnormal halves, 255 its
2^127). The quantized inputs are normal values of spreads 2^-20..2^20, with exact ties between
levels, zeros and blocks of zeros.

    .venv/bin/python scripts/make_mxfp4_fixture.py
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

OUT = Path(__file__).resolve().parent.parent / "rust" / "dasllama" / "tests" / "data" / "mxfp4_gguf_py.bin"


def main() -> None:
    rng = np.random.default_rng(39)
    blocks = np.zeros((256, 17), np.uint8)
    blocks[:, 0] = np.arange(256)
    blocks[:, 1:] = np.arange(16) | ((15 - np.arange(16)) << 4)
    with np.errstate(over="ignore"):  # e = 255 times the top levels: inf, as in ggml
        deq = dequantize(blocks, QT.MXFP4).astype("<f4").reshape(256, 32)

    nq = 96
    x = rng.normal(size=(nq, 32)) * np.exp2(rng.integers(-20, 21, size=(nq, 1)))
    levels = np.array([0, 1, 2, 3, 4, 6, 8, 12, -1, -2, -3, -4, -6, -8, -12], np.float64)
    # Exact ties: midpoints between neighbouring levels times a power of two.
    mids = (np.sort(levels)[1:] + np.sort(levels)[:-1]) / 2
    x[0] = np.resize(mids, 32) * 0.25
    x[1] = np.resize(levels, 32) * 0.5
    x[2] = 0.0
    x[3, ::3] = 0.0
    x = x.astype(np.float32)
    q = quantize(x.reshape(-1), QT.MXFP4).reshape(nq, 17)

    with OUT.open("wb") as f:
        f.write(struct.pack("<I", 256))
        f.write(blocks.tobytes())
        f.write(deq.tobytes())
        f.write(struct.pack("<I", nq))
        f.write(x.astype("<f4").tobytes())
        f.write(q.astype(np.uint8).tobytes())
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
