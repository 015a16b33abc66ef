"""Shared fixtures: the real models, fetched through the project's own fetcher and cached, and a headless browser."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dasllama as dl

GOLDEN = Path(__file__).parent / "golden"


def drain(m: dl.Model, sch: dl.Scheduler) -> list[dl.SchedEvent]:
    """Step `sch` until nothing is queued or running; every event, in order (the last step's too)."""
    events: list[dl.SchedEvent] = []
    more = True
    while more:
        more = dl.scheduler_step(m, sch, events)
    return events


def golden(name: str) -> dict:
    return json.loads((GOLDEN / name).read_text())


@pytest.fixture(scope="session")
def smollm() -> dl.Model:
    return dl.load_model(dl.fetch("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def gemma() -> dl.Model:
    return dl.load_model(dl.fetch("gemma3-270m"))


@pytest.fixture(scope="session")
def smollm_golden() -> dict:
    return golden("smollm2-135m-instruct-q4_1.json")


@pytest.fixture(scope="session")
def gemma_golden() -> dict:
    return golden("gemma-3-270m-q4_k_m.json")


# Headless Chromium for the web pages' tests (test_webui.py, test_vision_server.py), one per module.
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[test]'")
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("no chromium on the PATH: apt-get install chromium (scripts/test.sh installs it when missing)")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, headless=True)
        yield b
        b.close()
