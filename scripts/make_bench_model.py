"""Benchmark models of the size people run, with random weights: Llama-3.2-1B's shapes (d 2048, 16
layers, 32 query / 8 KV heads of 64, FFN 8192) over SmolLM2's 49152-token vocabulary and its
tokenizer (copied from the SmolLM2 GGUF), written as an F16 GGUF with `gguf.GGUFWriter`, then
quantized by llama.cpp's own quantizer into the formats people download (Q4_K_M, Q4_0, Q5_K_M,
Q6_K, Q8_0: Q4_K_M and Q5_K_M files keep some tensors in Q6_K as llama.cpp chooses).

`--shape` picks other bodies over the same vocabulary (`--shape moe`: a qwen3moe of 12 layers with
32 experts of which 4 route per token, 0.77B parameters, 0.19B active; `--shape hybrid`: a qwen35
Gated-DeltaNet hybrid of 16 layers, every fourth one gated attention, 0.38B).

The quantizer is `llama-quantize` when it is on the PATH, else the same library call
(`llama_model_quantize`) through llama-cpp-python, which builds llama.cpp from the sources its
sdist vendors: `--llama-python` names an interpreter that has it (default: this one if it imports
`llama_cpp`, else /work/llamacpp-venv/bin/python where that exists).

    python scripts/make_bench_model.py [--out-dir ~/.cache/dasllama/bench] [--types Q4_K_M Q4_0 Q5_K_M Q6_K Q8_0]
    python scripts/make_bench_model.py --shape moe --types Q4_K_M

Prints the paths; the benches take them (`bench_generate.py --models PATH...`,
`bench_batch.py --model PATH`, `bench_long_prompt.py --model PATH`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

# Llama-3.2-1B's body; the vocabulary is the tokenizer donor's.
SHAPE = {"dim": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "head_dim": 64, "ffn": 8192, "ctx": 8192, "rope_base": 500000.0, "eps": 1e-5}
# Qwen3-30B-A3B's proportions, scaled to run in minutes on two cores: QK-norm attention, and 32
# experts of 512 with the top 4 renormalised.
MOE = {"dim": 1024, "layers": 12, "heads": 16, "kv_heads": 4, "head_dim": 128, "experts": 32, "used": 4, "expert_ffn": 512, "ctx": 8192, "rope_base": 1000000.0, "eps": 1e-6}
# Qwen3.5's layer pattern: three Gated-DeltaNet layers (8 key heads, 16 value heads of 128, a
# 4-tap convolution) then one gated-attention layer (8 query / 2 KV heads of 256, RoPE on 64 of
# them), each with a dense SwiGLU FFN.
HYBRID = {
    "dim": 1024, "layers": 16, "heads": 8, "kv_heads": 2, "head_dim": 256, "ffn": 3072, "ctx": 8192, "rope_base": 10000000.0, "eps": 1e-6,
    "interval": 4, "nk": 8, "nv": 16, "dn_head": 128, "conv": 4, "rope_dims": 64,
}  # fmt: skip
SHAPES = {"llama1b": ("llama", "bench-llama1b"), "moe": ("qwen3moe", "bench-qwen3moe"), "hybrid": ("qwen35", "bench-qwen35")}
TYPES = ["Q4_K_M", "Q4_0", "Q5_K_M", "Q6_K", "Q8_0"]


def tokenizer_fields(path: str) -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    """Every tokenizer.* key of a GGUF, as (key, value, type, element type)."""
    r = GGUFReader(path)
    out = []
    for key, f in r.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
            out.append((key, f.contents(), f.types[0], sub))
    return out


def write_f16(path: Path, donor: str, seed: int, shape: str = "llama1b") -> None:
    """The model with random weights: matrices F16, norms F32. Scales keep activations ordinary
    through 16 layers (std 1/sqrt(fan-in), the FFN's down projection smaller)."""
    if shape != "llama1b":
        return write_f16_other(path, donor, seed, shape)
    s = SHAPE
    toks = tokenizer_fields(donor)
    vocab = next(len(v) for k, v, _, _ in toks if k == "tokenizer.ggml.tokens")
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_name("bench llama 1B shapes (random weights)")
    w.add_block_count(s["layers"])
    w.add_context_length(s["ctx"])
    w.add_embedding_length(s["dim"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(s["rope_base"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_rope_dimension_count(s["head_dim"])
    w.add_vocab_size(vocab)
    w.add_file_type(1)  # MOSTLY_F16
    for key, val, vt, sub in toks:
        w.add_key_value(key, val, vt, sub_type=sub)

    def mat(name: str, rows: int, cols: int, std: float) -> None:
        # numpy order rows x cols = GGUF's ne = [cols, rows]: `rows` outputs of `cols` inputs.
        x = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)
        w.add_tensor(name, x.astype(np.float16), raw_dtype=GGMLQuantizationType.F16)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32))

    d, hd, f = s["dim"], s["head_dim"], s["ffn"]
    mat("token_embd.weight", vocab, d, 1.0)
    for i in range(s["layers"]):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", d)
        mat(p + "attn_q.weight", s["heads"] * hd, d, d**-0.5)
        mat(p + "attn_k.weight", s["kv_heads"] * hd, d, d**-0.5)
        mat(p + "attn_v.weight", s["kv_heads"] * hd, d, d**-0.5)
        mat(p + "attn_output.weight", d, s["heads"] * hd, 0.5 * d**-0.5)
        norm(p + "ffn_norm.weight", d)
        mat(p + "ffn_gate.weight", f, d, d**-0.5)
        mat(p + "ffn_up.weight", f, d, d**-0.5)
        mat(p + "ffn_down.weight", d, f, 0.5 * f**-0.5)
    norm("output_norm.weight", d)
    mat("output.weight", vocab, d, d**-0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_f16_other(path: Path, donor: str, seed: int, shape: str) -> None:
    """The MoE or hybrid body (see MOE, HYBRID), tensors named and shaped as llama.cpp reads them."""
    arch = SHAPES[shape][0]
    s = MOE if shape == "moe" else HYBRID
    toks = tokenizer_fields(donor)
    vocab = next(len(v) for k, v, _, _ in toks if k == "tokenizer.ggml.tokens")
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_name(f"bench {arch} shapes (random weights)")
    d, hd = s["dim"], s["head_dim"]
    keys: dict[str, object] = {
        "block_count": s["layers"], "context_length": s["ctx"], "embedding_length": d, "attention.head_count": s["heads"],
        "attention.head_count_kv": s["kv_heads"], "attention.key_length": hd, "attention.value_length": hd,
        "attention.layer_norm_rms_epsilon": s["eps"], "rope.freq_base": s["rope_base"], "vocab_size": vocab,
    }  # fmt: skip
    if shape == "moe":
        keys.update({"expert_count": s["experts"], "expert_used_count": s["used"], "expert_feed_forward_length": s["expert_ffn"], "feed_forward_length": s["expert_ffn"]})
    else:
        keys.update({
            "feed_forward_length": s["ffn"], "rope.dimension_count": s["rope_dims"], "rope.dimension_sections": [11, 11, 10, 0],
            "full_attention_interval": s["interval"], "ssm.conv_kernel": s["conv"], "ssm.state_size": s["dn_head"],
            "ssm.group_count": s["nk"], "ssm.time_step_rank": s["nv"], "ssm.inner_size": s["nv"] * s["dn_head"],
        })  # fmt: skip
    for k, v in keys.items():
        if isinstance(v, float):
            w.add_float32(f"{arch}.{k}", v)
        elif isinstance(v, list):
            w.add_array(f"{arch}.{k}", v)
        else:
            w.add_uint32(f"{arch}.{k}", int(v))  # type: ignore[call-overload]
    w.add_file_type(1)  # MOSTLY_F16
    for key, val, vt, sub in toks:
        w.add_key_value(key, val, vt, sub_type=sub)

    def mat(name: str, rows: int, cols: int, std: float, n: int = 0) -> None:
        # numpy order (n x) rows x cols: `rows` outputs of `cols` inputs, GGUF's ne = [cols, rows(, n)].
        x = rng.standard_normal((n, rows, cols) if n else (rows, cols), dtype=np.float32) * np.float32(std)
        w.add_tensor(name, x.astype(np.float16), raw_dtype=GGMLQuantizationType.F16)

    def vec(name: str, n: int, mean: float = 1.0, std: float = 0.05) -> None:
        w.add_tensor(name, (mean + std * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", vocab, d, 1.0)
    for i in range(s["layers"]):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", d)
        recurrent = shape == "hybrid" and (i + 1) % s["interval"] != 0
        if recurrent:
            kd, vd = s["nk"] * s["dn_head"], s["nv"] * s["dn_head"]
            mat(p + "attn_qkv.weight", 2 * kd + vd, d, d**-0.5)
            mat(p + "attn_gate.weight", vd, d, d**-0.5)
            mat(p + "ssm_beta.weight", s["nv"], d, d**-0.5)
            mat(p + "ssm_alpha.weight", s["nv"], d, d**-0.5)
            w.add_tensor(p + "ssm_conv1d.weight", (0.4 * rng.standard_normal((2 * kd + vd, s["conv"]))).astype(np.float32))
            vec(p + "ssm_dt.bias", s["nv"], 0.0, 0.5)
            w.add_tensor(p + "ssm_a", (-rng.uniform(0.1, 1.0, size=s["nv"])).astype(np.float32))
            vec(p + "ssm_norm.weight", s["dn_head"])
            mat(p + "ssm_out.weight", d, vd, 0.5 * vd**-0.5)
        else:
            qd = s["heads"] * hd
            # A hybrid's attention layers are gated: each head's queries, then its gate.
            mat(p + "attn_q.weight", (2 if shape == "hybrid" else 1) * qd, d, d**-0.5)
            mat(p + "attn_k.weight", s["kv_heads"] * hd, d, d**-0.5)
            mat(p + "attn_v.weight", s["kv_heads"] * hd, d, d**-0.5)
            vec(p + "attn_q_norm.weight", hd)
            vec(p + "attn_k_norm.weight", hd)
            mat(p + "attn_output.weight", d, qd, 0.5 * qd**-0.5)
        if shape == "hybrid":
            vec(p + "post_attention_norm.weight", d)
            mat(p + "ffn_gate.weight", s["ffn"], d, d**-0.5)
            mat(p + "ffn_up.weight", s["ffn"], d, d**-0.5)
            mat(p + "ffn_down.weight", d, s["ffn"], 0.5 * s["ffn"] ** -0.5)
        else:
            vec(p + "ffn_norm.weight", d)
            w.add_tensor(p + "ffn_gate_inp.weight", (rng.standard_normal((s["experts"], d)) * d**-0.5).astype(np.float32))
            mat(p + "ffn_gate_exps.weight", s["expert_ffn"], d, d**-0.5, s["experts"])
            mat(p + "ffn_up_exps.weight", s["expert_ffn"], d, d**-0.5, s["experts"])
            mat(p + "ffn_down_exps.weight", d, s["expert_ffn"], 0.5 * s["expert_ffn"] ** -0.5, s["experts"])
    vec("output_norm.weight", d)
    mat("output.weight", vocab, d, d**-0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


QUANTIZE_PY = """
import ctypes, sys
import llama_cpp as l
inp, out, kind, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
p = l.llama_model_quantize_default_params()
p.ftype = getattr(l, "LLAMA_FTYPE_MOSTLY_" + kind)
p.nthread = threads
rc = l.llama_model_quantize(inp.encode(), out.encode(), ctypes.byref(p))
sys.exit(rc)
"""


def llama_python(arg: str | None) -> str | None:
    if arg:
        return arg
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    venv = "/work/llamacpp-venv/bin/python"
    return venv if os.path.exists(venv) else None


def quantize(src: Path, dst: Path, kind: str, threads: int, py: str | None) -> None:
    if shutil.which("llama-quantize"):
        cmd = ["llama-quantize", str(src), str(dst), kind, str(threads)]
    elif py:
        cmd = [py, "-c", QUANTIZE_PY, str(src), str(dst), kind, str(threads)]
    else:
        raise SystemExit("no llama-quantize on the PATH and no interpreter with llama_cpp: pass --llama-python")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="~/.cache/dasllama/bench")
    ap.add_argument("--types", nargs="+", default=TYPES, choices=TYPES)
    ap.add_argument("--shape", default="llama1b", choices=sorted(SHAPES), help="the body: Llama-3.2-1B's, a qwen3moe MoE, or a qwen35 hybrid")
    ap.add_argument("--tokenizer-from", default="smollm2-135m-instruct", help="a GGUF (path or known name) whose tokenizer the model takes")
    ap.add_argument("--llama-python", default=None, help="a Python interpreter that imports llama_cpp (when llama-quantize is not on the PATH)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-f16", action="store_true", help="keep the F16 file (2.4 GB) after quantizing")
    args = ap.parse_args()
    import dasllama as dl

    out = Path(args.out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    name = SHAPES[args.shape][1]
    f16 = out / f"{name}-F16.gguf"
    wanted = [out / f"{name}-{k}.gguf" for k in args.types]
    if not f16.exists() and not all(p.exists() for p in wanted):
        t = time.perf_counter()
        write_f16(f16, str(dl.fetch(args.tokenizer_from)), args.seed, args.shape)
        print(f"wrote {f16} ({f16.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s", flush=True)
    py = llama_python(args.llama_python)
    for kind, dst in zip(args.types, wanted, strict=True):
        if dst.exists():
            print(f"{dst} exists")
            continue
        t = time.perf_counter()
        quantize(f16, dst, kind, args.threads, py)
        print(f"{dst} ({dst.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t:.0f} s", flush=True)
    if not args.keep_f16 and f16.exists():
        f16.unlink()


if __name__ == "__main__":
    main()
