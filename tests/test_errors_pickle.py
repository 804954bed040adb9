"""Every exception class of the product pickles back whole: its type, its message and its
attributes. Exceptions cross process boundaries (Ray pickles what an actor raises back to the
driver: the trainer, the LLM proxy, an engine replica, veRL's reward actor; worker processes
too), and one that cannot be rebuilt from its pickle arrives as a TypeError of unpickling
instead of the error. Python rebuilds an exception as ``type(*self.args)``, the message
alone, which fails for an ``__init__`` of other arguments.

The classes are found by walking the packages, so a new one is covered: if its ``__init__``
takes more than a message, it needs sample arguments in ``SAMPLES``."""

from __future__ import annotations

import errno
import importlib
import inspect
import pickle
import pkgutil
from typing import Any

import pytest

from fabric.errors import FabricError
from fabric.integrations.errors import BatchDeadlineError
from fabric.protocol import ErrorInfo, Result

PACKAGES = ("fabric", "core", "envpool", "functions")

_FAILED = Result(ok=False, function="math_answer", error=ErrorInfo.of("UserError", "boom", "Traceback ..."))

#: Constructor arguments, ``(args, kwargs)``, of each class whose ``__init__`` takes more than
#: a message; keyword arguments are given values other than their defaults, so that a pickle
#: that rebuilds with the defaults is caught.
SAMPLES: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "fabric.errors.UnknownFunctionError": (("math_answr", ["math_answer", "exact_match"]), {}),
    "fabric.errors.SetupFailedError": (("setup raised", "Traceback (most recent call last): ..."), {}),
    "fabric.errors.InvocationError": ((_FAILED,), {}),
    "fabric.integrations.errors.RefusedArgumentsError": (
        ("f(x: int)", 2, 5, (3, ErrorInfo.of("InvalidArguments", "x: not an int"))),
        {},
    ),
    "fabric.integrations.errors.RewardCallError": (
        ("math_answer", 4, [(1, ErrorInfo.of("UserError", "boom"))], "; see the worker's log"),
        {},
    ),
    "fabric.serve._lambda_api.Reply": ((413, "RequestTooLargeException", "too big"), {"close": True}),
    "fabric.spill.SpillError": (("the payload expired",), {"retryable": False, "resend": True}),
    "fabric.testing.ConformanceError": (("math_answer", ["no example payloads", "returns a str"]), {}),
    "core.errors.ConfigError": (([("engine.model", "field required"), ("", "two problems")], "job.yaml"), {}),
    "core.errors.DiskFullError": (("/runs/a/metrics.jsonl", "the run directory"), {}),
    "core.rollout.engines.base.UnknownEngineError": (("vlm", ["vllm", "openai"]), {}),
    "core.rollout.engines.openai_.OpenAIEngineError": (("refused",), {"status": 400, "retryable": True}),
    "core.rollout.engines.openai_._Transient": (("overloaded", 503, 2.5), {}),
    "core.trainer.base.UnknownTrainerError": (("megatorn", ["megatron", "torch"]), {}),
    "envpool.errors.UnknownEnvError": (("coin-v1", ["coin-v0", "maze-v0"]), {}),
    "envpool.errors.EnvLogicError": (("boom",), {"remote_type": "ValueError", "traceback": "Traceback ..."}),
    "envpool.errors.EnvHung": (("step ran past 30s",), {"op": "step", "timeout_s": 30.0}),
    "envpool.images.errors.ImageNotFound": (("sha256:" + "a" * 64, ["local", "s3"]), {}),
    "envpool.images.errors.ImageFetchError": (("403 Forbidden",), {"tier": "s3", "retryable": False}),
    "envpool.images.errors.DigestMismatch": (("sha256:" + "a" * 64, "sha256:" + "b" * 64), {"tier": "s3"}),
    "envpool.protocol.FrameError": (("a frame over the limit", b"\x00\x10{"), {"too_large": True}),
    "envpool.testing.EnvConformanceError": (("coin-v0", ["reset returns no observation"]), {}),
    "functions._handler_idempotency._NotCached": ((_FAILED,), {}),
    "functions.rewards.judge_errors._Transient": (("429 Too Many Requests", "slow down", 1.5), {}),
    "functions.verifiers.rpc_errors.RemoteError": (("BadInput", "x must be positive"), {}),
}


def _product_modules() -> list[str]:
    names: list[str] = []
    for package in PACKAGES:
        path = importlib.import_module(package).__path__
        names.append(package)
        names += [
            m.name for m in pkgutil.walk_packages(path, package + ".") if not m.name.endswith(".__main__")
        ]
    return names


def _exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in _product_modules():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            # a module of an optional dependency that is not installed (vllm, megatron): its
            # classes are checked where it is; a product module that is missing is a failure
            if e.name is None or e.name.split(".")[0] in PACKAGES:
                raise
            continue
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name:
                found[f"{name}.{obj.__qualname__}"] = obj
    return found


CLASSES = _exception_classes()


def _takes_more_than_a_message(cls: type[BaseException]) -> bool:
    return any("__init__" in vars(base) for base in cls.__mro__ if base.__module__ != "builtins")


def _public(e: BaseException) -> dict[str, Any]:
    return {k: v for k, v in vars(e).items() if not k.startswith("_")}


def test_the_walk_finds_the_classes():
    assert "fabric.errors.FabricError" in CLASSES and "envpool.images.errors.DigestMismatch" in CLASSES
    assert not set(SAMPLES) - set(CLASSES), "SAMPLES names classes that are gone"


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_exception_pickles_back_whole(name):
    cls = CLASSES[name]
    if name in SAMPLES:
        args, kwargs = SAMPLES[name]
    elif _takes_more_than_a_message(cls):
        pytest.fail(f"{name} has its own __init__: add sample arguments for it to SAMPLES in {__file__}")
    else:
        args, kwargs = ("something failed",), {}
    e = cls(*args, **kwargs)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls
    assert str(back) == str(e)
    assert back.args == e.args
    assert _public(back) == _public(e)


class _NoSpace(FabricError, OSError):
    """An OSError of the SDK made of its parts (as a full disk's error would be)."""

    def __init__(self, path: str) -> None:
        super().__init__(errno.ENOSPC, "No space left on device", path)
        self.path = path


@pytest.mark.parametrize(
    "e",
    [BatchDeadlineError(errno.ETIMEDOUT, "timed out", "/runs/a/batch"), _NoSpace("/runs/a/metrics.jsonl")],
    ids=["BatchDeadlineError", "own __init__"],
)
def test_an_oserror_keeps_its_errno_strerror_and_filename(e):
    # an OSError holds them outside args and __dict__ (its own __reduce__ passes the filename
    # beside args; its __new__ leaves args empty for a class with its own __init__)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is type(e) and str(back) == str(e) and back.args == e.args
    assert (back.errno, back.strerror, back.filename) == (e.errno, e.strerror, e.filename)
    assert _public(back) == _public(e)
