"""Single-stream decode at the machine's limit: dasllama's decode tokens/s beside llama.cpp's
`llama-bench` tg64 in the same run, at 1 and 2 threads, with each figure's weight read as a share
of the box's read bandwidth (the `read_bw` probe: a streaming read over 2 GiB, one reader per
thread).

Models: the random Llama-3.2-1B-shaped bench model in Q4_K_M, Q4_0 and Q8_0
(`scripts/make_bench_model.py`, made here when missing) and Gemma 3 270M Q4_K_M (the fetcher's).
llama.cpp's tools come from the PATH, else ~/.cache/dasllama/llama.cpp/bin, else they are built
there (`scripts/build_llama_cpp.py`, minutes). The probe is the crate's `read_bw` example (cargo
builds it); without cargo, NumPy's (`bench_generate.read_bandwidth`), which reads more slowly.

    python benches/bench_decode.py [--threads 1 2] [--tokens 64] [--runs 3] [--models q4_k_m q4_0 q8_0 gemma]

Each dasllama figure is a process of its own (the thread count is fixed per process): one token,
then `--tokens` more one at a time, median of `--runs`. Speed is compared, never asserted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import cpu_name
from tqdm import tqdm

log = logging.getLogger("bench_decode")
ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = Path("~/.cache/dasllama/bench").expanduser()
LLAMA_BIN = Path("~/.cache/dasllama/llama.cpp/bin").expanduser()
# Label -> the bench model's quantization, or the fetcher's name for a real model.
MODELS = {"q4_k_m": "Q4_K_M", "q4_0": "Q4_0", "q8_0": "Q8_0", "gemma": "gemma3-270m"}
LABELS = {"q4_k_m": "1B Q4_K_M", "q4_0": "1B Q4_0", "q8_0": "1B Q8_0", "gemma": "Gemma 3 270M Q4_K_M"}


def built_llama_tool(name: str) -> Path | None:
    """A llama.cpp tool already on the PATH or in the cache (`scripts/build_llama_cpp.py`'s)."""
    found = shutil.which(name) or (str(LLAMA_BIN / name) if (LLAMA_BIN / name).exists() else None)
    return Path(found) if found else None


def llama_tool(name: str) -> Path:
    """A llama.cpp tool: on the PATH, in the cache, or built into the cache first."""
    found = built_llama_tool(name)
    if found:
        return found
    log.info("building llama.cpp's tools into %s (minutes)", LLAMA_BIN)
    subprocess.run([sys.executable, str(ROOT / "scripts/build_llama_cpp.py"), "--dest", str(LLAMA_BIN)], check=True)
    return LLAMA_BIN / name


def model_path(label: str) -> Path:
    """The model of `label`, made (bench models) or fetched when missing."""
    what = MODELS[label]
    if label == "gemma":
        import dasllama as dl

        return Path(dl.fetch(what))
    path = BENCH_DIR / f"bench-llama1b-{what}.gguf"
    if not path.exists():
        log.info("making %s (random weights, quantized by llama-quantize)", path)
        env = dict(os.environ, PATH=f"{llama_tool('llama-quantize').parent}{os.pathsep}{os.environ.get('PATH', '')}")
        subprocess.run([sys.executable, str(ROOT / "scripts/make_bench_model.py"), "--types", what, "--out-dir", str(BENCH_DIR)], check=True, env=env)
    return path


def read_bandwidth(threads: list[int]) -> dict[int, float]:
    """GB/s per thread count from the `read_bw` example, else NumPy's probe."""
    if shutil.which("cargo"):
        cmd = ["cargo", "run", "-q", "--release", "-p", "dasllama", "--example", "read_bw", "--", "2048", "--", *map(str, threads)]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
        found = {int(m[1]): float(m[2]) for m in re.finditer(r"threads (\d+) GB/s ([\d.]+)", r.stdout)}
        if set(found) == set(threads):
            return found
        log.warning("read_bw printed no figure (%s); NumPy's probe instead", r.stderr.strip()[-200:])
    from bench_generate import read_bandwidth as numpy_probe

    return {t: numpy_probe(t) for t in threads}


def decode_one(path: str, tokens: int, runs: int) -> float:
    """dasllama's decode tokens/s in this process (DASLLAMA_THREADS set by the caller)."""
    import dasllama as dl

    m = dl.load_model(path)
    ids = [(1000 + 7919 * i) % (m.n_vocab - 1000) + 500 for i in range(tokens + 1)]
    times = []
    for _ in range(runs + 1):
        s = dl.create_session(m)
        dl.eval(m, s, ids[:1])
        t0 = time.perf_counter()
        for t in ids[1:]:
            dl.eval(m, s, [t])
        times.append(time.perf_counter() - t0)
    # The first run warms the pages and the thread team.
    return tokens / statistics.median(times[1:])


def decode(path: Path, threads: int, tokens: int, runs: int) -> float:
    cmd = [sys.executable, __file__, "--one", str(path), "--tokens", str(tokens), "--runs", str(runs)]
    r = subprocess.run(cmd, env=dict(os.environ, DASLLAMA_THREADS=str(threads)), capture_output=True, text=True, check=True)
    return float(json.loads(r.stdout.strip().splitlines()[-1])["tok_s"])


def llama_bench(path: Path, threads: int, tokens: int, runs: int) -> float | None:
    cmd = [str(llama_tool("llama-bench")), "-m", str(path), "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", str(runs), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        log.warning("llama-bench failed on %s: %s", path.name, r.stderr.strip()[-300:])
        return None
    return float(json.loads(r.stdout)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps({"tok_s": decode_one(args.one, args.tokens, args.runs)}))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from bench_generate import weight_figures

    paths = {label: model_path(label) for label in args.models}
    load = os.getloadavg()[0]
    if load > 0.5:
        log.warning("load average %.1f: other work shares this box, and these figures with it", load)
    bw = read_bandwidth(args.threads)
    jobs = [(label, t) for label in args.models for t in args.threads]
    results: dict[tuple[str, int], tuple[float, float | None]] = {}
    for label, t in tqdm(jobs, desc="decoding", unit="run"):
        # Interleaved, ours then llama.cpp's, so drift on a shared box hits both alike.
        results[label, t] = (decode(paths[label], t, args.tokens, args.runs), llama_bench(paths[label], t, args.tokens, args.runs))
    print(f"\n{cpu_name()}; decode tokens/s, median of {args.runs} runs of {args.tokens} tokens; llama-bench tg{args.tokens}")
    print("read bandwidth (read_bw): " + ", ".join(f"{t} thread{'s' if t > 1 else ''} {bw[t]:.1f} GB/s" for t in args.threads))
    print(f"| {'model':<20} | threads | {'dasllama':>8} | {'llama.cpp':>9} | {'ratio':>6} | weights read | share of probe |")
    print(f"|{'-' * 22}|---------|{'-' * 10}|{'-' * 11}|{'-' * 8}|--------------|----------------|")
    for (label, t), (ours, ref) in results.items():
        read, _ = weight_figures(str(paths[label]))
        gbs = ours * read / 1e9
        ref_s, ratio = (f"{ref:9.1f}", f"{ours / ref:5.2f}x") if ref else (f"{'n/a':>9}", f"{'':>6}")
        print(f"| {LABELS[label]:<20} | {t:>7} | {ours:8.1f} | {ref_s} | {ratio} | {gbs:7.1f} GB/s | {gbs / bw[t]:14.0%} |")


if __name__ == "__main__":
    main()
