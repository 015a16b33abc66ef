"""The dasllama exception tree. Every error the package raises on purpose derives from DasllamaError."""

from ._native import ContextOverflowError, DasllamaError, DeviceError, EngineError, GgufError, KvPoolFullError, UnsupportedModelError


class FetchError(DasllamaError):
    """A model could not be fetched: unknown name, no network, or a bad checksum."""


class TemplateError(DasllamaError):
    """The model's chat template is missing or failed to render."""


__all__ = ["ContextOverflowError", "DasllamaError", "DeviceError", "EngineError", "FetchError", "GgufError", "KvPoolFullError", "TemplateError", "UnsupportedModelError"]
