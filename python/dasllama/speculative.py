"""Speculative decoding: drafters that propose a stream's next tokens for the scheduler to verify.

A drafter is attached to a model; a scheduler created with ``mtp=True`` then speculates on every
decoding stream, and how many tokens each stream drafts adapts to what the engine measures (its
acceptance, and what an extra row costs at the current batch)::

    attach_ngram_drafter(m)                       # prompt lookup: no extra model
    sch = create_scheduler(m, 4, mtp=mtp_capable(m))

A model whose file carries an MTP head (Qwen3.5, Qwen3-Next: ``<arch>.nextn_predict_layers``)
drafts with it when no other drafter is attached; ``attach_mtp_drafter(m, path)`` attaches the
head in a sidecar file instead, or Gemma 4's assistant drafter (``gemma4-assistant``).

Output does not depend on speculation: the target verifies each draft by sampling from its own
logits for that position with the stream's own sampler, so greedy and seeded streams produce
exactly the tokens they produce without a drafter.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from pathlib import Path
from typing import Any

from . import _native
from .gguf_file import GgufHeader, read_header
from .model import Model
from .scheduler import Scheduler

log = logging.getLogger("dasllama")

MAX_DRAFT = 32


def no_speculation(m: Model) -> str | None:
    """Why ``m`` cannot speculate, or None when it can. Every family can: K/V rolls back by
    truncation, and a hybrid's recurrent (DeltaNet) state by replaying the accepted rows of the
    verify chunk. (A hybrid cannot be a *draft model*: see :func:`attach_draft_model`.)"""
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
    nothing attached, when its vocabulary differs or the draft is a hybrid (its DeltaNet state
    goes back over its last pass only, and a draft model takes a pass per draft)."""
    if not isinstance(draft, Model):
        raise TypeError(f"draft must be a dasllama Model (from load_model), not {type(draft).__name__}")
    if draft.config.get("recurrent_layers", 0):
        log.warning("not speculating: the draft model %s (%s) has recurrent (DeltaNet) layers, which cannot draft", draft.path.name, draft.arch)
        return False
    drafter, why = _native.model_drafter(m._native, draft._native, _check_max_draft(max_draft))
    if drafter is None:
        log.warning("draft model %s cannot draft for %s: %s", draft.path.name, m.path.name, why)
        return False
    m._drafter = drafter
    return True


# A quantization tag ending a file's stem ("-Q4_K_M", "-Q8_0", "-BF16", "-IQ4_XS", "-MXFP4_MOE").
_QUANT_TAG = re.compile(r"-((?:I?Q\d|F16|F32|BF16|MXFP4)[A-Z0-9_]*)$", re.IGNORECASE)


def _quant_bits(tag: str) -> int:
    digits = re.search(r"\d+", tag)
    return int(digits.group()) if digits else 0


def mtp_drafter_sidecar(path: str | os.PathLike[str]) -> str:
    """The MTP sidecar that sits beside the model file ``path``, or "" if none: ``mtp-<stem>-Q8_0.gguf``
    or ``mtp-<stem>.gguf`` (llama.cpp's converter with ``--mtp``), else, as llama.cpp finds the
    sidecar of a Hugging Face repository's model (Gemma 4 ships its assistant drafter so:
    ``model-Q4_K_M.gguf`` beside ``mtp-model-Q8_0.gguf``), an ``mtp-<name>-<quant>.gguf`` of the
    model's name without its quantization tag: the same quantization first, else the closest in
    bits."""
    p = Path(path)
    for name in (f"mtp-{p.stem}-Q8_0.gguf", f"mtp-{p.stem}.gguf"):
        if (p.parent / name).is_file():
            return str(p.parent / name)
    tag = _QUANT_TAG.search(p.stem)
    if tag is None:
        return ""
    base, bits = p.stem[: tag.start()], _quant_bits(tag.group(1))
    found = []
    for f in p.parent.glob(f"mtp-{glob.escape(base)}-*.gguf"):
        t = _QUANT_TAG.search(f.stem)
        if f.is_file() and t is not None and f.stem[: t.start()] == f"mtp-{base}":
            found.append((t.group(1).upper() != tag.group(1).upper(), abs(_quant_bits(t.group(1)) - bits), f.name))
    return str(p.parent / min(found)[2]) if found else ""


