"""llama-server's native API over dasllama's engines: `/completion` (and `/completions`),
`/tokenize` with pieces, `/detokenize`, `/apply-template`, `/props`, `/slots`, `/infill`,
`/embedding(s)` and `/v1/embeddings` with llama-server's input forms. Fields and answers follow
llama.cpp's tools/server/README.md; what dasllama cannot do (LoRA, logit bias, slot files) is a
clear 4xx/501, never silently ignored where it would change the output."""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..chat import render_chat
from ..embeddings import default_pooling, embed
from ..errors import TemplateError
from ..grammar import check_grammar
from ..model import decode, encode, token_piece
from ..session import SamplingParams
from .app import ApiError, Job, Server, _num, _utf8_len, request_logit_bias
from .gbnf import request_grammar
from .logit_bias import format_logit_bias
from .slots import Slots
from .tools import ToolError, parse_tools, prepare_messages

if TYPE_CHECKING:
    from .engine import Engine
    from .routes import Routes

log = logging.getLogger("dasllama.serve")

Handler = Callable[[Request], Awaitable[Response]]

# llama-server's error types by status (its error shape: {"error": {"code", "message", "type"}}).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error", 501: "not_supported_error", 503: "unavailable_error"}

# llama.cpp's sampling defaults (common/common.h), for the native routes.
LLAMA_TEMP, LLAMA_TOP_K, LLAMA_TOP_P, LLAMA_MIN_P = 0.8, 40, 0.95, 0.05
MAX_N_PROBS = 20

FIM_TOKENS = {
    "pre": ("tokenizer.ggml.fim_pre_token_id", ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>", "<PRE>", "<|fim▁begin|>")),
    "suf": ("tokenizer.ggml.fim_suf_token_id", ("<|fim_suffix|>", "<fim_suffix>", "<fim-suffix>", "<SUF>", "<|fim▁hole|>")),
    "mid": ("tokenizer.ggml.fim_mid_token_id", ("<|fim_middle|>", "<fim_middle>", "<fim-middle>", "<MID>", "<|fim▁end|>")),
}


def llama_error(e: ApiError) -> JSONResponse:
    """An ApiError in llama-server's shape."""
    return JSONResponse({"error": {"code": e.status, "message": e.message, "type": ERROR_TYPES.get(e.status, "server_error" if e.status >= 500 else "invalid_request_error")}}, status_code=e.status, headers=e.headers)


def native(routes: Routes, handler: Handler) -> Handler:
    """`routes.guarded`, answering errors in llama-server's shape."""
    guarded = routes.guarded(handler)

    async def wrapped(request: Request) -> Response:
        resp = await guarded(request)
        if resp.status_code >= 400 and isinstance(resp, JSONResponse):
            try:
                err = json.loads(bytes(resp.body))["error"]
                return llama_error(ApiError(resp.status_code, err["message"], headers={k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}))
            except (ValueError, KeyError, TypeError):
                return resp
        return resp

    return wrapped


# ---- prompts -----------------------------------------------------------------------------------


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _text_of(obj: dict[str, Any], param: str) -> str:
    """llama-server's object prompt: {"prompt_string": ...} or {"content": [text parts]}."""
    if obj.get("multimodal_data"):
        raise ApiError(400, "this model takes no images or audio (multimodal_data)", param=param)
    if isinstance(obj.get("prompt_string"), str):
        return obj["prompt_string"]
    c = obj.get("content")  # a list of parts, as llama-server takes it (a bare string is not one)
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c):
        return "".join(p["text"] for p in c)
    raise ApiError(400, f"'{param}' objects take 'prompt_string' or 'content' (text parts)", param=param)


def tokenize_one(server: Server, m: Any, p: Any, param: str, add_special: bool = True) -> list[int]:
    """One prompt: text, token ids, ids mixed with text, or an object prompt."""
    def text(s: str, first: bool) -> list[int]:
        server.check_prompt_bytes(m, _utf8_len(s, param), param)
        return encode(m, s, add_bos=None if (first and add_special) else False, special=True)

    if isinstance(p, str):
        return text(p, True)
    if isinstance(p, dict):
        return text(_text_of(p, param), True)
    if isinstance(p, list) and all((isinstance(t, int) and not isinstance(t, bool)) or isinstance(t, str) for t in p):
        out: list[int] = []
        for i, t in enumerate(p):
            out += text(t, i == 0) if isinstance(t, str) else [t]
        bad = [t for t in out if not 0 <= t < m.n_vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is out of range for a vocabulary of {m.n_vocab}", param=param)
        return out
    raise ApiError(400, f"'{param}' must be a string, a list of token ids (and strings), an object, or a list of these", param=param)


def tokenize_prompts(server: Server, m: Any, p: Any, param: str = "prompt") -> list[list[int]]:
    """llama-server's prompt forms: one prompt, or a list of them."""
    if isinstance(p, list) and p and any(isinstance(x, (list, dict)) for x in p):
        return [tokenize_one(server, m, x, param) for x in p]
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p) and len(p) > 1:
        return [tokenize_one(server, m, x, param) for x in p]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        return [tokenize_one(server, m, p[0], param)]
    return [tokenize_one(server, m, p, param)]


