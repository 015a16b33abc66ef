"""llama-server's built-in agent tools, served at `/tools` when the operator opts in with
`--tools read_file,grep_search,...` (or `--tools all`): reading, searching, writing and editing
files and running shell commands for an agent UI, as llama.cpp's tools/server/server-tools.cpp
does, with its limits (16 KB reads and command output, 100 matches, a 60 s cap on commands, a
15 s budget per directory walk).

These tools act with the server's own rights on the machine it runs on: they are off unless
`--tools` names them, and then the server's CORS default narrows to loopback origins. A request
may route a tool through an isolate instead (`x-tool-runtime: docker-container:<id>`,
`podman-container:<id>`, `ssh:<host>`), and `--tools-runtime` sets one for every call (the
`docker:<image>` form starts a container the server owns and stops at exit). Identifiers that
could become options on the isolate's command line are refused, never passed.

`ServerTools` is the registry behind `GET/POST /tools`: these tools plus those of the MCP servers
(mcp.py), listed and invoked alike."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import os
import platform
import re
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

if TYPE_CHECKING:
    from .app import Server
    from .mcp import McpManager

log = logging.getLogger("dasllama.serve")

READ_FILE_MAX = 16 * 1024  # bytes of text read_file returns without a line range
READ_FILE_MAX_BASE64 = 32 * 1024 * 1024  # x-resp-type: base64 (the web UI's attachments)
SEARCH_MAX_RESULTS = 100
GIT_LS_FILES_MAX = 8 * 1024 * 1024
LIST_TIMEOUT_S = 15  # budget for one directory listing, git or walker
EXEC_MAX_OUTPUT = 16 * 1024
EXEC_MAX_TIMEOUT_S = 60
ISOLATE_AUX_TIMEOUT_S = 15  # stat/mkdir/ls helpers inside an isolate
ISOLATE_READ_MAX = 64 * 1024 * 1024
GET_INFO_TIMEOUT_S = 5
# Directories a listing reports but never descends into: they can be enormous.
JUNK_DIRS = (".git", ".svn", ".hg", "node_modules", "__pycache__", ".venv", "venv", "dist", "build", "target", ".cache", ".idea", ".vscode")

TOOL_NAMES = ("read_file", "file_glob_search", "grep_search", "exec_shell_command", "write_file", "edit_file", "get_info")


class ToolRequestError(Exception):
    """A /tools request that cannot run: answered with `status` (400 bad input, 404 unknown tool,
    500 a runtime that cannot be used), not as the tool's own {"error": ...} result."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _param(params: dict[str, Any], key: str, kind: type, default: Any = ...) -> Any:
    """A tool parameter of the given JSON type; a missing required one or a wrong type is a 400."""
    if key not in params or params[key] is None:
        if default is ...:
            raise ToolRequestError(400, f"missing parameter '{key}'")
        return default
    v = params[key]
    if kind is int and isinstance(v, float) and v.is_integer():
        v = int(v)
    if (isinstance(v, bool) and kind is not bool) or not isinstance(v, kind):
        want = {str: "a string", int: "an integer", bool: "a boolean", list: "an array"}.get(kind, kind.__name__)
        raise ToolRequestError(400, f"parameter '{key}' must be {want}")
    return v


# ---- glob matching (llama.cpp's common glob_match: '*' stays within a path segment, '**' crosses) ----


def _class_match(c: str, cls: str) -> bool:
    negated = cls.startswith("!")
    if negated:
        cls = cls[1:]
    i = 0
    if cls[:1] in ("]", "-"):
        if cls[0] == c:
            return not negated
        i = 1
    matched = False
    while i < len(cls):
        if i + 2 < len(cls) and cls[i + 1] == "-":
            if cls[i] <= c <= cls[i + 2]:
                matched = True
                break
            i += 3
        else:
            if cls[i] == c:
                matched = True
                break
            i += 1
    return matched != negated


def glob_match(pattern: str, s: str) -> bool:
    """'*' and '?' match within one path segment, '**' across segments, '[...]' a class."""

    def m(p: int, i: int) -> bool:
        while p < len(pattern):
            ch = pattern[p]
            if pattern.startswith("**", p):
                return any(m(p + 2, j) for j in range(i, len(s) + 1))
            if ch == "*":
                j = i
                while True:
                    if m(p + 1, j):
                        return True
                    if j >= len(s) or s[j] == "/":
                        return False
                    j += 1
            if ch == "?":
                if i >= len(s) or s[i] == "/":
                    return False
            elif ch == "[":
                start = p + 1 + (1 if p + 1 < len(pattern) and pattern[p + 1] in "]-" else 0)
                end = pattern.find("]", start)
                if end < 0:
                    if i >= len(s) or s[i] != "[":
                        return False
                else:
                    if i >= len(s) or not _class_match(s[i], pattern[p + 1 : end]):
                        return False
                    p, i = end + 1, i + 1
                    continue
            elif i >= len(s) or s[i] != ch:
                return False
            p, i = p + 1, i + 1
        return i == len(s)

    return m(0, 0)


def path_glob_match(pattern: str, rel: str) -> bool:
    """No '/' in the pattern: it matches the basename at any depth; else the whole relative path,
    anchored at any depth unless it starts with '**/' or '/'."""
    if "/" not in pattern:
        return glob_match(pattern, rel.rsplit("/", 1)[-1])
    if pattern == "**" or pattern.startswith("**/") or pattern.startswith("/"):
        return glob_match(pattern, rel)
    return glob_match("**/" + pattern, rel)


# ---- running commands -------------------------------------------------------------------------


