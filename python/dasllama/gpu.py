"""The GPU tier: a Vulkan driver that holds a whole model on the device and serves device-home
sessions (their K/V in one device region per stream) with true batched decode.

The names and their order are the serving tutorial's (§ "Multi-model GPU serving: the slot
dance" and § "Streams served from the device")::

    set_gpu_tier_want(GpuTierWant(auto_tier=True))
    moe_gpu_tier_arm()                    # open the device; False (and a reason) where there is none
    m = load_model(path)                  # an armed load puts the model on the device if it fits
    slot = gpu_model_marks_init()
    gpu_slot_capture(slot)                # "cpu" | "gpu:rails" | "gpu:partial" | "gpu:resident"

On a machine without Vulkan every call is a cheap no-op that reports "cpu", so the same code runs
anywhere. These names are the tutorial's, and so is their process-wide tier: one model installed
through it at a time. Underneath they are a facade over device and model objects
(:mod:`dasllama.devices`): the armed device is a :class:`~dasllama.devices.Device`, an installed
model owns its placement there, and everything the tier reports is read from those (a snapshot,
never waiting for a device step). Code that does not follow the tutorial uses
``load_model(path, device=...)``, ``Model.to`` and ``Model.placement`` directly, and may put
several models on one device. CPU-type Vulkan devices
(Mesa's lavapipe) are used only with ``DASLLAMA_VK_ALLOW_CPU=1``; ``DASLLAMA_VK_DEVICE`` picks a
device by index or name; ``DASLLAMA_GPU=0`` keeps everything on the CPU.

"gpu:resident": the device runs the model's whole forward pass (every family the CPU runs), for
device-home sessions whose K/V lives in device regions (f16, q8_0 or tq4:
:func:`set_gpu_kv_dtype`). Sessions whose K/V lives in host memory run on the CPU then, and
:func:`gpu_cpu_passes` counts them.

"gpu:partial": the model does not fit whole, so its first layers (as many as fit, with their K/V
regions) run on the device and the rest and the head on the CPU, over the session's host K/V for
those layers, as llama.cpp's ``-ngl``; the reason says how many.

"gpu:rails": a model the device cannot run whole and cannot split (:func:`gpu_resident_decline`
says why) has its matrices put on the device, densest first, as far as the budget allows, and
every session's matmuls over them run there, while the rest stays on the CPU over host K/V.
``numerics="ggml"`` stays on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import _native
from .devices import CPU, PlaceOptions, _open_default, place, tier_install
from .errors import DeviceError
from .model import Model
from .runtime import GpuTier, GpuTierWant, default_runtime
from .scheduler import Scheduler
from .session import KVDtype, Session, check_kv_dtype

__all__ = [
    "GpuCpuPass",
    "GpuCtxPins",
    "GpuKvDtypePin",
    "GpuModelMarks",
    "GpuTierStatus",
    "GpuTierWant",
    "create_device_session",
    "device_kv_max_rows",
    "gpu_cpu_passes",
    "gpu_ctx_pins",
    "gpu_device_kv_adopt",
    "gpu_device_kv_park",
    "gpu_device_prefill_continues",
    "gpu_device_prefill_window",
    "gpu_device_session_ctx",
    "gpu_device_session_dtype",
    "gpu_device_sessions",
    "gpu_install_reason",
    "gpu_kv_dtype_pin",
    "gpu_model_marks_init",
    "gpu_resident_decline",
    "gpu_resident_experts_host",
    "gpu_slot_capture",
    "gpu_slot_rearm",
    "gpu_tier_status",
    "is_device_session",
    "kernel_backend_available",
    "moe_gpu_drop_model",
    "moe_gpu_hydrate_session",
    "moe_gpu_model_marks_restore",
    "moe_gpu_model_marks_save",
    "moe_gpu_tier_arm",
    "moe_gpu_weight_budget",
    "reset_gpu_kv_dtype",
    "resident_prefill_allowed",
    "set_device_kv",
    "set_gpu_ctx_max",
    "set_gpu_ctx_strict",
    "set_gpu_kv_dtype",
    "set_gpu_resident_regions",
    "set_gpu_tier_want",
    "set_resident_prefill_allowed",
    "vulkan_devices",
]


def kernel_backend_available(name: str) -> bool:
    """Whether this machine can serve on backend ``name`` ("cpu" always; "vulkan" when a usable
    device answers: the witness enumerates devices once and caches its verdict)."""
    if name == "cpu":
        return True
    if name == "vulkan":
        return default_runtime().vk_witness()[0]
    raise ValueError(f"unknown kernel backend '{name}' (cpu or vulkan)")


def vulkan_devices() -> list[dict[str, object]]:
    """Every Vulkan device the loader reports: index, name, kind ("discrete", "integrated",
    "virtual", "cpu"), api_version, vram_bytes. Raises DeviceError where there is no loader."""
    return _native.vk_devices()


@dataclass
class GpuTierStatus:
    backend: str  # "vulkan" while a model is on the device, else "cpu"
    device: str  # the opened device's name ("" before arming)
    supported: bool  # a usable Vulkan device answers on this machine
    reason: str  # why the device is not serving ("" while it does)
    vram_bytes: int  # device memory dasllama's allocator holds
    budget_bytes: int  # the device's memory budget
    resident_layers: int
    weight_bytes: int
    kv_bytes: int
    chains_recorded: int = 0  # device steps that recorded their dispatch chain
    chains_replayed: int = 0  # device steps that replayed a chain kept from an earlier step of that shape


def _tier() -> GpuTier:
    """The default runtime's tier: the one these tutorial calls drive."""
    return default_runtime().tier


