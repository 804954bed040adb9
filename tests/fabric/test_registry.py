"""Registry, decorators, FunctionSpec, setup hooks and discovery."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import Field

import fabric
from fabric.errors import (
    DuplicateFunctionError,
    EntryPointError,
    ErrorCode,
    RegistryError,
    SignatureError,
    UnknownFunctionError,
)
from fabric.protocol import encode_payload
from fabric.registry import SPEC_ATTR, Registry, load_entry_point
from fabric.runner import FunctionRunner
from functions.rewards.answer import normalize

# top-level helpers: entry points are module:qualname


def add_one(x: int) -> int:
    """Adds one.

    More detail that is not part of the description."""
    return x + 1


def add_two(x: int) -> int:
    return x + 2


def score(traj: str, *, ground_truth: str = "") -> float:
    return 1.0 if traj == ground_truth else 0.0


def load_model() -> dict[str, Any]:
    return {"model": "loaded"}


def greet(text: str, ctx: dict[str, Any] | None = None) -> str:
    assert ctx is not None
    return f"{ctx['model']}:{text}"


def bounded(
    x: Annotated[int, Field(ge=0, le=10)] = 1, *, name: Annotated[str, Field(min_length=1)] = "a"
) -> str:
    return name * x


def no_params() -> float:
    return 1.0


def only_kwargs(**kw: Any) -> float:
    return float(len(kw))


def _make_nested() -> Any:
    def inner(x: int) -> int:
        return x

    return inner


def spec_of(fn: Any, **options: Any) -> Any:
    return getattr(Registry().function(**options)(fn), SPEC_ATTR)


@pytest.fixture
def default_reg(monkeypatch: pytest.MonkeyPatch) -> Registry:
    """fabric.default_registry, restored after the test."""
    reg = fabric.default_registry
    monkeypatch.setattr(reg, "_specs", dict(reg._specs))
    monkeypatch.setattr(reg, "_fns", dict(reg._fns))
    monkeypatch.setattr(reg, "_versions", {k: list(v) for k, v in reg._versions.items()})
    return reg


def test_versions_are_the_codes_registered_under_a_name_one_per_change() -> None:
    """What the client's version check reads: the code registered since a call was sent."""
    reg = Registry()
    assert reg.versions("add_one") == []
    reg.tool(add_one)
    first = reg.get("add_one").version
    reg.add(add_one)  # the same code again (discovered twice): no change
    assert reg.versions("add_one") == [first]
    spec = getattr(add_one, SPEC_ATTR)
    try:
        setattr(add_one, SPEC_ATTR, spec.model_copy(update={"version": "edited"}))
        reg.add(add_one)
        setattr(add_one, SPEC_ATTR, spec)
        reg.add(add_one)  # edited back
    finally:
        setattr(add_one, SPEC_ATTR, spec)
    assert reg.versions("add_one") == [first, "edited", first]


def test_bare_decorators_return_the_function_and_register_it() -> None:
    reg = Registry()
    assert reg.reward(score) is score
    assert reg.tool(add_one) is add_one
    assert reg.function(add_two) is add_two
    assert add_one(1) == 2  # still a plain callable
    assert reg.names() == ["add_one", "add_two", "score"]
    assert [reg.get(n).kind for n in reg.names()] == ["tool", "function", "reward"]
    assert reg.callable("score") is score and getattr(score, SPEC_ATTR) == reg.get("score")
    assert len(reg) == 3 and "score" in reg and "nope" not in reg
    assert [s.name for s in reg] == ["add_one", "add_two", "score"]


def test_decorators_with_arguments() -> None:
    reg = Registry()
    assert reg.reward(name="r1", warm=2)(score) is score
    reg.tool(name="t1", side_effects=True)(add_one)
    reg.function(kind="tool", name="t2")(add_two)
    assert reg.get("r1").kind == "reward" and reg.get("r1").warm == 2
    assert reg.get("t1").side_effects is True and reg.get("t1").hedgeable is False
    assert reg.get("t2").kind == "tool"


def test_module_level_reward_writes_to_default_registry(default_reg: Registry) -> None:
    fabric.reward(name="test_registry_default_probe", timeout_s=3)(score)
    spec = default_reg.get("test_registry_default_probe")
    assert spec.kind == "reward" and spec.timeout_s == 3 and spec.entry == f"{__name__}:score"


