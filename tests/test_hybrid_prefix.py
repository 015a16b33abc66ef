"""The prefix cache for DeltaNet hybrids (qwen35, qwen35moe, qwen3next): a cached page carries a
snapshot of the recurrent state after it where a stream's pass ended there (its prompt's last page
boundary, the last one its turn reached), and a later prompt takes the pages up to the deepest
such page with that state. A second turn then prefills only what follows that page, gives the
same tokens and bit-identical log-probabilities as a cold run, and counts its hit like any other
(also in the server's /metrics); a system prompt shared by different prompts gets a state where
the match ends from its second request; eviction and clearing free the snapshots; speculation (MTP
heads, prompt lookup) still gives the output without it."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

import dasllama as dl
from dasllama import _native
from dasllama.scheduler import kv_page_bytes
from serverproc import start, stop
from synthetic import FAMILIES, write_family

HYBRIDS = sorted(n for n in FAMILIES if "hybrid" in FAMILIES[n])
ROWS = 8
CLOSE = [2, 7]


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dl.Model:
    path = tmp_path_factory.mktemp("hybrid-prefix") / f"{request.param}.gguf"
    write_family(path, request.param, meta={"context_length": 256})
    return dl.load_model(path)


def conversation(seed: int = 3) -> tuple[list[int], list[int]]:
    """A first turn's prompt (37 tokens) and what the user says next (9 tokens)."""
    rng = np.random.default_rng(seed)
    return [1] + [int(t) for t in rng.integers(3, 267, size=36)], [int(t) for t in rng.integers(3, 267, size=9)]


def turn(m: dl.Model, sch: dl.Scheduler, rid: int, prompt: list[int], max_new: int = 12) -> tuple[list[int], list[float], dl.SchedEvent]:
    """Run one request alone: its tokens, their log-probabilities and the finished event."""
    assert dl.submit(m, sch, dl.PendingReq(id=rid, prompt=prompt, close_toks=CLOSE, max_new=max_new, ignore_eos=True, logprobs=3))
    events: list[dl.SchedEvent] = []
    more = True
    while more:
        more = dl.scheduler_step(m, sch, events)
        for sid, ctx, n_past, _ in _native.scheduler_streams(sch):
            assert n_past == ctx, (sid, ctx, n_past)
    pieces = [e for e in events if e.kind == "piece"]
    (fin,) = [e for e in events if e.kind == "finished"]
    assert fin.finish == "length", fin.error
    return [e.token for e in pieces], [e.logprob for e in pieces], fin


def second_prompt(m: dl.Model, max_new: int = 12) -> tuple[list[int], list[int]]:
    """The second turn's prompt, and the tokens the first turn leaves in the cache: the prompt,
    the reply but its last token (sampled, never evaluated), and the close."""
    first, user = conversation()
    cold = dl.create_scheduler(m, max_streams=1, chunk_tokens=16)
    reply, _, _ = turn(m, cold, 0, first, max_new)
    kept = first + reply[:-1] + CLOSE
    return kept + user, kept


def test_second_turn_takes_its_prefix_and_state_from_the_cache(hybrid: dl.Model) -> None:
    prompt2, kept = second_prompt(hybrid)
    first = conversation()[0]
    # Cold: no pool, so no cache.
    want, want_lp, _ = turn(hybrid, dl.create_scheduler(hybrid, max_streams=2, chunk_tokens=16), 9, prompt2)
    sch = dl.create_scheduler(hybrid, max_streams=2, chunk_tokens=16, page_rows=ROWS)
    turn(hybrid, sch, 1, first)
    st = dl.scheduler_stats(sch)
    # Snapshots at the prompt's last boundary (32) and at the turn's last one (48 of 50 kept).
    assert st["kv_snapshots"] == 2 and st["kv_snapshot_bytes"] > 0 and st["cached_tokens"] == 0, st
    before = st["prefill_tokens"]
    got, got_lp, fin = turn(hybrid, sch, 2, prompt2)
    st = dl.scheduler_stats(sch)
    hit = len(kept) // ROWS * ROWS
    assert (fin.n_cached, st["cached_tokens"], st["kv_cache_hits"]) == (hit, hit, 1), (fin.n_cached, st)
    # Only what follows the cached page is prefilled: the kept tokens past it and the new turn.
    assert st["prefill_tokens"] - before == len(prompt2) - hit < ROWS + 9 + 1
    assert got == want
    assert got_lp == want_lp, "the restored state gives bit-identical logits"


