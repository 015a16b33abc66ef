"""Devices a model runs on: the CPU, which every model has, and Vulkan devices, opened once per
process and shared by the models placed on them.

    import dasllama as dl
    dl.devices()                                    # [Device('cpu'), Device('vulkan:0', 'NVIDIA H200', ...)]
    m = dl.load_model("smollm2-135m-instruct", device="auto")
    m.device                                        # where it runs
    m.placement                                     # PlacementStatus: tier, bytes, regions (None on the CPU)
    m.to("cpu")                                     # take it off the device (its device memory is freed)

A model on a Vulkan device is placed there whole ("gpu:resident": every pass of a device-home
session runs there) when the resident driver takes its architecture and it fits; otherwise its
matrices go there and the rest runs on the CPU ("gpu:rails"); one that does not fit whole has its
first layers there and the rest on the CPU ("gpu:partial", as llama.cpp's -ngl). Models on one device share it, each
with its own weights and K/V regions; a step of one never waits for a step of another, and
status reads never wait for a step.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _native
from .errors import DeviceError
from .runtime import GpuTier, Runtime, default_runtime

if TYPE_CHECKING:
    from .model import Model

__all__ = ["Device", "PlacementStatus", "device", "devices"]

log = logging.getLogger("dasllama")


@dataclass(frozen=True)
class Device:
    """A compute device: ``kind`` "cpu" or "vulkan" (then ``index``, ``name`` and ``device_kind``,
    the Vulkan device type: "discrete", "integrated", "virtual", "cpu")."""

    kind: str
    index: int | None = None
    name: str = "cpu"
    device_kind: str = "cpu"
    vram_bytes: int = 0

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"vulkan:{self.index}"

    def memory(self) -> tuple[int, int]:
        """(budget, usage) of the device's memory in bytes ((0, 0) for the CPU)."""
        return _open(self).memory() if self.kind == "vulkan" else (0, 0)

    def allocated(self) -> int:
        """Device memory dasllama holds on this device (every model placed on it)."""
        return _open(self).allocated() if self.kind == "vulkan" else 0


CPU = Device("cpu")


@dataclass(frozen=True)
class PlacementStatus:
    """What a device holds for one model, as published after its last step."""

    tier: str  # "gpu:resident" (the whole pass on the device), "gpu:partial" (its first resident_layers) or "gpu:rails" (its matrices only)
    device: str  # the device's name
    reason: str  # why the device does not run the whole pass ("" while it does)
    serving: bool  # False once the device failed under it (the model runs on the CPU then)
    resident_layers: int
    weight_bytes: int
    kv_bytes: int
    regions: int  # device-home streams it serves (resident only)
    session_ctx: int  # positions per region
    kv_dtype: str | None  # the codec of its device K/V
    chains_recorded: int
    chains_replayed: int


_lock = threading.Lock()
_opened: dict[int, _native.VulkanDevice] = {}


def _describe(info: dict[str, Any]) -> Device:
    return Device("vulkan", int(info["index"]), str(info["name"]), str(info["kind"]), int(info["vram_bytes"]))


def _open(d: Device) -> _native.VulkanDevice:
    assert d.kind == "vulkan" and d.index is not None
    with _lock:
        dev = _opened.get(d.index)
        if dev is None or dev.lost():
            dev = _opened[d.index] = _native.VulkanDevice(str(d.index), default_runtime().config.vk_allow_cpu)
        return dev


def _open_default(rt: Runtime | None = None) -> tuple[Device, _native.VulkanDevice]:
    """The Vulkan device DASLLAMA_VK_DEVICE names, else the best one (a CPU-type one only with
    DASLLAMA_VK_ALLOW_CPU=1), opened once: as ``rt`` (the default runtime) is configured."""
    rt = rt or default_runtime()
    ok, why, _ = rt.vk_witness()
    if not ok:
        raise DeviceError(f"no usable Vulkan device: {why}")
    with _lock:
        dev = _native.VulkanDevice(rt.config.vk_device, rt.config.vk_allow_cpu)
        d = _describe(dev.info())
        assert d.index is not None
        held = _opened.get(d.index)
        if held is not None and not held.lost():
            return d, held
        _opened[d.index] = dev
        return d, dev


def devices() -> list[Device]:
    """The CPU, then every Vulkan device the loader reports (none where there is no loader)."""
    try:
        found = [_describe(i) for i in _native.vk_devices()]
    except DeviceError:
        found = []
    return [CPU, *found]


def device(spec: str | Device) -> Device:
    """A device by name: "cpu", "vulkan" (the default Vulkan device), "vulkan:N", or "auto" (a
    Vulkan device that is not CPU-type when there is one, else the CPU). Raises DeviceError
    naming what is missing."""
    if isinstance(spec, Device):
        return spec
    s = spec.strip().lower()
    if s == "cpu":
        return CPU
    if s == "auto":
        ok, _, kind = default_runtime().vk_witness()
        if not ok or kind == "cpu":
            # A CPU-type Vulkan device (lavapipe) is slower than the CPU path: only on request.
            return CPU
        return _open_default()[0]
    if s == "vulkan":
        return _open_default()[0]
    if s.startswith("vulkan:") and s[7:].isdigit():
        i = int(s[7:])
        known = [d for d in devices() if d.index == i]
        if not known:
            raise DeviceError(f"there is no Vulkan device {i}; devices here: {', '.join(str(d) for d in devices())}")
        _open(known[0])
        return known[0]
    raise ValueError(f"unknown device {spec!r}: use 'cpu', 'vulkan', 'vulkan:N' or 'auto'")