def test_spec_fields() -> None:
    s = spec_of(
        add_one,
        **{"timeout_s": 12.5, "memory_mb": 2048, "warm": 3, "max_concurrency": 8, "max_batch": 4},
        retry={"max_attempts": 5, "initial_backoff_s": 0.5},
        resources={"cpu": 2, "gpu": 1, "gpu_type": "H100"},
        side_effects=True,
        examples=({"x": 1},),
    )
    assert (s.name, s.kind, s.entry) == ("add_one", "function", f"{__name__}:add_one")
    assert s.description == "Adds one."
    assert (s.timeout_s, s.memory_mb, s.warm, s.max_concurrency, s.max_batch) == (12.5, 2048, 3, 8, 4)
    assert (s.retry.max_attempts, s.retry.initial_backoff_s, s.retry.max_backoff_s) == (5, 0.5, 2.0)
    assert (s.resources.cpu, s.resources.gpu, s.resources.gpu_type) == (2.0, 1, "H100")
    assert s.side_effects is True and s.examples == ({"x": 1},)
    assert s.is_async is False and s.setup is None
    assert [(p.name, p.required, p.annotation) for p in s.params] == [("x", True, "int")]
    assert s.check_args({"y": 1}) == "add_one(x): missing 'x'; unexpected 'y'"
    with pytest.raises(Exception, match="frozen"):
        s.warm = 0
    d = getattr(Registry().reward(score), SPEC_ATTR)  # defaults
    assert (d.timeout_s, d.memory_mb, d.warm, d.max_concurrency, d.max_batch) == (30.0, 512, 1, 64, 32)
    assert d.retry.max_attempts == 3 and d.resources.gpu == 0 and d.side_effects is False
    assert [(p.name, p.required) for p in d.params] == [("traj", True), ("ground_truth", False)]


def test_version_follows_source_and_setup(tmp_path) -> None:
    fns = []
    for i, body in enumerate(["1.0", "2.0", "1.0"]):
        (tmp_path / f"v{i}.py").write_text(f"def scorer(traj):\n    return {body}\n")
        fns.append(load_entry_point(f"{tmp_path / f'v{i}.py'}:scorer"))
    va, vb, vsame = (spec_of(f).version for f in fns)
    assert va != vb
    assert va == vsame  # only the source counts, not the file it lives in
    assert len(va) == 12
    assert spec_of(add_one).version == spec_of(add_one).version  # stable
    assert spec_of(add_one).version != spec_of(add_two).version
    with_setup = {spec_of(greet, setup=s).version for s in (None, load_model, no_params)}
    assert len(with_setup) == 3


def test_constraints_on_arguments_are_checked_at_the_edge() -> None:
    # get_type_hints dropped the Annotated extras: Field(ge=0) was never checked, and the
    # function ran on -1
    reg = Registry()
    runner = FunctionRunner(reg.function(bounded), reg.get("bounded"))
    assert runner.run(encode_payload({"x": 3, "name": "ab"})) == (True, b'"ababab"')
    for bad, says in (({"x": -1}, "x: Input should be greater than or equal to 0"), ({"name": ""}, "name:")):
        ok, (code, message, _) = runner.run(encode_payload(bad))
        assert not ok and code == ErrorCode.INVALID_ARGUMENTS and says in message, message


def test_setup_hook_passes_ctx() -> None:
    reg = Registry()
    fn = reg.function(setup=load_model)(greet)
    spec = reg.get("greet")
    assert spec.setup == f"{__name__}:load_model"
    assert [p.name for p in spec.params] == ["text"]  # ctx is filled by the worker, not the caller
    runner = FunctionRunner(fn, spec)
    runner.setup()
    assert runner.ctx == {"model": "loaded"}
    assert runner.run(encode_payload({"text": "hi"})) == (True, b'"loaded:hi"')
    again = FunctionRunner.from_entry(spec.entry)
    again.setup()
    assert again.run(encode_payload({"text": "yo"})) == (True, b'"loaded:yo"')
    with pytest.raises(SignatureError, match="setup= must be a callable"):
        Registry().function(setup=42)(add_one)
    with pytest.raises(SignatureError, match="the setup hook takes no arguments"):
        Registry().function(setup=lambda x: x)(add_one)


