"""Grammars for constrained decoding (``PendingReq.grammar``), in llguidance's Lark dialect.

A JSON schema becomes ``start: %json {...}``; text and schemas compose (a tool call is the call's
JSON inside the model's own tags). llguidance compiles the grammar when the request is submitted:
one it cannot compile raises ValueError there, with its reason.

    req = PendingReq(id=1, prompt=ids, max_new=64, grammar=json_schema_grammar({"type": "object"}))
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from . import _native

if TYPE_CHECKING:
    from .model import Model

# Compact JSON (", " and ": ", no other whitespace): a small model left free to indent can spend
# its whole budget on newlines, and the reply is the same data either way. oneOf is read as anyOf
# (what most schema writers mean, and what every JSON value of a oneOf satisfies at least).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "coerce_one_of": True}


def _with_options(schema: dict[str, Any]) -> dict[str, Any]:
    out = dict(schema)
    out.setdefault("x-guidance", JSON_OPTIONS)
    return out


def json_schema_lark(schema: dict[str, Any]) -> str:
    """``schema`` as a Lark expression (``%json {...}``), to place inside a larger grammar."""
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    return "%json " + json.dumps(_with_options(schema), ensure_ascii=False)


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """A grammar whose sentences are the JSON documents valid against ``schema``."""
    return "start: " + json_schema_lark(schema)


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    return json_schema_grammar({"type": "object"})


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def marker(m: Model, text: str) -> str:
    """``text`` as a Lark term for ``m``: the token itself (``<[id]>``) where ``m``'s vocabulary
    holds it as one control token, which no string literal can match; else a string literal."""
    from .model import encode

    ids = encode(m, text, add_bos=False, special=True)
    if len(ids) == 1 and m._native.token_type(ids[0]) == 3:
        return f"<[{ids[0]}]>"
    return lark_string(text)


def check_grammar(m: Model, grammar: str) -> None:
    """Compile ``grammar`` for ``m``; ValueError saying why if it does not compile. The first
    grammar of a model indexes its vocabulary (about a second, GIL released), shared afterwards
    by every scheduler of the model: call this ahead of ``submit`` to keep that wait out of the
    scheduler's steps."""
    _native.check_grammar(m._native, grammar)
