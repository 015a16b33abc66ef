"""Check `numerics="ggml"` against a real llama.cpp, bit for bit, on tiny synthetic models of every
format it covers (llama and gemma3 graphs; a nine-token prefill, then three decode steps).

It needs llama-cpp-python and, for the comparison to mean anything, llama.cpp's libraries built
for x86 AVX2 without AVX-512 (the build the golden files come from), e.g. from the sources
llama-cpp-python vendors:

    cmake -S vendor/llama.cpp -B build -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON \\
          -DGGML_F16C=ON -DGGML_AVX512=OFF -DBUILD_SHARED_LIBS=ON && cmake --build build --target llama
    LLAMA_CPP_LIB_PATH=build/bin python scripts/ggml_conformance.py

Each model is evaluated in a child process per engine (llama.cpp loads its libraries once).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

FORMATS = ["F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
IDS = [1, 261, 262, 263, 5, 70, 80, 90, 100]
STEPS = [110, 120, 130]

CHILD = f"""
import sys, numpy as np
path, engine, out = sys.argv[1:4]
ids, steps = {IDS}, {STEPS}
if engine == "llama.cpp":
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    llm.eval(ids)
    rows = [np.array(llm.scores[len(ids) - 1])]
    for t in steps:
        llm.eval([t])
        rows.append(np.array(llm.scores[llm.n_tokens - 1]))
else:
    import dasllama as dl
    m = dl.load_model(path, numerics="ggml")
    s = dl.create_session(m)
    rows = [dl.eval(m, s, ids)] + [dl.eval(m, s, [t]) for t in steps]
np.save(out, np.stack(rows))
"""


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from gguf import GGMLQuantizationType as QT

    from synthetic import write_model

    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in FORMATS:
            for arch in ("llama", "gemma3"):
                path = Path(tmp) / f"tiny-{arch}-{name}.gguf"
                write_model(path, QT[name], arch)
                got = {}
                for engine in ("llama.cpp", "dasllama"):
                    out = Path(tmp) / f"{engine}.npy"
                    subprocess.run([sys.executable, "-c", CHILD, str(path), engine, str(out)], check=True, capture_output=True)
                    got[engine] = np.load(out)
                diff = np.abs(got["llama.cpp"] - got["dasllama"]).max(axis=1)
                ok = not diff.any()
                failed += not ok
                print(f"{name:5} {arch:7} {'identical' if ok else 'DIFFERS'}  max |d| per step {diff}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
