"""Container runtimes: ``base.Runtime`` is the ABC; each sibling module is one kind."""

from envpool.runtimes.base import Container, Runtime, RuntimeConfig, make_runtime

__all__ = ["Container", "Runtime", "RuntimeConfig", "make_runtime"]
