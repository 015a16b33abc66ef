"""Logits against llama.cpp's, along llama.cpp's own greedy path.

The golden files are the output of llama.cpp's x86 AVX2 CPU build (an AVX2-only build of the
vendored sources reproduces them to 0.000 nats; the same sources built for AVX-512 differ from them
by a median 0.17 and up to 0.64 nats on SmolLM2). These small models are chaotic at the level of
float summation order: a one-ulp difference in a dot product flips q8 activation quants and f16
casts further on, and by the last layer moves log-probabilities by tenths of a nat. So:

- ``Numerics.ggml`` (ggml's AVX2 order in every matmul and attention product) is held to the
  issue's bound: every listed log-probability within 0.15 nats on every step, the same argmax, and
  free-running greedy text equal to llama.cpp's.
- ``Numerics.fast`` (our tiled kernels: the same activation rounding, our own order) is held to
  statistical bounds: the first step of every case is close, the median and 90th percentile over
  all steps are small, and the argmax agrees wherever llama.cpp is decisive. A real bug moves every
  step by nats; a different summation order moves single steps by tenths.
- Our fp32 reference lands where the golden README says f32 arithmetic lands.
"""

from __future__ import annotations

import numpy as np
import pytest

import dasllama as dl

# The scalar twins (a runtime of their own, in this process) are checked on the first steps of
# every case only: those kernels are several times slower, and a wrong kernel shows from the
# first step.
SCALAR_STEPS = 6


def step_errors(m: dl.Model, g: dict, steps: int | None = None) -> tuple[list[list[float]], int, int]:
    """Per case, per step (the first `steps`, or all): max |Δ log-prob| over llama.cpp's top-5;
    argmax disagreements where llama.cpp's top-1 leads by >= 0.15, and how many such decisive
    steps there were."""
    errs, flips, decisive = [], 0, 0
    for c in g["cases"]:
        s = dl.create_session(m)
        logits = dl.eval(m, s, c["prompt_ids"])
        case = []
        for i, st in enumerate(c["steps"][:steps]):
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


@pytest.fixture(scope="module")
def scalar_runtime() -> dl.Runtime:
    rt = dl.Runtime(kernels="scalar")
    assert rt.kernels == "scalar" and not rt.amx_status()[0], rt.amx_status()
    return rt


@pytest.fixture(scope="module")
def smollm_scalar_errors(smollm: dl.Model, smollm_golden: dict, scalar_runtime: dl.Runtime):
    return step_errors(dl.load_model(smollm.path, runtime=scalar_runtime), smollm_golden, SCALAR_STEPS)


@pytest.fixture(scope="module")
def gemma_scalar_errors(gemma: dl.Model, gemma_golden: dict, scalar_runtime: dl.Runtime):
    return step_errors(dl.load_model(gemma.path, runtime=scalar_runtime), gemma_golden, SCALAR_STEPS)


ERRORS = ["smollm_errors", "gemma_errors", "smollm_scalar_errors", "gemma_scalar_errors"]


@pytest.mark.parametrize("which", ERRORS)
def test_first_step_matches(which: str, request: pytest.FixtureRequest) -> None:
    errs, _, _ = request.getfixturevalue(which)
    first = [case[0] for case in errs]
    assert np.median(first) <= 0.2 and max(first) <= 0.6, first


@pytest.mark.parametrize("which", ERRORS)
def test_all_steps_close(which: str, request: pytest.FixtureRequest) -> None:
    errs, flips, decisive = request.getfixturevalue(which)
    flat = np.array([e for case in errs for e in case])
    assert np.median(flat) <= 0.25, np.median(flat)
    assert np.percentile(flat, 90) <= 0.5, np.percentile(flat, 90)
    assert flat.max() <= 1.3, flat.max()
    assert flips <= 0.05 * decisive, (flips, decisive)


@pytest.fixture(scope="module")
def smollm_ggml() -> dl.Model:
    return dl.load_model(dl.fetch("smollm2-135m-instruct"), numerics=dl.Numerics.ggml)


@pytest.fixture(scope="module")
def gemma_ggml() -> dl.Model:
    return dl.load_model(dl.fetch("gemma3-270m"), numerics=dl.Numerics.ggml)


@pytest.mark.parametrize("which", ["smollm", "gemma"])
def test_ggml_numerics_every_step_within_015(which: str, request: pytest.FixtureRequest) -> None:
    m, g = request.getfixturevalue(f"{which}_ggml"), request.getfixturevalue(f"{which}_golden")
    errs, flips, decisive = step_errors(m, g)
    worst = max(max(c) for c in errs)
    assert worst <= 0.15 and flips == 0, (worst, flips, decisive)
    # Not merely within tolerance: the same numbers, up to the golden file's rounding.
    assert worst < 1e-4, worst


def test_ggml_numerics_free_running_greedy(smollm_ggml: dl.Model, smollm_golden: dict, gemma_ggml: dl.Model, gemma_golden: dict) -> None:
    res = greedy_matches(smollm_ggml, smollm_golden, "chat", 32)
    assert sum(res) >= 9, res
    res = greedy_matches(gemma_ggml, gemma_golden, None, 32)
    assert all(res), res


def test_ggml_numerics_batched_equals_alone(smollm_ggml: dl.Model, smollm_golden: dict) -> None:
    # eval_batch in ggml numerics: each session's logits are those it gets alone.
    cases = smollm_golden["cases"][:3]
    alone = []
    for c in cases:
        s = dl.create_session(smollm_ggml)
        dl.eval(smollm_ggml, s, c["prompt_ids"])
        alone.append(dl.eval(smollm_ggml, s, c["greedy_ids"][:1]))
    sessions = [dl.create_session(smollm_ggml) for _ in cases]
    for s, c in zip(sessions, cases, strict=True):
        dl.eval(smollm_ggml, s, c["prompt_ids"])
    ws = dl.create_batch_workspace(smollm_ggml)
    batched = dl.eval_batch(smollm_ggml, ws, sessions, [c["greedy_ids"][0] for c in cases])
    for a, b in zip(alone, batched, strict=True):
        np.testing.assert_array_equal(a, b)


def test_ggml_numerics_refuses_what_it_does_not_cover(smollm_ggml: dl.Model) -> None:
    # (Weight formats it does not cover: test_synthetic.)
    with pytest.raises(ValueError, match="f16"):
        dl.create_kv_pool(smollm_ggml, kv_dtype=dl.KVDtype.q8_0)
    with pytest.raises(ValueError, match="unknown numerics"):
        dl.load_model(smollm_ggml.path, numerics="fastest")


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
