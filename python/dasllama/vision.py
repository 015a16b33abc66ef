"""Images in: mmproj files (llama.cpp's ``clip`` architecture), image decoding and preprocessing
as llama.cpp's ``tools/mtmd`` does it, and an image's embeddings from the vision tower.

Projector types: ``gemma3`` (SigLIP at a fixed size, 2-D average pooling, soft-embedding norm,
projection; the image's rows see each other), ``gemma4v`` (Gemma 4: the image at its own aspect
ratio, 70 to 1120 tokens of 3 x 3 patches, a tower with learned column and row tables and a 2-D
RoPE, average pooling, a standardisation, an RMS norm and the projection, between ``<|image>``
and ``<image|>``; its rows see each other in the text model's sliding-window layers, but for
E2B and E4B, whose are causal) and ``pixtral`` (Pixtral and Mistral Small 3.x: the
image at its own aspect ratio, a 2-D RoPE tower, patch merger, GELU MLP, a ``[IMG_BREAK]`` row
after each row of tokens, causal), ``qwen2vl_merger``/``qwen2.5vl_merger`` (Qwen2-VL and
Qwen2.5-VL: the image at its own aspect ratio in 2 x 2 patch blocks, one token each, causal, its
rows on M-RoPE axes in the text model: each row at the image's first position plus its row and
column, the text after it going on from there plus the larger side), ``qwen3vl_merger`` (Qwen3-VL:
the same layout and positions, a tower with learned positions and "deepstack" mergers whose
features ride in each image row after its embedding, added by the text model after its first
layers; a row is ``text_dim`` = the text width times 1 + the deepstack count) and ``idefics3`` (SmolVLM:
the image cut into tiles of the tower's size plus an overview, each a SigLIP pass, a pixel
shuffle and a linear map, laid out between row and column markers, causal)."""

from __future__ import annotations

import hashlib
import io
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import _native
from .devices import Device, _open
from .devices import device as resolve_device
from .errors import GgufError, UnsupportedModelError
from .gguf_file import meta_section, read_header
from .runtime import Runtime, default_runtime

log = logging.getLogger("dasllama")

# How each projector's image is marked in the prompt (mtmd.cpp's img_beg / img_end).
_MARKERS: dict[str, tuple[str, str]] = {
    "gemma3": ("<start_of_image>", "<end_of_image>"),
    "gemma4v": ("<|image>", "<image|>"),
    "pixtral": ("", "[IMG_END]"),
    "qwen2vl_merger": ("<|vision_start|>", "<|vision_end|>"),
    "qwen2.5vl_merger": ("<|vision_start|>", "<|vision_end|>"),
    "qwen3vl_merger": ("<|vision_start|>", "<|vision_end|>"),
    "idefics3": ("", ""),
}
# A dynamic-size tower's token budget per image (clip.cpp's set_limit_image_tokens), in merged
# tokens.
_TOKENS: dict[str, tuple[int, int]] = {"gemma4v": (70, 1120), "pixtral": (8, 1024), "qwen2vl_merger": (8, 4096), "qwen2.5vl_merger": (8, 4096), "qwen3vl_merger": (8, 4096)}
# Idefics3's longest image side before tiling (clip.cpp's image_longest_edge).
_LONGEST_EDGE_KEY = "clip.vision.preproc_image_size"
# Images past this many pixels are refused before decoding (a decompression bomb's guard).
MAX_PIXELS = 64_000_000


class ImageError(ValueError):
    """The bytes are not an image this build decodes (PNG, JPEG, WebP, GIF), or it is too large."""


