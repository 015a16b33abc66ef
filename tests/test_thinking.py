"""Thinking turns with Qwen3's own chat template (tests/golden/qwen3_chat_template.jinja, as
Qwen3 GGUFs embed it) in a synthetic file: thinking on and off render as `apply_chat_template`
renders them; the nothink guard splits a leading thought and stops a late one; the server returns
a leading thought as `reasoning_content`, streamed too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import drain

import dasllama as dl
from serverproc import start, stop
from synthetic import write_scripted_model

TEMPLATE = (Path(__file__).parent / "golden" / "qwen3_chat_template.jinja").read_text()
SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def model(tmp_path: Path, script: dict[str, str]) -> dl.Model:
    p = tmp_path / "qwen3ish.gguf"
    write_scripted_model(p, SPECIALS, script, TEMPLATE)
    m = dl.load_model(p)
    return m


# After the generation prompt's "\n": a thought, then the answer "at", then the turn's end.
THINKS = {"<0x0A>": "<think>", "<think>": "\u2581the", "\u2581the": "</think>", "</think>": "\u2581cat", "\u2581cat": "at", "at": "<|im_end|>"}
# A model that answers, then starts to think where it should not.
LATE = {"<0x0A>": "\u2581cat", "\u2581cat": "<think>", "<think>": "at", "at": "<|im_end|>"}


def test_renders_as_apply_chat_template(tmp_path: Path) -> None:
    m = model(tmp_path, THINKS)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nyo"}, {"role": "user", "content": "more"}]
    on = dl.render_chat(m, msgs)
    # An earlier assistant turn loses its thought; the generation prompt opens the reply.
    assert on == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    assert dl.render_chat(m, msgs, enable_thinking=False) == on + "<think>\n\n</think>\n\n"
    assert dl.render_chat(m, msgs, enable_thinking=True) == on


def test_guard_only_on_a_thinking_off_turn(tmp_path: Path) -> None:
    m = model(tmp_path, THINKS)
    chat = dl.create_chat_renderer(m)
    dl.add_user(chat, "hi")
    assert dl.make_nothink_guard(chat) is None  # the template's default: it thinks
    dl.set_thinking(chat, False)
    g = dl.make_nothink_guard(chat)
    assert g is not None and len(g.open_ids) == 1 and len(g.close_ids) == 1
    assert dl.decode(m, list(g.open_ids)) == "<think>" and dl.decode(m, list(g.close_ids)) == "</think>"
    dl.set_thinking(chat, True)
    assert dl.make_nothink_guard(chat) is None


def run(m: dl.Model, chat: dl.ChatRenderer) -> tuple[str, list[dl.SchedEvent]]:
    sch = dl.create_scheduler(m, 2)
    req = dl.PendingReq(id=1, prompt=dl.render_turn(m, chat), stop_ids=dl.turn_stop_ids(chat), max_new=12, nothink=dl.make_nothink_guard(chat))
    assert dl.submit(m, sch, req)
    evs = drain(m, sch)
    return "".join(e.text for e in evs if e.kind == "piece"), evs


def test_scheduler_lets_a_leading_thought_through_and_the_reader_splits_it(tmp_path: Path) -> None:
    m = model(tmp_path, THINKS)
    chat = dl.create_chat_renderer(m)
    dl.add_user(chat, "hi")
    dl.set_thinking(chat, False)
    text, evs = run(m, chat)
    assert text == "<think> the</think> catat", text
    assert evs[-1].finish == "stop"
    assert dl.split_reasoning(text) == (" the", " catat")


def test_scheduler_stops_a_thought_after_content(tmp_path: Path) -> None:
    m = model(tmp_path, LATE)
    chat = dl.create_chat_renderer(m)
    dl.add_user(chat, "hi")
    dl.set_thinking(chat, False)
    text, evs = run(m, chat)
    assert text == " cat" and evs[-1].finish == "stop", (text, evs[-1].finish)
    # Thinking on: no guard, the marker is just text.
    dl.set_thinking(chat, True)
    text, _ = run(m, chat)
    assert text.startswith(" cat<think>at"), text


@pytest.mark.parametrize("size", [1, 2, 3, 5, 100])
def test_splitter_holds_partial_markers(size: int) -> None:
    reply = "\n<think>\nweighing it\n</think>\n\nThe answer</thi"
    sp = dl.ThoughtSplitter()
    r, c = "", ""
    for i in range(0, len(reply), size):
        a, b = sp.feed(reply[i : i + size])
        r, c = r + a, c + b
    a, b = sp.finish()
    assert (r + a, c + b) == ("\nweighing it\n", "The answer</thi")
    assert dl.split_reasoning("no thought here") == ("", "no thought here")
    assert dl.split_reasoning("<think>cut off") == ("cut off", "")
    assert dl.split_reasoning("still thinking</think>\n\nok", in_thought=True) == ("still thinking", "ok")


# --- through the real HTTP server: `reasoning_content`, `enable_thinking`, `reasoning_effort` ---


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, dl.Model]]]:
    d = tmp_path_factory.mktemp("thinking-server")
    models = {}
    for name, script in (("thinks", THINKS), ("late", LATE)):
        write_scripted_model(d / f"{name}.gguf", SPECIALS, script, TEMPLATE)
        models[name] = dl.load_model(d / f"{name}.gguf")
    proc, base = start("--model", str(d / "thinks.gguf"), "--alias", "thinks", "--model", str(d / "late.gguf"), "--alias", "late", "--streams", "2")
    yield base, models
    assert stop(proc) == 0


MSGS = [{"role": "user", "content": "hi"}]


def chat(base: str, model: str, **extra: object) -> dict:
    r = httpx.post(base + "/v1/chat/completions", json={"model": model, "messages": MSGS, "max_tokens": 12, "temperature": 0, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def chat_stream(base: str, model: str, **extra: object) -> tuple[str, str, str, list[str]]:
    """(reasoning, content, finish reason, which field each delta carried in order)."""
    body = {"model": model, "messages": MSGS, "max_tokens": 12, "temperature": 0, "stream": True, **extra}
    reasoning, content, finish, order = "", "", "", []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])["choices"][0]
            delta = ch["delta"]
            if delta.get("reasoning_content"):
                reasoning += delta["reasoning_content"]
                order.append("reasoning")
            if delta.get("content"):
                content += delta["content"]
                order.append("content")
            finish = ch["finish_reason"] or finish
    return reasoning, content, finish, order


def prompt_tokens(m: dl.Model, **kw: bool) -> int:
    return len(dl.encode(m, dl.render_chat(m, MSGS, **kw), special=True))


def test_server_returns_a_leading_thought_as_reasoning_content(server: tuple[str, dict[str, dl.Model]]) -> None:
    base, models = server
    r = chat(base, "thinks")
    msg = r["choices"][0]["message"]
    assert (msg.get("reasoning_content"), msg["content"], r["choices"][0]["finish_reason"]) == (" the", " catat", "stop"), r
    assert r["usage"]["prompt_tokens"] == prompt_tokens(models["thinks"])
    reasoning, content, finish, order = chat_stream(base, "thinks")
    assert (reasoning, content, finish) == (" the", " catat", "stop")
    # The thought streams first, then the answer; no delta carries both or goes back.
    assert order == sorted(order, key=lambda k: k != "reasoning") and order[0] == "reasoning" and "content" in order, order


def test_server_without_a_thought_has_no_reasoning_content(server: tuple[str, dict[str, dl.Model]]) -> None:
    # Thinking on (the template's default), a model that answers at once: the late marker is text.
    base, _ = server
    msg = chat(base, "late")["choices"][0]["message"]
    assert "reasoning_content" not in msg and msg["content"].startswith(" cat<think>at"), msg
    reasoning, content, _, _ = chat_stream(base, "late")
    assert reasoning == "" and content.startswith(" cat<think>at"), content


@pytest.mark.parametrize("off", [{"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}, {"reasoning_effort": "none"}, {"reasoning_effort": "minimal"}])
def test_server_thinking_off_renders_and_guards_the_turn(server: tuple[str, dict[str, dl.Model]], off: dict) -> None:
    base, models = server
    # The template's non-thinking form: the prompt carries the empty thought...
    r = chat(base, "thinks", **off)
    assert r["usage"]["prompt_tokens"] == prompt_tokens(models["thinks"], enable_thinking=False) > prompt_tokens(models["thinks"])
    # ...a leading thought is still split off, not shown as content...
    msg = r["choices"][0]["message"]
    assert (msg.get("reasoning_content"), msg["content"]) == (" the", " catat"), msg
    # ...and a thought after content ends the reply (the nothink guard), streamed or not.
    r = chat(base, "late", **off)
    assert (r["choices"][0]["message"]["content"], r["choices"][0]["finish_reason"]) == (" cat", "stop"), r
    assert "reasoning_content" not in r["choices"][0]["message"]
    assert chat_stream(base, "late", **off)[:3] == ("", " cat", "stop")


@pytest.mark.parametrize("on", [{"chat_template_kwargs": {"enable_thinking": True}}, {"reasoning_effort": "high"}, {"reasoning_effort": "none", "enable_thinking": True}])
def test_server_thinking_on_keeps_the_template_default(server: tuple[str, dict[str, dl.Model]], on: dict) -> None:
    # An explicit enable_thinking wins over reasoning_effort; "high" leaves Qwen3's template thinking.
    base, models = server
    r = chat(base, "late", **on)
    assert r["usage"]["prompt_tokens"] == prompt_tokens(models["late"])
    assert r["choices"][0]["message"]["content"].startswith(" cat<think>at"), r


def test_server_rejects_an_unknown_reasoning_effort(server: tuple[str, dict[str, dl.Model]]) -> None:
    base, _ = server
    r = httpx.post(base + "/v1/chat/completions", json={"model": "thinks", "messages": MSGS, "reasoning_effort": "extreme"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
