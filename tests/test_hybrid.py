"""DeltaNet hybrids (qwen35, qwen35moe, qwen3next) as the engine serves them: the recurrent state
is per session and per stream, carried by eval, eval_batch and the scheduler; batched, chunked
(down to 7 tokens) and paged runs at 1-8 streams (the prefix cache on, tests/test_hybrid_prefix.py)
give each stream the tokens it gets alone; a hybrid speculates (its state rolls back by replay) but cannot be a draft model; `gpu_dn_room`
is a no-op on the CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import drain

import dasllama as dl
from synthetic import FAMILIES, family_cases, family_reference_logits, write_family

HYBRIDS = sorted(n for n in FAMILIES if "hybrid" in FAMILIES[n])
MAX_NEW = 10


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dl.Model:
    path = tmp_path_factory.mktemp("hybrid") / f"{request.param}.gguf"
    write_family(path, request.param)
    return dl.load_model(path)


def prompts() -> list[list[int]]:
    # Eight prompts; the first four share a 20-token prefix (a paged pool's cache would match it).
    rng = np.random.default_rng(7)
    shared = [1] + [int(t) for t in rng.integers(3, 267, size=19)]
    out = [shared + [int(t) for t in rng.integers(3, 267, size=k)] for k in (3, 9, 14, 21)]
    out += [[1] + [int(t) for t in rng.integers(3, 267, size=k)] for k in (4, 11, 17, 30)]
    return out


def solo(m: dl.Model, p: list[int]) -> list[int]:
    """Greedy tokens of one session alone, one eval per token, past end-of-generation."""
    s = dl.create_session(m)
    out = [int(np.argmax(dl.eval(m, s, p)))]
    while len(out) < MAX_NEW:
        out.append(int(np.argmax(dl.eval(m, s, [out[-1]]))))
    return out


def test_config_says_which_layers_recur(hybrid: dl.Model) -> None:
    assert hybrid.config["recurrent_layers"] == 3 and hybrid.config["n_layers"] == 4


def test_state_is_per_session_and_released_with_it(hybrid: dl.Model) -> None:
    ids = prompts()[0]
    a, b = dl.create_session(hybrid), dl.create_session(hybrid)
    first = dl.eval(hybrid, a, ids)
    # Another session's run does not touch a's state; a's next step equals a fresh run's.
    dl.eval(hybrid, b, prompts()[5])
    np.testing.assert_array_equal(dl.eval(hybrid, a, [5]), dl.eval_all(hybrid, dl.create_session(hybrid), ids + [5])[-1])
    # Released, the session starts from a zero state again.
    dl.release_kv_pages(a)
    np.testing.assert_array_equal(dl.eval(hybrid, a, ids), first)


def test_chunked_prefill_ends_in_the_whole_prefills_state(hybrid: dl.Model) -> None:
    ids = prompts()[7]
    whole = dl.create_session(hybrid)
    dl.eval(hybrid, whole, ids)
    for chunk in (1, 7, 13):
        s = dl.create_session(hybrid)
        for i in range(0, len(ids), chunk):
            dl.eval(hybrid, s, ids[i : i + chunk])
        # The same state: every later step agrees bit for bit.
        for t in (9, 40, 3):
            np.testing.assert_array_equal(dl.eval(hybrid, s, [t]), dl.eval(hybrid, whole, [t]))
        whole = dl.create_session(hybrid)
        dl.eval(hybrid, whole, ids)


@pytest.mark.parametrize(("streams", "chunk", "page_rows"), [(1, 64, 0), (3, 7, 0), (8, 7, 16), (4, 16, 8), (8, 64, 16)])
def test_scheduler_streams_get_their_solo_tokens(hybrid: dl.Model, streams: int, chunk: int, page_rows: int) -> None:
    ps = prompts()
    want = [solo(hybrid, p) for p in ps]
    sch = dl.create_scheduler(hybrid, max_streams=streams, max_queue=64, chunk_tokens=chunk, page_rows=page_rows)
    for i, p in enumerate(ps):
        assert dl.submit(hybrid, sch, dl.PendingReq(id=i, prompt=p, max_new=MAX_NEW, ignore_eos=True))
    events = drain(hybrid, sch)
    for i, w in enumerate(want):
        assert [e.token for e in events if e.id == i and e.kind == "piece"] == w, i
    stats = dl.scheduler_stats(sch)
    # Every prompt token prefilled or taken from the cache (with the state at its page).
    assert stats["cached_tokens"] + stats["prefill_tokens"] == sum(map(len, ps))
    if page_rows:
        assert stats["kv_pages_used"] == stats["kv_pages_cached"] and stats["kv_snapshots"] <= 4 * streams, stats
    else:
        assert stats["cached_tokens"] == 0


def test_a_hybrid_speculates(hybrid: dl.Model) -> None:
    # A verify chunk's rejected rows are taken back by replaying the DeltaNet state over the
    # accepted ones (tests/test_mtp.py checks the tokens); only as a draft model is a hybrid refused.
    from dasllama.speculative import configure, no_speculation

    assert no_speculation(hybrid) is None
    assert dl.attach_ngram_drafter(hybrid) and dl.mtp_capable(hybrid)
    assert configure(hybrid, "auto").startswith("n-gram")
    dl.detach_drafter(hybrid)
    assert not dl.mtp_capable(hybrid)


def test_gpu_dn_room_is_a_noop_on_the_cpu(hybrid: dl.Model) -> None:
    ps = prompts()[:2]
    dl.gpu_dn_room(2)
    sessions = [dl.create_session(hybrid) for _ in ps]
    for s, p in zip(sessions, ps, strict=True):
        dl.eval(hybrid, s, p)
    out = dl.eval_batch(hybrid, dl.create_batch_workspace(hybrid), sessions, [5, 6])
    for p, row, t in zip(ps, out, [5, 6], strict=True):
        np.testing.assert_array_equal(row, dl.eval_all(hybrid, dl.create_session(hybrid), p + [t])[-1])
    with pytest.raises(ValueError, match="stream count"):
        dl.gpu_dn_room(-1)


def test_native_scheduler_refuses_a_hybrid_draft_model(hybrid: dl.Model) -> None:
    from dasllama import _native

    drafter, why = _native.model_drafter(hybrid._native, hybrid._native, 4)
    assert drafter is not None, why
    with pytest.raises(ValueError, match="draft model has recurrent \\(DeltaNet\\) layers"):
        _native.create_scheduler(hybrid._native, 2, 8, 64, 0, 0, "f16", drafter)


def test_older_fused_qkvz_files_read_as_the_split_ones(tmp_path: Path) -> None:
    # Older qwen3next files fuse Q, K, V and the output gate into one `ssm_in` a layer, grouped per
    # key head: the same values there are the same model (fp32 mode: both read exactly the values
    # the files hold), and it is the float64 reading of those values.
    split, legacy = tmp_path / "split.gguf", tmp_path / "legacy.gguf"
    write_family(split, "qwen3next")
    weights = write_family(legacy, "qwen3next", legacy_qkvz=True)
    ids = family_cases("qwen3next")[0]
    a, b = dl.load_model(split, dl.QuantMode.fp32), dl.load_model(legacy, dl.QuantMode.fp32)
    la, lb = dl.eval_all(a, dl.create_session(a), ids), dl.eval_all(b, dl.create_session(b), ids)
    np.testing.assert_allclose(lb, la, rtol=0, atol=1e-4 * np.abs(la).max())
    ref = family_reference_logits(weights, "qwen3next", ids)
    assert np.abs(lb - ref).max() <= 0.005 * np.abs(ref).max()


def test_a_fused_qkvz_of_the_wrong_size_names_itself(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    write_family(path, "qwen3next", legacy_qkvz=True, replace={"blk.0.ssm_in.weight": np.zeros((100, 256), np.float32)})
    with pytest.raises(dl.GgufError, match=r"tensor 'blk.0.ssm_in.weight' is 100x256 but the model's metadata implies 768x256"):
        dl.load_model(path)
