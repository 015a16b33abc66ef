"""How each model family writes a tool call, read from its chat template as llama.cpp's chat
parsers read it: what opens and closes a call, how the call's text becomes a name and JSON
arguments, and the grammar that forces one (``tool_choice: "required"`` or a named function).

| convention | families | a call as the model writes it |
|---|---|---|
| ``hermes`` | Qwen2.5/3, Hermes, SmolLM3 | ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` |
| ``list`` | SmolLM2 and any template that knows no tools | ``<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`` |
| ``qwen3-coder`` | Qwen3-Coder, Qwen3.5 | ``<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>`` |
| ``glm`` | GLM-4.5/4.6 | ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`` |
| ``llama3`` | Llama 3.1/3.2/3.3 | ``{"name": ..., "parameters": {...}}`` as the whole reply (``<|python_tag|>`` optional) |
| ``mistral`` | Mistral Nemo, Small 3.x, Devstral, Ministral | ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` or ``[TOOL_CALLS]NAME[ARGS]{...}`` |
| ``gemma4`` | Gemma 4 | ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>`` |
| ``deepseek`` | DeepSeek V3/R1/V3.1 | ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>...<｜tool▁sep｜>...<｜tool▁call▁end｜>...`` |
| ``harmony`` | gpt-oss | a ``commentary`` message ``to=functions.NAME`` whose body is the JSON arguments |

Harmony's calls are messages of their own: :class:`dasllama.chat.HarmonySplitter` turns each into a
``hermes`` block as the reply streams, so the same parser reads them.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..grammar import json_schema_lark, lark_string

Call = dict[str, Any]  # {"name": str, "arguments": Any}


@dataclass(frozen=True)
class Convention:
    name: str
    open: str  # what starts a call block
    close: str  # what ends it ("": the reply's end)
    parse: Callable[[str], list[Call] | None]  # a block's text -> its calls, None if it holds none
    native: bool = True  # the template renders `tools` and assistant `tool_calls` itself
    leading_json: bool = False  # a reply that opens with "{" is a call block too (Llama 3.x)
    short_ids: bool = False  # call ids of 9 letters and digits (Mistral's templates insist)


def _json(s: str) -> Any:
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return None


def _named(items: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> list[Call] | None:
    """JSON calls (an object or a list of them) as [{"name", "arguments"}]; None if any is not one."""
    items = items if isinstance(items, list) else [items]
    out: list[Call] = []
    for c in items:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            return None
        args = next((c[k] for k in args_keys if k in c), {})
        if isinstance(args, str):
            args = _json(args)
            if args is None:
                return None
        out.append({"name": c["name"], "arguments": args})
    return out or None


def _parse_json_block(body: str) -> list[Call] | None:
    return _named(_json(body.strip()))


def _value(text: str) -> Any:
    """An XML-style argument's value: JSON where it parses (numbers, objects), else the text."""
    v = _json(text)
    return text if v is None else v


_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)


def _parse_qwen3_coder(body: str) -> list[Call] | None:
    calls = [{"name": n, "arguments": {k: _value(v) for k, v in _PARAMETER.findall(inner)}} for n, inner in _FUNCTION.findall(body)]
    return calls or None


_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _parse_glm(body: str) -> list[Call] | None:
    name = body.split("<arg_key>", 1)[0].strip()
    if not name or any(c in name for c in "<>{}\n"):
        return None
    return [{"name": name, "arguments": {k.strip(): _value(v) for k, v in _ARG.findall(body)}}]


def _parse_llama3(body: str) -> list[Call] | None:
    body = body.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>") :].strip()
    # Several calls come separated by ";" (Llama 3.2's prompt asks for one per reply, but some write more).
    whole = _named(_json(body))
    if whole is not None:
        return whole
    calls: list[Call] = []
    for part in body.split(";"):
        got = _named(_json(part.strip()))
        if got is None:
            return None
        calls += got
    return calls or None


