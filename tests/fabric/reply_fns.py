"""Functions for the backend tests of what a function's answer may be (top level: the local
backend's workers import them)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

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


def _checked(value: int) -> int:
    """An argument's own check that raises something other than ValueError (pydantic turns
    only ValueError and AssertionError into a ValidationError; the rest go through)."""
    if value < 0:
        raise LookupError(f"no entry for {value}")
    return value


@REG.function(warm=0, timeout_s=2, retry={"max_attempts": 1})
def checked(n: Annotated[int, AfterValidator(_checked)]) -> int:
    return n


@REG.function(warm=0, timeout_s=2, retry={"max_attempts": 1})
async def async_checked(n: Annotated[int, AfterValidator(_checked)]) -> int:
    return n


@REG.function(warm=0, timeout_s=10, retry={"max_attempts": 1})
def power_of_ten(digits: int) -> int:
    """10 to the ``digits``: an int of ``digits + 1`` digits (a factorial, a big power)."""
    return 10**digits


@REG.reward(warm=0, timeout_s=30, retry={"max_attempts": 1})
def numpy_score(completion: str, library: str = "numpy") -> dict:
    """A reward computed with an array library, returned as it comes out of it: a numpy
    float32 mean, a 0-d torch tensor, an int64 count and an array of per-token values."""
    if library == "numpy":
        import numpy as np

        per_token = np.array([0.25, 0.75], dtype=np.float32)
        return {"score": per_token.mean(), "tokens": np.int64(len(completion)), "per_token": per_token}
    import torch

    per_token = torch.tensor([0.25, 0.75])
    return {"score": per_token.mean(), "tokens": torch.tensor(len(completion)), "per_token": per_token}
