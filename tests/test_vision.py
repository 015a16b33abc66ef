"""Images in (issue 41), Gemma 3 first: the mmproj loader, the vision tower and projector against
a float64 NumPy reference, preprocessing as llama.cpp's mtmd does it, and image rows entering the
text model's input (non-causal among themselves) against the reference forward pass."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from PIL import Image

import dasllama as dl
from dasllama import _native, vision
from dasllama.errors import GgufError, UnsupportedModelError
from synthetic import reference_logits, write_model
from synthetic_vision import GEMMA3_VISION, reference_gemma3_image, rel_err, write_gemma3_mmproj

SPECIALS = ("<start_of_image>", "<end_of_image>")
N_IMG = (GEMMA3_VISION["image_size"] // GEMMA3_VISION["patch"] // GEMMA3_VISION["merge"]) ** 2


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("vision")
    text = d / "gemma3-tiny.gguf"
    tw = write_model(text, arch="gemma3", specials=SPECIALS)
    proj = d / "mmproj-gemma3-tiny.gguf"
    vw = write_gemma3_mmproj(proj)
    return {"dir": d, "text": text, "text_w": tw, "mmproj": proj, "vision_w": vw}


def _pixels(seed: int = 0) -> np.ndarray:
    s = GEMMA3_VISION["image_size"]
    return np.random.default_rng(seed).normal(0, 1, size=3 * s * s).astype(np.float32)


# --- the tower ---------------------------------------------------------------------------------


def test_gemma3_tower_matches_the_float64_reference(files: dict) -> None:
    p = vision.load_mmproj(files["mmproj"])
    assert (p.projector_type, p.image_size, p.n_tokens, p.text_dim) == ("gemma3", 32, N_IMG, 256)
    assert p.markers == SPECIALS
    for seed in range(3):
        px = _pixels(seed)
        got = vision.encode_pixels(p, px)
        want = reference_gemma3_image(files["vision_w"], px.reshape(3, 32, 32))
        assert got.shape == (N_IMG, 256)
        assert rel_err(got, want) < 1e-3, rel_err(got, want)
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())


@pytest.mark.parametrize("qt,tol", [(QT.F16, 1e-2), (QT.Q8_0, 3e-2)])
def test_gemma3_tower_with_stored_formats(tmp_path: Path, qt: QT, tol: float) -> None:
    path = tmp_path / "mmproj.gguf"
    w = write_gemma3_mmproj(path, qt=qt)
    p = vision.load_mmproj(path)
    px = _pixels(1)
    got = vision.encode_pixels(p, px)
    assert rel_err(got, reference_gemma3_image(w, px.reshape(3, 32, 32))) < tol


def test_swapped_mlp_of_older_conversions_is_read_back(tmp_path: Path) -> None:
    path = tmp_path / "mmproj-old.gguf"
    w = write_gemma3_mmproj(path, swapped_ffn=True)
    px = _pixels(2)
    got = vision.encode_pixels(vision.load_mmproj(path), px)
    assert rel_err(got, reference_gemma3_image(w, px.reshape(3, 32, 32))) < 1e-3


def test_pooling_by_four_is_the_default(tmp_path: Path) -> None:
    path = tmp_path / "mmproj-4.gguf"
    w = write_gemma3_mmproj(path, merge=4)
    p = vision.load_mmproj(path)
    assert p.n_tokens == 4
    px = _pixels(3)
    assert rel_err(vision.encode_pixels(p, px), reference_gemma3_image(w, px.reshape(3, 32, 32), merge=4)) < 1e-3


def test_wrong_files_are_refused_by_name(files: dict, tmp_path: Path) -> None:
    with pytest.raises(GgufError, match="not an mmproj"):
        vision.load_mmproj(files["text"])
    other = tmp_path / "mmproj-qwen.gguf"
    write_gemma3_mmproj(other, projector="qwen2vl")
    with pytest.raises(UnsupportedModelError, match="projector type 'qwen2vl' is not supported"):
        vision.load_mmproj(other)
    bad = tmp_path / "mmproj-pool.gguf"
    write_gemma3_mmproj(bad, merge=3)
    with pytest.raises(GgufError, match="pooling of 3"):
        vision.load_mmproj(bad)
    p = vision.load_mmproj(files["mmproj"])
    with pytest.raises(ValueError, match="3 x 32 x 32"):
        vision.encode_pixels(p, np.zeros(10, np.float32))


# --- preprocessing -----------------------------------------------------------------------------


def _png(img: Image.Image, fmt: str = "PNG") -> bytes:
    b = io.BytesIO()
    img.save(b, format=fmt)
    return b.getvalue()


def test_preprocess_square_image_is_normalized_planar(files: dict) -> None:
    p = vision.load_mmproj(files["mmproj"])
    rgb = np.random.default_rng(5).integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
    px = vision.preprocess(vision.decode_image(_png(Image.fromarray(rgb))), p)
    want = ((rgb.astype(np.float32) / 255.0 - 0.5) / 0.5).transpose(2, 0, 1).reshape(-1)
    np.testing.assert_array_equal(px, want)


def test_preprocess_keeps_the_aspect_ratio_on_black_as_mtmd(files: dict) -> None:
    p = vision.load_mmproj(files["mmproj"])
    rgb = np.random.default_rng(6).integers(0, 256, size=(20, 64, 3), dtype=np.uint8)  # 64 wide, 20 high
    img = Image.fromarray(rgb)
    px = vision.preprocess(img, p).reshape(3, 32, 32)
    # scale 0.5: 32 x 10, centered: rows 11..20 hold the image, the rest is black (-1 normalized).
    inner = np.asarray(img.resize((32, 10), Image.Resampling.BILINEAR), dtype=np.float32)
    np.testing.assert_array_equal(px[:, 11:21, :], ((inner / 255.0 - 0.5) / 0.5).transpose(2, 0, 1))
    assert (px[:, :11, :] == -1).all() and (px[:, 21:, :] == -1).all()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_decodes_each_format(fmt: str) -> None:
    img = Image.fromarray(np.full((8, 12, 3), 200, np.uint8))
    out = vision.decode_image(_png(img, fmt))
    assert out.mode == "RGB" and out.size == (12, 8)


def test_bad_images_are_refused() -> None:
    with pytest.raises(vision.ImageError, match="not a decodable image"):
        vision.decode_image(b"definitely not an image")
    with pytest.raises(vision.ImageError, match="unsupported image format BMP"):
        vision.decode_image(_png(Image.new("RGB", (4, 4)), "BMP"))


# --- loading beside the model ------------------------------------------------------------------


def test_load_model_with_mmproj_and_sidecar(files: dict, tmp_path: Path) -> None:
    m = dl.load_model(files["text"], mmproj=files["mmproj"])
    assert m.projector is not None and m.projector.n_tokens == N_IMG
    # Found beside the model, and not where asked not to.
    assert dl.load_model(files["text"]).projector is not None
    assert dl.load_model(files["text"], mmproj=False).projector is None
    alone = tmp_path / "alone.gguf"
    shutil.copy(files["text"], alone)
    assert dl.load_model(alone).projector is None
    with pytest.raises(GgufError, match="no mmproj"):
        dl.load_model(alone, mmproj=True)
    narrow = tmp_path / "mmproj-narrow.gguf"
    write_gemma3_mmproj(narrow, text_dim=128)
    with pytest.raises(UnsupportedModelError, match="belongs to another model"):
        dl.load_model(alone, mmproj=narrow)
    with pytest.raises(GgufError, match="not an mmproj"):
        dl.load_model(alone, mmproj=files["text"])


# --- image rows in the text model's input --------------------------------------------------------


def test_image_rows_enter_the_prompt_as_the_reference_says(files: dict) -> None:
    m = dl.load_model(files["text"], mmproj=files["mmproj"])
    img = Image.fromarray(np.random.default_rng(7).integers(0, 256, size=(32, 32, 3), dtype=np.uint8))
    p = vision.tokenize_with_images(m, "the cat <__media__> at", [img])
    start, end = (int(dl.encode(m, t, add_bos=False, special=True)[0]) for t in SPECIALS)
    (first, n), = p.spans
    assert n == N_IMG and p.ids[first - 1] == start and p.ids[first + n] == end and p.ids[0] == m.bos_id
    assert p.rows == list(range(first, first + n))
    s = dl.create_session(m)
    got = vision.eval_image_prompt(m, s, p, all=True)
    assert got.shape == (len(p.ids), m.n_vocab)
    embeds = {r: p.values[i].astype(np.float64) for i, r in enumerate(p.rows)}
    want = reference_logits(files["text_w"], p.ids, arch="gemma3", embeds=embeds, spans=tuple(p.spans))
    err = rel_err(got, want)
    assert err < 2e-3, err
    assert (got.argmax(-1) == want.argmax(-1)).all()
    # Causal rows would differ: the image rows see the rows after them.
    causal = reference_logits(files["text_w"], p.ids, arch="gemma3", embeds=embeds)
    assert np.abs(causal[first] - want[first]).max() > 10 * np.abs(got[first] - want[first]).max()
    # The same rows through the seam directly, and a session that has the text before the image
    # already, give the same logits.
    s2 = dl.create_session(m)
    direct = _native.eval_embeds(m._native, s2, p.ids, p.rows, p.values, p.spans, True)
    np.testing.assert_array_equal(direct, got)
    s3 = dl.create_session(m)
    dl.eval(m, s3, p.ids[:first])
    rest = vision.ImagePrompt(p.ids[first:], [r - first for r in p.rows], p.values, [(0, n)])
    tail = vision.eval_image_prompt(m, s3, rest, all=True)
    np.testing.assert_allclose(tail, got[first:], rtol=1e-4, atol=1e-4 * np.abs(got).max())
    # The session goes on decoding after the image as after any prompt.
    assert s.n_past == len(p.ids)
    nxt = dl.eval(m, s, [5])
    want_next = reference_logits(files["text_w"], [*p.ids, 5], arch="gemma3", embeds=embeds, spans=tuple(p.spans))[-1]
    assert np.abs(nxt - want_next).max() / np.abs(want_next).max() < 2e-3


def test_image_prompt_errors(files: dict) -> None:
    m = dl.load_model(files["text"], mmproj=files["mmproj"])
    bare = dl.load_model(files["text"], mmproj=False)
    img = Image.new("RGB", (32, 32))
    with pytest.raises(ValueError, match="takes no images"):
        vision.tokenize_with_images(bare, "a <__media__>", [img])
    with pytest.raises(ValueError, match="1 image markers"):
        vision.tokenize_with_images(m, "a <__media__>", [img, img])
    with pytest.raises(vision.ImageError):
        vision.tokenize_with_images(m, "a <__media__>", [b"junk"])
    s = dl.create_session(m)
    vals = np.zeros((2, 256), np.float32)
    with pytest.raises(ValueError, match="increasing row numbers"):
        _native.eval_embeds(m._native, s, [1, 2, 3], [2, 1], vals, [])
    with pytest.raises(ValueError, match="1 embedding rows need 256 values"):
        _native.eval_embeds(m._native, s, [1, 2, 3], [1], vals, [])
    with pytest.raises(ValueError, match="one session's"):
        _native.eval_embeds(m._native, s, [1, 2, 3], [1, 2], vals, [(2, 5)])
    assert s.n_past == 0


# --- through the scheduler ---------------------------------------------------------------------


def _greedy(m: dl.Model, p: vision.ImagePrompt, n: int) -> list[int]:
    s = dl.create_session(m)
    logits = vision.eval_image_prompt(m, s, p)
    out = []
    for _ in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        logits = dl.eval(m, s, [t])
    return out


def _run(m: dl.Model, sch: dl.Scheduler) -> dict[int, list[dl.SchedEvent]]:
    by_id: dict[int, list[dl.SchedEvent]] = {}
    evs: list[dl.SchedEvent] = []
    more = True
    while more:
        more = dl.scheduler_step(m, sch, evs)
        for e in evs:
            by_id.setdefault(e.id, []).append(e)
        evs.clear()
    return by_id


def test_scheduler_serves_image_prompts_and_caches_their_pages(files: dict) -> None:
    m = dl.load_model(files["text"], mmproj=files["mmproj"])
    rng = np.random.default_rng(11)
    imgs = [Image.fromarray(rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)) for _ in range(2)]
    prompts = [vision.tokenize_with_images(m, "the cat <__media__> at", [im]) for im in imgs]
    # Another picture, other placeholder ids: its pages never stand in for the first one's.
    assert prompts[0].ids[prompts[0].rows[0] : prompts[0].rows[-1] + 1] != prompts[1].ids[prompts[1].rows[0] : prompts[1].rows[-1] + 1]
    want = [_greedy(m, p, 6) for p in prompts]
    # Chunks of 5 would cut the 16 image rows; each image still goes into one pass.
    sch = dl.create_scheduler(m, max_streams=2, chunk_tokens=5, page_rows=8)
    for i, p in enumerate(prompts):
        dl.submit(m, sch, dl.PendingReq(id=i, prompt=p.ids, max_new=6, ignore_eos=True, images=p.images()))
    got = _run(m, sch)
    for i in range(2):
        assert [e.token for e in got[i] if e.kind == "piece"] == want[i]
    # A second turn about the first picture attaches its pages, image rows included.
    dl.submit(m, sch, dl.PendingReq(id=5, prompt=prompts[0].ids, max_new=6, ignore_eos=True, images=prompts[0].images()))
    again = _run(m, sch)[5]
    fin = again[-1]
    assert fin.kind == "finished" and fin.n_cached >= prompts[0].rows[-1] + 1 - 8, fin.n_cached
    assert [e.token for e in again if e.kind == "piece"] == want[0]


def test_scheduler_refuses_bad_image_rows(files: dict) -> None:
    m = dl.load_model(files["text"], mmproj=files["mmproj"])
    sch = dl.create_scheduler(m)
    with pytest.raises(ValueError, match="image's rows must be"):
        dl.submit(m, sch, dl.PendingReq(id=1, prompt=[1, 2, 3], images=[(2, np.zeros((4, 256), np.float32))]))
    with pytest.raises(ValueError, match="image's rows must be"):
        dl.submit(m, sch, dl.PendingReq(id=2, prompt=[1, 2, 3], images=[(0, np.zeros((2, 128), np.float32))]))
