"""Anthropic's Messages API on dasllama's server, through the official anthropic client, on SmolLM2."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import pytest

import dasllama as dl
from serverproc import start, stop

KEY = "sk-ant-test"


@pytest.fixture(scope="module")
def server(smollm: dl.Model) -> Iterator[str]:
    proc, base = start("--model", str(smollm.path), "--alias", "smol", "--api-key", KEY)
    yield base
    assert stop(proc) == 0


@pytest.fixture(scope="module")
def client(server: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key=KEY)  # sends the key as X-Api-Key


WEATHER = {"name": "get_weather", "description": "Get the weather in a city", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_messages_basic_and_system(client: anthropic.Anthropic) -> None:
    r = client.messages.create(model="claude-sonnet-4-5", max_tokens=12, system="You are brief.", messages=[{"role": "user", "content": "Say hello"}], extra_body={"temperature": 0})
    assert r.type == "message" and r.role == "assistant" and r.model == "smol"
    assert r.content[0].type == "text" and r.content[0].text
    assert r.stop_reason in ("end_turn", "max_tokens") and 0 < r.usage.output_tokens <= 12 and r.usage.input_tokens > 0


def test_messages_stream_events(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model="smol", max_tokens=10, messages=[{"role": "user", "content": "Count to five"}], extra_body={"temperature": 0}) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    whole = client.messages.create(model="smol", max_tokens=10, messages=[{"role": "user", "content": "Count to five"}], extra_body={"temperature": 0})
    assert text and text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    msgs: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.messages.create(model="smol", max_tokens=60, tools=[WEATHER], tool_choice={"type": "any"}, messages=msgs)
    assert r.stop_reason == "tool_use"
    use = next(b for b in r.content if b.type == "tool_use")
    assert use.name == "get_weather" and isinstance(use.input, dict) and "city" in use.input
    # The result goes back as a tool_result block; the model answers in text.
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in r.content]}, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 25 C"}]}]
    r2 = client.messages.create(model="smol", max_tokens=20, tools=[WEATHER], messages=msgs)
    assert r2.content and r2.content[0].type == "text"


def test_tool_use_streamed(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model="smol", max_tokens=60, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, messages=[{"role": "user", "content": "Weather in Rome?"}]) as s:
        final = s.get_final_message()
    use = next(b for b in final.content if b.type == "tool_use")
    assert final.stop_reason == "tool_use" and use.name == "get_weather" and "city" in use.input


def test_count_tokens(client: anthropic.Anthropic, smollm: dl.Model) -> None:
    msgs = [{"role": "user", "content": "Hello world"}]
    n = client.messages.count_tokens(model="smol", messages=msgs, system="Be brief.").input_tokens
    prompt = dl.render_chat(smollm, [{"role": "system", "content": "Be brief."}, *msgs])
    assert n == len(dl.encode(smollm, prompt, special=True))


def test_errors_in_anthropic_shape(server: str, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="smol", max_tokens=5, messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "takes no images" in str(e.value)  # a text-only model; a vision one takes image blocks (test_vision_server)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong").messages.create(model="smol", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    for body in ({"max_tokens": 5}, {"max_tokens": 0, "messages": []}, {"max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}, {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "nope"}]}]}):
        r = httpx.post(server + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
        assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert httpx.get(server + "/health").json() == {"status": "ok"}


def test_prefill_continues_the_assistant_turn(client: anthropic.Anthropic, smollm: dl.Model) -> None:
    msgs = [{"role": "user", "content": "Give me a JSON object with a key a."}, {"role": "assistant", "content": '{"a":'}]
    r = client.messages.create(model="smol", max_tokens=6, messages=msgs, extra_body={"temperature": 0})
    n = client.messages.count_tokens(model="smol", messages=msgs[:1]).input_tokens
    # The prompt is the conversation up to a new assistant turn, then the prefill's tokens.
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens > n and r.content[0].type == "text"
