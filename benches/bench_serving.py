"""Serving: N concurrent SmolLM2 conversations with 128-token replies through the scheduler,
batched (max_streams=N) against one at a time (max_streams=1), with the paged pool and prefix
cache as the server runs them (16-row pages). Each configuration runs `--repeat` times,
alternating, and the median run is reported: aggregate tokens/s, TTFT p50/p99, decode steps and
average batch. Writes a PNG plot of throughput against streams.

    python benches/bench_serving.py [--streams 1 4 8 16] [--max-new 128] [--repeat 3] [--page-rows 16] [--plot benches/serving.png] [--backend cpu|vulkan]

With ``--backend vulkan`` the model goes on the Vulkan device and every configuration also runs
with the streams' K/V in device regions (``set_device_kv``): the device's tokens/s beside the CPU's.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tqdm import tqdm

import dasllama as dl
from dasllama import gpu

TOPICS = ["the sea", "a robot", "autumn", "a lighthouse", "coffee", "mountains", "a city at night", "rain",
          "a library", "the moon", "a garden", "trains", "winter", "a violin", "the desert", "friendship"]


def requests(m: dl.Model, n: int, max_new: int, first_id: int) -> list[dl.PendingReq]:
    reqs = []
    for i in range(n):
        chat = dl.create_chat_renderer(m, "You are a helpful assistant.", max_new)
        dl.add_user(chat, f"Write a long story about {TOPICS[i % len(TOPICS)]}.")
        # Greedy, and no stop ids: every reply runs the full max_new tokens, so runs compare.
        reqs.append(dl.PendingReq(id=first_id + i, prompt=dl.render_turn(m, chat), max_new=max_new))
    return reqs


def run(m: dl.Model, reqs: list[dl.PendingReq], streams: int, page_rows: int, device: bool = False) -> dict[str, float]:
    sch = dl.create_scheduler(m, max_streams=streams, max_queue=len(reqs), chunk_tokens=64, page_rows=page_rows)
    if device:
        gpu.set_device_kv(sch, True)
    t0 = time.perf_counter()
    for r in reqs:
        assert dl.submit(m, sch, r)
    events: list[dl.SchedEvent] = []
    ttft, n_gen = [], 0
    while dl.scheduler_step(m, sch, events) or events:
        for e in events:
            if e.kind == "finished":
                ttft.append(e.ttft_us / 1000)
                n_gen += e.n_gen
        events.clear()
    wall = time.perf_counter() - t0
    st = dl.scheduler_stats(sch)
    q = statistics.quantiles(ttft, n=100) if len(ttft) > 1 else [ttft[0]] * 99
    return {"tok_s": n_gen / wall, "wall": wall, "ttft_p50": statistics.median(ttft), "ttft_p99": q[98], "steps": st["decode_steps"], "avg_batch": st["avg_batch"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3, help="runs per configuration; the median is reported")
    ap.add_argument("--page-rows", type=int, default=16, help="KV page size (0: private KV, no prefix cache)")
    ap.add_argument("--plot", default="benches/serving.png")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "vulkan"], help="vulkan: also run every configuration from the Vulkan device")
    args = ap.parse_args()
    device = args.backend == "vulkan"
    if device:
        gpu.set_gpu_resident_regions(max(args.streams))
        gpu.set_gpu_ctx_max(2048)
        gpu.set_gpu_tier_want(gpu.GpuTierWant(auto_tier=True))
        if not gpu.moe_gpu_tier_arm():
            raise SystemExit(f"--backend vulkan: {gpu.gpu_tier_status().reason}")
    m = dl.load_model(args.model)
    if device and gpu.gpu_slot_capture(gpu.gpu_model_marks_init()) != "gpu:resident":
        raise SystemExit(f"--backend vulkan: {gpu.gpu_install_reason()}")
    dev_runs: dict[int, list] = {n: [] for n in args.streams}
    median = lambda runs: sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
    runs: dict[int, tuple[list, list]] = {n: ([], []) for n in args.streams}
    # Machines drift in speed over minutes: every repeat visits every configuration, batched and
    # one at a time alternating, so the drift falls on all of them alike. Fresh ids (a cold
    # prefix cache) every run.
    with tqdm(total=args.repeat * len(args.streams), desc="runs") as bar:
        for k in range(args.repeat):
            for n in args.streams:
                runs[n][0].append(run(m, requests(m, n, args.max_new, 10_000 * k), n, args.page_rows))
                runs[n][1].append(run(m, requests(m, n, args.max_new, 10_000 * k + 5000), 1, args.page_rows))
                if device:
                    dev_runs[n].append(run(m, requests(m, n, args.max_new, 10_000 * k + 7000), n, args.page_rows, device=True))
                bar.update()
    rows = [(n, median(b), median(s)) for n, (b, s) in runs.items()]
    print(f"\n{m.path.name}, {dl.n_threads()} threads, {args.max_new}-token replies, page_rows={args.page_rows}, median of {args.repeat}")
    print("| streams | batched tok/s | 1-at-a-time tok/s | wall ratio | TTFT p50 ms | TTFT p99 ms | decode steps | avg batch |")
    print("|--------:|--------------:|------------------:|-----------:|------------:|------------:|-------------:|----------:|")
    for n, b, s in rows:
        print(f"| {n:7d} | {b['tok_s']:13.1f} | {s['tok_s']:17.1f} | {b['wall'] / s['wall']:9.2f}x | {b['ttft_p50']:11.0f} | {b['ttft_p99']:11.0f} | {b['steps']:12.0f} | {b['avg_batch']:9.2f} |")
    if device:
        print(f"\nThe same, batched, from the Vulkan device ({gpu.gpu_tier_status().device}):")
        print("| streams | device tok/s | CPU tok/s | device / CPU | TTFT p50 ms | avg batch |")
        print("|--------:|-------------:|----------:|-------------:|------------:|----------:|")
        for n, b, _ in rows:
            d = median(dev_runs[n])
            print(f"| {n:7d} | {d['tok_s']:12.1f} | {b['tok_s']:9.1f} | {d['tok_s'] / b['tok_s']:11.2f}x | {d['ttft_p50']:11.0f} | {d['avg_batch']:9.2f} |")
    single = rows[0][1]["tok_s"] if rows[0][0] == 1 else None
    if single:
        print(f"\n{rows[-1][0]} streams: {rows[-1][1]['tok_s'] / single:.2f}x the single-stream tokens/s")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'dasllama[bench]'): no plot written")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r[0] for r in rows], [r[1]["tok_s"] for r in rows], "o-", label="batched (scheduler)")
    ax.plot([r[0] for r in rows], [r[2]["tok_s"] for r in rows], "s--", label="one at a time")
    ax.set_xlabel("concurrent conversations")
    ax.set_ylabel("aggregate output tokens/s")
    ax.set_title(f"{m.path.name}, {dl.n_threads()} threads")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
