"""Prefill and batched rows on the CPU beside llama.cpp built on the same box, in the same run:
pp512 (a 512-token prompt into a fresh session) against `llama-bench -p 512`, and N streams end to
end (each stream's own prompt of `--npp` tokens, then `--ntg` tokens decoded by all of them
together) against `llama-batched-bench -npp .. -ntg .. -npl N`, whose S (all tokens over all the
time) and S_TG (the decoded tokens over the decode time) are the columns beside ours.

Where the CPU has AMX, dasllama runs with it (the default) and without (`DASLLAMA_AMX=0`), and
llama.cpp as built (its repacked weights: AMX or its own VNNI kernels) and with `--repack 0`
(ggml's plain kernels; on the AMX Xeon of docs/benchmarks.md llama.cpp's repacking segfaults on
prompts, so only this column has figures there). The read-bandwidth probe (`bench_decode.read_bandwidth`) is printed with
the table, and the batched decode's weight reads as a share of it.

    python benches/bench_prefill.py [--models q4_k_m q4_0 smollm2] [--threads 2] [--runs 2] [--streams 16]

Models: the random Llama-3.2-1B-shaped bench model (`bench_decode.model_path`: Q4_K_M, Q4_0,
Q8_0) and SmolLM2-135M Q4_1 (the fetcher's). Each dasllama figure is a process of its own (the
thread count and the AMX switch are read once per process). Speed is compared, never asserted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_decode import llama_tool, model_path, read_bandwidth
from machine import cpu_name

log = logging.getLogger("bench_prefill")
LABELS = {"q4_k_m": "1B Q4_K_M", "q4_0": "1B Q4_0", "q8_0": "1B Q8_0", "smollm2": "SmolLM2-135M Q4_1"}


def path_of(label: str) -> Path:
    if label == "smollm2":
        import dasllama as dl

        return Path(dl.fetch("smollm2-135m-instruct"))
    return model_path(label)


def tokens(n_vocab: int, n: int, seed: int) -> list[int]:
    """`n` token ids spread over the vocabulary, different per `seed` (no shared prefix)."""
    return [(1000 + 7919 * (i + 131 * seed)) % (n_vocab - 1000) + 500 for i in range(n)]


def ours_one(path: str, what: dict, runs: int) -> dict[str, float]:
    """dasllama's figures in this process: pp (tok/s) or streams (S, S_TG tok/s)."""
    import dasllama as dl

    m = dl.load_model(path)
    if what["test"] == "pp":
        ids = tokens(m.n_vocab, what["n"], 0)
        times = []
        for _ in range(runs + 1):
            s = dl.create_session(m)
            t0 = time.perf_counter()
            dl.eval(m, s, ids)
            times.append(time.perf_counter() - t0)
        # The first run warms the pages and the thread team.
        return {"pp": what["n"] / statistics.median(times[1:])}
    b, npp, ntg = what["streams"], what["npp"], what["ntg"]
    totals, decodes = [], []
    for _ in range(runs + 1):
        sessions = [dl.create_session(m) for _ in range(b)]
        ws = dl.create_batch_workspace(m)
        t0 = time.perf_counter()
        for i, s in enumerate(sessions):
            dl.eval(m, s, tokens(m.n_vocab, npp, i + 1))
        t1 = time.perf_counter()
        toks = [100 + i for i in range(b)]
        for _ in range(ntg):
            dl.eval_batch(m, ws, sessions, toks)
        t2 = time.perf_counter()
        totals.append(t2 - t0)
        decodes.append(t2 - t1)
    return {"s": b * (npp + ntg) / statistics.median(totals[1:]), "s_tg": b * ntg / statistics.median(decodes[1:])}