def attach_mtp_drafter(m: Model, path: str | os.PathLike[str] | None = None, max_draft: int = 8) -> bool:
    """Attach an MTP (NextN) head: the one in the sidecar ``path`` (``mtp_drafter_sidecar``
    finds it beside the model), or with ``path=None`` the one ``m``'s own file carries. It drafts
    by chaining: the next token's draft from the trunk's last hidden state, each further one from
    the head's own. False, with the reason logged and nothing attached, when the file holds no MTP
    head or was made for another model (architecture, width, attention shape, vocabulary)."""
    _check_max_draft(max_draft)
    if path is None:
        drafter = _native.own_mtp_drafter(m._native, max_draft)
        if drafter is None:
            log.warning("not attaching an MTP head: %s carries none (%s.nextn_predict_layers and blk.N.nextn.* tensors)", m.path.name, m.arch)
            return False
        m._drafter = drafter
        return True
    hdr = read_header(path)
    meta = hdr.metadata
    arch = str(meta.get("general.architecture", ""))
    tokens = meta.get("tokenizer.ggml.tokens")
    why = None
    if arch == ASSISTANT_ARCH:
        why = assistant_mismatch(m, hdr)
        if why is None:
            from .gguf_file import meta_section

            tensors = [(t.name, t.type_id, t.shape, t.offset) for t in hdr.tensors]
            drafter, why = _native.sidecar_mtp_drafter(m._native, str(path), arch, meta_section(meta, arch), tensors, max_draft)
            if drafter is not None:
                m._drafter = drafter
                return True
    elif not meta.get(f"{arch}.nextn_predict_layers") or not any(".nextn." in t.name for t in hdr.tensors):
        why = f"it holds no MTP layers ({arch}.nextn_predict_layers and blk.N.nextn.* tensors)"
    elif arch != m.arch:
        why = f"it was made for a {arch} model, and {m.path.name} is {m.arch}"
    elif tokens is not None and len(tokens) != m.n_vocab:
        why = f"its vocabulary has {len(tokens)} tokens, and {m.path.name}'s has {m.n_vocab}"
    else:
        from .gguf_file import meta_section

        tensors = [(t.name, t.type_id, t.shape, t.offset) for t in hdr.tensors]
        drafter, reason = _native.sidecar_mtp_drafter(m._native, str(path), arch, meta_section(meta, arch), tensors, max_draft)
        if drafter is not None:
            m._drafter = drafter
            return True
        why = reason
    log.warning("not attaching %s to %s: %s", path, m.path.name, why)
    return False


# Gemma 4's assistant drafter (llama.cpp's LLM_ARCH_GEMMA4_ASSISTANT): a small model of its own
# width that reads the target's token embeddings (scaled by the square root of the target's width)
# and the target's last hidden state, attends with queries only to the target's K/V (its
# sliding-window layers to the target's last sliding-window layer, its global layers to the
# target's last layer), and hands back logits and its next hidden state.
ASSISTANT_ARCH = "gemma4-assistant"
ASSISTANT_TARGETS = ("gemma4",)