@dataclass(frozen=True)
class Projector:
    """A loaded mmproj file: its vision tower and how its images enter the prompt."""

    native: _native.Vision
    path: Path
    metadata: dict[str, Any]
    # Whether the tower goes to the model's device with it (llama-server's --no-mmproj-offload
    # keeps it on the CPU).
    offload: bool = True

    @property
    def placement(self) -> dict[str, Any] | None:
        """What the tower's device holds and has done (device, matrices, left_on_cpu,
        weight_bytes, matmuls, attentions, failed); None while it runs on the CPU. It follows
        its model (``Model.to``) unless loaded with ``mmproj_offload=False``."""
        return _native.vision_placement(self.native)

    def to(self, device: str | Device) -> str:
        """Run the tower's matmuls and attention on ``device`` ("vulkan", "vulkan:N", a
        :class:`Device`), or on the host again ("cpu"). A model's projector follows the model
        (``Model.to``); this places one loaded alone (``load_mmproj``). Returns "" where it went,
        else why it stays on the host (no matrix fits the budget, or none is in a format the
        device reads)."""
        d = resolve_device(device)
        return _native.place_vision(self.native, None if d.kind == "cpu" else _open(d), 0)

    @property
    def projector_type(self) -> str:
        return self.native.projector_type

    @property
    def image_size(self) -> int:
        return self.native.image_size

    @property
    def n_tokens(self) -> int:
        """Rows one image takes in the prompt (for a tower that takes any size, Pixtral's: an
        image_size square's; ``native.n_tokens_for(width, height)`` for another size)."""
        return self.native.n_tokens

    @property
    def text_dim(self) -> int:
        """Values of each image row: the text model's width (times 1 + its deepstack mergers for
        Qwen3-VL, whose rows carry their features after the embedding)."""
        return self.native.text_dim

    @property
    def non_causal(self) -> bool:
        """Whether an image's rows see each other in the text model (mtmd_decode_use_non_causal)."""
        return self.native.non_causal

    @property
    def markers(self) -> tuple[str, str]:
        """The text before and after an image's rows."""
        return _MARKERS[self.projector_type]

    def __repr__(self) -> str:
        return repr(self.native)


def load_mmproj(path: str | os.PathLike[str], runtime: Runtime | None = None, offload: bool = True) -> Projector:
    """Load an mmproj GGUF (its passes run on ``runtime``, else the default runtime; on its
    model's device too where ``offload``, once the model is placed on one). Raises
    GgufError for a file that is not one (not the ``clip`` architecture, no projector type) and
    UnsupportedModelError for a projector type this build does not run."""
    p = Path(path).expanduser()
    hdr = read_header(p)
    meta = hdr.metadata
    arch = meta.get("general.architecture")
    if arch != "clip":
        raise GgufError(f"{p}: general.architecture is {arch!r}, not 'clip': this is not an mmproj file (a vision projector for a model)")
    ptype = meta.get("clip.vision.projector_type", meta.get("clip.projector_type"))
    if not isinstance(ptype, str):
        raise GgufError(f"{p}: clip.projector_type is missing; this is not an mmproj file")
    if ptype not in _MARKERS:
        raise UnsupportedModelError(f"{p}: projector type '{ptype}' is not supported (supported: {', '.join(sorted(_MARKERS))})")
    if ptype == "idefics3" and not isinstance(meta.get(_LONGEST_EDGE_KEY), int):
        # The older conversions' other preprocessing path (calc_size_preserved_ratio) is not ours.
        raise UnsupportedModelError(f"{p}: this idefics3 mmproj has no {_LONGEST_EDGE_KEY} (an older conversion): convert it again with a current llama.cpp")
    clip = meta_section(meta, "clip")
    tensors = [(t.name, t.type_id, t.shape, t.offset) for t in hdr.tensors]
    rt = runtime if runtime is not None else default_runtime()
    return Projector(_native.load_vision(rt._native, str(p), clip, tensors), p, meta, offload)


def find_sidecar(model_path: Path) -> Path | None:
    """The ``mmproj*.gguf`` beside a model, as llama-server's users lay them out: the one such file
    in its folder (None when there is none, or several and none named after the model)."""
    found = sorted(q for q in model_path.parent.glob("mmproj*.gguf") if q != model_path)
    if len(found) == 1:
        return found[0]
    stem = model_path.stem.lower()
    named = [q for q in found if q.stem.lower().removeprefix("mmproj-").removeprefix("mmproj") in stem]
    return named[0] if len(named) == 1 else None


