"""Tool calls in every convention the families we load write (``dasllama.serve.callformats``):
the convention read from each real chat template (tests/templates, tests/golden: llama.cpp's
models/templates), replies in each parsed into calls whole and piece by piece, and, through the
server with the ``openai`` client, a forced call (``tool_choice: "required"``) round-tripping in
each template's own form, streamed and not, on scripted synthetic models carrying the real
templates and their special tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from dasllama.chat import HARMONY_MARKERS, split_reasoning
from dasllama.serve.callformats import CONVENTIONS, detect, gemma4_to_json, split_calls
from serverproc import start, stop
from synthetic import write_scripted_model

HERE = Path(__file__).parent
TEMPLATES = {
    "hermes": HERE / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja",
    "llama3": HERE / "templates" / "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "mistral": HERE / "templates" / "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "mistral-v11": HERE / "templates" / "Mistral-Small-3.2-24B-Instruct-2506.jinja",
    "gemma4": HERE / "golden" / "gemma4_chat_template.jinja",
    "harmony": HERE / "golden" / "gpt_oss_chat_template.jinja",
    "qwen3-coder": HERE / "templates" / "Qwen3-Coder.jinja",
    "glm": HERE / "templates" / "GLM-4.6.jinja",
    "deepseek": HERE / "templates" / "deepseek-ai-DeepSeek-V3.1.jinja",
}


@pytest.mark.parametrize("name", TEMPLATES)
def test_each_template_names_its_convention(name: str) -> None:
    assert detect(TEMPLATES[name].read_text()).name == name.removesuffix("-v11")


def test_smollm2s_template_knows_no_tools() -> None:
    assert detect("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}").name == "list"


WEATHER = {"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}
# (convention, a reply as the family writes it, the content around the calls, the calls)
REPLIES = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>', "Let me look.", [WEATHER]),
    ("list", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}, {"name": "get_time", "arguments": {}}]</tool_call>', None, [WEATHER, {"name": "get_time", "arguments": {}}]),
    ("qwen3-coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", None, [WEATHER]),
    ("glm", "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", "Sure.", [WEATHER]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}', None, [WEATHER]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}', None, [WEATHER]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}, "id": "abc123def"}]', None, [WEATHER]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 3}[TOOL_CALLS]get_time[ARGS]{}', None, [WEATHER, {"name": "get_time", "arguments": {}}]),
    ("gemma4", 'I will check.<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:3}<tool_call|>', "I will check.", [WEATHER]),
    (
        "deepseek",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        None,
        [WEATHER],
    ),
    (
        "deepseek",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Oslo", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        None,
        [WEATHER],
    ),
]


def plain(calls: list[dict]) -> list[dict]:
    return [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in calls]


@pytest.mark.parametrize("conv, reply, content, calls", REPLIES)
@pytest.mark.parametrize("size", [1, 3, 10_000])
def test_replies_parse_into_calls_whole_and_piece_by_piece(conv: str, reply: str, content: str | None, calls: list[dict], size: int) -> None:
    from dasllama.serve.callformats import CallParser

    p = CallParser(conv)
    got_content, got_calls = "", []
    for i in range(0, len(reply), size):
        c, k = p.feed(reply[i : i + size])
        got_content, got_calls = got_content + c, got_calls + k
    c, k = p.finish()
    got_content, got_calls = got_content + c, got_calls + k
    assert (got_content.strip() or None, plain(got_calls)) == (content, calls)
    assert split_calls(reply, conv)[1] and plain(split_calls(reply, conv)[1]) == calls
    for c in got_calls:
        assert c["type"] == "function" and c["id"]
    if CONVENTIONS[conv].short_ids:
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got_calls)  # Mistral's templates refuse others


@pytest.mark.parametrize(
    "conv, reply",
    [
        ("hermes", "<tool_call>not json</tool_call> and on"),
        ("llama3", "{this is prose in braces}"),
        ("mistral", "[TOOL_CALLS]no args here"),
        ("gemma4", "<|tool_call>call:f{city:<|\"|>unclosed<tool_call|>"),
        ("hermes", "an answer with no call"),
    ],
)
def test_what_holds_no_valid_call_stays_content(conv: str, reply: str) -> None:
    assert split_calls(reply, conv) == (reply, [])


def test_gemma4_arguments_read_as_json() -> None:
    assert gemma4_to_json('{a:<|"|>x, y<|"|>,b:[1,2.5,<|"|>z<|"|>],c:{d:true,e:null}}') == {"a": "x, y", "b": [1, 2.5, "z"], "c": {"d": True, "e": None}}
    assert gemma4_to_json("{a:1") is None


def test_harmony_calls_become_blocks_only_when_tools_were_asked() -> None:
    reply = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + json.dumps(WEATHER["arguments"])
    thought, content = split_reasoning(reply, HARMONY_MARKERS, calls=True)
    assert thought == "Need weather." and plain(split_calls(content, "harmony")[1]) == [WEATHER]
    # The header's other order (the template writes `to=` before the channel).
    reply2 = "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>" + json.dumps(WEATHER["arguments"])
    assert plain(split_calls(split_reasoning(reply2, HARMONY_MARKERS, calls=True)[1], "harmony")[1]) == [WEATHER]
    assert split_reasoning(reply, HARMONY_MARKERS)[1] == ""  # without tools: reasoning, as before


# --- the forced call round trip, through the server and the openai client ---

PARAMS = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": PARAMS}}]
# Each template's special tokens (those its calls use among them): the vocabulary holds them as
# control tokens, as the real files do, so the grammar reaches them as tokens.
SPECIALS = {
    "hermes": ["<|im_start|>", "<|im_end|>"],
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"],
    "mistral": ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
    "gemma4": ["<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|tool>", "<tool|>"],
    "harmony": ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"],
    "qwen3-coder": ["<|im_start|>", "<|im_end|>"],
    "glm": ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
    "deepseek": ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("tool-formats")
    args = []
    for name, specials in SPECIALS.items():
        # No script: every logit is equal, so greedy decoding takes the grammar's first token
        # everywhere and the forced call is all the model can say.
        write_scripted_model(d / f"{name}.gguf", specials, {}, TEMPLATES[name].read_text(), pieces=("analysis", "final", "commentary", "assistant"), ctx=4096)
        args += ["--model", str(d / f"{name}.gguf"), "--alias", name]
    proc, base = start(*args, "--streams", "2")
    yield base
    assert stop(proc) == 0


@pytest.mark.parametrize("name", list(SPECIALS))
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_round_trips_through_the_openai_client(server: str, name: str, stream: bool) -> None:
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    msgs: list = [{"role": "user", "content": "What is the weather in Oslo?"}]
    kw = {"model": name, "messages": msgs, "tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 200}
    # One call: left free, a model that never prefers "]" to "," (equal logits) would list calls until max_tokens.
    kw["parallel_tool_calls"] = False
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kw):
            ch = chunk.choices[0]
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
        got = [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    else:
        r = client.chat.completions.create(**kw)
        finish = r.choices[0].finish_reason
        got = [(c.id, c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]
    assert finish == "tool_calls" and got, (name, finish, got)
    for _, fn, args in got:
        assert fn == "get_weather"
        jsonschema.validate(json.loads(args), PARAMS)
    # The call and its result go back through the template for the next turn.
    cid, fn, args = got[0]
    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [{"id": cid, "type": "function", "function": {"name": fn, "arguments": args}}]},
        {"role": "tool", "tool_call_id": cid, "content": '{"temp_c": 4}'},
    ]
    r2 = client.chat.completions.create(model=name, messages=msgs, tools=TOOLS, temperature=0, max_tokens=4)
    assert r2.usage.prompt_tokens > 0
