"""Tool calling and structured output for the OpenAI routes: checking ``tools``, ``tool_choice``
and ``response_format``, showing the tools to the model in its own template's convention, the
grammars that force a call, and parsing calls out of the reply (whole, or as it streams).

The convention a model writes calls in is read from its chat template (``callformats``). Where
the template knows tools (Hermes/Qwen, Llama 3.x, Mistral, Gemma 4, GLM, DeepSeek, gpt-oss), it
renders the ``tools`` variable itself, and ``tool`` messages and assistant ``tool_calls`` (their
arguments as objects) go to it as they are. Elsewhere (``list``: SmolLM2's tool format, for any
template that knows no tools) the tools are described in the system turn and the model answers
``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``; earlier calls are written back
the same way and tool results come back as a user turn inside ``<tool_response>`` tags.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..grammar import json_object_grammar, json_schema_grammar, lark_string
from . import callformats

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class ToolError(ValueError):
    """A request's tools, tool_choice or response_format is malformed; ``param`` names where."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Tools:
    tools: list[dict[str, Any]]  # the functions: {"name", "description", "parameters"}
    choice: str | dict[str, Any]  # "auto", "required", or {"name": ...}
    parallel: bool
    fmt: str  # the model's call convention (a name in callformats.CONVENTIONS)
    openai: list[dict[str, Any]] = field(default_factory=list)  # as the client sent them


def template_format(chat_template: str | None) -> str:
    return callformats.detect(chat_template).name


