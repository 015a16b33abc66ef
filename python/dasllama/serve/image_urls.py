"""Remote images for ``image_url`` parts (``--allow-image-urls``): an http(s) URL fetched with a
limit on its size and on the whole fetch's time, as llama-server fetches them (10 MiB, 10 s by
default). Off by default: while on, anyone who may call this server may make it fetch any URL
it can reach, so it is for a trusted network.

Runs in the worker thread that prepares a request (``Server.job``), never on the event loop."""

from __future__ import annotations

import http.client
import ssl
import time
import urllib.parse

CHUNK = 64 * 1024
MAX_REDIRECTS = 5


class ImageURLError(ValueError):
    """The URL could not be fetched within the limits; the message says why."""


def fetch_image(url: str, max_bytes: int, timeout_s: float) -> bytes:
    """The body of ``url`` (http or https; up to 5 redirects followed), refused past
    ``max_bytes`` or when the whole fetch takes more than ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    too_slow = f"the image at {url} did not arrive within {timeout_s:g} s (--image-url-timeout)"
    where = url
    for _ in range(MAX_REDIRECTS + 1):
        u = urllib.parse.urlsplit(where)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ImageURLError(f"an image URL must be http(s)://host/..., got {where!r}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise ImageURLError(too_slow)
        conn: http.client.HTTPConnection
        if u.scheme == "https":
            conn = http.client.HTTPSConnection(u.hostname, u.port, timeout=left, context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=left)
        try:
            conn.request("GET", (u.path or "/") + (f"?{u.query}" if u.query else ""), headers={"User-Agent": "dasllama", "Accept": "image/*"})
            if conn.sock is not None:
                conn.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            resp = conn.getresponse()
            if resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location"):
                where = urllib.parse.urljoin(where, resp.getheader("Location", ""))
                continue
            if not 200 <= resp.status < 300:
                raise ImageURLError(f"fetching the image at {url} failed: HTTP {resp.status} {resp.reason}")
            declared = resp.getheader("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise ImageURLError(f"the image at {url} is {int(declared)} bytes, more than the {max_bytes} this server fetches (--image-url-max-bytes)")
            body = bytearray()
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ImageURLError(too_slow)
                # Each receive waits at most what is left of the whole fetch, and read1 returns
                # what one receive brought: a server that trickles its bytes cannot stretch the
                # fetch past the limit.
                if conn.sock is not None:
                    conn.sock.settimeout(left)
                chunk = resp.read1(CHUNK)
                if not chunk:
                    return bytes(body)
                body += chunk
                if len(body) > max_bytes:
                    raise ImageURLError(f"the image at {url} is more than the {max_bytes} bytes this server fetches (--image-url-max-bytes)")
        except TimeoutError:
            raise ImageURLError(too_slow) from None
        except (OSError, http.client.HTTPException) as e:
            raise ImageURLError(f"fetching the image at {url} failed: {e or type(e).__name__}") from None
        finally:
            conn.close()
    raise ImageURLError(f"fetching the image at {url} failed: more than {MAX_REDIRECTS} redirects")
