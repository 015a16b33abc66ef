"""Every block format and both families on tiny synthetic models, against a NumPy reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import dasllama as dl
from synthetic import reference_logits, write_model

IDS = [1, 261, 262, 263, 5, 70, 80, 90, 100]
FORMATS = [QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.MXFP4]


def run(path: Path, quant: dl.QuantMode) -> np.ndarray:
    m = dl.load_model(path, quant)
    s = dl.create_session(m)
    return np.stack([dl.eval(m, s, [t]) for t in IDS])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("qt", FORMATS, ids=lambda q: q.name)
def test_format_against_numpy(tmp_path: Path, qt: QT, arch: str) -> None:
    path = tmp_path / f"tiny-{arch}-{qt.name}.gguf"
    weights = write_model(path, qt, arch)
    ref = reference_logits(weights, IDS, arch)
    # fp32 mode: exact weights and f32 activations; only the f16 KV rounding separates us.
    got = run(path, dl.QuantMode.fp32)
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() <= 0.02 * scale, (np.abs(got - ref).max(), scale)
    # native mode: activations rounded to the weight format's q8 partner; still close.
    nat = run(path, dl.QuantMode.native)
    assert np.abs(nat - ref).max() <= 0.12 * scale
    assert (nat.argmax(-1) == ref.argmax(-1)).mean() >= 0.75


@pytest.mark.parametrize("qt", [QT.Q4_1, QT.MXFP4], ids=lambda q: q.name)
def test_q8_mode_converts(tmp_path: Path, qt: QT) -> None:
    path = tmp_path / "tiny.gguf"
    ref = reference_logits(write_model(path, qt), IDS)
    got = run(path, dl.QuantMode.q8)
    assert np.abs(got - ref).max() <= 0.08 * np.abs(ref).max()


def test_long_context_attention_against_numpy(tmp_path: Path) -> None:
    """A thousand positions deep (many KV pages per session): decode steps against the NumPy
    reference, and prefill of the same tokens gives the last row bit for bit."""
    path = tmp_path / "tiny-long.gguf"
    weights = write_model(path, QT.F32, ctx=1400)
    rng = np.random.default_rng(7)
    ids = [int(t) for t in rng.integers(1, 250, size=1100)]
    ref = reference_logits(weights, ids)
    m = dl.load_model(path, dl.QuantMode.fp32)
    s = dl.create_session(m)
    dl.eval(m, s, ids[:1000])
    got = np.stack([dl.eval(m, s, [t]) for t in ids[1000:]])
    scale = np.abs(ref).max()
    assert np.abs(got - ref[1000:]).max() <= 0.02 * scale, (np.abs(got - ref[1000:]).max(), scale)
    # Prefill of the same tokens in one call gives the same last row, bit for bit.
    whole = dl.eval(m, dl.create_session(m), ids)
    assert np.array_equal(whole, got[-1])


GGML_ORDER = [QT.F32, QT.F16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]


@pytest.mark.parametrize("qt", GGML_ORDER, ids=lambda q: q.name)
def test_ggml_numerics_against_numpy(tmp_path: Path, qt: QT) -> None:
    # ggml's summation order (bit-exact against llama.cpp in test_golden) is the fast kernels'
    # arithmetic in another order: as close to the f32 reference, step by step (ggml's single-row
    # kernels) and as one nine-token prefill (its batched ones: groups of four, tiled at eight).
    path = tmp_path / f"tiny-{qt.name}.gguf"
    ref = reference_logits(write_model(path, qt, "gemma3"), IDS, "gemma3")
    m = dl.load_model(path, numerics=dl.Numerics.ggml)
    s = dl.create_session(m)
    got = np.stack([dl.eval(m, s, [t]) for t in IDS])
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() <= 0.12 * scale
    pre = dl.eval(m, dl.create_session(m), IDS)
    assert np.abs(pre - ref[-1]).max() <= 0.12 * scale


@pytest.mark.parametrize("qt", [QT.BF16], ids=lambda q: q.name)
def test_ggml_numerics_refuses_other_formats(tmp_path: Path, qt: QT) -> None:
    path = tmp_path / f"tiny-{qt.name}.gguf"
    write_model(path, qt)
    with pytest.raises(dl.UnsupportedModelError, match=f"is {qt.name}.*numerics='fast'"):
        dl.load_model(path, numerics="ggml")


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0", "tq4"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_chunk_rows_equal_one_token_at_a_time(tmp_path: Path, arch: str, kv_dtype: str) -> None:
    """Attention takes a chunk's rows in blocks that read each K/V page once for all of them:
    every row's logits are still bit for bit those of decoding the tokens one by one, across page
    boundaries, KV codecs and sliding windows (gemma3's even layers slide over 4 positions)."""
    path = tmp_path / f"tiny-{arch}.gguf"
    write_model(path, QT.Q8_0, arch, ctx=128)
    m = dl.load_model(path)
    ids = [int(t) for t in np.random.default_rng(3).integers(1, 250, size=70)]
    pool = dl.create_kv_pool(m, page_rows=4, kv_dtype=kv_dtype)
    one = dl.create_session(m, pool)
    singles = np.stack([dl.eval(m, one, [t]) for t in ids])
    s = dl.create_session(m, pool)
    dl.eval(m, s, ids[:7])
    np.testing.assert_array_equal(dl.eval_all(m, s, ids[7:]), singles[7:])
