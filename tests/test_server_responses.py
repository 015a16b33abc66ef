"""OpenAI's Responses API on dasllama's server, through the official openai client, on SmolLM2."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

import dasllama as dl
from serverproc import start, stop


@pytest.fixture(scope="module")
def server(smollm: dl.Model) -> Iterator[str]:
    proc, base = start("--model", str(smollm.path), "--alias", "smol")
    yield base
    assert stop(proc) == 0


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused")


def test_text_whole_and_streamed(client: openai.OpenAI) -> None:
    kw = {"model": "smol", "instructions": "Be brief.", "input": [{"role": "user", "content": "Name a fruit."}], "max_output_tokens": 10, "temperature": 0}
    r = client.responses.create(**kw)
    assert r.id.startswith("resp_") and r.status == "completed" and r.output[0].id.startswith("msg_")
    assert r.output_text and 0 < r.usage.output_tokens <= 10 and r.usage.input_tokens > 0
    deltas, done = "", None
    for ev in client.responses.create(**kw, stream=True):
        if ev.type == "response.output_text.delta":
            deltas += ev.delta
        elif ev.type == "response.completed":
            done = ev.response
    assert done is not None and deltas == done.output_text == r.output_text


def test_function_call_round_trip(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    r = client.responses.create(model="smol", input="What is the weather in Paris?", tools=tools, tool_choice="required", max_output_tokens=60)
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    follow = [{"role": "user", "content": "What is the weather in Paris?"}, call.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}]
    r2 = client.responses.create(model="smol", input=follow, tools=tools, max_output_tokens=16)
    assert r2.status == "completed" and r2.output


def test_bad_input_is_a_400(client: openai.OpenAI, server: str) -> None:
    for kw in ({"input": 5}, {"input": "x", "previous_response_id": "resp_1"}, {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="smol", **kw)  # type: ignore[call-overload]
    assert httpx.get(server + "/health").json() == {"status": "ok"}
