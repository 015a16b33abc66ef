"""Structured output and tool calling: grammars in the scheduler (masking per stream, no drafts,
stop when complete, "length" with a valid prefix), and the server's response_format, tools and
tool_choice through the official openai client, streaming and not, with the bad inputs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from conftest import drain

import dasllama as dl
from dasllama.serve.callformats import CallParser, split_calls
from dasllama.serve.tools import convert_messages
from serverproc import start, stop

# ---- schemas and prompts --------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "forecast": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
    },
    "required": ["city", "unit", "forecast"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "customer": {"type": "object", "properties": {"id": {"type": "integer"}, "vip": {"type": "boolean"}}, "required": ["id", "vip"], "additionalProperties": False},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["sku", "qty"], "additionalProperties": False},
        },
        "status": {"enum": ["new", "paid", "shipped"]},
    },
    "required": ["customer", "items", "status"],
    "additionalProperties": False,
}
REVIEW = {
    "type": "object",
    "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}, "score": {"type": "number", "minimum": 0, "maximum": 1}, "tags": {"type": "array", "items": {"enum": ["price", "quality", "service"]}, "maxItems": 3}},
    "required": ["sentiment", "score", "tags"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "weather": WEATHER, "order": ORDER, "review": REVIEW}
PROMPTS = [
    "Describe a person from a novel.", "Who is the oldest person you know of?", "Make up a customer.", "Give me data about Paris.",
    "What's the weather like in Tokyo tomorrow?", "Summarize this review: the food was great but slow.", "Invent an order of two items.",
    "Return JSON for a typical user.", "I bought three pens and a notebook.", "Rate this: terrible service, never again.",
    "Tell me about Ada Lovelace.", "Forecast for Oslo in fahrenheit.", "A VIP customer just paid.", "Quality is excellent, price too high.",
    "Describe yourself.", "Write a JSON record.",
    "Berlin, cold and rainy.", "The parcel shipped yesterday.",
    "A neutral review of a laptop.", "An 85 year old gardener named Rose.",
    "Weather in Lima, Peru.", "Order 4 cups and 2 plates.",
    "Five stars, would buy again.", "John, 30.",
    "Sydney heat wave.",
]  # fmt: skip
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"], "additionalProperties": False},
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


# ---- the scheduler ------------------------------------------------------------------------------


def chat_prompt(m: dl.Model, text: str) -> list[int]:
    chat = dl.create_chat_renderer(m, "", 64)
    dl.add_user(chat, text)
    return dl.render_turn(m, chat)


def run(m: dl.Model, reqs: list[dl.PendingReq], mtp: bool = False, stats: dict[str, float] | None = None) -> tuple[dict[int, str], dict[int, list[int]], dict[int, str]]:
    sch = dl.create_scheduler(m, max_streams=len(reqs), max_queue=len(reqs), page_rows=16, mtp=mtp)
    if mtp:
        dl.fix_draft_len(sch, 4)
    for r in reqs:
        assert dl.submit(m, sch, r)
    text: dict[int, str] = {r.id: "" for r in reqs}
    toks: dict[int, list[int]] = {r.id: [] for r in reqs}
    finish: dict[int, str] = {}
    for e in drain(m, sch):
        if e.kind == "piece":
            text[e.id] += e.text
            toks[e.id].append(e.token)
        else:
            assert e.finish in ("stop", "length"), (e.finish, e.error)
            finish[e.id] = e.finish
    if stats is not None:
        stats.update(dl.scheduler_stats(sch))
    return text, toks, finish


def test_a_grammar_constrains_its_stream_only(smollm: dl.Model) -> None:
    free = dl.PendingReq(id=1, prompt=chat_prompt(smollm, "Write a haiku about rain."), max_new=40)
    alone = run(smollm, [free])[1][1]
    schema_req = dl.PendingReq(id=2, prompt=chat_prompt(smollm, "Describe a person."), max_new=60, grammar=dl.json_schema_grammar(PERSON))
    text, toks, finish = run(smollm, [dl.PendingReq(id=1, prompt=free.prompt, max_new=40), schema_req])
    # The unconstrained stream beside it decodes exactly as alone (greedy).
    assert toks[1] == alone
    assert finish[2] == "stop", text[2]
    jsonschema.validate(json.loads(text[2]), PERSON)


def test_a_constrained_stream_gets_no_drafts(smollm: dl.Model) -> None:
    assert dl.attach_ngram_drafter(smollm, max_draft=8)
    try:
        prompt = chat_prompt(smollm, "Repeat exactly: a b c d e f g h a b c d e f g h a b c d e f g h")
        reqs = [dl.PendingReq(id=i, prompt=prompt, max_new=40, grammar=dl.json_schema_grammar(REVIEW)) for i in range(2)]
        stats: dict[str, float] = {}
        text, _, finish = run(smollm, reqs, mtp=True, stats=stats)
        # The same prompt unconstrained does draft (the lookup finds its repeats).
        free: dict[str, float] = {}
        run(smollm, [dl.PendingReq(id=9, prompt=prompt, max_new=40)], mtp=True, stats=free)
    finally:
        dl.detach_drafter(smollm)
    assert stats["spec_drafted"] == 0 and free["spec_drafted"] > 0
    for i in range(2):
        assert finish[i] == "stop"
        jsonschema.validate(json.loads(text[i]), REVIEW)


def test_a_schema_too_long_for_max_new_ends_with_length_and_a_valid_prefix(smollm: dl.Model) -> None:
    schema = {"type": "object", "properties": {"essay": {"type": "string", "minLength": 400}}, "required": ["essay"], "additionalProperties": False}
    text, _, finish = run(smollm, [dl.PendingReq(id=1, prompt=chat_prompt(smollm, "Write an essay."), max_new=12, grammar=dl.json_schema_grammar(schema))])
    assert finish[1] == "length"
    assert text[1].startswith('{"essay": "') and '"' not in text[1][len('{"essay": "') :].replace('\\"', "")


def test_a_bad_grammar_is_refused_at_submit(smollm: dl.Model) -> None:
    sch = dl.create_scheduler(smollm, max_streams=1)
    with pytest.raises(ValueError, match="grammar"):
        dl.submit(smollm, sch, dl.PendingReq(id=1, prompt=[1, 2, 3], max_new=4, grammar=dl.json_schema_grammar({"type": "nonsense"})))
    with pytest.raises(ValueError, match="grammar"):
        dl.submit(smollm, sch, dl.PendingReq(id=2, prompt=[1, 2, 3], max_new=4, grammar="start: undefined_rule"))
    assert dl.n_queued(sch) == 0


# ---- parsing calls --------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_calls_are_parsed_from_both_conventions_as_they_stream(chunk: int) -> None:
    qwen = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    smol = '<tool_call>[{"name": "add", "arguments": {"a": 3, "b": 4}}, {"name": "add", "arguments": {"a": 5, "b": 6}}]</tool_call>'
    for text, want_content, want in ((qwen, "Let me check.", [("get_weather", {"city": "Oslo", "unit": "celsius"}), ("add", {"a": 1, "b": 2})]), (smol, "", [("add", {"a": 3, "b": 4}), ("add", {"a": 5, "b": 6})])):
        p = CallParser()
        content, calls = "", []
        for i in range(0, len(text), chunk):
            c, got = p.feed(text[i : i + chunk])
            content, calls = content + c, calls + got
        c, _ = p.finish()
        assert content + c == want_content
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == want
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    # Text that only looks like a call stays text.
    assert split_calls("a <tool_call>not json</tool_call> b <tool") == ("a <tool_call>not json</tool_call> b <tool", [])
    assert split_calls("plain answer") == ("plain answer", [])


def test_tool_messages_in_each_convention() -> None:
    msgs = [
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "content": "3", "tool_call_id": "call_1"},
    ]
    hermes = convert_messages(msgs, "hermes")
    assert hermes[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1, "b": 2}} and hermes[2] == {"role": "tool", "content": "3", "tool_call_id": "call_1"}
    listed = convert_messages(msgs, "list")
    assert listed[1] == {"role": "assistant", "content": '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>'}
    assert listed[2] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}


# ---- the server -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(smollm: dl.Model) -> Iterator[str]:
    proc, base = start("--model", str(smollm.path), "--alias", "smollm", "--streams", "16", "--queue", "128")
    yield base
    assert stop(proc) == 0


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="none")


def alive(server: str) -> None:
    assert httpx.get(server + "/health").json() == {"status": "ok"}


def schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_json_schema_output_validates_on_every_prompt(server: str) -> None:
    async def one(client: openai.AsyncOpenAI, i: int, prompt: str, name: str) -> tuple[str, str, str]:
        r = await client.chat.completions.create(
            model="smollm", messages=[{"role": "user", "content": prompt}], response_format=schema_format(name, SCHEMAS[name]), max_tokens=160, temperature=0.7, seed=i  # type: ignore[arg-type]
        )
        return name, r.choices[0].message.content or "", r.choices[0].finish_reason

    async def main() -> list[tuple[str, str, str]]:
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", timeout=300)
        names = list(SCHEMAS)
        jobs = [one(client, i, PROMPTS[i % len(PROMPTS)], names[i % len(names)]) for i in range(50)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    assert len(results) == 50
    for name, content, finish in results:
        assert finish == "stop", (name, content)
        jsonschema.validate(json.loads(content), SCHEMAS[name])
    alive(server)


def test_json_object_parses(client: openai.OpenAI) -> None:
    # Any object: a 135M model asked for an open-ended one ("a user profile") can ramble on to
    # max_tokens (a bounded json_schema is what stops that); these ask for small ones.
    for prompt in ("Return a JSON object with your name and age.", "What is the capital of France? Answer in JSON."):
        r = client.chat.completions.create(model="smollm", messages=[{"role": "user", "content": prompt}], response_format={"type": "json_object"}, max_tokens=120, temperature=0)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


def test_streamed_json_schema_is_the_same_document(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "smollm", "messages": [{"role": "user", "content": "Weather in Rome."}], "response_format": schema_format("weather", WEATHER), "max_tokens": 120, "temperature": 0}
    whole = client.chat.completions.create(**kw).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(parts) == whole
    jsonschema.validate(json.loads(whole or ""), WEATHER)


def check_call(call: Any, names: set[str]) -> dict[str, Any]:
    assert call.type == "function" and call.id and call.function.name in names
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMS[call.function.name])
    return args


def test_tool_round_trip(client: openai.OpenAI) -> None:
    msgs: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="smollm", messages=msgs, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80, temperature=0)  # type: ignore[arg-type]
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls and len(ch.message.tool_calls) >= 1
    check_call(ch.message.tool_calls[0], {"get_weather"})
    call = ch.message.tool_calls[0]
    msgs += [
        {"role": "assistant", "content": ch.message.content, "tool_calls": [{"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    r2 = client.chat.completions.create(model="smollm", messages=msgs, tools=TOOLS, max_tokens=60, temperature=0)  # type: ignore[arg-type]
    c2 = r2.choices[0]
    assert c2.finish_reason in ("stop", "length", "tool_calls")
    assert (c2.message.content or "").strip() or c2.message.tool_calls
    # The tool's answer reached the prompt: the second turn is longer than the first by at least it.
    assert r2.usage and r.usage and r2.usage.prompt_tokens > r.usage.prompt_tokens + 10


def test_tool_round_trip_streaming(client: openai.OpenAI) -> None:
    msgs: list[Any] = [{"role": "user", "content": "Add 17 and 25."}]
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(model="smollm", messages=msgs, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0, stream=True):  # type: ignore[arg-type]
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += tc.id or ""
            c["name"] += (tc.function.name or "") if tc.function else ""
            c["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]  # parallel_tool_calls=False: exactly one
    c = calls[0]
    assert c["name"] in PARAMS and c["id"].startswith("call_")
    jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])
    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}]},
        {"role": "tool", "tool_call_id": c["id"], "content": "42"},
    ]
    text = ""
    for chunk in client.chat.completions.create(model="smollm", messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0, stream=True):  # type: ignore[arg-type]
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            assert not chunk.choices[0].delta.tool_calls
    assert text.strip()


def test_tool_choice_required_and_parallel(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="smollm", messages=[{"role": "user", "content": "Weather in Oslo and in Rome?"}], tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0  # type: ignore[arg-type]
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
    for call in ch.message.tool_calls:
        check_call(call, set(PARAMS))
    assert len({c.id for c in ch.message.tool_calls}) == len(ch.message.tool_calls)


def test_tool_choice_auto_and_none_answer_in_a_valid_shape(client: openai.OpenAI) -> None:
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model="smollm", messages=[{"role": "user", "content": "Hello!"}], tools=TOOLS, tool_choice=choice, max_tokens=40, temperature=0)  # type: ignore[arg-type]
        ch = r.choices[0]
        if ch.message.tool_calls:
            assert choice == "auto" and ch.finish_reason == "tool_calls"
            for call in ch.message.tool_calls:
                check_call(call, set(PARAMS))
        else:
            assert ch.finish_reason in ("stop", "length") and ch.message.content


def post(base: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json={"model": "smollm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **body}, timeout=120)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": schema_format("bad", {"type": "nonsense"})}, "response_format"),
        ({"response_format": schema_format("bad", {"type": "integer", "minimum": 5, "maximum": 2})}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "not an object"}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"tools": [{"type": "function", "function": {"description": "no name", "parameters": {"type": "object"}}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], "tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "x", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
    ],
)
def test_bad_schemas_and_tools_are_openai_shaped_400s(server: str, body: dict[str, Any], param: str) -> None:
    r = post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    alive(server)


def test_unsatisfiable_within_max_tokens_is_length_with_a_valid_prefix(server: str, client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"essay": {"type": "string", "minLength": 300}}, "required": ["essay"], "additionalProperties": False}
    r = client.chat.completions.create(model="smollm", messages=[{"role": "user", "content": "Write an essay."}], response_format=schema_format("essay", schema), max_tokens=10, temperature=0)  # type: ignore[arg-type]
    ch = r.choices[0]
    assert ch.finish_reason == "length"
    assert (ch.message.content or "").startswith('{"essay": "')
    alive(server)


# ---- a template that knows tools (Qwen 2.5's, the Hermes convention) ------------------------------

QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def test_a_tools_template_renders_them_and_a_forced_call_parses(smollm: dl.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    from dasllama.serve.tools import call_grammar, parse_tools, with_tools

    monkeypatch.setattr(smollm, "chat_template", QWEN_TEMPLATE)
    body = {"tools": TOOLS, "tool_choice": "required"}
    t = parse_tools(body, smollm.chat_template)
    assert t is not None and t.fmt == "hermes"
    msgs = [
        {"role": "user", "content": "add 1 and 2, then the weather in Oslo"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "content": "3", "tool_call_id": "call_1"},
    ]
    rendered, extra = with_tools(convert_messages(msgs, t.fmt), t)
    text = dl.render_chat(smollm, rendered, **extra)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    # The forced call in this convention: one or more <tool_call> blocks, each a valid call.
    grammar = call_grammar(t)
    assert grammar is not None
    out, _, finish = run(smollm, [dl.PendingReq(id=1, prompt=dl.encode(smollm, text, special=True), max_new=120, grammar=grammar)])
    assert finish[1] == "stop", out[1]
    content, calls = split_calls(out[1])
    assert out[1].startswith("<tool_call>\n{") and calls and content is None
    for c in calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), PARAMS[c["function"]["name"]])


def test_text_completions_take_response_format(server: str) -> None:
    body = {"model": "smollm", "prompt": "A person record in JSON: ", "max_tokens": 80, "temperature": 0, "response_format": schema_format("person", PERSON)}
    r = httpx.post(server + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "stop"
    jsonschema.validate(json.loads(ch["text"]), PERSON)
