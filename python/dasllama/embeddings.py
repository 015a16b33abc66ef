"""Embeddings: one vector per text, from the model's hidden states after its final norm, pooled
as the GGUF declares (``<arch>.pooling_type``) or as asked, L2-normalized like llama.cpp's
``llama-embedding``. All inputs of a call go through one pass over the weights."""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt

from . import _native
from .model import Model, encode

Pooling = Literal["mean", "cls", "last"]
# Tokens per weight pass: inputs are grouped so that a pass's activations stay bounded.
PASS_TOKENS = 8192
# llama.cpp's enum llama_pooling_type: 0 none, 1 mean, 2 cls, 3 last, 4 rank.
_GGUF_POOLING: dict[int, Pooling] = {1: "mean", 2: "cls", 3: "last"}


def default_pooling(m: Model) -> Pooling:
    """The pooling the file declares, else mean (what a causal LM's file leaves unsaid)."""
    return _GGUF_POOLING.get(int(m.metadata.get(f"{m.arch}.pooling_type", 1)), "mean")


def embed(m: Model, inputs: str | list[str] | list[int] | list[list[int]], pooling: Pooling | None = None, normalize: bool = True) -> npt.NDArray[np.float32]:
    """An (n, dim) float32 array: one row per input (a text, encoded as the model adds BOS, or a
    list of token ids). Inputs share weight passes of up to ``PASS_TOKENS`` tokens. Raises
    ValueError for no inputs, an empty one, one past the context or outside the vocabulary."""
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and all(isinstance(t, int) for t in inputs)):
        inputs = [inputs]  # type: ignore[list-item]
    if not isinstance(inputs, list) or not inputs:
        raise ValueError("embed needs at least one input: a string, a list of strings, or token id lists")
    ids: list[list[int]] = []
    for i, x in enumerate(inputs):
        if isinstance(x, str):
            toks = encode(m, x)
        elif isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
            toks = list(x)
        else:
            raise ValueError(f"input {i} must be a string or a list of token ids, not {type(x).__name__}")
        if not toks:
            raise ValueError(f"input {i} is empty; every input needs at least one token")
        if len(toks) > int(m.config["seq_len"]):
            raise ValueError(f"input {i} has {len(toks)} tokens, more than the context of {m.config['seq_len']}; shorten it")
        if any(not 0 <= t < m.n_vocab for t in toks):
            raise ValueError(f"input {i} holds a token id outside the vocabulary of {m.n_vocab}")
        ids.append(toks)
    groups: list[list[list[int]]] = [[]]
    for toks in ids:
        if groups[-1] and sum(map(len, groups[-1])) + len(toks) > PASS_TOKENS:
            groups.append([])
        groups[-1].append(toks)
    pool = pooling or default_pooling(m)
    return np.concatenate([_native.embed(m._native, g, pool, normalize) for g in groups])
