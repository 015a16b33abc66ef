"""Scale-out on Ray Serve, on one machine: `python -m dasllama.serve.ray --replicas 2` (one kernel
thread per replica) against a local Ray cluster this module starts once (2 CPUs), compared with a
single `python -m dasllama.serve`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import dasllama as dl
from serverproc import free_port, start, stop

REPO = Path(__file__).resolve().parent.parent
REPLICA = "x-dasllama-replica"


def _ray_or_skip() -> Any:
    try:
        import ray
        from ray import serve
    except ImportError as e:
        pytest.skip(f"Ray Serve is not installed ({e}); pip install -e '.[test]' installs it")
    return ray, serve


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray cluster for the whole module; yields its address."""
    ray, serve = _ray_or_skip()
    # Nothing leaves the machine (CI reaches no outside host; Ray would try to report usage).
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        ctx = ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    except Exception as e:  # noqa: BLE001 - whatever stops Ray from starting here is the skip's reason
        pytest.skip(f"a local Ray cluster could not start on this machine: {type(e).__name__}: {e}")
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        serve.shutdown()
        ray.shutdown()


def _wait_healthy(base: str, proc: subprocess.Popen | None = None, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"python -m dasllama.serve.ray exited with {proc.returncode}: {Path(proc.log_path).read_text()[-3000:]}")  # type: ignore[attr-defined]
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200 and httpx.get(base + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{base} did not become healthy within {timeout:.0f} s")


@pytest.fixture(scope="module")
def smollm_path(smollm: dl.Model) -> str:
    return str(smollm.path)


@pytest.fixture(scope="module")
def cli(cluster: str, smollm_path: str) -> Iterator[str]:
    """`python -m dasllama.serve.ray --replicas 2` on the module's cluster (RAY_ADDRESS); its URL."""
    port = free_port()
    env = {**os.environ, "RAY_ADDRESS": cluster, "DASLLAMA_THREADS": "1"}
    with tempfile.NamedTemporaryFile(prefix="dasllama-ray-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dasllama.serve.ray", "--replicas", "2", "--replica-threads", "1", "--model", smollm_path, "--alias", "smollm", "--port", str(port), "--streams", "4"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    proc.log_path = log.name  # type: ignore[attr-defined]
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, proc)
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        Path(log.name).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def single(smollm_path: str) -> Iterator[str]:
    """One plain server on one thread, to compare with."""
    old = os.environ.get("DASLLAMA_THREADS")
    os.environ["DASLLAMA_THREADS"] = "1"
    try:
        proc, base = start("--model", smollm_path, "--alias", "smollm", "--streams", "4")
    finally:
        if old is None:
            os.environ.pop("DASLLAMA_THREADS", None)
        else:
            os.environ["DASLLAMA_THREADS"] = old
    yield base
    stop(proc)


def chat(base: str, messages: list[dict[str, str]], max_tokens: int = 8, **kw: Any) -> httpx.Response:
    body = {"model": "smollm", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=120)


def test_prefix_chain_shares_links_exactly_with_a_shared_prefix() -> None:
    from dasllama.serve.ray.routing import CHUNK_CHARS, prefix_chain

    system = {"role": "system", "content": "You are a careful assistant who answers in full sentences. " * 4}
    a = prefix_chain({"model": "m", "messages": [system, {"role": "user", "content": "First question, about the weather at sea?"}]}, True)
    b = prefix_chain({"model": "m", "messages": [system, {"role": "user", "content": "Second question, about bread and butter?"}]}, True)
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert shared == (len("system\x1f") + len(system["content"]) + len("\x1euser\x1f")) // CHUNK_CHARS  # the user turns differ from their first letter
    # A later turn extends the earlier one's chain; another model or a text completion shares nothing.
    turn2 = prefix_chain({"model": "m", "messages": [system, {"role": "user", "content": "First question, about the weather at sea?"}, {"role": "assistant", "content": "Calm."}, {"role": "user", "content": "And tomorrow?"}]}, True)
    assert turn2[: len(a)] == a
    assert not set(a) & set(prefix_chain({"model": "other", "messages": [system]}, True))
    assert prefix_chain({"prompt": "x" * 200}, False) != prefix_chain({"messages": [{"role": "x", "content": "x" * 200}]}, True)
    assert len(prefix_chain({"prompt": list(range(40))}, False)) == 40 * 8 // CHUNK_CHARS
    assert prefix_chain({"messages": "not a list"}, True) == [] == prefix_chain(["no", "dict"], False) == prefix_chain({"prompt": "short"}, False)


def test_routers_rank_replicas() -> None:
    _ray_or_skip()
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

    from dasllama.serve.ray.router import PrefixRouter, RoundRobinRouter

    dep = DeploymentID(name="EngineReplica", app_name="test")
    a, b = (SimpleNamespace(replica_id=ReplicaID(unique_id=u, deployment_id=dep), max_ongoing_requests=12) for u in ("a", "b"))

    def req(*chain: str) -> Any:
        return SimpleNamespace(args=[SimpleNamespace(chain=list(chain))])

    def order(router: Any, pending: Any = None) -> list[str]:
        ranks = asyncio.run(router.choose_replicas([a, b], pending))
        assert all(len(rank) == 1 for rank in ranks) and len(ranks) == 2  # every replica, one per rank: the first with room wins
        return [rank[0].replica_id.unique_id for rank in ranks]

    r = PrefixRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True)
    r.initialize_state(imbalance=2)
    r.replica_queue_len_cache.update(a.replica_id, 1)
    r.replica_queue_len_cache.update(b.replica_id, 0)
    assert order(r, req("s1", "s2")) == ["b", "a"]  # never seen: the least loaded
    r.on_request_routed(req("s1", "s2"), a.replica_id, None)
    r.replica_queue_len_cache.update(a.replica_id, 2)
    assert order(r, req("s1", "s2", "s3")) == ["a", "b"]  # a served the prefix, and is only 2 busier
    assert order(r, req("s1", "t2")) == ["a", "b"]  # a shorter match still counts
    r.replica_queue_len_cache.update(a.replica_id, 3)
    assert order(r, req("s1", "s2")) == ["b", "a"]  # 3 busier than b: load wins
    assert order(r, req("u1")) == ["b", "a"]
    r.replica_queue_len_cache.update(a.replica_id, 0)
    r.on_request_routed(req("v1"), b.replica_id, None)
    assert order(r, req("v1", "v2")) == ["b", "a"]
    r.on_replica_actor_died(b.replica_id)
    assert "v1" not in r._owner and "s1" in r._owner  # b's prefixes died with it

    rr = RoundRobinRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN)
    rr.initialize_state()
    assert [order(rr, req("s1"))[0] for _ in range(4)] == ["a", "b", "a", "b"]


