"""One engine thread per model. It alone touches the scheduler: handlers hand it submits and
cancels through an inbox that it drains between steps, and read what it publishes after each step
(counts, stats) as one immutable snapshot, so no route ever waits for a step to end. Events go
back to the asyncio side, which only moves them."""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import gpu
from .. import scheduler as sched
from ..model import Model
from ..sampling_defaults import LLAMA_SERVER, SamplingDefaults
from ..speculative import drafter_kind

log = logging.getLogger("dasllama.serve")

# The most tokens one request generates unless the server says otherwise (--n-predict): a request
# asking for more (max_tokens 1e11) ends there with finish_reason "length". llama-server's default
# is the context alone, which let one request hold a stream for 12 minutes (8,160 tokens on
# SmolLM2's 8k context); 4096 is longer than any ordinary answer or a small model's reasoning,
# half a typical 8k context, and a couple of minutes of decoding on two CPU cores.
DEFAULT_N_PREDICT = 4096


@dataclass(frozen=True)
class EngineFailure:
    """Delivered instead of a `finished` event when the engine thread itself died."""

    message: str
    kind: str = "engine_failure"


Delivery = sched.SchedEvent | EngineFailure


@dataclass
class Subscription:
    """Where one request's events go: an asyncio queue, fed from the engine thread."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item: Delivery) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


@dataclass(frozen=True)
class Snapshot:
    """What the engine thread publishes after each step; replaced whole, never mutated."""

    active: int = 0
    queued: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    at: float = 0.0


class EngineDead(RuntimeError):
    """The engine thread is gone; nothing can be served by it."""


class Engine:
    def __init__(
        self, m: Model, name: str, streams: int, queue: int, chunk: int, page_rows: int, kv_dtype: str = "f16", prefix_cache_mb: float = 256, device_kv: bool = False
    ) -> None:
        self.m = m
        self.name = name
        # What a request that names none gets (set by whoever serves it; see serve/__main__.py):
        # sampling settings, and the most tokens one request may generate (0: the context only).
        self.sampling: SamplingDefaults = LLAMA_SERVER
        self.n_predict = DEFAULT_N_PREDICT
        # /v1/models' `created` (OpenAI: when the model was made): the file's modification time,
        # the same for every server and replica that serves that file.
        self.created = int(m.path.stat().st_mtime)
        self.max_streams = streams
        # The prefix cache keeps what finished streams leave behind: bounded, or a long-running
        # server's memory would grow with every new conversation until the pool is full.
        groups = max(1, int(prefix_cache_mb * 2**20 // sched.kv_page_bytes(m, page_rows, kv_dtype))) if page_rows else 0
        self.sch = sched.create_scheduler(
            m,
            max_streams=streams,
            max_queue=queue,
            chunk_tokens=chunk,
            page_rows=page_rows,
            prefix_groups=groups,
            kv_dtype=sched.KVDtype(kv_dtype),
            # What `speculative.configure` attached (--spec): with --spec off nothing is, and
            # a file's own MTP head does not draft either.
            mtp=drafter_kind(m) is not None,
        )
        if device_kv:
            # Every stream's K/V in a device region; a finished conversation's rows stay there
            # for its next turn.
            gpu.set_device_kv(self.sch, True)
        # Handlers append (op, ...) tuples; deque appends and pops are atomic, so no lock is held
        # across a step.
        self._inbox: collections.deque[tuple[Any, ...]] = collections.deque()
        self._wake = threading.Event()
        self._subs: dict[int, Subscription] = {}
        self._ids = itertools.count(1)
        self._stopping = False
        self.admitting = True
        self.dead: str | None = None
        self.snapshot = Snapshot(stats=sched.scheduler_stats(self.sch), at=time.monotonic())
        self._thread = threading.Thread(target=self._main, name=f"dasllama-engine-{name}", daemon=True)
        self._thread.start()

    def next_id(self) -> int:
        return next(self._ids)

    async def submit(self, req: sched.PendingReq, sub: Subscription) -> bool:
        """Queue a request; resolves once the engine has taken it (between two steps). False: the
        queue is full. Raises what `scheduler.submit` raises for a request that cannot run, and
        EngineDead when the engine thread is gone."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        if not self.admitting:
            return False
        fut: asyncio.Future[bool] = sub.loop.create_future()
        self._inbox.append(("submit", req, sub, fut))
        self._wake.set()
        return await fut

    def cancel(self, req_id: int) -> None:
        """Drop a request wherever it is (queued or running); returns at once."""
        self._inbox.append(("cancel", req_id))
        self._wake.set()

    def clear_prefix_cache(self) -> None:
        """Drop every cached page no stream holds (between two steps); returns at once."""
        self._inbox.append(("clear_prefix",))
        self._wake.set()

    def counts(self) -> tuple[int, int]:
        s = self.snapshot
        return s.active, s.queued

    def stats(self) -> dict[str, float]:
        return self.snapshot.stats

    @property
    def alive(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    # ---- the engine thread ---------------------------------------------------------------------

    def _drain(self) -> None:
        while self._inbox:
            op = self._inbox.popleft()
            if op[0] == "submit":
                _, req, sub, fut = op
                try:
                    ok = self.admitting and sched.submit(self.m, self.sch, req)
                except Exception as e:  # noqa: BLE001 - the request's fault (bad ids, too long): its handler says so
                    _resolve(sub.loop, fut, exc=e)
                    continue
                if ok:
                    self._subs[req.id] = sub
                _resolve(sub.loop, fut, ok)
            elif op[0] == "cancel":
                if self._subs.pop(op[1], None) is not None:
                    sched.evict(self.m, self.sch, op[1], [])
            elif op[0] == "clear_prefix":
                sched.clear_prefix_cache(self.sch)
            elif op[0] == "cancel_all":
                for rid in list(self._subs):
                    sched.evict(self.m, self.sch, rid, [])
                self._subs.clear()

    def _publish(self) -> None:
        self.snapshot = Snapshot(sched.n_active(self.sch), sched.n_queued(self.sch), sched.scheduler_stats(self.sch), time.monotonic())

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as e:
            self.dead = f"the engine thread of '{self.name}' died: {type(e).__name__}: {e}"
            log.exception("%s", self.dead)
            for sub in self._subs.values():
                sub.put(EngineFailure(self.dead))
            self._subs.clear()
            while self._inbox:
                op = self._inbox.popleft()
                if op[0] == "submit":
                    _resolve(op[2].loop, op[3], exc=EngineDead(self.dead))

    def _run(self) -> None:
        events: list[sched.SchedEvent] = []
        while True:
            self._drain()
            idle = sched.n_active(self.sch) == 0 and sched.n_queued(self.sch) == 0
            if idle:
                self._publish()
                if self._stopping:
                    return
                self._wake.wait()
                self._wake.clear()
                continue
            # Per-stream failures end those streams inside the step; an exception here is the
            # engine's own, and it ends the thread (clients get an error, /health turns 503).
            sched.scheduler_step(self.m, self.sch, events)
            for ev in events:
                sub = self._subs.get(ev.id)
                if sub is not None:
                    if ev.kind == "finished":
                        del self._subs[ev.id]
                    sub.put(ev)
            events.clear()
            self._publish()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting; let running requests finish (cancelling them after `timeout`)."""
        self.admitting = False
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._inbox.append(("cancel_all",))
            self._wake.set()
            self._thread.join(5)


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], value: Any = None, exc: BaseException | None = None) -> None:
    def done() -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)

    try:
        loop.call_soon_threadsafe(done)
    except RuntimeError:  # the loop is closed
        pass