def _placement(m: Model | None) -> dict[str, object] | None:
    return None if m is None else _native.placement_status(m._native)


def set_gpu_tier_want(want: GpuTierWant) -> None:
    """Record the tier request the next :func:`moe_gpu_tier_arm` / load honours."""
    if want.vram_mb < 0:
        raise ValueError(f"vram_mb must be >= 0, got {want.vram_mb}")
    _tier().want = GpuTierWant(bool(want.auto_tier), int(want.vram_mb))


def moe_gpu_tier_arm() -> bool:
    """Arm the recorded want: open the device so the next load can go there. False when the want
    is zero or no device answers (:func:`gpu_tier_status` says why)."""
    t = _tier()
    t.armed = None
    if not t.want.with_env().auto_tier:
        t.reason = "the GPU tier is off (zero want, --gpu off or DASLLAMA_GPU=0)"
        return False
    try:
        t.armed = _open_default()[0]
    except DeviceError as e:
        t.reason = str(e)
        return False
    t.reason = ""
    return True


def moe_gpu_weight_budget() -> int:
    """Bytes the armed device will hold for a model (0 when not armed): what it has free, plus
    what the installed model holds there."""
    t = _tier()
    if t.armed is None:
        return 0
    st = _placement(t.model())
    held = 0 if st is None else int(st["weight_bytes"]) + int(st["kv_bytes"])  # type: ignore[call-overload]
    free = t.armed.memory()[0] - t.armed.memory()[1]
    budget = max(free, 0) // 10 * 9 + held
    vram = t.want.with_env().vram_mb
    return min(budget, vram << 20) if vram else budget


def gpu_tier_status() -> GpuTierStatus:
    """A snapshot for status pages (never waits for a device step)."""
    t = _tier()
    supported, why, _ = default_runtime().vk_witness()
    s = GpuTierStatus("cpu", "", supported, "", 0, 0, 0, 0, 0)
    if t.armed is not None:
        s.device = t.armed.name
        s.budget_bytes = t.armed.memory()[0]
        s.vram_bytes = t.armed.allocated()
    st = _placement(t.model())
    if st is not None:
        s.backend = "vulkan"
        s.resident_layers, s.weight_bytes, s.kv_bytes = int(st["resident_layers"]), int(st["weight_bytes"]), int(st["kv_bytes"])  # type: ignore[call-overload]
        s.chains_recorded, s.chains_replayed = int(st["chains_recorded"]), int(st["chains_replayed"])  # type: ignore[call-overload]
        if not st["serving"]:
            s.backend, s.reason = "cpu", str(st["reason"])
    elif not supported:
        s.reason = why
    else:
        s.reason = t.reason or (t.install_reason if t.outcome == "cpu" else "") or "no model is on the device"
    return s


@dataclass
class GpuModelMarks:
    """One model slot's tier state: what its load got, and the want to re-arm it with."""

    outcome: str = "cpu"
    want: GpuTierWant = field(default_factory=GpuTierWant)
    reason: str = ""


def gpu_model_marks_init() -> GpuModelMarks:
    return GpuModelMarks()


