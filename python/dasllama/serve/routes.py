"""The routes of the OpenAI-compatible API: `Routes` holds the handlers over one `Server`, and
`build_app` (app.py) puts them in a Starlette app."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse

from .. import gpu
from .. import scheduler as sched
from ..chat import split_reasoning, thought_splitter
from ..embeddings import embed
from ..model import decode, encode
from .app import ENCODE_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, ApiError, Histogram, Job, Server, _utf8_len, internal_error
from .callformats import CallParser, split_calls
from .engine import Engine, Subscription
from .llama_api import llama_metrics, prompt_progress, timings
from .options import FINGERPRINT
from .status import status

log = logging.getLogger("dasllama.serve")

Handler = Callable[[Request], Awaitable[Response]]
Event = tuple[str, sched.SchedEvent | None, str | None]  # what Server.events yields: (text, event, finish_reason)

STATIC = Path(__file__).parent / "static"  # the web pages, shipped in the wheel
# The pages run only their own scripts and talk only to this server: should a model's reply ever
# slip markup past the renderer, the browser still runs none of it (and no other site frames them).
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
PROCESS_START = time.time()
# OpenAI's own bound on inputs per embeddings request.
EMBED_MAX_INPUTS = 2048


class Routes:
    """The request handlers over one `Server`: the data routes go through `guarded`, which answers
    every error (an unexpected one too) in OpenAI's shape."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def check_auth(self, request: Request) -> None:
        if self.server.api_key is None:
            return
        # Starlette decodes header values as latin-1, so this recovers the bytes sent; comparing in
        # constant time keeps the answer's timing from telling how much of a guess was right.
        sent = request.headers.get("authorization", "").encode("latin-1")
        # Anthropic's clients send the key as X-Api-Key.
        x_key = request.headers.get("x-api-key", "").encode("latin-1")
        good = hmac.compare_digest(sent, f"Bearer {self.server.api_key}".encode()) | hmac.compare_digest(x_key, self.server.api_key.encode())
        if not good:
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", type_="authentication_error", code="invalid_api_key")

    def guarded_as(self, handler: Handler, shape: Callable[[int, str], JSONResponse]) -> Handler:
        """`guarded`, its errors answered in another API's shape: `shape(status, message)`
        (a `Retry-After` kept)."""
        inner = self.guarded(handler)

        async def wrapped(request: Request) -> Response:
            resp = await inner(request)
            if resp.status_code >= 400 and isinstance(resp, JSONResponse):
                try:
                    msg = json.loads(bytes(resp.body))["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    return resp
                out = shape(resp.status_code, msg)
                if "retry-after" in resp.headers:
                    out.headers["retry-after"] = resp.headers["retry-after"]
                return out
            return resp

        return wrapped

    def guarded(self, handler: Handler) -> Handler:
        async def wrapped(request: Request) -> Response:
            try:
                if not self.server.ready:
                    raise ApiError(503, "the model is still loading; retry shortly", type_="server_error", code="loading", headers={"Retry-After": "2"})
                self.check_auth(request)
                if self.server.gate is not None:
                    return await self.server.gate(request, handler)
                return await handler(request)
            except ApiError as e:
                return e.response()
            except Exception as e:  # any other failure still answers in OpenAI's shape
                log.exception("%s %s failed", request.method, request.url.path)
                return internal_error(e, f"{request.method} {request.url.path}").response()

        return wrapped

    async def health(self, request: Request) -> Response:
        if not self.server.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        dead = {name: eng.dead or "the engine thread is gone" for name, eng in self.server.engines.items() if not eng.alive}
        if dead:
            return JSONResponse({"status": "error", "engines": dead}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        opts = self.server.options
        cards = [_model_card(name, eng) for name, eng in self.server.engines.items()]
        if len(cards) == 1 and (opts.aliases or opts.tags):  # dasllama-server's --alias a,b and --tags
            cards[0] |= {"aliases": opts.aliases or [cards[0]["id"]], "tags": opts.tags}
        return JSONResponse({"object": "list", "data": cards})

    async def model(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in self.server.names:
            raise ApiError(404, f"the model '{name}' does not exist; this server has: {', '.join(self.server.engines)}", param="model", code="model_not_found")
        return JSONResponse(_model_card(name, self.server.engine(name)))

    async def completions(self, request: Request, chat: bool) -> Response:
        return await self.complete(request, await self.server.body(request), chat)

    async def complete(self, request: Request, body: dict[str, Any], chat: bool) -> Response:
        """An OpenAI (chat) completion of `body`: the other APIs (Anthropic, Ollama) translate
        their requests into one and its answer back."""
        # Rendering the template and tokenizing grow with the prompt: never on the event loop.
        job = await asyncio.get_running_loop().run_in_executor(None, self.server.job, body, chat)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        # Every choice is queued before answering, so a full queue is a 503, not a broken stream;
        # the engine takes them between two steps, so the answer (and a stream's headers) go at once.
        started: list[tuple[int, Subscription]] = []
        try:
            for i in range(job.n):
                started.append(await self.server.start(job, i))
        except BaseException:
            for rid_, _ in started:
                job.engine.cancel(rid_)
            raise
        gens = [self.server.events(job, r, sub) for r, sub in started]
        if job.stream:
            return self._stream(request, job, chat, rid, created, gens)
        return await self._answer(request, job, chat, rid, created, gens)

    def _stream(self, request: Request, job: Job, chat: bool, rid: str, created: int, gens: list[AsyncGenerator[Event, None]]) -> Response:
        """The choices as server-sent events, as they are generated."""
        obj = "chat.completion" if chat else "text_completion"
        model_name = job.engine.name
        m = job.engine.m

        async def sse() -> AsyncIterator[bytes]:
            usage = {"prompt": 0, "completion": 0, "cached": 0, **_encode_us(job)}
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, g: AsyncIterator[Any]) -> None:
                try:
                    async for item in g:
                        await queue.put((i, item))
                except ApiError as e:
                    await queue.put((i, e))
                except Exception as e:  # the stream ends with an error event, as for an ApiError
                    log.exception("choice %d of %s %s failed", i, request.method, request.url.path)
                    await queue.put((i, internal_error(e, f"{request.method} {request.url.path}")))
                finally:
                    await queue.put((i, None))

            tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
            watch = asyncio.ensure_future(_disconnected(request))
            try:
                # With tools, each choice's text goes through a parser that gives calls out whole.
                parsers = [CallParser(job.tools.fmt) for _ in range(job.n)] if chat and job.tools is not None else None
                # A leading thought goes out as `reasoning_content` deltas, before the content.
                splitters = [thought_splitter(job.markers, job.in_thought, job.tools is not None) for _ in range(job.n)] if chat and job.markers else None
                # OpenAI's first chunk carries content ""; llama-server's carries null.
                first_content = None if self.server.options.llama_compat else ""
                if chat:
                    for i in range(job.n):
                        yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name, "choices": [{"index": i, "delta": {"role": "assistant", "content": first_content}, "logprobs": None, "finish_reason": None}]})
                done = 0
                while done < job.n:
                    getter = asyncio.ensure_future(queue.get())
                    # A client that hangs up is cancelled within a step or two, not whenever
                    # a write happens to fail.
                    await asyncio.wait([getter, watch], return_when=asyncio.FIRST_COMPLETED)
                    if not getter.done():
                        getter.cancel()
                        return
                    i, item = getter.result()
                    if item is None:
                        done += 1
                        continue
                    if isinstance(item, ApiError):
                        # OpenAI's shape for an error after the stream began: an error event.
                        yield _sse(item.body())
                        return
                    text, ev, reason = item
                    if ev is not None and ev.kind == "progress":
                        if chat:  # llama-server's: an empty assistant delta carrying the progress
                            chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name, "choices": [{"index": i, "delta": {"role": "assistant", "content": None}, "logprobs": None, "finish_reason": None}]}
                            yield _sse(chunk | {"prompt_progress": prompt_progress(ev)})
                        continue
                    if reason:
                        usage["prompt"] = ev.n_prompt if ev else usage["prompt"]
                        usage["completion"] += ev.n_gen if ev else 0
                        usage["cached"] = max(usage["cached"], ev.n_cached if ev else 0)
                        usage["ttft_us"] = max(usage.get("ttft_us", 0), ev.ttft_us if ev else 0)
                        usage["gen_us"] = max(usage.get("gen_us", 0), ev.gen_us if ev else 0)
                    calls: list[dict[str, Any]] = []
                    if splitters is not None:
                        thought, text = splitters[i].feed(text)
                        if reason:
                            t2, c2 = splitters[i].finish()
                            thought, text = thought + t2, text + c2
                        if thought:
                            chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name, "choices": [{"index": i, "delta": {"reasoning_content": thought}, "logprobs": None, "finish_reason": None}]}
                            if job.include_usage:
                                chunk["usage"] = None
                            yield _sse(chunk)
                    if parsers is not None:
                        text, calls = parsers[i].feed(text)
                        if reason:
                            tail, last = parsers[i].finish()
                            text += tail
                            calls += last
                            if parsers[i].n_calls and reason == "stop":
                                reason = "tool_calls"
                        if calls:
                            first = parsers[i].n_calls - len(calls)
                            delta = {"tool_calls": [{"index": first + k, **c} for k, c in enumerate(calls)]}
                            if text:
                                delta["content"] = text
                            chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]}
                            if job.include_usage:
                                chunk["usage"] = None
                            yield _sse(chunk)
                            text = ""
                    if not text and not reason:
                        continue
                    lp = None
                    if job.logprobs is not None and ev is not None and ev.kind == "piece" and text:
                        e = _logprob_entry(m, ev, chat)
                        lp = {"content": [e]} if chat else {"tokens": [e["token"]], "token_logprobs": [e["logprob"]], "top_logprobs": [e["top"]]}
                    if chat:
                        choice = {"index": i, "delta": {"content": text} if text else {}, "logprobs": lp, "finish_reason": reason}
                        chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name, "choices": [choice]}
                    else:
                        choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
                        chunk = {"id": rid, "object": "text_completion", "created": created, "model": model_name, "choices": [choice]}
                    if job.include_usage:
                        chunk["usage"] = None
                    yield _sse(chunk)
                if job.include_usage:
                    yield _sse({"id": rid, "object": obj + (".chunk" if chat else ""), "created": created, "model": model_name, "choices": [], "usage": _usage(usage), "timings": _timings(usage)})
                yield b"data: [DONE]\n\n"
            except Exception as e:  # past the headers, an error event is the only way left to say it
                log.exception("%s %s failed while streaming", request.method, request.url.path)
                yield _sse(internal_error(e, f"{request.method} {request.url.path}").body())
            finally:
                watch.cancel()
                # Cancelling a pump raises inside its request's generator, whose cleanup cancels.
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for g in gens:
                    await g.aclose()

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _answer(self, request: Request, job: Job, chat: bool, rid: str, created: int, gens: list[AsyncGenerator[Event, None]]) -> Response:
        """The whole answer at once, when every choice has finished."""
        obj = "chat.completion" if chat else "text_completion"
        model_name = job.engine.name
        m = job.engine.m
        async def collect(i: int) -> dict[str, Any]:
            text, reason, n_prompt, n_gen, cached, lps = "", "stop", 0, 0, 0, []
            ttft_us = gen_us = 0
            async for t, ev, r in gens[i]:
                text += t
                if job.logprobs is not None and ev is not None and ev.kind == "piece" and t:
                    lps.append(_logprob_entry(m, ev, chat))
                if r:
                    reason = r
                    if ev is not None:
                        n_prompt, n_gen, cached, ttft_us, gen_us = ev.n_prompt, ev.n_gen, ev.n_cached, ev.ttft_us, ev.gen_us
            return {"text": text, "reason": reason, "n_prompt": n_prompt or len(job.prompt), "n_gen": n_gen, "cached": cached, "lps": lps, "ttft_us": ttft_us, "gen_us": gen_us}

        # A client that hangs up before the answer is cancelled like a streaming one.
        work = asyncio.ensure_future(asyncio.gather(*(collect(i) for i in range(job.n))))
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            hung_up = not work.done()
            if hung_up:
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                for g in gens:
                    await g.aclose()
        if hung_up:
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        results = work.result()
        usage = {"prompt": results[0]["n_prompt"], "completion": sum(r["n_gen"] for r in results), "cached": max(r["cached"] for r in results), "ttft_us": max(r["ttft_us"] for r in results), "gen_us": max(r["gen_us"] for r in results), **_encode_us(job)}
        choices = []
        for i, r in enumerate(results):
            if chat:
                lp = {"content": r["lps"]} if job.logprobs is not None else None
                thought, reply = split_reasoning(r["text"], job.markers, job.in_thought, job.tools is not None) if job.markers else ("", r["text"])
                message: dict[str, Any] = {"role": "assistant", "content": reply}
                reason = r["reason"]
                if job.tools is not None:
                    content, calls = split_calls(reply, job.tools.fmt)
                    if calls:
                        message = {"role": "assistant", "content": content, "tool_calls": calls}
                        reason = "tool_calls" if reason == "stop" else reason
                if thought:
                    # Absent, never empty, where the reply had no thought (llama-server's shape).
                    message["reasoning_content"] = thought
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason})
            else:
                lp = None
                if job.logprobs is not None:
                    lp = {"tokens": [e["token"] for e in r["lps"]], "token_logprobs": [e["logprob"] for e in r["lps"]], "top_logprobs": [e["top"] for e in r["lps"]]}
                choices.append({"index": i, "text": r["text"], "logprobs": lp, "finish_reason": r["reason"]})
        out = {"id": rid, "object": obj, "created": created, "model": model_name, "system_fingerprint": self.server.options.build, "choices": choices, "usage": _usage(usage), "timings": _timings(usage)}
        if job.verbose:
            out["__verbose"] = {"prompt": decode(m, job.prompt, special=True), "n_prompt_tokens": len(job.prompt)}
        return JSONResponse(out)

    async def chat_completions(self, request: Request) -> Response:
        return await self.completions(request, True)

    async def text_completions(self, request: Request) -> Response:
        return await self.completions(request, False)

    async def tokenize(self, request: Request) -> Response:
        body = await self.server.body(request)
        eng = self.server.engine(body.get("model"))
        content = body.get("content", body.get("prompt"))
        if not isinstance(content, str):
            raise ApiError(400, "'content' must be a string", param="content")
        add_special = body.get("add_special", False)
        if not isinstance(add_special, bool):
            raise ApiError(400, "'add_special' must be a boolean", param="add_special")
        self.server.check_prompt_bytes(eng.m, _utf8_len(content, "content"), "content")
        special = bool(body.get("parse_special", False))
        toks = await asyncio.get_running_loop().run_in_executor(None, lambda: encode(eng.m, content, add_bos=add_special, special=special))
        return JSONResponse({"tokens": toks})

    async def embeddings(self, request: Request) -> Response:
        body = await self.server.body(request)
        eng = self.server.engine(body.get("model"))
        m = eng.m
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise ApiError(400, "'encoding_format' must be 'float' or 'base64'", param="encoding_format")
        dims = body.get("dimensions")
        if dims is not None and dims != int(m.config["dim"]):
            raise ApiError(400, f"this model's embeddings have {m.config['dim']} dimensions; 'dimensions' cannot change that", param="dimensions")
        raw = body.get("input")
        if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw)):
            raw = [raw]
        if not isinstance(raw, list) or not raw:
            raise ApiError(400, "'input' must be a non-empty string, list of strings, or list of token id lists", param="input")
        if len(raw) > EMBED_MAX_INPUTS:
            raise ApiError(400, f"'input' holds {len(raw)} items; at most {EMBED_MAX_INPUTS} per request", param="input")
        for i, x in enumerate(raw):
            if isinstance(x, str):
                if not x:
                    raise ApiError(400, f"input {i} is an empty string", param="input")
                self.server.check_prompt_bytes(m, _utf8_len(x, "input"), "input")
            elif not (isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)):
                raise ApiError(400, f"input {i} must be a non-empty string or a non-empty list of token ids", param="input")

        def run() -> tuple[Any, int]:
            ids = [encode(m, x) if isinstance(x, str) else x for x in raw]
            ctx = int(m.config["seq_len"])
            # Checked here too for its OpenAI code; embed() refuses the rest (token ids).
            for i, t in enumerate(ids):
                if len(t) > ctx:
                    raise ApiError(400, f"input {i} has {len(t)} tokens, more than the context of {ctx}", param="input", code="context_length_exceeded")
            try:
                return embed(m, ids), sum(map(len, ids))
            except ValueError as e:
                raise ApiError(400, str(e), param="input") from None

        vecs, n_tok = await asyncio.get_running_loop().run_in_executor(None, run)
        data = [
            {"object": "embedding", "index": i, "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else [float(x) for x in v]}
            for i, v in enumerate(vecs)
        ]
        return JSONResponse({"object": "list", "data": data, "model": eng.name, "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok}})

    async def detokenize(self, request: Request) -> Response:
        body = await self.server.body(request)
        eng = self.server.engine(body.get("model"))
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise ApiError(400, "'tokens' must be a list of integers", param="tokens")
        bad = [t for t in toks if not 0 <= t < eng.m.n_vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is out of range", param="tokens")
        if len(toks) > int(eng.m.config["seq_len"]):
            raise ApiError(400, f"'tokens' holds {len(toks)} ids, more than the context of {int(eng.m.config['seq_len'])}", param="tokens")
        return JSONResponse({"content": decode(eng.m, toks)})

    async def metrics(self, request: Request) -> Response:
        if not self.server.options.metrics_endpoint:
            raise ApiError(501, "This server does not support metrics endpoint (start it with --metrics)", type_="not_supported_error", code="not_supported")
        mt = self.server.metrics
        lines = [
            "# HELP dasllama_requests_total Requests by outcome (stop, length, cancelled, rejected, error).",
            "# TYPE dasllama_requests_total counter",
        ]
        lines += [f'dasllama_requests_total{{model="{m}",outcome="{o}"}} {c}' for (m, o), c in sorted(mt.requests.items())]
        for metric, table, help_ in (
            ("dasllama_prompt_tokens_total", mt.prompt_tokens, "Prompt tokens of finished requests."),
            ("dasllama_generated_tokens_total", mt.generated_tokens, "Generated tokens of finished requests."),
            ("dasllama_prefix_cache_hit_tokens_total", mt.cached_tokens, "Prompt tokens served from the prefix cache."),
        ):
            lines += [f"# HELP {metric} {help_}", f"# TYPE {metric} counter"]
            lines += [f'{metric}{{model="{name}"}} {table.get(name, 0)}' for name in self.server.engines]
        lines += ["# HELP dasllama_queue_depth Requests waiting.", "# TYPE dasllama_queue_depth gauge"]
        stats = {name: (eng.counts(), eng.stats()) for name, eng in self.server.engines.items()}
        lines += [f'dasllama_queue_depth{{model="{n}"}} {c[1]}' for n, (c, _) in stats.items()]
        lines += ["# HELP dasllama_active_streams Streams decoding or prefilling.", "# TYPE dasllama_active_streams gauge"]
        lines += [f'dasllama_active_streams{{model="{n}"}} {c[0]}' for n, (c, _) in stats.items()]
        for key, metric in (("kv_pages_used", "dasllama_kv_pages_used"), ("kv_pages_free", "dasllama_kv_pages_free"), ("kv_pages_cached", "dasllama_kv_pages_cached"), ("kv_snapshots", "dasllama_prefix_cache_state_snapshots")):
            lines += [f"# TYPE {metric} gauge"]
            lines += [f'{metric}{{model="{n}"}} {int(s.get(key, 0))}' for n, (_, s) in stats.items()]
        for key, metric, help_ in (
            ("spec_drafted", "dasllama_spec_draft_tokens_total", "Draft tokens proposed for verification (speculative decoding)."),
            ("spec_accepted", "dasllama_spec_accepted_tokens_total", "Draft tokens the model accepted."),
        ):
            lines += [f"# HELP {metric} {help_}", f"# TYPE {metric} counter"]
            lines += [f'{metric}{{model="{n}"}} {int(s.get(key, 0))}' for n, (_, s) in stats.items()]
        st = gpu.gpu_tier_status()
        lines += ["# HELP dasllama_gpu_memory_bytes Device memory dasllama holds (weights, K/V regions, activations).", "# TYPE dasllama_gpu_memory_bytes gauge"]
        # Samples only for a device that is there (on a CPU-only server, none: no `device=""`).
        if st.device:
            lines += [f'dasllama_gpu_memory_bytes{{device="{st.device}"}} {st.vram_bytes}']
        lines += ["# HELP dasllama_gpu_budget_bytes The device's memory budget.", "# TYPE dasllama_gpu_budget_bytes gauge"]
        if st.device:
            lines += [f'dasllama_gpu_budget_bytes{{device="{st.device}"}} {st.budget_bytes}']
        lines += ["# HELP dasllama_gpu_cpu_passes_total Calls that ran on the CPU while a model was on the device, by reason.", "# TYPE dasllama_gpu_cpu_passes_total counter"]
        lines += [f'dasllama_gpu_cpu_passes_total{{reason="{p.words}"}} {p.count}' for p in gpu.gpu_cpu_passes()]
        lines += ["# HELP dasllama_images_total Images encoded by the vision tower.", "# TYPE dasllama_images_total counter"]
        lines += [f'dasllama_images_total{{model="{name}"}} {mt.images.get(name, 0)}' for name, eng in self.server.engines.items() if eng.m.projector is not None]
        lines += ["# HELP dasllama_image_encode_seconds Time a request's images took in the vision tower (decode, preprocess, encode).", "# TYPE dasllama_image_encode_seconds histogram"]
        for name, eng in self.server.engines.items():
            if eng.m.projector is not None:
                lines += mt.image_encode.get(name, Histogram(ENCODE_BUCKETS)).render("dasllama_image_encode_seconds", f'model="{name}"')
        lines += ["# HELP dasllama_ttft_seconds Time to first token.", "# TYPE dasllama_ttft_seconds histogram"]
        for name in self.server.engines:
            lines += mt.ttft.get(name, Histogram(TTFT_BUCKETS)).render("dasllama_ttft_seconds", f'model="{name}"')
        lines += ["# HELP dasllama_inter_token_seconds Time between streamed tokens.", "# TYPE dasllama_inter_token_seconds histogram"]
        for name in self.server.engines:
            lines += mt.itl.get(name, Histogram(ITL_BUCKETS)).render("dasllama_inter_token_seconds", f'model="{name}"')
        lines += llama_metrics(self.server)
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4", headers={"Process-Start-Time-Unix": str(int(PROCESS_START))})

    async def status_json(self, request: Request) -> Response:
        return JSONResponse(status(self.server, self.server.history), headers={"Cache-Control": "no-store"})

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async def sample() -> None:
            while True:
                self.server.history.take(self.server)
                await asyncio.sleep(1.0)

        tasks = [asyncio.create_task(sample()), *(asyncio.create_task(bg()) for bg in self.server.background)]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _model_card(name: str, eng: Engine) -> dict[str, Any]:
    """OpenAI's model object, with the context length (as OpenRouter's `context_length` and vLLM's
    `max_model_len` name it) and, under `meta` (as llama-server's /v1/models has one), what a
    request that sets nothing gets: the generation cap and the sampling defaults, with where each
    came from."""
    m = eng.m
    ctx = int(m.config["seq_len"])
    train = m.metadata.get(f"{m.arch}.context_length")
    meta = {
        "arch": m.arch,
        "file": m.path.name,
        "n_ctx": ctx,
        "n_ctx_train": int(train) if isinstance(train, int) else ctx,
        "n_vocab": m.n_vocab,
        "n_predict": min(eng.n_predict, ctx) if eng.n_predict > 0 else ctx,  # a request never runs past the context
        "sampling": eng.sampling.as_dict(),
        # What the model takes (llama-server's /props names them so): images with an mmproj.
        "modalities": {"vision": m.projector is not None, "audio": False},
    }
    # OpenRouter's names for the same, and llama-server's capabilities list.
    inputs = ["text", "image"] if m.projector is not None else ["text"]
    caps = ["completion", "multimodal"] if m.projector is not None else ["completion"]
    return {
        "id": name, "object": "model", "created": eng.created, "owned_by": "dasllama", "context_length": ctx, "max_model_len": ctx,
        "input_modalities": inputs, "capabilities": caps, "meta": meta,
    }


async def favicon(request: Request) -> Response:
    """The browser asks every page for it; a small icon instead of a 404 in the log."""
    return FileResponse(STATIC / "favicon.ico", media_type="image/x-icon", headers={"Cache-Control": "max-age=86400"})


async def _disconnected(request: Request) -> None:
    """Return when the client hangs up."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)


async def not_found(request: Request, exc: Exception) -> Response:
    return ApiError(404, f"no route {request.method} {request.url.path}", code="not_found").response()

async def method_not_allowed(request: Request, exc: Exception) -> Response:
    return ApiError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed").response()

async def server_error(request: Request, exc: Exception) -> Response:
    # The last resort, for what no guarded route caught (say, in /health); Starlette re-raises
    # the exception after this answer, and the server logs its traceback.
    return internal_error(exc, f"{request.method} {request.url.path}").response()


# The pages hold no data (everything they show comes from guarded routes, with the key the
# user types into them), so they load without the key.
def page(filename: str) -> Handler:
    async def handler(request: Request) -> Response:
        return FileResponse(STATIC / filename, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache", **PAGE_HEADERS})

    return handler


def _logprob_entry(m: Any, ev: sched.SchedEvent, chat: bool) -> dict[str, Any]:
    def piece(t: int) -> str:
        return decode(m, [t])

    if chat:
        return {
            "token": piece(ev.token),
            "logprob": ev.logprob,
            "bytes": list(piece(ev.token).encode()),
            "top_logprobs": [{"token": piece(t), "logprob": lp, "bytes": list(piece(t).encode())} for t, lp in ev.top],
        }
    return {"token": piece(ev.token), "logprob": ev.logprob, "top": {piece(t): lp for t, lp in ev.top}}


def _sse(obj: dict[str, Any]) -> bytes:
    if "object" in obj:
        obj = {**obj, "system_fingerprint": FINGERPRINT}
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _encode_us(job: Job) -> dict[str, int]:
    """The request's image encode time for its `timings` (none for a request without images)."""
    return {"encode_us": int(job.image_encode_s * 1e6)} if job.images else {}


def _timings(u: dict[str, int]) -> dict[str, Any]:
    """llama-server's `timings` beside `usage`."""
    return timings(u["prompt"], u["cached"], u["completion"], u.get("ttft_us", 0), u.get("gen_us", 0), u.get("encode_us"))


def _usage(u: dict[str, int]) -> dict[str, Any]:
    return {
        "prompt_tokens": u["prompt"],
        "completion_tokens": u["completion"],
        "total_tokens": u["prompt"] + u["completion"],
        "prompt_tokens_details": {"cached_tokens": u["cached"]},
    }
