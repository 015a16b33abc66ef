"""Gemma 4's assistant drafter (``gemma4-assistant``): found beside its model as llama.cpp finds
it; refused, naming the key or tensor, where it was made for another target (architecture,
width, vocabulary, head sizes, the target's last layers) or its tensors disagree with its
metadata; its rows equal the float64 reference of llama.cpp's graph (whose target half equals
llama.cpp's); greedy and sampled output with it equal decoding without it at 1, 4 and 16 streams."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from gemma4_assistant import reference_step, target_reference, write_assistant, write_target
from gemma4_vocab import TEMPLATE_PATH, TOKENS, write_gemma4_vocab_model

import dasllama as dl
from dasllama.gguf_file import read_header
from dasllama.speculative import assistant_mismatch


def test_sidecar_names_as_llama_cpp_finds_them(tmp_path: Path) -> None:
    def touch(*names: str) -> None:
        for n in names:
            (tmp_path / n).write_bytes(b"GGUF")

    # Hugging Face's flat layout (ggml-org/gemma-4-31B-it-GGUF): the sidecar carries the model's
    # name without its quantization; the same quantization wins, else the closest in bits.
    touch("model-Q4_K_M.gguf", "mtp-model-BF16.gguf", "mtp-model-Q8_0.gguf", "mtp-other-Q4_K_M.gguf")
    assert Path(dl.mtp_drafter_sidecar(tmp_path / "model-Q4_K_M.gguf")).name == "mtp-model-Q8_0.gguf"
    touch("mtp-model-Q4_0.gguf")
    assert Path(dl.mtp_drafter_sidecar(tmp_path / "model-Q4_K_M.gguf")).name == "mtp-model-Q4_0.gguf"
    touch("mtp-model-Q4_K_M.gguf")
    assert Path(dl.mtp_drafter_sidecar(tmp_path / "model-Q4_K_M.gguf")).name == "mtp-model-Q4_K_M.gguf"
    # The names the converter writes beside any model come first.
    touch("gemma-4-E2B-it-Q8_0.gguf", "mtp-gemma-4-E2B-it-Q8_0.gguf", "mtp-gemma-4-E2B-it-Q8_0-Q8_0.gguf")
    assert Path(dl.mtp_drafter_sidecar(tmp_path / "gemma-4-E2B-it-Q8_0.gguf")).name == "mtp-gemma-4-E2B-it-Q8_0-Q8_0.gguf"
    # Another model's sidecar, or none: "".
    touch("solo-Q8_0.gguf", "plain.gguf", "mtp-modelx-Q8_0.gguf")
    assert dl.mtp_drafter_sidecar(tmp_path / "solo-Q8_0.gguf") == ""
    assert dl.mtp_drafter_sidecar(tmp_path / "plain.gguf") == ""


def test_an_assistant_for_another_architecture_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    target = tmp_path / "model-Q8_0.gguf"
    write_gemma4_vocab_model(target, TEMPLATE_PATH.read_text())
    write_assistant(tmp_path / "mtp-model-Q8_0.gguf", target_width=16, n_vocab=len(TOKENS))
    m = dl.load_model(target)
    side = dl.mtp_drafter_sidecar(m.path)
    assert Path(side).name == "mtp-model-Q8_0.gguf"
    with caplog.at_level(logging.WARNING, logger="dasllama"):
        assert not dl.attach_mtp_drafter(m, side)
    assert "gemma4-assistant drafter, which drafts for gemma4 models" in caplog.text and "is llama" in caplog.text
    assert not dl.mtp_capable(m) and dl.drafter_kind(m) is None
    # The server's --spec: auto falls back to prompt lookup, mtp says why it cannot.
    from dasllama.speculative import configure

    assert configure(m, "auto").startswith("n-gram")
    with pytest.raises(ValueError, match="cannot draft"):
        configure(m, "mtp")


@dataclass
class Target:
    """What the check reads of a gemma4 target: its architecture, metadata, file and vocabulary."""

    metadata: dict[str, Any] = field(default_factory=dict)
    arch: str = "gemma4"
    path: Path = Path("gemma-4-E2B-it-Q8_0.gguf")
    n_vocab: int = 640


GEMMA4 = {"gemma4.embedding_length": 32, "gemma4.attention.key_length": 16, "gemma4.attention.key_length_swa": 8}


@pytest.mark.parametrize(
    ("kw", "target", "message"),
    [
        ({}, {}, None),
        ({"target_width": 24}, {}, "gemma4-assistant.embedding_length_out is 24: it was made for a target of width 24, and gemma-4-E2B-it-Q8_0.gguf's gemma4.embedding_length is 32"),
        ({"meta": {"embedding_length_out": None}}, {}, "embedding_length_out is missing"),
        ({"target_width": 16, "width": 16}, {"gemma4.embedding_length": 16}, "equals its embedding_length"),
        ({"n_vocab": 600}, {}, "'token_embd.weight' has 600 rows: a vocabulary of 600"),
        ({"head_dim_swa": 4}, {}, "gemma4-assistant.attention.key_length_swa is 4, and gemma-4-E2B-it-Q8_0.gguf's gemma4.attention.key_length_swa is 8"),
        ({"head_dim": 32}, {}, "gemma4-assistant.attention.key_length is 32"),
    ],
)
def test_an_assistant_made_for_another_target_names_the_key(tmp_path: Path, kw: dict[str, Any], target: dict[str, Any], message: str | None) -> None:
    args: dict[str, Any] = {"target_width": 32, "n_vocab": 640, **kw}
    write_assistant(tmp_path / "a.gguf", **args)
    t = Target({**GEMMA4, **target})
    why = assistant_mismatch(cast(dl.Model, t), read_header(tmp_path / "a.gguf"))
    if message is None:
        assert why is None
    else:
        assert why is not None and message in why, why


def test_an_assistant_for_a_non_gemma4_target_is_refused_by_name(tmp_path: Path) -> None:
    write_assistant(tmp_path / "a.gguf", target_width=32, n_vocab=640)
    why = assistant_mismatch(cast(dl.Model, Target(GEMMA4, arch="qwen3")), read_header(tmp_path / "a.gguf"))
    assert why == "it is a gemma4-assistant drafter, which drafts for gemma4 models, and gemma-4-E2B-it-Q8_0.gguf is qwen3"


def test_reference_target_is_llama_cpps(tmp_path: Path) -> None:
    # The float64 Gemma 4 target whose K/V and hidden states the assistant's reference reads
    # equals llama.cpp's on the synthetic target (scripts/make_gemma4_target_golden.py); f16 K/V
    # in llama.cpp bounds the agreement.
    g = json.loads((Path(__file__).parent / "golden" / "gemma4-target.json").read_text())
    wt = write_target(tmp_path / "t.gguf", n_vocab=len(TOKENS))
    assert hashlib.sha256((tmp_path / "t.gguf").read_bytes()).hexdigest() == g["sha256"]
    for c in g["cases"]:
        logits, hidden, _ = target_reference(wt, c["ids"])
        assert np.abs(logits - np.array(c["logits"])).max() < 0.01
        assert np.abs(hidden - np.array(c["hidden"])).max() < 0.005


def test_reference_step_reads_the_window_and_the_whole_context(tmp_path: Path) -> None:
    # Sliding layers read the target's last `sliding_window` positions, global layers all of them:
    # K/V the sliding layers should not see change nothing there.
    wt = write_target(tmp_path / "t.gguf", n_vocab=len(TOKENS))
    wa = write_assistant(tmp_path / "a.gguf", target_width=32, n_vocab=len(TOKENS))
    meta = {"attention.head_count": 2, "rope.freq_base_swa": 10_000.0, "rope.freq_base": 1_000_000.0, "attention.sliding_window": 4}
    ids = [2, 300, 301, 302, 303, 304, 305]
    _, hidden, kvs = target_reference(wt, ids)
    n = len(ids)

    def step(kv: dict[bool, tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        return reference_step(wa, meta, (True, False), wt["token_embd.weight"][5], hidden[-1], n, kv)[0]

    base = step({True: kvs[0], False: kvs[1]})
    assert np.isfinite(base).all()
    k, v = (a.copy() for a in kvs[0])
    k[: n - 3], v[: n - 3] = 7.0, -7.0  # older than the window
    assert np.array_equal(step({True: (k, v), False: kvs[1]}), base)
    k, v = (a.copy() for a in kvs[1])
    k[0] = -k[0]  # the global layer sees position 0
    assert not np.allclose(step({True: kvs[0], False: (k, v)}), base)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"meta": {"attention.head_count": 4}}, "its tensor 'blk.0.attn_q.weight' is 16x16; its metadata implies 16x32"),
        ({"meta": {"feed_forward_length": 24}}, "its tensor 'blk.0.ffn_gate.weight' is 16x32; its metadata implies 16x24"),
        ({"meta": {"nextn_predict_layers": None, "block_count": None}}, "gemma4-assistant.nextn_predict_layers (or block_count) is missing or 0"),
        ({"meta": {"nextn_predict_layers": 3, "block_count": 3}}, "sliding_window_pattern is missing or shorter than its 3 layers"),
    ],
)
def test_an_assistant_whose_tensors_disagree_with_its_metadata_names_the_tensor(tmp_path: Path, kw: dict[str, Any], message: str) -> None:
    write_assistant(tmp_path / "a.gguf", target_width=32, n_vocab=640, **kw)
    why = assistant_mismatch(cast(dl.Model, Target(GEMMA4)), read_header(tmp_path / "a.gguf"))
    assert why is not None and message in why, why


def test_an_assistant_missing_a_tensor_names_it(tmp_path: Path) -> None:
    from gguf import GGUFReader, GGUFWriter

    write_assistant(tmp_path / "a.gguf", target_width=32, n_vocab=640)
    # Rewrite the file without its post-projection.
    r = GGUFReader(tmp_path / "a.gguf")
    w = GGUFWriter(str(tmp_path / "b.gguf"), "gemma4-assistant")
    for f in r.fields.values():
        if f.name.startswith("gemma4-assistant."):
            v = f.contents()
            if isinstance(v, list):
                w.add_array(f.name, v)
            elif isinstance(v, float):
                w.add_float32(f.name, v)
            else:
                w.add_uint32(f.name, int(v))
    for t in r.tensors:
        if t.name != "nextn.post_projection.weight":
            w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    why = assistant_mismatch(cast(dl.Model, Target(GEMMA4)), read_header(tmp_path / "b.gguf"))
    assert why == "its tensor 'nextn.post_projection.weight' is missing", why


def test_checked_against_a_loaded_gemma4_target(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from synthetic import DIM, VOCAB, write_family

    # tests/synthetic.py's gemma4 ends with a full layer then a sliding one (pattern
    # [sliding, sliding, full, sliding]); llama.cpp would pair the assistant's layers with the
    # wrong kinds of the target's.
    write_family(tmp_path / "model-Q8_0.gguf", "gemma4")
    m = dl.load_model(tmp_path / "model-Q8_0.gguf")
    side = tmp_path / "mtp-model-Q8_0.gguf"
    write_assistant(side, target_width=DIM, n_vocab=len(VOCAB), head_dim=128, head_dim_swa=64)
    assert dl.mtp_drafter_sidecar(m.path) == str(side)
    with caplog.at_level(logging.WARNING, logger="dasllama"):
        assert not dl.attach_mtp_drafter(m, side)
    assert "last two layers are full, sliding (gemma4.attention.sliding_window_pattern)" in caplog.text
    # Another width: named by its key before anything else.
    write_assistant(side, target_width=DIM // 2, n_vocab=len(VOCAB), head_dim=128, head_dim_swa=64)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dasllama"):
        assert not dl.attach_mtp_drafter(m, side)
    assert f"embedding_length_out is {DIM // 2}" in caplog.text and not dl.mtp_capable(m)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[dl.Model, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A dense Gemma 4 target ending sliding, full (llama.cpp's layout) with its assistant beside
    it, attached; and both's weights."""
    d = tmp_path_factory.mktemp("gemma4-pair")
    wt = write_target(d / "model-Q8_0.gguf", n_vocab=len(TOKENS))
    wa = write_assistant(d / "mtp-model-Q8_0.gguf", target_width=32, n_vocab=len(TOKENS), vocab=True)
    m = dl.load_model(d / "model-Q8_0.gguf")
    assert dl.attach_mtp_drafter(m, dl.mtp_drafter_sidecar(m.path), max_draft=6)
    return m, wt, wa


