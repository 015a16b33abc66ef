"""Black-box tests of `python -m dasllama.serve` on loopback, with httpx and the official openai client."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

import dasllama as dl
from serverproc import start, stop

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(smollm: dl.Model, gemma: dl.Model) -> Iterator[str]:
    proc, base = start("--model", str(smollm.path), "--alias", "smollm", "--model", str(gemma.path), "--alias", "gemma", "--api-key", KEY, "--streams", "16")
    yield base
    assert stop(proc) == 0


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY)


def post(base: str, path: str, body: object, headers: dict[str, str] = AUTH) -> httpx.Response:
    return httpx.post(base + path, json=body, headers=headers, timeout=120)


def test_models_and_health(server: str) -> None:
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    r = httpx.get(server + "/v1/models", headers=AUTH).json()
    assert r["object"] == "list" and [d["id"] for d in r["data"]] == ["smollm", "gemma"]


def test_models_answer_to_every_name(server: str, smollm: dl.Model) -> None:
    for name in ("smollm", smollm.path.stem, str(smollm.path)):
        r = httpx.get(f"{server}/v1/models/{name}", headers=AUTH)
        assert r.status_code == 200 and r.json()["id"] == name, r.text
    body = {"model": smollm.path.stem, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    r = httpx.post(server + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "smollm"
    r = httpx.get(server + "/v1/models/nope", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_ttft_histogram_measures_time_to_first_token(server: str) -> None:
    def ttft() -> tuple[float, float]:
        text = httpx.get(server + "/metrics", headers=AUTH).text
        val = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln.startswith('dasllama_ttft_seconds_') and 'model="smollm"' in ln}
        return val['dasllama_ttft_seconds_sum{model="smollm"}'], val['dasllama_ttft_seconds_count{model="smollm"}']
    s0, n0 = ttft()
    body = {"model": "smollm", "messages": [{"role": "user", "content": "Tell me about the sea. " * 20}], "max_tokens": 2}
    assert httpx.post(server + "/v1/chat/completions", json=body, headers=AUTH, timeout=60).status_code == 200
    s1, n1 = ttft()
    # A 200-token prompt is prefilled before the first token: that time is what is observed.
    assert n1 == n0 + 1 and s1 - s0 > 0.001


def test_ignore_eos_generates_max_tokens(server: str) -> None:
    body = {"model": "smollm", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 48, "temperature": 0}
    short = httpx.post(server + "/v1/chat/completions", json=body, headers=AUTH, timeout=60).json()
    assert short["choices"][0]["finish_reason"] == "stop" and short["usage"]["completion_tokens"] < 48
    full = httpx.post(server + "/v1/chat/completions", json=body | {"ignore_eos": True}, headers=AUTH, timeout=60).json()
    assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 48
    bad = httpx.post(server + "/v1/chat/completions", json=body | {"ignore_eos": "yes"}, headers=AUTH, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ignore_eos"


def test_number_fields_say_plainly_what_they_take(server: str) -> None:
    def post(**kw: object) -> httpx.Response:
        body = {"model": "smollm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2} | kw
        return httpx.post(server + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)

    assert post(max_tokens=2.0).status_code == 200  # an integral number is an integer
    assert post(max_tokens=0).json()["error"]["message"] == "'max_tokens' must be at least 1, got 0"
    assert post(max_tokens=2.5).json()["error"]["message"] == "'max_tokens' must be an integer, got float"
    assert post(temperature=3).json()["error"]["message"] == "'temperature' must be between 0 and 2, got 3"


def test_chat_and_usage(client: openai.OpenAI, smollm: dl.Model) -> None:
    r = client.chat.completions.create(model="smollm", messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=16, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content and c.finish_reason in ("stop", "length")
    prompt = dl.encode(smollm, dl.render_chat(smollm, [{"role": "user", "content": "What is 2+2?"}]), special=True)
    assert r.usage.prompt_tokens == len(prompt)
    assert 1 <= r.usage.completion_tokens <= 16 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    want = dl.generate(smollm, dl.create_session(smollm), prompt, dl.SamplingParams(), 16)
    assert c.message.content == dl.decode(smollm, [t for t in want if t not in smollm.eog_ids])


def test_completions_stream_and_not(client: openai.OpenAI, smollm: dl.Model) -> None:
    full = client.completions.create(model="smollm", prompt="The capital of France is", max_tokens=10, temperature=0)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="smollm", prompt="The capital of France is", max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    ids = dl.encode(smollm, "The capital of France is")
    assert full.choices[0].text == dl.decode(smollm, dl.generate(smollm, dl.create_session(smollm), ids, dl.SamplingParams(), 10))


def test_chat_stream_with_text_parts(client: openai.OpenAI) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Name a color."}]}]
    stream = client.chat.completions.create(model="smollm", messages=msgs, max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    full = client.chat.completions.create(model="smollm", messages=msgs, max_tokens=12, temperature=0)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_strings_are_never_emitted(client: openai.OpenAI) -> None:
    base = client.completions.create(model="smollm", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0).choices[0].text
    assert " 6" in base
    stop = base[base.index(" 6") : base.index(" 6") + 3]
    r = client.completions.create(model="smollm", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].text == base[: base.index(stop)] and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="smollm", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == base[: base.index(stop)]


def test_seed_reproducibility_and_n(client: openai.OpenAI) -> None:
    ask = lambda seed: client.completions.create(model="smollm", prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=seed, n=2)
    a, b, c = ask(7), ask(7), ask(8)
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    assert [x.text for x in a.choices] != [x.text for x in c.choices]
    assert len(a.choices) == 2 and [x.index for x in a.choices] == [0, 1]
    assert a.usage.completion_tokens >= 2


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smollm", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy: the chosen is the top one
    c = client.completions.create(model="smollm", prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.token_logprobs) == len(c.choices[0].logprobs.tokens) > 0


def test_several_models(client: openai.OpenAI, gemma: dl.Model) -> None:
    r = client.completions.create(model="gemma", prompt="The capital of France is", max_tokens=8, temperature=0)
    ids = dl.encode(gemma, "The capital of France is")
    assert r.choices[0].text == dl.decode(gemma, dl.generate(gemma, dl.create_session(gemma), ids, dl.SamplingParams(), 8))
    assert r.model == "gemma"


def test_sixteen_concurrent_streams_match_one_at_a_time(server: str, smollm: dl.Model) -> None:
    prompts = [f"Write a sentence about the number {i}." for i in range(16)]

    async def one(c: httpx.AsyncClient, p: str) -> str:
        body = {"model": "smollm", "messages": [{"role": "user", "content": p}], "max_tokens": 24, "temperature": 0, "stream": True}
        text = ""
        async with c.stream("POST", server + "/v1/chat/completions", json=body, headers=AUTH, timeout=300) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["delta"].get("content", "") if json.loads(line[6:])["choices"] else ""
        return text

    async def all_() -> list[str]:
        async with httpx.AsyncClient() as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    got = asyncio.run(all_())
    for p, g in zip(prompts, got, strict=True):
        ids = dl.encode(smollm, dl.render_chat(smollm, [{"role": "user", "content": p}]), special=True)
        want = dl.generate(smollm, dl.create_session(smollm), ids, dl.SamplingParams(), 24)
        assert g == dl.decode(smollm, [t for t in want if t not in smollm.eog_ids])


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "invalid_value"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400, "invalid_type"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "invalid_type"),
        ({"messages": []}, 400, None),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404, "model_not_found"),
        ({"messages": [{"role": "user", "content": "hi " * 9000}]}, 400, "context_length_exceeded"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ],
)
def test_bad_requests(server: str, body: dict, status: int, code: str | None) -> None:
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code:
        assert err["code"] == code
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_bad_bodies_and_auth(server: str) -> None:
    h = {**AUTH, "content-type": "application/json"}
    r = httpx.post(server + "/v1/completions", content=b"{not json", headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(server + "/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_encoding"
    r = httpx.post(server + "/v1/completions", content=b'{"prompt": "' + b"a" * (10 << 20) + b'"}', headers=h, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert post(server, "/v1/completions", {"prompt": "hi"}, headers={}).status_code == 401
    r = post(server, "/v1/completions", {"prompt": "hi"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server + "/health").status_code == 200  # no key needed
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "unknown_field": 1}).status_code == 200


def test_tokenize_round_trip(server: str, smollm: dl.Model) -> None:
    toks = post(server, "/tokenize", {"model": "smollm", "content": "Hello world"}).json()["tokens"]
    assert toks == dl.encode(smollm, "Hello world")
    assert post(server, "/detokenize", {"model": "smollm", "tokens": toks}).json()["content"] == "Hello world"
    assert post(server, "/detokenize", {"tokens": [10**9]}).status_code == 400


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", headers=AUTH).text
    for line in text.splitlines():
        if line.startswith(name + '{model="smollm"'):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_disconnect_evicts_and_pages_return(server: str) -> None:
    body = {"model": "smollm", "prompt": "1, 2, 3, 4,", "max_tokens": 1000, "temperature": 0, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        for i, _line in enumerate(r.iter_lines()):
            if i > 6:
                break  # hang up mid-stream
    deadline = time.time() + 10
    while time.time() < deadline and metric(server, "dasllama_active_streams") > 0:
        time.sleep(0.05)
    assert metric(server, "dasllama_active_streams") == 0
    text = httpx.get(server + "/metrics", headers=AUTH).text
    assert 'outcome="cancelled"' in text
    used, cached = metric(server, "dasllama_kv_pages_used"), metric(server, "dasllama_kv_pages_cached")
    assert used == cached  # idle: every page in use is the prefix cache's, none held by a stream


def test_full_queue_is_503_with_retry_after(smollm: dl.Model) -> None:
    proc, base = start("--model", str(smollm.path), "--streams", "1", "--queue", "1")
    try:
        body = {"prompt": "1, 2, 3, 4,", "max_tokens": 200, "temperature": 0}

        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*(c.post(base + "/v1/completions", json=body) for _ in range(4)))

        rs = asyncio.run(flood())
        codes = sorted(r.status_code for r in rs)
        # One stream and a queue of one: two are taken (also when the second arrives before the
        # engine admits the first), the rest are refused, none fails otherwise.
        assert codes == [200, 200, 503, 503], codes
        busy = next(r for r in rs if r.status_code == 503)
        assert busy.headers["retry-after"] and busy.json()["error"]["code"] == "queue_full"
        assert httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200
    finally:
        assert stop(proc) == 0


def test_follow_up_turn_attaches_the_cached_conversation(client: openai.OpenAI) -> None:
    system = {"role": "system", "content": "You are a concise assistant. Answer in one short sentence, always."}
    first = [system, {"role": "user", "content": "What is the capital of France?"}]
    r1 = client.chat.completions.create(model="smollm", messages=first, max_tokens=24, temperature=0)
    follow = [*first, {"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "And of Spain?"}]
    r2 = client.chat.completions.create(model="smollm", messages=follow, max_tokens=8, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached < r2.usage.prompt_tokens


def test_speculation_is_on_by_default_counted_and_invisible(server: str, smollm: dl.Model) -> None:
    # --spec auto: n-gram prompt lookup. An input-grounded request's reply is what plain greedy
    # decoding gives.
    before = metric(server, "dasllama_spec_accepted_tokens_total")
    text = "Copy this sentence word for word: The quick brown fox jumps over the lazy dog near the river bank."
    body = {"model": "smollm", "messages": [{"role": "user", "content": text}], "max_tokens": 40, "temperature": 0}
    got = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    ids = dl.encode(smollm, dl.render_chat(smollm, [{"role": "user", "content": text}]), special=True)
    want = dl.generate(smollm, dl.create_session(smollm), ids, dl.SamplingParams(), 40)
    assert got == dl.decode(smollm, [t for t in want if t not in smollm.eog_ids])
    # How much is drafted follows this machine's measured timings (tests/test_speculative.py pins
    # it where speculation must run); the counters are there and consistent.
    assert metric(server, "dasllama_spec_accepted_tokens_total") >= before
    assert metric(server, "dasllama_spec_draft_tokens_total") >= metric(server, "dasllama_spec_accepted_tokens_total")


def test_spec_flags_are_checked_before_serving() -> None:
    for args, msg in ((["--spec", "draft"], "needs --model-draft"), (["--spec-max", "0"], "--spec-max"), (["--spec", "ngram", "--numerics", "ggml"], "numerics fast")):
        r = subprocess.run([sys.executable, "-m", "dasllama.serve", *args], check=False, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and msg in r.stderr, (args, r.stderr)


def test_embeddings_route(client: openai.OpenAI, server: str, smollm: dl.Model) -> None:
    texts = ["Hello world", "The cat sat on the mat"]
    # The official client asks for base64 and decodes it; float lists as well.
    got = client.embeddings.create(model="smollm", input=texts)
    want = dl.embed(smollm, texts)
    assert [d.index for d in got.data] == [0, 1] and got.usage.prompt_tokens == sum(len(dl.encode(smollm, t)) for t in texts)
    np.testing.assert_allclose(np.array([d.embedding for d in got.data]), want, atol=1e-6)
    floats = post(server, "/v1/embeddings", {"model": "smollm", "input": [dl.encode(smollm, texts[0])], "encoding_format": "float"}).json()
    np.testing.assert_allclose(floats["data"][0]["embedding"], want[0], atol=1e-6)
    for body, param in (
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [["a"]]}, "input"),
        ({"input": "hi", "dimensions": 7}, "dimensions"),
        ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
        ({"input": [[10**9]]}, "input"),
    ):
        r = post(server, "/v1/embeddings", {"model": "smollm", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert httpx.get(server + "/health").status_code == 200


def test_enable_thinking_is_taken_as_vllm_and_llama_server_take_it(server: str) -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": True}):
        r = post(server, "/v1/chat/completions", {"model": "smollm", "messages": msgs, "max_tokens": 4, **extra})
        assert r.status_code == 200, r.text
    for bad, param in (({"chat_template_kwargs": []}, "chat_template_kwargs"), ({"enable_thinking": "no"}, "enable_thinking")):
        r = post(server, "/v1/chat/completions", {"model": "smollm", "messages": msgs, "max_tokens": 4, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- in-process: what a real server cannot be made to do on demand -----------------------------


def in_process(server: Any, *calls: Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]) -> list[httpx.Response]:
    """Run `calls` in order against `server`'s app over ASGI; an exception the app re-raises after
    answering (Starlette's last-resort handler does) is not raised here, as a real server logs it."""
    from dasllama.serve import build_app

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=build_app(server), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return [await asyncio.wait_for(call(c), 30) for call in calls]

    return asyncio.run(go())


def sse_events(r: httpx.Response) -> list[Any]:
    return [json.loads(ln[6:]) if ln != "data: [DONE]" else "[DONE]" for ln in r.text.splitlines() if ln.startswith("data: ")]


def test_unexpected_exceptions_answer_in_openai_shape(smollm: dl.Model, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from dasllama.serve import Server, app, routes
    from dasllama.serve.engine import Engine

    def boom(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("boom")

    server = Server()
    eng = Engine(smollm, "smollm", streams=2, queue=8, chunk=64, page_rows=16)
    try:
        server.add(eng)
        server.ready = True
        body = {"model": "smollm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
        # Each failure on its own: the engine's submit (before any answer), its counts (/metrics),
        # the metrics a token updates (inside a stream's events) and a logprob entry (in the SSE
        # loop itself), then /health, which no route guard covers.
        monkeypatch.setattr(eng, "submit", boom)
        (plain,) = in_process(server, lambda c: c.post("/v1/chat/completions", json=body))
        monkeypatch.undo()
        monkeypatch.setattr(eng, "counts", boom)
        (metrics,) = in_process(server, lambda c: c.get("/metrics"))
        monkeypatch.undo()
        monkeypatch.setattr(app.Histogram, "observe", boom)
        (in_events,) = in_process(server, lambda c: c.post("/v1/chat/completions", json=body | {"stream": True}))
        monkeypatch.undo()
        monkeypatch.setattr(routes, "_logprob_entry", boom)
        (in_loop,) = in_process(server, lambda c: c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "logprobs": 1, "stream": True}))
        monkeypatch.undo()
        monkeypatch.setattr(Engine, "alive", property(boom))
        (health,) = in_process(server, lambda c: c.get("/health"))
        monkeypatch.undo()

        for r, path in ((plain, "POST /v1/chat/completions"), (metrics, "GET /metrics"), (health, "GET /health")):
            assert r.status_code == 500, r.text
            assert r.json() == {"error": {"message": f"{path} failed: boom", "type": "server_error", "param": None, "code": "internal_error"}}
        for r, path in ((in_events, "POST /v1/chat/completions"), (in_loop, "POST /v1/completions")):
            # Past the headers: a 200 whose stream ends with an error event, as an engine failure's does.
            assert r.status_code == 200, r.text
            events = sse_events(r)
            assert events[-1] == {"error": {"message": f"{path} failed: boom", "type": "server_error", "param": None, "code": "internal_error"}}, events
            assert all("choices" in e for e in events[:-1])
        # Each one logged with its traceback; the answers carried none of it.
        logged = [rec for rec in caplog.records if rec.name == "dasllama.serve" and rec.exc_info]
        assert len(logged) == 4 and all(rec.exc_info[0] is RuntimeError for rec in logged)
        # The server is still whole: the next request is answered.
        (after,) = in_process(server, lambda c: c.post("/v1/chat/completions", json=body))
        assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"]
    finally:
        eng.shutdown(timeout=5)


def test_api_key_guards_every_data_route_byte_for_byte() -> None:
    from dasllama.serve import Server

    key = "sk-ключ-🔑"  # not ASCII: compared as the UTF-8 bytes a client sends
    server = Server(api_key=key)
    server.ready = True
    right = f"Bearer {key}".encode()
    wrong = [b"", b"Bearer", right[:-1], right + b"x", right[:-1] + b"?", b"bearer " + key.encode(), right.replace(b"Bearer", b"Basic ")]

    def get(path: str, auth: bytes | None) -> Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]:
        return lambda c: c.get(path, headers={"Authorization": auth} if auth is not None else {})

    paths = ["/v1/models", "/metrics", "/status.json"]
    rs = in_process(server, *(get(p, a) for p in paths for a in [None, *wrong]), *(get(p, right) for p in paths), get("/health", None), get("/", None))
    refused, allowed, (health, page) = rs[: -len(paths) - 2], rs[-len(paths) - 2 : -2], rs[-2:]
    for r in refused:
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert all(r.status_code == 200 for r in allowed), [r.text for r in allowed]
    assert health.status_code == 200 and page.status_code == 200
