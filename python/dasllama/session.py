"""Sessions, evaluation, sampling and generation."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import _native
from .model import Model

Session = _native.Session
BatchWorkspace = _native.BatchWorkspace
KvPool = _native.KvPool


class KVDtype(enum.Enum):
    """How KV values are stored: f16 (llama.cpp's default cache), q8_0 (32-value i8 blocks with an
    f16 scale, about half the bytes) or tq4 (each head sign-flipped and Walsh-Hadamard rotated,
    then 4-bit blocks: a quarter of f16; needs a power-of-two head size). q8_0 and tq4 need a pool."""

    f16 = "f16"
    q8_0 = "q8_0"
    tq4 = "tq4"


def check_kv_dtype(kv_dtype: KVDtype | str) -> str:
    try:
        return KVDtype(kv_dtype).value
    except ValueError:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; use one of {[k.value for k in KVDtype]}") from None


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings, applied as llama.cpp's default chain: penalties, top-k, top-p, min-p,
    temperature, then the draw. The defaults are greedy."""

    temp: float = 0.0  # <= 0: greedy argmax
    top_k: int = 0  # <= 0: off
    top_p: float = 1.0  # >= 1: off
    min_p: float = 0.0  # <= 0: off
    penalty: float = 1.0  # repetition penalty (1: off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64  # window of recent sampled tokens the penalties see (-1: all)
    seed: int | None = None  # reseed the session's RNG at the start of generate
    # (token id, bias) pairs added to the logits before the chain (llama.cpp's and OpenAI's
    # logit_bias); -inf bans a token. Token ids outside the vocabulary are ignored.
    logit_bias: tuple[tuple[int, float], ...] = ()

    def _native(self) -> _native.Params:
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        return _native.make_params(
            float(self.temp),
            int(self.top_k),
            float(self.top_p),
            float(self.min_p),
            float(self.penalty),
            float(self.presence_penalty),
            float(self.frequency_penalty),
            int(self.penalty_last_n),
            self.seed,
            [(int(t), float(b)) for t, b in self.logit_bias],
        )


def create_session(m: Model, pool: KvPool | None = None) -> Session:
    """A new conversation on ``m``: its KV pages come from ``pool``, or are its own (grown on demand)."""
    return _native.create_session(m._native, pool)


def create_kv_pool(m: Model, page_rows: int = 64, kv_dtype: KVDtype = KVDtype.f16, max_pages: int | None = None) -> KvPool:
    """A paged KV pool: pages of ``page_rows`` positions for every layer, taken on demand by the
    sessions created over it and returned by :func:`release_kv_pages`. ``max_pages`` bounds it
    (default: room for eight full-context sessions); pages are allocated only when first written."""
    codec = check_kv_dtype(kv_dtype)
    if page_rows < 1:
        raise ValueError(f"page_rows must be at least 1, got {page_rows}")
    if max_pages is None:
        max_pages = 8 * -(-int(m.config["seq_len"]) // page_rows)
    if max_pages < 1:
        raise ValueError(f"max_pages must be at least 1, got {max_pages}")
    return _native.create_kv_pool(m._native, page_rows, max_pages, codec)


def release_kv_pages(s: Session) -> None:
    """Give the session's KV pages back to its pool; it starts over at position 0."""
    _native.release_kv_pages(s)


def gpu_dn_room(n: int) -> None:
    """Say how many streams' recurrent (DeltaNet) state a GPU driver should keep resident at
    once, before the first prefill of a hand-rolled batch over a hybrid (qwen35, qwen3next), so
    that no stream's state is evicted under the batched step it rides. On the CPU a session's
    recurrent state lives in the session itself (sized per stream, freed with it), so there is no
    cache to size and the call does nothing; a driver without such a cache ignores it too.
    ``create_scheduler`` needs no such call for its own streams."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"gpu_dn_room needs a stream count >= 0, got {n!r}")


def kv_pool_stats(pool: KvPool) -> dict[str, int]:
    """pages_total / free / used / shared / cached, bytes_per_page, bytes_allocated, cache_chains, cache_hits."""
    return _native.kv_pool_stats(pool)


def eval(m: Model, s: Session, ids: list[int]) -> np.ndarray:
    """Run ``ids`` at the session's position; return float32 logits after the last one."""
    return _native.eval(m._native, s, list(ids))


def eval_all(m: Model, s: Session, ids: list[int]) -> np.ndarray:
    """Run ``ids`` and return a ``(len(ids), n_vocab)`` float32 array: row i holds the logits after
    ``ids[i]``, exactly what evaluating the ids one at a time gives (a speculative verify chunk)."""
    return _native.eval_all(m._native, s, list(ids))


def create_batch_workspace(m: Model) -> BatchWorkspace:
    """Scratch buffers for :func:`eval_batch`, reused across steps."""
    return _native.create_batch_workspace(m._native)


def eval_batch(m: Model, ws: BatchWorkspace, sessions: list[Session], tokens: list[int]) -> np.ndarray:
    """Advance ``sessions[i]`` by ``tokens[i]``, all in one pass over the weights.

    Returns float32 logits of shape (len(sessions), vocab); each row is bit-identical to what
    :func:`eval` gives that session alone, and is also left in the session for :func:`sample`.
    """
    return _native.eval_batch(m._native, ws, list(sessions), list(tokens))


def sample(s: Session, params: SamplingParams = SamplingParams()) -> int:
    """Pick the next token from the session's logits."""
    return _native.sample(s, params._native())


def generate(
    m: Model,
    s: Session,
    ids: list[int],
    params: SamplingParams = SamplingParams(),
    max_new: int = 128,
    on_piece: Callable[[int, str], bool | None] | None = None,
) -> list[int]:
    """Prefill ``ids`` and sample up to ``max_new`` tokens, stopping after an end-of-generation token.

    ``on_piece(id, text)`` streams each token's text (never half a UTF-8 character); return False
    to stop. Returns the generated ids (the end-of-generation token included when reached).
    """
    return _native.generate(m._native, s, list(ids), params._native(), int(max_new), on_piece)
