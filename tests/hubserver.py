"""A local HTTP server that answers as the Hugging Face hub does, for the routes `huggingface_hub`
uses to fetch a file: the model info (`GET /api/models/{repo}`, with the repository's files as
`siblings`) and the file itself (`HEAD`/`GET /{repo}/resolve/{revision}/{path}`, with the
`X-Repo-Commit`, `ETag` and `Content-Length` headers the client reads, and `X-Error-Code` on a
404). Point a client at it with HF_ENDPOINT."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    """Repositories (owner/repo -> {path in the repository: local file}) and the requests seen."""

    def __init__(self, repos: dict[str, dict[str, Path]]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        self._etags: dict[Path, str] = {}

    def etag(self, p: Path) -> str:
        if p not in self._etags:
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
            self._etags[p] = h.hexdigest()
        return self._etags[p]


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def _error(self, code: str, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            self.send_response(404)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _route(self) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path))
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
            if m:
                files = hub.repos.get(m.group(1))
                if files is None:
                    return self._error("RepoNotFound", f"Repository {m.group(1)} not found")
                body = json.dumps({"_id": "x", "id": m.group(1), "modelId": m.group(1), "sha": COMMIT, "private": False, "tags": ["gguf"], "siblings": [{"rfilename": f} for f in files]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)
                return None
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
            if not m:
                return self._error("EntryNotFound", f"no route {path}")
            files = hub.repos.get(m.group(1))
            if files is None:
                return self._error("RepoNotFound", f"Repository {m.group(1)} not found")
            local = files.get(m.group(2))
            if local is None:
                return self._error("EntryNotFound", f"{m.group(2)} does not exist in {m.group(1)}")
            size = local.stat().st_size
            start, end = 0, size - 1
            rng = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            if rng and self.command == "GET":
                start = int(rng.group(1))
                end = int(rng.group(2)) if rng.group(2) else size - 1
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            else:
                self.send_response(200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hub.etag(local)}"')
            self.send_header("Content-Length", str(end - start + 1))
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            if self.command == "GET":
                with open(local, "rb") as f:
                    f.seek(start)
                    left = end - start + 1
                    while left > 0 and (chunk := f.read(min(left, 1 << 20))):
                        self.wfile.write(chunk)
                        left -= len(chunk)
            return None

        def do_GET(self) -> None:
            self._route()

        def do_HEAD(self) -> None:
            self._route()

    return Handler


@contextmanager
def serve(repos: dict[str, dict[str, Path]]) -> Iterator[tuple[str, Hub]]:
    """Serve `repos` on a free loopback port; (endpoint URL, the hub) while in the block."""
    hub = Hub(repos)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", hub
    finally:
        httpd.shutdown()
        httpd.server_close()
