"""The OpenAI-compatible HTTP API over one or more engines (Starlette + uvicorn)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import datetime
import json
import logging
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .. import scheduler as sched
from .. import vision
from ..chat import HARMONY_EFFORTS, ChatRenderer, NothinkGuard, encode_prompt, is_harmony, make_nothink_guard, render_chat, render_close, thought_markers
from ..errors import ContextOverflowError, DasllamaError, TemplateError
from ..grammar import check_grammar
from ..grammar import marker as grammar_marker
from ..model import encode
from ..session import SamplingParams
from .engine import Engine, EngineDead, EngineFailure, Subscription
from .gbnf import request_grammar
from .image_urls import ImageURLError, fetch_image
from .logit_bias import parse_logit_bias
from .options import Options
from .status import StatusHistory
from .tools import ToolError, Tools, call_grammar, parse_tools, prepare_messages, response_format_grammar

if TYPE_CHECKING:  # tools_builtin builds on this module
    from .tools_builtin import ServerTools

log = logging.getLogger("dasllama.serve")

MAX_BODY = 4 << 20  # 4 MiB: far above any prompt the served models' contexts hold
# A prompt's text is refused before any template or tokenizer work when it has more than this many
# bytes per token of context: real text runs at 3-5 bytes a token, so a prompt past it could not
# fit, and refusing it costs nothing (`--max-prompt-bytes` overrides).
BYTES_PER_CONTEXT_TOKEN = 16


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type_, param, code, headers or {}
        self.extra = extra or {}  # more fields for the error object (llama-server's n_prompt_tokens, n_ctx)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code, **self.extra}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def internal_error(exc: BaseException, what: str) -> ApiError:
    """The 500 for an exception no code path expected. It carries the exception's own message, so
    a client can report what failed, but no traceback or type: those go to the log."""
    return ApiError(500, f"{what} failed: {str(exc) or type(exc).__name__}", type_="server_error", code="internal_error")


# ---- metrics -----------------------------------------------------------------------------------

ENCODE_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
TTFT_BUCKETS = [0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
ITL_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1]


@dataclass
class Histogram:
    buckets: list[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def observe(self, v: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.total += v
        self.n += 1

    def render(self, name: str, labels: str) -> list[str]:
        counts = self.counts or [0] * len(self.buckets)
        out = [f'{name}_bucket{{{labels},le="{b}"}} {c}' for b, c in zip(self.buckets, counts, strict=True)]
        out += [f'{name}_bucket{{{labels},le="+Inf"}} {self.n}', f"{name}_sum{{{labels}}} {self.total}", f"{name}_count{{{labels}}} {self.n}"]
        return out


@dataclass
class Metrics:
    requests: dict[tuple[str, str], int] = field(default_factory=dict)
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    generated_tokens: dict[str, int] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)
    ttft: dict[str, Histogram] = field(default_factory=dict)
    itl: dict[str, Histogram] = field(default_factory=dict)
    tokens_out: dict[str, int] = field(default_factory=dict)  # generated tokens as they stream, for the status page's rates
    embedded_tokens: int = 0  # prompt tokens of embedding (and rerank) requests
    embed_passes: int = 0  # their forward passes
    images: dict[str, int] = field(default_factory=dict)  # images through the vision tower
    image_encode: dict[str, Histogram] = field(default_factory=dict)  # their requests' encode time

    def outcome(self, model: str, outcome: str) -> None:
        self.requests[(model, outcome)] = self.requests.get((model, outcome), 0) + 1

    def encoded(self, model: str, n_images: int, seconds: float) -> None:
        """A request's images went through the vision tower in ``seconds``."""
        self.images[model] = self.images.get(model, 0) + n_images
        self.image_encode.setdefault(model, Histogram(ENCODE_BUCKETS)).observe(seconds)


# ---- request parsing ---------------------------------------------------------------------------


