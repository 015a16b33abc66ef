"""Write tests/golden/gemma4.json: llama.cpp's tokenization of strings and its rendering of Gemma
4's chat template (tests/golden/gemma4_chat_template.jinja, llama.cpp's
models/templates/google-gemma-4-31B-it.jinja) on the synthetic Gemma 4 vocabulary of
tests/gemma4_vocab.py, for tests/test_gemma4_chat.py.

Needs two things from the llama-cpp-python 0.3.36 sdist (its vendored llama.cpp is the reference):
its Python package built in an environment of its own (see scripts/make_family_goldens.py), and
llama.cpp's Jinja engine (common/jinja), which that package does not build, compiled into a small
driver that renders a template as common_chat_template_direct_apply_impl does (enable_thinking
always defined, add_generation_prompt only when true): scripts/llama_jinja_render.cpp, built with

    V=<sdist>/vendor/llama.cpp; L=<llama_cpp package>/lib
    g++ -std=c++17 -O1 -I$V/common -I$V/vendor -I$V/include -I$V/ggml/include scripts/llama_jinja_render.cpp \\
        $V/common/jinja/*.cpp $V/common/unicode.cpp $V/common/json.cpp -L$L -lggml-base -o render

    /tmp/llamacpp/bin/python scripts/make_gemma4_goldens.py --render /path/to/render

Each render is llama.cpp's prompt: the template's text with the leading BOS text cut (llama.cpp
cuts it when the vocabulary adds BOS, as Gemma 4's does), and its ids are llama.cpp's tokenization
of that text with BOS added and special tokens parsed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from gemma4_vocab import TEMPLATE_PATH, TOKENS, write_gemma4_vocab_model  # noqa: E402

TEXTS = [
    "Hello world",
    " Hello world",
    "Hello  world",
    "hello\n\nworld\n",
    "\t\ttabs and  spaces   ",
    "1234567890",
    "3.14159 and 2,718",
    "It's I'll we're they've",
    "CamelCaseIdentifier snake_case_name",
    "naïve café résumé",
    "日本語のテキスト",
    "emoji 🦙🚀 and ☕",
    "Привет, мир!",
    "def f(x):\n    return x**2  # square",
    "https://example.com/path?q=1&r=2",
    "   leading spaces",
    "trailing spaces   ",
    "",
    " ",
    "\n",
    "\n\n\n\n\n\n",
    "a\n\n\n\nb\n \n",
    "!!!???...",
    '{"key": [1, 2, {"nested": null}]}',
    "αβγ δεζ",
    "mixed 中文 and English",
    "The capital of France is Paris.",
    "<|turn>user\nhi<turn|>\n<|turn>model\n",
    "<|channel>thought\nhm<channel|>Hello",
    "a<turn|>b<|think|>c <|\"|>d",
    "<bos>text<eos>",
]

SYSTEM = {"role": "system", "content": "You are a concise assistant."}
USER = {"role": "user", "content": "What is the capital of France?"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}}, "required": ["city"]},
        },
    }
]
CHATS: list[dict] = [
    {"messages": [USER]},
    {"messages": [SYSTEM, USER]},
    {"messages": [{"role": "user", "content": "  hi  "}, {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "more"}]},
    {"messages": [SYSTEM, USER, {"role": "assistant", "content": "<|channel>thought\nFrance, so Paris.<channel|>Paris."}, {"role": "user", "content": "And Spain?"}]},
    {"messages": [USER, {"role": "assistant", "content": "Paris."}], "add_generation_prompt": False},
    {"messages": [SYSTEM, USER], "tools": TOOLS},
    {
        "messages": [
            USER,
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "get_time", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "c0", "content": "12:00"},
        ],
        "tools": TOOLS,
    },
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--render", required=True, help="the llama.cpp Jinja driver (see the docstring)")
    ap.add_argument("--out", default=str(ROOT / "tests" / "golden" / "gemma4.json"))
    args = ap.parse_args()

    from importlib.metadata import version

    import llama_cpp

    template = TEMPLATE_PATH.read_text()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gemma4-vocab.gguf"
        write_gemma4_vocab_model(path, template)
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)

        def tok(text: str, add_bos: bool, special: bool) -> list[int]:
            return [int(t) for t in llm.tokenize(text.encode(), add_bos=add_bos, special=special)]

        tokenize = [{"text": t, "ids": tok(t, False, False), "ids_special": tok(t, False, True)} for t in TEXTS]
        renders = []
        for chat in CHATS:
            for thinking in (False, True):
                gen = chat.get("add_generation_prompt", True)
                req = {"messages": chat["messages"], "add_generation_prompt": gen, "enable_thinking": thinking, "bos_token": "<bos>", "eos_token": "<eos>"}
                if "tools" in chat:
                    req["tools"] = chat["tools"]
                text = subprocess.run([args.render, str(TEMPLATE_PATH)], input=json.dumps(req), capture_output=True, text=True, check=True).stdout
                assert text.startswith("<bos>"), text[:40]
                prompt = text[len("<bos>") :]
                renders.append({**{k: v for k, v in req.items() if k not in ("bos_token", "eos_token")}, "prompt": prompt, "prompt_ids": tok(prompt, True, True)})
    doc = {
        "made_with": f"llama-cpp-python {version('llama-cpp-python')} (vendored llama.cpp: libllama's tokenizer, common/jinja for the template)",
        "vocab_sha256": hashlib.sha256("\n".join(TOKENS).encode()).hexdigest(),
        "template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "tokenize": tokenize,
        "renders": renders,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}: {len(tokenize)} strings, {len(renders)} renders")


if __name__ == "__main__":
    main()
