"""Reading a GGUF file's header: metadata, tensor table, tokenizer.

The weights themselves are memory-mapped by the Rust core; this module only reads the header.
Enumerations and block sizes come from the ``gguf`` package; the parser itself is a direct reader
because ``gguf.GGUFReader`` builds one NumPy view per vocabulary entry and takes ~10 s on a
262k-token vocabulary, where this takes a fraction of a second.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ._native import GgufError

SUPPORTED_VERSIONS = (2, 3)

_SCALAR = {
    GGUFValueType.UINT8: ("<B", 1),
    GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4),
    GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4),
    GGUFValueType.BOOL: ("<?", 1),
    GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
}
_NUMPY = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}


@dataclass
class TensorEntry:
    name: str
    type_id: int
    shape: list[int]  # GGUF order: the contiguous dimension first
    offset: int  # absolute, in bytes
    nbytes: int


@dataclass
class GgufHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorEntry] = field(default_factory=list)
    data_offset: int = 0


class _Cursor:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int, what: str) -> None:
        if self.pos + n > len(self.buf):
            raise GgufError(
                f"{self.path}: truncated header while reading {what} (byte {self.pos} of {len(self.buf)}); "
                "the file is incomplete: download it again"
            )

    def scalar(self, fmt: str, size: int, what: str) -> Any:
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self, what: str) -> str:
        n = self.scalar("<Q", 8, what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str) -> Any:
        try:
            vt = GGUFValueType(vtype)
        except ValueError:
            raise GgufError(f"{self.path}: metadata '{key}' has unknown value type {vtype}") from None
        if vt == GGUFValueType.STRING:
            return self.string(key)
        if vt == GGUFValueType.ARRAY:
            et = self.scalar("<I", 4, key)
            count = self.scalar("<Q", 8, key)
            try:
                et_v = GGUFValueType(et)
            except ValueError:
                raise GgufError(f"{self.path}: metadata array '{key}' has unknown element type {et}") from None
            if et_v == GGUFValueType.STRING:
                return [self.string(key) for _ in range(count)]
            if et_v == GGUFValueType.ARRAY:
                return [self.value(GGUFValueType.ARRAY, key) for _ in range(count)]
            size = _SCALAR[et_v][1] * count
            self.need(size, key)
            arr = np.frombuffer(self.buf, dtype=_NUMPY[et_v], count=count, offset=self.pos).copy()
            self.pos += size
            return arr
        fmt, size = _SCALAR[vt]
        return self.scalar(fmt, size, key)


def read_header(path: str | os.PathLike[str]) -> GgufHeader:
    """Parse the header of ``path``; raise :class:`GgufError` naming the file and the problem."""
    p = Path(path)
    if not p.exists():
        raise GgufError(f"{p}: no such file; pass a path to a .gguf file or a known model name (see dasllama.fetch)")
    if not p.is_file():
        raise GgufError(f"{p}: not a regular file")
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(4)
        if head != b"GGUF":
            raise GgufError(f"{p}: not a GGUF file (it starts with {head!r}, not b'GGUF')")
        f.seek(0)
        # The header is at most a few tens of MB (vocabularies); read it, not the weights.
        data = f.read(min(size, 256 << 20))
    cur = _Cursor(memoryview(data), p)
    cur.pos = 4
    version = cur.scalar("<I", 4, "version")
    if version not in SUPPORTED_VERSIONS:
        raise GgufError(f"{p}: GGUF version {version} is not supported (supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
    n_tensors = cur.scalar("<Q", 8, "tensor count")
    n_kv = cur.scalar("<Q", 8, "metadata count")
    if n_tensors > 1 << 20 or n_kv > 1 << 20:
        raise GgufError(f"{p}: implausible header ({n_tensors} tensors, {n_kv} metadata entries): the file is corrupt")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        vtype = cur.scalar("<I", 4, f"type of '{key}'")
        meta[key] = cur.value(vtype, key)
    infos = []
    for i in range(n_tensors):
        name = cur.string(f"tensor {i} name")
        n_dims = cur.scalar("<I", 4, f"tensor '{name}' rank")
        if n_dims > 4:
            raise GgufError(f"{p}: tensor '{name}' has {n_dims} dimensions (at most 4)")
        shape = [cur.scalar("<Q", 8, f"tensor '{name}' shape") for _ in range(n_dims)]
        type_id = cur.scalar("<I", 4, f"tensor '{name}' type")
        offset = cur.scalar("<Q", 8, f"tensor '{name}' offset")
        infos.append((name, shape, type_id, offset))
    align = int(meta.get("general.alignment", 32))
    data_offset = (cur.pos + align - 1) // align * align
    tensors = []
    for name, shape, type_id, offset in infos:
        try:
            qt = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[qt]
        except (ValueError, KeyError):
            raise GgufError(f"{p}: tensor '{name}' has unknown tensor type id {type_id}") from None
        n = int(np.prod(shape)) if shape else 1
        if shape and shape[0] % block:
            raise GgufError(f"{p}: tensor '{name}' row of {shape[0]} values is not a whole number of {qt.name} blocks")
        nbytes = n // block * type_size
        start = data_offset + offset
        if start + nbytes > size:
            raise GgufError(
                f"{p}: tensor '{name}' needs bytes {start}..{start + nbytes} but the file has {size}: "
                "the file is truncated; download it again"
            )
        tensors.append(TensorEntry(name, type_id, shape, start, nbytes))
    return GgufHeader(p, version, meta, tensors, data_offset)


def _plain(v: Any) -> Any:
    """A metadata value as plain Python (numpy arrays and scalars converted)."""
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def meta_section(meta: dict[str, Any], name: str) -> dict[str, Any]:
    """The ``<name>.`` keys of a header's metadata without their prefix, as plain Python with
    their types as the file stores them (``<arch>.`` for a model, ``clip.`` for a projector)."""
    prefix = name + "."
    return {k[len(prefix) :]: _plain(v) for k, v in meta.items() if k.startswith(prefix)}
