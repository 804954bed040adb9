"""The in-process tool bridge runs a tool's setup hook, as a fabric worker does.

``envpool.make``'s bridge (``inprocess_tool_caller``, and the pool's default one on top of
it) never ran ``@fabric.tool(setup=...)``: a tool whose ``ctx`` has no default failed with
"missing 1 required positional argument: 'ctx'", and one with a default ran without what
its setup loads. It now runs the hook once per process, at the tool's first call (two first
calls at once run it once), and passes its result as ``ctx``; a hook that raises is the
``SetupFailed`` a job's bridge (``fabric_tools``) raises for it, and is run again by a later
call, as the in-process backend runs it again.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import fabric
from envpool.api import inprocess_tool_caller
from envpool.errors import ToolUnavailable
from envpool.pool_config import fabric_tools, inprocess_tools

REG = fabric.Registry()
REG.discover("functions.tools")

RUNS: dict[str, int] = {"model": 0, "flaky": 0, "broken": 0}
ENTERED = threading.Event()
RELEASE = threading.Event()


def load_model() -> dict[str, str]:
    RUNS["model"] += 1
    ENTERED.set()
    # held until the test has started every first call: they arrive while it runs
    RELEASE.wait(timeout=30)
    return {"greeting": "hello"}


@REG.tool(setup=load_model)
def greet(name: str, ctx: dict[str, str]) -> str:
    return f"{ctx['greeting']} {name}"


@REG.tool(setup=load_model)
def greet_or_default(name: str, ctx: dict[str, str] | None = None) -> str:
    return f"{(ctx or {'greeting': 'no setup'})['greeting']} {name}"


def broken_setup() -> object:
    RUNS["broken"] += 1
    raise RuntimeError("model file missing")


@REG.tool(setup=broken_setup)
def needs_model(name: str, ctx: object) -> str:
    return name


def flaky_setup() -> str:
    RUNS["flaky"] += 1
    if RUNS["flaky"] == 1:
        raise RuntimeError("download interrupted")
    return "loaded"


@REG.tool(setup=flaky_setup)
def flaky(name: str, ctx: str) -> str:
    return f"{ctx} {name}"


@pytest.fixture
def tools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fabric, "default_registry", REG)


def test_concurrent_first_calls_run_the_hook_once_and_get_its_ctx(tools):
    RELEASE.clear()
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(inprocess_tool_caller, "greet", {"name": f"n{i}"}) for i in range(8)]
        # until the hook runs (a bridge that never runs it answers at once)
        while not ENTERED.wait(0.01) and not all(f.done() for f in futs):
            pass
        RELEASE.set()
        answers = [f.result(timeout=30) for f in futs]
    assert answers == [f"hello n{i}" for i in range(8)]
    assert RUNS["model"] == 1
    # later calls reuse it
    assert inprocess_tool_caller("greet", {"name": "ada"}) == "hello ada"
    assert RUNS["model"] == 1


async def test_the_pools_default_bridge_runs_the_hook_once_across_tasks(tools):
    RELEASE.set()
    before = RUNS["model"]
    answers = await asyncio.gather(*(inprocess_tools("greet_or_default", {"name": str(i)}) for i in range(6)))
    # (each function's hook runs once: this one's, with a default ctx, ran without it)
    assert answers == [f"hello {i}" for i in range(6)]
    assert RUNS["model"] == before + 1


def test_a_hook_that_raises_is_setup_failed_with_its_cause(tools):
    with pytest.raises(ToolUnavailable) as info:
        inprocess_tool_caller("needs_model", {"name": "ada"})
    assert str(info.value) == "tool 'needs_model' failed (SetupFailed): RuntimeError: model file missing"
    assert isinstance(info.value.__cause__, RuntimeError)


async def test_the_text_is_what_a_job_bridge_on_the_inproc_backend_raises():
    async with fabric.Client(backend="inproc", registry=REG) as client:
        with pytest.raises(ToolUnavailable) as info:
            await fabric_tools(client)("needs_model", {"name": "ada"})
    assert str(info.value) == "tool 'needs_model' failed (SetupFailed): RuntimeError: model file missing"


def test_a_hook_that_raised_is_run_again_by_a_later_call(tools):
    with pytest.raises(ToolUnavailable, match="download interrupted"):
        inprocess_tool_caller("flaky", {"name": "ada"})
    assert inprocess_tool_caller("flaky", {"name": "ada"}) == "loaded ada"
    assert inprocess_tool_caller("flaky", {"name": "bo"}) == "loaded bo"
    assert RUNS["flaky"] == 2


def test_bad_arguments_are_still_the_policys_text(tools):
    assert inprocess_tool_caller("greet", {"name": "ada", "ctx": {"greeting": "pwned"}}) == (
        "error: greet(name): unexpected 'ctx'"
    )


def test_the_builtin_tools_still_answer(tools):
    from functions.tools.search import search

    assert inprocess_tool_caller("search", {"query": "speed of light", "k": 2}) == search(
        "speed of light", k=2
    )
    assert inprocess_tool_caller("python", {"code": "print(6 * 7)"}) == "42\n"
    assert inprocess_tool_caller("calculator", {"expression": "6 * 7"}) == "42"