def _parse_mistral(body: str) -> list[Call] | None:
    body = body.strip()
    if body.startswith("["):
        return _named(_json(body))
    # Mistral Small 3.2 and later: NAME[ARGS]{...}, each further call after another [TOOL_CALLS].
    calls: list[Call] = []
    for part in body.split("[TOOL_CALLS]"):
        name, sep, args = part.partition("[ARGS]")
        a = _json(args.strip()) if sep else None
        if not name.strip() or a is None:
            return None
        calls.append({"name": name.strip(), "arguments": a})
    return calls


GEMMA4_QUOTE = '<|"|>'


def gemma4_to_json(text: str) -> Any:
    """Gemma 4's argument syntax (unquoted keys, strings between ``<|"|>`` marks) as a JSON
    value; None where it does not parse."""

    def value(i: int) -> tuple[Any, int]:
        while i < len(text) and text[i].isspace():
            i += 1
        if text.startswith(GEMMA4_QUOTE, i):
            end = text.find(GEMMA4_QUOTE, i + len(GEMMA4_QUOTE))
            if end < 0:
                raise ValueError("an unclosed string")
            return text[i + len(GEMMA4_QUOTE) : end], end + len(GEMMA4_QUOTE)
        if text.startswith("{", i):
            out: dict[str, Any] = {}
            i += 1
            while True:
                while i < len(text) and text[i] in " \n\t,":
                    i += 1
                if text.startswith("}", i):
                    return out, i + 1
                colon = text.find(":", i)
                if colon < 0:
                    raise ValueError("a key without a value")
                out[text[i:colon].strip()], i = value(colon + 1)
        if text.startswith("[", i):
            items: list[Any] = []
            i += 1
            while True:
                while i < len(text) and text[i] in " \n\t,":
                    i += 1
                if text.startswith("]", i):
                    return items, i + 1
                v, i = value(i)
                items.append(v)
        m = re.compile(r"[^,}\]]*").match(text, i)
        assert m is not None  # matches the empty string at worst
        return json.loads(m.group().strip()), m.end()

    try:
        v, i = value(0)
    except (ValueError, IndexError):
        return None
    return v if not text[i:].strip() else None


def _parse_gemma4(body: str) -> list[Call] | None:
    body = body.strip()
    if not body.startswith("call:") or "{" not in body:
        return None
    name, _, args = body[len("call:") :].partition("{")
    a = gemma4_to_json("{" + args)
    if not name.strip() or not isinstance(a, dict):
        return None
    return [{"name": name.strip(), "arguments": a}]


DS_CALL_OPEN, DS_SEP, DS_CALL_CLOSE = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def _parse_deepseek(body: str) -> list[Call] | None:
    calls: list[Call] = []
    for part in body.split(DS_CALL_OPEN)[1:]:
        part = part.split(DS_CALL_CLOSE, 1)[0]
        head, sep, args = part.partition(DS_SEP)
        if not sep:
            return None
        if head.strip() == "function":
            # V3 and R1: function<sep>NAME\n```json\n{...}\n```
            name, _, args = args.partition("\n")
        else:
            name = head  # V3.1: NAME<sep>{...}
        args = args.strip().removeprefix("```json").removesuffix("```").strip()
        a = _json(args)
        if not name.strip() or a is None:
            return None
        calls.append({"name": name.strip(), "arguments": a})
    return calls or None


CONVENTIONS: dict[str, Convention] = {
    c.name: c
    for c in (
        Convention("hermes", "<tool_call>", "</tool_call>", _parse_json_block),
        Convention("list", "<tool_call>", "</tool_call>", _parse_json_block, native=False),
        Convention("qwen3-coder", "<tool_call>", "</tool_call>", _parse_qwen3_coder),
        Convention("glm", "<tool_call>", "</tool_call>", _parse_glm),
        Convention("llama3", "<|python_tag|>", "", _parse_llama3, leading_json=True),
        Convention("mistral", "[TOOL_CALLS]", "", _parse_mistral, short_ids=True),
        Convention("gemma4", "<|tool_call>", "<tool_call|>", _parse_gemma4),
        Convention("deepseek", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", _parse_deepseek),
        # Harmony's calls reach the parser as hermes blocks (see the module's docstring).
        Convention("harmony", "<tool_call>", "</tool_call>", _parse_json_block),
    )
}


def detect(chat_template: str | None) -> Convention:
    """The convention a chat template writes calls in (``list`` where it knows no tools)."""
    t = chat_template or ""
    if "to=functions" in t or ("<|channel|>" in t and '"functions."' in t):
        return CONVENTIONS["harmony"]
    if "<|tool_call>" in t:
        return CONVENTIONS["gemma4"]
    if "[TOOL_CALLS]" in t:
        return CONVENTIONS["mistral"]
    if "tool▁calls▁begin" in t:
        return CONVENTIONS["deepseek"]
    if "<function=" in t and "<parameter=" in t:
        return CONVENTIONS["qwen3-coder"]
    if "<arg_key>" in t:
        return CONVENTIONS["glm"]
    if "<tool_call>" in t and "tools" in t:
        return CONVENTIONS["hermes"]
    if "ipython" in t and '"parameters"' in t:
        return CONVENTIONS["llama3"]
    return CONVENTIONS["list"]


def call_id(conv: Convention) -> str:
    if conv.short_ids:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


# Gemma 4's argument syntax as a grammar (llama.cpp's gemma4 rules: any value, not the schema's).
_GEMMA4_LARK = r"""
g4_value: g4_string | g4_dict | g4_array | g4_number | "true" | "false" | "null"
g4_string: g4_quote /[^<]*/ g4_quote
g4_dict: "{" (g4_kv ("," g4_kv)*)? "}"
g4_kv: /[A-Za-z_][A-Za-z0-9_]*/ ":" g4_value
g4_array: "[" (g4_value ("," g4_value)*)? "]"
g4_number: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?/
"""


def _g4_value(schema: Any) -> str:
    """A Gemma 4 value of ``schema``'s type, as far as the type says (any value otherwise)."""
    if not isinstance(schema, dict):
        return "g4_value"
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return "(" + " | ".join(f"g4_quote {lark_string(v)} g4_quote" for v in schema["enum"]) + ")"
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if schema.get("type") == "integer" and isinstance(lo, int) and isinstance(hi, int) and 0 <= hi - lo <= 64:
        # A small range as its members: the syntax is not JSON, so no JSON schema bounds it.
        return "(" + " | ".join(f'"{v}"' for v in range(lo, hi + 1)) + ")"
    return {"string": "g4_string", "integer": "/-?(0|[1-9][0-9]*)/", "number": "g4_number", "boolean": '("true" | "false")', "object": _g4_object(schema), "array": "g4_array"}.get(
        schema.get("type"), "g4_value"
    )


def _g4_object(schema: Any) -> str:
    """A Gemma 4 dict of ``schema``'s properties (the required ones, then each optional one or
    not, in the schema's order); any dict where the schema names none."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not props:
        return "g4_dict"
    required = set(schema.get("required", []))
    terms = [f'"{k}:" {_g4_value(v)}' for k, v in props.items() if k in required]
    optional = [f'"{k}:" {_g4_value(v)}' for k, v in props.items() if k not in required]
    body = ' "," '.join(terms)
    for t in optional:
        body += f' ("," {t})?' if body else f" ({t})?"
    return f'"{{" {body} "}}"'


def _xml_args(f: dict[str, Any], open_fmt: str, close: str) -> str:
    """A function's arguments as XML-style items (Qwen3-Coder's parameters, GLM's key/value
    pairs): each property's value as JSON between ``open_fmt`` (its ``{k}`` the name) and
    ``close``, the required ones always, the others optionally, in the schema's order."""
    params = f["parameters"] if isinstance(f["parameters"], dict) else {}
    required = set(params.get("required", []))
    items = []
    for k, v in params.get("properties", {}).items():
        item = f"({lark_string(open_fmt.format(k=k))} {json_schema_lark(v if isinstance(v, dict) else {})} {lark_string(close)})"
        items.append(item if k in required else item + "?")
    return " ".join(items)