# ---- sampling ----------------------------------------------------------------------------------


def llama_job(server: Server, eng: Engine, body: dict[str, Any], prompt: list[int]) -> Job:
    """A Job from llama-server's native fields."""
    m = eng.m
    opts = server.options
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    ctx = int(m.config["seq_len"])
    if len(prompt) >= ctx:
        raise ApiError(400, f"the request exceeds the available context size: the prompt has {len(prompt)} tokens, the context {ctx}; try increasing it", param="prompt", code="exceed_context_size_error")
    if body.get("lora"):
        raise ApiError(400, "dasllama has no LoRA adapters ('lora')", param="lora")
    n_predict = _num(body, "n_predict", int, None, -1, None)
    if n_predict is None:
        n_predict = _num(body, "max_tokens", int, -1, -1, None)
    if opts.n_predict > 0:
        n_predict = opts.n_predict if n_predict < 0 else min(n_predict, opts.n_predict)
    room = ctx - len(prompt)
    max_new = room if n_predict < 0 else min(n_predict, room)
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a list of strings", param="stop")
    temp = opts.temperature if opts.temperature is not None else LLAMA_TEMP
    params = SamplingParams(
        temp=float(_num(body, "temperature", (int, float), temp, 0, None)),
        top_k=max(0, _num(body, "top_k", int, LLAMA_TOP_K, None, None)),
        top_p=float(_num(body, "top_p", (int, float), LLAMA_TOP_P, 0, 1)),
        min_p=float(_num(body, "min_p", (int, float), LLAMA_MIN_P, 0, 1)),
        penalty=float(_num(body, "repeat_penalty", (int, float), 1.0, 0, None)),
        presence_penalty=float(_num(body, "presence_penalty", (int, float), 0.0, None, None)),
        frequency_penalty=float(_num(body, "frequency_penalty", (int, float), 0.0, None, None)),
        penalty_last_n=_num(body, "repeat_last_n", int, 64, -1, None),
        logit_bias=request_logit_bias(m, body),
    )
    seed = _num(body, "seed", int, None)
    if seed is None or seed < 0:
        seed = opts.seed
    n_probs = _num(body, "n_probs", int, 0, 0, None)
    try:
        grammar, gparam = request_grammar(body)
    except ValueError as e:
        raise ApiError(400, str(e), param="grammar") from None
    if grammar is not None:
        try:
            check_grammar(m, grammar)
        except ValueError as e:
            raise ApiError(400, f"failed to parse grammar: {e}", param=gparam) from None
    ignore_eos = bool(body.get("ignore_eos", False))
    if ignore_eos:
        # As llama-server: the end-of-generation tokens are banned, not just let through.
        params = replace(params, logit_bias=params.logit_bias + tuple((t, -math.inf) for t in m.eog_ids))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    return Job(
        eng, prompt, params, max(1, max_new), [s for s in stop if s], [] if ignore_eos else list(m.eog_ids), [], 1, seed,
        min(n_probs, MAX_N_PROBS) if n_probs else None, stream, False, ignore_eos, grammar, gparam,
        progress=stream and body.get("return_progress") is True,
    )


def timings(n_prompt: int, cached: int, n_gen: int, ttft_us: int, gen_us: int, encode_us: int | None = None) -> dict[str, Any]:
    """llama-server's `timings`: the prompt's time is the time to the first token; the
    generation rate counts the tokens after the first (it comes with the prompt's last step).
    A request with images (``encode_us`` given) counts their encode in the prompt's time, as
    llama-server's does (it encodes them while processing the prompt), and says it apart as
    ``image_encode_ms``."""
    prompt_ms, gen_ms = (max(ttft_us, 1) + (encode_us or 0)) / 1000, gen_us / 1000
    n_new = max(1, n_prompt - cached)
    steps = n_gen - 1
    return {
        "cache_n": cached,
        "prompt_n": n_prompt - cached,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / n_new,
        "prompt_per_second": 1e3 * n_new / prompt_ms,
        "predicted_n": n_gen,
        "predicted_ms": gen_ms,
        "predicted_per_token_ms": gen_ms / steps if steps > 0 and gen_ms > 0 else 0.0,
        "predicted_per_second": 1e3 / gen_ms * steps if steps > 0 and gen_ms > 0 else 0.0,
    } | ({"image_encode_ms": encode_us / 1000} if encode_us is not None else {})


def prompt_progress(ev: Any) -> dict[str, Any]:
    """llama-server's `prompt_progress` from a scheduler "progress" event."""
    return {"total": ev.n_prompt, "cache": ev.n_cached, "processed": ev.n_gen, "time_ms": ev.ttft_us / 1000}


