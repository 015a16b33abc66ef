"""A real `python -m dasllama.serve` process on a free loopback port, for the black-box tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*args: str, module: str = "dasllama.serve", env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start a server with `args` and wait until /health answers 200; (process, base URL).
    `module` "dasllama.serve.llama_server" starts dasllama-server (llama-server's flags); `env`
    adds environment variables."""
    port = free_port()
    quiet = ["--log-level", "warning"] if module == "dasllama.serve" else []
    # The log goes to a file, readable while the server runs (a pipe nobody reads would also stall
    # a chatty server once its buffer fills).
    with tempfile.NamedTemporaryFile(prefix="dasllama-serve-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *quiet, *args], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env} if env else None)
    proc.log_path = Path(log.name)  # type: ignore[attr-defined]
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log_text(proc)[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become healthy")


def log_text(proc: subprocess.Popen) -> str:
    """What the server has logged so far."""
    return proc.log_path.read_text(errors="replace")  # type: ignore[attr-defined]


def stop(proc: subprocess.Popen, timeout: float = 60) -> int | None:
    """SIGINT (stop admitting, finish, exit 0); killed if it has not exited within `timeout`."""
    proc.send_signal(2)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.log_path.unlink(missing_ok=True)  # type: ignore[attr-defined]
