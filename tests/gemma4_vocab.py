"""A synthetic Gemma 4 vocabulary (``tokenizer.ggml.model = gemma4``: SPM-style BPE) and tiny
models that carry it, for the tokenizer, chat template and thinking tests and their goldens
(scripts/make_gemma4_goldens.py).

The vocabulary is built deterministically: Gemma 4's special tokens, the 256 ``<0xXX>`` byte
tokens, a small alphabet (``▁`` for the space; some characters left out so that text falls back
to bytes), newline runs, and merges learned by plain BPE training on a fixed corpus, so merges
chain and compete as a real file's do.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<|turn>",
    "<turn|>",
    "<|think|>",
    "<|channel>",
    "<channel|>",
    "<|tool>",
    "<tool|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    '<|"|>',
    "<|image|>",
    "<|audio|>",
]
# Not in the alphabet, so they tokenize as <0xXX> bytes: some accents, CJK, emoji, Cyrillic.
ALPHABET = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"()[]{}<>=+-*/_#&%$@|\\^`~\t") | {"\u2581", "é", "ï", "中", "文", "α", "β"})
NEWLINES = ["\n", "\n\n", "\n\n\n", "\n\n\n\n"]
CORPUS = """What is the capital of France? The capital of France is Paris.
You are a concise assistant. Answer the question in one sentence.
system user model thought thinking tool call response the a cat sat on the mat
def f(x): return x**2 # square of x; print(f(3)) and snake_case_name CamelCaseIdentifier
Hello world! hello there, how are you? I'm fine, thanks. It's what we're doing and they've done.
The quick brown fox jumps over the lazy dog. 1234567890 3.14159 and 2,718
{"key": [1, 2, {"nested": null}]} https://example.com/path?q=1&r=2 x=1;y=2;z=x+y
naïve café résumé mixed 中文 and English αβγ
thought
thought
thought
"""
N_MERGES = 260


def _train_merges() -> list[tuple[str, str]]:
    """Plain BPE: repeatedly merge the most frequent adjacent pair (ties: first seen) over the
    corpus's words (each but a line's first with its ``▁``), symbols starting as characters of
    the alphabet."""
    words = []
    for line in CORPUS.splitlines():
        for k, word in enumerate(line.split(" ")):
            words.append([c for c in ("\u2581" if k else "") + word if c in ALPHABET])
    merges: list[tuple[str, str]] = []
    for _ in range(N_MERGES):
        pairs: Counter[tuple[str, str]] = Counter()
        for w in words:
            for a, b in pairwise(w):
                pairs[(a, b)] += 1
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: kv[1])[0]
        merges.append(best)
        joined = best[0] + best[1]
        for k, w in enumerate(words):
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            words[k] = out
    # Newline runs merge too (llama.cpp keeps a run that is one token whole anyway).
    merges += [("\n", "\n"), ("\n\n", "\n\n"), ("\n\n", "\n")]
    return merges


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the synthetic Gemma 4 vocabulary."""
    merges = _train_merges()
    tokens = list(SPECIALS) + [f"<0x{b:02X}>" for b in range(256)] + ALPHABET + NEWLINES
    types = [3] * len(SPECIALS) + [6] * 256 + [1] * (len(ALPHABET) + len(NEWLINES))
    types[SPECIALS.index("<unk>")] = 2
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
            types.append(1)
    return tokens, types, [f"{a} {b}" for a, b in merges]


TOKENS, TYPES, MERGES = vocabulary()
ID = {t: i for i, t in enumerate(TOKENS)}
DIM, HIDDEN, HEADS, KV_HEADS = 16, 32, 2, 1


def write_vocab(w: GGUFWriter, template: str | None) -> None:
    w.add_tokenizer_model("gemma4")
    w.add_tokenizer_pre("gemma4")
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(ID["<bos>"])
    w.add_eos_token_id(ID["<eos>"])
    w.add_pad_token_id(ID["<pad>"])
    w.add_unk_token_id(ID["<unk>"])
    w.add_add_bos_token(True)
    if template is not None:
        w.add_chat_template(template)


def write_gemma4_vocab_model(path: Path, template: str | None = None, script: dict[str, str] | None = None) -> None:
    """A one-layer llama model with the Gemma 4 vocabulary. With ``script`` it continues each
    token with the one the script names (token texts), as tests/synthetic.py's scripted models
    do: its layer adds nothing and its output matrix holds each token's successor's embedding."""
    rng = np.random.default_rng(4)
    n = len(TOKENS)
    w = GGUFWriter(str(path), "llama")
    for k, v in (("block_count", 1), ("context_length", 512), ("embedding_length", DIM), ("feed_forward_length", HIDDEN), ("attention.head_count", HEADS), ("attention.head_count_kv", KV_HEADS)):
        w.add_uint32(f"llama.{k}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    write_vocab(w, template)
    emb = rng.normal(0, 1.0, size=(n, DIM)).astype(np.float32)
    if script is None:
        out = rng.normal(0, 0.5, size=(n, DIM)).astype(np.float32)
    else:
        out = np.zeros((n, DIM), np.float32)
        for a, b in script.items():
            out[ID[b]] += emb[ID[a]]
    hd = DIM // HEADS
    zero = script is not None
    for name, shape in (
        ("token_embd.weight", None),
        ("output.weight", None),
        ("blk.0.attn_q.weight", (HEADS * hd, DIM)),
        ("blk.0.attn_k.weight", (KV_HEADS * hd, DIM)),
        ("blk.0.attn_v.weight", (KV_HEADS * hd, DIM)),
        ("blk.0.attn_output.weight", (DIM, HEADS * hd)),
        ("blk.0.ffn_gate.weight", (HIDDEN, DIM)),
        ("blk.0.ffn_up.weight", (HIDDEN, DIM)),
        ("blk.0.ffn_down.weight", (DIM, HIDDEN)),
    ):
        if name == "token_embd.weight":
            w.add_tensor(name, emb)
        elif name == "output.weight":
            w.add_tensor(name, out)
        else:
            assert shape is not None
            w.add_tensor(name, np.zeros(shape, np.float32) if zero else rng.normal(0, 0.1, size=shape).astype(np.float32))
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, np.ones(DIM, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


TEMPLATE_PATH = Path(__file__).parent / "golden" / "gemma4_chat_template.jinja"
