"""Models named on a Hugging Face hub (`hf://owner/repo/file.gguf`, `owner/repo[:quant]`) through
huggingface_hub, against a local server that answers as the hub does (tests/hubserver.py, reached
through HF_ENDPOINT), and the `dasllama models` command that lists, fetches and removes them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import dasllama as dl
from dasllama.errors import FetchError
from dasllama.fetch.hub import HubRef, choose_file, parse_ref
from hubserver import serve
from serverproc import start, stop
from synthetic import write_model

pytest.importorskip("huggingface_hub")

SMOL = "test-org/SmolLM2-135M-Instruct-GGUF"
SMOL_FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"
TINY = "test-org/tiny-GGUF"


@pytest.fixture(scope="module")
def hub(smollm: dl.Model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, object]]:
    d = tmp_path_factory.mktemp("hubfiles")
    tiny, other = d / "tiny.gguf", d / "other.gguf"
    write_model(tiny)
    write_model(other, ctx=128)
    readme = d / "README.md"
    readme.write_text("# a model card\n")
    repos = {
        SMOL: {"README.md": readme, SMOL_FILE: smollm.path, "SmolLM2-135M-Instruct-Q8_0.gguf": tiny},
        # The projector sorts first and carries the default tag: it must not be chosen.
        TINY: {"mmproj-tiny-Q4_K_M.gguf": other, "tiny-Q4_K_M.gguf": tiny, "tiny-Q8_0.gguf": other, "sub/tiny-F16.gguf": other, "tiny-Q2_K-00001-of-00002.gguf": other},
    }
    with serve(repos) as (url, h):
        yield url, h


@pytest.fixture
def hub_env(hub: tuple[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, object, Path]:
    url, h = hub
    home = tmp_path / "home"
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("DASLLAMA_HOME", str(home))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return url, h, home


def test_references_are_told_from_paths_and_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_ref("hf://owner/repo/model-Q4_K_M.gguf") == HubRef("owner/repo", "model-Q4_K_M.gguf")
    assert parse_ref("hf://owner/repo/sub/dir/m.gguf") == HubRef("owner/repo", "sub/dir/m.gguf")
    assert parse_ref("owner/repo") == HubRef("owner/repo")
    assert parse_ref("owner/repo:q8_0") == HubRef("owner/repo", quant="q8_0")
    assert parse_ref("hf.co/owner/repo:Q4_K_M") == HubRef("owner/repo", quant="Q4_K_M")
    for not_hub in ("smollm2-135m-instruct", "models/x.gguf", "/abs/path/model", "x.gguf", "a/b/c"):
        assert parse_ref(not_hub) is None, not_hub
    (tmp_path / "owner" / "repo").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_ref("owner/repo") is None  # a folder here is a path
    with pytest.raises(FetchError, match=r"hf://owner/repo/file\.gguf"):
        parse_ref("hf://owner/repo")


def test_a_quantization_tag_picks_the_file_as_llama_cpp_does() -> None:
    files = ["README.md", "mmproj-m-Q4_K_M.gguf", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-Q2_K-00001-of-00003.gguf"]
    assert choose_file(files, None) == "m-Q4_K_M.gguf"
    assert choose_file(files, "q8_0") == "m-Q8_0.gguf"
    assert choose_file(files, "Q2_K") is None  # split files are not loaded
    assert choose_file(["b-Q8_0.gguf", "a-F16.gguf"], None) == "a-F16.gguf"  # no Q4_K_M: the first


def test_load_model_fetches_from_the_hub_once(hub_env: tuple[str, object, Path], smollm: dl.Model) -> None:
    _, h, home = hub_env
    before = len(h.requests)  # type: ignore[attr-defined]
    m = dl.load_model(f"hf://{SMOL}/{SMOL_FILE}")
    assert m.path == home / "hf" / SMOL / SMOL_FILE and m.path.stat().st_size == smollm.path.stat().st_size
    ids = dl.encode(m, "The capital of France is")
    assert dl.generate(m, dl.create_session(m), ids, dl.SamplingParams(), 8) == dl.generate(smollm, dl.create_session(smollm), ids, dl.SamplingParams(), 8)
    seen = len(h.requests)  # type: ignore[attr-defined]
    assert seen > before
    # Cached: the same name, and the repository with the file's tag, need no request at all.
    assert dl.load_model(f"hf://{SMOL}/{SMOL_FILE}").path == m.path
    assert dl.fetch(f"{SMOL}:Q4_1") == m.path
    assert len(h.requests) == seen  # type: ignore[attr-defined]


def test_repository_and_tag(hub_env: tuple[str, object, Path]) -> None:
    _, _, home = hub_env
    assert dl.fetch(TINY) == home / "hf" / TINY / "tiny-Q4_K_M.gguf"
    assert dl.fetch(f"{TINY}:q8_0") == home / "hf" / TINY / "tiny-Q8_0.gguf"
    assert dl.fetch(f"{TINY}:F16") == home / "hf" / TINY / "sub" / "tiny-F16.gguf"
    assert dl.load_model(f"{TINY}:Q8_0").config["seq_len"] == 128
    with pytest.raises(FetchError, match=r"no GGUF matching 'Q5_K_S'; it has: .*tiny-Q4_K_M.gguf"):
        dl.fetch(f"{TINY}:Q5_K_S")
    with pytest.raises(FetchError, match=r"cannot fetch test-org/nothing-here .*RepositoryNotFound"):
        dl.fetch("test-org/nothing-here")
    with pytest.raises(FetchError, match=r"cannot fetch hf://test-org/tiny-GGUF/missing\.gguf .*EntryNotFound"):
        dl.fetch(f"hf://{TINY}/missing.gguf")


def test_the_server_serves_a_hub_model(hub_env: tuple[str, object, Path]) -> None:
    proc, base = start("--model", f"{SMOL}:Q4_1")
    try:
        card = httpx.get(base + "/v1/models").json()["data"][0]
        assert card["id"] == "SmolLM2-135M-Instruct-Q4_1" and card["meta"]["file"] == SMOL_FILE
        r = httpx.post(base + "/v1/chat/completions", json={"model": f"{SMOL}:Q4_1", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 12, "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    finally:
        assert stop(proc) == 0


def models_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dasllama", "models", *args], check=False, capture_output=True, text=True, timeout=300)


def test_dasllama_models_lists_fetches_and_removes(hub_env: tuple[str, object, Path], smollm: dl.Model) -> None:
    _, _, home = hub_env
    r = models_cli("list")
    assert r.returncode == 0 and f"cache: {home}" in r.stdout and "smollm2-135m-instruct" in r.stdout and "not fetched" in r.stdout, r.stdout + r.stderr
    r = models_cli("fetch", TINY)
    assert r.returncode == 0 and r.stdout.strip() == str(home / "hf" / TINY / "tiny-Q4_K_M.gguf"), r.stdout + r.stderr
    assert "downloaded tiny-Q4_K_M.gguf" in r.stderr and "HTTP Request" not in r.stderr
    assert models_cli("fetch", f"hf://{TINY}/tiny-Q8_0.gguf").returncode == 0
    # A PyPI-fetched file in the cache is listed under its known name.
    (home / smollm.path.name).symlink_to(smollm.path)
    out = models_cli("list").stdout
    assert f"hf://{TINY}/tiny-Q4_K_M.gguf" in out and f"hf://{TINY}/tiny-Q8_0.gguf" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("smollm2-135m-instruct"))
    assert "98 MB" in line and "(default)" in line
    r = models_cli("remove", f"{TINY}:Q8_0")
    assert r.returncode == 0 and "tiny-Q8_0.gguf" in r.stdout and not (home / "hf" / TINY / "tiny-Q8_0.gguf").exists()
    assert (home / "hf" / TINY / "tiny-Q4_K_M.gguf").exists()
    r = models_cli("remove", TINY)  # the whole repository
    assert r.returncode == 0 and not (home / "hf" / TINY).exists()
    r = models_cli("remove", TINY)
    assert r.returncode == 1 and "nothing cached" in r.stderr
    r = models_cli("remove", "smollm2")  # an alias of the known name
    assert r.returncode == 0 and not (home / smollm.path.name).exists() and smollm.path.exists()
    r = models_cli("fetch", "test-org/nothing-here")
    assert r.returncode == 1 and "RepositoryNotFound" in r.stderr
