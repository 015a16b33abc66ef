"""Ollama's API (`/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`, `/api/tags`,
`/api/show`, `/api/ps`, `/api/version`) over dasllama's engines, so clients written for Ollama
work unchanged. Chat and generate requests are translated into OpenAI requests and run by the
same code as /v1/chat/completions and /v1/completions; streams (Ollama's default) come back as
newline-delimited JSON. Errors come in Ollama's shape: {"error": "message"}."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..embeddings import default_pooling, embed
from ..model import encode
from .app import ApiError, _utf8_len

if TYPE_CHECKING:
    from .engine import Engine
    from .routes import Handler, Routes

VERSION = "0.6.0"  # the Ollama API version these routes follow

# Ollama's options -> OpenAI's fields.
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed", "num_predict": "max_tokens", "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}


def guarded(routes: Routes, handler: Handler) -> Handler:
    """`routes.guarded`, answering errors in Ollama's shape."""
    return routes.guarded_as(handler, lambda status, msg: JSONResponse({"error": msg}, status_code=status))


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def _options(body: dict[str, Any]) -> dict[str, Any]:
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "'options' must be an object", param="options")
    out: dict[str, Any] = {}
    for k, v in opts.items():
        if k in OPTIONS:
            out[OPTIONS[k]] = v
    if out.get("max_tokens") is not None and isinstance(out["max_tokens"], int) and out["max_tokens"] < 0:
        out.pop("max_tokens")  # Ollama's -1: until the model stops
    if isinstance(out.get("stop"), list):
        out["stop"] = out["stop"][:4]
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise ApiError(400, "'format' must be 'json' or a JSON schema object", param="format")
    if body.get("model") is not None:
        out["model"] = body["model"]
    return out


def _images(images: Any, where: str) -> list[dict[str, Any]]:
    """Ollama's ``images`` (base64 strings, no media type) as OpenAI ``image_url`` parts; the
    chat route decodes them whatever their format."""
    if not isinstance(images, list) or not all(isinstance(b, str) for b in images):
        raise ApiError(400, f"'{where}' must be a list of base64 strings", param=where)
    return [{"type": "image_url", "image_url": {"url": "data:image/*;base64," + b}} for b in images]


def _messages(msgs: Any) -> list[dict[str, Any]]:
    if not isinstance(msgs, list):
        raise ApiError(400, "'messages' must be a list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}] needs a role of system, user, assistant or tool", param=f"messages[{i}].role")
        msg: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("images"):
            msg["content"] = [{"type": "text", "text": msg["content"]}, *_images(m["images"], f"messages[{i}].images")]
        calls = m.get("tool_calls")
        if calls:
            msg["tool_calls"] = [
                {"id": f"call_{i}_{j}", "type": "function", "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"].get("arguments") or {}, ensure_ascii=False)}}
                for j, c in enumerate(calls)
                if isinstance(c, dict) and isinstance(c.get("function"), dict)
            ]
        if m["role"] == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id") or m.get("tool_name") or "")
        out.append(msg)
    return out


def _stats(usage: dict[str, Any] | None, timings: dict[str, Any] | None, reason: str | None) -> dict[str, Any]:
    u, t = usage or {}, timings or {}
    prompt_ns = int(float(t.get("prompt_ms", 0)) * 1e6)
    eval_ns = int(float(t.get("predicted_ms", 0)) * 1e6)
    return {
        "done": True,
        "done_reason": {"length": "length"}.get(reason or "", "stop"),
        "total_duration": prompt_ns + eval_ns,
        "load_duration": 0,
        "prompt_eval_count": int(u.get("prompt_tokens", 0)),
        "prompt_eval_duration": prompt_ns,
        "eval_count": int(u.get("completion_tokens", 0)),
        "eval_duration": eval_ns,
    }


def _calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for c in message.get("tool_calls") or []:
        try:
            args = json.loads(c["function"]["arguments"] or "{}")
        except ValueError:
            args = {}
        out.append({"function": {"name": c["function"]["name"], "arguments": args if isinstance(args, dict) else {}}})
    return out


# GGUF's general.file_type -> the name Ollama shows.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 30: "BF16", 38: "MXFP4"}


def _details(eng: Engine) -> dict[str, Any]:
    m = eng.m
    ft = m.metadata.get("general.file_type")
    quant = FILE_TYPES.get(ft, str(ft)) if isinstance(ft, int) else ""
    return {"parent_model": "", "format": "gguf", "family": m.arch, "families": [m.arch], "parameter_size": "", "quantization_level": quant}


