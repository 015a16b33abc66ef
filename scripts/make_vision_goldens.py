"""Write tests/golden/vision/{gemma3,gemma4v,gemma4v-e,pixtral,qwen25vl,qwen3vl,idefics3}-tiny.json: llama.cpp's own multimodal path
(tools/mtmd) on the tiny synthetic text models and mmproj files of tests/synthetic_vision.py, for
tests/test_vision_golden.py: the prompt's text chunks as mtmd tokenizes them, the image's
embeddings (its preprocessing included: for Gemma 3 a 48 x 40 picture fitted on black into
32 x 32 with bilinear resampling; for Gemma 4 a 45 x 37 picture resized bicubically up to
120 x 96, 10 x 8 tokens of 3 x 3 patches (its minimum of 70 tokens), into the tiny gemma4 text
family of tests/synthetic.py, whose sliding layers see the image's rows both ways (and into the
E-series family, ``gemma4v-e``, whose per-layer inputs take the padding token's row for an image
row); for Pixtral a 45 x 37 picture resized bicubically to 48 x 40,
its own aspect ratio in multiples of 8; for Qwen2.5-VL a 125 x 37 picture resized to
128 x 40, 16 x 5 tokens, wide enough for two of its 112-pixel windows, on M-RoPE axes in a qwen2vl
text model; for Qwen3-VL a 61 x 45 picture resized to 64 x 48, 8 x 6 tokens, its learned 8 x 8
positions interpolated to 16 x 12 patches, each row carrying a deepstack slice into a qwen3vl
text model on interleaved M-RoPE; for Idefics3 a 48 x 40 picture scaled (Lanczos) to a longest side of 64, cut into
2 x 2 tiles of 32 and an overview), and greedy steps after the prompt with every step's logits.

Needs the harness scripts/mtmd_golden.cpp built against a static build of llama-cpp-python
0.3.36's vendored llama.cpp (the sdist, as scripts/build_llama_cpp.py fetches it):

    V=/path/to/llama_cpp_python-0.3.36/vendor/llama.cpp B=/tmp/llama-build
    cmake -S $V -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=ON
    cmake --build $B --target llama mtmd -j2      # tens of minutes on two cores
    g++ -std=c++17 -O2 -I$V/include -I$V/ggml/include -I$V/tools/mtmd scripts/mtmd_golden.cpp \\
        $B/tools/mtmd/libmtmd.a $B/vendor/hash/libvendor-hash.a $B/src/libllama.a $B/ggml/src/libggml.a \\
        $B/ggml/src/libggml-cpu.a $B/ggml/src/libggml-base.a -fopenmp -lpthread -ldl -o /tmp/mtmd_golden
    python scripts/make_vision_goldens.py --harness /tmp/mtmd_golden [--case gemma3|gemma4v|...]

The files are written deterministically (fixed seeds); the golden records their sha256, which the
test checks before comparing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from synthetic import write_family, write_model  # noqa: E402
from synthetic_vision import write_gemma3_mmproj, write_gemma4v_mmproj, write_idefics3_mmproj, write_pixtral_mmproj, write_qwen2vl_mmproj, write_qwen3vl_mmproj  # noqa: E402

PROMPT = "the cat <__media__> at"
STEPS = 6
# Per projector: the text model's architecture and control tokens, the mmproj writer, the
# picture (a seeded random RGB of this size).
CASES = {
    "gemma3": dict(arch="gemma3", specials=("<start_of_image>", "<end_of_image>"), write=write_gemma3_mmproj, image=dict(seed=7, width=48, height=40)),
    # The text model: tests/synthetic.py's gemma4 family (three sliding layers with a window of 6
    # and one full layer; llama.cpp lets an image's rows see each other in the sliding layers
    # only), its context raised for the 80 image rows.
    "gemma4v": dict(
        family="gemma4",
        specials=("<|image>", "<image|>"),
        write=write_gemma4v_mmproj,
        image=dict(seed=17, width=45, height=37),
        meta={"context_length": 128},
    ),
    # The same image into the E-series family (per-layer inputs: an image row's token part is
    # the padding token's; two layers reading earlier layers' K/V).
    "gemma4v-e": dict(
        family="gemma4-e",
        specials=("<|image>", "<image|>"),
        write=write_gemma4v_mmproj,
        image=dict(seed=17, width=45, height=37),
        meta={"context_length": 128},
    ),
    "pixtral": dict(arch="llama", specials=("[IMG]", "[IMG_BREAK]", "[IMG_END]"), write=write_pixtral_mmproj, image=dict(seed=9, width=45, height=37)),
    # 125 x 37 pixels: 16 x 5 tokens, the windowed layer's windows 14 tokens wide.
    # The text tower on M-RoPE (Qwen2-VL's consecutive sections, 8/12/12/0 of its 32 pairs; a
    # RoPE base of 10000 so that the image's row and column positions tell) with Q/K/V biases,
    # its norms adding ~0 as llama.cpp's qwen2vl does (see tests/synthetic.py).
    "qwen25vl": dict(
        arch="qwen2vl",
        specials=("<|vision_start|>", "<|vision_end|>"),
        write=write_qwen2vl_mmproj,
        image=dict(seed=11, width=125, height=37),
        meta={"rope.dimension_sections": [8, 12, 12, 0], "attention.layer_norm_rms_epsilon": 1e-30},
        biases=True,
    ),
    # 61 x 45 pixels: 64 x 48 after preprocessing, 8 x 6 tokens. The text tower: qwen3 (QK-norm)
    # on Qwen3-VL's interleaved M-RoPE (12/10/10/0 of its 32 pairs, a RoPE base of 10000 so that
    # the image's positions tell) with one deepstack layer of its two: the image rows' extra
    # slice joins the first layer's output. (llama.cpp's graph cannot take a deepstack on the
    # last layer: its output rows are cut to the logits' there before the slice is added.)
    "qwen3vl": dict(
        arch="qwen3vl",
        specials=("<|vision_start|>", "<|vision_end|>"),
        write=write_qwen3vl_mmproj,
        image=dict(seed=13, width=61, height=45),
        meta={"rope.dimension_sections": [12, 10, 10, 0], "n_deepstack_layers": 1},
        qk_norm=True,
    ),
    # SmolVLM's layout tokens ("\n\n" is one token in its vocabulary, and mtmd looks it up).
    "idefics3": dict(
        arch="llama",
        specials=("<fake_token_around_image>", "<global-img>", "<row_1_col_1>", "<row_1_col_2>", "<row_2_col_1>", "<row_2_col_2>", "\n\n"),
        write=write_idefics3_mmproj,
        image=dict(seed=11, width=48, height=40),
    ),
}


def golden_path(case: str) -> Path:
    return ROOT / "tests" / "golden" / "vision" / f"{case}-tiny.json"


def image_rgb(case: str = "gemma3") -> np.ndarray:
    im = CASES[case]["image"]
    return np.random.default_rng(im["seed"]).integers(0, 256, size=(im["height"], im["width"], 3), dtype=np.uint8)


def write_files(d: Path, case: str = "gemma3") -> tuple[Path, Path]:
    c = CASES[case]
    text, proj = d / f"{case}-tiny.gguf", d / f"mmproj-{case}-tiny.gguf"
    extra = text_extra(c)
    if "family" in c:
        write_family(text, c["family"], meta=c.get("meta"), specials=c["specials"])
    else:
        write_model(text, arch=c["arch"], specials=c["specials"], ctx=128, meta=c.get("meta"), extra=extra)
    c["write"](proj)
    return text, proj


def text_extra(c: dict) -> dict[str, np.ndarray] | None:
    """The tensors a case's tiny text model adds to write_model's (Q/K/V biases, Q/K norms), at
    the synthetic shapes in force when called."""
    return {**(biases() if c.get("biases") else {}), **(qk_norms() if c.get("qk_norm") else {})} or None


def biases() -> dict[str, np.ndarray]:
    """Q/K/V biases for the tiny text model (qwen2's layers need them), K's large as in the real
    models."""
    from synthetic import HEAD_DIM, HEADS, KV_HEADS, LAYERS

    rng = np.random.default_rng(97)
    out = {}
    for i in range(LAYERS):
        for t, n, sd in (("attn_q", HEADS * HEAD_DIM, 0.2), ("attn_k", KV_HEADS * HEAD_DIM, 1.0), ("attn_v", KV_HEADS * HEAD_DIM, 0.2)):
            out[f"blk.{i}.{t}.bias"] = rng.normal(0, sd, size=n).astype(np.float32)
    return out


def qk_norms() -> dict[str, np.ndarray]:
    """Per-head Q and K RMS-norm weights for the tiny text model (qwen3's layers need them)."""
    from synthetic import HEAD_DIM, LAYERS

    rng = np.random.default_rng(98)
    return {f"blk.{i}.attn_{t}_norm.weight": (1 + rng.normal(0, 0.1, size=HEAD_DIM)).astype(np.float32) for i in range(LAYERS) for t in ("q", "k")}


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--harness", required=True, help="the built scripts/mtmd_golden.cpp")
    ap.add_argument("--case", choices=sorted(CASES), action="append", help="which projector (default: all)")
    args = ap.parse_args()
    for case in args.case or sorted(CASES):
        im = CASES[case]["image"]
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            text, proj = write_files(d, case)
            raw = d / "image.rgb"
            raw.write_bytes(image_rgb(case).tobytes())
            cmd = [args.harness, str(text), str(proj), str(raw), str(im["width"]), str(im["height"]), PROMPT, str(STEPS)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            g = json.loads(out)
            g["origin"] = "llama-cpp-python 0.3.36's vendored llama.cpp, tools/mtmd (scripts/mtmd_golden.cpp), CPU, 1 thread"
            g["files"] = {"text": sha(text), "mmproj": sha(proj)}
            g["prompt"], g["image"] = PROMPT, im
        out_path = golden_path(case)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(g) + "\n")
        print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
