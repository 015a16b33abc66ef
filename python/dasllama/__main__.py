"""`dasllama` (or `python -m dasllama`): the umbrella command. For now one group, `models`:

    dasllama models list                     # known names and every cached file, with sizes
    dasllama models fetch NAME|hf://owner/repo/file.gguf|owner/repo[:quant]
    dasllama models remove NAME|hf://...|owner/repo[:quant]|owner/repo
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ._cli import HelpFormatter
from .errors import FetchError
from .fetch import ALIASES, DEFAULT_MODEL, KNOWN, cache_dir, fetch, known_names
from .fetch.hub import hub_dir, parse_ref
from .fetch.hub import remove as remove_hub


def _size(p: Path) -> str:
    n = p.stat().st_size
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def cached_models() -> list[tuple[str, Path | None]]:
    """(the name to pass as --model, its cached file or None) for every known name and every
    GGUF in the cache."""
    root = cache_dir()
    rows: list[tuple[str, Path | None]] = []
    seen: set[Path] = set()
    for name, spec in KNOWN.items():
        p = root / spec.file
        rows.append((name, p if p.is_file() else None))
        seen.add(p)
    hub = hub_dir()
    if hub.is_dir():
        for p in sorted(hub.rglob("*.gguf")):
            rel = p.relative_to(hub)
            if ".cache" in rel.parts or len(rel.parts) < 3:
                continue
            rows.append((f"hf://{rel.parts[0]}/{rel.parts[1]}/{'/'.join(rel.parts[2:])}", p))
            seen.add(p)
    if root.is_dir():
        rows += [(str(p), p) for p in sorted(root.glob("*.gguf")) if p not in seen]
    return rows


def cmd_list(args: argparse.Namespace) -> int:
    rows = cached_models()
    print(f"cache: {cache_dir()}")
    width = max(len(n) for n, _ in rows)
    for name, p in rows:
        note = " (default)" if name == DEFAULT_MODEL else ""
        print(f"{name:<{width}}  {_size(p) if p else 'not fetched':>11}  {p or ''}{note}")
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    try:
        print(fetch(args.name))
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    name = ALIASES.get(args.name, args.name)
    gone: list[Path] = []
    try:
        ref = parse_ref(name)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if name in KNOWN:
        p = cache_dir() / KNOWN[name].file
        if p.is_file():
            p.unlink()
            gone.append(p)
    elif ref is not None:
        gone = remove_hub(ref)
    else:
        p = Path(name).expanduser().resolve()
        if p.suffix == ".gguf" and p.is_file() and cache_dir().resolve() in p.parents:
            p.unlink()
            gone.append(p)
        elif p.exists():
            print(f"error: {p} is not a model in the cache ({cache_dir()}); dasllama removes only what it fetched", file=sys.stderr)
            return 1
    if not gone:
        print(f"error: nothing cached for '{args.name}' (see: dasllama models list)", file=sys.stderr)
        return 1
    for p in gone:
        print(f"removed {p}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dasllama", description="dasllama's commands (the server is python -m dasllama.serve).", formatter_class=HelpFormatter)
    groups = ap.add_subparsers(dest="group", required=True)
    models = groups.add_parser("models", help="list, fetch and remove cached models", formatter_class=HelpFormatter)
    sub = models.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="known model names and every cached file, with sizes").set_defaults(run=cmd_list)
    forms = f"one of {', '.join(known_names())}, hf://owner/repo/file.gguf, or owner/repo[:quant] (a Hugging Face repository; quant defaults to Q4_K_M)"
    f = sub.add_parser("fetch", help="fetch a model into the cache and print its path")
    f.add_argument("name", help=forms)
    f.set_defaults(run=cmd_fetch)
    r = sub.add_parser("remove", help="delete a model's cached file (owner/repo: all of that repository's)")
    r.add_argument("name", help=forms + ", or a cached file's path")
    r.set_defaults(run=cmd_remove)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("httpx", "httpx2", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.WARNING)  # their request lines are not for a person
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