class Ollama:
    def __init__(self, routes: Routes) -> None:
        self.routes = routes
        self.server = routes.server

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    def _card(self, name: str, eng: Engine) -> dict[str, Any]:
        path = eng.m.path
        st = path.stat()
        digest = hashlib.sha256(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
        modified = datetime.datetime.fromtimestamp(st.st_mtime, datetime.UTC).isoformat().replace("+00:00", "Z")
        return {"name": name, "model": name, "modified_at": modified, "size": st.st_size, "digest": digest, "details": _details(eng)}

    async def tags(self, request: Request) -> Response:
        return JSONResponse({"models": [self._card(n, e) for n, e in self.server.engines.items()]})

    async def ps(self, request: Request) -> Response:
        return JSONResponse({"models": [self._card(n, e) | {"expires_at": "9999-12-31T00:00:00Z", "size_vram": 0} for n, e in self.server.engines.items()]})

    async def show(self, request: Request) -> Response:
        body = await self.server.body(request)
        name = body.get("model", body.get("name"))
        if not isinstance(name, str) or name not in self.server.names:
            raise ApiError(404, f"model '{name}' not found", param="model")
        eng = self.server.engine(name)
        m = eng.m
        info = {k: v for k, v in m.metadata.items() if isinstance(v, (int, float, str)) and not k.startswith("tokenizer.ggml.") and k != "tokenizer.chat_template"}
        caps = ["completion"] + (["tools"] if m.chat_template and "tool" in m.chat_template else []) + ["embedding"] + (["vision"] if m.projector is not None else [])
        return JSONResponse({"modelfile": f"FROM {m.path}\n", "parameters": "", "template": m.chat_template or "", "details": _details(eng), "model_info": info, "capabilities": caps, "modified_at": self._card(name, eng)["modified_at"]})

    async def chat(self, request: Request) -> Response:
        body = await self.server.body(request)
        oai = _options(body) | {"messages": _messages(body.get("messages"))}
        if not oai["messages"]:
            # Ollama answers an empty conversation by loading the model: nothing to generate.
            return JSONResponse({"model": body.get("model"), "created_at": _now(), "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "load"})
        if body.get("tools"):
            oai["tools"] = body["tools"]
        if isinstance(body.get("think"), bool):
            oai["enable_thinking"] = body["think"]
        return await self._run(request, body, oai, chat=True, shape="chat")

    async def generate(self, request: Request) -> Response:
        body = await self.server.body(request)
        prompt = body.get("prompt", "")
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' must be a string", param="prompt")
        images = _images(body["images"], "images") if body.get("images") else []
        if not prompt and not images:
            return JSONResponse({"model": body.get("model"), "created_at": _now(), "response": "", "done": True, "done_reason": "load"})
        oai = _options(body)
        eng = self.server.engine(body.get("model"))
        if body.get("raw") or not eng.m.chat_template:
            if images:
                raise ApiError(400, "images go through the model's chat template: send them without 'raw' to a model that has one", param="images")
            oai["prompt"] = prompt
            return await self._run(request, body, oai, chat=False, shape="generate")
        system = body.get("system")
        user: Any = [{"type": "text", "text": prompt}, *images] if images else prompt
        msgs = ([{"role": "system", "content": system}] if isinstance(system, str) and system else []) + [{"role": "user", "content": user}]
        oai["messages"] = msgs
        if isinstance(body.get("think"), bool):
            oai["enable_thinking"] = body["think"]
        return await self._run(request, body, oai, chat=True, shape="generate")

    async def _run(self, request: Request, body: dict[str, Any], oai: dict[str, Any], chat: bool, shape: str) -> Response:
        """Run `oai` as a (chat) completion; answer as /api/chat (`shape` "chat") or /api/generate."""
        stream = body.get("stream", True)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", param="stream")
        oai["stream"] = stream
        # Ollama's num_predict defaults to -1: until the model stops or the context is full.
        eng = self.server.engine(oai.get("model"))
        oai.setdefault("max_tokens", int(eng.m.config["seq_len"]))
        if stream:
            oai["stream_options"] = {"include_usage": True}
        resp = await self.routes.complete(request, oai, chat=chat)
        if resp.status_code != 200:
            return resp
        if not stream:
            r = json.loads(bytes(resp.body))  # type: ignore[attr-defined]
            choice = r["choices"][0]
            out: dict[str, Any] = {"model": r["model"], "created_at": _now()}
            if shape == "chat":
                msg = choice["message"]
                out["message"] = {"role": "assistant", "content": msg.get("content") or ""}
                if msg.get("reasoning_content"):
                    out["message"]["thinking"] = msg["reasoning_content"]
                if msg.get("tool_calls"):
                    out["message"]["tool_calls"] = _calls(msg)
            else:
                out["response"] = choice["message"].get("content") or "" if chat else choice["text"]
                if chat and choice["message"].get("reasoning_content"):
                    out["thinking"] = choice["message"]["reasoning_content"]
            return JSONResponse(out | _stats(r.get("usage"), r.get("timings"), choice.get("finish_reason")))
        assert isinstance(resp, StreamingResponse)
        return StreamingResponse(self._ndjson(resp.body_iterator, chat, shape), media_type="application/x-ndjson")

    async def _ndjson(self, chunks: AsyncIterator[Any], chat: bool, shape: str) -> AsyncIterator[bytes]:
        model, reason, usage, timings = None, None, None, None
        async for raw in chunks:
            data = raw.decode() if isinstance(raw, bytes) else str(raw)
            for line in data.split("\n"):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ch = json.loads(line[6:])
                if "error" in ch:
                    yield (json.dumps({"error": ch["error"].get("message", "")}) + "\n").encode()
                    return
                model = ch.get("model", model)
                usage = ch.get("usage") or usage
                timings = ch.get("timings") or timings
                for c in ch.get("choices") or []:
                    reason = c.get("finish_reason") or reason
                    if chat and shape == "generate":
                        d = c.get("delta") or {}
                        if d.get("content"):
                            yield (json.dumps({"model": model, "created_at": _now(), "response": d["content"], "done": False}, ensure_ascii=False) + "\n").encode()
                    elif chat:
                        d = c.get("delta") or {}
                        msg: dict[str, Any] = {"role": "assistant", "content": d.get("content") or ""}
                        if d.get("reasoning_content"):
                            msg["thinking"] = d["reasoning_content"]
                        if d.get("tool_calls"):
                            msg["tool_calls"] = _calls(d)
                        if msg["content"] or len(msg) > 2:
                            yield (json.dumps({"model": model, "created_at": _now(), "message": msg, "done": False}, ensure_ascii=False) + "\n").encode()
                    elif c.get("text"):
                        yield (json.dumps({"model": model, "created_at": _now(), "response": c["text"], "done": False}, ensure_ascii=False) + "\n").encode()
        last: dict[str, Any] = {"model": model, "created_at": _now()}
        last |= {"message": {"role": "assistant", "content": ""}} if shape == "chat" else {"response": ""}
        yield (json.dumps(last | _stats(usage, timings, reason)) + "\n").encode()

    async def embed(self, request: Request) -> Response:
        body = await self.server.body(request)
        legacy = request.url.path.endswith("/embeddings")
        eng = self.server.engine(body.get("model"))
        m = eng.m
        raw = body.get("prompt") if legacy else body.get("input")
        items = [raw] if isinstance(raw, str) else raw
        if not isinstance(items, list) or not items or not all(isinstance(x, str) and x for x in items):
            raise ApiError(400, f"'{'prompt' if legacy else 'input'}' must be a non-empty string or list of strings", param="input")
        if len(items) > 2048:
            raise ApiError(400, "at most 2048 inputs per request", param="input")
        for x in items:
            self.server.check_prompt_bytes(m, _utf8_len(x, "input"), "input")

        def run() -> tuple[list[list[float]], int]:
            ids = [encode(m, x) for x in items]
            ctx = int(m.config["seq_len"])
            if body.get("truncate", True):
                ids = [t[:ctx] for t in ids]
            elif any(len(t) > ctx for t in ids):
                raise ApiError(400, f"an input exceeds the context length of {ctx} tokens", param="input")
            vecs = embed(m, ids, pooling=self.server.options.pooling or default_pooling(m))  # type: ignore[arg-type]
            return [[float(v) for v in row] for row in vecs], sum(map(len, ids))

        vecs, n = await asyncio.get_running_loop().run_in_executor(None, run)
        if legacy:
            return JSONResponse({"embedding": vecs[0]})
        return JSONResponse({"model": eng.name, "embeddings": vecs, "total_duration": 0, "load_duration": 0, "prompt_eval_count": n})

    async def unsupported(self, request: Request) -> Response:
        raise ApiError(501, f"{request.url.path} is not supported: dasllama serves the models it was started with (see /api/tags)")
