"""python -m dasllama.serve [--model PATH|NAME ...] [--alias NAME ...] [--host H] [--port P] ...

Serves the default model (fetched on first use) on 127.0.0.1:8080 with no arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from .. import gpu
from .._cli import HelpFormatter
from ..fetch import DEFAULT_MODEL, known_names
from ..fetch.hub import is_hub_ref
from ..model import load_model
from ..runtime import Runtime, RuntimeConfig, default_runtime, default_runtime_with
from ..sampling_defaults import LLAMA_SERVER, describe, sampling_defaults
from ..session import KVDtype
from ..speculative import MAX_DRAFT, SPEC_MODES
from ..speculative import configure as configure_spec
from .app import Server
from .asgi import build_app
from .engine import DEFAULT_N_PREDICT, Engine
from .tools_builtin import start_tools

log = logging.getLogger("dasllama.serve")


def parse_args(argv: list[str] | None, prog: str = "python -m dasllama.serve", extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The server's flags; `extra` adds a front end's own (python -m dasllama.serve.ray takes these
    same flags and its replica count)."""
    ap = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible server for GGUF models.", formatter_class=HelpFormatter)
    ap.add_argument("--model", action="append", help=f"a .gguf path, a known model name, or a Hugging Face model (hf://owner/repo/file.gguf, owner/repo[:quant]); repeat to serve several (default: {DEFAULT_MODEL})")
    ap.add_argument("--alias", action="append", help="the name clients use for the matching --model (default: the model's name)")
    ap.add_argument("--mmproj", action="append", help="the vision projector (mmproj-*.gguf) for the matching --model, so it takes images (default: the mmproj*.gguf beside the model, if any)")
    ap.add_argument("--no-mmproj", action="store_true", help="load no vision projector, not even one found beside a model")
    ap.add_argument("--no-mmproj-offload", action="store_true", help="keep the vision tower on the CPU when the model goes on a GPU")
    ap.add_argument("--allow-image-urls", action="store_true", help="fetch http(s) image URLs in image_url parts (default: data: URLs only); anyone who may call the server can then make it fetch any URL it reaches")
    ap.add_argument("--image-url-max-bytes", type=int, default=10 * 1024 * 1024, metavar="N", help="with --allow-image-urls: the largest image fetched (llama-server's 10 MiB by default)")
    ap.add_argument("--image-url-timeout", type=float, default=10.0, metavar="S", help="with --allow-image-urls: seconds one image's whole fetch may take (default 10, as llama-server)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--port", type=int, default=8080, help="port to listen on")
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams per model")
    ap.add_argument("--queue", type=int, default=64, help="requests waiting per model before 503")
    ap.add_argument("--chunk", type=int, default=512, help="most prefill tokens per scheduler step (a step-time budget sizes chunks below this; DASLLAMA_STEP_MS sets it, default 60)")
    ap.add_argument("--page-rows", type=int, default=16, help="KV page size; 0 turns the paged pool and prefix cache off")
    ap.add_argument("--ctx", type=int, default=0, help="cap on the context per request (0: the model's)")
    ap.add_argument(
        "--n-predict",
        type=int,
        default=DEFAULT_N_PREDICT,
        metavar="N",
        help="most tokens one request generates: a larger max_tokens ends here with finish_reason 'length', and a chat request that sets none gets this; -1: the context only",
    )
    ap.add_argument("--threads", type=int, default=None, metavar="N", help="kernel threads (default: DASLLAMA_THREADS, else the physical cores)")
    sampling = ap.add_argument_group("sampling defaults", "what a request that sets none gets; each defaults to the model file's general.sampling.* value where it has one, else llama-server's default")
    sampling.add_argument("--temp", type=float, default=None, metavar="T", help=f"temperature; 0 is greedy (default: the file's, else {LLAMA_SERVER.temp:g})")
    sampling.add_argument("--top-k", type=int, default=None, metavar="K", help=f"keep the K likeliest tokens; 0: off (default: the file's, else {LLAMA_SERVER.top_k})")
    sampling.add_argument("--top-p", type=float, default=None, metavar="P", help=f"nucleus sampling; 1: off (default: the file's, else {LLAMA_SERVER.top_p:g})")
    sampling.add_argument("--min-p", type=float, default=None, metavar="P", help=f"drop tokens below P times the likeliest's probability; 0: off (default: the file's, else {LLAMA_SERVER.min_p:g})")
    sampling.add_argument("--repeat-penalty", type=float, default=None, metavar="R", help=f"repetition penalty; 1: off (default: the file's, else {LLAMA_SERVER.repeat_penalty:g})")
    ap.add_argument("--kv-dtype", default="f16", choices=[k.value for k in KVDtype], help="how the KV cache stores K and V")
    ap.add_argument("--prefix-cache-mb", type=float, default=256, help="memory the prefix cache may keep per model, in MiB")
    ap.add_argument("--numerics", default="fast", choices=["fast", "ggml"], help="ggml: logits bit for bit those of llama.cpp's AVX2 CPU build (slower; f16 KV only)")
    ap.add_argument("--max-prompt-bytes", type=int, default=0, help="refuse prompts longer than this many bytes before any tokenizer work (0: 16 per token of context)")
    ap.add_argument("--spec", default="auto", choices=list(SPEC_MODES), help="speculative decoding: auto = a --model-draft if given, else the model's MTP head (in its file, or a sidecar mtp-<stem>.gguf beside it), else n-gram prompt lookup")
    ap.add_argument("--model-draft", default=None, help="a draft model (path or known name) sharing the model's vocabulary, for --spec draft/auto")
    ap.add_argument("--spec-max", type=int, default=8, help=f"most tokens a stream drafts per step (1-{MAX_DRAFT}); fewer are drafted as the batch grows")
    ap.add_argument(
        "--gpu",
        default="auto",
        choices=["auto", "off", "vulkan"],
        help="auto: the first model on a Vulkan GPU when one answers (said in the start-up log), else the CPU; vulkan: require it; off: the CPU only (DASLLAMA_GPU=0 too)",
    )
    ap.add_argument("--gpu-device", default=None, help="the Vulkan device to use: an index or part of its name (default: a discrete GPU first)")
    ap.add_argument("--gpu-regions", type=int, default=0, help="device K/V regions, one per stream the device serves (default: --streams)")
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every data route (/v1/*, /metrics, /status.json, /tokenize, /detokenize); /health and the web pages load without it")
    ap.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let web pages from ORIGIN (e.g. http://localhost:3000; '*' for any) call the API from a browser; repeat for several (default: none, the server's own pages need none)",
    )
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    agent = ap.add_argument_group("agent tools (llama-server's, experimental)", "off by default: they act with this server's rights, so enable them only on a trusted machine")
    agent.add_argument("--tools", default=None, metavar="T1,T2|all", help="serve built-in tools at /tools: read_file, file_glob_search, grep_search, exec_shell_command, write_file, edit_file, get_info, or all")
    agent.add_argument("--tools-runtime", default=None, metavar="SPEC", help="run the tools in an isolate: docker:<image> or podman:<image> (a container started and stopped with the server), docker-container:<id>, podman-container:<id>, ssh:<host>")
    agent.add_argument("--mcp-servers-config", default=None, metavar="FILE", help='MCP servers whose tools /tools serves, as <server>_<tool>: a JSON file in Cursor\'s format, {"mcpServers": {name: {command, args, env, cwd, timeout_ms}}}')
    agent.add_argument("--mcp-servers-json", default=None, metavar="JSON", help="the same, given inline")
    agent.add_argument("--ui-mcp-proxy", action="store_true", help="serve /cors-proxy?url=..., which fetches any http(s) URL for a browser page")
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    args.model = args.model or [DEFAULT_MODEL]
    if args.alias and len(args.alias) != len(args.model):
        ap.error("give one --alias per --model")
    if args.mmproj and len(args.mmproj) != len(args.model):
        ap.error("give one --mmproj per --model")
    if args.mmproj and args.no_mmproj:
        ap.error("--mmproj and --no-mmproj contradict each other")
    if args.image_url_max_bytes < 1 or not args.image_url_timeout > 0:
        ap.error("--image-url-max-bytes must be at least 1 and --image-url-timeout above 0")
    for name in ("streams", "queue", "chunk"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if args.gpu_regions < 0:
        ap.error("--gpu-regions must be >= 0")
    if args.gpu_regions and args.gpu_regions < args.streams:
        ap.error(f"--gpu-regions {args.gpu_regions} is fewer than --streams {args.streams}: every stream needs a region")
    if args.n_predict == 0 or args.n_predict < -1:
        ap.error("--n-predict must be at least 1, or -1 for the context only")
    if args.threads is not None and args.threads < 1:
        ap.error("--threads must be at least 1")
    for name in ("temp", "top_k", "repeat_penalty"):
        v = getattr(args, name)
        if v is not None and v < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0")
    for name in ("top_p", "min_p"):
        v = getattr(args, name)
        if v is not None and not 0 <= v <= 1:
            ap.error(f"--{name.replace('_', '-')} must be between 0 and 1")
    if args.page_rows < 0 or args.ctx < 0 or args.max_prompt_bytes < 0 or args.prefix_cache_mb <= 0:
        ap.error("--page-rows, --ctx and --max-prompt-bytes must be >= 0, --prefix-cache-mb > 0")
    if not 1 <= args.spec_max <= MAX_DRAFT:
        ap.error(f"--spec-max must be between 1 and {MAX_DRAFT}")
    if args.spec == "draft" and not args.model_draft:
        ap.error("--spec draft needs --model-draft")
    if args.model_draft and len(args.model) > 1:
        ap.error("--model-draft drafts for one --model; serve one model with it")
    if args.numerics == "ggml":
        # ggml's order sums a chunk's rows differently from single rows: verified drafts could
        # differ from what plain decoding gives.
        if args.spec not in ("auto", "off"):
            ap.error("--spec needs --numerics fast")
        args.spec = "off"
    if KVDtype(args.kv_dtype) is not KVDtype.f16 and args.page_rows == 0:
        ap.error(f"--kv-dtype {args.kv_dtype} needs the paged pool (--page-rows > 0)")
    for origin in args.cors_origin:
        # A browser sends its origin as scheme://host[:port], never with a path or a trailing
        # slash: anything else would silently match nothing.
        if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
            ap.error(f"--cors-origin {origin!r} is not an origin: give scheme://host[:port] with no path or trailing slash (e.g. http://localhost:3000), or '*'")
    return args


def unknown_model(args: argparse.Namespace) -> str | None:
    """Why a --model cannot be served (no such file, not a known name, not a Hugging Face
    reference), or None."""
    for spec in args.model:
        if is_hub_ref(spec):
            continue  # fetched (or refused, saying why) while /health answers "loading"
        if not Path(spec).expanduser().exists() and (spec.endswith(".gguf") or os.sep in spec or spec not in known_names()):
            return f"cannot serve '{spec}': no such file, not a Hugging Face model (hf://owner/repo/file.gguf, owner/repo[:quant]), and not a known model name (known: {', '.join(known_names())})"
    return None


def arm_gpu(args: argparse.Namespace) -> bool:
    """Arm the GPU tier as --gpu says, before the first load; False (with the reason logged) when
    the models run on the CPU. --gpu vulkan without a usable device is an error."""
    if args.gpu_device is not None:
        os.environ["DASLLAMA_VK_DEVICE"] = args.gpu_device
    if args.gpu == "off":
        return False
    available, name, kind = default_runtime().vk_witness()
    if not available:
        if args.gpu == "vulkan":
            raise SystemExit(f"--gpu vulkan: no usable Vulkan device ({name})")
        # The usual case on a server without a GPU: not worth more than a line. Why there is none
        # (no Vulkan loader, only a CPU-type device) is for --log-level debug.
        log.info("no GPU: running on the CPU")
        log.debug("no usable Vulkan device: %s", name)
        return False
    if kind == "cpu" and args.gpu == "auto":
        # A CPU-type Vulkan device (lavapipe) is slower than our own CPU path: only on request.
        log.info("serving on the CPU: the only Vulkan device, '%s', runs on the CPU (--gpu vulkan uses it anyway)", name)
        return False
    gpu.set_gpu_resident_regions(args.gpu_regions or args.streams)
    gpu.set_gpu_ctx_max(args.ctx or 0)
    gpu.set_gpu_ctx_strict(bool(args.ctx))
    # The device holds K/V in the codec the host pool uses (a model whose heads the codec cannot
    # take stays on the CPU, saying so).
    gpu.set_gpu_kv_dtype(args.kv_dtype)
    gpu.set_gpu_tier_want(gpu.GpuTierWant(auto_tier=True))
    if not gpu.moe_gpu_tier_arm():
        why = gpu.gpu_tier_status().reason
        if args.gpu == "vulkan":
            raise SystemExit(f"--gpu vulkan: {why}")
        log.info("serving on the CPU: %s", why)
        return False
    return True


def server_runtime(args: argparse.Namespace) -> Runtime:
    """The runtime this server's models run on, settled once per server (kept in ``args``).
    Without --threads, the default runtime. With --threads N, N threads: the default runtime
    made with them when this process has made none yet (a lone server, whose GPU tier is the
    default runtime's), else a runtime of its own, so that two servers in one process keep their
    own thread counts."""
    rt = getattr(args, "runtime", None)
    if rt is None:
        threads = getattr(args, "threads", None)
        if threads:
            rt = default_runtime_with(replace(RuntimeConfig.from_env(), threads=int(threads))) or Runtime(threads=int(threads))
        else:
            rt = default_runtime()
        args.runtime = rt
    return rt


def sampling_flags(args: argparse.Namespace) -> dict[str, float | int | None]:
    """The sampling flags given (None where not), as `dasllama.sampling_defaults` takes them."""
    return {"temp": args.temp, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p, "repeat_penalty": args.repeat_penalty}


def load_models(server: Server, args: argparse.Namespace) -> None:
    """Load every --model into an engine of `server`, as the flags say. With the GPU tier armed
    the first model goes on the device (one model holds it at a time); the rest run on the CPU."""
    rt = server_runtime(args)
    if rt is default_runtime():
        armed = arm_gpu(args)
    else:
        # The GPU tier (dasllama.gpu) is the default runtime's, which another server here holds.
        armed = False
        if args.gpu == "vulkan":
            raise SystemExit(f"--gpu vulkan with --threads {args.threads}: the device belongs to this process's first server; run this one in a process of its own")
        log.info("serving on the CPU on %d threads of its own: the GPU tier belongs to this process's default runtime", rt.threads)
    for i, spec in enumerate(args.model):
        m = load_model(spec, numerics=args.numerics, mmproj=False if args.no_mmproj else args.mmproj[i] if args.mmproj else None, runtime=rt, mmproj_offload=not args.no_mmproj_offload)
        on_device = False
        if armed:
            slot = gpu.gpu_model_marks_init()
            outcome = gpu.gpu_slot_capture(slot)
            on_device = outcome in ("gpu:resident", "gpu:partial")
            st = gpu.gpu_tier_status()
            if outcome == "gpu:partial":
                log.info("gpu backend auto-detected: %s split between '%s' and the CPU (%s)", m.path.name, st.device, slot.reason)
            elif on_device:
                log.info("gpu backend auto-detected: %s on '%s' (%d MiB of weights, %d streams from device memory)", m.path.name, st.device, st.weight_bytes >> 20, gpu.gpu_device_sessions())
            elif outcome == "gpu:rails":
                log.info("gpu backend auto-detected: %s on the per-op rails of '%s' (%d MiB of matrices on the device, K/V in host memory; not resident because %s)", m.path.name, st.device, st.weight_bytes >> 20, slot.reason)
            elif args.gpu == "vulkan" and i == 0:
                raise SystemExit(f"--gpu vulkan: {m.path.name} cannot go on the device: {slot.reason}")
            else:
                log.info("%s runs on the CPU: %s", m.path.name, slot.reason)
        if args.ctx:
            m.config["seq_len"] = min(int(m.config["seq_len"]), args.ctx)
        # Served as the alias, else as the known model name it was started with, else as
        # its file's stem; it answers to all three.
        is_path = spec.endswith(".gguf") or os.sep in spec
        name = args.alias[i] if args.alias else (m.path.stem if is_path else spec)
        draft = load_model(args.model_draft, numerics=args.numerics, runtime=rt) if args.model_draft else None
        drafting = configure_spec(m, args.spec, draft, args.spec_max)
        eng = Engine(m, name, args.streams, args.queue, args.chunk, args.page_rows, args.kv_dtype, args.prefix_cache_mb, device_kv=on_device)
        eng.sampling = sampling_defaults(m.metadata, sampling_flags(args))
        eng.n_predict = args.n_predict if args.n_predict > 0 else 0
        server.add(eng, spec, m.path.stem)
        log.info("serving %s as '%s' (speculative decoding: %s)", m.path.name, name, drafting)
        cap = min(eng.n_predict, int(m.config["seq_len"])) if eng.n_predict else int(m.config["seq_len"])
        log.info("'%s' defaults: %s; at most %d tokens a request (--n-predict); %d kernel threads", name, describe(eng.sampling), cap, m.runtime.threads)
        if not m.chat_template:
            log.warning(
                "'%s' (%s) has no chat template: it is a base model, so only /v1/completions works for it; /v1/chat/completions answers 400 (no_chat_template)", name, m.path.name
            )


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


def run(args: argparse.Namespace, setup: Callable[[Server], None] | None = None) -> int:
    """Serve as `args` say; `setup` adjusts the Server before it answers (dasllama-server sets
    llama-server's options there). `args.host` may list several addresses, comma-separated."""
    server_runtime(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # A model that cannot exist is refused before the server starts (loading, which may download,
    # runs in the background while /health answers "loading").
    problem = unknown_model(args)
    if problem:
        log.error("%s", problem)
        return 1
    import uvicorn

    server = Server(api_key=args.api_key, max_prompt_bytes=args.max_prompt_bytes, cors_origins=args.cors_origin)
    server.options.image_urls = args.allow_image_urls
    server.options.image_url_max_bytes, server.options.image_url_timeout_s = args.image_url_max_bytes, args.image_url_timeout
    if args.allow_image_urls:
        log.warning("--allow-image-urls: image_url parts may name http(s) URLs, which this server fetches (at most %d bytes, %g s each)", args.image_url_max_bytes, args.image_url_timeout)
    if setup is not None:
        setup(server)
    try:
        server.tools = start_tools(args.tools, args.tools_runtime, args.mcp_servers_config, args.mcp_servers_json)
    except ValueError as e:
        log.error("%s", e)
        return 1
    server.cors_proxy = args.ui_mcp_proxy
    if server.cors_proxy:
        log.warning("experimental /cors-proxy enabled: it fetches any URL for whoever may call this server")
    app = build_app(server)
    failed: list[BaseException] = []

    def load() -> None:
        try:
            load_models(server, args)
            server.ready = True
        except BaseException as e:  # noqa: BLE001 - surfaced below: the server exits non-zero
            failed.append(e)
            log.error("could not load the model: %s", e)
            os_kill()

    class _Uvicorn(uvicorn.Server):
        # SIGINT/SIGTERM are ours: stop admitting, let running requests finish, exit 0. (uvicorn's
        # own handler re-raises the signal after shutdown, which would exit non-zero.)
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    hosts = [h.strip() for h in args.host.split(",") if h.strip()]
    # dasllama-server asks for h11, which writes header names in the case given (httptools lowercases them).
    http = getattr(args, "http", "auto")
    config = uvicorn.Config(app, host=hosts[0], port=args.port, log_level=args.log_level, timeout_graceful_shutdown=30, http=http)
    uv = _Uvicorn(config)
    sockets = [_listen(h, args.port) for h in hosts] if len(hosts) > 1 else None

    def on_signal(signum: int, frame: object) -> None:
        for eng in server.engines.values():
            eng.admitting = False
        if server.tools is not None:
            server.tools.shutdown()  # a slow MCP call must not hold the shutdown
        uv.should_exit = True

    def os_kill() -> None:
        uv.should_exit = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    threading.Thread(target=load, name="dasllama-load", daemon=True).start()
    uv.run(sockets=sockets)
    server.ready = False
    if server.tools is not None:
        server.tools.close()
    for eng in server.engines.values():
        eng.shutdown()
    return 1 if failed else 0


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on one of several --host addresses (uvicorn binds one by itself)."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    sys.exit(main())
