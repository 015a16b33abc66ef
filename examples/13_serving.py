"""Tutorial 13, "Serving Many Conversations", on the default model.

    python examples/13_serving.py [MODEL]

1. The raw mechanism: two sessions advanced by ONE weight pass with eval_batch.
2. The scheduler: four conversations, one digit (the stream) printed per generated piece.
3. The batched round against the same four conversations run one at a time.
4. A warm round: new questions under the same system turn attach its pages from the prefix cache.
   (In the cold round the streams after the first already attach the system turn the first one
   prefilled: requests running together share a prompt prefix.)
5. Speculative where the model can: the tutorial's MTP sidecar if one sits beside the model, else
   n-gram prompt lookup; the same replies, with the drafts the model accepted counted.
6. Multi-model GPU serving, the slot dance: want, arm, load, capture; then a switch in the
   contract's order (hydrate, drop, save; restore, re-arm). "cpu" and the reason on a box without
   a usable Vulkan device (lavapipe counts only with DASLLAMA_VK_ALLOW_CPU=1).
7. Streams served from the device: regions, a device-home session parked and adopted so turn two
   prefills only its new tokens, the scheduler with device K/V, and the honesty counter.
"""

from __future__ import annotations

import sys
import time

import dasllama as dl
from dasllama import gpu

SYSTEM = (
    "You are a concise assistant. Answer every question in one short, accurate sentence. "
    "Do not add greetings, lists or explanations unless the user asks for them, and say so when you do not know."
)
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?", "What do bees make?"]
WARM_QUESTIONS = ["What is the capital of Italy?", "Name a fruit.", "What is 3 + 3?", "What do cows give?"]


def requests(m: dl.Model, first_id: int, max_new: int, questions: list[str] = QUESTIONS) -> list[dl.PendingReq]:
    out = []
    for i, q in enumerate(questions):
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


def run(
    m: dl.Model, reqs: list[dl.PendingReq], streams: int, show: bool, sch: dl.Scheduler | None = None, label: str = "stream"
) -> tuple[float, dict[int, str], list[float]]:
    sch = sch or dl.create_scheduler(m, max_streams=streams, max_queue=32, chunk_tokens=64)
    ttfts: list[float] = []
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
                    print(ev.slot + 1, end="", flush=True)
            else:
                ttfts.append(ev.ttft_us / 1000)
                if show:
                    print(
                        f"\n[{label} {ev.slot + 1}] {ev.finish}: {ev.n_gen} tok, ttft {ev.ttft_us / 1000:.0f} ms, "
                        f"cached {ev.n_cached} of {ev.n_prompt} prompt tokens",
                        end="",
                    )
        events.clear()
        if not more:
            break
    if show:
        print()
    return time.perf_counter() - t0, texts, ttfts


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
    batched, texts, _ = run(m, requests(m, 1, 32), streams=4, show=True)
    for i, q in enumerate(QUESTIONS):
        print(f"   {q} -> {texts[1 + i].strip()!r}")

    print("\n3. the same four conversations one at a time")
    single, _, _ = run(m, requests(m, 11, 32), streams=1, show=False)
    print(f"   batched {batched:.2f}s, one at a time {single:.2f}s: {batched / single:.2f}x the wall clock")

    print("\n4. the prefix cache: 16-row pages; a cold round, then new questions under the same system turn")
    sch = dl.create_scheduler(m, max_streams=4, max_queue=32, chunk_tokens=64, page_rows=16)
    _, _, cold = run(m, requests(m, 21, 32), 4, show=True, sch=sch, label="cold stream")
    _, _, warm = run(m, requests(m, 31, 32, WARM_QUESTIONS), 4, show=True, sch=sch, label="warm stream")
    print(f"   mean ttft: cold {sum(cold) / len(cold):.0f} ms, warm {sum(warm) / len(warm):.0f} ms")

    print("\n5. speculative where the model can")
    drafter = dl.mtp_drafter_sidecar(m.path)  # "" where no sidecar sits beside the model
    if not drafter or not dl.attach_mtp_drafter(m, drafter):
        dl.attach_ngram_drafter(m)
    sch = dl.create_scheduler(m, max_streams=4, max_queue=32, chunk_tokens=64, page_rows=16, mtp=dl.mtp_capable(m))
    _, spec_texts, _ = run(m, requests(m, 1, 32), 4, show=False, sch=sch)
    st = dl.scheduler_stats(sch)
    same = all(spec_texts[i] == texts[i] for i in texts)
    print(f"   drafter {dl.drafter_kind(m)}: {int(st['spec_accepted'])} of {int(st['spec_drafted'])} drafts accepted; replies as in round 2: {same}")

    m = gpu_sections(m)


