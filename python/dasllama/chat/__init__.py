"""Chat templates: the model's own Jinja template, rendered in jinja2's sandbox as Hugging Face's
``apply_chat_template`` does, and an interactive chat on the command line.

    python -m dasllama.chat [-m MODEL]
"""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError as JinjaTemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import TemplateError
from ..model import Model, encode

Message = dict[str, Any]


def _raise(message: str) -> None:
    raise TemplateError(f"the chat template refused the conversation: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render_chat(m: Model, messages: list[Message], add_generation_prompt: bool = True, **extra: Any) -> str:
    """Render ``messages`` (dicts with ``role`` and ``content``) through the model's chat template."""
    if not m.chat_template:
        raise TemplateError(f"{m.path.name} has no chat template (tokenizer.chat_template); it is a base model: use dasllama.generate with raw text")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise TemplateError(f"message {i} must be a dict with 'role' and 'content', got {msg!r}")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    # Hugging Face's tojson: keys in their order and no HTML escaping (jinja's own sorts keys and
    # writes '<' as \u003c), so tools and call arguments read as the model was trained on them.
    env.filters["tojson"] = _tojson

    def token(key: str) -> str:
        tid = m.metadata.get(key)
        return m._native.token_text(int(tid)) if tid is not None and 0 <= int(tid) < m.n_vocab else ""

    try:
        tmpl = env.from_string(m.chat_template)
        return tmpl.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=token("tokenizer.ggml.bos_token_id"),
            eos_token=token("tokenizer.ggml.eos_token_id"),
            **extra,
        )
    except TemplateError:
        raise
    except JinjaTemplateError as e:
        raise TemplateError(f"{m.path.name}: the chat template failed to render: {e}") from e


_MARK = "\u2063dasllama-reply\u2063"


@dataclass
class ChatRenderer:
    """A conversation as messages, rendered to tokens on demand; it holds no KV."""

    model: Model
    messages: list[Message] = field(default_factory=list)
    max_new: int = 256
    # None: the template's own default; a bool is passed as `enable_thinking` (Qwen3's switch).
    thinking: bool | None = None


def create_chat_renderer(m: Model, system: str = "", max_new: int = 256) -> ChatRenderer:
    """A renderer over ``m``'s own chat template, with an optional system turn."""
    render_chat(m, [{"role": "user", "content": "x"}])  # fail now, with the template's error, not later
    return ChatRenderer(m, [{"role": "system", "content": system}] if system else [], max_new)


def add_user(chat: ChatRenderer, text: str) -> None:
    chat.messages.append({"role": "user", "content": text})


def add_assistant(chat: ChatRenderer, text: str) -> None:
    """Record a reply (one the model gave, or a replayed one); nothing is evaluated."""
    chat.messages.append({"role": "assistant", "content": text})


def encode_prompt(m: Model, text: str) -> list[int]:
    """A rendered prompt as tokens, special tokens parsed and BOS added where the model adds it.
    A template that writes the BOS text itself (Gemma's ``{{ bos_token }}``) does not get a
    second one: llama.cpp cuts the text's leading BOS when its tokenizer adds one, and so do we."""
    bos = m.bos_id
    if bos is not None and encode(m, "") == [bos]:
        text = text.removeprefix(m._native.token_text(bos))
    return encode(m, text, special=True)


def render_turn(m: Model, chat: ChatRenderer) -> list[int]:
    """The whole conversation so far plus the assistant's opening, as tokens."""
    return encode_prompt(m, render_chat(m, chat.messages, add_generation_prompt=True, **_thinking(chat)))


def _close_text(m: Model, chat: ChatRenderer) -> str:
    """What the template writes after an assistant reply: render one with a marker and cut."""
    text = render_chat(m, [*chat.messages, {"role": "assistant", "content": _MARK}], add_generation_prompt=False, **_thinking(chat))
    at = text.rfind(_MARK)
    return text[at + len(_MARK) :] if at >= 0 else ""


