"""Tiny synthetic GGUF models (random weights, any block format), written with gguf.GGUFWriter:
``write_model`` (llama or gemma3, one format throughout) with a NumPy float64 reference forward
pass to check the engine against, and ``write_family`` (every supported family, its weights in
several block formats) whose llama.cpp outputs are the goldens under ``golden/families/``."""

from __future__ import annotations

from collections.abc import Callable
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


def _write_vocab(w: GGUFWriter, specials: tuple[str, ...] = ()) -> None:
    w.add_tokenizer_model("llama")
    w.add_token_list(VOCAB + list(specials))
    w.add_token_scores([0.0] * 3 + [0.0] * 256 + [-float(i) for i in range(len(PIECES))] + [0.0] * len(specials))
    w.add_token_types(TYPES + [3] * len(specials))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def _add_keys(w: GGUFWriter, arch: str, keys: dict[str, Any]) -> None:
    for k, v in keys.items():
        if v is None:
            continue
        if isinstance(v, str):
            w.add_string(f"{arch}.{k}", v)
        elif isinstance(v, bool):
            w.add_bool(f"{arch}.{k}", v)
        elif isinstance(v, float):
            w.add_float32(f"{arch}.{k}", v)
        elif isinstance(v, list):
            w.add_array(f"{arch}.{k}", v)
        elif v < 0:
            w.add_int32(f"{arch}.{k}", v)
        else:
            w.add_uint32(f"{arch}.{k}", v)


