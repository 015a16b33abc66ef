"""Loading a GGUF model, and its tokenizer."""

from __future__ import annotations

import enum
import logging
import os
import time
from pathlib import Path
from typing import Any

from . import _native
from .devices import CPU, Device, PlacementStatus, PlaceOptions, default_device, place, placement, tier_install
from .devices import device as resolve_device
from .errors import DeviceError, GgufError, UnsupportedModelError
from .fetch import fetch
from .fetch.hub import is_hub_ref
from .gguf_file import meta_section, read_header
from .runtime import Runtime, default_runtime
from .vision import Projector, find_sidecar, load_mmproj

log = logging.getLogger("dasllama")

# Token texts llama.cpp treats as end-of-generation besides eos (llama-vocab.cpp).
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>", "<|eom_id|>"}
# Gemma 4 ends a turn with <turn|> and a tool call with <|tool_response>; llama.cpp lists these
# with the rest, but only for a gemma4 vocabulary here, where their meaning is known.
_EOG_TEXTS_GEMMA4 = {"<turn|>", "<|tool_response>", "<eos>"}
# Harmony's (gpt-oss's) structural tokens, which llama.cpp shows as text (user-defined) whatever
# the file says, so that a reply's channels can be read from its text.
_HARMONY_SHOWN = {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"}


class QuantMode(enum.Enum):
    """How weights are held after loading."""

    native = "native"  # as stored in the GGUF, memory-mapped
    q8 = "q8"  # every matrix converted to Q8_0 at load
    fp32 = "fp32"  # every matrix dequantized to f32: the exact-arithmetic reference


class Numerics(enum.Enum):
    """How dot products are added up."""

    fast = "fast"  # our tiled SIMD kernels (llama.cpp's activation rounding, our own order)
    ggml = "ggml"  # llama.cpp's AVX2 CPU order, bit for bit; several times slower (conformance)


class Model:
    """A loaded model. Read-only and shareable between sessions and threads."""

    def __init__(self, native: _native.Model, metadata: dict[str, Any], path: Path, runtime: Runtime) -> None:
        self._native = native
        # What it runs with (threads, K/V page bin, GPU tier): its sessions and schedulers too.
        self.runtime = runtime
        self.metadata = metadata
        self.path = path
        self.arch: str = native.arch
        self.config: dict[str, Any] = native.config
        self.chat_template: str | None = metadata.get("tokenizer.chat_template")
        # What schedulers created with mtp=True draft with (dasllama.speculative).
        self._drafter: _native.Drafter | None = None
        self._device: Device = CPU
        # The vision tower loaded beside it (load_model's mmproj), if any (dasllama.vision).
        self.projector: Projector | None = None

    @property
    def device(self) -> Device:
        """Where the model runs: the CPU, or the Vulkan device it is placed on."""
        if self._device.kind != "cpu" and _native.placement_status(self._native) is None:
            self._device = CPU
        return self._device

    @property
    def placement(self) -> PlacementStatus | None:
        """What its device holds for it and has done (None on the CPU): a snapshot published
        after each step, read without waiting for a running one."""
        return placement(self)

    def to(self, device: str | Device, **opts: Any) -> str:
        """Place the model on ``device`` ("cpu", "vulkan", "vulkan:N", "auto" or a Device),
        taking it off where it was; returns its tier ("cpu", "gpu:rails", "gpu:partial", "gpu:resident").
        ``opts`` are :class:`PlaceOptions` (regions, ctx_max, ctx_strict, kv_dtype, vram_mb).
        An explicit Vulkan device the model cannot go on raises DeviceError with the reason;
        "auto" falls back to the CPU, logging why."""
        auto = isinstance(device, str) and device.strip().lower() == "auto"
        d = resolve_device(device)
        tier, why = place(self, d, PlaceOptions(**opts))
        if tier == "cpu" and d.kind != "cpu":
            if not auto:
                raise DeviceError(f"{self.path.name} cannot go on {d} ('{d.name}'): {why}")
            log.info("%s runs on the CPU: %s", self.path.name, why)
        elif tier == "gpu:rails":
            log.info("%s on the per-op rails of '%s' (not resident: %s)", self.path.name, d.name, why)
        elif tier == "gpu:partial":
            log.info("%s split between '%s' and the CPU: %s", self.path.name, d.name, why)
        return tier

    @property
    def n_vocab(self) -> int:
        return self._native.n_vocab

    @property
    def eog_ids(self) -> list[int]:
        return self._native.eog_ids

    @property
    def bos_id(self) -> int | None:
        return self._native.bos_id

    @property
    def eos_id(self) -> int | None:
        return self._native.eos_id

    def __repr__(self) -> str:
        return repr(self._native)


def _tokenizer_args(meta: dict[str, Any], path: Path) -> dict[str, Any]:
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise GgufError(f"{path}: the file has no tokenizer (tokenizer.ggml.tokens is missing)")
    n = len(tokens)
    types = meta.get("tokenizer.ggml.token_type")
    types = [1] * n if types is None else [int(t) for t in types]
    scores = meta.get("tokenizer.ggml.scores")
    scores = [] if scores is None else [float(s) for s in scores]
    model = str(meta.get("tokenizer.ggml.model", "gpt2"))

    def tid(key: str) -> int | None:
        v = meta.get(key)
        return int(v) if v is not None and 0 <= int(v) < n else None

    eos = tid("tokenizer.ggml.eos_token_id")
    eog = {t for t in (tid("tokenizer.ggml.eot_token_id"), tid("tokenizer.ggml.eom_token_id")) if t is not None}
    eog_texts = _EOG_TEXTS | _EOG_TEXTS_GEMMA4 if model == "gemma4" else _EOG_TEXTS
    eog |= {i for i, (t, ty) in enumerate(zip(tokens, types, strict=False)) if ty in (3, 4) and t in eog_texts}
    special = {t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=False)) if ty in (3, 4) and t in _EOG_TEXTS | _HARMONY_SHOWN}
    if "<|return|>" in special and "<|call|>" in special:
        # Harmony: <|end|> closes one message (the analysis) and the reply goes on; <|return|>
        # and <|call|> end it (llama.cpp drops <|end|> from its end-of-generation ids the same way).
        eog.discard(special.get("<|end|>", -1))
        types = [4 if t in _HARMONY_SHOWN and ty in (3, 4) else ty for t, ty in zip(tokens, types, strict=False)]
    eog.discard(eos)  # type: ignore[arg-type]
    return dict(
        tokenizer_model=model,
        tokenizer_pre=str(meta.get("tokenizer.ggml.pre", "default")),
        tokens=list(tokens),
        token_types=types,
        scores=scores,
        merges=list(meta.get("tokenizer.ggml.merges", [])),
        bos=tid("tokenizer.ggml.bos_token_id"),
        eos=eos,
        eog=sorted(eog),
        # llama.cpp adds BOS for gemma4 whatever the file says (its files that say false are wrong).
        add_bos=model == "gemma4" or bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", model == "llama")),
    )