def gpu_slot_capture(st: GpuModelMarks) -> str:
    """Right after a load: move its outcome into ``st`` and classify it: "cpu", "gpu:rails",
    "gpu:partial" or "gpu:resident"."""
    st.outcome, st.reason = gpu_outcome()
    return st.outcome


def gpu_outcome() -> tuple[str, str]:
    """(the last install's outcome, why it stayed on the CPU)."""
    t = _tier()
    if not t.outcome:
        return "cpu", gpu_resident_decline()
    return t.outcome, t.install_reason


def moe_gpu_hydrate_session(m: Model, s: Session) -> None:
    """Pull a device session's K/V back to host memory (it is a host session afterwards). Run it
    over every live session before :func:`moe_gpu_drop_model`."""
    del m  # the session knows its model; the name and order are the tutorial's
    _native.gpu_hydrate(s)


def moe_gpu_drop_model() -> None:
    """Free the installed model's whole device state (it runs on the CPU afterwards). Device
    sessions not hydrated first fail their next call with a clear error."""
    t = _tier()
    m = t.model()
    if m is not None:
        place(m, CPU, PlaceOptions())
    t.held = None
    t.outcome = "cpu"


_SAVED: dict[int, GpuModelMarks] = {}


def moe_gpu_model_marks_save(st: GpuModelMarks) -> None:
    """Bank what is left of the outgoing model's tier state in its slot."""
    _SAVED[id(st)] = GpuModelMarks(st.outcome, st.want, st.reason)


def moe_gpu_model_marks_restore(st: GpuModelMarks) -> None:
    """Bring back a slot's banked tier state before :func:`gpu_slot_rearm`."""
    saved = _SAVED.pop(id(st), None)
    if saved is not None:
        st.outcome, st.want, st.reason = saved.outcome, saved.want, saved.reason


def gpu_slot_rearm(want: GpuTierWant, m: Model) -> str:
    """Re-arm the installed model: want, arm, resident upload. The device must hold no other
    model (the switch order: hydrate, drop, save; then restore, rearm)."""
    set_gpu_tier_want(want)
    if not moe_gpu_tier_arm():
        t = _tier()
        t.outcome, t.install_reason = "cpu", t.reason
        return "cpu"
    return tier_install(_tier(), m)


def gpu_install_reason() -> str:
    """Why the last load or re-arm stayed on the CPU ("" when it went to the device)."""
    return gpu_outcome()[1]


def set_resident_prefill_allowed(allowed: bool) -> None:
    """Kept for the tutorial's order (a multi-stream scheduler pins it off). Device-home sessions
    never share a mirror here, so the pin changes nothing in this driver."""
    _tier().prefill_allowed = bool(allowed)


def resident_prefill_allowed() -> bool:
    return _tier().prefill_allowed


def _resident(m: Model | None) -> dict[str, object] | None:
    st = _placement(m)
    return st if st is not None and st["tier"] in ("gpu:resident", "gpu:partial") and st["serving"] else None


def device_kv_max_rows(m: Model) -> int:
    """Rows of context the driver holds a device session's K/V for (the model's context when it
    is not on the device)."""
    st = _resident(m)
    return int(st["session_ctx"]) if st is not None else int(m.config["seq_len"])  # type: ignore[call-overload]


def set_gpu_resident_regions(n: int) -> None:
    """How many device-home streams the next load serves (one K/V region each)."""
    if n < 1:
        raise ValueError(f"the device needs at least one region, got {n}")
    _tier().regions = int(n)


def set_gpu_ctx_max(n: int) -> None:
    """Cap the positions one region holds (0: the model's context)."""
    if n < 0:
        raise ValueError(f"ctx_max must be >= 0, got {n}")
    _tier().ctx_max = int(n)


def set_gpu_ctx_strict(strict: bool) -> None:
    """True: the cap is the context asked for, held for every region or the load declines."""
    _tier().ctx_strict = bool(strict)


@dataclass
class GpuCtxPins:
    ctx_max: int
    strict: bool


def gpu_ctx_pins() -> GpuCtxPins:
    return GpuCtxPins(_tier().ctx_max, _tier().ctx_strict)


def set_gpu_kv_dtype(dt: KVDtype | str) -> None:
    """The codec the driver holds K/V in for the next load: f16, q8_0 (about half of f16) or tq4
    (about a quarter), stored as the CPU's codecs store them. Unpinned, ``DASLLAMA_GPU_KV``
    decides (default f16). A model whose head size the codec cannot take stays on the CPU, saying
    so."""
    _tier().kv_pin = check_kv_dtype(dt)


