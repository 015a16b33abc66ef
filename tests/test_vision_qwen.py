"""Qwen2-VL and Qwen2.5-VL's projectors (issue 41): the tower over 2 x 2 patch blocks (vision
M-RoPE, windows in 2.5, both norms and MLPs) against a float64 NumPy reference; the image's rows
on M-RoPE axes in a qwen2vl text model (each row at the image's position plus its row and
column, the text after going on from there plus the larger side), through a session, the
scheduler and its prefix cache. llama.cpp's own numbers are tests/test_vision_golden.py's."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

import dasllama as dl
from dasllama import _native, vision
from serverproc import start, stop
from synthetic import write_model
from synthetic_vision import reference_qwen2vl_image, rel_err, write_qwen2vl_mmproj
from vision_checks import assert_scheduler_matches_sessions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import make_vision_goldens as mk


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("qwenvl")
    text, proj = mk.write_files(d, "qwen25vl")
    proj2 = d / "mmproj-qwen2vl-tiny.gguf"
    return {"text": text, "mmproj": proj, "w25": write_qwen2vl_mmproj(d / "again.gguf"), "mmproj2": proj2, "w2": write_qwen2vl_mmproj(proj2, qwen25=False)}


def _pixels(w: int, h: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1, size=3 * w * h).astype(np.float32)


@pytest.mark.parametrize("qwen25", [True, False])
@pytest.mark.parametrize("w,h", [(48, 40), (16, 64), (136, 24)])
def test_qwen_tower_matches_the_float64_reference(files: dict, qwen25: bool, w: int, h: int) -> None:
    p = vision.load_mmproj(files["mmproj"] if qwen25 else files["mmproj2"])
    assert p.projector_type == ("qwen2.5vl_merger" if qwen25 else "qwen2vl_merger")
    assert (p.markers, p.non_causal, p.native.dynamic_size) == (("<|vision_start|>", "<|vision_end|>"), False, True)
    px = _pixels(w, h, w * h + qwen25)
    got = vision.encode_pixels(p, px, w, h)
    want = reference_qwen2vl_image(files["w25" if qwen25 else "w2"], px.reshape(3, h, w), qwen25=qwen25)
    assert got.shape == ((w // 8) * (h // 8), 256) == want.shape
    assert p.native.n_tokens_for(w, h) == len(got)
    assert p.native.mrope_grid(w, h) == (w // 8, h // 8)
    assert rel_err(got, want) < 1e-4, rel_err(got, want)


def test_windows_change_the_result(files: dict) -> None:
    # 128 x 16 pixels: 16 x 2 tokens, windows of 14 x 14 (112 pixels over patches of 4, merged 2
    # x 2). Run as if every layer attended the whole image, the reference differs: the windowed
    # layer is really windowed. An image inside one window is the same either way.
    p = vision.load_mmproj(files["mmproj"])
    px = _pixels(128, 16, 5)
    got = vision.encode_pixels(p, px, 128, 16)
    assert rel_err(got, reference_qwen2vl_image(files["w25"], px.reshape(3, 16, 128), wa=1)) > 1e-2
    px = _pixels(112, 16, 6)
    got = vision.encode_pixels(p, px, 112, 16)
    assert rel_err(got, reference_qwen2vl_image(files["w25"], px.reshape(3, 16, 112), wa=1)) < 1e-4


def test_an_image_that_is_not_blocks_of_patches_is_refused(files: dict) -> None:
    p = vision.load_mmproj(files["mmproj"])
    with pytest.raises(ValueError, match="multiples of 8"):
        vision.encode_pixels(p, _pixels(44, 40), 44, 40)


def _prompt(m: dl.Model, seed: int, size: tuple[int, int] = (45, 37)) -> vision.ImagePrompt:
    rgb = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    return vision.tokenize_with_images(m, "the cat <__media__> at", [Image.fromarray(rgb)])


def test_image_rows_take_mrope_positions(files: dict) -> None:
    m = dl.load_model(files["text"], mmproj=files["mmproj"])
    p = _prompt(m, 1)
    ((first, n),) = p.spans
    assert p.grids == [(6, 5)] and n == 30
    # 30 rows take max(6, 5) positions: the prompt's 44 rows take 20.
    assert p.n_pos == len(p.ids) - 24
    s = dl.create_session(m)
    logits = vision.eval_image_prompt(m, s, p, all=True)
    assert (s.n_past, s.n_pos) == (len(p.ids), p.n_pos)
    # Without the grid the rows are positioned as text: the rows after the image differ, the
    # rows before it do not.
    s2 = dl.create_session(m)
    plain = _native.eval_embeds(m._native, s2, p.ids, p.rows, p.values, [], True)
    assert s2.n_pos == s2.n_past == len(p.ids)
    np.testing.assert_array_equal(logits[:first], plain[:first])
    assert np.abs(logits[first + 1 :] - plain[first + 1 :]).max() > 1e-3
    # Text after it goes on from the session's position: one token at a time, or with the rest
    # of the prompt, the same logits.
    s3 = dl.create_session(m)
    head = vision.ImagePrompt(p.ids[: first + n + 1], p.rows, p.values, p.spans, p.non_causal, p.grids)
    vision.eval_image_prompt(m, s3, head)
    for t in p.ids[first + n + 1 :]:
        last = dl.eval(m, s3, [t])
    np.testing.assert_allclose(last, logits[-1], atol=2e-4)
    assert s3.n_pos == s.n_pos


def test_scheduler_and_prefix_cache_keep_the_positions(files: dict) -> None:
    m = dl.load_model(files["text"], mmproj=files["mmproj"])
    prompts = [_prompt(m, 2), _prompt(m, 3, (30, 70))]
    assert_scheduler_matches_sessions(m, prompts)


def test_through_the_server_with_the_openai_client(tmp_path: Path) -> None:
    # The golden's text model with a chat template that is the messages' text alone, so the
    # server's prompt is the one tokenized directly below.
    c = mk.CASES["qwen25vl"]
    text = tmp_path / "qwen-vis.gguf"
    write_model(text, arch="qwen2vl", specials=c["specials"], ctx=128, meta=c["meta"], extra=mk.biases(), template="{% for m in messages %}{{ m.content }}{% endfor %}")
    proj = tmp_path / "vision" / "mmproj-q.gguf"
    proj.parent.mkdir()
    write_qwen2vl_mmproj(proj)
    rgb = np.random.default_rng(4).integers(0, 256, size=(37, 45, 3), dtype=np.uint8)
    b = io.BytesIO()
    Image.fromarray(rgb).save(b, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(b.getvalue()).decode()
    # Directly: the greedy reply.
    m = dl.load_model(text, mmproj=proj)
    p = vision.tokenize_with_images(m, "the cat <__media__> at", [Image.fromarray(rgb)])
    s = dl.create_session(m)
    logits, toks = vision.eval_image_prompt(m, s, p), []
    for _ in range(5):
        toks.append(int(np.argmax(logits)))
        logits = dl.eval(m, s, [toks[-1]])
    want = dl.decode(m, toks)
    proc, base = start("--model", str(text), "--mmproj", str(proj), "--alias", "q", "--page-rows", "8")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x")
        msgs = [{"role": "user", "content": [{"type": "text", "text": "the cat "}, {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": " at"}]}]
        r = client.chat.completions.create(model="q", messages=msgs, max_tokens=5, temperature=0)  # type: ignore[arg-type]
        assert r.choices[0].message.content == want
        assert r.usage is not None and r.usage.prompt_tokens == len(p.ids)
        chunks = list(client.chat.completions.create(model="q", messages=msgs, max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True}))  # type: ignore[arg-type]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
        # The second turn's image rows come from the prefix cache, and its reply is the same.
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens >= 32, usage
    finally:
        assert stop(proc) == 0
