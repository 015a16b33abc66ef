"""Tutorial 13, "Serving Many Conversations", on the default model.

    python examples/13_serving.py [MODEL]

1. The raw mechanism: two sessions advanced by ONE weight pass with eval_batch.
2. The scheduler: four conversations, one digit (the stream) printed per generated piece.
3. The batched round against the same four conversations run one at a time.
"""

from __future__ import annotations

import sys
import time

import dasllama as dl

SYSTEM = "You are a concise assistant. Answer in one short sentence."
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?", "What do bees make?"]


def requests(m: dl.Model, first_id: int, max_new: int) -> list[dl.PendingReq]:
    out = []
    for i, q in enumerate(QUESTIONS):
        chat = dl.create_chat_renderer(m, SYSTEM, max_new)
        dl.add_user(chat, q)
        out.append(
            dl.PendingReq(
                id=first_id + i,
                prompt=dl.render_turn(m, chat),
                close_toks=dl.render_close(m, chat),
                stop_ids=dl.turn_stop_ids(chat),
                nothink=dl.make_nothink_guard(chat),
                max_new=max_new,
            )
        )
    return out


def run(m: dl.Model, reqs: list[dl.PendingReq], streams: int, show: bool) -> tuple[float, dict[int, str]]:
    sch = dl.create_scheduler(m, max_streams=streams, max_queue=32, chunk_tokens=64)
    for r in reqs:
        dl.submit(m, sch, r)
    texts: dict[int, str] = {r.id: "" for r in reqs}
    events: list[dl.SchedEvent] = []
    t0 = time.perf_counter()
    while True:
        more = dl.scheduler_step(m, sch, events)
        for ev in events:
            if ev.kind == "piece":
                texts[ev.id] += ev.text
                if show:
                    print(ev.stream + 1, end="", flush=True)
            elif show:
                print(f"\n[stream {ev.stream + 1}] {ev.finish}: {ev.n_gen} tok, ttft {ev.ttft_us / 1000:.0f} ms", end="")
        events.clear()
        if not more:
            break
    if show:
        print()
    return time.perf_counter() - t0, texts


def main() -> None:
    m = dl.load_model(sys.argv[1] if len(sys.argv) > 1 else dl.DEFAULT_MODEL)

    print("1. the raw mechanism: one weight pass advances two sessions")
    s0, s1 = dl.create_session(m), dl.create_session(m)
    dl.eval(m, s0, dl.encode(m, "The sky is"))
    dl.eval(m, s1, dl.encode(m, "Grass is"))
    ws = dl.create_batch_workspace(m)
    toks = [dl.sample(s0), dl.sample(s1)]
    logits = dl.eval_batch(m, ws, [s0, s1], toks)
    print(f"   eval_batch -> logits {logits.shape}; next tokens {dl.decode(m, toks)!r}")

    print("\n2. the scheduler: four conversations, one digit per piece")
    batched, texts = run(m, requests(m, 1, 32), streams=4, show=True)
    for i, q in enumerate(QUESTIONS):
        print(f"   {q} -> {texts[1 + i].strip()!r}")

    print("\n3. the same four conversations one at a time")
    single, _ = run(m, requests(m, 11, 32), streams=1, show=False)
    print(f"   batched {batched:.2f}s, one at a time {single:.2f}s: {batched / single:.2f}x the wall clock")


if __name__ == "__main__":
    main()
