"""dasllama-server: dasllama's server behind llama-server's command line.

    dasllama-server -m model.gguf -c 4096 -np 4 --host 0.0.0.0 --port 8080 --alias my-model

The flags keep llama-server's names, long and short; each maps onto a `python -m dasllama.serve`
option or a server option (options.py). Flags that only tune llama.cpp's own machinery (GPU
layers, batch sizes, flash attention, mmap) are taken and ignored, saying so in the log; flags for
features dasllama does not have (LoRA adapters, projector downloads) are refused by
name, as are flags llama-server does not know either. With no model, or with --models-dir or
--models-preset, it is a router (router.py); --sleep-idle-seconds unloads an idle model (sleep.py).

llama-server downloads `--hf-repo`/`--model-url` models itself; dasllama-server does not. Such a
model resolves to the file named by DASLLAMA_SERVER_HF_FALLBACK (a path or a dasllama model name)
when that is set, and is refused otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from .._cli import HelpFormatter
from .options import HF_FALLBACK_ENV, Options

log = logging.getLogger("dasllama.serve")


# llama-server's cache types -> dasllama's KV codecs (f32 and bf16 store as f16).
KV_TYPES = {"f16": "f16", "f32": "f16", "bf16": "f16", "q8_0": "q8_0"}

# Flags taken for compatibility that change nothing here: (names, takes a value).
IGNORED: list[tuple[tuple[str, ...], bool]] = [
    (("-ngl", "--gpu-layers", "--n-gpu-layers"), True),
    (("-ub", "--ubatch-size"), True),
    (("-cb", "--cont-batching"), False),
    (("-nocb", "--no-cont-batching"), False),
    (("-fa", "--flash-attn"), True),
    (("--swa-full",), False),
    (("--backend_sampling", "--backend-sampling"), False),
    (("--jinja",), False),
    (("--no-jinja",), False),
    (("--offline",), False),
    (("--context-shift",), False),
    (("--no-context-shift",), False),
    (("-cram", "--cache-ram"), True),
    (("--no-cache-idle-slots",), False),
    (("--reasoning-format",), True),
    (("--reasoning-budget",), True),
    (("--spec-draft-n-max", "--draft-max", "--draft", "--draft-n"), True),
    (("--spec-draft-n-min", "--draft-min", "--draft-n-min"), True),
    (("--spec-synth-len",), True),
    (("--spec-synth-rates",), True),
    (("--mlock",), False),
    (("--no-mmap",), False),
    (("--mmap",), False),
    (("--grp-attn-n", "-gan"), True),
    (("--grp-attn-w", "-gaw"), True),
    (("--media-path",), True),
    (("--numa",), True),
    (("-dev", "--device"), True),
    (("-sm", "--split-mode"), True),
    (("-ts", "--tensor-split"), True),
    (("-mg", "--main-gpu"), True),
    (("--log-disable",), False),
    (("--log-colors",), True),
    (("--no-warmup",), False),
    (("--warmup",), False),
    (("-to", "--timeout"), True),
    (("--threads-http",), True),
    (("-tb", "--threads-batch"), True),
    (("--cache-reuse",), True),
    (("--webui",), False),
    (("--props",), False),
    (("--keep", "-k"), True),
]

# Features dasllama does not have: the flag is refused, naming what is missing.
UNSUPPORTED = {
    "--lora": "LoRA adapters",
    "--lora-scaled": "LoRA adapters",
    "-mmu": "downloading a projector (pass --mmproj PATH)",
    "--mmproj-url": "downloading a projector (pass --mmproj PATH)",
    "--spec-type": "llama.cpp's speculative decoding types (dasllama's own: python -m dasllama.serve --spec)",
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dasllama-server",
        description="dasllama's server with llama-server's command line (see docs/server-compat.md).",
        formatter_class=HelpFormatter,
        allow_abbrev=False,
        add_help=False,
    )
    ap.add_argument("-h", "--help", action="help", help="show this help and exit")
    ap.add_argument("-m", "--model", default=None, help="a .gguf path or dasllama model name")
    ap.add_argument("-mm", "--mmproj", default=None, help="the model's vision projector (default: an mmproj*.gguf beside the model)")
    ap.add_argument("--no-mmproj", dest="no_mmproj", action="store_true", help="load no vision projector")
    ap.add_argument("--no-mmproj-offload", dest="no_mmproj_offload", action="store_true", help="keep the vision tower on the CPU when the model goes on a GPU")
    ap.add_argument("--allow-image-urls", dest="allow_image_urls", action="store_true", help="dasllama's: fetch http(s) image URLs (llama-server always does; dasllama only with this), at most 10 MiB in 10 s each")
    ap.add_argument("-hf", "-hfr", "--hf-repo", dest="hf_repo", default=None, help=f"a Hugging Face repo (not downloaded: resolves to ${HF_FALLBACK_ENV})")
    ap.add_argument("-hff", "--hf-file", dest="hf_file", default=None, help="a file in --hf-repo (as --hf-repo)")
    ap.add_argument("-mu", "--model-url", dest="model_url", default=None, help="a model URL (as --hf-repo)")
    ap.add_argument("-md", "--model-draft", dest="model_draft", default=None, help="a draft model for speculative decoding")
    ap.add_argument("-a", "--alias", default=None, help="the model's names, comma-separated (the first in sorted order is its id)")
    ap.add_argument("--tags", default=None, help="the model's tags, comma-separated (listed by /models)")
    ap.add_argument("--host", default="127.0.0.1", help="address(es) to listen on, comma-separated")
    ap.add_argument("--port", type=int, default=8080, help="port to listen on")
    ap.add_argument("-c", "--ctx-size", dest="ctx_size", type=int, default=0, help="context size, shared by the slots (0: the model's)")
    ap.add_argument("-np", "--parallel", dest="parallel", type=int, default=4, help="slots: concurrent streams")
    ap.add_argument("-t", "--threads", type=int, default=0, help="CPU threads of this server's runtime (default: DASLLAMA_THREADS, else the physical cores)")
    ap.add_argument("-b", "--batch-size", dest="batch_size", type=int, default=512, help="most prompt tokens per step")
    ap.add_argument("-ctk", "--cache-type-k", dest="cache_type_k", default="f16", help="K cache type: f16, f32, bf16, q8_0")
    ap.add_argument("-ctv", "--cache-type-v", dest="cache_type_v", default=None, help="V cache type (must match -ctk: dasllama stores K and V alike)")
    ap.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int, default=-1, help="default tokens to predict (-1: unlimited)")
    ap.add_argument("--temp", type=float, default=None, help="default temperature")
    ap.add_argument("-s", "--seed", type=int, default=None, help="default seed (-1: random)")
    ap.add_argument("--api-key", dest="api_key", default=None, help="require this key (comma-separated: the first is used)")
    ap.add_argument("--api-key-file", dest="api_key_file", default=None, help="read the key from this file's first line")
    ap.add_argument("--cors-origins", dest="cors_origins", default=None, help="origins allowed from a browser, comma-separated; 'localhost' is any loopback origin")
    ap.add_argument("--metrics", action="store_true", help="serve /metrics")
    ap.add_argument("--slots", dest="slots", action="store_true", default=True, help="serve /slots (the default)")
    ap.add_argument("--no-slots", dest="slots", action="store_false", help="answer /slots with 501")
    ap.add_argument("--embedding", "--embeddings", dest="embedding", action="store_true", help="(embeddings are always served)")
    ap.add_argument("--reranking", "--rerank", dest="reranking", action="store_true", help="(accepted; /rerank needs a reranker model)")
    ap.add_argument("--no-ui", "--no-webui", dest="no_ui", action="store_true", help="no chat page at /")
    ap.add_argument("--chat-template", dest="chat_template", default=None, help="a chat template used instead of the model's: one of llama.cpp's built-in names (chatml, llama3, command-r, gemma, phi3, ...) or Jinja text")
    ap.add_argument("--chat-template-file", dest="chat_template_file", default=None, help="a Jinja chat template file used instead of the model's")
    ap.add_argument("-kvu", "--kv-unified", dest="kv_unified", action="store_true", help="one cache shared by the slots: a request may use the whole -c")
    ap.add_argument("-no-kvu", "--no-kv-unified", dest="kv_unified", action="store_false", help="each slot gets -c / -np (the default)")
    ap.add_argument("--pooling", default=None, choices=["none", "mean", "cls", "last", "rank"], help="embeddings pooling (default: the model's)")
    ap.add_argument("-rea", "--reasoning", default=None, choices=["on", "off", "auto"], help="off: render chat templates with thinking off")
    ap.add_argument("--tools", default=None, help="experimental: built-in tools at /tools (read_file, file_glob_search, grep_search, exec_shell_command, write_file, edit_file, get_info, or all); limits --cors-origins to localhost by default")
    ap.add_argument("--tools-runtime", dest="tools_runtime", default=None, help="experimental: run the tools in docker:<image>, podman:<image>, docker-container:<id>, podman-container:<id> or ssh:<host>")
    ap.add_argument("--mcp-servers-config", dest="mcp_servers_config", default=None, help="experimental: a JSON file of MCP servers (Cursor's format) whose tools /tools serves; limits --cors-origins to localhost by default")
    ap.add_argument("--mcp-servers-json", dest="mcp_servers_json", default=None, help="experimental: the same, inline")
    ap.add_argument("--ui-mcp-proxy", "--webui-mcp-proxy", dest="ui_mcp_proxy", action="store_true", default=False, help="experimental: serve /cors-proxy (do not enable in untrusted environments)")
    ap.add_argument("--no-ui-mcp-proxy", "--no-webui-mcp-proxy", dest="ui_mcp_proxy", action="store_false", help="no /cors-proxy (the default)")
    ap.add_argument("-ag", "--agent", dest="agent", action="store_true", default=None, help="all built-in tools and the CORS proxy")
    ap.add_argument("-no-ag", "--no-agent", dest="agent", action="store_false", help="neither")
    ap.add_argument("--slot-save-path", dest="slot_save_path", default=None, help="where POST /slots/N?action=save|restore writes and reads slot files")
    ap.add_argument("--models-dir", dest="models_dir", default=None, help="router mode: serve the .gguf files (and one-model folders) of this directory, loaded on request")
    ap.add_argument("--models-preset", dest="models_preset", default=None, help="router mode: serve the models an INI file's sections name (model = PATH or hf-repo = owner/repo)")
    ap.add_argument("--models-max", dest="models_max", type=int, default=4, help="router mode: most models loaded at once (0: no limit); the least recently used idle one is unloaded")
    ap.add_argument("--no-models-autoload", dest="models_autoload", action="store_false", help="router mode: load models on POST /models/load only")
    ap.add_argument("--sleep-idle-seconds", dest="sleep_idle_seconds", type=float, default=-1, help="unload the model after this many idle seconds, reload it on the next request (-1: never)")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    ap.add_argument("--log-verbosity", "-lv", dest="log_verbosity", type=int, default=None, help="(accepted)")
    for names, takes_value in IGNORED:
        if takes_value:
            ap.add_argument(*names, dest="ignored_" + names[-1].lstrip("-").replace("-", "_"), default=None, help=argparse.SUPPRESS)
        else:
            ap.add_argument(*names, dest="ignored_" + names[-1].lstrip("-").replace("-", "_"), action="store_true", help=argparse.SUPPRESS)
    return ap


def resolve_model(ns: argparse.Namespace, ap: argparse.ArgumentParser) -> str | None:
    """The --model to serve: -m as given; a Hugging Face repo or URL resolves to the fallback
    file; none at all serves dasllama's default model."""
    if ns.model:
        return ns.model
    remote = ns.hf_repo or ns.model_url
    if remote is None:
        return None
    fallback = os.environ.get(HF_FALLBACK_ENV)
    if not fallback:
        ap.error(
            f"dasllama-server does not download models ({'--hf-repo ' + ns.hf_repo if ns.hf_repo else '--model-url ' + ns.model_url}); "
            f"pass -m PATH, or set {HF_FALLBACK_ENV} to the local file to serve in its place"
        )
    ns.notes.append(f"serving {fallback} in place of {remote}{'/' + ns.hf_file if ns.hf_file else ''} ({HF_FALLBACK_ENV})")
    return fallback


