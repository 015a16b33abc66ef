"""One engine thread per model: it owns the scheduler, runs `scheduler_step` (GIL released in the
core) and hands events to the asyncio side, which only moves them."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

from .. import scheduler as sched
from ..model import Model

log = logging.getLogger("dasllama.serve")


@dataclass
class Subscription:
    """Where one request's events go: an asyncio queue, fed from the engine thread."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class Engine:
    def __init__(self, m: Model, name: str, streams: int, queue: int, chunk: int, page_rows: int, kv_dtype: str = "f16") -> None:
        self.m = m
        self.name = name
        self.sch = sched.create_scheduler(m, max_streams=streams, max_queue=queue, chunk_tokens=chunk, page_rows=page_rows, kv_dtype=sched.KVDtype(kv_dtype))
        self._lock = threading.Lock()  # guards the scheduler: the engine thread steps, handlers submit/evict
        self._wake = threading.Condition(self._lock)
        self._subs: dict[int, Subscription] = {}
        self._ids = itertools.count(1)
        self._stopping = False
        self.admitting = True
        self.last_step = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"dasllama-engine-{name}", daemon=True)
        self._thread.start()

    def next_id(self) -> int:
        return next(self._ids)

    def submit(self, req: sched.PendingReq, sub: Subscription) -> bool:
        """Queue a request (called from a worker thread, never the event loop). False: queue full."""
        with self._lock:
            if not self.admitting:
                return False
            ok = sched.submit(self.m, self.sch, req)
            if ok:
                self._subs[req.id] = sub
                self._wake.notify()
            return ok

    def evict(self, req_id: int) -> None:
        with self._lock:
            if req_id in self._subs:
                events: list[sched.SchedEvent] = []
                sched.evict(self.m, self.sch, req_id, events)
                self._subs.pop(req_id, None)

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return sched.n_active(self.sch), sched.n_queued(self.sch)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return sched.scheduler_stats(self.sch)

    def _run(self) -> None:
        events: list[sched.SchedEvent] = []
        while True:
            with self._lock:
                while not self._stopping and sched.n_active(self.sch) == 0 and sched.n_queued(self.sch) == 0:
                    self._wake.wait()
                if self._stopping and sched.n_active(self.sch) == 0 and sched.n_queued(self.sch) == 0:
                    return
                try:
                    sched.scheduler_step(self.m, self.sch, events)
                except Exception:  # a bug, not a request's fault: report it and fail what runs
                    log.exception("scheduler step failed")
                    for rid in list(self._subs):
                        sched.evict(self.m, self.sch, rid, events)
                self.last_step = time.monotonic()
                deliveries = []
                for ev in events:
                    sub = self._subs.get(ev.id)
                    if sub is not None:
                        deliveries.append((sub, ev))
                        if ev.kind == "finished":
                            del self._subs[ev.id]
                events.clear()
            for sub, ev in deliveries:
                sub.loop.call_soon_threadsafe(sub.queue.put_nowait, ev)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting; let running requests finish (evicting them after `timeout`)."""
        with self._lock:
            self.admitting = False
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._lock:
                for rid in list(self._subs):
                    sched.evict(self.m, self.sch, rid, [])
                self._subs.clear()
            self._thread.join(5)
