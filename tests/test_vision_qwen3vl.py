"""Qwen3-VL's projector (issue 41): the tower (learned positions interpolated to the image, fused
Q/K/V, deepstack mergers) against a float64 NumPy reference; its rows (the embedding and a
deepstack slice) in a qwen3vl text model, which adds slice k after its layer k - 1, through a
session, the scheduler with its prefix cache, and the server; what does not fit is refused.
llama.cpp's own numbers are tests/test_vision_golden.py's."""

from __future__ import annotations

import base64
import io
import re
import sys
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

import dasllama as dl
from dasllama import _native, vision
from serverproc import start, stop
from synthetic import DIM, write_model
from synthetic_vision import reference_qwen3vl_image, rel_err, write_qwen3vl_mmproj
from vision_checks import assert_scheduler_matches_sessions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import make_vision_goldens as mk


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("qwen3vl")
    text, proj = mk.write_files(d, "qwen3vl")
    # Two deepstack mergers, after the first and the last layer: their slices in layer order.
    two = d / "mmproj-two.gguf"
    return {"text": text, "mmproj": proj, "w": write_qwen3vl_mmproj(d / "again.gguf"), "two": two, "w2": write_qwen3vl_mmproj(two, deepstack=(0, 2))}


def _pixels(w: int, h: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1, size=3 * w * h).astype(np.float32)


