"""Tiny random-weight mmproj files (llama.cpp's ``clip`` architecture) written with
gguf.GGUFWriter, with a NumPy float64 reference of the tower and projector to check the engine
against: Gemma 3, Gemma 4, Pixtral, Qwen2-VL / Qwen2.5-VL, Qwen3-VL and Idefics3 (SmolVLM), each
described beside its writer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter

from synthetic import DIM as TEXT_DIM
from synthetic import encode_weight

# The tower's shape: 32 x 32 pixels in patches of 4 (an 8 x 8 grid), pooled by 2 per side into
# 16 tokens of the text model's width.
GEMMA3_VISION: dict[str, Any] = dict(image_size=32, patch=4, dim=64, ff=128, heads=4, layers=2, merge=2, eps=1e-6, mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])



class _Tensors:
    """A writer's tensors: `put` adds one to the file (quantized when ``kind`` is not F32) and keeps
    the exact values it stands for in ``weights``; ``drop`` keeps one out of the file (the
    refusals' tests), ``as_name`` stores it under another name."""

    def __init__(self, w: GGUFWriter, rng: np.random.Generator, qt: QT, drop: str | None = None, mat_scale: float = 0.1) -> None:
        self.w, self.rng, self.qt, self.drop, self.mat_scale = w, rng, qt, drop, mat_scale
        self.weights: dict[str, np.ndarray] = {}

    def put(self, name: str, arr: np.ndarray, kind: QT = QT.F32, as_name: str | None = None) -> None:
        data, exact = encode_weight(arr, kind, self.rng) if arr.ndim == 2 and kind != QT.F32 else (arr.astype(np.float32), arr.astype(np.float32))
        self.weights[name] = exact
        if name == self.drop:
            return
        if data.dtype == np.uint8:
            self.w.add_tensor(as_name or name, data, raw_dtype=kind)
        else:
            self.w.add_tensor(as_name or name, data)

    def mat(self, name: str, rows: int, cols: int, kind: QT | None = None, scale: float | None = None, as_name: str | None = None) -> None:
        self.put(name, self.rng.normal(0, self.mat_scale if scale is None else scale, size=(rows, cols)), self.qt if kind is None else kind, as_name)

    def vec(self, name: str, n: int, mean: float = 1.0, std: float = 0.1) -> None:
        self.put(name, mean + self.rng.normal(0, std, size=n))


def _clip_writer(path: Path, projector: str, act: str, c: dict[str, Any], text_dim: int) -> GGUFWriter:
    """A clip GGUF's writer with the keys every projector's tower has (llama.cpp's clip loader)."""
    w = GGUFWriter(str(path), "clip")
    w.add_string("clip.projector_type", projector)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool(f"clip.use_{act}", True)
    w.add_uint32("clip.vision.image_size", c["image_size"])
    w.add_uint32("clip.vision.patch_size", c["patch"])
    w.add_uint32("clip.vision.embedding_length", c["dim"])
    w.add_uint32("clip.vision.feed_forward_length", c["ff"])
    w.add_uint32("clip.vision.block_count", c["layers"])
    w.add_uint32("clip.vision.projection_dim", text_dim)
    w.add_uint32("clip.vision.attention.head_count", c["heads"])
    w.add_float32("clip.vision.attention.layer_norm_epsilon", c["eps"])
    w.add_array("clip.vision.image_mean", c["mean"])
    w.add_array("clip.vision.image_std", c["std"])
    return w


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """Largest error relative to the largest reference value."""
    return float(np.abs(got - want).max() / np.abs(want).max())


def write_gemma3_mmproj(path: Path, qt: QT = QT.F32, text_dim: int = TEXT_DIM, projector: str = "gemma3", swapped_ffn: bool = False, **over: Any) -> dict[str, np.ndarray]:
    """Write a tiny Gemma 3 mmproj; return its exact weights (numpy order) and ``"_cfg"``'s values
    under their keys. ``swapped_ffn`` stores the MLP's up and down under each other's names, as
    older conversions did."""
    c = {**GEMMA3_VISION, **over}
    rng = np.random.default_rng(4321)
    w = _clip_writer(path, projector, "gelu", c, text_dim)
    if c["merge"] != 4:
        w.add_uint32("clip.vision.projector.scale_factor", c["merge"])
    t = _Tensors(w, rng, qt)
    weights = t.weights
    d, p, g = c["dim"], c["patch"], c["image_size"] // c["patch"]

    put, mat, vec = t.put, t.mat, t.vec

    put("v.patch_embd.weight", rng.normal(0, 0.2, size=(d, 3, p, p)))
    vec("v.patch_embd.bias", d, 0.0)
    put("v.position_embd.weight", rng.normal(0, 0.5, size=(g * g, d)))
    for i in range(c["layers"]):
        b = f"v.blk.{i}."
        vec(b + "ln1.weight", d)
        vec(b + "ln1.bias", d, 0.0)
        for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
            mat(b + t + ".weight", d, d)
            vec(b + t + ".bias", d, 0.0)
        vec(b + "ln2.weight", d)
        vec(b + "ln2.bias", d, 0.0)
        up, down = ("ffn_down", "ffn_up") if swapped_ffn else ("ffn_up", "ffn_down")
        mat(b + "ffn_up.weight", c["ff"], d, as_name=b + up + ".weight")
        put(b + "ffn_up.bias", rng.normal(0, 0.1, size=c["ff"]), as_name=b + up + ".bias")
        mat(b + "ffn_down.weight", d, c["ff"], as_name=b + down + ".weight")
        put(b + "ffn_down.bias", rng.normal(0, 0.1, size=d), as_name=b + down + ".bias")
    vec("v.post_ln.weight", d)
    vec("v.post_ln.bias", d, 0.0)
    vec("mm.soft_emb_norm.weight", d, 0.0, 0.3)
    # ggml shape [text_dim, dim]: numpy (dim, text_dim); tokens @ it gives the text width.
    put("mm.input_projection.weight", rng.normal(0, 0.1, size=(d, text_dim)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    weights["_cfg"] = np.array([0])
    return weights


def _ln(x: np.ndarray, wt: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * wt + b


def reference_gemma3_image(W: dict[str, np.ndarray], pixels: np.ndarray, **over: Any) -> np.ndarray:
    """Float64 tower + projector over planar normalized pixels (3, S, S): (tokens, text_dim)."""
    c = {**GEMMA3_VISION, **over}
    X = {k: v.astype(np.float64) for k, v in W.items()}
    S, p, d, H = c["image_size"], c["patch"], c["dim"], c["heads"]
    g, eps = S // p, c["eps"]
    px = pixels.astype(np.float64)
    # (3, g, p, g, p) -> patches (g*g) of (3, p, p)
    patches = px.reshape(3, g, p, g, p).transpose(1, 3, 0, 2, 4).reshape(g * g, 3 * p * p)
    x = patches @ X["v.patch_embd.weight"].reshape(d, -1).T + X["v.patch_embd.bias"]
    x = x + X["v.position_embd.weight"]
    n, hd = g * g, d // H
    for i in range(c["layers"]):
        b = f"v.blk.{i}."
        h = _ln(x, X[b + "ln1.weight"], X[b + "ln1.bias"], eps)
        q, k, v = (h @ X[b + t + ".weight"].T + X[b + t + ".bias"] for t in ("attn_q", "attn_k", "attn_v"))
        att = np.zeros((n, d))
        for hh in range(H):
            s = slice(hh * hd, (hh + 1) * hd)
            sc = q[:, s] @ k[:, s].T / np.sqrt(hd)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            att[:, s] = pr @ v[:, s]
        x = x + att @ X[b + "attn_out.weight"].T + X[b + "attn_out.bias"]
        h = _ln(x, X[b + "ln2.weight"], X[b + "ln2.bias"], eps)
        u = h @ X[b + "ffn_up.weight"].T + X[b + "ffn_up.bias"]
        u = 0.5 * u * (1 + np.tanh(0.7978845608 * (u + 0.044715 * u**3)))
        x = x + u @ X[b + "ffn_down.weight"].T + X[b + "ffn_down.bias"]
    x = _ln(x, X["v.post_ln.weight"], X["v.post_ln.bias"], eps)
    k = c["merge"]
    side = g // k
    pooled = x.reshape(side, k, side, k, d).mean(axis=(1, 3)).reshape(side * side, d)
    pooled = pooled / np.sqrt((pooled**2).mean(-1, keepdims=True) + eps) * X["mm.soft_emb_norm.weight"]
    return pooled @ X["mm.input_projection.weight"]


# Pixtral (Mistral Small 3.1's layout): RMS norms, a SiLU-gated MLP, 2-D RoPE, no learned
# positions, then the patch merger (2 x 2 patches into one token), the GELU MLP to the text
# width and an [IMG_BREAK] row after every row of tokens but the last. Patches of 4, so an image
# is a multiple of 8 pixels on each side.
PIXTRAL_VISION: dict[str, Any] = dict(image_size=64, patch=4, dim=64, ff=96, heads=4, layers=2, merge=2, eps=1e-5, hidden=128, theta=10000.0, mean=[0.48145466, 0.4578275, 0.40821073], std=[0.26862954, 0.26130258, 0.27577711])


def write_pixtral_mmproj(path: Path, qt: QT = QT.F32, text_dim: int = TEXT_DIM, merger: bool = True, img_break: bool = True, **over: Any) -> dict[str, np.ndarray]:
    """Write a tiny Pixtral mmproj; return its exact weights (numpy order)."""
    c = {**PIXTRAL_VISION, **over}
    rng = np.random.default_rng(8765)
    w = _clip_writer(path, "pixtral", "silu", c, text_dim)
    if merger:
        w.add_uint32("clip.vision.spatial_merge_size", c["merge"])
    t = _Tensors(w, rng, qt)
    weights = t.weights
    d, p, m = c["dim"], c["patch"], c["merge"]

    put, mat, vec = t.put, t.mat, t.vec

    put("v.patch_embd.weight", rng.normal(0, 0.2, size=(d, 3, p, p)))
    vec("v.pre_ln.weight", d)
    for i in range(c["layers"]):
        b = f"v.blk.{i}."
        vec(b + "ln1.weight", d)
        for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
            mat(b + t + ".weight", d, d, scale=0.15)
        vec(b + "ln2.weight", d)
        mat(b + "ffn_gate.weight", c["ff"], d)
        mat(b + "ffn_up.weight", c["ff"], d)
        mat(b + "ffn_down.weight", d, c["ff"])
    if merger:
        vec("mm.input_norm.weight", d)
        mat("mm.patch_merger.weight", d, d * m * m, scale=0.08)
    mat("mm.1.weight", c["hidden"], d)
    put("mm.1.bias", rng.normal(0, 0.1, size=c["hidden"]))
    mat("mm.2.weight", text_dim, c["hidden"])
    put("mm.2.bias", rng.normal(0, 0.1, size=text_dim))
    if img_break:
        put("v.token_embd.img_break", rng.normal(0, 0.5, size=text_dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def _rms(x: np.ndarray, wt: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * wt


def _rope_2d(x: np.ndarray, gw: int, gh: int, heads: int, theta: float) -> np.ndarray:
    """Pixtral's 2-D RoPE (clip.cpp's build_rope_2d, interleaved frequencies): in each head, the
    first half's adjacent pairs turn by the patch's row at base^(-4i/hd), the second half's by its
    column at base^(-(4i+2)/hd)."""
    n, d = x.shape
    hd = d // heads
    q = hd // 4
    rows, cols = np.arange(n) // gw, np.arange(n) % gw
    out = x.reshape(n, heads, hd).copy()
    for half, pos, off in ((0, rows, 0.0), (1, cols, 2.0)):
        freq = theta ** (-(4 * np.arange(q) + off) / hd)
        ang = pos[:, None] * freq[None, :]  # (n, q)
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        seg = out[:, :, half * hd // 2 : (half + 1) * hd // 2]
        x0, x1 = seg[..., 0::2].copy(), seg[..., 1::2].copy()
        seg[..., 0::2] = x0 * cos - x1 * sin
        seg[..., 1::2] = x0 * sin + x1 * cos
    return out.reshape(n, d)


def reference_pixtral_image(W: dict[str, np.ndarray], pixels: np.ndarray, merger: bool = True, img_break: bool = True, **over: Any) -> np.ndarray:
    """Float64 tower + projector over planar normalized pixels (3, H, W): (rows, text_dim)."""
    c = {**PIXTRAL_VISION, **over}
    X = {k: v.astype(np.float64) for k, v in W.items()}
    p, d, H, eps = c["patch"], c["dim"], c["heads"], c["eps"]
    _, hh, ww = pixels.shape
    gh, gw = hh // p, ww // p
    px = pixels.astype(np.float64)
    patches = px.reshape(3, gh, p, gw, p).transpose(1, 3, 0, 2, 4).reshape(gh * gw, 3 * p * p)
    x = patches @ X["v.patch_embd.weight"].reshape(d, -1).T
    x = _rms(x, X["v.pre_ln.weight"], eps)
    n, hd = gh * gw, d // H
    for i in range(c["layers"]):
        b = f"v.blk.{i}."
        h = _rms(x, X[b + "ln1.weight"], eps)
        q, k, v = (h @ X[b + t + ".weight"].T for t in ("attn_q", "attn_k", "attn_v"))
        q, k = _rope_2d(q, gw, gh, H, c["theta"]), _rope_2d(k, gw, gh, H, c["theta"])
        att = np.zeros((n, d))
        for j in range(H):
            s = slice(j * hd, (j + 1) * hd)
            sc = q[:, s] @ k[:, s].T / np.sqrt(hd)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            att[:, s] = pr @ v[:, s]
        x = x + att @ X[b + "attn_out.weight"].T
        h = _rms(x, X[b + "ln2.weight"], eps)
        g = h @ X[b + "ffn_gate.weight"].T
        u = h @ X[b + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ X[b + "ffn_down.weight"].T
    m = c["merge"] if merger else 1
    py, pxn = gh // m, gw // m
    if merger:
        x = _rms(x, X["mm.input_norm.weight"], eps)
        # Each m x m block as channel, row, column (torch's unfold), then the merger.
        blocks = x.reshape(py, m, pxn, m, d).transpose(0, 2, 4, 1, 3).reshape(py * pxn, d * m * m)
        x = blocks @ X["mm.patch_merger.weight"].T
    u = x @ X["mm.1.weight"].T + X["mm.1.bias"]
    u = 0.5 * u * (1 + np.tanh(0.7978845608 * (u + 0.044715 * u**3)))
    tok = u @ X["mm.2.weight"].T + X["mm.2.bias"]
    if not img_break:
        return tok
    rows = []
    for r in range(py):
        rows.append(tok[r * pxn : (r + 1) * pxn])
        if r + 1 < py:
            rows.append(X["v.token_embd.img_break"][None, :])
    return np.concatenate(rows)


# Qwen2.5-VL (projector ``qwen2.5vl_merger``): RMS norms, Q/K/V/output biases, a SiLU-gated MLP with
# biases, the vision M-RoPE, windows of 112 pixels (clip.cpp's, whatever the file says: 14 x 14
# blocks of 2 x 2 patches here) in every layer but each second; the post norm, then each 2 x 2 block of patches through the GELU MLP ``mm.0``,
# ``mm.2``. Qwen2-VL (``qwen2vl_merger``): LayerNorms with biases, an ungated GELU-quick MLP, no windows.
# Patches of 4, so an image is a multiple of 8 pixels on each side.
QWEN2VL_VISION: dict[str, Any] = dict(
    image_size=64, patch=4, dim=64, ff=96, heads=4, layers=2, eps=1e-6, hidden=256, window=112, wa=2, mean=[0.48145466, 0.4578275, 0.40821073], std=[0.26862954, 0.26130258, 0.27577711]
)


def write_qwen2vl_mmproj(path: Path, qt: QT = QT.F32, text_dim: int = TEXT_DIM, qwen25: bool = True, **over: Any) -> dict[str, np.ndarray]:
    """Write a tiny Qwen2.5-VL (or, ``qwen25=False``, Qwen2-VL) mmproj; return its exact weights
    (numpy order)."""
    c = {**QWEN2VL_VISION, **over}
    rng = np.random.default_rng(2468 if qwen25 else 1357)
    w = _clip_writer(path, "qwen2.5vl_merger" if qwen25 else "qwen2vl_merger", "silu" if qwen25 else "gelu_quick", c, text_dim)
    w.add_uint32("clip.vision.spatial_merge_size", 2)
    if qwen25:
        w.add_uint32("clip.vision.n_wa_pattern", c["wa"])
    t = _Tensors(w, rng, qt)
    weights = t.weights
    d, p = c["dim"], c["patch"]

    put, mat, vec = t.put, t.mat, t.vec

    put("v.patch_embd.weight", rng.normal(0, 0.15, size=(d, 3, p, p)))
    put("v.patch_embd.weight.1", rng.normal(0, 0.15, size=(d, 3, p, p)))
    for i in range(c["layers"]):
        b = f"v.blk.{i}."
        vec(b + "ln1.weight", d)
        if not qwen25:
            vec(b + "ln1.bias", d, 0.0)
        for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
            mat(b + t + ".weight", d, d, scale=0.15)
            vec(b + t + ".bias", d, 0.0)
        vec(b + "ln2.weight", d)
        if not qwen25:
            vec(b + "ln2.bias", d, 0.0)
        if qwen25:
            mat(b + "ffn_gate.weight", c["ff"], d)
            vec(b + "ffn_gate.bias", c["ff"], 0.0)
        mat(b + "ffn_up.weight", c["ff"], d)
        vec(b + "ffn_up.bias", c["ff"], 0.0)
        mat(b + "ffn_down.weight", d, c["ff"])
        vec(b + "ffn_down.bias", d, 0.0)
    vec("v.post_ln.weight", d)
    if not qwen25:
        vec("v.post_ln.bias", d, 0.0)
    mat("mm.0.weight", c["hidden"], 4 * d, scale=0.08)
    vec("mm.0.bias", c["hidden"], 0.0)
    mat("mm.2.weight", text_dim, c["hidden"])
    vec("mm.2.bias", text_dim, 0.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def _qwen_rope(x: np.ndarray, pos: np.ndarray, heads: int, theta: float = 10000.0) -> np.ndarray:
    """ggml's vision M-RoPE (clip.cpp's qwen2vl graph): per head, pair j of (j, j + hd/2) turns by
    the patch's row times theta^(-4j/hd) for j < hd/4, by its column times theta^(-4(j-hd/4)/hd)
    after."""
    n, d = x.shape
    hd = d // heads
    q = hd // 4
    freq = theta ** (-4 * np.arange(q) / hd)
    ang = np.concatenate([pos[:, :1] * freq, pos[:, 1:2] * freq], axis=1)  # (n, hd/2)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.reshape(n, heads, hd).copy()
    a, b = out[..., : hd // 2].copy(), out[..., hd // 2 :].copy()
    out[..., : hd // 2], out[..., hd // 2 :] = a * cos - b * sin, a * sin + b * cos
    return out.reshape(n, d)


def reference_qwen2vl_image(W: dict[str, np.ndarray], pixels: np.ndarray, qwen25: bool = True, **over: Any) -> np.ndarray:
    """Float64 tower + projector over planar normalized pixels (3, H, W): (tokens, text_dim), the
    tokens row by row of 2 x 2 patch blocks."""
    c = {**QWEN2VL_VISION, **over}
    X = {k: v.astype(np.float64) for k, v in W.items()}
    p, d, H, eps = c["patch"], c["dim"], c["heads"], c["eps"]
    _, hh, ww = pixels.shape
    gh, gw = hh // p, ww // p
    bh, bw = gh // 2, gw // 2
    px = pixels.astype(np.float64)
    # Patches in block order: block row, block column, row in block, column in block.
    patches = px.reshape(3, bh, 2, p, bw, 2, p).transpose(1, 4, 2, 5, 0, 3, 6).reshape(gh * gw, 3 * p * p)
    kernel = (X["v.patch_embd.weight"] + X["v.patch_embd.weight.1"]).reshape(d, -1)
    x = patches @ kernel.T
    idx = np.arange(gh * gw)
    blk, r = idx // 4, idx % 4
    pos = np.stack([2 * (blk // bw) + r // 2, 2 * (blk % bw) + r % 2], axis=1).astype(np.float64)
    # Window membership per sequence row (blocks of `side` x `side`), for the windowed layers.
    side = c["window"] // p // 2
    win = (blk // bw) // side * 10_000 + (blk % bw) // side
    same = win[:, None] == win[None, :]

    def norm(x: np.ndarray, pre: str) -> np.ndarray:
        return _rms(x, X[pre + ".weight"], eps) if qwen25 else _ln(x, X[pre + ".weight"], X[pre + ".bias"], eps)

    n, hd = gh * gw, d // H
    for i in range(c["layers"]):
        b = f"v.blk.{i}."
        h = norm(x, b + "ln1")
        q, k, v = (h @ X[b + t + ".weight"].T + X[b + t + ".bias"] for t in ("attn_q", "attn_k", "attn_v"))
        q, k = _qwen_rope(q, pos, H), _qwen_rope(k, pos, H)
        full = not qwen25 or (i + 1) % c["wa"] == 0
        att = np.zeros((n, d))
        for j in range(H):
            s = slice(j * hd, (j + 1) * hd)
            sc = q[:, s] @ k[:, s].T / np.sqrt(hd)
            if not full:
                sc = np.where(same, sc, -np.inf)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            att[:, s] = pr @ v[:, s]
        x = x + att @ X[b + "attn_out.weight"].T + X[b + "attn_out.bias"]
        h = norm(x, b + "ln2")
        u = h @ X[b + "ffn_up.weight"].T + X[b + "ffn_up.bias"]
        if qwen25:
            g = h @ X[b + "ffn_gate.weight"].T + X[b + "ffn_gate.bias"]
            u = g / (1 + np.exp(-g)) * u
        else:
            u = u / (1 + np.exp(-1.702 * u))
        x = x + u @ X[b + "ffn_down.weight"].T + X[b + "ffn_down.bias"]
    x = norm(x, "v.post_ln")
    m = x.reshape(n // 4, 4 * d) @ X["mm.0.weight"].T + X["mm.0.bias"]
    m = 0.5 * m * (1 + np.tanh(0.7978845608 * (m + 0.044715 * m**3)))
    return m @ X["mm.2.weight"].T + X["mm.2.bias"]


# Qwen3-VL (projector ``qwen3vl_merger``): Qwen2-VL's tower (2 x 2 patch blocks, two patch
# kernels, the vision M-RoPE, LayerNorms with biases, an ungated GELU MLP, no windows) with a fused
# Q/K/V, a patch bias, learned positions on a grid of their own (8 x 8 here, interpolated to the
# image: bilinear, corners aligned) and a deepstack merger after layer 1 of 3 (``deepstack``
# names the layers): each block's four patches (4 x dim) through a LayerNorm and a GELU MLP to the
# text width. A row is the merger's output, then each deepstack's (here 2 x the text width).
QWEN3VL_VISION: dict[str, Any] = dict(image_size=32, patch=4, dim=64, ff=96, heads=4, layers=3, eps=1e-6, hidden=256, deepstack=(1,), mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])


def write_qwen3vl_mmproj(path: Path, qt: QT = QT.F32, text_dim: int = TEXT_DIM, drop: str | None = None, **over: Any) -> dict[str, np.ndarray]:
    """Write a tiny Qwen3-VL mmproj; return its exact weights (numpy order; the fused Q/K/V under
    ``attn_qkv``). ``drop`` leaves a tensor out (the refusals' tests)."""
    c = {**QWEN3VL_VISION, **over}
    rng = np.random.default_rng(3579)
    w = _clip_writer(path, "qwen3vl_merger", "gelu", c, text_dim)
    w.add_uint32("clip.vision.spatial_merge_size", 2)
    w.add_array("clip.vision.is_deepstack_layers", [i in c["deepstack"] for i in range(c["layers"])])
    t = _Tensors(w, rng, qt, drop=drop)
    weights = t.weights
    d, p, g = c["dim"], c["patch"], c["image_size"] // c["patch"]

    put, mat, vec = t.put, t.mat, t.vec

    put("v.patch_embd.weight", rng.normal(0, 0.15, size=(d, 3, p, p)))
    put("v.patch_embd.weight.1", rng.normal(0, 0.15, size=(d, 3, p, p)))
    vec("v.patch_embd.bias", d, 0.0)
    put("v.position_embd.weight", rng.normal(0, 0.5, size=(g * g, d)))
    for i in range(c["layers"]):
        b = f"v.blk.{i}."
        vec(b + "ln1.weight", d)
        vec(b + "ln1.bias", d, 0.0)
        mat(b + "attn_qkv.weight", 3 * d, d, scale=0.15)
        vec(b + "attn_qkv.bias", 3 * d, 0.0)
        mat(b + "attn_out.weight", d, d, scale=0.15)
        vec(b + "attn_out.bias", d, 0.0)
        vec(b + "ln2.weight", d)
        vec(b + "ln2.bias", d, 0.0)
        mat(b + "ffn_up.weight", c["ff"], d)
        vec(b + "ffn_up.bias", c["ff"], 0.0)
        mat(b + "ffn_down.weight", d, c["ff"])
        vec(b + "ffn_down.bias", d, 0.0)
    for i in c["deepstack"]:
        b = f"v.deepstack.{i}."
        vec(b + "norm.weight", 4 * d)
        vec(b + "norm.bias", 4 * d, 0.0)
        mat(b + "fc1.weight", c["hidden"], 4 * d, scale=0.08)
        vec(b + "fc1.bias", c["hidden"], 0.0)
        mat(b + "fc2.weight", text_dim, c["hidden"])
        vec(b + "fc2.bias", text_dim, 0.0)
    vec("v.post_ln.weight", d)
    vec("v.post_ln.bias", d, 0.0)
    mat("mm.0.weight", c["hidden"], 4 * d, scale=0.08)
    vec("mm.0.bias", c["hidden"], 0.0)
    mat("mm.2.weight", text_dim, c["hidden"])
    vec("mm.2.bias", text_dim, 0.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def _interpolate_aligned(grid: np.ndarray, gw: int, gh: int) -> np.ndarray:
    """(side, side, d) values bilinearly resampled to (gh, gw, d) with corners aligned (PyTorch's
    ``interpolate(..., mode="bilinear", align_corners=True)``)."""
    side = grid.shape[0]

    def taps(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x = np.arange(n) * ((side - 1) / (n - 1)) if n > 1 else np.zeros(1)
        x0 = np.clip(np.floor(x).astype(int), 0, side - 1)
        x1 = np.minimum(x0 + 1, side - 1)
        return x0, x1, np.clip(x - x0, 0, 1)

    (y0, y1, dy), (x0, x1, dx) = taps(gh), taps(gw)
    dy, dx = dy[:, None, None], dx[None, :, None]
    top = grid[y0][:, x0] * (1 - dx) + grid[y0][:, x1] * dx
    bot = grid[y1][:, x0] * (1 - dx) + grid[y1][:, x1] * dx
    return top * (1 - dy) + bot * dy


def reference_qwen3vl_image(W: dict[str, np.ndarray], pixels: np.ndarray, **over: Any) -> np.ndarray:
    """Float64 tower, merger and deepstack mergers over planar normalized pixels (3, H, W):
    (tokens, (1 + deepstack mergers) * text_dim), the tokens row by row of 2 x 2 patch blocks."""
    c = {**QWEN3VL_VISION, **over}
    X = {k: v.astype(np.float64) for k, v in W.items()}
    p, d, H, eps = c["patch"], c["dim"], c["heads"], c["eps"]
    _, hh, ww = pixels.shape
    gh, gw = hh // p, ww // p
    bh, bw = gh // 2, gw // 2
    px = pixels.astype(np.float64)
    patches = px.reshape(3, bh, 2, p, bw, 2, p).transpose(1, 4, 2, 5, 0, 3, 6).reshape(gh * gw, 3 * p * p)
    kernel = (X["v.patch_embd.weight"] + X["v.patch_embd.weight.1"]).reshape(d, -1)
    x = patches @ kernel.T + X["v.patch_embd.bias"]
    idx = np.arange(gh * gw)
    blk, r = idx // 4, idx % 4
    pos = np.stack([2 * (blk // bw) + r // 2, 2 * (blk % bw) + r % 2], axis=1)
    side = int(np.sqrt(len(X["v.position_embd.weight"])) + 0.5)
    learned = _interpolate_aligned(X["v.position_embd.weight"].reshape(side, side, d), gw, gh)
    x = x + learned[pos[:, 0], pos[:, 1]]
    n, hd = gh * gw, d // H
    deep = []
    for i in range(c["layers"]):
        b = f"v.blk.{i}."
        h = _ln(x, X[b + "ln1.weight"], X[b + "ln1.bias"], eps)
        qkv = h @ X[b + "attn_qkv.weight"].T + X[b + "attn_qkv.bias"]
        q, k, v = qkv[:, :d], qkv[:, d : 2 * d], qkv[:, 2 * d :]
        q, k = _qwen_rope(q, pos.astype(np.float64), H), _qwen_rope(k, pos.astype(np.float64), H)
        att = np.zeros((n, d))
        for j in range(H):
            s = slice(j * hd, (j + 1) * hd)
            sc = q[:, s] @ k[:, s].T / np.sqrt(hd)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            att[:, s] = pr @ v[:, s]
        x = x + att @ X[b + "attn_out.weight"].T + X[b + "attn_out.bias"]
        h = _ln(x, X[b + "ln2.weight"], X[b + "ln2.bias"], eps)
        u = _gelu(h @ X[b + "ffn_up.weight"].T + X[b + "ffn_up.bias"])
        x = x + u @ X[b + "ffn_down.weight"].T + X[b + "ffn_down.bias"]
        if i in c["deepstack"]:
            ds = f"v.deepstack.{i}."
            f = _ln(x.reshape(n // 4, 4 * d), X[ds + "norm.weight"], X[ds + "norm.bias"], eps)
            f = _gelu(f @ X[ds + "fc1.weight"].T + X[ds + "fc1.bias"])
            deep.append(f @ X[ds + "fc2.weight"].T + X[ds + "fc2.bias"])
    x = _ln(x, X["v.post_ln.weight"], X["v.post_ln.bias"], eps)
    m = _gelu(x.reshape(n // 4, 4 * d) @ X["mm.0.weight"].T + X["mm.0.bias"])
    return np.concatenate([m @ X["mm.2.weight"].T + X["mm.2.bias"], *deep], axis=1)


def _gelu(u: np.ndarray) -> np.ndarray:
    return 0.5 * u * (1 + np.tanh(0.7978845608 * (u + 0.044715 * u**3)))


# Idefics3 (SmolVLM): the SigLIP tower of Gemma 3's writer over 32 x 32 tiles, a pixel shuffle of
# 2 x 2 patches (16 tokens a tile) and one linear map; images scaled to a longest side of 64
# first, so a 48 x 40 picture is 2 x 2 tiles and an overview.
IDEFICS3_VISION: dict[str, Any] = dict(image_size=32, patch=4, dim=64, ff=128, heads=4, layers=2, scale=2, longest=64, eps=1e-6, mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])


def write_idefics3_mmproj(path: Path, qt: QT = QT.F32, text_dim: int = TEXT_DIM, **over: Any) -> dict[str, np.ndarray]:
    """Write a tiny Idefics3 mmproj; return its exact weights (numpy order)."""
    c = {**IDEFICS3_VISION, **over}
    rng = np.random.default_rng(2468)
    w = _clip_writer(path, "idefics3", "gelu", c, text_dim)
    # 0 leaves a key out (the refusals' tests).
    if c["scale"]:
        w.add_uint32("clip.vision.projector.scale_factor", c["scale"])
    if c["longest"]:
        w.add_uint32("clip.vision.preproc_image_size", c["longest"])
    t = _Tensors(w, rng, qt)
    weights = t.weights
    d, p, g, s = c["dim"], c["patch"], c["image_size"] // c["patch"], c["scale"] or 2

    put, mat, vec = t.put, t.mat, t.vec

    put("v.patch_embd.weight", rng.normal(0, 0.2, size=(d, 3, p, p)))
    vec("v.patch_embd.bias", d, 0.0)
    put("v.position_embd.weight", rng.normal(0, 0.5, size=(g * g, d)))
    for i in range(c["layers"]):
        b = f"v.blk.{i}."
        vec(b + "ln1.weight", d)
        vec(b + "ln1.bias", d, 0.0)
        for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
            mat(b + t + ".weight", d, d)
            vec(b + t + ".bias", d, 0.0)
        vec(b + "ln2.weight", d)
        vec(b + "ln2.bias", d, 0.0)
        mat(b + "ffn_up.weight", c["ff"], d)
        put(b + "ffn_up.bias", rng.normal(0, 0.1, size=c["ff"]))
        mat(b + "ffn_down.weight", d, c["ff"])
        put(b + "ffn_down.bias", rng.normal(0, 0.1, size=d))
    vec("v.post_ln.weight", d)
    vec("v.post_ln.bias", d, 0.0)
    mat("mm.model.fc.weight", text_dim, d * s * s, scale=0.05)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def reference_idefics3_tile(W: dict[str, np.ndarray], pixels: np.ndarray, **over: Any) -> np.ndarray:
    """Float64 tower, pixel shuffle and projection over one tile's planar normalized pixels
    (3, S, S): (tokens, text_dim)."""
    c = {**IDEFICS3_VISION, **over}
    X = {k: v.astype(np.float64) for k, v in W.items()}
    S, p, d, H = c["image_size"], c["patch"], c["dim"], c["heads"]
    g, eps, s = S // p, c["eps"], c["scale"]
    patches = pixels.astype(np.float64).reshape(3, g, p, g, p).transpose(1, 3, 0, 2, 4).reshape(g * g, 3 * p * p)
    x = patches @ X["v.patch_embd.weight"].reshape(d, -1).T + X["v.patch_embd.bias"] + X["v.position_embd.weight"]
    n, hd = g * g, d // H
    for i in range(c["layers"]):
        b = f"v.blk.{i}."
        h = _ln(x, X[b + "ln1.weight"], X[b + "ln1.bias"], eps)
        q, k, v = (h @ X[b + t + ".weight"].T + X[b + t + ".bias"] for t in ("attn_q", "attn_k", "attn_v"))
        att = np.zeros((n, d))
        for hh in range(H):
            sl = slice(hh * hd, (hh + 1) * hd)
            sc = q[:, sl] @ k[:, sl].T / np.sqrt(hd)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            att[:, sl] = (pr / pr.sum(-1, keepdims=True)) @ v[:, sl]
        x = x + att @ X[b + "attn_out.weight"].T + X[b + "attn_out.bias"]
        h = _ln(x, X[b + "ln2.weight"], X[b + "ln2.bias"], eps)
        u = h @ X[b + "ffn_up.weight"].T + X[b + "ffn_up.bias"]
        u = 0.5 * u * (1 + np.tanh(0.7978845608 * (u + 0.044715 * u**3)))
        x = x + u @ X[b + "ffn_down.weight"].T + X[b + "ffn_down.bias"]
    x = _ln(x, X["v.post_ln.weight"], X["v.post_ln.bias"], eps)
    # Token (ty, tx): its block's patches row by row, each patch's features whole.
    side = g // s
    shuffled = x.reshape(side, s, side, s, d).transpose(0, 2, 1, 3, 4).reshape(side * side, s * s * d)
    return shuffled @ X["mm.model.fc.weight"].T


# Gemma 4 (projector ``gemma4v``): patches of 4 pooled 3 x 3 (clip.cpp's default merge, no
# scale_factor key, as the converted files), so an image is a multiple of 12 pixels a side and
# 70 to 1120 tokens; learned column and row tables for up to 40 patches a side; RMS norms
# without biases, per-head Q/K norms, a NeoX 2-D RoPE of base 100, V normed without a weight,
# unscaled attention, post norms, a gated GELU-quick MLP (no use_gelu key, as the converted
# files), each layer's output scaled by a scalar; clamps on some matrices' inputs and outputs
# (Gemma4ClippableLinear) that bind on some values; std_bias / std_scale, an RMS norm and the
# projection to the text width.
GEMMA4V_VISION: dict[str, Any] = dict(image_size=48, patch=4, dim=64, ff=96, heads=4, layers=2, merge=3, eps=1e-6, pos=40, mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])
# (matrix, side): (min, max), where the synthetic file has them.
GEMMA4V_CLAMPS: dict[tuple[str, str], tuple[float, float]] = {
    ("v.blk.0.attn_q", "input"): (-1.5, 1.5),
    ("v.blk.1.ffn_down", "input"): (-0.4, 0.4),
    ("v.blk.1.attn_out", "output"): (-0.3, 0.3),
    ("mm.input_projection", "output"): (-4.0, 4.0),
}


def write_gemma4v_mmproj(path: Path, qt: QT = QT.F32, text_dim: int = TEXT_DIM, drop: str | None = None, **over: Any) -> dict[str, np.ndarray]:
    """Write a tiny Gemma 4 mmproj (``drop`` leaves a tensor out); return its exact weights
    (numpy order)."""
    c = {**GEMMA4V_VISION, **over}
    rng = np.random.default_rng(4444)
    w = _clip_writer(path, "gemma4v", "gelu_quick", c, text_dim)
    if c["merge"] != 3:
        w.add_uint32("clip.vision.projector.scale_factor", c["merge"])
    t = _Tensors(w, rng, qt, drop=drop, mat_scale=0.12)
    weights = t.weights
    d, p, hd = c["dim"], c["patch"], c["dim"] // c["heads"]

    put, mat, vec = t.put, t.mat, t.vec

    put("v.patch_embd.weight", rng.normal(0, 0.1, size=(d, 3, p, p)))
    # GGUF shape [dim, pos, 2]: the column table, then the row table.
    put("v.position_embd.weight", rng.normal(0, 0.5, size=(2, c["pos"], d)))
    for i in range(c["layers"]):
        b = f"v.blk.{i}."
        vec(b + "ln1.weight", d)
        for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
            mat(b + t + ".weight", d, d, scale=0.15)
        vec(b + "attn_q_norm.weight", hd)
        vec(b + "attn_k_norm.weight", hd)
        vec(b + "attn_post_norm.weight", d, 0.5)
        vec(b + "ln2.weight", d)
        mat(b + "ffn_gate.weight", c["ff"], d)
        mat(b + "ffn_up.weight", c["ff"], d)
        mat(b + "ffn_down.weight", d, c["ff"])
        vec(b + "ffn_post_norm.weight", d, 0.5)
        put(b + "out_scale.weight", np.array([0.8 + 0.1 * i]))
    vec("v.std_bias", d, 0.0, 0.5)
    vec("v.std_scale", d, 1.0, 0.2)
    mat("mm.input_projection.weight", text_dim, d, scale=0.2)
    for (m, side), (lo, hi) in GEMMA4V_CLAMPS.items():
        put(f"{m}.{side}_min", np.array([lo]))
        put(f"{m}.{side}_max", np.array([hi]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def _neox_2d(x: np.ndarray, gw: int, heads: int, theta: float = 100.0) -> np.ndarray:
    """Gemma 4's tower RoPE: in each head, the first half turned by the patch's column and the
    second by its row, each a NeoX RoPE of hd/2 dimensions (pair i with pair i + hd/4,
    frequencies base^(-4i/hd))."""
    n, d = x.shape
    hd = d // heads
    q = hd // 4
    cols, rows = np.arange(n) % gw, np.arange(n) // gw
    out = x.reshape(n, heads, hd).copy()
    freq = theta ** (-2.0 * np.arange(q) / (hd // 2))
    for half, pos in ((0, cols), (1, rows)):
        ang = pos[:, None] * freq[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        base = half * hd // 2
        x0, x1 = out[:, :, base : base + q].copy(), out[:, :, base + q : base + 2 * q].copy()
        out[:, :, base : base + q] = x0 * cos - x1 * sin
        out[:, :, base + q : base + 2 * q] = x0 * sin + x1 * cos
    return out.reshape(n, d)


def reference_gemma4v_image(W: dict[str, np.ndarray], pixels: np.ndarray, **over: Any) -> np.ndarray:
    """Float64 tower + projector over planar normalized pixels (3, H, W): (tokens, text_dim)."""
    c = {**GEMMA4V_VISION, **over}
    X = {k: v.astype(np.float64) for k, v in W.items()}
    p, d, H, eps, k = c["patch"], c["dim"], c["heads"], c["eps"], c["merge"]
    _, hh, ww = pixels.shape
    gh, gw = hh // p, ww // p
    n, hd = gh * gw, d // H
    clamps = GEMMA4V_CLAMPS

    def lin(name: str, x: np.ndarray) -> np.ndarray:
        if (name, "input") in clamps:
            x = np.clip(x, *clamps[(name, "input")])
        y = x @ X[name + ".weight"].T
        return np.clip(y, *clamps[(name, "output")]) if (name, "output") in clamps else y

    def rms(x: np.ndarray, wt: np.ndarray | float = 1.0) -> np.ndarray:
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * wt

    px = pixels.astype(np.float64) * 2 - 1
    patches = px.reshape(3, gh, p, gw, p).transpose(1, 3, 0, 2, 4).reshape(n, 3 * p * p)
    x = patches @ X["v.patch_embd.weight"].reshape(d, -1).T
    tab = X["v.position_embd.weight"]
    x = x + tab[0][np.arange(n) % gw] + tab[1][np.arange(n) // gw]
    for i in range(c["layers"]):
        b = f"v.blk.{i}."
        h = rms(x, X[b + "ln1.weight"])
        q, kk, v = (lin(b + t, h) for t in ("attn_q", "attn_k", "attn_v"))
        q = rms(q.reshape(n, H, hd), X[b + "attn_q_norm.weight"]).reshape(n, d)
        kk = rms(kk.reshape(n, H, hd), X[b + "attn_k_norm.weight"]).reshape(n, d)
        q, kk = _neox_2d(q, gw, H), _neox_2d(kk, gw, H)
        v = rms(v.reshape(n, H, hd)).reshape(n, d)
        att = np.zeros((n, d))
        for j in range(H):
            s = slice(j * hd, (j + 1) * hd)
            sc = q[:, s] @ kk[:, s].T
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            att[:, s] = pr @ v[:, s]
        x = x + rms(lin(b + "attn_out", att), X[b + "attn_post_norm.weight"])
        h = rms(x, X[b + "ln2.weight"])
        g, u = lin(b + "ffn_gate", h), lin(b + "ffn_up", h)
        x = x + rms(lin(b + "ffn_down", g / (1 + np.exp(-1.702 * g)) * u), X[b + "ffn_post_norm.weight"])
        x = x * X[b + "out_scale.weight"][0]
    oy, ox = gh // k, gw // k
    pooled = x.reshape(oy, k, ox, k, d).mean(axis=(1, 3)).reshape(oy * ox, d) * np.sqrt(d)
    pooled = (pooled - X["v.std_bias"]) * X["v.std_scale"]
    return lin("mm.input_projection", rms(pooled))
