"""`logit_bias` as OpenAI and llama-server take it: an object mapping a token id (as a string key)
to a bias, or llama-server's list of [token, bias] pairs; a key that is not an integer is text,
whose tokens all get the bias. A bias of false (llama-server) or -100 or less (OpenAI's "ban")
means never: the token's logit becomes -inf. The sampler adds the biases before its chain.
Bad input raises ValueError naming what is wrong; the routes answer it with a 400."""

from __future__ import annotations

import math
from typing import Any

from ..model import encode

# OpenAI's range: -100 bans a token, 100 all but forces it.
BAN = -100.0


def _bias(v: Any, param: str) -> float | None:
    """A bias value; None for an entry llama-server skips (true, or not a number)."""
    if v is False:
        return -math.inf
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    b = float(v)
    if math.isnan(b) or b == math.inf:
        raise ValueError(f"'{param}' biases must be finite numbers (or false to ban a token), got {v}")
    return -math.inf if b <= BAN else b


def _tokens(m: Any, key: Any, param: str) -> list[int]:
    if isinstance(key, int) and not isinstance(key, bool):
        tok = key
    elif isinstance(key, str):
        try:
            tok = int(key, 10)
        except ValueError:
            return encode(m, key, add_bos=False) if key else []
    else:
        raise ValueError(f"'{param}' keys must be token ids or text, got {type(key).__name__}")
    if not 0 <= tok < m.n_vocab:
        raise ValueError(f"'{param}' names token id {tok}, out of range for a vocabulary of {m.n_vocab}")
    return [tok]


def parse_logit_bias(m: Any, value: Any, param: str = "logit_bias") -> tuple[tuple[int, float], ...]:
    """The (token id, bias) pairs a request's `logit_bias` asks for, in order (a later entry for
    the same token adds to an earlier one, as llama.cpp's sampler applies them)."""
    if value is None:
        return ()
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = []
        for i, el in enumerate(value):
            if not isinstance(el, list) or len(el) != 2:
                raise ValueError(f"'{param}[{i}]' must be a [token, bias] pair")
            items.append((el[0], el[1]))
    else:
        raise ValueError(f"'{param}' must be an object mapping token ids to biases, or a list of [token, bias] pairs")
    out: list[tuple[int, float]] = []
    for key, v in items:
        b = _bias(v, param)
        if b is None:
            continue
        out += [(t, b) for t in _tokens(m, key, param)]
    return tuple(out)


def format_logit_bias(pairs: tuple[tuple[int, float], ...]) -> list[dict[str, Any]]:
    """llama-server's `generation_settings.logit_bias`: -inf is written as null."""
    return [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in pairs]