# 32 x 32: the learned grid as it is; the others interpolate it (up, down, one side each way).
@pytest.mark.parametrize("deep", [(1,), (0, 2)])
@pytest.mark.parametrize("w,h", [(32, 32), (48, 40), (16, 64), (136, 24)])
def test_qwen3vl_tower_matches_the_float64_reference(files: dict, w: int, h: int, deep: tuple[int, ...]) -> None:
    p = vision.load_mmproj(files["mmproj"] if deep == (1,) else files["two"])
    assert p.projector_type == "qwen3vl_merger"
    assert (p.markers, p.non_causal, p.native.dynamic_size) == (("<|vision_start|>", "<|vision_end|>"), False, True)
    # A row: the merger's output and each deepstack merger's.
    width = (1 + len(deep)) * DIM
    assert p.text_dim == width
    px = _pixels(w, h, w * h)
    got = vision.encode_pixels(p, px, w, h)
    want = reference_qwen3vl_image(files["w"] if deep == (1,) else files["w2"], px.reshape(3, h, w), deepstack=deep)
    assert got.shape == ((w // 8) * (h // 8), width) == want.shape
    assert p.native.mrope_grid(w, h) == (w // 8, h // 8)
    # Each part on its own: a slice that went wrong is not hidden by the others' scale.
    for k in range(1 + len(deep)):
        s = slice(k * DIM, (k + 1) * DIM)
        assert rel_err(got[:, s], want[:, s]) < 1e-4, (k, rel_err(got[:, s], want[:, s]))


@pytest.mark.parametrize(
    "drop,why",
    [
        ("v.patch_embd.bias", "'v.patch_embd.bias' is missing; Qwen3-VL's tower has a patch bias"),
        ("v.position_embd.weight", "'v.position_embd.weight'"),
        ("v.deepstack.1.fc2.weight", "'v.deepstack.1.fc2.weight'"),
    ],
)
def test_a_file_without_its_parts_is_refused(tmp_path: Path, drop: str, why: str) -> None:
    proj = tmp_path / "mmproj-broken.gguf"
    write_qwen3vl_mmproj(proj, drop=drop)
    with pytest.raises(dl.GgufError, match=re.escape(why)):
        vision.load_mmproj(proj)


def _prompt(m: dl.Model, seed: int, size: tuple[int, int] = (61, 45)) -> vision.ImagePrompt:
    rgb = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    return vision.tokenize_with_images(m, "the cat <__media__> at", [Image.fromarray(rgb)])


def test_deepstack_slices_reach_the_text_model(files: dict) -> None:
    m = dl.load_model(files["text"], mmproj=files["mmproj"])
    assert (m.config["dim"], m.config["embd_inp"]) == (DIM, 2 * DIM)
    p = _prompt(m, 1)
    ((first, n),) = p.spans
    assert p.grids == [(8, 6)] and n == 48 and p.values.shape == (48, 2 * DIM)
    s = dl.create_session(m)
    logits = vision.eval_image_prompt(m, s, p, all=True)
    # The same rows with the deepstack slice zeroed: the rows before the image are the same, the
    # image's and the text's after it are not; so the slice is read.
    v = p.values.copy()
    v[:, DIM:] = 0
    s2 = dl.create_session(m)
    other = vision.eval_image_prompt(m, s2, vision.ImagePrompt(p.ids, p.rows, v, p.spans, p.non_causal, p.grids), all=True)
    np.testing.assert_array_equal(logits[:first], other[:first])
    assert np.abs(logits[first:] - other[first:]).max() > 1e-3
    # Text after the image, a token at a time, agrees with the whole prompt at once (the
    # deepstack slices belong to the image's rows only).
    s3 = dl.create_session(m)
    head = vision.ImagePrompt(p.ids[: first + n + 1], p.rows, p.values, p.spans, p.non_causal, p.grids)
    vision.eval_image_prompt(m, s3, head)
    for t in p.ids[first + n + 1 :]:
        last = dl.eval(m, s3, [t])
    np.testing.assert_allclose(last, logits[-1], atol=2e-4)


def test_rows_without_their_deepstack_slices_are_refused(files: dict) -> None:
    m = dl.load_model(files["text"], mmproj=files["mmproj"])
    p = _prompt(m, 2)
    narrow = np.ascontiguousarray(p.values[:, :DIM])
    s = dl.create_session(m)
    with pytest.raises(ValueError, match=r"512 each: the input and 1 deepstack slice of 256\)"):
        _native.eval_embeds(m._native, s, p.ids, p.rows, narrow, [], False)
    sch = dl.create_scheduler(m, max_streams=1, page_rows=8)
    first = p.spans[0][0]
    with pytest.raises(ValueError, match="with 512 values a row"):
        dl.submit(m, sch, dl.PendingReq(id=1, prompt=p.ids, max_new=2, images=[(first, narrow, False, p.grids[0])]))


def test_a_projector_for_another_text_model_is_refused(files: dict, tmp_path: Path) -> None:
    # Qwen2.5-VL's text tower has no deepstack layers: Qwen3-VL's rows do not fit it, nor does a
    # Qwen3-VL text tower take a projector without deepstack.
    other, proj25 = mk.write_files(tmp_path, "qwen25vl")
    with pytest.raises(dl.UnsupportedModelError, match=r"rows of 512 values but .* embeds 256"):
        dl.load_model(other, mmproj=files["mmproj"])
    with pytest.raises(dl.UnsupportedModelError, match=r"rows of 256 values but .* takes image rows of 512 values"):
        dl.load_model(files["text"], mmproj=proj25)


def test_scheduler_and_prefix_cache_carry_the_deepstack_rows(files: dict) -> None:
    m = dl.load_model(files["text"], mmproj=files["mmproj"])
    prompts = [_prompt(m, 3), _prompt(m, 4, (30, 70))]
    assert_scheduler_matches_sessions(m, prompts)


def test_through_the_server_with_the_openai_client(tmp_path: Path) -> None:
    c = mk.CASES["qwen3vl"]
    text = tmp_path / "qwen3-vis.gguf"
    write_model(text, arch="qwen3vl", specials=c["specials"], ctx=128, meta=c["meta"], extra=mk.qk_norms(), template="{% for m in messages %}{{ m.content }}{% endfor %}")
    proj = tmp_path / "mmproj-q3.gguf"
    write_qwen3vl_mmproj(proj)
    rgb = np.random.default_rng(5).integers(0, 256, size=(45, 61, 3), dtype=np.uint8)
    b = io.BytesIO()
    Image.fromarray(rgb).save(b, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(b.getvalue()).decode()
    m = dl.load_model(text, mmproj=proj)
    p = vision.tokenize_with_images(m, "the cat <__media__> at", [Image.fromarray(rgb)])
    s = dl.create_session(m)
    logits, toks = vision.eval_image_prompt(m, s, p), []
    for _ in range(5):
        toks.append(int(np.argmax(logits)))
        logits = dl.eval(m, s, [toks[-1]])
    want = dl.decode(m, toks)
    # The sidecar beside the model is found as llama-server's users lay it out.
    proc, base = start("--model", str(text), "--alias", "q3", "--page-rows", "8")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x")
        msgs = [{"role": "user", "content": [{"type": "text", "text": "the cat "}, {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": " at"}]}]
        r = client.chat.completions.create(model="q3", messages=msgs, max_tokens=5, temperature=0)  # type: ignore[arg-type]
        assert r.choices[0].message.content == want
        assert r.usage is not None and r.usage.prompt_tokens == len(p.ids)
        chunks = list(client.chat.completions.create(model="q3", messages=msgs, max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True}))  # type: ignore[arg-type]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens >= 48, usage
    finally:
        assert stop(proc) == 0


def test_the_moe_text_tower_takes_the_rows_too(tmp_path: Path) -> None:
    # qwen3vlmoe (Qwen3-VL-30B-A3B's layout) with two deepstack layers over a projector with two
    # deepstack mergers: the rows load, run, and each slice changes what follows.
    from synthetic import write_family

    text, proj = tmp_path / "moe.gguf", tmp_path / "mmproj-moe.gguf"
    write_family(text, "qwen3vlmoe")
    write_qwen3vl_mmproj(proj, deepstack=(0, 2))
    m = dl.load_model(text, mmproj=proj)
    assert m.config["embd_inp"] == m.projector.text_dim == 3 * DIM
    rows = vision.encode_pixels(m.projector, _pixels(32, 24, 3), 32, 24)
    ids = [1, 5, 6, *vision.placeholder_ids(rows, m.n_vocab), 7, 8]
    at = list(range(3, 3 + len(rows)))
    full = _native.eval_embeds(m._native, dl.create_session(m), ids, at, rows, [], True, [(3, 4, 3)])
    for k in (1, 2):
        v = rows.copy()
        v[:, k * DIM : (k + 1) * DIM] = 0
        other = _native.eval_embeds(m._native, dl.create_session(m), ids, at, v, [], True, [(3, 4, 3)])
        np.testing.assert_array_equal(full[:3], other[:3])
        assert np.abs(full[3:] - other[3:]).max() > 1e-3, k
