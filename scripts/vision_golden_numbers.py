"""Print how far dasllama's vision paths are from llama.cpp's mtmd on the goldens
(tests/golden/vision/*.json; tests/test_vision_golden.py asserts the bounds): per projector, the
image embeddings' largest error relative to the largest value, the largest log-probability
difference over llama.cpp's top 5 and over the whole vocabulary in the greedy steps after the
prompt, argmax flips, and llama.cpp's margin between its first and second choice at each step.

    python scripts/vision_golden_numbers.py
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

import make_vision_goldens as mk  # noqa: E402

import dasllama as dl  # noqa: E402
from dasllama import vision  # noqa: E402

log = logging.getLogger("vision_golden_numbers")


def _lp(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for case in sorted(mk.CASES):
        g = json.loads(mk.golden_path(case).read_text())
        with tempfile.TemporaryDirectory() as tmp:
            text, proj = mk.write_files(Path(tmp), case)
            m = dl.load_model(text, mmproj=proj)
        p = vision.tokenize_with_images(m, g["prompt"], [Image.fromarray(mk.image_rgb(case))])
        n = sum(k for _, k in p.spans)
        want = np.concatenate([np.array(c["embd"], dtype=np.float64).reshape(c["image"], -1) for c in g["chunks"] if "image" in c])
        err = np.abs(p.values - want).max() / np.abs(want).max()
        s = dl.create_session(m)
        logits = vision.eval_image_prompt(m, s, p)
        top5 = every = 0.0
        margins, flips = [], 0
        for st in g["steps"]:
            a, b = _lp(logits), _lp(np.array(st["logits"]))
            top = np.argsort(b)[-5:]
            top5, every = max(top5, float(np.abs(a[top] - b[top]).max())), max(every, float(np.abs(a - b).max()))
            margins.append(round(float(b[top[-1]] - b[top[-2]]), 2))
            flips += int(np.argmax(logits)) != st["token"]
            logits = dl.eval(m, s, [st["token"]])
        log.info("%s: %d image rows; embeddings max rel err %.2e; log-probs max |diff| top-5 %.2e, whole vocabulary %.2e; argmax flips %d/%d; llama.cpp's margins %s", case, n, err, top5, every, flips, len(g["steps"]), margins)


if __name__ == "__main__":
    main()