def default_device() -> str:
    """What ``load_model(device=None)`` uses outside the tutorial's armed tier: ``DASLLAMA_DEVICE``,
    else ``DASLLAMA_GPU`` ("vulkan": that, required; 1/on/true/auto: "auto", which falls back to
    the CPU), else the CPU."""
    d = os.environ.get("DASLLAMA_DEVICE")
    if d:
        return d
    g = os.environ.get("DASLLAMA_GPU", "").strip().lower()
    if g == "vulkan":
        return "vulkan"
    if g in ("1", "on", "true", "auto"):
        return "auto"
    return "cpu"


@dataclass(frozen=True)
class PlaceOptions:
    """How a model is placed on a Vulkan device."""

    regions: int = 4  # device-home streams (one K/V region each)
    ctx_max: int = 4096  # positions per region (0: the model's context)
    ctx_strict: bool = False  # ctx_max must be held for every region, or the resident driver declines
    kv_dtype: str | None = None  # device K/V codec (None: DASLLAMA_GPU_KV, else f16)
    vram_mb: int = 0  # cap on the model's device memory (0: what the device has free; DASLLAMA_GPU_VRAM_MB)

    def vram(self) -> int:
        if self.vram_mb:
            return self.vram_mb
        try:
            return int(os.environ.get("DASLLAMA_GPU_VRAM_MB", "0"))
        except ValueError:
            raise ValueError(f"DASLLAMA_GPU_VRAM_MB={os.environ['DASLLAMA_GPU_VRAM_MB']!r} is not a number of MiB") from None


def place(m: Model, d: Device, opts: PlaceOptions) -> tuple[str, str]:
    """Put ``m`` on ``d`` (taking it off where it was): its tier ("gpu:resident", "gpu:partial", "gpu:rails", or
    "cpu" when it stays on the CPU) and why it is not resident."""
    if opts.regions < 1:
        raise ValueError(f"the device needs at least one K/V region, got {opts.regions}")
    if opts.ctx_max < 0:
        raise ValueError(f"ctx_max must be >= 0, got {opts.ctx_max}")
    if d.kind == "cpu":
        _native.unplace_model(m._native)
        m._device = CPU
        _place_projector(m, None, opts)
        return "cpu", "placed on the CPU"
    cfg = m.runtime.config
    dev = _open(d)
    tier, why = _native.place_model(m._native, dev, opts.regions, opts.ctx_max, opts.ctx_strict, opts.kv_dtype or cfg.gpu_kv, opts.vram(), cfg.vk_log)
    m._device = d if tier != "cpu" else CPU
    _place_projector(m, dev if tier != "cpu" else None, opts)
    return tier, why


def _place_projector(m: Model, dev: _native.VulkanDevice | None, opts: PlaceOptions) -> None:
    """The model's vision tower follows it: onto ``dev`` (from what the model left of the
    budget), or back to the CPU (None, or a projector loaded with offload=False)."""
    proj = m.projector
    if proj is None:
        return
    if not proj.offload:
        dev = None
    # Not Projector.to: the model's cap on device memory holds for its tower too.
    why = _native.place_vision(proj.native, dev, opts.vram())
    if why:
        log.warning("%s's vision tower stays on the CPU: %s", m.path.name, why)
    elif dev is not None:
        st = proj.placement or {}
        log.info("%s's vision tower on the device: %s matrices (%.0f MiB), %s on the CPU", m.path.name, st.get("matrices"), st.get("weight_bytes", 0) / 2**20, st.get("left_on_cpu"))


def placement(m: Model) -> PlacementStatus | None:
    st = _native.placement_status(m._native)
    return None if st is None else PlacementStatus(**st)


def tier_options(t: GpuTier) -> PlaceOptions:
    """How the tier ``t`` places a model: its pins, and its want's cap."""
    return PlaceOptions(t.regions, t.ctx_max, t.ctx_strict, t.kv_pin, t.want.with_env().vram_mb)


def tier_install(t: GpuTier, m: Model) -> str:
    """Put ``m`` on the device the tier ``t`` armed, recording the outcome for gpu_slot_capture."""
    if t.armed is None:
        t.outcome, t.install_reason = "cpu", t.reason or "the GPU tier was not armed before the load"
    elif t.model() not in (None, m):
        t.outcome, t.install_reason = "cpu", "the device still holds another model: hydrate its sessions and drop it first (the switch order)"
    else:
        t.outcome, t.install_reason = place(m, t.armed, tier_options(t))
        if t.outcome == "gpu:resident":
            t.install_reason = ""
        if t.outcome != "cpu":
            t.held = weakref.ref(m)
    return t.outcome