def test_duplicate_names() -> None:
    reg = Registry()
    reg.function(name="adder")(add_one)
    with pytest.raises(DuplicateFunctionError) as ei:
        reg.function(name="adder")(add_two)
    msg = str(ei.value)
    assert f"'adder' is taken by {__name__}:add_one; {__name__}:add_two needs another name" in msg
    assert "(pass name=... to the decorator)" in msg
    assert reg.callable("adder") is add_one
    reg.function(name="adder", warm=2)(add_one)  # the same function again is fine
    reg.add(add_one)
    assert reg.names() == ["adder"] and reg.get("adder").warm == 2


@pytest.mark.parametrize(
    ("fn", "kind", "match"),
    [
        (lambda *items: 0, "function", r"\*items is not supported"),
        (lambda a, /: a, "function", "positional-only parameter 'a'"),
        (no_params, "reward", "takes no arguments; it needs at least the trajectory"),
        (int, "function", "decorates a function"),
    ],
)
def test_bad_signatures(fn: Any, kind: str, match: str) -> None:
    reg = Registry()
    with pytest.raises(SignatureError, match=match):
        reg.function(kind=kind)(fn)
    assert len(reg) == 0


def test_signatures_that_are_allowed() -> None:
    reg = Registry()
    reg.function(no_params)  # a plain function may take nothing
    reg.reward(only_kwargs)  # a reward taking **kwargs is fine
    assert reg.get("only_kwargs").accepts_extra is True and reg.get("no_params").params == ()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"warm": 5, "max_concurrency": 2}, "warm=5 exceeds max_concurrency=2"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": 901}, "timeout_s"),
        ({"name": "1bad"}, "name"),
        ({"name": "x" * 65}, "name"),
        ({"memory_mb": 64}, "memory_mb"),
        ({"wram": 1}, "wram"),
        ({"retry": {"max_attempts": 0}}, "max_attempts"),
        # a spec is JSON (deploys read it): inf was written as null and the spec did not load
        ({"resources": {"cpu": float("inf")}}, "cpu"),
    ],
)
def test_bad_options(options: dict[str, Any], match: str) -> None:
    reg = Registry()
    with pytest.raises(RegistryError, match=match) as ei:
        reg.function(**options)(add_one)
    assert str(ei.value).startswith(f"bad options for function {options.get('name', 'add_one')!r}")
    assert len(reg) == 0


def test_a_misspelt_option_lists_the_decorators_options_not_the_fields_it_derives() -> None:
    reg = Registry()
    with pytest.raises(RegistryError, match=r"did you mean 'timeout_s'\?\); allowed: ") as ei:
        reg.function(timeot_s=3)(add_one)
    allowed = str(ei.value).split("allowed: ")[1].split(", ")
    assert {"name", "timeout_s", "warm", "setup", "hedge"} <= set(allowed)
    assert not {"kind", "entry", "version", "params", "is_async", "accepts_extra"} & set(allowed)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"warm": True}, "warm"),
        ({"warm": "2"}, "warm"),
        ({"max_concurrency": "8"}, "max_concurrency"),
        ({"memory_mb": 1024.0}, "memory_mb"),
        ({"max_batch": False}, "max_batch"),
        ({"timeout_s": "10"}, "timeout_s"),
        ({"timeout_s": True}, "timeout_s"),
        ({"side_effects": "yes"}, "side_effects"),
        ({"hedge": 0}, "hedge"),
        ({"retry": {"max_attempts": "3"}}, "retry.max_attempts"),
        ({"retry": {"initial_backoff_s": "0.1"}}, "retry.initial_backoff_s"),
        ({"resources": {"gpu": True}}, "resources.gpu"),
        ({"resources": {"cpu": "2"}}, "resources.cpu"),
    ],
)
def test_numbers_and_flags_are_not_coerced(options: dict[str, Any], key: str) -> None:
    """``warm=True`` registered one warm worker and ``max_concurrency="8"`` eight: pydantic's
    lax mode turned bools and strings into numbers (and "yes" into True), so a typo or a value
    read from the environment unconverted passed unseen. Each is refused, naming the key."""
    reg = Registry()
    with pytest.raises(RegistryError) as ei:
        reg.function(**options)(add_one)
    assert f"{key}: " in str(ei.value), str(ei.value)
    assert len(reg) == 0
    # the right types still pass: an int where a float is wanted too
    reg.function(warm=2, timeout_s=10, retry={"initial_backoff_s": 1}, resources={"cpu": 2})(add_one)
    assert reg.get("add_one").warm == 2 and reg.get("add_one").timeout_s == 10.0