def load_model(
    path: str | os.PathLike[str],
    quant: QuantMode | str = QuantMode.native,
    numerics: Numerics | str = Numerics.fast,
    device: str | Device | None = None,
    mmproj: str | os.PathLike[str] | bool | None = None,
    runtime: Runtime | None = None,
    mmproj_offload: bool = True,
) -> Model:
    """Load a GGUF model: a path, a known name, or a Hugging Face model (``hf://owner/repo/file.gguf``
    or ``owner/repo[:quant]``, through ``huggingface_hub``), the last two fetched on first use.

    ``mmproj``: the vision projector file (llama.cpp's ``mmproj-*.gguf``) that lets the model
    take images (``Model.projector``, ``dasllama.vision``). None loads the ``mmproj*.gguf``
    beside the model when there is one (the one in its folder, or the one named after it) and
    its width fits the model; False loads none. A file given that is not an mmproj, or does not
    fit the model, raises. Where the model goes on a Vulkan device, its vision tower's matmuls
    and attention go there too (``Projector.placement``), unless ``mmproj_offload`` is False
    (llama-server's ``--no-mmproj-offload``).

    ``numerics=Numerics.ggml`` adds every dot product up in the order of llama.cpp's x86 AVX2 CPU
    build, so logits equal that build's bit for bit (every format but BF16; f16 KV cache); the
    default ``fast`` kernels round activations the same way but sum in their own
    order, which moves single log-probabilities by up to tenths of a nat on small models.

    ``device``: "cpu", "vulkan", "vulkan:N", "auto" or a :class:`Device` (see ``Model.to``).
    None follows the tutorial's armed GPU tier when it is armed (``dasllama.gpu``), else
    ``DASLLAMA_DEVICE`` / ``DASLLAMA_GPU``, else the CPU.

    ``runtime``: the :class:`~dasllama.Runtime` it runs on (its threads, K/V page bin, GPU tier);
    None: the default runtime, made from the environment on first use.

    Raises GgufError for a missing, malformed or truncated file and UnsupportedModelError for an
    architecture, tokenizer or tensor type this build does not implement.
    """
    qm = QuantMode(quant) if not isinstance(quant, QuantMode) else quant
    try:
        nm = Numerics(numerics)
    except ValueError:
        raise ValueError(f"unknown numerics {numerics!r} (use {', '.join(n.value for n in Numerics)})") from None
    p = Path(path).expanduser()
    if not p.exists() and (is_hub_ref(str(path)) or (not str(path).endswith(".gguf") and os.sep not in str(path))):
        p = fetch(str(path))  # a download logs its own time: the load below is timed apart
    t0 = time.perf_counter()
    hdr = read_header(p)
    meta = hdr.metadata
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise GgufError(f"{p}: general.architecture is missing; this is not a model file")
    if arch not in _native.arch_names():
        raise UnsupportedModelError(f"{p}: architecture '{arch}' is not supported (supported: {', '.join(_native.arch_names())})")
    tensors = [(t.name, t.type_id, t.shape, t.offset) for t in hdr.tensors]
    rt = runtime if runtime is not None else default_runtime()
    native = _native.load_model(rt._native, str(p), arch, meta_section(meta, arch), tensors, quant=qm.value, numerics=nm.value, **_tokenizer_args(meta, p))
    log.info("loaded %s (%s, %s, %s numerics) in %.2fs", p.name, arch, qm.value, nm.value, time.perf_counter() - t0)
    model = Model(native, meta, p, rt)
    _attach_projector(model, mmproj, mmproj_offload)
    if device is None:
        if rt.tier.armed is not None:
            # The tutorial's armed tier takes the model (or records why not).
            tier_install(rt.tier, model)
            return model
        device = default_device()
    if str(device).strip().lower() != "cpu":
        model.to(device)
    return model