def _schema(name: str, args: Any, args_key: str = "arguments") -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, args_key: args}, "required": ["name", args_key], "additionalProperties": False}


def call_grammar(conv: Convention, funcs: list[dict[str, Any]], parallel: bool, mark: Callable[[str], str] = lark_string) -> str:
    """A grammar whose sentences are calls of ``funcs`` (one, or one or more where ``parallel``)
    in ``conv``; ``mark`` writes a marker as a Lark term (a special token's own syntax where the
    vocabulary holds it as one)."""
    more = ' ("\\n" call)*' if parallel else ""

    def alt(build: Callable[[dict[str, Any]], str]) -> str:
        return " | ".join(f"({build(f)})" for f in funcs)

    def one_of(args_key: str = "arguments") -> dict[str, Any]:
        schemas = [_schema(f["name"], f["parameters"], args_key) for f in funcs]
        return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}

    if conv.name == "list":
        arr: dict[str, Any] = {"type": "array", "items": one_of(), "minItems": 1}
        if not parallel:
            arr["maxItems"] = 1
        return f"start: {mark('<tool_call>')} {json_schema_lark(arr)} {mark('</tool_call>')}\n"
    if conv.name in ("hermes", "harmony"):
        if conv.name == "harmony":
            # The call is a commentary message to the function; <|call|> (end of generation) closes it.
            call = alt(lambda f: f"{mark('<|channel|>')} {lark_string('commentary to=functions.' + f['name'] + ' ')}{mark('<|constrain|>')} \"json\" {mark('<|message|>')} {json_schema_lark(f['parameters'])}")
            return f"start: {call}\n"
        return f"start: call{more}\ncall: {mark('<tool_call>')} \"\\n\" {json_schema_lark(one_of())} \"\\n\" {mark('</tool_call>')}\n"
    if conv.name == "qwen3-coder":

        def function(f: dict[str, Any]) -> str:
            args = _xml_args(f, "<parameter={k}>\n", "\n</parameter>\n")
            return f"{lark_string('<function=' + f['name'] + '>' + chr(10))} {args} {lark_string('</function>' + chr(10))}"

        return f"start: call{more}\ncall: {mark('<tool_call>')} {lark_string(chr(10))} ({alt(function)}) {mark('</tool_call>')}\n"
    if conv.name == "glm":

        def pairs(f: dict[str, Any]) -> str:
            return f"{lark_string(f['name'])} {_xml_args(f, chr(10) + '<arg_key>{k}</arg_key>' + chr(10) + '<arg_value>', '</arg_value>')}"

        return f"start: call{more}\ncall: {mark('<tool_call>')} ({alt(pairs)}) {lark_string(chr(10))} {mark('</tool_call>')}\n"
    if conv.name == "llama3":
        return f"start: {json_schema_lark(one_of('parameters'))}\n"
    if conv.name == "mistral":
        arr = {"type": "array", "items": one_of(), "minItems": 1}
        if not parallel:
            arr["maxItems"] = 1
        return f"start: {mark('[TOOL_CALLS]')} {json_schema_lark(arr)}\n"
    if conv.name == "gemma4":
        call = alt(lambda f: f'"call:{f["name"]}" {_g4_object(f["parameters"])}')
        return f"start: call{' call*' if parallel else ''}\ncall: {mark('<|tool_call>')} ({call}) {mark('<tool_call|>')}\ng4_quote: {mark(GEMMA4_QUOTE)}\n{_GEMMA4_LARK}"
    if conv.name == "deepseek":
        call = alt(lambda f: f"{lark_string(f['name'])} {mark(DS_SEP)} {json_schema_lark(f['parameters'])}")
        return f"start: {mark('<｜tool▁calls▁begin｜>')} call{'+' if parallel else ''} {mark('<｜tool▁calls▁end｜>')}\ncall: {mark(DS_CALL_OPEN)} ({call}) {mark(DS_CALL_CLOSE)}\n"
    raise ValueError(f"no grammar for the {conv.name} tool-call convention")


