"""Single-stream speed: prefill (pp128, pp512) and decode (tg128) tokens/s, median of 5 runs,
for both test models, with llama.cpp's figures beside ours when llama-cpp-python is installed.

    python benches/bench_generate.py [--runs 5] [--threads N] [--models smollm2-135m-instruct gemma3-270m] [--backend cpu|vulkan]

With ``--backend vulkan`` each model also runs whole on the Vulkan device (a device-home session),
its rows printed beside the CPU's (a CPU-type device such as lavapipe needs DASLLAMA_VK_ALLOW_CPU=1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("DASLLAMA_THREADS", "2")))
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    ap.add_argument("--backend", default="cpu", choices=["cpu", "vulkan"], help="vulkan: also run each model on the Vulkan device")
    args = ap.parse_args()
    os.environ.setdefault("DASLLAMA_THREADS", str(args.threads))
    import dasllama as dl

    rows: list[tuple[str, str, float, float | None]] = []
    jobs: list[tuple[str, Callable[[], dict[str, float] | None]]] = []
    for name in args.models:
        path = str(dl.fetch(name))
        jobs.append((name, lambda p=path: bench_dasllama(p, args.runs)))
        if args.backend == "vulkan":
            jobs.append((name + " [vulkan]", lambda p=path: bench_dasllama(p, args.runs, device=True)))
        jobs.append((name + " (llama.cpp)", lambda p=path: bench_llama_cpp(p, args.runs, args.threads)))
    results: dict[str, dict[str, float] | None] = {}
    for label, job in tqdm(jobs, desc="benchmarking", unit="model"):
        results[label] = job()
    for name in args.models:
        ours, ref = results[name], results[name + " (llama.cpp)"]
        assert ours is not None
        for test, _ in TESTS:
            rows.append((name, test, ours[test], ref[test] if ref else None))
        dev = results.get(name + " [vulkan]")
        for test, _ in TESTS if dev else []:
            rows.append((name + " [vulkan]", test, dev[test], ref[test] if ref else None))
    print(f"\nthreads={args.threads}, median of {args.runs} runs, tokens/s")
    print(f"| {'model':<24} | {'test':<6} | {'dasllama':>9} | {'llama.cpp':>9} | {'ratio':>6} |")
    print(f"|{'-' * 26}|{'-' * 8}|{'-' * 11}|{'-' * 11}|{'-' * 8}|")
    for model, test, ours_v, ref_v in rows:
        ref_s = f"{ref_v:9.1f}" if ref_v else f"{'n/a':>9}"
        ratio = f"{ours_v / ref_v:5.2f}x" if ref_v else f"{'':>6}"
        print(f"| {model:<24} | {test:<6} | {ours_v:9.1f} | {ref_s} | {ratio} |")


if __name__ == "__main__":
    main()
