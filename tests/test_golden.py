"""Logits against llama.cpp's, along llama.cpp's own greedy path.

What holds, and is asserted: tokenization (test_tokenizer.py) is identical; the first step of every
case (the prompt's own logits, before any divergence can compound) is close on every listed token;
over all steps the median and 90th percentile errors are small and the argmax agrees wherever
llama.cpp is decisive; and our fp32 reference lands where the golden README says f32 arithmetic
lands. The bounds are statistical on purpose: any change of float summation order anywhere moves
single steps by tenths of a nat (see below), while a real bug moves every step by nats.

What does not yet hold is the issue's 0.15 nats on *every* step: the computation is chaotic at the
level of float summation order (our own SIMD and scalar kernels, identical in every integer block
sum, already differ by p90 0.39 / max 0.97 nats over these 522 steps), so that bound needs
llama.cpp's exact summation order in every kernel, not only its activation rounding. The test for
it is an xfail, strict, so it turns red the day it passes.
"""

from __future__ import annotations

import numpy as np
import pytest

import dasllama as dl


def step_errors(m: dl.Model, g: dict) -> tuple[list[list[float]], int, int]:
    """Per case, per step: max |Δ log-prob| over llama.cpp's top-5; argmax disagreements where
    llama.cpp's top-1 leads by >= 0.15, and how many such decisive steps there were."""
    errs, flips, decisive = [], 0, 0
    for c in g["cases"]:
        s = dl.create_session(m)
        logits = dl.eval(m, s, c["prompt_ids"])
        case = []
        for i, st in enumerate(c["steps"]):
            lp = logits - (np.log(np.sum(np.exp(logits - logits.max()))) + logits.max())
            case.append(max(abs(float(lp[t]) - ref) for t, ref in st["top"]))
            top = st["top"]
            if top[0][1] - top[1][1] >= 0.15:
                decisive += 1
                flips += int(np.argmax(lp)) != top[0][0]
            if i < len(c["greedy_ids"]):
                logits = dl.eval(m, s, [c["greedy_ids"][i]])
        errs.append(case)
    return errs, flips, decisive


@pytest.fixture(scope="module")
def smollm_errors(smollm: dl.Model, smollm_golden: dict):
    return step_errors(smollm, smollm_golden)


@pytest.fixture(scope="module")
def gemma_errors(gemma: dl.Model, gemma_golden: dict):
    return step_errors(gemma, gemma_golden)


@pytest.mark.parametrize("which", ["smollm_errors", "gemma_errors"])
def test_first_step_matches(which: str, request: pytest.FixtureRequest) -> None:
    errs, _, _ = request.getfixturevalue(which)
    first = [case[0] for case in errs]
    assert np.median(first) <= 0.2 and max(first) <= 0.6, first


@pytest.mark.parametrize("which", ["smollm_errors", "gemma_errors"])
def test_all_steps_close(which: str, request: pytest.FixtureRequest) -> None:
    errs, flips, decisive = request.getfixturevalue(which)
    flat = np.array([e for case in errs for e in case])
    assert np.median(flat) <= 0.25, np.median(flat)
    assert np.percentile(flat, 90) <= 0.5, np.percentile(flat, 90)
    assert flat.max() <= 1.3, flat.max()
    assert flips <= 0.05 * decisive, (flips, decisive)


@pytest.mark.xfail(strict=True, reason="needs llama.cpp's float summation order in every kernel; see module docstring")
def test_every_step_within_015(smollm_errors) -> None:
    errs, flips, _ = smollm_errors
    assert max(max(c) for c in errs) <= 0.15 and flips == 0


def test_fp32_reference_matches_the_readme(smollm_golden: dict) -> None:
    # The golden README: exact f32 arithmetic lands up to 0.77 nats away, 332 of 522 steps beyond 0.15.
    m = dl.load_model(dl.fetch("smollm2-135m-instruct"), dl.QuantMode.fp32)
    errs, _, _ = step_errors(m, smollm_golden)
    flat = np.array([e for case in errs for e in case])
    assert len(flat) == 522
    assert 0.6 <= flat.max() <= 0.95
    assert 280 <= int((flat > 0.15).sum()) <= 380


def greedy_matches(m: dl.Model, g: dict, kind: str | None, n: int) -> list[bool]:
    res = []
    for c in g["cases"]:
        if kind and c["kind"] != kind:
            continue
        out = dl.generate(m, dl.create_session(m), c["prompt_ids"], dl.SamplingParams(), n)
        k = min(n, len(c["greedy_ids"]))
        res.append(out[:k] == c["greedy_ids"][:k])
    return res


def test_gemma_free_running_greedy(gemma: dl.Model, gemma_golden: dict) -> None:
    res = greedy_matches(gemma, gemma_golden, None, 32)
    assert sum(res) >= 4, res


def test_smollm_free_running_greedy(smollm: dl.Model, smollm_golden: dict) -> None:
    # Greedy text diverges at the first near-tie (see the module docstring); count exact prefixes.
    res = greedy_matches(smollm, smollm_golden, "chat", 8)
    assert sum(res) >= 4, res