def _attach_projector(model: Model, mmproj: str | os.PathLike[str] | bool | None, offload: bool) -> None:
    """Load ``mmproj`` (or the sidecar found beside the model, for None) into ``model.projector``."""
    if mmproj is False:
        return
    explicit = mmproj is not None and mmproj is not True
    path = Path(mmproj).expanduser() if explicit else find_sidecar(model.path)  # type: ignore[arg-type]
    if path is None:
        if mmproj is True:
            raise GgufError(f"{model.path}: no mmproj*.gguf beside the model (pass its path as mmproj=)")
        return
    proj = load_mmproj(path, model.runtime, offload)
    # An image row's values: the embedding, and Qwen3-VL's deepstack slices after it.
    dim = int(model.config["embd_inp"])
    if proj.text_dim != dim:
        what = f"takes image rows of {dim} values" if dim != int(model.config["dim"]) else f"embeds {dim}"
        msg = f"{path}: the projector writes rows of {proj.text_dim} values but {model.path.name} {what}: it belongs to another model"
        if explicit or mmproj is True:
            raise UnsupportedModelError(msg)
        log.warning("not loading the sidecar %s", msg)
        return
    model.projector = proj
    per_image = "tokens by the image's size" if proj.native.dynamic_size else f"{proj.n_tokens} tokens an image"
    log.info("loaded %s (%s projector, %s)", path.name, proj.projector_type, per_image)


def encode(m: Model, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
    """Text to token ids. ``add_bos=None`` follows the model; ``special`` parses control tokens."""
    return _native.encode(m._native, text, add_bos, special)


def decode(m: Model, ids: list[int], special: bool = False) -> str:
    """Token ids to text. Control tokens are dropped unless ``special``."""
    return _native.decode(m._native, list(ids), special)


def token_piece(m: Model, id: int, special: bool = False) -> bytes | str:
    """One token's text: ``str`` when it is valid UTF-8 on its own, else the raw ``bytes``."""
    raw = _native.token_piece_bytes(m._native, id, special)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw
