"""Image encode time: dasllama's vision tower and projector beside llama.cpp's own (`llama-mtmd-cli`
from the llama.cpp that llama-cpp-python 0.3.36 vendors), per projector at its native size, on
the same box in the same run.

The mmproj files have random weights at the real models' vision-tower shapes (written with
gguf.GGUFWriter, f16 matrices as the published mmproj files hold them), so the arithmetic is the
real models':

- ``gemma3``: Gemma 3 4B's SigLIP-So400m tower (27 layers, 1152 wide, 16 heads, patches of 14) at
  its fixed 896 x 896, pooled into 256 tokens of the text's 2560;
- ``pixtral``: Pixtral 12B's tower (24 layers, 1024 wide, 2-D RoPE, patches of 16) at a typical
  512 x 512 (1024 tokens and 31 row breaks of the text's 5120; the tower takes any size up to
  1024 x 1024);
- ``gemma4v``: Gemma 4's vision tower as published with the 31B (27 layers, 1152 wide, 16 heads
  of 72, patches of 16, per-head Q/K norms, a 2-D RoPE, 3 x 3 pooling) at 768 x 768 (2304
  patches pooled into 256 tokens), projected to the tests' small gemma4 text model (256 wide; the
  projection is a sliver of the work);
- ``qwen25vl``: Qwen2.5-VL 3B's tower (32 layers, 1280 wide, 16 heads, patches of 14, windows of
  112 pixels in all layers but every eighth, a SiLU-gated MLP) at 448 x 448 (1024 patches merged
  2 x 2 into 256 tokens of the text's 2048; the tower takes any size);
- ``qwen3vl``: Qwen3-VL 2B's tower (24 layers, 1024 wide, 16 heads, patches of 16, learned
  positions for 48 x 48 interpolated, deepstack mergers after layers 5, 11 and 17) at 512 x 512
  (1024 patches, 256 tokens of the text's 2048 plus three deepstack slices);
- ``idefics3``: SmolVLM2 2.2B's tower (SigLIP-So400m at 384 x 384, patches of 14, a pixel shuffle
  of 3 x 3 into 81 tokens of the text's 2048) with its longest side set to one tile, so an image
  is one tile and the overview: two tower passes (the real file's 1536 cuts a picture into up to
  16 tiles and the overview, each pass the same cost).

``--shapes tiny`` runs the tests' tiny towers instead (seconds; a check that the bench works).
The text model beside each mmproj is a one-layer random one of the projector's output width:
llama-mtmd-cli needs one, and only the image's encode is timed.

What is timed: dasllama's ``vision.encode_pixels`` (the tower and projector over preprocessed
pixels) and llama.cpp's ``mtmd_batch_encode`` (llama-mtmd-cli's "mtmd batch encoding done in N
ms", whole milliseconds; its preprocessing is outside that too). Each side encodes the image ``--runs`` + 1 times in one
process; the first (cold caches, first touch of the buffers) is dropped, the median of the rest
reported. llama.cpp's tool is found on the PATH, in ~/.cache/dasllama/llama.cpp/bin, or built
there with scripts/build_llama_cpp.py's tree (``--llama-build DIR`` names an existing cmake tree
to build the target in instead).

    python benches/bench_vision.py [--shapes real|tiny] [--threads 2] [--runs 2] [--cases gemma3 pixtral] [--layers N]

``--layers N`` cuts every tower to N layers (files of their own in the cache): minutes become
seconds while the widths, and so the kernels' shapes, stay the real ones. ``--device vulkan``
runs dasllama's tower on the Vulkan device (``Projector.to``: its matmuls and attention there);
scripts/gpu_check.sh runs it so on a lent GPU.

Speed is compared, never asserted: on a shared box the figures move with the other work on it.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from machine import cpu_name

log = logging.getLogger("bench_vision")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
BENCH_DIR = Path("~/.cache/dasllama/bench/vision").expanduser()
LLAMA_BIN = Path("~/.cache/dasllama/llama.cpp/bin").expanduser()

# Per projector: what it models, the tower's shape (synthetic_vision's writer keys), the text
# width and the image's size. The text model's architecture and control tokens are the goldens'
# (scripts/make_vision_goldens.py's CASES).
REAL: dict[str, dict[str, Any]] = {
    "gemma3": dict(
        label="Gemma 3 4B (SigLIP-400M)",
        tower=dict(image_size=896, patch=14, dim=1152, ff=4304, heads=16, layers=27, merge=4, eps=1e-6),
        text_dim=2560,
        image=(896, 896),
    ),
    "pixtral": dict(
        label="Pixtral 12B",
        tower=dict(image_size=1024, patch=16, dim=1024, ff=4096, heads=16, layers=24, eps=1e-5, hidden=5120),
        text_dim=5120,
        merger=False,
        image=(512, 512),
    ),
    "gemma4v": dict(
        label="Gemma 4 (27 x 1152)",
        tower=dict(image_size=768, patch=16, dim=1152, ff=4304, heads=16, layers=27, merge=3, eps=1e-6, pos=10240),
        text_dim=256,
        image=(768, 768),
    ),
    "qwen25vl": dict(
        label="Qwen2.5-VL 3B",
        tower=dict(image_size=448, patch=14, dim=1280, ff=3420, heads=16, layers=32, eps=1e-6, hidden=5120, window=112, wa=8),
        text_dim=2048,
        image=(448, 448),
    ),
    "qwen3vl": dict(
        label="Qwen3-VL 2B",
        tower=dict(image_size=768, patch=16, dim=1024, ff=4096, heads=16, layers=24, eps=1e-6, hidden=4096, deepstack=(5, 11, 17)),
        text_dim=2048,
        image=(512, 512),
    ),
    "idefics3": dict(
        label="SmolVLM2 2.2B (1 tile + ov.)",
        tower=dict(image_size=384, patch=14, dim=1152, ff=4304, heads=16, layers=27, scale=3, longest=384, eps=1e-6),
        text_dim=2048,
        image=(384, 384),
    ),
}
TINY: dict[str, dict[str, Any]] = {
    "gemma3": dict(label="Gemma 3 (tiny)", tower={}, text_dim=256, image=(32, 32)),
    "pixtral": dict(label="Pixtral (tiny)", tower={}, text_dim=256, image=(64, 48)),
    "gemma4v": dict(label="Gemma 4 (tiny)", tower={}, text_dim=256, image=(48, 48)),
    "qwen25vl": dict(label="Qwen2.5-VL (tiny)", tower={}, text_dim=256, image=(64, 48)),
    "qwen3vl": dict(label="Qwen3-VL (tiny)", tower={}, text_dim=256, image=(64, 48)),
    "idefics3": dict(label="Idefics3 (tiny)", tower={}, text_dim=256, image=(48, 40)),
}


def llama_tool(name: str, build_dir: Path | None) -> Path:
    """llama.cpp's tool: built in ``build_dir`` where given, else on the PATH, in the cache, or
    built into the cache first."""
    if build_dir is not None:
        ninja = shutil.which("ninja") or "ninja"
        subprocess.run([ninja, "-C", str(build_dir), name], check=True, capture_output=True)
        return build_dir / "bin" / name
    found = shutil.which(name) or (str(LLAMA_BIN / name) if (LLAMA_BIN / name).exists() else None)
    if found:
        return Path(found)
    log.info("building llama.cpp's tools into %s (minutes)", LLAMA_BIN)
    subprocess.run([sys.executable, str(ROOT / "scripts/build_llama_cpp.py"), "--dest", str(LLAMA_BIN), "--tools", name], check=True)
    return LLAMA_BIN / name


def files(case: str, shapes: str, layers: int | None = None) -> tuple[Path, Path, Path]:
    """(text model, mmproj, picture) for ``case``, written into the bench cache when missing;
    ``layers`` cuts the tower to that many layers (a quicker run of the same widths)."""
    import numpy as np
    from gguf import GGMLQuantizationType as QT
    from PIL import Image

    from synthetic_vision import write_gemma3_mmproj, write_gemma4v_mmproj, write_idefics3_mmproj, write_pixtral_mmproj, write_qwen2vl_mmproj, write_qwen3vl_mmproj

    c = (REAL if shapes == "real" else TINY)[case]
    cut = ""
    if layers is not None:
        c = {**c, "tower": {**c["tower"], "layers": layers}}
        cut = f"-{layers}l"
    d = BENCH_DIR / shapes
    d.mkdir(parents=True, exist_ok=True)
    text, proj, pic = d / f"{case}-text.gguf", d / f"mmproj-{case}{cut}.gguf", d / f"{case}-{c['image'][0]}x{c['image'][1]}.png"
    if not proj.exists():
        log.info("writing %s (random weights at %s's shapes)", proj, c["label"])
        tmp = proj.with_suffix(".part")
        qt = QT.F16 if shapes == "real" else QT.F32
        if case == "gemma3":
            write_gemma3_mmproj(tmp, qt=qt, text_dim=c["text_dim"], **c["tower"])
        elif case == "idefics3":
            write_idefics3_mmproj(tmp, qt=qt, text_dim=c["text_dim"], **c["tower"])
        elif case == "gemma4v":
            write_gemma4v_mmproj(tmp, qt=qt, text_dim=c["text_dim"], **c["tower"])
        elif case == "qwen25vl":
            write_qwen2vl_mmproj(tmp, qt=qt, text_dim=c["text_dim"], **c["tower"])
        elif case == "qwen3vl":
            write_qwen3vl_mmproj(tmp, qt=qt, text_dim=c["text_dim"], **c["tower"])
        else:
            write_pixtral_mmproj(tmp, qt=qt, text_dim=c["text_dim"], merger=c.get("merger", True), **c["tower"])
        tmp.rename(proj)
    if not text.exists():
        write_text(case, c, text)
    if not pic.exists():
        w, h = c["image"]
        Image.fromarray(np.random.default_rng(5).integers(0, 256, size=(h, w, 3), dtype=np.uint8)).save(pic)
    return text, proj, pic


def write_text(case: str, c: dict[str, Any], text: Path) -> None:
    """The text model beside ``case``'s mmproj: mtmd checks that its width is the projection's,
    and its cost is not what is measured, so it is small. One layer of the projector's output
    width; the Qwen text towers as the goldens' (M-RoPE sections, Q/K/V biases or Q/K norms), with
    a deepstack slice per deepstack layer of the tower for Qwen3-VL and a layer after the last of
    them (llama.cpp needs one); Gemma 4's the tests' gemma4 family (the image's projection to its
    width is a sliver of the encode)."""
    import make_vision_goldens as goldens

    import synthetic

    g = goldens.CASES[case]
    arch, specials = g.get("arch"), g["specials"]
    if "family" in g:
        synthetic.write_family(text, g["family"], meta={"context_length": 8192}, specials=specials)
        return
    deepstack = len(c["tower"].get("deepstack", (1,))) if case == "qwen3vl" else 0
    # llama.cpp's qwen2vl takes no key length: its heads span the width.
    heads = c["text_dim"] // synthetic.HEAD_DIM if arch == "qwen2vl" else synthetic.HEADS
    saved = synthetic.DIM, synthetic.LAYERS, synthetic.HEADS
    synthetic.DIM, synthetic.LAYERS, synthetic.HEADS = c["text_dim"], deepstack + 1, heads
    try:
        extra = goldens.text_extra(g)
        meta = {**g.get("meta", {}), **({"n_deepstack_layers": deepstack} if deepstack else {})} or None
        synthetic.write_model(text, arch=arch, specials=specials, ctx=8192, meta=meta, extra=extra)
    finally:
        synthetic.DIM, synthetic.LAYERS, synthetic.HEADS = saved


def ours(proj: Path, pic: Path, threads: int, runs: int, device: str) -> tuple[list[float], int, int, int]:
    """dasllama's encode times of the whole image (ms, the first dropped), its prompt rows, its
    patches and its tower passes (Idefics3: one a tile and one the overview)."""
    import dasllama as dl
    from dasllama import vision

    p = vision.load_mmproj(proj, runtime=dl.Runtime(threads=threads))
    if device != "cpu":
        why = p.to(device)
        if why:
            raise SystemExit(f"the tower cannot go on {device}: {why}")
    img = vision.decode_image(pic.read_bytes())
    if p.projector_type == "idefics3":
        s = p.image_size
        slices = [(px, s, s) for px in vision.idefics3_tiles(img, p)[2]]
    else:
        slices = [vision.preprocess_sized(img, p)]
    times, rows = [], 0
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        rows = sum(len(vision.encode_pixels(p, px, w, h)) for px, w, h in slices)
        times.append((time.perf_counter() - t0) * 1000)
    if device != "cpu":
        log.info("%s on %s: %s", proj.name, device, p.placement)
    patch = p.native.patch_size
    return times[1:], rows, sum((w // patch) * (h // patch) for _, w, h in slices), len(slices)


def theirs(tool: Path, text: Path, proj: Path, pic: Path, threads: int, runs: int, passes: int) -> list[float] | None:
    """llama-mtmd-cli's encode times of the whole image (ms, the first dropped): the same picture
    ``runs`` + 1 times in one prompt, one token generated. The tool encodes each run of image
    chunks between two text chunks as one batch ("mtmd batch encoding done in N ms"); every image
    chunk here has text on both sides, so a batch is one tower pass, and an image of several
    (Idefics3's tiles) sums its passes."""
    cmd = [str(tool), "-m", str(text), "--mmproj", str(proj), "-t", str(threads), "-c", "8192", "-n", "1", "-p", "describe", "--temp", "0"]
    # The random text models carry no chat template.
    cmd += ["--chat-template", "chatml", "--image", ",".join([str(pic)] * (runs + 1))]
    # The random model's one generated token need not be UTF-8.
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", check=False)
    out = r.stdout + r.stderr
    sizes = [int(x) for x in re.findall(r"encoding mtmd batch, n_chunks = (\d+)", out)]
    found = [float(x) for x in re.findall(r"mtmd batch encoding done in (\d+) ms", out)]
    if r.returncode != 0 or len(found) != (runs + 1) * passes or set(sizes) != {1}:
        log.warning("llama-mtmd-cli failed on %s (exit %d): %s", proj.name, r.returncode, out.strip()[-600:])
        return None
    return [sum(found[i * passes : (i + 1) * passes]) for i in range(1, runs + 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", choices=("real", "tiny"), default="real")
    ap.add_argument("--cases", nargs="+", choices=list(REAL), default=list(REAL))
    ap.add_argument("--threads", nargs="+", type=int, default=[os.cpu_count() or 1])
    ap.add_argument("--runs", type=int, default=2, help="timed encodes per side (after one dropped)")
    ap.add_argument("--llama-build", type=Path, default=None, help="an existing cmake/ninja tree of the vendored llama.cpp to build llama-mtmd-cli in")
    ap.add_argument("--no-llama", action="store_true", help="dasllama's figures only")
    ap.add_argument("--layers", type=int, default=None, help="cut the towers to this many layers (a quicker run at the real widths)")
    ap.add_argument("--device", default="cpu", help="where dasllama's tower runs: cpu, vulkan, vulkan:N (llama-mtmd-cli uses whatever its build has)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tool = None if args.no_llama else llama_tool("llama-mtmd-cli", args.llama_build)
    load = os.getloadavg()[0]
    if load > 0.5:
        log.warning("load average %.1f: other work shares this box, and these figures with it", load)
    table = (REAL if args.shapes == "real" else TINY)
    rows = []
    for case in args.cases:
        text, proj, pic = files(case, args.shapes, args.layers)
        for t in args.threads:
            # Ours then theirs for each, so drift on a shared box hits both alike.
            mine, n_rows, n_patches, passes = ours(proj, pic, t, args.runs, args.device)
            ref = theirs(tool, text, proj, pic, t, args.runs, passes) if tool is not None else None
            rows.append((case, t, statistics.median(mine), statistics.median(ref) if ref else None, n_rows, n_patches))
            log.info("%s, %d threads: dasllama %s ms, llama.cpp %s ms", case, t, [round(x) for x in mine], [round(x) for x in ref] if ref else "n/a")
    print(f"\n{cpu_name()}; {os.cpu_count()} CPUs; load average {load:.1f} at the start")
    print(f"image encode (tower + projector) on dasllama's {args.device}, median of {args.runs} after one dropped; llama.cpp: llama-mtmd-cli's mtmd_batch_encode")
    print(f"| {'projector (shape)':<26} | image     | patches | tokens | threads | dasllama ms | llama.cpp ms | ratio | dasllama tok/s | llama.cpp tok/s |")
    print(f"|{'-' * 28}|-----------|---------|--------|---------|-------------|--------------|-------|----------------|-----------------|")
    for case, t, mine, ref, n_rows, n_patches in rows:
        w, h = table[case]["image"]
        ref_ms, ratio, ref_tps = (f"{ref:12.0f}", f"{ref / mine:4.2f}x", f"{n_rows / ref * 1000:15.0f}") if ref else (f"{'n/a':>12}", f"{'':>5}", f"{'n/a':>15}")
        size = f"{w}x{h}"
        print(f"| {table[case]['label']:<26} | {size:<9} | {n_patches:>7} | {n_rows:>6} | {t:>7} | {mine:11.0f} | {ref_ms} | {ratio} | {n_rows / mine * 1000:14.0f} | {ref_tps} |")
    print("ratio: llama.cpp's time over dasllama's (above 1: dasllama is faster)")


if __name__ == "__main__":
    main()