def gpu_sections(m: dl.Model) -> dl.Model:
    print("\n6. multi-model GPU serving: the slot dance")
    print(f"   vulkan available: {gpu.kernel_backend_available('vulkan')}")
    gpu.set_gpu_resident_regions(4)
    pins = gpu.gpu_ctx_pins()
    gpu.set_gpu_ctx_max(2048)
    gpu.set_gpu_tier_want(gpu.GpuTierWant(auto_tier=True))
    armed = gpu.moe_gpu_tier_arm()
    print(f"   armed {armed}: budget {gpu.moe_gpu_weight_budget() >> 20} MiB on '{gpu.gpu_tier_status().device}'")
    m = dl.load_model(m.path)  # an armed load goes to the device if it fits
    slot = gpu.gpu_model_marks_init()
    outcome = gpu.gpu_slot_capture(slot)
    print(f"   {outcome}" + (f" ({slot.reason})" if slot.reason else ""))
    s = dl.create_session(m)
    dl.eval(m, s, dl.encode(m, "A live conversation"))
    gpu.moe_gpu_hydrate_session(m, s)  # per live session
    gpu.moe_gpu_drop_model()
    gpu.moe_gpu_model_marks_save(slot)  # A is out
    gpu.moe_gpu_model_marks_restore(slot)  # B (here: A again) is in...
    print(f"   re-armed: {gpu.gpu_slot_rearm(gpu.GpuTierWant(auto_tier=True), m)}")
    gpu.set_gpu_ctx_max(pins.ctx_max)

    print("\n7. streams served from the device")
    regions = gpu.gpu_device_sessions()
    if regions == 0:
        print(f"   no device-home sessions here: {gpu.gpu_resident_decline()}")
    else:
        print(f"   {regions} streams, {gpu.gpu_device_session_ctx()} positions each, K/V in {gpu.gpu_device_session_dtype().value}")
        turn1 = dl.encode(m, "The capital of France is")
        first = gpu.create_device_session(m, gpu.gpu_device_session_dtype())
        dl.eval(m, first, turn1)
        held = first.n_past
        claim = gpu.gpu_device_kv_park(first)  # before every device-home delete
        del first
        second = gpu.create_device_session(m, gpu.gpu_device_session_dtype())
        if gpu.gpu_device_prefill_continues(m) and gpu.gpu_device_kv_adopt(second, claim, held):
            rest = dl.encode(m, " Paris, and", add_bos=False)
            dl.eval(m, second, rest)  # turn one's rows are already there
            print(f"   turn two adopted {held} rows and prefilled {len(rest)} new tokens")
        gpu.gpu_device_kv_park(second)
        del second
        sch = dl.create_scheduler(m, max_streams=min(4, regions), max_queue=32)
        gpu.set_device_kv(sch, True)
        _, texts, _ = run(m, requests(m, 41, 16), min(4, regions), show=False, sch=sch)
        print(f"   the scheduler from device memory: {texts[41].strip()!r}")
    for p in gpu.gpu_cpu_passes():
        print(f"   {p.count} calls ran on the CPU: {p.words}")
    return m


if __name__ == "__main__":
    main()
