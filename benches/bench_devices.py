"""A CPU model beside a busy GPU model in one server: the CPU model's inter-token gap at N streams
alone, and again while the GPU model serves N streams of its own, plus how long `/metrics` takes
meanwhile (it reads the device's status, which must never wait for a device step).

The GPU is whatever Vulkan device the server picks (lavapipe, a CPU Vulkan device, with
DASLLAMA_VK_ALLOW_CPU=1). On lavapipe the GPU model's kernels run on the CPU too, so each side gets
cores of its own: the CPU model DASLLAMA_THREADS, lavapipe LP_NUM_THREADS (default one each).

    python benches/bench_devices.py [--model NAME_OR_PATH] [--streams 4] [--tokens 48]
                                    [--python-path DIR]   # serve from another checkout (a before/after run)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import subprocess
import sys
import time

import httpx
from bench_server import free_port, wait_healthy
from machine import cpu_name

import dasllama as dl

PROMPTS = [f"Write a short paragraph about {t}." for t in ["the sea", "robots", "autumn", "lighthouses", "coffee", "mountains", "rain", "libraries"]]


async def stream(c: httpx.AsyncClient, base: str, model: str, prompt: str, tokens: int) -> list[float]:
    """Inter-token gaps (s) of one streamed completion."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    stamps: list[float] = []
    async with c.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                stamps.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(stamps)]


async def poll_metrics(c: httpx.AsyncClient, base: str, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        (await c.get(base + "/metrics", timeout=60)).raise_for_status()
        out.append(time.perf_counter() - t0)
        await asyncio.sleep(0.05)


async def phase(base: str, streams: int, tokens: int, gpu_busy: bool) -> tuple[list[float], list[float]]:
    """The CPU model's gaps over `streams` concurrent requests, with the GPU model serving as many
    at the same time when `gpu_busy`; and /metrics latencies meanwhile."""
    async with httpx.AsyncClient() as c:
        stop = asyncio.Event()
        metrics: list[float] = []
        poller = asyncio.create_task(poll_metrics(c, base, stop, metrics))
        busy: list[asyncio.Task[list[float]]] = []
        if gpu_busy:
            # More GPU work than the CPU side needs, so the device is busy the whole time.
            busy = [asyncio.create_task(stream(c, base, "gpu", PROMPTS[i % len(PROMPTS)], tokens * 2)) for i in range(streams)]
            await asyncio.sleep(2.0)
        runs = await asyncio.gather(*[stream(c, base, "cpu", PROMPTS[i % len(PROMPTS)], tokens) for i in range(streams)])
        stop.set()
        await poller
        for t in busy:
            t.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
    # The first gap of each stream waits on the others' prefill: decode gaps only.
    return [g for r in runs for g in r[2:]], metrics


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2, help="alone / busy pairs, interleaved")
    ap.add_argument("--python-path", default=None, help="PYTHONPATH for the server (another checkout's python/)")
    args = ap.parse_args()
    path = dl.fetch(args.model)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "DASLLAMA_VK_ALLOW_CPU": "1"}
    env.setdefault("DASLLAMA_THREADS", "1")
    env.setdefault("LP_NUM_THREADS", "1")
    if args.python_path:
        env["PYTHONPATH"] = args.python_path
    cmd = [sys.executable, "-m", "dasllama.serve", "--model", str(path), "--alias", "gpu", "--model", str(path), "--alias", "cpu"]
    cmd += ["--gpu", "vulkan", "--streams", str(args.streams), "--spec", "off", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env)
    try:
        wait_healthy(base, proc)
        gaps: dict[bool, list[float]] = {False: [], True: []}
        mets: dict[bool, list[float]] = {False: [], True: []}
        asyncio.run(phase(base, args.streams, 8, False))  # warm-up: pipelines, pages
        for _ in range(args.rounds):
            for busy in (False, True):
                g, ms = asyncio.run(phase(base, args.streams, args.tokens, busy))
                gaps[busy] += g
                mets[busy] += ms
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"\nCPU: {cpu_name()}; server threads {env['DASLLAMA_THREADS']}, lavapipe threads {env['LP_NUM_THREADS']}; {args.streams} streams per model")
    print(f"server code: {args.python_path or 'this checkout'}\n")
    print(f"{'CPU model':<22} {'gap p50 ms':>11} {'gap p99 ms':>11} {'/metrics p50 ms':>16} {'/metrics p99 ms':>16}")
    for busy in (False, True):
        g, ms = gaps[busy], mets[busy]
        print(f"{'GPU model busy' if busy else 'alone':<22} {statistics.median(g) * 1e3:>11.1f} {pct(g, 99) * 1e3:>11.1f} {statistics.median(ms) * 1e3:>16.1f} {pct(ms, 99) * 1e3:>16.1f}")
    ratio = statistics.median(gaps[True]) / statistics.median(gaps[False])
    print(f"\nbusy / alone (median gap): {ratio:.3f}")


if __name__ == "__main__":
    main()
