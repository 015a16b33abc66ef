"""Write tests/golden/families/<family>-mtp.json: llama.cpp's top-5 log-probabilities of the MTP
head of a synthetic hybrid model with an MTP block (tests/synthetic.py, ``write_family(...,
mtp=True)``; qwen35 and qwen3next), for tests/test_mtp.py.

Run with the llama-cpp-python 0.3.36 environment (see scripts/make_family_goldens.py):

    /work/llamacpp-venv/bin/python scripts/make_mtp_golden.py [qwen35 qwen3next]

For each case the trunk runs the ids one token per decode call in a context with embeddings on
(pooling none), which gives its hidden state after the final norm at every position (what
llama.cpp hands its MTP context). An MTP context (LLAMA_CONTEXT_TYPE_MTP, the model loaded with
its MTP layers) then takes, for p = 0 .. n-2 in order, one row: token ids[p + 1] with the
trunk's hidden state at p as its embedding row (which the MTP graph reads as the state), at
position p. steps[p].top = top-5 [token,
log-prob] of the head's logits of that row. CPU, 2 threads, flash attention off.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

from make_family_goldens import top5  # noqa: E402

from synthetic import family_cases, write_family  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", default=["qwen35", "qwen3next"])
    ap.add_argument("--out", default=str(ROOT / "tests" / "golden" / "families"))
    args = ap.parse_args()
    for name in args.families:
        golden(name, Path(args.out) / f"{name}-mtp.json")


def golden(name: str, out: Path) -> None:
    from importlib.metadata import version

    import llama_cpp
    import llama_cpp.llama_cpp as L

    L.llama_backend_init()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}-mtp.gguf"
        write_family(path, name, mtp=True)
        mp = L.llama_model_default_params()
        mp.load_mtp = True
        model = L.llama_model_load_from_file(str(path).encode(), mp)
        assert model, "llama.cpp could not load the model"
        assert L.llama_model_n_layer_nextn(model) == 1
        n_embd = L.llama_model_n_embd(model)
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))

        def context(mtp: bool):
            cp = L.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_ubatch = 64, 64, 64
            cp.n_threads = cp.n_threads_batch = 2
            cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
            if mtp:
                cp.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
            else:
                cp.embeddings = True
                cp.pooling_type = L.LLAMA_POOLING_TYPE_NONE
            ctx = L.llama_init_from_model(model, cp)
            assert ctx, "llama.cpp could not make the context"
            return ctx

        rows = []
        for ids in family_cases(name):
            trunk, head = context(False), context(True)
            hidden = np.zeros((len(ids), n_embd), np.float32)
            for p, t in enumerate(ids):
                batch = L.llama_batch_get_one((L.llama_token * 1)(t), 1)
                assert L.llama_decode(trunk, batch) == 0
                hidden[p] = np.ctypeslib.as_array(L.llama_get_embeddings_ith(trunk, -1), shape=(n_embd,))
            logits = []
            # A batch that carries a token and an embedding row: llama.cpp's MTP graph reads the
            # row as the hidden state (llama_batch_ext_set_embd_state is not implemented in this
            # version; its llm_graph_input_embd_h takes ubatch.embd as the state).
            b = L.llama_batch_init(1, 0, 1)
            for p in range(len(ids) - 1):
                row = np.ascontiguousarray(hidden[p])
                b.n_tokens = 1
                b.token[0] = ids[p + 1]
                b.embd = row.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                b.pos[0] = p
                b.n_seq_id[0] = 1
                b.seq_id[0][0] = 0
                b.logits[0] = 1
                assert L.llama_decode(head, b) == 0
                logits.append(np.ctypeslib.as_array(L.llama_get_logits_ith(head, -1), shape=(n_vocab,)).copy())
            b.embd = None
            L.llama_batch_free(b)
            L.llama_free(trunk)
            L.llama_free(head)
            rows.append({"ids": ids, "steps": top5(np.array(logits))})
        doc = {
            "family": name,
            "mtp": True,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "made_with": {"llama_cpp_python": llama_cpp.__version__, "gguf": version("gguf"), "numpy": np.__version__},
            "note": "llama.cpp (CPU, 2 threads, no flash attention): the trunk one token per decode call with embeddings on gives hidden[p]; "
            "its MTP context then takes token ids[p+1] with state hidden[p] at position p (one llama_batch carrying both), p = 0..n-2 in order; steps[p].top = top-5 [token, log-prob] of that row",
            "cases": rows,
        }
        L.llama_model_free(model)
    out.write_text(json.dumps(doc, indent=None, separators=(",", ":")) + "\n")
    gaps = [s["top"][0][1] - s["top"][1][1] for c in rows for s in c["steps"]]
    print(f"{name} MTP head: {len(gaps)} rows, median top-1 lead {np.median(gaps):.3f}")


if __name__ == "__main__":
    main()