def _generation_settings(server: Server, job: Job, body: dict[str, Any]) -> dict[str, Any]:
    p = job.params
    eng = job.engine
    return {
        "n_predict": job.max_new if _num(body, "n_predict", int, -1, -1, None) >= 0 or server.options.n_predict > 0 else -1,
        "seed": job.seed if job.seed is not None else -1,
        "temperature": p.temp,
        "dynatemp_range": 0.0,
        "dynatemp_exponent": 1.0,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "typical_p": 1.0,
        "repeat_last_n": p.penalty_last_n,
        "repeat_penalty": p.penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "adaptive_target": -1.0,
        "adaptive_decay": 0.9,
        "stop": job.stop,
        "n_probs": job.logprobs or 0,
        "min_keep": 0,
        "grammar": body.get("grammar", "") if isinstance(body.get("grammar"), str) else "",
        "ignore_eos": job.ignore_eos,
        "stream": job.stream,
        "n_ctx": int(eng.m.config["seq_len"]),
        "model": eng.name,
        "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
        "logit_bias": format_logit_bias(p.logit_bias),
        "speculative.n_max": 0,
        "lora": [],
    }


def _prob_entry(m: Any, tok: int, lp: float, top: list[tuple[int, float]], post: bool) -> dict[str, Any]:
    def one(t: int, v: float) -> dict[str, Any]:
        b = token_piece(m, t)
        raw = b if isinstance(b, bytes) else b.encode()
        e: dict[str, Any] = {"id": t, "token": raw.decode("utf-8", errors="replace"), "bytes": list(raw)}
        if post:
            e["prob"] = math.exp(v)
        else:
            e["logprob"] = v
        return e

    out = one(tok, lp)
    out["top_probs" if post else "top_logprobs"] = [one(t, v) for t, v in top]
    return out