def write_model(
    path: Path,
    qt: QT = QT.F32,
    arch: str = "llama",
    drop: str | None = None,
    ctx: int = 64,
    meta: dict[str, Any] | None = None,
    extra: dict[str, np.ndarray] | None = None,
    general: dict[str, Any] | None = None,
    specials: tuple[str, ...] = (),
    template: str | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny model; return the exact weights (numpy order: rows x cols) it holds. ``meta``
    overrides ``<arch>.`` keys (None drops one); ``extra`` adds tensors as given; ``general`` adds
    keys under their full names (``{"general.sampling.temp": 0.6}``); ``specials`` adds control
    tokens after the vocabulary."""
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
    _add_keys(w, arch, keys)
    for k, v in (general or {}).items():
        prefix, _, rest = k.partition(".")
        _add_keys(w, prefix, {rest: v})
    _write_vocab(w, specials)
    if template is not None:
        w.add_chat_template(template)
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

    mat("token_embd.weight", len(VOCAB) + len(specials), DIM, qt if qt not in K_QUANTS else QT.Q8_0, 0.5)
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


def reference_logits(
    wt: dict[str, np.ndarray], ids: list[int], arch: str = "llama", embeds: dict[int, np.ndarray] | None = None, spans: tuple[tuple[int, int], ...] = ()
) -> np.ndarray:
    """Float64 forward pass; logits after each position (tied output embedding). ``embeds`` gives
    rows' inputs instead of their tokens' (unscaled); the rows of each (first, count) of ``spans``
    attend each other (an image's rows, non-causal as llama.cpp decodes Gemma 3's)."""
    gemma = arch == "gemma3"
    W = {k: v.astype(np.float64) for k, v in wt.items()}
    x = W["token_embd.weight"][ids] * (np.sqrt(DIM) if gemma else 1.0)
    for r, v in (embeds or {}).items():
        x[r] = v
    T = len(ids)
    ends = list(range(1, T + 1))
    for first, n in spans:
        ends[first : first + n] = [first + n] * n
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
                sc = k[lo : ends[t], kv] @ q[t, hh] / np.sqrt(HEAD_DIM)
                pr = np.exp(sc - sc.max())
                pr /= pr.sum()
                att[t, hh] = pr @ v[lo : ends[t], kv]
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


# --- every family, several block formats per model (goldens: scripts/make_family_goldens.py) ---

# Per family: its shape and what sets it apart. Sizes keep every matrix's rows a multiple of 256
# (the K-quants' block). Embeddings of std 0.12 put the logits where a real model's are (top-1
# log-prob about -1.8, uniform would be -5.6): far from flat, and not so steep that one activation
# rounded the other way moves a log-prob by tenths of a nat (with std 0.5 it did, in llama.cpp too,
# between its own prefill and decode). gemma2 keeps 0.5: its scaled embeddings, post-norms and
# capped logits hold it steady.
FAMILIES: dict[str, dict[str, Any]] = {
    # Q/K/V biases (large on K, as in the real models), NEOX RoPE.
    "qwen2": dict(arch="qwen2", heads=4, kv_heads=2, head_dim=64, bias=True, embd=(0.12, QT.Q8_0), meta={"rope.freq_base": 1000000.0}),
    # QK-norm; heads wider than dim / n_heads.
    "qwen3": dict(arch="qwen3", heads=4, kv_heads=2, head_dim=128, qk_norm=True, embd=(0.12, QT.Q8_0), meta={"rope.freq_base": 1000000.0}),
    # Fused QKV and gate/up, partial RoPE (48 of 64), longrope: the context (64) outgrows the
    # original one (32), so the long factors apply, and the attention factor scales both.
    "phi3": dict(
        arch="phi3",
        heads=4,
        kv_heads=2,
        head_dim=64,
        fused=True,
        embd=(0.12, QT.Q8_0),
        output=(0.12, QT.Q6_K),
        factors=True,
        meta={"rope.dimension_count": 48, "rope.scaling.original_context_length": 32, "rope.scaling.attn_factor": 1.19, "attention.layer_norm_rms_epsilon": 1e-5},
    ),
    # Phi-3-mini's shape: full heads (no GQA), the short factors (the context fits the original).
    "phi3-short": dict(
        arch="phi3", heads=4, kv_heads=4, head_dim=64, fused=True, factors=True, embd=(0.12, QT.Q8_0), meta={"rope.scaling.original_context_length": 4096, "attention.layer_norm_rms_epsilon": 1e-5}
    ),
    # Soft-capped scores and logits (caps near their sizes here, so both bite), even layers
    # sliding over 4 positions, post-norms, GELU, scaled embeddings.
    "gemma2": dict(
        arch="gemma2",
        heads=4,
        kv_heads=2,
        head_dim=64,
        post_norms=1.0,
        embd=(0.5, QT.F16),
        layers=3,
        meta={"attention.sliding_window": 4, "attn_logit_softcapping": 1.5, "final_logit_softcapping": 15.0},
    ),
    # Routed experts: 8 of them, the top 2 by softmax weight as they come, plus a shared expert
    # under a sigmoid gate; qwen2's attention.
    "qwen2moe": dict(
        arch="qwen2moe",
        heads=4,
        kv_heads=2,
        head_dim=64,
        bias=True,
        embd=(0.12, QT.Q8_0),
        moe=dict(n=8, used=2, hidden=256, shared=512),
        output=(0.12, QT.Q8_0),  # llama.cpp's qwen2moe has no tied output
        meta={"rope.freq_base": 1000000.0, "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 256, "expert_shared_feed_forward_length": 512},
    ),
    # The top 3 of 8 experts, their weights renormalised; qwen3's attention.
    "qwen3moe": dict(
        arch="qwen3moe",
        heads=4,
        kv_heads=2,
        head_dim=128,
        qk_norm=True,
        embd=(0.12, QT.Q8_0),
        moe=dict(n=8, used=3, hidden=256),
        meta={"rope.freq_base": 1000000.0, "expert_count": 8, "expert_used_count": 3, "expert_feed_forward_length": 256},
    ),
    # qwen3 with every matrix in the non-linear 4-bit formats (IQ4_XS and IQ4_NL in turn), the
    # token embedding (and so the tied output) in IQ4_NL.
    "qwen3-iq4": dict(
        arch="qwen3",
        heads=4,
        kv_heads=2,
        head_dim=128,
        qk_norm=True,
        embd=(0.12, QT.IQ4_NL),
        formats=[QT.IQ4_XS, QT.IQ4_NL],
        meta={"rope.freq_base": 1000000.0},
    ),
    # qwen3moe's experts as IQ4 files ship them (each stack in one of the two formats).
    "qwen3moe-iq4": dict(
        arch="qwen3moe",
        heads=4,
        kv_heads=2,
        head_dim=128,
        qk_norm=True,
        embd=(0.12, QT.Q8_0),
        formats=[QT.IQ4_NL, QT.IQ4_XS],
        moe=dict(n=8, used=3, hidden=256),
        meta={"rope.freq_base": 1000000.0, "expert_count": 8, "expert_used_count": 3, "expert_feed_forward_length": 256},
    ),
    # The VL text towers (no vision encoder): a text token has the same position on the first three
    # M-RoPE axes and 0 on the fourth. qwen2vl: qwen2 with consecutive sections (Qwen2-VL's
    # 16/24/24/0 of 64 pairs, here over 32). llama-cpp-python 0.3.36's llama.cpp does not read
    # qwen2vl's norm epsilon (its norms add 0); dasllama reads the file's, so this file's is ~0
    # and the goldens test the rest of the graph (with 1e-6 they part by 0.12 nats).
    "qwen2vl": dict(
        arch="qwen2vl",
        heads=4,
        kv_heads=2,
        head_dim=64,
        bias=True,
        embd=(0.12, QT.Q8_0),
        meta={"rope.freq_base": 1000000.0, "rope.dimension_sections": [8, 12, 12, 0], "attention.layer_norm_rms_epsilon": 1e-30},
    ),
    # qwen3 with Qwen3-VL's interleaved sections (24/20/20/0 of 64 pairs: in ggml's layout pairs
    # 61 and 62 fall on the fourth axis, position 0 for text) and deepstack layers (inert for text).
    "qwen3vl": dict(
        arch="qwen3vl",
        heads=4,
        kv_heads=2,
        head_dim=128,
        qk_norm=True,
        embd=(0.12, QT.Q8_0),
        meta={"rope.freq_base": 1000000.0, "rope.dimension_sections": [24, 20, 20, 0], "n_deepstack_layers": 2},
    ),
    "qwen3vlmoe": dict(
        arch="qwen3vlmoe",
        heads=4,
        kv_heads=2,
        head_dim=128,
        qk_norm=True,
        embd=(0.12, QT.Q8_0),
        moe=dict(n=8, used=3, hidden=256),
        meta={
            "rope.freq_base": 1000000.0,
            "rope.dimension_sections": [24, 20, 20, 0],
            "n_deepstack_layers": 2,
            "expert_count": 8,
            "expert_used_count": 3,
            "expert_feed_forward_length": 256,
        },
    ),
    # llama's layers (adjacent-pair RoPE) with YaRN from an original context of 8 (its ramp over
    # pairs 3-12 with these betas, the log multiplier's magnitude), and Llama 4's attention
    # temperature: queries at positions 8-15 scaled by 1 + 0.1 ln 2, 16-23 by 1 + 0.1 ln 3.
    "mistral3": dict(
        arch="mistral3",
        heads=4,
        kv_heads=2,
        head_dim=64,
        embd=(0.12, QT.Q8_0),
        output=(0.12, QT.Q8_0),
        meta={
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": 4.0,
            "rope.scaling.original_context_length": 8,
            "rope.scaling.yarn_beta_fast": 0.5,
            "rope.scaling.yarn_beta_slow": 0.05,
            "rope.scaling.yarn_log_multiplier": 0.5,
            "attention.temperature_scale": 0.1,
            "attention.layer_norm_rms_epsilon": 1e-5,
        },
    ),
    # GLM-4.5's layers: Q/K/V biases, QK-norm (the 355B model's; the Air has none), NEOX RoPE on
    # 32 of 64 values, the FFN under post_attention_norm. Layer 0 dense, layers 1-2 routed: 8
    # experts scored by sigmoid, the top 3 chosen by score plus a selection bias (`exp_probs_b`,
    # large enough to change choices), renormalised and scaled by 2.5, plus an ungated shared
    # expert of 2 experts' width. An MTP (NextN) block follows the trunk (block 3), which
    # llama.cpp loads past and the forward pass does not run. As with qwen3next, a near-tie of
    # router scores flips a choice under activation rounding on some seeds (llama.cpp's own
    # prefill and decode then part by 0.6 nats); `seed` picks weights where they agree (0.035).
    "glm4moe": dict(
        arch="glm4moe",
        seed=3,
        heads=4,
        kv_heads=2,
        head_dim=64,
        layers=3,
        glm=dict(lead=1, nextn=True),
        bias=True,
        qk_norm=True,
        embd=(0.12, QT.Q8_0),
        output=(0.12, QT.Q8_0),
        moe=dict(n=8, used=3, hidden=256, shared=512, norm=True, sigmoid=True, bias=0.15, scale=2.5),
        meta={
            "block_count": 4,
            "nextn_predict_layers": 1,
            "leading_dense_block_count": 1,
            "rope.dimension_count": 32,
            "expert_count": 8,
            "expert_used_count": 3,
            "expert_feed_forward_length": 256,
            "expert_shared_count": 2,
            "expert_weights_norm": True,
            "expert_weights_scale": 2.5,
            "expert_gating_func": 2,
        },
    ),
    # gpt-oss's layers: biases on Q/K/V and the output, a sink logit per head (large enough to
    # take a good share of the softmax), NEOX RoPE with the real model's YaRN (base 150000, factor
    # 32 over an original context of 4096), even layers sliding over 8 positions (the cases run
    # 24, so the window cuts), more query heads than dim / head_dim (as the real 64 x 64 > 2880).
    # The FFN under post_attention_norm, all routed: the router's biased logits pick the top 4 of
    # 8 experts, weighted by a softmax over those 4; each expert a clamped swiglu_oai (gate and up
    # wide enough that the clamp at 7 bites) with biases on gate, up and down.
    "gpt-oss": dict(
        arch="gpt-oss",
        heads=8,
        kv_heads=2,
        head_dim=64,
        layers=3,
        oai=dict(sinks=(1.0, 1.0)),
        embd=(0.12, QT.Q8_0),
        output=(0.12, QT.Q8_0),
        moe=dict(n=8, used=4, hidden=256, gate_up=0.25),
        meta={
            "rope.freq_base": 150000.0,
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": 32.0,
            "rope.scaling.original_context_length": 4096,
            "attention.sliding_window": 8,
            "attention.layer_norm_rms_epsilon": 1e-5,
            "expert_count": 8,
            "expert_used_count": 4,
            "expert_feed_forward_length": 256,
        },
    ),
    # gpt-oss as its files ship: the routed experts in MXFP4 (the rest in the formats above).
    "gpt-oss-mxfp4": dict(
        arch="gpt-oss",
        heads=8,
        kv_heads=2,
        head_dim=64,
        layers=3,
        oai=dict(sinks=(1.0, 1.0)),
        embd=(0.12, QT.Q8_0),
        output=(0.12, QT.Q8_0),
        stack_formats=[QT.MXFP4],
        moe=dict(n=8, used=4, hidden=256, gate_up=0.25),
        meta={
            "rope.freq_base": 150000.0,
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": 32.0,
            "rope.scaling.original_context_length": 4096,
            "attention.sliding_window": 8,
            "attention.layer_norm_rms_epsilon": 1e-5,
            "expert_count": 8,
            "expert_used_count": 4,
            "expert_feed_forward_length": 256,
        },
    ),
    # qwen3 with its matrices in MXFP4 and Q8_0 in turn (gguf quantizes them by ggml's reference
    # rounding), the token embedding in Q8_0: MXFP4 in dense matmuls, in both numerics.
    "qwen3-mxfp4": dict(
        arch="qwen3",
        heads=4,
        kv_heads=2,
        head_dim=128,
        qk_norm=True,
        embd=(0.12, QT.Q8_0),
        formats=[QT.MXFP4, QT.Q8_0],
        meta={"rope.freq_base": 1000000.0},
    ),
    # qwen3moe with its expert stacks in MXFP4, as gpt-oss ships them (gguf quantizes them, by
    # ggml's reference rounding), the other matrices in MXFP4 and Q8_0 in turn, the token
    # embedding (and so the tied output) in MXFP4.
    "qwen3moe-mxfp4": dict(
        arch="qwen3moe",
        heads=4,
        kv_heads=2,
        head_dim=128,
        qk_norm=True,
        embd=(0.12, QT.MXFP4),
        formats=[QT.MXFP4, QT.Q8_0],
        stack_formats=[QT.MXFP4],
        moe=dict(n=8, used=3, hidden=256),
        meta={"rope.freq_base": 1000000.0, "expert_count": 8, "expert_used_count": 3, "expert_feed_forward_length": 256},
    ),
    # Gated DeltaNet hybrid: layers 0-2 recurrent (2 key heads, 4 value heads of 64, a 4-tap
    # convolution), layer 3 gated full attention (QK-norm, NEOX RoPE on 16 of 64 values, Q's
    # sigmoid gate on the output); value heads read key heads tiled; dense FFN under
    # post_attention_norm.
    "qwen35": dict(
        arch="qwen35",
        heads=4,
        kv_heads=2,
        head_dim=64,
        layers=4,
        hybrid=dict(nk=2, nv=4, hd=64, conv=4, fused_ba=False),
        embd=(0.12, QT.Q8_0),
        meta={
            "rope.freq_base": 1000000.0,
            "rope.dimension_count": 16,
            "rope.dimension_sections": [3, 3, 2, 0],
            "full_attention_interval": 4,
            "ssm.conv_kernel": 4,
            "ssm.state_size": 64,
            "ssm.group_count": 2,
            "ssm.time_step_rank": 4,
            "ssm.inner_size": 256,
        },
    ),
    # qwen35's layers with value heads grouped per key head and beta/alpha from one projection;
    # an FFN of 8 routed experts (top 2, renormalised) and a gated shared expert. Routing inside a
    # recurrent model is chaotic under activation rounding (a token routed otherwise stays in the
    # state for good): on most seeds llama.cpp's own prefill and decode of such a file part by
    # 0.15-1.2 nats. `seed` picks weights where they agree (0.07), so the goldens can hold us to 0.15.
    "qwen3next": dict(
        arch="qwen3next",
        seed=2,
        heads=4,
        kv_heads=2,
        head_dim=64,
        layers=4,
        hybrid=dict(nk=2, nv=4, hd=64, conv=4, fused_ba=True),
        embd=(0.12, QT.Q8_0),
        moe=dict(n=8, used=2, hidden=256, shared=512, norm=True),
        meta={
            "rope.freq_base": 1000000.0,
            "rope.dimension_count": 16,
            "full_attention_interval": 4,
            "ssm.conv_kernel": 4,
            "ssm.state_size": 64,
            "ssm.group_count": 2,
            "ssm.time_step_rank": 4,
            "ssm.inner_size": 256,
            "expert_count": 8,
            "expert_used_count": 2,
            "expert_feed_forward_length": 256,
            "expert_shared_feed_forward_length": 512,
        },
    ),
    # Gemma 4, dense (the 12B/31B shape): sliding layers of 4 query and 2 K/V heads of 64, a
    # full layer of 4 and 1 of 128 whose V is its K (no attn_v); NEOX RoPE, the full layer's
    # p-RoPE turning 16 of its 64 pairs (`rope_freqs`: the rest divided by 1e30), bases 1e6 and
    # 1e4; Q/K norms with weights, V norms without, unscaled scores, a window of 6, sandwich
    # norms, each layer's output scaled (`layer_output_scale`), GELU, logits soft-capped at 10.
    "gemma4": dict(
        arch="gemma4",
        heads=4,
        kv_heads=2,
        head_dim=64,
        layers=4,
        embd=(0.12, QT.Q8_0),
        output=(0.12, QT.Q8_0),
        gemma4=dict(swa=[True, True, False, True], full_hd=128, full_kv=1, k_eq_v=True, rot=16),
        meta={
            "attention.sliding_window_pattern": [True, True, False, True],
            "attention.sliding_window": 6,
            "attention.head_count_kv": [2, 2, 1, 2],
            "attention.key_length": 128,
            "attention.value_length": 128,
            "attention.key_length_swa": 64,
            "attention.value_length_swa": 64,
            "rope.dimension_count": 128,
            "rope.dimension_count_swa": 64,
            "rope.freq_base": 1000000.0,
            "rope.freq_base_swa": 10000.0,
            "embedding_length_per_layer_input": 0,
            "final_logit_softcapping": 10.0,
        },
    ),
    # Gemma 4 26B-A4B's FFN on the dense shape's attention (V of its own here): every layer a
    # dense GELU GLU of 512 beside 8 routed experts of 256 (top 2): the router reads the residual
    # normed without a weight, scaled by 1/sqrt(dim) and `ffn_gate_inp.scale`; softmax scores,
    # renormalised, each expert's output scaled by `ffn_down_exps.scale`; pre_ffw_norm_2,
    # post_ffw_norm_1 and _2 around the two halves.
    "gemma4-moe": dict(
        arch="gemma4",
        heads=4,
        kv_heads=2,
        head_dim=64,
        layers=3,
        embd=(0.12, QT.Q8_0),
        output=(0.12, QT.Q8_0),
        gemma4=dict(swa=[True, False, True], full_hd=128, full_kv=1, k_eq_v=False, rot=16),
        moe=dict(n=8, used=2, hidden=256),
        meta={
            "attention.sliding_window_pattern": [True, False, True],
            "attention.sliding_window": 6,
            "attention.head_count_kv": [2, 1, 2],
            "attention.key_length": 128,
            "attention.value_length": 128,
            "attention.key_length_swa": 64,
            "attention.value_length_swa": 64,
            "rope.dimension_count": 128,
            "rope.dimension_count_swa": 64,
            "rope.freq_base": 1000000.0,
            "rope.freq_base_swa": 10000.0,
            "embedding_length_per_layer_input": 0,
            "expert_count": 8,
            "expert_used_count": 2,
            "expert_feed_forward_length": 256,
        },
    ),
    # Gemma 4 E-series (E2B/E4B): per-layer embeddings of 32 values a layer, the last 2 of 5
    # layers reading the K/V of the last earlier layer of their kind (their file has no attn_k or
    # attn_v), those two twice as wide in their FFN (`feed_forward_length` per layer).
    "gemma4-e": dict(
        arch="gemma4",
        heads=4,
        kv_heads=2,
        head_dim=64,
        layers=5,
        embd=(0.12, QT.Q8_0),
        output=(0.12, QT.Q8_0),
        gemma4=dict(swa=[True, True, False, True, False], full_hd=128, full_kv=1, k_eq_v=False, rot=16, ple=32, shared=2, hidden=[512, 512, 512, 1024, 1024]),
        meta={
            "attention.sliding_window_pattern": [True, True, False, True, False],
            "attention.sliding_window": 6,
            "attention.head_count_kv": [2, 2, 1, 2, 1],
            "attention.key_length": 128,
            "attention.value_length": 128,
            "attention.key_length_swa": 64,
            "attention.value_length_swa": 64,
            "rope.dimension_count": 128,
            "rope.dimension_count_swa": 64,
            "rope.freq_base": 1000000.0,
            "rope.freq_base_swa": 10000.0,
            "embedding_length_per_layer_input": 32,
            "attention.shared_kv_layers": 2,
            "feed_forward_length": [512, 512, 512, 1024, 1024],
            "final_logit_softcapping": 10.0,
        },
    ),
    # Qwen3.6-35B-A3B's layers: qwen35's hybrid (value heads tiled over key heads, separate beta
    # and alpha, interleaved multi-axis RoPE) with qwen3next's FFN: 8 routed experts (top 2,
    # renormalised) and a shared expert under a sigmoid gate. As for qwen3next, `seed` picks
    # weights where llama.cpp's own prefill and decode agree (0.100) and we agree with it (0.116);
    # `mtp_seed` draws the MTP head's weights apart, where no router near-tie parts its rows from
    # llama.cpp's (tests/golden/families/README.md).
    "qwen35moe": dict(
        arch="qwen35moe",
        seed=1,
        mtp_seed=3,
        heads=4,
        kv_heads=2,
        head_dim=64,
        layers=4,
        hybrid=dict(nk=2, nv=4, hd=64, conv=4, fused_ba=False),
        embd=(0.12, QT.Q8_0),
        moe=dict(n=8, used=2, hidden=256, shared=512, norm=True),
        meta={
            "rope.freq_base": 1000000.0,
            "rope.dimension_count": 16,
            "rope.dimension_sections": [3, 3, 2, 0],
            "full_attention_interval": 4,
            "ssm.conv_kernel": 4,
            "ssm.state_size": 64,
            "ssm.group_count": 2,
            "ssm.time_step_rank": 4,
            "ssm.inner_size": 256,
            "expert_count": 8,
            "expert_used_count": 2,
            "expert_feed_forward_length": 256,
            "expert_shared_feed_forward_length": 512,
        },
    ),
}

# Shapes no real family has that meet a device's limits; written by write_family like the
# families, but llama.cpp ran none of them (no goldens).
DEVICE_LIMIT_FAMILIES: dict[str, dict[str, Any]] = {
    # Heads of 384 values: past what the device's attention kernel takes (256), so a placed
    # model goes on the per-op rails.
    "qwen3-wide-heads": dict(arch="qwen3", heads=2, kv_heads=1, head_dim=384, qk_norm=True, embd=(0.12, QT.Q8_0), meta={"rope.freq_base": 1000000.0}),
}


def _recurrent(f: dict[str, Any], meta: dict[str, Any], i: int) -> bool:
    """Whether layer ``i`` of a hybrid family is a DeltaNet layer."""
    return "hybrid" in f and (i + 1) % meta.get("full_attention_interval", 4) != 0

# The block formats a family's matrices cycle through (each row length here is a multiple of 256).
FAMILY_FORMATS = [QT.Q8_0, QT.Q4_K, QT.F16, QT.Q6_K, QT.Q4_0, QT.Q5_K, QT.Q5_0, QT.Q4_1]


def _k_blocks(rows: int, cols: int, qt: QT, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks of about zero mean and the given spread (gguf cannot quantize to
    these): random quants, and scales and mins set so that the dequantized values centre on 0."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qt]
    nb = rows * (cols // block)
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    if qt == QT.Q6_K:
        # d * sc * (q - 32): q uniform on 0..63 is centred already; int8 scales in [-24, 24].
        raw[:, 192:208] = rng.integers(-24, 25, size=(nb, 16)).astype(np.int8).view(np.uint8)
        d = std / (14.0 * 18.5) * rng.uniform(0.8, 1.2, size=nb)
        raw[:, 208:210] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    else:
        # d * sc * q - dmin * m with every sub-block's sc = m = 8 (4-bit, so the 12 packed bytes
        # are 8, 8, 8, 8 | 8, 8, 8, 8 | 0x88 x4); dmin = d * mean(q) centres the values.
        qmax = 15 if qt == QT.Q4_K else 31
        d = std / (8.0 * qmax / np.sqrt(12.0)) * rng.uniform(0.8, 1.2, size=nb)
        raw[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
        raw[:, 2:4] = (d * qmax / 2).astype(np.float16).view(np.uint8).reshape(nb, 2)
        raw[:, 4:12] = 8
        raw[:, 12:16] = 0x88
    return raw.reshape(rows, -1)


IQ4 = {QT.IQ4_NL, QT.IQ4_XS}
# ggml's kvalues_iq4nl: the sixteen levels an IQ4 nibble picks.
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float64)


def _iq4_blocks(rows: int, cols: int, qt: QT, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random IQ4_NL / IQ4_XS blocks of about zero mean and the given spread (gguf cannot quantize
    to these): random nibbles, block scales of random sign (the levels lean negative), and for
    IQ4_XS 6-bit sub-block scales ls with ls - 32 in +-[4, 12]."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qt]
    nb = rows * (cols // block)
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    sign = rng.choice([-1.0, 1.0], size=nb)
    if qt == QT.IQ4_NL:
        d = sign * std / IQ4_LEVELS.std() * rng.uniform(0.8, 1.2, size=nb)
    else:
        ls = 32 + rng.choice([-1, 1], size=(nb, 8)) * rng.integers(4, 13, size=(nb, 8))
        raw[:, 2:4] = (ls >> 4 << (2 * np.arange(8))).sum(axis=1).astype(np.uint16).view(np.uint8).reshape(nb, 2)
        raw[:, 4:8] = (ls[:, 0::2] & 0xF) | ((ls[:, 1::2] & 0xF) << 4)
        d = sign * std / (IQ4_LEVELS.std() * np.abs(ls - 32).mean()) * rng.uniform(0.8, 1.2, size=nb)
    raw[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    return raw.reshape(rows, -1)


def write_family(
    path: Path,
    name: str,
    drop: str | None = None,
    meta: dict[str, Any] | None = None,
    replace: dict[str, np.ndarray] | None = None,
    extra: dict[str, np.ndarray] | None = None,
    mtp: bool | Path = False,
    legacy_qkvz: bool = False,
    fuse_gate_up: bool = False,
    specials: tuple[str, ...] = (),
    vocab: Callable[[GGUFWriter], None] | None = None,
) -> dict[str, np.ndarray]:
    """Write family ``name`` of ``FAMILIES`` deterministically (the same bytes on every call with
    the same gguf and numpy); return the exact weights (numpy order: rows x cols). ``drop`` leaves
    a tensor out, ``meta`` overrides ``<arch>.`` keys (None drops one), ``replace`` writes given
    values in place of a tensor and ``extra`` adds tensors (bad-input tests). ``legacy_qkvz``
    writes a hybrid's Q/K/V and gate as older qwen3next files did: one F32 ``ssm_in`` of the
    same values, grouped per key head (query, key, its value heads' values, their gates).
    ``fuse_gate_up`` (gemma4-moe and the hybrids with experts) writes each trunk layer's expert
    gates and ups as one F32 ``ffn_gate_up_exps`` of the same values (each expert's gate rows,
    then its up rows). ``specials`` adds control tokens after the vocabulary (an image's
    markers), with their embedding and output rows; ``vocab`` writes another tokenizer in place of
    the synthetic one (as many tokens as the embedding has rows, no ``specials``).

    ``mtp`` (hybrid families): True adds an MTP head after the trunk (block ``layers``: gated
    attention and the family's FFN, ``nextn.eh_proj``, ``enorm``, ``hnorm`` and
    ``shared_head_norm``; ``nextn_predict_layers`` 1, counted in ``block_count``), as llama.cpp's
    converter writes Qwen3.5; a path writes the same head to that sidecar file instead (its
    metadata the model's plus the MTP keys; ``meta``, ``drop`` and ``extra`` then apply to the
    sidecar) and leaves the model file as without ``mtp``."""
    f = FAMILIES[name] if name in FAMILIES else DEVICE_LIMIT_FAMILIES[name]
    arch, heads, kvh, hd = f["arch"], f["heads"], f["kv_heads"], f["head_dim"]
    layers = f.get("layers", LAYERS)
    qd, kvd = heads * hd, kvh * hd
    rng = np.random.default_rng(sum(map(ord, name)) + f.get("seed", 0))
    w = GGUFWriter(str(path), arch)
    keys: dict[str, Any] = {
        "block_count": layers,
        "context_length": 64,
        "embedding_length": DIM,
        "feed_forward_length": HIDDEN,
        "attention.head_count": heads,
        "attention.head_count_kv": kvh,
        "attention.key_length": hd,
        "attention.value_length": hd,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 10000.0,
    }
    keys.update(f.get("meta", {}))
    sidecar = isinstance(mtp, Path)
    mtp_keys = {"block_count": layers + 1, "nextn_predict_layers": 1}
    if mtp is True:
        keys.update(mtp_keys)
    side_keys = {**keys, **mtp_keys, **(meta or {})}
    if not sidecar:
        keys.update(meta or {})
    _add_keys(w, arch, keys)
    if vocab is not None:
        assert not specials, "a given vocabulary takes no extra control tokens"
        vocab(w)
    else:
        _write_vocab(w, specials)
    weights: dict[str, np.ndarray] = {}
    count = [0]
    out = [w]
    formats = f.get("formats", FAMILY_FORMATS)
    stack_formats = f.get("stack_formats", formats)

    held: set[str] = set()  # written another way (legacy_qkvz)

    def put(name: str, data: np.ndarray, kind: QT | None = None) -> None:
        if name == drop or name in held:
            return
        data = replace.get(name, data) if replace else data
        if kind is not None and data.dtype == np.uint8:
            out[0].add_tensor(name, data, raw_dtype=kind)
        else:
            out[0].add_tensor(name, data)

    def mat(name: str, rows: int, cols: int, scale: float = 0.08, kind: QT | None = None) -> None:
        if kind is None:
            kind = formats[count[0] % len(formats)]
            count[0] += 1
        if kind in K_QUANTS | IQ4:
            raw = (_k_blocks if kind in K_QUANTS else _iq4_blocks)(rows, cols, kind, scale, rng)
            data, exact = raw, dequantize(raw, kind).reshape(rows, cols).astype(np.float32)
        else:
            data, exact = encode_weight(rng.normal(0, scale, size=(rows, cols)), kind, rng)
        weights[name] = exact
        put(name, data, kind)

    def stack(name: str, n: int, rows: int, cols: int, scale: float = 0.08) -> None:
        # n experts' matrices as one 3-D tensor (GGUF shape [cols, rows, n]).
        kind = stack_formats[count[0] % len(stack_formats)]
        count[0] += 1
        if kind in K_QUANTS | IQ4:
            raw = (_k_blocks if kind in K_QUANTS else _iq4_blocks)(n * rows, cols, kind, scale, rng)
            data, exact = raw, dequantize(raw, kind).reshape(n * rows, cols).astype(np.float32)
        else:
            data, exact = encode_weight(rng.normal(0, scale, size=(n * rows, cols)), kind, rng)
        weights[name] = exact.reshape(n, rows, cols)
        put(name, data.reshape(n, rows, -1), kind)

    def vec(name: str, n: int, mean: float = 1.0, std: float = 0.1) -> None:
        v = (mean + rng.normal(0, std, size=n)).astype(np.float32)
        weights[name] = v
        put(name, v)

    embd_std, embd_type = f.get("embd", (0.5, QT.Q8_0))
    mat("token_embd.weight", len(VOCAB) + len(specials), DIM, embd_std, embd_type)
    def fuse(p: str) -> None:
        # The layer's expert gates and ups once more, as one F32 stack of the same values.
        if fuse_gate_up and p + "ffn_gate_exps.weight" in weights:
            put(p + "ffn_gate_up_exps.weight", np.concatenate([weights[p + "ffn_gate_exps.weight"], weights[p + "ffn_up_exps.weight"]], axis=1).astype(np.float32))

    for i in range(layers):
        p = f"blk.{i}."
        if fuse_gate_up:
            held.update({p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"})
        vec(p + "attn_norm.weight", DIM)
        if _recurrent(f, keys, i):
            hy = f["hybrid"]
            kd, vd = hy["nk"] * hy["hd"], hy["nv"] * hy["hd"]
            if legacy_qkvz:
                held.update({p + "attn_qkv.weight", p + "attn_gate.weight"})
            mat(p + "attn_qkv.weight", 2 * kd + vd, DIM)
            mat(p + "attn_gate.weight", vd, DIM)
            if legacy_qkvz:
                qkv, z = weights[p + "attn_qkv.weight"], weights[p + "attn_gate.weight"]
                hd, nk, gv = hy["hd"], hy["nk"], vd // hy["nk"]
                groups = [[qkv[g * hd : (g + 1) * hd], qkv[kd + g * hd : kd + (g + 1) * hd], qkv[2 * kd + g * gv : 2 * kd + (g + 1) * gv], z[g * gv : (g + 1) * gv]] for g in range(nk)]
                put(p + "ssm_in.weight", np.concatenate([m for grp in groups for m in grp]).astype(np.float32))
            if hy["fused_ba"]:
                mat(p + "ssm_ba.weight", 2 * hy["nv"], DIM, 0.08, QT.F32)
            else:
                mat(p + "ssm_beta.weight", hy["nv"], DIM, 0.08, QT.F32)
                mat(p + "ssm_alpha.weight", hy["nv"], DIM, 0.08, QT.F32)
            mat(p + "ssm_conv1d.weight", 2 * kd + vd, hy["conv"], 0.4, QT.F32)
            vec(p + "ssm_dt.bias", hy["nv"], 0.0, 0.5)
            a = (-rng.uniform(0.1, 1.0, size=hy["nv"])).astype(np.float32)
            weights[p + "ssm_a"] = a
            put(p + "ssm_a", a)
            vec(p + "ssm_norm.weight", hy["hd"])
            mat(p + "ssm_out.weight", DIM, vd)
            vec(p + "post_attention_norm.weight", DIM)
            _ffn(f, p, mat, stack, vec)
            fuse(p)
            continue
        if "glm" in f:
            _glm_block(f, p, i >= f["glm"]["lead"], mat, stack, vec, qd, kvd, hd)
            continue
        if "gemma4" in f:
            _gemma4_block(f, i, mat, stack, vec, put, weights)
            fuse(p)
            continue
        if "oai" in f:
            _oai_block(f, p, mat, stack, vec, heads, qd, kvd, rng, weights, put)
            continue
        if "hybrid" in f:
            # Gated attention: each head's queries, then its gate, in the Q projection.
            mat(p + "attn_q.weight", 2 * qd, DIM)
            mat(p + "attn_k.weight", kvd, DIM)
            mat(p + "attn_v.weight", kvd, DIM)
            vec(p + "attn_q_norm.weight", hd)
            vec(p + "attn_k_norm.weight", hd)
            mat(p + "attn_output.weight", DIM, qd)
            vec(p + "post_attention_norm.weight", DIM)
            _ffn(f, p, mat, stack, vec)
            fuse(p)
            continue
        if f.get("fused"):
            mat(p + "attn_qkv.weight", qd + 2 * kvd, DIM)
        else:
            mat(p + "attn_q.weight", qd, DIM)
            mat(p + "attn_k.weight", kvd, DIM)
            mat(p + "attn_v.weight", kvd, DIM)
        if f.get("bias"):
            vec(p + "attn_q.bias", qd, 0.0, 0.2)
            vec(p + "attn_k.bias", kvd, 0.0, 1.0)
            vec(p + "attn_v.bias", kvd, 0.0, 0.2)
        if f.get("qk_norm"):
            vec(p + "attn_q_norm.weight", hd)
            vec(p + "attn_k_norm.weight", hd)
        mat(p + "attn_output.weight", DIM, qd)
        if f.get("post_norms"):
            vec(p + "post_attention_norm.weight", DIM, f["post_norms"])
        vec(p + "ffn_norm.weight", DIM)
        if "moe" in f:
            e = f["moe"]
            mat(p + "ffn_gate_inp.weight", e["n"], DIM, 0.1, QT.F32)
            stack(p + "ffn_gate_exps.weight", e["n"], e["hidden"], DIM)
            stack(p + "ffn_up_exps.weight", e["n"], e["hidden"], DIM)
            stack(p + "ffn_down_exps.weight", e["n"], DIM, e["hidden"])
            if "shared" in e:
                vec(p + "ffn_gate_inp_shexp.weight", DIM, 0.0, 0.1)
                mat(p + "ffn_gate_shexp.weight", e["shared"], DIM)
                mat(p + "ffn_up_shexp.weight", e["shared"], DIM)
                mat(p + "ffn_down_shexp.weight", DIM, e["shared"])
        elif f.get("fused"):
            mat(p + "ffn_up.weight", 2 * HIDDEN, DIM)
            mat(p + "ffn_down.weight", DIM, HIDDEN)
        else:
            mat(p + "ffn_gate.weight", HIDDEN, DIM)
            mat(p + "ffn_up.weight", HIDDEN, DIM)
            mat(p + "ffn_down.weight", DIM, HIDDEN)
        if f.get("post_norms"):
            vec(p + "post_ffw_norm.weight", DIM, f["post_norms"])
    if f.get("factors"):
        n = keys.get("rope.dimension_count", hd) // 2
        long = (1.0 + np.linspace(0.0, 3.0, n)).astype(np.float32)
        short = (1.0 + np.linspace(0.0, 0.4, n)).astype(np.float32)
        weights["rope_factors_long.weight"], weights["rope_factors_short.weight"] = long, short
        put("rope_factors_long.weight", long)
        put("rope_factors_short.weight", short)
    if "gemma4" in f:
        _gemma4_globals(f, layers, mat, vec, put, weights, len(VOCAB) + len(specials))
    vec("output_norm.weight", DIM)
    if f.get("output"):
        mat("output.weight", len(VOCAB) + len(specials), DIM, *f["output"])
    if f.get("glm", {}).get("nextn"):
        p = f"blk.{layers}."
        vec(p + "attn_norm.weight", DIM)
        _glm_block(f, p, True, mat, stack, vec, qd, kvd, hd)
        mat(p + "nextn.eh_proj.weight", DIM, 2 * DIM)
        vec(p + "nextn.enorm.weight", DIM)
        vec(p + "nextn.hnorm.weight", DIM)
        vec(p + "nextn.shared_head_norm.weight", DIM)
    if mtp is not False:
        if "mtp_seed" in f:
            # The head's weights from a stream of their own (the trunk's stay as they are).
            rng = np.random.default_rng(f["mtp_seed"])
        if sidecar:
            sw = GGUFWriter(str(mtp), arch)
            _add_keys(sw, arch, side_keys)
            _write_vocab(sw)
            out[0] = sw
        p = f"blk.{layers}."
        vec(p + "attn_norm.weight", DIM)
        mat(p + "attn_q.weight", 2 * qd, DIM)
        mat(p + "attn_k.weight", kvd, DIM)
        mat(p + "attn_v.weight", kvd, DIM)
        vec(p + "attn_q_norm.weight", hd)
        vec(p + "attn_k_norm.weight", hd)
        mat(p + "attn_output.weight", DIM, qd)
        vec(p + "post_attention_norm.weight", DIM)
        _ffn(f, p, mat, stack, vec)
        mat(p + "nextn.eh_proj.weight", DIM, 2 * DIM)
        vec(p + "nextn.enorm.weight", DIM)
        vec(p + "nextn.hnorm.weight", DIM)
        vec(p + "nextn.shared_head_norm.weight", DIM)
    for tname, t in (extra or {}).items():
        out[0].add_tensor(tname, t)
    for wr in {id(x): x for x in (w, out[0])}.values():
        wr.write_header_to_file()
        wr.write_kv_data_to_file()
        wr.write_tensors_to_file()
        wr.close()
    return weights


def _gemma4_heads(f: dict[str, Any], i: int) -> tuple[int, int, int]:
    """Layer ``i`` of a gemma4 family: (query heads, K/V heads, head size)."""
    g = f["gemma4"]
    return (f["heads"], f["kv_heads"], f["head_dim"]) if g["swa"][i] else (f["heads"], g["full_kv"], g["full_hd"])


def _gemma4_block(f: dict[str, Any], i: int, mat: Any, stack: Any, vec: Any, put: Any, weights: dict[str, np.ndarray]) -> None:
    """A gemma4 block after its `attn_norm`: attention (no K/V where the layer reads an earlier
    one's, no V on a full layer of a k_eq_v family), Q/K norms, sandwich norms, the FFN (a GELU GLU,
    beside routed experts where the family has them), per-layer embedding weights, the output scale."""
    g, p = f["gemma4"], f"blk.{i}."
    heads, kvh, hd = _gemma4_heads(f, i)
    own_kv = i < f.get("layers", LAYERS) - g.get("shared", 0)
    mat(p + "attn_q.weight", heads * hd, DIM)
    if own_kv:
        mat(p + "attn_k.weight", kvh * hd, DIM)
        if not (g["k_eq_v"] and not g["swa"][i]):
            mat(p + "attn_v.weight", kvh * hd, DIM)
    vec(p + "attn_q_norm.weight", hd, 0.5, 0.1)
    if own_kv:
        vec(p + "attn_k_norm.weight", hd, 0.5, 0.1)
    mat(p + "attn_output.weight", DIM, heads * hd)
    vec(p + "post_attention_norm.weight", DIM)
    vec(p + "ffn_norm.weight", DIM)
    hidden = g.get("hidden", [HIDDEN] * f.get("layers", LAYERS))[i]
    mat(p + "ffn_gate.weight", hidden, DIM)
    mat(p + "ffn_up.weight", hidden, DIM)
    mat(p + "ffn_down.weight", DIM, hidden)
    if "moe" in f:
        e = f["moe"]
        mat(p + "ffn_gate_inp.weight", e["n"], DIM, 0.5, QT.F32)
        vec(p + "ffn_gate_inp.scale", DIM, 1.0, 0.3)
        vec(p + "pre_ffw_norm_2.weight", DIM)
        vec(p + "post_ffw_norm_1.weight", DIM)
        vec(p + "post_ffw_norm_2.weight", DIM)
        stack(p + "ffn_gate_exps.weight", e["n"], e["hidden"], DIM)
        stack(p + "ffn_up_exps.weight", e["n"], e["hidden"], DIM)
        stack(p + "ffn_down_exps.weight", e["n"], DIM, e["hidden"])
        vec(p + "ffn_down_exps.scale", e["n"], 1.0, 0.3)
    vec(p + "post_ffw_norm.weight", DIM)
    if g.get("ple"):
        mat(p + "inp_gate.weight", g["ple"], DIM, 0.08, QT.Q8_0)
        mat(p + "proj.weight", DIM, g["ple"], 0.08, QT.F16)
        vec(p + "post_norm.weight", DIM)
    vec(p + "layer_output_scale.weight", 1, 0.8, 0.1)


def _gemma4_globals(f: dict[str, Any], layers: int, mat: Any, vec: Any, put: Any, weights: dict[str, np.ndarray], n_vocab: int) -> None:
    """gemma4's tensors outside the blocks: the full layers' p-RoPE factors (1 on the pairs that
    turn, 1e30 on the rest, as the converter writes them) and the per-layer embeddings."""
    g = f["gemma4"]
    pairs = g["full_hd"] // 2
    factors = np.array([1.0] * g["rot"] + [1e30] * (pairs - g["rot"]), np.float32)
    weights["rope_freqs.weight"] = factors
    put("rope_freqs.weight", factors)
    if g.get("ple"):
        mat("per_layer_token_embd.weight", n_vocab, layers * g["ple"], 0.5, QT.F16)
        mat("per_layer_model_proj.weight", layers * g["ple"], DIM, 0.08, QT.Q8_0)
        vec("per_layer_proj_norm.weight", g["ple"])


def _gelu(g: np.ndarray) -> np.ndarray:
    return 0.5 * g * (1 + np.tanh(0.7978845608 * (g + 0.044715 * g**3)))


def _gemma4_logits(
    W: dict[str, np.ndarray],
    f: dict[str, Any],
    meta: dict[str, Any],
    ids: list[int],
    embeds: dict[int, np.ndarray] | None = None,
    spans: tuple[tuple[int, int], ...] = (),
    every_layer: bool = False,
) -> np.ndarray:
    """Float64 forward pass of a gemma4 family, as llama.cpp's gemma4 graph computes it (rows
    given and non-causal spans as ``family_reference_logits`` says)."""
    g, eps, T = f["gemma4"], meta["attention.layer_norm_rms_epsilon"], len(ids)
    L = f.get("layers", LAYERS)
    first_shared = L - g.get("shared", 0)

    def rope(x: np.ndarray, pos: int, swa: bool) -> np.ndarray:
        rd = meta["rope.dimension_count_swa"] if swa else meta["rope.dimension_count"]
        base = meta["rope.freq_base_swa"] if swa else meta["rope.freq_base"]
        theta = pos * base ** (-np.arange(0, rd, 2) / rd)
        if not swa:
            theta = theta / W["rope_freqs.weight"][: rd // 2]
        c, s = np.cos(theta), np.sin(theta)
        out = x.copy()
        a, b = x[..., : rd // 2], x[..., rd // 2 : rd]
        out[..., : rd // 2], out[..., rd // 2 : rd] = a * c - b * s, a * s + b * c
        return out

    x = W["token_embd.weight"][ids] * np.sqrt(DIM)
    for r, val in (embeds or {}).items():
        x[r] = val
    # Where each row's keys end in a sliding layer: its own position, or its span's end.
    ends = np.arange(1, T + 1)
    for first, n in spans:
        ends[first : first + n] = first + n
    if g.get("ple"):
        np_ = g["ple"]
        # A given row's per-layer token input is the padding token's (0), as llama.cpp's.
        ple_ids = [0 if t in (embeds or {}) else i for t, i in enumerate(ids)]
        tok = W["per_layer_token_embd.weight"][ple_ids].reshape(T, L, np_) * np.sqrt(np_)
        proj = (x @ W["per_layer_model_proj.weight"].T / np.sqrt(DIM)).reshape(T, L, np_)
        ple = (_rms(proj, W["per_layer_proj_norm.weight"], eps) + tok) / np.sqrt(2)
    kv: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for i in range(L):
        p, swa = f"blk.{i}.", g["swa"][i]
        H, KVH, HD = _gemma4_heads(f, i)
        h = _rms(x, W[p + "attn_norm.weight"], eps)
        q = _rms((h @ W[p + "attn_q.weight"].T).reshape(T, H, HD), W[p + "attn_q_norm.weight"], eps)
        q = np.stack([rope(q[t], t, swa) for t in range(T)])
        if i < first_shared:
            kraw = (h @ W[p + "attn_k.weight"].T).reshape(T, KVH, HD)
            vraw = (h @ W[p + "attn_v.weight"].T).reshape(T, KVH, HD) if p + "attn_v.weight" in W else kraw
            k = np.stack([rope(kk, t, swa) for t, kk in enumerate(_rms(kraw, W[p + "attn_k_norm.weight"], eps))])
            kv[i] = (k, _rms(vraw, 1.0, eps))
            k, v = kv[i]
        else:
            k, v = kv[first_shared - (2 if swa else 1)]
        window = meta["attention.sliding_window"] if swa else 0
        att = np.zeros((T, H, HD))
        for t in range(T):
            lo = max(0, t - window + 1) if window else 0
            hi = ends[t] if swa or every_layer else t + 1
            for hh in range(H):
                sc = k[lo:hi, hh // (H // KVH)] @ q[t, hh]
                pr = np.exp(sc - sc.max())
                att[t, hh] = (pr / pr.sum()) @ v[lo:hi, hh // (H // KVH)]
        x = x + _rms(att.reshape(T, -1) @ W[p + "attn_output.weight"].T, W[p + "post_attention_norm.weight"], eps)
        hf = _rms(x, W[p + "ffn_norm.weight"], eps)
        d = (_gelu(hf @ W[p + "ffn_gate.weight"].T) * (hf @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
        if "moe" in f:
            e = f["moe"]
            d = _rms(d, W[p + "post_ffw_norm_1.weight"], eps)
            logits = (_rms(x, 1.0, eps) / np.sqrt(DIM) * W[p + "ffn_gate_inp.scale"]) @ W[p + "ffn_gate_inp.weight"].T
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            hm = _rms(x, W[p + "pre_ffw_norm_2.weight"], eps)
            routed = np.zeros_like(x)
            for t in range(T):
                top = np.argsort(-probs[t], kind="stable")[: e["used"]]
                _note_gap(t, probs[t], e["used"])
                for xx, wx in zip(top, probs[t, top] / probs[t, top].sum(), strict=True):
                    gx = _gelu(hm[t] @ W[p + "ffn_gate_exps.weight"][xx].T) * (hm[t] @ W[p + "ffn_up_exps.weight"][xx].T)
                    routed[t] += wx * W[p + "ffn_down_exps.scale"][xx] * (gx @ W[p + "ffn_down_exps.weight"][xx].T)
            d = d + _rms(routed, W[p + "post_ffw_norm_2.weight"], eps)
        x = x + _rms(d, W[p + "post_ffw_norm.weight"], eps)
        if g.get("ple"):
            gate = _gelu(x @ W[p + "inp_gate.weight"].T) * ple[:, i]
            x = x + _rms(gate @ W[p + "proj.weight"].T, W[p + "post_norm.weight"], eps)
        x = x * W[p + "layer_output_scale.weight"][0]
    out = _rms(x, W["output_norm.weight"], eps) @ W.get("output.weight", W["token_embd.weight"]).T
    cap = meta.get("final_logit_softcapping")
    return cap * np.tanh(out / cap) if cap else out


def _glm_block(f: dict[str, Any], p: str, routed: bool, mat: Any, stack: Any, vec: Any, qd: int, kvd: int, hd: int) -> None:
    """A glm4moe block: biased Q/K/V, QK-norm where the family has it, the FFN under
    post_attention_norm: a dense SwiGLU, or routed experts with a selection bias and an
    ungated shared expert (after `attn_norm`, which the caller writes)."""
    mat(p + "attn_q.weight", qd, DIM)
    mat(p + "attn_k.weight", kvd, DIM)
    mat(p + "attn_v.weight", kvd, DIM)
    vec(p + "attn_q.bias", qd, 0.0, 0.2)
    vec(p + "attn_k.bias", kvd, 0.0, 1.0)
    vec(p + "attn_v.bias", kvd, 0.0, 0.2)
    if f.get("qk_norm"):
        vec(p + "attn_q_norm.weight", hd)
        vec(p + "attn_k_norm.weight", hd)
    mat(p + "attn_output.weight", DIM, qd)
    vec(p + "post_attention_norm.weight", DIM)
    if not routed:
        mat(p + "ffn_gate.weight", HIDDEN, DIM)
        mat(p + "ffn_up.weight", HIDDEN, DIM)
        mat(p + "ffn_down.weight", DIM, HIDDEN)
        return
    e = f["moe"]
    mat(p + "ffn_gate_inp.weight", e["n"], DIM, 0.1, QT.F32)
    vec(p + "exp_probs_b.bias", e["n"], 0.0, e["bias"])
    stack(p + "ffn_gate_exps.weight", e["n"], e["hidden"], DIM)
    stack(p + "ffn_up_exps.weight", e["n"], e["hidden"], DIM)
    stack(p + "ffn_down_exps.weight", e["n"], DIM, e["hidden"])
    mat(p + "ffn_gate_shexp.weight", e["shared"], DIM)
    mat(p + "ffn_up_shexp.weight", e["shared"], DIM)
    mat(p + "ffn_down_shexp.weight", DIM, e["shared"])


def _oai_block(f: dict[str, Any], p: str, mat: Any, stack: Any, vec: Any, heads: int, qd: int, kvd: int, rng: np.random.Generator, weights: dict[str, np.ndarray], put: Any) -> None:
    """A gpt-oss block (after `attn_norm`, which the caller writes): biased Q/K/V and output,
    the heads' sinks, the FFN under post_attention_norm: a biased router and biased experts
    (their biases 2-D, [width, n] in GGUF order, as llama.cpp requires)."""
    mat(p + "attn_q.weight", qd, DIM)
    mat(p + "attn_k.weight", kvd, DIM)
    mat(p + "attn_v.weight", kvd, DIM)
    vec(p + "attn_q.bias", qd, 0.0, 0.2)
    vec(p + "attn_k.bias", kvd, 0.0, 0.5)
    vec(p + "attn_v.bias", kvd, 0.0, 0.2)
    mat(p + "attn_output.weight", DIM, qd)
    vec(p + "attn_output.bias", DIM, 0.0, 0.1)
    vec(p + "attn_sinks.weight", heads, *f["oai"]["sinks"])
    vec(p + "post_attention_norm.weight", DIM)
    e = f["moe"]
    mat(p + "ffn_gate_inp.weight", e["n"], DIM, 0.1, QT.F32)
    vec(p + "ffn_gate_inp.bias", e["n"], 0.0, 0.3)
    stack(p + "ffn_gate_exps.weight", e["n"], e["hidden"], DIM, e["gate_up"])
    stack(p + "ffn_up_exps.weight", e["n"], e["hidden"], DIM, e["gate_up"])
    stack(p + "ffn_down_exps.weight", e["n"], DIM, e["hidden"])
    for t, width, std in (("ffn_gate_exps", e["hidden"], 0.5), ("ffn_up_exps", e["hidden"], 0.5), ("ffn_down_exps", DIM, 0.05)):
        b = rng.normal(0, std, size=(e["n"], width)).astype(np.float32)
        weights[p + t + ".bias"] = b
        put(p + t + ".bias", b)


def _ffn(f: dict[str, Any], p: str, mat: Any, stack: Any, vec: Any) -> None:
    """A hybrid layer's FFN: dense SwiGLU, or routed experts and a shared one."""
    if "moe" in f:
        e = f["moe"]
        mat(p + "ffn_gate_inp.weight", e["n"], DIM, e.get("router", 0.1), QT.F32)
        stack(p + "ffn_gate_exps.weight", e["n"], e["hidden"], DIM)
        stack(p + "ffn_up_exps.weight", e["n"], e["hidden"], DIM)
        stack(p + "ffn_down_exps.weight", e["n"], DIM, e["hidden"])
        vec(p + "ffn_gate_inp_shexp.weight", DIM, 0.0, 0.1)
        mat(p + "ffn_gate_shexp.weight", e["shared"], DIM)
        mat(p + "ffn_up_shexp.weight", e["shared"], DIM)
        mat(p + "ffn_down_shexp.weight", DIM, e["shared"])
    else:
        mat(p + "ffn_gate.weight", HIDDEN, DIM)
        mat(p + "ffn_up.weight", HIDDEN, DIM)
        mat(p + "ffn_down.weight", DIM, HIDDEN)


def family_cases(name: str) -> list[list[int]]:
    """The token sequences the goldens follow (teacher-forced): a BOS, then random ids."""
    rng = np.random.default_rng(sum(map(ord, name)) + 1)
    return [[1] + [int(t) for t in rng.integers(3, len(VOCAB), size=23)] for _ in range(3)]


def _swiglu(h: np.ndarray, wg: np.ndarray, wu: np.ndarray, wd: np.ndarray) -> np.ndarray:
    g = h @ wg.T
    return (g / (1 + np.exp(-g)) * (h @ wu.T)) @ wd.T


def _moe(W: dict[str, np.ndarray], p: str, e: dict[str, int], h: np.ndarray) -> np.ndarray:
    logits = h @ W[p + "ffn_gate_inp.weight"].T
    if e.get("sigmoid"):  # glm4moe: sigmoid scores, chosen with a bias that does not weight them
        probs = 1 / (1 + np.exp(-logits))
        sel = probs + W[p + "exp_probs_b.bias"]
    else:
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        sel = probs
    out = np.zeros_like(h)
    for t in range(len(h)):
        top = np.argsort(-sel[t], kind="stable")[: e["used"]]
        _note_gap(t, sel[t], e["used"])
        w = probs[t, top]
        if "shared" not in e or e.get("norm"):  # qwen3moe, qwen3next renormalise; qwen2moe takes them as they come
            w = w / w.sum()
        w = w * e.get("scale", 1.0)
        for x, wx in zip(top, w, strict=True):
            out[t] += wx * _swiglu(h[t], W[p + "ffn_gate_exps.weight"][x], W[p + "ffn_up_exps.weight"][x], W[p + "ffn_down_exps.weight"][x])
    if "shared" in e:
        gated = p + "ffn_gate_inp_shexp.weight" in W
        gate = 1 / (1 + np.exp(-(h @ W[p + "ffn_gate_inp_shexp.weight"]))) if gated else np.ones(len(h))
        out += gate[:, None] * _swiglu(h, W[p + "ffn_gate_shexp.weight"], W[p + "ffn_up_shexp.weight"], W[p + "ffn_down_shexp.weight"])
    return out


# Each row's smallest gap, over the routed layers of the last reference pass, between the
# selection score of the last expert chosen and of the best one left out (empty after a model
# with no router): where it is small, a near-tie that another summation order may break.
ROUTING_GAPS: list[float] = []


def _note_gap(t: int, sel: np.ndarray, used: int) -> None:
    s = np.sort(sel)[::-1]
    ROUTING_GAPS.extend([np.inf] * (t + 1 - len(ROUTING_GAPS)))
    ROUTING_GAPS[t] = min(ROUTING_GAPS[t], float(s[used - 1] - s[used]))


def family_reference_logits(
    wt: dict[str, np.ndarray],
    name: str,
    ids: list[int],
    meta_over: dict[str, Any] | None = None,
    embeds: dict[int, np.ndarray] | None = None,
    spans: tuple[tuple[int, int], ...] = (),
    every_layer: bool = False,
) -> np.ndarray:
    """Float64 forward pass of ``write_family(name)``'s weights; logits after each position.
    ``meta_over``: the keys ``write_family`` was given as ``meta``. Leaves each row's router
    margin in ``ROUTING_GAPS``. gemma4 families only: ``embeds`` gives rows' inputs instead of
    their tokens' (unscaled), and the rows of each (first, count) of ``spans`` see each other in
    the sliding layers (within the window), the full layers staying causal (llama.cpp's
    LLAMA_NON_CAUSAL_TYPE_SWA_ONLY; ``every_layer``: in the full layers too, as llama.cpp's other
    models)."""
    ROUTING_GAPS.clear()
    f = FAMILIES[name] if name in FAMILIES else DEVICE_LIMIT_FAMILIES[name]
    meta: dict[str, Any] = {"attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 10000.0, "context_length": 64, **f.get("meta", {}), **(meta_over or {})}
    if "gemma4" in f:
        return _gemma4_logits({k: v.astype(np.float64) for k, v in wt.items()}, f, meta, ids, embeds, spans, every_layer)
    if embeds or spans:
        raise ValueError(f"family_reference_logits takes embeds and spans for gemma4 families only, not {name}")
    arch, H, KVH, HD = f["arch"], f["heads"], f["kv_heads"], f["head_dim"]
    qd, kvd = H * HD, KVH * HD
    eps = meta["attention.layer_norm_rms_epsilon"]
    rd = meta.get("rope.dimension_count", HD)
    gemma = arch == "gemma2"
    W = {k: v.astype(np.float64) for k, v in wt.items()}
    factors, mscale = None, meta.get("rope.scaling.attn_factor", 1.0)
    if f.get("factors"):
        long = meta["context_length"] > meta["rope.scaling.original_context_length"]
        factors = W["rope_factors_long.weight" if long else "rope_factors_short.weight"]

    neox = arch != "mistral3"
    # A text token's M-RoPE pairs on the fourth axis see position 0 (ggml's layout).
    still = _mrope_fourth_axis(meta["rope.dimension_sections"], rd // 2, arch != "qwen2vl") if "rope.dimension_sections" in meta else np.zeros(rd // 2, bool)
    yarn = _yarn(meta, rd) if meta.get("rope.scaling.type") == "yarn" else None
    if yarn:
        mscale = yarn[2]

    def rope(x: np.ndarray, pos: int) -> np.ndarray:
        theta = np.where(still, 0.0, pos * meta["rope.freq_base"] ** (-np.arange(0, rd, 2) / rd))
        if factors is not None:
            theta = theta / factors
        if yarn:
            low, high, _ = yarn
            mix = 1 - np.clip((np.arange(rd // 2) - low) / max(0.001, high - low), 0, 1)
            theta = theta / meta["rope.scaling.factor"] * (1 - mix) + theta * mix
        c, s = np.cos(theta) * mscale, np.sin(theta) * mscale
        out = x.copy()
        if neox:
            a, b = x[..., : rd // 2], x[..., rd // 2 : rd]
            out[..., : rd // 2], out[..., rd // 2 : rd] = a * c - b * s, a * s + b * c
        else:
            a, b = x[..., 0:rd:2], x[..., 1:rd:2]
            out[..., 0:rd:2], out[..., 1:rd:2] = a * c - b * s, a * s + b * c
        return out

    x = W["token_embd.weight"][ids] * (np.sqrt(DIM) if gemma else 1.0)
    T = len(ids)
    for i in range(f.get("layers", LAYERS)):
        p = f"blk.{i}."
        h = _rms(x, W[p + "attn_norm.weight"], eps)
        if "glm" in f:
            x = x + _glm_attention(W, p, H, KVH, HD, h, rope, eps, f.get("qk_norm", False))
            h = _rms(x, W[p + "post_attention_norm.weight"], eps)
            x = x + (_moe(W, p, f["moe"], h) if i >= f["glm"]["lead"] else _swiglu(h, W[p + "ffn_gate.weight"], W[p + "ffn_up.weight"], W[p + "ffn_down.weight"]))
            continue
        if "oai" in f:
            window = meta["attention.sliding_window"] if i % 2 == 0 else 0
            x = x + _oai_attention(W, p, H, KVH, HD, h, rope, window)
            h = _rms(x, W[p + "post_attention_norm.weight"], eps)
            x = x + _oai_moe(W, p, f["moe"], h)
            continue
        if "hybrid" in f:
            x = x + (_deltanet(W, p, f["hybrid"], h, eps) if _recurrent(f, meta, i) else _gated_attention(W, p, H, KVH, HD, h, rope, eps))
            h = _rms(x, W[p + "post_attention_norm.weight"], eps)
            x = x + (_moe(W, p, f["moe"], h) if "moe" in f else _swiglu(h, W[p + "ffn_gate.weight"], W[p + "ffn_up.weight"], W[p + "ffn_down.weight"]))
            continue
        if f.get("fused"):
            wq, wk, wv = np.split(W[p + "attn_qkv.weight"], [qd, qd + kvd])
        else:
            wq, wk, wv = W[p + "attn_q.weight"], W[p + "attn_k.weight"], W[p + "attn_v.weight"]
        q, k, v = h @ wq.T, h @ wk.T, h @ wv.T
        if f.get("bias"):
            q, k, v = q + W[p + "attn_q.bias"], k + W[p + "attn_k.bias"], v + W[p + "attn_v.bias"]
        q, k, v = q.reshape(T, H, HD), k.reshape(T, KVH, HD), v.reshape(T, KVH, HD)
        if f.get("qk_norm"):
            q, k = _rms(q, W[p + "attn_q_norm.weight"], eps), _rms(k, W[p + "attn_k_norm.weight"], eps)
        q = np.stack([rope(q[t], t) for t in range(T)])
        k = np.stack([rope(k[t], t) for t in range(T)])
        if "attention.temperature_scale" in meta:
            floor = meta["rope.scaling.original_context_length"]
            q = q * (1 + meta["attention.temperature_scale"] * np.log(np.arange(T) // floor + 1))[:, None, None]
        window = meta["attention.sliding_window"] if gemma and i % 2 == 0 else 0
        att = np.zeros((T, H, HD))
        for t in range(T):
            lo = max(0, t - window + 1) if window else 0
            for hh in range(H):
                kv = hh // (H // KVH)
                sc = k[lo : t + 1, kv] @ q[t, hh] / np.sqrt(HD)
                if gemma:
                    cap = meta["attn_logit_softcapping"]
                    sc = cap * np.tanh(sc / cap)
                pr = np.exp(sc - sc.max())
                att[t, hh] = (pr / pr.sum()) @ v[lo : t + 1, kv]
        o = att.reshape(T, -1) @ W[p + "attn_output.weight"].T
        if f.get("post_norms"):
            o = _rms(o, W[p + "post_attention_norm.weight"], eps)
        x = x + o
        h = _rms(x, W[p + "ffn_norm.weight"], eps)
        if "moe" in f:
            d = _moe(W, p, f["moe"], h)
        else:
            if f.get("fused"):
                g, u = np.split(h @ W[p + "ffn_up.weight"].T, 2, axis=-1)
            else:
                g, u = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
            a = 0.5 * g * (1 + np.tanh(0.7978845608 * (g + 0.044715 * g**3))) if gemma else g / (1 + np.exp(-g))
            d = (a * u) @ W[p + "ffn_down.weight"].T
        if f.get("post_norms"):
            d = _rms(d, W[p + "post_ffw_norm.weight"], eps)
        x = x + d
    out = _rms(x, W["output_norm.weight"], eps) @ W.get("output.weight", W["token_embd.weight"]).T
    if gemma:
        cap = meta["final_logit_softcapping"]
        out = cap * np.tanh(out / cap)
    return out


def _glm_attention(W: dict[str, np.ndarray], p: str, H: int, KVH: int, HD: int, h: np.ndarray, rope: Any, eps: float, qk_norm: bool) -> np.ndarray:
    """Causal attention with Q/K/V biases and QK-norm where the file has it."""
    T = len(h)
    q = (h @ W[p + "attn_q.weight"].T + W[p + "attn_q.bias"]).reshape(T, H, HD)
    k = (h @ W[p + "attn_k.weight"].T + W[p + "attn_k.bias"]).reshape(T, KVH, HD)
    v = (h @ W[p + "attn_v.weight"].T + W[p + "attn_v.bias"]).reshape(T, KVH, HD)
    if qk_norm:
        q, k = _rms(q, W[p + "attn_q_norm.weight"], eps), _rms(k, W[p + "attn_k_norm.weight"], eps)
    q = np.stack([rope(q[t], t) for t in range(T)])
    k = np.stack([rope(k[t], t) for t in range(T)])
    att = np.zeros((T, H, HD))
    for t in range(T):
        for hh in range(H):
            kv = hh // (H // KVH)
            sc = k[: t + 1, kv] @ q[t, hh] / np.sqrt(HD)
            pr = np.exp(sc - sc.max())
            att[t, hh] = (pr / pr.sum()) @ v[: t + 1, kv]
    return att.reshape(T, -1) @ W[p + "attn_output.weight"].T


def _oai_attention(W: dict[str, np.ndarray], p: str, H: int, KVH: int, HD: int, h: np.ndarray, rope: Any, window: int) -> np.ndarray:
    """gpt-oss's attention: biased Q/K/V and output, a window where given, and each head's
    sink logit in its softmax's normalizer (weight on nothing)."""
    T = len(h)
    q = (h @ W[p + "attn_q.weight"].T + W[p + "attn_q.bias"]).reshape(T, H, HD)
    k = (h @ W[p + "attn_k.weight"].T + W[p + "attn_k.bias"]).reshape(T, KVH, HD)
    v = (h @ W[p + "attn_v.weight"].T + W[p + "attn_v.bias"]).reshape(T, KVH, HD)
    q = np.stack([rope(q[t], t) for t in range(T)])
    k = np.stack([rope(k[t], t) for t in range(T)])
    sinks = W[p + "attn_sinks.weight"]
    att = np.zeros((T, H, HD))
    for t in range(T):
        lo = max(0, t - window + 1) if window else 0
        for hh in range(H):
            kv = hh // (H // KVH)
            sc = k[lo : t + 1, kv] @ q[t, hh] / np.sqrt(HD)
            m = max(sc.max(), sinks[hh])
            pr = np.exp(sc - m)
            att[t, hh] = (pr / (pr.sum() + np.exp(sinks[hh] - m))) @ v[lo : t + 1, kv]
    return att.reshape(T, -1) @ W[p + "attn_output.weight"].T + W[p + "attn_output.bias"]


def _oai_moe(W: dict[str, np.ndarray], p: str, e: dict[str, Any], h: np.ndarray) -> np.ndarray:
    """gpt-oss's experts: the top `used` by the biased router logits, weighted by a softmax over
    those; each a clamped swiglu_oai (alpha 1.702, limit 7) with biases."""
    logits = h @ W[p + "ffn_gate_inp.weight"].T + W[p + "ffn_gate_inp.bias"]
    out = np.zeros_like(h)
    for t in range(len(h)):
        top = np.argsort(-logits[t], kind="stable")[: e["used"]]
        _note_gap(t, logits[t], e["used"])
        w = np.exp(logits[t, top] - logits[t, top].max())
        w /= w.sum()
        for x, wx in zip(top, w, strict=True):
            g = h[t] @ W[p + "ffn_gate_exps.weight"][x].T + W[p + "ffn_gate_exps.bias"][x]
            u = h[t] @ W[p + "ffn_up_exps.weight"][x].T + W[p + "ffn_up_exps.bias"][x]
            g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
            a = g / (1 + np.exp(-1.702 * g)) * (u + 1)
            out[t] += wx * (a @ W[p + "ffn_down_exps.weight"][x].T + W[p + "ffn_down_exps.bias"][x])
    return out


def _mrope_fourth_axis(sections: list[int], pairs: int, interleaved: bool) -> np.ndarray:
    """Which rotary pairs ggml's M-RoPE gives the fourth position axis."""
    s0, s1, s2, _ = sections
    sector = np.arange(pairs) % sum(sections)
    if interleaved:
        return ~(((sector % 3 == 0) & (sector < 3 * s0)) | ((sector % 3 == 1) & (sector < 3 * s1)) | ((sector % 3 == 2) & (sector < 3 * s2)))
    return sector >= s0 + s1 + s2


def _yarn(meta: dict[str, Any], rd: int) -> tuple[float, float, float]:
    """YaRN's ramp (ggml's correction dims) and its sine/cosine scale as llama.cpp sets them up."""
    factor, orig, base = meta["rope.scaling.factor"], meta["rope.scaling.original_context_length"], meta["rope.freq_base"]
    log_mul = meta.get("rope.scaling.yarn_log_multiplier", 0.0)

    def corr(beta: float) -> float:
        return rd * np.log(orig / (beta * 2 * np.pi)) / (2 * np.log(base))

    def m(scale: float, ms: float) -> float:
        return 1.0 if scale <= 1 else 0.1 * ms * np.log(scale) + 1.0

    attn = (m(factor, 1.0) / m(factor, log_mul) if log_mul else m(factor, 1.0)) / (1 + 0.1 * np.log(factor)) * meta.get("rope.scaling.attn_factor", 1.0)
    low = max(0.0, np.floor(corr(meta.get("rope.scaling.yarn_beta_fast", 32.0))))
    high = min(rd - 1.0, np.ceil(corr(meta.get("rope.scaling.yarn_beta_slow", 1.0))))
    return low, high, attn * (1 + 0.1 * np.log(factor))


def _gated_attention(W: dict[str, np.ndarray], p: str, H: int, KVH: int, HD: int, h: np.ndarray, rope: Any, eps: float) -> np.ndarray:
    """qwen35's full attention: QK-norm, RoPE, and a sigmoid gate (each head's second half of
    the Q projection) on the output."""
    T = len(h)
    qg = (h @ W[p + "attn_q.weight"].T).reshape(T, H, 2 * HD)
    q, gate = qg[..., :HD], qg[..., HD:]
    k = (h @ W[p + "attn_k.weight"].T).reshape(T, KVH, HD)
    v = (h @ W[p + "attn_v.weight"].T).reshape(T, KVH, HD)
    q, k = _rms(q, W[p + "attn_q_norm.weight"], eps), _rms(k, W[p + "attn_k_norm.weight"], eps)
    q = np.stack([rope(q[t], t) for t in range(T)])
    k = np.stack([rope(k[t], t) for t in range(T)])
    att = np.zeros((T, H, HD))
    for t in range(T):
        for hh in range(H):
            kv = hh // (H // KVH)
            sc = k[: t + 1, kv] @ q[t, hh] / np.sqrt(HD)
            pr = np.exp(sc - sc.max())
            att[t, hh] = (pr / pr.sum()) @ v[: t + 1, kv]
    att = att * (1 / (1 + np.exp(-gate)))
    return att.reshape(T, -1) @ W[p + "attn_output.weight"].T


def _deltanet(W: dict[str, np.ndarray], p: str, hy: dict[str, Any], h: np.ndarray, eps: float) -> np.ndarray:
    """A gated DeltaNet layer over the whole sequence (state from zero)."""
    T = len(h)
    nk, nv, hd, K = hy["nk"], hy["nv"], hy["hd"], hy["conv"]
    kd, r = nk * hd, nv // nk
    qkv = h @ W[p + "attn_qkv.weight"].T
    z = (h @ W[p + "attn_gate.weight"].T).reshape(T, nv, hd)
    if hy["fused_ba"]:
        ba = (h @ W[p + "ssm_ba.weight"].T).reshape(T, nk, 2 * r)
        beta, alpha = ba[..., :r].reshape(T, nv), ba[..., r:].reshape(T, nv)
    else:
        beta, alpha = h @ W[p + "ssm_beta.weight"].T, h @ W[p + "ssm_alpha.weight"].T
    beta = 1 / (1 + np.exp(-beta))
    g = np.log1p(np.exp(alpha + W[p + "ssm_dt.bias"])) * W[p + "ssm_a"]
    conv = W[p + "ssm_conv1d.weight"]  # channels x taps
    xp = np.concatenate([np.zeros((K - 1, qkv.shape[1])), qkv])
    y = np.stack([(xp[t : t + K] * conv.T).sum(0) for t in range(T)])
    y = y / (1 + np.exp(-y))
    q, k, v = y[:, :kd].reshape(T, nk, hd), y[:, kd : 2 * kd].reshape(T, nk, hd), y[:, 2 * kd :].reshape(T, nv, hd)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + eps)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + eps)
    S = np.zeros((nv, hd, hd))  # [head, key index, value index]
    o = np.zeros((T, nv, hd))
    for t in range(T):
        for j in range(nv):
            kh = j // r if hy["fused_ba"] else j % nk  # qwen3next groups, qwen35 tiles
            S[j] *= np.exp(g[t, j])
            d = beta[t, j] * (v[t, j] - S[j].T @ k[t, kh])
            S[j] += np.outer(k[t, kh], d)
            o[t, j] = S[j].T @ q[t, kh] / np.sqrt(hd)
    o = _rms(o, W[p + "ssm_norm.weight"], eps) * (z / (1 + np.exp(-z)))
    return o.reshape(T, -1) @ W[p + "ssm_out.weight"].T


def write_scripted_model(path: Path, specials: list[str], script: dict[str, str], template: str, pieces: tuple[str, ...] = (), ctx: int = 256) -> None:
    """A llama model that continues each token with the one ``script`` names (pieces or specials,
    as their text): its layers add nothing (zero output projections) and its output matrix holds,
    for each token, the embedding of the token it follows, so the logits peak on the successor.
    ``specials`` join the vocabulary as control tokens, except thought markers (``<think>``,
    ``</think>``), which Qwen3's files mark user-defined (shown as text); ``template`` is its chat
    template. ``pieces`` join as plain pieces after the specials (words a script emits whole, as
    Harmony's channel names); ``ctx`` is the context length."""
    rng = np.random.default_rng(99)
    vocab = VOCAB + specials + list(pieces)
    n = len(vocab)
    w = GGUFWriter(str(path), "llama")
    _add_keys(
        w,
        "llama",
        {
            "block_count": 1,
            "context_length": ctx,
            "embedding_length": DIM,
            "feed_forward_length": HIDDEN,
            "attention.head_count": HEADS,
            "attention.head_count_kv": KV_HEADS,
            "attention.layer_norm_rms_epsilon": 1e-6,
        },
    )
    w.add_tokenizer_model("llama")
    w.add_token_list(vocab)
    w.add_token_scores([0.0] * 3 + [0.0] * 256 + [-float(i) for i in range(len(PIECES))] + [0.0] * len(specials) + [-100.0] * len(pieces))
    w.add_token_types(TYPES + [4 if "think>" in t else 3 for t in specials] + [1] * len(pieces))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(template)
    emb = rng.normal(0, 1.0, size=(n, DIM)).astype(np.float32)
    out = np.zeros((n, DIM), np.float32)
    idx = {t: i for i, t in enumerate(vocab)}
    for a, b in script.items():
        out[idx[b]] += emb[idx[a]]
    w.add_tensor("token_embd.weight", emb)
    w.add_tensor("output.weight", out)
    z = np.zeros
    w.add_tensor("blk.0.attn_norm.weight", np.ones(DIM, np.float32))
    w.add_tensor("blk.0.attn_q.weight", z((HEADS * HEAD_DIM, DIM), np.float32))
    w.add_tensor("blk.0.attn_k.weight", z((KV_HEADS * HEAD_DIM, DIM), np.float32))
    w.add_tensor("blk.0.attn_v.weight", z((KV_HEADS * HEAD_DIM, DIM), np.float32))
    w.add_tensor("blk.0.attn_output.weight", z((DIM, HEADS * HEAD_DIM), np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(DIM, np.float32))
    w.add_tensor("blk.0.ffn_gate.weight", z((HIDDEN, DIM), np.float32))
    w.add_tensor("blk.0.ffn_up.weight", z((HIDDEN, DIM), np.float32))
    w.add_tensor("blk.0.ffn_down.weight", z((DIM, HIDDEN), np.float32))
    w.add_tensor("output_norm.weight", np.ones(DIM, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Text the gpt-4o pre-tokenizer (gpt-oss's o200k) splits in every way it can: case runs,
# contractions in either case, digit triples, punctuation runs with newlines, non-ASCII letters.
GPT4O_TEXTS = [
    "Hello World's 12345 na\u00efveTEST\n\n x",
    "the inner WEATHER in Paris isn't 1234567 degrees!!\r\n\tok",
    "  leading   spaces and \u00c9COLE \u00e9t\u00e9 \u00c0\u00c9\u00ce",
    "CamelCaseWordsHere and HTTPServer's API_KEY=abc123",
    "\u4e2d\u6587 \u0442\u0435\u043a\u0441\u0442 \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac \U0001f642\U0001f642 done.",
    "a/b\\c <tag>x</tag>\n\n\n",
    "I'LL SEE YOU'RE don'T",
    "x  \n  y \t\n",
    "O'Neil McDONALD's 3.14159 1,000,000",
]


def _gpt2_bytes() -> dict[int, str]:
    """GPT-2's byte-to-unicode map (each byte as a printable char)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def write_gpt4o_vocab_model(path: Path) -> None:
    """The gpt-oss family's file with a byte-level BPE vocabulary under the `gpt-4o`
    pre-tokenizer: the 256 byte tokens (ids = byte values) and 11 merges, as many tokens as the
    family's embedding has rows."""
    bmap = _gpt2_bytes()
    merges = [("\u0120", "t"), ("h", "e"), ("\u0120t", "he"), ("i", "n"), ("e", "r"), ("\u0120", "a"), ("o", "n"), ("\u0120", "W"), ("\u0120", "n"), ("\u00c3", "\u00af"), ("'", "s")]
    toks = [bmap[b] for b in range(256)] + [a + b for a, b in merges]

    def vocab(w: GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-4o")
        w.add_token_list(toks)
        w.add_token_types([1] * len(toks))
        w.add_token_merges([f"{a} {b}" for a, b in merges])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)

    write_family(path, "gpt-oss", vocab=vocab)
