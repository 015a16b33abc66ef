"""Scale-out on Ray Serve: N engine replicas behind an OpenAI-compatible ingress, with prefix-aware
routing. ``python -m dasllama.serve.ray --replicas N`` (the flags of ``python -m dasllama.serve``),
or ``serve run`` with a config file naming ``dasllama.serve.ray:app_builder`` (examples/ray-serve.yaml).
Needs the ``ray`` extra: ``pip install 'dasllama[ray]'``."""

from __future__ import annotations

from typing import Any


def app_builder(config: dict[str, Any]) -> Any:
    """The application `serve run` builds from a config file's `args` (see deployments.app_builder)."""
    from .deployments import app_builder as build_from_config

    return build_from_config(config)


__all__ = ["app_builder"]