def test_a_shared_prompt_prefix_is_taken_by_the_next_round(hybrid: dl.Model) -> None:
    # Four prompts over one 20-token system prompt, twice: the second round takes each prompt's
    # own pages up to its last boundary (each prompt's end left a snapshot there), streams
    # batched and chunked as they come, and every token is what it is without a cache.
    rng = np.random.default_rng(7)
    system = [1] + [int(t) for t in rng.integers(3, 267, size=19)]
    prompts = [system + [int(t) for t in rng.integers(3, 267, size=k)] for k in (3, 9, 14, 21)]
    cold = dl.create_scheduler(hybrid, max_streams=4, chunk_tokens=7)
    want = [turn(hybrid, cold, i, p, 8)[0] for i, p in enumerate(prompts)]
    sch = dl.create_scheduler(hybrid, max_streams=2, chunk_tokens=7, page_rows=4)
    for rnd in range(2):
        for i, p in enumerate(prompts):
            assert dl.submit(hybrid, sch, dl.PendingReq(id=10 * rnd + i, prompt=p, close_toks=CLOSE, max_new=8, ignore_eos=True))
        events: list[dl.SchedEvent] = []
        more = True
        while more:
            more = dl.scheduler_step(hybrid, sch, events)
        for i, w in enumerate(want):
            assert [e.token for e in events if e.id == 10 * rnd + i and e.kind == "piece"] == w, (rnd, i)
            (cached,) = [e.n_cached for e in events if e.id == 10 * rnd + i and e.kind == "finished"]
            if rnd:
                assert cached == (len(prompts[i]) - 1) // 4 * 4, (i, cached)
    st = dl.scheduler_stats(sch)
    assert st["kv_pages_used"] == st["kv_pages_cached"] and st["kv_snapshots"] <= 4 * 2, st


def test_a_system_prompt_gets_its_state_from_the_second_request_on(hybrid: dl.Model) -> None:
    # Three requests over one 22-token system prompt, one after another (page_rows 4). The first
    # leaves snapshots at its own prompt's end and turn's end, past the shared part. The second
    # matches the shared pages (20 tokens) without a state there: it prefills whole, but ends a
    # pass at 20 and leaves the state there. The third takes it.
    rng = np.random.default_rng(11)
    system = [1] + [int(t) for t in rng.integers(3, 267, size=21)]
    prompts = [system + [int(t) for t in rng.integers(3, 267, size=k)] for k in (9, 14, 21)]
    cold = dl.create_scheduler(hybrid, max_streams=1, chunk_tokens=64)
    want = [turn(hybrid, cold, i, p, 6)[0] for i, p in enumerate(prompts)]
    sch = dl.create_scheduler(hybrid, max_streams=1, chunk_tokens=64, page_rows=4)
    cached = []
    for i, p in enumerate(prompts):
        got, _, fin = turn(hybrid, sch, i, p, 6)
        assert got == want[i], i
        cached.append(fin.n_cached)
    st = dl.scheduler_stats(sch)
    assert cached == [0, 0, 20] and st["kv_cache_stateless"] == 1 and st["kv_cache_hits"] == 1, (cached, st)