def test_cli_refuses_bad_flags_before_starting_ray() -> None:
    r = subprocess.run([sys.executable, "-m", "dasllama.serve.ray", "--replicas", "0", "--model", "no-such-model.gguf"], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--replicas must be at least 1" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "dasllama.serve.ray", "--help"], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--replicas" in r.stdout and "--kv-dtype" in r.stdout  # the server's flags, and its own


def test_config_file_builds_the_app(cluster: str) -> None:
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from dasllama.serve.ray import app_builder

    cfg = yaml.safe_load((REPO / "examples" / "ray-serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(cfg)
    app = schema.applications[0]
    assert app.import_path == "dasllama.serve.ray:app_builder"
    built = app_builder(app.args)
    assert type(built).__name__ == "Application"
    engine = next(d for d in app.deployments if d.name == "EngineReplica")
    assert engine.autoscaling_config["min_replicas"] < engine.autoscaling_config["max_replicas"]
    with pytest.raises(ValueError, match="argv must be a list"):
        app_builder({"argv": {"model": "x"}})


def test_same_output_as_single_server(cli: str, single: str) -> None:
    convs = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Name a color."}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
    ]
    for msgs in convs:
        a, b = chat(cli, msgs, 24), chat(single, msgs, 24)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        ja, jb = a.json(), b.json()
        assert ja["choices"][0]["message"] == jb["choices"][0]["message"]
        assert ja["usage"]["completion_tokens"] == jb["usage"]["completion_tokens"]
    # Text completions, streamed, and the server's own errors come back the same.
    body = {"model": "smollm", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    a, b = httpx.post(cli + "/v1/completions", json=body, timeout=120), httpx.post(single + "/v1/completions", json=body, timeout=120)
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]

    def streamed(base: str) -> list[str]:
        with httpx.stream("POST", base + "/v1/completions", json=body | {"stream": True}, timeout=120) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            frames = [ln[len("data: ") :] for ln in r.iter_lines() if ln.startswith("data:")]
        assert frames[-1] == "[DONE]"
        return [json.loads(f)["choices"][0]["text"] for f in frames[:-1]]

    pieces = streamed(cli)
    assert pieces == streamed(single) and "".join(pieces) == a.json()["choices"][0]["text"]
    bad = {"model": "smollm", "messages": [{"role": "user", "content": "hi"}], "temperature": 3}
    a, b = httpx.post(cli + "/v1/chat/completions", json=bad, timeout=60), httpx.post(single + "/v1/chat/completions", json=bad, timeout=60)
    assert a.status_code == b.status_code == 400 and a.json() == b.json()
    assert httpx.get(cli + "/v1/models", timeout=30).json() == httpx.get(single + "/v1/models", timeout=30).json()
    emb = {"model": "smollm", "input": ["The sea is calm.", "Bread rises."]}
    a, b = httpx.post(cli + "/v1/embeddings", json=emb, timeout=60), httpx.post(single + "/v1/embeddings", json=emb, timeout=60)
    assert a.status_code == b.status_code == 200 and [d["embedding"] for d in a.json()["data"]] == [d["embedding"] for d in b.json()["data"]]
    assert httpx.get(cli + "/nope", timeout=30).status_code == 404


SYSTEMS = [
    "You are a ship's navigator in the age of sail. You speak of stars, currents, charts and the trade winds, and you never mention engines. " * 3,
    "You are a pastry chef from Lyon. Every answer mentions butter, the oven's temperature, and how long the dough should rest before it is shaped. " * 3,
    "You are a patient mathematics tutor. You explain each step slowly, name the rule you used, and check the answer at the end with a second method. " * 3,
]
QUESTIONS = ["What do you do?", "Tell me about your morning.", "What is your favourite tool?", "Give me one piece of advice."]


def workload(base: str) -> tuple[float, dict[int, set[str]]]:
    """Three system turns, four questions each, asked round after round, plus a three-turn
    conversation; (prefix-cache hit rate over all prompt tokens, replicas each system turn went to)."""
    prompt = cached = 0
    where: dict[int, set[str]] = {i: set() for i in range(len(SYSTEMS))}
    for q in QUESTIONS:
        for i, sys_turn in enumerate(SYSTEMS):
            r = chat(base, [{"role": "system", "content": sys_turn}, {"role": "user", "content": q}], 4)
            assert r.status_code == 200, r.text
            u = r.json()["usage"]
            prompt += u["prompt_tokens"]
            cached += u["prompt_tokens_details"]["cached_tokens"]
            where[i].add(r.headers[REPLICA])
    msgs = [{"role": "user", "content": "Let us plan a garden with vegetables and herbs for a small balcony in the north. " * 4}]
    for turn in range(3):
        r = chat(base, msgs, 6)
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        prompt += u["prompt_tokens"]
        cached += u["prompt_tokens_details"]["cached_tokens"]
        msgs += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}, {"role": "user", "content": f"And what about week {turn + 2}?"}]
    return cached / prompt, where