class Native:
    """The native routes over one Server."""

    def __init__(self, routes: Routes) -> None:
        self.routes = routes
        self.server: Server = routes.server
        self.slot_store = Slots(self.server, self.server.options.slot_save_path)

    # ---- /completion ---------------------------------------------------------------------------

    async def completion(self, request: Request) -> Response:
        body = await self.server.body(request)
        eng = self.server.engine(body.get("model"))
        if "prompt" not in body:
            raise ApiError(400, "'prompt' is required", param="prompt")
        loop = asyncio.get_running_loop()
        prompts = await loop.run_in_executor(None, tokenize_prompts, self.server, eng.m, body["prompt"])
        return await self._complete(request, eng, body, prompts)

    async def _complete(self, request: Request, eng: Engine, body: dict[str, Any], prompts: list[list[int]], infill: bool = False) -> Response:
        loop = asyncio.get_running_loop()
        jobs = [await loop.run_in_executor(None, llama_job, self.server, eng, body, p) for p in prompts]
        if jobs[0].stream:
            return StreamingResponse(self._stream(request, jobs, body), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        results = await asyncio.gather(*(self._collect(request, i, j, body) for i, j in enumerate(jobs)))
        if any(r is None for r in results):
            return Response(status_code=499)
        out = [_select(r, body.get("response_fields")) for r in results if r is not None]
        return JSONResponse(out[0] if len(out) == 1 and not _is_multi(body.get("prompt")) else out)

    async def _run(self, request: Request, job: Job) -> AsyncIterator[tuple[str, Any, str | None]]:
        rid, sub = await self.server.start(job, 0)
        gen = self.server.events(job, rid, sub)
        try:
            async for item in gen:
                yield item
        finally:
            await gen.aclose()

    def _final(self, job: Job, index: int, body: dict[str, Any], content: str, tokens: list[int], ev: Any, reason: str | None, probs: list[dict[str, Any]], t0: float) -> dict[str, Any]:
        m = job.engine.m
        n_prompt = ev.n_prompt if ev is not None and ev.n_prompt else len(job.prompt)
        cached = ev.n_cached if ev is not None else 0
        n_gen = len(tokens)
        ttft = (ev.ttft_us / 1000) if ev is not None and ev.ttft_us else (time.monotonic() - t0) * 1000
        gen_ms = (ev.gen_us / 1000) if ev is not None and ev.gen_us else 0.0
        word = ev is not None and ev.kind == "piece" and reason == "stop"
        stop_type = "limit" if reason == "length" else "word" if word else "eos"
        stopping_word = ""
        if word:
            stopping_word = next((s for s in job.stop if s), "")
        res: dict[str, Any] = {
            "index": index,
            "content": content,
            "tokens": tokens if body.get("return_tokens") else [],
            "id_slot": body.get("id_slot", -1) if isinstance(body.get("id_slot"), int) else -1,
            "stop": True,
            "model": job.engine.name,
            "tokens_predicted": n_gen,
            "tokens_evaluated": n_prompt,
            "generation_settings": _generation_settings(self.server, job, body),
            "prompt": decode(m, job.prompt, special=True),
            "has_new_line": "\n" in content,
            "truncated": False,
            "stop_type": stop_type,
            "stopping_word": stopping_word,
            "tokens_cached": n_prompt + n_gen,
            "timings": timings(n_prompt, cached, n_gen, int(ttft * 1000), int(gen_ms * 1000)),
        }
        if job.logprobs:
            res["completion_probabilities"] = probs
        self.slot_store.record(job.engine, body.get("id_slot"), [*job.prompt, *tokens])
        return res

    async def _collect(self, request: Request, index: int, job: Job, body: dict[str, Any]) -> dict[str, Any] | None:
        post = bool(body.get("post_sampling_probs"))
        content, tokens, probs = "", [], []
        last_ev, reason = None, None
        t0 = time.monotonic()
        work = asyncio.ensure_future(self._drain(job, index))
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return None
        for text, ev, r in work.result():
            content += text
            if ev is not None and ev.kind == "piece" and not r:
                tokens.append(ev.token)
                if job.logprobs:
                    probs.append(_prob_entry(job.engine.m, ev.token, ev.logprob or 0.0, list(ev.top), post))
            if r:
                reason, last_ev = r, ev
        return self._final(job, index, body, content, tokens, last_ev, reason, probs, t0)

    async def _drain(self, job: Job, index: int) -> list[tuple[str, Any, str | None]]:
        return [item async for item in self._run(None, job)]  # type: ignore[arg-type]

    async def _stream(self, request: Request, jobs: list[Job], body: dict[str, Any]) -> AsyncIterator[bytes]:
        post = bool(body.get("post_sampling_probs"))
        try:
            for index, job in enumerate(jobs):
                content_all, tokens = "", []
                t0 = time.monotonic()
                first_us: int | None = None
                async for text, ev, r in self._run(request, job):
                    if ev is not None and ev.kind == "progress":
                        first_us = ev.ttft_us if first_us is None else first_us
                        chunk = {"index": index, "content": "", "tokens": [], "stop": False, "id_slot": -1, "tokens_predicted": 0, "tokens_evaluated": len(job.prompt), "prompt_progress": prompt_progress(ev)}
                        if body.get("timings_per_token"):
                            # The prompt's time so far, from the first report (sent before any row).
                            chunk["timings"] = timings(ev.n_prompt, ev.n_cached, 0, 0, 0) | {"prompt_n": ev.n_gen - ev.n_cached, "prompt_ms": (ev.ttft_us - first_us) / 1000}
                        yield _sse(chunk)
                        continue
                    if ev is not None and ev.kind == "piece" and not r:
                        tokens.append(ev.token)
                        chunk: dict[str, Any] = {"index": index, "content": text, "tokens": [ev.token], "stop": False, "id_slot": -1, "tokens_predicted": len(tokens), "tokens_evaluated": len(job.prompt)}
                        if job.logprobs:
                            chunk["completion_probabilities"] = [_prob_entry(job.engine.m, ev.token, ev.logprob or 0.0, list(ev.top), post)]
                        content_all += text
                        yield _sse(chunk)
                    elif r:
                        if text:
                            content_all += text
                            yield _sse({"index": index, "content": text, "tokens": [], "stop": False, "id_slot": -1, "tokens_predicted": len(tokens), "tokens_evaluated": len(job.prompt)})
                        final = self._final(job, index, body, "", tokens, ev, r, [], t0)
                        yield _sse(_select(final, body.get("response_fields")))
                    elif text:
                        content_all += text
                        yield _sse({"index": index, "content": text, "tokens": [], "stop": False, "id_slot": -1, "tokens_predicted": len(tokens), "tokens_evaluated": len(job.prompt)})
                    if await request.is_disconnected():
                        return
        except ApiError as e:
            yield _sse({"error": {"code": e.status, "message": e.message, "type": ERROR_TYPES.get(e.status, "server_error")}})

    # ---- /predict (Vertex AI's prediction shape, as llama-server serves it) ----------------------

    async def predict(self, request: Request) -> Response:
        body = await self.server.body(request)
        instances = body.get("instances")
        if not isinstance(instances, list) or not instances or not all(isinstance(i, dict) for i in instances):
            raise ApiError(400, "'instances' must be a non-empty list of request objects", param="instances")
        if len(instances) > 64:
            raise ApiError(400, "at most 64 instances per request", param="instances")
        kinds = {"chatCompletions": True, "chat_completions": True, "completions": False}

        async def one(inst: dict[str, Any]) -> Any:
            fmt = inst.get("@requestFormat", "chatCompletions")
            if fmt not in kinds:
                raise ApiError(400, f"'@requestFormat' must be one of {', '.join(kinds)}", param="@requestFormat")
            req = {k: v for k, v in inst.items() if k != "@requestFormat"} | {"stream": False}
            resp = await self.routes.complete(request, req, chat=kinds[fmt])
            if resp.status_code != 200:
                err = json.loads(bytes(resp.body))["error"]
                raise ApiError(resp.status_code, err["message"], param=err.get("param"))
            return json.loads(bytes(resp.body))

        return JSONResponse({"predictions": list(await asyncio.gather(*(one(i) for i in instances)))})

    # ---- /infill -------------------------------------------------------------------------------

    async def infill(self, request: Request) -> Response:
        body = await self.server.body(request)
        eng = self.server.engine(body.get("model"))
        m = eng.m
        prefix, suffix = body.get("input_prefix", ""), body.get("input_suffix", "")
        extra = body.get("input_extra", [])
        if not isinstance(prefix, str) or not isinstance(suffix, str):
            raise ApiError(400, "'input_prefix' and 'input_suffix' must be strings", param="input_prefix")
        if not isinstance(extra, list) or not all(isinstance(c, dict) and isinstance(c.get("text"), str) and isinstance(c.get("filename", ""), str) for c in extra):
            raise ApiError(400, "'input_extra' must be a list of {'filename': str, 'text': str} chunks", param="input_extra")
        prompt_text = body.get("prompt", "")
        if not isinstance(prompt_text, str):
            raise ApiError(400, "'prompt' must be a string", param="prompt")
        fim = {k: _fim_token(m, k) for k in FIM_TOKENS}
        missing = [k for k, v in fim.items() if v is None]
        if missing:
            raise ApiError(501, f"this model has no fill-in-the-middle tokens ({', '.join(missing)} missing from its vocabulary): /infill needs a code model with FIM tokens", code="not_supported")

        def build() -> list[int]:
            ctx_text = "".join((f"{c.get('filename', '')}\n" if c.get("filename") else "") + c.get("text", "") for c in extra)
            pre = encode(m, ctx_text + prefix, add_bos=False, special=False)
            suf = encode(m, suffix, add_bos=False, special=False)
            mid = encode(m, prompt_text, add_bos=False, special=False) if prompt_text else []
            self.server.check_prompt_bytes(m, len(ctx_text) + len(prefix) + len(suffix), "input_prefix")
            bos = [m.bos_id] if m.metadata.get("tokenizer.ggml.add_bos_token") and m.bos_id is not None else []
            return [*bos, fim["pre"], *pre, fim["suf"], *suf, fim["mid"], *mid]  # type: ignore[list-item]

        prompt = await asyncio.get_running_loop().run_in_executor(None, build)
        return await self._complete(request, eng, body, [prompt], infill=True)

    # ---- tokenizer -----------------------------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        body = await self.server.body(request)
        eng = self.server.engine(body.get("model"))
        m = eng.m
        content = body.get("content", body.get("prompt"))
        if not isinstance(content, str):
            raise ApiError(400, "'content' must be a string", param="content")
        add_special = body.get("add_special", False)
        with_pieces = body.get("with_pieces", False)
        parse_special = body.get("parse_special", True)
        for k, v in (("add_special", add_special), ("with_pieces", with_pieces), ("parse_special", parse_special)):
            if not isinstance(v, bool):
                raise ApiError(400, f"'{k}' must be a boolean", param=k)
        self.server.check_prompt_bytes(m, _utf8_len(content, "content"), "content")
        # add_special adds what the file says to add (SmolLM2's says no BOS), as llama.cpp does.
        toks = await asyncio.get_running_loop().run_in_executor(None, lambda: encode(m, content, add_bos=None if add_special else False, special=parse_special))
        if not with_pieces:
            return JSONResponse({"tokens": toks})
        out = []
        for t in toks:
            b = token_piece(m, t, special=True)
            raw = b if isinstance(b, bytes) else b.encode()
            try:
                piece: Any = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)  # llama-server gives a partial UTF-8 piece as its bytes
            out.append({"id": t, "piece": piece})
        return JSONResponse({"tokens": out})

    async def detokenize(self, request: Request) -> Response:
        body = await self.server.body(request)
        eng = self.server.engine(body.get("model"))
        toks = body.get("tokens", [])
        if not _is_ids(toks):
            raise ApiError(400, "'tokens' must be a list of integers", param="tokens")
        bad = [t for t in toks if not 0 <= t < eng.m.n_vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is out of range", param="tokens")
        if len(toks) > int(eng.m.config["seq_len"]) * 4:
            raise ApiError(400, f"'tokens' holds {len(toks)} ids, too many", param="tokens")
        return JSONResponse({"content": decode(eng.m, toks)})

    # ---- /apply-template -----------------------------------------------------------------------

    async def apply_template(self, request: Request) -> Response:
        body = await self.server.body(request)
        eng = self.server.engine(body.get("model"))
        text = await asyncio.get_running_loop().run_in_executor(None, render_request, self.server, eng, body)
        return JSONResponse({"prompt": text})

    # ---- /props, /slots ------------------------------------------------------------------------

    def _default_settings(self, eng: Engine) -> dict[str, Any]:
        opts = self.server.options
        n_ctx = opts.n_ctx_slot or int(eng.m.config["seq_len"])
        params = {
            "n_predict": opts.n_predict,
            "seed": opts.seed if opts.seed is not None else -1,
            "temperature": opts.temperature if opts.temperature is not None else LLAMA_TEMP,
            "top_k": LLAMA_TOP_K,
            "top_p": LLAMA_TOP_P,
            "min_p": LLAMA_MIN_P,
            "repeat_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "stop": [],
            "n_probs": 0,
            "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
        }
        return {"id": 0, "n_ctx": n_ctx, "speculative": False, "is_processing": False, "params": params}

    async def props(self, request: Request) -> Response:
        if request.method == "POST":
            body = await self.server.body(request)
            raise ApiError(501, f"changing server properties is not supported (got {', '.join(sorted(body)) or 'nothing'})", code="not_supported")
        eng = self.server.engine(request.query_params.get("model"))
        m = eng.m
        return JSONResponse(
            {
                "default_generation_settings": self._default_settings(eng),
                "total_slots": eng.max_streams,
                "model_alias": eng.name,
                "model_path": str(m.path),
                "modalities": {"vision": m.projector is not None, "audio": False},
                "chat_template": m.chat_template or "",
                "chat_template_caps": {},
                "bos_token": m._native.token_text(m.bos_id) if m.bos_id is not None else "",
                "eos_token": m._native.token_text(m.eos_id) if m.eos_id is not None else "",
                "build_info": self.server.options.build,
                "is_sleeping": False,
                "webui": self.server.options.ui,
            }
        )

    async def slots(self, request: Request) -> Response:
        if not self.server.options.slots_endpoint:
            raise ApiError(501, "This server does not support slots endpoint (start it with --slots)", code="not_supported")
        eng = self.server.engine(request.query_params.get("model"))
        active, _ = eng.counts()
        base = self._default_settings(eng)
        out = []
        for i in range(eng.max_streams):
            s = {k: v for k, v in base.items() if k != "params"}
            s["id"] = i
            s["is_processing"] = i < active
            s["id_task"] = -1
            out.append(s)
        return JSONResponse(out)

    async def slot_action(self, request: Request) -> Response:
        """POST /slots/N?action=save|restore|erase (slots.py); taken with --no-slots too, as
        llama-server does: only --slot-save-path turns them on."""
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
        body = body if isinstance(body, dict) else {}
        eng = self.server.engine(body.get("model") or request.query_params.get("model"))
        try:
            id_slot = int(request.path_params["id_slot"])
        except ValueError:
            raise ApiError(400, "Invalid slot ID", param="id_slot") from None
        return JSONResponse(await self.slot_store.action(eng, id_slot, request.query_params.get("action"), body))

    # ---- embeddings ----------------------------------------------------------------------------

    async def embeddings(self, request: Request, oai: bool) -> Response:
        body = await self.server.body(request)
        eng = self.server.engine(body.get("model"))
        m = eng.m
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise ApiError(400, "'encoding_format' must be 'float' or 'base64'", param="encoding_format")
        dims = body.get("dimensions")
        if dims is not None and dims != int(m.config["dim"]):
            raise ApiError(400, f"this model's embeddings have {m.config['dim']} dimensions; 'dimensions' cannot change that", param="dimensions")
        raw = body.get("input", body.get("content"))
        if raw is None:
            raise ApiError(400, "'input' is required", param="input")
        pooling = self.server.options.pooling or default_pooling(m)
        if pooling == "none" and oai:
            raise ApiError(400, "pooling type 'none' is not OpenAI-compatible: use /embeddings", param="input")
        if isinstance(raw, list) and len(raw) > 2048:
            raise ApiError(400, f"'input' holds {len(raw)} items; at most 2048", param="input")

        def run() -> tuple[list[Any], int]:
            prompts = tokenize_prompts(self.server, m, raw, "input") if raw != [] else []
            if not prompts:
                raise ApiError(400, "'input' is empty", param="input")
            ctx = int(m.config["seq_len"])
            filler = m.bos_id if m.bos_id is not None else (m.eos_id or 0)
            prompts = [p or [filler] for p in prompts]  # llama-server embeds an empty input too
            for i, t in enumerate(prompts):
                if len(t) > ctx:
                    raise ApiError(400, f"input {i} is too large to process ({len(t)} tokens); the context holds {ctx}", param="input", code="context_length_exceeded")
            try:
                if pooling == "none":
                    return [embed(m, [t], pooling="last", normalize=True) for t in prompts], sum(map(len, prompts))
                return list(embed(m, prompts, pooling=pooling)), sum(map(len, prompts))  # type: ignore[arg-type]
            except ValueError as e:
                raise ApiError(400, str(e), param="input") from None

        vecs, n_tok = await asyncio.get_running_loop().run_in_executor(None, run)
        self.server.metrics.embedded_tokens += n_tok
        self.server.metrics.embed_passes += 1

        def enc(v: Any) -> Any:
            return base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else [float(x) for x in v]

        if oai:
            data = [{"object": "embedding", "index": i, "embedding": enc(v)} for i, v in enumerate(vecs)]
            return JSONResponse({"object": "list", "data": data, "model": eng.name, "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok}})
        return JSONResponse([{"index": i, "embedding": [enc(v)] if v.ndim == 1 else [enc(r) for r in v]} for i, v in enumerate(vecs)])


def render_request(server: Server, eng: Engine, body: dict[str, Any]) -> str:
    """The chat prompt a /apply-template request renders to (the text, not tokens)."""
    m = eng.m
    if not m.chat_template:
        raise ApiError(400, f"'{eng.name}' has no chat template", param="messages")
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise ApiError(400, "'messages' must be a list", param="messages")
    agp = body.get("add_generation_prompt", True)
    if not isinstance(agp, bool):
        raise ApiError(400, "'add_generation_prompt' must be a boolean", param="add_generation_prompt")
    b = dict(body)
    if not b.get("tools"):
        b.pop("tools", None)
        b.pop("tool_choice", None)
    try:
        tools = parse_tools(b, m.chat_template)
    except ToolError as e:
        raise ApiError(400, str(e), param=e.param) from None
    rendered = []
    for i, msg in enumerate(msgs):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ApiError(400, f"messages[{i}] needs a role", param=f"messages[{i}].role")
        c = msg.get("content")
        if isinstance(c, list):
            c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
        rendered.append({**msg, "content": c if isinstance(c, str) else ""})
    try:
        rendered, extra = prepare_messages(rendered, tools, m.chat_template)
    except ToolError as e:
        raise ApiError(400, str(e), param=e.param) from None
    kw = body.get("chat_template_kwargs") or {}
    if isinstance(kw, dict):
        extra.update({k: v for k, v in kw.items() if isinstance(k, str)})
    # As llama-server renders: enable_thinking always given (false under --reasoning off), and
    # today's date as date_string (Llama 3.x templates print it) and datetime.
    extra.setdefault("enable_thinking", server.options.reasoning != "off")
    today = datetime.date.today()
    extra.setdefault("date_string", today.strftime("%d %b %Y"))
    extra.setdefault("datetime", today.strftime("%b %d %Y"))  # FireFunction v2's
    try:
        text = render_chat(m, rendered, add_generation_prompt=agp, **extra)
    except TemplateError as e:
        raise ApiError(400, str(e), param="messages") from None
    return text


def _fim_token(m: Any, kind: str) -> int | None:
    key, spellings = FIM_TOKENS[kind]
    v = m.metadata.get(key)
    if isinstance(v, int) and 0 <= v < m.n_vocab:
        return v
    for s in spellings:
        ids = encode(m, s, add_bos=False, special=True)
        if len(ids) == 1 and m._native.token_text(ids[0]) == s:
            return ids[0]
    return None


def _is_multi(p: Any) -> bool:
    return isinstance(p, list) and bool(p) and (any(isinstance(x, (list, dict)) for x in p) or (len(p) > 1 and all(isinstance(x, str) for x in p)))


def _select(res: dict[str, Any], fields: Any) -> dict[str, Any]:
    """llama-server's `response_fields`: only these, "a/b" reaching into objects (keyed as written)."""
    if not isinstance(fields, list) or not fields:
        return res
    out: dict[str, Any] = {}
    for f in fields:
        if not isinstance(f, str):
            continue
        cur: Any = res
        for part in f.split("/"):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if cur is not None:
            out[f] = cur
    return out


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)


LLAMA_METRICS = [
    # (name, type, help)
    ("prompt_tokens_total", "counter", "Number of prompt tokens processed (cached ones apart)."),
    ("prompt_tokens_cached_total", "counter", "Number of prompt tokens served from the prefix cache."),
    ("prompt_seconds_total", "counter", "Prompt process time (time to first token)."),
    ("tokens_predicted_total", "counter", "Number of generation tokens processed."),
    ("tokens_predicted_seconds_total", "counter", "Predict process time."),
    ("n_decode_total", "counter", "Total number of decode steps."),
    ("n_tokens_max", "counter", "Largest context a request may use."),
    ("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed for verification."),
    ("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted."),
    ("spec_decode_num_drafts_total", "counter", "Verification steps of drafts."),
    ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s."),
    ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s."),
    ("requests_processing", "gauge", "Number of requests processing."),
    ("requests_deferred", "gauge", "Number of requests deferred (queued)."),
    ("n_busy_slots_per_decode", "gauge", "Average number of busy slots per decode step."),
]


def llama_metrics(server: Server) -> list[str]:
    """llama-server's `llamacpp:` metrics over every model served (beside dasllama's own)."""
    mt = server.metrics
    stats = [eng.stats() for eng in server.engines.values()]
    counts = [eng.counts() for eng in server.engines.values()]
    cached = sum(mt.cached_tokens.values())
    prompt = sum(mt.prompt_tokens.values()) - cached + mt.embedded_tokens
    prompt_s = sum(h.total for h in mt.ttft.values())
    gen = sum(mt.generated_tokens.values())
    gen_s = sum(h.total for h in mt.itl.values())
    steps = sum(int(s.get("decode_steps", 0)) for s in stats) + mt.embed_passes
    values = {
        "prompt_tokens_total": prompt,
        "prompt_tokens_cached_total": cached,
        "prompt_seconds_total": prompt_s,
        "tokens_predicted_total": gen,
        "tokens_predicted_seconds_total": gen_s,
        "n_decode_total": steps,
        "n_tokens_max": max((int(e.m.config["seq_len"]) for e in server.engines.values()), default=0),
        "spec_decode_num_draft_tokens_total": sum(int(s.get("spec_drafted", 0)) for s in stats),
        "spec_decode_num_accepted_tokens_total": sum(int(s.get("spec_accepted", 0)) for s in stats),
        "spec_decode_num_drafts_total": sum(int(s.get("spec_verifies", 0)) for s in stats),
        "prompt_tokens_seconds": prompt / prompt_s if prompt_s > 0 else 0.0,
        "predicted_tokens_seconds": gen / gen_s if gen_s > 0 else 0.0,
        "requests_processing": sum(a for a, _ in counts),
        "requests_deferred": sum(q for _, q in counts),
        "n_busy_slots_per_decode": sum(float(s.get("avg_batch", 0.0)) for s in stats),
    }
    out = []
    for name, kind, help_ in LLAMA_METRICS:
        out += [f"# HELP llamacpp:{name} {help_}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {values[name]}"]
    return out


def _has_rank_head(m: Any) -> bool:
    """Whether the file declares a reranker's classifier head (llama.cpp's rank pooling)."""
    return m.metadata.get(f"{m.arch}.pooling_type") == 4


class Rerank:
    """`/rerank`, `/v1/rerank`, `/reranking` (llama-server's and TEI's shapes). dasllama runs no
    classifier heads yet, so a model whose file declares one (a real reranker) is refused with a
    501; any other model ranks documents by the cosine similarity of its embeddings of the
    query and each document (`"scoring": "embedding_similarity"` in the answer says so)."""

    def __init__(self, server: Server) -> None:
        self.server = server

    async def rerank(self, request: Request) -> Response:
        body = await self.server.body(request)
        eng = self.server.engine(body.get("model"))
        m = eng.m
        query = body.get("query")
        if not isinstance(query, str) or not query:
            raise ApiError(400, "'query' must be a non-empty string", param="query")
        tei = "texts" in body
        docs = body.get("texts" if tei else "documents")
        if not isinstance(docs, list) or not docs:
            raise ApiError(400, f"'{'texts' if tei else 'documents'}' must be a non-empty list of strings", param="documents")
        texts = []
        for i, d in enumerate(docs):
            if isinstance(d, dict) and isinstance(d.get("text"), str):
                d = d["text"]
            if not isinstance(d, str):
                raise ApiError(400, f"document {i} must be a string", param="documents")
            texts.append(d)
        top_n = _num(body, "top_n", int, len(texts), 1, None)
        if _has_rank_head(m):
            raise ApiError(501, f"'{eng.name}' is a reranker (a classifier head): dasllama does not run classifier heads yet", code="not_supported")
        for t in (query, *texts):
            self.server.check_prompt_bytes(m, _utf8_len(t, "documents"), "documents")

        def run() -> tuple[list[float], int]:
            filler = m.bos_id if m.bos_id is not None else (m.eos_id or 0)
            ids = [encode(m, t) or [filler] for t in (query, *texts)]
            ctx = int(m.config["seq_len"])
            if any(len(t) > ctx for t in ids):
                raise ApiError(400, f"an input is too large to process; the context holds {ctx} tokens", param="documents")
            vecs = embed(m, ids, pooling=self.server.options.pooling if self.server.options.pooling in ("mean", "cls", "last") else default_pooling(m), normalize=True)  # type: ignore[arg-type]
            q = vecs[0]
            return [float(v @ q) for v in vecs[1:]], sum(len(ids[0]) + len(t) for t in ids[1:])

        scores, n_tok = await asyncio.get_running_loop().run_in_executor(None, run)
        order = sorted(range(len(texts)), key=lambda i: -scores[i])[:top_n]
        if tei:
            out: list[dict[str, Any]] = [{"index": i, "score": scores[i]} for i in order]
            if body.get("return_text"):
                for o in out:
                    o["text"] = texts[o["index"]]
            return JSONResponse(out)
        results = [{"index": i, "relevance_score": scores[i]} for i in order]
        if body.get("return_documents"):
            for r in results:
                r["document"] = {"text": texts[r["index"]]}
        return JSONResponse({"model": eng.name, "object": "list", "scoring": "embedding_similarity", "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok}, "results": results})
