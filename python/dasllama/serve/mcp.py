"""MCP servers behind `/tools`, as llama-server runs them (`--mcp-servers-config FILE`,
`--mcp-servers-json JSON`, Cursor's `{"mcpServers": {name: {command, args, env, cwd,
timeout_ms}}}`): each server is a child process speaking JSON-RPC 2.0 as newline-delimited JSON
over its stdin and stdout (MCP's stdio transport, protocol 2024-11-05).

At start each server is spawned once to list its tools, then stopped; `/tools` lists them as
`<server>_<tool>`. A call spawns the server again (and keeps it), one call at a time per server;
one that died is respawned on the next call, one that cannot start is left alone for 5 s. A call
waits at most the server's `timeout_ms` (30 s by default), and a server stopping cancels every
call in flight, so shutdown never waits for a slow tool.

The configured commands run with the server's rights: like `--tools`, this is for a trusted
operator's machine."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("dasllama.serve")

PROTOCOL_VERSION = "2024-11-05"
COOLDOWN_S = 5.0  # after a server fails to start
WARMUP_TIMEOUT_S = 10.0  # per server, to list its tools at start
POLL_S = 0.05  # how often a waiting call looks at its deadline and the stop flag
MAX_LINE = 8 * 1024 * 1024  # a longer line from a server is dropped
STDERR_TAIL = 4096


class McpConfigError(ValueError):
    """The MCP configuration cannot be read: the server refuses to start."""


@dataclass
class McpServerConfig:
    name: str
    command: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # over the server's own environment
    cwd: str = ""
    timeout_ms: int = 30000  # per call


@dataclass
class McpToolDef:
    server: str
    name: str  # as the server names it, no "<server>_" prefix
    description: str
    input_schema: Any


def parse_config(text: str, where: str) -> list[McpServerConfig]:
    """Cursor's format: {"mcpServers": {name: {...}}}. No "mcpServers" is no servers; an entry
    without a command is skipped (with a warning); anything malformed is an McpConfigError."""
    try:
        j = json.loads(text)
    except ValueError as e:
        raise McpConfigError(f"{where} is not valid JSON: {e}") from None
    servers = j.get("mcpServers") if isinstance(j, dict) else None
    if not isinstance(servers, dict):
        log.warning("%s has no \"mcpServers\" object: no MCP servers", where)
        return []
    out = []
    for name, cfg in servers.items():
        if not isinstance(cfg, dict):
            raise McpConfigError(f"{where}: mcpServers.{name} must be an object")
        command = cfg.get("command") or ""
        args, env, cwd, timeout = cfg.get("args", []), cfg.get("env", {}), cfg.get("cwd", ""), cfg.get("timeout_ms", 30000)
        if not isinstance(command, str) or not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise McpConfigError(f"{where}: mcpServers.{name}: 'command' must be a string and 'args' a list of strings")
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()) or not isinstance(cwd, str):
            raise McpConfigError(f"{where}: mcpServers.{name}: 'env' must map names to strings and 'cwd' be a string")
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0:
            raise McpConfigError(f"{where}: mcpServers.{name}: 'timeout_ms' must be a positive integer")
        if not command:
            log.warning("MCP server %r has no command; skipping it", name)
            continue
        out.append(McpServerConfig(name, command, list(args), dict(env), cwd, timeout))
    return out


def load_configs(config_path: str | None, config_json: str | None) -> list[McpServerConfig]:
    """--mcp-servers-config FILE and --mcp-servers-json JSON together; a name given twice keeps
    its first definition."""
    found: list[McpServerConfig] = []
    sources = []
    if config_path:
        try:
            sources.append((Path(config_path).read_text(encoding="utf-8"), f"--mcp-servers-config {config_path}"))
        except OSError as e:
            raise McpConfigError(f"cannot read the MCP config file {config_path}: {e.strerror or e}") from None
    if config_json:
        sources.append((config_json, "--mcp-servers-json"))
    for text, where in sources:
        for cfg in parse_config(text, where):
            if any(c.name == cfg.name for c in found):
                log.warning("MCP server %r is defined twice; keeping the first", cfg.name)
                continue
            found.append(cfg)
    return found


class StdioTransport:
    """One running MCP server: a child process in its own session (so stopping it stops whatever
    it started), a reader thread splitting its stdout into messages, one draining its stderr."""

    def __init__(self, cfg: McpServerConfig) -> None:
        self.cfg = cfg
        self.proc: subprocess.Popen[bytes] | None = None
        self.inbox: queue.Queue[str | None] = queue.Queue()
        self.lock = threading.Lock()  # one request/reply exchange at a time
        self.next_id = 1
        self.initialized = False
        self.tools: list[McpToolDef] = []
        self.last_error = ""
        self.err_tail = ""
        # Set when its stdout ends: it can answer nothing more, whether or not the process has
        # been reaped yet (poll() may still say running for a moment after a crash).
        self.closed = threading.Event()

    def start(self) -> bool:
        env = {**os.environ, **self.cfg.env}
        try:
            self.proc = subprocess.Popen(
                [self.cfg.command, *self.cfg.args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=self.cfg.cwd or None, start_new_session=True
            )
        except OSError as e:
            self.last_error = f"cannot run {self.cfg.command!r}: {e.strerror or e}"
            return False
        threading.Thread(target=self._read, name=f"mcp-{self.cfg.name}-out", daemon=True).start()
        threading.Thread(target=self._drain_stderr, name=f"mcp-{self.cfg.name}-err", daemon=True).start()
        return True

    def alive(self) -> bool:
        return self.proc is not None and not self.closed.is_set() and self.proc.poll() is None

    def diagnostics(self) -> str:
        tail = self.err_tail.strip()
        return "; ".join(x for x in (self.last_error, f"stderr: {tail[-500:]}" if tail else "") if x) or "no diagnostics"

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        out = self.proc.stdout
        try:
            while True:
                line = out.readline(MAX_LINE + 1)
                if not line:
                    break
                if len(line) > MAX_LINE and not line.endswith(b"\n"):
                    log.warning("MCP %r: dropping a line over %d bytes", self.cfg.name, MAX_LINE)
                    while line and not line.endswith(b"\n"):
                        line = out.readline(MAX_LINE + 1)
                    continue
                text = line.decode("utf-8", errors="replace").strip()
                if text:
                    self.inbox.put(text)
        except (OSError, ValueError):
            pass
        self.closed.set()
        self.inbox.put(None)  # EOF: wakes a waiting call

    def _drain_stderr(self) -> None:
        # an undrained stderr pipe would block the server once it fills
        assert self.proc is not None and self.proc.stderr is not None
        with contextlib.suppress(OSError, ValueError):
            for line in self.proc.stderr:
                text = line.decode("utf-8", errors="replace").rstrip()
                log.debug("MCP %r stderr: %s", self.cfg.name, text)
                self.err_tail = (self.err_tail + text + "\n")[-STDERR_TAIL:]

    def _send(self, msg: dict[str, Any]) -> bool:
        if self.proc is None or self.proc.stdin is None:
            return False
        try:
            self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):
            return False
        return True

    def rpc(self, method: str, params: dict[str, Any] | None, should_stop: Callable[[], bool]) -> dict[str, Any]:
        """One request and its reply (the caller holds `lock`), or {"error": {...}}: timed out,
        cancelled, or the transport closed. Notifications and stale replies are skipped."""
        rid = self.next_id
        self.next_id += 1
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            msg["params"] = params
        if not self._send(msg):
            return {"error": {"code": -32603, "message": "transport closed"}}
        deadline = time.monotonic() + self.cfg.timeout_ms / 1000
        while True:
            if should_stop():
                return {"error": {"code": -32603, "message": "cancelled"}}
            left = deadline - time.monotonic()
            if left <= 0:
                return {"error": {"code": -32603, "message": "request timed out"}}
            try:
                frame = self.inbox.get(timeout=min(POLL_S, left))
            except queue.Empty:
                continue
            if frame is None:
                self.inbox.put(None)  # stays closed for whoever asks next
                return {"error": {"code": -32603, "message": "transport closed"}}
            try:
                reply = json.loads(frame)
            except ValueError:
                continue  # a malformed line
            # no id: a notification; another id: the late reply to a call that timed out
            if isinstance(reply, dict) and reply.get("id") == rid:
                return reply

    def ensure_init(self, should_stop: Callable[[], bool]) -> bool:
        if self.initialized:
            return True
        resp = self.rpc("initialize", {"protocolVersion": PROTOCOL_VERSION, "capabilities": {}, "clientInfo": {"name": "dasllama", "version": "1.0"}}, should_stop)
        if "result" not in resp:
            self.last_error = f"initialize failed: {_rpc_error(resp)}"
            return False
        self._send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        self.initialized = True
        return True

    def list_tools(self, should_stop: Callable[[], bool]) -> list[McpToolDef]:
        with self.lock:
            if not self.ensure_init(should_stop):
                return []
            if self.tools:
                return self.tools
            resp = self.rpc("tools/list", None, should_stop)
            result = resp.get("result")
            if not isinstance(result, dict):
                self.last_error = f"tools/list failed: {_rpc_error(resp)}"
                return []
            for t in result.get("tools") or []:
                if isinstance(t, dict) and isinstance(t.get("name"), str):
                    self.tools.append(McpToolDef(self.cfg.name, t["name"], str(t.get("description", "")), t.get("inputSchema")))
            return self.tools

    def call_tool(self, name: str, arguments: dict[str, Any], should_stop: Callable[[], bool]) -> dict[str, Any]:
        with self.lock:
            if not self.ensure_init(should_stop):
                return {"error": self.last_error}
            resp = self.rpc("tools/call", {"name": name, "arguments": arguments}, should_stop)
        if "error" in resp:
            return {"error": _rpc_error(resp)}
        result = resp.get("result")
        if not isinstance(result, dict):
            return {"error": "invalid response from MCP server"}
        # /tools's contract: the text parts joined; isError is the tool's own failure
        text = "\n".join(str(p.get("text", "")) for p in result.get("content") or [] if isinstance(p, dict) and p.get("type") == "text")
        if result.get("isError"):
            return {"error": text or "MCP tool returned an error"}
        return {"plain_text_response": text}

    def close(self, grace_s: float = 0.2) -> None:
        """Stop the server: its stdin closed (MCP's way to ask), then its whole session killed."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError, ValueError):
            if proc.stdin is not None:
                proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
        # also what it started: a child holding the pipes would otherwise outlive it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1)


def _rpc_error(resp: dict[str, Any]) -> str:
    e = resp.get("error")
    if isinstance(e, dict):
        return str(e.get("message", "unknown error"))
    if isinstance(e, str):
        return e
    return "unknown error"


class McpManager:
    """The configured MCP servers: their tools (listed once at start) and the running transports
    calls go through."""

    def __init__(self, configs: list[McpServerConfig]) -> None:
        self.configs = {c.name: c for c in configs}
        self.lock = threading.Lock()
        self.transports: dict[str, StdioTransport] = {}
        self.dead_until: dict[str, float] = {}
        self.registry: list[McpToolDef] = []
        self.stopping = threading.Event()

    def warmup(self) -> None:
        """Spawn each server, list its tools, stop it. A server that fails is logged and left
        out; the others still serve."""
        found: list[McpToolDef] = []
        for cfg in self.configs.values():
            t = StdioTransport(cfg)
            if not t.start():
                log.warning("MCP server %r failed to start: %s", cfg.name, t.diagnostics())
                continue
            deadline = time.monotonic() + WARMUP_TIMEOUT_S

            def stop(deadline: float = deadline) -> bool:
                return self.stopping.is_set() or time.monotonic() >= deadline

            tools = t.list_tools(stop)
            if not tools and t.last_error:
                log.warning("MCP server %r: %s", cfg.name, t.diagnostics())
            log.info("MCP server %r: %d tools", cfg.name, len(tools))
            found += tools
            t.close()
        self.registry = found

    def list_tools(self) -> list[McpToolDef]:
        return list(self.registry)

    def call_tool(self, server: str, tool: str, arguments: dict[str, Any], should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        t = self._transport(server)
        if t is None:
            return {"error": f"MCP server unavailable: {server}"}
        return t.call_tool(tool, arguments, lambda: self.stopping.is_set() or (should_stop is not None and should_stop()))

    def _transport(self, name: str) -> StdioTransport | None:
        stale: list[StdioTransport] = []
        try:
            with self.lock:
                if self.stopping.is_set():
                    return None
                now = time.monotonic()
                if self.dead_until.get(name, 0) > now:
                    return None
                t = self.transports.get(name)
                if t is not None:
                    if t.alive():
                        return t
                    log.warning("MCP server %r is no longer running (%s); starting it again", name, t.diagnostics())
                    stale.append(self.transports.pop(name))
                cfg = self.configs.get(name)
                if cfg is None:
                    return None
                fresh = StdioTransport(cfg)
                if fresh.start() and fresh.alive():
                    self.transports[name] = fresh
                    return fresh
                log.warning("MCP server %r failed to start: %s", name, fresh.diagnostics())
                stale.append(fresh)
                self.dead_until[name] = now + COOLDOWN_S
                return None
        finally:
            for s in stale:
                s.close()

    def shutdown(self) -> None:
        """Cancel every call in flight (they answer at once); no new ones start. Cheap: safe in
        a signal handler."""
        self.stopping.set()

    def close(self) -> None:
        self.shutdown()
        with self.lock:
            ts, self.transports = list(self.transports.values()), {}
        for t in ts:
            t.close()
