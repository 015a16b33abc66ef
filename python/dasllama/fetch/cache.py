"""Where fetched models live: one folder for the PyPI-packaged models and the hub's downloads."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("DASLLAMA_HOME", Path.home() / ".cache" / "dasllama" / "models"))
