"""Tiny random-weight mmproj files (llama.cpp's ``clip`` architecture) written with
gguf.GGUFWriter, with a NumPy float64 reference of the tower and projector to check the engine
against. Gemma 3 only so far: SigLIP (LayerNorm with bias, full attention, GELU MLP, post norm),
then average pooling, the soft-embedding RMS norm and the projection."""

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
    weights: dict[str, np.ndarray] = {}
    d, p, g = c["dim"], c["patch"], c["image_size"] // c["patch"]

    def put(name: str, arr: np.ndarray, kind: QT = QT.F32, as_name: str | None = None) -> None:
        data, exact = encode_weight(arr, kind, rng) if arr.ndim == 2 and kind != QT.F32 else (arr.astype(np.float32), arr.astype(np.float32))
        weights[name] = exact
        if data.dtype == np.uint8:
            w.add_tensor(as_name or name, data, raw_dtype=kind)
        else:
            w.add_tensor(as_name or name, data)

    def mat(name: str, rows: int, cols: int, kind: QT = qt, scale: float = 0.1, as_name: str | None = None) -> None:
        put(name, rng.normal(0, scale, size=(rows, cols)), kind, as_name)

    def vec(name: str, n: int, mean: float = 1.0, std: float = 0.1) -> None:
        put(name, mean + rng.normal(0, std, size=n))

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
    weights: dict[str, np.ndarray] = {}
    d, p, m = c["dim"], c["patch"], c["merge"]

    def put(name: str, arr: np.ndarray, kind: QT = QT.F32) -> None:
        data, exact = encode_weight(arr, kind, rng) if arr.ndim == 2 and kind != QT.F32 else (arr.astype(np.float32), arr.astype(np.float32))
        weights[name] = exact
        if data.dtype == np.uint8:
            w.add_tensor(name, data, raw_dtype=kind)
        else:
            w.add_tensor(name, data)

    def mat(name: str, rows: int, cols: int, kind: QT = qt, scale: float = 0.1) -> None:
        put(name, rng.normal(0, scale, size=(rows, cols)), kind)

    def vec(name: str, n: int, mean: float = 1.0, std: float = 0.1) -> None:
        put(name, mean + rng.normal(0, std, size=n))

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
    weights: dict[str, np.ndarray] = {}
    d, p, g, s = c["dim"], c["patch"], c["image_size"] // c["patch"], c["scale"] or 2

    def put(name: str, arr: np.ndarray, kind: QT = QT.F32) -> None:
        data, exact = encode_weight(arr, kind, rng) if arr.ndim == 2 and kind != QT.F32 else (arr.astype(np.float32), arr.astype(np.float32))
        weights[name] = exact
        if data.dtype == np.uint8:
            w.add_tensor(name, data, raw_dtype=kind)
        else:
            w.add_tensor(name, data)

    def mat(name: str, rows: int, cols: int, kind: QT = qt, scale: float = 0.1) -> None:
        put(name, rng.normal(0, scale, size=(rows, cols)), kind)

    def vec(name: str, n: int, mean: float = 1.0, std: float = 0.1) -> None:
        put(name, mean + rng.normal(0, std, size=n))

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
