"""Sessions, sampling and generation on the real model."""

from __future__ import annotations

import numpy as np
import pytest

import dasllama as dl

PROMPT = "Once upon a time"


def test_eval_returns_float32_logits(smollm: dl.Model) -> None:
    s = dl.create_session(smollm)
    logits = dl.eval(smollm, s, dl.encode(smollm, PROMPT))
    assert logits.dtype == np.float32 and logits.shape == (smollm.n_vocab,)
    assert np.isfinite(logits).all()
    assert s.n_past == len(dl.encode(smollm, PROMPT))


def test_prefill_equals_token_by_token(smollm: dl.Model) -> None:
    ids = dl.encode(smollm, PROMPT + " there was a little")
    a = dl.eval(smollm, dl.create_session(smollm), ids)
    s = dl.create_session(smollm)
    for t in ids:
        b = dl.eval(smollm, s, [t])
    # Same kernels per row whatever the batch: identical numbers, not merely close.
    np.testing.assert_array_equal(a, b)


def test_greedy_is_argmax(smollm: dl.Model) -> None:
    ids = dl.encode(smollm, PROMPT)
    s = dl.create_session(smollm)
    logits = dl.eval(smollm, s, ids)
    assert dl.sample(s) == int(np.argmax(logits))
    out = dl.generate(smollm, dl.create_session(smollm), ids, dl.SamplingParams(), 1)
    assert out == [int(np.argmax(logits))]


def test_same_seed_same_tokens(smollm: dl.Model) -> None:
    ids = dl.encode(smollm, PROMPT)
    p = lambda seed: dl.SamplingParams(temp=0.8, top_k=40, top_p=0.95, penalty=1.1, seed=seed)
    run = lambda seed: dl.generate(smollm, dl.create_session(smollm), ids, p(seed), 24)
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_generation_stops_at_end_of_turn(smollm: dl.Model) -> None:
    ids = dl.encode(smollm, "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n", special=True)
    out = dl.generate(smollm, dl.create_session(smollm), ids, dl.SamplingParams(), 200)
    assert out[-1] in smollm.eog_ids
    assert not any(t in smollm.eog_ids for t in out[:-1])


def test_on_piece_streams_whole_text_and_can_stop(smollm: dl.Model) -> None:
    ids = dl.encode(smollm, PROMPT)
    pieces: list[str] = []
    out = dl.generate(smollm, dl.create_session(smollm), ids, dl.SamplingParams(), 20, lambda _i, t: pieces.append(t))
    assert "".join(pieces) == dl.decode(smollm, out)
    seen: list[int] = []
    out = dl.generate(smollm, dl.create_session(smollm), ids, dl.SamplingParams(), 20, lambda i, _t: seen.append(i) or len(seen) < 3)
    assert len(out) == 3


def test_utf8_never_split(gemma: dl.Model) -> None:
    ids = dl.encode(gemma, "Emoji party: 🎉🎈🎂 and more emoji:")
    pieces: list[str] = []
    out = dl.generate(gemma, dl.create_session(gemma), ids, dl.SamplingParams(temp=1.0, seed=3), 40, lambda _i, t: pieces.append(t))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == dl.decode(gemma, out)


def test_sessions_are_independent(smollm: dl.Model) -> None:
    a, b = dl.create_session(smollm), dl.create_session(smollm)
    ids_a, ids_b = dl.encode(smollm, PROMPT), dl.encode(smollm, "The weather today")
    la = dl.eval(smollm, a, ids_a)
    dl.eval(smollm, b, ids_b)
    np.testing.assert_array_equal(la, dl.eval(smollm, dl.create_session(smollm), ids_a))


def test_context_overflow_is_a_clear_error(smollm: dl.Model) -> None:
    s = dl.create_session(smollm)
    n_ctx = smollm.config["seq_len"]
    with pytest.raises(dl.ContextOverflowError, match="context window"):
        dl.eval(smollm, s, [1] * (n_ctx + 1))
    assert s.n_past == 0  # nothing half-done: the session is still usable
    assert dl.eval(smollm, s, [1, 2]).shape == (smollm.n_vocab,)


def test_bad_inputs(smollm: dl.Model) -> None:
    s = dl.create_session(smollm)
    with pytest.raises(ValueError, match="out of range"):
        dl.eval(smollm, s, [smollm.n_vocab])
    with pytest.raises(ValueError, match="at least one token"):
        dl.eval(smollm, s, [])
    with pytest.raises(ValueError, match="eval a prompt first"):
        dl.sample(s)
    with pytest.raises(ValueError, match="top_p"):
        dl.generate(smollm, s, [1], dl.SamplingParams(temp=1.0, top_p=float("nan")), 4)
    with pytest.raises(ValueError, match="max_new"):
        dl.generate(smollm, s, [1], dl.SamplingParams(), -1)


def test_quant_modes_agree_on_argmax(smollm: dl.Model) -> None:
    ids = dl.encode(smollm, "The capital of France is")
    ref = dl.eval(smollm, dl.create_session(smollm), ids)
    for q in (dl.QuantMode.q8, dl.QuantMode.fp32):
        m = dl.load_model(smollm.path, q)
        got = dl.eval(m, dl.create_session(m), ids)
        assert int(np.argmax(got)) == int(np.argmax(ref)), q
        assert np.corrcoef(got, ref)[0, 1] > 0.99, q


def test_model_info(smollm: dl.Model, gemma: dl.Model) -> None:
    assert smollm.arch == "llama" and gemma.arch == "gemma3"
    assert smollm.config["n_layers"] == 30 and smollm.config["n_kv_heads"] == 3
    assert gemma.config["sliding_window"] == 512
    assert "llama" in dl.arch_names() and "gemma3" in dl.arch_names()
