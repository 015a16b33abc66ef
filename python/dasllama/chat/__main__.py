"""`python -m dasllama.chat`: the command line (a module of its own, so that running it does not
import it twice: the package imports `dasllama.chat` itself)."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace

from .._cli import HelpFormatter
from ..errors import TemplateError
from ..fetch import DEFAULT_MODEL
from ..model import decode, encode, load_model
from ..sampling_defaults import sampling_defaults
from ..session import create_session, generate
from . import Message, render_chat


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dasllama.chat", description="Chat with a model through its own chat template.", formatter_class=HelpFormatter)
    ap.add_argument("-m", "--model", default=DEFAULT_MODEL, help="path to a .gguf, a known model name, or a Hugging Face model (hf://owner/repo/file.gguf, owner/repo[:quant])")
    ap.add_argument("--system", default="", help="system prompt")
    ap.add_argument("--max-new", type=int, default=256)
    # As the server's: the model file's general.sampling.* where it has them, else llama-server's.
    ap.add_argument("--temp", type=float, default=None, help="temperature; 0 is greedy (default: the model file's, else 0.8)")
    ap.add_argument("--top-k", type=int, default=None, help="default: the model file's, else 40")
    ap.add_argument("--top-p", type=float, default=None, help="default: the model file's, else 0.95")
    ap.add_argument("--min-p", type=float, default=None, help="default: the model file's, else 0.05")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    m = load_model(args.model)
    if not m.chat_template:
        # Checked before the prompt is shown: a base model continues text and has no turns to render.
        print(
            f"error: {m.path.name} has no chat template: '{args.model}' is a base model, which continues text instead of answering turns.\n"
            f"Use it with: python -m dasllama.generate -m {args.model} \"your text\"  (or chat with a chat model, e.g. -m {DEFAULT_MODEL})",
            file=sys.stderr,
        )
        return 1
    params = replace(sampling_defaults(m.metadata, {"temp": args.temp, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p}).params(), seed=args.seed)
    messages: list[Message] = [{"role": "system", "content": args.system}] if args.system else []
    s = create_session(m)
    fed: list[int] = []  # tokens already in the session's KV
    print(f"chatting with {m.path.name} (empty line or Ctrl-D to quit)", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        try:
            ids = encode(m, render_chat(m, messages), special=True)
        except TemplateError as e:
            # The template refused this conversation (e.g. its roles): say why, drop the turn, go on.
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        # Reuse the KV of everything already evaluated; only the new turn is prefilled.
        if ids[: len(fed)] != fed:
            s.reset()
            fed = []
        out = generate(m, s, ids[len(fed) :], params, args.max_new, lambda _id, text: print(text, end="", flush=True))
        print()
        fed = ids + out[:-1]  # the last sampled token was never evaluated into the KV
        messages.append({"role": "assistant", "content": decode(m, [t for t in out if t not in m.eog_ids])})
    return 0


if __name__ == "__main__":
    sys.exit(main())