@dataclass
class GpuKvDtypePin:
    dt: KVDtype
    asked: bool


def gpu_kv_dtype_pin() -> GpuKvDtypePin:
    name = _tier().kv_pin
    return GpuKvDtypePin(KVDtype(name or "f16"), name is not None)


def reset_gpu_kv_dtype() -> None:
    _tier().kv_pin = None


def gpu_device_sessions() -> int:
    """Regions the driver serves (0 on a CPU box or when the model is not on the device)."""
    st = _resident(_tier().model())
    return 0 if st is None else int(st["regions"])  # type: ignore[call-overload]


def gpu_resident_decline() -> str:
    """Why the resident driver does not serve, in words a person can act on ("" while it does)."""
    t = _tier()
    m = t.model()
    if _resident(m) is not None:
        return ""
    supported, why, _ = default_runtime().vk_witness()
    if not supported:
        return why
    st = _placement(m)
    if st is not None:
        return str(st["reason"])
    if t.outcome == "cpu" and t.install_reason:
        return t.install_reason
    return t.reason or "no model was installed on the device (arm the tier before the load)"


def gpu_device_session_ctx() -> int:
    st = _resident(_tier().model())
    return 0 if st is None else int(st["session_ctx"])  # type: ignore[call-overload]


def gpu_device_session_dtype() -> KVDtype:
    """The codec device-home sessions carry: the installed model's, else what the next install
    would use."""
    st = _resident(_tier().model())
    if st is not None and st["kv_dtype"]:
        return KVDtype(st["kv_dtype"])
    return KVDtype(_tier().kv_pin or default_runtime().config.gpu_kv or "f16")


def gpu_device_prefill_window() -> int:
    """Positions the device prefills in one dispatch chain."""
    return _native.gpu_prefill_window()


def gpu_resident_experts_host() -> bool:
    """Whether the driver serves a MoE whose routed experts sum on the CPU: never here (MoE
    models take the per-op rails)."""
    return False


def create_device_session(m: Model, dt: KVDtype | str | None = None) -> Session:
    """A device-home session: its K/V in a region of the device that holds ``m``, in the codec
    the model was placed with (``dt``, when given, must be that one). Raises ValueError when
    ``m`` is not held whole by a device, KvPoolFullError when every region is held."""
    st = _resident(m)
    if dt is not None and st is not None and check_kv_dtype(dt) != st["kv_dtype"]:
        raise ValueError(f"device sessions carry K/V in {st['kv_dtype']}, not {KVDtype(check_kv_dtype(dt)).value}; pin it with set_gpu_kv_dtype before the load")
    return _native.create_device_session(m._native)


def is_device_session(s: Session) -> bool:
    return _native.is_device_session(s)


def gpu_device_kv_park(s: Session) -> int:
    """Before deleting a finished device session: free its region for the next stream and keep
    its rows, named by the returned claim, until another stream takes the region."""
    return _native.gpu_park(s)


def gpu_device_kv_adopt(s: Session, claim: int, rows: int) -> bool:
    """Hand the first ``rows`` rows a claim names to the fresh device session ``s``, so the next
    turn prefills only its new tokens; images on M-RoPE axes among those rows come with them
    (they place the rows after them). False when the claim is stale."""
    return _native.gpu_adopt(s, int(claim), int(rows))


def gpu_device_prefill_continues(m: Model) -> bool:
    """Whether a device session of ``m`` may continue from adopted rows (every model the driver
    serves has no recurrent state, so yes when it is on the device)."""
    return _resident(m) is not None


@dataclass
class GpuCpuPass:
    count: int
    words: str


def gpu_cpu_passes() -> list[GpuCpuPass]:
    """The honesty counter: every kind of call that ran on the CPU while the installed model was
    on the device, with how many and why."""
    m = _tier().model()
    return [] if m is None else [GpuCpuPass(n, w) for n, w in _native.placement_cpu_passes(m._native)]


def set_device_kv(sch: Scheduler, on: bool) -> None:
    """Serve the scheduler's streams from the device: each stream's K/V in a device region, a
    finished conversation's rows parked there and adopted by its next turn (which then prefills
    only its new tokens). Only an idle scheduler switches; switching on needs the model on the
    device and a region for every stream (``gpu_device_sessions() >= max_streams``). ValueError
    says which is missing. If the device is lost, the scheduler's new streams go back to the CPU."""
    _native.set_device_kv(sch, bool(on))
