"""Inference engines behind one ABC (``base.Engine``), one sibling module per backend.

``torch_`` (a ``TinyLM`` on the CPU) is the embedded default; GPU and remote backends
register in ``engine_registry`` and are imported only when named.
"""

from core.rollout.engines.base import (
    Completion,
    Engine,
    EngineClosedError,
    EngineError,
    EngineRegistry,
    GenerateRequest,
    PromptTooLongError,
    UnknownEngineError,
    engine_registry,
)

__all__ = [
    "Completion",
    "Engine",
    "EngineClosedError",
    "EngineError",
    "EngineRegistry",
    "GenerateRequest",
    "PromptTooLongError",
    "UnknownEngineError",
    "engine_registry",
]
