"""Batched decode: B sessions advanced by eval_batch (one weight pass per step) against the same B
sessions stepped one at a time. Aggregate tokens/s, median of 3, and the batched step's int8
multiply-adds per second (the layers' weights once per row), against `--peak-gmacs` when given.

    python benches/bench_batch.py [--model smollm2-135m-instruct] [--steps 32] [--batches 1 4 8 16 32 64]
    python benches/bench_batch.py --model ~/.cache/dasllama/bench/bench-llama1b-Q4_K_M.gguf --batches 16 --llama-python /work/llamacpp-venv/bin/python

With ``--llama-python`` (an interpreter with llama_cpp) llama.cpp decodes the same B streams beside
ours: one ``llama_decode`` per step of B tokens, one per sequence (its batched decode, as
``llama-batched-bench`` runs it), after each stream's prompt; its column is aggregate tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench_generate import weight_figures
from tqdm import tqdm

PROMPT = "Write a short story about a robot who learns to paint."


def llama_cpp_batched(path: str, prompt: list[int], b: int, steps: int, threads: int) -> float:
    """llama.cpp's aggregate decode tokens/s over `b` sequences advanced together (median of 3)."""
    import llama_cpp as lc

    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
    cp = lc.llama_context_default_params()
    cp.n_ctx = b * (len(prompt) + steps + 16)
    cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max = b
    cp.n_threads = cp.n_threads_batch = threads
    batch = lc.llama_batch_init(max(512, b), 0, 1)

    def decode(ctx: object, rows: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(rows)
        for i, (tok, pos, seq, logits) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, logits
            batch.seq_id[i][0] = seq
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    times = []
    for _ in range(3):
        ctx = lc.llama_init_from_model(model, cp)
        for s in range(b):
            decode(ctx, [(t, p, s, p == len(prompt) - 1) for p, t in enumerate(prompt)])
        t0 = time.perf_counter()
        for step in range(steps):
            decode(ctx, [(100 + s, len(prompt) + step, s, True) for s in range(b)])
        times.append(time.perf_counter() - t0)
        lc.llama_free(ctx)
    lc.llama_batch_free(batch)
    lc.llama_model_free(model)
    return b * steps / statistics.median(times)


def llama_cpp_batched_in(python: str, path: str, prompt: list[int], b: int, steps: int, threads: int) -> float | None:
    """`llama_cpp_batched` in another interpreter (one that has llama_cpp)."""
    cmd = [python, __file__, "--llama-only", json.dumps([path, prompt, b, steps, threads])]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        print(f"llama.cpp batched run failed: {r.stderr.strip()[-500:]}", file=sys.stderr)
        return None
    return float(json.loads(lines[-1])["tok_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--peak-gmacs", type=float, default=None, help="the GEMM kernel's measured peak, G int8 multiply-adds/s")
    ap.add_argument("--llama-python", default=None, help="an interpreter with llama_cpp: run llama.cpp's batched decode beside ours")
    ap.add_argument("--skip-one-at-a-time", action="store_true", help="only eval_batch (and llama.cpp): the sequential column is slow on big models")
    ap.add_argument("--llama-only", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_only:
        path, prompt, b, steps, threads = json.loads(args.llama_only)
        print(json.dumps({"tok_s": llama_cpp_batched(path, prompt, b, steps, threads)}))
        return
    import dasllama as dl

    m = dl.load_model(args.model)
    _, macs = weight_figures(str(m.path))
    prompt = dl.encode(m, PROMPT)
    threads = int(os.environ.get("DASLLAMA_THREADS", str(dl.n_threads())))
    rows = []
    for b in tqdm(args.batches, desc="batch sizes"):
        res = {}
        for mode in ("eval_batch",) if args.skip_one_at_a_time else ("one at a time", "eval_batch"):
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
                        for s, t in zip(sessions, toks, strict=False):
                            dl.eval(m, s, [t])
                times.append(time.perf_counter() - t0)
            res[mode] = b * args.steps / statistics.median(times)
        llama = llama_cpp_batched_in(args.llama_python, str(m.path), prompt, b, args.steps, threads) if args.llama_python else None
        rows.append((b, res.get("one at a time"), res["eval_batch"], llama))
    print(f"\n{m.path.name}, {dl.n_threads()} threads, {args.steps} decode steps, aggregate tokens/s, load average {os.getloadavg()[0]:.1f}")
    print(f"| {'streams':>7} | {'one at a time':>13} | {'eval_batch':>10} | {'speedup':>7} | {'llama.cpp':>9} | {'ratio':>6} | eval_batch GMAC/s |")
    print(f"|{'-' * 9}|{'-' * 15}|{'-' * 12}|{'-' * 9}|{'-' * 11}|{'-' * 8}|---|")
    for b, one, batch, llama in rows:
        g = batch * macs / 1e9
        frac = f" = {g / args.peak_gmacs:.0%} of {args.peak_gmacs:.0f}" if args.peak_gmacs else ""
        one_s, speedup = (f"{one:.1f}", f"{batch / one:.2f}x") if one else ("-", "-")
        llama_s, ratio = (f"{llama:.1f}", f"{batch / llama:.2f}x") if llama else ("-", "-")
        print(f"| {b:>7} | {one_s:>13} | {batch:>10.1f} | {speedup:>7} | {llama_s:>9} | {ratio:>6} | {g:.0f}{frac} |")


if __name__ == "__main__":
    main()
