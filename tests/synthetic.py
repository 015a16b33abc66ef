"""Tiny synthetic GGUF models (random weights, any block format, llama or gemma3), written with
gguf.GGUFWriter, and a NumPy float64 reference forward pass to check the engine against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, LAYERS = 256, 4, 2, 64, 512, 2
# SentencePiece-style vocabulary: specials, then the 256 byte tokens, then a few pieces.
PIECES = ["\u2581the", "\u2581a", "\u2581cat", "at", "\u2581", "e", "t", "h"]
VOCAB = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
TYPES = [2, 3, 3] + [6] * 256 + [1] * len(PIECES)
K_QUANTS = {QT.Q4_K, QT.Q5_K, QT.Q6_K}


def _random_k_blocks(rows: int, cols: int, qt: QT, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with small finite f16 scales (gguf cannot quantize to these)."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale_at = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}[qt]
    for at in scale_at:
        raw[:, :, at : at + 2] = rng.uniform(0.0003, 0.001, size=(rows, cols // block)).astype(np.float16).view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def encode_weight(w: np.ndarray, qt: QT, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or array to write, the exact values the file holds)."""
    if qt == QT.F32:
        return w.astype(np.float32), w.astype(np.float32)
    if qt == QT.F16:
        h = w.astype(np.float16)
        return h, h.astype(np.float32)
    raw = _random_k_blocks(*w.shape, qt, rng) if qt in K_QUANTS else quantize(w.astype(np.float32), qt)
    return raw, dequantize(raw, qt).reshape(w.shape).astype(np.float32)


