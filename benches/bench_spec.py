"""Speculative decoding against plain decoding, through the scheduler, same requests, runs
interleaved: single-stream decode tokens/s with n-gram prompt lookup on input-grounded prompts
(summarise, rewrite, extract, edit code) and on open-ended chat; a Q4_0 draft model for its F16
and Q8_0 originals; 4 and 16 streams end to end. Prints acceptance and the pass cost the policy measured.

    python benches/bench_spec.py [--runs 3] [--max-new 128] [--only ngram,draft,batch,mtp]

`mtp` runs the MTP head of a synthetic qwen35 hybrid (tests/synthetic.py: 4 layers of width 256,
random weights, an MTP block after them). Its drafts are right by chance only, so acceptance
there says nothing about a real model's: those rows measure what the machinery costs where
drafts fail, the head's passes plus the verify rows plus replaying the DeltaNet state back to the
accepted row, under the adaptive policy (which should back off to about plain speed) and with
3 drafts forced every step (the full price).

The F16 and Q8_0 targets and the Q4_0 draft are made once from SmolLM2's Q4_1 file (dequantized,
then written as F16 or requantized with gguf-py) and cached beside it.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize
from tqdm import tqdm

import dasllama as dl

SOURCE = """The city council met on Tuesday to discuss the new bicycle lanes on Main Street. Supporters
said the lanes would make cycling safer and reduce traffic. Shop owners worried that removing
parking spaces would hurt their business. The council voted five to two to build the lanes next
spring, and promised to review parking in the autumn."""
CODE = """def mean(xs):
    total = 0
    for x in xs:
        total += x
    return total / len(xs)

def variance(xs):
    m = mean(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)
