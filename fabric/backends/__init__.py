"""Backends run invocations. ``base.Backend`` is the ABC; each sibling module is one kind."""

from fabric.backends.base import Backend, BackendConfig, make_backend

__all__ = ["Backend", "BackendConfig", "make_backend"]
