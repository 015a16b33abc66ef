"""The Starlette app: every route of every API family (routes.py, llama_api.py, anthropic.py,
ollama.py, responses.py) over one `Server` (app.py), with CORS. Apart from app.py because those
modules build on its `Server` and `ApiError`: the app sits above them all, so nothing imports
back."""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .anthropic import Anthropic
from .anthropic import guarded as anthropic_guarded
from .app import ApiError, Server
from .llama_api import Native, Rerank, native
from .ollama import Ollama
from .ollama import guarded as ollama_guarded
from .responses import Responses
from .routes import STATIC, Routes, favicon, method_not_allowed, not_found, page, server_error
from .tools_builtin import ToolRoutes


class _Cors(CORSMiddleware):
    """Starlette's CORS, except that a preflight from an origin not allowed gets no CORS headers at
    all (Starlette's still lists the allowed methods and headers) and says what to change."""

    def preflight_response(self, request_headers: Any) -> Response:
        origin = request_headers.get("origin", "")
        if not self.is_allowed_origin(origin):
            msg = f"the origin {origin!r} may not call this server from a browser; start the server with --cors-origin {origin} to allow it"
            return ApiError(403, msg, code="cors_origin_not_allowed").response()
        return super().preflight_response(request_headers)


def build_app(server: Server) -> Starlette:
    r = Routes(server)
    n = Native(r)
    rr = Rerank(server)
    a = Anthropic(r)
    o = Ollama(r)
    resp = Responses(r)
    tr = ToolRoutes(server)
    routes = [
        *([Route("/", page("chat.html"), methods=["GET"])] if server.options.ui else []),
        Route("/status", page("status.html"), methods=["GET"]),
        Route("/favicon.ico", favicon, methods=["GET"]),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
        Route("/status.json", r.guarded(r.status_json), methods=["GET"]),
        Route("/health", r.health, methods=["GET"]),
        Route("/v1/models", r.guarded(r.models), methods=["GET"]),
        Route("/v1/models/{name:path}", r.guarded(r.model), methods=["GET"]),
        Route("/v1/chat/completions", r.guarded(r.chat_completions), methods=["POST"]),
        Route("/v1/completions", r.guarded(r.text_completions), methods=["POST"]),
        Route("/tokenize", native(r, n.tokenize), methods=["POST"]),
        Route("/v1/embeddings", r.guarded(lambda q: n.embeddings(q, oai=True)) if server.options.llama_compat else r.guarded(r.embeddings), methods=["POST"]),
        Route("/detokenize", native(r, n.detokenize), methods=["POST"]),
        Route("/metrics", r.guarded(r.metrics), methods=["GET"]),
        # llama-server's routes (llama_api.py): its native API, and the OpenAI ones without /v1.
        Route("/completion", native(r, n.completion), methods=["POST"]),
        Route("/completions", native(r, n.completion), methods=["POST"]),
        Route("/chat/completions", r.guarded(r.chat_completions), methods=["POST"]),
        Route("/models", r.guarded(r.models), methods=["GET"]),
        Route("/v1/health", r.health, methods=["GET"]),
        Route("/embedding", native(r, lambda q: n.embeddings(q, oai=False)), methods=["POST"]),
        Route("/embeddings", native(r, lambda q: n.embeddings(q, oai=False)), methods=["POST"]),
        Route("/infill", native(r, n.infill), methods=["POST"]),
        Route("/predict", native(r, n.predict), methods=["POST"]),
        Route("/apply-template", native(r, n.apply_template), methods=["POST"]),
        Route("/props", native(r, n.props), methods=["GET", "POST"]),
        Route("/slots", native(r, n.slots), methods=["GET"]),
        Route("/slots/{id_slot}", native(r, n.slot_action), methods=["POST"]),
        Route("/rerank", native(r, rr.rerank), methods=["POST"]),
        Route("/reranking", native(r, rr.rerank), methods=["POST"]),
        Route("/v1/rerank", native(r, rr.rerank), methods=["POST"]),
        Route("/v1/reranking", native(r, rr.rerank), methods=["POST"]),
        # Anthropic's Messages API (anthropic.py).
        Route("/v1/messages", anthropic_guarded(r, a.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic_guarded(r, a.count_tokens), methods=["POST"]),
        Route("/chat/completions/input_tokens", r.guarded(a.openai_input_tokens), methods=["POST"]),
        # OpenAI's Responses API (responses.py).
        Route("/v1/responses", r.guarded(resp.create), methods=["POST"]),
        Route("/responses", r.guarded(resp.create), methods=["POST"]),
        Route("/v1/responses/input_tokens", r.guarded(lambda q: resp.input_tokens(q, a.count_prompt)), methods=["POST"]),
        Route("/responses/input_tokens", r.guarded(lambda q: resp.input_tokens(q, a.count_prompt)), methods=["POST"]),
        # Ollama's API (ollama.py).
        Route("/api/version", ollama_guarded(r, o.version), methods=["GET"]),
        Route("/api/tags", ollama_guarded(r, o.tags), methods=["GET"]),
        Route("/api/ps", ollama_guarded(r, o.ps), methods=["GET"]),
        Route("/api/show", ollama_guarded(r, o.show), methods=["POST"]),
        Route("/api/chat", ollama_guarded(r, o.chat), methods=["POST"]),
        Route("/api/generate", ollama_guarded(r, o.generate), methods=["POST"]),
        Route("/api/embed", ollama_guarded(r, o.embed), methods=["POST"]),
        Route("/api/embeddings", ollama_guarded(r, o.embed), methods=["POST"]),
        Route("/api/{op:path}", ollama_guarded(r, o.unsupported), methods=["GET", "POST", "DELETE", "HEAD"]),
        Route("/v1/chat/completions/input_tokens", r.guarded(a.openai_input_tokens), methods=["POST"]),
        # llama-server's agent routes (tools_builtin.py, mcp.py, proxy.py): 403 unless enabled.
        Route("/tools", tr.get, methods=["GET"]),
        Route("/tools", tr.post, methods=["POST"]),
        Route("/cors-proxy", tr.cors_proxy, methods=["GET", "POST"]),
    ]
    if server.extra_routes is not None:  # the router's and sleep mode's (they take precedence)
        routes = [*server.extra_routes(r, routes), *routes]
    middleware = []
    if server.options.llama_cors is not None:
        from .cors import LlamaCors, TitleCaseHeaders

        middleware.append(Middleware(TitleCaseHeaders))
        middleware.append(Middleware(LlamaCors, allowed=server.options.llama_cors))
    elif server.cors_origins:
        # Only the origins named: a browser page elsewhere may call the API (preflight answered,
        # the key sent as a header, never as a cookie); any other origin gets no CORS headers, so
        # its browser refuses the answer. The server's own pages are same-origin and need none.
        middleware.append(
            Middleware(
                _Cors,
                allow_origins=server.cors_origins,
                allow_methods=["GET", "POST", "OPTIONS"],
                allow_headers=["Authorization", "Content-Type"],
                max_age=600,
            )
        )
    return Starlette(routes=routes, middleware=middleware, exception_handlers={404: not_found, 405: method_not_allowed, 500: server_error}, lifespan=r.lifespan)
