"""Thinking turns with Qwen3's own chat template (tests/golden/qwen3_chat_template.jinja, as
Qwen3 GGUFs embed it) in a synthetic file: thinking on and off render as `apply_chat_template`
renders them; the nothink guard splits a leading thought and stops a late one; the server returns
a leading thought as `reasoning_content`, streamed too."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import drain

import dasllama as dl
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
