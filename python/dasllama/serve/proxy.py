"""llama-server's CORS proxy, `GET/POST /cors-proxy?url=...`, which lets a browser page (its web
UI, calling MCP servers over HTTP) reach a server that sends no CORS headers. Off unless the
operator passes `--ui-mcp-proxy` (403 otherwise): while on, anyone who may call this server may
make it fetch any http(s) URL, so it is for a trusted machine only.

Only the headers the page names explicitly travel: `x-llama-server-proxy-header-<name>: value`
goes out as `<name>: value`; the caller's own credentials (Authorization, cookies, X-Api-Key)
never do. The answer comes back as the target gave it (status, content type, body streamed),
less the hop-by-hop and CORS headers this server sets itself. Redirects are followed (5 at most),
as llama-server's client does."""

from __future__ import annotations

import contextlib
import http.client
import logging
import ssl
import urllib.parse
from collections.abc import Iterator

from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger("dasllama.serve")

HEADER_PREFIX = "x-llama-server-proxy-header-"
TIMEOUT_S = 600  # llama-server's: a proxied MCP call may stream for a long while
MAX_REDIRECTS = 5
# Never sent on: the body is re-framed here, the host is the target's.
SKIP_OUT = {"accept-encoding", "transfer-encoding", "content-length", "host", "connection"}
# Never passed back: framing is this server's, and so are its CORS answers.
SKIP_BACK = {"server", "transfer-encoding", "content-length", "keep-alive", "connection", "date"}


class ProxyError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def target(url: str | None) -> urllib.parse.SplitResult:
    """The URL to fetch, checked: http or https, a host, no credentials in it."""
    if not url:
        raise ProxyError(400, "missing 'url' query parameter: /cors-proxy?url=http://host/path")
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https"):
        raise ProxyError(400, f"unsupported URL scheme in target URL: {u.scheme or '(none)'}")
    if not u.hostname:
        raise ProxyError(400, "invalid target URL: missing host")
    if u.password is not None or u.username is not None:
        raise ProxyError(400, "authentication in target URL is not supported")
    return u


def outgoing_headers(headers: list[tuple[str, str]]) -> dict[str, str]:
    """Only what the caller named with the x-llama-server-proxy-header- prefix."""
    out = {}
    for k, v in headers:
        low = k.lower()
        if low.startswith(HEADER_PREFIX) and (name := k[len(HEADER_PREFIX) :]) and name.lower() not in SKIP_OUT:
            out[name] = v
    return out


def _open(method: str, u: urllib.parse.SplitResult, headers: dict[str, str], body: bytes | None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    for _ in range(MAX_REDIRECTS + 1):
        conn: http.client.HTTPConnection
        if u.scheme == "https":
            conn = http.client.HTTPSConnection(u.hostname or "", u.port, timeout=TIMEOUT_S, context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(u.hostname or "", u.port, timeout=TIMEOUT_S)
        path = urllib.parse.urlunsplit(("", "", u.path or "/", u.query, ""))
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        loc = resp.getheader("location")
        if resp.status in (301, 302, 303, 307, 308) and loc:
            resp.close()
            conn.close()
            u = target(urllib.parse.urljoin(urllib.parse.urlunsplit(u), loc))
            if resp.status == 303 or (resp.status in (301, 302) and method == "POST"):
                method, body = "GET", None
            continue
        return conn, resp
    raise ProxyError(502, f"proxy error: more than {MAX_REDIRECTS} redirects")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": status, "message": message, "type": "server_error" if status >= 500 else "invalid_request_error"}}, status_code=status)


async def cors_proxy(request: Request) -> Response:
    try:
        u = target(request.query_params.get("url"))
    except ProxyError as e:
        return _error(e.status, str(e))
    body = await request.body() if request.method == "POST" else None
    headers = outgoing_headers(request.headers.items())
    log.info("proxying %s to %s://%s%s", request.method, u.scheme, u.netloc, u.path or "/")
    try:
        conn, resp = await run_in_threadpool(_open, request.method, u, headers, body)
    except ProxyError as e:
        return _error(e.status, str(e))
    except (OSError, http.client.HTTPException) as e:
        return _error(502, f"proxy error: {e}")
    back = {k: v for k, v in resp.getheaders() if k.lower() not in SKIP_BACK and not k.lower().startswith("access-control-")}
    if resp.status in (204, 304) or request.method == "HEAD":
        resp.close()
        conn.close()
        return Response(status_code=resp.status, headers=back)

    def chunks() -> Iterator[bytes]:
        try:
            while chunk := resp.read1(65536):
                yield chunk
        except (OSError, http.client.HTTPException) as e:
            log.warning("proxy: the target's answer broke off: %s", e)
        finally:
            with contextlib.suppress(OSError):
                resp.close()
                conn.close()

    return StreamingResponse(iterate_in_threadpool(chunks()), status_code=resp.status, headers=back)
