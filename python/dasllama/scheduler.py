"""The continuous-batching scheduler (the seed's ``dasllama_scheduler``).

Requests are token lists with no KV; ``submit`` queues them; each ``scheduler_step`` admits FIFO
into free streams, runs ONE batched decode step over every decoding stream, then at most ONE
prefill chunk of ``chunk_tokens``. Results come back as :class:`SchedEvent` values::

    sch = create_scheduler(m, max_streams=4)
    submit(m, sch, PendingReq(id=1, prompt=ids, max_new=32))
    events: list[SchedEvent] = []
    while scheduler_step(m, sch, events):
        for ev in events:
            if ev.kind == "piece":
                print(ev.text, end="")
        events.clear()
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _native
from .chat import NothinkGuard
from .model import Model
from .session import KVDtype, SamplingParams, check_kv_dtype

Scheduler = _native.Scheduler


@dataclass
class PendingReq:
    """A request: its tokens and how to run it. Holds no KV, so a deep queue is cheap."""

    id: int
    prompt: list[int] = field(default_factory=list)
    close_toks: list[int] = field(default_factory=list)  # the turn's closing tokens (for the prefix cache)
    stop_ids: list[int] = field(default_factory=list)  # end the stream (besides end-of-generation); not emitted
    # make_nothink_guard(chat): on a turn rendered with thinking off, a thought marker before the
    # reply's content is a leading thought (emitted; split off by the reader), one after content
    # ends the stream. None: no guard.
    nothink: NothinkGuard | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new: int = 256
    seed: int = 0
    logprobs: int | None = None  # report each token's log-probability and this many alternatives
    ignore_eos: bool = False  # go on past end-of-generation tokens until max_new
    # Constrain the reply to an llguidance grammar: Lark text (JSON schemas embed as
    # ``start: %json {...}``; :func:`dasllama.grammar.json_schema_grammar` writes one), or
    # llguidance's JSON grammar list. Each token is sampled from those the grammar allows, the
    # stream stops ("stop") when the grammar is complete, and it never speculates. A grammar that
    # does not compile raises ValueError at submit.
    grammar: str | None = None
    # Images in the prompt (dasllama.vision.ImagePrompt.images()): (first prompt row, its
    # (rows, dim) float32 embeddings[, whether its rows see each other: default True[, its
    # M-RoPE grid (tokens per row, rows) or None: default None]]) each, in order. Their rows take
    # the embeddings instead of the placeholder tokens there; a non-causal image's rows run in
    # one pass and see each other; a gridded one's rows take M-RoPE positions (Qwen-VL).
    images: list[tuple[Any, ...]] = field(default_factory=list)
    # Report the prefill's progress: a "progress" event before its first chunk and after each.
    progress: bool = False


SchedEvent = _native.SchedEvent
"""``kind`` is "piece" (one token's text; never half a UTF-8 character) or "finished" (``finish``
is "stop", "length", "evicted" or "error"; an error names its kind in ``error_type``, e.g.
"kv_pool_full" or "internal", and says why in ``error``), or, for a request that asked for it,
"progress" (``n_prompt`` prompt rows, ``n_cached`` of them from the prefix cache, ``n_gen`` of
them evaluated so far, cached ones included; ``ttft_us`` the time since submit). Times are
microseconds."""


def create_scheduler(
    m: Model,
    max_streams: int = 4,
    max_queue: int = 32,
    chunk_tokens: int = 64,
    page_rows: int = 0,
    prefix_groups: int = 0,
    kv_dtype: KVDtype = KVDtype.f16,
    mtp: bool = False,
) -> Scheduler:
    """A scheduler of ``max_streams`` concurrent streams over ``m``, taking up to ``max_queue`` more
    requests waiting for a free stream (``submit`` returns False past that). ``page_rows > 0`` gives them a
    paged pool and a prefix cache (of at most ``prefix_groups`` pages; 0: as the pool allows):
    a finished stream donates its full pages and a new request attaches the longest cached prefix.
    ``mtp=True`` speculates with the drafter attached to ``m``, else with the MTP head its file
    carries (see :mod:`dasllama.speculative`; ``mtp_capable(m)`` says whether one is): output is the same, decoding faster where drafts
    are accepted."""
    codec = check_kv_dtype(kv_dtype)
    if page_rows < 0 or prefix_groups < 0:
        raise ValueError("page_rows and prefix_groups must be >= 0")
    # Without an attached drafter, the MTP head of the model's own file drafts, if it has one.
    drafter = (m._drafter or _native.own_mtp_drafter(m._native, 8)) if mtp else None
    if mtp and drafter is None:
        raise ValueError(
            "mtp=True needs a drafter attached to the model: attach_ngram_drafter(m), attach_draft_model(m, draft) "
            "or attach_mtp_drafter(m, path); mtp_capable(m) says whether one is"
        )
    if max_streams < 1 or chunk_tokens < 1 or max_queue < 0:
        raise ValueError("max_streams and chunk_tokens must be at least 1, max_queue at least 0")
    return _native.create_scheduler(m._native, max_streams, max_queue, chunk_tokens, page_rows, prefix_groups, codec, drafter)


def set_step_budget(sch: Scheduler, ms: float | None) -> float | None:
    """Size each step's prefill chunk so the whole step (the decode rows plus the chunk) takes about
    ``ms`` milliseconds: streams that are decoding keep a gap of about ``ms`` between tokens while a
    long prompt is prefilled, and the prompt gets what each step has left (at most ``chunk_tokens``,
    at least 4 tokens; no stream drafts meanwhile). ``None`` turns the budget off: fixed chunks of ``chunk_tokens``. Overrides
    ``DASLLAMA_STEP_MS`` (default 60 ms) for this scheduler. Returns the budget now in force, in ms:
    ``None`` under ``numerics="ggml"``, where a prompt's sums depend on its chunking, so chunks stay
    fixed whatever is asked."""
    if ms is not None:
        if isinstance(ms, bool) or not isinstance(ms, int | float):
            raise TypeError(f"step budget: expected milliseconds as a number, or None for fixed chunks; got {type(ms).__name__}")
        if not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"step budget must be a positive, finite number of milliseconds (got {ms}); pass None for fixed chunks")
    secs = _native.set_step_budget(sch, None if ms is None else ms / 1000.0)
    return None if secs is None else secs * 1000.0


def step_budget(sch: Scheduler) -> float | None:
    """The step budget in force, in milliseconds (None: fixed chunks); see :func:`set_step_budget`."""
    secs = _native.step_budget(sch)
    return None if secs is None else secs * 1000.0


def _image(im: tuple[Any, ...]) -> tuple[int, np.ndarray, bool, tuple[int, int] | None]:
    """A ``PendingReq.images`` entry in the native call's full form."""
    grid = im[3] if len(im) > 3 else None
    return (int(im[0]), np.ascontiguousarray(im[1], dtype=np.float32), bool(im[2]) if len(im) > 2 else True, None if grid is None else (int(grid[0]), int(grid[1])))


