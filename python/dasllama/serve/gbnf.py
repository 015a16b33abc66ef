"""llama.cpp's GBNF grammars (the `grammar` field of llama-server's requests) as llguidance Lark,
which dasllama's constrained decoding compiles. Rules become lowercase Lark rules (`root` is the
start), string literals JSON strings, character classes and `.` regular expressions; repetition
(`*`, `+`, `?`, `{m,n}`), grouping and alternation carry over as written."""

from __future__ import annotations

import json
import re
from typing import Any

from ..grammar import json_schema_grammar

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+|\#[^\n]*)
  | (?P<define>::=)
  | (?P<name>[A-Za-z0-9_-]+)
  | (?P<string>"(?:\\.|[^"\\])*")
  | (?P<cls>\[(?:\\.|[^\]\\])*\])
  | (?P<rep>\{\s*\d*\s*(?:,\s*\d*\s*)?\})
  | (?P<op>[|()*+?.])
    """,
    re.VERBOSE,
)
_ESC = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "]": "]", "[": "[", "-": "-", "^": "^"}


def _unescape(body: str) -> str:
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        if i + 1 >= len(body):
            raise ValueError("a literal ends in a lone backslash")
        e = body[i + 1]
        if e in ("x", "u", "U"):
            n = {"x": 2, "u": 4, "U": 8}[e]
            hexs = body[i + 2 : i + 2 + n]
            if len(hexs) != n or not all(h in "0123456789abcdefABCDEF" for h in hexs):
                raise ValueError(f"bad escape \\{e}{hexs}")
            out.append(chr(int(hexs, 16)))
            i += 2 + n
        else:
            out.append(_ESC.get(e, e))
            i += 2
    return "".join(out)


def _rule_name(name: str) -> str:
    return "r_" + name.lower().replace("-", "_")


def _class_regex(cls: str) -> str:
    """A GBNF character class as a Lark regex (slashes escaped)."""
    body = cls[1:-1]
    return "/[" + body.replace("/", "\\/") + "]/"


def gbnf_to_lark(text: str) -> str:
    """`text` (GBNF) as llguidance Lark; ValueError for what is not GBNF."""
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        mt = _TOKEN.match(text, pos)
        if mt is None:
            raise ValueError(f"unexpected {text[pos:pos + 20]!r} at offset {pos}")
        kind = mt.lastgroup or ""
        if kind != "ws":
            tokens.append((kind, mt.group()))
        pos = mt.end()
    rules: list[tuple[str, list[str]]] = []
    depth = 0
    i = 0
    while i < len(tokens):
        kind, val = tokens[i]
        if kind == "name" and i + 1 < len(tokens) and tokens[i + 1][0] == "define" and depth == 0:
            rules.append((val, []))
            i += 2
            continue
        if not rules:
            raise ValueError(f"expected a rule ('name ::= ...'), got {val!r}")
        body = rules[-1][1]
        if kind == "name":
            body.append(_rule_name(val))
        elif kind == "string":
            body.append(json.dumps(_unescape(val[1:-1]), ensure_ascii=False))
        elif kind == "cls":
            body.append(_class_regex(val))
        elif kind == "rep":
            body[-1:] = [body[-1] + val.replace(" ", "")] if body else [val]
        elif kind == "define":
            raise ValueError("'::=' without a rule name before it")
        elif val == ".":
            body.append("/(.|\\n)/")
        elif val in "*+?":
            if not body or body[-1] in ("|", "("):
                raise ValueError(f"'{val}' follows nothing")
            body[-1] += val
        else:
            depth += {"(": 1, ")": -1}.get(val, 0)
            if depth < 0:
                raise ValueError("unbalanced ')'")
            body.append(val)
        i += 1
    if depth != 0:
        raise ValueError("unbalanced '('")
    names = [n for n, _ in rules]
    if "root" not in names:
        raise ValueError("the grammar has no 'root' rule")
    lines = ["start: r_root"]
    for name, body in rules:
        if not body:
            raise ValueError(f"rule '{name}' is empty")
        lines.append(f"{_rule_name(name)}: {' '.join(body)}")
    return "\n".join(lines) + "\n"


def request_grammar(body: dict[str, Any]) -> tuple[str | None, str | None]:
    """llama-server's request grammars: `json_schema` (a schema) or `grammar` (GBNF), as
    (llguidance grammar, the field it came from); (None, None) when the request has neither.
    ValueError for a field that is not one."""
    if body.get("json_schema") is not None:
        if not isinstance(body["json_schema"], dict):
            raise ValueError("'json_schema' must be a JSON schema object")
        return json_schema_grammar(body["json_schema"]), "json_schema"
    if body.get("grammar"):
        if not isinstance(body["grammar"], str):
            raise ValueError("'grammar' must be a string (GBNF)")
        try:
            return gbnf_to_lark(body["grammar"]), "grammar"
        except ValueError as e:
            raise ValueError(f"failed to parse grammar: {e}") from None
    return None, None