def test_prefix_sharing_prompts_stick_to_one_replica(cli: str) -> None:
    system = {"role": "system", "content": "You are a lighthouse keeper on a northern island, and you describe the weather in detail. " * 3}
    seen = {chat(cli, [system, {"role": "user", "content": q}], 2).headers[REPLICA] for q in QUESTIONS}
    assert len(seen) == 1, f"prompts sharing a system turn went to {seen}"
    msgs = [{"role": "user", "content": "Describe a quiet harbour town at dawn, with its boats and its market. " * 3}]
    seen = set()
    for _ in range(3):
        r = chat(cli, msgs, 4)
        seen.add(r.headers[REPLICA])
        msgs += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}, {"role": "user", "content": "Go on."}]
    assert len(seen) == 1, f"one conversation's turns went to {seen}"
    # The second and third turns attach the first's pages on that replica.
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_killed_replica_new_requests_succeed(cli: str, cluster: str) -> None:
    import ray

    system = {"role": "system", "content": "You are a train conductor who knows every timetable of the old northern line by heart. " * 3}
    owner = chat(cli, [system, {"role": "user", "content": "Hello."}], 2).headers[REPLICA]
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in a["name"]]
    victim = next(a for a in actors if owner in a["name"])
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    # The prefix's owner is gone: its next turns, and new prompts, go to the survivor.
    for q in ("Hello again.", "When is the next train?", "Thank you."):
        r = chat(cli, [system, {"role": "user", "content": q}], 2)
        assert r.status_code == 200, r.text
        assert r.headers[REPLICA] != owner
    r = chat(cli, [{"role": "user", "content": "A brand new question."}], 2)
    assert r.status_code == 200 and r.headers[REPLICA] != owner
    # Serve replaces the dead replica; /health stays up through it.
    assert httpx.get(cli + "/health", timeout=30).status_code == 200