META = {"attention.head_count": 2, "rope.freq_base_swa": 10_000.0, "rope.freq_base": 1_000_000.0, "attention.sliding_window": 4}


def test_the_assistant_attaches_and_drafts_as_the_reference(pair: tuple[dl.Model, dict[str, np.ndarray], dict[str, np.ndarray]]) -> None:
    m, wt, wa = pair
    assert dl.drafter_kind(m) == "mtp" and dl.mtp_capable(m)
    from dasllama import _native
    from dasllama.speculative import configure

    v, d = len(TOKENS), 32
    for ids in ([2, 300, 301, 302, 303, 304, 305], [2, 420, 421, 422, 10, 500, 501, 502, 503]):
        _, hidden, kvs = target_reference(wt, ids)
        got = _native.assistant_rows(m._native, m._drafter, ids, 5, 3)
        tok, state = 5, hidden[-1]
        for row in got:
            logits, h_next = reference_step(wa, META, (True, False), wt["token_embd.weight"][tok], state, len(ids), {True: kvs[0], False: kvs[1]})
            # f16 K/V and f32 arithmetic against float64.
            assert np.abs(row[:v] - logits).max() < 0.01, np.abs(row[:v] - logits).max()
            assert np.abs(row[v:] - h_next).max() < 0.01
            assert int(np.argmax(row[:v])) == int(np.argmax(logits))
            tok, state = int(np.argmax(row[:v])), row[v:].astype(np.float64)
        assert got.shape == (3, v + d)
    dl.detach_drafter(m)
    assert configure(m, "auto").startswith("MTP head mtp-model-Q8_0.gguf")
    assert dl.drafter_kind(m) == "mtp"


