"""dasllama: run GGUF language models on the CPU from Python.

    import dasllama as dl
    m = dl.load_model("smollm2-135m-instruct")       # fetched on first use
    s = dl.create_session(m)
    ids = dl.encode(m, "Once upon a time")
    out = dl.generate(m, s, ids, dl.SamplingParams(temp=0.8, seed=1), 48)
    print(dl.decode(m, out))
"""

import logging

from ._native import amx_status, arch_names
from .chat import (
    ChatRenderer,
    HarmonySplitter,
    NothinkGuard,
    ThoughtSplitter,
    add_assistant,
    add_user,
    create_chat_renderer,
    make_nothink_guard,
    render_chat,
    render_close,
    render_turn,
    set_thinking,
    split_reasoning,
    thought_splitter,
    turn_stop_ids,
)
from .devices import Device, PlacementStatus, device, devices
from .embeddings import default_pooling, embed
from .errors import ContextOverflowError, DasllamaError, DeviceError, EngineError, FetchError, GgufError, KvPoolFullError, TemplateError, UnsupportedModelError
from .fetch import DEFAULT_MODEL, fetch
from .grammar import check_grammar, json_object_grammar, json_schema_grammar
from .model import Model, Numerics, QuantMode, decode, encode, load_model, token_piece
from .runtime import Runtime, RuntimeConfig, default_runtime, n_threads
from .sampling_defaults import SamplingDefaults, sampling_defaults
from .scheduler import PendingReq, SchedEvent, Scheduler, clear_prefix_cache, create_scheduler, evict, n_active, n_queued, scheduler_stats, scheduler_step, set_step_budget, step_budget, submit
from .session import (
    BatchWorkspace,
    KVDtype,
    KvPool,
    SamplingParams,
    Session,
    create_batch_workspace,
    create_kv_pool,
    create_session,
    eval,
    eval_all,
    eval_batch,
    generate,
    gpu_dn_room,
    kv_pool_stats,
    release_kv_pages,
    sample,
)
from .speculative import attach_draft_model, attach_mtp_drafter, attach_ngram_drafter, detach_drafter, drafter_kind, fix_draft_len, mtp_capable, mtp_drafter_sidecar

logging.getLogger("dasllama").addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "BatchWorkspace",
    "ChatRenderer",
    "ContextOverflowError",
    "DasllamaError",
    "Device",
    "DeviceError",
    "EngineError",
    "FetchError",
    "GgufError",
    "HarmonySplitter",
    "KVDtype",
    "KvPool",
    "KvPoolFullError",
    "Model",
    "NothinkGuard",
    "Numerics",
    "PendingReq",
    "PlacementStatus",
    "QuantMode",
    "Runtime",
    "RuntimeConfig",
    "SamplingDefaults",
    "SamplingParams",
    "SchedEvent",
    "Scheduler",
    "Session",
    "TemplateError",
    "ThoughtSplitter",
    "UnsupportedModelError",
    "add_assistant",
    "add_user",
    "amx_status",
    "arch_names",
    "attach_draft_model",
    "attach_mtp_drafter",
    "attach_ngram_drafter",
    "check_grammar",
    "clear_prefix_cache",
    "create_batch_workspace",
    "create_chat_renderer",
    "create_kv_pool",
    "create_scheduler",
    "create_session",
    "decode",
    "default_pooling",
    "default_runtime",
    "detach_drafter",
    "device",
    "devices",
    "drafter_kind",
    "embed",
    "encode",
    "eval",
    "eval_all",
    "eval_batch",
    "evict",
    "fetch",
    "fix_draft_len",
    "generate",
    "gpu_dn_room",
    "json_object_grammar",
    "json_schema_grammar",
    "kv_pool_stats",
    "load_model",
    "make_nothink_guard",
    "mtp_capable",
    "mtp_drafter_sidecar",
    "n_active",
    "n_queued",
    "n_threads",
    "release_kv_pages",
    "render_chat",
    "render_close",
    "render_turn",
    "sample",
    "sampling_defaults",
    "scheduler_stats",
    "scheduler_step",
    "set_step_budget",
    "set_thinking",
    "split_reasoning",
    "step_budget",
    "submit",
    "thought_splitter",
    "token_piece",
    "turn_stop_ids",
]
