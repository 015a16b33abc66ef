"""The continuous-batching scheduler: every request's greedy output equals its single-session
`generate` output, whatever else runs beside it; every request finishes exactly once."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dasllama as dl

MAX_NEW = 12


@pytest.fixture(scope="module")
def prompts(smollm_golden: dict) -> list[list[int]]:
    return [c["prompt_ids"] for c in smollm_golden["cases"]]


@pytest.fixture(scope="module")
def reference(smollm: dl.Model, prompts: list[list[int]]) -> list[list[int]]:
    return [dl.generate(smollm, dl.create_session(smollm), p, dl.SamplingParams(), MAX_NEW) for p in prompts]


def run(m: dl.Model, sch: dl.Scheduler, events: list[dl.SchedEvent] | None = None) -> dict[int, list[dl.SchedEvent]]:
    by_id: dict[int, list[dl.SchedEvent]] = {}
    evs: list[dl.SchedEvent] = []
    more = True
    while more:
        more = dl.scheduler_step(m, sch, evs)
        for e in evs:
            by_id.setdefault(e.id, []).append(e)
        if events is not None:
            events.extend(evs)
        evs.clear()
    return by_id


def tokens_of(evs: list[dl.SchedEvent]) -> list[int]:
    toks = [e.token for e in evs if e.kind == "piece"]
    fin = [e for e in evs if e.kind == "finished"]
    assert len(fin) == 1 and evs[-1] is fin[0], "exactly one finished event, last"
    if fin[0].finish == "stop":
        toks.append(fin[0].token)
    return toks


@pytest.mark.parametrize(("streams", "chunk", "page_rows"), [(1, 64, 0), (4, 64, 0), (4, 7, 16), (16, 16, 5), (3, 32, 64)])
def test_greedy_equals_generate(smollm: dl.Model, prompts, reference, streams: int, chunk: int, page_rows: int) -> None:
    sch = dl.create_scheduler(smollm, max_streams=streams, max_queue=64, chunk_tokens=chunk, page_rows=page_rows)
    for i, p in enumerate(prompts):
        assert dl.submit(smollm, sch, dl.PendingReq(id=i, prompt=p, max_new=MAX_NEW))
    got = run(smollm, sch)
    for i, want in enumerate(reference):
        assert tokens_of(got[i]) == want, i
    assert dl.n_active(sch) == 0 and dl.n_queued(sch) == 0
    stats = dl.scheduler_stats(sch)
    assert stats["finished"] == len(prompts)
    assert 1 <= stats["avg_batch"] <= streams
    assert stats["prefill_tokens"] + stats["cached_tokens"] == sum(len(p) for p in prompts)
    assert page_rows or stats["cached_tokens"] == 0


def test_requests_joining_and_leaving(smollm: dl.Model, prompts, reference) -> None:
    """Requests arrive while others decode; one is evicted mid-stream; the rest are unchanged."""
    sch = dl.create_scheduler(smollm, max_streams=3, chunk_tokens=16)
    evs: list[dl.SchedEvent] = []
    pending = list(range(len(prompts)))
    by_id: dict[int, list[dl.SchedEvent]] = {}
    step = 0
    while pending or dl.n_active(sch) or dl.n_queued(sch):
        if pending and step % 3 == 0:
            i = pending.pop(0)
            assert dl.submit(smollm, sch, dl.PendingReq(id=i, prompt=prompts[i], max_new=MAX_NEW))
        if step == 5:
            assert dl.evict(smollm, sch, 0, evs)
        dl.scheduler_step(smollm, sch, evs)
        for e in evs:
            by_id.setdefault(e.id, []).append(e)
        evs.clear()
        step += 1
    assert by_id[0][-1].finish == "evicted"
    for i in range(1, len(prompts)):
        assert tokens_of(by_id[i]) == reference[i], i


def test_pieces_are_whole_text(smollm: dl.Model, prompts) -> None:
    sch = dl.create_scheduler(smollm, max_streams=4)
    for i, p in enumerate(prompts[:4]):
        dl.submit(smollm, sch, dl.PendingReq(id=i, prompt=p, max_new=20, params=dl.SamplingParams(temp=0.9, seed=5), seed=i))
    got = run(smollm, sch)
    for i in range(4):
        pieces = [e.text for e in got[i] if e.kind == "piece"]
        assert all("\ufffd" not in t for t in pieces)
        toks = [e.token for e in got[i] if e.kind == "piece"]
        assert "".join(pieces) == dl.decode(smollm, toks)


def test_seeded_sampling_is_reproducible(smollm: dl.Model, prompts) -> None:
    def once() -> list[list[int]]:
        sch = dl.create_scheduler(smollm, max_streams=2)
        for i, p in enumerate(prompts[:3]):
            dl.submit(smollm, sch, dl.PendingReq(id=i, prompt=p, max_new=10, params=dl.SamplingParams(temp=1.0, top_k=40), seed=100 + i))
        got = run(smollm, sch)
        return [tokens_of(got[i]) for i in range(3)]

    assert once() == once()


def test_stop_ids_end_the_stream_unemitted(smollm: dl.Model, prompts, reference) -> None:
    want = reference[0]
    stop = want[3]
    sch = dl.create_scheduler(smollm)
    dl.submit(smollm, sch, dl.PendingReq(id=1, prompt=prompts[0], stop_ids=[stop], max_new=MAX_NEW))
    evs = run(smollm, sch)[1]
    assert [e.token for e in evs if e.kind == "piece"] == want[: want.index(stop)]
    assert evs[-1].finish == "stop" and evs[-1].token == stop


def test_bad_requests_are_refused_and_scheduler_stays_usable(smollm: dl.Model, prompts, reference) -> None:
    sch = dl.create_scheduler(smollm, max_streams=2, max_queue=2)
    with pytest.raises(ValueError, match="prompt is empty"):
        dl.submit(smollm, sch, dl.PendingReq(id=1, prompt=[]))
    with pytest.raises(ValueError, match="max_new"):
        dl.submit(smollm, sch, dl.PendingReq(id=1, prompt=[1, 2], max_new=0))
    with pytest.raises(dl.ContextOverflowError, match="context window"):
        dl.submit(smollm, sch, dl.PendingReq(id=1, prompt=[1] * smollm.config["seq_len"]))
    with pytest.raises(ValueError, match="out of range"):
        dl.submit(smollm, sch, dl.PendingReq(id=1, prompt=[smollm.n_vocab]))
    assert dl.submit(smollm, sch, dl.PendingReq(id=1, prompt=prompts[0], max_new=MAX_NEW))
    with pytest.raises(ValueError, match="already queued or running"):
        dl.submit(smollm, sch, dl.PendingReq(id=1, prompt=prompts[1]))
    assert dl.submit(smollm, sch, dl.PendingReq(id=2, prompt=prompts[1], max_new=MAX_NEW))
    # Two free streams and a queue of two: four wait for the first step, a fifth is refused.
    for i in (3, 4):
        assert dl.submit(smollm, sch, dl.PendingReq(id=i, prompt=prompts[i - 1], max_new=MAX_NEW))
    assert not dl.submit(smollm, sch, dl.PendingReq(id=5, prompt=prompts[4]))  # queue full
    assert dl.n_queued(sch) == 4
    got = run(smollm, sch)
    assert [tokens_of(got[i]) for i in (1, 2, 3, 4)] == reference[:4]
    with pytest.raises(ValueError, match="paged pool"):
        dl.create_scheduler(smollm, page_rows=0, kv_dtype=dl.KVDtype.q8_0)
    assert not dl.evict(smollm, sch, 99, [])


ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(0, 14), st.integers(1, 6)),
        st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
        st.tuples(st.just("evict"), st.integers(0, 30), st.just(0)),
    ),
    max_size=25,
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, streams=st.integers(1, 4), chunk=st.sampled_from([5, 32]), page_rows=st.sampled_from([0, 4, 16]), groups=st.sampled_from([0, 3]))
def test_random_sequences_finish_each_request_once(smollm: dl.Model, prompts, ops, streams: int, chunk: int, page_rows: int, groups: int) -> None:
    sch = dl.create_scheduler(smollm, max_streams=streams, max_queue=8, chunk_tokens=chunk, page_rows=page_rows, prefix_groups=groups)
    accepted: set[int] = set()
    finished: list[int] = []
    evs: list[dl.SchedEvent] = []
    next_id = 0
    for op, a, b in ops:
        if op == "submit":
            if dl.submit(smollm, sch, dl.PendingReq(id=next_id, prompt=prompts[a], max_new=b)):
                accepted.add(next_id)
            next_id += 1
        elif op == "step":
            for _ in range(a):
                dl.scheduler_step(smollm, sch, evs)
        else:
            dl.evict(smollm, sch, a, evs)
        finished += [e.id for e in evs if e.kind == "finished"]
        evs.clear()
    while dl.scheduler_step(smollm, sch, evs) or evs:
        finished += [e.id for e in evs if e.kind == "finished"]
        evs.clear()
    assert sorted(finished) == sorted(accepted)
    assert dl.n_active(sch) == 0 and dl.n_queued(sch) == 0
    stats = dl.scheduler_stats(sch)
    if page_rows:  # idle: every page is free or held by the prefix cache, none leaked
        assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
        assert groups == 0 or stats["kv_pages_cached"] <= groups


def test_concurrent_requests_share_a_prefix_being_prefilled(smollm: dl.Model) -> None:
    """Requests admitted together with one system prompt: once the first has prefilled it, the
    ones that have not started attach its pages instead of prefilling them again, and every
    reply still equals generate's."""
    system = "You are a concise assistant. Answer in one short sentence. Be helpful, polite and accurate."
    prompts = []
    for q in ["What is the capital of France?", "Name a color.", "What is 2+2?", "Say hello."]:
        c = dl.create_chat_renderer(smollm, system)
        dl.add_user(c, q)
        prompts.append(dl.render_turn(smollm, c))
    want = [dl.generate(smollm, dl.create_session(smollm), p, dl.SamplingParams(), MAX_NEW) for p in prompts]
    sch = dl.create_scheduler(smollm, max_streams=4, chunk_tokens=16, page_rows=8)
    for i, p in enumerate(prompts):
        assert dl.submit(smollm, sch, dl.PendingReq(id=i, prompt=p, max_new=MAX_NEW))
    got = run(smollm, sch)
    for i, w in enumerate(want):
        assert tokens_of(got[i]) == w, i
    cached = [got[i][-1].n_cached for i in range(len(prompts))]
    # The first prefills everything; the second starts in the tick the first completes; the
    # others attach at least the system prompt's whole pages.
    assert cached[0] == 0 and min(cached[2:]) >= 16, cached
    stats = dl.scheduler_stats(sch)
    assert stats["prefill_tokens"] + stats["cached_tokens"] == sum(len(p) for p in prompts)