def ours(path: Path, what: dict, threads: int, runs: int, amx: bool) -> dict[str, float]:
    env = dict(os.environ, DASLLAMA_THREADS=str(threads), DASLLAMA_AMX="1" if amx else "0")
    cmd = [sys.executable, __file__, "--one", json.dumps([str(path), what, runs])]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def llama_pp(path: Path, n: int, threads: int, runs: int, repack: bool) -> float | None:
    cmd = [str(llama_tool("llama-bench")), "-m", str(path), "-t", str(threads), "-p", str(n), "-n", "0", "-r", str(runs), "--repack", str(int(repack)), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        log.warning("llama-bench --repack %d failed on %s (exit %d): %s", repack, path.name, r.returncode, r.stderr.strip()[-300:])
        return None
    return float(json.loads(r.stdout)[0]["avg_ts"])


def llama_streams(path: Path, what: dict, threads: int, repack: bool) -> dict[str, float] | None:
    b, npp, ntg = what["streams"], what["npp"], what["ntg"]
    cmd = [str(llama_tool("llama-batched-bench")), "-m", str(path), "-t", str(threads), "-c", str(b * (npp + ntg) + 64), "-b", "2048", "-ub", "512"]
    cmd += ["-npp", str(npp), "-ntg", str(ntg), "-npl", str(b), "--output-format", "jsonl"] + ([] if repack else ["--no-repack"])
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{") and '"speed"' in ln]
    if r.returncode != 0 or not rows:
        log.warning("llama-batched-bench failed on %s (exit %d, repack %s): %s", path.name, r.returncode, repack, (r.stderr or r.stdout).strip()[-300:])
        return None
    return {"s": float(rows[-1]["speed"]), "s_tg": float(rows[-1]["speed_tg"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["q4_k_m", "smollm2"], choices=list(LABELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--npp", type=int, default=128, help="each stream's prompt tokens")
    ap.add_argument("--ntg", type=int, default=32, help="tokens each stream decodes")
    ap.add_argument("--tests", nargs="+", default=["pp", "streams"], choices=["pp", "streams"])
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        path, what, runs = json.loads(args.one)
        print(json.dumps(ours_one(path, what, runs)))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from bench_generate import weight_figures

    import dasllama as dl

    amx_on, amx_why = dl.amx_status()
    has_amx = amx_on or "amx_int8" in open("/proc/cpuinfo").read()
    paths = {label: path_of(label) for label in args.models}
    load0 = os.getloadavg()[0]
    bw = read_bandwidth([args.threads])[args.threads]
    rows = []
    for label in args.models:
        for test in args.tests:
            if test == "pp":
                what = {"test": "pp", "n": args.pp}
                name = f"pp{args.pp}"
            else:
                what = {"test": "streams", "streams": args.streams, "npp": args.npp, "ntg": args.ntg}
                name = f"{args.streams} streams"
            # Interleaved, ours then llama.cpp's, so drift on a shared box hits both alike.
            a = ours(paths[label], what, args.threads, args.runs, True)
            a0 = ours(paths[label], what, args.threads, args.runs, False) if has_amx else None
            if test == "pp":
                ref = {"pp": llama_pp(paths[label], args.pp, args.threads, args.runs, True)}
                ref0 = {"pp": llama_pp(paths[label], args.pp, args.threads, args.runs, False)}
                keys = [("pp", "")]
            else:
                ref = llama_streams(paths[label], what, args.threads, True) or {}
                ref0 = llama_streams(paths[label], what, args.threads, False) or {}
                keys = [("s", " S"), ("s_tg", " S_TG")]
            for k, suffix in keys:
                rows.append((label, name + suffix, a[k], a0[k] if a0 else None, ref.get(k), ref0.get(k), k == "s_tg"))
    load1 = os.getloadavg()[0]
    print(f"\n{cpu_name()}; {args.threads} threads; tokens/s, median of {args.runs} runs; load average {load0:.1f} at the start, {load1:.1f} at the end")
    print(f"dasllama amx: {amx_why}")
    print(f"read bandwidth (read_bw): {args.threads} threads {bw:.1f} GB/s; streams: {args.npp}-token prompts, then {args.ntg} tokens each (llama-batched-bench -npp {args.npp} -ntg {args.ntg})")
    fmt = lambda v: f"{v:.1f}" if v else "n/a"
    ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"
    print("| model | figure | dasllama | dasllama AMX off | llama.cpp | llama.cpp --repack 0 | ratio | ratio to --repack 0 | weights read (decode) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, name, a, a0, ref, ref0, is_tg in rows:
        share = ""
        if is_tg:
            read, _ = weight_figures(str(paths[label]))
            gbs = a / args.streams * read / 1e9
            share = f"{gbs:.1f} GB/s = {gbs / bw:.0%} of probe"
        print(f"| {LABELS[label]} | {name} | {fmt(a)} | {fmt(a0)} | {fmt(ref)} | {fmt(ref0)} | {ratio(a, ref)} | {ratio(a, ref0)} | {share} |")


if __name__ == "__main__":
    main()
