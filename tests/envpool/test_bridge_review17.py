"""The in-process tool bridge checks a policy's arguments as the fabric's workers do.

``envpool.make``'s bridge (``inprocess_tool_caller``, and the pool's default one on top of
it) called the tool with the policy's arguments as they came: an extra field was a raw
``TypeError``, a wrong type reached the tool, and an argument named ``ctx`` replaced the
tool's setup object (the search tool answered "'str' object has no attribute 'search'",
a tool that trusts its setup ran on the policy's). It now refuses them with the text a job's
bridge (``fabric_tools``) shows for the same call on the local backend, and runs the tool
on the arguments as the worker reads them.
"""

from __future__ import annotations

from typing import Any

import pytest

import fabric
from envpool.api import inprocess_tool_caller
from envpool.pool_config import fabric_tools, inprocess_tools

# the built-in tools and two of this module's, with a setup hook (importable by the local
# backend's workers: they take this process's sys.path)
REG = fabric.Registry()
REG.discover("functions.tools")


def setup_greeting() -> dict[str, str]:
    return {"greeting": "hello"}


@REG.tool(setup=setup_greeting)
def greet(name: str, times: int = 1, ctx: dict[str, str] | None = None) -> str:
    ctx = ctx if ctx is not None else setup_greeting()  # (a direct call: no setup hook run)
    return ", ".join([f"{ctx['greeting']} {name}"] * times)


@REG.tool(setup=setup_greeting)
def greet_any(name: str, ctx: dict[str, str] | None = None, **extra: Any) -> str:
    ctx = ctx if ctx is not None else setup_greeting()
    return f"{ctx['greeting']} {name} {sorted(extra)}"


@pytest.fixture
def tools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fabric, "default_registry", REG)


#: Bad calls and the text the local backend's bridge answers for each.
BAD_CALLS: list[tuple[str, Any, str]] = [
    ("calculator", {"expression": "1+1", "unit": "cm"}, "error: calculator(expression): unexpected 'unit'"),
    ("calculator", {}, "error: calculator(expression): missing 'expression'"),
    (
        "calculator",
        {"expression": 7},
        "error: calculator(expression): expression: Input should be a valid string",
    ),
    ("calculator", ["1+1"], "error: calculator: payload must be a dict of keyword arguments, got list"),
    ("search", {"query": "speed of light", "ctx": "x"}, "error: search(query, k=…): unexpected 'ctx'"),
    ("search", {"query": "light", "k": "3"}, "error: search(query, k=…): k: Input should be a valid integer"),
    ("python", {"code": "print(1)", "ctx": "x"}, "error: python(code, stdin=…): unexpected 'ctx'"),
    ("greet", {"name": "ada", "ctx": {"greeting": "pwned"}}, "error: greet(name, times=…): unexpected 'ctx'"),
    (
        "greet",
        {"name": "ada", "times": "two"},
        "error: greet(name, times=…): times: Input should be a valid integer, unable to parse string as an "
        "integer",
    ),
]


@pytest.mark.parametrize(("name", "arguments", "shown"), BAD_CALLS)
def test_bad_arguments_are_refused_with_the_fabrics_text(tools, name, arguments, shown):
    assert inprocess_tool_caller(name, arguments) == shown


async def test_the_text_is_what_the_local_backend_answers():
    """The expectations above, asked of a job's bridge on the local backend (its workers)."""
    async with fabric.Client(backend="local", registry=REG) as client:
        call = fabric_tools(client)
        for name, arguments, shown in BAD_CALLS:
            assert await call(name, arguments) == shown, (name, arguments)
        # a **extra tool takes a ctx argument, but the worker gives it its setup's
        assert await call("greet_any", {"name": "ada", "ctx": {"greeting": "pwned"}}) == "hello ada []"
        assert await call("greet", {"name": "ada", "times": "2"}) == "hello ada, hello ada"


def test_a_lone_surrogate_is_refused_as_the_fabric_refuses_it(tools):
    out = inprocess_tool_caller("calculator", {"expression": "\ud800"})
    assert out.startswith("error: payload of calculator has a lone surrogate at $.expression: ")


def test_a_ctx_argument_never_reaches_the_tools_setup_parameter(tools):
    # a **extra tool accepts the name: the worker replaces it with its setup's, and so does
    # this bridge
    assert inprocess_tool_caller("greet_any", {"name": "ada", "ctx": {"greeting": "pwned"}}) == "hello ada []"
    assert inprocess_tool_caller("greet_any", {"name": "ada", "mood": "calm"}) == "hello ada ['mood']"


def test_the_tool_runs_on_the_arguments_as_the_worker_reads_them(tools):
    # lax mode, as the worker validates: "2" is 2 (the tool got the string, and repeated its list "2" times)
    assert inprocess_tool_caller("greet", {"name": "ada", "times": "2"}) == "hello ada, hello ada"


def test_good_calls_answer_as_before(tools):
    from functions.tools.calculator import calculator
    from functions.tools.search import search

    assert inprocess_tool_caller("calculator", {"expression": "(17 + 25) * 3 / 4"}) == calculator(
        "(17 + 25) * 3 / 4"
    )
    assert inprocess_tool_caller("search", {"query": "speed of light", "k": 2}) == search(
        "speed of light", k=2
    )
    assert inprocess_tool_caller("greet", {"name": "ada"}) == "hello ada"
    # the tool's own refusal of a well-formed argument is still its text
    assert inprocess_tool_caller("calculator", {"expression": "1/0"}).startswith("error: ValueError: ")


async def test_the_pools_default_bridge_refuses_a_ctx_argument(tools):
    # it runs inprocess_tool_caller in a thread: a ctx of None was the tool's default, unseen
    assert await inprocess_tools("search", {"query": "speed of light", "ctx": None}) == (
        "error: search(query, k=…): unexpected 'ctx'"
    )