def assistant_mismatch(m: Model, hdr: GgufHeader) -> str | None:
    """Why the gemma4-assistant file ``hdr`` cannot draft for ``m`` (naming the key or tensor
    that differs), or None when its shape fits: the target's architecture, its width (the
    assistant's ``embedding_length_out``), its vocabulary, and the head sizes of the target layers
    the assistant attends to."""
    meta, a = hdr.metadata, ASSISTANT_ARCH
    t = m.arch
    if t not in ASSISTANT_TARGETS:
        return f"it is a {a} drafter, which drafts for {' or '.join(ASSISTANT_TARGETS)} models, and {m.path.name} is {t}"
    tmeta = m.metadata
    width, theirs = tmeta.get(f"{t}.embedding_length"), meta.get(f"{a}.embedding_length_out")
    if theirs is None:
        return f"{a}.embedding_length_out is missing: the drafter does not say which target width it reads"
    if int(theirs) != int(width or 0):
        return f"{a}.embedding_length_out is {theirs}: it was made for a target of width {theirs}, and {m.path.name}'s {t}.embedding_length is {width}"
    if int(theirs) == int(meta.get(f"{a}.embedding_length", 0)):
        return f"{a}.embedding_length_out equals its embedding_length ({theirs}): llama.cpp requires it to carry the target's width, unlike the drafter's own"
    emb = next((x for x in hdr.tensors if x.name == "token_embd.weight"), None)
    if emb is None:
        return "its tensor 'token_embd.weight' (the drafter's output matrix) is missing"
    rows = int(emb.shape[1]) if len(emb.shape) > 1 else 1
    if rows != m.n_vocab:
        return f"its 'token_embd.weight' has {rows} rows: a vocabulary of {rows}, and {m.path.name}'s has {m.n_vocab}"
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) != m.n_vocab:
        return f"its vocabulary (tokenizer.ggml.tokens) has {len(tokens)} tokens, and {m.path.name}'s has {m.n_vocab}"
    # llama.cpp points the assistant's sliding layers at the target's second-to-last layer and its
    # global layers at the last (llama_model::create_memory's share): a Gemma 4 ends sliding, full.
    tpat: Any = tmeta.get(f"{t}.attention.sliding_window_pattern")
    tpat = [bool(x) for x in tpat] if tpat is not None and hasattr(tpat, "__len__") else []
    if len(tpat) >= 2 and (not tpat[-2] or tpat[-1]):
        kinds = ", ".join("sliding" if x else "full" for x in tpat[-2:])
        return f"{m.path.name}'s last two layers are {kinds} ({t}.attention.sliding_window_pattern): the assistant reads the K/V of a sliding then a full last layer"
    for key in ("attention.key_length", "attention.key_length_swa"):
        mine, target = meta.get(f"{a}.{key}"), tmeta.get(f"{t}.{key}")
        if mine is not None and target is not None and int(mine) != int(target):
            return f"{a}.{key} is {mine}, and {m.path.name}'s {t}.{key} is {target}: its queries do not fit the target's keys"
    return _assistant_tensors_mismatch(hdr, int(theirs), m.n_vocab)


def _per_layer(meta: dict[str, Any], key: str, n_layers: int) -> list[int] | str:
    """A key that is one number or one per layer (llama.cpp's get_key_or_arr), per layer; a
    message naming it where it is missing or of another length."""
    v = meta.get(f"{ASSISTANT_ARCH}.{key}")
    if v is None:
        return f"{ASSISTANT_ARCH}.{key} is missing"
    if not hasattr(v, "__len__"):
        return [int(v)] * n_layers
    xs = [int(x) for x in v]  # an array (read as a list or a NumPy array)
    return xs if len(xs) == n_layers else f"{ASSISTANT_ARCH}.{key} has {len(xs)} entries for {n_layers} layers"


