"""Kernels per runtime: one process runs the same model on the scalar twins and on the vector
kernels (each runtime's weights laid out at load for its own kernels), and with the GEMM on Intel
AMX and off it. The scalar twins sum in another order than the vector kernels, so their logits
differ in the last bits but not in substance; AMX's are the vector kernels' bit for bit. The
golden comparisons on the scalar twins are in test_golden.py (``*_scalar_errors``)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import dasllama as dl

PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome. The capital of Spain is"


def logits_of(m: dl.Model, ids: list[int]) -> np.ndarray:
    return np.asarray(dl.eval(m, dl.create_session(m), ids), dtype=np.float32)


def log_probs(x: np.ndarray) -> np.ndarray:
    return x - (np.log(np.sum(np.exp(x - x.max()))) + x.max())


@pytest.fixture(scope="module")
def scalar_smollm(smollm: dl.Model) -> dl.Model:
    return dl.load_model(smollm.path, runtime=dl.Runtime(threads=2, kernels="scalar"))


def test_scalar_and_vector_kernels_side_by_side(smollm: dl.Model, scalar_smollm: dl.Model) -> None:
    assert smollm.runtime.kernels == "simd" and scalar_smollm.runtime.kernels == "scalar"
    ids = dl.encode(smollm, PROMPT)
    fast, slow = logits_of(smollm, ids), logits_of(scalar_smollm, ids)
    # The scalar twins ran: their summation order differs from the vector kernels', so some
    # logit moves (were both runtimes on one set of kernels, the two would be equal bit for bit).
    assert not np.array_equal(fast, slow)
    # ... by rounding only: the same prediction, and the top log-probabilities within the tenths
    # of a nat that another summation order moves them on a model this small (test_golden's
    # bound on a first step); a wrong kernel moves them by nats.
    assert int(np.argmax(fast)) == int(np.argmax(slow))
    top = np.argsort(fast)[-5:]
    moved = np.abs(log_probs(fast)[top] - log_probs(slow)[top])
    assert float(moved.max()) <= 0.6, moved
    assert float(np.mean(np.abs(fast - slow))) < 0.5
    # The same model again on the vector kernels is the default runtime's bit for bit.
    again = dl.load_model(smollm.path, runtime=dl.Runtime(threads=1))
    np.testing.assert_array_equal(logits_of(again, ids), fast)


def test_two_kernel_choices_at_once_keep_to_their_own(smollm: dl.Model, scalar_smollm: dl.Model) -> None:
    # The choice travels with each runtime's threads: passes of both at the same time give what
    # each gives alone, bit for bit.
    ids = dl.encode(smollm, PROMPT)
    alone = {"simd": logits_of(smollm, ids), "scalar": logits_of(scalar_smollm, ids)}
    got: dict[str, list[np.ndarray]] = {"simd": [], "scalar": []}

    def run(name: str, m: dl.Model) -> None:
        for _ in range(3):
            got[name].append(logits_of(m, ids))

    threads = [threading.Thread(target=run, args=a) for a in (("simd", smollm), ("scalar", scalar_smollm))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, outs in got.items():
        assert len(outs) == 3
        for out in outs:
            np.testing.assert_array_equal(out, alone[name], err_msg=name)


def test_amx_on_and_off_per_runtime(gemma: dl.Model) -> None:
    on_rt, off_rt = dl.Runtime(amx=True), dl.Runtime(amx=False)
    off, why_off = off_rt.amx_status()
    assert not off and "amx=False" in why_off, why_off
    on, why = on_rt.amx_status()
    if not on:
        pytest.skip(f"this machine runs no AMX: {why}")
    # Gemma 3 270M's FFN down matrix is 2048 wide: a prompt of 32+ rows goes through the tiles.
    ids = dl.encode(gemma, PROMPT * 2)
    assert len(ids) >= 40
    a = logits_of(dl.load_model(gemma.path, runtime=on_rt), ids)
    b = logits_of(dl.load_model(gemma.path, runtime=off_rt), ids)
    np.testing.assert_array_equal(a, b)


def test_a_kernel_choice_that_is_none_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'simd'.*'scalar'"):
        dl.Runtime(kernels="avx9")