def test_eviction_and_clearing_free_the_snapshots(hybrid: dl.Model) -> None:
    prompt2, _ = second_prompt(hybrid)
    first = conversation()[0]
    want, _, _ = turn(hybrid, dl.create_scheduler(hybrid, max_streams=1, chunk_tokens=16), 0, prompt2)
    page = kv_page_bytes(hybrid, ROWS)
    # A cache budget of 20 pages, where one snapshot is worth more than that: the snapshot and
    # its pages go as soon as the stream lets go of them, and the next turn prefills whole.
    snap_pages = -(-dl.scheduler_stats(_with_snapshot(hybrid, first))["kv_snapshot_bytes"] // 2 // page)
    assert snap_pages > 20
    sch = dl.create_scheduler(hybrid, max_streams=1, chunk_tokens=16, page_rows=ROWS, prefix_groups=20)
    turn(hybrid, sch, 1, first)
    st = dl.scheduler_stats(sch)
    assert (st["kv_snapshots"], st["kv_snapshot_bytes"]) == (0, 0), st
    got, _, fin = turn(hybrid, sch, 2, prompt2)
    # Its pages matched, none with a state: prefilled whole, and counted so.
    assert got == want and fin.n_cached == 0 and dl.scheduler_stats(sch)["kv_cache_stateless"] == 1
    # Room for them: the hit; cleared: none, and nothing held.
    sch = dl.create_scheduler(hybrid, max_streams=1, chunk_tokens=16, page_rows=ROWS, prefix_groups=4 * snap_pages)
    turn(hybrid, sch, 1, first)
    assert dl.scheduler_stats(sch)["kv_snapshots"] == 2
    dl.clear_prefix_cache(sch)
    st = dl.scheduler_stats(sch)
    assert (st["kv_snapshots"], st["kv_snapshot_bytes"], st["kv_pages_cached"], st["kv_pages_used"]) == (0, 0, 0, 0), st
    got, _, fin = turn(hybrid, sch, 2, prompt2)
    assert got == want and fin.n_cached == 0 and dl.scheduler_stats(sch)["kv_cache_hits"] == 0


def _with_snapshot(m: dl.Model, prompt: list[int]) -> dl.Scheduler:
    """A scheduler whose cache holds the snapshots `prompt`'s turn leaves (two)."""
    sch = dl.create_scheduler(m, max_streams=1, chunk_tokens=16, page_rows=ROWS)
    turn(m, sch, 0, prompt)
    assert dl.scheduler_stats(sch)["kv_snapshots"] == 2
    return sch


def test_a_snapshot_is_never_another_models(tmp_path: Path) -> None:
    # Two loads of one file are two models as far as the cache goes: each scheduler's pool is
    # its own, and a pool's chains start from its model's identity (the unit tests in kv/mod.rs
    # check a session of another model matching nothing in one pool).
    path = tmp_path / "q.gguf"
    write_family(path, "qwen35", meta={"context_length": 256})
    a, b = dl.load_model(path), dl.load_model(path)
    prompt2, _ = second_prompt(a)
    sch = _with_snapshot(a, conversation()[0])
    _, _, fin = turn(a, sch, 1, prompt2)
    assert fin.n_cached > 0
    with pytest.raises(ValueError):
        dl.submit(b, sch, dl.PendingReq(id=2, prompt=prompt2, max_new=2))


@pytest.mark.parametrize("name", HYBRIDS)
@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
def test_speculation_over_cached_prefixes_keeps_the_output(name: str, drafter: str, tmp_path: Path) -> None:
    # The file's MTP head (nearly always wrong: verify chunks rolled back to their first row) and
    # prompt lookup on a hybrid that loops (drafts accepted in part): verify chunks cross page
    # boundaries and roll the state back inside them, where a boundary's snapshot must go with
    # the rows. Both turns give the plain greedy tokens, the second from the cache.
    from test_mtp import copying_hybrid

    path = tmp_path / f"{name}.gguf"
    if drafter == "mtp":
        write_family(path, name, mtp=True, meta={"context_length": 256})
        m = dl.load_model(path)
    else:
        m = copying_hybrid(path, name)
    n = 40 if drafter == "mtp" else 80
    prompt2, kept = second_prompt(m, n)
    first = conversation()[0]
    want1, _, _ = turn(m, dl.create_scheduler(m, max_streams=1, chunk_tokens=16), 0, first, n)
    want2, _, _ = turn(m, dl.create_scheduler(m, max_streams=1, chunk_tokens=16), 0, prompt2, n)
    if drafter == "ngram":
        assert dl.attach_ngram_drafter(m, max_draft=4)
    sch = dl.create_scheduler(m, max_streams=2, chunk_tokens=16, page_rows=ROWS, mtp=True)
    dl.fix_draft_len(sch, 3)
    got1, _, _ = turn(m, sch, 1, first, n)
    got2, _, fin = turn(m, sch, 2, prompt2, n)
    st = dl.scheduler_stats(sch)
    assert (got1, got2) == (want1, want2)
    # The second turn from the turn-end snapshot (verify chunks may step over the last
    # boundary, leaving an earlier one).
    assert len(kept) - 3 * ROWS < fin.n_cached <= len(kept) // ROWS * ROWS and st["spec_verifies"] > 5, (fin.n_cached, len(kept), st)
    if drafter == "ngram":
        assert 0 < st["spec_accepted"] < st["spec_drafted"], st
        dl.detach_drafter(m)


def test_the_server_counts_a_hybrids_second_turn_as_a_hit(tmp_path: Path) -> None:
    path = tmp_path / "qwen35moe.gguf"
    write_family(path, "qwen35moe", meta={"context_length": 256})
    m = dl.load_model(path)
    first = conversation()[0]
    reply = dl.generate(m, dl.create_session(m), first, dl.SamplingParams(temp=0.0), 10)
    # A completion donates its prompt and the reply but its last token.
    prompt2 = first + reply + conversation()[1]
    hit = (len(first) + len(reply) - 1) // ROWS * ROWS
    want = dl.decode(m, dl.generate(m, dl.create_session(m), prompt2, dl.SamplingParams(temp=0.0), 6))
    proc, base = start("--model", str(path), "--alias", "h", "--page-rows", str(ROWS), "--streams", "2")
    try:

        def hits() -> float:
            text = httpx.get(base + "/metrics").text
            (line,) = [ln for ln in text.splitlines() if ln.startswith('dasllama_prefix_cache_hit_tokens_total{model="h"}')]
            return float(line.split()[-1])

        def complete(prompt: list[int], n: int) -> dict:
            r = httpx.post(base + "/v1/completions", json={"model": "h", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        assert dl.decode(m, reply) == complete(first, 10)["choices"][0]["text"]
        assert hits() == 0
        r = complete(prompt2, 6)
        assert r["choices"][0]["text"] == want
        assert hits() == hit > 0
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
        text = httpx.get(base + "/metrics").text
        assert 'dasllama_prefix_cache_state_snapshots{model="h"}' in text
    finally:
        assert stop(proc) == 0
