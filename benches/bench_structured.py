"""Does a constrained stream slow the unconstrained streams beside it? Through the scheduler,
the same N unconstrained streams (greedy, ignore_eos, max_new tokens each) decode alone, beside
one more unconstrained stream, and beside one stream held to a JSON schema (an array of nested
objects with enums, the kind of grammar whose masks cost the most) that lasts the whole run.
Prints the unconstrained streams' tokens/s in each case (median of the runs, interleaved) and
what the grammar's masks cost the pass.

    python benches/bench_structured.py [--streams 4] [--max-new 96] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import dasllama as dl

SCHEMA = {
    "type": "array",
    "minItems": 200,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        },
        "required": ["name", "age", "role", "tags"],
        "additionalProperties": False,
    },
}
PROMPTS = ["Write a short story about a lighthouse keeper.", "What are good habits for learning a language?", "Describe a day in a medieval village.", "Why is the sky blue?"]


def chat_ids(m: dl.Model, text: str) -> list[int]:
    chat = dl.create_chat_renderer(m, "", 256)
    dl.add_user(chat, text)
    return dl.render_turn(m, chat)


def run(m: dl.Model, n: int, extra: str | None, max_new: int) -> tuple[float, int]:
    """Tokens/s of the n unconstrained streams (from their first token to their last), and the
    extra stream's token count."""
    sch = dl.create_scheduler(m, max_streams=n + 1, max_queue=n + 1, page_rows=16)
    for i in range(n):
        dl.submit(m, sch, dl.PendingReq(id=i, prompt=chat_ids(m, PROMPTS[i % len(PROMPTS)]), max_new=max_new, ignore_eos=True))
    if extra is not None:
        grammar = dl.json_schema_grammar(SCHEMA) if extra == "constrained" else None
        dl.submit(m, sch, dl.PendingReq(id=99, prompt=chat_ids(m, "List the users of a small company as JSON."), max_new=max_new + 32, ignore_eos=True, grammar=grammar))
    evs: list[dl.SchedEvent] = []
    first: float | None = None
    last = 0.0
    toks = 0
    extra_toks = 0
    while dl.scheduler_step(m, sch, evs):
        now = time.perf_counter()
        for e in evs:
            if e.kind != "piece":
                continue
            if e.id == 99:
                extra_toks += 1
                continue
            if first is None:
                first = now
            toks += 1
            last = now
        evs.clear()
    assert first is not None
    return toks / (last - first), extra_toks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    m = dl.load_model(dl.fetch(a.model))
    run(m, a.streams, "constrained", 8)  # warm: the first grammar indexes the vocabulary
    cases = {"alone": None, "+1 unconstrained": "free", "+1 constrained (JSON schema)": "constrained"}
    rates: dict[str, list[float]] = {k: [] for k in cases}
    extra: dict[str, int] = {}
    for _ in range(a.runs):
        for name, kind in cases.items():
            tps, n_extra = run(m, a.streams, kind, a.max_new)
            rates[name].append(tps)
            extra[name] = n_extra
    print(f"{a.model}, {a.streams} unconstrained streams x {a.max_new} tokens, {dl.n_threads()} threads, median of {a.runs}")
    print(f"{'beside them':<32}{'their tokens/s':>16}{'vs alone':>10}{'extra stream tokens':>22}")
    base = statistics.median(rates["alone"])
    for name in cases:
        r = statistics.median(rates[name])
        print(f"{name:<32}{r:>16.1f}{r / base:>10.2f}{extra[name]:>22}")


if __name__ == "__main__":
    main()
