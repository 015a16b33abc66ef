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
    for a, b, i in zip(alone, batched, ids, strict=True):
        la = dl.eval(m, a, i)
        np.testing.assert_array_equal(la, dl.eval(m, b, i))
        nxt.append(int(np.argmax(la)))
    ws = dl.create_batch_workspace(m)
    for _step in range(4):
        out = dl.eval_batch(m, ws, batched, nxt)
        assert out.shape == (len(PROMPTS), m.n_vocab) and out.dtype == np.float32
        for k, (a, t) in enumerate(zip(alone, nxt, strict=True)):
            np.testing.assert_array_equal(out[k], dl.eval(m, a, [t]))
        nxt = [dl.sample(s) for s in batched]  # greedy, from the logits eval_batch left in each session
        assert nxt == [int(np.argmax(r)) for r in out]
    assert [s.n_past for s in batched] == [s.n_past for s in alone]


def test_batched_greedy_equals_generate(smollm: dl.Model) -> None:
    ids = [dl.encode(smollm, p) for p in PROMPTS[:3]]
    want = [dl.generate(smollm, dl.create_session(smollm), i, dl.SamplingParams(), 12) for i in ids]
    sessions = [dl.create_session(smollm) for _ in ids]
    toks = [int(np.argmax(dl.eval(smollm, s, i))) for s, i in zip(sessions, ids, strict=True)]
    got = [[t] for t in toks]
    ws = dl.create_batch_workspace(smollm)
    for _ in range(11):
        out = dl.eval_batch(smollm, ws, sessions, toks)
        toks = [int(np.argmax(r)) for r in out]
        for g, t in zip(got, toks, strict=True):
            g.append(t)
    for w, g in zip(want, got, strict=True):
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


