"""The sampler's candidate set and probabilities against llama.cpp's own sampler chain.

`golden/sampler_chain.json` is llama.cpp's output (see `scripts/make_sampler_goldens.py`): 20 logit
vectors with token histories, 12 settings, and for each pair the tokens the chain keeps, in its
order, with the probabilities `dist` draws from. Where llama.cpp's array is sorted, tokens of equal
logit may come in any order; where a cut splits tokens of equal logit (`tied`), which of them
llama.cpp keeps is its sort's choice, so only the rest of the set, the count and the values are
held.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import golden

import dasllama as dl
from dasllama import _native

G = golden("sampler_chain.json")
TOL = 1e-6


@pytest.mark.parametrize("si", range(len(G["settings"])), ids=[s["name"] for s in G["settings"]])
def test_candidates_match_llama_cpp(si: int) -> None:
    s = {k: v for k, v in G["settings"][si].items() if k != "name"}
    params = dl.SamplingParams(**s)._native()
    for vi, (vec, case) in enumerate(zip(G["vectors"], (c[si] for c in G["cases"]), strict=True)):
        where = f"vector {vi}, {G['settings'][si]['name']}"
        logits = np.asarray(vec["logits"], dtype=np.float64).astype(np.float32)
        ids, probs = _native.sampler_candidates(logits, vec["history"], params)
        want_ids, want_p = case["ids"], case["probs"]
        assert len(ids) == len(want_ids), where
        tied = set(case["tied"])
        assert set(ids) - tied == set(want_ids) - tied, where
        assert set(ids) <= set(want_ids) | tied, where
        if case["sorted"]:
            # Position by position the probabilities agree, which fixes the order up to ties.
            np.testing.assert_allclose(probs, want_p, rtol=0, atol=TOL, err_msg=where)
        else:
            assert ids == want_ids, where
        by_id = dict(zip(ids, probs, strict=True))
        for t, p in zip(want_ids, want_p, strict=True):
            if t not in tied:
                assert abs(by_id[t] - p) <= TOL, f"{where}: token {t}: {by_id[t]} vs llama.cpp's {p}"


def test_golden_covers_what_it_claims() -> None:
    assert len(G["vectors"]) == 20 and len(G["settings"]) == 12
    sizes = [len(v["logits"]) for v in G["vectors"]]
    assert min(sizes) <= 128 and max(sizes) > 1024, "llama.cpp's small and large top-p paths"
    assert any(c["tied"] for row in G["cases"] for c in row), "some cuts fall inside ties"
    assert any(s["temp"] <= 0 for s in G["settings"]) and any(s["penalty"] != 1 for s in G["settings"])
