"""The Ray Serve application: engine replicas behind an OpenAI-compatible ingress.

Each `EngineReplica` is what `python -m dasllama.serve` runs (the same `Server`, engines and
Starlette app, built from the same flags), driven in-process over ASGI: a forwarded request goes
through exactly the routes, checks and errors of a single server. The `Ingress` answers HTTP on
Serve's proxy, computes the prompt's prefix chain and hands the request to an engine replica
through a deployment handle whose request router (router.py) picks the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..app import MAX_BODY, ApiError, Server
from ..asgi import build_app
from .routing import prefix_chain

log = logging.getLogger("dasllama.serve.ray")

ROUTERS = {
    "prefix": "dasllama.serve.ray.router:PrefixRouter",
    "round-robin": "dasllama.serve.ray.router:RoundRobinRouter",
}
PROMPT_ROUTES = {"/v1/chat/completions": True, "/v1/completions": False}
REPLICA_HEADER = "x-dasllama-replica"  # added to every answer: which replica gave it


@dataclass
class Call:
    """One HTTP request as the ingress forwards it."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    chain: list[str] = field(default_factory=list)  # the prompt's prefix chain, for the router


@dataclass
class Head:
    """The first item a replica yields: the response's status and headers."""

    status: int
    headers: list[tuple[bytes, bytes]]


class EngineReplica:
    """One engine server (model(s) loaded, engine threads running) serving forwarded requests."""

    def __init__(self, argv: list[str]) -> None:
        from ..__main__ import load_models, parse_args, unknown_model

        args = parse_args(argv)
        logging.getLogger("dasllama").setLevel(args.log_level.upper())
        problem = unknown_model(args)
        if problem:
            raise ValueError(problem)
        self.server = Server(api_key=args.api_key, max_prompt_bytes=args.max_prompt_bytes, cors_origins=args.cors_origin)
        self.app = build_app(self.server)
        load_models(self.server, args)
        self.server.ready = True
        try:
            self.name = serve.get_replica_context().replica_id.unique_id
        except (RuntimeError, AttributeError):  # built outside a Serve replica (a test)
            self.name = f"local-{os.getpid()}"
        self._lifespan: asyncio.Task[None] | None = None

    async def _run_lifespan(self) -> None:
        # The app's lifespan samples /status's history once a second; run it for the replica's life.
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "lifespan.startup"}
            await asyncio.Event().wait()  # never set: the replica's process ends, and the sampling with it
            return {"type": "lifespan.shutdown"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"].endswith(".failed"):
                log.error("the app's lifespan failed: %s", message.get("message"))

        await self.app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)

    async def handle(self, call: Call) -> AsyncIterator[Head | bytes]:
        """Run `call` through the server's app: yields its Head, then its body as it is written.
        Stopping early (the client hung up) is a disconnect to the app, which cancels the request."""
        if self._lifespan is None:
            self._lifespan = asyncio.get_running_loop().create_task(self._run_lifespan())
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": call.method,
            "scheme": "http",
            "path": call.path,
            "raw_path": call.path.encode(),
            "query_string": call.query,
            "root_path": "",
            "headers": call.headers,
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 80),
            "state": {},
        }
        out: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": call.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await out.put(message)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                await out.put({"type": "dasllama.done"})

        task = asyncio.get_running_loop().create_task(run())
        started = False
        try:
            while True:
                msg = await out.get()
                if msg["type"] == "http.response.start":
                    started = True
                    yield Head(msg["status"], [*msg.get("headers", []), (REPLICA_HEADER.encode(), self.name.encode())])
                elif msg["type"] == "http.response.body":
                    if msg.get("body"):
                        yield msg["body"]
                    if not msg.get("more_body"):
                        break
                elif msg["type"] == "dasllama.done":
                    break
        finally:
            gone.set()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(task, 30)
        failure = task.exception() if task.done() and not task.cancelled() else None
        if failure is not None:
            # Starlette has answered 500 already when it could; the cause goes to the log.
            log.error("replica %s: %s %s failed: %s", self.name, call.method, call.path, failure, exc_info=failure)
        if not started:
            err = ApiError(500, f"the engine replica {self.name} gave no answer to {call.method} {call.path}: {failure}", type_="server_error", code="replica_error").response()
            yield Head(err.status_code, [*err.raw_headers, (REPLICA_HEADER.encode(), self.name.encode())])
            yield bytes(err.body)

    async def check_health(self) -> None:
        """Serve calls this every few seconds; raising marks the replica unhealthy, and Serve
        replaces it. The verdict is the server's own /health."""
        status: int | None = None
        body = b""
        async for item in self.handle(Call("GET", "/health", b"", [], b"")):
            if isinstance(item, Head):
                status = item.status
            else:
                body += item
        if status != 200:
            raise RuntimeError(f"replica {self.name}: /health answered {status}: {body.decode(errors='replace')}")

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            for eng in server.engines.values():
                eng.shutdown(timeout=5)


