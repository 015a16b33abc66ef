"""Vision towers on a Vulkan device: a model placed on one takes its projector's tower with it
(the matrices and the attention run there, the rest on the host), and the image embeddings still
match llama.cpp's mtmd goldens (scripts/make_vision_goldens.py). Lavapipe in CI, a GPU where
there is one; without a device the tests skip with the reason (or fail where one is expected:
tests/test_vulkan.py's `device` fixture)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_vulkan import (
    device,  # noqa: F401 (the fixture needs_device names)
    needs_device,
)

import dasllama as dl
from dasllama import vision

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import make_vision_goldens as mk


def _golden_embeddings(g: dict) -> np.ndarray:
    return np.concatenate([np.array(c["embd"], dtype=np.float64).reshape(c["image"], -1) for c in g["chunks"] if "image" in c])


@needs_device
@pytest.mark.parametrize("case", sorted(mk.CASES))
def test_the_tower_on_the_device_matches_llama_cpp_mtmd(tmp_path: Path, case: str) -> None:
    g = json.loads(mk.golden_path(case).read_text())
    text, proj = mk.write_files(tmp_path, case)
    m = dl.load_model(text, mmproj=proj, device="vulkan")
    assert m.device.kind == "vulkan" and m.projector is not None
    st = m.projector.placement
    assert st is not None and st["matrices"] > 0 and st["failed"] is None, st
    img = Image.fromarray(mk.image_rgb(case))
    p = vision.tokenize_with_images(m, g["prompt"], [img])
    want = _golden_embeddings(g)
    err = np.abs(p.values - want).max() / np.abs(want).max()
    assert err < 1e-3, err
    # The device ran the tower's work (the counters would stay 0 had the host run it all).
    st = m.projector.placement
    assert st["matmuls"] > 0 and st["attentions"] > 0 and st["failed"] is None, st
    # Back on the CPU the tower goes with the model, and encodes the same image alike.
    m.to("cpu")
    assert m.projector.placement is None
    again = vision.tokenize_with_images(m, g["prompt"], [img]).values
    assert np.abs(again - p.values).max() / np.abs(want).max() < 1e-3


@needs_device
def test_mmproj_offload_false_keeps_the_tower_on_the_cpu(tmp_path: Path) -> None:
    text, proj = mk.write_files(tmp_path, "gemma3")
    m = dl.load_model(text, mmproj=proj, device="vulkan", mmproj_offload=False)
    assert m.device.kind == "vulkan" and m.projector is not None
    assert m.projector.placement is None
    # Moving the model again keeps the choice.
    m.to("vulkan")
    assert m.projector.placement is None