def translate(argv: list[str]) -> tuple[argparse.Namespace, Options]:
    """llama-server's flags -> (`python -m dasllama.serve`'s namespace, the server options)."""
    from .__main__ import parse_args

    for a in argv:
        flag = a.split("=", 1)[0]
        if flag in UNSUPPORTED:
            raise SystemExit(f"dasllama-server: {flag} is not supported: dasllama has no {UNSUPPORTED[flag]}")
    ap = build_parser()
    ns, unknown = ap.parse_known_args(argv)
    ns.notes = []
    if unknown:
        ap.error(f"unknown arguments: {' '.join(unknown)} (llama-server flags dasllama-server takes: dasllama-server --help)")
    kv = KV_TYPES.get(ns.cache_type_k)
    if kv is None:
        ap.error(f"-ctk {ns.cache_type_k}: dasllama stores the KV cache as {', '.join(sorted(KV_TYPES))}")
    if ns.cache_type_v is not None and KV_TYPES.get(ns.cache_type_v) != kv:
        ap.error(f"-ctv {ns.cache_type_v} differs from -ctk {ns.cache_type_k}: dasllama stores K and V alike")
    if ns.parallel < 1:
        ns.parallel = 4  # llama-server's -np -1 (auto)
    api_key = ns.api_key.split(",")[0] if ns.api_key else None
    if ns.api_key_file:
        with open(ns.api_key_file, encoding="utf-8") as f:
            api_key = f.readline().strip() or api_key
    aliases = sorted({a.strip() for a in ns.alias.split(",") if a.strip()}) if ns.alias else []
    model = resolve_model(ns, ap)
    serve_argv = ["--host", ns.host, "--port", str(ns.port), "--streams", str(ns.parallel), "--kv-dtype", kv, "--chunk", str(max(1, ns.batch_size))]
    serve_argv += ["--log-level", "debug" if ns.verbose else "info"]
    if ns.threads > 0:
        serve_argv += ["--threads", str(ns.threads)]  # the server's runtime gets them (server_runtime)
    if model:
        serve_argv += ["--model", model]
        if aliases:
            serve_argv += ["--alias", aliases[0]]
        if ns.mmproj:
            serve_argv += ["--mmproj", ns.mmproj]
    if ns.no_mmproj:
        serve_argv += ["--no-mmproj"]
    if ns.no_mmproj_offload:
        serve_argv += ["--no-mmproj-offload"]
    if ns.allow_image_urls:
        serve_argv += ["--allow-image-urls"]
    if ns.model_draft:
        serve_argv += ["--model-draft", ns.model_draft]
    unified = bool(ns.kv_unified)
    if ns.ctx_size > 0:
        # llama-server divides -c among the slots; each request gets a slot's share (all of it
        # with --kv-unified, where the slots share one cache).
        serve_argv += ["--ctx", str(ns.ctx_size if unified else max(1, ns.ctx_size // ns.parallel))]
    if api_key:
        serve_argv += ["--api-key", api_key]
    if ns.agent is not None:  # llama-server's --agent: every tool and the proxy (or, --no-agent, neither)
        ns.tools, ns.ui_mcp_proxy = ("all", True) if ns.agent else (None, False)
    for flag, value in (("--tools", ns.tools), ("--tools-runtime", ns.tools_runtime), ("--mcp-servers-config", ns.mcp_servers_config), ("--mcp-servers-json", ns.mcp_servers_json)):
        if value:
            serve_argv += [flag, value]
    if ns.ui_mcp_proxy:
        serve_argv += ["--ui-mcp-proxy"]
    args = parse_args(serve_argv, prog="dasllama-server")
    # llama-server with no model is a router: it serves the models of its cache, --models-dir
    # and --models-preset, loading each on request (router.py).
    args.router = bool(ns.models_dir or ns.models_preset or not model)
    args.router_opts = {"models_dir": ns.models_dir, "models_preset": ns.models_preset, "models_max": ns.models_max, "autoload": ns.models_autoload}
    args.sleep_idle_seconds = ns.sleep_idle_seconds
    if args.router:
        args.model = []
    args.http = "h11"  # header names as llama-server writes them (Title-Case)
    ignored = sorted(k[len("ignored_") :] for k, v in vars(ns).items() if k.startswith("ignored_") and v not in (None, False))
    if ignored:
        ns.notes.append(f"ignored (no effect on dasllama): {', '.join(ignored)}")
    cors = [o.strip() for o in ns.cors_origins.split(",") if o.strip()] if ns.cors_origins else ["*"]
    if ns.cors_origins is None and (ns.tools or ns.mcp_servers_config or ns.mcp_servers_json):
        # as llama-server: tools that touch this machine are not for every web page's scripts
        cors = ["localhost"]
        ns.notes.append("tools or MCP servers enabled: CORS allows loopback origins only (change with --cors-origins)")
    opts = Options(
        n_predict=ns.n_predict,
        temperature=ns.temp,
        seed=ns.seed if ns.seed is not None and ns.seed >= 0 else None,
        n_ctx_slot=(ns.ctx_size if unified else ns.ctx_size // ns.parallel) if ns.ctx_size > 0 else 0,
        slots_endpoint=ns.slots,
        metrics_endpoint=ns.metrics,
        ui=not ns.no_ui,
        aliases=aliases,
        tags=sorted({t.strip() for t in ns.tags.split(",") if t.strip()}) if ns.tags else [],
        llama_cors=cors,
        llama_compat=True,
        verbose=ns.verbose,
        notes=ns.notes,
        pooling=ns.pooling if ns.pooling != "rank" else None,
        reasoning=ns.reasoning,
        slot_save_path=ns.slot_save_path,
    )
    if ns.chat_template_file:
        with open(ns.chat_template_file, encoding="utf-8") as f:
            opts.chat_template = f.read()
        ns.notes.append(f"chat template from --chat-template-file {ns.chat_template_file}")
    elif ns.chat_template:
        from .chat_templates import resolve

        opts.chat_template, how = resolve(ns.chat_template)
        ns.notes.append(f"chat template: {how} (--chat-template)")
    return args, opts


def main(argv: list[str] | None = None) -> int:
    from .__main__ import run

    args, opts = translate(list(sys.argv[1:] if argv is None else argv))

    def setup(server: Any) -> None:
        server.options = opts
        for note in opts.notes:
            log.warning("%s", note)
        if args.router:
            start_router(server, args)
        elif args.sleep_idle_seconds >= 0:
            start_sleep(server, args)

    return run(args, setup)


def start_router(server: Any, args: argparse.Namespace) -> None:
    from pathlib import Path

    from ..fetch import cache_dir
    from .router import Router, engine_loader

    try:
        router = Router(server, engine_loader(args), extra_cache=Path(cache_dir()), **args.router_opts)
    except ValueError as e:
        raise SystemExit(f"dasllama-server: {e}") from None
    server.gate = router.gate
    server.extra_routes = lambda routes, existing: router.routes(routes.guarded, existing)
    log.info("router mode: %d models listed (GET /models), at most %s loaded at once", len(router.entries), args.router_opts["models_max"] or "any number")
    if args.sleep_idle_seconds >= 0:
        log.warning("--sleep-idle-seconds is not applied in router mode (the router unloads idle models beyond --models-max)")


def start_sleep(server: Any, args: argparse.Namespace) -> None:
    from .router import engine_loader
    from .sleep import Sleeper

    sleeper = Sleeper(server, engine_loader(args), args.sleep_idle_seconds)
    server.gate = sleeper.gate
    server.background.append(sleeper.watch)

    def attach(routes: Any, existing: list[Any]) -> list[Any]:
        sleeper.routes = existing
        return []

    server.extra_routes = attach


if __name__ == "__main__":
    sys.exit(main())