@pytest.mark.parametrize(
    "retry",
    [
        {"max_backoff_s": float("inf"), "initial_backoff_s": float("inf")},
        {"max_backoff_s": float("inf")},
        {"initial_backoff_s": float("inf")},
    ],
)
def test_a_backoff_of_no_end_is_refused(retry: dict[str, Any]) -> None:
    """An infinite backoff was accepted: with both ends infinite, a call with no deadline that
    failed retryably slept for good before its second attempt (asyncio.sleep(inf))."""
    reg = Registry()
    with pytest.raises(RegistryError, match="backoff_s"):
        reg.function(retry=retry)(add_one)
    assert len(reg) == 0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"version": "abc"}, "version"),
        ({"entry": "mod:fn"}, "entry"),
        ({"params": ()}, "params"),
        ({"is_async": True}, "is_async"),
        ({"accepts_extra": True}, "accepts_extra"),
        ({"name": ""}, "name"),
    ],
)
def test_options_the_decorator_derives_or_an_empty_name_are_refused(
    options: dict[str, Any], match: str
) -> None:
    """``version=`` (and the other fields read from the function) raised a bare TypeError
    ("got multiple values for keyword argument"), no FabricError; ``name=""`` was dropped
    silently and the function registered under its own name."""
    reg = Registry()
    with pytest.raises(RegistryError, match=match):
        reg.function(**options)(add_one)
    assert len(reg) == 0
    # the description, read from the docstring too, may be given (it raised the same TypeError)
    assert spec_of(add_one, description="Plus one.").description == "Plus one."


class _CallableObject:
    def __call__(self, x: int) -> int:
        return x


@pytest.mark.parametrize(
    ("fn", "options", "match"),
    [
        (functools.partial(add_one, x=1), {}, "has no __name__"),
        (_CallableObject(), {}, "has no __name__"),
        (add_one, {"setup": dict}, "signature of the setup hook"),
    ],
)
def test_callables_the_decorator_cannot_read_are_signature_errors(
    fn: Any, options: dict[str, Any], match: str
) -> None:
    """A functools.partial or a callable object raised AttributeError ('__name__'), a setup
    hook with no readable signature ValueError: not FabricErrors, as the SDK's are."""
    reg = Registry()
    with pytest.raises(SignatureError, match=match):
        reg.function(**options)(fn)
    assert len(reg) == 0


def test_unknown_function_lists_known_names() -> None:
    reg = Registry()
    reg.function(add_two)
    reg.function(add_one)
    with pytest.raises(UnknownFunctionError) as ei:
        reg.get("gamma")
    assert str(ei.value) == "unknown function 'gamma'; known functions: add_one, add_two"
    assert ei.value.known == ["add_one", "add_two"] and ei.value.name == "gamma"
    # a near miss names the function meant before the list, where it is easy to miss
    with pytest.raises(UnknownFunctionError) as ei:
        reg.get("add_tow")
    assert str(ei.value).startswith("unknown function 'add_tow' (did you mean 'add_two'?); known functions:")
    with pytest.raises(UnknownFunctionError, match=r"\(none registered\)"):
        Registry().callable("gamma")
    with pytest.raises(RegistryError, match="not a fabric function"):
        Registry().add(normalize)


_BUILTIN_MISS = """
import fabric
from fabric.errors import UnknownFunctionError
for discover in (False, True):
    if discover:
        fabric.default_registry.discover("functions")
    try:
        fabric.default_registry.get("exact_match")
        print("found")
    except UnknownFunctionError as e:
        print(e)
"""


def test_a_script_that_never_loaded_the_built_ins_is_told_how() -> None:
    """A fresh interpreter, as a user's script: the built-ins are not registered until their
    package is discovered, and the error says so (the CLI discovers them itself)."""
    out = subprocess.run(
        [sys.executable, "-c", _BUILTIN_MISS], capture_output=True, text=True, timeout=60, check=True
    ).stdout.splitlines()
    assert out[0].startswith("unknown function 'exact_match'; known functions: (none registered)")
    assert "fabric.default_registry.discover('functions')" in out[0]
    assert out[1] == "found"


