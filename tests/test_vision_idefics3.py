"""Idefics3 (SmolVLM) against a NumPy float64 reference: one tile through the SigLIP tower, the
pixel shuffle and the projection; the tiling of pictures of several shapes; and the prompt's
layout of tiles, row breaks and the overview (llama.cpp's own path is
tests/test_vision_golden.py's idefics3 golden)."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

import dasllama as dl
from dasllama import vision
from dasllama.errors import GgufError, UnsupportedModelError
from serverproc import start, stop
from synthetic import write_model
from synthetic_vision import IDEFICS3_VISION, reference_idefics3_tile, rel_err, write_idefics3_mmproj

SPECIALS = ("<fake_token_around_image>", "<global-img>", "<row_1_col_1>", "<row_1_col_2>", "<row_2_col_1>", "<row_2_col_2>", "\n\n")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    d = tmp_path_factory.mktemp("idefics3")
    text, proj = d / "smolvlm-tiny.gguf", d / "mmproj-smolvlm-tiny.gguf"
    write_model(text, arch="llama", specials=SPECIALS, ctx=256)
    return text, proj, write_idefics3_mmproj(proj)


def test_a_tile_matches_the_reference(files: tuple[Path, Path, dict[str, np.ndarray]]) -> None:
    _, proj_path, W = files
    proj = vision.load_mmproj(proj_path)
    assert (proj.projector_type, proj.n_tokens, proj.non_causal) == ("idefics3", 16, False)
    s = IDEFICS3_VISION["image_size"]
    pixels = np.random.default_rng(3).uniform(-1, 1, size=(3, s, s)).astype(np.float32)
    got = vision.encode_pixels(proj, pixels)
    want = reference_idefics3_tile(W, pixels)
    assert got.shape == want.shape == (16, proj.text_dim)
    assert rel_err(got, want) < 2e-4


def test_a_tile_that_is_not_whole_patches(tmp_path: Path) -> None:
    """SmolVLM2's towers take 384-pixel tiles in patches of 14: the convolution reads 27 patches
    a side and never the last 6 pixels. Here 35-pixel tiles in patches of 4: the 32-pixel tile's
    result from the first 32 rows and columns, whatever the last 3 hold."""
    path = tmp_path / "mmproj-odd.gguf"
    W = write_idefics3_mmproj(path, image_size=35)
    proj = vision.load_mmproj(path)
    assert proj.n_tokens == 16
    pixels = np.random.default_rng(4).uniform(-1, 1, size=(3, 35, 35)).astype(np.float32)
    got = vision.encode_pixels(proj, pixels)
    want = reference_idefics3_tile(W, pixels[:, :32, :32])
    assert rel_err(got, want) < 2e-4
    pixels[:, 32:, :] = 9.0
    pixels[:, :, 32:] = -9.0
    np.testing.assert_array_equal(vision.encode_pixels(proj, pixels), got)


@pytest.mark.parametrize(
    "size,grid",
    [
        ((48, 40), (2, 2)),  # longest side 64: 64 x 54 -> 2 x 2 tiles of 32
        ((40, 48), (2, 2)),
        ((100, 20), (2, 1)),  # 64 x 12: one row of two tiles
        ((20, 100), (1, 2)),
        ((64, 64), (2, 2)),
        ((8, 8), (2, 2)),  # scaled up to the longest side, as mtmd does
    ],
)
def test_tiling(files: tuple[Path, Path, dict[str, np.ndarray]], size: tuple[int, int], grid: tuple[int, int]) -> None:
    proj = vision.load_mmproj(files[1])
    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8))
    gx, gy, tiles = vision.idefics3_tiles(img, proj)
    assert (gx, gy) == grid and len(tiles) == gx * gy + 1
    assert all(t.shape == (3 * 32 * 32,) for t in tiles)


def test_prompt_layout(files: tuple[Path, Path, dict[str, np.ndarray]]) -> None:
    text, proj, _ = files
    m = dl.load_model(text, mmproj=proj)
    img = Image.fromarray(np.random.default_rng(2).integers(0, 256, size=(20, 100, 3), dtype=np.uint8))  # one row of two tiles
    p = vision.tokenize_with_images(m, "a <__media__> b", [img])
    assert [n for _, n in p.spans] == [16, 16, 16]
    tok = {t: dl.encode(m, t, add_bos=False, special=True) for t in SPECIALS}
    fake, glob, r11, r12, blank = (tok[t][0] for t in ("<fake_token_around_image>", "<global-img>", "<row_1_col_1>", "<row_1_col_2>", "\n\n"))
    (a, _), (b, _), (c, _) = p.spans
    # One row of tiles: no newline between them; a blank line and the global marker before the
    # overview, the fake token around it.
    assert p.ids[a - 2 : a] == [fake, r11] and p.ids[b - 2 : b] == [fake, r12]
    assert p.ids[c - 3 : c] == [blank, fake, glob] and p.ids[c + 16] == fake
    # The tiles and the overview are three images to the prefix cache: three runs of placeholders.
    assert len({tuple(p.ids[x : x + 16]) for x in (a, b, c)}) == 3
    enc = vision.encode_image(m.projector, img)
    np.testing.assert_array_equal(enc, p.values)


def test_an_older_conversion_is_refused_by_name(tmp_path: Path) -> None:
    # The same tower without the preprocessing size: mtmd would take another path for it.
    bad = tmp_path / "mmproj-old.gguf"
    write_idefics3_mmproj(bad, longest=0)
    with pytest.raises(UnsupportedModelError, match="preproc_image_size"):
        vision.load_mmproj(bad)


def test_a_missing_scale_factor_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "mmproj-noscale.gguf"
    write_idefics3_mmproj(bad, scale=0)
    with pytest.raises(GgufError, match="scale_factor"):
        vision.load_mmproj(bad)


def test_served_a_tiled_picture_is_one_image(tmp_path: Path) -> None:
    """Through the server: a picture of 2 x 2 tiles and an overview (five spans of rows) is
    answered, and /metrics counts it as the one image it is."""
    text, proj = tmp_path / "smolvlm-tiny.gguf", tmp_path / "mmproj-smolvlm-tiny.gguf"
    template = "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    write_model(text, arch="llama", specials=SPECIALS, ctx=256, template=template)
    write_idefics3_mmproj(proj)
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(5).integers(0, 256, size=(40, 48, 3), dtype=np.uint8)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    proc, base = start("--model", str(text), "--mmproj", str(proj), "--alias", "vis")
    try:
        msgs = [{"role": "user", "content": [{"type": "text", "text": "the cat "}, {"type": "image_url", "image_url": {"url": url}}]}]
        r = httpx.post(base + "/v1/chat/completions", json={"model": "vis", "messages": msgs, "max_tokens": 3, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        # Five spans of 16 rows, the markers between them, the words and the template.
        assert r.json()["usage"]["prompt_tokens"] > 80
        metrics = httpx.get(base + "/metrics", timeout=30).text
        got = re.search(r'^dasllama_images_total\{model="vis"\} ([0-9.]+)$', metrics, re.M)
        assert got is not None and float(got[1]) == 1.0, metrics
    finally:
        assert stop(proc) == 0
