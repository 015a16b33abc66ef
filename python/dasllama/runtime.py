"""Runtimes: what models run with. A :class:`Runtime` owns a thread team (the forward pass's
threads), the bin its K/V pools recycle page buffers through, the scratch of single-session
evaluations, its settings, and the tutorial's GPU tier state (``dasllama.gpu``). Models loaded on
one runtime share those; two runtimes share nothing mutable, so two models (or two servers) in one
process each run on their own threads::

    import dasllama as dl
    small = dl.load_model("smollm2-135m-instruct", runtime=dl.Runtime(threads=1))
    big = dl.load_model("gemma3-270m", runtime=dl.Runtime(threads=2, step_ms=0))

``load_model`` without ``runtime=`` uses the default runtime (:func:`default_runtime`), made on
first use from the environment. This module is where the ``DASLLAMA_*`` settings are read (once,
when a runtime is made); nothing below the Python bindings reads the environment:

- ``DASLLAMA_THREADS``: threads (default: one per physical core);
- ``DASLLAMA_STEP_MS``: each scheduler step's time budget in ms (default 60; 0: fixed chunks);
- ``DASLLAMA_VK_ALLOW_CPU=1``, ``DASLLAMA_VK_DEVICE``, ``DASLLAMA_VK_LOG=1``, ``DASLLAMA_GPU_KV``:
  the Vulkan device settings (see ``dasllama.gpu``);
- ``DASLLAMA_NO_SIMD``, ``DASLLAMA_NO_AVX512``, ``DASLLAMA_NO_VNNI``, ``DASLLAMA_NO_AMX``,
  ``DASLLAMA_AMX``, ``DASLLAMA_AMX_LOG``, ``DASLLAMA_PREFETCH``: the process's kernel switches,
  read when dasllama is imported: what any runtime may use.

Within those, each runtime picks its kernels: ``Runtime(kernels="scalar")`` runs every kernel's
scalar twin, ``Runtime(amx=False)`` keeps the GEMM off Intel AMX (``amx=True`` puts it there even
under ``DASLLAMA_AMX=0``, where the CPU allows). Its models' weights are laid out at load for
them, so one process can run a model on the scalar and the vector kernels side by side::

    scalar = dl.load_model("smollm2-135m-instruct", runtime=dl.Runtime(kernels="scalar"))
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from . import _native

if TYPE_CHECKING:
    from .devices import Device
    from .model import Model

__all__ = ["GpuTierWant", "Runtime", "RuntimeConfig", "default_runtime", "n_threads"]

DEFAULT_STEP_MS = 60.0
KERNELS = ("simd", "scalar")  # the vector kernels the process allows, or the scalar twins


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "") == "1"


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; unset it or give one") from None


@dataclass(frozen=True)
class RuntimeConfig:
    """A runtime's settings. ``from_env`` reads them from ``DASLLAMA_*`` variables."""

    threads: int = 0  # 0: one per physical core
    step_ms: float | None = DEFAULT_STEP_MS  # None (or 0): fixed prefill chunks
    vk_allow_cpu: bool = False  # CPU-type Vulkan devices (lavapipe) may serve
    vk_device: str | None = None  # the Vulkan device to open (an index or part of a name)
    vk_log: bool = False  # say on stderr where placed models went
    gpu_kv: str | None = None  # the device K/V codec where a load pins none
    kernels: str = "simd"  # "simd": the vector kernels the process allows; "scalar": their scalar twins
    amx: bool | None = None  # the GEMM on AMX (True), off it (False), or as the process says (None)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RuntimeConfig:
        env = os.environ if env is None else env
        threads = int(_number(env, "DASLLAMA_THREADS", 0))
        step = _number(env, "DASLLAMA_STEP_MS", DEFAULT_STEP_MS)
        kv = env.get("DASLLAMA_GPU_KV", "").strip() or None
        if kv is not None and kv not in ("f16", "q8_0", "tq4"):
            raise ValueError(f"DASLLAMA_GPU_KV={kv!r} is not a K/V codec; use f16, q8_0 or tq4")
        return cls(
            threads=max(threads, 0),
            step_ms=step if step > 0 else None,
            vk_allow_cpu=_flag(env, "DASLLAMA_VK_ALLOW_CPU"),
            vk_device=env.get("DASLLAMA_VK_DEVICE") or None,
            vk_log=_flag(env, "DASLLAMA_VK_LOG"),
            gpu_kv=kv,
        )


@dataclass
class GpuTierWant:
    """What the next load should put on the device. A zero want (``auto_tier=False``) keeps the
    load off it. ``DASLLAMA_GPU`` overrides ``auto_tier``, ``DASLLAMA_GPU_VRAM_MB`` the cap."""

    auto_tier: bool = False
    vram_mb: int = 0  # cap on the device memory the model may take (0: the device's budget)

    def with_env(self) -> GpuTierWant:
        auto, vram = self.auto_tier, self.vram_mb
        if "DASLLAMA_GPU" in os.environ:
            auto = os.environ["DASLLAMA_GPU"].strip().lower() not in ("0", "off", "false", "cpu", "")
        try:
            vram = int(os.environ.get("DASLLAMA_GPU_VRAM_MB", vram))
        except ValueError:
            pass
        return GpuTierWant(auto, vram)


