"""llama.cpp's own sampler chain run over seeded logits, written to `tests/golden/sampler_chain.json`
for `tests/test_sampling_chain.py` to hold dasllama's sampler to.

The chain is llama.cpp's default (common/sampling.cpp) restricted to the samplers dasllama has:
penalties, top-k, top-p, min-p, temperature, then `dist`, built through the C API
(`llama_sampler_chain_init` and `llama_sampler_init_*`, `min_keep` 0 as in common's defaults) of
the llama.cpp that llama-cpp-python 0.3.36 vendors, loaded with ctypes. Each of 20 logit vectors
(vocabularies of 128 to 3,000 tokens: spread, peaked, flat, tied) gets a token history through
`llama_sampler_accept`, then each of 12 settings is applied with `llama_sampler_apply`. `dist`
softmaxes the survivors into `p` before it draws; those `p` are what is recorded, so the draw
itself (a seeded mt19937, not dasllama's RNG) plays no part.

    pip install cmake ninja numpy           # if missing; a C++ compiler is needed too
    python scripts/make_sampler_goldens.py  # builds libllama once (minutes), then writes the JSON
    python scripts/make_sampler_goldens.py --lib-dir DIR  # reuse a shared build's .so files

The build (shared libraries, `-DGGML_NATIVE=OFF`, the `llama` target only) is cached in
`~/.cache/dasllama/llama.cpp/libllama-<version>`. The output is deterministic: the logits come from
a seeded generator and are stored in the file, so the test needs neither numpy's generator nor
llama.cpp.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import shutil
import tempfile
from pathlib import Path

import numpy as np
from build_llama_cpp import run, vendored_sources

log = logging.getLogger("make_sampler_goldens")

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests/golden/sampler_chain.json"
LIBS = ("libggml-base.so", "libggml-cpu.so", "libggml.so", "libllama.so")

# One entry per sampler setting; absent keys take SamplingParams' defaults (temp 0, top_k 0,
# top_p 1, min_p 0, no penalties, penalty_last_n 64).
SETTINGS: list[dict] = [
    {"name": "greedy", "temp": 0.0},
    {"name": "temp 0.8", "temp": 0.8},
    {"name": "top_k 40", "temp": 1.0, "top_k": 40},
    {"name": "top_p 0.9", "temp": 1.0, "top_p": 0.9},
    {"name": "min_p 0.05", "temp": 1.0, "min_p": 0.05},
    {"name": "llama.cpp defaults", "temp": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
    {"name": "repeat 1.1 + defaults", "temp": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "penalty": 1.1},
    {"name": "repeat 1.3", "temp": 1.0, "penalty": 1.3},
    {"name": "presence + frequency + top_p", "temp": 0.7, "top_p": 0.9, "presence_penalty": 0.5, "frequency_penalty": 0.3},
    {"name": "top_k 1", "temp": 1.5, "top_k": 1},
    {"name": "no-op filters, temp 0.5", "temp": 0.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
    {"name": "temp 1.5, top_p 0.8, min_p 0.1, repeat 1.2, last 16", "temp": 1.5, "top_p": 0.8, "min_p": 0.1, "penalty": 1.2, "frequency_penalty": 0.2, "penalty_last_n": 16},
]
DEFAULTS = {"temp": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "penalty_last_n": 64}


class TokenData(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int32), ("logit", ctypes.c_float), ("p", ctypes.c_float)]


class TokenDataArray(ctypes.Structure):
    _fields_ = [("data", ctypes.POINTER(TokenData)), ("size", ctypes.c_size_t), ("selected", ctypes.c_int64), ("sorted", ctypes.c_bool)]


class ChainParams(ctypes.Structure):
    _fields_ = [("no_perf", ctypes.c_bool)]


def build(version: str, dest: Path) -> None:
    """libllama and the ggml libraries it links, from the llama-cpp-python sdist, into `dest`."""
    with tempfile.TemporaryDirectory(prefix="llama-cpp-") as tmp:
        work = Path(tmp)
        build_log = work / "build.log"
        src, generator = vendored_sources(version, work, build_log)
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_COMMON=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
        log.info("configuring llama.cpp (shared, portable)")
        run(["cmake", "-S", str(src), "-B", str(src / "build"), *generator, *flags], src, build_log)
        log.info("building libllama (minutes)")
        run(["cmake", "--build", str(src / "build"), "-j", "2", "--target", "llama"], src, build_log)
        dest.mkdir(parents=True, exist_ok=True)
        for name in LIBS:
            found = next((src / "build").rglob(name), None)
            if found is None:
                raise SystemExit(f"the build made no {name}; see {build_log}")
            shutil.copy2(found, dest / name)


def load(lib_dir: Path) -> ctypes.CDLL:
    """libllama, its ggml dependencies loaded first so that it finds them wherever it was copied."""
    for name in LIBS[:-1]:
        ctypes.CDLL(str(lib_dir / name), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(lib_dir / LIBS[-1]))
    smpl = ctypes.c_void_p
    sigs = {
        "llama_sampler_chain_init": ([ChainParams], smpl),
        "llama_sampler_chain_add": ([smpl, smpl], None),
        "llama_sampler_init_penalties": ([ctypes.c_int32, ctypes.c_int32, ctypes.c_float, ctypes.c_float, ctypes.c_float], smpl),
        "llama_sampler_init_top_k": ([ctypes.c_int32], smpl),
        "llama_sampler_init_top_p": ([ctypes.c_float, ctypes.c_size_t], smpl),
        "llama_sampler_init_min_p": ([ctypes.c_float, ctypes.c_size_t], smpl),
        "llama_sampler_init_temp": ([ctypes.c_float], smpl),
        "llama_sampler_init_dist": ([ctypes.c_uint32], smpl),
        "llama_sampler_accept": ([smpl, ctypes.c_int32], None),
        "llama_sampler_apply": ([smpl, ctypes.POINTER(TokenDataArray)], None),
        "llama_sampler_free": ([smpl], None),
    }
    for name, (args, res) in sigs.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, res
    return lib


def vectors(rng: np.random.Generator) -> list[tuple[list[float], list[int]]]:
    """20 logit vectors and token histories. Logits are rounded to a few decimals so the file stays
    small; llama.cpp and the test both see them as `float32(the decimal's float64)`."""
    sizes = [200, 256, 300, 400, 500, 600, 700, 800, 1000, 1024, 1025, 1100, 1200, 1500, 2000, 2500, 3000, 128, 129, 640]
    out = []
    for i, n in enumerate(sizes):
        kind = i % 10
        if kind == 0:  # spread: a typical model's logits
            x = rng.normal(0.0, 2.5, n)
        elif kind == 1:  # a long tail under a few strong candidates
            x = rng.normal(-4.0, 3.0, n)
            x[rng.choice(n, 5, replace=False)] = rng.normal(8.0, 1.0, 5)
        elif kind == 2:  # very peaked: one token far ahead
            x = rng.normal(0.0, 1.0, n)
            x[rng.integers(n)] = 25.0
        elif kind == 3:  # nearly flat
            x = rng.normal(0.0, 0.05, n)
        elif kind == 4:  # coarse: ties everywhere, the maximum among them
            x = np.round(rng.normal(0.0, 2.0, n) * 2.0) / 2.0
        elif kind == 5:  # exactly flat
            x = np.zeros(n)
        elif kind == 6:  # two tied leaders, then a gap
            x = rng.normal(-2.0, 1.5, n)
            x[rng.choice(n, 2, replace=False)] = 6.0
        elif kind == 7:  # wide
            x = rng.normal(0.0, 6.0, n)
        elif kind == 8:  # all negative
            x = -np.abs(rng.normal(3.0, 2.0, n))
        else:  # coarse tail with fine leaders
            x = np.round(rng.normal(-3.0, 2.0, n))
            x[rng.choice(n, 10, replace=False)] = rng.normal(3.0, 1.0, 10)
        x = np.round(x, 4 if kind in (3,) else 3)
        # A history of 80 tokens: half from the 30 likeliest (repeats), half anywhere.
        top = np.argsort(-x, kind="stable")[:30]
        hist = [int(t) for t in np.concatenate([rng.choice(top, 40), rng.integers(0, n, 40)])]
        rng.shuffle(hist)
        out.append((x.tolist(), hist))
    return out


def chain(lib: ctypes.CDLL, s: dict, n_vocab: int, hist: list[int], filters: bool = True) -> int:
    """llama.cpp's chain for setting `s` (with `filters` False: its penalties alone), history accepted."""
    c = lib.llama_sampler_chain_init(ChainParams(no_perf=True))
    samplers = [lib.llama_sampler_init_penalties(n_vocab, s["penalty_last_n"], s["penalty"], s["frequency_penalty"], s["presence_penalty"])]
    if filters:
        samplers += [
            lib.llama_sampler_init_top_k(s["top_k"]),
            lib.llama_sampler_init_top_p(s["top_p"], 0),
            lib.llama_sampler_init_min_p(s["min_p"], 0),
            lib.llama_sampler_init_temp(s["temp"]),
            lib.llama_sampler_init_dist(1234),
        ]
    for x in samplers:
        lib.llama_sampler_chain_add(c, x)
    for t in hist:
        lib.llama_sampler_accept(c, t)
    return c