def test_prefix_cache_hits_give_the_same_output(smollm: dl.Model) -> None:
    """A second round of the same conversations attaches cached pages and still matches generate."""
    system = "You are a concise assistant. Answer in one short sentence. Be helpful, polite and accurate."
    chats = []
    for q in ["What is the capital of France?", "Name a color.", "What is 2+2?"]:
        c = dl.create_chat_renderer(smollm, system)
        dl.add_user(c, q)
        chats.append(c)
    reqs = lambda base: [
        dl.PendingReq(id=base + i, prompt=dl.render_turn(smollm, c), close_toks=dl.render_close(smollm, c), stop_ids=dl.turn_stop_ids(c), max_new=MAX_NEW)
        for i, c in enumerate(chats)
    ]
    want = [dl.generate(smollm, dl.create_session(smollm), r.prompt, dl.SamplingParams(), MAX_NEW) for r in reqs(0)]
    want = [[t for t in w if t not in reqs(0)[0].stop_ids] for w in want]
    sch = dl.create_scheduler(smollm, max_streams=2, page_rows=8)
    for base in (0, 100):
        for r in reqs(base):
            dl.submit(smollm, sch, r)
        got = run(smollm, sch)
        for i, w in enumerate(want):
            evs = got[base + i]
            assert [e.token for e in evs if e.kind == "piece"] == w
            if base:
                # The whole prompt but its last token is cached, rounded down to whole pages.
                n = len(reqs(0)[i].prompt)
                assert evs[-1].n_cached == (n - 1) // 8 * 8 > 0
    stats = dl.scheduler_stats(sch)
    assert stats["cached_tokens"] > 0 and stats["kv_cache_hits"] >= 3
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]


