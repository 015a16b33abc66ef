"""Ollama's API on dasllama's server, through the official ollama client, on SmolLM2."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import ollama
import pytest

import dasllama as dl
from serverproc import start, stop


@pytest.fixture(scope="module")
def server(smollm: dl.Model) -> Iterator[str]:
    proc, base = start("--model", str(smollm.path), "--alias", "smol")
    yield base
    assert stop(proc) == 0


@pytest.fixture(scope="module")
def client(server: str) -> ollama.Client:
    return ollama.Client(host=server)


def test_tags_show_version(client: ollama.Client, server: str) -> None:
    models = client.list().models
    assert [m.model for m in models] == ["smol"] and models[0].details.format == "gguf" and models[0].details.quantization_level == "Q4_1"
    show = client.show("smol")
    assert show.details.family == "llama" and "<|im_start|>" in (show.template or "")
    assert httpx.get(server + "/api/version").json()["version"]


def test_chat_whole_and_streamed(client: ollama.Client) -> None:
    msgs = [{"role": "user", "content": "Name a color."}]
    r = client.chat(model="smol", messages=msgs, options={"num_predict": 8, "temperature": 0})
    assert r.message.role == "assistant" and r.message.content and r.done and r.done_reason in ("stop", "length") and 0 < r.eval_count <= 8
    parts = list(client.chat(model="smol", messages=msgs, options={"num_predict": 8, "temperature": 0}, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == r.message.content


def test_chat_tools(client: ollama.Client) -> None:
    def get_weather(city: str) -> str:
        """Get the weather in a city.

        Args:
          city: the city
        """
        return "sunny"

    r = client.chat(model="smol", messages=[{"role": "user", "content": "What is the weather in Paris? Use the tool."}], tools=[get_weather], options={"num_predict": 60, "temperature": 0})
    # A 135M model may answer in text; a call it makes must be well formed.
    for call in r.message.tool_calls or []:
        assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)


def test_generate_template_and_raw(client: ollama.Client, smollm: dl.Model) -> None:
    r = client.generate(model="smol", prompt="Say hi.", options={"num_predict": 6, "temperature": 0})
    assert r.response and r.done and r.prompt_eval_count == len(dl.encode(smollm, dl.render_chat(smollm, [{"role": "user", "content": "Say hi."}]), special=True))
    raw = client.generate(model="smol", prompt="The capital of France is", raw=True, options={"num_predict": 4, "temperature": 0})
    assert raw.prompt_eval_count == len(dl.encode(smollm, "The capital of France is"))
    streamed = "".join(p.response for p in client.generate(model="smol", prompt="The capital of France is", raw=True, options={"num_predict": 4, "temperature": 0}, stream=True))
    assert streamed == raw.response


def test_embed(client: ollama.Client, smollm: dl.Model) -> None:
    r = client.embed(model="smol", input=["hello world", "goodbye"])
    ref = dl.embed(smollm, ["hello world", "goodbye"])
    assert np.allclose(np.array(r.embeddings), ref, atol=1e-5)
    assert r.prompt_eval_count == sum(len(dl.encode(smollm, t)) for t in ("hello world", "goodbye"))


def test_errors_in_ollama_shape(client: ollama.Client, server: str) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="smol", messages=[{"role": "wizard", "content": "x"}])
    assert e.value.status_code == 400 and "role" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3")
    assert e.value.status_code == 501
    for path, body in (("/api/generate", {"prompt": 5}), ("/api/embed", {"input": []}), ("/api/chat", {"messages": "x"}), ("/api/show", {"model": "nope"})):
        r = httpx.post(server + path, json=body, timeout=60)
        assert 400 <= r.status_code < 500 and isinstance(r.json()["error"], str), (path, r.text)
    assert httpx.get(server + "/health").json() == {"status": "ok"}
