"""Write tests/golden/families/<name>.json: llama.cpp's teacher-forced top-5 log-probabilities on
each synthetic family model of tests/synthetic.py (FAMILIES), for tests/test_families.py.

Needs llama-cpp-python 0.3.36 built from its sdist (its vendored llama.cpp is the reference), in
an environment of its own:

    python3 -m venv /tmp/llamacpp && /tmp/llamacpp/bin/pip install numpy gguf
    CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llamacpp/bin/pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36
    /tmp/llamacpp/bin/python scripts/make_family_goldens.py

The files are written deterministically (fixed seeds); each golden records the sha256 of the file
it was made from, which the tests check before comparing. llama.cpp runs on the CPU with 2
threads and flash attention off (its f16-rounded softmax path, which dasllama's kernels follow).
`steps` are teacher-forced one token per decode call, as llama.cpp computes each step while
generating; `prefill_steps` are the same ids as one batch, where ggml adds some products up in
another order (dasllama's `ggml` numerics reproduce both; its `fast` kernels keep one order for
every batch, and land within 0.15 nats of the first). llama.cpp pads the context of 64 to 256,
which keeps its choice of phi3's long or short RoPE factors the same as dasllama's here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from synthetic import FAMILIES, family_cases, write_family  # noqa: E402


def top5(scores: np.ndarray) -> list[dict]:
    logits = np.array(scores, dtype=np.float64)
    m = logits.max(axis=-1, keepdims=True)
    lp = logits - (np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)) + m)
    return [{"top": [[int(t), round(float(row[t]), 6)] for t in np.argsort(-row, kind="stable")[:5]]} for row in lp]


def spread(a: list[dict], b: list[dict]) -> float:
    """max |Δ log p| between two runs' steps, over the first run's top-5."""
    out = 0.0
    for x, y in zip(a, b, strict=False):
        ly = {t: v for t, v in y["top"]}
        out = max(out, *(abs(v - ly[t]) for t, v in x["top"] if t in ly))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=sorted(FAMILIES), help="families to write (default: all)")
    ap.add_argument("--out", default=str(ROOT / "tests" / "golden" / "families"))
    args = ap.parse_args()

    from importlib.metadata import version

    import llama_cpp

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.names:
            path = Path(tmp) / f"{name}.gguf"
            write_family(path, name)
            cases = family_cases(name)
            # The YaRN knobs at -1 ("not set", llama.cpp's own defaults): llama-cpp-python's 32 and
            # 1 would override the file's rope.scaling.yarn_beta_* keys (mistral3).
            llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=64,
                n_batch=64,
                n_ubatch=64,
                n_threads=2,
                n_threads_batch=2,
                logits_all=True,
                flash_attn=False,
                yarn_beta_fast=-1.0,
                yarn_beta_slow=-1.0,
                yarn_attn_factor=-1.0,
                verbose=False,
            )
            rows = []
            for ids in cases:
                # Each step as llama.cpp computes it while generating (one token per decode call),
                # and the whole sequence as one prompt batch: ggml adds up some products in another
                # order for a batch, which moves these tiny random models by tenths of a nat.
                llm.reset()
                for t in ids:
                    llm.eval([t])
                one = top5(llm.scores[: len(ids)])
                llm.reset()
                llm.eval(ids)
                batch = top5(llm.scores[: len(ids)])
                rows.append({"ids": ids, "steps": one, "prefill_steps": batch})
            del llm
            doc = {
                "family": name,
                "arch": FAMILIES[name]["arch"],
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "made_with": {"llama_cpp_python": llama_cpp.__version__, "gguf": version("gguf"), "numpy": np.__version__},
                "note": "llama.cpp (CPU, 2 threads, no flash attention), teacher-forced: steps[i].top = top-5 [token, log-prob] after ids[: i + 1], one token per decode call; prefill_steps: the same from one batch of all the ids",
                "cases": rows,
            }
            (out / f"{name}.json").write_text(json.dumps(doc, indent=None, separators=(",", ":")) + "\n")
            gaps = [s["top"][0][1] - s["top"][1][1] for c in rows for s in c["steps"]]
            sp = max(spread(c["steps"], c["prefill_steps"]) for c in rows)
            print(f"{name}: {len(gaps)} steps, median top-1 lead {np.median(gaps):.3f}, {sum(g >= 0.15 for g in gaps)} decisive; llama.cpp's prefill vs decode: max {sp:.3f} nats")


if __name__ == "__main__":
    main()