def apply(lib: ctypes.CDLL, c: int, logits: np.ndarray) -> tuple[list[int], list[float], list[float], bool]:
    """Runs chain `c` over `logits`; the surviving entries' ids, logits, p, and the sorted flag."""
    n = len(logits)
    data = (TokenData * n)(*[TokenData(i, float(v), 0.0) for i, v in enumerate(logits)])
    arr = TokenDataArray(data, n, -1, False)
    lib.llama_sampler_apply(c, ctypes.byref(arr))
    out = [arr.data[i] for i in range(arr.size)]
    return [d.id for d in out], [d.logit for d in out], [d.p for d in out], bool(arr.sorted)


def case(lib: ctypes.CDLL, s: dict, logits: np.ndarray, hist: list[int]) -> dict:
    c = chain(lib, s, len(logits), hist)
    ids, final, probs, is_sorted = apply(lib, c, logits)
    lib.llama_sampler_free(c)
    # temp <= 0 leaves every other entry in place at -inf: those are not candidates.
    keep = [i for i, v in enumerate(final) if v != float("-inf")]
    ids, probs = [ids[i] for i in keep], [probs[i] for i in keep]
    pc = chain(lib, s, len(logits), hist, filters=False)
    _, penalized, _, _ = apply(lib, pc, logits)
    lib.llama_sampler_free(pc)
    # Where the cut splits tokens of equal (penalized) logit, llama.cpp's choice among them is its
    # sort's, not defined: the test then holds only the rest of the set, the count and the values.
    cut = min(penalized[t] for t in ids)
    group = [t for t, v in enumerate(penalized) if v == cut]
    tied = group if not set(group) <= set(ids) else []
    return {"ids": ids, "probs": [round(p, 10) for p in probs], "sorted": is_sorted, "tied": tied}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default="0.3.36", help="the llama-cpp-python release whose vendored llama.cpp to build")
    ap.add_argument("--lib-dir", type=Path, help="a directory holding libllama.so and its libggml*.so (default: build into the cache)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    lib_dir = args.lib_dir or Path.home() / f".cache/dasllama/llama.cpp/libllama-{args.version}"
    if not all((lib_dir / name).exists() for name in LIBS):
        if args.lib_dir:
            raise SystemExit(f"{lib_dir} lacks one of {', '.join(LIBS)}")
        build(args.version, lib_dir)
    lib = load(lib_dir)
    settings = [{**DEFAULTS, **s} for s in SETTINGS]
    vecs = vectors(np.random.default_rng(20250601))
    cases = [[case(lib, s, np.asarray(x, dtype=np.float64).astype(np.float32), h) for s in settings] for x, h in vecs]
    doc = {
        "source": f"llama.cpp vendored in llama-cpp-python {args.version}: penalties, top_k, top_p, min_p (min_keep 0), temp, dist; p as dist leaves it, to 1e-10",
        "regenerate": "python scripts/make_sampler_goldens.py",
        "settings": settings,
        "vectors": [{"logits": x, "history": h} for x, h in vecs],
        "cases": cases,
    }
    args.out.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    log.info("wrote %s (%d KB): %d vectors x %d settings", args.out, args.out.stat().st_size // 1024, len(vecs), len(settings))


if __name__ == "__main__":
    main()
