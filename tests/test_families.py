"""Every model family on tiny synthetic files (tests/synthetic.py: FAMILIES), against llama.cpp's
teacher-forced top-5 log-probabilities on the very same files (tests/golden/families/, written by
scripts/make_family_goldens.py): `fast` numerics within 0.15 nats on every step, `ggml` numerics
to 1e-4; against our own float64 reading of each family; each family's batched and
chunked runs against its single-stream ones; and each family's own piece (bias, soft-cap, window,
RoPE factors) taken out, to show the goldens see it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

import dasllama as dl
from synthetic import FAMILIES, IQ4, VOCAB, family_cases, family_reference_logits, write_family

GOLDEN = Path(__file__).parent / "golden" / "families"
NAMES = sorted(FAMILIES)
DENSE = [n for n in NAMES if "moe" not in FAMILIES[n] and "hybrid" not in FAMILIES[n]]
HYBRIDS = [n for n in NAMES if "hybrid" in FAMILIES[n]]
# numerics='ggml' covers the block formats whose ggml order we reproduce: not the IQ4 files, and
# not gemma4 (refused at load: test_ggml_numerics_refuse_gemma4).
GGML_ORDER = [n for n in DENSE if not set(FAMILIES[n].get("formats", [])) & IQ4 and "gemma4" not in FAMILIES[n]]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("families")
    out = {}
    for name in NAMES:
        out[name] = d / f"{name}.gguf"
        write_family(out[name], name)
    return out


def golden(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.json").read_text())


def log_probs(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (np.log(np.exp(x - m).sum(axis=-1, keepdims=True)) + m)


def one_at_a_time(m: dl.Model, ids: list[int]) -> np.ndarray:
    s = dl.create_session(m)
    return np.stack([dl.eval(m, s, [t]) for t in ids])


def one_batch(m: dl.Model, ids: list[int]) -> np.ndarray:
    return dl.eval_all(m, dl.create_session(m), ids)


# Steps on a knife edge, (case, step), and so the steps after it in that case (they attend its
# K/V): qwen35moe's seed-1 file has rows where an activation sits a few ulps from a q8 rounding
# step or a router choice is that close, so the CPU's summation order decides which side our fast
# kernels land on. With the AVX-512 kernels every step is within 0.116 of llama.cpp; with the AVX2
# ones and the scalar twins (an AMD EPYC without AVX-512) case 0 step 19 is 0.79 off (the exact
# weights' fp32 pass, tied to float64 by test_against_numpy, 0.81: llama.cpp's rounding is what
# parts there), case 1 step 17 0.151 from llama.cpp's prefill order, and the MTP head (test_mtp.py)
# 1.5 and 1.2 off at those rows; every step before them is within 0.13. Such steps still count
# for argmax flips here, but not for the 0.15 bound. A new seed with goldens made again
# (scripts/make_family_goldens.py) would take the family off these edges.
KNIFE_EDGES: dict[str, frozenset[tuple[int, int]]] = {"qwen35moe": frozenset({(0, 19), (1, 17)})}


def past_edge(edges: frozenset[tuple[int, int]], case: int, step: int) -> bool:
    """Whether step `step` of case `case` is a knife edge of `edges` or after one in its case."""
    return any(case == ec and step >= es for ec, es in edges)


def compare(m: dl.Model, g: dict, run=one_batch, key: str = "steps", edges: frozenset = frozenset()) -> tuple[float, int, int, int]:
    """(max |Δ log p| over llama.cpp's top-5 at every step, argmax flips where llama.cpp leads by
    >= 0.15, such decisive steps, steps)."""
    worst, flips, decisive, steps = 0.0, 0, 0, 0
    for ci, c in enumerate(g["cases"]):
        lp = log_probs(run(m, c["ids"]))
        for j, (row, st) in enumerate(zip(lp, c[key], strict=True)):
            top = st["top"]
            if not past_edge(edges, ci, j):
                worst = max(worst, *(abs(float(row[t]) - ref) for t, ref in top))
            if top[0][1] - top[1][1] >= 0.15:
                decisive += 1
                flips += int(np.argmax(row)) != top[0][0]
            steps += 1
    return worst, flips, decisive, steps


@pytest.mark.parametrize("name", NAMES)
def test_against_numpy(name: str, tmp_path: Path) -> None:
    # Our own float64 reading of each family (tests/synthetic.py), independent of llama.cpp: the
    # fp32 mode (exact weights, f32 activations) lands on it up to the f16 K/V and query rounding.
    path = tmp_path / f"{name}.gguf"
    weights = write_family(path, name)
    ids = family_cases(name)[0]
    ref = family_reference_logits(weights, name, ids)
    m = dl.load_model(path, dl.QuantMode.fp32)
    got = dl.eval_all(m, dl.create_session(m), ids)
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() <= 0.005 * scale, (np.abs(got - ref).max(), scale)


@pytest.mark.parametrize("name", ["gemma4-moe", "qwen35moe", "qwen3next"])
def test_fused_expert_gate_and_up(tmp_path: Path, name: str) -> None:
    # Newer converters write each layer's expert gates and ups as one `ffn_gate_up_exps` (gates
    # first), which llama.cpp takes for these families: read as two, the fused file lands on the
    # float64 reference, and (its F32 values the split file's, dequantized) on the split file's
    # fp32 logits bit for bit.
    fused, split = tmp_path / "fused.gguf", tmp_path / "split.gguf"
    weights = write_family(fused, name, fuse_gate_up=True)
    write_family(split, name)
    ids = family_cases(name)[0]
    ref = family_reference_logits(weights, name, ids)
    got = dl.eval_all(m := dl.load_model(fused, dl.QuantMode.fp32), dl.create_session(m), ids)
    assert np.abs(got - ref).max() <= 0.005 * np.abs(ref).max()
    want = dl.eval_all(m := dl.load_model(split, dl.QuantMode.fp32), dl.create_session(m), ids)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("name", NAMES)
def test_synthetic_file_is_the_one_llamacpp_ran(name: str, files: dict[str, Path]) -> None:
    # The goldens hold for these exact bytes; a different gguf or numpy that wrote other bytes
    # needs the goldens made again (scripts/make_family_goldens.py), not a looser test.
    digest = hashlib.sha256(files[name].read_bytes()).hexdigest()
    assert digest == golden(name)["sha256"], f"{name}: the synthetic file differs from the one the goldens were made from; rerun scripts/make_family_goldens.py"


@pytest.mark.parametrize("name", NAMES)
def test_every_step_within_015_of_llamacpp(name: str, files: dict[str, Path]) -> None:
    # `fast` numerics (the default) against llama.cpp teacher-forced both ways: one token per
    # decode call, and the whole case as one prompt batch (where ggml adds some products up in
    # another order). Our kernels give every row the same arithmetic whatever the batch, so one
    # run serves both (test_batched_and_chunked_equal_single_stream).
    g = golden(name)
    m = dl.load_model(files[name])
    assert m.arch == FAMILIES[name]["arch"]
    assert [c["ids"] for c in g["cases"]] == family_cases(name)
    edges = KNIFE_EDGES.get(name, frozenset())
    for key in ("steps", "prefill_steps"):
        worst, flips, decisive, steps = compare(m, g, one_batch, key, edges)
        assert steps == sum(len(c["ids"]) for c in g["cases"])
        assert worst <= 0.15 and flips == 0, (key, worst, flips, decisive)
        # The goldens are decisive enough to mean something: most steps have a clear leader.
        assert decisive >= steps * 2 // 3, (decisive, steps)


def test_ggml_numerics_refuse_routed_experts(files: dict[str, Path]) -> None:
    with pytest.raises(dl.UnsupportedModelError, match="numerics='ggml' does not reproduce ggml's order for routed experts; load with numerics='fast'"):
        dl.load_model(files["qwen3moe"], numerics=dl.Numerics.ggml)


def test_ggml_numerics_refuse_deltanet(files: dict[str, Path]) -> None:
    with pytest.raises(dl.UnsupportedModelError, match="numerics='ggml' does not reproduce ggml's order for DeltaNet layers; load with numerics='fast'"):
        dl.load_model(files["qwen35"], numerics=dl.Numerics.ggml)


@pytest.mark.parametrize("name", ["gemma4", "gemma4-e"])
def test_ggml_numerics_refuse_gemma4(name: str, files: dict[str, Path]) -> None:
    # Measured against the goldens, ggml numerics land 0.036 nats from llama.cpp's decode steps and
    # 7e-4 from its prefill on the dense file (not its order to 1e-4, as for the other families):
    # refused rather than claimed.
    with pytest.raises(dl.UnsupportedModelError, match="numerics='ggml' does not reproduce ggml's order for gemma4's layers"):
        dl.load_model(files[name], numerics=dl.Numerics.ggml)


def test_ggml_numerics_refuse_iq4(files: dict[str, Path]) -> None:
    with pytest.raises(dl.UnsupportedModelError, match=r"is IQ4_(NL|XS), for which numerics='ggml' does not reproduce ggml's order.*load with numerics='fast'"):
        dl.load_model(files["qwen3-iq4"], numerics=dl.Numerics.ggml)


# qwen2vl's file carries a norm epsilon of 1e-30 (llama-cpp-python 0.3.36's llama.cpp ignores
# the key and adds 0): its decode steps match to 1e-6, its prefill batch to 0.01 nats only. That
# is the tiny epsilon, not the family: the same weights with 1e-6, read as qwen2 by both, match
# exactly, and dasllama's qwen2vl and qwen2 readings of one file are bit-identical.
GGML_PREFILL_TOLERANCE = {"qwen2vl": 0.02}


@pytest.mark.parametrize("name", GGML_ORDER)
def test_ggml_numerics_reproduce_llamacpp(name: str, files: dict[str, Path]) -> None:
    # ggml's order, decode steps and one prefill batch alike: the same numbers as llama.cpp up to
    # the goldens' rounding, for every family (the family's graph, not just its tolerance).
    g = golden(name)
    m = dl.load_model(files[name], numerics=dl.Numerics.ggml)
    worst, flips, _, _ = compare(m, g, one_at_a_time, "steps")
    assert worst < 1e-4 and flips == 0, worst
    worst, flips, _, _ = compare(m, g, one_batch, "prefill_steps")
    assert worst < GGML_PREFILL_TOLERANCE.get(name, 1e-4) and flips == 0, worst


# Each family's distinguishing piece, taken out of its file (the rest byte for byte the same):
# the golden must then miss by far more than the tolerance, or that piece was never tested.
ABLATIONS = {
    "qwen2 without its K bias": ("qwen2", dict(drop="blk.0.attn_k.bias")),
    "gemma2 without score capping": ("gemma2", dict(meta={"attn_logit_softcapping": 1e6})),
    "gemma2 without logit capping": ("gemma2", dict(meta={"final_logit_softcapping": 1e6})),
    "gemma2 without its window": ("gemma2", dict(meta={"attention.sliding_window": 64})),
    "phi3 without long factors": ("phi3", dict(drop="rope_factors_long.weight")),
    "phi3 without the attention factor": ("phi3", dict(meta={"rope.scaling.attn_factor": None})),
    "phi3 with the short factors": ("phi3", dict(meta={"rope.scaling.original_context_length": 4096})),
    "phi3-short without factors": ("phi3-short", dict(drop="rope_factors_short.weight")),
    "qwen2moe with its shared expert half open": ("qwen2moe", dict(replace={"blk.0.ffn_gate_inp_shexp.weight": np.zeros(256, np.float32)})),
    "qwen3moe with two experts a token": ("qwen3moe", dict(meta={"expert_used_count": 2})),
    "qwen35 with a convolution that passes its input": ("qwen35", dict(replace={f"blk.{i}.ssm_conv1d.weight": np.tile(np.float32([0, 0, 0, 1]), (512, 1)) for i in range(3)})),
    "qwen35 without decay": ("qwen35", dict(replace={f"blk.{i}.ssm_a": np.zeros(4, np.float32) for i in range(3)})),
    "mistral3 without its attention temperature": ("mistral3", dict(meta={"attention.temperature_scale": None})),
    "mistral3 with ggml's default YaRN betas": ("mistral3", dict(meta={"rope.scaling.yarn_beta_fast": None, "rope.scaling.yarn_beta_slow": None})),
    "mistral3 without the YaRN log multiplier": ("mistral3", dict(meta={"rope.scaling.yarn_log_multiplier": None})),
    "glm4moe without its selection bias": ("glm4moe", dict(replace={f"blk.{i}.exp_probs_b.bias": np.zeros(8, np.float32) for i in (1, 2)})),
    "glm4moe with softmax scores": ("glm4moe", dict(meta={"expert_gating_func": 1})),
    "glm4moe without its weight scale": ("glm4moe", dict(meta={"expert_weights_scale": None})),
    "glm4moe without one layer's query norm": ("glm4moe", dict(drop="blk.1.attn_q_norm.weight")),
    # (Turning all 64 pairs instead of the 16 moves the logits by 0.21 only: the high pairs turn slowly.)
    "gemma4 with no pair of its full layer turning": ("gemma4", dict(replace={"rope_freqs.weight": np.full(64, 1e30, np.float32)})),
    "gemma4 with its full layer at the sliding layers' base": ("gemma4", dict(meta={"rope.freq_base": 10000.0})),
    "gemma4 without its window": ("gemma4", dict(meta={"attention.sliding_window": 64})),
    "gemma4 without logit capping": ("gemma4", dict(meta={"final_logit_softcapping": None})),
    "gemma4-moe without the router's scale": ("gemma4-moe", dict(replace={f"blk.{i}.ffn_gate_inp.scale": np.ones(256, np.float32) for i in range(3)})),
    "gemma4-moe without its experts' scales": ("gemma4-moe", dict(replace={f"blk.{i}.ffn_down_exps.scale": np.ones(8, np.float32) for i in range(3)})),
    "gemma4-e without per-layer token embeddings": ("gemma4-e", dict(replace={"per_layer_token_embd.weight": np.zeros((len(VOCAB), 160), np.float32)})),
    "qwen35moe with an ungated shared expert": ("qwen35moe", dict(replace={f"blk.{i}.ffn_gate_inp_shexp.weight": np.full(256, 30.0, np.float32) for i in range(4)})),
    "qwen35moe with one expert a token": ("qwen35moe", dict(meta={"expert_used_count": 1})),
    "gpt-oss without its sinks": ("gpt-oss", dict(replace={f"blk.{i}.attn_sinks.weight": np.full(8, -1e30, np.float32) for i in range(3)})),
    "gpt-oss without its window": ("gpt-oss", dict(meta={"attention.sliding_window": 64})),
    "gpt-oss without YaRN": ("gpt-oss", dict(meta={"rope.scaling.type": "none"})),
    "gpt-oss without its router's bias": ("gpt-oss", dict(replace={f"blk.{i}.ffn_gate_inp.bias": np.zeros(8, np.float32) for i in range(3)})),
    "gpt-oss without its experts' gate biases": ("gpt-oss", dict(replace={f"blk.{i}.ffn_gate_exps.bias": np.zeros((8, 256), np.float32) for i in range(3)})),
    "gpt-oss without its output bias": ("gpt-oss", dict(replace={f"blk.{i}.attn_output.bias": np.zeros(256, np.float32) for i in range(3)})),
    "qwen3next with an ungated shared expert": ("qwen3next", dict(replace={f"blk.{i}.ffn_gate_inp_shexp.weight": np.full(256, 30.0, np.float32) for i in range(4)})),
}


@pytest.mark.parametrize("what", sorted(ABLATIONS))
def test_the_goldens_see_each_piece(what: str, tmp_path: Path) -> None:
    name, kw = ABLATIONS[what]
    path = tmp_path / "ablated.gguf"
    write_family(path, name, **kw)
    worst, _, _, _ = compare(dl.load_model(path), golden(name))
    assert worst > 0.5, worst


@pytest.mark.parametrize("name", NAMES)
def test_batched_and_chunked_equal_single_stream(name: str, files: dict[str, Path]) -> None:
    m = dl.load_model(files[name])
    cases = family_cases(name)
    # One stream, one token at a time: the reference rows.
    alone = []
    for ids in cases:
        s = dl.create_session(m)
        alone.append(np.stack([dl.eval(m, s, [t]) for t in ids]))
    # Prefill in chunks of 7 gives the same rows.
    for ids, ref in zip(cases, alone, strict=True):
        s = dl.create_session(m)
        rows = np.concatenate([dl.eval_all(m, s, ids[i : i + 7]) for i in range(0, len(ids), 7)])
        np.testing.assert_array_equal(rows, ref)
    # Streams at different depths advanced together, one token each per step.
    sessions = [dl.create_session(m) for _ in cases]
    starts = [5, 9, 13]
    for s, ids, k in zip(sessions, cases, starts, strict=True):
        dl.eval(m, s, ids[:k])
    ws = dl.create_batch_workspace(m)
    for step in range(8):
        out = dl.eval_batch(m, ws, sessions, [ids[k + step] for ids, k in zip(cases, starts, strict=True)])
        for i, (ref, k) in enumerate(zip(alone, starts, strict=True)):
            np.testing.assert_array_equal(out[i], ref[k + step])


def test_gpt_oss_with_the_real_window_over_a_long_case(tmp_path: Path) -> None:
    # gpt-oss-20b's window (128) over 200 positions (the goldens' files use 8 over 24): the fp32
    # mode lands on the float64 reference, which without the window parts from it by far more;
    # chunked prefill and decode past the window give the rows of one token at a time. At
    # position 178 the router's 4th and 5th logits are 0.0006 apart, which the f16 K/V rounding
    # tips the other way (1.9 off there, and a few later rows that attend to it are moved), so the
    # comparison takes 95% of positions (0.037 against a scale of 9; median 0.014 past 128, where
    # the reference without the window is 5.6 away).
    meta = {"attention.sliding_window": 128, "context_length": 256}
    path = tmp_path / "long.gguf"
    weights = write_family(path, "gpt-oss", meta=meta)
    ids = [1] + [int(t) for t in np.random.default_rng(5).integers(3, len(VOCAB), size=199)]
    ref = family_reference_logits(weights, "gpt-oss", ids, meta)
    m = dl.load_model(path, dl.QuantMode.fp32)
    got = dl.eval_all(m, dl.create_session(m), ids)
    err = np.abs(got - ref).max(axis=-1)
    assert np.quantile(err, 0.95) <= 0.005 * np.abs(ref).max(), (np.quantile(err, 0.95), np.abs(ref).max())
    unwindowed = family_reference_logits(weights, "gpt-oss", ids, {**meta, "attention.sliding_window": 0})
    assert np.median(np.abs(unwindowed[128:] - got[128:]).max(axis=-1)) > 10 * np.median(err[128:])
    assert np.abs(unwindowed[:128] - ref[:128]).max() < 1e-9  # the window only cuts past 128
    m = dl.load_model(path)
    s = dl.create_session(m)
    alone = np.stack([dl.eval(m, s, [t]) for t in ids])
    s = dl.create_session(m)
    chunked = np.concatenate([dl.eval_all(m, s, ids[i : i + 48]) for i in range(0, len(ids), 48)])
    np.testing.assert_array_equal(chunked, alone)
