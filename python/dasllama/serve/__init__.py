"""An OpenAI-compatible HTTP server over the scheduler: ``python -m dasllama.serve``."""

from .app import Server
from .asgi import build_app

__all__ = ["Server", "build_app"]
