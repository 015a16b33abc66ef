"""Write tests/golden/embeddings-smollm2.json: llama.cpp's pooled, normalized embeddings of a few
texts on SmolLM2-135M-Instruct Q4_1 (what `llama-embedding --pooling mean|last` prints), for
tests/test_embeddings.py. Needs llama-cpp-python (0.3.36, built from its sdist), and the model
where dasllama's fetcher caches it (or its path as the argument):

    python scripts/make_embedding_goldens.py [MODEL.gguf]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import llama_cpp
from llama_cpp import Llama

TEXTS = ["Hello world", "The cat sat on the mat", "Embeddings map text to vectors of numbers.", "Paris is the capital of France."]


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else str(Path.home() / ".cache/dasllama/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    out: dict[str, object] = {"model": Path(path).name, "texts": TEXTS}
    for name, pooling in (("mean", llama_cpp.LLAMA_POOLING_TYPE_MEAN), ("last", llama_cpp.LLAMA_POOLING_TYPE_LAST)):
        m = Llama(str(path), embedding=True, pooling_type=pooling, n_threads=2, n_ctx=512, verbose=False)
        out[name] = [[round(float(x), 7) for x in m.embed(t, normalize=True)] for t in TEXTS]
        out["ids"] = [m.tokenize(t.encode(), add_bos=True) for t in TEXTS]
        del m
    dst = Path(__file__).parent.parent / "tests" / "golden" / "embeddings-smollm2.json"
    dst.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