class Ingress:
    """The HTTP front: every route of the single server, forwarded to an engine replica."""

    def __init__(self, engine: DeploymentHandle, retries: int = 3) -> None:
        self.engine = engine.options(stream=True)
        self.retries = retries

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        if len(body) > MAX_BODY:
            return ApiError(413, f"the request body exceeds {MAX_BODY} bytes", code="request_too_large").response()
        path = request.url.path
        chain: list[str] = []
        chat = PROMPT_ROUTES.get(path)
        if chat is not None and request.method == "POST":
            with contextlib.suppress(ValueError, RecursionError):
                chain = prefix_chain(json.loads(body), chat)
        call = Call(request.method, path, request.url.query.encode(), list(request.headers.raw), body, chain)
        # A replica that died since the router last heard of it fails the call before it yields
        # anything; the router has dropped it by then, so the call goes again to another.
        for attempt in range(self.retries + 1):
            gen = self.engine.handle.remote(call)
            try:
                head = await gen.__anext__()
            except BackPressureError:
                return ApiError(503, "the server is at capacity: every replica's request queue is full; retry shortly", type_="server_error", code="queue_full", headers={"Retry-After": "1"}).response()
            except (RayActorError, ActorUnavailableError) as e:
                if attempt == self.retries:
                    return ApiError(503, f"no engine replica could take the request: {e}", type_="server_error", code="replica_unavailable", headers={"Retry-After": "1"}).response()
                log.warning("an engine replica was gone (%s); sending the request to another", type(e).__name__)
                continue
            break
        assert isinstance(head, Head)

        async def rest() -> AsyncIterator[bytes]:
            try:
                async for chunk in gen:
                    yield chunk
            finally:
                gen.cancel()

        response = StreamingResponse(rest(), status_code=head.status)
        response.raw_headers = [(k, v) for k, v in head.headers if k.lower() not in (b"content-length", b"transfer-encoding")]
        return response


def build(argv: list[str], replicas: int | None = 1, routing: str = "prefix", threads: int = 1, max_replicas: int | None = None, imbalance: int = 8) -> Any:
    """The Serve application for `python -m dasllama.serve <argv>` on `replicas` engine replicas
    (autoscaled between `replicas` and `max_replicas` when that is given), each with `threads`
    kernel threads and as many CPUs reserved."""
    from ..__main__ import parse_args

    if routing not in ROUTERS:
        raise ValueError(f"routing must be one of {', '.join(ROUTERS)}, got {routing!r}")
    args = parse_args(argv)  # refuses bad flags here, not in every replica
    kwargs = {"imbalance": imbalance} if routing == "prefix" else {}
    options: dict[str, Any] = {
        # A replica is sent at most its streams plus its queue, so that its engine, not Serve,
        # queues them (and answers 503 when its queue is full, as a single server does).
        "max_ongoing_requests": args.streams + args.queue,
        # Past that on every replica, a bounded wait at the ingress, then 503 as a full queue is.
        "max_queued_requests": args.queue,
        "ray_actor_options": {"num_cpus": threads},
        "request_router_config": RequestRouterConfig(request_router_class=ROUTERS[routing], request_router_kwargs=kwargs),
        "health_check_period_s": 5,
    }
    # None: neither, so that a config file's `deployments` section sets them without a clash.
    if replicas is not None and max_replicas is not None and max_replicas > replicas:
        options["autoscaling_config"] = {"min_replicas": replicas, "max_replicas": max_replicas, "target_ongoing_requests": args.streams}
    elif replicas is not None:
        options["num_replicas"] = replicas
    # Each replica's runtime gets the threads through its flags (server_runtime), not the environment.
    replica_argv = argv if "--threads" in argv else [*argv, "--threads", str(threads)]
    engine = serve.deployment(EngineReplica, name="EngineReplica").options(**options).bind(replica_argv)
    # The ingress only moves bytes: it reserves no CPU, and many requests may pass it at once.
    ingress = serve.deployment(Ingress, name="Ingress").options(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
    return ingress.bind(engine)


def app_builder(config: dict[str, Any]) -> Any:
    """For `serve run`'s config file: `args` holds `argv` (the server's flags, as a list), and
    optionally `routing` and `threads`. Replica counts and autoscaling go in the file's
    `deployments` section, which overrides what is built here."""
    argv = config.get("argv", [])
    if isinstance(argv, str):
        argv = argv.split()
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"args.argv must be a list of the server's flags as strings, e.g. ['--model', 'smollm2-135m-instruct']; got {argv!r}")
    return build([str(a) for a in argv], replicas=None, routing=str(config.get("routing", "prefix")), threads=int(config.get("threads", 1)), imbalance=int(config.get("imbalance", 8)))