@dataclass
class ExecResult:
    output: str
    exit_code: int = -1
    timed_out: bool = False
    raw: bytes = b""  # the output's bytes as they came (a file read through an isolate)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    # The command runs in its own session: its children (a pipeline, a backgrounded job) go too.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_subprocess(
    args: list[str],
    max_output: int,
    timeout_s: float,
    on_chunk: Callable[[str], bool] | None = None,
    combine_stderr: bool = True,
    cwd: str | None = None,
    stdin_data: bytes | None = None,
) -> ExecResult:
    """Run `args`, collecting up to `max_output` bytes of output (drained past it, so the child
    never blocks on a full pipe). `on_chunk` sees the output as it arrives and stops the command
    by returning False. Past `timeout_s` the command and its children are killed."""
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE if stdin_data is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if combine_stderr else subprocess.DEVNULL,
            cwd=cwd or None,
            start_new_session=True,
        )
    except OSError as e:
        return ExecResult(f"failed to spawn process: {e}")
    timed_out = threading.Event()
    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(timeout_s):
            timed_out.set()
            _kill_group(proc)

    threading.Thread(target=watchdog, name="dasllama-tool-timeout", daemon=True).start()
    if stdin_data is not None:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, OSError):
            proc.stdin.write(stdin_data)
        with contextlib.suppress(BrokenPipeError, OSError):
            proc.stdin.close()  # a client waiting on stdin would wait forever
    out = bytearray()
    truncated = False
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        if truncated:
            continue
        room = max_output - len(out)
        if len(chunk) > room:
            chunk, truncated = chunk[:room], True
        out += chunk
        if on_chunk is not None and chunk and not on_chunk(chunk.decode("utf-8", errors="replace")):
            _kill_group(proc)
            break
    proc.stdout.close()
    code = proc.wait()
    done.set()
    text = out.decode("utf-8", errors="replace")
    if truncated:
        text += "\n[output truncated]"
    return ExecResult(text, code, timed_out.is_set(), bytes(out))


# ---- where a tool's I/O happens ---------------------------------------------------------------


@dataclass
class Listing:
    entries: list[tuple[str, bool]] = field(default_factory=list)  # ('/'-separated relative path, is a directory)
    err: str = ""
    truncated: bool = False


class HostIO:
    """The server's own file system and shell; relative paths resolve against `cwd` (the
    x-tool-cwd header) or the server's working directory."""

    def __init__(self, cwd: str = "") -> None:
        self.cwd = cwd

    def resolve(self, path: str) -> str:
        p = os.path.expanduser(path) if path.startswith("~") else path
        if not os.path.isabs(p):
            p = os.path.join(self.cwd or os.getcwd(), p)
        return os.path.normpath(p)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(self.resolve(path))

    def is_file(self, path: str) -> bool:
        return os.path.isfile(self.resolve(path))

    def file_size(self, path: str) -> int | None:
        try:
            return os.path.getsize(self.resolve(path))
        except OSError:
            return None

    def read(self, path: str) -> bytes | None:
        try:
            return Path(self.resolve(path)).read_bytes()
        except OSError:
            return None

    def write(self, path: str, data: bytes) -> bool:
        p = Path(self.resolve(path))
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        except OSError:
            return False
        return True

    def list_entries(self, base: str, max_depth: int, kind: str) -> Listing:
        out = Listing()
        if not os.path.isdir(base):
            out.err = "path does not exist or is not a directory"
            return out
        deadline = time.monotonic() + LIST_TIMEOUT_S
        if kind == "file":
            # git knows what is ignored; it cannot list directories, and outside a repo it fails
            res = self.run(["git", "-C", base, "ls-files", "--cached", "--others", "--exclude-standard"], GIT_LS_FILES_MAX, LIST_TIMEOUT_S)
            if res.exit_code == 0 and not res.timed_out:
                for line in res.output.splitlines():
                    rel = line.rstrip("\r").replace("\\", "/")
                    if rel and not (max_depth > 0 and rel.count("/") + 1 > max_depth) and os.path.isfile(os.path.join(base, rel)):
                        out.entries.append((rel, False))
                return out
        out.entries = self._walk(base, max_depth, kind, deadline, out)
        return out

    @staticmethod
    def _walk(base: str, max_depth: int, kind: str, deadline: float, out: Listing) -> list[tuple[str, bool]]:
        result: list[tuple[str, bool]] = []
        stack: list[tuple[str, str, int]] = [(base, "", 0)]
        while stack:
            d, rel_dir, depth = stack.pop()
            try:
                entries = sorted(os.scandir(d), key=lambda e: e.name)
            except OSError:
                out.truncated = True
                continue
            subdirs = []
            for e in entries:
                if time.monotonic() >= deadline:
                    out.truncated = True
                    return result
                rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
                try:
                    is_dir = e.is_dir()
                    if is_dir:
                        if kind in ("dir", "all"):
                            result.append((rel, True))
                        # junk directories stay selectable but are never walked; links could loop
                        if e.name not in JUNK_DIRS and not e.is_symlink() and (max_depth == 0 or depth + 1 < max_depth):
                            subdirs.append((e.path, rel, depth + 1))
                    elif e.is_file() and kind in ("file", "all"):
                        result.append((rel, False))
                except OSError:
                    continue
            stack.extend(reversed(subdirs))
        return result

    def run(self, args: list[str], max_output: int, timeout_s: float, on_chunk: Callable[[str], bool] | None = None) -> ExecResult:
        return run_subprocess(args, max_output, timeout_s, on_chunk, True, self.cwd or None)