@dataclass
class GpuTier:
    """The tutorial's GPU tier of one runtime (``dasllama.gpu`` drives the default runtime's):
    the want and pins, the armed device, and the model the last install put there (weakly:
    dropping the model frees its device memory)."""

    want: GpuTierWant = field(default_factory=GpuTierWant)
    armed: Device | None = None
    reason: str = ""
    held: weakref.ref[Model] | None = None
    outcome: str = ""
    install_reason: str = ""
    regions: int = 4
    ctx_max: int = 4096
    ctx_strict: bool = False
    kv_pin: str | None = None
    prefill_allowed: bool = True

    def model(self) -> Model | None:
        m = self.held() if self.held is not None else None
        if m is not None and m.device.kind == "cpu":
            self.held = None
            return None
        return m


class Runtime:
    """What models run with: a thread team, a K/V page bin, scratch, settings, kernels and a GPU
    tier.

    ``threads`` and ``step_ms`` override ``DASLLAMA_THREADS`` and ``DASLLAMA_STEP_MS`` (``step_ms``
    None or 0: fixed prefill chunks); ``kernels`` ("simd" or "scalar") and ``amx`` pick its
    kernels within the process's switches; ``config`` gives every setting at once (the environment
    is then not read). The threads start with the first forward pass and end when the runtime and
    every model on it are gone."""

    def __init__(
        self,
        threads: int | None = None,
        step_ms: float | None = -1.0,
        *,
        kernels: str | None = None,
        amx: bool | None = None,
        config: RuntimeConfig | None = None,
    ) -> None:
        cfg = config if config is not None else RuntimeConfig.from_env()
        if threads is not None:
            if threads < 0:
                raise ValueError(f"threads must be >= 0 (0: one per physical core), got {threads}")
            cfg = replace(cfg, threads=int(threads))
        if step_ms is None or step_ms >= 0:
            cfg = replace(cfg, step_ms=float(step_ms) if step_ms else None)
        if kernels is not None:
            cfg = replace(cfg, kernels=kernels)
        if amx is not None:
            cfg = replace(cfg, amx=bool(amx))
        if cfg.kernels not in KERNELS:
            raise ValueError(f"kernels={cfg.kernels!r} is not a kernel choice; use 'simd' (the vector kernels) or 'scalar' (their scalar twins)")
        self.config = cfg
        self._native = _native.Runtime(cfg.threads, cfg.step_ms / 1000.0 if cfg.step_ms else None, scalar=cfg.kernels == "scalar", amx=cfg.amx)
        self.tier = GpuTier()
        self._witness: tuple[bool, str, str] | None = None
        self._lock = threading.Lock()

    @property
    def threads(self) -> int:
        """The threads its forward passes run on."""
        return int(self._native.threads)

    @property
    def kernels(self) -> str:
        """"simd" (the vector kernels the process allows) or "scalar" (their scalar twins)."""
        return "scalar" if self._native.scalar else "simd"

    def amx_status(self) -> tuple[bool, str]:
        """(whether this runtime's GEMMs run on Intel AMX, why or why not in words)."""
        on, why = self._native.amx_status()
        return bool(on), str(why)

    def vk_witness(self) -> tuple[bool, str, str]:
        """(a usable Vulkan device answers, its name or why not, its kind) under this runtime's
        Vulkan settings: enumerated once, then kept."""
        with self._lock:
            if self._witness is None:
                self._witness = _native.vk_witness(self.config.vk_device, self.config.vk_allow_cpu)
            return self._witness

    def page_bin_bytes(self) -> int:
        """Bytes of freed K/V pages this runtime keeps for its next pages."""
        return int(self._native.page_bin_bytes())

    def __repr__(self) -> str:
        step = "fixed chunks" if self.config.step_ms is None else f"{self.config.step_ms:g} ms"
        return f"Runtime(threads={self.threads}, step={step}, kernels={self.kernels})"


_default: Runtime | None = None
_default_lock = threading.Lock()


def default_runtime() -> Runtime:
    """The runtime of every model loaded without ``runtime=``, made on first use from the
    environment (``DASLLAMA_THREADS`` and the rest, read then)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Runtime()
        return _default


def default_runtime_with(config: RuntimeConfig) -> Runtime | None:
    """Make the default runtime from ``config`` if none is made yet, and return it; None once one
    is (its settings are fixed then). For a command line's flags (``--threads``): a lone server
    sets the default runtime's threads, the one ``dasllama.gpu``'s tier belongs to."""
    global _default
    with _default_lock:
        if _default is not None:
            return None
        _default = Runtime(config=config)
        return _default


def n_threads() -> int:
    """The threads the default runtime's kernels run on (``DASLLAMA_THREADS``, else the physical
    cores)."""
    return default_runtime().threads


def _configure_kernels(env: Mapping[str, str]) -> None:
    prefetch = None
    raw = env.get("DASLLAMA_PREFETCH", "")
    if raw:
        size, _, cache = raw.partition(":")
        if size.strip().isdigit():
            prefetch = (int(size), {"l1": 0, "l2": 1}.get(cache.strip()))
    amx = env.get("DASLLAMA_AMX")
    _native.configure_kernels(
        no_simd="DASLLAMA_NO_SIMD" in env,
        no_avx512="DASLLAMA_NO_AVX512" in env,
        no_vnni="DASLLAMA_NO_VNNI" in env,
        no_amx="DASLLAMA_NO_AMX" in env,
        amx=None if amx is None else amx == "1",
        amx_log=_flag(env, "DASLLAMA_AMX_LOG"),
        prefetch=prefetch,
    )


# The kernel switches hold for the process: fixed here, before anything can run a kernel.
_configure_kernels(os.environ)
