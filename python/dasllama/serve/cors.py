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
            out: list[tuple[bytes, bytes]] = [(b"content-length", b"0")]
            if ok and origin is not None:
                out += [
                    (b"access-control-allow-origin", origin.encode("latin-1")),
                    (b"access-control-allow-credentials", b"true"),
                    (b"access-control-allow-methods", METHODS.encode()),
                    (b"access-control-allow-headers", b"*"),
                    (b"vary", b"Origin"),
                ]
            await send({"type": "http.response.start", "status": 200, "headers": out})
            await send({"type": "http.response.body", "body": b""})
            return
        if not ok or origin is None:
            await self.app(scope, receive, send)
            return
        extra = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"access-control-allow-credentials", b"true"), (b"vary", b"Origin")]

        async def send_with(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with)

