"""Remote image URLs behind --allow-image-urls (a size and a time limit, a 400 naming the problem
otherwise), and the vision tower's encode time in /metrics and in a reply's ``timings``. The
images are served by a local HTTP server in this process (no internet)."""

from __future__ import annotations

import base64
import http.server
import io
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import httpx
import numpy as np
import pytest
from PIL import Image

from dasllama.serve.image_urls import ImageURLError, fetch_image
from serverproc import start, stop
from synthetic import write_model
from synthetic_vision import write_gemma3_mmproj

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _png(seed: int) -> bytes:
    b = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(40, 48, 3), dtype=np.uint8)).save(b, format="PNG")
    return b.getvalue()


PNG = _png(3)


class _Pictures(http.server.BaseHTTPRequestHandler):
    """/cat.png; /big (more bytes than the limits below, with and without a Content-Length);
    /slow (the picture a byte at a time, slower than the time limit); /redirect; anything else 404.
    Every path asked is recorded in ``hits``."""

    hits: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.hits.append(self.path)
        if self.path == "/cat.png":
            self._send(PNG)
        elif self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/big-declared":
            self._send(b"\0" * 300_000)
        elif self.path == "/big-chunked":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()  # no Content-Length: the body ends with the connection
            try:
                for _ in range(40):
                    self.wfile.write(b"\0" * 10_000)
            except OSError:
                pass  # the client stopped reading at its limit
            self.close_connection = True
        elif self.path == "/slow":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            try:
                for b in PNG[:40]:
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
                    time.sleep(0.1)  # each byte well within a read's timeout, the whole far past it
            except OSError:
                pass
        else:
            self.send_error(404)

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def pictures() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pictures)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_fetch_image_within_its_limits(pictures: str) -> None:
    assert fetch_image(pictures + "/cat.png", 200_000, 5) == PNG
    assert fetch_image(pictures + "/redirect", 200_000, 5) == PNG
    with pytest.raises(ImageURLError, match=r"300000 bytes, more than the 200000"):
        fetch_image(pictures + "/big-declared", 200_000, 5)
    with pytest.raises(ImageURLError, match=r"more than the 200000 bytes"):
        fetch_image(pictures + "/big-chunked", 200_000, 5)
    with pytest.raises(ImageURLError, match=r"HTTP 404"):
        fetch_image(pictures + "/missing.png", 200_000, 5)
    t0 = time.monotonic()
    with pytest.raises(ImageURLError, match=r"did not arrive within 1 s"):
        fetch_image(pictures + "/slow", 200_000, 1.0)
    # The whole fetch is bounded, not each read: 40 bytes at 0.1 s would take 4 s.
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(ImageURLError, match=r"http\(s\)"):
        fetch_image("ftp://127.0.0.1/cat.png", 200_000, 5)


def _model(d: Path) -> Path:
    text = d / "gemma3-vis.gguf"
    write_model(text, arch="gemma3", specials=("<start_of_image>", "<end_of_image>"), template=TEMPLATE, ctx=128)
    write_gemma3_mmproj(d / "mmproj-gemma3-vis.gguf")
    return text


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(a server that fetches image URLs, within 200 kB and 1 s; one that does not)."""
    text = _model(tmp_path_factory.mktemp("vision-urls"))
    on, base_on = start("--model", str(text), "--alias", "vis", "--page-rows", "8", "--allow-image-urls", "--image-url-max-bytes", "200000", "--image-url-timeout", "1")
    off, base_off = start("--model", str(text), "--alias", "vis", "--page-rows", "8")
    yield base_on, base_off
    assert stop(on) == 0
    assert stop(off) == 0


def _chat(base: str, url: str) -> httpx.Response:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "the cat "}, {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": " at"}]}]
    return httpx.post(base + "/v1/chat/completions", json={"model": "vis", "messages": msgs, "max_tokens": 4, "temperature": 0}, timeout=120)


def _metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=30).text
    m = re.search(rf'^{re.escape(name)}{{model="vis"}} ([0-9.e+-]+)$', text, re.M)
    assert m is not None, f"{name} not in /metrics:\n{text}"
    return float(m[1])


def test_image_urls_served_only_when_allowed(servers: tuple[str, str], pictures: str) -> None:
    on, off = servers
    data_url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    want = _chat(on, data_url)
    assert want.status_code == 200, want.text
    got = _chat(on, pictures + "/cat.png")
    assert got.status_code == 200, got.text
    # The fetched picture is the same picture: the same reply, and its rows from the cache.
    assert got.json()["choices"][0]["message"]["content"] == want.json()["choices"][0]["message"]["content"]
    assert got.json()["usage"]["prompt_tokens"] == want.json()["usage"]["prompt_tokens"]
    assert got.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 16
    for path, words in (("/big-declared", "more than the 200000"), ("/big-chunked", "more than the 200000"), ("/slow", "did not arrive within 1 s"), ("/missing.png", "HTTP 404")):
        r = _chat(on, pictures + path)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_image_url" and err["param"] == "messages[0].content[1]" and words in err["message"], err
    # Anthropic's URL image source takes the same path.
    blocks = [{"type": "text", "text": "the cat "}, {"type": "image", "source": {"type": "url", "url": pictures + "/cat.png"}}, {"type": "text", "text": " at"}]
    a = httpx.post(on + "/v1/messages", json={"model": "vis", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": blocks}]}, timeout=120)
    assert a.status_code == 200 and a.json()["content"][0]["text"] == want.json()["choices"][0]["message"]["content"], a.text
    # Without the flag: refused, and nothing fetched.
    before = list(_Pictures.hits)
    r = _chat(off, pictures + "/cat.png")
    assert r.status_code == 400 and "--allow-image-urls" in r.json()["error"]["message"], r.text
    assert _Pictures.hits == before


def test_encode_time_in_timings_and_metrics(servers: tuple[str, str]) -> None:
    on, _ = servers
    n0 = _metric(on, "dasllama_images_total")
    c0 = _metric(on, "dasllama_image_encode_seconds_count")
    s0 = _metric(on, "dasllama_image_encode_seconds_sum")
    r = _chat(on, "data:image/png;base64," + base64.b64encode(_png(11)).decode())
    assert r.status_code == 200, r.text
    t = r.json()["timings"]
    # The encode is part of the prompt's time, as in llama-server, and said apart.
    assert 0 < t["image_encode_ms"] <= t["prompt_ms"], t
    assert _metric(on, "dasllama_images_total") == n0 + 1
    assert _metric(on, "dasllama_image_encode_seconds_count") == c0 + 1
    assert _metric(on, "dasllama_image_encode_seconds_sum") - s0 == pytest.approx(t["image_encode_ms"] / 1000, rel=1e-3, abs=1e-6)
    # A text-only request's timings are llama-server's, with no encode figure.
    r = httpx.post(on + "/v1/chat/completions", json={"model": "vis", "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and "image_encode_ms" not in r.json()["timings"], r.text
    # Streamed: the final chunk's timings carry it too.
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(_png(12)).decode()}}]}]
    with httpx.stream("POST", on + "/v1/chat/completions", json={"model": "vis", "messages": msgs, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}, timeout=60) as s:
        last = [line for line in s.iter_lines() if line.startswith("data: {")][-1]
    assert '"image_encode_ms"' in last
    assert _metric(on, "dasllama_images_total") == n0 + 2