@pytest.mark.parametrize("page_rows", [1, 3, 16, 64])
def test_paged_sessions_match_private_ones(smollm: dl.Model, page_rows: int) -> None:
    pool = dl.create_kv_pool(smollm, page_rows=page_rows, max_pages=4096)
    ids = dl.encode(smollm, PROMPTS[1])
    flat, paged = dl.create_session(smollm), dl.create_session(smollm, pool)
    np.testing.assert_array_equal(dl.eval(smollm, flat, ids), dl.eval(smollm, paged, ids))
    ws = dl.create_batch_workspace(smollm)
    other = dl.create_session(smollm, pool)
    dl.eval(smollm, other, ids[:3])
    for t in [5, 6, 7]:
        out = dl.eval_batch(smollm, ws, [paged, other], [t, t])
        np.testing.assert_array_equal(out[0], dl.eval(smollm, flat, [t]))
    st = dl.kv_pool_stats(pool)
    assert st["pages_used"] == -(-paged.n_past // page_rows) + -(-other.n_past // page_rows)
    dl.release_kv_pages(paged)
    dl.release_kv_pages(other)
    st = dl.kv_pool_stats(pool)
    assert st["pages_used"] == 0 and st["pages_free"] == st["pages_total"]
    assert paged.n_past == 0


def test_full_pool_is_a_clear_error(smollm: dl.Model) -> None:
    pool = dl.create_kv_pool(smollm, page_rows=4, max_pages=2)
    s = dl.create_session(smollm, pool)
    dl.eval(smollm, s, [1, 2, 3, 4, 5, 6])
    with pytest.raises(dl.KvPoolFullError, match="KV pool is full"):
        dl.eval(smollm, s, [7, 8, 9])
    assert s.n_past == 6  # nothing half-done
    other = dl.create_session(smollm)
    np.testing.assert_array_equal(dl.eval(smollm, s, [7, 8]), dl.eval(smollm, other, [1, 2, 3, 4, 5, 6, 7, 8]))
    with pytest.raises(ValueError, match="page_rows"):
        dl.create_kv_pool(smollm, page_rows=0)


def test_q8_0_kv_codec(smollm: dl.Model) -> None:
    f16 = dl.create_kv_pool(smollm, page_rows=16, max_pages=64)
    q8 = dl.create_kv_pool(smollm, page_rows=16, kv_dtype=dl.KVDtype.q8_0, max_pages=64)
    ids = dl.encode(smollm, "The capital of France is Paris, and the capital of Italy is")
    a = dl.eval(smollm, dl.create_session(smollm, f16), ids)
    b = dl.eval(smollm, dl.create_session(smollm, q8), ids)
    assert not np.array_equal(a, b)  # a different codec really stores different numbers
    assert int(np.argmax(a)) == int(np.argmax(b)) and np.corrcoef(a, b)[0, 1] > 0.99
    assert dl.kv_pool_stats(q8)["bytes_per_page"] * 64 == dl.kv_pool_stats(f16)["bytes_per_page"] * 34
    # Through the scheduler: greedy output equals a q8_0 session run alone.
    sch = dl.create_scheduler(smollm, max_streams=2, page_rows=16, kv_dtype=dl.KVDtype.q8_0)
    s = dl.create_session(smollm, q8)
    want = dl.generate(smollm, s, ids, dl.SamplingParams(), 8)
    dl.submit(smollm, sch, dl.PendingReq(id=1, prompt=ids, max_new=8))
    evs: list[dl.SchedEvent] = []
    while dl.scheduler_step(smollm, sch, evs):
        pass
    got = [e.token for e in evs if e.kind == "piece"] + [e.token for e in evs if e.kind == "finished" and e.finish == "stop"]
    assert got == want


def test_tq4_kv_codec(smollm: dl.Model) -> None:
    """The rotated 4-bit cache: a quarter of f16's bytes, logits close to f16's, and the scheduler's
    greedy output equal to a tq4 session run alone."""
    f16 = dl.create_kv_pool(smollm, page_rows=16, max_pages=64)
    tq4 = dl.create_kv_pool(smollm, page_rows=16, kv_dtype=dl.KVDtype.tq4, max_pages=64)
    assert dl.kv_pool_stats(tq4)["bytes_per_page"] * 64 == dl.kv_pool_stats(f16)["bytes_per_page"] * 18
    ids = dl.encode(smollm, "The capital of France is Paris, and the capital of Italy is")
    a = dl.eval(smollm, dl.create_session(smollm, f16), ids)
    b = dl.eval(smollm, dl.create_session(smollm, tq4), ids)
    assert not np.array_equal(a, b)
    assert int(np.argmax(a)) == int(np.argmax(b)) and np.corrcoef(a, b)[0, 1] > 0.98
    sch = dl.create_scheduler(smollm, max_streams=2, page_rows=16, kv_dtype=dl.KVDtype.tq4)
    want = dl.generate(smollm, dl.create_session(smollm, tq4), ids, dl.SamplingParams(), 8)
    dl.submit(smollm, sch, dl.PendingReq(id=1, prompt=ids, max_new=8))
    dl.submit(smollm, sch, dl.PendingReq(id=2, prompt=ids[:5], max_new=8))
    evs: list[dl.SchedEvent] = []
    while dl.scheduler_step(smollm, sch, evs):
        pass
    got = [e.token for e in evs if e.id == 1 and (e.kind == "piece" or (e.kind == "finished" and e.finish == "stop"))]
    assert got == want
    with pytest.raises(ValueError, match="unknown KV dtype"):
        dl.create_kv_pool(smollm, page_rows=16, kv_dtype="q2")


def test_eval_all_rows_equal_one_token_at_a_time(smollm: dl.Model) -> None:
    # A speculative verify chunk: logits after every token of a chunk, each exactly what
    # decoding the tokens one by one gives, whether the chunk starts the session or follows.
    ids = dl.encode(smollm, "The quick brown fox jumps over the lazy dog because")
    one = dl.create_session(smollm)
    singles = np.stack([dl.eval(smollm, one, [t]) for t in ids])
    after = dl.eval(smollm, one, [ids[0]])
    for split in (0, 5):
        s = dl.create_session(smollm)
        if split:
            dl.eval(smollm, s, ids[:split])
        rows = dl.eval_all(smollm, s, ids[split:])
        assert rows.shape == (len(ids) - split, smollm.n_vocab)
        np.testing.assert_array_equal(rows, singles[split:])
        assert s.n_past == len(ids)
        # The session goes on from there as after eval.
        np.testing.assert_array_equal(dl.eval(smollm, s, [ids[0]]), after)