def submit(m: Model, sch: Scheduler, req: PendingReq) -> bool:
    """Queue ``req``; False when the queue is full. A request that cannot run (empty prompt,
    ``max_new < 1``, a prompt past the context, a duplicate id) raises and nothing is queued."""
    guard = None
    if req.nothink is not None:
        if not isinstance(req.nothink, NothinkGuard):
            raise TypeError(f"request {req.id}: nothink must come from make_nothink_guard (or be None), not {type(req.nothink).__name__}")
        guard = (list(req.nothink.open_ids), list(req.nothink.close_ids))
    if not 0 <= req.seed < 2**64:
        raise ValueError(f"request {req.id}: seed must be in [0, 2**64)")
    return _native.submit(m._native, sch, int(req.id), list(req.prompt), list(req.close_toks), list(req.stop_ids), req.params._native(), int(req.max_new), int(req.seed), req.logprobs, bool(req.ignore_eos), req.grammar, guard, [_image(im) for im in req.images], bool(req.progress))


def scheduler_step(m: Model, sch: Scheduler, events: list[SchedEvent]) -> bool:
    """One tick; appends its events to ``events``. Returns whether work remains."""
    more, evs = _native.scheduler_step(m._native, sch)
    events.extend(evs)
    return more


def evict(m: Model, sch: Scheduler, id: int, events: list[SchedEvent]) -> bool:
    """Drop request ``id`` (queued or running) at once; a finished(evicted) event reports it."""
    found, evs = _native.evict(m._native, sch, int(id))
    events.extend(evs)
    return found


def kv_page_bytes(m: Model, page_rows: int, kv_dtype: KVDtype | str = KVDtype.f16) -> int:
    """Bytes one KV page of ``page_rows`` positions takes for ``m`` (every layer's K and V)."""
    return _native.kv_page_bytes(m._native, page_rows, check_kv_dtype(kv_dtype))


def _inject_fault(sch: Scheduler, id: int) -> bool:
    """Test hook: the next evaluation that includes request ``id`` fails inside the engine. Only in
    a build with the ``fault-injection`` feature (the test suite's); AttributeError elsewhere."""
    return _native._inject_stream_fault(sch, int(id))


def clear_prefix_cache(sch: Scheduler) -> None:
    """Forget every page (and a hybrid's recurrent-state snapshot) the prefix cache holds: no
    later request attaches anything donated before. Pages live streams hold stay theirs."""
    _native.clear_prefix_cache(sch)


def n_active(sch: Scheduler) -> int:
    return _native.scheduler_counts(sch)[0]


def n_queued(sch: Scheduler) -> int:
    return _native.scheduler_counts(sch)[1]


def scheduler_stats(sch: Scheduler) -> dict[str, float]:
    """Counters: decode_steps, avg_batch, prefill_chunks, prefill_tokens, cached_tokens, finished,
    avg_ttft_ms, spec_verifies/spec_drafted/spec_accepted (speculation); with a paged pool also
    its page counts and the prefix cache's chains and hits, and for a hybrid model the recurrent-
    state snapshots it holds (kv_snapshots, kv_snapshot_bytes) and the prompts that matched cached
    pages none of which carried one (kv_cache_stateless: prefilled whole)."""
    stats = dict(_native.scheduler_stats(sch))
    pool = _native.scheduler_pool_stats(sch)
    if pool is not None:
        stats.update({f"kv_{k}": v for k, v in pool.items()})
    return stats
