"""Gemma 4's projector (``gemma4v``): the tower at the image's own size (learned column and row
tables, per-head Q/K/V norms, a NeoX 2-D RoPE, post norms, clamped matrices), the pooling, the
standardisation and the projection against a float64 NumPy reference; the dynamic resize in its
70..1120-token budget; the image's rows between ``<|image>`` and ``<image|>``, seeing each other
in the gemma4 text model's sliding layers only, through a session and the scheduler; files that
lack a tensor refused by name; a chat with a picture through dasllama-server and the openai client."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

import dasllama as dl
from dasllama import GgufError, vision
from serverproc import start, stop
from synthetic import family_reference_logits, write_family
from synthetic_vision import GEMMA4V_VISION, reference_gemma4v_image, rel_err, write_gemma4v_mmproj
from vision_checks import assert_scheduler_matches_sessions

SPECIALS = ("<|image>", "<image|>")
# The 70-token minimum puts 80 image rows in a prompt: the tiny family's context raised for them.
META = {"context_length": 160}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("gemma4v")
    text = d / "gemma4-tiny.gguf"
    tw = write_family(text, "gemma4", meta=META, specials=SPECIALS)
    proj = d / "mmproj-gemma4-tiny.gguf"
    vw = write_gemma4v_mmproj(proj)
    return {"text": text, "text_w": tw, "mmproj": proj, "vision_w": vw}


def _pixels(w: int, h: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.5, size=3 * w * h).astype(np.float32)


@pytest.mark.parametrize("w,h", [(120, 96), (36, 72), (48, 48)])
def test_gemma4v_tower_matches_the_float64_reference(files: dict, w: int, h: int) -> None:
    p = vision.load_mmproj(files["mmproj"])
    assert (p.projector_type, p.markers, p.non_causal) == ("gemma4v", SPECIALS, True)
    assert p.native.dynamic_size and p.native.merge == 3
    px = _pixels(w, h, w + h)
    got = vision.encode_pixels(p, px, w, h)
    want = reference_gemma4v_image(files["vision_w"], px.reshape(3, h, w))
    assert got.shape == ((w // 12) * (h // 12), 256) == want.shape
    assert p.native.n_tokens_for(w, h) == len(got)
    assert rel_err(got, want) < 1e-3, rel_err(got, want)
    # The projection's output clamp binds: some values sit on its bound, as in the reference.
    assert np.isclose(np.abs(got).max(), 4.0) and np.isclose(np.abs(want).max(), 4.0)


def test_gemma4v_sizes_are_refused_off_the_grid_and_past_the_tables(files: dict) -> None:
    p = vision.load_mmproj(files["mmproj"])
    with pytest.raises(ValueError, match="multiples of 12"):
        vision.encode_pixels(p, _pixels(40, 36), 40, 36)
    # The tables cover 40 patches a side (160 pixels); 168 is 42 patches.
    with pytest.raises(ValueError, match="cover 40 patches a side"):
        vision.encode_pixels(p, _pixels(168, 36), 168, 36)


def test_target_size_as_clip_cpp(files: dict) -> None:
    p = vision.load_mmproj(files["mmproj"])
    # 45 x 37 rounds to 48 x 36 = 12 tokens of 12 x 12 pixels, under the minimum of 70: scaled
    # up, sides rounded up to multiples of 12 (10 x 8 tokens).
    assert vision.target_size(p, 45, 37) == (120, 96)
    # Within 70..1120 tokens: only rounded (halves up).
    assert vision.target_size(p, 126, 90) == (132, 96)
    # Over 1120 tokens: scaled down, sides rounded down (47 x 23 = 1081 tokens).
    assert vision.target_size(p, 2000, 1000) == (564, 276)
    rgb = np.random.default_rng(2).integers(0, 256, size=(37, 45, 3), dtype=np.uint8)
    img = Image.fromarray(rgb)
    px, w, h = vision.preprocess_sized(img, p)
    assert (w, h) == (120, 96)
    mean, std = (np.array(GEMMA4V_VISION[k], np.float32) for k in ("mean", "std"))
    # 45 x 37 scaled by min(120 / 45, 96 / 37) is 120 x 99 rounded up, kept to 120 x 96: the
    # whole canvas is the picture (bicubic, as Pillow).
    scale = min(np.float32(120) / np.float32(45), np.float32(96) / np.float32(37))
    nw, nh = min(int(np.ceil(np.float32(45) * scale)), 120), min(int(np.ceil(np.float32(37) * scale)), 96)
    canvas = Image.new("RGB", (120, 96))
    canvas.paste(img.resize((nw, nh), Image.Resampling.BICUBIC), ((120 - nw) // 2, (96 - nh) // 2))
    want = ((np.asarray(canvas, np.float32) / np.float32(255) - mean) / std).transpose(2, 0, 1)
    np.testing.assert_array_equal(px.reshape(3, 96, 120), want)


@pytest.mark.parametrize("text_dim", [1536, 2560])
def test_e2b_and_e4b_widths_keep_the_image_causal(tmp_path: Path, text_dim: int) -> None:
    # mtmd_decode_use_non_causal: Gemma 4 E2B (1536) and E4B (2560) decode their images causally.
    path = tmp_path / f"mmproj-{text_dim}.gguf"
    write_gemma4v_mmproj(path, text_dim=text_dim)
    p = vision.load_mmproj(path)
    assert p.text_dim == text_dim and p.non_causal is False


@pytest.mark.parametrize("tensor", ["v.position_embd.weight", "mm.input_projection.weight", "v.blk.1.attn_q.weight"])
def test_a_missing_tensor_is_refused_by_name(tmp_path: Path, tensor: str) -> None:
    path = tmp_path / "mmproj-drop.gguf"
    write_gemma4v_mmproj(path, drop=tensor)
    with pytest.raises(GgufError, match=f"tensor '{tensor}' is missing"):
        vision.load_mmproj(path)


def test_image_rows_see_each_other_in_the_sliding_layers_only(files: dict) -> None:
    # fp32 weights, as the family tests compare with their float64 reference.
    m = dl.load_model(files["text"], dl.QuantMode.fp32, mmproj=files["mmproj"])
    img = Image.fromarray(np.random.default_rng(4).integers(0, 256, size=(37, 45, 3), dtype=np.uint8))
    p = vision.tokenize_with_images(m, "the cat <__media__> at", [img])
    beg, end = (int(dl.encode(m, t, add_bos=False, special=True)[0]) for t in SPECIALS)
    ((first, n),) = p.spans
    assert n == 80 and p.ids[first - 1] == beg and p.ids[first + n] == end and p.non_causal
    s = dl.create_session(m)
    got = vision.eval_image_prompt(m, s, p, all=True)
    embeds = {r: p.values[i].astype(np.float64) for i, r in enumerate(p.rows)}
    want = family_reference_logits(files["text_w"], "gemma4", p.ids, META, embeds=embeds, spans=((first, n),))
    err = rel_err(got, want)
    # The rows do see each other, and in the sliding layers only: a causal reading of the same
    # rows, and one where every layer lets them, are far off.
    causal = family_reference_logits(files["text_w"], "gemma4", p.ids, META, embeds=embeds)
    every = family_reference_logits(files["text_w"], "gemma4", p.ids, META, embeds=embeds, spans=((first, n),), every_layer=True)
    assert err < 5e-3, err
    assert rel_err(causal, want) > 10 * err and rel_err(every, want) > 10 * err


def test_image_rows_of_a_model_with_per_layer_inputs(tmp_path: Path) -> None:
    # The E-series' per-layer inputs: an image row's token part is the padding token's (0), its
    # projected part the image row's own (llama.cpp's gemma4 graph for rows given as embeddings).
    text = tmp_path / "gemma4-e.gguf"
    tw = write_family(text, "gemma4-e", meta=META, specials=SPECIALS)
    proj = tmp_path / "mmproj.gguf"
    write_gemma4v_mmproj(proj)
    m = dl.load_model(text, dl.QuantMode.fp32, mmproj=proj)
    img = Image.fromarray(np.random.default_rng(5).integers(0, 256, size=(30, 40, 3), dtype=np.uint8))
    p = vision.tokenize_with_images(m, "the cat <__media__> at", [img])
    ((first, n),) = p.spans
    got = vision.eval_image_prompt(m, dl.create_session(m), p, all=True)
    embeds = {r: p.values[i].astype(np.float64) for i, r in enumerate(p.rows)}
    want = family_reference_logits(tw, "gemma4-e", p.ids, META, embeds=embeds, spans=((first, n),))
    assert rel_err(got, want) < 5e-3, rel_err(got, want)
    # Causal, as E2B and E4B decode theirs: the same rows without the span.
    causal = vision.ImagePrompt(p.ids, p.rows, p.values, p.spans, non_causal=False, grids=p.grids)
    got = vision.eval_image_prompt(m, dl.create_session(m), causal, all=True)
    want = family_reference_logits(tw, "gemma4-e", p.ids, META, embeds=embeds)
    assert rel_err(got, want) < 5e-3, rel_err(got, want)


def test_scheduler_runs_gemma4_images_as_sessions_do(files: dict) -> None:
    m = dl.load_model(files["text"], mmproj=files["mmproj"])
    rng = np.random.default_rng(12)
    imgs = [Image.fromarray(rng.integers(0, 256, size=(30, 40, 3), dtype=np.uint8)) for _ in range(2)]
    prompts = [vision.tokenize_with_images(m, "the cat <__media__> at", [im]) for im in imgs]
    assert all(p.non_causal for p in prompts)
    assert_scheduler_matches_sessions(m, prompts)


def test_served_chat_with_a_picture_streamed_and_not_then_cached(files: dict, tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{{ bos_token }}{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
    )
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(21).integers(0, 256, size=(40, 48, 3), dtype=np.uint8)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "the cat "}, {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": " at"}]}]
    proc, base = start("-m", str(files["text"]), "-mm", str(files["mmproj"]), "--chat-template-file", str(template), "-a", "g4", module="dasllama.serve.llama_server")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x")
        r = client.chat.completions.create(model="g4", messages=msgs, max_tokens=6, temperature=0)  # type: ignore[arg-type]
        # 80 image rows (the 70-token minimum, in 3 x 3 patches of 12 pixels) and the text.
        assert r.usage is not None and r.usage.prompt_tokens > 80, r.usage
        chunks = list(client.chat.completions.create(model="g4", messages=msgs, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}))  # type: ignore[arg-type]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
        usage = chunks[-1].usage
        # The same picture again: its rows come from the prefix cache.
        assert usage is not None and usage.prompt_tokens == r.usage.prompt_tokens
        assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens >= 80, usage
    finally:
        assert stop(proc) == 0
