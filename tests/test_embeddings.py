"""Embeddings: pooled final-norm hidden states, equal to llama.cpp's `llama-embedding` on the same
model (goldens made by scripts/make_embedding_goldens.py), the same whether inputs run together
or alone."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import golden

import dasllama as dl


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_match_llama_cpp(smollm: dl.Model, pooling: str) -> None:
    g = golden("embeddings-smollm2.json")
    assert [dl.encode(smollm, t) for t in g["texts"]] == g["ids"]
    got = dl.embed(smollm, g["texts"], pooling=pooling)  # type: ignore[arg-type]
    ref = np.array(g[pooling], dtype=np.float64)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > 1 - 1e-3, cos
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_batched_equals_alone_and_pooling_matters(smollm: dl.Model) -> None:
    texts = ["short", "a somewhat longer sentence about embeddings", "x " * 300]
    together = dl.embed(smollm, texts)
    for t, row in zip(texts, together, strict=True):
        np.testing.assert_array_equal(dl.embed(smollm, t)[0], row)
    assert together.shape == (3, smollm.config["dim"]) and together.dtype == np.float32
    assert not np.allclose(dl.embed(smollm, texts[1], pooling="last"), together[1])
    raw = dl.embed(smollm, texts[1], normalize=False)
    np.testing.assert_allclose(raw[0] / np.linalg.norm(raw[0]), together[1], atol=1e-6)
    assert dl.default_pooling(smollm) == "mean"


def test_bad_inputs(smollm: dl.Model) -> None:
    for bad, msg in (([], "at least one"), ([""], "empty"), (["ok", 3.5], "input 1"), ([[smollm.n_vocab]], "vocabulary"), (["w " * 9000], "context")):
        with pytest.raises(ValueError, match=msg):
            dl.embed(smollm, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pooling"):
        dl.embed(smollm, "hi", pooling="max")  # type: ignore[arg-type]
