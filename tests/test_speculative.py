"""Speculative decoding: every drafter leaves a stream's output exactly as without it (greedy and
seeded sampling, any batch, cold and with prefix-cache hits), sampled tokens follow the target's
distribution, rejected rows give their KV pages back, and bad drafters are refused whole."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import drain

import dasllama as dl
from synthetic import write_model

# Input-grounded requests (drafts from the prompt are often right) and open-ended ones.
GROUNDED = [
    "Repeat this list exactly: apples, pears, plums, cherries, grapes, lemons, limes, figs, dates.",
    "Copy this sentence word for word: The quick brown fox jumps over the lazy dog near the river bank.",
    "Rewrite in capital letters: the meeting is on monday at noon in room four.",
    "Fix the typo and print the code again:\ndef add(a, b):\n    retrun a + b\n",
]
OPEN = ["Write a short poem about the sea.", "Tell me a fact about owls."]


def chat_prompt(m: dl.Model, text: str) -> list[int]:
    chat = dl.create_chat_renderer(m, "You are a helpful assistant.", 64)
    dl.add_user(chat, text)
    return dl.render_turn(m, chat)


def run(
    m: dl.Model,
    prompts: list[list[int]],
    streams: int,
    mtp: bool,
    max_new: int = 40,
    params: dl.SamplingParams | None = None,
    page_rows: int = 16,
    rounds: int = 1,
    fixed: int | None = None,
) -> tuple[list[dict[int, list[int]]], dict[str, float]]:
    """Outputs per round and the stats. `fixed` pins the draft length (so that speculation
    surely runs, whatever this machine's timings make the adaptive policy choose)."""
    sch = dl.create_scheduler(m, max_streams=streams, max_queue=len(prompts), page_rows=page_rows, mtp=mtp)
    if fixed is not None:
        dl.fix_draft_len(sch, fixed)
    outs = []
    for r in range(rounds):
        for i, p in enumerate(prompts):
            assert dl.submit(m, sch, dl.PendingReq(id=r * 1000 + i, prompt=p, max_new=max_new, params=params or dl.SamplingParams(), seed=11 + i))
        out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        for e in drain(m, sch):
            if e.kind == "piece" or e.finish == "stop":
                out[e.id - r * 1000].append(e.token)
            elif e.finish not in ("length", "stop"):
                raise AssertionError(f"request {e.id} ended with {e.finish}: {e.error}")
        outs.append(out)
    stats = dl.scheduler_stats(sch)
    if page_rows:
        # Every stream is done: no page is held but the prefix cache's.
        assert stats["kv_pages_used"] == stats["kv_pages_cached"], stats
    return outs, stats


@pytest.fixture
def ngram(smollm: dl.Model):
    assert dl.attach_ngram_drafter(smollm, max_draft=8)
    yield smollm
    dl.detach_drafter(smollm)


@pytest.mark.parametrize("streams", [1, 4, 16])
def test_ngram_greedy_output_is_unchanged(ngram: dl.Model, streams: int) -> None:
    prompts = [chat_prompt(ngram, t) for t in GROUNDED + OPEN]
    # Two rounds of the same prompts: the second attaches the first's pages from the prefix cache.
    (want,) = run(ngram, prompts, streams, mtp=False)[0][:1]
    for fixed in (None, 4):
        got, stats = run(ngram, prompts, streams, mtp=True, rounds=2, fixed=fixed)
        assert got[0] == want and got[1] == want, fixed
        assert stats["cached_tokens"] > 0
        assert stats["spec_accepted"] <= stats["spec_drafted"]
    assert stats["spec_accepted"] > 0, stats


def test_sampled_output_is_unchanged(ngram: dl.Model) -> None:
    prompts = [chat_prompt(ngram, t) for t in GROUNDED]
    params = dl.SamplingParams(temp=0.7, top_p=0.9, penalty=1.05)
    want = run(ngram, prompts, 4, mtp=False, params=params)[0]
    got, stats = run(ngram, prompts, 4, mtp=True, params=params, fixed=4)
    assert got == want
    assert stats["spec_drafted"] > 0, stats


def test_draft_model_greedy_output_is_unchanged(smollm: dl.Model) -> None:
    # The target: the same file with every matrix in Q8_0, drafted for by the Q4_1 original.
    target = dl.load_model(smollm.path, quant="q8")
    assert dl.attach_draft_model(target, smollm, max_draft=4)
    assert dl.drafter_kind(target) == "draft" and dl.mtp_capable(target)
    prompts = [chat_prompt(target, t) for t in GROUNDED[:2] + OPEN]
    for streams in (1, 4):
        want = run(target, prompts, streams, mtp=False, max_new=24)[0]
        got, stats = run(target, prompts, streams, mtp=True, max_new=24, fixed=3)
        assert got == want, streams
        assert 0 < stats["spec_accepted"] <= stats["spec_drafted"], stats


def test_gemma_ngram_output_is_unchanged(gemma: dl.Model) -> None:
    text = "one two three four five six seven eight nine ten. one two three four five six seven eight nine ten. one two"
    prompts = [dl.encode(gemma, text), dl.encode(gemma, "The list of colors: red, green, blue, red, green, blue, red,")]
    dl.attach_ngram_drafter(gemma)
    try:
        want = run(gemma, prompts, 2, mtp=False, max_new=24)[0]
        got, stats = run(gemma, prompts, 2, mtp=True, max_new=24, fixed=4)
    finally:
        dl.detach_drafter(gemma)
    assert got == want
    assert stats["spec_accepted"] > 0, stats


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dl.Model:
    p = tmp_path_factory.mktemp("spec") / "tiny.gguf"
    write_model(p, ctx=256)
    return dl.load_model(p)


# Critical chi-square values at p = 0.001 by degrees of freedom: a correct sampler fails one run
# in a thousand.
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def target_probs(logits: np.ndarray, temp: float, top_k: int, top_p: float) -> np.ndarray:
    """The final sampling distribution in llama.cpp's order: top-k, top-p on the softmax before
    temperature, then the survivors' softmax at `temp`."""
    order = np.argsort(-logits, kind="stable")[:top_k]
    w = np.exp(logits[order] - logits[order[0]])
    keep = int(np.searchsorted(np.cumsum(w / w.sum()), top_p) + 1)
    w = np.exp((logits[order[:keep]] - logits[order[0]]) / temp)
    p = np.zeros_like(logits, dtype=np.float64)
    p[order[:keep]] = w / w.sum()
    return p


def test_accepted_tokens_follow_the_target_distribution(tiny: dl.Model, tmp_path: Path) -> None:
    # The draft is the target itself decoding greedily: its drafts are accepted exactly when the
    # target's sampler draws its argmax, so both verdicts happen often.
    dl.attach_draft_model(tiny, dl.load_model(tiny.path), max_draft=3)
    # The tiny model's logits are steep: a high temperature makes its top tokens compete, and top-p
    # (which judges the logits before temperature) only cuts the far tail.
    temp, top_k, top_p = 6.0, 4, 0.99999
    params = dl.SamplingParams(temp=temp, top_k=top_k, top_p=top_p)
    prompt = [5, 80, 81, 82, 83]
    n = 1500
    sch = dl.create_scheduler(tiny, max_streams=16, max_queue=n, mtp=True)
    dl.fix_draft_len(sch, 3)
    for i in range(n):
        assert dl.submit(tiny, sch, dl.PendingReq(id=i, prompt=prompt, max_new=3, params=params, seed=i))
    seqs: dict[int, list[int]] = {i: [] for i in range(n)}
    for e in drain(tiny, sch):
        if e.kind == "piece":
            seqs[e.id].append(e.token)
    stats = dl.scheduler_stats(sch)
    dl.detach_drafter(tiny)
    assert 0 < stats["spec_accepted"] < stats["spec_drafted"], stats
    # The third token given the commonest first two: under speculation it was drawn from verify
    # rows past the first whenever the second was the draft.
    pair, _ = Counter(tuple(s[:2]) for s in seqs.values() if len(s) == 3).most_common(1)[0]
    third = Counter(s[2] for s in seqs.values() if len(s) == 3 and tuple(s[:2]) == pair)
    total = sum(third.values())
    assert total >= 100, total
    s = dl.create_session(tiny)
    p = target_probs(dl.eval(tiny, s, prompt + list(pair)).astype(np.float64), temp, top_k, top_p)
    support = np.flatnonzero(p)
    assert set(third) <= set(support.tolist()), "a token outside the sampler's support was emitted"
    exp = p[support] * total
    obs = np.array([third.get(int(t), 0) for t in support])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 < CHI2_CRIT[len(support) - 1], (chi2, obs, exp)


def test_rejections_and_disconnects_return_pages(smollm: dl.Model) -> None:
    target = dl.load_model(smollm.path, quant="q8")
    dl.attach_draft_model(target, smollm, max_draft=8)
    sch = dl.create_scheduler(target, max_streams=4, page_rows=4, mtp=True)
    dl.fix_draft_len(sch, 8)
    prompts = [chat_prompt(target, t) for t in GROUNDED]
    params = dl.SamplingParams(temp=1.2, seed=None)
    for i, p in enumerate(prompts):
        dl.submit(target, sch, dl.PendingReq(id=i, prompt=p, max_new=200, params=params, seed=i))
    evs: list[dl.SchedEvent] = []
    for _ in range(12):
        dl.scheduler_step(target, sch, evs)
    assert dl.scheduler_stats(sch)["spec_drafted"] > 0
    for i in range(len(prompts)):  # clients gone mid-verify
        dl.evict(target, sch, i, evs)
    st = dl.scheduler_stats(sch)
    assert dl.n_active(sch) == 0 and st["kv_pages_used"] == st["kv_pages_cached"], st


def test_bad_drafters_are_refused_whole(smollm: dl.Model, tiny: dl.Model, tmp_path: Path) -> None:
    for bad in (0, -1, 33, 10**9, True, 2.5):
        with pytest.raises(ValueError, match="max_draft"):
            dl.attach_ngram_drafter(smollm, max_draft=bad)  # type: ignore[arg-type]
        assert not dl.mtp_capable(smollm)
    # Another vocabulary: False, nothing attached.
    assert not dl.attach_draft_model(smollm, tiny)
    assert not dl.mtp_capable(smollm) and dl.drafter_kind(smollm) is None
    with pytest.raises(ValueError, match="needs a drafter"):
        dl.create_scheduler(smollm, mtp=True)
    # MTP sidecars: found beside the model by name, refused when made for another model.
    model = tmp_path / "m.gguf"
    write_model(model)
    assert dl.mtp_drafter_sidecar(model) == ""
    side = tmp_path / "mtp-m-Q8_0.gguf"
    write_model(side, meta={"nextn_predict_layers": 1}, extra={"blk.2.nextn.eh_proj.weight": np.zeros((8, 8), np.float32)})
    assert dl.mtp_drafter_sidecar(model) == str(side)
    assert not dl.attach_mtp_drafter(smollm, side)
    assert not dl.attach_mtp_drafter(smollm, model)
    assert not dl.mtp_capable(smollm)
    # Speculation needs the fast numerics, where a chunk's rows equal single rows bit for bit.
    exact = dl.load_model(tiny.path, numerics="ggml")
    dl.attach_ngram_drafter(exact)
    with pytest.raises(ValueError, match="numerics"):
        dl.create_scheduler(exact, mtp=True)


def test_adaptive_policy_drafts_at_one_stream(ngram: dl.Model) -> None:
    # One stream quoting its prompt: extra rows ride on a pass bound by reading the weights, so
    # the policy drafts (and its measured pass cost is reported).
    prompts = [chat_prompt(ngram, GROUNDED[1])]
    _, stats = run(ngram, prompts, 1, mtp=True, max_new=48)
    assert stats["spec_drafted"] > 0 and stats["spec_row_us"] > 0 and stats["spec_pass_us"] > 0, stats
