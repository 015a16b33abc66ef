"""A real `python -m dasllama.serve` process on a free loopback port, for the black-box tests."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*args: str) -> tuple[subprocess.Popen, str]:
    """Start a server with `args` and wait until /health answers 200; (process, base URL)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dasllama.serve", "--port", str(port), "--log-level", "warning", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read().decode()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become healthy")


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
