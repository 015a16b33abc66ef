"""MXFP4 experts: a gpt-oss file of gpt-oss-20b's widths (d 2880, 64 query / 8 KV heads of 64,
32 experts of 2880 with 4 routed per token, attention sinks, biases, every other layer sliding over
128, YaRN) and fewer layers, its expert stacks in MXFP4 as gpt-oss ships them, the other matrices
in Q8_0, written with random weights. Decode tokens/s (one token per call after a short prompt)
and pp512 (one 512-token prompt), dasllama against llama.cpp on the same file, both on the same
number of threads. The two take turns, a round each (on a shared machine both see the same load);
the table has the median of `--rounds`.

    python benches/bench_mxfp4.py [--layers 4] [--threads 2] [--rounds 3] [--llama-python /tmp/llamacpp/bin/python]

The file (about 0.45 GB a layer) is written once to --out (default ~/.cache/dasllama/bench/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from machine import cpu_name

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

# gpt-oss-20b's widths; `--layers` of its 24.
GPTOSS = {"dim": 2880, "heads": 64, "kv_heads": 8, "head_dim": 64, "experts": 32, "used": 4, "expert_ffn": 2880}
PROMPT = [1, 260, 261, 262, 263, 264, 265, 266]


def write_model(path: Path, layers: int, seed: int = 39) -> None:
    """Random weights: MXFP4 stacks of random codes under scale 2^-8 (values of std about 0.02,
    1/sqrt(2880)), Q8_0 attention and embeddings (gguf's quantizer), F32 norms and router."""
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFWriter
    from gguf.quants import quantize

    from synthetic import VOCAB, _add_keys, _write_vocab

    s, rng = GPTOSS, np.random.default_rng(seed)
    d, hd = s["dim"], s["head_dim"]
    w = GGUFWriter(str(path), "gpt-oss")
    keys = {
        "block_count": layers, "context_length": 4096, "embedding_length": d, "feed_forward_length": s["expert_ffn"],
        "attention.head_count": s["heads"], "attention.head_count_kv": s["kv_heads"], "attention.key_length": hd,
        "attention.value_length": hd, "attention.layer_norm_rms_epsilon": 1e-5, "attention.sliding_window": 128,
        "rope.freq_base": 150000.0, "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
        "rope.scaling.original_context_length": 4096,
        "expert_count": s["experts"], "expert_used_count": s["used"], "expert_feed_forward_length": s["expert_ffn"],
    }  # fmt: skip
    _add_keys(w, "gpt-oss", keys)
    _write_vocab(w)

    def q8(name: str, rows: int, cols: int, std: float) -> None:
        w.add_tensor(name, quantize(rng.normal(0, std, size=(rows, cols)).astype(np.float32), QT.Q8_0), raw_dtype=QT.Q8_0)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32))

    def vec(name: str, shape: tuple[int, ...], std: float) -> None:
        w.add_tensor(name, rng.normal(0, std, size=shape).astype(np.float32))

    def experts(name: str, rows: int, cols: int) -> None:
        raw = rng.integers(0, 256, size=(s["experts"], rows, cols // 32, 17), dtype=np.uint8)
        raw[..., 0] = 120
        w.add_tensor(name, raw.reshape(s["experts"], rows, -1), raw_dtype=QT.MXFP4)

    q8("token_embd.weight", len(VOCAB), d, 0.5)
    qd, kvd = s["heads"] * hd, s["kv_heads"] * hd
    for i in range(layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", d)
        q8(p + "attn_q.weight", qd, d, d**-0.5)
        q8(p + "attn_k.weight", kvd, d, d**-0.5)
        q8(p + "attn_v.weight", kvd, d, d**-0.5)
        vec(p + "attn_q.bias", (qd,), 0.1)
        vec(p + "attn_k.bias", (kvd,), 0.1)
        vec(p + "attn_v.bias", (kvd,), 0.1)
        q8(p + "attn_output.weight", d, qd, 0.5 * qd**-0.5)
        vec(p + "attn_output.bias", (d,), 0.05)
        vec(p + "attn_sinks.weight", (s["heads"],), 1.0)
        norm(p + "post_attention_norm.weight", d)
        vec(p + "ffn_gate_inp.weight", (s["experts"], d), d**-0.5)
        vec(p + "ffn_gate_inp.bias", (s["experts"],), 0.1)
        experts(p + "ffn_gate_exps.weight", s["expert_ffn"], d)
        experts(p + "ffn_up_exps.weight", s["expert_ffn"], d)
        experts(p + "ffn_down_exps.weight", d, s["expert_ffn"])
        # The experts' biases, [n, width] as llama.cpp reads them.
        for t, width in (("ffn_gate_exps", s["expert_ffn"]), ("ffn_up_exps", s["expert_ffn"]), ("ffn_down_exps", d)):
            vec(p + t + ".bias", (s["experts"], width), 0.05)
    norm("output_norm.weight", d)
    q8("output.weight", len(VOCAB), d, d**-0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in ("decode", "pp")}


def pp_ids(n: int) -> list[int]:
    return [1] + [3 + (7 * i) % 260 for i in range(n - 1)]


def bench_dasllama(m: object, steps: int, pp: int) -> dict[str, float]:
    import dasllama as dl

    def decode() -> None:
        s = dl.create_session(m)
        dl.eval(m, s, PROMPT)
        for i in range(steps):
            dl.eval(m, s, [3 + i])

    def prefill() -> None:
        dl.eval(m, dl.create_session(m), pp_ids(pp))

    dl.eval(m, dl.create_session(m), PROMPT)  # the weights' pages in memory
    prompt_s = timed(lambda: dl.eval(m, dl.create_session(m), PROMPT))
    return {"decode": steps / (timed(decode) - prompt_s), "pp": pp / timed(prefill)}


def bench_llama_cpp(path: Path, steps: int, pp: int, threads: int) -> dict[str, float]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads, verbose=False)

    def decode() -> None:
        llm.reset()
        llm.eval(PROMPT)
        for i in range(steps):
            llm.eval([3 + i])

    def prefill() -> None:
        llm.reset()
        llm.eval(pp_ids(pp))

    def prompt() -> None:
        llm.reset()
        llm.eval(PROMPT)

    prompt()
    prompt_s = timed(prompt)
    return {"decode": steps / (timed(decode) - prompt_s), "pp": pp / timed(prefill)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per run")
    ap.add_argument("--rounds", type=int, default=3, help="turns each engine takes")
    ap.add_argument("--pp", type=int, default=512, help="prompt tokens of the prefill run")
    ap.add_argument("--out", default=str(Path.home() / ".cache" / "dasllama" / "bench"))
    ap.add_argument("--llama-python", default=None, help="an interpreter with llama_cpp: run llama.cpp on the same file")
    ap.add_argument("--llama-only", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_only:
        path, steps, pp, threads = json.loads(args.llama_only)
        print(json.dumps(bench_llama_cpp(Path(path), steps, pp, threads)))
        return
    path = Path(args.out) / f"bench-gptoss-{args.layers}l-mxfp4.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} ...", file=sys.stderr)
        write_model(path, args.layers)
    os.environ["DASLLAMA_THREADS"] = str(args.threads)
    import dasllama as dl

    m = dl.load_model(path)
    ours_runs: list[dict[str, float]] = []
    theirs_runs: list[dict[str, float]] = []
    loads = []
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        ours_runs.append(bench_dasllama(m, args.steps, args.pp))
        if args.llama_python:
            cmd = [args.llama_python, __file__, "--llama-only", json.dumps([str(path), args.steps, args.pp, args.threads])]
            r = subprocess.run(cmd, capture_output=True, text=True, check=False)
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            if r.returncode != 0 or not lines:
                print(f"llama.cpp run failed: {r.stderr.strip()[-500:]}", file=sys.stderr)
                continue
            theirs_runs.append(json.loads(lines[-1]))
    ours, theirs = median_of(ours_runs), median_of(theirs_runs) if theirs_runs else None
    size = path.stat().st_size / 2**30
    print(
        f"\n{path.name} ({size:.2f} GiB, {args.layers} layers, MXFP4 experts), {cpu_name()}, {args.threads} threads, "
        f"median of {args.rounds} rounds, load average {min(loads):.1f}-{max(loads):.1f}"
    )
    print(f"| {'':<12} | {'dasllama':>9} | {'llama.cpp':>9} | {'ratio':>6} |")
    print(f"|{'-' * 14}|{'-' * 11}|{'-' * 11}|{'-' * 8}|")
    for key, label in (("decode", "decode tok/s"), ("pp", f"pp{args.pp} tok/s")):
        t = theirs[key] if theirs else None
        t_s, ratio = (f"{t:.1f}", f"{ours[key] / t:.2f}x") if t else ("-", "-")
        print(f"| {label:<12} | {ours[key]:>9.1f} | {t_s:>9} | {ratio:>6} |")


if __name__ == "__main__":
    main()
