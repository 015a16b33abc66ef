"""Tokenization identical to llama.cpp on every golden string and prompt, for both models, and for
gpt-oss's pre-tokenizer on a synthetic vocabulary."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import dasllama as dl
from dasllama.chat import render_chat
from synthetic import GPT4O_TEXTS, write_gpt4o_vocab_model


@pytest.mark.parametrize("which", ["smollm", "gemma"])
def test_golden_strings(which: str, request: pytest.FixtureRequest) -> None:
    m = request.getfixturevalue(which)
    g = request.getfixturevalue(f"{which}_golden")
    for e in g["tokenize"]:
        assert dl.encode(m, e["text"], add_bos=False) == e["ids"], e["text"]
        assert dl.encode(m, e["text"], add_bos=False, special=True) == e["ids_special"], e["text"]


@pytest.mark.parametrize("which", ["smollm", "gemma"])
def test_golden_prompts(which: str, request: pytest.FixtureRequest) -> None:
    m = request.getfixturevalue(which)
    g = request.getfixturevalue(f"{which}_golden")
    for c in g["cases"]:
        assert dl.encode(m, c["prompt"], special=True) == c["prompt_ids"], c["prompt"]


def test_chat_template_renders_like_hf(smollm: dl.Model, smollm_golden: dict) -> None:
    chats = [c for c in smollm_golden["cases"] if c["kind"] == "chat"]
    assert chats
    for c in chats:
        assert render_chat(smollm, c["messages"]) == c["prompt"]


def test_base_model_without_template_is_a_clear_error(gemma: dl.Model) -> None:
    with pytest.raises(dl.TemplateError, match="no chat template"):
        render_chat(gemma, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("which", ["smollm", "gemma"])
def test_round_trip(which: str, request: pytest.FixtureRequest) -> None:
    m = request.getfixturevalue(which)
    g = request.getfixturevalue(f"{which}_golden")
    for e in g["tokenize"]:
        assert dl.decode(m, dl.encode(m, e["text"], add_bos=False)) == e["text"]


def test_bos_follows_the_model(smollm: dl.Model, gemma: dl.Model) -> None:
    assert dl.encode(gemma, "hi")[0] == gemma.bos_id
    assert dl.encode(gemma, "hi", add_bos=False)[0] != gemma.bos_id
    assert dl.encode(smollm, "hi")[0] != smollm.bos_id  # SmolLM2 adds no BOS


def test_special_tokens_parse_only_when_asked(smollm: dl.Model) -> None:
    im_start = dl.encode(smollm, "<|im_start|>", special=True)
    assert len(im_start) == 1 and dl.token_piece(smollm, im_start[0]) == ""
    assert len(dl.encode(smollm, "<|im_start|>")) > 1


def test_token_piece_bytes_for_partial_utf8(gemma: dl.Model) -> None:
    ids = dl.encode(gemma, "🙂", add_bos=False)
    pieces = [dl.token_piece(gemma, i) for i in ids]
    joined = b"".join(p if isinstance(p, bytes) else p.encode() for p in pieces)
    assert joined.decode("utf-8") == "🙂"


def test_token_piece_rejects_bad_id(smollm: dl.Model) -> None:
    with pytest.raises(ValueError, match="out of range"):
        dl.token_piece(smollm, smollm.n_vocab)


def test_gpt_4o_pre_tokenizer_matches_llamacpp(tmp_path: Path) -> None:
    # gpt-oss's pre-tokenizer on a byte-level vocabulary with a few merges: llama.cpp's ids
    # (tests/golden/gpt4o_tokenizer.json, scripts/make_gpt4o_tokenizer_golden.py) for text that
    # splits every way it can (case runs, contractions, digit triples, non-ASCII letters).
    g = json.loads((Path(__file__).parent / "golden" / "gpt4o_tokenizer.json").read_text())
    path = tmp_path / "gpt4o.gguf"
    write_gpt4o_vocab_model(path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == g["sha256"], "the file differs from the one llama.cpp read; rerun the script"
    m = dl.load_model(path)
    assert [c["text"] for c in g["cases"]] == GPT4O_TEXTS
    for c in g["cases"]:
        assert dl.encode(m, c["text"], add_bos=False) == c["ids"], c["text"]
        assert dl.decode(m, c["ids"]) == c["text"]
