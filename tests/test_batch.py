"""eval_batch: several sessions advance in one pass over the weights, each row bit-identical to
its session evaluated alone."""

from __future__ import annotations

import numpy as np
import pytest

import dasllama as dl

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Roses are red,", "1, 2, 3, 4,"]


@pytest.mark.parametrize("which", ["smollm", "gemma"])
def test_batched_logits_equal_single(which: str, request: pytest.FixtureRequest) -> None:
    m = request.getfixturevalue(which)
    ids = [dl.encode(m, p) for p in PROMPTS]
    alone = [dl.create_session(m) for _ in PROMPTS]
    batched = [dl.create_session(m) for _ in PROMPTS]
    nxt = []
    for a, b, i in zip(alone, batched, ids):
        la = dl.eval(m, a, i)
        np.testing.assert_array_equal(la, dl.eval(m, b, i))
        nxt.append(int(np.argmax(la)))
    ws = dl.create_batch_workspace(m)
    for _step in range(4):
        out = dl.eval_batch(m, ws, batched, nxt)
        assert out.shape == (len(PROMPTS), m.n_vocab) and out.dtype == np.float32
        for k, (a, t) in enumerate(zip(alone, nxt)):
            np.testing.assert_array_equal(out[k], dl.eval(m, a, [t]))
        nxt = [dl.sample(s) for s in batched]  # greedy, from the logits eval_batch left in each session
        assert nxt == [int(np.argmax(r)) for r in out]
    assert [s.n_past for s in batched] == [s.n_past for s in alone]


def test_batched_greedy_equals_generate(smollm: dl.Model) -> None:
    ids = [dl.encode(smollm, p) for p in PROMPTS[:3]]
    want = [dl.generate(smollm, dl.create_session(smollm), i, dl.SamplingParams(), 12) for i in ids]
    sessions = [dl.create_session(smollm) for _ in ids]
    toks = [int(np.argmax(dl.eval(smollm, s, i))) for s, i in zip(sessions, ids)]
    got = [[t] for t in toks]
    ws = dl.create_batch_workspace(smollm)
    for _ in range(11):
        out = dl.eval_batch(smollm, ws, sessions, toks)
        toks = [int(np.argmax(r)) for r in out]
        for g, t in zip(got, toks):
            g.append(t)
    for w, g in zip(want, got):
        n = len(w) if w[-1] not in smollm.eog_ids else len(w) - 1
        assert g[:n] == w[:n]


def test_eval_batch_bad_inputs(smollm: dl.Model, gemma: dl.Model) -> None:
    ws = dl.create_batch_workspace(smollm)
    a, b = dl.create_session(smollm), dl.create_session(smollm)
    dl.eval(smollm, a, [1, 2])
    dl.eval(smollm, b, [1, 2])
    with pytest.raises(ValueError, match="one token per session"):
        dl.eval_batch(smollm, ws, [a, b], [5])
    with pytest.raises(ValueError, match="appears twice"):
        dl.eval_batch(smollm, ws, [a, a], [5, 6])
    with pytest.raises(ValueError, match="out of range"):
        dl.eval_batch(smollm, ws, [a, b], [5, smollm.n_vocab])
    with pytest.raises(ValueError, match="different model"):
        dl.eval_batch(gemma, ws, [a], [5])
    assert a.n_past == 2 and b.n_past == 2  # nothing half-done
    assert dl.eval_batch(smollm, ws, [a, b], [5, 6]).shape == (2, smollm.n_vocab)
