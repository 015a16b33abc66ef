"""The sampling settings a request gets when it names none, as llama.cpp chooses them.

In order of precedence: what the request says; what the server was started with (``--temp``,
``--top-k``, ...); the model file's recommended values (the ``general.sampling.*`` keys llama.cpp's
``convert_hf_to_gguf.py`` writes from a model's ``generation_config.json``); llama-server's own
defaults (``LLAMA_SERVER``). The Python API's ``SamplingParams()`` stays greedy: these are for
front ends (the HTTP server), where a person expects a model to sample as its makers meant.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .session import SamplingParams

log = logging.getLogger("dasllama")


@dataclass(frozen=True)
class SamplingDefaults:
    """Default sampling settings and where each came from (``sources``: field -> "request",
    "flag", "model file" or "llama-server default")."""

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    penalty_last_n: int = 64
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def params(self) -> SamplingParams:
        """These settings as the engine's ``SamplingParams`` (no seed)."""
        return SamplingParams(temp=self.temp, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, penalty=self.repeat_penalty, penalty_last_n=self.penalty_last_n)

    def as_dict(self) -> dict[str, Any]:
        """The values under the names OpenAI-style requests use, plus where each came from."""
        return {
            "temperature": self.temp,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repetition_penalty": self.repeat_penalty,
            "penalty_last_n": self.penalty_last_n,
            "sources": dict(self.sources),
        }


# llama-server's defaults (common/common.h, common_params_sampling): temp 0.8, top_k 40,
# top_p 0.95, min_p 0.05, repeat_penalty 1.0 over the last 64 tokens.
LLAMA_SERVER = SamplingDefaults()
VALUE_FIELDS = ("temp", "top_k", "top_p", "min_p", "repeat_penalty", "penalty_last_n")

# field -> (GGUF key, type, lowest, highest): the keys llama.cpp reads (llama-arch.cpp,
# LLM_KV_GENERAL_SAMPLING_*), with the ranges its sampler takes.
GGUF_KEYS: dict[str, tuple[str, type, float, float]] = {
    "temp": ("general.sampling.temp", float, 0.0, math.inf),
    "top_k": ("general.sampling.top_k", int, 0, math.inf),
    "top_p": ("general.sampling.top_p", float, 0.0, 1.0),
    "min_p": ("general.sampling.min_p", float, 0.0, 1.0),
    "repeat_penalty": ("general.sampling.penalty_repeat", float, 0.0, math.inf),
    "penalty_last_n": ("general.sampling.penalty_last_n", int, -1, math.inf),
}


def from_metadata(metadata: Mapping[str, Any]) -> dict[str, float | int]:
    """The recommended sampling values a GGUF's metadata carries (``general.sampling.*``), by
    field name; a value of the wrong type or out of range is left out, with a warning."""
    out: dict[str, float | int] = {}
    for name, (key, kind, lo, hi) in GGUF_KEYS.items():
        if key not in metadata:
            continue
        v = metadata[key]
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi
        if ok and kind is int and isinstance(v, float):
            ok = v.is_integer()
        if not ok:
            log.warning("ignoring %s = %r in the model file: not a %s in [%g, %g]", key, v, kind.__name__, lo, hi)
            continue
        # float32 in the file: 0.95 reads back as 0.949999988; six digits are what was meant.
        out[name] = int(v) if kind is int else float(f"{v:.6g}")
    return out


def sampling_defaults(metadata: Mapping[str, Any], flags: Mapping[str, float | int | None] | None = None) -> SamplingDefaults:
    """The defaults for a model: ``flags`` (a server's ``--temp`` etc., None where not given) over
    the file's ``general.sampling.*`` over llama-server's defaults."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    file_values = from_metadata(metadata)
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    unknown = set(given) - set(VALUE_FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling settings {sorted(unknown)}; known: {', '.join(VALUE_FIELDS)}")
    for f in fields(SamplingDefaults):
        if f.name not in VALUE_FIELDS:
            continue
        if f.name in given:
            values[f.name], sources[f.name] = given[f.name], "flag"
        elif f.name in file_values:
            values[f.name], sources[f.name] = file_values[f.name], "model file"
        else:
            values[f.name], sources[f.name] = getattr(LLAMA_SERVER, f.name), "llama-server default"
    return replace(LLAMA_SERVER, **values, sources=sources)


def describe(d: SamplingDefaults) -> str:
    """One line for a start-up log: each value and, when it is not llama-server's, where from."""
    parts = []
    for name in VALUE_FIELDS:
        src = d.sources.get(name, "llama-server default")
        parts.append(f"{name} {getattr(d, name):g}" + ("" if src == "llama-server default" else f" ({src})"))
    return ", ".join(parts)