def render_close(m: Model, chat: ChatRenderer) -> list[int]:
    """The tokens that close the assistant's turn after its reply (e.g. ``<|im_end|>\\n``)."""
    return encode(m, _close_text(m, chat), add_bos=False, special=True)


def turn_stop_ids(chat: ChatRenderer) -> list[int]:
    """Tokens that end the reply: the model's end-of-generation ids and the template's turn end."""
    m = chat.model
    close = render_close(m, chat)
    ids = list(m.eog_ids)
    if close and m._native.token_type(close[0]) in (3, 4) and close[0] not in ids:
        ids.append(close[0])
    return ids


def set_thinking(chat: ChatRenderer, on: bool) -> None:
    """Ask a thinking template to think or not: rendered as the template's ``enable_thinking``
    (Qwen3's closes an empty ``<think>`` block after the assistant's opening when it is false;
    Gemma 4's opens the system turn with the ``<|think|>`` gate when it is true, and otherwise,
    its default, prefills the closed empty thought channel ``<|channel>thought\n<channel|>``).
    Templates that do not read it are unaffected."""
    chat.thinking = bool(on)


def _thinking(chat: ChatRenderer) -> dict[str, Any]:
    return {} if chat.thinking is None else {"enable_thinking": chat.thinking}


@dataclass(frozen=True)
class NothinkGuard:
    """The thinking-off extras of a non-thinking turn: the token ids of the template's thought
    markers. The scheduler treats a marker before the reply's first content as a leading thought
    (emitted, for :class:`ThoughtSplitter` to split off) and one after content as the end of the
    stream (a stop; the marker is not emitted)."""

    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]


THOUGHT_MARKERS = ("<think>", "</think>")
# Harmony (gpt-oss): the reasoning is the analysis channel, the answer the final one. The model
# switches channels itself; the pair stands for that format wherever markers are passed around.
HARMONY_MARKERS = ("<|channel|>analysis<|message|>", "<|channel|>final<|message|>")
# The tokens a Harmony template writes (each one token in gpt-oss's vocabulary).
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
# The levels gpt-oss's template takes as `reasoning_effort` ("medium" where none is given).
HARMONY_EFFORTS = ("low", "medium", "high")
# Gemma 4 writes a thought as `<|channel>thought\n...<channel|>`: the reply's markers are these,
# the guard's are the two channel tokens (GEMMA4_CHANNEL), and the newline after the channel's
# name belongs to neither (llama.cpp's parser drops it too).
GEMMA4_THOUGHT = ("<|channel>thought", "<channel|>")
GEMMA4_CHANNEL = ("<|channel>", "<channel|>")


def _is_gemma4_thinker(m: Model) -> bool:
    """Gemma 4's template (it writes `<|turn>` and the thought channel) over a vocabulary that
    holds both channel markers as special tokens."""
    tmpl = m.chat_template or ""
    return "<|turn>" in tmpl and all(t in tmpl for t in GEMMA4_CHANNEL) and all(_marker_id(m, t) is not None for t in GEMMA4_CHANNEL)


def _marker_id(m: Model, text: str) -> int | None:
    """The id of ``text`` where the vocabulary holds it as one special token, else None."""
    ids = encode(m, text, add_bos=False, special=True)
    return ids[0] if len(ids) == 1 and m._native.token_type(ids[0]) in (3, 4) else None


def is_harmony(m: Model) -> bool:
    """Whether ``m`` speaks Harmony (gpt-oss): its template writes channels and its vocabulary
    holds the format's tokens as special tokens."""
    tmpl = m.chat_template or ""
    return "<|channel|>" in tmpl and all(_marker_id(m, t) is not None for t in HARMONY_TOKENS)


def thought_markers(m: Model) -> tuple[str, str] | None:
    """The template's thought markers (``<think>``, ``</think>``) where ``m`` thinks: its template
    writes them and its vocabulary holds both as special tokens (Qwen3 does; Qwen2.5 shares the
    template family but has no such tokens, so nothing is armed for it); Gemma 4's
    ``<|channel>thought`` and ``<channel|>``."""
    if _is_gemma4_thinker(m):
        return GEMMA4_THOUGHT
    tmpl = m.chat_template or ""
    if is_harmony(m):
        return HARMONY_MARKERS
    if not all(t in tmpl for t in THOUGHT_MARKERS):
        return None
    if any(_marker_id(m, t) is None for t in THOUGHT_MARKERS):
        return None
    return THOUGHT_MARKERS


