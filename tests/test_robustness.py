"""Robustness: faults inside the engine (injected kernel panics, a failing stream), a full KV pool,
a dead engine thread, and a server under hostile or vanishing clients. Every failure is contained:
the call or stream that failed says so, and everything else goes on exactly as without it."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest

import dasllama as dl
from dasllama import _native
from dasllama import scheduler as sched_mod
from serverproc import start, stop

# The engine's fault hooks exist only in a build with the `fault-injection` feature (scripts/test.sh
# builds one; a release wheel has none).
needs_fault_hooks = pytest.mark.skipif(
    not (hasattr(_native.Runtime, "_inject_kernel_fault") and hasattr(_native, "_inject_stream_fault")), reason="built without the fault-injection feature"
)

# ---- helpers -----------------------------------------------------------------------------------


def prompt_ids(m: dl.Model, text: str) -> list[int]:
    ids = dl.encode(m, text)
    assert len(ids) >= 6, "the test needs a prompt of a few tokens"
    return ids


def run_sched(
    m: dl.Model,
    prompts: list[list[int]],
    max_new: int,
    page_rows: int = 16,
    chunk: int = 16,
    before_step: dict[int, Any] | None = None,
) -> tuple[dict[int, list[dl.SchedEvent]], dl.Scheduler]:
    """Run `prompts` (greedy) to the end; `before_step[k](sch)` runs just before step k."""
    sch = dl.create_scheduler(m, max_streams=4, page_rows=page_rows, chunk_tokens=chunk)
    for i, p in enumerate(prompts):
        assert dl.submit(m, sch, dl.PendingReq(id=i, prompt=p, max_new=max_new))
    by_id: dict[int, list[dl.SchedEvent]] = {}
    evs: list[dl.SchedEvent] = []
    step, more = 0, True
    while more:
        if before_step and step in before_step:
            before_step[step](sch)
        more = dl.scheduler_step(m, sch, evs)
        for e in evs:
            by_id.setdefault(e.id, []).append(e)
        evs.clear()
        step += 1
        assert step < 10_000, "the scheduler never went idle"
    return by_id, sch


def tokens_of(evs: list[dl.SchedEvent]) -> list[int]:
    fin = [e for e in evs if e.kind == "finished"]
    assert len(fin) == 1 and evs[-1] is fin[0], "exactly one finished event, last"
    toks = [e.token for e in evs if e.kind == "piece"]
    if fin[0].finish == "stop":
        toks.append(fin[0].token)
    return toks


@pytest.fixture(scope="module")
def sched_prompts(smollm_golden: dict) -> list[list[int]]:
    return [c["prompt_ids"] for c in smollm_golden["cases"][:3]]


# ---- 1. an injected kernel panic: EngineError, nothing half-done, the next call works --------------


def test_engine_error_is_a_dasllama_error() -> None:
    assert issubclass(dl.EngineError, dl.DasllamaError) and issubclass(dl.DasllamaError, Exception)
    assert issubclass(dl.KvPoolFullError, dl.DasllamaError)
    assert dl.errors.EngineError is dl.EngineError


@needs_fault_hooks
def test_kernel_fault_in_eval(smollm: dl.Model) -> None:
    ids = prompt_ids(smollm, "The quick brown fox jumps over the lazy dog")
    whole = dl.eval(smollm, dl.create_session(smollm), ids)
    for split in (3, len(ids) - 1):  # a multi-token chunk, and a single-token step
        s = dl.create_session(smollm)
        dl.eval(smollm, s, ids[:split])
        before = s.n_past
        smollm.runtime._native._inject_kernel_fault()
        with pytest.raises(dl.EngineError, match=r"eval failed inside the engine") as exc:
            dl.eval(smollm, s, ids[split:])
        assert isinstance(exc.value, dl.DasllamaError)
        assert "injected fault" in str(exc.value)
        assert s.n_past == before, "a failed eval must not advance the session"
        again = dl.eval(smollm, s, ids[split:])
        assert s.n_past == len(ids)
        np.testing.assert_array_equal(again, whole)


@needs_fault_hooks
def test_kernel_fault_in_eval_batch(smollm: dl.Model) -> None:
    pa = prompt_ids(smollm, "Once upon a time there was a little")
    pb = prompt_ids(smollm, "The capital city of France is called")
    a, b = dl.create_session(smollm), dl.create_session(smollm)
    dl.eval(smollm, a, pa)
    dl.eval(smollm, b, pb)
    ws = dl.create_batch_workspace(smollm)
    toks = [11, 42]
    smollm.runtime._native._inject_kernel_fault()
    with pytest.raises(dl.EngineError, match=r"eval_batch failed inside the engine"):
        dl.eval_batch(smollm, ws, [a, b], toks)
    assert (a.n_past, b.n_past) == (len(pa), len(pb)), "a failed batch must not advance any session"
    out = dl.eval_batch(smollm, ws, [a, b], toks)
    assert (a.n_past, b.n_past) == (len(pa) + 1, len(pb) + 1)
    np.testing.assert_array_equal(out[0], dl.eval(smollm, dl.create_session(smollm), pa + [toks[0]]))
    np.testing.assert_array_equal(out[1], dl.eval(smollm, dl.create_session(smollm), pb + [toks[1]]))
    # and the workspace and the sessions go on working
    nxt = [dl.sample(a), dl.sample(b)]
    out2 = dl.eval_batch(smollm, ws, [a, b], nxt)
    np.testing.assert_array_equal(out2[0], dl.eval(smollm, dl.create_session(smollm), pa + [toks[0], nxt[0]]))


@needs_fault_hooks
@pytest.mark.parametrize("fault_step", [0, 2, 6])  # the first prefill chunk, prefill beside decoding, decoding only
def test_transient_kernel_fault_in_a_scheduler_step(smollm: dl.Model, sched_prompts: list[list[int]], fault_step: int) -> None:
    clean, _ = run_sched(smollm, sched_prompts, max_new=10)
    got, sch = run_sched(smollm, sched_prompts, max_new=10, before_step={fault_step: lambda _s: smollm.runtime._native._inject_kernel_fault()})
    for i in range(len(sched_prompts)):
        fin = got[i][-1]
        assert fin.kind == "finished" and fin.finish in ("stop", "length"), (i, fin)
        assert fin.error is None and fin.error_type is None
        assert tokens_of(got[i]) == tokens_of(clean[i]), i
    assert dl.n_active(sch) == 0 and dl.n_queued(sch) == 0
    assert dl.scheduler_stats(sch)["finished"] == len(sched_prompts)
    # The fault fired inside the step (and was retried there): nothing is left armed.
    dl.eval(smollm, dl.create_session(smollm), sched_prompts[0][:4])


# ---- 2. one stream that fails ends alone ---------------------------------------------------------


@needs_fault_hooks
@pytest.mark.parametrize("fault_step", [1, 5])  # while it prefills; while it decodes
def test_a_failing_stream_ends_alone(smollm: dl.Model, sched_prompts: list[list[int]], fault_step: int) -> None:
    max_new = 12
    clean, _ = run_sched(smollm, sched_prompts, max_new=max_new)
    bad = 1
    injected: list[bool] = []
    got, sch = run_sched(smollm, sched_prompts, max_new=max_new, before_step={fault_step: lambda s: injected.append(sched_mod._inject_fault(s, bad))})
    assert injected == [True], "request 1 should have been running when the fault was injected"
    fin = got[bad][-1]
    assert fin.kind == "finished" and fin.finish == "error", fin
    assert fin.error_type == "internal"
    assert isinstance(fin.error, str) and "failed inside the engine" in fin.error
    pieces = [e.token for e in got[bad] if e.kind == "piece"]
    assert pieces == tokens_of(clean[bad])[: len(pieces)], "what it produced before failing is what it would have produced"
    assert len(pieces) < len(tokens_of(clean[bad]))
    for i in range(len(sched_prompts)):
        if i != bad:
            assert got[i][-1].finish in ("stop", "length")
            assert tokens_of(got[i]) == tokens_of(clean[i]), i
    assert dl.n_active(sch) == 0 and dl.n_queued(sch) == 0
    stats = dl.scheduler_stats(sch)
    assert stats["finished"] == len(sched_prompts)
    assert stats["kv_pages_used"] - stats["kv_pages_cached"] == 0, f"pages still held by streams: {stats}"
    # The scheduler goes on: the failed request's prompt again, and it is served in full.
    assert dl.submit(smollm, sch, dl.PendingReq(id=100, prompt=sched_prompts[bad], max_new=max_new))
    evs: list[dl.SchedEvent] = []
    while dl.scheduler_step(smollm, sch, evs):
        pass
    assert tokens_of([e for e in evs if e.id == 100]) == tokens_of(clean[bad])
    stats = dl.scheduler_stats(sch)
    assert stats["kv_pages_used"] - stats["kv_pages_cached"] == 0, stats


@needs_fault_hooks
def test_inject_fault_on_unknown_request_is_false(smollm: dl.Model) -> None:
    sch = dl.create_scheduler(smollm, max_streams=2)
    assert sched_mod._inject_fault(sch, 12345) is False


# ---- 3. SchedEvent is a native class ------------------------------------------------------------


def test_sched_event_is_native(smollm: dl.Model, sched_prompts: list[list[int]]) -> None:
    assert dl.SchedEvent is _native.SchedEvent and dl.scheduler.SchedEvent is _native.SchedEvent
    got, _ = run_sched(smollm, sched_prompts[:1], max_new=3)
    evs = got[0]
    assert all(type(e) is _native.SchedEvent for e in evs)
    piece, fin = evs[0], evs[-1]
    for e in (piece, fin):
        for name in ("stream", "id", "kind", "token", "text", "finish", "n_prompt", "n_gen", "n_cached", "ttft_us", "gen_us", "logprob", "top", "error_type", "error"):
            assert hasattr(e, name), name
    assert piece.kind == "piece" and isinstance(piece.text, str) and piece.id == 0 and piece.stream == 0 and piece.slot >= 0
    assert piece.logprob is None and list(piece.top) == []  # no logprobs asked for
    assert fin.kind == "finished" and fin.finish in ("stop", "length") and fin.n_prompt == len(sched_prompts[0])
    assert fin.n_gen >= 1 and fin.error is None and fin.error_type is None
    assert "SchedEvent(" in repr(fin)
    with pytest.raises(AttributeError):
        fin.finish = "error"  # frozen


# ---- 4. a full KV pool -------------------------------------------------------------------------


def test_full_pool_error_leaves_the_session_intact(smollm: dl.Model) -> None:
    ids = prompt_ids(smollm, "One two three four five six seven eight nine ten")[:8]
    assert len(ids) == 8
    pool = dl.create_kv_pool(smollm, page_rows=4, max_pages=2)  # room for 8 positions
    s = dl.create_session(smollm, pool)
    dl.eval(smollm, s, ids[:5])
    with pytest.raises(dl.KvPoolFullError) as exc:
        dl.eval(smollm, s, ids[5:] + [ids[0]])  # would be 9 positions
    assert isinstance(exc.value, dl.DasllamaError)
    assert s.n_past == 5, "a refused eval must not advance the session"
    out = dl.eval(smollm, s, ids[5:])  # exactly fills the pool
    np.testing.assert_array_equal(out, dl.eval(smollm, dl.create_session(smollm), ids))
    dl.release_kv_pages(s)
    assert dl.kv_pool_stats(pool)["pages_used"] == 0
    np.testing.assert_array_equal(dl.eval(smollm, s, ids), out)


# ---- 8. a dead engine thread: a 500 now, then 503s, and /health says so ---------------------------


def test_engine_death_is_reported_not_hung(smollm: dl.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    from dasllama.serve import engine as engine_mod
    from dasllama.serve.app import Server
    from dasllama.serve.asgi import build_app
    from dasllama.serve.engine import Engine

    def boom(*_a: Any, **_k: Any) -> bool:
        raise RuntimeError("boom")

    server = Server()
    eng = Engine(smollm, "smollm", streams=2, queue=8, chunk=64, page_rows=16)
    try:
        monkeypatch.setattr(engine_mod.sched, "scheduler_step", boom)
        server.engines["smollm"] = eng
        server.default = "smollm"
        server.ready = True
        body = {"model": "smollm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}

        async def go() -> tuple[httpx.Response, httpx.Response, httpx.Response, httpx.Response]:
            transport = httpx.ASGITransport(app=build_app(server))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                healthy = await asyncio.wait_for(c.get("/health"), 5)
                first = await asyncio.wait_for(c.post("/v1/chat/completions", json=body), 10)
                health = await asyncio.wait_for(c.get("/health"), 5)
                second = await asyncio.wait_for(c.post("/v1/chat/completions", json=body), 10)
                return healthy, first, health, second

        healthy, first, health, second = asyncio.run(go())
        assert healthy.status_code == 200
        assert first.status_code == 500, first.text
        err = first.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "engine_failure" and err["type"] == "server_error" and "boom" in err["message"]
        assert health.status_code == 503
        h = health.json()
        assert h["status"] == "error" and "smollm" in h["engines"] and "boom" in h["engines"]["smollm"]
        assert second.status_code == 503, second.text
        assert second.json()["error"]["code"] == "engine_failure"
        assert not eng.alive and eng.dead is not None
    finally:
        eng.shutdown(timeout=1)


# ---- the server under hostile and vanishing clients ---------------------------------------------


@pytest.fixture(scope="module")
def server(smollm: dl.Model) -> Iterator[str]:
    proc, base = start("--model", str(smollm.path), "--alias", "smollm", "--streams", "4")
    yield base
    stop(proc, timeout=10)  # killed past that: e.g. an executor thread still busy with a hostile prompt


def metrics(base: str) -> dict[str, float]:
    r = httpx.get(base + "/metrics", timeout=5)
    assert r.status_code == 200
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def active(base: str) -> float:
    return metrics(base)['dasllama_active_streams{model="smollm"}']


def queued(base: str) -> float:
    return metrics(base)['dasllama_queue_depth{model="smollm"}']


def outcome(base: str, what: str) -> float:
    return metrics(base).get(f'dasllama_requests_total{{model="smollm",outcome="{what}"}}', 0.0)


def wait_idle(base: str, within: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        m = metrics(base)
        if m['dasllama_active_streams{model="smollm"}'] == 0 and m['dasllama_queue_depth{model="smollm"}'] == 0:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"the server still has work {within} s later: {metrics(base)}")


def under_fire(base: str, hostile: dict[str, tuple[str, dict[str, Any]]], limit: float = 20.0) -> None:
    """Send the `hostile` requests at once while /health is polled every 100 ms, /metrics is read and
    a small chat runs; each hostile one must be refused (400, context_length_exceeded) in time."""
    stop = threading.Event()
    health: list[tuple[float, int | str]] = []

    def poll_health() -> None:
        with httpx.Client(timeout=5) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    code: int | str = c.get(base + "/health").status_code
                except httpx.HTTPError as e:
                    code = repr(e)
                health.append((time.monotonic() - t0, code))
                stop.wait(0.1)

    def send(path: str, body: dict[str, Any]) -> tuple[float, int | str, Any]:
        t0 = time.monotonic()
        try:
            r = httpx.post(base + path, json=body, timeout=limit)
        except httpx.HTTPError as e:
            return time.monotonic() - t0, repr(e), None
        try:
            payload = r.json()
        except ValueError:
            payload = r.text[:200]
        return time.monotonic() - t0, r.status_code, payload

    def timed_get(path: str) -> tuple[float, int]:
        t0 = time.monotonic()
        r = httpx.get(base + path, timeout=5)
        return time.monotonic() - t0, r.status_code

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    t_start = time.monotonic()
    with ThreadPoolExecutor(len(hostile) + 2) as ex:
        futs = {name: ex.submit(send, path, body) for name, (path, body) in hostile.items()}
        time.sleep(0.2)
        small = ex.submit(send, "/v1/chat/completions", {"model": "smollm", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0})
        mets = []
        for _ in range(3):
            mets.append(timed_get("/metrics"))
            time.sleep(0.2)
        results = {name: f.result() for name, f in futs.items()}
        small_res = small.result()
    time.sleep(0.3)  # a few more health polls after the storm
    stop.set()
    poller.join(10)
    elapsed = time.monotonic() - t_start

    problems = []
    for name, (dt, status, payload) in results.items():
        if status != 400:
            problems.append(f"{name}: got {status} after {dt:.1f} s, want 400 within {limit} s")
            continue
        if dt > limit:
            problems.append(f"{name}: 400 only after {dt:.1f} s")
        err = payload.get("error") if isinstance(payload, dict) else None
        if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"} or not err["message"]:
            problems.append(f"{name}: not OpenAI's error shape: {payload!r}"[:300])
        elif err["code"] != "context_length_exceeded":
            problems.append(f"{name}: code {err['code']!r}, want 'context_length_exceeded'")
    dt, status, payload = small_res
    if status != 200 or not payload["choices"][0]["message"]["content"]:
        problems.append(f"the small chat: {status} after {dt:.1f} s: {payload!r}"[:300])
    slow_health = [(round(t, 2), c) for t, c in health if c != 200 or t > 1.0]
    if slow_health or len(health) < max(3, int(elapsed / 0.5)):
        problems.append(f"/health: {len(health)} polls in {elapsed:.1f} s; slow or failed: {slow_health[:10]}")
    if any(c != 200 or t > 1.0 for t, c in mets):
        problems.append(f"/metrics: {mets}")
    assert not problems, "\n".join(problems)


def test_hostile_prompts_are_refused_while_the_server_stays_responsive(server: str) -> None:
    word = "a" * 1_000_000
    many_words = " ".join(["word"] * 600_000)  # 3 MB of text, under the 4 MiB body limit
    assert 2_900_000 < len(json.dumps({"prompt": many_words}).encode()) < 4 << 20
    hostile = {
        "1 MB word in a chat": ("/v1/chat/completions", {"model": "smollm", "messages": [{"role": "user", "content": word}], "max_tokens": 4}),
        "3 MB of words as a completion": ("/v1/completions", {"model": "smollm", "prompt": many_words, "max_tokens": 4}),
        "200k emoji in a chat": ("/v1/chat/completions", {"model": "smollm", "messages": [{"role": "user", "content": "\U0001f600" * 200_000}], "max_tokens": 4}),
        "1 MB word as a completion": ("/v1/completions", {"model": "smollm", "prompt": word, "max_tokens": 4}),
    }
    under_fire(server, hostile)
    wait_idle(server, 5)


def test_non_streaming_client_that_hangs_up_is_cancelled(server: str) -> None:
    # Greedy counting goes on for thousands of tokens: the request would run for a long time.
    body = {"model": "smollm", "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 2000, "temperature": 0}
    wait_idle(server, 10)
    cancelled_before = outcome(server, "cancelled")

    async def go() -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            task = asyncio.create_task(c.post(server + "/v1/completions", json=body))
            t0 = time.monotonic()
            while active(server) < 1:
                assert not task.done(), f"the request ended before it could be cancelled: {task.result().text[:200]}"
                assert time.monotonic() - t0 < 10, "the request never started"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            assert not task.done(), "the request should still be generating"
            task.cancel()  # closes the connection: the client hangs up
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    took = wait_idle(server, 3)
    assert took < 3
    assert outcome(server, "cancelled") == cancelled_before + 1


def test_streaming_headers_come_at_once_while_others_prefill(server: str) -> None:
    rng = random.Random(5)
    longs = [[rng.randrange(1000, 40000) for _ in range(3000)] for _ in range(4)]  # distinct: no shared prefix
    wait_idle(server, 10)

    async def go() -> tuple[float, float, int, str, dict[str, Any]]:
        async with httpx.AsyncClient(timeout=120) as c:
            tasks = [asyncio.create_task(c.post(server + "/v1/completions", json={"model": "smollm", "prompt": p, "max_tokens": 1, "temperature": 0})) for p in longs]
            t0 = time.monotonic()
            while active(server) < 4:
                assert time.monotonic() - t0 < 10, "the long prompts never started"
                await asyncio.sleep(0.05)
            body = {"model": "smollm", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0, "stream": True}
            try:
                t1 = time.monotonic()
                async with c.stream("POST", server + "/v1/chat/completions", json=body) as r:
                    t_headers = time.monotonic() - t1
                    # Still waiting for a stream, so no token of it can exist yet. (The gauge is
                    # published after each engine step: give it a few.)
                    q = queued(server)
                    while q < 1 and time.monotonic() - t1 < t_headers + 2:
                        await asyncio.sleep(0.05)
                        q = queued(server)
                    lines = r.aiter_lines()
                    first = ""
                    while not first:
                        first = await asyncio.wait_for(lines.__anext__(), 5)
                    t_first = time.monotonic() - t1
                    return t_headers, t_first, r.status_code, r.headers.get("content-type", ""), {"queued": q, "first": first}
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    t_headers, t_first, status, ctype, extra = asyncio.run(go())
    assert status == 200 and ctype.startswith("text/event-stream")
    assert t_headers < 2.0, f"headers took {t_headers:.2f} s"
    assert extra["queued"] >= 1, "the streaming request should still have been queued behind the long prompts"
    assert t_first < 2.0, f"the first event took {t_first:.2f} s"
    first = json.loads(extra["first"].removeprefix("data: "))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    wait_idle(server, 5)  # the hung-up long prompts are evicted


def test_hostile_prompts_just_under_the_byte_limit(server: str, smollm: dl.Model) -> None:
    """Prompts the byte bound lets through reach the tokenizer: one huge word (BPE merges within a
    single pre-token) must still be tokenized, and refused for its length, in bounded time."""
    limit = 16 * int(smollm.config["seq_len"])  # the server's default --max-prompt-bytes
    n = limit - 1000
    hostile = {
        f"{n}-byte word in a chat": ("/v1/chat/completions", {"model": "smollm", "messages": [{"role": "user", "content": "a" * n}], "max_tokens": 4}),
        f"{n // 4} emoji in a chat": ("/v1/chat/completions", {"model": "smollm", "messages": [{"role": "user", "content": "\U0001f600" * (n // 4)}], "max_tokens": 4}),
        f"{n}-byte word as a completion": ("/v1/completions", {"model": "smollm", "prompt": "b" * n, "max_tokens": 4}),
    }
    under_fire(server, hostile)

