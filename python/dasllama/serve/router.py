"""The model router: llama-server's router mode (`dasllama-server` with no model, or with
`--models-dir` / `--models-preset`) over dasllama's multi-model serving.

llama-server runs one child process per model and proxies to it; dasllama loads each model into an
engine of its own in this process (as `--model` repeated does), so routing a request is choosing
the engine its `model` names. The catalogue lists what can be loaded: llama.cpp's model cache
(`LLAMA_CACHE`, else the Hugging Face hub cache: `models--owner--repo/snapshots/*/x-TAG.gguf`,
listed as `owner/repo:TAG`), dasllama's own model cache, the `.gguf` files (or one-model folders)
of `--models-dir`, and the sections of a `--models-preset` INI file. A request for a model not
loaded loads it first (unless `--no-models-autoload`); at most `--models-max` models are loaded,
and a load beyond that unloads the least recently used idle one, or waits, in arrival order, for
one to become idle. Requests for a model that is loading wait for that one load.
"""

from __future__ import annotations

import asyncio
import configparser
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .app import ApiError, Server
from .engine import Engine
from .options import HF_FALLBACK_ENV

log = logging.getLogger("dasllama.serve")

# Builds an engine for a model file (or dasllama model name) served as a name; runs off the loop.
Loader = Callable[[str, str], Engine]
Handler = Callable[[Request], Any]


async def held_while_answering(request: Request, handler: Handler, release: Callable[[], Awaitable[None]]) -> Response:
    """Answer `request` with `handler`, then call `release`: once the answer is sent, or, for a
    stream, once its last chunk is (or the client goes away); at once if the handler fails. What
    the router's loaded model and sleep mode's activity count hold for a request."""
    try:
        resp = await handler(request)
    except BaseException:
        await release()
        raise
    if not isinstance(resp, StreamingResponse):
        await release()
        return resp
    body = resp.body_iterator

    async def held() -> AsyncIterator[Any]:
        try:
            async for chunk in body:
                yield chunk
        finally:
            await release()

    resp.body_iterator = held()
    return resp

# The router's own routes: they name a model to act on, not one to serve the request.
OWN_ROUTES = {"/models/load", "/models/unload", "/models"}
# A quant tag at the end of a cached file's name, as llama.cpp's split-name parser reads it.
TAG = re.compile(r"[-.]((?:[IT]Q|Q|F|BF|MXFP)[0-9][0-9A-Za-z_]*|F16|F32|BF16)(?:-\d{5}-of-\d{5})?$", re.IGNORECASE)
COMPANIONS = ("mmproj", "mtp-", "eagle3-", "dflash-", "dspark-")


@dataclass
class Entry:
    """One model the router can serve."""

    name: str
    spec: str | None  # the .gguf path (or dasllama model name) to load; None: resolved at load
    source: str  # "preset", "models_dir" or "cache", as llama-server's `source`
    hf_repo: str | None = None  # a preset's hf-repo, resolved when loaded
    aliases: set[str] = field(default_factory=set)
    tags: set[str] = field(default_factory=set)
    hidden: bool = False  # a cache entry a preset stands for (dedup-cache-models)
    preset: str = ""  # the preset's own INI text, as /models shows it
    status: str = "unloaded"  # unloaded, loading, loaded
    engine: Engine | None = None
    pins: int = 0  # requests being served (a pinned model is never unloaded)
    last_used: float = 0.0
    loading: asyncio.Future[None] | None = None
    failed: str | None = None  # why the last load failed

    def busy(self) -> bool:
        if self.pins:
            return True
        if self.engine is None:
            return False
        active, queued = self.engine.counts()
        return active + queued > 0


def hf_cache_dir() -> Path:
    """llama.cpp's model cache, found as llama.cpp finds it (common/hf-cache.cpp)."""
    for var, sub in (("LLAMA_CACHE", ""), ("HF_HUB_CACHE", ""), ("HUGGINGFACE_HUB_CACHE", ""), ("HF_HOME", "hub"), ("XDG_CACHE_HOME", "huggingface/hub")):
        v = os.environ.get(var)
        if v:
            return Path(v) / sub if sub else Path(v)
    return Path.home() / ".cache" / "huggingface" / "hub"


