"""Single-stream speed: prefill (pp128, pp512) and decode (tg128) tokens/s, median of 5 runs,
for both test models, with llama.cpp's figures beside ours when llama-cpp-python is installed
(here, or in the interpreter `--llama-python` names, run as a subprocess).

Each row also prints how far it is from its bound: decode as GB/s of weights read per token
against this box's read bandwidth (measured here with NumPy over 1 GiB, one reader per thread),
prefill as int8 multiply-adds per second (the layers' weights once per token) against
`--peak-gmacs` when given (the GEMM kernel's measured peak; the Rust `matmul` criterion bench
prints it).

    python benches/bench_generate.py [--runs 5] [--threads N] [--models smollm2-135m-instruct gemma3-270m] [--backend cpu|vulkan]
    python benches/bench_generate.py --models ~/.cache/dasllama/bench/bench-llama1b-Q4_K_M.gguf --llama-python /work/llamacpp-venv/bin/python

With ``--backend vulkan`` each model also runs whole on the Vulkan device (a device-home session),
its rows printed beside the CPU's (a CPU-type device such as lavapipe needs DASLLAMA_VK_ALLOW_CPU=1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

TESTS = [("pp128", 128), ("pp512", 512), ("tg128", 128)]


def _ids(n: int, vocab: int) -> list[int]:
    # A fixed, ordinary token stream: what is measured is the arithmetic, not the text.
    return [(1000 + 7919 * i) % (vocab - 1000) + 500 for i in range(n)]


def bench_dasllama(path: str, runs: int, device: bool = False) -> dict[str, float]:
    import dasllama as dl
    from dasllama import gpu

    if device:
        gpu.set_gpu_resident_regions(1)
        gpu.set_gpu_ctx_max(1024)
        gpu.set_gpu_tier_want(gpu.GpuTierWant(auto_tier=True))
        if not gpu.moe_gpu_tier_arm():
            raise SystemExit(f"--backend vulkan: {gpu.gpu_tier_status().reason}")
    m = dl.load_model(path)
    if device and not gpu.is_device_session(s0 := gpu.create_device_session(m)):
        raise SystemExit(f"--backend vulkan: {gpu.gpu_install_reason()}")
    if device:
        gpu.gpu_device_kv_park(s0)
    out: dict[str, float] = {}
    for name, n in TESTS:
        ids = _ids(n, m.n_vocab)
        times = []
        for _ in range(runs):
            s = gpu.create_device_session(m) if device else dl.create_session(m)
            if name.startswith("pp"):
                t0 = time.perf_counter()
                dl.eval(m, s, ids)
            else:
                dl.eval(m, s, ids[:1])
                t0 = time.perf_counter()
                for t in ids[1:]:
                    dl.eval(m, s, [t])
                n = len(ids) - 1
            times.append(time.perf_counter() - t0)
            if device:
                gpu.gpu_device_kv_park(s)
        out[name] = n / statistics.median(times)
    if device:
        gpu.moe_gpu_drop_model()
    return out


def bench_llama_cpp(path: str, runs: int, threads: int) -> dict[str, float] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=path, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    out: dict[str, float] = {}
    for name, n in TESTS:
        ids = _ids(n, llm.n_vocab())
        times = []
        for _ in range(runs):
            llm.reset()
            llm._ctx.memory_clear(True) if hasattr(llm._ctx, "memory_clear") else None
            if name.startswith("pp"):
                t0 = time.perf_counter()
                llm.eval(ids)
            else:
                llm.eval(ids[:1])
                t0 = time.perf_counter()
                for t in ids[1:]:
                    llm.eval([t])
                n = len(ids) - 1
            times.append(time.perf_counter() - t0)
        out[name] = n / statistics.median(times)
    return out


def bench_llama_cpp_in(python: str, path: str, runs: int, threads: int) -> dict[str, float] | None:
    """`bench_llama_cpp` in another interpreter (one that has llama_cpp)."""
    cmd = [python, __file__, "--llama-only", path, "--runs", str(runs), "--threads", str(threads)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if r.returncode == 0 and lines else None


def read_bandwidth(threads: int, gib: float = 1.0) -> float:
    """GB/s that `threads` readers draw from memory: each takes the largest value of its share of
    an array larger than any cache (NumPy releases the GIL, and its SIMD max keeps up with memory
    where a float sum does not); best of 5."""
    import numpy as np

    a = np.ones(int(gib * 2**30) // 4, dtype=np.float32)
    parts = np.array_split(a, threads)
    best = 0.0
    for _ in range(5):
        ts = [threading.Thread(target=np.maximum.reduce, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = max(best, a.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def weight_figures(path: str) -> tuple[float, float]:
    """(bytes of weights a decoded token reads, weight multiply-adds of a prefilled token): every
    tensor but the token embedding (one row of it is read) unless it is also the output matrix
    (tied, as in Gemma 3: all of it is read for the logits), and the layers' matrices only (the
    logits are one row per chunk)."""
    from gguf import GGUFReader

    r = GGUFReader(path)
    tied = not any(t.name == "output.weight" for t in r.tensors)
    read = sum(int(t.n_bytes) for t in r.tensors if tied or t.name != "token_embd.weight")
    macs = sum(int(t.n_elements) for t in r.tensors if t.name.startswith("blk.") and len(t.shape) >= 2)
    return read, macs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("DASLLAMA_THREADS", "2")))
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    ap.add_argument("--backend", default="cpu", choices=["cpu", "vulkan"], help="vulkan: also run each model on the Vulkan device")
    ap.add_argument("--llama-python", default=None, help="an interpreter with llama_cpp, when this one has none")
    ap.add_argument("--peak-gmacs", type=float, default=None, help="the GEMM kernel's measured peak, G int8 multiply-adds/s")
    ap.add_argument("--llama-only", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_only:
        print(json.dumps(bench_llama_cpp(args.llama_only, args.runs, args.threads)))
        return
    os.environ.setdefault("DASLLAMA_THREADS", str(args.threads))
    import dasllama as dl

    rows: list[tuple[str, str, float, float | None]] = []
    jobs: list[tuple[str, Callable[[], dict[str, float] | None]]] = []
    for name in args.models:
        path = str(dl.fetch(name))
        jobs.append((name, lambda p=path: bench_dasllama(p, args.runs)))
        if args.backend == "vulkan":
            jobs.append((name + " [vulkan]", lambda p=path: bench_dasllama(p, args.runs, device=True)))
        if args.llama_python:
            jobs.append((name + " (llama.cpp)", lambda p=path: bench_llama_cpp_in(args.llama_python, p, args.runs, args.threads)))
        else:
            jobs.append((name + " (llama.cpp)", lambda p=path: bench_llama_cpp(p, args.runs, args.threads)))
    # Before any model runs: the engine's worker threads spin a while after each pass and would
    # take the cores from NumPy's readers.
    bw = read_bandwidth(args.threads)
    results: dict[str, dict[str, float] | None] = {}
    for label, job in tqdm(jobs, desc="benchmarking", unit="model"):
        results[label] = job()
    bound: dict[str, str] = {}
    for name in args.models:
        ours, ref = results[name], results[name + " (llama.cpp)"]
        assert ours is not None
        read, macs = weight_figures(str(dl.fetch(name)))
        for test, _ in TESTS:
            rows.append((name, test, ours[test], ref[test] if ref else None))
            if test.startswith("tg"):
                gbs = ours[test] * read / 1e9
                bound[name + test] = f"{gbs:.1f} GB/s = {gbs / bw:.0%} of {bw:.1f}"
            else:
                g = ours[test] * macs / 1e9
                bound[name + test] = f"{g:.0f} GMAC/s" + (f" = {g / args.peak_gmacs:.0%} of {args.peak_gmacs:.0f}" if args.peak_gmacs else "")
        dev = results.get(name + " [vulkan]")
        for test, _ in TESTS if dev else []:
            rows.append((name + " [vulkan]", test, dev[test], ref[test] if ref else None))
            bound[name + " [vulkan]" + test] = "device"
    print(f"\nthreads={args.threads}, median of {args.runs} runs, tokens/s; read bandwidth {bw:.1f} GB/s")
    print(f"| {'model':<24} | {'test':<6} | {'dasllama':>9} | {'llama.cpp':>9} | {'ratio':>6} | bound (dasllama) |")
    print(f"|{'-' * 26}|{'-' * 8}|{'-' * 11}|{'-' * 11}|{'-' * 8}|---|")
    for model, test, ours_v, ref_v in rows:
        ref_s = f"{ref_v:9.1f}" if ref_v else f"{'n/a':>9}"
        ratio = f"{ours_v / ref_v:5.2f}x" if ref_v else f"{'':>6}"
        print(f"| {Path(model).name[:24]:<24} | {test:<6} | {ours_v:9.1f} | {ref_s} | {ratio} | {bound[model + test]} |")


if __name__ == "__main__":
    main()
