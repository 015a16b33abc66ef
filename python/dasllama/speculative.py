"""Speculative decoding: drafters that propose a stream's next tokens for the scheduler to verify.

A drafter is attached to a model; a scheduler created with ``mtp=True`` then speculates on every
decoding stream, and how many tokens each stream drafts adapts to what the engine measures (its
acceptance, and what an extra row costs at the current batch)::

    attach_ngram_drafter(m)                       # prompt lookup: no extra model
    sch = create_scheduler(m, 4, mtp=mtp_capable(m))

Output does not depend on speculation: the target verifies each draft by sampling from its own
logits for that position with the stream's own sampler, so greedy and seeded streams produce
exactly the tokens they produce without a drafter.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from . import _native
from .gguf_file import read_header
from .model import Model
from .scheduler import Scheduler

log = logging.getLogger("dasllama")

MAX_DRAFT = 32


def no_speculation(m: Model) -> str | None:
    """Why ``m`` cannot speculate, or None when it can: a hybrid's recurrent (DeltaNet) layers
    hold every position in one state that cannot be rolled back past a rejected draft (K/V is
    rolled back by truncation), so hybrids decode without drafts."""
    if m.config.get("recurrent_layers", 0):
        return f"{m.path.name} ({m.arch}) has recurrent (DeltaNet) layers, whose state cannot be rolled back past a rejected draft"
    return None


def attach_ngram_drafter(m: Model, max_draft: int = 8) -> bool:
    """Draft by prompt lookup: what followed the last earlier occurrence of the stream's last 2-4
    tokens. Best on input-grounded work (summaries, rewrites, code edits). Replaces any drafter.
    False, with the reason logged and nothing attached, for a hybrid (:func:`no_speculation`)."""
    _check_max_draft(max_draft)
    if why := no_speculation(m):
        log.warning("not speculating: %s", why)
        return False
    m._drafter = _native.ngram_drafter(max_draft)
    return True


def attach_draft_model(m: Model, draft: Model, max_draft: int = 8) -> bool:
    """Draft with a smaller model (or a coarser quantization of the same one) that shares ``m``'s
    vocabulary; it decodes greedily, batched across streams. False, with the reason logged and
    nothing attached, when its vocabulary differs or either model is a hybrid (:func:`no_speculation`)."""
    if not isinstance(draft, Model):
        raise TypeError(f"draft must be a dasllama Model (from load_model), not {type(draft).__name__}")
    if why := no_speculation(m) or no_speculation(draft):
        log.warning("not speculating: %s", why)
        return False
    drafter, why = _native.model_drafter(m._native, draft._native, _check_max_draft(max_draft))
    if drafter is None:
        log.warning("draft model %s cannot draft for %s: %s", draft.path.name, m.path.name, why)
        return False
    m._drafter = drafter
    return True


def mtp_drafter_sidecar(path: str | os.PathLike[str]) -> str:
    """The MTP sidecar that sits beside the model file ``path`` (``mtp-<stem>-Q8_0.gguf``, else
    ``mtp-<stem>.gguf``, as llama.cpp's converter writes them with ``--mtp``), or "" if none."""
    p = Path(path)
    for name in (f"mtp-{p.stem}-Q8_0.gguf", f"mtp-{p.stem}.gguf"):
        if (p.parent / name).is_file():
            return str(p.parent / name)
    return ""


def attach_mtp_drafter(m: Model, path: str | os.PathLike[str]) -> bool:
    """Attach the MTP (NextN) head in ``path``. False, with the reason logged, when the file is
    not an MTP sidecar for ``m`` or when ``m``'s family has no MTP head in this build."""
    hdr = read_header(path)
    arch = str(hdr.metadata.get("general.architecture", ""))
    layers = hdr.metadata.get(f"{arch}.nextn_predict_layers")
    if not layers or not any(".nextn." in t.name for t in hdr.tensors):
        why = f"{path} holds no MTP layers ({arch}.nextn_predict_layers and blk.N.nextn.* tensors)"
    elif arch != m.arch or hdr.metadata.get(f"{arch}.embedding_length") != m.config.get("dim"):
        why = f"{path} was made for another model ({arch}, width {hdr.metadata.get(f'{arch}.embedding_length')}) than {m.path.name} ({m.arch}, width {m.config.get('dim')})"
    else:
        why = f"MTP heads are not implemented for the {m.arch} family in this build; use attach_ngram_drafter or attach_draft_model"
    log.warning("not attaching %s: %s", path, why)
    return False


def fix_draft_len(sch: Scheduler, k: int | None) -> None:
    """Make ``sch`` draft exactly ``k`` tokens per stream wherever its drafter can, instead of
    the adaptive choice (None restores it): for measuring what verify rows cost, and for tests."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise ValueError(f"k is {k!r}; pass an integer >= 0, or None for the adaptive choice")
    _native.fix_draft_len(sch, k)


def detach_drafter(m: Model) -> None:
    """Stop speculating on schedulers created from now on."""
    m._drafter = None


def mtp_capable(m: Model) -> bool:
    """Whether a drafter is attached, so that ``create_scheduler(m, ..., mtp=True)`` speculates."""
    return m._drafter is not None


def drafter_kind(m: Model) -> str | None:
    """"ngram", "draft", or None when no drafter is attached."""
    return None if m._drafter is None else m._drafter.kind


SPEC_MODES = ("auto", "off", "ngram", "draft", "mtp")


def configure(m: Model, mode: str = "auto", draft: Model | None = None, max_draft: int = 8) -> str:
    """Attach the drafter ``mode`` asks for and say in words what runs: "off", "ngram" (prompt
    lookup), "draft" (``draft`` is required), "mtp" (the sidecar beside ``m``'s file), or "auto":
    the draft model if one is given, else an MTP sidecar that attaches, else prompt lookup.
    Raises ValueError when the drafter asked for cannot be attached."""
    if mode not in SPEC_MODES:
        raise ValueError(f"unknown speculation mode {mode!r} (use {', '.join(SPEC_MODES)})")
    detach_drafter(m)
    if mode == "off":
        return "off"
    if why := no_speculation(m):
        if mode != "auto":
            raise ValueError(f"speculation ({mode}) is not available: {why}")
        return f"off: {why}"
    if mode == "draft" or (mode == "auto" and draft is not None):
        if draft is None:
            raise ValueError("speculation with a draft model needs the draft model (--model-draft)")
        if not attach_draft_model(m, draft, max_draft):
            raise ValueError(f"{draft.path.name} cannot draft for {m.path.name}: their vocabularies differ (see the log)")
        return f"draft model {draft.path.name}, up to {max_draft} tokens"
    sidecar = mtp_drafter_sidecar(m.path) if mode in ("mtp", "auto") else ""
    if mode == "mtp" and not sidecar:
        raise ValueError(f"no MTP sidecar beside {m.path} (looked for mtp-{m.path.stem}-Q8_0.gguf and mtp-{m.path.stem}.gguf)")
    if sidecar and attach_mtp_drafter(m, sidecar):
        return f"MTP head {Path(sidecar).name}"
    if mode == "mtp":
        raise ValueError(f"the MTP sidecar {sidecar} cannot draft for {m.path.name} (see the log)")
    attach_ngram_drafter(m, max_draft)
    return f"n-gram prompt lookup, up to {max_draft} tokens"


def _check_max_draft(max_draft: int) -> int:
    if isinstance(max_draft, bool) or not isinstance(max_draft, int) or not 1 <= max_draft <= MAX_DRAFT:
        raise ValueError(f"max_draft is {max_draft!r}; it must be an integer between 1 and {MAX_DRAFT}")
    return max_draft


__all__ = [
    "SPEC_MODES",
    "attach_draft_model",
    "attach_mtp_drafter",
    "attach_ngram_drafter",
    "configure",
    "detach_drafter",
    "drafter_kind",
    "fix_draft_len",
    "mtp_capable",
    "mtp_drafter_sidecar",
    "no_speculation",
]