def make_nothink_guard(chat: ChatRenderer) -> NothinkGuard | None:
    """The guard of a turn rendered with thinking off (``set_thinking(chat, False)``) on a model
    whose template thinks; None where the turn may think or the model cannot. Gemma 4's turn
    thinks only when asked (``set_thinking(chat, True)`` renders its ``<|think|>`` gate); by
    default it is rendered closed, and its guard holds the two channel markers."""
    m = chat.model
    if _is_gemma4_thinker(m):
        if chat.thinking is True:
            return None
        o, c = (_marker_id(m, t) for t in GEMMA4_CHANNEL)
        assert o is not None and c is not None
        return NothinkGuard((o,), (c,))
    # Harmony has no thinking-off form (gpt-oss always reasons; `reasoning_effort` sets how much).
    if chat.thinking is not False or thought_markers(m) in (None, HARMONY_MARKERS):
        return None
    o, c = (_marker_id(m, t) for t in THOUGHT_MARKERS)
    assert o is not None and c is not None
    return NothinkGuard((o,), (c,))


class ThoughtSplitter:
    """Splits a reply's leading thought from its content as pieces arrive: ``feed`` returns the
    (reasoning, content) text each piece adds, holding back what may be the start of a marker;
    ``finish`` flushes. A thought counts only at the reply's start (after whitespace); an unclosed
    one is reasoning. ``in_thought``: the prompt already opened the thought (a template whose
    generation prompt ends with ``<think>``)."""

    def __init__(self, markers: tuple[str, str] = THOUGHT_MARKERS, in_thought: bool = False) -> None:
        self.open, self.close = markers
        self.state = "thought" if in_thought else "start"
        self.buf = ""
        # Gemma 4: the newline that ends the channel's name `<|channel>thought` is not thought.
        self.skip_newline = markers == GEMMA4_THOUGHT and not in_thought

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, content = "", ""
        while self.buf:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(self.open):
                    self.buf = stripped[len(self.open) :]
                    self.state = "thought"
                    continue
                if not stripped or self.open.startswith(stripped):
                    break  # whitespace, or maybe the start of the marker: wait
                self.state = "content"
                continue
            if self.state == "thought":
                if self.skip_newline:
                    if self.buf.startswith(self.close):
                        self.skip_newline = False  # an empty thought, `<|channel>thought<channel|>`
                    elif not self.close.startswith(self.buf):
                        self.buf = self.buf.removeprefix("\n")
                        self.skip_newline = False
                    else:
                        break  # maybe the close marker: wait
                at = self.buf.find(self.close)
                if at >= 0:
                    reasoning += self.buf[:at]
                    self.buf = self.buf[at + len(self.close) :].lstrip("\n")
                    self.state = "after"
                    continue
                keep = _partial_suffix(self.buf, self.close)
                reasoning += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep :]
                break
            if self.state == "after":
                # The newlines between the thought and the answer belong to neither.
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    break
                self.state = "content"
                continue
            content += self.buf
            self.buf = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.state == "thought":
            return rest, ""
        if self.state == "start":
            return "", rest.lstrip() if rest.strip() else ""
        return "", rest if self.state == "content" else rest.lstrip("\n")


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HarmonySplitter:
    """Splits a Harmony reply (gpt-oss) by channel as pieces arrive, with :class:`ThoughtSplitter`'s
    ``feed``/``finish``. A reply is messages ``[<|start|>role]<|channel|>NAME[ to=...]
    [<|constrain|>...]<|message|>BODY``, each ended by ``<|end|>`` (a control token, not in the
    text), the next header, or the reply's end (``<|return|>`` and ``<|call|>`` stop it). Bodies of
    the ``final`` channel are content, of ``analysis`` and ``commentary`` reasoning; the headers are
    neither. With ``calls``, a message to a function (``to=functions.NAME`` in its header) is a
    tool call: it goes out as content, whole at its end, in the form ``<tool_call>{"name": NAME, "arguments": BODY}</tool_call>``
    that the server's call parser reads. A reply that opens with no header (a model that skips the
    format) is content; ``in_thought``: the prompt already opened the analysis channel."""

    HEADS = ("<|start|>", "<|channel|>")
    ENDS = ("<|end|>", "<|return|>", "<|call|>")

    def __init__(self, in_thought: bool = False, calls: bool = False) -> None:
        self.calls = calls
        self.state = "body" if in_thought else "start"
        self.channel = "analysis"
        self.recipient: str | None = None  # the function a message is addressed to
        self.call = ""  # that message's body so far
        self.buf = ""

    def _sink(self, text: str, out: list[str]) -> None:
        if self.recipient is not None:
            self.call += text
        else:
            out[0 if self.channel == "final" else 1] += text

    def _end_message(self, out: list[str]) -> None:
        if self.recipient is not None:
            out[0] += '<tool_call>{"name": ' + json.dumps(self.recipient) + ', "arguments": ' + (self.call.strip() or "{}") + "}</tool_call>"
            self.recipient, self.call = None, ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        out = ["", ""]  # content, reasoning
        while self.buf:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(self.HEADS):
                    self.buf, self.state = stripped, "header"
                    continue
                if not stripped or any(h.startswith(stripped) for h in self.HEADS):
                    break  # whitespace, or maybe the start of a header: wait
                self.state, self.channel = "body", "final"
                continue
            if self.state == "header":
                at = self.buf.find("<|message|>")
                if at < 0:
                    break
                head, self.buf = self.buf[:at], self.buf[at + len("<|message|>") :]
                name = head.split("<|channel|>", 1)[1] if "<|channel|>" in head else "final"
                self.channel = name.split("<|", 1)[0].split(" ", 1)[0].strip() or "final"
                to = re.search(r"to=functions\.([^\s<]+)", head)
                self.recipient = to.group(1) if to and self.calls else None
                self.state = "body"
                continue
            # A body runs to the next marker; what may be the start of one is held back.
            hits = [(at, mk) for mk in self.HEADS + self.ENDS if (at := self.buf.find(mk)) >= 0]
            if hits:
                at, mk = min(hits)
                self._sink(self.buf[:at], out)
                self._end_message(out)
                if mk in self.HEADS:
                    self.buf, self.state = self.buf[at:], "header"
                else:
                    self.buf, self.state = self.buf[at + len(mk) :], "start"
                continue
            keep = max(_partial_suffix(self.buf, mk) for mk in self.HEADS + self.ENDS)
            self._sink(self.buf[: len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep :]
            break
        return out[1], out[0]

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.state == "body":
            out = ["", ""]
            self._sink(rest, out)
            self._end_message(out)
            return out[1], out[0]
        if self.state == "start" and rest.strip():
            return "", rest.lstrip()
        return "", ""  # an unfinished header is markup, not text


def thought_splitter(markers: tuple[str, str] = THOUGHT_MARKERS, in_thought: bool = False, calls: bool = False) -> ThoughtSplitter | HarmonySplitter:
    """The incremental splitter for a template's markers (:func:`thought_markers`); ``calls``:
    Harmony's messages to functions go out as tool-call blocks (the request declared tools)."""
    return HarmonySplitter(in_thought, calls) if markers == HARMONY_MARKERS else ThoughtSplitter(markers, in_thought)


def split_reasoning(reply: str, markers: tuple[str, str] = THOUGHT_MARKERS, in_thought: bool = False, calls: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a whole reply (see :class:`ThoughtSplitter`, :class:`HarmonySplitter`)."""
    sp = thought_splitter(markers, in_thought, calls)
    r1, c1 = sp.feed(reply)
    r2, c2 = sp.finish()
    return r1 + r2, c1 + c2
