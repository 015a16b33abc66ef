"""Models named on a Hugging Face hub, fetched through ``huggingface_hub`` and cached.

Two forms, as llama.cpp's ``-hf`` and Ollama's ``pull hf.co/...`` take them:

- ``hf://owner/repo/path/to/file.gguf``: that file of that repository;
- ``owner/repo`` or ``owner/repo:QUANT``: the repository's GGUF whose name holds QUANT (any case;
  ``Q4_K_M`` when none is given, as llama.cpp chooses, else the first GGUF), leaving out
  multimodal projectors (``mmproj``) and the parts of split files.

Files go under ``$DASLLAMA_HOME/hf/owner/repo/`` and are found there again without the network.
The hub is ``$HF_ENDPOINT`` (read at each call), else huggingface.co; ``HF_TOKEN`` is honoured as
``huggingface_hub`` honours it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import FetchError
from .cache import cache_dir

log = logging.getLogger("dasllama.fetch")

DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's choice for `-hf owner/repo` without a tag
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REPO_RE = re.compile(rf"^(?:hf\.co/|huggingface\.co/)?({_NAME})/({_NAME})(?::([A-Za-z0-9._-]+))?$")
_SPLIT_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


@dataclass(frozen=True)
class HubRef:
    """A model on the hub: a repository and either one file or a quantization to choose by."""

    repo: str  # owner/repo
    filename: str | None = None  # a file of the repository, or None to choose by `quant`
    quant: str | None = None  # None: DEFAULT_QUANT, else the first GGUF

    def __str__(self) -> str:
        if self.filename:
            return f"hf://{self.repo}/{self.filename}"
        return self.repo + (f":{self.quant}" if self.quant else "")


def parse_ref(spec: str) -> HubRef | None:
    """`spec` as a hub reference, or None when it is not one. ``hf://`` is always one; a bare
    ``owner/repo[:quant]`` is one unless a file or folder of that name exists here or it ends in
    ``.gguf`` (then it is a path)."""
    if spec.startswith("hf://"):
        parts = spec[len("hf://") :].strip("/").split("/")
        if len(parts) < 3 or not all(parts) or not parts[-1].endswith(".gguf"):
            raise FetchError(f"'{spec}' is not a hub file: write hf://owner/repo/file.gguf (or owner/repo[:quant] to choose by quantization)")
        return HubRef(f"{parts[0]}/{parts[1]}", "/".join(parts[2:]))
    if spec.endswith(".gguf") or Path(spec).expanduser().exists():
        return None
    m = _REPO_RE.match(spec)
    if m is None:
        return None
    return HubRef(f"{m.group(1)}/{m.group(2)}", quant=m.group(3))


def is_hub_ref(spec: str) -> bool:
    try:
        return parse_ref(spec) is not None
    except FetchError:
        return True  # an hf:// reference, if a malformed one: fetching it says what is wrong


def hub_dir() -> Path:
    return cache_dir() / "hf"


def repo_dir(repo: str) -> Path:
    return hub_dir() / repo


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def _hub() -> Any:
    try:
        import huggingface_hub
    except ImportError:
        raise FetchError("models on the Hugging Face hub need huggingface_hub: pip install 'dasllama[hub]' (or pip install huggingface_hub)") from None
    return huggingface_hub


def choose_file(files: list[str], quant: str | None) -> str | None:
    """The GGUF of `files` a quantization tag picks, as llama.cpp picks it: the first whose name
    holds the tag (any case), else, without a tag, the first GGUF; projectors and split parts
    are left out."""
    ggufs = sorted(f for f in files if f.endswith(".gguf") and "mmproj" not in f.lower() and not _SPLIT_RE.search(f))
    tag = (quant or DEFAULT_QUANT).lower()
    for f in ggufs:
        if tag in Path(f).name.lower():
            return f
    if quant is None and ggufs:
        return ggufs[0]
    return None


def cached(ref: HubRef) -> Path | None:
    """The file `ref` names, if it is in the cache already."""
    d = repo_dir(ref.repo)
    if ref.filename:
        p = d / ref.filename
        return p if p.is_file() else None
    if not d.is_dir():
        return None
    files = [str(p.relative_to(d)) for p in d.rglob("*.gguf") if ".cache" not in p.parts]
    hit = choose_file(files, ref.quant)
    return d / hit if hit else None


def fetch_hub(ref: HubRef, progress: bool = True) -> Path:
    """The local path of the file `ref` names: from the cache, else downloaded from the hub."""
    hit = cached(ref)
    if hit is not None:
        return hit
    hf = _hub()
    endpoint = _endpoint()
    filename = ref.filename
    try:
        if filename is None:
            info = hf.HfApi(endpoint=endpoint).model_info(ref.repo)
            files = [s.rfilename for s in info.siblings or []]
            filename = choose_file(files, ref.quant)
            if filename is None:
                ggufs = [f for f in files if f.endswith(".gguf") and "mmproj" not in f.lower()]
                if not ggufs:
                    raise FetchError(f"{ref.repo} holds no .gguf file (it has: {', '.join(files[:12]) or 'nothing'})")
                raise FetchError(f"{ref.repo} has no GGUF matching '{ref.quant}'; it has: {', '.join(ggufs)}")
        t0 = time.perf_counter()
        log.info("downloading %s from %s", f"hf://{ref.repo}/{filename}", endpoint or "huggingface.co")
        path = hf.hf_hub_download(ref.repo, filename, local_dir=repo_dir(ref.repo), endpoint=endpoint)
    except FetchError:
        raise
    except Exception as e:  # noqa: BLE001 - every hub failure (network, 404, gated, auth) becomes one error saying which
        first = (str(e).strip().splitlines() or [""])[0]  # huggingface_hub's messages run on with advice
        raise FetchError(f"cannot fetch {ref} from {endpoint or 'huggingface.co'}: {type(e).__name__}: {first}") from None
    p = Path(path)
    log.info("downloaded %s (%.0f MB) in %.1fs; cached at %s", filename, p.stat().st_size / 1e6, time.perf_counter() - t0, p)
    return p


def remove(ref: HubRef) -> list[Path]:
    """Delete the cached files `ref` names (a bare ``owner/repo``: all of that repository's);
    the paths deleted."""
    d = repo_dir(ref.repo)
    if not d.is_dir():
        return []
    if ref.filename is None and ref.quant is None:
        gone = sorted(p for p in d.rglob("*.gguf") if ".cache" not in p.parts)
        shutil.rmtree(d)
        return gone
    hit = cached(ref)
    if hit is None:
        return []
    hit.unlink()
    meta = d / ".cache" / "huggingface" / "download" / (str(hit.relative_to(d)) + ".metadata")
    meta.unlink(missing_ok=True)
    return [hit]
