"""Gemma 4's tokenizer, chat template and thinking, on the synthetic Gemma 4 vocabulary of
tests/gemma4_vocab.py with Gemma 4's own template (tests/golden/gemma4_chat_template.jinja):
tokenization and rendered prompts equal llama.cpp's (tests/golden/gemma4.json, made by
scripts/make_gemma4_goldens.py); thoughts split as llama.cpp's parser splits them; the nothink
guard ends a thinking-off reply at a stray channel marker, through the scheduler and the server."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import drain
from gemma4_vocab import ID, TEMPLATE_PATH, TOKENS, write_gemma4_vocab_model

import dasllama as dl
from dasllama.chat import GEMMA4_THOUGHT, encode_prompt, thought_markers
from serverproc import start, stop

GOLDEN = json.loads((Path(__file__).parent / "golden" / "gemma4.json").read_text())
TEMPLATE = TEMPLATE_PATH.read_text()


def test_golden_matches_this_vocabulary_and_template() -> None:
    assert GOLDEN["vocab_sha256"] == hashlib.sha256("\n".join(TOKENS).encode()).hexdigest()
    assert GOLDEN["template_sha256"] == hashlib.sha256(TEMPLATE.encode()).hexdigest()


@pytest.fixture(scope="module")
def m(tmp_path_factory: pytest.TempPathFactory) -> dl.Model:
    p = tmp_path_factory.mktemp("gemma4") / "gemma4-vocab.gguf"
    write_gemma4_vocab_model(p, TEMPLATE)
    return dl.load_model(p)


def test_tokenizes_as_llama_cpp(m: dl.Model) -> None:
    for e in GOLDEN["tokenize"]:
        assert dl.encode(m, e["text"], add_bos=False) == e["ids"], e["text"]
        assert dl.encode(m, e["text"], add_bos=False, special=True) == e["ids_special"], e["text"]


def test_round_trip_and_bos(m: dl.Model) -> None:
    for e in GOLDEN["tokenize"]:
        assert dl.decode(m, dl.encode(m, e["text"], add_bos=False)) == e["text"], e["text"]
    # llama.cpp adds BOS for gemma4 whatever the file says; the turn and tool ends end generation.
    assert dl.encode(m, "hi")[0] == ID["<bos>"]
    assert {ID["<eos>"], ID["<turn|>"], ID["<|tool_response>"]} <= set(m.eog_ids)


def test_renders_as_llama_cpp(m: dl.Model) -> None:
    for r in GOLDEN["renders"]:
        extra = {"tools": r["tools"]} if "tools" in r else {}
        text = dl.render_chat(m, r["messages"], add_generation_prompt=r["add_generation_prompt"], enable_thinking=r["enable_thinking"], **extra)
        assert text == "<bos>" + r["prompt"], (r["messages"], r["enable_thinking"])
        # One BOS: the template writes its text and the tokenizer adds it, as in llama.cpp.
        assert encode_prompt(m, text) == r["prompt_ids"]


def test_renderer_thinking_off_by_default_and_on_with_the_gate(m: dl.Model) -> None:
    def golden(thinking: bool) -> list[int]:
        (r,) = [r for r in GOLDEN["renders"] if r["messages"] == [{"role": "system", "content": "You are a concise assistant."}, {"role": "user", "content": "What is the capital of France?"}] and "tools" not in r and r["enable_thinking"] is thinking]
        return r["prompt_ids"]

    chat = dl.create_chat_renderer(m, "You are a concise assistant.")
    dl.add_user(chat, "What is the capital of France?")
    # The template's default (no enable_thinking) is llama.cpp's thinking-off prompt: the closed
    # empty thought channel.
    assert dl.render_turn(m, chat) == golden(False)
    assert dl.decode(m, dl.render_turn(m, chat), special=True).endswith("<|turn>model\n<|channel>thought\n<channel|>")
    dl.set_thinking(chat, True)
    assert dl.render_turn(m, chat) == golden(True)
    assert ID["<|think|>"] in dl.render_turn(m, chat)
    dl.set_thinking(chat, False)
    assert dl.render_turn(m, chat) == golden(False)
    assert ID["<turn|>"] in dl.turn_stop_ids(chat)
    assert dl.decode(m, dl.render_close(m, chat), special=True) == "<turn|>\n"


def test_thought_markers_and_guard(m: dl.Model) -> None:
    assert thought_markers(m) == GEMMA4_THOUGHT
    chat = dl.create_chat_renderer(m)
    dl.add_user(chat, "hi")
    for thinking in (None, False):
        chat.thinking = thinking
        g = dl.make_nothink_guard(chat)
        assert g is not None and g.open_ids == (ID["<|channel>"],) and g.close_ids == (ID["<channel|>"],)
    dl.set_thinking(chat, True)
    assert dl.make_nothink_guard(chat) is None
    # The markers show in the reply's text (the reader splits on them), other control tokens do not.
    assert dl.decode(m, [ID["<|channel>"], ID["<channel|>"], ID["<turn|>"]]) == "<|channel><channel|>"


@pytest.mark.parametrize("size", [1, 2, 3, 7, 100])
def test_splits_thoughts_as_llama_cpp(size: int) -> None:
    # llama.cpp's tests/test-chat.cpp cases for the Gemma 4 parser.
    cases = {
        "<|channel>thought\nI'm\nthinking<channel|>Hello, world!\nWhat's up?": ("I'm\nthinking", "Hello, world!\nWhat's up?"),
        "<|channel>thought<channel|>Hello, world!\nWhat's up?": ("", "Hello, world!\nWhat's up?"),
        "Hello, world!": ("", "Hello, world!"),
        "<|channel>thought\ncut off": ("cut off", ""),
    }
    for reply, want in cases.items():
        sp = dl.ThoughtSplitter(GEMMA4_THOUGHT)
        r, c = "", ""
        for i in range(0, len(reply), size):
            a, b = sp.feed(reply[i : i + size])
            r, c = r + a, c + b
        a, b = sp.finish()
        assert (r + a, c + b) == want, reply
        assert dl.split_reasoning(reply, GEMMA4_THOUGHT) == want


# After the prompt's closed thought channel: an answer, then a stray channel marker (the model
# starting to think where it should not), then what it would have thought. After the thinking
# prompt's bare `<|turn>model\n`: a thought.
LATE = {"\n": "<|channel>", "<channel|>": "The", "The": "\u2581capital", "\u2581capital": "<|channel>", "<|channel>": "\u2581the", "\u2581the": "<turn|>"}
# A reply that opens with a thought anyway: the guard lets it through for the reader to split.
LEADING = {"<channel|>": "<|channel>", "<|channel>": "\u2581the", "\u2581the": "<channel|>", "\u2581capital": "<turn|>"}


def scripted(tmp_path: Path, script: dict[str, str]) -> dl.Model:
    p = tmp_path / "gemma4-scripted.gguf"
    write_gemma4_vocab_model(p, TEMPLATE, script)
    return dl.load_model(p)


def run(m: dl.Model, chat: dl.ChatRenderer, streams: int = 2) -> tuple[str, list[dl.SchedEvent]]:
    sch = dl.create_scheduler(m, streams)
    req = dl.PendingReq(id=1, prompt=dl.render_turn(m, chat), stop_ids=dl.turn_stop_ids(chat), max_new=12, nothink=dl.make_nothink_guard(chat))
    assert dl.submit(m, sch, req)
    evs = drain(m, sch)
    return "".join(e.text for e in evs if e.kind == "piece"), evs


def test_scheduler_guard_ends_a_reply_at_a_stray_channel_marker(tmp_path: Path) -> None:
    m = scripted(tmp_path, LATE)
    chat = dl.create_chat_renderer(m)
    dl.add_user(chat, "What is the capital of France?")
    text, evs = run(m, chat)
    assert text == "The capital" and evs[-1].finish == "stop", (text, evs[-1].finish)
    # The marker ended the stream and was not emitted.
    assert ID["<|channel>"] not in [e.token for e in evs if e.kind == "piece"]
    # Thinking on: no guard, so the marker is text and the reply runs to the turn's end.
    dl.set_thinking(chat, True)
    text, evs = run(m, chat)
    assert text == "<|channel> the" and evs[-1].finish == "stop", text


def test_scheduler_lets_a_leading_thought_through(tmp_path: Path) -> None:
    m = scripted(tmp_path, LEADING)
    chat = dl.create_chat_renderer(m)
    dl.add_user(chat, "What is the capital of France?")
    text, _ = run(m, chat)
    # `<|channel>` before any content is a leading thought: emitted, and the reader splits it.
    assert text.startswith("<|channel> the<channel|>"), text
    assert dl.split_reasoning("<|channel>thought\n the<channel|>x", GEMMA4_THOUGHT) == (" the", "x")


# --- through the real HTTP server: `reasoning_content` and the guard on Gemma 4's turns ---

# Thinking on (the bare `<|turn>model\n`): a thought in the channel, then the answer. Thinking off
# (the closed channel): an answer, then a stray marker.
SERVED = {"\n": "<|channel>", "<|channel>": "thought", "thought": "\u2581the", "\u2581the": "<channel|>", "<channel|>": "The", "The": "\u2581capital", "\u2581capital": "<|channel>"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("gemma4-server")
    write_gemma4_vocab_model(d / "g4.gguf", TEMPLATE, SERVED)
    proc, base = start("--model", str(d / "g4.gguf"), "--alias", "g4", "--streams", "2")
    yield base
    assert stop(proc) == 0


def ask(base: str, **extra: object) -> dict:
    body = {"model": "g4", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12, "temperature": 0, **extra}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_server_splits_gemma4_thoughts_and_guards_thinking_off_turns(server: str) -> None:
    on = ask(server, chat_template_kwargs={"enable_thinking": True})
    # `<|channel>thought the<channel|>The capital<|channel>…`: thinking on has no guard, so the
    # second marker is text; the turn runs to max_tokens.
    assert on["message"].get("reasoning_content") == " the" and on["message"]["content"].startswith("The capital<|channel>"), on
    for off in ({}, {"enable_thinking": False}):
        r = ask(server, **off)
        # The closed channel's prompt: the answer, and the stray marker ends it.
        assert (r["message"]["content"], r["finish_reason"]) == ("The capital", "stop"), r
        assert "reasoning_content" not in r["message"]
