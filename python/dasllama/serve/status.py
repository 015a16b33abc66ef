"""What the status page shows: per-model counts from the engines' snapshots, rates from a short
history the server samples once a second, and the compute tier each model runs on."""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from ..runtime import n_threads

if TYPE_CHECKING:
    from .app import Server

HISTORY_S = 120  # seconds of samples kept for the plots
RATE_WINDOW_S = 3.0  # the "now" figures average over this much history, so one slow step does not read as zero


def tier_status() -> dict[str, Any]:
    """The compute tier the process serves on: the GPU tier's status (`dasllama.gpu`) and its
    honesty counter, or the CPU's kernel threads."""
    from .. import gpu

    threads = n_threads()
    try:
        st = gpu.gpu_tier_status()
    except Exception as e:  # noqa: BLE001 - the status page reports a broken tier query instead of failing whole
        return {"backend": "unknown", "device": "unknown", "detail": f"gpu_tier_status failed: {type(e).__name__}: {e}", "threads": threads}
    if st.backend == "cpu":
        # Why no GPU serves (no Vulkan loader, only a CPU-type device) is kept apart from the line
        # the page shows: on a CPU-only machine that is the normal case, not a fault to fix.
        return {"backend": "cpu", "device": "cpu", "detail": f"no GPU: running on the CPU, {threads} kernel threads", "threads": threads, "gpu_reason": st.reason}
    return {
        "backend": st.backend,
        "device": st.device,
        "detail": f"{st.weight_bytes >> 20} MiB of weights, {st.kv_bytes >> 20} MiB of K/V on the device",
        "threads": threads,
        "vram_bytes": st.vram_bytes,
        "budget_bytes": st.budget_bytes,
        "gpu_cpu_passes": {p.words: p.count for p in gpu.gpu_cpu_passes()},
    }


def rss_bytes() -> int | None:
    """The server process's resident memory (Linux; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Sample:
    at: float
    tokens_out: int  # generated tokens streamed to clients so far
    prompt_tokens: int  # prompt tokens the engine prefilled so far
    ttft_sum: float  # the TTFT histogram's sum and count: their deltas give an interval's mean
    ttft_n: int
    active: int
    queued: int


class StatusHistory:
    """Per-model samples, one a second, taken by a task of the server's event loop."""

    def __init__(self) -> None:
        self.samples: dict[str, collections.deque[Sample]] = {}
        self.started = time.time()

    def take(self, server: Server) -> None:
        now = time.monotonic()
        mt = server.metrics
        for name, eng in server.engines.items():
            active, queued = eng.counts()
            h = mt.ttft.get(name)
            s = Sample(now, mt.tokens_out.get(name, 0), int(eng.stats().get("prefill_tokens", 0)), h.total if h else 0.0, h.n if h else 0, active, queued)
            self.samples.setdefault(name, collections.deque(maxlen=HISTORY_S + 1)).append(s)

    def series(self, name: str) -> list[dict[str, Any]]:
        """One point per interval between samples: tokens/s, prompt tokens/s, mean TTFT (ms, None
        when no request began in it), active and queued streams."""
        pts = list(self.samples.get(name, ()))
        out = []
        for a, b in pairwise(pts):
            dt = max(b.at - a.at, 1e-6)
            dn = b.ttft_n - a.ttft_n
            out.append(
                {
                    "t": round(b.at - pts[-1].at, 1),
                    "tokens_per_s": round((b.tokens_out - a.tokens_out) / dt, 1),
                    "prompt_tokens_per_s": round((b.prompt_tokens - a.prompt_tokens) / dt, 1),
                    "ttft_ms": round((b.ttft_sum - a.ttft_sum) / dn * 1000, 1) if dn else None,
                    "active": b.active,
                    "queued": b.queued,
                }
            )
        return out

    def rate(self, name: str, server: Server) -> tuple[float, float]:
        """(generated, prompt) tokens per second over the last RATE_WINDOW_S, up to this moment."""
        pts = self.samples.get(name)
        eng = server.engines[name]
        now = time.monotonic()
        cur_out = server.metrics.tokens_out.get(name, 0)
        cur_prompt = int(eng.stats().get("prefill_tokens", 0))
        if not pts:
            return 0.0, 0.0
        base = next((p for p in pts if now - p.at <= RATE_WINDOW_S), pts[-1])
        dt = now - base.at
        if dt < 0.2:
            return 0.0, 0.0
        return (cur_out - base.tokens_out) / dt, (cur_prompt - base.prompt_tokens) / dt


def status(server: Server, history: StatusHistory) -> dict[str, Any]:
    """The /status.json document."""
    mt = server.metrics
    tier = tier_status()
    models = []
    for name, eng in server.engines.items():
        m = eng.m
        active, queued = eng.counts()
        st = eng.stats()
        tok_s, prompt_s = history.rate(name, server)
        prefilled, cached = int(st.get("prefill_tokens", 0)), int(st.get("cached_tokens", 0))
        h = mt.ttft.get(name)
        requests = {o: c for (n, o), c in sorted(mt.requests.items()) if n == name}
        paged = "kv_pages_total" in st
        models.append(
            {
                "name": name,
                "file": m.path.name,
                "arch": m.arch,
                "context": int(m.config["seq_len"]),
                "chat": bool(m.chat_template),
                "alive": eng.alive,
                "error": eng.dead,
                "streams": {"active": active, "queued": queued, "max": eng.max_streams},
                "kv": {
                    "paged": paged,
                    "pages_total": int(st.get("kv_pages_total", 0)),
                    "pages_used": int(st.get("kv_pages_used", 0)),
                    "pages_free": int(st.get("kv_pages_free", 0)),
                    "pages_cached": int(st.get("kv_pages_cached", 0)),
                    "bytes_per_page": int(st.get("kv_bytes_per_page", 0)),
                    "bytes_allocated": int(st.get("kv_bytes_allocated", 0)),
                },
                "prefix_cache": {
                    "cached_tokens": cached,
                    "prefilled_tokens": prefilled,
                    # Of the prompt tokens the engine needed, the share it found in the cache.
                    "hit_rate": cached / (cached + prefilled) if cached + prefilled else 0.0,
                    "hits": int(st.get("kv_cache_hits", 0)),
                },
                "tokens_per_s": round(tok_s, 1),
                "prompt_tokens_per_s": round(prompt_s, 1),
                "tokens_out": mt.tokens_out.get(name, 0),
                "ttft_ms_mean": round(h.total / h.n * 1000, 1) if h and h.n else None,
                "decode_steps": int(st.get("decode_steps", 0)),
                "avg_batch": round(float(st.get("avg_batch", 0.0)), 2),
                "requests": requests,
                "tier": tier,
                "memory": {"weights_bytes": _file_size(m.path), "kv_bytes": int(st.get("kv_bytes_allocated", 0))},
                "history": history.series(name),
            }
        )
    return {"ready": server.ready, "uptime_s": round(time.time() - history.started, 1), "gpu": tier["device"], "tier": tier, "rss_bytes": rss_bytes(), "models": models}


def _file_size(path: Any) -> int:
    try:
        return int(path.stat().st_size)
    except OSError:
        return 0