def cached_models(root: Path) -> dict[str, Path]:
    """`owner/repo:TAG` -> file for every model file in a Hugging Face-layout cache."""
    out: dict[str, Path] = {}
    if not root.is_dir():
        return out
    for repo_dir in sorted(root.glob("models--*")):
        repo = repo_dir.name[len("models--") :].replace("--", "/")
        for f in sorted(repo_dir.glob("snapshots/*/**/*.gguf")):
            stem = f.name[: -len(".gguf")]
            m = TAG.search(stem)
            if m is None or any(c in stem for c in COMPANIONS) or ("-of-" in stem and "-00001-of-" not in stem):
                continue
            out.setdefault(f"{repo}:{m.group(1).upper()}", f)
    return out


def cached_repo_file(repo: str) -> Path | None:
    """The file a `owner/repo[:TAG]` reference names in llama.cpp's cache, if it is there."""
    name, _, tag = repo.partition(":")
    hits = {k: v for k, v in cached_models(hf_cache_dir()).items() if k.split(":")[0] == name}
    if tag:
        return hits.get(f"{name}:{tag.upper()}")
    return next(iter(hits.values()), None)


def models_dir_entries(d: Path) -> dict[str, Entry]:
    """llama-server's --models-dir: each .gguf file (named by its stem) and each folder holding
    one model (named by the folder; its mmproj and draft companions are not models)."""
    if not d.is_dir():
        raise ValueError(f"--models-dir {d}: no such directory")
    out: dict[str, Entry] = {}
    for p in sorted(d.iterdir()):
        if p.is_dir():
            files = sorted(f for f in p.glob("*.gguf") if not any(c in f.name for c in COMPANIONS))
            shard = [f for f in files if "-00001-of-" in f.name]
            pick = shard[0] if shard else files[0] if files else None
            if pick is not None:
                out[p.name] = Entry(p.name, str(pick), "models_dir")
        elif p.suffix == ".gguf" and not any(c in p.name for c in COMPANIONS):
            out[p.stem] = Entry(p.stem, str(p), "models_dir")
    return out


def preset_entries(path: Path, base: Path | None = None) -> tuple[dict[str, Entry], set[str]]:
    """llama-server's --models-preset INI: a section per model (`model` a path, or `hf-repo`),
    `[*]` for what every section inherits. Returns the entries and the cache names that presets
    with `dedup-cache-models` stand for."""
    ini = configparser.ConfigParser(interpolation=None, default_section="*")
    ini.optionxform = str  # type: ignore[assignment,method-assign]  # keys as written
    try:
        ini.read_string(path.read_text(encoding="utf-8"))
    except (OSError, configparser.Error) as e:
        raise ValueError(f"--models-preset {path}: {e}") from None
    out: dict[str, Entry] = {}
    dedup: set[str] = set()
    for section in ini.sections():
        kv = {k.replace("_", "-").lower(): v.strip() for k, v in ini[section].items()}
        model = kv.get("model") or kv.get("m")
        repo = kv.get("hf-repo") or kv.get("hf") or kv.get("hfr")
        if model is None and repo is None:
            log.warning("--models-preset %s: [%s] names no model (model = PATH or hf-repo = owner/repo): skipped", path, section)
            continue
        if model is not None and base is not None and not Path(model).is_absolute():
            model = str(base / model)
        text = "\n".join([f"[{section}]", *(f"{k} = {v}" for k, v in ini[section].items())])
        entry = Entry(section, model, "preset", hf_repo=None if model else repo, preset=text)
        entry.aliases = {a.strip() for a in kv.get("alias", "").split(",") if a.strip()}
        entry.tags = {t.strip() for t in kv.get("tags", "").split(",") if t.strip()}
        out[section] = entry
        if kv.get("dedup-cache-models", "0").lower() in ("1", "true", "on", "yes") and repo:
            for r in (repo, kv.get("spec-draft-hf") or kv.get("hf-repo-draft")):
                if r:
                    dedup.add(r)
    return out, dedup