def test_discover_package_and_entry_point() -> None:
    reg = Registry()
    assert "exact_match" in [s.name for s in reg.discover("functions")]
    spec = reg.get("exact_match")
    assert spec.entry == "functions.rewards.exact_match:exact_match" and len(spec.examples) == 2
    assert (spec.kind, spec.warm, spec.timeout_s, spec.max_batch) == ("reward", 1, 5.0, 64)
    one = Registry()
    assert [s.name for s in one.discover(spec.entry)] == ["exact_match"] == one.names()
    with pytest.raises(RegistryError, match="not a fabric function"):
        one.discover("functions.rewards.answer:normalize")


def test_discover_py_file(tmp_path, default_reg: Registry) -> None:
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "import fabric\n\n\n@fabric.reward(name='test_registry_file_reward', timeout_s=2)\n"
        "def file_reward(traj: str) -> float:\n    return 0.5 if traj else 0.0\n"
    )
    reg = Registry()
    assert [s.name for s in reg.discover(str(path))] == ["test_registry_file_reward"]
    spec = reg.get("test_registry_file_reward")
    assert spec.entry == f"{path.resolve()}:file_reward" and spec.timeout_s == 2
    assert FunctionRunner.from_entry(spec.entry).run(encode_payload({"traj": "x"})) == (True, b"0.5")


_PKG_SCRIPT = """
import asyncio, fabric
from .helpers import norm

@fabric.reward
def match(traj: str, ground_truth: str) -> float:
    return float(norm(traj) == norm(ground_truth))

async def main():
    print("ENTRY", match.__fabric_spec__.entry)
    async with fabric.Client(backend="local") as c:
        r = await c.call("match", {"traj": " A", "ground_truth": "a"})
        print("RESULT", r.ok, r.value, r.error)

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_a_module_run_with_python_dash_m_is_imported_by_name_in_workers(tmp_path) -> None:
    """``python -m pkg.script``: __main__ is ``pkg.script``, so workers import it by that name;
    as a bare file its relative import failed (SetupFailed: no known parent package)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers.py").write_text("def norm(s):\n    return s.strip().lower()\n")
    (pkg / "script.py").write_text(textwrap.dedent(_PKG_SCRIPT))
    root = str(Path(fabric.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    p = subprocess.run(
        [sys.executable, "-m", "pkg.script"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "ENTRY pkg.script:match" in p.stdout, p.stdout + p.stderr[-2000:]
    assert "RESULT True 1.0" in p.stdout, p.stdout + p.stderr[-2000:]


def test_discover_missing_module() -> None:
    with pytest.raises(EntryPointError, match="cannot import 'no_such_module_xyz' for discovery"):
        Registry().discover("no_such_module_xyz")
    with pytest.raises(EntryPointError, match=r"cannot import 'functions\.nope'"):
        Registry().discover("functions.nope")


@pytest.mark.parametrize("content", [None, "raise ValueError('boom at import')\n"], ids=["missing", "raises"])
def test_discover_bad_py_file_is_entry_point_error(tmp_path, content: str | None) -> None:
    if content is not None:
        (tmp_path / "bad.py").write_text(content)
    with pytest.raises(EntryPointError, match=r"bad\.py"):
        Registry().discover(str(tmp_path / "bad.py"))


def test_discover_py_file_failure_is_not_cached(tmp_path) -> None:
    (tmp_path / "broken2.py").write_text("raise ValueError('boom at import')\n")
    for _ in range(2):
        with pytest.raises((ValueError, EntryPointError), match="boom at import"):
            Registry().discover(str(tmp_path / "broken2.py"))


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (f"{__name__}:_make_nested.<locals>.inner", "nested function or a lambda"),
        (f"{__name__}:<lambda>", "nested function or a lambda"),
        ("fabric.registry", "must look like 'module:attr'"),
        ("fabric.registry:no_such_attr", "has no attribute 'no_such_attr'"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    ],
)
def test_load_entry_point_errors(entry: str, match: str) -> None:
    with pytest.raises(EntryPointError, match=match):
        load_entry_point(entry)


def test_nested_function_cannot_be_run_by_entry() -> None:
    spec = spec_of(_make_nested())
    assert spec.entry == f"{__name__}:_make_nested.<locals>.inner"
    with pytest.raises(EntryPointError, match="nested function"):
        FunctionRunner.from_entry(spec.entry)
    with pytest.raises(EntryPointError, match="not a fabric function"):
        FunctionRunner.from_entry("functions.rewards.answer:normalize")
