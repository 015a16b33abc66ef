"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the
chat completions: a request is translated into an OpenAI chat request (system, text and
tool_use/tool_result blocks, tools, tool_choice, thinking, stop_sequences), run by the same code
as /v1/chat/completions, and its answer (or its stream) translated back into Anthropic's message
and events. Errors come in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..chat import encode_prompt, render_chat
from ..errors import TemplateError
from .app import ApiError
from .tools import ToolError, parse_tools, prepare_messages

if TYPE_CHECKING:
    from .routes import Handler, Routes

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def anthropic_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}, status_code=status)


def guarded(routes: Routes, handler: Handler) -> Handler:
    """`routes.guarded`, answering errors in Anthropic's shape."""
    return routes.guarded_as(handler, anthropic_error)


def _text(content: Any, where: str) -> str:
    """The text of a content that must hold text only (a system prompt, a tool result)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for b in content:
            if not isinstance(b, dict):
                raise ApiError(400, f"{where}: content blocks must be objects", param=where)
            if b.get("type") == "text" and isinstance(b.get("text"), str):
                out.append(b["text"])
            elif b.get("type") in ("image", "document"):
                raise ApiError(400, f"{where}: image input is not supported by this model", param=where)
            else:
                raise ApiError(400, f"{where}: unsupported content block type {b.get('type')!r}", param=where)
        return "".join(out)
    raise ApiError(400, f"{where} must be a string or a list of content blocks", param=where)


def _image(b: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block (``source``: base64 with its media type, or a URL) as an OpenAI
    ``image_url`` part; the chat route decodes it (or refuses it for a model without a projector,
    and a URL where the server fetches none: --allow-image-urls)."""
    src = b.get("source")
    if isinstance(src, dict) and src.get("type") == "url" and isinstance(src.get("url"), str):
        return {"type": "image_url", "image_url": {"url": src["url"]}}
    if not isinstance(src, dict) or src.get("type") != "base64":
        raise ApiError(400, f"{where}: an image source must be base64 ({{'type': 'base64', 'media_type': ..., 'data': ...}}) or a URL ({{'type': 'url', 'url': ...}})", param=where)
    media, data = src.get("media_type"), src.get("data")
    if not isinstance(media, str) or not media.startswith("image/") or not isinstance(data, str):
        raise ApiError(400, f"{where}: an image source needs 'media_type' (image/png, image/jpeg, image/webp, image/gif) and base64 'data'", param=where)
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def to_openai(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request as an OpenAI chat completions request."""
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise ApiError(400, "messages: field required (a list of messages)", param="messages")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, msg in enumerate(msgs):
        where = f"messages.{i}"
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"{where}.role must be 'user' or 'assistant'", param=f"{where}.role")
        role, content = msg["role"], msg.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"{where}.content must be a string or a list of content blocks", param=f"{where}.content")
        texts: list[str] = []
        images: list[tuple[int, dict[str, Any]]] = []  # (texts before it, its image_url part)
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        thinking = ""
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            bw = f"{where}.content.{j}"
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise ApiError(400, f"{bw}: tool_use needs a 'name' and an object 'input'", param=bw)
                calls.append({"id": str(b.get("id") or "toolu_" + uuid.uuid4().hex[:24]), "type": "function", "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                text = _text(b.get("content"), bw)
                if b.get("is_error"):
                    text = "Error: " + text
                results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")), "content": text})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                thinking += str(b.get("thinking", ""))
            elif kind == "image" and role == "user":
                images.append((len(texts), _image(b, bw)))
            elif kind in ("image", "document"):
                raise ApiError(400, f"{bw}: {kind} input is not supported here", param=bw)
            else:
                raise ApiError(400, f"{bw}: unsupported content block type {kind!r}", param=bw)
        out.extend(results)
        if role == "assistant":
            m: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                m["tool_calls"] = calls
            if thinking:
                m["reasoning_content"] = thinking
            out.append(m)
        elif images:
            parts: list[dict[str, Any]] = []
            for k, t in enumerate(texts + [""]):
                parts += [im for at, im in images if at == k]
                if t:
                    parts.append({"type": "text", "text": t})
            out.append({"role": "user", "content": parts})
        elif texts or not results:
            out.append({"role": "user", "content": "".join(texts)})
    if not any(m["role"] != "system" for m in out):
        out.append({"role": "user", "content": ""})  # llama-server answers an empty conversation too
    oai: dict[str, Any] = {"messages": out, "model": body.get("model")}
    if len(out) > 1 and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls") and out[-1]["content"]:
        oai["continue_final_message"] = True  # Anthropic's prefill: the reply continues it
    if "max_tokens" in body:
        oai["max_tokens"] = body["max_tokens"]
    for k in ("temperature", "top_p", "top_k", "stream"):
        if k in body:
            oai[k] = body[k]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ApiError(400, "stop_sequences must be a list of strings", param="stop_sequences")
        oai["stop"] = stops[:4]
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
            raise ApiError(400, "tools must be a list of {name, description, input_schema}", param="tools")
        oai["tools"] = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""), "parameters": t.get("input_schema") or {"type": "object"}}} for t in tools]
        tc = body.get("tool_choice")
        if isinstance(tc, dict):
            kind = tc.get("type")
            if kind == "any":
                oai["tool_choice"] = "required"
            elif kind == "tool":
                oai["tool_choice"] = {"type": "function", "function": {"name": tc.get("name")}}
            elif kind == "none":
                oai["tool_choice"] = "none"
            elif kind != "auto":
                raise ApiError(400, "tool_choice.type must be auto, any, tool or none", param="tool_choice")
            if tc.get("disable_parallel_tool_use"):
                oai["parallel_tool_calls"] = False
    th = body.get("thinking")
    if isinstance(th, dict) and th.get("type") in ("enabled", "disabled"):
        oai["enable_thinking"] = th["type"] == "enabled"
    return oai


def _usage(u: dict[str, Any] | None) -> dict[str, int]:
    u = u or {}
    cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return {"input_tokens": int(u.get("prompt_tokens", 0)) - cached, "output_tokens": int(u.get("completion_tokens", 0)), "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for c in message.get("tool_calls") or []:
        try:
            args = json.loads(c["function"]["arguments"] or "{}")
        except ValueError:
            args = {"arguments": c["function"]["arguments"]}
        blocks.append({"type": "tool_use", "id": c.get("id") or "toolu_" + uuid.uuid4().hex[:24], "name": c["function"]["name"], "input": args if isinstance(args, dict) else {"value": args}})
    if not blocks:
        blocks.append({"type": "text", "text": ""})
    return blocks


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()


class Anthropic:
    def __init__(self, routes: Routes) -> None:
        self.routes = routes
        self.server = routes.server

    async def messages(self, request: Request) -> Response:
        body = await self.server.body(request)
        if body.get("max_tokens") is not None and (not isinstance(body["max_tokens"], int) or isinstance(body["max_tokens"], bool) or body["max_tokens"] < 1):
            raise ApiError(400, "max_tokens must be a positive integer", param="max_tokens")
        oai = to_openai(body)
        stream = bool(oai.get("stream"))
        if stream:
            oai["stream_options"] = {"include_usage": True}
        resp = await self.routes.complete(request, oai, chat=True)
        if resp.status_code != 200:
            return resp
        if not stream:
            r = json.loads(bytes(resp.body))  # type: ignore[attr-defined]
            choice = r["choices"][0]
            return JSONResponse(
                {
                    "id": "msg_" + uuid.uuid4().hex[:24],
                    "type": "message",
                    "role": "assistant",
                    "model": r["model"],
                    "content": _blocks(choice["message"]),
                    "stop_reason": STOP_REASONS.get(choice["finish_reason"], "end_turn"),
                    "stop_sequence": None,
                    "usage": _usage(r.get("usage")),
                }
            )
        assert isinstance(resp, StreamingResponse)
        return StreamingResponse(self._events(resp.body_iterator, oai), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _events(self, chunks: AsyncIterator[Any], oai: dict[str, Any]) -> AsyncIterator[bytes]:
        n_prompt = await asyncio.get_running_loop().run_in_executor(None, self.count_prompt, oai)
        msg_id = "msg_" + uuid.uuid4().hex[:24]
        model = None
        index = -1
        open_kind: str | None = None  # the kind of the block now open
        reason, usage = "end_turn", None
        started = False
        async for raw in chunks:
            data = raw.decode() if isinstance(raw, bytes) else str(raw)
            for line in data.split("\n"):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ch = json.loads(line[6:])
                if "error" in ch:
                    yield _event("error", {"error": {"type": "api_error", "message": ch["error"].get("message", "")}})
                    return
                if not started:
                    model = ch.get("model")
                    started = True
                    yield _event("message_start", {"message": {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
                if ch.get("usage"):
                    usage = ch["usage"]
                for c in ch.get("choices") or []:
                    d = c.get("delta") or {}
                    for kind, key, delta_type, field_name in (("thinking", "reasoning_content", "thinking_delta", "thinking"), ("text", "content", "text_delta", "text")):
                        if d.get(key):
                            if open_kind != kind:
                                if open_kind is not None:
                                    yield _event("content_block_stop", {"index": index})
                                index += 1
                                open_kind = kind
                                block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
                                yield _event("content_block_start", {"index": index, "content_block": block})
                            yield _event("content_block_delta", {"index": index, "delta": {"type": delta_type, field_name: d[key]}})
                    for tc in d.get("tool_calls") or []:
                        if open_kind is not None:
                            yield _event("content_block_stop", {"index": index})
                        index += 1
                        open_kind = None
                        fn = tc.get("function") or {}
                        yield _event("content_block_start", {"index": index, "content_block": {"type": "tool_use", "id": tc.get("id") or "toolu_" + uuid.uuid4().hex[:24], "name": fn.get("name", ""), "input": {}}})
                        yield _event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta", "partial_json": fn.get("arguments") or "{}"}})
                        yield _event("content_block_stop", {"index": index})
                    if c.get("finish_reason"):
                        reason = STOP_REASONS.get(c["finish_reason"], "end_turn")
        if not started:
            return
        if open_kind is not None:
            yield _event("content_block_stop", {"index": index})
        elif index < 0:
            yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            yield _event("content_block_stop", {"index": 0})
        u = _usage(usage)
        yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": None}, "usage": {"output_tokens": u["output_tokens"]}})
        yield _event("message_stop", {})

    def count_prompt(self, oai: dict[str, Any]) -> int:
        eng = self.server.engine(oai.get("model"))
        m = eng.m
        if not m.chat_template:
            raise ApiError(400, f"'{eng.name}' has no chat template", param="messages")
        try:
            tools = parse_tools(oai, m.chat_template)
            msgs = [{**x, "content": x.get("content") or ""} for x in oai["messages"]]
            msgs, extra = prepare_messages(msgs, tools, m.chat_template)
            text = render_chat(m, msgs, **extra)
        except ToolError as e:
            raise ApiError(400, str(e), param=e.param) from None
        except TemplateError as e:
            raise ApiError(400, str(e), param="messages") from None
        return len(encode_prompt(m, text))

    async def count_tokens(self, request: Request) -> Response:
        body = await self.server.body(request)
        oai = to_openai(body)
        n = await asyncio.get_running_loop().run_in_executor(None, self.count_prompt, oai)
        return JSONResponse({"input_tokens": n})

    async def openai_input_tokens(self, request: Request) -> Response:
        """llama-server's POST /chat/completions/input_tokens: the prompt's token count for an
        OpenAI chat request (in OpenAI's error shape)."""
        body = await self.server.body(request)
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages")
        n = await asyncio.get_running_loop().run_in_executor(None, self.count_prompt, body)
        return JSONResponse({"input_tokens": n})
