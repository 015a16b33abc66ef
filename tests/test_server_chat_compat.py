"""Where dasllama-server renders chats as llama-server does: llama.cpp's built-in named chat
templates (--chat-template NAME), FireFunction v2's `functions`/`datetime` variables, a prefill
given as text parts, and two assistant messages at the end refused."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

import dasllama as dl
from dasllama.model import decode
from dasllama.serve import Server
from dasllama.serve.app import ApiError
from dasllama.serve.chat_templates import NAMED, resolve
from dasllama.serve.engine import Engine
from dasllama.serve.llama_api import render_request
from dasllama.serve.options import Options
from dasllama.serve.tools import prepare_messages

# FireFunction v2's template, as llama.cpp ships it: its tools come as a `functions` JSON string,
# today's date as `datetime`.
FIREFUNCTION = (Path(__file__).parent / "templates" / "fireworks-ai-llama-3-firefunction-v2.jinja")
TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": {"type": "object", "properties": {}}}}
MSGS = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture
def llama_server(smollm: dl.Model) -> Iterator[Server]:
    server = Server()
    server.options = Options(llama_compat=True)
    eng = Engine(smollm, "smollm", streams=1, queue=4, chunk=64, page_rows=16)
    server.add(eng)
    server.ready = True
    yield server
    eng.shutdown()


def test_named_templates_render_llama_cpp_formats(smollm: dl.Model) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment()
    msgs = [*MSGS, {"role": "assistant", "content": " ok "}, {"role": "user", "content": "more"}]

    def render(name: str) -> str:
        return env.from_string(NAMED[name]).render(messages=msgs, add_generation_prompt=True)

    # llama.cpp's src/llama-chat.cpp, written out: command-r and llama3 trim each message
    assert render("command-r") == (
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>ok<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>more<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    )
    assert render("llama3").endswith("<|start_header_id|>assistant<|end_header_id|>\n\nok<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nmore<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert render("chatml").startswith("<|im_start|>system\nYou are a test.<|im_end|>\n") and render("chatml").endswith("<|im_start|>assistant\n")
    # Gemma has no system turn: the system text opens the first user turn
    assert render("gemma").startswith("<start_of_turn>user\nYou are a test.\n\nHi there<end_of_turn>\n<start_of_turn>model\nok<end_of_turn>\n")
    assert resolve("command-r")[0] == NAMED["command-r"]
    assert resolve("{{ messages[0].content }}") == ("{{ messages[0].content }}", "given on the command line")


def test_chat_template_flag_picks_a_named_template(llama_server: Server) -> None:
    from dasllama.serve.llama_server import translate

    _, opts = translate(["-m", "x.gguf", "--chat-template", "command-r"])
    assert opts.chat_template == NAMED["command-r"]
    eng = llama_server.engine(None)
    saved = eng.m.chat_template
    try:
        eng.m.chat_template = opts.chat_template
        text = render_request(llama_server, eng, {"messages": MSGS})
    finally:
        eng.m.chat_template = saved
    assert text == "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"


def test_firefunction_gets_functions_and_datetime(llama_server: Server) -> None:
    template = FIREFUNCTION.read_text()
    _, extra = prepare_messages(list(MSGS), None, template)
    assert extra == {"functions": ""}
    eng = llama_server.engine(None)
    saved = eng.m.chat_template
    try:
        eng.m.chat_template = template
        text = render_request(llama_server, eng, {"messages": MSGS, "tools": [TOOL]})
        plain = render_request(llama_server, eng, {"messages": MSGS})
    finally:
        eng.m.chat_template = saved
    assert "Today is " + datetime.date.today().strftime("%b %d %Y") in text
    assert json.dumps(TOOL["function"]["name"]) in text and "get_time" not in plain
    assert text.count("get_time") == 1  # shown through `functions` only, not also in a system prompt of ours


def test_prefill_parts_and_two_assistant_turns(llama_server: Server, smollm: dl.Model) -> None:
    parts = [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]
    job = llama_server.job({"messages": [*MSGS, {"role": "assistant", "content": parts}], "max_tokens": 4}, chat=True)
    assert decode(smollm, job.prompt, special=True).endswith("<|im_start|>assistant\nWh\n\nill")
    with pytest.raises(ApiError) as e:
        llama_server.job({"messages": [*MSGS, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]}, chat=True)
    assert e.value.status == 400 and "2 or more assistant messages" in e.value.message
    # asked for explicitly, the last of them is continued
    job = llama_server.job({"messages": [*MSGS, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}], "continue_final_message": True}, chat=True)
    assert decode(smollm, job.prompt, special=True).endswith("<|im_end|>\n<|im_start|>assistant\nb")