def test_prefix_routing_hits_the_cache_more_than_round_robin(cli: str, smollm_path: str) -> None:
    from ray import serve

    from dasllama.serve.ray.deployments import build

    # The CLI's app stops; each policy gets two fresh replicas (empty prefix caches) in its place,
    # behind the same proxy.
    serve.delete("dasllama")
    rates: dict[str, float] = {}
    spread: dict[str, dict[int, set[str]]] = {}
    for routing in ("prefix", "round-robin"):
        t0 = time.time()
        serve.run(build(["--model", smollm_path, "--alias", "smollm", "--streams", "4"], replicas=2, routing=routing, threads=1), name="dasllama", route_prefix="/")
        _wait_healthy(cli)
        rates[routing], spread[routing] = workload(cli)
        print(f"\n{routing:>11}: prefix-cache hit rate {rates[routing]:.1%} of prompt tokens; replicas per system turn {[len(s) for s in spread[routing].values()]} ({time.time() - t0:.1f} s)")
        serve.delete("dasllama")
    assert all(len(s) == 1 for s in spread["prefix"].values()), spread["prefix"]
    assert all(len(s) == 2 for s in spread["round-robin"].values()), spread["round-robin"]
    assert rates["prefix"] > rates["round-robin"] + 0.1, rates


def test_full_replicas_answer_503_like_a_full_queue(cli: str, smollm_path: str) -> None:
    from ray import serve

    from dasllama.serve.ray.deployments import build

    serve.delete("dasllama")
    # One replica taking two requests (one stream, one queued), one more waiting at the ingress.
    serve.run(build(["--model", smollm_path, "--alias", "smollm", "--streams", "1", "--queue", "1"], replicas=1, threads=1), name="dasllama", route_prefix="/")
    _wait_healthy(cli)

    async def burst() -> list[httpx.Response]:
        body = {"model": "smollm", "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(c.post(cli + "/v1/completions", json=body) for _ in range(6)))

    try:
        answers = asyncio.run(burst())
    finally:
        serve.delete("dasllama")
    codes = [r.status_code for r in answers]
    full = [r for r in answers if r.status_code == 503]
    assert codes.count(200) >= 2 and set(codes) <= {200, 503} and 503 in codes, codes
    assert full and all(r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] == "1" for r in full)
