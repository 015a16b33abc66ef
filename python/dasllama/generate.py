"""Stream a completion of raw text.

    python -m dasllama.generate [-m MODEL] [--max-new N] [--temp T] "prompt"
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from ._cli import HelpFormatter
from .errors import DasllamaError
from .fetch import DEFAULT_MODEL
from .model import encode, load_model
from .session import SamplingParams, create_session, generate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dasllama.generate", description="Generate text from a prompt and stream it.", formatter_class=HelpFormatter)
    ap.add_argument("prompt")
    ap.add_argument("-m", "--model", default=DEFAULT_MODEL, help="path to a .gguf, a known model name or a Hugging Face model (hf://owner/repo/file.gguf, owner/repo[:quant]), fetched on first use")
    ap.add_argument("-n", "--max-new", type=int, default=128, help="tokens to generate at most")
    ap.add_argument("--temp", type=float, default=0.0, help="temperature; 0 is greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repeat-penalty", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--special", action="store_true", help="parse special tokens like <|im_start|> in the prompt")
    ap.add_argument("--numerics", default="fast", choices=["fast", "ggml"], help="ggml: llama.cpp's AVX2 summation order, bit for bit (slower)")
    ap.add_argument("-v", "--verbose", action="store_true", help="log loading and print timings")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if args.max_new < 1:
        ap.error("--max-new must be at least 1")
    try:
        m = load_model(args.model, numerics=args.numerics)
        ids = encode(m, args.prompt, special=args.special)
        if not ids:
            ap.error("the prompt is empty")
        s = create_session(m)
        p = SamplingParams(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, penalty=args.repeat_penalty, seed=args.seed)
        sys.stdout.write(args.prompt)
        t0 = time.perf_counter()
        out = generate(m, s, ids, p, args.max_new, lambda _id, text: (sys.stdout.write(text), sys.stdout.flush()) and None)
        dt = time.perf_counter() - t0
        sys.stdout.write("\n")
        if args.verbose:
            print(f"[{len(ids)} prompt tokens, {len(out)} generated in {dt:.2f}s]", file=sys.stderr)
    except DasllamaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
