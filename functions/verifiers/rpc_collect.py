"""The tests a test text defines but never runs itself, which the harness runs after it
(stdlib only, like the harness). Without them, a text that only defines its tests runs
nothing and passes every program: ``def test_add(): assert add(2, 3) == 5`` with no call
(pytest would find and call it), HumanEval's ``def check(candidate): ...`` whose entry
point comes apart from it, a ``TestCase`` with no ``unittest.main()``.

Once the text's top-level code ended, the harness runs (pytest's collection rules, the
ones such texts are written for):

* each top-level ``def test*`` the text did not call, with no arguments, in the order
  defined; one that takes arguments (pytest fixtures) cannot run: the tests are broken;
* each ``test*`` method of a top-level ``class Test*`` (not a ``unittest.TestCase``) that
  the text did not call, on a fresh instance of its class;
* ``check(<the program's entry point>)`` if the text defines ``check`` and did not call
  it; with no ``entry_point`` in the request, the tests are broken;
* the text's ``TestCase`` classes, through unittest, if it started no unittest run.

Which tests the text called is recorded, not guessed: a statement added at the top of each
such function's body (an AST edit, at the line of the statement it precedes) adds its name
to a set. Why per function, and not "run them all if the text called none": a text that
calls some of its tests and forgets one would skip that one, and one that calls them all
would have them run twice (a side effect twice, a counter off by one) by a rule that did
not look at which. Why not a tracer (``sys.setprofile``): it would slow every call the
tests make, each of a loop's thousands of proxy calls included; the edit costs one set
insertion per test.

A text must test something: a top-level statement that does something (an ``assert``, a
call, a loop, an assignment that calls: anything but imports, definitions, docstrings and
assignments of constants or names), a test it or
the harness ran, a unittest test or a doctest example. Otherwise the tests are broken
(``Unrunnable``), whatever the program.
"""

from __future__ import annotations

import ast
import inspect
import json
import opcode
import os
import types
import unittest
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from functions.verifiers import rpc

#: The tests module's name for the set that the added statements fill.
RAN = "__rlfabric_ran__"
HINT = "define test_* functions, call check(candidate) (or give entry_point), or write top-level asserts"
#: Top-level statements that test nothing (and a bare string, a docstring: ``_is_string``).
_INERT = (
    *(ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef),
    *(ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Pass),
)
#: What a top-level ``assert`` compiles to (None where an interpreter lacks it: no shortcut).
_ASSERT_OP = opcode.opmap.get("LOAD_ASSERTION_ERROR")


class Unrunnable(Exception):
    """The tests cannot judge any program; the message says why and what to fix."""


@dataclass
class Plan:
    """What the text defines that the harness may have to run, and what ran."""

    acts: bool = True
    """A top-level statement does something (an assert, a call, a loop)."""
    tests: list[str] = field(default_factory=list)
    """Its test functions and test methods (``"test_add"``, ``"TestAdd.test_zero"``), in order."""
    classes: list[str] = field(default_factory=list)
    """Its top-level classes (the ``TestCase`` ones run if the text started no unittest run)."""
    check: bool = False
    """It defines ``check`` (HumanEval's ``check(candidate)``)."""
    ran: set[str] = field(default_factory=set)
    """The tests that ran (filled by the statements added to them, under ``RAN``)."""


def prepare(source: str, entry: str) -> tuple[types.CodeType, Plan]:
    """The text, compiled, and its plan. The common text (top-level asserts, no test function,
    no class) is compiled once, as before: its bytecode says so, with no AST pass."""
    try:
        code = compile(source, entry, "exec", dont_inherit=True)  # not this module's __future__ flags
    except (SyntaxError, ValueError) as e:  # ValueError: a null byte, before Python 3.12
        # the tests' own text: it fails whatever the program (a 0 would blame the program)
        raise Unrunnable(f"the tests do not compile: {type(e).__name__}: {e}") from None
    if _plain_asserts(code):
        return code, Plan()
    tree = ast.parse(source, entry)
    plan = Plan(acts=False)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and (node.name.startswith("test") or node.name == "check"):
            _record(node, node.name)
            if node.name == "check":
                plan.check = True
            else:
                plan.tests.append(node.name)
        elif isinstance(node, ast.ClassDef):
            plan.classes.append(node.name)
            if node.name.startswith("Test"):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name.startswith("test"):
                        _record(item, f"{node.name}.{item.name}")
                        plan.tests.append(f"{node.name}.{item.name}")
        elif (not isinstance(node, _INERT) and not _is_string(node)) or _assigns_a_call(node):
            plan.acts = True
    if plan.tests or plan.check:
        code = compile(tree, entry, "exec", dont_inherit=True)
    return code, plan


def _plain_asserts(code: types.CodeType) -> bool:
    """Does the text assert at its top level (an ``assert`` there, in a block or not, is a
    LOAD_ASSERTION_ERROR of the module's own code) and define no ``test*`` or ``check``
    function and no class (whose code is a constant of the module's, named after it)?"""
    if _ASSERT_OP is None or bytes([_ASSERT_OP]) not in code.co_code[::2]:  # opcodes: even bytes
        return False
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if not const.co_flags & inspect.CO_NEWLOCALS:  # a class body
                return False
            if const.co_name.startswith("test") or const.co_name == "check":
                return False
    return True


