"""Write tests/golden/gemma4-target.json: llama.cpp's logits and hidden states (after the
final norm, its h_nextn: what an assistant drafter reads) of the synthetic dense Gemma 4 target of
tests/gemma4_assistant.py (write_target), for tests/test_gemma4_assistant.py, which checks the
float64 reference target there (the K/V and hidden states its assistant reference reads) against
them.

Run with the llama-cpp-python 0.3.36 environment (see scripts/make_family_goldens.py):

    /tmp/llamacpp/bin/python scripts/make_gemma4_target_golden.py

Each prompt is decoded as one batch with logits at every row and nextn embeddings on (unmasked).
CPU, 2 threads, flash attention off.

The assistant's own logits are not recorded: this llama.cpp loads the synthetic assistant and
runs its graph in a context made with ctx_other = the target's (as common/speculative.cpp attaches
it), through llama_decode or llama_process alike, but the draft row's attention mask admits none
of the target's cells (kq_soft_max is NaN from the first layer on, whatever the row's position);
its batch_ext API leaves llama_batch_ext_set_embd_state unimplemented, and its own
tests/test-llama-archs.cpp skips gemma4 and gemma4-assistant ("ISWA KV cache initialization needs
more fixture params"). The assistant is therefore checked against the float64 reference written
from src/models/gemma4-assistant.cpp (tests/gemma4_assistant.py: reference_step).
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

from gemma4_assistant import write_target  # noqa: E402
from gemma4_vocab import TOKENS  # noqa: E402

PROMPTS = [[2, 300, 301, 302, 303, 304, 305], [2, 420, 421, 422, 10, 500, 501, 502, 503, 504, 505, 506]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "golden" / "gemma4-assistant.json"))
    args = ap.parse_args()

    import llama_cpp
    import llama_cpp.llama_cpp as L
    from llama_cpp import llama_cpp_ext as X

    L.llama_backend_init()
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        tpath = Path(tmp) / "target.gguf"
        write_target(tpath, n_vocab=len(TOKENS))
        target = L.llama_model_load_from_file(str(tpath).encode(), L.llama_model_default_params())
        assert target, "llama.cpp could not load the target"
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(target))
        n_embd = L.llama_model_n_embd(target)

        def params():
            cp = L.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_ubatch = 64, 64, 64
            cp.n_threads = cp.n_threads_batch = 2
            cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
            return cp

        for ids in PROMPTS:
            ctx_t = L.llama_init_from_model(target, params())
            X.llama_set_embeddings_nextn(ctx_t, True, False)
            n = len(ids)
            b = L.llama_batch_init(n, 0, 1)
            for i, t in enumerate(ids):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, i, 1, 1
                b.seq_id[i][0] = 0
            b.n_tokens = n
            assert L.llama_decode(ctx_t, b) == 0
            L.llama_batch_free(b)
            t_logits = np.array([np.ctypeslib.as_array(L.llama_get_logits_ith(ctx_t, i), shape=(n_vocab,)) for i in range(n)], np.float64)
            hidden = np.array([np.ctypeslib.as_array(X.llama_get_embeddings_nextn_ith(ctx_t, i), shape=(n_embd,)) for i in range(n)], np.float64)

            L.llama_free(ctx_t)
            cases.append({"ids": ids, "logits": [[round(float(x), 5) for x in r] for r in t_logits], "hidden": [[round(float(x), 6) for x in r] for r in hidden]})
        L.llama_model_free(target)
        sha = hashlib.sha256(tpath.read_bytes()).hexdigest()
    doc = {"made_with": f"llama-cpp-python {llama_cpp.__version__} (CPU, 2 threads, flash attention off)", "sha256": sha, "cases": cases}
    Path(args.out).write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print(f"wrote {args.out}: {len(cases)} prompts, {sum(len(c['ids']) for c in cases)} rows")


if __name__ == "__main__":
    main()
