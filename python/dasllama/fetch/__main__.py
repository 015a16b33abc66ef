"""`python -m dasllama.fetch`: the command line (a module of its own, so that running it does not
import it twice: the package imports `dasllama.fetch` itself)."""

from __future__ import annotations

import argparse
import logging
import sys

from .._cli import HelpFormatter
from ..errors import FetchError
from . import DEFAULT_MODEL, fetch, known_names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dasllama.fetch", description="Fetch a known model into the dasllama cache and print its path.", formatter_class=HelpFormatter)
    ap.add_argument("name", nargs="?", default=DEFAULT_MODEL, help=f"one of {', '.join(known_names())}, or a path")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(fetch(args.name))
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