class Router:
    """The catalogue, the loaded engines' lifetimes, and the gate every data request passes."""

    def __init__(
        self, server: Server, loader: Loader, models_max: int = 4, autoload: bool = True, models_dir: str | None = None, models_preset: str | None = None, extra_cache: Path | None = None
    ) -> None:
        self.server = server
        self.loader = loader
        self.models_max = models_max
        self.autoload = autoload
        self.models_dir = Path(models_dir).expanduser() if models_dir else None
        self.models_preset = Path(models_preset).expanduser() if models_preset else None
        self.extra_cache = extra_cache  # dasllama's own model cache, listed as models
        self.entries: dict[str, Entry] = {}
        self._changed: asyncio.Condition | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # loads and unloads under way (kept referenced)
        self.scan()

    # ---- the catalogue -------------------------------------------------------------------------

    def scan(self) -> None:
        """(Re)read the sources. A loaded model that left its source stays until it is unloaded;
        an unloaded one is dropped; new ones are added."""
        found: dict[str, Entry] = {}
        dedup: set[str] = set()
        for key, f in cached_models(hf_cache_dir()).items():
            found[key] = Entry(key, str(f), "cache")
        if self.extra_cache is not None and self.extra_cache.is_dir():
            for f in sorted(self.extra_cache.glob("*.gguf")):
                if not any(c in f.name for c in COMPANIONS):
                    found.setdefault(f.stem, Entry(f.stem, str(f), "cache"))
        if self.models_dir is not None:
            found.update(models_dir_entries(self.models_dir))
        if self.models_preset is not None:
            presets, dedup = preset_entries(self.models_preset, self.models_preset.parent)
            found.update(presets)
        for key, e in found.items():
            if e.source == "cache" and (key in dedup or key.split(":")[0] in dedup):
                e.hidden = True
        for name, old in list(self.entries.items()):
            if name in found and old.status != "unloaded":
                kept = found[name]
                old.hidden, old.preset, old.aliases, old.tags = kept.hidden, kept.preset, kept.aliases, kept.tags
                found[name] = old
            elif name not in found and old.status != "unloaded":
                found[name] = old  # still serving; gone from the list once unloaded
        self.entries = found

    def resolve(self, name: str) -> Entry | None:
        e = self.entries.get(name)
        if e is not None:
            return e
        return next((e for e in self.entries.values() if name in e.aliases), None)

    # ---- loading and unloading ------------------------------------------------------------------

    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def _running(self) -> int:
        return sum(1 for e in self.entries.values() if e.status != "unloaded")

    def start_load(self, e: Entry) -> asyncio.Future[None]:
        """Begin loading `e` (it must be unloaded); resolves when it is loaded or has failed."""
        loop = asyncio.get_running_loop()
        e.status, e.failed = "loading", None
        e.loading = loop.create_future()
        fut = e.loading

        async def run() -> None:
            try:
                spec = e.spec or _resolve_repo(e.hf_repo or e.name)
                eng = await loop.run_in_executor(None, self.loader, spec, e.name)
            except Exception as exc:  # noqa: BLE001 - reported to every waiter and in /models
                e.status, e.failed = "unloaded", f"{type(exc).__name__}: {exc}"
                log.error("router: could not load '%s': %s", e.name, e.failed)
                fut.set_result(None)
                await self._notify()
                return
            e.engine, e.status, e.last_used = eng, "loaded", time.monotonic()
            self.server.add(eng, *e.aliases)
            log.info("router: '%s' loaded (%s)", e.name, spec)
            fut.set_result(None)
            await self._notify()

        self._spawn(run())
        return fut

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def unload(self, e: Entry) -> None:
        eng = e.engine
        e.status, e.engine = "unloaded", None
        if eng is not None:
            self.server.engines.pop(eng.name, None)
            for n in [n for n, s in self.server.names.items() if s == eng.name]:
                del self.server.names[n]
            if self.server.default == eng.name:
                self.server.default = next(iter(self.server.engines), None)
            await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
            log.info("router: '%s' unloaded", e.name)
        await self._notify()

    def _victim(self) -> Entry | None:
        idle = [e for e in self.entries.values() if e.status == "loaded" and not e.busy()]
        return min(idle, key=lambda e: e.last_used, default=None)

    async def acquire(self, name: str, autoload: bool) -> Entry:
        """The loaded entry `name` names, pinned for one request (`release` unpins it): loaded
        first when autoload allows, unloading the least recently used idle model when the
        router is full, or waiting for one to become idle."""
        e = self.resolve(name)
        if e is None:
            raise ApiError(400, f"model '{name}' not found", param="model", code="model_not_found")
        if e.status == "unloaded" and not autoload:
            raise ApiError(400, f"model '{e.name}' is not loaded (this router loads models on request only: POST /models/load)", param="model", code="model_not_loaded")
        while True:
            if e.status == "loaded":
                e.pins += 1
                e.last_used = time.monotonic()
                return e
            if e.status == "loading":
                assert e.loading is not None
                await asyncio.shield(e.loading)
                if e.status == "unloaded" and e.failed:
                    raise ApiError(500, f"model '{e.name}' failed to load: {e.failed}", type_="server_error", code="load_failed")
                continue
            if self.models_max <= 0 or self._running() < self.models_max:
                self.start_load(e)
                continue
            victim = self._victim()
            if victim is not None:
                await self.unload(victim)
                continue
            async with self.changed:
                # Woken by every load, unload and release; the wait is bounded so an engine that
                # finished its last stream (which notifies nobody) is seen idle soon after.
                try:
                    await asyncio.wait_for(self.changed.wait(), 0.25)
                except TimeoutError:
                    pass

    async def release(self, e: Entry) -> None:
        e.pins -= 1
        e.last_used = time.monotonic()
        await self._notify()

    # ---- the gate --------------------------------------------------------------------------------

    async def gate(self, request: Request, handler: Handler) -> Response:
        """Serve one data request: load the model it names, pin it while the answer (or its
        stream) lasts. Requests that name no model pass through unchanged."""
        if request.url.path in OWN_ROUTES:
            return await handler(request)
        name = await model_of(request)
        if name is None:
            if request.method == "POST":
                raise ApiError(400, "model name is missing from the request ('model')", param="model")
            return await handler(request)
        q = request.query_params.get("autoload")
        autoload = self.autoload if q is None else q in ("1", "true")
        e = await self.acquire(name, autoload)
        return await held_while_answering(request, handler, lambda: self.release(e))

    # ---- routes ------------------------------------------------------------------------------------

    def card(self, e: Entry, now: int) -> dict[str, Any]:
        status: dict[str, Any] = {"value": e.status, "args": []}
        if e.preset:
            status["preset"] = e.preset
        if e.failed and e.status == "unloaded":
            status |= {"failed": True, "exit_code": 1, "error": e.failed}
        card: dict[str, Any] = {
            "id": e.name,
            "aliases": sorted(e.aliases),
            "tags": sorted(e.tags),
            "object": "model",
            "owned_by": "llamacpp",
            "created": now,
            "status": status,
            "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
            "source": e.source,
            "can_remove": False,
        }
        if e.engine is not None:
            m = e.engine.m
            ctx = int(m.config["seq_len"])
            card |= {"path": str(m.path), "context_length": ctx, "meta": {"arch": m.arch, "file": m.path.name, "n_ctx": ctx, "n_vocab": m.n_vocab}}
        return card

    async def models(self, request: Request) -> Response:
        if request.query_params.get("reload"):
            try:
                self.scan()
            except ValueError as exc:
                raise ApiError(400, str(exc)) from None
        now = int(time.time())
        return JSONResponse({"object": "list", "data": [self.card(e, now) for e in self.entries.values() if not e.hidden]})

    async def load(self, request: Request) -> Response:
        name = await _body_model(request)
        e = self.resolve(name) if name else None
        if e is None:
            raise ApiError(404, f"model '{name}' is not found", param="model", code="model_not_found")
        if e.status != "unloaded":
            raise ApiError(400, f"model '{e.name}' is already running", param="model")
        # Room is made as a request's would be: the least recently used idle model goes.
        while self.models_max > 0 and self._running() >= self.models_max:
            victim = self._victim()
            if victim is None:
                raise ApiError(503, f"cannot load '{e.name}': {self.models_max} models (--models-max) are loaded and all are busy; retry shortly", type_="server_error", headers={"Retry-After": "1"})
            await self.unload(victim)
        self.start_load(e)
        return JSONResponse({"success": True})

    async def unload_route(self, request: Request) -> Response:
        name = await _body_model(request)
        e = self.resolve(name) if name else None
        if e is None:
            raise ApiError(400, f"model '{name}' is not found", param="model")
        if e.status == "unloaded":
            raise ApiError(400, f"model '{e.name}' is not running", param="model")
        if e.status == "loading":
            assert e.loading is not None
            await asyncio.shield(e.loading)
        self._spawn(self.unload(e))
        return JSONResponse({"success": True})

    def props(self, delegate: Handler) -> Handler:
        async def handler(request: Request) -> Response:
            if request.query_params.get("model"):
                return await delegate(request)
            opts = self.server.options
            return JSONResponse(
                {
                    "role": "router",
                    "max_instances": self.models_max,
                    "models_autoload": self.autoload,
                    "model_alias": "dasllama-server",
                    "model_path": "none",
                    "default_generation_settings": {"params": {}, "n_ctx": 0},
                    "ui_settings": {},
                    "build_info": opts.build,
                    "cors_proxy_enabled": False,
                }
            )

        return handler

    def routes(self, guarded: Callable[[Handler], Handler], existing: list[Any]) -> list[Route]:
        """The router's routes, to go before the app's own (which they override)."""
        props = next((r.endpoint for r in existing if isinstance(r, Route) and r.path == "/props"), None)
        out = [
            Route("/models", guarded(self.models), methods=["GET"]),
            Route("/v1/models", guarded(self.models), methods=["GET"]),
            Route("/models/load", guarded(self.load), methods=["POST"]),
            Route("/models/unload", guarded(self.unload_route), methods=["POST"]),
        ]
        if props is not None:
            out.append(Route("/props", self.props(props), methods=["GET"]))
        return out


