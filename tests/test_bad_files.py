"""Every kind of bad file raises the documented dasllama exception, naming the file and the problem."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

import dasllama as dl
from synthetic import write_family, write_model


@pytest.fixture()
def good(tmp_path: Path) -> Path:
    p = tmp_path / "good.gguf"
    write_model(p)
    dl.load_model(p)  # the baseline loads
    return p


def test_missing(tmp_path: Path) -> None:
    with pytest.raises(dl.GgufError, match="no such file"):
        dl.load_model(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(b"hello world, not a model")
    with pytest.raises(dl.GgufError, match="not a GGUF file") as e:
        dl.load_model(p)
    assert str(p) in str(e.value)


def test_truncated_header(good: Path) -> None:
    good.write_bytes(good.read_bytes()[:300])
    with pytest.raises(dl.GgufError, match="truncated header"):
        dl.load_model(good)


def test_truncated_data(good: Path) -> None:
    data = good.read_bytes()
    good.write_bytes(data[: len(data) - 4096])
    with pytest.raises(dl.GgufError, match="truncated"):
        dl.load_model(good)


def test_bad_version(good: Path) -> None:
    data = bytearray(good.read_bytes())
    data[4:8] = struct.pack("<I", 99)
    good.write_bytes(bytes(data))
    with pytest.raises(dl.GgufError, match="version 99"):
        dl.load_model(good)


def test_unknown_tensor_type(good: Path) -> None:
    data = bytearray(good.read_bytes())
    name = b"output_norm.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    data[at + 4 + 8 * n_dims : at + 8 + 8 * n_dims] = struct.pack("<I", 77)
    good.write_bytes(bytes(data))
    with pytest.raises(dl.GgufError, match="unknown tensor type id 77"):
        dl.load_model(good)


def test_missing_tensor(tmp_path: Path) -> None:
    p = tmp_path / "m.gguf"
    write_model(p, drop="blk.1.ffn_up.weight")
    with pytest.raises(dl.GgufError, match=r"blk\.1\.ffn_up\.weight.*missing"):
        dl.load_model(p)


def test_unsupported_architecture(tmp_path: Path) -> None:
    p = tmp_path / "a.gguf"
    write_model(p, arch="mamba")
    with pytest.raises(dl.UnsupportedModelError, match="architecture 'mamba' is not supported") as e:
        dl.load_model(p)
    # It names what is supported.
    for arch in ("llama", "gemma2", "gemma3", "phi3", "qwen2", "qwen2moe", "qwen3", "qwen3moe"):
        assert arch in str(e.value)


def test_bad_quant_mode(good: Path) -> None:
    with pytest.raises(ValueError):
        dl.load_model(good, "q3")


def test_exception_tree() -> None:
    for e in (dl.GgufError, dl.UnsupportedModelError, dl.ContextOverflowError, dl.FetchError, dl.TemplateError, dl.KvPoolFullError, dl.EngineError):
        assert issubclass(e, dl.DasllamaError)


# ---- metadata that contradicts itself or the tensors: a GgufError naming the key or tensor ----


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ({"rope.dimension_count": 128}, r"'llama\.rope\.dimension_count' is 128.*head size 64"),
        ({"rope.dimension_count": 7}, r"'llama\.rope\.dimension_count' is 7"),
        ({"attention.head_count_kv": 0}, r"'llama\.attention\.head_count_kv' is 0"),
        ({"attention.head_count_kv": 3}, r"'llama\.attention\.head_count_kv' is 3, which does not divide"),
        ({"attention.head_count": 0}, r"'llama\.attention\.head_count' is 0"),
        ({"context_length": 0}, r"'llama\.context_length' is 0"),
        ({"context_length": None}, r"'llama\.context_length' is missing"),
        ({"block_count": 6}, r"'llama\.block_count' is 6 but the file holds tensors for 2 blocks"),
        ({"block_count": 0}, r"'llama\.block_count' is 0"),
        ({"embedding_length": 128}, r"'llama\.embedding_length' is 128 but token_embd\.weight has rows of 256"),
        ({"embedding_length": -5}, r"'llama\.embedding_length' must be an integer"),
        ({"attention.key_length": 0}, r"'llama\.attention\.key_length' is 0"),
        ({"attention.layer_norm_rms_epsilon": -1.0}, r"'llama\.attention\.layer_norm_rms_epsilon' is -1"),
        ({"rope.freq_base": 0.0}, r"'llama\.rope\.freq_base' is 0"),
        ({"feed_forward_length": "wide"}, r"'llama\.feed_forward_length' must be an integer.*the string"),
        ({"attention.head_count_kv": [2, 2, 2]}, r"'llama\.attention\.head_count_kv' has 3 values but the model has 2 layers"),
    ],
)
def test_inconsistent_metadata(tmp_path: Path, meta: dict, match: str) -> None:
    p = tmp_path / "m.gguf"
    write_model(p, meta=meta)
    with pytest.raises(dl.GgufError, match=match) as e:
        dl.load_model(p)
    assert str(p) in str(e.value)


def test_head_dim_that_rope_needs_is_checked_before_any_eval(tmp_path: Path) -> None:
    # Was an index panic inside the thread team at the first eval.
    p = tmp_path / "m.gguf"
    write_model(p, meta={"rope.dimension_count": 66})
    with pytest.raises(dl.GgufError, match=r"rope\.dimension_count"):
        dl.load_model(p)


@pytest.mark.parametrize(("type_id", "name"), [(9, "Q8_1"), (15, "Q8_K")])
def test_activation_only_tensor_types(good: Path, type_id: int, name: str) -> None:
    data = bytearray(good.read_bytes())
    key = b"output_norm.weight"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    data[at + 4 + 8 * n_dims : at + 8 + 8 * n_dims] = struct.pack("<I", type_id)
    good.write_bytes(bytes(data))
    with pytest.raises(dl.GgufError, match=f"tensor 'output_norm.weight' is stored as {name}, a format llama.cpp uses only for activations"):
        dl.load_model(good)


def test_zero_dimensional_tensor(tmp_path: Path) -> None:
    p = tmp_path / "m.gguf"
    write_model(p, extra={"blk.0.scale": np.array(1.0, dtype=np.float32)})
    with pytest.raises(dl.GgufError, match=r"tensor 'blk\.0\.scale' has shape \[\]"):
        dl.load_model(p)


def test_expert_stack_is_not_folded_into_a_matrix(tmp_path: Path) -> None:
    p = tmp_path / "m.gguf"
    write_model(p, drop="blk.0.ffn_up.weight", extra={"blk.0.ffn_up.weight": np.zeros((4, 512, 256), dtype=np.float32)})
    with pytest.raises(dl.GgufError, match=r"tensor 'blk\.0\.ffn_up\.weight' has shape \[256, 512, 4\]"):
        dl.load_model(p)


# ---- the other families' own pieces: fused tensors, biases, RoPE scaling, soft-capping ----

F32 = np.float32


@pytest.mark.parametrize(
    ("name", "kw", "match"),
    [
        # A bias of the wrong length, a fused matrix or bias of the wrong height.
        ("qwen2", dict(replace={"blk.1.attn_k.bias": np.zeros(100, F32)}), r"tensor 'blk\.1\.attn_k\.bias' has 100 values, expected 128"),
        ("phi3", dict(replace={"blk.0.attn_qkv.weight": np.zeros((500, 256), F32)}), r"tensor 'blk\.0\.attn_qkv\.weight' is 500x256 but the model's metadata implies 512x256"),
        ("phi3", dict(extra_bias=True), r"tensor 'blk\.0\.attn_qkv\.bias' has 7 values, expected 512"),
        # phi3's up holds gate and up: 2 * feed_forward_length rows.
        ("phi3", dict(replace={"blk.1.ffn_up.weight": np.zeros((512, 256), F32)}), r"tensor 'blk\.1\.ffn_up\.weight' is 512x256 but the model's metadata implies 1024x256"),
        ("phi3", dict(replace={"rope_factors_long.weight": np.ones(32, F32)}), r"tensor 'rope_factors_long\.weight' has 32 values, expected 24"),
        ("phi3", dict(replace={"rope_factors_long.weight": np.zeros(24, F32)}), r"tensor 'rope_factors_long\.weight' holds 0; RoPE frequency factors must be positive"),
        # QK-norm is not optional where the family has it.
        ("qwen3", dict(drop="blk.1.attn_k_norm.weight"), r"tensor 'blk\.1\.attn_k_norm\.weight' is missing"),
        ("qwen3", dict(replace={"blk.0.attn_q_norm.weight": np.ones(64, F32)}), r"tensor 'blk\.0\.attn_q_norm\.weight' has 64 values, expected 128"),
        ("gemma2", dict(drop="blk.2.post_ffw_norm.weight"), r"tensor 'blk\.2\.post_ffw_norm\.weight' is missing"),
        ("gemma2", dict(meta={"attn_logit_softcapping": -1.0}), r"'gemma2\.attn_logit_softcapping' is -1"),
        ("gemma2", dict(meta={"attention.sliding_window_pattern": [True, False]}), r"'gemma2\.attention\.sliding_window_pattern' has 2 values but the model has 3 layers"),
        ("qwen2", dict(meta={"rope.scaling.factor": -2.0}), r"'qwen2\.rope\.scaling\.factor' is -2"),
        # Expert counts and widths that disagree with the tensors, a missing shared expert.
        ("qwen3moe", dict(meta={"expert_count": 6}), r"tensor 'blk\.0\.ffn_gate_inp\.weight' is 8x256 but the model's metadata implies 6x256"),
        ("qwen3moe", dict(meta={"expert_used_count": 9}), r"'qwen3moe\.expert_used_count' is 9; it must be between 1 and expert_count \(8\)"),
        ("qwen3moe", dict(meta={"expert_feed_forward_length": 128}), r"tensor 'blk\.0\.ffn_gate_exps\.weight' has shape \[256, 256, 8\] but the model's metadata implies \[256, 128, 8\]"),
        ("qwen2moe", dict(drop="blk.1.ffn_down_shexp.weight"), r"tensor 'blk\.1\.ffn_down_shexp\.weight' is missing"),
        ("qwen2moe", dict(meta={"expert_count": None}), r"'qwen2moe\.expert_count' is missing"),
        # DeltaNet hybrids: a missing recurrent tensor, state sizes that disagree with each other
        # or with the tensors, the gated attention's double-height Q.
        ("qwen35", dict(drop="blk.1.ssm_a"), r"tensor 'blk\.1\.ssm_a' is missing"),
        ("qwen35", dict(drop="blk.0.ssm_conv1d.weight"), r"tensor 'blk\.0\.ssm_conv1d\.weight' is missing"),
        ("qwen3next", dict(drop="blk.2.ssm_ba.weight"), r"tensor 'blk\.2\.ssm_ba\.weight' is missing"),
        ("qwen35", dict(meta={"ssm.inner_size": 512}), r"'qwen35\.ssm\.inner_size' is 512 but ssm\.time_step_rank \(4 value heads\) x ssm\.state_size \(64\) is 256"),
        ("qwen35", dict(meta={"ssm.state_size": 32, "ssm.inner_size": 128}), r"tensor 'blk\.0\.attn_qkv\.weight' is 512x256 but the model's metadata implies 256x256"),
        ("qwen35", dict(meta={"ssm.conv_kernel": 3}), r"tensor 'blk\.0\.ssm_conv1d\.weight' is 512x4 but the model's metadata implies 512x3"),
        ("qwen35", dict(meta={"ssm.group_count": 3}), r"'qwen35\.ssm\.time_step_rank' \(value heads\) is 4, not a multiple of ssm\.group_count \(key heads, 3\)"),
        ("qwen3next", dict(meta={"ssm.time_step_rank": 2, "ssm.inner_size": 128}), r"tensor 'blk\.0\.attn_qkv\.weight' is 512x256 but the model's metadata implies 384x256"),
        ("qwen35", dict(meta={"ssm.conv_kernel": None}), r"'qwen35\.ssm\.conv_kernel' is missing"),
        ("qwen35", dict(meta={"attention.head_count": 2}), r"tensor 'blk\.3\.attn_q\.weight' is 512x256 but the model's metadata implies 256x256"),
        ("qwen35", dict(meta={"attention.recurrent_layers": [True, False]}), r"'qwen35\.attention\.recurrent_layers' has 2 values but the model has 4 layers"),
        # The VL text towers' multi-axis RoPE: its sections required, four of them, some on the
        # first three axes, no more pairs than the head has values, over the whole head.
        ("qwen2vl", dict(meta={"rope.dimension_sections": None}), r"'qwen2vl\.rope\.dimension_sections' is missing"),
        ("qwen3vl", dict(meta={"rope.dimension_sections": [24, 20, 20]}), r"'qwen3vl\.rope\.dimension_sections' has 3 values; it must have 4"),
        ("qwen3vl", dict(meta={"rope.dimension_sections": [64, 40, 40, 0]}), r"'qwen3vl\.rope\.dimension_sections' is \[64, 40, 40, 0\]: 144 pairs, more than the head has values \(128\)"),
        ("qwen2vl", dict(meta={"rope.dimension_sections": [0, 0, 0, 32]}), r"'qwen2vl\.rope\.dimension_sections' is \[0, 0, 0, 32\]; the first three axes have no pairs"),
        ("qwen2vl", dict(meta={"rope.dimension_count": 32}), r"'qwen2vl\.rope\.dimension_count' is 32; this architecture turns the whole head \(64\)"),
        ("qwen3vl", dict(meta={"n_deepstack_layers": "two"}), r"'qwen3vl\.n_deepstack_layers'"),
        ("qwen3vlmoe", dict(drop="blk.1.ffn_up_exps.weight"), r"tensor 'blk\.1\.ffn_up_exps\.weight' is missing"),
        # glm4moe: expert counts and widths against the tensors, the selection bias, the shared
        # expert's count, where the dense layers end, the MTP block count.
        ("glm4moe", dict(meta={"expert_count": 6}), r"tensor 'blk\.1\.ffn_gate_inp\.weight' is 8x256 but the model's metadata implies 6x256"),
        ("glm4moe", dict(meta={"expert_used_count": 9}), r"'glm4moe\.expert_used_count' is 9; it must be between 1 and expert_count \(8\)"),
        ("glm4moe", dict(drop="blk.2.exp_probs_b.bias"), r"tensor 'blk\.2\.exp_probs_b\.bias' is missing"),
        ("glm4moe", dict(replace={"blk.1.exp_probs_b.bias": np.zeros(6, F32)}), r"tensor 'blk\.1\.exp_probs_b\.bias' has 6 values, expected 8"),
        ("glm4moe", dict(meta={"expert_shared_count": None}), r"'glm4moe\.expert_shared_count' is missing"),
        ("glm4moe", dict(meta={"expert_shared_count": 1}), r"tensor 'blk\.1\.ffn_gate_shexp\.weight' is 512x256 but the model's metadata implies 256x256"),
        ("glm4moe", dict(drop="blk.2.ffn_down_shexp.weight"), r"tensor 'blk\.2\.ffn_down_shexp\.weight' is missing"),
        ("glm4moe", dict(meta={"expert_feed_forward_length": 128, "expert_shared_count": 4}), r"tensor 'blk\.1\.ffn_gate_exps\.weight' has shape \[256, 256, 8\] but the model's metadata implies \[256, 128, 8\]"),
        ("glm4moe", dict(meta={"leading_dense_block_count": 0}), r"tensor 'blk\.0\.ffn_gate_shexp\.weight' is missing"),
        ("glm4moe", dict(meta={"leading_dense_block_count": 2}), r"tensor 'blk\.1\.ffn_gate\.weight' is missing"),
        ("glm4moe", dict(meta={"nextn_predict_layers": 4}), r"'glm4moe\.nextn_predict_layers' is 4 but the model has 4 blocks"),
        ("glm4moe", dict(meta={"expert_weights_norm": 1}), r"'glm4moe\.expert_weights_norm' must be a boolean"),
        ("glm4moe", dict(drop="blk.1.post_attention_norm.weight"), r"tensor 'blk\.1\.post_attention_norm\.weight' is missing"),
        ("glm4moe", dict(replace={"blk.0.attn_k_norm.weight": np.ones(32, F32)}), r"tensor 'blk\.0\.attn_k_norm\.weight' has 32 values, expected 64"),
        # gemma4: expert counts, the router's and experts' scales, per-layer arrays of the wrong
        # length, the per-layer embeddings' tensors, a KV-sharing count the layers cannot carry.
        ("gemma4-moe", dict(meta={"expert_count": 6}), r"tensor 'blk\.0\.ffn_gate_exps\.weight' has shape \[256, 256, 8\] but the model's metadata implies \[256, 256, 6\] \(6 experts\)"),
        ("gemma4-moe", dict(meta={"expert_used_count": 9}), r"'gemma4\.expert_used_count' is 9; it must be between 1 and expert_count \(8\)"),
        ("gemma4-moe", dict(meta={"expert_feed_forward_length": 128}), r"tensor 'blk\.0\.ffn_gate_exps\.weight' has shape \[256, 256, 8\] but the model's metadata implies \[256, 128, 8\]"),
        ("gemma4-moe", dict(drop="blk.1.ffn_gate_inp.scale"), r"tensor 'blk\.1\.ffn_gate_inp\.scale' is missing"),
        ("gemma4-moe", dict(drop="blk.2.pre_ffw_norm_2.weight"), r"tensor 'blk\.2\.pre_ffw_norm_2\.weight' is missing"),
        ("gemma4-moe", dict(replace={"blk.0.ffn_down_exps.scale": np.ones(6, F32)}), r"tensor 'blk\.0\.ffn_down_exps\.scale' has 6 values, expected 8"),
        ("gemma4-e", dict(meta={"feed_forward_length": [512, 512, 512, 1024]}), r"'gemma4\.feed_forward_length' has 4 values but the model has 5 layers"),
        ("gemma4", dict(meta={"attention.head_count_kv": [2, 2, 1]}), r"'gemma4\.attention\.head_count_kv' has 3 values but the model has 4 layers"),
        ("gemma4", dict(meta={"attention.sliding_window_pattern": [True, False]}), r"'gemma4\.attention\.sliding_window_pattern' has 2 values but the model has 4 layers"),
        ("gemma4", dict(meta={"attention.sliding_window_pattern": 4}), r"'gemma4\.attention\.sliding_window_pattern' must be an array of booleans, one per layer"),
        ("gemma4", dict(meta={"attention.key_length_swa": None}), r"'gemma4\.attention\.key_length_swa' is missing"),
        ("gemma4", dict(meta={"embedding_length_per_layer_input": None}), r"'gemma4\.embedding_length_per_layer_input' is missing"),
        ("gemma4", dict(drop="blk.2.attn_k.weight"), r"tensor 'blk\.2\.attn_k\.weight' is missing"),
        ("gemma4", dict(drop="rope_freqs.weight"), r"tensor 'rope_freqs\.weight' is missing"),
        ("gemma4", dict(replace={"rope_freqs.weight": np.ones(32, F32)}), r"tensor 'rope_freqs\.weight' has 32 values, expected 64"),
        ("gemma4", dict(replace={"blk.2.attn_q_norm.weight": np.ones(64, F32)}), r"tensor 'blk\.2\.attn_q_norm\.weight' has 64 values, expected 128"),
        ("gemma4-e", dict(drop="per_layer_token_embd.weight"), r"tensor 'per_layer_token_embd\.weight' is missing"),
        ("gemma4-e", dict(drop="per_layer_model_proj.weight"), r"tensor 'per_layer_model_proj\.weight' is missing"),
        ("gemma4-e", dict(drop="blk.3.inp_gate.weight"), r"tensor 'blk\.3\.inp_gate\.weight' is missing"),
        ("gemma4-e", dict(drop="blk.4.post_norm.weight"), r"tensor 'blk\.4\.post_norm\.weight' is missing"),
        ("gemma4-e", dict(meta={"embedding_length_per_layer_input": 16}), r"tensor 'blk\.0\.inp_gate\.weight' is 32x256 but the model's metadata implies 16x256"),
        ("gemma4-e", dict(meta={"attention.shared_kv_layers": 9}), r"'gemma4\.attention\.shared_kv_layers' is 9 but the model has 5 layers; at least 2 must keep their own K/V"),
        ("gemma4-e", dict(meta={"attention.shared_kv_layers": 4}), r"'gemma4\.attention\.shared_kv_layers' is 4 but the model has 5 layers; at least 2 must keep their own K/V"),
        ("gemma4-e", dict(meta={"attention.shared_kv_layers": 1}), r"'gemma4\.attention\.sliding_window_pattern' makes layer 3 sliding but layer 4, which reads its K/V \(attention\.shared_kv_layers\), full"),
        ("gemma4-e", dict(meta={"attention.shared_kv_layers": 0}), r"tensor 'blk\.3\.attn_k\.weight' is missing"),
        # gpt-oss: its sinks, biases and experts against the tensors, the keys llama.cpp requires.
        ("gpt-oss", dict(drop="blk.1.attn_sinks.weight"), r"tensor 'blk\.1\.attn_sinks\.weight' is missing"),
        ("gpt-oss", dict(replace={"blk.0.attn_sinks.weight": np.zeros(4, F32)}), r"tensor 'blk\.0\.attn_sinks\.weight' has 4 values, expected 8"),
        ("gpt-oss", dict(meta={"expert_count": 6}), r"tensor 'blk\.0\.ffn_gate_inp\.weight' is 8x256 but the model's metadata implies 6x256"),
        ("gpt-oss", dict(meta={"expert_count": 16}), r"tensor 'blk\.0\.ffn_gate_inp\.weight' is 8x256 but the model's metadata implies 16x256"),
        ("gpt-oss", dict(meta={"expert_feed_forward_length": 128}), r"tensor 'blk\.0\.ffn_gate_exps\.weight' has shape \[256, 256, 8\] but the model's metadata implies \[256, 128, 8\]"),
        ("gpt-oss", dict(meta={"expert_used_count": 9}), r"'gpt-oss\.expert_used_count' is 9; it must be between 1 and expert_count \(8\)"),
        ("gpt-oss", dict(meta={"attention.sliding_window": None}), r"'gpt-oss\.attention\.sliding_window' is missing"),
        ("gpt-oss", dict(meta={"attention.sliding_window": 0}), r"'gpt-oss\.attention\.sliding_window' is 0; it must be at least 1"),
        ("gpt-oss", dict(meta={"expert_feed_forward_length": None}), r"'gpt-oss\.expert_feed_forward_length' is missing"),
        ("gpt-oss", dict(meta={"attention.layer_norm_rms_epsilon": None}), r"'gpt-oss\.attention\.layer_norm_rms_epsilon' is missing"),
        ("gpt-oss", dict(drop="blk.2.attn_output.bias"), r"tensor 'blk\.2\.attn_output\.bias' is missing"),
        ("gpt-oss", dict(drop="blk.0.ffn_gate_inp.bias"), r"tensor 'blk\.0\.ffn_gate_inp\.bias' is missing"),
        ("gpt-oss", dict(replace={"blk.1.ffn_down_exps.bias": np.zeros((8, 128), F32)}), r"tensor 'blk\.1\.ffn_down_exps\.bias' has 1024 values, expected 2048"),
        ("gpt-oss", dict(drop="blk.1.post_attention_norm.weight"), r"tensor 'blk\.1\.post_attention_norm\.weight' is missing"),
        ("gpt-oss", dict(meta={"rope.dimension_count": 32}), r"'gpt-oss\.rope\.dimension_count' is 32; gpt-oss turns the whole head \(64\)"),
        ("gpt-oss", dict(meta={"attention.sliding_window_pattern": [True, False]}), r"'gpt-oss\.attention\.sliding_window_pattern' has 2 values but the model has 3 layers"),
        ("mistral3", dict(meta={"attention.layer_norm_rms_epsilon": None}), r"'mistral3\.attention\.layer_norm_rms_epsilon' is missing"),
        ("mistral3", dict(meta={"rope.scaling.original_context_length": 0}), r"'mistral3\.rope\.scaling\.original_context_length' is 0; attention temperature scaling needs the original context"),
    ],
)
def test_family_tensors_checked(tmp_path: Path, name: str, kw: dict, match: str) -> None:
    p = tmp_path / "m.gguf"
    if kw.pop("extra_bias", False):
        kw["extra"] = {"blk.0.attn_qkv.bias": np.zeros(7, F32)}
    write_family(p, name, **kw)
    with pytest.raises(dl.GgufError, match=match) as e:
        dl.load_model(p)
    assert str(p) in str(e.value)


def test_qwen35_rope_sections_with_pairs_on_the_fourth_axis(tmp_path: Path) -> None:
    # Sections that put pairs on the fourth axis load as llama.cpp reads them: a text token's
    # position there is 0, so those pairs do not turn (and the logits differ from the model's own).
    p, q = tmp_path / "p.gguf", tmp_path / "q.gguf"
    write_family(p, "qwen35", meta={"rope.dimension_sections": [1, 1, 0, 1]})
    write_family(q, "qwen35")
    ids = [1, 40, 50, 60, 70, 80, 90, 100]
    a, b = (dl.eval_all(m, dl.create_session(m), ids) for m in (dl.load_model(p), dl.load_model(q)))
    assert not np.array_equal(a, b)


@pytest.mark.parametrize(
    ("name", "kw", "match"),
    [
        ("mistral3", dict(meta={"expert_count": 8}), r"'mistral3\.expert_count' is set: mistral3 with routed experts is not supported"),
        ("mistral3", dict(extra={"blk.1.ffn_down.bias": np.zeros(256, F32)}), r"tensor 'blk\.1\.ffn_down\.bias' is not supported \(no output or FFN biases\)"),
        ("mistral3", dict(meta={"rope.scaling.type": "longrope"}), r"'mistral3\.rope\.scaling\.type' is \"longrope\", which is not supported for mistral3"),
        ("gemma2", dict(meta={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}), r"'gemma2\.rope\.scaling\.type' is \"yarn\", which is not supported for gemma2"),
        ("glm4moe", dict(meta={"expert_gating_func": 3}), r"'glm4moe\.expert_gating_func' is 3, which is not supported \(supported: 1 softmax, 2 sigmoid\)"),
        ("glm4moe", dict(meta={"expert_feed_forward_length": [256, 256, 128, 256]}), r"'glm4moe\.expert_feed_forward_length' varies by layer, which is not supported"),
        ("gemma4", dict(meta={"attention.value_length_swa": 32}), r"'gemma4\.attention\.value_length_swa' is 32 but the key heads have 64 values: Gemma 4 needs K and V heads of one size"),
        ("gemma4-moe", dict(meta={"expert_feed_forward_length": [256, 128, 256]}), r"'gemma4\.expert_feed_forward_length' varies by layer, which is not supported"),
        ("gpt-oss", dict(meta={"expert_feed_forward_length": [256, 128, 256]}), r"'gpt-oss\.expert_feed_forward_length' varies by layer, which is not supported"),
        ("gpt-oss", dict(meta={"rope.freq_base_swa": 10000.0}), r"'gpt-oss\.rope\.freq_base_swa' is 10000 but rope\.freq_base is 150000: another RoPE base on the sliding layers is not supported"),
        # The biases only gpt-oss's graph adds are refused elsewhere, not ignored.
        ("qwen3moe", dict(extra={"blk.0.ffn_gate_inp.bias": np.zeros(8, F32)}), r"tensor 'blk\.0\.ffn_gate_inp\.bias' is not supported"),
        ("qwen2", dict(extra={"blk.1.attn_output.bias": np.zeros(256, F32)}), r"tensor 'blk\.1\.attn_output\.bias' is not supported"),
    ],
)
def test_family_pieces_not_supported(tmp_path: Path, name: str, kw: dict, match: str) -> None:
    p = tmp_path / "m.gguf"
    write_family(p, name, **kw)
    with pytest.raises(dl.UnsupportedModelError, match=match) as e:
        dl.load_model(p)
    assert str(p) in str(e.value)


@pytest.mark.parametrize("kind", ["su", "dynamic"])
def test_unknown_rope_scaling_type(tmp_path: Path, kind: str) -> None:
    p = tmp_path / "m.gguf"
    write_family(p, "qwen2", meta={"rope.scaling.type": kind, "rope.scaling.factor": 4.0})
    with pytest.raises(dl.UnsupportedModelError, match=rf"'qwen2\.rope\.scaling\.type' is \"{kind}\", which is not supported \(supported: none, linear, longrope, yarn\)") as e:
        dl.load_model(p)
    assert str(p) in str(e.value)


def test_sliding_window_pattern_as_llamacpp_reads_it(tmp_path: Path) -> None:
    # A period, or one boolean per layer; here both say "only the last layer is global".
    p, q = tmp_path / "p.gguf", tmp_path / "q.gguf"
    write_family(p, "gemma2", meta={"attention.sliding_window_pattern": 3})
    write_family(q, "gemma2", meta={"attention.sliding_window_pattern": [True, True, False]})
    ids = [1, 40, 50, 60, 70, 80, 90, 100]
    a = [dl.eval_all(m, dl.create_session(m), ids) for m in (dl.load_model(p), dl.load_model(q))]
    np.testing.assert_array_equal(a[0], a[1])
    # and differs from gemma2's default (every other layer global).
    r = tmp_path / "r.gguf"
    write_family(r, "gemma2")
    m = dl.load_model(r)
    assert not np.array_equal(dl.eval_all(m, dl.create_session(m), ids), a[0])


def test_mxfp4_tensor_truncated_or_ragged(tmp_path: Path) -> None:
    # An MXFP4 tensor (an expert stack) cut off by the end of the file, and an MXFP4 matrix whose
    # rows are not whole 32-value blocks: each names the tensor.
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFReader

    p = tmp_path / "mx.gguf"
    write_family(p, "qwen3moe-mxfp4")
    tensors = GGUFReader(p).tensors
    last = max((t for t in tensors if t.tensor_type == QT.MXFP4), key=lambda t: t.data_offset)
    assert last.name.endswith("_exps.weight"), last.name
    data = p.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: last.data_offset + last.n_bytes // 2])
    with pytest.raises(dl.GgufError, match=rf"tensor '{last.name}' needs bytes .* the file is truncated"):
        dl.load_model(tmp_path / "cut.gguf")

    ragged = bytearray(data)
    name = b"blk.0.attn_q.weight"
    assert next(t for t in tensors if t.name == name.decode()).tensor_type == QT.MXFP4
    at = ragged.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    assert struct.unpack_from("<IQ", ragged, at) == (2, 256)
    ragged[at + 4 : at + 12] = struct.pack("<Q", 240)
    (tmp_path / "ragged.gguf").write_bytes(bytes(ragged))
    with pytest.raises(dl.GgufError, match=r"tensor 'blk\.0\.attn_q\.weight' row of 240 values is not a whole number of MXFP4 blocks"):
        dl.load_model(tmp_path / "ragged.gguf")
