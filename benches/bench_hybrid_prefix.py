"""A hybrid's second conversation turn with and without the prefix cache, through the scheduler:
turn 1 is a prompt of `--prompt-tokens` random tokens and a greedy reply of `--reply` tokens (its
close after it); turn 2 is what the cache then holds plus `--new` more tokens. Prints turn 2's
prompt tokens prefilled, cached, and its time to first token, cold (a scheduler without a pool)
and warm (the one that ran turn 1), the median of `--repeat` runs each, and whether the tokens
agree. The model is a DeltaNet hybrid's GGUF (`--model`; `scripts/make_bench_model.py --shape
hybrid` writes a 0.38B qwen35), or else the synthetic qwen35 of tests/synthetic.py with a
context of 4096.

    python benches/bench_hybrid_prefix.py [--model PATH] [--prompt-tokens 1000] [--reply 32] [--new 40] [--page-rows 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from machine import cpu_name

import dasllama as dl

CLOSE = [2, 7]


def turn(m: dl.Model, sch: dl.Scheduler, rid: int, prompt: list[int], n: int) -> tuple[list[int], float, int]:
    """(tokens, seconds to the first token, prompt tokens from the cache) of one request alone."""
    t0 = time.perf_counter()
    dl.submit(m, sch, dl.PendingReq(id=rid, prompt=prompt, close_toks=CLOSE, max_new=n, ignore_eos=True))
    events: list[dl.SchedEvent] = []
    ttft = 0.0
    more = True
    while more:
        more = dl.scheduler_step(m, sch, events)
        if not ttft and any(e.kind == "piece" for e in events):
            ttft = time.perf_counter() - t0
    (fin,) = [e for e in events if e.kind == "finished"]
    return [e.token for e in events if e.kind == "piece"], ttft, fin.n_cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--reply", type=int, default=32)
    ap.add_argument("--new", type=int, default=40)
    ap.add_argument("--page-rows", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.model:
        m = dl.load_model(args.model)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from synthetic import write_family

        path = Path(tempfile.mkdtemp()) / "qwen35.gguf"
        write_family(path, "qwen35", meta={"context_length": 4096})
        m = dl.load_model(path)
    rng = np.random.default_rng(0)
    first = [1] + [int(t) for t in rng.integers(3, min(m.n_vocab, 30000), size=args.prompt_tokens - 1)]
    new = [int(t) for t in rng.integers(3, min(m.n_vocab, 30000), size=args.new)]
    cold_rows, warm_rows, same = [], [], True
    for r in range(args.repeat):
        sch = dl.create_scheduler(m, max_streams=1, page_rows=args.page_rows)
        reply, _, _ = turn(m, sch, 0, first, args.reply)
        prompt2 = first + reply[:-1] + CLOSE + new
        st = dl.scheduler_stats(sch)
        snaps = (st["kv_snapshots"], st["kv_snapshot_bytes"], st["kv_bytes_per_page"])
        before = st["prefill_tokens"]
        warm, t_warm, cached = turn(m, sch, 1, prompt2, 8)
        warm_rows.append((t_warm, dl.scheduler_stats(sch)["prefill_tokens"] - before, cached))
        cold_sch = dl.create_scheduler(m, max_streams=1)
        cold, t_cold, _ = turn(m, cold_sch, 0, prompt2, 8)
        cold_rows.append((t_cold, dl.scheduler_stats(cold_sch)["prefill_tokens"], 0))
        same = same and cold == warm
        print(f"run {r}: turn 2 of {len(prompt2)} tokens: cold {t_cold * 1e3:.1f} ms ({cold_rows[-1][1]} prefilled), warm {t_warm * 1e3:.1f} ms ({warm_rows[-1][1]} prefilled, {cached} cached)")
    print(f"\nmodel {m.path.name} ({m.arch}), {cpu_name()}, page_rows {args.page_rows}; turn 2 of {len(prompt2)} tokens, median of {args.repeat}:")
    print("| turn 2 | prefilled | cached | TTFT ms |")
    print("| --- | --- | --- | --- |")
    for name, rows in (("cold", cold_rows), ("cached", warm_rows)):
        print(f"| {name} | {rows[0][1]} | {rows[0][2]} | {statistics.median(r[0] for r in rows) * 1e3:.1f} |")
    print(f"same tokens: {same}; after turn 1 the cache held {snaps[0]} snapshots of {snaps[1] / max(snaps[0], 1) / 2**20:.2f} MiB (a page: {snaps[2] / 2**10:.0f} KiB)")


if __name__ == "__main__":
    main()
