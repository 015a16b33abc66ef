"""llama-server's agent routes: the built-in tools at /tools (files, search, shell, isolates), MCP
servers over stdio behind them, and the /cors-proxy; in-process over ASGI (no model needed),
plus dasllama-server's flags in real processes."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from dasllama.serve import Server
from dasllama.serve.mcp import McpConfigError, McpManager, load_configs, parse_config
from dasllama.serve.tools_builtin import (
    HostIO,
    ServerTools,
    ToolRequestError,
    edit_file,
    file_glob_search,
    glob_match,
    grep_search,
    make_io,
    path_glob_match,
    read_file,
    run_subprocess,
    start_tools,
)
from serverproc import free_port

# A small MCP server: echo, a tool that fails as MCP says (isError), one that sleeps, one that
# exits; a progress notification before every reply, and the reply and notification sometimes in
# one write.
MCP_SERVER = textwrap.dedent(
    """
    import json, os, sys, time
    TOOLS = [
        {"name": "echo", "description": "Echo", "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}},
        {"name": "oops", "description": "Fails", "inputSchema": {"type": "object", "properties": {}}},
        {"name": "sleep", "description": "Sleeps", "inputSchema": {"type": "object", "properties": {"s": {"type": "number"}}}},
        {"name": "die", "description": "Exits", "inputSchema": {"type": "object", "properties": {}}},
    ]
    def out(obj):
        os.write(1, (json.dumps(obj) + "\\n").encode())
    for line in sys.stdin:
        req = json.loads(line)
        rid, method, params = req.get("id"), req.get("method"), req.get("params") or {}
        if rid is None:
            continue
        if method == "initialize":
            out({"jsonrpc": "2.0", "id": rid, "result": {"protocolVersion": "2024-11-05", "capabilities": {"tools": {}}, "serverInfo": {"name": "t", "version": "1"}}})
        elif method == "tools/list":
            out({"jsonrpc": "2.0", "id": rid, "result": {"tools": TOOLS}})
        elif method == "tools/call":
            name, args = params["name"], params.get("arguments") or {}
            if name == "echo":
                notif = {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}}
                reply = {"jsonrpc": "2.0", "id": rid, "result": {"content": [{"type": "text", "text": "pid " + str(os.getpid())}, {"type": "text", "text": "echo: " + args.get("message", "")}]}}
                os.write(1, (json.dumps(notif) + "\\n" + json.dumps(reply) + "\\n").encode())
            elif name == "oops":
                out({"jsonrpc": "2.0", "id": rid, "result": {"isError": True, "content": [{"type": "text", "text": "it broke"}]}})
            elif name == "sleep":
                time.sleep(args.get("s", 1))
                out({"jsonrpc": "2.0", "id": rid, "result": {"content": [{"type": "text", "text": "slept"}]}})
            elif name == "die":
                os._exit(3)
            else:
                out({"jsonrpc": "2.0", "id": rid, "error": {"code": -32602, "message": "Unknown tool: " + name}})
    """
)


@pytest.fixture(scope="module")
def mcp_script(tmp_path_factory: pytest.TempPathFactory) -> str:
    p = tmp_path_factory.mktemp("mcp") / "mcp_test_server.py"
    p.write_text(MCP_SERVER)
    return str(p)


def mcp_json(script: str, **extra: Any) -> str:
    return json.dumps({"mcpServers": {"t": {"command": sys.executable, "args": [script], **extra}}})


# ---- the tools themselves -----------------------------------------------------------------------


def test_glob_matching_as_llama_cpp() -> None:
    cases = [
        ("*.py", "a.py", True), ("*.py", "dir/a.py", False), ("**/*.py", "dir/sub/a.py", True), ("**", "x/y", True),
        ("a?c", "abc", True), ("a?c", "a/c", False), ("[a-c]x", "bx", True), ("[!a-c]x", "bx", False), ("[]]", "]", True),
    ]  # fmt: skip
    for pattern, s, want in cases:
        assert glob_match(pattern, s) is want, (pattern, s)
    # no '/': the basename at any depth; with '/': the whole path, anchored at any depth
    assert path_glob_match("*.cpp", "src/deep/main.cpp")
    assert path_glob_match("src/*.cpp", "lib/src/main.cpp")
    assert not path_glob_match("/src/*.cpp", "lib/src/main.cpp")


def test_read_file_ranges_limits_and_base64(tmp_path: Path) -> None:
    f = tmp_path / "f.txt"
    f.write_text("one\ntwo\nthree\n")
    io = HostIO(str(tmp_path))
    assert read_file({"path": "f.txt"}, io, None) == {"plain_text_response": "one\ntwo\nthree\n"}
    assert read_file({"path": "f.txt", "start_line": 2, "end_line": 2, "append_loc": True}, io, None) == {"plain_text_response": "2\u2192two\n"}
    assert read_file({"path": "f.txt", "resp_type": "base64"}, io, None)["size_bytes"] == 14
    big = tmp_path / "big.txt"
    big.write_text("x" * 100 + "\n" + "y" * 20000 + "\n")
    assert "file too large" in read_file({"path": "big.txt"}, io, None)["error"]
    # a line range lifts the whole-file limit, but the answer is still capped
    assert read_file({"path": "big.txt", "end_line": 1}, io, None)["plain_text_response"] == "x" * 100 + "\n"
    assert read_file({"path": "big.txt", "end_line": 2}, io, None)["plain_text_response"].endswith("[output truncated]")
    assert "cannot stat" in read_file({"path": "nope.txt"}, io, None)["error"]
    with pytest.raises(ToolRequestError) as e:
        read_file({}, io, None)
    assert e.value.status == 400 and "'path'" in str(e.value)


def test_glob_search_and_grep(tmp_path: Path) -> None:
    (tmp_path / "src" / "deep").mkdir(parents=True)
    (tmp_path / "node_modules" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "a.py").write_text("import os\nneedle = 1\n")
    (tmp_path / "src" / "deep" / "b.py").write_text("needle = 2\nneedle = 3\n")
    (tmp_path / "node_modules" / "pkg" / "c.py").write_text("needle = 4\n")
    io = HostIO()
    r = file_glob_search({"path": str(tmp_path), "include": "*.py"}, io, None)
    assert sorted(e["path"] for e in r["entries"]) == ["src/a.py", "src/deep/b.py"]  # junk dirs are not walked
    assert r["base"] == str(tmp_path)
    r = file_glob_search({"path": str(tmp_path), "type": "dir", "max_depth": 1}, io, None)
    assert sorted(e["path"] for e in r["entries"]) == ["node_modules", "src"]
    assert "invalid limit" in file_glob_search({"path": str(tmp_path), "limit": 0}, io, None)["error"]
    r = grep_search({"path": str(tmp_path), "pattern": r"needle = \d", "return_line_numbers": True}, io, None)
    text = r["plain_text_response"]
    assert "src/a.py:2:needle = 1" in text and "src/deep/b.py:2:needle = 3" in text and "Total matches: 3" in text
    r = grep_search({"path": str(tmp_path / "src" / "a.py"), "pattern": "os", "context_lines": 1}, io, None)
    assert "a.py:1:import os\n" in r["plain_text_response"] and "a.py-2-needle = 1\n" in r["plain_text_response"]
    assert "invalid regex" in grep_search({"path": str(tmp_path), "pattern": "("}, io, None)["error"]
    assert "does not exist" in grep_search({"path": str(tmp_path / "missing"), "pattern": "x"}, io, None)["error"]


def test_edit_file_exact_fuzzy_unique_and_overlap(tmp_path: Path) -> None:
    f = tmp_path / "e.txt"
    io = HostIO()
    f.write_text("alpha\nbeta  \ngamma \u201cq\u201d\n")
    # typographic quotes and trailing blanks in the file still match what a model typed
    r = edit_file({"path": str(f), "edits": [{"old_text": 'gamma "q"', "new_text": "GAMMA"}]}, io, None)
    assert r["edits_applied"] == 1
    assert f.read_text() == "alpha\nbeta  \nGAMMA\n"  # the untouched line keeps its trailing blanks
    f.write_text("dup\ndup\n")
    assert "unique" in edit_file({"path": str(f), "edits": [{"old_text": "dup", "new_text": "x"}]}, io, None)["error"]
    f.write_text("line1\nline2\n")
    assert "overlap" in edit_file({"path": str(f), "edits": [{"old_text": "line1\nline2", "new_text": "a"}, {"old_text": "line2", "new_text": "b"}]}, io, None)["error"]
    assert "could not find" in edit_file({"path": str(f), "edits": [{"old_text": "zzz", "new_text": "a"}]}, io, None)["error"]
    assert "identical" in edit_file({"path": str(f), "edits": [{"old_text": "line1", "new_text": "line1"}]}, io, None)["error"]
    assert f.read_text() == "line1\nline2\n"


def test_commands_time_out_with_their_children_and_cap_output() -> None:
    t0 = time.monotonic()
    # the pipeline's children hold the output pipe open: they must die with the shell
    r = run_subprocess(["sh", "-c", "sleep 30 | cat; echo never"], 1000, 0.5)
    assert r.timed_out and "never" not in r.output and time.monotonic() - t0 < 10
    r = run_subprocess(["sh", "-c", "yes | head -c 100000"], 1000, 10)
    assert r.exit_code == 0 and r.output.endswith("\n[output truncated]") and len(r.output) < 1100


def test_isolate_identifiers_cannot_become_options() -> None:
    for runtime, msg in (("ssh:-oProxyCommand=touch /tmp/x", "invalid ssh target"), ("docker-container:--privileged", "invalid container id"), ("podman-container:", "invalid container id"),
                         ("docker:busybox", "must name a running container"), ("fake:x", "unknown tool runtime")):  # fmt: skip
        with pytest.raises(ToolRequestError) as e:
            make_io("", runtime)
        assert e.value.status == 500 and msg in str(e.value)
    # what a good id and target build: the command after the id / as one quoted word
    assert make_io("/w", "docker-container:abc123").build_argv(["cat", "x y"], True) == ["docker", "exec", "-i", "abc123", "cat", "x y"]  # type: ignore[attr-defined]
    assert make_io("", "ssh:user@host").build_argv(["cat", "x y"], False)[-2:] == ["user@host", "cat 'x y'"]  # type: ignore[attr-defined]


def test_container_runtime_through_a_fake_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `docker` here is a script: `run` writes a container id and waits on its stdin like the real
    # container's shell; `exec [-i] ID cmd...` runs cmd locally. The tools' argv goes through it.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    engine = bin_dir / "docker"
    engine.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {tmp_path}/calls\n'
        'if [ "$1" = run ]; then echo cafe1234 > "$5"; cat > /dev/null; exit 0; fi\n'
        'shift; [ "$1" = -i ] && shift; shift; exec "$@"\n'
    )
    engine.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    st = ServerTools(["all"], runtime="docker:busybox")
    try:
        assert st.runtime is not None and st.runtime.container_id == "cafe1234"
        tool, params, _ = st.prepare({"tool": "write_file", "params": {"path": str(tmp_path / "o.txt"), "content": "via container"}}, {})
        assert params["runtime"] == "docker-container:cafe1234"
        assert st.invoke(tool, params)["result"] == "file written successfully"
        assert (tmp_path / "o.txt").read_text() == "via container"
        tool, params, _ = st.prepare({"tool": "exec_shell_command", "params": {"command": "echo in-box"}}, {"x-tool-cwd": str(tmp_path)})
        assert "in-box" in st.invoke(tool, params)["plain_text_response"]
        (tmp_path / "bin.dat").write_bytes(bytes(range(256)))
        tool, params, _ = st.prepare({"tool": "read_file", "params": {"path": str(tmp_path / "bin.dat")}}, {"x-resp-type": "base64"})
        assert base64.b64decode(st.invoke(tool, params)["base64"]) == bytes(range(256))  # bytes intact through `cat`
        calls = (tmp_path / "calls").read_text()
        assert "exec -i cafe1234 sh -c" in calls and "timeout 10s sh -c echo in-box" in calls
        proc = st.runtime.proc
    finally:
        st.close()
    assert proc is not None and proc.poll() == 0  # its stdin closed: the container's shell ended


def test_unknown_tool_names_are_refused() -> None:
    with pytest.raises(ValueError, match=r'unknown tool "rm_rf"\. available tools: read_file'):
        start_tools("read_file,rm_rf", None, None, None)
    assert start_tools(None, None, None, None) is None
    st = start_tools("read_file,get_info", None, None, None)
    assert st is not None and list(st.tools) == ["read_file", "get_info"]
    st.close()


# ---- MCP --------------------------------------------------------------------------------------


def test_mcp_config_forms_and_errors(tmp_path: Path) -> None:
    cfgs = parse_config(json.dumps({"mcpServers": {"a": {"command": "x", "args": ["1"], "env": {"K": "v"}, "timeout_ms": 5}, "nocmd": {"args": []}}}), "test")
    assert [(c.name, c.args, c.env, c.timeout_ms) for c in cfgs] == [("a", ["1"], {"K": "v"}, 5)]
    assert parse_config("{}", "test") == []
    with pytest.raises(McpConfigError, match="not valid JSON"):
        parse_config("not json", "--mcp-servers-json")
    with pytest.raises(McpConfigError, match="timeout_ms"):
        parse_config(json.dumps({"mcpServers": {"a": {"command": "x", "timeout_ms": "soon"}}}), "t")
    with pytest.raises(McpConfigError, match="cannot read the MCP config file"):
        load_configs(str(tmp_path / "missing.json"), None)
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"mcpServers": {"a": {"command": "from-file"}}}))
    both = load_configs(str(f), json.dumps({"mcpServers": {"a": {"command": "inline"}, "b": {"command": "y"}}}))
    assert [(c.name, c.command) for c in both] == [("a", "from-file"), ("b", "y")]  # a name given twice: the first


def test_mcp_tools_calls_errors_respawn_and_cancel(mcp_script: str) -> None:
    st = start_tools(None, None, None, mcp_json(mcp_script, timeout_ms=700))
    assert st is not None and st.mcp is not None
    try:
        cards = {c["tool"]: c for c in st.cards()}
        assert set(cards) == {"t_echo", "t_oops", "t_sleep", "t_die"}
        assert cards["t_echo"]["type"] == "mcp"
        assert cards["t_echo"]["definition"]["function"]["parameters"]["required"] == ["message"]

        def call(name: str, **params: Any) -> dict[str, Any]:
            tool, p, _ = st.prepare({"tool": name, "params": params}, {"x-tool-cwd": "/tmp"})
            return st.invoke(tool, p)

        first = call("t_echo", message="hi")["plain_text_response"]
        assert first.endswith("\necho: hi")  # the notification before it is skipped
        assert call("t_echo", message="again")["plain_text_response"].split("\n")[0] == first.split("\n")[0]  # the same process
        assert call("t_oops") == {"error": "it broke"}
        assert "request timed out" in call("t_sleep", s=1)["error"]
        # the late reply of the timed-out call is not taken for the next call's
        assert call("t_echo", message="after")["plain_text_response"].endswith("echo: after")
        assert "error" in call("t_die")
        again = call("t_echo", message="respawned")["plain_text_response"]
        assert again.endswith("echo: respawned") and again.split("\n")[0] != first.split("\n")[0]
        # stopping cancels a call in flight at once
        t = threading.Timer(0.3, st.shutdown)
        t.start()
        t0 = time.monotonic()
        tool, p, _ = st.prepare({"tool": "t_sleep", "params": {"s": 0.6}}, {})
        assert st.invoke(tool, p) in ({"error": "cancelled"}, {"error": "request timed out"})
        assert time.monotonic() - t0 < 0.65
    finally:
        st.close()


def test_mcp_server_that_cannot_start_leaves_the_others(mcp_script: str) -> None:
    cfg = json.dumps({"mcpServers": {"bad": {"command": "/nonexistent/mcp-server"}, "good": {"command": sys.executable, "args": [mcp_script]}}})
    mgr = McpManager(load_configs(None, cfg))
    mgr.warmup()
    try:
        assert {d.server for d in mgr.list_tools()} == {"good"}
        assert mgr.call_tool("bad", "x", {}) == {"error": "MCP server unavailable: bad"}
    finally:
        mgr.close()


# ---- the routes, in-process --------------------------------------------------------------------


def in_process(server: Server, *calls: Any) -> list[httpx.Response]:
    from dasllama.serve import build_app

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=build_app(server))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as c:
            return [await call(c) for call in calls]

    return asyncio.run(go())


@pytest.fixture
def target() -> Iterator[ThreadingHTTPServer]:
    """A plain HTTP server that records what reached it and answers with its path's status."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.server.seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, self.rfile.read(int(self.headers.get("content-length") or 0))))  # type: ignore[attr-defined]
            if self.path.startswith("/moved"):
                self.send_response(302)
                self.send_header("Location", "/json")
                self.end_headers()
                return
            status = 204 if self.path.startswith("/empty") else 200
            self.send_response(status)
            if status == 200:
                self.send_header("Content-Type", "application/json")
                self.send_header("Access-Control-Allow-Origin", "*")
                self.end_headers()
                self.wfile.write(b'{"ok": true}')
            else:
                self.end_headers()

        do_GET = do_POST = _answer

        def log_message(self, *a: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.seen = []  # type: ignore[attr-defined]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_routes_are_403_until_enabled_and_behind_the_key() -> None:
    server = Server(api_key="k")
    r = in_process(server, lambda c: c.get("/tools", headers={"Authorization": "Bearer k"}), lambda c: c.get("/cors-proxy?url=http://x/", headers={"Authorization": "Bearer k"}), lambda c: c.get("/tools"))
    assert [x.status_code for x in r] == [403, 403, 401]
    assert r[0].json()["error"]["type"] == "feature_disabled"


def test_tools_route_calls_streams_and_errors(tmp_path: Path) -> None:
    server = Server()
    server.tools = ServerTools(["all"])
    (tmp_path / "in.txt").write_text("content\n")
    hdr = {"x-tool-cwd": str(tmp_path)}
    try:
        r = in_process(
            server,
            lambda c: c.get("/tools"),
            lambda c: c.post("/tools", json={"tool": "read_file", "params": {"path": "in.txt", "cwd": "/elsewhere"}}, headers=hdr),
            lambda c: c.post("/tools", json={"tool": "exec_shell_command", "params": {"command": "echo one; echo two >&2; exit 3"}, "stream": True}, headers=hdr),
            lambda c: c.post("/tools", json={"tool": "read_file", "params": {"path": "missing"}}),
            lambda c: c.post("/tools", json={"tool": "nope", "params": {}}),
            lambda c: c.post("/tools", json={"tool": "read_file", "params": {}, "stream": True}),
            lambda c: c.post("/tools", json={"tool": "read_file"}),
            lambda c: c.post("/tools", content=b"{bad"),
            lambda c: c.post("/tools", json={"tool": "get_info"}, headers={"x-tool-runtime": "fake:x"}),
        )
        assert [t["tool"] for t in r[0].json()] == ["read_file", "file_glob_search", "grep_search", "exec_shell_command", "write_file", "edit_file", "get_info"]
        assert r[1].json() == {"plain_text_response": "content\n"}  # the header's cwd, not the model's
        events = [json.loads(ln[6:]) for ln in r[2].text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == {"done": True}
        out = "".join(e["chunk"] for e in events[:-1])
        assert "one\n" in out and "two\n" in out and out.endswith("[exit code: 3]")
        assert r[3].status_code == 200 and "cannot stat" in r[3].json()["error"]  # the tool's own failure
        assert [x.status_code for x in r[4:]] == [404, 404, 400, 400, 500]
        assert "unknown tool runtime" in r[8].json()["error"]["message"]
    finally:
        server.tools.close()


def test_cors_proxy_forwards_only_named_headers(target: ThreadingHTTPServer) -> None:
    server = Server(api_key="k")
    server.cors_proxy = True
    base = f"http://127.0.0.1:{target.server_port}"
    hdr = {"Authorization": "Bearer k", "Cookie": "s=1", "X-Api-Key": "k", "x-llama-server-proxy-header-authorization": "Bearer theirs"}
    r = in_process(
        server,
        lambda c: c.get(f"/cors-proxy?url={base}/json?q=1", headers=hdr),
        lambda c: c.post(f"/cors-proxy?url={base}/empty", content=b"payload", headers=hdr),
        lambda c: c.get(f"/cors-proxy?url={base}/moved", headers=hdr),
        lambda c: c.get("/cors-proxy?url=file:///etc/passwd", headers=hdr),
        lambda c: c.get("/cors-proxy?url=http://user:pw@127.0.0.1/", headers=hdr),
        lambda c: c.get(f"/cors-proxy?url=http://127.0.0.1:{free_port()}/", headers=hdr),
    )
    assert r[0].status_code == 200 and r[0].json() == {"ok": True} and r[0].headers["content-type"] == "application/json"
    assert "access-control-allow-origin" not in r[0].headers  # the target's CORS is not this server's
    method, path, headers, _ = target.seen[0]  # type: ignore[attr-defined]
    assert (method, path, headers["authorization"]) == ("GET", "/json?q=1", "Bearer theirs")
    assert "cookie" not in headers and "x-api-key" not in headers
    assert r[1].status_code == 204 and r[1].content == b"" and target.seen[1][3] == b"payload"  # type: ignore[attr-defined]
    assert r[2].status_code == 200 and target.seen[-1][1] == "/json"  # type: ignore[attr-defined]
    assert [x.status_code for x in r[3:]] == [400, 400, 502]


# ---- dasllama-server's flags, real processes --------------------------------------------------


def test_llama_server_refuses_bad_tool_configs() -> None:
    import dasllama as dl

    model = str(dl.fetch("smollm2-135m-instruct"))  # its path only: the configs fail before any load
    for flags, needle in ((["--mcp-servers-json", "not valid json"], "not valid JSON"), (["--mcp-servers-config", "/nonexistent/mcp.json"], "cannot read the MCP config file"), (["--tools", "bogus"], 'unknown tool "bogus"')):
        p = subprocess.run([sys.executable, "-m", "dasllama.serve.llama_server", "-m", model, "--port", str(free_port()), *flags], check=False, capture_output=True, text=True, timeout=60)
        assert p.returncode != 0 and needle in p.stderr, p.stderr[-2000:]


def test_llama_server_flags_and_cors_default() -> None:
    from dasllama.serve.llama_server import translate

    args, opts = translate(["-m", "x.gguf", "--tools", "read_file", "--mcp-servers-json", "{}", "--ui-mcp-proxy"])
    assert (args.tools, args.mcp_servers_json, args.ui_mcp_proxy) == ("read_file", "{}", True)
    assert opts.llama_cors == ["localhost"]  # tools on: loopback pages only, unless the operator says
    _, opts = translate(["-m", "x.gguf", "--tools", "all", "--cors-origins", "http://a.example"])
    assert opts.llama_cors == ["http://a.example"]
    args, opts = translate(["-m", "x.gguf", "--agent"])
    assert (args.tools, args.ui_mcp_proxy, opts.llama_cors) == ("all", True, ["localhost"])
    _, opts = translate(["-m", "x.gguf"])
    assert opts.llama_cors == ["*"]
