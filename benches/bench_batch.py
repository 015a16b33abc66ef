"""Batched decode: B sessions advanced by eval_batch (one weight pass per step) against the same B
sessions stepped one at a time. Aggregate tokens/s, median of 3, and the batched step's int8
multiply-adds per second (the layers' weights once per row), against `--peak-gmacs` when given.

    python benches/bench_batch.py [--model smollm2-135m-instruct] [--steps 32] [--batches 1 4 8 16 32 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_generate import weight_figures
from tqdm import tqdm

import dasllama as dl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--peak-gmacs", type=float, default=None, help="the GEMM kernel's measured peak, G int8 multiply-adds/s")
    args = ap.parse_args()
    m = dl.load_model(args.model)
    _, macs = weight_figures(str(m.path))
    prompt = dl.encode(m, "Write a short story about a robot who learns to paint.")
    rows = []
    for b in tqdm(args.batches, desc="batch sizes"):
        res = {}
        for mode in ("one at a time", "eval_batch"):
            times = []
            for _ in range(3):
                sessions = [dl.create_session(m) for _ in range(b)]
                for s in sessions:
                    dl.eval(m, s, prompt)
                toks = [100 + i for i in range(b)]
                ws = dl.create_batch_workspace(m)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    if mode == "eval_batch":
                        dl.eval_batch(m, ws, sessions, toks)
                    else:
                        for s, t in zip(sessions, toks):
                            dl.eval(m, s, [t])
                times.append(time.perf_counter() - t0)
            res[mode] = b * args.steps / statistics.median(times)
        rows.append((b, res["one at a time"], res["eval_batch"]))
    print(f"\n{m.path.name}, {dl.n_threads()} threads, {args.steps} decode steps, aggregate tokens/s")
    print(f"| {'streams':>7} | {'one at a time':>13} | {'eval_batch':>10} | {'speedup':>7} | eval_batch GMAC/s |")
    print(f"|{'-' * 9}|{'-' * 15}|{'-' * 12}|{'-' * 9}|---|")
    for b, one, batch in rows:
        g = batch * macs / 1e9
        frac = f" = {g / args.peak_gmacs:.0%} of {args.peak_gmacs:.0f}" if args.peak_gmacs else ""
        print(f"| {b:>7} | {one:>13.1f} | {batch:>10.1f} | {batch / one:>6.2f}x | {g:.0f}{frac} |")


if __name__ == "__main__":
    main()
