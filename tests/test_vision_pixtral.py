"""Pixtral's projector (issue 41's second family): the tower at the image's own size (2-D RoPE,
RMS norms, gated MLP), the patch merger, the MLP and the [IMG_BREAK] rows against a float64 NumPy
reference; the dynamic resize as clip.cpp computes it; the image's rows causal in the text model,
through a session and the scheduler."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import dasllama as dl
from dasllama import vision
from synthetic import reference_logits, write_model
from synthetic_vision import PIXTRAL_VISION, reference_pixtral_image, rel_err, write_pixtral_mmproj

SPECIALS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("pixtral")
    text = d / "pixtral-tiny.gguf"
    tw = write_model(text, specials=SPECIALS, ctx=128)
    proj = d / "mmproj-pixtral-tiny.gguf"
    vw = write_pixtral_mmproj(proj)
    return {"text": text, "text_w": tw, "mmproj": proj, "vision_w": vw, "dir": d}


def _pixels(w: int, h: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1, size=3 * w * h).astype(np.float32)


@pytest.mark.parametrize("w,h", [(48, 40), (16, 64), (64, 64)])
def test_pixtral_tower_matches_the_float64_reference(files: dict, w: int, h: int) -> None:
    p = vision.load_mmproj(files["mmproj"])
    assert (p.projector_type, p.markers, p.non_causal) == ("pixtral", ("", "[IMG_END]"), False)
    px = _pixels(w, h, w + h)
    got = vision.encode_pixels(p, px, w, h)
    want = reference_pixtral_image(files["vision_w"], px.reshape(3, h, w))
    tx, ty = w // 8, h // 8
    assert got.shape == (tx * ty + ty - 1, 256) == want.shape
    assert p.native.n_tokens_for(w, h) == len(got)
    assert rel_err(got, want) < 1e-3, rel_err(got, want)
    # The break rows are the file's [IMG_BREAK] embedding, after each row of tokens but the last.
    breaks = [(r + 1) * (tx + 1) - 1 for r in range(ty - 1)]
    np.testing.assert_array_equal(got[breaks], np.broadcast_to(files["vision_w"]["v.token_embd.img_break"], (ty - 1, 256)))


def test_pixtral_without_merger_or_breaks(tmp_path: Path) -> None:
    # Pixtral 12B's layout: no patch merger (a token per patch), and a file without break rows.
    path = tmp_path / "mmproj-pixtral12b.gguf"
    w = write_pixtral_mmproj(path, merger=False, img_break=False)
    p = vision.load_mmproj(path)
    px = _pixels(12, 8, 3)
    got = vision.encode_pixels(p, px, 12, 8)
    assert got.shape == (3 * 2, 256)
    assert rel_err(got, reference_pixtral_image(w, px.reshape(3, 8, 12), merger=False, img_break=False)) < 1e-3


def test_pixtral_sizes_are_refused_off_the_grid(files: dict) -> None:
    p = vision.load_mmproj(files["mmproj"])
    with pytest.raises(ValueError, match="multiples of 8"):
        vision.encode_pixels(p, _pixels(44, 40), 44, 40)
    with pytest.raises(ValueError, match="takes 3 x 40 x 48 values"):
        vision.encode_pixels(p, _pixels(8, 8), 48, 40)


def test_target_size_as_clip_cpp(files: dict) -> None:
    p = vision.load_mmproj(files["mmproj"])
    # Rounded to multiples of 8 (halves up), kept if within 8..1024 tokens of 8 x 8 pixels.
    assert vision.target_size(p, 45, 37) == (48, 40)
    assert vision.target_size(p, 44, 36) == (48, 40)
    assert vision.target_size(p, 43, 35) == (40, 32)
    # Too few pixels (under 8 tokens): scaled up, sides rounded up.
    assert vision.target_size(p, 10, 10) == (24, 24)
    # Too many (over 1024 tokens = 65536 pixels): scaled down, sides rounded down.
    assert vision.target_size(p, 1000, 500) == (360, 176)
    # A 45 x 37 picture is resized (bicubic, as Pillow) to 48 x 40 without padding.
    rgb = np.random.default_rng(2).integers(0, 256, size=(37, 45, 3), dtype=np.uint8)
    img = Image.fromarray(rgb)
    px, w, h = vision.preprocess_sized(img, p)
    assert (w, h) == (48, 40)
    mean, std = (np.array(PIXTRAL_VISION[k], np.float32) for k in ("mean", "std"))
    want = ((np.asarray(img.resize((48, 40), Image.Resampling.BICUBIC), np.float32) / np.float32(255) - mean) / std).transpose(2, 0, 1)
    np.testing.assert_array_equal(px.reshape(3, 40, 48), want)


def test_pixtral_image_rows_are_causal_in_the_text_model(files: dict) -> None:
    m = dl.load_model(files["text"], mmproj=files["mmproj"])
    img = Image.fromarray(np.random.default_rng(4).integers(0, 256, size=(24, 32, 3), dtype=np.uint8))
    p = vision.tokenize_with_images(m, "the cat <__media__> at", [img])
    end = int(dl.encode(m, "[IMG_END]", add_bos=False, special=True)[0])
    (first, n), = p.spans
    assert n == 4 * 3 + 2 and p.ids[first + n] == end and not p.non_causal
    assert p.images()[0][2] is False
    s = dl.create_session(m)
    got = vision.eval_image_prompt(m, s, p, all=True)
    embeds = {r: p.values[i].astype(np.float64) for i, r in enumerate(p.rows)}
    want = reference_logits(files["text_w"], p.ids, embeds=embeds)
    assert rel_err(got, want) < 2e-3, rel_err(got, want)


def test_scheduler_splits_a_causal_image_across_chunks(files: dict) -> None:
    m = dl.load_model(files["text"], mmproj=files["mmproj"])
    rng = np.random.default_rng(12)
    imgs = [Image.fromarray(rng.integers(0, 256, size=(40, 48, 3), dtype=np.uint8)) for _ in range(2)]
    prompts = [vision.tokenize_with_images(m, "the cat <__media__> at", [im]) for im in imgs]
    # One session each: the greedy tokens and the top-3 log-probs of each step.
    want = []
    for p in prompts:
        s = dl.create_session(m)
        logits = vision.eval_image_prompt(m, s, p).astype(np.float64)
        steps = []
        for _ in range(5):
            lp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
            top = np.argsort(lp)[::-1][:3]
            steps.append((int(top[0]), lp[top]))
            logits = dl.eval(m, s, [int(top[0])]).astype(np.float64)
        want.append(steps)
    # Chunks of 5 rows cut each image's 34 rows: causal rows need no single pass.
    sch = dl.create_scheduler(m, max_streams=2, chunk_tokens=5, page_rows=8)
    for i, p in enumerate(prompts):
        dl.submit(m, sch, dl.PendingReq(id=i, prompt=p.ids, max_new=5, ignore_eos=True, images=p.images(), logprobs=3))
    got: dict[int, list[dl.SchedEvent]] = {0: [], 1: []}
    evs: list[dl.SchedEvent] = []
    n_steps, more = 0, True
    while more:
        more = dl.scheduler_step(m, sch, evs)
        n_steps += 1
        for e in evs:
            if e.kind == "piece":
                got[e.id].append(e)
        evs.clear()
    for i in range(2):
        assert [e.token for e in got[i]] == [t for t, _ in want[i]]
        for e, (_, lps) in zip(got[i], want[i], strict=True):
            np.testing.assert_allclose([lp for _, lp in e.top], lps, atol=2e-3)
    # A whole image in one pass would take one prefill step for its 34 rows; cut into chunks of
    # 5 the two prompts' prefills take more steps than their rows / 5 minus the images' share.
    assert n_steps >= sum(len(p.ids) for p in prompts) // 5
