"""Functions for the backend tests of what a function's answer may be (top level: the local
backend's workers import them)."""

from __future__ import annotations

from fabric.registry import Registry

REG = Registry()


@REG.function(warm=0, timeout_s=10, retry={"max_attempts": 1})
def nested(depth: int) -> object:
    """A list nested ``depth`` deep around 1."""
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


class Unprintable(Exception):
    """An exception whose ``str()`` raises (a C extension's, one formatting its args lazily)."""

    def __str__(self) -> str:
        raise RuntimeError("cannot format this error")


@REG.function(warm=0, timeout_s=2, retry={"max_attempts": 1})
def raises_unprintable() -> None:
    raise Unprintable()


@REG.function(warm=0, timeout_s=2, retry={"max_attempts": 1})
async def async_raises_unprintable() -> None:
    raise Unprintable()