def _assistant_tensors_mismatch(hdr: GgufHeader, target_width: int, n_vocab: int) -> str | None:
    """The first tensor of the assistant file that is missing or has another shape than its
    metadata implies (as llama.cpp's gemma4-assistant loader creates them), named; else None."""
    meta, a = hdr.metadata, ASSISTANT_ARCH
    n_layers = int(meta.get(f"{a}.nextn_predict_layers") or meta.get(f"{a}.block_count") or 0)
    if n_layers <= 0:
        return f"{a}.nextn_predict_layers (or block_count) is missing or 0: it has no layers"
    width = int(meta.get(f"{a}.embedding_length", 0))
    raw: Any = meta.get(f"{a}.attention.sliding_window_pattern")
    pattern = [bool(x) for x in raw] if raw is not None and hasattr(raw, "__len__") and not isinstance(raw, str) else []
    if len(pattern) < n_layers:
        return f"{a}.attention.sliding_window_pattern is missing or shorter than its {n_layers} layers"
    heads, ffs = _per_layer(meta, "attention.head_count", n_layers), _per_layer(meta, "feed_forward_length", n_layers)
    for v in (heads, ffs):
        if isinstance(v, str):
            return v
    assert isinstance(heads, list) and isinstance(ffs, list)
    hd_full = int(meta.get(f"{a}.attention.key_length", 0))
    hd_swa = int(meta.get(f"{a}.attention.key_length_swa", hd_full))
    want: dict[str, list[int]] = {
        "token_embd.weight": [width, n_vocab],
        "output_norm.weight": [width],
        "nextn.pre_projection.weight": [2 * target_width, width],
        "nextn.post_projection.weight": [width, target_width],
    }
    for i in range(n_layers):
        hd, p = hd_swa if pattern[i] else hd_full, f"blk.{i}."
        want |= {
            p + "attn_norm.weight": [width],
            p + "attn_q.weight": [width, hd * heads[i]],
            p + "attn_q_norm.weight": [hd],
            p + "attn_output.weight": [hd * heads[i], width],
            p + "post_attention_norm.weight": [width],
            p + "layer_output_scale.weight": [1],
            p + "ffn_norm.weight": [width],
            p + "ffn_gate.weight": [width, ffs[i]],
            p + "ffn_up.weight": [width, ffs[i]],
            p + "ffn_down.weight": [ffs[i], width],
            p + "post_ffw_norm.weight": [width],
        }
        if not pattern[i]:
            want["rope_freqs.weight"] = [hd // 2]
    have = {t.name: [int(x) for x in t.shape] for t in hdr.tensors}
    for name, shape in want.items():
        if name not in have:
            return f"its tensor '{name}' is missing"
        if have[name] != shape:
            return f"its tensor '{name}' is {'x'.join(map(str, have[name]))}; its metadata implies {'x'.join(map(str, shape))}"
    return None


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
    """Whether ``create_scheduler(m, ..., mtp=True)`` speculates: a drafter is attached, or the
    model's file carries an MTP head (which drafts when nothing else is attached)."""
    return m._drafter is not None or bool(m.config.get("mtp_layers", 0))


def drafter_kind(m: Model) -> str | None:
    """"ngram", "draft", "mtp", or None when no drafter is attached."""
    return None if m._drafter is None else m._drafter.kind


SPEC_MODES = ("auto", "off", "ngram", "draft", "mtp")


def configure(m: Model, mode: str = "auto", draft: Model | None = None, max_draft: int = 8) -> str:
    """Attach the drafter ``mode`` asks for and say in words what runs: "off", "ngram" (prompt
    lookup), "draft" (``draft`` is required), "mtp" (the head in ``m``'s own file, else the
    sidecar beside it), or "auto": the draft model if one is given, else an MTP head that
    attaches, else prompt lookup.
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
    if mode in ("mtp", "auto") and m.config.get("mtp_layers", 0) and attach_mtp_drafter(m, None, max_draft):
        return f"MTP head in {m.path.name}, up to {max_draft} tokens"
    sidecar = mtp_drafter_sidecar(m.path) if mode in ("mtp", "auto") else ""
    if mode == "mtp" and not sidecar:
        raise ValueError(f"{m.path.name} carries no MTP head and there is no MTP sidecar beside it (looked for mtp-{m.path.stem}-Q8_0.gguf and mtp-{m.path.stem}.gguf)")
    if sidecar and attach_mtp_drafter(m, sidecar, max_draft):
        return f"MTP head {Path(sidecar).name}, up to {max_draft} tokens"
    if mode == "mtp":
        raise ValueError(f"the MTP sidecar {sidecar} cannot draft for {m.path.name} (see the log)")
    attach_ngram_drafter(m, max_draft)
    return f"n-gram prompt lookup, up to {max_draft} tokens"


def _check_max_draft(max_draft: int) -> int:
    if isinstance(max_draft, bool) or not isinstance(max_draft, int) or not 1 <= max_draft <= MAX_DRAFT:
        raise ValueError(f"max_draft is {max_draft!r}; it must be an integer between 1 and {MAX_DRAFT}")
    return max_draft


__all__ = [
    "ASSISTANT_ARCH",
    "SPEC_MODES",
    "assistant_mismatch",
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