def write_model(
    path: Path, qt: QT = QT.F32, arch: str = "llama", drop: str | None = None, ctx: int = 64, meta: dict[str, Any] | None = None, extra: dict[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """Write a tiny model; return the exact weights (numpy order: rows x cols) it holds. ``meta``
    overrides ``<arch>.`` keys (None drops one); ``extra`` adds tensors as given."""
    rng = np.random.default_rng(1234)
    w = GGUFWriter(str(path), arch)
    keys: dict[str, Any] = {
        "block_count": LAYERS,
        "context_length": ctx,
        "embedding_length": DIM,
        "feed_forward_length": HIDDEN,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
        "attention.key_length": HEAD_DIM,
        "attention.value_length": HEAD_DIM,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 10000.0,
    }
    if arch == "gemma3":
        keys["attention.sliding_window"] = 4
    keys.update(meta or {})
    for k, v in keys.items():
        if v is None:
            continue
        if isinstance(v, str):
            w.add_string(f"{arch}.{k}", v)
        elif isinstance(v, float):
            w.add_float32(f"{arch}.{k}", v)
        elif isinstance(v, list):
            w.add_array(f"{arch}.{k}", v)
        elif v < 0:
            w.add_int32(f"{arch}.{k}", v)
        else:
            w.add_uint32(f"{arch}.{k}", v)
    w.add_tokenizer_model("llama")
    w.add_token_list(VOCAB)
    w.add_token_scores([0.0] * 3 + [0.0] * 256 + [-float(i) for i in range(len(PIECES))])
    w.add_token_types(TYPES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    weights: dict[str, np.ndarray] = {}

    def mat(name: str, rows: int, cols: int, kind: QT, scale: float = 0.08) -> None:
        data, exact = encode_weight(rng.normal(0, scale, size=(rows, cols)), kind, rng)
        weights[name] = exact
        if name != drop:
            if data.dtype == np.uint8:
                w.add_tensor(name, data, raw_dtype=kind)
            else:
                w.add_tensor(name, data)

    def vec(name: str, n: int) -> None:
        v = (1.0 + rng.normal(0, 0.1, size=n)).astype(np.float32)
        weights[name] = v
        if name != drop:
            w.add_tensor(name, v)

    mat("token_embd.weight", len(VOCAB), DIM, qt if qt not in K_QUANTS else QT.Q8_0, 0.5)
    for i in range(LAYERS):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", DIM)
        mat(p + "attn_q.weight", HEADS * HEAD_DIM, DIM, qt)
        mat(p + "attn_k.weight", KV_HEADS * HEAD_DIM, DIM, qt)
        mat(p + "attn_v.weight", KV_HEADS * HEAD_DIM, DIM, qt)
        mat(p + "attn_output.weight", DIM, HEADS * HEAD_DIM, qt)
        vec(p + "ffn_norm.weight", DIM)
        mat(p + "ffn_gate.weight", HIDDEN, DIM, qt)
        mat(p + "ffn_up.weight", HIDDEN, DIM, qt)
        mat(p + "ffn_down.weight", DIM, HIDDEN, qt)
        if arch == "gemma3":
            vec(p + "attn_q_norm.weight", HEAD_DIM)
            vec(p + "attn_k_norm.weight", HEAD_DIM)
            vec(p + "post_attention_norm.weight", DIM)
            vec(p + "post_ffw_norm.weight", DIM)
    vec("output_norm.weight", DIM)
    for name, t in (extra or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def _rms(x: np.ndarray, g: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def _rope(x: np.ndarray, pos: int, base: float, neox: bool) -> np.ndarray:
    d = x.shape[-1]
    theta = pos * base ** (-np.arange(0, d, 2) / d)
    c, s = np.cos(theta), np.sin(theta)
    out = x.copy()
    if neox:
        a, b = x[..., : d // 2], x[..., d // 2 :]
        out[..., : d // 2], out[..., d // 2 :] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


def reference_logits(wt: dict[str, np.ndarray], ids: list[int], arch: str = "llama") -> np.ndarray:
    """Float64 forward pass; logits after each position (tied output embedding)."""
    gemma = arch == "gemma3"
    W = {k: v.astype(np.float64) for k, v in wt.items()}
    x = W["token_embd.weight"][ids] * (np.sqrt(DIM) if gemma else 1.0)
    T = len(ids)
    for i in range(LAYERS):
        p = f"blk.{i}."
        h = _rms(x, W[p + "attn_norm.weight"])
        q = (h @ W[p + "attn_q.weight"].T).reshape(T, HEADS, HEAD_DIM)
        k = (h @ W[p + "attn_k.weight"].T).reshape(T, KV_HEADS, HEAD_DIM)
        v = (h @ W[p + "attn_v.weight"].T).reshape(T, KV_HEADS, HEAD_DIM)
        swa = gemma and (i % 6) < 5
        base = 10000.0
        if gemma:
            q, k = _rms(q, W[p + "attn_q_norm.weight"]), _rms(k, W[p + "attn_k_norm.weight"])
        q = np.stack([_rope(q[t], t, base, gemma) for t in range(T)])
        k = np.stack([_rope(k[t], t, base, gemma) for t in range(T)])
        att = np.zeros((T, HEADS, HEAD_DIM))
        for t in range(T):
            lo = max(0, t - 4 + 1) if swa else 0
            for hh in range(HEADS):
                kv = hh // (HEADS // KV_HEADS)
                sc = k[lo : t + 1, kv] @ q[t, hh] / np.sqrt(HEAD_DIM)
                pr = np.exp(sc - sc.max())
                pr /= pr.sum()
                att[t, hh] = pr @ v[lo : t + 1, kv]
        o = att.reshape(T, -1) @ W[p + "attn_output.weight"].T
        if gemma:
            o = _rms(o, W[p + "post_attention_norm.weight"])
        x = x + o
        h = _rms(x, W[p + "ffn_norm.weight"])
        g, u = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
        a = 0.5 * g * (1 + np.tanh(0.7978845608 * (g + 0.044715 * g**3))) if gemma else g / (1 + np.exp(-g))
        d = (a * u) @ W[p + "ffn_down.weight"].T
        if gemma:
            d = _rms(d, W[p + "post_ffw_norm.weight"])
        x = x + d
    return _rms(x, W["output_norm.weight"]) @ W["token_embd.weight"].T