def parse_tools(body: dict[str, Any], chat_template: str | None) -> Tools | None:
    """The request's tools, or None when there are none (or ``tool_choice`` is "none")."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise ToolError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if raw is None:
        if choice not in (None, "none"):
            raise ToolError("'tool_choice' needs 'tools': this request declares no tool to call", "tool_choice")
        return None
    if not isinstance(raw, list):
        raise ToolError("'tools' must be a list of {'type': 'function', 'function': {...}}", "tools")
    funcs: list[dict[str, Any]] = []
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise ToolError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}", where)
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError(f"{where}.function has no 'name': every tool needs one (letters, digits, '_', '.', '-'; at most 64)", f"{where}.function.name")
        if not NAME_RE.match(name):
            raise ToolError(f"{where}.function.name {name!r} must be 1 to 64 letters, digits, '_', '.' or '-'", f"{where}.function.name")
        if any(g["name"] == name for g in funcs):
            raise ToolError(f"{where}.function.name {name!r} is declared twice", f"{where}.function.name")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
        desc = f.get("description", "")
        if not isinstance(desc, str):
            raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description")
        funcs.append({"name": name, "description": desc, "parameters": params})
    if not funcs:
        raise ToolError("'tools' is empty: leave it out, or declare at least one function", "tools")
    if choice is None:
        choice = "auto"
    if choice == "none":
        return None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ToolError("'tool_choice' must be \"none\", \"auto\", \"required\" or {'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if not any(g["name"] == name for g in funcs):
            raise ToolError(f"'tool_choice' names {name!r}, which is not among the tools: {', '.join(g['name'] for g in funcs)}", "tool_choice")
        choice = {"name": name}
    elif choice not in ("auto", "required"):
        raise ToolError("'tool_choice' must be \"none\", \"auto\", \"required\" or {'type': 'function', 'function': {'name': ...}}", "tool_choice")
    return Tools(funcs, choice, parallel, template_format(chat_template), list(raw))


def response_format_grammar(body: dict[str, Any]) -> str | None:
    """The grammar ``response_format`` asks for (None: free text)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ToolError("'response_format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = rf.get("schema")  # llama-server's extension: a schema beside json_object
        if schema is None:
            return json_object_grammar()
        if not isinstance(schema, dict):
            raise ToolError("'response_format.schema' must be a JSON schema object", "response_format.schema")
        return json_schema_grammar(schema)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ToolError("'response_format.json_schema' must be {'name': ..., 'schema': {...}, 'strict': true}", "response_format.json_schema")
        name = js.get("name")
        if name is not None and (not isinstance(name, str) or not NAME_RE.match(name)):
            raise ToolError("'response_format.json_schema.name' must be 1 to 64 letters, digits, '_', '.' or '-'", "response_format.json_schema.name")
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise ToolError("'response_format.json_schema.schema' must be a JSON schema object", "response_format.json_schema.schema")
        return json_schema_grammar(schema)
    raise ToolError(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}", "response_format.type")


def call_grammar(t: Tools, mark: Callable[[str], str] = lark_string) -> str | None:
    """For ``required`` or a named function: a grammar whose sentences are calls in the model's
    convention (one, or one or more with ``parallel_tool_calls``). None for ``auto``. ``mark``
    writes a marker as a Lark term (see ``grammar.marker``)."""
    if t.choice == "auto":
        return None
    funcs = [f for f in t.tools if isinstance(t.choice, str) or f["name"] == t.choice["name"]]
    return callformats.call_grammar(callformats.CONVENTIONS[t.fmt], funcs, t.parallel, mark)


def system_prompt(t: Tools) -> str:
    """The ``list`` convention's description of the tools (SmolLM2's tool prompt)."""
    specs = json.dumps([{"name": f["name"], "description": f["description"], "parameters": f["parameters"]} for f in t.tools], ensure_ascii=False)
    return (
        "You are an expert in composing functions. You are given a question and a set of possible functions. "
        "Based on the question, you will need to make one or more function/tool calls to achieve the purpose. "
        "If none of the functions can be used, answer the question directly.\n\n"
        f"You have access to the following tools:\n<tools>{specs}</tools>\n\n"
        "To call tools, answer with only this, the arguments matching each tool's parameters:\n"
        '<tool_call>[{"name": "func_name1", "arguments": {"argument1": "value1"}}]</tool_call>'
    )


def _arguments(s: Any, where: str) -> Any:
    if isinstance(s, dict):
        return s
    if not isinstance(s, str):
        raise ToolError(f"{where}.function.arguments must be a JSON string", f"{where}.function.arguments")
    try:
        return json.loads(s) if s.strip() else {}
    except json.JSONDecodeError:
        raise ToolError(f"{where}.function.arguments is not valid JSON", f"{where}.function.arguments") from None


def convert_messages(msgs: list[dict[str, Any]], fmt: str) -> list[dict[str, Any]]:
    """``tool`` messages and assistant ``tool_calls`` (already shape-checked content) in the
    template's convention. Each message is {"role", "content", ...}."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(msgs):
        calls = msg.get("tool_calls")
        if msg["role"] == "assistant" and calls:
            if not isinstance(calls, list):
                raise ToolError(f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
            plain = []
            for j, c in enumerate(calls):
                where = f"messages[{i}].tool_calls[{j}]"
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise ToolError(f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., 'arguments': '...'}}}}", where)
                plain.append({"name": fn["name"], "arguments": _arguments(fn.get("arguments", "{}"), where), "id": c.get("id")})
            if callformats.CONVENTIONS[fmt].native:
                out.append(
                    {
                        "role": "assistant",
                        "content": msg["content"],
                        "tool_calls": [{"id": p["id"], "type": "function", "function": {"name": p["name"], "arguments": p["arguments"]}} for p in plain],
                    }
                )
            else:
                text = json.dumps([{"name": p["name"], "arguments": p["arguments"]} for p in plain], ensure_ascii=False)
                out.append({"role": "assistant", "content": (msg["content"] + "\n" if msg["content"] else "") + f"{OPEN}{text}{CLOSE}"})
        elif msg["role"] == "tool":
            if callformats.CONVENTIONS[fmt].native:
                out.append({"role": "tool", "content": msg["content"], "tool_call_id": msg.get("tool_call_id")})
            else:
                out.append({"role": "user", "content": f"<tool_response>\n{msg['content']}\n</tool_response>"})
        else:
            out.append({"role": msg["role"], "content": msg["content"]})
    return out


def with_tools(msgs: list[dict[str, Any]], t: Tools) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and the template variables that show ``t`` to the model."""
    if callformats.CONVENTIONS[t.fmt].native:
        return msgs, {"tools": t.openai}
    sys = system_prompt(t)
    if msgs and msgs[0]["role"] == "system":
        return [{"role": "system", "content": msgs[0]["content"] + "\n\n" + sys}, *msgs[1:]], {}
    return [{"role": "system", "content": sys}, *msgs], {}


# A template that shows the tools from a `functions` JSON string (FireFunction v2's) rather than
# a `tools` list.
_FUNCTIONS_VAR = re.compile(r"(\+|\{\{-?)\s*functions\b")


def prepare_messages(msgs: list[dict[str, Any]], t: Tools | None, chat_template: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``msgs`` in the template's call convention, and the template variables that show ``t``
    to the model (none without tools). ToolError names a malformed call."""
    msgs = convert_messages(msgs, t.fmt if t is not None else template_format(chat_template))
    if chat_template and _FUNCTIONS_VAR.search(chat_template):
        # it reads `functions` unconditionally: empty without tools (as llama.cpp leaves it)
        return msgs, {"functions": json.dumps(t.tools, indent=4) if t is not None else ""}
    return with_tools(msgs, t) if t is not None else (msgs, {})
