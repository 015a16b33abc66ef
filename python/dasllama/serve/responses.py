"""OpenAI's Responses API (`POST /v1/responses`, and `/responses` as llama-server serves it):
text in (a string or message items, `instructions`), text and function calls out, whole or as
the Responses stream's events. A request is translated into a chat completion and run by the
same code as /v1/chat/completions. Stateless: `previous_response_id` and `store` are refused."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .app import ApiError

if TYPE_CHECKING:
    from .routes import Routes


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for p in content:
            if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text") and isinstance(p.get("text"), str):
                out.append(p["text"])
            elif isinstance(p, dict) and p.get("type") in ("input_image", "input_file", "input_audio"):
                raise ApiError(400, f"{where}: {p['type']} is not supported by this model", param=where)
            else:
                raise ApiError(400, f"{where}: content parts must be input_text", param=where)
        return "".join(out)
    raise ApiError(400, f"{where} must be a string or a list of content parts", param=where)


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses request as a chat completions request."""
    if body.get("previous_response_id"):
        raise ApiError(400, "'previous_response_id' is not supported: this server keeps no responses; send the whole conversation as 'input'", param="previous_response_id")
    msgs: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise ApiError(400, "'instructions' must be a string", param="instructions")
        msgs.append({"role": "system", "content": body["instructions"]})
    inp = body.get("input")
    if isinstance(inp, str):
        msgs.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        for i, item in enumerate(inp):
            where = f"input[{i}]"
            if not isinstance(item, dict):
                raise ApiError(400, f"{where} must be an object", param=where)
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("system", "developer", "user", "assistant"):
                    raise ApiError(400, f"{where}.role must be system, developer, user or assistant", param=f"{where}.role")
                msgs.append({"role": "system" if role == "developer" else role, "content": _text_of(item.get("content"), f"{where}.content")})
            elif kind == "function_call":
                call = {"id": str(item.get("call_id", "")), "type": "function", "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "{}")}}
                if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                    msgs[-1]["tool_calls"].append(call)
                else:
                    msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                out = item.get("output", "")
                msgs.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": out if isinstance(out, str) else json.dumps(out)})
            else:
                raise ApiError(400, f"{where}.type {kind!r} is not supported", param=f"{where}.type")
    else:
        raise ApiError(400, "'input' must be a string or a list of input items", param="input")
    chat: dict[str, Any] = {"messages": msgs, "model": body.get("model")}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for k in ("temperature", "top_p", "stream", "parallel_tool_calls", "top_k", "seed"):
        if k in body:
            chat[k] = body[k]
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str) for t in tools):
            raise ApiError(400, "'tools' must be a list of function tools ({type: 'function', name, parameters})", param="tools")
        chat["tools"] = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""), "parameters": t.get("parameters") or {"type": "object"}}} for t in tools]
        tc = body.get("tool_choice")
        if isinstance(tc, dict) and tc.get("type") == "function":
            chat["tool_choice"] = {"type": "function", "function": {"name": tc.get("name")}}
        elif tc is not None:
            chat["tool_choice"] = tc
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema", {})}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort"):
        chat["reasoning_effort"] = reasoning["effort"]
    return chat


def _usage(u: dict[str, Any] | None) -> dict[str, Any]:
    u = u or {}
    return {
        "input_tokens": int(u.get("prompt_tokens", 0)),
        "input_tokens_details": {"cached_tokens": int((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0))},
        "output_tokens": int(u.get("completion_tokens", 0)),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": int(u.get("total_tokens", 0)),
    }


