"""Images through the server (issue 41): OpenAI ``image_url`` parts with data URLs, through the
official client, streamed and not, the second turn's image rows from the prefix cache, and the
400s for what cannot be served."""

from __future__ import annotations

import base64
import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from test_vulkan import (
    device,  # noqa: F401 (the fixture needs_device names)
    needs_device,
)

from serverproc import start, stop
from synthetic import write_model
from synthetic_vision import write_gemma3_mmproj

TEMPLATE = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"


def _data_url(seed: int, fmt: str = "PNG") -> str:
    img = Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(40, 48, 3), dtype=np.uint8))
    b = io.BytesIO()
    img.save(b, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(b.getvalue()).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("vision-serve")
    text = d / "vis" / "gemma3-vis.gguf"
    text.parent.mkdir()
    write_model(text, arch="gemma3", specials=("<start_of_image>", "<end_of_image>"), template=TEMPLATE, ctx=128)
    # The sidecar beside the model is found; the same text model elsewhere takes no images.
    write_gemma3_mmproj(text.parent / "mmproj-gemma3-vis.gguf")
    plain = d / "plain" / "gemma3-plain.gguf"
    plain.parent.mkdir()
    shutil.copy(text, plain)
    proc, base = start("--model", str(text), "--alias", "vis", "--model", str(plain), "--alias", "plain", "--page-rows", "8")
    yield base
    assert stop(proc) == 0


def _msgs(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "the cat "}, {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": " at"}]}]


def test_chat_with_an_image_streamed_and_not_then_cached(server: str) -> None:
    client = openai.OpenAI(base_url=server + "/v1", api_key="x")
    msgs = _msgs(_data_url(1))
    r = client.chat.completions.create(model="vis", messages=msgs, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    text = r.choices[0].message.content
    assert r.usage is not None and r.usage.prompt_tokens > 16
    chunks = list(client.chat.completions.create(model="vis", messages=msgs, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}))  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == r.usage.prompt_tokens
    # The second turn about the same picture: its rows come from the prefix cache.
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens >= 16, usage
    # Another picture: the cache holds none of its image rows.
    r2 = client.chat.completions.create(model="vis", messages=_msgs(_data_url(2, "JPEG")), max_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert r2.usage is not None and r2.usage.prompt_tokens_details is not None
    assert r2.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens - 16


@pytest.mark.parametrize(
    "model,url,code",
    [
        ("plain", _data_url(1), "images_not_supported"),
        ("vis", "https://example.com/cat.png", "invalid_image_url"),
        ("vis", "data:image/png;base64,@@@not base64@@@", "invalid_image_url"),
        ("vis", "data:image/png;base64," + base64.b64encode(b"not an image").decode(), "invalid_image"),
        ("vis", "data:image/png,rawbytes", "invalid_image_url"),
    ],
)
def test_bad_images_are_400s_naming_the_problem(server: str, model: str, url: str, code: str) -> None:
    body = {"model": model, "messages": _msgs(url), "max_tokens": 2}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == "messages[0].content[1]", err


def test_models_say_which_take_images(server: str) -> None:
    cards = {c["id"]: c for c in httpx.get(server + "/v1/models", timeout=30).json()["data"]}
    assert cards["vis"]["input_modalities"] == ["text", "image"] and "multimodal" in cards["vis"]["capabilities"]
    assert cards["vis"]["meta"]["modalities"] == {"vision": True, "audio": False}
    assert cards["plain"]["input_modalities"] == ["text"] and cards["plain"]["capabilities"] == ["completion"]
    assert cards["plain"]["meta"]["modalities"]["vision"] is False
    assert httpx.get(server + "/props", params={"model": "vis"}, timeout=30).json()["modalities"]["vision"] is True
    assert httpx.get(server + "/props", params={"model": "plain"}, timeout=30).json()["modalities"]["vision"] is False
    assert "vision" in httpx.post(server + "/api/show", json={"model": "vis"}, timeout=30).json()["capabilities"]


def _b64(url: str) -> str:
    return url.partition(",")[2]


def test_anthropic_image_blocks_take_the_same_path(server: str) -> None:
    import anthropic

    url = _data_url(3)
    oai = openai.OpenAI(base_url=server + "/v1", api_key="x").chat.completions.create(model="vis", messages=_msgs(url), max_tokens=6, temperature=0)  # type: ignore[arg-type]
    client = anthropic.Anthropic(base_url=server, api_key="x")
    blocks = [{"type": "text", "text": "the cat "}, {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(url)}}, {"type": "text", "text": " at"}]
    r = client.messages.create(model="vis", max_tokens=6, extra_body={"temperature": 0}, messages=[{"role": "user", "content": blocks}])  # type: ignore[list-item]
    assert r.content[0].text == oai.choices[0].message.content  # type: ignore[union-attr]
    # The same prompt; its image rows were just cached by the OpenAI request (Anthropic counts
    # cache reads apart from input_tokens).
    assert oai.usage is not None and r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == oai.usage.prompt_tokens
    assert (r.usage.cache_read_input_tokens or 0) >= 16
    with pytest.raises(anthropic.BadRequestError, match="takes no images"):
        client.messages.create(model="plain", max_tokens=2, messages=[{"role": "user", "content": blocks}])  # type: ignore[list-item]
    url_block = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    with pytest.raises(anthropic.BadRequestError, match="--allow-image-urls"):
        client.messages.create(model="vis", max_tokens=2, messages=[{"role": "user", "content": [url_block]}])  # type: ignore[list-item]


def test_ollama_images_take_the_same_path(server: str) -> None:
    import ollama

    client = ollama.Client(host=server)
    png = base64.b64decode(_b64(_data_url(4)))
    r = client.chat(model="vis", messages=[{"role": "user", "content": "the cat", "images": [png]}], options={"temperature": 0, "num_predict": 4})
    # The image's 16 rows and its two markers are in the prompt.
    assert r.prompt_eval_count is not None and r.prompt_eval_count > 18 and r.message.content
    g = client.generate(model="vis", prompt="the cat", images=[png], options={"temperature": 0, "num_predict": 4})
    assert g.prompt_eval_count == r.prompt_eval_count and g.response == r.message.content
    with pytest.raises(ollama.ResponseError, match="takes no images"):
        client.chat(model="plain", messages=[{"role": "user", "content": "a", "images": [png]}])
    with pytest.raises(ollama.ResponseError, match="not a decodable image"):
        client.generate(model="vis", prompt="a", images=[base64.b64encode(b"not a picture").decode()])


# ---- the chat page in a browser ----------------------------------------------------------------


@needs_device
def test_a_server_on_the_device_answers_an_image_chat_from_device_kv(server: str, tmp_path: Path) -> None:
    """--gpu vulkan: the vision model resident, its streams' K/V on the device, an image chat
    answered there (no pass counted on the CPU), with the CPU server's reply, and its second turn's
    image rows from the device's prefix claims."""
    text = tmp_path / "gemma3-vis.gguf"
    write_model(text, arch="gemma3", specials=("<start_of_image>", "<end_of_image>"), template=TEMPLATE, ctx=128)
    write_gemma3_mmproj(tmp_path / "mmproj-gemma3-vis.gguf")
    msgs = _msgs(_data_url(1))
    want = openai.OpenAI(base_url=server + "/v1", api_key="x").chat.completions.create(model="vis", messages=msgs, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    proc, base = start("--model", str(text), "--alias", "vis", "--gpu", "vulkan", "--streams", "2")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x")
        r = client.chat.completions.create(model="vis", messages=msgs, max_tokens=6, temperature=0)  # type: ignore[arg-type]
        assert r.choices[0].message.content == want.choices[0].message.content
        again = client.chat.completions.create(model="vis", messages=msgs, max_tokens=6, temperature=0)  # type: ignore[arg-type]
        assert again.choices[0].message.content == r.choices[0].message.content
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens >= 16, again.usage
        metrics = httpx.get(base + "/metrics", timeout=30).text
        mem = [ln for ln in metrics.splitlines() if ln.startswith("dasllama_gpu_memory_bytes")]
        assert mem and int(mem[0].split()[-1]) > 0, mem
        assert "dasllama_gpu_cpu_passes_total{" not in metrics
    finally:
        assert stop(proc) == 0


def test_chat_page_attaches_and_pastes_a_picture(browser: Any, server: str) -> None:
    from test_webui import close, new_page

    page = new_page(browser, server, key=None)
    try:
        page.goto("/")
        page.wait_for_function("() => document.querySelectorAll('#model option').length === 2")
        # The button shows for a model that takes images only.
        page.select_option("#model", "plain")
        assert not page.is_visible("#attach")
        page.select_option("#model", "vis")
        assert page.is_visible("#attach")
        page.fill("#temperature", "0")
        page.fill("#max_tokens", "6")
        url = _data_url(5)
        png = base64.b64decode(_b64(url))
        page.set_input_files("#attach-file", files=[{"name": "cat.png", "mimeType": "image/png", "buffer": png}])
        page.wait_for_selector("#attachments img")
        page.fill("#input", "the cat")
        page.press("#input", "Enter")
        page.wait_for_selector(".msg.assistant[data-state='done']")
        assert page.is_visible(".msg.user .images img") and not page.is_visible("#attachments img")
        reply = page.evaluate("chatState.messages[chatState.messages.length - 1]")
        # What the API answers for the same picture and text, streamed to the page.
        parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "the cat"}]
        body = {"model": "vis", "messages": [{"role": "user", "content": parts}], "max_tokens": 6, "temperature": 0}
        want = httpx.post(server + "/v1/chat/completions", json=body, timeout=60).json()
        assert reply["content"] == want["choices"][0]["message"]["content"] and reply["usage"]["completion_tokens"] == 6
        assert reply["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"] > 16
        assert int(page.get_attribute(".msg.assistant", "data-chunks")) > 1
        # A picture pasted into the message is attached too.
        page.evaluate(
            """(b64) => {
                const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
                const dt = new DataTransfer();
                dt.items.add(new File([bytes], "pasted.png", { type: "image/png" }));
                document.getElementById("input").dispatchEvent(new ClipboardEvent("paste", { clipboardData: dt, bubbles: true, cancelable: true }));
            }""",
            _b64(url),
        )
        page.wait_for_function("() => chatState.attached.length === 1")
    finally:
        close(page)
