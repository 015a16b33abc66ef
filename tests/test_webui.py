"""The server's own web pages (the chat page and the status page) in a real browser (Playwright
driving Debian's chromium, headless), CORS, and how base models are refused."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

import dasllama as dl
from dasllama.serve import Server, build_app
from dasllama.serve.__main__ import parse_args
from dasllama.serve.status import tier_status
from serverproc import log_text, start, stop

KEY = "ui-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ALLOWED = "http://allowed.example:3000"
COUNT = "Count from 1 to 300, separated by commas."  # SmolLM2 at temperature 0 goes on past 2000 tokens


@pytest.fixture(scope="module")
def served(smollm: dl.Model, gemma: dl.Model) -> Iterator[tuple[subprocess.Popen, str]]:
    proc, base = start("--model", str(smollm.path), "--alias", "smollm", "--model", str(gemma.path), "--alias", "gemma", "--api-key", KEY, "--cors-origin", ALLOWED, "--streams", "4")
    yield proc, base
    assert stop(proc) == 0


@pytest.fixture(scope="module")
def server(served: tuple[subprocess.Popen, str]) -> str:
    return served[1]


def status(base: str, model: str = "smollm") -> dict[str, Any]:
    doc = httpx.get(base + "/status.json", headers=AUTH, timeout=30).json()
    return next(m for m in doc["models"] if m["name"] == model)


def wait_until(cond: Any, timeout: float = 10, what: str = "") -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


# ---- without a browser -------------------------------------------------------------------------


def test_pages_load_without_the_key_and_data_routes_need_it(server: str) -> None:
    for path, kind in (("/", "text/html"), ("/status", "text/html"), ("/static/chat.js", "javascript"), ("/static/markdown.js", "javascript"), ("/static/style.css", "text/css")):
        r = httpx.get(server + path)
        assert r.status_code == 200 and kind in r.headers["content-type"], path
    assert KEY not in httpx.get(server + "/").text
    csp = httpx.get(server + "/status").headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp
    for path in ("/status.json", "/v1/models", "/metrics"):
        assert httpx.get(server + path).status_code == 401, path
        assert httpx.get(server + path, headers=AUTH).status_code == 200, path
    assert httpx.get(server + "/static/nope.js").status_code == 404


def test_status_json_reports_models_counts_and_the_tier(server: str, smollm: dl.Model) -> None:
    doc = httpx.get(server + "/status.json", headers=AUTH).json()
    assert doc["ready"] and doc["gpu"] == "cpu" and doc["tier"]["backend"] == "cpu"
    by = {m["name"]: m for m in doc["models"]}
    assert set(by) == {"smollm", "gemma"} and by["smollm"]["chat"] and not by["gemma"]["chat"]
    s0 = by["smollm"]
    assert s0["memory"]["weights_bytes"] == smollm.path.stat().st_size and doc["rss_bytes"] > s0["memory"]["weights_bytes"] // 2
    assert s0["kv"]["paged"] and s0["kv"]["pages_total"] > 0 and s0["streams"]["max"] == 4
    body = {"model": "smollm", "messages": [{"role": "system", "content": "You are terse. " * 12}, {"role": "user", "content": "Name a colour."}], "max_tokens": 6, "temperature": 0}
    for _ in range(2):  # the second time the prompt comes from the prefix cache
        r = httpx.post(server + "/v1/chat/completions", json=body, headers=AUTH, timeout=60).json()
    s1 = status(server)
    done = sum(s1["requests"].values()) - sum(s0["requests"].values())
    assert done == 2
    assert s1["tokens_out"] - s0["tokens_out"] >= r["usage"]["completion_tokens"]
    assert s1["prefix_cache"]["cached_tokens"] - s0["prefix_cache"]["cached_tokens"] >= r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert 0 < s1["prefix_cache"]["hit_rate"] <= 1
    assert s1["streams"]["active"] == 0 and s1["kv"]["pages_used"] + s1["kv"]["pages_free"] == s1["kv"]["pages_total"]


def test_tier_status_reads_the_gpu_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    from dasllama import gpu

    assert tier_status()["device"] == "cpu"
    st = gpu.GpuTierStatus("vulkan", "lavapipe", True, "", 300 << 20, 2 << 30, 30, 140 << 20, 48 << 20)
    monkeypatch.setattr(gpu, "gpu_tier_status", lambda: st)
    monkeypatch.setattr(gpu, "gpu_cpu_passes", lambda: [gpu.GpuCpuPass(3, "host sessions ran on the CPU")])
    t = tier_status()
    assert (t["backend"], t["device"], t["gpu_cpu_passes"]) == ("vulkan", "lavapipe", {"host sessions ran on the CPU": 3})
    assert t["detail"] == "140 MiB of weights, 48 MiB of K/V on the device"
    monkeypatch.setattr(gpu, "gpu_tier_status", lambda: 1 / 0)
    assert tier_status()["detail"].startswith("gpu_tier_status failed: ZeroDivisionError")


def test_cors_answers_the_allowed_origin_only(server: str) -> None:
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(server + "/v1/chat/completions", headers={"Origin": ALLOWED, **pre})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED
    assert "authorization" in r.headers["access-control-allow-headers"].lower() and "POST" in r.headers["access-control-allow-methods"]
    r = httpx.post(server + "/v1/completions", json={"model": "smollm", "prompt": "Hi", "max_tokens": 2}, headers={"Origin": ALLOWED, **AUTH}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED
    other = "http://elsewhere.example"
    r = httpx.options(server + "/v1/chat/completions", headers={"Origin": other, **pre})
    assert r.status_code == 403 and r.json()["error"]["code"] == "cors_origin_not_allowed" and f"--cors-origin {other}" in r.json()["error"]["message"]
    assert not [h for h in r.headers if h.startswith("access-control-")]
    r = httpx.get(server + "/v1/models", headers={"Origin": other, **AUTH})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_is_off_by_default_and_star_allows_any_origin() -> None:
    pre = {"Origin": "http://any.example", "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    r = TestClient(build_app(Server())).options("/v1/chat/completions", headers=pre)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    r = TestClient(build_app(Server(cors_origins=["*"]))).options("/v1/chat/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert parse_args(["--cors-origin", "*", "--cors-origin", "http://localhost:3000"]).cors_origin == ["*", "http://localhost:3000"]


@pytest.mark.parametrize("origin", ["http://localhost:3000/", "localhost:3000", "http://x.example/app"])
def test_cors_origin_must_be_an_origin(origin: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--cors-origin", origin])
    assert "is not an origin" in capsys.readouterr().err


def test_base_model_says_so_at_start_and_refuses_chat(served: tuple[subprocess.Popen, str]) -> None:
    proc, server = served
    log = log_text(proc)
    assert "'gemma' (gemma-3-270m-q4_k_m.gguf) has no chat template" in log and "/v1/completions" in log
    assert "'smollm'" not in log  # the chat model is not named in a warning
    r = httpx.post(server + "/v1/chat/completions", json={"model": "gemma", "messages": [{"role": "user", "content": "Hi"}]}, headers=AUTH, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "no_chat_template" and "/v1/completions" in err["message"]
    r = httpx.post(server + "/v1/completions", json={"model": "gemma", "prompt": "The sky is", "max_tokens": 3}, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_chat_cli_refuses_a_base_model_plainly(gemma: dl.Model) -> None:
    r = subprocess.run([sys.executable, "-m", "dasllama.chat", "-m", str(gemma.path)], input="Hi\n", capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1
    assert "has no chat template" in r.stderr and "dasllama.generate" in r.stderr
    assert "Traceback" not in r.stderr and "> " not in r.stdout  # said before any prompt is shown


# ---- in the browser ----------------------------------------------------------------------------


def new_page(browser: Any, base: str, key: str | None = KEY) -> Any:
    ctx = browser.new_context(base_url=base)
    if key is not None:
        ctx.add_init_script(f"localStorage.setItem('dasllama.apiKey', {json.dumps(key)})")
    page = ctx.new_page()
    page.set_default_timeout(60_000)
    # The pages' own faults: uncaught exceptions and anything the content security policy blocked.
    # (That policy forbids eval, which Playwright uses for a bare expression given to
    # wait_for_function: the tests give it functions, "() => ...".)
    page.faults = []
    page.on("pageerror", lambda e: page.faults.append(str(e)))
    page.on("console", lambda m: page.faults.append(m.text) if m.type == "error" and "Content Security Policy" in m.text else None)
    return page


def close(page: Any) -> None:
    faults = page.faults
    page.context.close()
    assert not faults, faults


@pytest.fixture
def page(browser: Any, server: str) -> Iterator[Any]:
    p = new_page(browser, server)
    yield p
    close(p)


def open_chat(page: Any, model: str = "smollm", max_tokens: int = 24) -> None:
    page.goto("/")
    page.wait_for_function("() => document.querySelectorAll('#model option').length === 2")
    page.select_option("#model", model)
    page.fill("#temperature", "0")
    page.fill("#max_tokens", str(max_tokens))


def last_reply(page: Any) -> dict[str, Any]:
    return page.evaluate("chatState.messages[chatState.messages.length - 1]")


def test_chat_page_streams_a_reply(page: Any, server: str) -> None:
    open_chat(page)
    question = "What is the capital of France?"
    page.fill("#input", question)
    page.press("#input", "Enter")
    page.wait_for_selector(".msg.assistant[data-state='done']")
    reply = last_reply(page)
    # Streamed: the text arrived in many deltas, and is what the API gives for the same request.
    assert int(page.get_attribute(".msg.assistant", "data-chunks")) > 3
    body = {"model": "smollm", "messages": [{"role": "user", "content": question}], "max_tokens": 24, "temperature": 0}
    want = httpx.post(server + "/v1/chat/completions", json=body, headers=AUTH, timeout=60).json()["choices"][0]["message"]["content"]
    assert reply["content"] == want and reply["usage"]["completion_tokens"] > 3
    shown = page.inner_text(".msg.assistant .content")
    assert all(w in shown for w in re.findall(r"\w+", want)[:5])  # rendered (markdown aside, the same words)
    assert page.is_visible("#send") and not page.is_visible("#stop")


def ask(page: Any, text: str) -> None:
    n = page.evaluate("chatState.messages.length")
    page.fill("#input", text)
    page.press("#input", "Enter")
    page.wait_for_function(f"() => chatState.messages.length === {n + 2} && chatState.messages[{n + 1}].state !== 'streaming'")


def test_conversations_are_kept_in_the_browser(page: Any) -> None:
    open_chat(page, max_tokens=4)
    ask(page, "Name a fruit.")
    ask(page, "Another one?")
    page.click("#new-chat")
    assert page.evaluate("chatState.messages.length") == 0
    ask(page, "Name a colour.")
    page.reload()
    page.wait_for_selector("#conversations li >> nth=1")
    assert page.inner_text("#conversations li[aria-current] .open") == "Name a colour."
    titles = page.eval_on_selector_all("#conversations .open", "b => b.map(x => x.textContent)")
    assert titles == ["Name a colour.", "Name a fruit."]
    page.click("#conversations li:not([aria-current]) .open")
    assert page.eval_on_selector_all(".msg.user", "m => m.map(x => x.textContent)") == ["Name a fruit.", "Another one?"]
    assert page.evaluate("chatState.messages[3].state") == "done"
    page.click("#conversations li[aria-current] .delete")
    assert page.eval_on_selector_all("#conversations .open", "b => b.map(x => x.textContent)") == ["Name a colour."]
    assert page.evaluate("chatState.messages.length") == 0


def test_stop_button_cancels_the_request_on_the_server(page: Any, server: str) -> None:
    before = status(server)
    open_chat(page, max_tokens=2000)
    page.fill("#input", COUNT)
    page.press("#input", "Enter")
    page.wait_for_function("() => chatState.messages.length === 2 && chatState.messages[1].content.length > 20")
    assert status(server)["streams"]["active"] == 1
    page.click("#stop")
    page.wait_for_selector(".msg.assistant[data-state='stopped']")
    wait_until(lambda: status(server)["streams"]["active"] == 0, 10, "the server to drop the stopped stream")
    after = status(server)
    assert after["requests"].get("cancelled", 0) == before["requests"].get("cancelled", 0) + 1
    produced = after["tokens_out"] - before["tokens_out"]
    assert produced < 2000 and len(last_reply(page)["content"]) > 20
    time.sleep(0.5)
    assert status(server)["tokens_out"] == after["tokens_out"]  # nothing more is generated for it
    assert "stopped" in page.inner_text(".msg.assistant .meta")


def test_status_page_moves_under_load(page: Any, server: str) -> None:
    page.goto("/status")
    card = "section[data-model='smollm']"
    val = f"document.querySelector(\"{card} [data-field='%s']\").textContent"
    page.wait_for_selector(f"{card} [data-field='active']:text('0 / 4')")
    n0 = int(page.inner_text(f"{card} [data-field='tokens_out']"))
    cancelled = status(server)["requests"].get("cancelled", 0)
    # The load runs until the page has seen it, however slow the machine, then hangs up.
    seen, got = threading.Event(), []

    def load() -> None:
        body = {"model": "smollm", "prompt": "1, 2, 3, 4,", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            got.append(r.status_code)
            for _ in r.iter_lines():
                if seen.is_set():
                    break

    t = threading.Thread(target=load)
    t.start()
    try:
        page.wait_for_function(f"() => {val % 'active'}.startsWith('1 /') && parseFloat({val % 'tokens_per_s'}) > 0 && parseInt({val % 'tokens_out'}) > {n0}", timeout=30_000)
        assert page.inner_text(f"{card} [data-field='tier']") == "cpu on cpu" and "gpu: cpu" in page.inner_text("#server-line")
        kv = page.inner_text(f"{card} [data-field='kv']")
        assert kv.count("/") == 2 and int(kv.split("/")[0]) > 0  # the running stream holds pages
    finally:
        seen.set()
        t.join()
    assert got == [200]
    page.wait_for_function(f"() => {val % 'active'}.startsWith('0 /') && {val % 'requests'}.includes('cancelled {cancelled + 1}')", timeout=15_000)


def test_api_key_entered_on_the_pages(browser: Any, server: str) -> None:
    page = new_page(browser, server, key=None)
    try:
        page.goto("/status")
        page.wait_for_selector("#key-box:not([hidden])")
        assert "API key" in page.inner_text("#key-msg")
        assert page.evaluate("fetch('status.json').then(r => r.status)") == 401
        page.fill("#key-box #api-key", KEY)
        page.click("#key-box button")
        page.wait_for_selector("section[data-model='smollm'] [data-field='active']:text('/ 4')")
        page.evaluate("localStorage.removeItem('dasllama.apiKey')")
        page.goto("/")
        page.wait_for_selector("#model-note.error")
        assert "API key" in page.inner_text("#model-note") and page.eval_on_selector_all("#model option", "o => o.length") == 0
        page.fill("#api-key", "wrong")
        page.dispatch_event("#api-key", "change")
        page.wait_for_function("() => document.querySelector('#model-note').textContent.includes('wrong API key')")
        page.fill("#api-key", KEY)
        page.dispatch_event("#api-key", "change")
        page.wait_for_function("() => document.querySelectorAll('#model option').length === 2")
        assert page.evaluate("localStorage.getItem('dasllama.apiKey')") == KEY
        page.fill("#max_tokens", "4")
        page.fill("#input", "Hi")
        page.press("#input", "Enter")
        page.wait_for_selector(".msg.assistant[data-state='done']")
        assert last_reply(page)["content"] and not last_reply(page).get("error")
    finally:
        close(page)


def test_base_model_error_shows_on_the_chat_page(page: Any) -> None:
    open_chat(page, model="gemma")
    page.fill("#input", "Hi")
    page.press("#input", "Enter")
    page.wait_for_selector(".msg.assistant[data-state='error']")
    assert "base model" in page.inner_text(".msg.assistant .meta") and "/v1/completions" in page.inner_text(".msg.assistant .meta")


def test_reasoning_shown_apart_and_markdown_rendered_safely(page: Any) -> None:
    def sse(delta: dict[str, Any], finish: str | None = None) -> str:
        return "data: " + json.dumps({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

    answer = "**Paris** is it. <script>window.pwned = 1</script><img src=x onerror='window.pwned = 2'>\n\n```py\nprint(1 < 2)\n```\n\n- [bad](javascript:alert(1))\n- [ok](https://example.com/a_b_c) `x_y_z`\n"
    # A thinking model's stream, as the server will send it once such a family is served.
    events = sse({"role": "assistant", "content": ""}) + sse({"reasoning_content": "Let me "}) + sse({"reasoning_content": "think."})
    events += "".join(sse({"content": answer[i : i + 7]}) for i in range(0, len(answer), 7)) + sse({}, "stop") + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=events))
    open_chat(page)
    page.fill("#input", "Where?")
    page.press("#input", "Enter")
    page.wait_for_selector(".msg.assistant[data-state='done']")
    msg = ".msg.assistant"
    assert page.is_visible(f"{msg} .reasoning") and page.text_content(f"{msg} .reasoning-text") == "Let me think."
    assert "think" not in page.inner_text(f"{msg} .content")
    assert page.inner_text(f"{msg} .content strong") == "Paris"
    assert page.inner_text(f"{msg} .content pre code") == "print(1 < 2)"
    assert page.evaluate("window.pwned") is None
    assert page.eval_on_selector_all(f"{msg} .content script, {msg} .content img", "e => e.length") == 0
    assert "<script>" in page.inner_text(f"{msg} .content")  # shown as text
    hrefs = page.eval_on_selector_all(f"{msg} .content a", "a => a.map(x => x.getAttribute('href'))")
    assert hrefs == ["https://example.com/a_b_c"]
    assert page.inner_text(f"{msg} .content li code") == "x_y_z"
