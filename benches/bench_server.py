"""Load on the HTTP server: an async httpx generator at concurrency 1, 4, 16, 64 over a fixed
prompt set (64-token replies, streaming), printing requests/s, output tokens/s, TTFT and
inter-token latency p50/p99 -- and the same against llama.cpp's server when one is on the PATH
(`llama-server`, or in ~/.cache/dasllama/llama.cpp/bin where `scripts/build_llama_cpp.py` puts it)
or llama-cpp-python's (`python -m llama_cpp.server`) is importable.

    python benches/bench_server.py [--concurrency 1 4 16 64] [--requests 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from itertools import pairwise

import httpx
from bench_decode import built_llama_tool, read_bandwidth
from machine import cpu_name
from tqdm import tqdm

import dasllama as dl

PROMPTS = [f"Write a short paragraph about {t}." for t in ["the sea", "robots", "autumn", "lighthouses", "coffee", "mountains", "rain", "libraries"]]


def llama_cpu_flags() -> list[str]:
    """llama-server's flags for this CPU: on one with AMX, `--no-repack`, since llama.cpp's AMX
    weight repacking (on by default) segfaults here on prompts (seen with the 0.3.36 sources on a
    Xeon with amx_int8: `llama-bench -p 16` exits with SIGSEGV, `--repack 0` runs)."""
    try:
        with open("/proc/cpuinfo") as f:
            return ["--no-repack"] if "amx_int8" in f.read() else []
    except OSError:
        return []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited during start-up")
        for probe in ("/health", "/v1/models"):  # llama-cpp-python's server has no /health
            try:
                if httpx.get(base + probe, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(0.3)
    raise RuntimeError("server did not become healthy")


async def one(c: httpx.AsyncClient, base: str, prompt: str, max_tokens: int) -> tuple[float, list[float], int, bool]:
    """(TTFT, inter-token gaps, streamed pieces, whether the stream was cut off or refused)."""
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    done = False
    try:
        async with c.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    ch = json.loads(line[6:])["choices"]
                    if ch and ch[0].get("delta", {}).get("content"):
                        stamps.append(time.perf_counter())
    except httpx.HTTPError:
        done = False
    ttft = (stamps[0] - t0) if stamps else float("nan")
    return ttft, [b - a for a, b in pairwise(stamps)], len(stamps), not done


async def load(base: str, conc: int, n_req: int, max_tokens: int) -> dict[str, float]:
    sem = asyncio.Semaphore(conc)
    results = []

    async def task(i: int) -> None:
        async with sem:
            results.append(await one(c, base, PROMPTS[i % len(PROMPTS)], max_tokens))

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=conc + 4)) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(task(i) for i in range(n_req)))
        wall = time.perf_counter() - t0
    failed = sum(r[3] for r in results)
    ttfts = sorted(r[0] for r in results if r[0] == r[0]) or [float("nan")]
    itls = sorted(x for r in results for x in r[1]) or [float("nan")]
    toks = sum(r[2] for r in results)
    pct = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))]
    return {"failed": failed, "rps": (n_req - failed) / wall, "tok_s": toks / wall, "ttft50": statistics.median(ttfts), "ttft99": pct(ttfts, 0.99), "itl50": statistics.median(itls), "itl99": pct(itls, 0.99)}


def run_server(cmd: list[str], base: str, label: str, concs: list[int], n_req: int, max_tokens: int) -> list[tuple[str, int, dict[str, float]]]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(base, proc)
        return [(label, c, asyncio.run(load(base, c, max(n_req, c), max_tokens))) for c in tqdm(concs, desc=label)]
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    path = str(dl.fetch(args.model))
    load0 = os.getloadavg()[0]
    bw = read_bandwidth([args.threads])[args.threads]
    rows = []
    port = free_port()
    cmd = [sys.executable, "-m", "dasllama.serve", "--model", path, "--alias", "m", "--port", str(port), "--streams", "16", "--log-level", "warning"]
    rows += run_server(cmd, f"http://127.0.0.1:{port}", "dasllama", args.concurrency, args.requests, args.max_tokens)
    port = free_port()
    if llama_server := built_llama_tool("llama-server"):
        cmd = [str(llama_server), "-m", path, "--port", str(port), "-np", "16", "-t", str(args.threads), "-c", str(16 * 1024), "-a", "m", *llama_cpu_flags()]
        rows += run_server(cmd, f"http://127.0.0.1:{port}", "llama-server", args.concurrency, args.requests, args.max_tokens)
    else:
        try:
            import llama_cpp.server  # noqa: F401

            cmd = [sys.executable, "-m", "llama_cpp.server", "--model", path, "--port", str(port), "--n_threads", str(args.threads), "--model_alias", "m", "--n_ctx", "4096"]
            rows += run_server(cmd, f"http://127.0.0.1:{port}", "llama-cpp-python", args.concurrency, args.requests, args.max_tokens)
        except ImportError:
            print("no llama-server (PATH or ~/.cache/dasllama/llama.cpp/bin) and no llama_cpp.server: dasllama only")
    print(f"\n{cpu_name()}; {args.max_tokens}-token replies, {args.requests} requests per level (at least the concurrency); load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print(f"read bandwidth (read_bw): {args.threads} threads {bw:.1f} GB/s")
    print("| server | concurrency | completed req/s | cut off | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, c, r in rows:
        print(
            f"| {label} | {c} | {r['rps']:.2f} | {r['failed']} | {r['tok_s']:.1f} | {r['ttft50'] * 1000:.0f} | {r['ttft99'] * 1000:.0f} "
            f"| {r['itl50'] * 1000:.1f} | {r['itl99'] * 1000:.1f} |"
        )


if __name__ == "__main__":
    main()