def _num(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any, lo: float | None = None, hi: float | None = None) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if kind is int and isinstance(v, float) and v.is_integer():
        v = int(v)  # JSON has one number type: 10.0 is the integer 10 to most clients
    if isinstance(v, bool) or not isinstance(v, kind):
        raise ApiError(400, f"'{key}' must be {'an integer' if kind is int else 'a number'}, got {type(v).__name__}", param=key, code="invalid_type")
    if isinstance(v, float) and not math.isfinite(v):
        raise ApiError(400, f"'{key}' must be finite", param=key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bound = f"between {lo:g} and {hi:g}" if lo is not None and hi is not None else f"at least {lo:g}" if lo is not None else f"at most {hi:g}"
        raise ApiError(400, f"'{key}' must be {bound}, got {v}", param=key, code="invalid_value")
    return v


KNOWN_FIELDS = {
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop", "stream", "stream_options",
    "logprobs", "top_logprobs", "n", "user", "ignore_eos", "response_format", "tools", "tool_choice", "parallel_tool_calls",
    "chat_template_kwargs", "enable_thinking", "reasoning_effort", "verbose", "continue_final_message", "add_generation_prompt",
    "logit_bias", "return_progress",
}

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def _reasoning_effort(body: dict[str, Any]) -> str | None:
    """`reasoning_effort` as OpenAI, vLLM and llama-server take it: passed to the template (where
    one reads it, e.g. gpt-oss's); "none" and "minimal" also turn thinking off where the request
    does not say `enable_thinking` itself (Qwen3's templates have no levels, only on and off)."""
    v = body.get("reasoning_effort")
    if v is not None and v not in REASONING_EFFORTS:
        raise ApiError(400, f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}", param="reasoning_effort")
    return v


def _enable_thinking(body: dict[str, Any]) -> bool | None:
    """`enable_thinking` at the top level or in `chat_template_kwargs` (as vLLM and llama-server
    take it): None leaves the template's default."""
    kw = body.get("chat_template_kwargs", {})
    if not isinstance(kw, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    unknown = set(kw) - {"enable_thinking"}
    if unknown:
        log.warning("ignoring chat_template_kwargs %s (only enable_thinking is passed to templates)", sorted(unknown))
    v = body.get("enable_thinking", kw.get("enable_thinking"))
    if v is not None and not isinstance(v, bool):
        raise ApiError(400, "'enable_thinking' must be a boolean", param="enable_thinking")
    return v


def request_logit_bias(m: Any, body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """The request's `logit_bias` (logit_bias.py), a 400 when malformed."""
    try:
        return parse_logit_bias(m, body.get("logit_bias"))
    except ValueError as e:
        raise ApiError(400, str(e), param="logit_bias") from None


@dataclass
class Job:
    engine: Engine
    prompt: list[int]
    params: SamplingParams
    max_new: int
    stop: list[str]
    stop_ids: list[int]
    close_toks: list[int]
    n: int
    seed: int | None
    logprobs: int | None
    stream: bool
    include_usage: bool
    ignore_eos: bool = False
    grammar: str | None = None  # llguidance grammar constraining every choice
    grammar_param: str | None = None  # the request field the grammar came from (for errors)
    tools: Tools | None = None  # parse tool calls out of the replies
    # Where the model's template thinks: its thought markers, split off each reply's leading
    # thought into `reasoning_content`; `in_thought` when the prompt itself opened the thought.
    markers: tuple[str, str] | None = None
    in_thought: bool = False
    nothink: NothinkGuard | None = None
    verbose: bool = False  # llama-server's "verbose": the answer carries the prompt it ran (__verbose)
    # Images in the prompt: (first prompt row, embeddings, ...) per span (sched.PendingReq.images).
    images: list[tuple[int, Any]] = field(default_factory=list)
    image_encode_s: float = 0.0  # the vision tower's time over those images (timings, /metrics)
    n_images: int = 0  # the pictures given: an Idefics3 picture is several spans of `images`
    # llama-server's return_progress: the prefill's progress comes through events() as
    # ("", progress event, None) items, for a stream that reports them.
    progress: bool = False


def _utf8_len(text: str, param: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ApiError(400, f"'{param}' holds a lone surrogate (\\ud800-\\udfff), which is not text", param=param, code="invalid_encoding") from None


def _strip_bos(m: Any, text: str) -> str:
    """The rendered text without a leading BOS text where the tokenizer adds one (as
    ``encode_prompt``)."""
    bos = m.bos_id
    if bos is not None and encode(m, "") == [bos]:
        return text.removeprefix(m._native.token_text(bos))
    return text


def _image_part(p: dict[str, Any], where: str, m: Any, images: list[Any], opts: Options | None = None) -> str:
    """An ``image_url`` part: its picture decoded into ``images``; its place in the text is the
    media marker. Data URLs; http(s) URLs only where the server allows them (--allow-image-urls),
    fetched within its size and time limits. 400 naming the problem."""
    if m.projector is None:
        raise ApiError(400, f"{where}: '{m.path.name}' takes no images (serve it with its --mmproj file)", param=where, code="images_not_supported")
    iu = p.get("image_url")
    url = iu.get("url") if isinstance(iu, dict) else iu
    if not isinstance(url, str):
        raise ApiError(400, f"{where}.image_url must be {{'url': 'data:image/...;base64,...'}}", param=where)
    if url.startswith(("http://", "https://")):
        if opts is None or not opts.image_urls:
            raise ApiError(400, f"{where}: this server fetches no remote images (start it with --allow-image-urls); send the picture as a data: URL", param=where, code="invalid_image_url")
        try:
            raw = fetch_image(url, opts.image_url_max_bytes, opts.image_url_timeout_s)
        except ImageURLError as e:
            raise ApiError(400, f"{where}: {e}", param=where, code="invalid_image_url") from None
    elif url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ApiError(400, f"{where}: a data URL must be base64 (data:image/png;base64,...)", param=where, code="invalid_image_url")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, f"{where}: the data URL's base64 does not decode", param=where, code="invalid_image_url") from None
    else:
        allowed = "data: URLs and http(s) URLs" if opts is not None and opts.image_urls else "only data: URLs (this server fetches no remote images)"
        raise ApiError(400, f"{where}: an image URL must be a data: URL or http(s); this server takes {allowed}", param=where, code="invalid_image_url")
    try:
        images.append(vision.decode_image(raw))
    except vision.ImageError as e:
        raise ApiError(400, f"{where}: {e}", param=where, code="invalid_image") from None
    return vision.MEDIA_MARKER


def _content(msg: dict[str, Any], i: int, m: Any = None, images: list[Any] | None = None, opts: Options | None = None) -> str:
    """A message's text; its ``image_url`` parts (for a model that takes images) become media
    markers, their pictures appended to ``images``."""
    c = msg.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for j, p in enumerate(c):
            if isinstance(p, dict) and p.get("type") == "image_url" and images is not None:
                parts.append(_image_part(p, f"messages[{i}].content[{j}]", m, images, opts))
                continue
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ApiError(400, f"messages[{i}].content parts must be {{'type': 'text', 'text': ...}} or {{'type': 'image_url', ...}}", param=f"messages[{i}].content")
            parts.append(p["text"])
        return "".join(parts)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text and image parts", param=f"messages[{i}].content")


# ---- the app -----------------------------------------------------------------------------------


class Server:
    def __init__(self, api_key: str | None = None, max_prompt_bytes: int = 0, cors_origins: list[str] | None = None) -> None:
        self.engines: dict[str, Engine] = {}
        # Every name a model answers to (its served name, the name or path it was started with,
        # its file stem) -> its served name.
        self.names: dict[str, str] = {}
        self.max_prompt_bytes = max_prompt_bytes  # 0: BYTES_PER_CONTEXT_TOKEN per context token
        self.default: str | None = None
        self.ready = False
        self.api_key = api_key
        self.cors_origins = list(cors_origins or [])
        self.metrics = Metrics()
        self.history = StatusHistory()
        self.options = Options()
        self.tools: ServerTools | None = None  # /tools: --tools and MCP servers (tools_builtin.py)
        self.cors_proxy = False  # /cors-proxy: --ui-mcp-proxy (proxy.py)
        # Set by the model router (router.py) or sleep mode (sleep.py): every guarded request goes
        # through gate(request, handler); background tasks run for the app's lifetime.
        self.gate: Callable[[Request, Callable[[Request], Awaitable[Response]]], Awaitable[Response]] | None = None
        self.background: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self.extra_routes: Callable[[Any, list[Any]], list[Any]] | None = None

    def engine(self, name: Any) -> Engine:
        if name is None or name == "":
            assert self.default is not None
            return self.engines[self.default]
        if not isinstance(name, str):
            raise ApiError(400, "'model' must be a string", param="model", code="invalid_type")
        served = self.names.get(name, name)
        if served not in self.engines and len(self.engines) == 1:
            # One model served: any name reaches it (clients written for OpenAI send their own
            # model names, as llama-server accepts).
            return next(iter(self.engines.values()))
        if served not in self.engines:
            raise ApiError(404, f"the model '{name}' does not exist; this server has: {', '.join(self.engines)}", param="model", code="model_not_found")
        return self.engines[served]

    def add(self, eng: Engine, *names: str) -> None:
        """Serve `eng` under its name and answer to `names` as well."""
        self.engines[eng.name] = eng
        if self.options.chat_template:
            eng.m.chat_template = self.options.chat_template
        for n in (eng.name, *names, *self.options.aliases):
            self.names.setdefault(n, eng.name)
        self.default = self.default or eng.name

    async def body(self, request: Request) -> dict[str, Any]:
        """Read and parse a JSON body; the parse (up to MAX_BODY) runs off the event loop."""
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > MAX_BODY:
            raise ApiError(413, f"the request body is {int(length)} bytes; the limit is {MAX_BODY}", code="request_too_large")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_BODY:
                raise ApiError(413, f"the request body exceeds {MAX_BODY} bytes", code="request_too_large")
        return await asyncio.get_running_loop().run_in_executor(None, _parse_body, b"".join(chunks))

    def prompt_limit(self, m: Any) -> int:
        return self.max_prompt_bytes or BYTES_PER_CONTEXT_TOKEN * int(m.config["seq_len"])

    def check_prompt_bytes(self, m: Any, n_bytes: int, param: str) -> None:
        limit = self.prompt_limit(m)
        if n_bytes > limit:
            raise ApiError(
                400,
                f"the prompt is too large: {n_bytes} bytes; this server takes at most {limit} bytes for a context of {int(m.config['seq_len'])} tokens "
                "(start it with a larger --max-prompt-bytes to raise the limit)",
                param=param,
                code="context_length_exceeded",
            )

    def job(self, body: dict[str, Any], chat: bool) -> Job:
        eng = self.engine(body.get("model"))
        m = eng.m
        close: list[int] = []
        stop_ids = list(m.eog_ids)
        if chat:
            if not m.chat_template:
                raise ApiError(
                    400,
                    f"'{eng.name}' is a base model: its file has no chat template, so it cannot take 'messages'; send raw text as 'prompt' to /v1/completions instead",
                    param="messages",
                    code="no_chat_template",
                )
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ApiError(400, "'messages' must be a non-empty list", param="messages")
            # The reply continues the last assistant message (a prefill): on request
            # (continue_final_message, as vLLM and transformers take it), and under dasllama-server
            # whenever the conversation ends with one, as llama-server does.
            prefill = bool(body.get("continue_final_message"))
            if prefill and body.get("add_generation_prompt"):
                raise ApiError(400, "'continue_final_message' and 'add_generation_prompt' cannot both be true", param="continue_final_message")
            last = msgs[-1] if isinstance(msgs[-1], dict) else {}
            if prefill and last.get("role") != "assistant":
                raise ApiError(400, "'continue_final_message' needs the last message to be the assistant's", param="continue_final_message")
            if not prefill and self.options.llama_compat and last.get("role") == "assistant" and len(msgs) > 1 and isinstance(msgs[-2], dict) and msgs[-2].get("role") == "assistant":
                # which of the two would the reply continue? llama-server refuses to guess
                raise ApiError(400, "Cannot have 2 or more assistant messages at the end of the list.", param="messages")
            prefill = (prefill or self.options.llama_compat) and last.get("role") == "assistant" and not last.get("tool_calls") and len(msgs) > 1
            try:
                tools = parse_tools(body, m.chat_template)
                grammar, grammar_param = response_format_grammar(body), "response_format"
                if grammar is None:  # llama-server's own fields
                    grammar, grammar_param = request_grammar(body)
            except ToolError as e:
                raise ApiError(400, str(e), param=e.param) from None
            except ValueError as e:
                raise ApiError(400, str(e), param="grammar") from None
            if tools is not None and (g := call_grammar(tools, lambda text: grammar_marker(m, text))) is not None:
                if grammar is not None:
                    raise ApiError(400, "'response_format' cannot apply when 'tool_choice' forces a call: the reply is the call", param="response_format")
                grammar, grammar_param = g, "tools"
            rendered = []
            images: list[Any] = []
            for i, msg in enumerate(msgs):
                if not isinstance(msg, dict) or msg.get("role") not in ("system", "user", "assistant", "developer", "tool"):
                    raise ApiError(400, f"messages[{i}] needs a role of system, user, assistant or tool", param=f"messages[{i}].role")
                role = "system" if msg["role"] == "developer" else msg["role"]
                r = {**msg, "role": role, "content": _content(msg, i, m, images, self.options)}
                if role == "tool" and not isinstance(msg.get("tool_call_id", ""), str):
                    raise ApiError(400, f"messages[{i}].tool_call_id must be a string", param=f"messages[{i}].tool_call_id")
                rendered.append(r)
            # Bounded before the template and the tokenizer see it: their cost grows with it.
            self.check_prompt_bytes(m, sum(_utf8_len(r["content"], "messages") for r in rendered) + len(json.dumps(body.get("tools") or [])), "messages")
            try:
                rendered, extra = prepare_messages(rendered, tools, m.chat_template)
            except ToolError as e:
                raise ApiError(400, str(e), param=e.param) from None
            thinking = _enable_thinking(body)
            if thinking is None and self.options.llama_compat:
                # llama-server passes enable_thinking to every template (false under --reasoning off)
                # and today's date as date_string (Llama 3.x templates print it).
                thinking = self.options.reasoning != "off"
                today = datetime.date.today()
                extra["date_string"] = today.strftime("%d %b %Y")
                extra["datetime"] = today.strftime("%b %d %Y")  # FireFunction v2's
            effort = _reasoning_effort(body)
            if is_harmony(m):
                # gpt-oss's template writes the level into its system message as given, and the
                # model knows three; it always reasons, so "none" cannot switch it off.
                if effort is not None and effort not in HARMONY_EFFORTS:
                    raise ApiError(
                        400,
                        f"'reasoning_effort' is {effort!r}, but this model's template (Harmony, gpt-oss) takes {', '.join(HARMONY_EFFORTS)}",
                        param="reasoning_effort",
                        code="invalid_value",
                    )
                effort = effort or "medium"
            if effort is not None:
                extra["reasoning_effort"] = effort
                if thinking is None and effort in ("none", "minimal"):
                    thinking = False
            if thinking is not None:
                extra["enable_thinking"] = thinking
            head = ""
            if prefill:
                head = rendered[-1]["content"]
                parts = last.get("content")
                if isinstance(parts, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
                    # a prefill in text parts continues them joined by a blank line, as llama.cpp's
                    head = "\n\n".join(p["text"] for p in parts)
                rendered = rendered[:-1]
            try:
                text = render_chat(m, rendered, **extra) + head
                # What closes the reply in the next turn's prompt: evaluated at the end so the
                # whole turn goes to the prefix cache and a follow-up attaches it.
                close = [] if prefill else render_close(m, ChatRenderer(m, rendered, thinking=thinking))
            except TemplateError as e:
                raise ApiError(400, str(e), param="messages") from None
            if images:
                try:
                    ip = vision.tokenize_with_images(m, _strip_bos(m, text), images, add_bos=None)
                except ValueError as e:
                    raise ApiError(400, str(e), param="messages") from None
                prompt, prompt_images, encode_s, n_images = ip.ids, ip.images(), ip.encode_s, len(images)
            else:
                prompt, prompt_images, encode_s, n_images = encode_prompt(m, text), [], 0.0, 0
            markers = thought_markers(m)
            in_thought = markers is not None and text.rstrip().endswith(markers[0])
            nothink = make_nothink_guard(ChatRenderer(m, rendered, thinking=thinking))
        else:
            tools = None
            markers, in_thought, nothink = None, False, None
            prompt_images, encode_s, n_images = [], 0.0, 0
            try:
                grammar, grammar_param = response_format_grammar(body), "response_format"
                if grammar is None:  # llama-server's own fields
                    grammar, grammar_param = request_grammar(body)
            except ToolError as e:
                raise ApiError(400, str(e), param=e.param) from None
            except ValueError as e:
                raise ApiError(400, str(e), param="grammar") from None
            p = body.get("prompt")
            if isinstance(p, str):
                self.check_prompt_bytes(m, _utf8_len(p, "prompt"), "prompt")
                prompt = encode(m, p)
            elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                bad = [t for t in p if not 0 <= t < m.n_vocab]
                if bad:
                    raise ApiError(400, f"token id {bad[0]} is out of range for a vocabulary of {m.n_vocab}", param="prompt")
                prompt = list(p)
            else:
                raise ApiError(400, "'prompt' must be a string or a non-empty list of token ids", param="prompt")
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="messages" if chat else "prompt")
        ctx = int(m.config["seq_len"])
        if len(prompt) + 1 > ctx:
            raise ApiError(
                400,
                f"this model's maximum context length is {ctx} tokens; the prompt has {len(prompt)}",
                type_="exceed_context_size_error" if self.options.llama_compat else "invalid_request_error",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
                extra={"n_prompt_tokens": len(prompt), "n_ctx": ctx} if self.options.llama_compat else None,
            )
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        # The server's cap (--n-predict, or dasllama-server's -n) bounds every request, as
        # llama-server's does; a request that names no bound gets the cap (a text completion
        # OpenAI's 16, except under dasllama-server).
        cap = self.options.n_predict if self.options.n_predict > 0 else eng.n_predict if eng.n_predict > 0 else ctx
        default_new = cap if chat or self.options.n_predict > 0 else 16
        max_new = _num(body, key, int, default_new, 1, None)
        max_new = min(max_new, cap, ctx - len(prompt))
        stop = body.get("stop")
        if stop is None:
            stops: list[str] = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
            stops = list(stop)
        else:
            raise ApiError(400, "'stop' must be a string or a list of at most 4 strings", param="stop")
        stops = [s for s in stops if s]
        seed = _num(body, "seed", int, self.options.seed)
        # What the request leaves out comes from the engine's defaults: the server's flags, else
        # the model file's general.sampling.*, else llama-server's (dasllama.sampling_defaults).
        d = eng.sampling
        params = SamplingParams(
            temp=float(_num(body, "temperature", (int, float), d.temp if self.options.temperature is None else self.options.temperature, 0, 2)),
            top_k=_num(body, "top_k", int, d.top_k, 0, None),
            top_p=float(_num(body, "top_p", (int, float), d.top_p, 0, 1)),
            min_p=float(_num(body, "min_p", (int, float), d.min_p, 0, 1)),
            penalty=float(_num(body, "repetition_penalty", (int, float), d.repeat_penalty, 0, None)),
            presence_penalty=float(_num(body, "presence_penalty", (int, float), 0.0, -2, 2)),
            frequency_penalty=float(_num(body, "frequency_penalty", (int, float), 0.0, -2, 2)),
            penalty_last_n=d.penalty_last_n,
            logit_bias=request_logit_bias(m, body),
        )
        n = _num(body, "n", int, 1, 1, 8)
        lp = body.get("logprobs")
        if chat:
            if lp is not None and not isinstance(lp, bool):
                raise ApiError(400, "'logprobs' must be a boolean", param="logprobs")
            logprobs = _num(body, "top_logprobs", int, 0, 0, 20) if lp else None
        else:
            logprobs = _num(body, "logprobs", int, None, 0, 5)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", param="stream")
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise ApiError(400, "'stream_options' must be an object", param="stream_options")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise ApiError(400, "'ignore_eos' must be a boolean", param="ignore_eos")
        if ignore_eos:
            stop_ids = []
        if grammar is not None:
            # Compiled here, in a worker thread, to answer a bad schema with a 400 before anything
            # is queued, and so that the model's first grammar indexes its vocabulary here rather
            # than inside an engine step, where every stream would wait for it.
            try:
                check_grammar(m, grammar)
            except ValueError as e:
                raise ApiError(400, str(e), param=grammar_param) from None
        verbose = body.get("verbose", self.options.verbose)
        if not isinstance(verbose, bool):
            raise ApiError(400, "'verbose' must be a boolean", param="verbose")
        return Job(
            eng,
            prompt,
            params,
            max_new,
            stops,
            stop_ids,
            close,
            n,
            seed,
            logprobs,
            stream,
            bool(so.get("include_usage", self.options.llama_compat and chat)),
            ignore_eos,
            grammar,
            grammar_param,
            tools,
            markers,
            in_thought,
            nothink,
            verbose=verbose,
            images=prompt_images,
            image_encode_s=encode_s,
            n_images=n_images,
            progress=stream and body.get("return_progress") is True,
        )

    async def start(self, job: Job, index: int) -> tuple[int, Subscription]:
        """Submit one choice of `job`; returns once the engine has queued it. Raises ApiError for a
        request that cannot run or a full queue (503)."""
        eng = job.engine
        if index == 0 and job.images:
            # Counted here, on the event loop as every metric is, once per request: its choices
            # share the one encode.
            self.metrics.encoded(eng.name, job.n_images, job.image_encode_s)
        rid = eng.next_id()
        seed = (job.seed + index) if job.seed is not None else (time.time_ns() + index) % (2**63)
        req = sched.PendingReq(
            id=rid, prompt=job.prompt, close_toks=job.close_toks, stop_ids=job.stop_ids, params=job.params, max_new=job.max_new, seed=seed, logprobs=job.logprobs, ignore_eos=job.ignore_eos,
            grammar=job.grammar, nothink=job.nothink, images=job.images, progress=job.progress,
        )
        sub = Subscription(asyncio.get_running_loop())
        try:
            ok = await eng.submit(req, sub)
        except asyncio.CancelledError:
            eng.cancel(rid)  # it may have been queued just before the client went away
            raise
        except ContextOverflowError as e:
            raise ApiError(400, str(e), code="context_length_exceeded") from None
        except EngineDead as e:
            raise ApiError(503, f"the server cannot serve '{eng.name}': {e}", type_="server_error", code="engine_failure") from None
        except (ValueError, DasllamaError) as e:
            # With a grammar, the likeliest cause is that it does not compile (a bad schema).
            raise ApiError(400, str(e), param=job.grammar_param if job.grammar else None) from None
        if not ok:
            self.metrics.outcome(eng.name, "rejected")
            raise ApiError(503, "the server is at capacity: its request queue is full; retry shortly", type_="server_error", code="queue_full", headers={"Retry-After": "1"})
        return rid, sub

    async def events(self, job: Job, rid: int, sub: Subscription) -> AsyncGenerator[tuple[str, sched.SchedEvent | None, str | None], None]:
        """Yield (text delta, event, finish_reason) for one started choice. A stream that fails
        raises ApiError (after the text it produced); leaving early cancels it."""
        eng = job.engine
        name = eng.name
        pending = ""  # text held back while it could still become a stop string
        t_start = time.monotonic()
        t_last: float | None = None
        finished = False
        try:
            while True:
                ev = await sub.queue.get()
                if isinstance(ev, EngineFailure):
                    finished = True
                    self.metrics.outcome(name, "error")
                    raise ApiError(500, ev.message, type_="server_error", code="engine_failure")
                if ev.kind == "progress":
                    yield "", ev, None
                    continue
                if ev.kind == "piece":
                    now = time.monotonic()
                    self.metrics.tokens_out[name] = self.metrics.tokens_out.get(name, 0) + 1
                    if t_last is None:
                        self.metrics.ttft.setdefault(name, Histogram(TTFT_BUCKETS)).observe(now - t_start)
                    else:
                        self.metrics.itl.setdefault(name, Histogram(ITL_BUCKETS)).observe(now - t_last)
                    t_last = now
                    pending += ev.text
                    at = min((i for i in (pending.find(s) for s in job.stop) if i >= 0), default=-1)
                    if at >= 0:
                        yield pending[:at], ev, None
                        finished = True
                        eng.cancel(rid)
                        yield "", ev, "stop"
                        self._count(name, ev, "stop")
                        return
                    keep = max((len(s) - 1 for s in job.stop), default=0)
                    # Hold back the longest tail that could still grow into a stop string.
                    cut = len(pending)
                    for k in range(min(keep, len(pending)), 0, -1):
                        if any(s.startswith(pending[-k:]) for s in job.stop):
                            cut = len(pending) - k
                            break
                    out, pending = pending[:cut], pending[cut:]
                    yield out, ev, None
                elif ev.finish == "error":
                    finished = True
                    self.metrics.outcome(name, "error")
                    if ev.error_type == "kv_pool_full":
                        raise ApiError(503, f"the server ran out of KV memory for this request: {ev.error}; retry shortly", type_="server_error", code="kv_pool_full", headers={"Retry-After": "1"})
                    raise ApiError(500, f"the request failed inside the engine: {ev.error}", type_="server_error", code=ev.error_type)
                else:
                    finished = True
                    reason = "length" if ev.finish == "length" else "stop"
                    if pending:
                        yield pending, None, None
                    yield "", ev, reason
                    self._count(name, ev, reason)
                    return
        finally:
            if not finished:
                self.metrics.outcome(name, "cancelled")
                eng.cancel(rid)

    def _count(self, name: str, ev: sched.SchedEvent, reason: str) -> None:
        self.metrics.outcome(name, reason)
        self.metrics.prompt_tokens[name] = self.metrics.prompt_tokens.get(name, 0) + ev.n_prompt
        self.metrics.generated_tokens[name] = self.metrics.generated_tokens.get(name, 0) + ev.n_gen
        self.metrics.cached_tokens[name] = self.metrics.cached_tokens.get(name, 0) + ev.n_cached


def _parse_body(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not valid UTF-8", code="invalid_encoding") from None
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    unknown = set(body) - KNOWN_FIELDS
    if unknown:
        log.info("ignoring unknown request fields: %s", ", ".join(sorted(unknown)))
    return body