def _assigns_a_call(node: ast.stmt) -> bool:
    """``ok = run_all()``, ``result = solution(5)``: an assignment that calls something runs
    code (tests that check the program runs, or a runner not named ``test*``); one of a
    constant or a name (``EPS = 1e-9``) does not."""
    if not isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign) or node.value is None:
        return False
    return any(isinstance(n, ast.Call) for n in ast.walk(node.value))


def _is_string(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _record(fn: ast.FunctionDef, key: str) -> None:
    """Add ``__rlfabric_ran__.add(key)`` at the top of ``fn``'s body, after its docstring, at
    the place of the statement it precedes (the text's line numbers stay as they were)."""
    at = 1 if _is_string(fn.body[0]) else 0  # a docstring stays one (doctest reads it)
    add = ast.Attribute(ast.Name(RAN, ast.Load()), "add", ast.Load())
    where = fn.body[min(at, len(fn.body) - 1)]
    stmt = ast.copy_location(ast.Expr(ast.Call(add, [ast.Constant(key)], [])), where)
    fn.body.insert(at, ast.fix_missing_locations(stmt))


def pending(
    plan: Plan, namespace: dict[str, Any], program: dict[str, Any], entry: str, runs: list[Any]
) -> list[tuple[str, Callable[[], object]]]:
    """The tests the text defined and did not run, each as (name, call), in order: to be
    called only if ``name`` is still not in ``plan.ran`` when its turn comes (a test may
    call another, ``check`` among them). Raises ``Unrunnable`` if a test takes fixtures;
    the call of a ``check`` with no entry point raises it. ``program``: the program's names
    bound for the tests (the entry point is the program's, never a function of the tests
    of that name); ``entry``: the test code's file; ``runs``: the unittest runs the text
    started."""
    calls: list[tuple[str, Callable[[], object]]] = []
    needs_arguments: list[str] = []
    for key in dict.fromkeys(plan.tests):  # a test defined twice is the later one, once
        if key in plan.ran:
            continue
        owner, _, name = key.rpartition(".")
        cls = namespace.get(owner)
        if not owner:
            test, skip = namespace.get(key), 0
        elif isinstance(cls, type) and not issubclass(cls, unittest.TestCase):  # (unittest runs those)
            test = getattr(cls, name, None)
            # a plain function of the class is called on an instance: its first parameter is given
            skip = 1 if isinstance(inspect.getattr_static(cls, name, None), types.FunctionType) else 0
        else:
            continue
        if not callable(test):
            continue  # rebound by the text to something that is not a test
        if missing := _required(test, skip):
            needs_arguments.append(f"{key}({', '.join(missing)})")
        else:
            calls.append((key, _on_instance(cls, name) if owner else test))
    if needs_arguments:
        takes = "take" if len(needs_arguments) > 1 else "takes"
        raise Unrunnable(
            f"{', '.join(needs_arguments)} {takes} arguments (pytest fixtures?), which the verifier "
            "cannot give: give them defaults, or call them in the tests"
        )
    check = namespace.get("check")
    if plan.check and "check" not in plan.ran and callable(check):
        calls.append(("check", lambda: check(_candidate(program, _options(entry).get("entry_point")))))
    if not runs and (suite := _unittest_suite(plan, namespace)).countTestCases():
        calls.append(("unittest", lambda: unittest.TextTestRunner().run(suite)))  # recorded in runs
    return calls


def _options(entry: str) -> dict[str, Any]:
    """The request's options for the harness, beside the test code (``rpc.TEST_OPTIONS``)."""
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(entry)), rpc.TEST_OPTIONS), "rb") as f:
            options = json.load(f)
    except FileNotFoundError:
        return {}
    return options if type(options) is dict else {}


def _required(fn: Any, skip: int) -> list[str]:
    """The parameters of ``fn`` that have no default (past the first ``skip``)."""
    try:
        params = list(inspect.signature(fn).parameters.values())[skip:]
    except (TypeError, ValueError):  # no signature to read: call it and see
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in params if p.default is p.empty and p.kind not in variadic]


def _on_instance(cls: Any, name: str) -> Callable[[], object]:
    return lambda: getattr(cls(), name)()


def _candidate(program: dict[str, Any], entry_point: str | None) -> Any:
    if entry_point is None:
        raise Unrunnable(
            "check(candidate) is defined but never called, and the request names no entry_point: "
            "give entry_point (the program's function it checks), or call check(...) in the tests"
        )
    if entry_point not in program:  # the program's fault, as a test's call of a missing name
        raise NameError(
            f"name {entry_point!r} is not defined: the program has no {entry_point} (the entry point)"
        )
    return program[entry_point]


def _unittest_suite(plan: Plan, namespace: dict[str, Any]) -> unittest.TestSuite:
    """The tests of the text's own ``TestCase`` classes."""
    suite = unittest.TestSuite()
    for name in plan.classes:
        cls = namespace.get(name)
        if isinstance(cls, type) and issubclass(cls, unittest.TestCase):
            suite.addTests(unittest.defaultTestLoader.loadTestsFromTestCase(cls))
    return suite
