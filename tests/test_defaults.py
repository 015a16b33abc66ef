"""What a newcomer gets without asking (issue 42): sampling defaults from the model file's
general.sampling.* keys, else llama-server's; the server's flags over both; the generation cap
(--n-predict) ending a huge max_tokens at the cap; /v1/models' created time, context length and
defaults; the favicon; a CPU-only server's quiet start; `scripts/test.sh ARGS` running only ARGS."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import dasllama as dl
from dasllama.sampling_defaults import LLAMA_SERVER, from_metadata, sampling_defaults
from serverproc import log_text, start, stop
from synthetic import write_model

ROOT = Path(__file__).resolve().parent.parent
# What the synthetic model's file recommends (written as float32 / uint32, as llama.cpp's
# convert_hf_to_gguf.py writes them).
FILE_SAMPLING = {
    "general.sampling.temp": 0.6,
    "general.sampling.top_k": 5,
    "general.sampling.top_p": 0.9,
    "general.sampling.min_p": 0.1,
    "general.sampling.penalty_repeat": 1.1,
    "general.sampling.penalty_last_n": 32,
}
PROMPT = [1, 259, 260, 261, 262]  # token ids of the synthetic vocabulary (267 tokens)


@pytest.fixture(scope="module")
def recommended(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("defaults") / "recommended.gguf"
    write_model(path, ctx=256, general=FILE_SAMPLING)
    return path


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("defaults") / "plain.gguf"
    write_model(path, ctx=256)
    return path


def complete(base: str, **body: object) -> dict:
    r = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


# ---- the defaults themselves ------------------------------------------------------------------


def test_defaults_come_from_the_model_file(recommended: Path) -> None:
    m = dl.load_model(recommended)
    d = sampling_defaults(m.metadata)
    assert (d.temp, d.top_k, d.top_p, d.min_p, d.repeat_penalty, d.penalty_last_n) == (0.6, 5, 0.9, 0.1, 1.1, 32)
    assert set(d.sources.values()) == {"model file"}
    p = d.params()
    assert (p.temp, p.top_k, p.top_p, p.min_p, p.penalty, p.penalty_last_n) == (0.6, 5, 0.9, 0.1, 1.1, 32)


def test_without_keys_llama_server_defaults(plain: Path, smollm: dl.Model) -> None:
    for m in (dl.load_model(plain), smollm):
        d = sampling_defaults(m.metadata)
        assert (d.temp, d.top_k, d.top_p, d.min_p, d.repeat_penalty, d.penalty_last_n) == (0.8, 40, 0.95, 0.05, 1.0, 64)
        assert set(d.sources.values()) == {"llama-server default"}
        assert d == LLAMA_SERVER


def test_flags_win_over_the_file_and_bad_file_values_are_ignored(recommended: Path, caplog: pytest.LogCaptureFixture) -> None:
    m = dl.load_model(recommended)
    d = sampling_defaults(m.metadata, {"temp": 0.0, "top_k": None, "min_p": 0.0})
    assert (d.temp, d.top_k, d.min_p) == (0.0, 5, 0.0)
    assert d.sources["temp"] == d.sources["min_p"] == "flag" and d.sources["top_k"] == "model file"
    bad = {"general.sampling.temp": float("nan"), "general.sampling.top_p": 1.5, "general.sampling.top_k": -3, "general.sampling.min_p": "0.1", "general.sampling.penalty_repeat": 1.2}
    with caplog.at_level("WARNING", logger="dasllama"):
        assert from_metadata(bad) == {"repeat_penalty": 1.2}
    assert sum("ignoring general.sampling" in r.getMessage() for r in caplog.records) == 4
    with pytest.raises(ValueError, match="unknown sampling settings"):
        sampling_defaults({}, {"temperature": 0.5})


# ---- through the server -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def file_server(recommended: Path) -> Iterator[str]:
    proc, base = start("--model", str(recommended), "--alias", "rec", "--spec", "off")
    yield base
    assert stop(proc) == 0


def test_server_samples_with_the_files_values(file_server: str) -> None:
    card = httpx.get(file_server + "/v1/models/rec").json()
    s = card["meta"]["sampling"]
    assert (s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["repetition_penalty"], s["penalty_last_n"]) == (0.6, 5, 0.9, 0.1, 1.1, 32)
    assert set(s["sources"].values()) == {"model file"}
    # A request that sets nothing samples exactly as one that names the file's values; naming
    # llama-server's instead samples differently (for at least one of the seeds).
    explicit = {"temperature": 0.6, "top_k": 5, "top_p": 0.9, "min_p": 0.1, "repetition_penalty": 1.1}
    server_defaults = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0}
    differs = 0
    for seed in range(1, 7):
        by_default = complete(file_server, seed=seed)["choices"][0]["text"]
        assert by_default == complete(file_server, seed=seed, **explicit)["choices"][0]["text"]
        differs += by_default != complete(file_server, seed=seed, **server_defaults)["choices"][0]["text"]
    assert differs, "the file's settings and llama-server's sampled alike for every seed: the test cannot tell them apart"


def test_flags_override_the_file_through_the_server(recommended: Path) -> None:
    proc, base = start("--model", str(recommended), "--alias", "rec", "--spec", "off", "--temp", "0", "--top-k", "3")
    try:
        s = httpx.get(base + "/v1/models").json()["data"][0]["meta"]["sampling"]
        assert (s["temperature"], s["top_k"], s["top_p"]) == (0.0, 3, 0.9)
        assert s["sources"]["temp"] == s["sources"]["top_k"] == "flag" and s["sources"]["top_p"] == "model file"
        # --temp 0: every request that sets none is greedy, whatever its seed.
        texts = {complete(base, seed=seed)["choices"][0]["text"] for seed in range(4)}
        assert texts == {complete(base, temperature=0)["choices"][0]["text"]}
    finally:
        assert stop(proc) == 0


def test_bad_sampling_flags_are_refused() -> None:
    for flags, words in ((["--top-p", "1.5"], "--top-p must be between 0 and 1"), (["--temp", "-1"], "--temp must be >= 0"), (["--n-predict", "0"], "--n-predict must be at least 1"), (["--threads", "0"], "--threads must be at least 1")):
        r = subprocess.run([sys.executable, "-m", "dasllama.serve", *flags], check=False, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and words in r.stderr, (flags, r.stderr)


def test_help_shows_the_defaults() -> None:
    out = " ".join(subprocess.run([sys.executable, "-m", "dasllama.serve", "--help"], check=False, capture_output=True, text=True, timeout=60).stdout.split())
    for words in ("--n-predict N", "(default: 4096)", "--threads N", "--temp T", "else 0.8", "else 40", "else 0.95", "else 0.05", "general.sampling"):
        assert words in out, words


@pytest.fixture(scope="module")
def smollm_server(smollm: dl.Model, monkeypatch_module: pytest.MonkeyPatch) -> Iterator[tuple[str, subprocess.Popen]]:
    # As on a machine with no usable GPU: lavapipe (the tests' CPU Vulkan device) not allowed.
    monkeypatch_module.delenv("DASLLAMA_VK_ALLOW_CPU", raising=False)
    proc, base = start("--model", str(smollm.path), "--alias", "smollm", "--n-predict", "24", "--log-level", "info")
    yield base, proc
    assert stop(proc) == 0


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_the_cap_ends_a_huge_max_tokens_request(smollm_server: tuple[str, subprocess.Popen]) -> None:
    base, _ = smollm_server
    for body in ({"max_tokens": 10**11}, {"max_tokens": 1e11}, {"max_completion_tokens": 10**9}, {}):
        r = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Count to a million."}], "ignore_eos": True, **body}, timeout=120).json()
        assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 24, (body, r)
    # Under the cap a request's own bound holds; a text completion's default is OpenAI's 16.
    r = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True, "max_tokens": 5}, timeout=120).json()
    assert r["usage"]["completion_tokens"] == 5
    r = httpx.post(base + "/v1/completions", json={"prompt": "Once upon a time", "ignore_eos": True}, timeout=120).json()
    assert r["usage"]["completion_tokens"] == 16
    # Streamed, the last chunk says "length" after 24 pieces' worth of text.
    with httpx.stream("POST", base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Go on forever."}], "ignore_eos": True, "max_tokens": 10**11, "stream": True, "stream_options": {"include_usage": True}}, timeout=120) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: {")]
    chunks = [json.loads(ln[6:]) for ln in lines]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 24


def test_models_card_favicon_metrics_and_a_quiet_cpu_start(smollm_server: tuple[str, subprocess.Popen], smollm: dl.Model) -> None:
    base, proc = smollm_server
    card = httpx.get(base + "/v1/models").json()["data"][0]
    assert card["id"] == "smollm" and card["created"] == int(smollm.path.stat().st_mtime) > 0
    assert card["context_length"] == card["max_model_len"] == int(smollm.config["seq_len"]) == 8192
    assert card["meta"]["n_predict"] == 24 and card["meta"]["sampling"]["temperature"] == 0.8
    assert httpx.get(base + "/v1/models/smollm").json()["created"] == card["created"]
    fav = httpx.get(base + "/favicon.ico")
    assert fav.status_code == 200 and fav.headers["content-type"] == "image/x-icon" and fav.content[:4] == b"\x00\x00\x01\x00"
    metrics = httpx.get(base + "/metrics").text
    assert 'device=""' not in metrics and "dasllama_gpu_memory_bytes{" not in metrics
    tier = httpx.get(base + "/status.json").json()["tier"]
    assert tier["backend"] == "cpu" and tier["detail"].startswith("no GPU: running on the CPU") and "install" not in tier["detail"]
    log = log_text(proc)
    assert "no GPU: running on the CPU" in log and "libvulkan1" not in log and "Vulkan device" not in log, log[-2000:]
    assert "defaults: temp 0.8, top_k 40, top_p 0.95, min_p 0.05" in log and "at most 24 tokens a request" in log


def test_the_default_cap_is_4096(smollm: dl.Model) -> None:
    """The server as started with no flags: 10**11 tokens asked, 4096 given, finish_reason length.
    (Greedy text past the end of an answer repeats itself, so the default n-gram speculation
    speeds this up a good deal.)"""
    proc, base = start("--model", str(smollm.path))
    try:
        t = time.time()
        r = httpx.post(base + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 10**11, "ignore_eos": True, "temperature": 0}, timeout=600).json()
        assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 4096, r["usage"]
        print(f"4096 tokens in {time.time() - t:.1f}s")
    finally:
        assert stop(proc) == 0


def test_test_sh_with_arguments_runs_only_them() -> None:
    """`bash scripts/test.sh FILE ARGS` is pytest on FILE alone: no apt, lints or cargo."""
    r = subprocess.run(["bash", "scripts/test.sh", "tests/test_sampling_chain.py", "--collect-only"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    ids = [ln for ln in r.stdout.splitlines() if "::" in ln]
    assert ids and all(ln.startswith("tests/test_sampling_chain.py::") for ln in ids), r.stdout
    out = r.stdout + r.stderr
    for absent in ("apt-get", "installing", "clippy", "cargo", "Compiling", "ruff"):
        assert absent not in out, absent
