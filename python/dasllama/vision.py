"""Images in: mmproj files (llama.cpp's ``clip`` architecture), image decoding and preprocessing
as llama.cpp's ``tools/mtmd`` does it, and an image's embeddings from the vision tower.

Projector types: ``gemma3`` (SigLIP, 2-D average pooling, soft-embedding norm, projection)."""

from __future__ import annotations

import hashlib
import io
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import _native
from .errors import GgufError, UnsupportedModelError
from .gguf_file import meta_section, read_header
from .runtime import Runtime, default_runtime

log = logging.getLogger("dasllama")

# How each projector's image is marked in the prompt (mtmd.cpp's img_beg / img_end).
_MARKERS: dict[str, tuple[str, str]] = {"gemma3": ("<start_of_image>", "<end_of_image>")}
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

    @property
    def projector_type(self) -> str:
        return self.native.projector_type

    @property
    def image_size(self) -> int:
        return self.native.image_size

    @property
    def n_tokens(self) -> int:
        """Rows one image takes in the prompt."""
        return self.native.n_tokens

    @property
    def text_dim(self) -> int:
        return self.native.text_dim

    @property
    def markers(self) -> tuple[str, str]:
        """The text before and after an image's rows."""
        return _MARKERS[self.projector_type]

    def __repr__(self) -> str:
        return repr(self.native)


def load_mmproj(path: str | os.PathLike[str], runtime: Runtime | None = None) -> Projector:
    """Load an mmproj GGUF (its passes run on ``runtime``, else the default runtime). Raises
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
    clip = meta_section(meta, "clip")
    tensors = [(t.name, t.type_id, t.shape, t.offset) for t in hdr.tensors]
    rt = runtime if runtime is not None else default_runtime()
    return Projector(_native.load_vision(rt._native, str(p), clip, tensors), p, meta)


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


def preprocess(img: Any, proj: Projector) -> np.ndarray:
    """An RGB Pillow image as the tower takes it: (3 * size * size,) float32, planar, normalized.

    As mtmd's fixed-size preprocessor with llama.cpp's default padding: scaled to fit the square
    keeping its aspect ratio (Pillow-compatible bilinear resampling, sizes rounded up), centered
    on black, then x / 255, minus the file's mean, over its std."""
    from PIL import Image

    size = proj.image_size
    if img.mode != "RGB":
        img = img.convert("RGB")
    w, h = img.size
    if (w, h) != (size, size):
        scale = min(np.float32(size) / np.float32(w), np.float32(size) / np.float32(h))
        nw = min(math.ceil(np.float32(w) * scale), size)
        nh = min(math.ceil(np.float32(h) * scale), size)
        resized = img if (nw, nh) == (w, h) else img.resize((nw, nh), Image.Resampling.BILINEAR)
        canvas = Image.new("RGB", (size, size), (0, 0, 0))
        canvas.paste(resized, ((size - nw) // 2, (size - nh) // 2))
        img = canvas
    x = np.asarray(img, dtype=np.float32) / np.float32(255.0)
    mean = np.asarray(proj.native.image_mean, dtype=np.float32)
    std = np.asarray(proj.native.image_std, dtype=np.float32)
    x = (x - mean) / std
    return np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32).reshape(-1)


def encode_pixels(proj: Projector, pixels: np.ndarray) -> np.ndarray:
    """The tower and projector over preprocessed pixels: (n_tokens, text_dim) float32."""
    return _native.encode_image(proj.native, np.ascontiguousarray(pixels, dtype=np.float32).reshape(-1))


def encode_image(proj: Projector, image: bytes | Any) -> np.ndarray:
    """One image (encoded bytes or a Pillow image) to its prompt rows: (n_tokens, text_dim)."""
    img = decode_image(bytes(image)) if isinstance(image, (bytes, bytearray, memoryview)) else image
    return encode_pixels(proj, preprocess(img, proj))


# Where an image goes in a prompt's text (llama.cpp's mtmd_default_marker).
MEDIA_MARKER = "<__media__>"


@dataclass
class ImagePrompt:
    """A prompt with images as the text model takes it: token ids (an image's rows hold a
    placeholder id), the rows that take given values instead (``values``: one row of the model's
    width each) and the spans of rows that see each other (each image's: first row, rows)."""

    ids: list[int]
    rows: list[int]
    values: np.ndarray
    spans: list[tuple[int, int]]

    def images(self) -> list[tuple[int, np.ndarray]]:
        """Per image, (its first row, its rows' values): what ``PendingReq.images`` takes."""
        out, at = [], 0
        for first, n in self.spans:
            out.append((first, self.values[at : at + n]))
            at += n
        return out


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
    embedded = [encode_image(proj, img) for img in images] if proj is not None else []
    for i, piece in enumerate(pieces):
        if i == 0 or piece:
            ids += encode(m, piece, add_bos=add_bos if i == 0 else False, special=True)
        if i < len(embedded):
            beg, end = proj.markers  # type: ignore[union-attr]
            ids += encode(m, beg, add_bos=False, special=True)
            e = embedded[i]
            spans.append((len(ids), len(e)))
            rows += range(len(ids), len(ids) + len(e))
            ids += placeholder_ids(e, m.n_vocab)
            values.append(e)
            ids += encode(m, end, add_bos=False, special=True)
    dim = proj.text_dim if proj is not None else 0
    return ImagePrompt(ids, rows, np.concatenate(values) if values else np.zeros((0, dim), np.float32), spans)


def eval_image_prompt(m: Any, s: Any, p: ImagePrompt, all: bool = False) -> np.ndarray:
    """Run ``p`` at the session's position (``_native.eval_embeds``): logits after the last row,
    or after every row where ``all``. The image rows see each other (llama.cpp decodes Gemma 3's
    images non-causally)."""
    values = np.ascontiguousarray(p.values, dtype=np.float32).reshape(len(p.rows), -1)
    return _native.eval_embeds(m._native, s, list(p.ids), list(p.rows), values, [(a, n) for a, n in p.spans], all)