def run(m: dl.Model, prompts: list[list[int]], streams: int, mtp: bool, fixed: int | None = None, page_rows: int = 0, params: dl.SamplingParams | None = None) -> tuple[dict[int, list[int]], dict[str, Any]]:
    sch = dl.create_scheduler(m, max_streams=streams, max_queue=len(prompts), page_rows=page_rows, mtp=mtp)
    if fixed is not None:
        dl.fix_draft_len(sch, fixed)
    for i, p in enumerate(prompts):
        assert dl.submit(m, sch, dl.PendingReq(id=i, prompt=p, max_new=20, params=params or dl.SamplingParams(), seed=11 + i, ignore_eos=True))
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    events: list[dl.SchedEvent] = []
    more = True
    while more:
        more = dl.scheduler_step(m, sch, events)
    for e in events:
        if e.kind == "piece":
            out[e.id].append(e.token)
        elif e.finish not in ("length", "stop"):
            raise AssertionError(f"request {e.id} ended with {e.finish}: {e.error}")
    return out, dl.scheduler_stats(sch)


@pytest.mark.parametrize("streams", [1, 4, 16])
def test_greedy_output_with_the_assistant_is_unchanged(pair: tuple[dl.Model, dict[str, np.ndarray], dict[str, np.ndarray]], streams: int) -> None:
    m, _, _ = pair
    rng = np.random.default_rng(streams)
    prompts = [[2] + [int(t) for t in rng.integers(290, 640, size=int(rng.integers(3, 14)))] for _ in range(16 if streams == 16 else 6)]
    assert dl.attach_mtp_drafter(m, dl.mtp_drafter_sidecar(m.path), max_draft=6)
    want, _ = run(m, prompts, streams, mtp=False)
    for fixed, page_rows in ((None, 0), (3, 16)):
        got, stats = run(m, prompts, streams, mtp=True, fixed=fixed, page_rows=page_rows)
        assert got == want, (fixed, page_rows)
    assert stats["spec_drafted"] > 20, stats


def test_sampled_output_with_the_assistant_is_unchanged(pair: tuple[dl.Model, dict[str, np.ndarray], dict[str, np.ndarray]]) -> None:
    m, _, _ = pair
    assert dl.attach_mtp_drafter(m, dl.mtp_drafter_sidecar(m.path), max_draft=6)
    rng = np.random.default_rng(7)
    prompts = [[2] + [int(t) for t in rng.integers(290, 640, size=int(rng.integers(3, 14)))] for _ in range(4)]
    params = dl.SamplingParams(temp=0.9, top_p=0.95)
    want, _ = run(m, prompts, 4, mtp=False, params=params)
    got, stats = run(m, prompts, 4, mtp=True, fixed=4, params=params)
    assert got == want and stats["spec_drafted"] > 0
