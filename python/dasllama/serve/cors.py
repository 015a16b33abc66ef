"""CORS as llama-server answers it (dasllama-server): every preflight gets a 200; an allowed
origin is echoed back with credentials allowed, any other gets no CORS headers (so its browser
refuses the answer). `*` allows every origin; `localhost` allows any loopback origin
(http(s)://localhost, 127.0.0.1 or [::1], any port)."""

from __future__ import annotations

import re

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

METHODS = "GET, POST, DELETE, OPTIONS"
_LOOPBACK = re.compile(r"^(https?://)?(localhost|127\.0\.0\.1|\[::1\])(:\d+)?$")


def origin_allowed(origin: str, allowed: list[str]) -> bool:
    for a in allowed:
        if a in ("*", origin):
            return True
        if a == "localhost" and _LOOPBACK.match(origin):
            return True
    return False


class LlamaCors:
    def __init__(self, app: ASGIApp, allowed: list[str]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        ok = origin is not None and origin_allowed(origin, self.allowed)
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            out: list[tuple[bytes, bytes]] = [(b"Content-Length", b"0")]
            if ok and origin is not None:
                out += [
                    (b"Access-Control-Allow-Origin", origin.encode("latin-1")),
                    (b"Access-Control-Allow-Credentials", b"true"),
                    (b"Access-Control-Allow-Methods", METHODS.encode()),
                    (b"Access-Control-Allow-Headers", b"*"),
                    (b"Vary", b"Origin"),
                ]
            await send({"type": "http.response.start", "status": 200, "headers": out})
            await send({"type": "http.response.body", "body": b""})
            return
        if not ok or origin is None:
            await self.app(scope, receive, send)
            return
        extra = [(b"Access-Control-Allow-Origin", origin.encode("latin-1")), (b"Access-Control-Allow-Credentials", b"true"), (b"Vary", b"Origin")]

        async def send_with(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with)



class TitleCaseHeaders:
    """Response header names in Title-Case, as llama-server writes them (Starlette writes them in
    lowercase; HTTP does not care, but clients that read headers into a plain dict do). Needs an
    HTTP layer that keeps the case it is given (uvicorn's h11, not httptools)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_titled(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [(_title(k), v) for k, v in message.get("headers", [])]}
            await send(message)

        await self.app(scope, receive, send_titled)


def _title(name: bytes) -> bytes:
    return b"-".join(p[:1].upper() + p[1:].lower() for p in name.split(b"-"))