@pytest.mark.parametrize(("step_ms", "how"), [("1", "env"), ("0", "env"), ("1", "api"), ("0", "api")])
def test_time_budgeted_prefill(smollm: dl.Model, monkeypatch: pytest.MonkeyPatch, step_ms: str, how: str) -> None:
    """A long prompt arriving while a stream decodes is prefilled in chunks sized by the step's
    time budget (DASLLAMA_STEP_MS, read when the runtime is made, or set_step_budget over a
    contrary DASLLAMA_STEP_MS; a 1 ms budget leaves the least chunk, 4 tokens, per step) or in
    fixed chunks of chunk_tokens (0 / None); either way every token is what it is alone."""
    if how == "env":
        monkeypatch.setenv("DASLLAMA_STEP_MS", step_ms)
    else:
        monkeypatch.setenv("DASLLAMA_STEP_MS", "0" if step_ms == "1" else "1")
    smollm = dl.load_model(smollm.path, runtime=dl.Runtime())
    long = dl.encode(smollm, "The history of the lighthouse keepers of the northern coast. " * 30)[:300]
    short = dl.encode(smollm, "Tell me a story.")
    news = (40, 4)
    want = []
    for p, n in zip((short, long), news, strict=True):
        s = dl.create_session(smollm)
        # Greedy decoding past end-of-generation, one token at a time.
        logits = dl.eval(smollm, s, p)
        want.append([])
        for _ in range(n):
            want[-1].append(int(logits.argmax()))
            logits = dl.eval(smollm, s, [want[-1][-1]])
    sch = dl.create_scheduler(smollm, max_streams=2, chunk_tokens=128, page_rows=16)
    if how == "api":
        budget = 1.0 if step_ms == "1" else None
        assert dl.set_step_budget(sch, budget) == budget == dl.step_budget(sch)
    assert dl.submit(smollm, sch, dl.PendingReq(id=0, prompt=short, max_new=news[0], ignore_eos=True))
    evs: list[dl.SchedEvent] = []
    dl.scheduler_step(smollm, sch, evs)
    assert dl.submit(smollm, sch, dl.PendingReq(id=1, prompt=long, max_new=news[1], ignore_eos=True))
    run(smollm, sch, evs)
    by_id: dict[int, list[dl.SchedEvent]] = {}
    for e in evs:
        by_id.setdefault(e.id, []).append(e)
    assert [tokens_of(by_id[i]) for i in (0, 1)] == want
    chunks = dl.scheduler_stats(sch)["prefill_chunks"] - 1
    # The long prompt's chunks while the short one decodes: 64 tokens until a step's cost is
    # measured (three passes), then 4; or 128, 128 and 44.
    assert chunks == (2 + (300 - 2 * 64 + 3) // 4 if step_ms == "1" else 3), chunks


def test_step_budget_setter(smollm: dl.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """set_step_budget takes milliseconds or None and refuses anything else, leaving the budget as
    it was; the default is the model's runtime's (DASLLAMA_STEP_MS when the runtime was made, 60 ms
    without it; Runtime(step_ms=...)); under ggml numerics chunks stay fixed whatever is asked."""
    monkeypatch.delenv("DASLLAMA_STEP_MS", raising=False)
    sch = dl.create_scheduler(smollm, max_streams=2, page_rows=16)
    assert dl.step_budget(sch) == pytest.approx(60.0)
    assert dl.set_step_budget(sch, 25) == pytest.approx(25.0)
    for bad, err in [(0, ValueError), (-5.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError), ("60", TypeError), (True, TypeError)]:
        with pytest.raises(err, match="step budget"):
            dl.set_step_budget(sch, bad)  # type: ignore[arg-type]
        assert dl.step_budget(sch) == pytest.approx(25.0)
    assert dl.set_step_budget(sch, None) is None and dl.step_budget(sch) is None
    monkeypatch.setenv("DASLLAMA_STEP_MS", "0")
    assert dl.step_budget(dl.create_scheduler(smollm, max_streams=2)) == pytest.approx(60.0), "the environment is read when a runtime is made"
    assert dl.step_budget(dl.create_scheduler(dl.load_model(smollm.path, runtime=dl.Runtime()), max_streams=2)) is None
    assert dl.step_budget(dl.create_scheduler(dl.load_model(smollm.path, runtime=dl.Runtime(step_ms=25)), max_streams=2)) == pytest.approx(25.0)
    ggml = dl.load_model(dl.fetch("smollm2-135m-instruct"), numerics=dl.Numerics.ggml)
    sch = dl.create_scheduler(ggml, max_streams=2)
    assert dl.set_step_budget(sch, 30.0) is None and dl.step_budget(sch) is None
