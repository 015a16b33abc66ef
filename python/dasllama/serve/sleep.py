"""Sleep mode (llama-server's --sleep-idle-seconds): after that many seconds with no request, the
server unloads its models (their weights, KV pools and prefix caches) and the next request that
needs a model loads them again before it is served.

Asleep, the read-only routes (`/health`, `/props`, `/models`, `/v1/models`, `/metrics`, `/slots`)
answer without waking it: `/props` says `is_sleeping: true`, and the others give what they said
just before the server fell asleep (llama-server serves its metrics from that snapshot too).
Polling them does not keep the server awake. A reloaded model runs on the CPU, without a draft model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .app import Server
from .router import Handler, Loader, held_while_answering

log = logging.getLogger("dasllama.serve")

READ_ONLY = ("/props", "/models", "/v1/models", "/metrics", "/slots")


class Sleeper:
    def __init__(self, server: Server, loader: Loader, idle_seconds: float) -> None:
        self.server = server
        self.loader = loader
        self.idle_seconds = idle_seconds
        self.sleeping = False
        self.in_flight = 0
        self.last_active = time.monotonic()
        self.snapshots: dict[str, Response] = {}
        self.asleep: list[tuple[str, str, list[str]]] = []  # (file, served name, other names) per model
        self.routes: list[Any] = []
        self._transition: asyncio.Future[None] | None = None

    # ---- the gate ----------------------------------------------------------------------------

    async def gate(self, request: Request, handler: Handler) -> Response:
        if request.method == "GET" and request.url.path in READ_ONLY:
            if self.sleeping and request.url.path in self.snapshots:
                snap = self.snapshots[request.url.path]
                return Response(snap.body, status_code=snap.status_code, media_type=snap.media_type)
            return await handler(request)  # read-only: does not count as activity
        self.in_flight += 1
        try:
            await self.wake()
        except BaseException:
            await self._done()
            raise
        return await held_while_answering(request, handler, self._done)

    async def _done(self) -> None:
        self.in_flight -= 1
        self.last_active = time.monotonic()

    # ---- falling asleep and waking ------------------------------------------------------------

    def idle(self) -> bool:
        if self.sleeping or self.in_flight or not self.server.ready or not self.server.engines:
            return False
        if any(sum(eng.counts()) for eng in self.server.engines.values()):
            self.last_active = time.monotonic()
            return False
        return time.monotonic() - self.last_active >= self.idle_seconds

    async def watch(self) -> None:
        """Runs for the server's lifetime (started by the app's lifespan)."""
        while True:
            await asyncio.sleep(min(0.25, self.idle_seconds / 4))
            if self.idle() and self._transition is None:
                await self._run(self.sleep())

    async def _run(self, what: Any) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._transition = fut
        try:
            await what
        finally:
            self._transition = None
            fut.set_result(None)

    async def sleep(self) -> None:
        self.snapshots = {p: r for p in READ_ONLY if (r := await self._render(p)) is not None}
        props = self.snapshots.get("/props")
        if props is not None and props.status_code == 200:
            body = json.loads(bytes(props.body))
            body["is_sleeping"] = True
            self.snapshots["/props"] = Response(json.dumps(body).encode(), media_type="application/json")
        srv = self.server
        self.asleep = [(str(eng.m.path), name, [n for n, s in srv.names.items() if s == name and n != name]) for name, eng in srv.engines.items()]
        self.sleeping = True
        engines = list(srv.engines.values())
        srv.engines.clear()
        srv.names.clear()
        srv.default = None
        loop = asyncio.get_running_loop()
        for eng in engines:
            await loop.run_in_executor(None, eng.shutdown)
        log.info("sleeping after %gs idle: %s unloaded (--sleep-idle-seconds)", self.idle_seconds, ", ".join(n for _, n, _ in self.asleep))

    async def wake(self) -> None:
        while self._transition is not None:
            await asyncio.shield(self._transition)
        if not self.sleeping:
            return
        await self._run(self._load())

    async def _load(self) -> None:
        loop = asyncio.get_running_loop()
        for path, name, names in self.asleep:
            eng = await loop.run_in_executor(None, self.loader, path, name)
            self.server.add(eng, *names)
        self.sleeping = False
        self.last_active = time.monotonic()
        log.info("awake: %s loaded again", ", ".join(n for _, n, _ in self.asleep))

    async def _render(self, path: str) -> Response | None:
        """What a read-only route answers now, asked in-process."""
        route = next((r for r in self.routes if isinstance(r, Route) and r.path == path), None)
        if route is None:
            return None
        headers = [(b"authorization", f"Bearer {self.server.api_key}".encode())] if self.server.api_key else []
        scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b"", "headers": headers, "path_params": {}}

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        endpoint: Callable[[Request], Any] = route.endpoint
        resp = await endpoint(Request(scope, receive))
        return resp if isinstance(resp, Response) and hasattr(resp, "body") else None
