"""Gemma 4's KV layout in the paged pool and the scheduler: sliding and full layers of their own
heads share a page, the E-series' layers that read an earlier layer's K/V keep none, and the
prefix cache and batched streams give what one stream alone gives (the goldens themselves are in
test_families.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import dasllama as dl
from synthetic import write_family

MAX_NEW = 6


@pytest.fixture(scope="module", params=["gemma4", "gemma4-e", "gemma4-moe"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dl.Model:
    path = tmp_path_factory.mktemp("g4") / f"{request.param}.gguf"
    write_family(path, request.param)
    return dl.load_model(path)


def test_a_page_holds_the_layers_that_keep_kv(tmp_path: Path) -> None:
    # f16 rows of 8 positions: K and V of the sliding layers (2 heads of 64) and the full ones
    # (1 head of 128); gemma4-e's last two layers read layers 1 and 2 and hold nothing.
    rows = 8
    sliding, full = 2 * rows * 2 * 64 * 2, 2 * rows * 1 * 128 * 2
    for name, n_sliding, n_full in (("gemma4", 3, 1), ("gemma4-e", 2, 1)):
        p = tmp_path / f"{name}.gguf"
        write_family(p, name)
        pool = dl.create_kv_pool(dl.load_model(p), rows, max_pages=4)
        assert dl.kv_pool_stats(pool)["bytes_per_page"] == n_sliding * sliding + n_full * full, name


def run(m: dl.Model, sch: dl.Scheduler) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}
    evs: list[dl.SchedEvent] = []
    more = True
    while more:
        more = dl.scheduler_step(m, sch, evs)
        for e in evs:
            assert e.kind != "finished" or e.finish != "error", e.error
            if e.kind == "piece":
                got.setdefault(e.id, []).append(e.token)
        evs.clear()
    return got


def test_prefix_cache_and_batched_streams_match_one_stream(model: dl.Model) -> None:
    """Streams sharing a 12-token prefix, batched in the scheduler twice over: the second round
    attaches the cached pages (of the layers that keep K/V, the sharing layers reading them) and
    every reply equals greedy generation alone; no page is leaked."""
    prefix = [1] + [40 + i for i in range(11)]
    prompts = [prefix + [100 + 7 * i, 120 + i] for i in range(3)]
    greedy = dl.SamplingParams(temp=0.0)
    want = [dl.generate(model, dl.create_session(model), p, greedy, MAX_NEW) for p in prompts]
    sch = dl.create_scheduler(model, max_streams=3, chunk_tokens=5, page_rows=4)
    for base in (0, 100):
        for i, p in enumerate(prompts):
            assert dl.submit(model, sch, dl.PendingReq(id=base + i, prompt=p, max_new=MAX_NEW))
        got = run(model, sch)
        for i, w in enumerate(want):
            assert got[base + i] == w[: len(got[base + i])] and got[base + i], (base, i, got[base + i], w)
    stats = dl.scheduler_stats(sch)
    assert stats["cached_tokens"] >= 3 * 12 and stats["kv_cache_hits"] >= 3, stats
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"], stats


@pytest.mark.parametrize("kv_dtype", ["q8_0", "tq4"])
def test_the_smaller_kv_codecs_hold_every_layer(model: dl.Model, kv_dtype: str) -> None:
    # Sliding heads of 64 and full heads of 128 each stored in the pool's codec: a chunked run
    # equals the whole prompt at once, and the logits stay as near the f16 pool's as the codec's
    # rounding leaves other families on these tiny models (qwen3: 0.24 nats under q8_0, 1.5 under
    # tq4; gemma4: 0.22 / 1.6, gemma4-e 0.54 / 2.9, gemma4-moe 0.24 / 2.5), where a misplaced row
    # would cost several nats.
    ids = [1] + [40 + 3 * i for i in range(15)]
    ref = dl.eval_all(model, dl.create_session(model), ids)
    pool = dl.create_kv_pool(model, 4, kv_dtype=kv_dtype)
    got = dl.eval_all(model, dl.create_session(model, pool), ids)
    s = dl.create_session(model, pool)
    chunked = np.concatenate([dl.eval_all(model, s, ids[i : i + 5]) for i in range(0, len(ids), 5)])
    np.testing.assert_array_equal(chunked, got)
    lp = lambda x: x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
    assert np.abs(lp(got) - lp(ref)).max() < {"q8_0": 1.0, "tq4": 3.5}[kv_dtype], np.abs(lp(got) - lp(ref)).max()