class CallParser:
    """Splits a reply, as it streams, into content and tool calls: text outside call blocks is
    content (a tail that could still open a block is held back), a block is given out as its calls
    once it closes (or at the reply's end, for conventions whose calls run to it). A block that
    never closes, or holds no valid call, is content."""

    def __init__(self, conv: Convention | str = "hermes") -> None:
        self.conv = CONVENTIONS[conv] if isinstance(conv, str) else conv
        self.buf = ""
        self.inside = False
        self.opened = ""  # the opener of the block being read ("" for a leading JSON reply)
        self.started = False  # content other than whitespace has been seen
        self.held_ws = ""  # trailing whitespace of the content, given out only if more content follows
        self.n_calls = 0

    def _content(self, s: str) -> str:
        # Trailing whitespace waits: before a call it is dropped, before more text it is given.
        body = s.rstrip()
        if not body:
            self.held_ws += s
            return ""
        self.started = True
        out, self.held_ws = self.held_ws + body, s[len(body) :]
        return out

    def _calls(self, block: str) -> list[dict[str, Any]] | None:
        got = self.conv.parse(block)
        if got is None:
            return None
        return [{"id": call_id(self.conv), "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}} for c in got]

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buf += text
        content, calls = "", []
        opener = self.conv.open
        while True:
            if not self.inside:
                at = self.buf.find(opener)
                if self.conv.leading_json and not self.started and self.buf.lstrip().startswith("{"):
                    at, opener = len(self.buf) - len(self.buf.lstrip()), ""
                if at >= 0:
                    content += self._content(self.buf[:at])
                    self.buf = self.buf[at + len(opener) :]
                    self.inside, self.opened = True, opener
                    continue
                if self.conv.leading_json and not self.started and not self.buf.strip():
                    return content, calls
                keep = next((k for k in range(min(len(opener) - 1, len(self.buf)), 0, -1) if opener.startswith(self.buf[-k:])), 0)
                content += self._content(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                return content, calls
            if not self.conv.close:
                return content, calls  # the block runs to the reply's end
            end = self.buf.find(self.conv.close)
            if end < 0:
                return content, calls
            block = self.buf[:end]
            self.buf = self.buf[end + len(self.conv.close) :]
            self.inside = False
            got = self._calls(block)
            if got is None:
                content += self._content(self.opened + block + self.conv.close)
            else:
                calls += got
                self.n_calls += len(got)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        calls: list[dict[str, Any]] = []
        if self.inside and not self.conv.close:
            got = self._calls(self.buf)
            if got is not None:
                self.buf, self.inside = "", False
                calls = got
                self.n_calls += len(got)
        rest = (self.opened if self.inside else "") + self.buf
        self.buf, self.inside = "", False
        content = self._content(rest)
        if self.held_ws and not self.n_calls:
            content, self.held_ws = content + self.held_ws, ""
        return content, calls


def split_calls(text: str, conv: Convention | str = "hermes") -> tuple[str | None, list[dict[str, Any]]]:
    """A whole reply's content (None if only calls) and calls."""
    p = CallParser(conv)
    c1, calls = p.feed(text)
    c2, more = p.finish()
    calls += more
    content = c1 + c2
    if calls:
        return (content.strip() or None), calls
    return content, calls
