"""Soak test of the HTTP server: drives `python -m dasllama.serve` for a configurable time
(default 20 minutes) with 16-64 concurrent clients (the count ramps up and down over the run)
mixing streaming and non-streaming chat, /v1/completions, multi-turn conversations that share a
long system prompt (prefix-cache turns), deliberate disconnects mid-stream and mid-prefill, and
hostile requests (a 1 MB single word, 3 MB of words, 200k emoji, malformed JSON, invalid UTF-8,
wrong types, huge and negative values) that must be refused with a 4xx quickly. A separate
thread probes GET /health every 200 ms for the whole run.

At the end it waits for the server to go idle and reports requests by action and outcome, the KV
pages still held after idle, the server's RSS drift between the end of the warm-up and the end
(after idle), /health latency p50/p99/max, the slowest hostile rejection, and PASS/FAIL lines for
the thresholds: 0 pages held by streams after idle, RSS drift under 2%, 0 requests without an
answer, /health p99 under 100 ms. It is a bench, not a test: the exit status is 0 unless the
server could not be started.

    python benches/soak.py --minutes 20
    python benches/soak.py --minutes 1 --clients 16 --json soak.json
    python benches/soak.py --url http://127.0.0.1:8080 --pid 12345   # a server already running
    python benches/soak.py --skip hostile:word_1mb                    # leave a case out

Outcomes: ok (200 with a reply / a stream that ended with a finish_reason and [DONE]),
client_disconnect (cut on purpose), rejected_4xx (a hostile request refused, as it should be),
unexpected_4xx (a normal request refused), hostile_accepted (a hostile request answered 200),
busy_503, error_5xx, stream_error (an SSE event carrying an "error"), truncated (a stream that
ended without [DONE]), bad_response (a 200 whose body is not a completion), timeout (no answer
within --request-timeout), transport_error (the connection failed or was dropped).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

try:
    from tabulate import tabulate
except ImportError:  # the bench extra is optional
    tabulate = None  # type: ignore[assignment]

OUTCOMES = [
    "ok", "client_disconnect", "rejected_4xx", "unexpected_4xx", "hostile_accepted", "busy_503", "error_5xx",
    "stream_error", "truncated", "bad_response", "timeout", "transport_error",
]
# The outcomes that leave a client without an answer: nothing came back in time, or the
# connection died before a complete response.
UNANSWERED = ("timeout", "transport_error")

TOPICS = [
    "the sea", "robots", "autumn", "lighthouses", "coffee", "mountains", "rain", "libraries", "trains", "the moon",
    "a garden", "winter", "violins", "the desert", "friendship", "bread", "volcanoes", "bees", "clocks", "bridges",
]
WORDS = (
    "the of and to in is was that for it with as his on be at by had are but from or have an they which one you were "
    "her all she there would their we him been has when who will more no if out so said what up its about into than "
    "them can only other new some could time these two may then do first any my now such like our over man me even "
    "most made after also did many before must through back years where much your way well down should because each "
    "just those people how too little state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might us great old year off come since against go came "
    "right used take three river mountain lantern harbor signal copper meadow winter engine orchard ledger cipher"
).split()


# ---- the payloads ------------------------------------------------------------------------------


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompts(n: int) -> list[str]:
    """A few long system prompts (~700 tokens each) shared by every conversation: the prefix cache
    should serve them to all clients after the first turn that carries them."""
    out = []
    for k in range(n):
        rng = random.Random(1000 + k)
        rules = [f"Rule {i + 1}: {words(rng, 22)}." for i in range(24)]
        out.append(f"You are assistant number {k}, a careful and concise helper. Follow these house rules.\n" + "\n".join(rules))
    return out


def hostile_cases(rng: random.Random) -> dict[str, tuple[str, bytes, bool]]:
    """name -> (path, raw body, whether the request streams). Built once: multi-megabyte bodies are
    not re-encoded on the event loop during the run."""

    def chat(msgs: Any, **kw: Any) -> bytes:
        return json.dumps({"messages": msgs, **kw}, ensure_ascii=False).encode()

    def user(text: str, **kw: Any) -> bytes:
        return chat([{"role": "user", "content": text}], **kw)

    many_words = []
    size = 0
    while size < 3_000_000:
        w = rng.choice(WORDS)
        many_words.append(w)
        size += len(w) + 1
    depth = 100_000
    cases: dict[str, tuple[str, bytes, bool]] = {
        "word_1mb": ("/v1/chat/completions", user("a" * 1_000_000, max_tokens=8), False),
        "words_3mb": ("/v1/chat/completions", user(" ".join(many_words), max_tokens=8), True),
        "emoji_200k": ("/v1/chat/completions", user("\U0001F600" * 200_000, max_tokens=8), False),
        "completion_word_1mb": ("/v1/completions", json.dumps({"prompt": "b" * 1_000_000, "max_tokens": 8}).encode(), False),
        "nested_json": ("/v1/chat/completions", b'{"messages": ' + b"[" * depth + b"]" * depth + b"}", False),
        "truncated_json": ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hel', False),
        "invalid_utf8": ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3\x28"}]}', False),
        "body_not_object": ("/v1/chat/completions", b'[{"role": "user", "content": "hi"}]', False),
        "messages_not_list": ("/v1/chat/completions", chat("hello there"), False),
        "messages_empty": ("/v1/chat/completions", chat([]), False),
        "message_not_object": ("/v1/chat/completions", chat([1, 2, 3]), False),
        "role_wrong_type": ("/v1/chat/completions", chat([{"role": 5, "content": "hi"}]), False),
        "content_wrong_type": ("/v1/chat/completions", chat([{"role": "user", "content": 12}]), False),
        "content_bad_parts": ("/v1/chat/completions", chat([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]), False),
        "max_tokens_huge": ("/v1/chat/completions", user("Say hi.", max_tokens=10**30, stream=True), True),
        "max_tokens_infinity": ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": Infinity}', False),
        "max_tokens_negative": ("/v1/chat/completions", user("Say hi.", max_tokens=-5), False),
        "max_tokens_string": ("/v1/chat/completions", user("Say hi.", max_tokens="lots"), False),
        "temperature_negative": ("/v1/chat/completions", user("Say hi.", temperature=-1, stream=True), True),
        "top_p_out_of_range": ("/v1/chat/completions", user("Say hi.", top_p=7), False),
        "n_zero": ("/v1/chat/completions", user("Say hi.", n=0), False),
        "n_huge": ("/v1/chat/completions", user("Say hi.", n=100_000, stream=True), True),
        "stream_not_bool": ("/v1/chat/completions", user("Say hi.", stream="yes"), False),
        "stop_too_many": ("/v1/chat/completions", user("Say hi.", stop=[str(i) for i in range(50)]), False),
        "model_wrong_type": ("/v1/chat/completions", user("Say hi.", model=["m"]), False),
        "model_unknown": ("/v1/chat/completions", user("Say hi.", model="no-such-model"), False),
        "prompt_token_out_of_range": ("/v1/completions", json.dumps({"prompt": [10**9, -1], "max_tokens": 4}).encode(), False),
        "prompt_empty_list": ("/v1/completions", json.dumps({"prompt": [], "max_tokens": 4}).encode(), False),
        "prompt_object": ("/v1/completions", json.dumps({"prompt": {"a": 1}, "max_tokens": 4}).encode(), False),
    }
    return cases


# ---- bookkeeping -------------------------------------------------------------------------------


@dataclass
class Result:
    outcome: str
    status: int = 0
    latency: float = 0.0
    text: str = ""
    usage: dict[str, Any] | None = None
    detail: str = ""


@dataclass
class Stats:
    by_action: Counter = field(default_factory=Counter)  # (action, outcome) -> count
    hostile: list[tuple[str, str, float, int]] = field(default_factory=list)  # (case, outcome, seconds, status)
    ok_latency: list[float] = field(default_factory=list)
    examples: dict[str, list[str]] = field(default_factory=dict)  # a few details per bad outcome
    cut_before_first_token: int = 0
    cut_after_first_token: int = 0
    conv_prompt_tokens: int = 0
    conv_cached_tokens: int = 0
    empty_replies: int = 0

    def record(self, action: str, res: Result) -> None:
        self.by_action[(action, res.outcome)] += 1
        if res.outcome == "ok":
            self.ok_latency.append(res.latency)
        elif res.outcome not in ("client_disconnect", "rejected_4xx", "busy_503"):
            ex = self.examples.setdefault(res.outcome, [])
            if len(ex) < 5:
                ex.append(f"{action}: status {res.status}, {res.latency:.1f}s, {res.detail[:160]}")

    def totals(self) -> Counter:
        t: Counter = Counter()
        for (_, o), n in self.by_action.items():
            t[o] += n
        return t


@dataclass
class Ctx:
    client: httpx.AsyncClient
    base: str
    headers: dict[str, str]
    stats: Stats
    t0: float
    deadline: float
    min_clients: int
    max_clients: int
    start_clients: int
    period: float
    max_tokens: int
    request_timeout: float
    systems: list[str]
    hostile: dict[str, tuple[str, bytes, bool]]
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    hostile_order: list[str] = field(default_factory=list)
    hostile_next: int = 0

    def next_hostile(self) -> str:
        """The cases in turn (the multi-megabyte ones first, then a seeded shuffle), so that even
        a short run sends each of them."""
        if not self.hostile_order:
            big = [n for n in ("word_1mb", "words_3mb", "emoji_200k", "completion_word_1mb") if n in self.hostile]
            rest = sorted(set(self.hostile) - set(big))
            random.Random(len(rest)).shuffle(rest)
            self.hostile_order = big + rest
        name = self.hostile_order[self.hostile_next % len(self.hostile_order)]
        self.hostile_next += 1
        return name

    def target_clients(self) -> int:
        """A triangle wave between min and max clients, starting at start_clients on the way up."""
        if self.max_clients <= self.min_clients:
            return self.max_clients
        span = self.max_clients - self.min_clients
        phase = (self.start_clients - self.min_clients) / span / 2
        x = ((time.monotonic() - self.t0) / self.period + phase) % 1.0
        return self.min_clients + round(span * (1 - abs(2 * x - 1)))

    def over(self) -> bool:
        return self.stop.is_set() or time.monotonic() >= self.deadline


# ---- one request -------------------------------------------------------------------------------


def _error_message(raw: bytes) -> str:
    try:
        err = json.loads(raw)["error"]
        return str(err.get("message", err) if isinstance(err, dict) else err)
    except Exception:  # noqa: BLE001 -- any body at all
        return raw[:160].decode("utf-8", "replace")


async def _send(ctx: Ctx, path: str, payload: bytes, *, stream: bool, hostile: bool, cut_after: int | None, first_token: asyncio.Event | None) -> Result:
    t0 = time.perf_counter()
    headers = {"content-type": "application/json", **ctx.headers}
    async with ctx.client.stream("POST", ctx.base + path, content=payload, headers=headers) as r:
        status = r.status_code
        if status != 200:
            raw = await r.aread()
            lat = time.perf_counter() - t0
            msg = _error_message(raw)
            if status == 503:
                return Result("busy_503", status, lat, detail=msg)
            if status >= 500:
                return Result("error_5xx", status, lat, detail=msg)
            if 400 <= status < 500:
                return Result("rejected_4xx" if hostile else "unexpected_4xx", status, lat, detail=msg)
            return Result("bad_response", status, lat, detail=msg)
        if hostile:  # leaving the block closes the connection: a stream the server accepted is evicted
            return Result("hostile_accepted", status, time.perf_counter() - t0, detail="answered 200")
        if not stream:
            raw = await r.aread()
            lat = time.perf_counter() - t0
            try:
                body = json.loads(raw)
                choice = body["choices"][0]
                text = choice["message"]["content"] if "message" in choice else choice["text"]
                if not isinstance(text, str) or choice.get("finish_reason") not in ("stop", "length"):
                    raise ValueError(f"finish_reason {choice.get('finish_reason')!r}")
            except Exception as e:  # noqa: BLE001 -- whatever is wrong with it, it is not a completion
                return Result("bad_response", status, lat, detail=f"{type(e).__name__}: {e}; {raw[:120]!r}")
            return Result("ok", status, lat, text=text, usage=body.get("usage"))
        text, finished, done, chunks, usage = [], False, False, 0, None
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                obj = json.loads(data)
            except json.JSONDecodeError:
                return Result("bad_response", status, time.perf_counter() - t0, detail=f"bad SSE line {data[:120]!r}")
            if not isinstance(obj, dict):
                return Result("bad_response", status, time.perf_counter() - t0, detail=f"bad SSE line {data[:120]!r}")
            if "error" in obj:
                return Result("stream_error", status, time.perf_counter() - t0, detail=str(obj["error"])[:200])
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") if "delta" in ch else ch.get("text")
                if piece:
                    text.append(piece)
                    chunks += 1
                    if first_token is not None:
                        first_token.set()
                if ch.get("finish_reason"):
                    finished = True
            if cut_after is not None and chunks >= cut_after and not finished:
                return Result("client_disconnect", status, time.perf_counter() - t0, text="".join(text), detail=f"cut after {chunks} chunks")
        lat = time.perf_counter() - t0
        if not done:
            return Result("truncated", status, lat, text="".join(text), detail=f"no [DONE] after {chunks} chunks")
        if not finished:
            return Result("bad_response", status, lat, detail="[DONE] without a finish_reason")
        return Result("ok", status, lat, text="".join(text), usage=usage)


async def send(ctx: Ctx, path: str, payload: bytes | dict[str, Any], *, stream: bool = False, hostile: bool = False, cut_after: int | None = None, first_token: asyncio.Event | None = None) -> Result:
    """One request, classified; never waits past --request-timeout."""
    if isinstance(payload, dict):
        payload = json.dumps(payload, ensure_ascii=False).encode()
    t0 = time.perf_counter()
    try:
        return await asyncio.wait_for(_send(ctx, path, payload, stream=stream, hostile=hostile, cut_after=cut_after, first_token=first_token), ctx.request_timeout)
    except (TimeoutError, httpx.TimeoutException):
        return Result("timeout", 0, time.perf_counter() - t0, detail=f"no answer within {ctx.request_timeout:.0f}s")
    except httpx.HTTPError as e:
        return Result("transport_error", 0, time.perf_counter() - t0, detail=f"{type(e).__name__}: {e}")


# ---- the client actions ------------------------------------------------------------------------


def chat_body(ctx: Ctx, rng: random.Random, messages: list[dict[str, str]], stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": messages, "max_tokens": rng.randint(max(1, ctx.max_tokens // 4), ctx.max_tokens), "temperature": rng.choice([0, 0.7, 1.0])}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.1:
        body["stop"] = [rng.choice(["\n\n", ".", " the"])]
    if rng.random() < 0.05:
        body["n"] = 2
    return body


async def act_chat(ctx: Ctx, rng: random.Random, stream: bool = False) -> None:
    msgs = [{"role": "user", "content": f"Write a short paragraph about {rng.choice(TOPICS)}."}]
    res = await send(ctx, "/v1/chat/completions", chat_body(ctx, rng, msgs, stream), stream=stream)
    if res.outcome == "ok" and not res.text:
        ctx.stats.empty_replies += 1
    ctx.stats.record("chat_stream" if stream else "chat", res)
    await backoff(res, rng)


async def act_chat_stream(ctx: Ctx, rng: random.Random) -> None:
    await act_chat(ctx, rng, stream=True)


async def act_stream_disconnect(ctx: Ctx, rng: random.Random) -> None:
    msgs = [{"role": "user", "content": f"Write a long story about {rng.choice(TOPICS)}."}]
    body = chat_body(ctx, rng, msgs, True)
    body["max_tokens"] = max(ctx.max_tokens, 32)
    body.pop("stop", None)
    res = await send(ctx, "/v1/chat/completions", body, stream=True, cut_after=rng.randint(1, 12))
    ctx.stats.record("stream_disconnect", res)
    await backoff(res, rng)


async def act_prefill_disconnect(ctx: Ctx, rng: random.Random) -> None:
    """A long prompt, then the request is dropped a moment later: usually while the server is still
    prefilling it (or while it waits in the queue)."""
    stream = rng.random() < 0.5
    prompt = f"Summarize this text in one sentence:\n{words(rng, rng.randint(600, 2400))}"
    if rng.random() < 0.75:
        path, body = "/v1/chat/completions", chat_body(ctx, rng, [{"role": "user", "content": prompt}], stream)
    else:
        path, body = "/v1/completions", {"prompt": prompt, "max_tokens": ctx.max_tokens, "stream": stream}
    first = asyncio.Event()
    task = asyncio.ensure_future(send(ctx, path, body, stream=stream, first_token=first))
    done, _ = await asyncio.wait({task}, timeout=rng.uniform(0.02, 1.5))
    if task in done:
        res = task.result()
    else:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        res = Result("client_disconnect", detail="cancelled")
        if stream and first.is_set():
            ctx.stats.cut_after_first_token += 1
        else:
            ctx.stats.cut_before_first_token += 1
    ctx.stats.record("prefill_disconnect", res)
    await backoff(res, rng)


async def act_hostile(ctx: Ctx, rng: random.Random) -> None:
    if not ctx.hostile:
        return await act_chat(ctx, rng)
    name = ctx.next_hostile()
    path, payload, stream = ctx.hostile[name]
    res = await send(ctx, path, payload, stream=stream, hostile=True)
    ctx.stats.record(f"hostile:{name}", res)
    ctx.stats.hostile.append((name, res.outcome, res.latency, res.status))
    await backoff(res, rng)


async def act_conversation(ctx: Ctx, rng: random.Random) -> None:
    """2-4 turns over a shared long system prompt; each turn carries the previous replies, so every
    turn after the first should start from the prefix cache."""
    msgs = [{"role": "system", "content": rng.choice(ctx.systems)}]
    for turn in range(rng.randint(2, 4)):
        if ctx.over():
            return
        msgs.append({"role": "user", "content": f"Turn {turn + 1}: tell me one fact about {rng.choice(TOPICS)}."})
        stream = rng.random() < 0.5
        body = chat_body(ctx, rng, msgs, stream)
        body.pop("n", None)
        res = await send(ctx, "/v1/chat/completions", body, stream=stream)
        ctx.stats.record("conversation", res)
        if res.outcome != "ok":
            await backoff(res, rng)
            return
        if res.usage:
            ctx.stats.conv_prompt_tokens += int(res.usage.get("prompt_tokens") or 0)
            ctx.stats.conv_cached_tokens += int((res.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        msgs.append({"role": "assistant", "content": res.text})


async def act_completion(ctx: Ctx, rng: random.Random) -> None:
    stream = rng.random() < 0.5
    body: dict[str, Any] = {"prompt": f"Once upon a time, {rng.choice(TOPICS)}", "max_tokens": rng.randint(max(1, ctx.max_tokens // 4), ctx.max_tokens), "temperature": 0.8, "stream": stream}
    res = await send(ctx, "/v1/completions", body, stream=stream)
    ctx.stats.record("completion", res)
    await backoff(res, rng)


async def backoff(res: Result, rng: random.Random) -> None:
    """Do not spin on a server that refuses or is gone."""
    if res.outcome == "busy_503":
        await asyncio.sleep(rng.uniform(0.2, 1.0))
    elif res.outcome in ("transport_error", "error_5xx"):
        await asyncio.sleep(rng.uniform(0.5, 1.5))


ACTIONS: dict[str, tuple[float, Callable[[Ctx, random.Random], Awaitable[None]]]] = {
    "chat": (0.20, act_chat),
    "chat_stream": (0.20, act_chat_stream),
    "stream_disconnect": (0.10, act_stream_disconnect),
    "prefill_disconnect": (0.08, act_prefill_disconnect),
    "hostile": (0.08, act_hostile),
    "conversation": (0.22, act_conversation),
    "completion": (0.12, act_completion),
}


async def client_loop(ctx: Ctx, i: int, seed: int) -> None:
    rng = random.Random(seed * 7919 + i)
    names = list(ACTIONS)
    weights = [ACTIONS[n][0] for n in names]
    await asyncio.sleep(rng.uniform(0, 1))  # do not all start in the same millisecond
    while not ctx.over():
        if i >= ctx.target_clients():
            await asyncio.sleep(0.5)
            continue
        await ACTIONS[rng.choices(names, weights)[0]][1](ctx, rng)


# ---- the server side: process, /health probe, RSS, /metrics -------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kb(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> metric name -> value summed over its labels (the models)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        try:
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def read_metrics(base: str, headers: dict[str, str]) -> dict[str, float] | None:
    try:
        r = httpx.get(base + "/metrics", headers=headers, timeout=10)
        return parse_metrics(r.text) if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


class Prober(threading.Thread):
    """GET /health every 200 ms on its own thread and connection (so the load's event loop does not
    delay the probes), and the server's RSS every 2 s."""

    def __init__(self, base: str, headers: dict[str, str], pid: int | None, warmup: float, interval: float = 0.2, timeout: float = 10.0) -> None:
        super().__init__(name="soak-prober", daemon=True)
        self.base, self.headers, self.pid, self.warmup, self.interval, self.timeout = base, headers, pid, warmup, interval, timeout
        self.halt = threading.Event()
        self.latencies: list[float] = []
        self.non_200: Counter = Counter()
        self.rss_samples: list[tuple[float, int]] = []
        self.rss_warm: int | None = None
        # (seconds, pages used, pages cached) every 5 s: RSS grows with the KV pool, so a drift
        # reads against how full the pool was at each end.
        self.page_samples: list[tuple[float, float, float]] = []
        self.pages_warm: tuple[float, float] | None = None

    def run(self) -> None:
        t0 = time.monotonic()
        next_rss = next_pages = t0
        with httpx.Client(timeout=self.timeout) as c:
            while not self.halt.is_set():
                start = time.perf_counter()
                try:
                    status = c.get(self.base + "/health").status_code
                except httpx.TimeoutException:
                    status = "timeout"
                except httpx.HTTPError as e:
                    status = type(e).__name__
                lat = time.perf_counter() - start
                self.latencies.append(lat)
                if status != 200:
                    self.non_200[str(status)] += 1
                now = time.monotonic()
                if now >= next_rss:
                    kb = rss_kb(self.pid)
                    if kb is not None:
                        self.rss_samples.append((now - t0, kb))
                        if self.rss_warm is None and now - t0 >= self.warmup:
                            self.rss_warm = kb
                    next_rss = now + 2.0
                if now >= next_pages:
                    next_pages = now + 5.0
                    try:
                        r = c.get(self.base + "/metrics", headers=self.headers)
                        m = parse_metrics(r.text) if r.status_code == 200 else {}
                    except httpx.HTTPError:
                        m = {}
                    if "dasllama_kv_pages_used" in m:
                        used, cached = m["dasllama_kv_pages_used"], m.get("dasllama_kv_pages_cached", 0.0)
                        self.page_samples.append((now - t0, used, cached))
                        if self.pages_warm is None and now - t0 >= self.warmup:
                            self.pages_warm = (used, cached)
                self.halt.wait(max(0.0, self.interval - lat))


