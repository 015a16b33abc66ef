"""Write tests/golden/gpt4o_tokenizer.json: llama.cpp's token ids for tests/synthetic.py's
GPT4O_TEXTS under the `gpt-4o` pre-tokenizer (gpt-oss's), on write_gpt4o_vocab_model's vocabulary,
for tests/test_tokenizer.py. Run with llama-cpp-python 0.3.36 (see make_family_goldens.py):

    /tmp/llamacpp/bin/python scripts/make_gpt4o_tokenizer_golden.py
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from synthetic import GPT4O_TEXTS, write_gpt4o_vocab_model  # noqa: E402


def main() -> None:
    import llama_cpp

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt4o.gguf"
        write_gpt4o_vocab_model(path)
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        cases = [{"text": t, "ids": llm.tokenize(t.encode(), add_bos=False, special=False)} for t in GPT4O_TEXTS]
        doc = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "made_with": {"llama_cpp_python": llama_cpp.__version__}, "cases": cases}
    (ROOT / "tests" / "golden" / "gpt4o_tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False, indent=None) + "\n")


if __name__ == "__main__":
    main()