class IsolateIO(HostIO):
    """Every operation as a POSIX command inside an isolate (a container, a remote host): `sh`,
    `cat`, `wc`, `find` and `timeout` must exist there. Subclasses wrap the command line."""

    def resolve(self, path: str) -> str:
        if not self.cwd or path.startswith("/"):
            return path
        return f"{self.cwd}/{path}"

    def build_argv(self, inner: list[str], needs_stdin: bool) -> list[str]:
        raise NotImplementedError

    def _exec(self, inner: list[str], max_output: int = 4096, combine_stderr: bool = True) -> ExecResult:
        return run_subprocess(self.build_argv(inner, False), max_output, ISOLATE_AUX_TIMEOUT_S, None, combine_stderr)

    def _test(self, flag: str, path: str) -> bool:
        r = self._exec(["sh", "-c", f'[ {flag} "$1" ]', "_", self.resolve(path)])
        return r.exit_code == 0 and not r.timed_out

    def is_dir(self, path: str) -> bool:
        return self._test("-d", path)

    def is_file(self, path: str) -> bool:
        return self._test("-f", path)

    def file_size(self, path: str) -> int | None:
        r = self._exec(["sh", "-c", 'wc -c < "$1"', "_", self.resolve(path)], 64)
        try:
            return int(r.output.strip()) if r.exit_code == 0 and not r.timed_out else None
        except ValueError:
            return None

    def read(self, path: str) -> bytes | None:
        # stderr kept out: it must not be spliced into the file's bytes
        r = run_subprocess(self.build_argv(["cat", "--", self.resolve(path)], False), ISOLATE_READ_MAX, ISOLATE_AUX_TIMEOUT_S, None, False)
        return r.raw if r.exit_code == 0 and not r.timed_out else None

    def write(self, path: str, data: bytes) -> bool:
        # the content travels on stdin: nothing for the far side to re-parse, no temporary file
        argv = self.build_argv(["sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1"', "_", self.resolve(path)], True)
        r = run_subprocess(argv, 4096, ISOLATE_AUX_TIMEOUT_S, None, True, None, data)
        return r.exit_code == 0 and not r.timed_out

    def list_entries(self, base: str, max_depth: int, kind: str) -> Listing:
        out = Listing()
        abs_base = self.resolve(base)
        if not self.is_dir(base):
            out.err = "path does not exist or is not a directory"
            return out
        if kind == "file":
            r = self._exec(["sh", "-c", 'cd "$1" && git ls-files --cached --others --exclude-standard', "_", abs_base], GIT_LS_FILES_MAX)
            if r.exit_code == 0 and not r.timed_out:
                out.entries = [(rel, False) for rel in _lines(r.output, False) if not (max_depth > 0 and rel.count("/") + 1 > max_depth)]
                return out
        if kind in ("dir", "all"):
            out.entries += [(rel, True) for rel in self._find(abs_base, max_depth, True, out)]
        if kind in ("file", "all"):
            out.entries += [(rel, False) for rel in self._find(abs_base, max_depth, False, out)]
        return out

    def _find(self, abs_base: str, max_depth: int, dirs: bool, out: Listing) -> list[str]:
        # one `find` pass: junk directories are printed but pruned; -mindepth/-maxdepth suit busybox too
        prune = " -o ".join(f"-name {n}" for n in JUNK_DIRS)
        cmd = 'cd "$1" && find . -mindepth 1' + (f" -maxdepth {max_depth}" if max_depth > 0 else "") + f" \\( {prune} \\) -prune"
        cmd += " -print -o -type d -print" if dirs else " -o -type f -print"
        r = self._exec(["sh", "-c", cmd, "_", abs_base], GIT_LS_FILES_MAX)
        out.truncated = out.truncated or r.timed_out
        return _lines(r.output, True)

    def run(self, args: list[str], max_output: int, timeout_s: float, on_chunk: Callable[[str], bool] | None = None) -> ExecResult:
        # killing the local client does not kill what runs inside the isolate: `timeout` there does
        inner = ["timeout", f"{int(timeout_s)}s", *args]
        if self.cwd:
            inner = ["sh", "-c", 'cd "$1" || exit 127; shift; exec "$@"', "_", self.cwd, *inner]
        return run_subprocess(self.build_argv(inner, True), max_output, timeout_s + 5, on_chunk, True)


def _lines(text: str, strip_dot_slash: bool) -> list[str]:
    out = []
    for line in text.splitlines():
        line = line.rstrip("\r")
        if not line:
            continue
        if strip_dot_slash and line.startswith("./"):
            line = line[2:]
        out.append(line.replace("\\", "/"))
    return out


_CONTAINER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SSH_TARGET = re.compile(r"[A-Za-z0-9._@][A-Za-z0-9._@-]*")
ENGINES = ("docker", "podman")


class ContainerIO(IsolateIO):
    """A running container, driven through `docker exec` / `podman exec`."""

    def __init__(self, engine: str, container_id: str, cwd: str = "") -> None:
        super().__init__(cwd)
        self.engine, self.container_id = engine, container_id

    def build_argv(self, inner: list[str], needs_stdin: bool) -> list[str]:
        return [self.engine, "exec", *(["-i"] if needs_stdin else []), self.container_id, *inner]


class SshIO(IsolateIO):
    """A remote POSIX host over ssh: remoting, not isolation (the tools can do what the account
    can). Key-based auth and an already trusted host key only: a prompt would hang the call."""

    def __init__(self, target: str, cwd: str = "") -> None:
        super().__init__(cwd)
        self.target = target

    def build_argv(self, inner: list[str], needs_stdin: bool) -> list[str]:
        opts = ["-o", "BatchMode=yes", "-o", "PasswordAuthentication=no", "-o", "KbdInteractiveAuthentication=no", "-o", "StrictHostKeyChecking=yes"]
        # the remote shell re-parses the command line, so it travels as one quoted word
        return ["ssh", *opts, *([] if needs_stdin else ["-n"]), self.target, shlex.join(inner)]


def parse_container_spec(spec: str) -> tuple[str, str, bool] | None:
    """'<engine>:<image>' (a container to start) or '<engine>-container:<id>' (one running):
    (engine, image or id, attach), or None for another scheme."""
    for engine in ENGINES:
        if spec.startswith(f"{engine}-container:"):
            return engine, spec[len(engine) + len("-container:") :], True
        if spec.startswith(f"{engine}:"):
            return engine, spec[len(engine) + 1 :], False
    return None


def make_io(cwd: str, runtime: str) -> HostIO:
    """Where one tool call runs: the host, or the isolate `runtime` names. A runtime that cannot
    be used is an error, never a quiet fall-back to the host (the caller asked for an isolate)."""
    if not runtime:
        return HostIO(cwd)
    spec = parse_container_spec(runtime)
    if spec is not None:
        engine, ident, attach = spec
        if not attach:
            raise ToolRequestError(500, f"tool runtime must name a running container: {runtime}")
        # an id starting with '-' would become an option of `<engine> exec` (--privileged)
        if not _CONTAINER_ID.fullmatch(ident):
            raise ToolRequestError(500, f"invalid container id: {ident}")
        return ContainerIO(engine, ident, cwd)
    if runtime.startswith("ssh:"):
        target = runtime[4:]
        # ssh reads options from its argv: -oProxyCommand=... would run on this host
        if not _SSH_TARGET.fullmatch(target):
            raise ToolRequestError(500, f"invalid ssh target: {target}")
        return SshIO(target, cwd)
    raise ToolRequestError(500, f"unknown tool runtime: {runtime}")


class ContainerRuntime:
    """`--tools-runtime docker:<image>`: a container this server starts (`run --rm -i <image>
    sh`, kept alive by its open stdin) and stops at exit by closing that stdin; one that dies is
    started again on the next call."""

    def __init__(self, engine: str, image: str) -> None:
        if not image:
            raise ValueError(f"--tools-runtime {engine}:<image> needs an image name")
        self.engine, self.image = engine, image
        self.proc: subprocess.Popen[bytes] | None = None
        self.container_id = ""
        self.lock = threading.Lock()
        self._spawn()

    def _spawn(self) -> None:
        self.close()
        cidfile = Path(tempfile.gettempdir()) / f"dasllama-tools-runtime-{os.getpid()}-{threading.get_ident()}.cid"
        cidfile.unlink(missing_ok=True)
        try:
            self.proc = subprocess.Popen([self.engine, "run", "--rm", "-i", "--cidfile", str(cidfile), self.image, "sh"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError as e:
            raise ValueError(f"cannot start a {self.engine} container for --tools-runtime (image {self.image}): {e}") from None
        cid = ""
        for _ in range(100):
            with contextlib.suppress(OSError):
                cid = cidfile.read_text().strip()
            if cid or self.proc.poll() is not None:
                break
            time.sleep(0.1)
        cidfile.unlink(missing_ok=True)
        if not cid:
            self.close()
            raise ValueError(f"the {self.engine} container for --tools-runtime (image {self.image}) did not start within 10 s")
        self.container_id = cid

    def spec(self) -> str:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                log.warning("the %s tools runtime container %s died; starting another", self.engine, self.container_id)
                self._spawn()
            return f"{self.engine}-container:{self.container_id}"

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()  # the container's shell (its pid 1) exits; --rm removes it
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- the tools ----------------------------------------------------------------------------------


@dataclass
class Tool:
    name: str
    display_name: str
    description: str
    properties: dict[str, Any]
    required: list[str]
    run: Callable[[dict[str, Any], HostIO, Callable[[str], bool] | None], dict[str, Any]]
    write: bool = False  # changes something (files, or anything a shell command can)
    stream: bool = False  # POST /tools with "stream": true
    kind: str = "server"
    uses_cwd: bool = True
    schema: dict[str, Any] | None = None  # an MCP tool's own input schema, as it gave it

    def definition(self) -> dict[str, Any]:
        params: dict[str, Any] = {"type": "object", "properties": self.properties}
        if self.required:
            params["required"] = self.required
        if self.schema is not None:
            params = self.schema
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": params}}

    def card(self) -> dict[str, Any]:
        return {"display_name": self.display_name, "tool": self.name, "type": self.kind, "permissions": {"write": self.write}, "uses_cwd": self.uses_cwd, "definition": self.definition()}


def _s(desc: str) -> dict[str, str]:
    return {"type": "string", "description": desc}


def _i(desc: str) -> dict[str, str]:
    return {"type": "integer", "description": desc}


def _b(desc: str) -> dict[str, str]:
    return {"type": "boolean", "description": desc}


def read_file(params: dict[str, Any], io: HostIO, _: Any) -> dict[str, Any]:
    path = _param(params, "path", str)
    start = _param(params, "start_line", int, 1)
    end = _param(params, "end_line", int, -1)
    loc = _param(params, "append_loc", bool, False)
    size = io.file_size(path)
    if size is None:
        return {"error": f"cannot stat file: {path}"}
    if params.get("resp_type") == "base64":
        if size > READ_FILE_MAX_BASE64:
            return {"error": f"file too large ({size} bytes, max {READ_FILE_MAX_BASE64})"}
        data = io.read(path)
        if data is None:
            return {"error": f"failed to open file: {path}"}
        return {"base64": base64.b64encode(data).decode("ascii"), "size_bytes": len(data)}
    if size > READ_FILE_MAX and end == -1:
        return {"error": f"file too large ({size} bytes, max {READ_FILE_MAX}). Use start_line/end_line to read a portion."}
    data = io.read(path)
    if data is None:
        return {"error": f"failed to open file: {path}"}
    out: list[str] = []
    used = 0
    for n, line in enumerate(_split_lines(data.decode("utf-8", errors="replace")), 1):
        if n < start:
            continue
        if end != -1 and n > end:
            break
        text = f"{n}\u2192{line}\n" if loc else line + "\n"
        used += len(text.encode("utf-8"))
        if used > READ_FILE_MAX:
            out.append("[output truncated]")
            break
        out.append(text)
    return {"plain_text_response": "".join(out)}


def _split_lines(text: str) -> list[str]:
    """Lines as C++'s getline reads them: a final newline ends the last line, adds none."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def file_glob_search(params: dict[str, Any], io: HostIO, _: Any) -> dict[str, Any]:
    path = _param(params, "path", str)
    base = io.resolve(path)
    include = _param(params, "include", str, "**")
    exclude = _param(params, "exclude", str, "")
    kind = _param(params, "type", str, "file")
    max_depth = max(0, _param(params, "max_depth", int, 0))
    limit = _param(params, "limit", int, SEARCH_MAX_RESULTS)
    if limit < 1:
        return {"error": f"invalid limit: {limit} (expected 1 or more)"}
    limit = min(limit, SEARCH_MAX_RESULTS)
    if kind not in ("file", "dir", "all"):
        return {"error": f'invalid type: {kind} (expected "file", "dir" or "all")'}
    listing = io.list_entries(base, max_depth, kind)
    if listing.err:
        return {"error": f"{listing.err}: {path}"}
    matches = [(rel, d) for rel, d in listing.entries if path_glob_match(include, rel) and not (exclude and path_glob_match(exclude, rel))]
    shown = matches[:limit]
    text = "".join(f"{rel}{'/' if d else ''}\n" for rel, d in shown)
    text += f"\n---\nTotal matches: {len(matches)}\n"
    if len(matches) > len(shown):
        text += f"[{len(shown)} results limit reached ({len(matches)} total matches). Refine the glob pattern to narrow the search.]\n"
    if listing.truncated:
        text += "[results truncated: time budget or unreadable directory]\n"
    # `base` is absolute, so a client (the web UI's picker) can join the relative entries to it
    return {"plain_text_response": text, "entries": [{"path": rel, "type": "dir" if d else "file"} for rel, d in shown], "base": base}


def grep_search(params: dict[str, Any], io: HostIO, _: Any) -> dict[str, Any]:
    path = _param(params, "path", str)
    pattern = _param(params, "pattern", str)
    include = _param(params, "include", str, "**")
    exclude = _param(params, "exclude", str, "")
    show_num = _param(params, "return_line_numbers", bool, False)
    literal = _param(params, "literal", bool, False)
    ignore_case = _param(params, "ignore_case", bool, False)
    ctx = max(0, _param(params, "context_lines", int, 0))
    try:
        rx = re.compile(re.escape(pattern) if literal else pattern, re.IGNORECASE if ignore_case else 0)
    except re.error as e:
        return {"error": f"invalid regex: {e}"}
    abs_path = io.resolve(path)
    files: list[tuple[str, str]] = []
    if io.is_file(abs_path):
        files.append((abs_path, path))
    elif io.is_dir(abs_path):
        listing = io.list_entries(abs_path, 0, "file")
        if listing.err:
            return {"error": f"{listing.err}: {path}"}
        for rel, _d in listing.entries:
            if path_glob_match(include, rel) and not (exclude and path_glob_match(exclude, rel)):
                files.append((f"{abs_path.rstrip('/')}/{rel}", rel))
    else:
        return {"error": f"path does not exist: {path}"}
    show_num = show_num or ctx > 0
    out: list[str] = []
    total = 0
    limited = False
    for fpath, shown in files:
        if limited:
            break
        data = io.read(fpath)
        if data is None:
            continue
        lines = _split_lines(data.decode("utf-8", errors="replace"))
        for i, line in enumerate(lines):
            if total >= SEARCH_MAX_RESULTS:
                limited = True
                break
            if not rx.search(line):
                continue
            for j in range(max(0, i - ctx), min(len(lines) - 1, i + ctx) + 1):
                sep = ":" if j == i else "-"
                out.append(f"{shown}{sep}{f'{j + 1}{sep}' if show_num else ''}{lines[j]}\n")
            if ctx > 0:
                out.append("--\n")
            total += 1
    text = "".join(out) + f"\n---\nTotal matches: {total}\n"
    if limited:
        text += f"[{SEARCH_MAX_RESULTS} matches limit reached. Narrow the path/pattern/include to see more.]\n"
    return {"plain_text_response": text}


def exec_shell_command(params: dict[str, Any], io: HostIO, push: Callable[[str], bool] | None) -> dict[str, Any]:
    command = _param(params, "command", str)
    timeout = min(_param(params, "timeout", int, 10), EXEC_MAX_TIMEOUT_S)
    max_output = min(_param(params, "max_output_size", int, EXEC_MAX_OUTPUT), EXEC_MAX_OUTPUT)
    res = io.run(["sh", "-c", command], max(0, max_output), max(1, timeout), push)
    tail = f"\n[exit code: {res.exit_code}]" + (" [exit due to timed out]" if res.timed_out else "")
    if push is not None:
        push(tail)
        return {}
    return {"plain_text_response": res.output + tail}


def write_file(params: dict[str, Any], io: HostIO, _: Any) -> dict[str, Any]:
    path = _param(params, "path", str)
    content = _param(params, "content", str).encode("utf-8")
    if not io.write(path, content):
        return {"error": f"failed to write file: {path}"}
    return {"result": "file written successfully", "path": path, "bytes": len(content)}


_FUZZY = {
    **dict.fromkeys("\u2018\u2019\u201a\u201b", "'"),
    **dict.fromkeys("\u201c\u201d\u201e\u201f", '"'),
    **dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2015\u2212", "-"),
    **dict.fromkeys("\u00a0\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u202f\u205f\u3000", " "),
}
_FUZZY_TABLE = str.maketrans(_FUZZY)


def _fuzzy(text: str) -> str:
    """Each line without trailing blanks, typographic quotes, dashes and spaces as ASCII: what a
    model that retyped the text may have changed. Line count and positions stay."""
    return "\n".join(line.rstrip(" \t\r").translate(_FUZZY_TABLE) for line in text.split("\n"))


def _count(hay: str, needle: str) -> int:
    n = pos = 0
    while needle and (pos := hay.find(needle, pos)) >= 0:
        n += 1
        pos += len(needle)
    return n


def edit_file(params: dict[str, Any], io: HostIO, _: Any) -> dict[str, Any]:
    path = _param(params, "path", str)
    raw = _param(params, "edits", list)
    if not raw:
        return {"error": '"edits" must be a non-empty array'}
    edits: list[tuple[str, str]] = []
    for i, e in enumerate(raw):
        if not isinstance(e, dict):
            raise ToolRequestError(400, f"edits[{i}] must be an object with old_text and new_text")
        old, new = _param(e, "old_text", str), _param(e, "new_text", str)
        if not old:
            return {"error": f"edits[{i}].old_text must not be empty"}
        edits.append((old, new))
    data = io.read(path)
    if data is None:
        return {"error": f"failed to open file: {path}"}
    original = data.decode("utf-8", errors="surrogateescape")
    fuzzy_original = _fuzzy(original)
    any_fuzzy = False
    for i, (old, _new) in enumerate(edits):
        if old in original:
            continue
        if _fuzzy(old) not in fuzzy_original:
            return {"error": f"could not find edits[{i}].old_text in {path}, it must match the file's current content exactly"}
        any_fuzzy = True
    base = fuzzy_original if any_fuzzy else original
    matched: list[tuple[int, int, int, str]] = []  # (start, length, edit index, new text)
    for i, (old, new) in enumerate(edits):
        needle = _fuzzy(old) if any_fuzzy else old
        # uniqueness always on the normalized text: a whitespace-only duplicate still counts
        n = _count(fuzzy_original, _fuzzy(old))
        if n > 1:
            return {"error": f"found {n} occurrences of edits[{i}].old_text in {path}, it must be unique"}
        matched.append((base.find(needle), len(needle), i, new))
    matched.sort()
    for a, b in itertools.pairwise(matched):
        if a[0] + a[1] > b[0]:
            return {"error": f"edits[{a[2]}] and edits[{b[2]}] overlap in {path}; merge them into one edit or target disjoint regions"}
    result = _apply_keeping_lines(original, base, matched) if any_fuzzy else _apply(base, matched, 0)
    if result == original:
        return {"error": "no changes made: the replacement(s) produced identical content"}
    if not io.write(path, result.encode("utf-8", errors="surrogateescape")):
        return {"error": f"failed to write file: {path}"}
    return {"result": "file edited successfully", "path": path, "edits_applied": len(matched)}


def _apply(text: str, reps: list[tuple[int, int, int, str]], offset: int) -> str:
    for start, length, _i, new in reversed(reps):
        at = start - offset
        text = text[:at] + new + text[at + length :]
    return text


def _apply_keeping_lines(original: str, base: str, reps: list[tuple[int, int, int, str]]) -> str:
    """The replacements made on the normalized text, every line they do not touch taken from
    the original (so its trailing blanks and typography stay)."""
    orig_lines = original.splitlines(keepends=True)
    spans, off = [], 0
    for line in base.splitlines(keepends=True):
        spans.append((off, off + len(line)))
        off += len(line)
    groups: list[list[Any]] = []  # [first line, end line (exclusive), replacements]
    for rep in reps:
        start, end = rep[0], rep[0] + rep[1]
        first = next((k for k, (a, b) in enumerate(spans) if a <= start < b), 0)
        last = first
        while last < len(spans) - 1 and spans[last][1] < end:
            last += 1
        if groups and first < groups[-1][1]:
            groups[-1][1] = max(groups[-1][1], last + 1)
            groups[-1][2].append(rep)
        else:
            groups.append([first, last + 1, [rep]])
    out, k = [], 0
    for first, end_line, gr in groups:
        out += orig_lines[k:first]
        a, b = spans[first][0], spans[end_line - 1][1]
        out.append(_apply(base[a:b], gr, a))
        k = end_line
    out += orig_lines[k:]
    return "".join(out)


def get_info(params: dict[str, Any], io: HostIO, _: Any) -> dict[str, Any]:
    res = io.run(["uname", "-a"], 4096, GET_INFO_TIMEOUT_S)
    os_info = res.output.strip() if res.exit_code == 0 and not res.timed_out else "unknown"
    cwd = params.get("cwd") or ""
    if not cwd:
        if not params.get("runtime"):
            cwd = os.getcwd()
        else:
            pwd = io.run(["pwd"], 4096, GET_INFO_TIMEOUT_S)
            cwd = pwd.output.strip() if pwd.exit_code == 0 and not pwd.timed_out else "unknown"
    return {"os": os_info or platform.platform(), "cwd": cwd}


def builtin_tools() -> list[Tool]:
    return [
        Tool(
            "read_file", "Read file",
            'Read the contents of a file. Optionally specify a 1-based line range. If append_loc is true, each line is prefixed with its line number (e.g. "1\u2192...").',
            {"path": _s("Path to the file"), "start_line": _i("First line to read, 1-based (default: 1)"), "end_line": _i("Last line to read, 1-based inclusive (default: end of file)"), "append_loc": _b("Prefix each line with its line number")},
            ["path"], read_file,
        ),
        Tool(
            "file_glob_search", "File search",
            "Recursively search for files matching a glob pattern under a directory. Automatically skips files ignored by .gitignore (when the directory is inside a git repo) "
            "and common junk directories (.git, node_modules, build, dist, etc.) otherwise. A pattern with no '/' (e.g. \"*.cpp\") matches the file's basename at any depth. "
            "A pattern containing '/' matches the full relative path; unless already anchored with \"**/\" or a leading '/', it is automatically prefixed with \"**/\". "
            "Use type=\"dir\" or \"all\" to also list directories; directory entries are suffixed with '/' in the output. Note: directory listings do not apply .gitignore filtering.",
            {
                "path": _s("Base directory to search in"), "include": _s('Glob pattern for files to include (e.g. "*.cpp" or "src/**/*.cpp"). Default: **'), "exclude": _s("Glob pattern for files to exclude"),
                "type": _s('Entry type to return: "file" (default), "dir" or "all"'), "max_depth": _i("Maximum depth to descend into subdirectories (default: 0 = unlimited; 1 = direct children only)"),
                "limit": _i(f"Maximum number of results to return, capped at {SEARCH_MAX_RESULTS} (default {SEARCH_MAX_RESULTS})"),
            },
            ["path"], file_glob_search,
        ),
        Tool(
            "grep_search", "Grep search",
            "Search for a pattern in files under a path. Returns matching lines with file paths (and, unless searching a single file, paths relative to the given directory). "
            "Automatically skips files ignored by .gitignore (when the directory is inside a git repo) and common junk directories (.git, node_modules, build, dist, etc.) otherwise. "
            "include/exclude: a pattern with no '/' matches the basename at any depth; a pattern containing '/' matches the full relative path (auto-anchored with \"**/\" unless already anchored).",
            {
                "path": _s("File or directory to search in"), "pattern": _s("Pattern to search for (regular expression unless literal is true)"), "include": _s("Glob pattern to filter files (default: **)"),
                "exclude": _s("Glob pattern to exclude files"), "return_line_numbers": _b("If true, include line numbers in results"),
                "literal": _b("Treat pattern as a literal string instead of a regular expression (default: false)"), "ignore_case": _b("Case-insensitive search (default: false)"),
                "context_lines": _i("Number of lines of context to show before and after each match (default: 0)"),
            },
            ["path", "pattern"], grep_search,
        ),
        Tool(
            "exec_shell_command", "Execute shell command", "Execute a shell command and return its output (stdout and stderr combined).",
            {"command": _s("Shell command to execute"), "timeout": _i(f"Timeout in seconds (default 10, max {EXEC_MAX_TIMEOUT_S})"), "max_output_size": _i(f"Maximum output size in bytes (default {EXEC_MAX_OUTPUT})")},
            ["command"], exec_shell_command, write=True, stream=True,
        ),
        Tool(
            "write_file", "Write file", "Write content to a file, creating it (including parent directories) if it does not exist. May use with edit_file for more complex edits.",
            {"path": _s("Path of the file to write"), "content": _s("Content to write")}, ["path", "content"], write_file, write=True,
        ),
        Tool(
            "edit_file", "Edit file",
            "Edit a file using exact text replacement. Each edits[].old_text must be unique in the file and is matched against the original content, not incrementally. "
            "Merge nearby changes into one edit instead of overlapping edits. Use write_file to replace the whole file.",
            {
                "path": _s("Path to the file to edit"),
                "edits": {
                    "type": "array", "description": "One or more exact text replacements to apply",
                    "items": {
                        "type": "object",
                        "properties": {"old_text": _s("Exact text to find; must be unique in the file and must not overlap with other edits"), "new_text": _s("Text to replace old_text with")},
                        "required": ["old_text", "new_text"],
                    },
                },
            },
            ["path", "edits"], edit_file, write=True,
        ),
        Tool("get_info", "Get Runtime Info", "Returns runtime info: the OS name/version and the current working directory", {}, [], get_info),
    ]  # fmt: skip


# ---- the /tools registry and its routes --------------------------------------------------------


class ServerTools:
    """The tools `/tools` lists and runs: the built-in ones `--tools` enables, then each MCP
    server's as `<server>_<tool>` (a name already taken is skipped)."""

    def __init__(self, enabled: list[str], mcp: McpManager | None = None, runtime: str = "") -> None:
        self.mcp = mcp
        known = {t.name: t for t in builtin_tools()}
        for name in enabled:
            if name != "all" and name not in known:
                raise ValueError(f'unknown tool "{name}". available tools: {", ".join(TOOL_NAMES)}')
        self.tools: dict[str, Tool] = {n: t for n, t in known.items() if "all" in enabled or n in enabled}
        self.mcp_tools: dict[str, tuple[str, str]] = {}  # "<server>_<tool>" -> (server, tool)
        if mcp is not None:
            for d in mcp.list_tools():
                name = f"{d.server}_{d.name}"
                if name in self.tools or name in self.mcp_tools:
                    log.warning("MCP tool %r from server %r collides with an existing tool; skipping it", name, d.server)
                    continue
                schema = d.input_schema if isinstance(d.input_schema, dict) else {}
                self.mcp_tools[name] = (d.server, d.name)
                self.tools[name] = Tool(name, name, d.description, {}, [], self._mcp_call(d.server, d.name), kind="mcp", uses_cwd=False, schema=schema)
        self.runtime: ContainerRuntime | None = None
        self.runtime_spec = ""
        if runtime:
            spec = parse_container_spec(runtime)
            if spec is not None and not spec[2]:
                self.runtime = ContainerRuntime(spec[0], spec[1])
            else:
                try:
                    make_io("", runtime)  # a static target: only checked here
                except ToolRequestError as e:
                    raise ValueError(f"--tools-runtime: {e}") from None
                self.runtime_spec = runtime
        # tool calls block (files, commands up to a minute, MCP round trips): their own threads
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="dasllama-tool")

    def _mcp_call(self, server: str, tool: str) -> Callable[[dict[str, Any], HostIO, Any], dict[str, Any]]:
        def call(params: dict[str, Any], io: HostIO, _: Any) -> dict[str, Any]:
            assert self.mcp is not None
            # cwd/runtime/resp_type are this server's plumbing, not the MCP tool's arguments
            args = {k: v for k, v in params.items() if k not in ("cwd", "runtime", "resp_type")}
            return self.mcp.call_tool(server, tool, args)

        return call

    def cards(self) -> list[dict[str, Any]]:
        return [t.card() for t in self.tools.values()]

    def prepare(self, body: dict[str, Any], headers: Any) -> tuple[Tool, dict[str, Any], bool]:
        name = body.get("tool")
        if not isinstance(name, str):
            raise ToolRequestError(400, "'tool' must be a string naming a tool (GET /tools lists them)")
        params = body.get("params", {})
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ToolRequestError(400, "'params' must be an object")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ToolRequestError(400, "'stream' must be a boolean")
        # The working directory and the runtime come from the client (headers) or the operator
        # (--tools-runtime), never from the model's arguments.
        params = {k: v for k, v in params.items() if k not in ("cwd", "runtime", "resp_type")}
        if cwd := headers.get("x-tool-cwd"):
            params["cwd"] = cwd
        if runtime := headers.get("x-tool-runtime"):
            params["runtime"] = runtime
        elif self.runtime is not None:
            params["runtime"] = self.runtime.spec()
        elif self.runtime_spec:
            params["runtime"] = self.runtime_spec
        if resp_type := headers.get("x-resp-type"):
            params["resp_type"] = resp_type
        tool = self.tools.get(name)
        if tool is None:
            raise ToolRequestError(404, f'unknown tool "{name}"')
        if stream and not tool.stream:
            raise ToolRequestError(404, f'tool "{name}" does not support stream = true')
        return tool, params, stream

    @staticmethod
    def invoke(tool: Tool, params: dict[str, Any], push: Callable[[str], bool] | None = None) -> dict[str, Any]:
        io = make_io(params.get("cwd", ""), params.get("runtime", "")) if tool.kind == "server" else HostIO()
        return tool.run(params, io, push)

    def shutdown(self) -> None:
        """The server is stopping: MCP calls in flight return now (safe in a signal handler)."""
        if self.mcp is not None:
            self.mcp.shutdown()

    def close(self) -> None:
        """After the last request: stop the MCP servers and the container this server started."""
        if self.mcp is not None:
            self.mcp.close()
        if self.runtime is not None:
            self.runtime.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


def start_tools(tools: str | None, runtime: str | None, mcp_config: str | None, mcp_json: str | None) -> ServerTools | None:
    """The /tools registry the flags ask for (--tools a,b|all, --tools-runtime, the MCP
    configs), MCP servers already listed; None when none is asked for (/tools answers 403). A
    bad flag or config raises ValueError, saying which."""
    from .mcp import McpManager, load_configs

    enabled = [t.strip() for t in (tools or "").split(",") if t.strip()]
    configs = load_configs(mcp_config, mcp_json)
    if not enabled and not configs:
        if runtime:
            log.warning("--tools-runtime %s has no effect without --tools or MCP servers", runtime)
        return None
    mcp = None
    if configs:
        mcp = McpManager(configs)
        mcp.warmup()
    try:
        st = ServerTools(enabled, mcp, runtime or "")
    except BaseException:
        if mcp is not None:
            mcp.close()
        raise
    log.warning(
        "experimental /tools enabled: %s%s; they run with this server's rights (do not enable on an untrusted network)",
        ", ".join(n for n in st.tools if n not in st.mcp_tools) or "no built-in tools",
        f", {len(st.mcp_tools)} MCP tools from {len(configs)} servers" if configs else "",
    )
    return st


def _error(status: int, message: str) -> JSONResponse:
    types = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
    return JSONResponse({"error": {"code": status, "message": message, "type": types.get(status, "server_error")}}, status_code=status)


def disabled() -> JSONResponse:
    """llama-server's answer on a feature the operator did not turn on."""
    return JSONResponse({"error": {"message": "this feature is disabled", "type": "feature_disabled"}}, status_code=403)


class ToolRoutes:
    """GET /tools (the cards) and POST /tools ({"tool", "params", "stream"}). A tool's own
    failure is a 200 with {"error": "..."} (the model reads it); a request that cannot run is a
    4xx/5xx in llama-server's error shape. /tools answers 403 unless the operator enabled it."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def _denied(self, request: Request) -> JSONResponse | None:
        """The API key's 401, as every data route checks it (the model need not be loaded)."""
        from .app import ApiError
        from .routes import Routes

        try:
            Routes(self.server).check_auth(request)
        except ApiError as e:
            return _error(e.status, e.message)
        return None

    async def get(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        if self.server.tools is None:
            return disabled()
        return JSONResponse(self.server.tools.cards())

    async def post(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        tools = self.server.tools
        if tools is None:
            return disabled()
        from .app import MAX_BODY

        raw = await request.body()
        if len(raw) > MAX_BODY:
            return _error(413, f"the request body exceeds {MAX_BODY} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            return _error(400, f"the request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        try:
            tool, params, stream = tools.prepare(body, request.headers)
        except ToolRequestError as e:
            return _error(e.status, str(e))
        loop = asyncio.get_running_loop()
        if not stream:
            try:
                result = await loop.run_in_executor(tools.pool, tools.invoke, tool, params, None)
            except ToolRequestError as e:
                return _error(e.status, str(e))
            except Exception as e:  # a tool's unexpected failure answers, never kills the server
                log.exception("tool %s failed", tool.name)
                return _error(500, f"tool {tool.name} failed: {e}")
            return JSONResponse(result)
        return StreamingResponse(self._stream(tools, tool, params), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def cors_proxy(self, request: Request) -> Response:
        """/cors-proxy (proxy.py): behind the API key, and 403 unless --ui-mcp-proxy."""
        from .proxy import cors_proxy

        if (denied := self._denied(request)) is not None:
            return denied
        if not self.server.cors_proxy:
            return disabled()
        return await cors_proxy(request)

    @staticmethod
    async def _stream(tools: ServerTools, tool: Tool, params: dict[str, Any]) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        alive = threading.Event()
        alive.set()

        def push(chunk: str) -> bool:
            if chunk:
                loop.call_soon_threadsafe(q.put_nowait, {"chunk": chunk})
            return alive.is_set()  # False stops the command: the client went away

        def work() -> None:
            final: dict[str, Any] = {"done": True}
            try:
                tools.invoke(tool, params, push)
            except Exception as e:  # noqa: BLE001 - reported in the stream's last event
                final["error"] = str(e)
            loop.call_soon_threadsafe(q.put_nowait, final)

        loop.run_in_executor(tools.pool, work)  # work() reports its own end, errors included
        try:
            while True:
                ev = await q.get()
                yield f"data: {json.dumps(ev)}\n\n".encode()
                if ev.get("done"):
                    break
        finally:
            # a client gone mid-stream: the command stops at its next output (or its timeout)
            alive.clear()