def start_server(args: argparse.Namespace, port: int, log_path: Path) -> subprocess.Popen:
    model = args.model
    try:  # fetch here, with its progress bar, so the server's start-up is only the load
        import dasllama as dl

        model = str(dl.fetch(args.model))
    except Exception as e:  # noqa: BLE001 -- the server gets the name and fetches it itself
        print(f"could not fetch {args.model} here ({e}); the server will", file=sys.stderr)
    cmd = [sys.executable, "-m", "dasllama.serve", "--model", model, "--port", str(port), "--streams", str(args.streams), "--log-level", "warning"]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    cmd += args.server_arg
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(base: str, proc: subprocess.Popen | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    return False


def stop_server(proc: subprocess.Popen) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(45)  # the server lets running requests finish for up to 30 s
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def wait_idle(base: str, headers: dict[str, str], timeout: float) -> tuple[bool, float, dict[str, float] | None]:
    t0 = time.monotonic()
    m = None
    while time.monotonic() - t0 < timeout:
        m = read_metrics(base, headers)
        if m is not None and m.get("dasllama_active_streams", 0) == 0 and m.get("dasllama_queue_depth", 0) == 0:
            return True, time.monotonic() - t0, m
        time.sleep(0.5)
    return False, time.monotonic() - t0, m


# ---- the run -----------------------------------------------------------------------------------


async def load(args: argparse.Namespace, base: str, headers: dict[str, str], proc: subprocess.Popen | None, hostile: dict[str, tuple[str, bytes, bool]]) -> tuple[Stats, float, str | None]:
    duration = args.minutes * 60
    stats = Stats()
    limits = httpx.Limits(max_connections=args.max_clients + 8, max_keepalive_connections=args.max_clients + 8)
    timeout = httpx.Timeout(args.request_timeout + 5, connect=30)
    died: str | None = None
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        now = time.monotonic()
        ctx = Ctx(
            client=client, base=base, headers=headers, stats=stats, t0=now, deadline=now + duration,
            min_clients=args.min_clients, max_clients=args.max_clients, start_clients=args.clients,
            period=min(args.ramp_period, duration) if duration > 0 else args.ramp_period,
            max_tokens=args.max_tokens, request_timeout=args.request_timeout, systems=system_prompts(4), hostile=hostile,
        )
        tasks = [asyncio.ensure_future(client_loop(ctx, i, args.seed)) for i in range(args.max_clients)]
        with tqdm(total=int(duration), unit="s", desc="soak", dynamic_ncols=True) as bar:
            while not all(t.done() for t in tasks):
                await asyncio.sleep(1)
                elapsed = time.monotonic() - now
                tot = stats.totals()
                if elapsed < duration:
                    bar.n = int(elapsed)
                else:
                    bar.n = int(duration)
                    bar.set_description(f"draining ({sum(not t.done() for t in tasks)} clients)")
                bad = sum(n for o, n in tot.items() if o in UNANSWERED + ("error_5xx", "stream_error", "truncated", "bad_response", "unexpected_4xx"))
                bar.set_postfix(clients=ctx.target_clients() if elapsed < duration else 0, requests=sum(tot.values()), ok=tot["ok"], bad=bad, refresh=False)
                bar.refresh()
                if proc is not None and proc.poll() is not None and died is None:
                    died = f"the server exited with status {proc.returncode} after {elapsed:.0f}s"
                    ctx.stop.set()
        for t in tasks:
            if t.exception() is not None:
                print(f"a client crashed: {t.exception()!r}", file=sys.stderr)
        wall = time.monotonic() - now
    return stats, wall, died


def ms(x: float, digits: int = 1) -> str:
    return "n/a" if math.isnan(x) else f"{x * 1000:.{digits}f}"


def secs(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}"


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


def server_log_errors(text: str) -> Counter:
    """Each traceback in the log by its exception line, and each ERROR/CRITICAL line that no
    traceback follows."""
    out: Counter = Counter()
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("Traceback"):
            j = i + 1
            while j < len(lines) and (lines[j].startswith((" ", "\t")) or not lines[j].strip()):
                j += 1
            if j < len(lines):
                out["Traceback: " + lines[j].strip()] += 1
            i = j + 1
            continue
        if ("ERROR" in line or "CRITICAL" in line) and not (i + 1 < len(lines) and lines[i + 1].startswith("Traceback")):
            out[line.strip()] += 1
        i += 1
    return out


def _clean(x: Any) -> Any:
    """NaN and infinities to null: strict JSON has neither."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def table(rows: list[list[Any]], headers: list[str]) -> str:
    if tabulate is not None:
        return tabulate(rows, headers=headers, tablefmt="github")
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + " |"
    return "\n".join([fmt(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(r) for r in cells[1:]])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="how long the load runs (default 20)")
    ap.add_argument("--clients", type=int, default=32, help="clients at the start (default 32)")
    ap.add_argument("--min-clients", type=int, default=16, help="the low end of the ramp (default 16)")
    ap.add_argument("--max-clients", type=int, default=64, help="the high end of the ramp (default 64); equal to --min-clients for a fixed count")
    ap.add_argument("--ramp-period", type=float, default=600.0, help="seconds per up-and-down cycle of the client count (at most the run's length)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--port", type=int, default=0, help="port for the server this starts (default: a free one)")
    ap.add_argument("--url", default=None, help="drive an already running server instead of starting one")
    ap.add_argument("--pid", type=int, default=None, help="with --url: the server's process id, for its RSS")
    ap.add_argument("--api-key", default=None, help="passed to the server and sent by the clients")
    ap.add_argument("--streams", type=int, default=8, help="--streams for the server (default 8)")
    ap.add_argument("--server-arg", action="append", default=[], help="one more argument for the server (repeatable), e.g. --server-arg=--queue=32")
    ap.add_argument("--max-tokens", type=int, default=64, help="the most tokens a normal request asks for (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds after which a request counts as unanswered (default 120)")
    ap.add_argument("--warmup", type=float, default=None, help="seconds before the warm RSS is taken (default: a quarter of the run, by when the bounded prefix cache has filled)")
    ap.add_argument("--idle-timeout", type=float, default=60.0, help="how long to wait for the server to go idle at the end")
    ap.add_argument("--skip", nargs="+", default=[], help="leave out actions (e.g. hostile) or hostile cases (e.g. hostile:word_1mb)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON here")
    args = ap.parse_args()
    args.min_clients = min(args.min_clients, args.clients)
    args.max_clients = max(args.max_clients, args.clients, args.min_clients)
    duration = args.minutes * 60
    warmup = args.warmup if args.warmup is not None else duration / 4

    hostile = hostile_cases(random.Random(args.seed))
    for s in args.skip:
        if s.startswith("hostile:"):
            if hostile.pop(s.split(":", 1)[1], None) is None:
                ap.error(f"no hostile case {s!r}; the cases: {', '.join(sorted(hostile))}")
        elif s in ACTIONS:
            ACTIONS[s] = (0.0, ACTIONS[s][1])
        else:
            ap.error(f"nothing to skip called {s!r}; the actions: {', '.join(ACTIONS)}")
    if not any(w for w, _ in ACTIONS.values()):
        ap.error("every action is skipped")

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    proc: subprocess.Popen | None = None
    log_path = Path(tempfile.mkstemp(prefix="dasllama-soak-", suffix=".log")[1])
    if args.url:
        base, pid = args.url.rstrip("/"), args.pid
        if not wait_healthy(base, None, 60):
            print(f"{base}/health does not answer 200", file=sys.stderr)
            return 1
    else:
        port = args.port or free_port()
        base = f"http://127.0.0.1:{port}"
        proc = start_server(args, port, log_path)
        pid = proc.pid
        if not wait_healthy(base, proc, 600):
            stop_server(proc)
            print(f"the server did not become healthy; its log ({log_path}):\n" + log_path.read_text(errors="replace")[-4000:], file=sys.stderr)
            return 1

    prober = Prober(base, headers, pid, warmup)
    prober.start()
    died: str | None = None
    try:
        stats, wall, died = asyncio.run(load(args, base, headers, proc, hostile))
        prober.halt.set()
        prober.join()
        idle, idle_s, m = (False, 0.0, None) if died else wait_idle(base, headers, args.idle_timeout)
        time.sleep(1.0)  # let the last evictions and frees land before reading pages and RSS
        m2 = None if died else read_metrics(base, headers)
        m = m2 or m
        rss_end = rss_kb(pid)
    finally:
        prober.halt.set()
        exit_status = stop_server(proc) if proc is not None else None
    log_text = log_path.read_text(errors="replace") if proc is not None else ""

    # ---- figures --------------------------------------------------------------------------------
    tot = stats.totals()
    n_req = sum(tot.values())
    unanswered = sum(tot[o] for o in UNANSWERED)
    used = m.get("dasllama_kv_pages_used") if m else None
    cached = m.get("dasllama_kv_pages_cached") if m else None
    held = (used - (cached or 0)) if used is not None else None
    rss_warm = prober.rss_warm or (prober.rss_samples[-1][1] if prober.rss_samples else None)
    drift = (rss_end - rss_warm) / rss_warm if rss_end and rss_warm else None
    rss_peak = max([kb for _, kb in prober.rss_samples] + ([rss_end] if rss_end else []), default=None)
    h = prober.latencies
    h50, h99, hmax = pct(h, 0.5), pct(h, 0.99), max(h, default=math.nan)
    rej = [lat for _, o, lat, _ in stats.hostile if o == "rejected_4xx"]
    hostile_bad = [(c, o, lat, st) for c, o, lat, st in stats.hostile if o != "rejected_4xx"]
    actions = sorted({a for a, _ in stats.by_action})
    cache_ratio = stats.conv_cached_tokens / stats.conv_prompt_tokens if stats.conv_prompt_tokens else None

    verdicts = [
        ("0 KV pages held by streams after idle", held == 0, "n/a" if held is None else f"{held:.0f} held" + ("" if idle else " (server never went idle)")),
        ("RSS drift under 2%", None if drift is None else drift < 0.02, "n/a (no server process to read)" if drift is None else f"{drift * 100:+.2f}%"),
        ("0 requests without an answer", unanswered == 0, f"{unanswered} (timeout {tot['timeout']}, transport_error {tot['transport_error']})"),
        ("/health p99 under 100 ms", not math.isnan(h99) and h99 < 0.1, f"{ms(h99)} ms"),
    ]
    extras = [
        ("every hostile request refused with a 4xx", not hostile_bad, f"{len(hostile_bad)} of {len(stats.hostile)} not"),
        ("no unexpected errors", not any(tot[o] for o in ("unexpected_4xx", "error_5xx", "stream_error", "truncated", "bad_response")),
         ", ".join(f"{o} {tot[o]}" for o in ("unexpected_4xx", "error_5xx", "stream_error", "truncated", "bad_response") if tot[o]) or "none"),
        ("the server stayed up", died is None, died or "yes"),
    ]

    # ---- the report -----------------------------------------------------------------------------
    print(f"\nsoak: {args.model}, {wall / 60:.1f} min (load {args.minutes:g} min + drain), clients {args.min_clients}-{args.max_clients} "
          f"(start {args.clients}, ramp period {min(args.ramp_period, duration) if duration > 0 else args.ramp_period:.0f}s), server --streams {args.streams}, max_tokens {args.max_tokens}, seed {args.seed}, "
          f"{n_req} requests ({n_req / wall:.1f}/s)\n")
    print(table([[o, tot[o]] for o in OUTCOMES if tot[o]] + [["total", n_req]], ["outcome", "requests"]))
    print()
    cols = [o for o in OUTCOMES if tot[o]]
    short = lambda a: a if len(a) <= 34 else a[:33] + "…"
    print(table([[short(a)] + [stats.by_action[(a, o)] or "" for o in cols] for a in actions], ["action"] + cols))
    print()
    fmt_kb = lambda kb: "n/a" if kb is None else f"{kb / 1024:.1f} MiB"
    figures = [
        ["KV pages used after idle (raw)", "n/a" if used is None else f"{used:.0f}"],
        ["KV pages cached (prefix cache) after idle", "n/a" if cached is None else f"{cached:.0f}"],
        ["KV pages held by streams after idle", "n/a" if held is None else f"{held:.0f}"],
        ["server idle after the load", f"{'yes' if idle else 'NO'} ({idle_s:.1f}s)" if not died else "n/a (server gone)"],
        ["KV pages used / cached at warm-up", "n/a" if prober.pages_warm is None else f"{prober.pages_warm[0]:.0f} / {prober.pages_warm[1]:.0f}"],
        ["KV pages used at peak", "n/a" if not prober.page_samples else f"{max(u for _, u, _ in prober.page_samples):.0f}"],
        [f"RSS warm (after {warmup:.0f}s)", fmt_kb(rss_warm)],
        ["RSS end (after idle)", fmt_kb(rss_end)],
        ["RSS peak", fmt_kb(rss_peak)],
        ["RSS drift", "n/a" if drift is None else f"{drift * 100:+.2f}%"],
        ["/health probes", f"{len(h)} ({sum(prober.non_200.values())} not 200" + (f": {dict(prober.non_200)}" if prober.non_200 else "") + ")"],
        ["/health p50 / p99 / max", f"{ms(h50)} / {ms(h99)} / {ms(hmax)} ms"],
        ["hostile rejections (4xx): p50 / max", f"{ms(pct(rej, 0.5), 0)} / {ms(max(rej, default=math.nan), 0)} ms ({len(rej)} rejected)"],
        ["ok requests latency p50 / p99", f"{secs(pct(stats.ok_latency, 0.5))} / {secs(pct(stats.ok_latency, 0.99))} s"],
        ["conversation turns: prompt tokens from the prefix cache", "n/a" if cache_ratio is None else f"{cache_ratio * 100:.0f}%"],
        ["prefill disconnects cut before / after the first token", f"{stats.cut_before_first_token} / {stats.cut_after_first_token}"],
        ["empty ok replies", stats.empty_replies],
    ]
    log_errors = server_log_errors(log_text)
    if proc is not None:
        figures.append(["server log: errors and tracebacks", f"{sum(log_errors.values())} (exit status {exit_status}; log {log_path})"])
    print(table(figures, ["figure", "value"]))
    print()
    print(table([["n/a" if ok is None else "PASS" if ok else "FAIL", what, val] for what, ok, val in verdicts] + [[("ok" if ok else "WARN"), what, val] for what, ok, val in extras],
                ["verdict", "threshold", "measured"]))
    if hostile_bad:
        by_case: Counter = Counter((c, o) for c, o, _, _ in hostile_bad)
        print("\nhostile requests not refused with a 4xx: " + ", ".join(f"{c} -> {o} x{n}" for (c, o), n in sorted(by_case.items())))
    if log_errors:
        print("\nin the server's log:\n  " + "\n  ".join(f"{n} x {line[:200]}" for line, n in log_errors.most_common(8)))
    for o, ex in stats.examples.items():
        print(f"\n{o}, e.g.:\n  " + "\n  ".join(ex))
    if died and log_text:
        print("\nthe server's log, last lines:\n" + log_text[-3000:])

    if args.json:
        out = {
            "config": {k: v for k, v in vars(args).items()},
            "wall_s": wall,
            "died": died,
            "outcomes": dict(tot),
            "by_action": {a: {o: stats.by_action[(a, o)] for o in OUTCOMES if stats.by_action[(a, o)]} for a in actions},
            "kv_pages": {"used": used, "cached": cached, "held_by_streams": held, "idle": idle, "idle_wait_s": idle_s},
            "rss_kb": {"warm": rss_warm, "end": rss_end, "peak": rss_peak, "drift": drift, "warmup_s": warmup, "samples": prober.rss_samples},
            "kv_pages_samples": prober.page_samples,
            "health": {"probes": len(h), "non_200": dict(prober.non_200), "p50_s": h50, "p99_s": h99, "max_s": hmax},
            "hostile": {"rejected": len(rej), "rejection_p50_s": pct(rej, 0.5), "rejection_max_s": max(rej, default=None),
                        "not_refused": [{"case": c, "outcome": o, "latency_s": lat, "status": st} for c, o, lat, st in hostile_bad]},
            "ok_latency_p50_s": pct(stats.ok_latency, 0.5),
            "ok_latency_p99_s": pct(stats.ok_latency, 0.99),
            "conversation_cache_ratio": cache_ratio,
            "prefill_cuts": {"before_first_token": stats.cut_before_first_token, "after_first_token": stats.cut_after_first_token},
            "examples": stats.examples,
            "server_log_errors": dict(log_errors),
            "verdicts": {what: {"pass": ok, "measured": val} for what, ok, val in verdicts + extras},
        }
        Path(args.json).write_text(json.dumps(_clean(out), indent=2, default=str))
        print(f"\nfigures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