def _resolve_repo(repo: str) -> str:
    """A Hugging Face reference (a preset's hf-repo) as a local file: llama.cpp's cache, else
    DASLLAMA_SERVER_HF_FALLBACK (as dasllama-server's --hf-repo)."""

    hit = cached_repo_file(repo)
    if hit is not None:
        return str(hit)
    fallback = os.environ.get(HF_FALLBACK_ENV)
    if fallback:
        log.warning("router: serving %s in place of %s (%s)", fallback, repo, HF_FALLBACK_ENV)
        return fallback
    raise ValueError(f"{repo} is not in llama.cpp's model cache ({hf_cache_dir()}) and dasllama downloads nothing from Hugging Face; put the file there or set {HF_FALLBACK_ENV}")


async def _body_model(request: Request) -> str | None:
    name = await model_of(request)
    if name is None:
        raise ApiError(400, "'model' is required", param="model")
    return name


async def model_of(request: Request) -> str | None:
    """The model a request names: its JSON body's `model` (POST), else the `model` query
    parameter. The body stays readable by the handler (Starlette keeps it)."""
    q = request.query_params.get("model")
    if request.method != "POST":
        return q or None
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else {}
    except (ValueError, UnicodeDecodeError):
        return q or None  # the handler answers the bad body
    v = body.get("model") if isinstance(body, dict) else None
    return v if isinstance(v, str) and v else (q or None)


def engine_loader(args: Any) -> Loader:
    """A Loader serving models as `python -m dasllama.serve` would with these flags (on the CPU,
    without a draft model: the router's models and a woken sleeper's come and go)."""
    from ..model import load_model
    from ..sampling_defaults import sampling_defaults
    from ..speculative import configure as configure_spec
    from .__main__ import sampling_flags, server_runtime

    def load(spec: str, name: str) -> Engine:
        m = load_model(spec, numerics=args.numerics, mmproj=False if args.no_mmproj else None, runtime=server_runtime(args))
        if args.ctx:
            m.config["seq_len"] = min(int(m.config["seq_len"]), args.ctx)
        configure_spec(m, args.spec if args.spec != "draft" else "off", None, args.spec_max)
        eng = Engine(m, name, args.streams, args.queue, args.chunk, args.page_rows, args.kv_dtype, args.prefix_cache_mb)
        eng.sampling = sampling_defaults(m.metadata, sampling_flags(args))
        eng.n_predict = args.n_predict if args.n_predict > 0 else 0
        return eng

    return load