"""
GROUNDED = [
    f"Summarise this article in three sentences:\n\n{SOURCE}",
    f"Rewrite this article in simpler words, keeping every fact:\n\n{SOURCE}",
    f"Extract every number and what it counts from this article, one per line:\n\n{SOURCE}",
    f"Add a docstring to each function and print the whole file again:\n\n{CODE}",
]
OPEN = ["Write a short story about a lighthouse keeper.", "What are good habits for learning a language?", "Describe a day in a medieval village.", "Why is the sky blue?"]


def chat_ids(m: dl.Model, text: str) -> list[int]:
    chat = dl.create_chat_renderer(m, "You are a helpful assistant.", 512)
    dl.add_user(chat, text)
    return dl.render_turn(m, chat)


def run(m: dl.Model, sch: dl.Scheduler, prompts: list[list[int]], max_new: int) -> dict[str, float]:
    """Decode tok/s per stream (generated tokens after the first over the time since it) and end
    to end tok/s (all generated tokens over the wall time)."""
    for p in prompts:
        dl.submit(m, sch, dl.PendingReq(id=next(IDS), prompt=p, max_new=max_new, params=dl.SamplingParams()))
    evs: list[dl.SchedEvent] = []
    rates, total = [], 0
    t0 = time.perf_counter()
    more = True
    while more:
        more = dl.scheduler_step(m, sch, evs)
        for e in evs:
            if e.kind == "finished":
                total += e.n_gen
                if e.n_gen > 1 and e.gen_us > 0:
                    rates.append((e.n_gen - 1) / (e.gen_us / 1e6))
        evs.clear()
    wall = time.perf_counter() - t0
    st = dl.scheduler_stats(sch)
    return {
        "decode": statistics.mean(rates) if rates else 0.0,
        "e2e": total / wall,
        "drafted": st["spec_drafted"],
        "accepted": st["spec_accepted"],
        "row_us": st.get("spec_row_us", 0.0),
        "pass_us": st.get("spec_pass_us", 0.0),
    }


IDS = itertools.count()


def compare(label: str, m: dl.Model, prompts: list[list[int]], streams: int, max_new: int, runs: int, key: str, bar: tqdm, fixed: int | None = None) -> list[str]:
    # One long-lived scheduler per mode, as a server has: what speculation measures about the
    # machine (pass cost, acceptance, the guard) carries over from run to run, as it does there.
    # A warm-up run each, not counted.
    plain, spec_sch = (dl.create_scheduler(m, max_streams=streams, max_queue=len(prompts), page_rows=16, mtp=mtp) for mtp in (False, True))
    if fixed is not None:
        dl.fix_draft_len(spec_sch, fixed)
    run(m, plain, prompts, max_new)
    run(m, spec_sch, prompts, max_new)
    base, spec = [], []
    last: dict[str, float] = {}
    for _ in range(runs):  # interleaved, so drift in the machine's speed hits both alike
        base.append(run(m, plain, prompts, max_new)[key])
        bar.update()
        last = run(m, spec_sch, prompts, max_new)
        spec.append(last[key])
        bar.update()
    b, s = statistics.median(base), statistics.median(spec)
    # Acceptance over everything the scheduler ran (the counters are cumulative).
    acc = last["accepted"] / last["drafted"] if last["drafted"] else 0.0
    return [label, str(streams), f"{b:.1f}", f"{s:.1f}", f"{s / b:.2f}x", f"{acc:.0%} of {int(last['drafted'])}", f"{last['pass_us'] / 1000:.1f} + {last['row_us'] / 1000:.2f}/row"]


def single_stream(label: str, m: dl.Model, prompts: list[list[int]], max_new: int, runs: int, bar: tqdm) -> list[str]:
    """One request at a time, the prompts one after another: mean decode tok/s with and without."""
    return compare(label, m, prompts, 1, max_new, runs, "decode", bar)


def copy_as(src: Path, dst: Path, qt: QT) -> None:
    """Rewrite `src` with every matrix as `qt` (F16 or a 32-block format), the rest as is."""
    r = GGUFReader(src)
    arch = str(r.fields["general.architecture"].contents())
    w = GGUFWriter(str(dst), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
        w.add_key_value(name, f.contents(), vtype, sub_type=sub)
    for t in r.tensors:
        rows = [int(x) for x in reversed(t.shape)]
        if len(rows) == 2:
            x = dequantize(t.data, t.tensor_type).reshape(rows).astype(np.float32)
            if qt == QT.F16:
                w.add_tensor(t.name, x.astype(np.float16))
            else:
                w.add_tensor(t.name, quantize(x, qt), raw_dtype=qt)
        else:
            w.add_tensor(t.name, np.asarray(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def variant(src: Path, qt: QT) -> Path:
    path = src.with_name(f"{src.stem}.bench-{qt.name}.gguf")
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        copy_as(src, tmp, qt)
        tmp.rename(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--only", default="ngram,draft,batch,mtp")
    args = ap.parse_args()
    only = set(args.only.split(","))
    src = Path(dl.fetch("smollm2-135m-instruct"))
    m = dl.load_model(src)
    grounded, open_ = [chat_ids(m, t) for t in GROUNDED], [chat_ids(m, t) for t in OPEN]
    jobs = 4 * ("ngram" in only) + 4 * ("batch" in only) + 4 * ("draft" in only) + 6 * ("mtp" in only)
    rows = []
    with tqdm(total=jobs * args.runs, desc="bench_spec", unit="run") as bar:
        if "ngram" in only:
            dl.attach_ngram_drafter(m)
            for kind, ps in (("ngram, grounded", grounded), ("ngram, open-ended", open_)):
                rows.append(single_stream(kind, m, ps, args.max_new, args.runs, bar))
        if "batch" in only:
            dl.attach_ngram_drafter(m)
            mixed = grounded + open_
            for streams in (4, 16):
                ps = (mixed * (2 * streams // len(mixed) + 1))[: 2 * streams]
                rows.append(compare("ngram, mixed (end to end)", m, ps, streams, args.max_new, args.runs, "e2e", bar))
        if "draft" in only:
            draft = dl.load_model(variant(src, QT.Q4_0))
            for qt in (QT.F16, QT.Q8_0):
                target = dl.load_model(variant(src, qt))
                dl.attach_draft_model(target, draft)
                prompts = [chat_ids(target, t) for t in GROUNDED + OPEN]
                rows.append(single_stream(f"Q4_0 draft for {qt.name}", target, prompts, args.max_new, args.runs, bar))
        if "mtp" in only:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
            from synthetic import write_family

            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "qwen35-mtp.gguf"
                write_family(path, "qwen35", mtp=True, meta={"context_length": 512})
                hy = dl.load_model(path)
                rng = np.random.default_rng(0)
                ps = [[1] + [int(t) for t in rng.integers(3, 267, size=40)] for _ in range(8)]
                rows.append(compare("MTP head, synthetic qwen35 (random)", hy, ps[:4], 1, args.max_new, args.runs, "decode", bar))
                rows.append(compare("  same, 3 drafts forced", hy, ps[:4], 1, args.max_new, args.runs, "decode", bar, fixed=3))
                rows.append(compare("  same, 3 drafts forced (end to end)", hy, ps, 4, args.max_new, args.runs, "e2e", bar, fixed=3))
    head = ["case", "streams", "plain tok/s", "spec tok/s", "speedup", "accepted", "pass cost ms (a + b/row)"]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)))


if __name__ == "__main__":
    main()
