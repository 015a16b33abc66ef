"""A long prompt among running streams, through the HTTP server: N streams decode (streaming,
greedy, no end of generation), then a prompt of about `--prompt-tokens` tokens arrives. Prints the
long prompt's time to first token and the decoders' inter-token gaps while it is prefilled
(p50 / p99 / max), beside their gaps before it arrived -- and the same against llama.cpp's
server when `llama-server` is on the PATH or in ~/.cache/dasllama/llama.cpp/bin. Each run uses a
fresh prompt (no prefix-cache hit); `--repeat` runs alternate between the servers and every run
is printed, then the medians.

    python benches/bench_long_prompt.py [--model smollm2-135m-instruct] [--streams 8] [--prompt-tokens 4000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from itertools import pairwise

import httpx
from bench_decode import built_llama_tool, read_bandwidth
from bench_server import free_port, llama_cpu_flags, wait_healthy
from machine import cpu_name

import dasllama as dl

WORDS = ("river stone lantern orchard harbor meadow signal copper window garden winter engine "
         "violet market thunder canvas pebble mirror silver forest ribbon candle rocket marble").split()


def long_text(m: dl.Model, n_tokens: int, seed: int) -> str:
    """Random words, about `n_tokens` tokens of them (counted with the model's tokenizer)."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(n_tokens)]
    text = " ".join(words)
    while len(dl.encode(m, text)) > n_tokens - 40:
        words = words[: int(len(words) * 0.9)]
        text = " ".join(words)
    return f"Summarize the following notes in one sentence.\n\n{text}"


async def stream(c: httpx.AsyncClient, base: str, prompt: str, max_tokens: int, stamps: list[float], t0: list[float]) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    t0.append(time.perf_counter())
    async with c.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"]
                if ch and ch[0].get("delta", {}).get("content"):
                    stamps.append(time.perf_counter())


def gaps(stamps: list[float], lo: float, hi: float) -> list[float]:
    """Gaps between consecutive tokens whose later token arrived in [lo, hi]; the gap open at `hi`
    (a token not yet arrived) counts up to the first token after it."""
    return [b - a for a, b in pairwise(stamps) if lo <= b and a <= hi]


async def one_run(base: str, n_streams: int, long_prompt: str) -> dict[str, float]:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n_streams + 4)) as c:
        stamps: list[list[float]] = [[] for _ in range(n_streams)]
        tasks = [asyncio.create_task(stream(c, base, f"Write a long story about {WORDS[i]}.", 100_000, stamps[i], [])) for i in range(n_streams)]
        # Let every decoder get going, then measure their undisturbed gaps for a while.
        while min(len(s) for s in stamps) < 5:
            await asyncio.sleep(0.02)
        t_calm = time.perf_counter()
        await asyncio.sleep(1.5)
        t_long = time.perf_counter()
        long_stamps: list[float] = []
        t0: list[float] = []
        await stream(c, base, long_prompt, 4, long_stamps, t0)
        t_first = long_stamps[0] if long_stamps else float("nan")
        await asyncio.sleep(0.3)  # the gap open when the long prompt's first token came
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    calm = sorted(g for s in stamps for g in gaps(s, t_calm, t_long))
    hot = sorted(g for s in stamps for g in gaps(s, t_long, t_first))
    pct = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")
    return {"ttft": t_first - t0[0], "calm50": statistics.median(calm), "hot50": statistics.median(hot), "hot99": pct(hot, 0.99), "hotmax": hot[-1] if hot else float("nan"), "n_hot": len(hot)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--streams", type=int, default=8, help="decoding streams when the long prompt arrives")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="llama-server's threads")
    ap.add_argument("--server-arg", action="append", default=[], help="an extra flag for dasllama's server (repeatable)")
    args = ap.parse_args()
    path = str(dl.fetch(args.model))
    m = dl.load_model(path)
    bw = read_bandwidth([args.threads])[args.threads]
    servers: list[tuple[str, list[str], int]] = []
    port = free_port()
    servers.append(("dasllama", [sys.executable, "-m", "dasllama.serve", "--model", path, "--alias", "m", "--port", str(port), "--streams", str(args.streams + 1), "--log-level", "warning", *args.server_arg], port))
    if llama_server := built_llama_tool("llama-server"):
        port = free_port()
        ctx = (args.streams + 1) * (args.prompt_tokens + 2048)
        servers.append(("llama-server", [str(llama_server), "-m", path, "--port", str(port), "-np", str(args.streams + 1), "-t", str(args.threads), "-c", str(ctx), "-a", "m", *llama_cpu_flags()], port))
    else:
        print("no llama-server (PATH or ~/.cache/dasllama/llama.cpp/bin): dasllama only")
    procs = {}
    try:
        for label, cmd, port in servers:
            procs[label] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_healthy(f"http://127.0.0.1:{port}", procs[label])
        results: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in servers}
        print(f"\n{cpu_name()}; {m.path.name}: {args.streams} decoding streams, a {args.prompt_tokens}-token prompt arrives; load average {os.getloadavg()[0]:.1f}")
        print(f"read bandwidth (read_bw): {args.threads} threads {bw:.1f} GB/s")
        print("| server | run | long prompt TTFT s | gap before p50 ms | gap during p50 ms | p99 ms | max ms | gaps |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for k in range(args.repeat):
            for label, _, port in servers:
                r = asyncio.run(one_run(f"http://127.0.0.1:{port}", args.streams, long_text(m, args.prompt_tokens, 1000 * k + len(label))))
                results[label].append(r)
                print(f"| {label} | {k} | {r['ttft']:.2f} | {r['calm50'] * 1e3:.1f} | {r['hot50'] * 1e3:.1f} | {r['hot99'] * 1e3:.0f} | {r['hotmax'] * 1e3:.0f} | {r['n_hot']} |", flush=True)
        for label, rs in results.items():
            med = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
            spread = (min(r["ttft"] for r in rs), max(r["ttft"] for r in rs))
            print(f"| {label} | median | {med['ttft']:.2f} ({spread[0]:.2f}-{spread[1]:.2f}) | {med['calm50'] * 1e3:.1f} | {med['hot50'] * 1e3:.1f} | {med['hot99'] * 1e3:.0f} | {med['hotmax'] * 1e3:.0f} | {med['n_hot']:.0f} |")
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(60)


if __name__ == "__main__":
    main()
