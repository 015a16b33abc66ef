"""Two servers in one process, each on a runtime of its own (`dasllama.Runtime`): SmolLM2 on one
thread and a synthetic model on two, with their own thread teams, K/V page bins and step
budgets. Under load (every request of both at once, streamed and not) each answers every request,
and each answer is the one that server gives the same prompt alone (greedy decoding: a batch
changes nothing)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

import dasllama as dl

PROMPTS = {
    "smol": ["The capital of France is", "Once upon a time, there was a", "1, 2, 3, 4, 5,", "The best way to learn to code is"],
    "synth": ["hello world", "the quick brown fox", "abc abc abc", "lorem ipsum dolor"],
}
MAX_TOKENS = 10


@pytest.fixture()
def two_models(smollm: dl.Model, tmp_path: Path) -> tuple[dl.Model, dl.Model]:
    import synthetic

    path = tmp_path / "synth.gguf"
    synthetic.write_model(path, synthetic.QT.Q8_0, ctx=256)
    small = dl.load_model(smollm.path, runtime=dl.Runtime(threads=1))
    synth = dl.load_model(path, runtime=dl.Runtime(threads=2, step_ms=0))
    return small, synth


def test_two_servers_on_their_own_runtimes_answer_under_load(two_models: tuple[dl.Model, dl.Model]) -> None:
    from dasllama.serve import Server, build_app
    from dasllama.serve.engine import Engine

    small, synth = two_models
    assert (small.runtime.threads, synth.runtime.threads) == (1, 2)
    assert small.runtime is not synth.runtime and small.runtime is not dl.default_runtime()
    engines = {"smol": Engine(small, "smol", streams=4, queue=64, chunk=32, page_rows=16), "synth": Engine(synth, "synth", streams=3, queue=64, chunk=16, page_rows=16)}
    assert dl.step_budget(engines["synth"].sch) is None and dl.step_budget(engines["smol"].sch) is not None
    servers = {}
    for name, eng in engines.items():
        s = Server()
        s.add(eng)
        s.ready = True
        servers[name] = s

    async def ask(c: httpx.AsyncClient, name: str, prompt: str, stream: bool) -> tuple[int, str]:
        body: dict[str, Any] = {"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
        r = await c.post("/v1/completions", json=body)
        if r.status_code != 200 or not stream:
            return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]", events
        return 200, "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])

    async def go() -> tuple[dict[tuple[str, str], tuple[int, str]], list[tuple[str, str, tuple[int, str]]], list[int]]:
        clients = {n: httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(s)), base_url="http://test", timeout=120) for n, s in servers.items()}
        try:
            alone = {(n, p): await ask(clients[n], n, p, False) for n in PROMPTS for p in PROMPTS[n]}
            jobs = [(n, p, i % 2 == 1) for i in range(3) for n in PROMPTS for p in PROMPTS[n]]
            got = await asyncio.gather(*(ask(clients[n], n, p, st) for n, p, st in jobs))
            # Each server lists only its own model.
            other = [[m["id"] for m in (await clients[n].get("/v1/models")).json()["data"]] for n in ("smol", "synth")]
            return alone, [(n, p, g) for (n, p, _), g in zip(jobs, got, strict=True)], other
        finally:
            for c in clients.values():
                await c.aclose()

    try:
        alone, loaded, other = asyncio.run(go())
    finally:
        for eng in engines.values():
            eng.shutdown(timeout=10)
    assert all(code == 200 and text for code, text in alone.values()), alone
    assert len(loaded) == 24
    for n, p, answer in loaded:
        assert answer == alone[(n, p)], (n, p, answer, alone[(n, p)])
    # Real answers from each model: SmolLM2 knows its capitals; the synthetic model's random
    # weights give other text for the same kind of prompt.
    assert "Paris" in alone[("smol", PROMPTS["smol"][0])][1], alone
    assert {t for (n, _), (_, t) in alone.items() if n == "synth"}.isdisjoint({t for (n, _), (_, t) in alone.items() if n == "smol"})
    assert other == [["smol"], ["synth"]], other
    # Every page went back: nothing is held by a stream after the load.
    for eng in engines.values():
        st = dl.scheduler_stats(eng.sch)
        assert st["kv_pages_free"] + st["kv_pages_cached"] == st["kv_pages_total"], st


def test_two_llama_servers_in_one_process_get_their_own_thread_counts(smollm: dl.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    # dasllama-server -t N, twice in one process, through the path its command line takes
    # (translate, then load_models): each server's models run on a runtime of N threads, and the
    # environment is left alone.
    import os

    from dasllama.serve import Server, build_app
    from dasllama.serve.__main__ import load_models
    from dasllama.serve.llama_server import translate

    monkeypatch.delenv("DASLLAMA_THREADS", raising=False)
    dl.default_runtime()  # made already in a test process: each server makes its own
    servers = []
    for threads, alias in ((1, "one"), (2, "two")):
        args, _ = translate(["-m", str(smollm.path), "-t", str(threads), "-a", alias, "-np", "2", "--port", "0"])
        s = Server()
        load_models(s, args)
        s.ready = True
        servers.append((threads, alias, args, s))
    assert "DASLLAMA_THREADS" not in os.environ
    rts = [args.runtime for _, _, args, _ in servers]
    assert [rt.threads for rt in rts] == [1, 2] and rts[0] is not rts[1]
    assert all(rt is not dl.default_runtime() for rt in rts)
    for (threads, _, _, s), rt in zip(servers, rts, strict=True):
        engines = list(s.engines.values())
        assert engines and all(e.m.runtime is rt for e in engines), (threads, engines)

    async def go() -> list[str]:
        clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(s)), base_url="http://test", timeout=120) for *_, s in servers]
        try:
            body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
            rs = await asyncio.gather(*(c.post("/v1/completions", json={**body, "model": alias}) for c, (_, alias, _, _) in zip(clients, servers, strict=True)))
            assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
            return [r.json()["choices"][0]["text"] for r in rs]
        finally:
            for c in clients:
                await c.aclose()

    try:
        one, two = asyncio.run(go())
    finally:
        for *_, s in servers:
            for e in s.engines.values():
                e.shutdown(timeout=10)
    # The same model and greedy decoding: the thread count changes nothing in the answer.
    assert one == two and "Paris" in one, (one, two)
