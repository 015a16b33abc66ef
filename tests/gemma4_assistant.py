"""Synthetic Gemma 4 assistant drafters (``general.architecture = gemma4-assistant``, the files
Gemma 4 ships beside its models as ``mtp-<name>-<quant>.gguf``) and a float64 NumPy reference of
their forward pass, written from llama.cpp's src/models/gemma4-assistant.cpp:

    x   = target.token_embd[token] * sqrt(target width)        # the target's embedding, scaled
    h   = pre_projection @ [x, target hidden state]             # 2 * target width -> width
    per layer (no K/V of its own):
        q   = rope(rms(q_proj @ rms(h, attn_norm), attn_q_norm)) # queries only
        a   = attention(q, K/V of the target's last sliding-window layer (sliding layers) or
                        of its last layer (global layers)), scale 1
        h   = rms(o_proj @ a, post_attention_norm) + h
        h   = (rms(geglu(rms(h, ffn_norm)), post_ffw_norm) + h) * layer_output_scale
    out = rms(h, output_norm); logits = token_embd @ out;  next hidden = post_projection @ out

The hidden state is the target's after its final norm (llama.cpp's ``h_nextn``) for the first
draft, the assistant's own ``post_projection`` output for the next; every draft of one step sits
at the position of the last accepted token and sees the target's K/V before it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gemma4_vocab import write_vocab
from gguf import GGUFWriter

ARCH = "gemma4-assistant"
TARGET = "gemma4"


def write_assistant(path: Path, *, target_width: int, n_vocab: int, width: int = 16, heads: int = 2, head_dim: int = 16, head_dim_swa: int = 8, pattern: tuple[bool, ...] = (True, False), ff: int = 32, meta: dict[str, Any] | None = None, seed: int = 7, vocab: bool = False) -> dict[str, np.ndarray]:
    """Write an assistant for a target of width ``target_width`` and ``n_vocab`` tokens; return
    its weights (rows x cols). ``pattern``: per layer, whether it is a sliding-window layer.
    ``meta`` overrides ``gemma4-assistant.`` keys (None drops one); ``vocab`` adds the synthetic
    Gemma 4 vocabulary (llama.cpp loads a file's tokenizer with it)."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), ARCH)
    keys: dict[str, Any] = {
        "block_count": len(pattern),
        "nextn_predict_layers": len(pattern),
        "context_length": 512,
        "embedding_length": width,
        "embedding_length_out": target_width,
        "feed_forward_length": ff,
        "attention.head_count": heads,
        "attention.head_count_kv": 1,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "attention.key_length_swa": head_dim_swa,
        "attention.value_length_swa": head_dim_swa,
        "attention.sliding_window": 4,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.dimension_count": head_dim,
        "rope.dimension_count_swa": head_dim_swa,
        "rope.freq_base": 1_000_000.0,
        "rope.freq_base_swa": 10_000.0,
    }
    keys.update(meta or {})
    for k, v in keys.items():
        if v is None:
            continue
        if isinstance(v, float):
            w.add_float32(f"{ARCH}.{k}", v)
        else:
            w.add_uint32(f"{ARCH}.{k}", v)
    w.add_array(f"{ARCH}.attention.sliding_window_pattern", list(pattern))
    if vocab:
        write_vocab(w, None)
    weights: dict[str, np.ndarray] = {}

    t = _tensor_writer(w, rng, weights)
    t("token_embd.weight", n_vocab, width, scale=0.5)
    t("output_norm.weight", width, one=True)
    t("nextn.pre_projection.weight", width, 2 * target_width)
    t("nextn.post_projection.weight", target_width, width)
    _write_layers(t, w, weights, pattern, width, heads, head_dim, head_dim_swa, ff, own_kv=False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def _tensor_writer(w: GGUFWriter, rng: np.random.Generator, weights: dict[str, np.ndarray]) -> Callable[..., None]:
    """`t(name, *shape)`: a random F32 tensor (near 1 for a norm), written and kept in `weights`."""

    def t(name: str, *shape: int, scale: float = 0.2, one: bool = False) -> None:
        a = (1.0 + rng.normal(0, 0.1, size=shape) if one else rng.normal(0, scale, size=shape)).astype(np.float32)
        weights[name] = a
        w.add_tensor(name, a)

    return t


def _write_layers(t: Callable[..., None], w: GGUFWriter, weights: dict[str, np.ndarray], pattern: tuple[bool, ...], width: int, heads: int, head_dim: int, head_dim_swa: int, ff: int, own_kv: bool) -> None:
    """Gemma 4 layers of `pattern` (True: sliding): the target's with K/V of their own (one K/V
    head), the assistant's with queries only."""
    for i, swa in enumerate(pattern):
        hd = head_dim_swa if swa else head_dim
        p = f"blk.{i}."
        t(p + "attn_norm.weight", width, one=True)
        t(p + "attn_q.weight", heads * hd, width)
        if own_kv:
            t(p + "attn_k.weight", hd, width)
            t(p + "attn_v.weight", hd, width)
        t(p + "attn_q_norm.weight", hd, one=True)
        if own_kv:
            t(p + "attn_k_norm.weight", hd, one=True)
        t(p + "attn_output.weight", width, heads * hd)
        t(p + "post_attention_norm.weight", width, one=True)
        t(p + "layer_output_scale.weight", 1, one=True)
        t(p + "ffn_norm.weight", width, one=True)
        t(p + "ffn_gate.weight", ff, width)
        t(p + "ffn_up.weight", ff, width)
        t(p + "ffn_down.weight", width, ff)
        t(p + "post_ffw_norm.weight", width, one=True)
        if not swa and "rope_freqs.weight" not in weights:
            # Proportional RoPE: the global layers' frequency factors (1 rotates, 1e30 does not).
            f = np.where(np.arange(head_dim // 2) < head_dim // 4, 1.0, 1e30).astype(np.float32)
            weights["rope_freqs.weight"] = f
            w.add_tensor("rope_freqs.weight", f)


def _rms(x: np.ndarray, g: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * g


def _rope_neox(x: np.ndarray, pos: int, base: float, factors: np.ndarray | None) -> np.ndarray:
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    if factors is not None:
        inv = inv / factors
    ang = pos * inv
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def reference_step(wt: dict[str, np.ndarray], meta: dict[str, Any], pattern: tuple[bool, ...], target_embd_row: np.ndarray, hidden: np.ndarray, pos: int, kv: dict[bool, tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """One draft row: (logits, next hidden state) in float64. ``target_embd_row``: the target's
    (unscaled) embedding of the token; ``hidden``: the state it pairs with; ``pos``: the row's
    position; ``kv[swa]``: the K and V (positions x kv heads x head size, K after RoPE) of the
    target layer the assistant's sliding (True) or global (False) layers read, for positions
    before ``pos``."""
    W = {k: v.astype(np.float64) for k, v in wt.items()}
    tw = hidden.shape[0]
    x = target_embd_row.astype(np.float64) * math.sqrt(tw)
    h = W["nextn.pre_projection.weight"] @ np.concatenate([x, hidden.astype(np.float64)])
    heads = int(meta["attention.head_count"])
    for i, swa in enumerate(pattern):
        p = f"blk.{i}."
        q = (W[p + "attn_q.weight"] @ _rms(h, W[p + "attn_norm.weight"])).reshape(heads, -1)
        q = _rms(q, W[p + "attn_q_norm.weight"])
        base = float(meta["rope.freq_base_swa"] if swa else meta["rope.freq_base"])
        q = _rope_neox(q, pos, base, None if swa else W["rope_freqs.weight"])
        K, V = (a.astype(np.float64) for a in kv[swa])
        lo = max(0, pos - int(meta["attention.sliding_window"]) + 1) if swa else 0
        K, V = K[lo:pos], V[lo:pos]
        group = heads // K.shape[1]
        out = []
        for hh in range(heads):
            s = K[:, hh // group, :] @ q[hh]
            e = np.exp(s - s.max())
            out.append((e / e.sum()) @ V[:, hh // group, :])
        a = W[p + "attn_output.weight"] @ np.concatenate(out)
        h = _rms(a, W[p + "post_attention_norm.weight"]) + h
        f = _rms(h, W[p + "ffn_norm.weight"])
        f = W[p + "ffn_down.weight"] @ (_gelu(W[p + "ffn_gate.weight"] @ f) * (W[p + "ffn_up.weight"] @ f))
        h = (_rms(f, W[p + "post_ffw_norm.weight"]) + h) * W[p + "layer_output_scale.weight"][0]
    out = _rms(h, W["output_norm.weight"])
    return W["token_embd.weight"] @ out, W["nextn.post_projection.weight"] @ out


def write_target(path: Path, *, n_vocab: int, width: int = 32, heads: int = 2, head_dim: int = 16, head_dim_swa: int = 8, pattern: tuple[bool, ...] = (True, False), ff: int = 48, seed: int = 5) -> dict[str, np.ndarray]:
    """A dense Gemma 4 target as llama.cpp's src/models/gemma4.cpp reads it (no per-layer
    embeddings, no shared K/V, separate K and V, QK-norm and a weightless V-norm, proportional RoPE
    on the global layers, a final logit soft-cap), with the synthetic Gemma 4 vocabulary; returns
    its weights."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), TARGET)
    for k, v in (
        ("block_count", len(pattern)),
        ("context_length", 512),
        ("embedding_length", width),
        ("feed_forward_length", ff),
        ("attention.head_count", heads),
        ("attention.head_count_kv", 1),
        ("attention.key_length", head_dim),
        ("attention.value_length", head_dim),
        ("attention.key_length_swa", head_dim_swa),
        ("attention.value_length_swa", head_dim_swa),
        ("attention.sliding_window", 4),
        ("embedding_length_per_layer_input", 0),
        ("rope.dimension_count", head_dim),
        ("rope.dimension_count_swa", head_dim_swa),
    ):
        w.add_uint32(f"{TARGET}.{k}", v)
    for k, f in (("attention.layer_norm_rms_epsilon", 1e-6), ("rope.freq_base", 1_000_000.0), ("rope.freq_base_swa", 10_000.0), ("final_logit_softcapping", 30.0)):
        w.add_float32(f"{TARGET}.{k}", f)
    w.add_array(f"{TARGET}.attention.sliding_window_pattern", list(pattern))
    write_vocab(w, None)
    weights: dict[str, np.ndarray] = {}

    t = _tensor_writer(w, rng, weights)
    t("token_embd.weight", n_vocab, width, scale=0.5)
    t("output_norm.weight", width, one=True)
    _write_layers(t, w, weights, pattern, width, heads, head_dim, head_dim_swa, ff, own_kv=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def target_reference(wt: dict[str, np.ndarray], ids: list[int], pattern: tuple[bool, ...] = (True, False), heads: int = 2, window: int = 4, softcap: float = 30.0) -> tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """The target of :func:`write_target` on ``ids`` in float64: (logits, hidden states after the
    final norm, per layer (K after RoPE, V), each positions x 1 x head size)."""
    W = {k: v.astype(np.float64) for k, v in wt.items()}
    d = W["token_embd.weight"].shape[1]
    x = W["token_embd.weight"][ids] * math.sqrt(d)
    n = len(ids)
    kvs = []
    for i, swa in enumerate(pattern):
        p = f"blk.{i}."
        h = _rms(x, W[p + "attn_norm.weight"])
        q = _rms((h @ W[p + "attn_q.weight"].T).reshape(n, heads, -1), W[p + "attn_q_norm.weight"])
        k = _rms((h @ W[p + "attn_k.weight"].T).reshape(n, 1, -1), W[p + "attn_k_norm.weight"])
        v = _rms((h @ W[p + "attn_v.weight"].T).reshape(n, 1, -1), 1.0)
        base = 10_000.0 if swa else 1_000_000.0
        f = None if swa else W["rope_freqs.weight"]
        q = np.stack([_rope_neox(q[t], t, base, f) for t in range(n)])
        k = np.stack([_rope_neox(k[t], t, base, f) for t in range(n)])
        kvs.append((k, v))
        out = np.zeros((n, heads * q.shape[-1]))
        for t in range(n):
            lo = max(0, t - window + 1) if swa else 0
            for hh in range(heads):
                s = k[lo : t + 1, 0, :] @ q[t, hh]
                e = np.exp(s - s.max())
                out[t, hh * q.shape[-1] : (hh + 1) * q.shape[-1]] = (e / e.sum()) @ v[lo : t + 1, 0, :]
        x = _rms(out @ W[p + "attn_output.weight"].T, W[p + "post_attention_norm.weight"]) + x
        g = _rms(x, W[p + "ffn_norm.weight"])
        g = (_gelu(g @ W[p + "ffn_gate.weight"].T) * (g @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
        x = (_rms(g, W[p + "post_ffw_norm.weight"]) + x) * W[p + "layer_output_scale.weight"][0]
    hidden = _rms(x, W["output_norm.weight"])
    logits = hidden @ W["token_embd.weight"].T
    return softcap * np.tanh(logits / softcap), hidden, kvs
