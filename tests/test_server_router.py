"""dasllama-server's router mode (--models-dir, --models-preset, /models, /models/load, /models/unload,
--models-max), sleep mode (--sleep-idle-seconds), slot files (--slot-save-path), logit_bias and
return_progress, black-box on SmolLM2."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

import dasllama as dl
from dasllama.serve.router import cached_models, preset_entries
from dasllama.serve.slots import encode_file
from serverproc import start, stop


def status(base: str, name: str) -> str:
    for card in httpx.get(base + "/models", timeout=30).json()["data"]:
        if card["id"] == name:
            return card["status"]["value"]
    raise AssertionError(f"{name} not listed")


def wait_status(base: str, name: str, want: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if status(base, name) == want:
            return
        time.sleep(0.05)
    raise AssertionError(f"{name} never became {want}")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory, smollm: dl.Model) -> Path:
    d = tmp_path_factory.mktemp("models")
    for name in ("alpha", "beta"):
        (d / f"{name}.gguf").symlink_to(smollm.path)
    (d / "gamma").mkdir()
    (d / "gamma" / "gamma-Q4_1.gguf").symlink_to(smollm.path)
    (d / "delta").mkdir()
    (d / "delta" / "mmproj-delta.gguf").symlink_to(smollm.path)  # a companion alone: no model
    return d


@pytest.fixture(scope="module")
def router(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cache = tmp_path_factory.mktemp("empty-cache")
    proc, base = start(
        "--models-dir", str(models_dir), "--models-max", "1", "-c", "512", "-np", "1", "-n", "8",
        module="dasllama.serve.llama_server", env={"LLAMA_CACHE": str(cache), "DASLLAMA_HOME": str(cache)},
    )
    yield base
    assert stop(proc) == 0


def test_router_lists_loads_evicts_and_unloads(router: str) -> None:
    props = httpx.get(router + "/props", timeout=30).json()
    assert props["role"] == "router" and props["max_instances"] == 1 and props["models_autoload"] is True
    ids = {c["id"]: c for c in httpx.get(router + "/models", timeout=30).json()["data"]}
    assert set(ids) == {"alpha", "beta", "gamma"} and all(c["status"]["value"] == "unloaded" and c["source"] == "models_dir" for c in ids.values())
    r = httpx.post(router + "/models/load", json={"model": "alpha"}, timeout=30)
    assert r.status_code == 200 and r.json() == {"success": True}
    wait_status(router, "alpha", "loaded")
    assert httpx.post(router + "/models/load", json={"model": "alpha"}, timeout=30).status_code == 400  # already running
    # A request for another model loads it, unloading the idle one (--models-max 1).
    r = httpx.post(router + "/v1/chat/completions", json={"model": "beta", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "beta" and status(router, "beta") == "loaded" and status(router, "alpha") == "unloaded"
    assert httpx.post(router + "/models/unload", json={"model": "beta"}, timeout=30).json() == {"success": True}
    wait_status(router, "beta", "unloaded")
    assert httpx.post(router + "/models/unload", json={"model": "beta"}, timeout=30).status_code == 400  # not running


def test_router_refuses_unknown_and_missing_models(router: str) -> None:
    r = httpx.post(router + "/v1/chat/completions", json={"model": "nope/model", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 400 and "not found" in r.json()["error"]["message"]
    r = httpx.post(router + "/completion", json={"prompt": "hi"}, timeout=30)
    assert r.status_code == 400 and "model" in r.json()["error"]["message"]
    assert httpx.post(router + "/models/load", json={"model": "nope"}, timeout=30).status_code == 404


def test_router_streams_pin_their_model(router: str) -> None:
    # Two models, room for one: each streamed request is answered whole, one after the other.
    with httpx.Client(timeout=120) as c:
        for name in ("gamma", "alpha"):
            with c.stream("POST", router + "/v1/chat/completions", json={"model": name, "stream": True, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}) as r:
                assert r.status_code == 200, r.read()
                assert any(line.startswith("data: [DONE]") for line in r.iter_lines())
    assert status(router, "alpha") == "loaded" and status(router, "gamma") == "unloaded"


def test_catalogue_sources(tmp_path: Path, smollm: dl.Model) -> None:
    snap = tmp_path / "models--org--repo-GGUF" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    for f in ("repo-Q8_0.gguf", "mmproj-repo-F16.gguf", "repo-notag.gguf"):
        (snap / f).symlink_to(smollm.path)
    assert set(cached_models(tmp_path)) == {"org/repo-GGUF:Q8_0"}
    ini = tmp_path / "p.ini"
    ini.write_text("[*]\ndedup-cache-models = 1\n\n[mine]\nhf-repo = org/repo-GGUF\nalias = a1,a2\n\n[local]\nmodel = x.gguf\n")
    entries, dedup = preset_entries(ini, tmp_path)
    assert entries["mine"].hf_repo == "org/repo-GGUF" and entries["mine"].aliases == {"a1", "a2"}
    assert entries["local"].spec == str(tmp_path / "x.gguf") and dedup == {"org/repo-GGUF"}


def test_sleep_unloads_and_wakes(smollm: dl.Model) -> None:
    proc, base = start("-m", str(smollm.path), "-c", "512", "-np", "1", "--sleep-idle-seconds", "1", "--metrics", module="dasllama.serve.llama_server")
    try:
        assert httpx.post(base + "/completion", json={"prompt": "Hello", "n_predict": 2}, timeout=60).status_code == 200
        awake = httpx.get(base + "/metrics", timeout=30).text
        deadline = time.time() + 30
        while not httpx.get(base + "/props", timeout=30).json()["is_sleeping"]:
            assert time.time() < deadline, "never fell asleep"
            time.sleep(0.1)
        # Asleep: the read-only routes answer from before, and polling them does not wake it.
        assert httpx.get(base + "/health", timeout=30).status_code == 200
        assert httpx.get(base + "/metrics", timeout=30).text == awake
        assert httpx.get(base + "/models", timeout=30).json()["data"][0]["id"]
        assert httpx.get(base + "/props", timeout=30).json()["is_sleeping"] is True
        r = httpx.post(base + "/tokenize", json={"content": "Hello"}, timeout=120)
        assert r.status_code == 200 and r.json()["tokens"]
        assert httpx.get(base + "/props", timeout=30).json()["is_sleeping"] is False
    finally:
        assert stop(proc) == 0


@pytest.fixture(scope="module")
def single(smollm: dl.Model) -> Iterator[str]:
    proc, base = start("-m", str(smollm.path), "-c", "1024", "-np", "2", "--temp", "0", module="dasllama.serve.llama_server")
    yield base
    assert stop(proc) == 0


def test_logit_bias_bans_and_forces_tokens(single: str) -> None:
    prompt = "The capital of France is"
    plain = httpx.post(single + "/completion", json={"prompt": prompt, "n_predict": 6, "temperature": 0, "return_tokens": True}, timeout=60).json()
    first = plain["tokens"][0]
    # Banned (false, -100, or as text): the greedy choice is never made.
    for bias in ([[first, False]], {str(first): -100}, [[plain["content"][:1] or " ", -100]] if plain["content"][:1].strip() else [[first, -100]]):
        j = httpx.post(single + "/completion", json={"prompt": prompt, "n_predict": 6, "temperature": 0, "return_tokens": True, "logit_bias": bias}, timeout=60).json()
        assert first not in j["tokens"], (bias, j)
        assert any(e["token"] == first and e["bias"] is None for e in j["generation_settings"]["logit_bias"])
    # Boosted: every sampled token is the boosted one, even at temperature 1.
    forced = 12345 % 49152
    j = httpx.post(single + "/completion", json={"prompt": prompt, "n_predict": 5, "temperature": 1, "return_tokens": True, "logit_bias": [[forced, 100]], "seed": 3}, timeout=60).json()
    assert j["tokens"] == [forced] * 5
    # ignore_eos bans the end-of-generation tokens, as llama-server does.
    j = httpx.post(single + "/completion", json={"prompt": prompt, "n_predict": 2, "ignore_eos": True}, timeout=60).json()
    assert j["generation_settings"]["logit_bias"] and all(e["bias"] is None for e in j["generation_settings"]["logit_bias"])
    # OpenAI's form, through the openai client.
    client = openai.OpenAI(base_url=single + "/v1", api_key="x")
    msgs = [{"role": "user", "content": "Say hello."}]
    ref = client.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0, logprobs=True)
    tok = ref.choices[0].logprobs.content[0].token
    ids = httpx.post(single + "/tokenize", json={"content": tok}, timeout=30).json()["tokens"]
    out = client.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0, logprobs=True, logit_bias={str(ids[0]): -100})
    assert out.choices[0].logprobs.content[0].token != tok
    bad = httpx.post(single + "/v1/chat/completions", json={"messages": msgs, "logit_bias": {"99999999": 1}}, timeout=30)
    assert bad.status_code == 400 and "out of range" in bad.json()["error"]["message"]


def test_return_progress_reports_the_prefill(single: str) -> None:
    prompt = "the quick brown fox jumps over the lazy dog " * 30
    body = {"prompt": prompt, "n_predict": 2, "stream": True, "return_progress": True, "timings_per_token": True, "cache_prompt": False}
    progress = []
    with httpx.stream("POST", single + "/completion", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and "prompt_progress" in line:
                progress.append(json.loads(line[6:]))
    p = [c["prompt_progress"] for c in progress]
    assert len(p) >= 2 and p[0]["processed"] == p[0]["cache"] and progress[0]["timings"]["prompt_ms"] == 0.0
    assert all(b["processed"] > a["processed"] and b["total"] == a["total"] for a, b in itertools.pairwise(p))
    assert p[-1]["processed"] == p[-1]["total"] > 200
    # The chat route's progress rides on empty assistant deltas, before any content.
    chunks = []
    with httpx.stream("POST", single + "/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "stream": True, "return_progress": True}, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    marks = [i for i, c in enumerate(chunks) if "prompt_progress" in c]
    content = [i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert marks and content and max(marks) < min(content)
    assert chunks[marks[-1]]["prompt_progress"]["processed"] == chunks[marks[-1]]["prompt_progress"]["total"]


def test_slot_save_restore_erase(smollm: dl.Model, tmp_path: Path) -> None:
    proc, base = start("-m", str(smollm.path), "-c", "1024", "-np", "2", "--temp", "0", "--slot-save-path", str(tmp_path), module="dasllama.serve.llama_server")
    try:
        prompt = "Once upon a time, in a small village by the sea, there lived an old fisherman who " * 2
        first = httpx.post(base + "/completion", json={"prompt": prompt, "n_predict": 8, "id_slot": 1}, timeout=60).json()
        r = httpx.post(base + "/slots/1?action=save", json={"filename": "s1.bin"}, timeout=30)
        n = first["tokens_evaluated"] + first["tokens_predicted"]
        assert r.status_code == 200 and r.json()["n_saved"] == n and r.json()["n_written"] == (tmp_path / "s1.bin").stat().st_size
        # Erased, the prompt is evaluated whole again.
        assert httpx.post(base + "/slots/1?action=erase", timeout=30).json() == {"id_slot": 1, "n_erased": n}
        again = httpx.post(base + "/completion", json={"prompt": prompt, "n_predict": 8, "id_slot": 1}, timeout=60).json()
        assert again["timings"]["cache_n"] == 0 and again["content"] == first["content"]
        httpx.post(base + "/slots/0?action=erase", timeout=30)
        # Restored into another slot, the next request finds the prompt in the prefix cache.
        r = httpx.post(base + "/slots/0?action=restore", json={"filename": "s1.bin"}, timeout=60)
        assert r.status_code == 200 and r.json()["n_restored"] == n
        after = httpx.post(base + "/completion", json={"prompt": prompt, "n_predict": 8, "id_slot": 0}, timeout=60).json()
        assert after["timings"]["cache_n"] > 0 and after["content"] == first["content"]
        # Refused: a path, a missing file, a file from a model with another vocabulary.
        assert httpx.post(base + "/slots/0?action=save", json={"filename": "../x.bin"}, timeout=30).status_code == 400
        assert httpx.post(base + "/slots/0?action=restore", json={"filename": "none.bin"}, timeout=30).status_code == 404
        other = {"model": "other-model.gguf", "arch": "gemma3", "n_vocab": 262144, "vocab_sha256": "0" * 64}
        (tmp_path / "other.bin").write_bytes(encode_file(other, [1, 2, 3]))
        r = httpx.post(base + "/slots/0?action=restore", json={"filename": "other.bin"}, timeout=30)
        msg = r.json()["error"]["message"]
        assert r.status_code == 400 and "other-model.gguf" in msg and smollm.path.name in msg
    finally:
        assert stop(proc) == 0
