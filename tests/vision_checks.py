"""Checks the image tests share: a scheduler run with image prompts against plain sessions."""

from __future__ import annotations

import numpy as np

import dasllama as dl
from dasllama import vision


def run_scheduler(m: dl.Model, sch: object, reqs: list[dl.PendingReq]) -> dict[int, list[dl.SchedEvent]]:
    """Submit ``reqs`` and step until the scheduler is idle: each request's piece and finished
    events."""
    for r in reqs:
        dl.submit(m, sch, r)
    got: dict[int, list[dl.SchedEvent]] = {r.id: [] for r in reqs}
    evs: list[dl.SchedEvent] = []
    while dl.scheduler_step(m, sch, evs):
        for e in evs:
            if e.kind in ("piece", "finished"):
                got[e.id].append(e)
        evs.clear()
    for e in evs:
        if e.kind in ("piece", "finished"):
            got[e.id].append(e)
    return got


def assert_scheduler_matches_sessions(m: dl.Model, prompts: list[vision.ImagePrompt]) -> None:
    """Two image prompts through a scheduler at once, their images cut across chunks of 7 rows,
    then again from the prefix cache: the same greedy tokens and top-3 log-probs as a plain
    session each time, and the second run's image rows taken from the cache."""
    want = []
    for p in prompts:
        s = dl.create_session(m)
        logits = vision.eval_image_prompt(m, s, p).astype(np.float64)
        steps = []
        for _ in range(5):
            lp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
            top = np.argsort(lp)[::-1][:3]
            steps.append((int(top[0]), lp[top]))
            logits = dl.eval(m, s, [int(top[0])]).astype(np.float64)
        want.append(steps)
    sch = dl.create_scheduler(m, max_streams=2, chunk_tokens=7, page_rows=8)

    def req(i: int, p: vision.ImagePrompt) -> dl.PendingReq:
        return dl.PendingReq(id=i, prompt=p.ids, max_new=5, ignore_eos=True, images=p.images(), logprobs=3)

    got = run_scheduler(m, sch, [req(i, p) for i, p in enumerate(prompts)])
    # Again: the prompts' pages come from the prefix cache, the image's rows among them, and the
    # rest of each prompt is placed after the images all the same.
    again = run_scheduler(m, sch, [req(10 + i, p) for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        for evs in (got[i], again[10 + i]):
            pieces = [e for e in evs if e.kind == "piece"]
            assert [e.token for e in pieces] == [t for t, _ in want[i]]
            for e, (_, lps) in zip(pieces, want[i], strict=True):
                np.testing.assert_allclose([lp for _, lp in e.top], lps, atol=2e-3)
        (fin,) = [e for e in again[10 + i] if e.kind == "finished"]
        # Whole pages of 8 rows: the image's ends on or before the last cached one.
        first, n = prompts[i].spans[0]
        assert fin.n_cached >= (first + n) // 8 * 8 and fin.n_cached > first, fin.n_cached
