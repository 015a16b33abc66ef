"""Every kind of bad file raises the documented dasllama exception, naming the file and the problem."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from synthetic import write_model

import dasllama as dl


@pytest.fixture()
def good(tmp_path: Path) -> Path:
    p = tmp_path / "good.gguf"
    write_model(p)
    dl.load_model(p)  # the baseline loads
    return p


def test_missing(tmp_path: Path) -> None:
    with pytest.raises(dl.GgufError, match="no such file"):
        dl.load_model(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(b"hello world, not a model")
    with pytest.raises(dl.GgufError, match="not a GGUF file") as e:
        dl.load_model(p)
    assert str(p) in str(e.value)


def test_truncated_header(good: Path) -> None:
    good.write_bytes(good.read_bytes()[:300])
    with pytest.raises(dl.GgufError, match="truncated header"):
        dl.load_model(good)


def test_truncated_data(good: Path) -> None:
    data = good.read_bytes()
    good.write_bytes(data[: len(data) - 4096])
    with pytest.raises(dl.GgufError, match="truncated"):
        dl.load_model(good)


def test_bad_version(good: Path) -> None:
    data = bytearray(good.read_bytes())
    data[4:8] = struct.pack("<I", 99)
    good.write_bytes(bytes(data))
    with pytest.raises(dl.GgufError, match="version 99"):
        dl.load_model(good)


def test_unknown_tensor_type(good: Path) -> None:
    data = bytearray(good.read_bytes())
    name = b"output_norm.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    data[at + 4 + 8 * n_dims : at + 8 + 8 * n_dims] = struct.pack("<I", 77)
    good.write_bytes(bytes(data))
    with pytest.raises(dl.GgufError, match="unknown tensor type id 77"):
        dl.load_model(good)


def test_missing_tensor(tmp_path: Path) -> None:
    p = tmp_path / "m.gguf"
    write_model(p, drop="blk.1.ffn_up.weight")
    with pytest.raises(dl.GgufError, match="blk.1.ffn_up.weight.*missing"):
        dl.load_model(p)


def test_unsupported_architecture(tmp_path: Path) -> None:
    p = tmp_path / "a.gguf"
    write_model(p, arch="mamba")
    with pytest.raises(dl.UnsupportedModelError, match="architecture 'mamba' is not supported"):
        dl.load_model(p)


def test_bad_quant_mode(good: Path) -> None:
    with pytest.raises(ValueError):
        dl.load_model(good, "q3")


def test_exception_tree() -> None:
    for e in (dl.GgufError, dl.UnsupportedModelError, dl.ContextOverflowError, dl.FetchError, dl.TemplateError):
        assert issubclass(e, dl.DasllamaError)