def _message_item(msg_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": msg_id, "status": status, "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _call_items(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": c.get("id") or "call_" + uuid.uuid4().hex[:24], "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"} for c in calls]


def _response(resp_id: str, created: int, model: str, output: list[dict[str, Any]], usage: dict[str, Any] | None, status: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": resp_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output,
        "usage": _usage(usage) if usage is not None else None,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "text": {"format": {"type": "text"}},
        "store": False,
        "metadata": body.get("metadata") or {},
    }


class Responses:
    def __init__(self, routes: Routes) -> None:
        self.routes = routes
        self.server = routes.server

    async def input_tokens(self, request: Request, count: Callable[[dict[str, Any]], int]) -> Response:
        """POST /v1/responses/input_tokens: the prompt's token count for a Responses request
        (`count` renders the chat request it translates to and tokenizes it)."""
        chat = to_chat(await self.server.body(request))
        n = await asyncio.get_running_loop().run_in_executor(None, count, chat)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": n})

    async def create(self, request: Request) -> Response:
        body = await self.server.body(request)
        chat = to_chat(body)
        stream = bool(chat.get("stream"))
        if stream:
            chat["stream_options"] = {"include_usage": True}
        resp = await self.routes.complete(request, chat, chat=True)
        if resp.status_code != 200:
            return resp
        resp_id, created = "resp_" + uuid.uuid4().hex[:24], int(time.time())
        if not stream:
            r = json.loads(bytes(resp.body))  # type: ignore[attr-defined]
            msg = r["choices"][0]["message"]
            output = []
            if msg.get("reasoning_content"):
                output.append({"type": "reasoning", "id": "rs_" + uuid.uuid4().hex[:24], "summary": [], "content": [{"type": "reasoning_text", "text": msg["reasoning_content"]}]})
            if msg.get("content") or not msg.get("tool_calls"):
                output.append(_message_item("msg_" + uuid.uuid4().hex[:24], msg.get("content") or ""))
            output += _call_items(msg.get("tool_calls") or [])
            out = _response(resp_id, created, r["model"], output, r.get("usage"), "completed", body)
            return JSONResponse(out)
        assert isinstance(resp, StreamingResponse)
        return StreamingResponse(self._events(resp.body_iterator, resp_id, created, body), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _events(self, chunks: AsyncIterator[Any], resp_id: str, created: int, body: dict[str, Any]) -> AsyncIterator[bytes]:
        seq = 0

        def ev(kind: str, data: dict[str, Any]) -> bytes:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data}, ensure_ascii=False)}\n\n".encode()

        msg_id = "msg_" + uuid.uuid4().hex[:24]
        model = body.get("model") or ""
        text, calls, usage, timings = "", [], None, None
        started = opened = False
        async for raw in chunks:
            data = raw.decode() if isinstance(raw, bytes) else str(raw)
            for line in data.split("\n"):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ch = json.loads(line[6:])
                if "error" in ch:
                    yield ev("error", {"code": ch["error"].get("code"), "message": ch["error"].get("message", ""), "param": ch["error"].get("param")})
                    return
                if not started:
                    model = ch.get("model", model)
                    started = True
                    base = _response(resp_id, created, model, [], None, "in_progress", body)
                    yield ev("response.created", {"response": base})
                    yield ev("response.in_progress", {"response": base})
                usage = ch.get("usage") or usage
                timings = ch.get("timings") or timings
                for c in ch.get("choices") or []:
                    d = c.get("delta") or {}
                    if d.get("content"):
                        if not opened:
                            opened = True
                            yield ev("response.output_item.added", {"output_index": 0, "item": _message_item(msg_id, "", "in_progress")})
                            yield ev("response.content_part.added", {"item_id": msg_id, "output_index": 0, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})
                        text += d["content"]
                        delta: dict[str, Any] = {"item_id": msg_id, "output_index": 0, "content_index": 0, "delta": d["content"], "logprobs": []}
                        yield ev("response.output_text.delta", delta)
                    calls += d.get("tool_calls") or []
        if not started:
            return
        output = []
        if opened or not calls:
            if not opened:
                yield ev("response.output_item.added", {"output_index": 0, "item": _message_item(msg_id, "", "in_progress")})
                yield ev("response.content_part.added", {"item_id": msg_id, "output_index": 0, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})
            part = {"type": "output_text", "text": text, "annotations": []}
            yield ev("response.output_text.done", {"item_id": msg_id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []})
            yield ev("response.content_part.done", {"item_id": msg_id, "output_index": 0, "content_index": 0, "part": part})
            item = _message_item(msg_id, text)
            yield ev("response.output_item.done", {"output_index": 0, "item": item})
            output.append(item)
        for item in _call_items(calls):
            idx = len(output)
            yield ev("response.output_item.added", {"output_index": idx, "item": item})
            yield ev("response.function_call_arguments.done", {"item_id": item["id"], "output_index": idx, "arguments": item["arguments"]})
            yield ev("response.output_item.done", {"output_index": idx, "item": item})
            output.append(item)
        final: dict[str, Any] = {"response": _response(resp_id, created, model, output, usage, "completed", body)}
        if timings is not None:
            final["timings"] = timings
        yield ev("response.completed", final)
