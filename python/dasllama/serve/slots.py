"""llama-server's slot actions (`POST /slots/N?action=save|restore|erase`, `--slot-save-path`)
over dasllama's prefix cache.

dasllama has no fixed slots: any stream serves any request, and what a finished request leaves
behind (its prompt and reply, as K/V pages) goes to the shared prefix cache, where the next request
with the same beginning picks it up. A slot's state is therefore the token sequence it last
served: `save` writes those tokens to a file (with the model's vocabulary fingerprint), `restore`
reads them and evaluates them once, so their K/V pages are in the prefix cache for the requests
that follow (a recompute where llama-server copies K/V tensors: the same later answers, never a
different one), and `erase` forgets the slot's tokens and empties the prefix cache. A file saved
from a model with another vocabulary is refused, naming both.

File format (little-endian): b"DASLSLOT", u32 version (1), u32 header length, the header as UTF-8
JSON (model file name, architecture, vocabulary size and SHA-256), u32 token count, the token ids
as u32.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import time
from pathlib import Path
from typing import Any

from ..session import SamplingParams
from .app import ApiError, Job, Server
from .engine import Engine

MAGIC = b"DASLSLOT"
VERSION = 1
# llama.cpp's fs_validate_filename, in short: a plain file name, no directories, no traversal.
FILENAME = re.compile(r"[^/\\\x00-\x1f:*?\"<>|]{1,255}")


def vocab_fingerprint(eng: Engine) -> dict[str, Any]:
    """What makes token ids mean the same text: the vocabulary, hashed once per engine."""
    fp = getattr(eng, "_slot_fingerprint", None)
    if fp is None:
        m = eng.m
        tokens = m.metadata.get("tokenizer.ggml.tokens") or []
        digest = hashlib.sha256("\x00".join(str(t) for t in tokens).encode("utf-8", "surrogatepass")).hexdigest()
        fp = {"model": m.path.name, "arch": m.arch, "n_vocab": m.n_vocab, "vocab_sha256": digest}
        eng._slot_fingerprint = fp  # type: ignore[attr-defined]
    return fp


def encode_file(fp: dict[str, Any], tokens: list[int]) -> bytes:
    head = json.dumps(fp, sort_keys=True).encode()
    return MAGIC + struct.pack("<II", VERSION, len(head)) + head + struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens)


def decode_file(raw: bytes, name: str) -> tuple[dict[str, Any], list[int]]:
    if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + 8:
        raise ApiError(400, f"'{name}' is not a dasllama slot file (it does not start with {MAGIC!r})", param="filename")
    version, hlen = struct.unpack_from("<II", raw, len(MAGIC))
    if version != VERSION:
        raise ApiError(400, f"'{name}' is a slot file of version {version}; this server reads version {VERSION}", param="filename")
    at = len(MAGIC) + 8
    try:
        fp = json.loads(raw[at : at + hlen])
        (n,) = struct.unpack_from("<I", raw, at + hlen)
        tokens = list(struct.unpack_from(f"<{n}I", raw, at + hlen + 4))
    except (ValueError, struct.error):
        raise ApiError(400, f"'{name}' is a truncated or damaged slot file", param="filename") from None
    return fp, tokens


class Slots:
    """The slot actions over one Server; the token sequences each slot last served, per model."""

    def __init__(self, server: Server, save_path: str | None) -> None:
        self.server = server
        self.save_path = Path(save_path).expanduser() if save_path else None
        self.held: dict[tuple[str, int], list[int]] = {}

    def record(self, eng: Engine, id_slot: Any, tokens: list[int]) -> None:
        """A finished request's prompt and reply, as the slot it asked for (slot 0 if none)."""
        slot = id_slot if isinstance(id_slot, int) and not isinstance(id_slot, bool) and 0 <= id_slot < eng.max_streams else 0
        self.held[(eng.name, slot)] = list(tokens)

    def _path(self, body: dict[str, Any]) -> tuple[str, Path]:
        name = body.get("filename")
        if not isinstance(name, str) or not FILENAME.fullmatch(name) or name in (".", ".."):
            raise ApiError(400, "Invalid filename: give a plain file name ('filename'), no directories", param="filename")
        assert self.save_path is not None
        return name, self.save_path / name

    async def action(self, eng: Engine, id_slot: int, action: str | None, body: dict[str, Any]) -> dict[str, Any]:
        if self.save_path is None:
            raise ApiError(501, "This server does not support slots action. Start it with `--slot-save-path`", code="not_supported")
        if not 0 <= id_slot < eng.max_streams:
            raise ApiError(400, f"Invalid slot ID: {id_slot} (this server has slots 0-{eng.max_streams - 1})", param="id_slot")
        t0 = time.monotonic()
        if action == "save":
            name, path = self._path(body)
            tokens = self.held.get((eng.name, id_slot), [])
            data = encode_file(vocab_fingerprint(eng), tokens)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            return {"id_slot": id_slot, "filename": name, "n_saved": len(tokens), "n_written": len(data), "timings": {"save_ms": (time.monotonic() - t0) * 1000}}
        if action == "restore":
            name, path = self._path(body)
            try:
                raw = path.read_bytes()
            except FileNotFoundError:
                raise ApiError(404, f"no slot file '{name}' in --slot-save-path", param="filename") from None
            fp, tokens = decode_file(raw, name)
            mine = vocab_fingerprint(eng)
            if fp.get("vocab_sha256") != mine["vocab_sha256"] or fp.get("n_vocab") != mine["n_vocab"]:
                raise ApiError(
                    400,
                    f"'{name}' was saved from {fp.get('model')} ({fp.get('arch')}, a vocabulary of {fp.get('n_vocab')}), whose tokens mean other text than "
                    f"{mine['model']}'s ({mine['arch']}, {mine['n_vocab']}): restore it on a server of that model",
                    param="filename",
                )
            await self._prefill(eng, tokens)
            self.held[(eng.name, id_slot)] = tokens
            return {"id_slot": id_slot, "filename": name, "n_restored": len(tokens), "n_read": len(raw), "timings": {"restore_ms": (time.monotonic() - t0) * 1000}}
        if action == "erase":
            n = len(self.held.pop((eng.name, id_slot), []))
            eng.clear_prefix_cache()
            return {"id_slot": id_slot, "n_erased": n}
        raise ApiError(400, "Invalid action: use save, restore or erase", param="action")

    async def _prefill(self, eng: Engine, tokens: list[int]) -> None:
        """Evaluate `tokens` once so that their K/V pages go to the prefix cache."""
        ctx = int(eng.m.config["seq_len"])
        if len(tokens) < 2:
            return
        if len(tokens) >= ctx:
            raise ApiError(400, f"the slot file holds {len(tokens)} tokens; this server's context is {ctx}", param="filename")
        job = Job(eng, tokens, SamplingParams(), 1, [], [], [], 1, 0, None, False, False)
        rid, sub = await self.server.start(job, 0)
        async for _ in self.server.events(job, rid, sub):
            pass