def decode_image(data: bytes) -> Any:
    """Decode PNG, JPEG, WebP or GIF (its first frame) bytes into an RGB Pillow image."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        fmt = img.format
        if fmt not in ("PNG", "JPEG", "WEBP", "GIF"):
            raise ImageError(f"unsupported image format {fmt or 'unknown'} (use PNG, JPEG, WebP or GIF)")
        w, h = img.size
        if w * h > MAX_PIXELS:
            raise ImageError(f"the image is {w} x {h} pixels, more than the {MAX_PIXELS} this server decodes")
        img.seek(0)
        return img.convert("RGB")
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError, ValueError) as e:
        raise ImageError(f"not a decodable image: {e}") from None


def target_size(proj: Projector, width: int, height: int) -> tuple[int, int]:
    """The size (width, height) an image of ``width`` x ``height`` is preprocessed to: the tower's
    square for a fixed-size projector; for Gemma 4, Pixtral and Qwen-VL, clip.cpp's
    ``calc_size_preserved_ratio``: each side rounded to a multiple of patch x merge, then scaled
    (keeping the aspect ratio) into the projector's budget (70 to 1120 tokens for Gemma 4, 8 to
    1024 for Pixtral, 8 to 4096 for Qwen-VL), f32 arithmetic as there."""
    nat = proj.native
    if not nat.dynamic_size:
        return proj.image_size, proj.image_size
    f = nat.patch_size * nat.merge
    lo, hi = (n * f * f for n in _TOKENS[proj.projector_type])
    f32 = np.float32

    def by(x: Any, how: Any) -> int:
        return int(how(f32(x) / f32(f))) * f

    def half_up(x: Any) -> float:  # std::round: halves away from zero
        return math.floor(x + 0.5)

    w_bar, h_bar = max(f, by(width, half_up)), max(f, by(height, half_up))
    if w_bar * h_bar > hi:
        beta = np.sqrt(f32(height) * f32(width) / f32(hi), dtype=np.float32)
        h_bar, w_bar = max(f, by(f32(height) / beta, math.floor)), max(f, by(f32(width) / beta, math.floor))
    elif w_bar * h_bar < lo:
        beta = np.sqrt(f32(lo) / (f32(height) * f32(width)), dtype=np.float32)
        h_bar, w_bar = by(f32(height) * beta, math.ceil), by(f32(width) * beta, math.ceil)
    return w_bar, h_bar


def preprocess_sized(img: Any, proj: Projector) -> tuple[np.ndarray, int, int]:
    """An RGB Pillow image as the tower takes it: ((3 * height * width,) float32 planar and
    normalized, width, height).

    As mtmd's preprocessors with llama.cpp's default padding: scaled to fit ``target_size``
    keeping its aspect ratio (Pillow's resampling, which clip.cpp reproduces: bilinear for
    Gemma 3, bicubic for Gemma 4, Pixtral and Qwen-VL; sizes rounded up), centered on black, then x / 255, minus the
    file's mean, over its std."""
    from PIL import Image

    if img.mode != "RGB":
        img = img.convert("RGB")
    w, h = img.size
    tw, th = target_size(proj, w, h)
    if (w, h) != (tw, th):
        resample = Image.Resampling.BICUBIC if proj.native.dynamic_size else Image.Resampling.BILINEAR
        scale = min(np.float32(tw) / np.float32(w), np.float32(th) / np.float32(h))
        nw = min(math.ceil(np.float32(w) * scale), tw)
        nh = min(math.ceil(np.float32(h) * scale), th)
        resized = img if (nw, nh) == (w, h) else img.resize((nw, nh), resample)
        canvas = Image.new("RGB", (tw, th), (0, 0, 0))
        canvas.paste(resized, ((tw - nw) // 2, (th - nh) // 2))
        img = canvas
    return _normalize(img, proj), tw, th


def preprocess(img: Any, proj: Projector) -> np.ndarray:
    """``preprocess_sized``'s pixels alone (for a fixed-size tower: 3 x image_size x image_size)."""
    return preprocess_sized(img, proj)[0]


def _normalize(img: Any, proj: Projector) -> np.ndarray:
    x = np.asarray(img, dtype=np.float32) / np.float32(255.0)
    mean = np.asarray(proj.native.image_mean, dtype=np.float32)
    std = np.asarray(proj.native.image_std, dtype=np.float32)
    x = (x - mean) / std
    return np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32).reshape(-1)


def encode_pixels(proj: Projector, pixels: np.ndarray, width: int | None = None, height: int | None = None) -> np.ndarray:
    """The tower and projector over preprocessed pixels (``width`` x ``height``, by default the
    tower's own size): (n_tokens, text_dim) float32."""
    return _native.encode_image(proj.native, np.ascontiguousarray(pixels, dtype=np.float32).reshape(-1), width, height)


def idefics3_tiles(img: Any, proj: Projector) -> tuple[int, int, list[np.ndarray]]:
    """An RGB Pillow image as Idefics3's tower takes it (mtmd's idefics3 preprocessor): scaled
    (Lanczos, as Pillow and clip.cpp) so its longest side is the file's preprocessing size and
    the other even, then up to whole tiles of the tower's size; (tiles per row, rows, each
    tile's normalized pixels row by row, then the overview's: the whole picture at one tile)."""
    from PIL import Image

    if img.mode != "RGB":
        img = img.convert("RGB")
    tile, longest = proj.image_size, int(proj.metadata[_LONGEST_EDGE_KEY])
    w, h = img.size
    aspect = w / h
    if w >= h:
        rw, rh = longest, int(longest / aspect)
        rh = max(2, rh + rh % 2)
    else:
        rw, rh = int(longest * aspect), longest
        rw = max(2, rw + rw % 2)
    gx, gy = -(-rw // tile), -(-rh // tile)
    lz = Image.Resampling.LANCZOS

    def fit(im: Any, size: tuple[int, int]) -> Any:
        return im if im.size == size else im.resize(size, lz)

    refined = fit(fit(img, (rw, rh)), (gx * tile, gy * tile))
    tiles = [refined.crop((x * tile, y * tile, (x + 1) * tile, (y + 1) * tile)) for y in range(gy) for x in range(gx)]
    return gx, gy, [_normalize(t, proj) for t in [*tiles, fit(refined, (tile, tile))]]


# A piece of an image's place in the prompt: text (control tokens parsed), token ids as they
# are, or rows of embeddings with their M-RoPE grid (None: positioned as text).
_Part = str | list[int] | tuple[np.ndarray, tuple[int, int] | None]


def _lookup(m: Any, text: str) -> int:
    """The first token whose piece is ``text`` (mtmd's lookup_token)."""
    cache: dict[str, int] = m.__dict__.setdefault("_piece_ids", {})
    if text not in cache:
        want = text.encode()
        found = next((i for i in range(m.n_vocab) if _native.token_piece_bytes(m._native, i, True) == want), None)
        if found is None:
            raise ValueError(f"{m.path.name} has no token {text!r}, which its projector's image layout needs")
        cache[text] = found
    return cache[text]


def _image_parts(m: Any, proj: Projector, img: Any) -> list[_Part]:
    """What one image becomes in the prompt. Gemma 3 and Pixtral: its begin marker, its rows, its
    end marker. Idefics3 (mtmd.cpp's MTMD_SLICE_TMPL_IDEFICS3): each tile after
    ``<fake_token_around_image><row_Y_col_X>``, a newline after each row of tiles but the last,
    then a blank line (one token), ``<fake_token_around_image><global-img>``, the overview, ``<fake_token_around_image>``."""
    if proj.projector_type != "idefics3":
        beg, end = proj.markers
        return [p for p in (beg, _encode_placed(proj, img), end) if not isinstance(p, str) or p]
    gx, gy, pixels = idefics3_tiles(img, proj)
    rows = [encode_pixels(proj, px) for px in pixels]
    fake = _lookup(m, "<fake_token_around_image>")
    parts: list[_Part] = []
    for y in range(gy):
        for x in range(gx):
            parts += [f"<fake_token_around_image><row_{y + 1}_col_{x + 1}>", (rows[y * gx + x], None)]
        if y < gy - 1:
            parts.append([_lookup(m, "\n")])
    return [*parts, [_lookup(m, "\n\n"), fake, _lookup(m, "<global-img>")], (rows[-1], None), [fake]]


def encode_image(proj: Projector, image: bytes | Any) -> np.ndarray:
    """One image (encoded bytes or a Pillow image) to its prompt rows: (n_tokens, text_dim). For
    Idefics3, every tile's rows row by row, then the overview's (``tokenize_with_images`` puts
    the markers between them)."""
    img = decode_image(bytes(image)) if isinstance(image, (bytes, bytearray, memoryview)) else image
    if proj.projector_type == "idefics3":
        return np.concatenate([encode_pixels(proj, px) for px in idefics3_tiles(img, proj)[2]])
    return _encode_placed(proj, img)[0]


def _encode_placed(proj: Projector, img: Any) -> tuple[np.ndarray, tuple[int, int] | None]:
    """A Pillow image's rows through a one-pass tower (not Idefics3's tiles) and its M-RoPE grid
    (tokens per row, rows; None where its rows are positioned as text)."""
    pixels, w, h = preprocess_sized(img, proj)
    return encode_pixels(proj, pixels, w, h), proj.native.mrope_grid(w, h)


# Where an image goes in a prompt's text (llama.cpp's mtmd_default_marker).
MEDIA_MARKER = "<__media__>"


@dataclass
class ImagePrompt:
    """A prompt with images as the text model takes it: token ids (an image's rows hold a
    placeholder id), the rows that take given values instead (``values``: one row of the model's
    width each), each image's span of rows (first row, rows), and whether an image's rows see
    each other (``non_causal``: Gemma 3's do) or are causal as text, and per image its M-RoPE
    grid (``grids``: tokens per row and rows, Qwen-VL's; None where its rows are positioned as
    text)."""

    ids: list[int]
    rows: list[int]
    values: np.ndarray
    spans: list[tuple[int, int]]
    non_causal: bool = True
    grids: list[tuple[int, int] | None] = field(default_factory=list)
    # Seconds the vision tower took over the images (their decoding and preprocessing included):
    # the server's /metrics and `timings` report it.
    encode_s: float = 0.0

    def images(self) -> list[tuple[int, np.ndarray, bool, tuple[int, int] | None]]:
        """Per image, (its first row, its rows' values, whether they see each other, its M-RoPE
        grid): what ``PendingReq.images`` takes."""
        out, at = [], 0
        for i, (first, n) in enumerate(self.spans):
            out.append((first, self.values[at : at + n], self.non_causal, self.grids[i] if i < len(self.grids) else None))
            at += n
        return out

    @property
    def n_pos(self) -> int:
        """The positions the prompt takes (mtmd's ``n_past`` after it): its rows, less what
        images on M-RoPE axes save (an nx x ny image takes max(nx, ny) positions)."""
        return len(self.ids) - sum(nx * ny - max(nx, ny) for g in self.grids if g is not None for nx, ny in [g])


def placeholder_ids(values: np.ndarray, n_vocab: int) -> list[int]:
    """The token ids an image's rows hold: derived from a hash of its embeddings (a function of
    its pixels), so that the prefix cache, which keys pages by tokens, keys an image's pages by
    the image: a later turn about the same picture attaches them, another picture never does."""
    raw = np.ascontiguousarray(values, dtype=np.float32).tobytes()
    seed = hashlib.sha256(raw).digest()
    out: list[int] = []
    block = 0
    while len(out) < len(values):
        h = hashlib.sha256(seed + block.to_bytes(8, "little")).digest()
        out += [int.from_bytes(h[i : i + 4], "little") % n_vocab for i in range(0, 32, 4)]
        block += 1
    return out[: len(values)]


def tokenize_with_images(m: Any, text: str, images: list[Any], add_bos: bool | None = None, marker: str = MEDIA_MARKER) -> ImagePrompt:
    """Tokenize ``text`` (control tokens parsed, as mtmd does) with ``images`` (encoded bytes or
    Pillow images, one per ``marker`` in order) in place of the markers: each becomes its
    projector's begin marker, its rows, and its end marker (Gemma 3: ``<start_of_image>``, 256
    rows, ``<end_of_image>``). Raises ValueError for a model without a projector, or markers and
    images that do not pair up; ImageError for an image that does not decode."""
    def encode(m: Any, text: str, add_bos: bool | None, special: bool) -> list[int]:
        # The native call itself: dasllama.model builds on this module (a model holds its
        # projector), so this one does not import it back.
        return _native.encode(m._native, text, add_bos, special)

    proj: Projector | None = m.projector
    pieces = text.split(marker)
    if len(pieces) - 1 != len(images):
        raise ValueError(f"the prompt has {len(pieces) - 1} image markers ({marker}) but {len(images)} images were given")
    if images and proj is None:
        raise ValueError(f"{m.path.name} takes no images: load it with its mmproj file (load_model(..., mmproj=...))")
    ids: list[int] = []
    rows: list[int] = []
    values: list[np.ndarray] = []
    spans: list[tuple[int, int]] = []
    grids: list[tuple[int, int] | None] = []
    t0 = time.perf_counter()
    laid_out = [_image_parts(m, proj, decode_image(bytes(img)) if isinstance(img, (bytes, bytearray, memoryview)) else img) for img in images] if proj is not None else []
    encode_s = time.perf_counter() - t0
    for i, piece in enumerate(pieces):
        if i == 0 or piece:
            ids += encode(m, piece, add_bos=add_bos if i == 0 else False, special=True)
        for part in laid_out[i] if i < len(laid_out) else []:
            if isinstance(part, str):
                ids += encode(m, part, add_bos=False, special=True)
            elif isinstance(part, list):
                ids += part
            else:
                vals, grid = part
                spans.append((len(ids), len(vals)))
                grids.append(grid)
                rows += range(len(ids), len(ids) + len(vals))
                ids += placeholder_ids(vals, m.n_vocab)
                values.append(vals)
    dim = proj.text_dim if proj is not None else 0
    non_causal = proj.non_causal if proj is not None else True
    return ImagePrompt(ids, rows, np.concatenate(values) if values else np.zeros((0, dim), np.float32), spans, non_causal, grids, encode_s)


def eval_image_prompt(m: Any, s: Any, p: ImagePrompt, all: bool = False) -> np.ndarray:
    """Run ``p`` at the session's position (``_native.eval_embeds``): logits after the last row,
    or after every row where ``all``. A non-causal image's rows see each other (llama.cpp
    decodes Gemma 3's images so); a causal one's are causal as text (Pixtral's). Images on M-RoPE
    axes (Qwen-VL's) place their rows and the text after them (the session's ``n_pos``)."""
    values = np.ascontiguousarray(p.values, dtype=np.float32).reshape(len(p.rows), -1)
    spans = [(a, n) for a, n in p.spans] if p.non_causal else []
    grids = [(a, g[0], g[1]) for (a, _), g in zip(p.spans, p.grids, strict=False) if g is not None]  # an ImagePrompt made by hand may carry no grids
    return _native.eval_embeds(m._native, s, list(p.ids), list(p.rows), values, spans, all, grids)
