"""Shared fixtures: the real models, fetched through the project's own fetcher and cached."""

from __future__ import annotations

import json
from pathlib import Path

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
