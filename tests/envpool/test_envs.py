"""The built-in environments, the calculator tool and the ``check_env`` conformance checker."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import time
from itertools import count
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pool_util import wait_for

import envpool
import envpool.envs  # registers the built-ins
from envpool.api import EnvRegistry, Observation, StepResult, as_observation
from envpool.envs.code_repair import TASKS, parse_blocks
from envpool.envs.frozenlake import FrozenLakeEnv
from envpool.errors import EnvOrderError
from envpool.pool import EnvPool
from envpool.testing import EnvConformanceError, check_env
from fabric.registry import Registry
from functions.tools.calculator import MAX_INT_BITS, OPENAI_SCHEMA, calculator

REPO = Path(__file__).resolve().parents[2]


def edit_action(file: str, search: str, replace: str) -> str:
    return f"edit {file}\n<<<<<<< SEARCH\n{search}\n=======\n{replace}\n>>>>>>> REPLACE"


# ----------------------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("2 + 3 * 4", "14"),
        ("(1 + 2) ** 3", "27"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 4", "3"),
        ("-3 ** 2", "-9"),
        ("+5 - -5", "10"),
        ("10 / 4", "2.5"),
        ("6 / 3", "2"),
        ("0.1 + 0.2", "0.3"),
        ("2 ** -1", "0.5"),
        ("  1_000 * 3\n", "3000"),
        ("2 ** 100", str(2**100)),
        ("1.5e3 / 2", "750"),
        # tiny, not "too large": an exponent too big for a float underflows like 2 ** -2000
        ("2 ** -(10 ** 3000)", "0"),
        ("0.5 ** (10 ** 3000)", "0"),
        ("2 ** -2000", "0"),
        ("(-1) ** -(10 ** 3000 + 1)", "-1"),
        # every digit the float has (12 significant digits rounded or dropped these)
        ("100000000001.5", "100000000001.5"),
        ("4.35 * 100", "435"),  # binary noise just below a whole number is not shown
        ("0.57 * 100", "57"),
        ("1.005 * 1000", "1005"),
        ("0.5 + 123456789012", "123456789012.5"),
        ("99999999999.99", "99999999999.99"),
        ("1e15 + 1", "1000000000000001"),
        ("123456789012345.6", "123456789012345.6"),
        ("2 ** 53 + 0.0", "9.00719925474099e+15"),
        ("1e300", "1e+300"),
        ("-0.1 - 0.2", "-0.3"),
    ],
)
def test_calculator_evaluates(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("7 // 0.0", "division by zero"),
        ("x + 1", "names are not allowed"),
        ("abs(-1)", "function calls are not allowed"),
        ("__import__('os').system('true')", "function calls are not allowed"),
        ("(1).real", "attributes are not allowed"),
        ("2 ^ 3", "use '**'"),
        ("[1, 2]", "List is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("2j", "only numbers"),
        ("", "empty expression"),
        ("1 +", "not an arithmetic expression"),
        ("(-8) ** 0.5", "not a real number"),
        ("1e308 * 10", "too large"),
        ("1e999", "a number is too large for a float"),  # parses as inf
        ("-1e999 + 1", "a number is too large for a float"),
        ("0.5 ** -(10 ** 3000)", "the result is too large"),
        ("0 ** -(10 ** 3000)", "division by zero"),
        ("1" * 501, "over the 500 limit"),
    ],
)
def test_calculator_refuses(expression, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        calculator(expression)


@pytest.mark.parametrize("expression", ["9**9**9", "2 ** 10 ** 100", "10 ** 3000 * 10 ** 3000", "7 ** 5000"])
def test_calculator_refuses_huge_numbers_fast(expression):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="too large"):
        calculator(expression)
    assert time.perf_counter() - t0 < 5  # refused before computing: 9**9**9 would not end


def test_calculator_allows_numbers_up_to_the_bound():
    assert calculator(f"2 ** {MAX_INT_BITS - 1}") == str(2 ** (MAX_INT_BITS - 1))


def test_calculator_schema_matches_its_signature():
    reg = Registry()
    reg.discover("functions.tools")
    spec = reg.get("calculator")
    assert spec.kind == "tool"
    params = OPENAI_SCHEMA["function"]["parameters"]
    assert OPENAI_SCHEMA["function"]["name"] == spec.name
    assert params["required"] == [p.name for p in spec.params if p.required]
    assert set(params["properties"]) == {p.name for p in spec.params}


# ----------------------------------------------------------------------------- frozenlake

SEED0_MAP = ["SFFF", "FFFF", "FFHF", "FFFG"]


def test_frozenlake_seeded_map_is_reproducible():
    env = envpool.make("frozenlake-v1")
    obs, info = env.reset(seed=0)
    assert info["map"] == SEED0_MAP  # pinned: a change of generation needs frozenlake-v2
    assert env.reset(seed=0) == (obs, info)
    assert envpool.make("frozenlake-v1").reset(seed=1)[1]["map"] != SEED0_MAP
    assert obs.text.splitlines()[1:5] == ["@ F F F", "F F F F", "F F H F", "F F F G"]


def test_frozenlake_neighbours_line_names_the_tile_each_move_reaches():
    env = envpool.make("frozenlake-v1", neighbours=True)
    obs, _ = env.reset(seed=0)
    assert "Next to you: left edge, right F, up edge, down F." in obs.text.splitlines()
    for move in ("down", "right", "right"):
        obs = env.step(move).obs
    assert "Next to you: left F, right F, up F, down H." in obs.text.splitlines()  # at (1, 2)
    assert "Next to you" not in envpool.make("frozenlake-v1").reset(seed=0)[0].text


def test_latency_tail_per_task_repeats_for_a_seed_and_per_rollout_does_not():
    def slow_draws(tail: str) -> list[bool]:
        env = envpool.make("latency-v0", mu_s=0.0, slow_prob=0.5, tail=tail)
        return [env.reset(seed=7)[1]["slow"] for _ in range(40)]

    assert len(set(slow_draws("task"))) == 1  # the same task is slow (or not) every time
    assert set(slow_draws("rollout")) == {True, False}  # 2 ** -39 to fail by chance


@pytest.mark.parametrize(
    "kwargs",
    [{"tail": "machine"}, {"mu_s": -1.0}, {"turns": 0}, {"slow_prob": 1.5}, {"fail_prob": -0.1}],
)
def test_latency_refuses_bad_kwargs(kwargs):
    with pytest.raises(ValueError):
        envpool.make("latency-v0", **kwargs)


def test_frozenlake_reset_without_seed_continues_the_seeded_stream():
    a, b = envpool.make("frozenlake-v1"), envpool.make("frozenlake-v1")
    a.reset(seed=5)
    b.reset(seed=5)
    assert a.reset()[1]["map"] == b.reset()[1]["map"]


def test_frozenlake_winning_path():
    env = envpool.make("frozenlake-v1")
    env.reset(seed=0)
    path = ["right", "right", "right", "down", "down", "down"]
    for move in path[:-1]:
        res = env.step(move)
        assert (res.reward, res.terminated) == (0.0, False)
    res = env.step(path[-1])
    assert (res.reward, res.terminated, res.truncated) == (1.0, True, False)
    assert res.info["position"] == [3, 3]
    assert "reached the goal" in res.obs.text
    with pytest.raises(EnvOrderError):
        env.step("left")


def test_frozenlake_hole_ends_the_episode_without_reward():
    env = envpool.make("frozenlake-v1")
    env.reset(seed=0)
    results = [env.step(m) for m in ("down", "down", "right", "right")]
    assert [r.terminated for r in results] == [False, False, False, True]
    assert results[-1].reward == 0.0
    assert results[-1].info["position"] == [2, 2]
    assert "fell into a hole" in results[-1].obs.text


def test_frozenlake_invalid_move_and_edges():
    env = envpool.make("frozenlake-v1")
    env.reset(seed=0)
    res = env.step("jump")
    assert (res.reward, res.terminated, res.info["valid"]) == (0.0, False, False)
    assert "Valid actions: left, right, up, down" in res.obs.text
    assert res.info["position"] == [0, 0]
    res = env.step("up")  # the edge: stays put, still a valid move
    assert res.info == {"valid": True, "moved": "up", "slipped": False, "position": [0, 0]}
    assert "bumped into the edge" in res.obs.text
    assert env.step("  RIGHT \n").info["position"] == [0, 1]  # case and whitespace ignored


def test_frozenlake_episode_is_truncated_at_max_steps():
    env = envpool.make("frozenlake-v1")
    env.reset(seed=0)
    results = [env.step("up") for _ in range(env.spec.max_episode_steps)]
    assert not any(r.truncated for r in results[:-1])
    assert results[-1].truncated and not results[-1].terminated


def test_frozenlake_slippery_is_reproducible_from_the_seed():
    def play() -> list[tuple[str, list[int]]]:
        env = envpool.make("frozenlake-v1", slippery=True)
        env.reset(seed=3)
        out = []
        for move in ["right", "down"] * 10:
            res = env.step(move)
            out.append((res.info["moved"], res.info["position"]))
            if res.done:
                break
        return out

    first = play()
    assert play() == first
    assert any(moved not in ("right", "down") for moved, _ in first)  # it did slip


def test_frozenlake_size_and_fixed_map():
    env = envpool.make("frozenlake-v1", size=7)
    _, info = env.reset(seed=11)
    assert len(info["map"]) == 7 and all(len(r) == 7 for r in info["map"])
    assert info["map"][0][0] == "S" and info["map"][-1][-1] == "G"
    fixed = envpool.make("frozenlake-v1", desc=["SH", "FG"])
    assert fixed.reset(seed=1)[1]["map"] == ["SH", "FG"]
    assert fixed.step("right").terminated
    with pytest.raises(ValueError, match="size"):
        FrozenLakeEnv(size=1)
    with pytest.raises(ValueError, match="desc"):
        FrozenLakeEnv(desc=["SX", "FG"])


# ----------------------------------------------------------------------------- math tools


def test_math_seeded_problem_and_correct_answer():
    env = envpool.make("math-tools-v1")
    obs, info = env.reset(seed=0)
    assert "boxes of 19" in obs.text and "579 cookies" in obs.text  # 579 // 19 == 30
    assert (
        obs.tools == [OPENAI_SCHEMA]
        and info["tools"] == ["calculator"]
        and set(info["task"]) == {"question", "answer"}
    )
    assert env.reset(seed=0)[0] == obs
    res = env.step("579 // 19 is 30, so\nAnswer: 30")
    assert (res.reward, res.terminated) == (1.0, True)
    assert res.info["correct"] is True


def test_math_tool_call_through_the_inprocess_caller():
    env = envpool.make("math-tools-v1")
    env.reset(seed=0)
    res = env.step('{"tool": "calculator", "arguments": {"expression": "579 // 19"}}')
    assert (res.obs.text, res.reward, res.terminated) == ("30", 0.0, False)
    assert res.obs.tools == [OPENAI_SCHEMA]
    # OpenAI's shape: "name", and arguments as a JSON string; a fenced block is fine too
    res = env.step('```json\n{"name": "calculator", "arguments": "{\\"expression\\": \\"2 ** 10\\"}"}\n```')
    assert res.obs.text == "1024"
    assert res.info == {"tool": "calculator", "tool_calls": 2, "valid": True}
    res = env.step('{"tool": "calculator", "arguments": {"expression": "1 / 0"}}')
    assert res.obs.text == "error: ValueError: division by zero" and not res.terminated
    assert res.info["valid"] is False and res.info["outcome"] == "tool_error"


def test_math_tool_calls_go_through_the_bridge():
    calls: list[tuple[str, dict[str, Any]]] = []

    def bridge(name: str, arguments: dict[str, Any]) -> str:
        calls.append((name, arguments))
        return "99"

    env = envpool.make("math-tools-v1", tool_caller=bridge)
    env.reset(seed=0)
    assert env.step('{"tool": "calculator", "arguments": {"expression": "1 + 1"}}').obs.text == "99"
    assert calls == [("calculator", {"expression": "1 + 1"})]


@pytest.mark.parametrize(
    ("action", "reward"),
    [
        ("\\boxed{42}", 1.0),
        ("The answer is 42.", 1.0),
        ("Answer: 42.0", 1.0),
        ("Answer: 41", 0.0),
        # as the math_answer reward reads them (the env said 0, and ran on after the last two)
        ("Answer: 42 trees", 1.0),
        ("My final answer: 42", 1.0),
        ("42", 1.0),
        ("  43 ", 0.0),
    ],
)
def test_math_final_answer(action, reward):
    env = envpool.make("math-tools-v1")
    env.reset(options={"question": "What is 6 * 7?", "answer": "42"})
    res = env.step(action)
    assert (res.reward, res.terminated) == (reward, True)
    assert res.info.get("outcome") == ("success" if reward else None)


@pytest.mark.parametrize(
    ("action", "says"),
    [
        ("let me think", "No tool call or final answer"),
        ('{"tool": "calculator", "arguments": ', "Bad tool call: invalid JSON"),
        ('{"tool": "python", "arguments": {"code": "1"}}', "unknown tool 'python'"),
        ('{"tool": "calculator", "arguments": {"expr": "1"}}', 'takes {"expression"'),
        ("[1, 2]", "No tool call or final answer"),
        # a number in a step is not a stated answer (the reward's last-number rule would read 5)
        ("6 * 7 is 42; next I add 5", "No tool call or final answer"),
    ],
)
def test_math_other_actions_get_a_reminder(action, says):
    env = envpool.make("math-tools-v1")
    env.reset(seed=1)
    res = env.step(action)
    assert says in res.obs.text
    assert (res.reward, res.terminated) == (0.0, False)
    # the schedulers' signal: neither a tool call nor an answer is a tool error
    assert res.info == {"valid": False, "outcome": "tool_error"}


@pytest.mark.parametrize("template", ["Answer: {} trees", "My final answer: {}", "{}", "so \\boxed{{{}}}."])
def test_math_env_reward_agrees_with_the_math_answer_reward(template):
    from functions.rewards.math import math_answer

    env = envpool.make("math-tools-v1")
    for seed in range(5):
        _, info = env.reset(seed=seed)
        answer = info["task"]["answer"]
        for given in (answer, str(int(answer) + 1)):
            reply = template.format(given)
            env.reset(seed=seed)
            res = env.step(reply)
            assert res.terminated and res.reward == math_answer(reply, ground_truth=answer).score, reply


def test_math_problems_have_positive_integer_answers():
    env = envpool.make("math-tools-v1")
    answers = set()
    for seed in range(100):
        env.reset(seed=seed)
        answers.add(env.env.answer)
        assert env.env.answer.isdigit() and int(env.env.answer) > 0
    assert len(answers) > 50


# ----------------------------------------------------------------------------- code repair


@pytest.fixture
def repair():
    env = envpool.make("code-repair-v1")
    yield env
    env.close()


def test_code_repair_view(repair):
    obs, info = repair.reset(options={"task": "mathutils"})
    assert info == {"task": "mathutils", "files": ["README.md", "mathutils.py", "test_mathutils.py"]}
    assert "view <file>" in obs.text and "mathutils.py" in obs.text
    res = repair.step("view mathutils.py")
    assert "   6 |     return a - b" in res.obs.text
    assert (res.reward, res.terminated, res.info) == (0.0, False, {"valid": True})
    res = repair.step("view nope.py")
    assert "No such file 'nope.py'" in res.obs.text and res.info == {"valid": False}


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_code_repair_fix_run_tests_and_submit(repair, task):
    repair.reset(options={"task": task.name})
    res = repair.step("run_tests")
    assert res.info["failed"] > 0 and not res.info["all_passed"]
    assert res.info["outcome"] == "test_failure"  # the schedulers' signal
    for file, search, replace in task.fix:
        res = repair.step(edit_action(file, search, replace))
        assert "block(s) applied" in res.obs.text and res.info == {"valid": True}
    res = repair.step("run_tests")
    assert res.info == {"passed": task.n_tests, "failed": 0, "all_passed": True, "outcome": "success"}
    assert res.obs.text.startswith(f"Tests: {task.n_tests} passed, 0 failed.")
    res = repair.step("submit")
    assert (res.reward, res.terminated) == (1.0, True)


def test_code_repair_submit_unfixed_scores_zero(repair):
    repair.reset(options={"task": "stats"})
    res = repair.step("submit")
    assert (res.reward, res.terminated) == (0.0, True)
    assert res.info == {"passed": 2, "failed": 2, "all_passed": False, "outcome": "test_failure"}


@pytest.mark.parametrize(
    "action",
    [
        "view ../outside.txt",
        "view /etc/passwd",
        "view sub/../../outside.txt",
        edit_action("../outside.txt", "secret", "changed"),
        edit_action("/tmp/outside.txt", "secret", "changed"),
    ],
)
def test_code_repair_refuses_paths_outside_the_work_dir(repair, action):
    repair.reset(options={"task": "mathutils"})
    outside = repair.env.workdir.parent / "outside.txt"
    res = repair.step(action)
    assert res.obs.text.startswith("Refused") and res.info == {"valid": False}
    assert not outside.exists() or "changed" not in outside.read_text()


def test_code_repair_refuses_a_symlink_out(repair, tmp_path):
    repair.reset(options={"task": "mathutils"})
    secret = tmp_path / "secret.txt"
    secret.write_text("secret\n")
    (repair.env.workdir / "link.txt").symlink_to(secret)
    assert "points outside" in repair.step("view link.txt").obs.text
    assert "points outside" in repair.step(edit_action("link.txt", "secret", "x")).obs.text
    assert secret.read_text() == "secret\n"


@pytest.mark.parametrize(
    "action",
    [
        "view " + "a" * 300,
        "view " + "a/" * 3000,
        edit_action("b" * 300, "x", "y"),
    ],
)
def test_code_repair_answers_a_name_the_file_system_refuses(repair, action):
    # over NAME_MAX / PATH_MAX: an OSError raised from step would mask the episode as an
    # infra failure (and its message shows the work dir); it is the policy's bad name
    repair.reset(options={"task": "mathutils"})
    res = repair.step(action)
    assert res.obs.text.startswith("No such file") and (res.reward, res.terminated) == (0.0, False)
    assert res.info == {"valid": False}
    assert str(repair.env.workdir) not in res.obs.text


def test_code_repair_answers_a_file_it_cannot_read(repair, monkeypatch):
    # the policy's code may chmod its module to 0; the OS's refusal is played here (it was a
    # chmod, skipped as root, which reads a mode-0 file all the same: always skipped in CI)
    repair.reset(options={"task": "mathutils"})
    module = repair.env.workdir / "mathutils.py"
    read_text = Path.read_text

    def refused(self: Path, *args, **kwargs) -> str:
        if self == module:
            raise PermissionError(13, "Permission denied", str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refused)
    res = repair.step("view mathutils.py")
    assert "cannot be read (Permission denied)" in res.obs.text and res.info["valid"] is False
    res = repair.step(edit_action("mathutils.py", "a - b", "a + b"))
    assert "cannot be read (Permission denied)" in res.obs.text and res.info["valid"] is False


def test_code_repair_refuses_to_edit_a_module_that_is_not_text(repair):
    # the policy's code can write any bytes
    repair.reset(options={"task": "mathutils"})
    (repair.env.workdir / "mathutils.py").write_bytes(b"\xff\xfe def add(a, b): return a - b\n")
    res = repair.step(edit_action("mathutils.py", "a - b", "a + b"))
    assert "cannot be read (it is not UTF-8 text)" in res.obs.text and res.info["valid"] is False


def test_code_repair_tests_are_read_only(repair):
    repair.reset(options={"task": "mathutils"})
    res = repair.step(edit_action("test_mathutils.py", "assert got == 5", "assert True"))
    assert "read-only" in res.obs.text
    # code that rewrites the tests on disk does not help either: they are restored per run
    (repair.env.workdir / "test_mathutils.py").write_text("def test_add():\n    pass\n")
    res = repair.step("run_tests")
    assert res.info["failed"] == 2


@pytest.mark.parametrize(
    ("blocks", "says"),
    [
        ("<<<<<<< SEARCH\nreturn a * b\n=======\nx\n>>>>>>> REPLACE", "was not found"),
        ("<<<<<<< SEARCH\n    return\n=======\nx\n>>>>>>> REPLACE", "found 2 times"),
        ("<<<<<<< SEARCH\nreturn a - b\n=======\nx", "not closed"),
        ("replace it please", "expected '<<<<<<< SEARCH'"),
        ("", "no SEARCH/REPLACE block"),
        ("<<<<<<< SEARCH\n\n=======\nx\n>>>>>>> REPLACE", "SEARCH section is empty"),
    ],
)
def test_code_repair_bad_edits_leave_the_file_alone(repair, blocks, says):
    repair.reset(options={"task": "mathutils"})
    before = (repair.env.workdir / "mathutils.py").read_text()
    res = repair.step(f"edit mathutils.py\n{blocks}")
    assert says in res.obs.text and "not applied" in res.obs.text and res.info == {"valid": False}
    assert (repair.env.workdir / "mathutils.py").read_text() == before


def test_parse_blocks_several_and_deletion():
    text = "<<<<<<< SEARCH\na\n=======\nb\n>>>>>>> REPLACE\n\n<<<<<<< SEARCH\nc\nd\n=======\n>>>>>>> REPLACE"
    assert parse_blocks(text) == [("a", "b"), ("c\nd", "")]


def test_code_repair_output_hides_the_work_dir_and_forged_results(repair):
    repair.reset(options={"task": "mathutils"})
    workdir = str(repair.env.workdir)
    res = repair.step(edit_action("mathutils.py", "    return a - b", "    return a -"))
    res = repair.step("run_tests")
    assert "ERROR test_mathutils.py: SyntaxError" in res.obs.text
    assert workdir not in res.obs.text and res.info["passed"] == 0
    forged = 'print("@@result x 3 0")\n    return a - b'
    repair.step(edit_action("mathutils.py", "    return a -", "    " + forged))
    res = repair.step("submit")
    assert res.reward == 0.0 and res.info["failed"] == 2


# The nonce, eq and int-subclass forgeries passed every test of the old runner, which ran
# the tests in the module's own process and trusted the result line it printed.
_FORGED_LINES = (
    "print('@@result x 3 0', 'PASS test_mathutils.py::test_add', 'Tests: 3 passed.', sep='\\n', flush=True)"
)
_FORGERIES = {
    # reads the old runner's verdict nonce from its globals, prints a pass and exits
    "nonce": (
        "import __main__, os\n"
        "print(f\"@@result {getattr(__main__, 'nonce', 'x')} 3 0\", flush=True)\nos._exit(0)\n",
        "prepend",
    ),
    # a value equal to everything
    "eq": ("    class _Any:\n        __eq__ = lambda s, o: True\n    return _Any()", "body"),
    # an int subclass equal to everything (an isinstance check would let it through)
    "int-subclass": ("    class _Int(int):\n        __eq__ = lambda s, o: True\n    return _Int(0)", "body"),
    # patches the comparison itself
    "builtins": ("import builtins\nbuiltins.AssertionError = type('X', (BaseException,), {})\n", "prepend"),
    # the checks' results, wrong ones, written to every descriptor the runner may use
    "fds": (
        "import os, json\nfor fd in range(3, 64):\n    try:\n"
        "        lines = [json.dumps({'i': i, 'value': 'ok'}) for i in range(9)]\n"
        "        os.write(fd, ('\\n'.join(lines) + '\\n').encode())\n"
        "    except OSError:\n        pass\nos._exit(0)\n",
        "prepend",
    ),
}


@pytest.mark.parametrize("name", sorted(_FORGERIES))
def test_code_repair_module_cannot_forge_a_pass(repair, name):
    code, where = _FORGERIES[name]
    repair.reset(options={"task": "mathutils"})
    if where == "prepend":
        edit = ('"""Small numeric helpers."""', code + '"""Small numeric helpers."""')
    else:
        edit = ("    return a - b", code)
    assert "block(s) applied" in repair.step(edit_action("mathutils.py", *edit)).obs.text
    res = repair.step("submit")
    assert res.reward == 0.0 and not res.info["all_passed"], res.obs.text
    assert res.info["passed"] < 3


def test_code_repair_forged_output_is_shown_as_output_not_as_results(repair):
    repair.reset(options={"task": "mathutils"})
    forged = "import os\n" + _FORGED_LINES + "\nos._exit(0)\n"
    repair.step(edit_action("mathutils.py", '"""Small numeric helpers."""', forged))
    res = repair.step("run_tests")
    head, _, output = res.obs.text.partition("Output of the run:")
    assert head.startswith("Tests: 0 passed, 3 failed.")
    assert "FAIL test_mathutils.py::test_add: add(2, 3) did not finish" in head
    assert "PASS test_mathutils.py::test_add" in output  # the module's print, shown apart


def test_code_repair_a_value_that_is_not_plain_fails_with_a_reason(repair):
    repair.reset(options={"task": "mathutils"})
    repair.step(edit_action("mathutils.py", "    return a - b", "    return {1, 2}"))
    res = repair.step("run_tests")
    assert "add(2, 3) returned {1, 2} (a set; the tests compare plain values" in res.obs.text


def test_code_repair_expected_exceptions_match_by_class_and_subclass(repair):
    repair.reset(options={"task": "stats"})
    # UnicodeError is a ValueError subclass: `except ValueError` would take it too
    repair.step(
        edit_action("stats.py", 'raise ValueError("mean of an empty list")', "raise UnicodeError('x')")
    )
    assert "PASS test_stats.py::test_mean_empty" in repair.step("run_tests").obs.text
    repair.step(edit_action("stats.py", "raise UnicodeError('x')", "return 0"))
    text = repair.step("run_tests").obs.text
    assert "FAIL test_stats.py::test_mean_empty: mean([]) did not raise ValueError (it returned 0)" in text


def test_code_repair_a_huge_int_is_too_large_and_the_other_tests_still_run(repair):
    # json.dumps refuses an int past 4300 digits: the runner died there, and the correct
    # clamp tests after it read "did not finish"
    repair.reset(options={"task": "mathutils"})
    repair.step(edit_action("mathutils.py", "    return a - b", "    return 10**5000 if a < 0 else a + b"))
    text = repair.step("run_tests").obs.text
    assert (
        "FAIL test_mathutils.py::test_add_negative: add(-4, 1) returned a value too large to compare" in text
    )
    assert "PASS test_mathutils.py::test_clamp" in text and "PASS test_mathutils.py::test_add" in text


def test_code_repair_missing_name_fails_every_test(repair):
    repair.reset(options={"task": "mathutils"})
    repair.step(edit_action("mathutils.py", "def add(a, b):", "def plus(a, b):"))
    res = repair.step("run_tests")
    assert res.info["passed"] == 0 and res.info["failed"] == 3
    assert "ERROR test_mathutils.py: ImportError: cannot import name 'add' from 'mathutils'" in res.obs.text


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_code_repair_rendered_tests_agree_with_the_judge(task, tmp_path):
    """The test file the policy reads, run as plain Python, fails and passes the same tests
    as the judge does, before and after the fix."""
    for fixed in (False, True):
        source = task.source
        if fixed:
            for _, search, replace in task.fix:
                source = source.replace(search, replace, 1)
        (tmp_path / task.module).write_text(source)
        (tmp_path / task.test_file).write_text(task.files[task.test_file])
        script = (
            f"import {task.test_file[:-3]} as t\n"
            f"for name in {[x.name for x in task.tests]!r}:\n"
            "    try:\n        getattr(t, name)()\n    except BaseException:\n        print('FAIL', name)\n"
            "    else:\n        print('PASS', name)\n"
        )
        run = subprocess.run(
            [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True
        )
        env = envpool.make("code-repair-v1")
        try:
            env.reset(options={"task": task.name})
            (env.env.workdir / task.module).write_text(source)
            judged = env.step("run_tests").obs.text
        finally:
            env.close()
        for line in run.stdout.splitlines():
            verdict, name = line.split()
            assert f"{verdict} {task.test_file}::{name}" in judged, (fixed, line, judged)
        assert (f"Tests: {task.n_tests} passed" in judged) == fixed


def test_code_repair_test_timeout():
    env = envpool.make("code-repair-v1", test_timeout_s=0.5)
    try:
        env.reset(options={"task": "mathutils"})
        env.step(edit_action("mathutils.py", "    return a - b", "    while True:\n        pass"))
        res = env.step("run_tests")
        assert "The test run timed out after 0.5 s" in res.obs.text
        assert res.info == {"passed": 0, "failed": 3, "all_passed": False, "outcome": "timeout"}
        assert env.step("submit").reward == 0.0
    finally:
        env.close()


def _running_in(root: Path) -> list[int]:
    """Processes whose working directory is under ``root`` (a test run in a work dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cwd = Path(os.readlink(entry / "cwd"))
            except OSError:  # gone, or a zombie
                continue
            if cwd.is_relative_to(root):
                found.append(int(entry.name))
    return found


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _repair_in(tmp_path: Path, test_timeout_s: float):
    """A code-repair env on the mathutils task whose work dirs are under ``tmp_path/work``
    (what runs there is found by its cwd), and every process left there killed at the end."""
    work = tmp_path / "work"
    work.mkdir()
    env = envpool.make("code-repair-v1", test_timeout_s=test_timeout_s, workdir_root=str(work))
    try:
        env.reset(options={"task": "mathutils"})
        yield env, work
    finally:
        _kill_all(_running_in(work))
        env.close()


def _none_left_in(work: Path, within_s: float) -> bool:
    """Whether no process runs in ``work`` within ``within_s`` (a SIGKILL lands when each
    is next scheduled)."""
    deadline = time.monotonic() + within_s
    while _running_in(work) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _running_in(work)


LOOP = "    while True:\n        pass"
# a test run that starts a helper process of its own, then loops
SPAWN_AND_LOOP = '    import subprocess\n    subprocess.Popen(["sleep", "60"])\n' + LOOP


def test_code_repair_test_timeout_kills_what_the_run_started(tmp_path):
    with _repair_in(tmp_path, 0.5) as (env, work):
        env.step(edit_action("mathutils.py", "    return a - b", SPAWN_AND_LOOP))
        res = env.step("run_tests")
        assert "The test run timed out after 0.5 s" in res.obs.text
        assert _none_left_in(work, 2)  # the runner and the helper it started


# the fix, plus helpers the module starts at import and leaves behind: a child that sleeps, and
# a daemon (a child that forks a sleeper and exits, so the sleeper's parent is gone)
FIX_AND_FORKS = (
    "    return a + b\n"
    "import os, time\n"
    "if os.fork() == 0:\n"
    "    time.sleep(60)\n"
    "    os._exit(0)\n"
    "if os.fork() == 0:\n"
    "    if os.fork() == 0:\n"
    "        time.sleep(60)\n"
    "    os._exit(0)"
)


@pytest.mark.parametrize("early_exit", [False, True])
def test_code_repair_a_run_that_ends_takes_what_it_started_with_it(tmp_path, early_exit):
    # the runner returned normally and its module's forked helpers, reparented to pid 1, ran
    # on for good: only a timeout killed the tree. Now the runner stays alive past its
    # results, a subreaper, and its parent kills it with all it started
    with _repair_in(tmp_path, 10) as (env, work):
        body = FIX_AND_FORKS + ("\nos.close(int(sys.argv[3]))" if early_exit else "")
        if early_exit:  # the module closes the done pipe: the runner's end must still be seen
            body = "import sys\n" + body.replace("    return a + b\n", "", 1)
            env.step(edit_action("mathutils.py", "    return a - b", "    return a + b"))
            env.step(edit_action("mathutils.py", "def add", body + "\ndef add"))
        else:
            env.step(edit_action("mathutils.py", "    return a - b", FIX_AND_FORKS))
        t0 = time.monotonic()
        res = env.step("run_tests")
        assert time.monotonic() - t0 < 8  # ended by the runner, not at the timeout
        assert res.info["all_passed"] and res.info["failed"] == 0, res.obs.text
        assert "timed out" not in res.obs.text
        assert _none_left_in(work, 3)  # the sleeper and the daemon's child too (they sleep 60 s)


def test_code_repair_a_runner_that_ends_after_its_done_byte_is_swept(tmp_path, monkeypatch):
    # the runner's wait on its parent can be cut short by the module (it puts /dev/null where
    # the runner waits): the runner wrote its done byte, then ended by itself; its parent,
    # scheduled after that end (slowed here), took the run for one that waited, killed the
    # runner's tree (empty: its daemon had left it) and never swept the work dir
    from envpool.envs import code_repair

    kill_tree = code_repair.kill_tree

    def late_kill_tree(pid: int) -> None:
        time.sleep(0.5)
        kill_tree(pid)

    monkeypatch.setattr(code_repair, "kill_tree", late_kill_tree)
    with _repair_in(tmp_path, 10) as (env, work):
        cut = "import __main__\nos.dup2(os.open(os.devnull, os.O_RDONLY), __main__.stdin_fd)"
        env.step(edit_action("mathutils.py", "    return a - b", FIX_AND_FORKS + "\n" + cut))
        res = env.step("run_tests")
        assert res.info["all_passed"], res.obs.text
        assert _none_left_in(work, 3)


@pytest.mark.parametrize("reader", ["module", "helper"])
def test_code_repair_a_module_that_reads_stdin_reads_nothing(tmp_path, reader):
    # the runner kept its stdin (the pipe its parent fed the spec on) open past the spec, to
    # wait on it once done: a module (or a helper it ran) that read stdin, which found it at
    # its end when the parent closed it after the spec, then blocked until test_timeout_s
    # and the run read "timed out"
    with _repair_in(tmp_path, 5) as (env, _):
        if reader == "module":
            read = "import sys\n_ = sys.stdin.read()"
        else:
            read = 'import subprocess\nsubprocess.run(["cat"], stdout=subprocess.DEVNULL)'
        env.step(edit_action("mathutils.py", "    return a - b", "    return a + b\n" + read))
        t0 = time.monotonic()
        res = env.step("run_tests")
        assert time.monotonic() - t0 < 4
        assert res.info["all_passed"], res.obs.text


@pytest.mark.parametrize("how", ["aborted", "leader_killed"])
async def test_a_test_run_dies_with_its_container(tmp_path, how):
    # the runner had a session of its own: killing the container's process group (an aborted
    # trajectory, EnvHung, a recycle) missed it, and a policy's infinite loop ran on outside
    # every container until test_timeout_s, or forever once its env was gone
    work = tmp_path / "work"
    work.mkdir()
    kwargs = {"workdir_root": str(work), "test_timeout_s": 30}
    runtime = {"heartbeat_s": 0.1, "zygote": how == "aborted"}
    try:
        async with EnvPool({"min_warm": 0, "runtime": runtime}) as p:
            started = asyncio.Event()
            pids: list[int] = []

            async def rollout() -> None:
                async with p.session("code-repair-v1", env_kwargs=kwargs) as s:
                    await s.reset(seed=0, options={"task": "mathutils"})
                    await s.step(edit_action("mathutils.py", "    return a - b", LOOP))
                    pids.append(s.container.pid)
                    started.set()
                    await s.step("run_tests")

            t = asyncio.create_task(rollout())
            await started.wait()
            await wait_for(lambda: bool(_running_in(work)))  # the test run is going
            if how == "aborted":
                t.cancel()  # the trajectory is aborted: its container is killed
            else:
                # the server alone is killed (the OOM killer): its test run goes with it
                os.kill(pids[0], signal.SIGKILL)
            await wait_for(lambda: not _running_in(work), 3.0)
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
    finally:
        _kill_all(_running_in(work))


def test_code_repair_dirs_are_removed(repair):
    repair.reset(seed=1)
    first = repair.env.workdir
    assert first.is_dir()
    repair.reset(seed=2)
    second = repair.env.workdir
    assert not first.exists() and second.is_dir()
    repair.close()
    repair.close()
    assert not second.exists()


def test_code_repair_seed_picks_the_task():
    env = envpool.make("code-repair-v1")
    try:
        names = [env.reset(seed=s)[1]["task"] for s in range(12)]
        assert names == [env.reset(seed=s)[1]["task"] for s in range(12)]
        assert set(names) == {t.name for t in TASKS}
        with pytest.raises(ValueError, match="unknown task"):
            env.reset(options={"task": "nope"})
    finally:
        env.close()


def test_code_repair_unknown_action(repair):
    repair.reset(seed=0)
    res = repair.step("rm -rf /")
    assert "Unknown action 'rm -rf /'" in res.obs.text and "run_tests" in res.obs.text
    assert res.info == {"valid": False}


# ----------------------------------------------------------------------------- check_env


def test_builtins_are_registered():
    builtins = {"frozenlake-v1", "math-tools-v1", "code-repair-v1"}
    assert builtins <= set(envpool.default_registry.ids())


def test_make_finds_the_builtins_without_importing_envpool_envs_first():
    # a fresh interpreter, where nothing imported envpool.envs: make once answered
    # "unknown environment 'frozenlake-v1'; registered: (none)"
    code = "import envpool; print(envpool.make('frozenlake-v1').spec.id, *envpool.default_registry.ids())"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    made, *ids = out.stdout.split()
    # every built-in (this process's registry may hold more: other tests' user modules)
    builtins = [
        i
        for i in envpool.default_registry.ids()
        if envpool.default_registry.spec(i).entry_point.startswith("envpool.envs.")
    ]
    assert made == "frozenlake-v1" and sorted(ids) == sorted(builtins) and len(builtins) >= 5
    # a registry of one's own stays as registered: nothing is added behind its back
    assert EnvRegistry().ids() == []


@pytest.mark.parametrize("env_id", envpool.default_registry.ids())
def test_registered_env_conforms(env_id):
    check_env(env_id)


class NoisyEnv(envpool.Env):
    """Everything wrong that a well-behaved wrapper cannot fix."""

    example_actions: ClassVar[tuple[str, ...]] = ("go",)

    def __init__(self) -> None:
        self.closed = False

    def reset(self, *, seed=None, options=None):
        return f"it is {time.perf_counter_ns()}", {"handle": object()}

    def step(self, action: str) -> StepResult:
        return StepResult(obs=Observation(text="ok"), reward=math.nan)

    def close(self) -> None:
        if self.closed:
            raise RuntimeError("already closed")
        self.closed = True


class EndlessEnv(envpool.Env):
    example_actions: ClassVar[tuple[str, ...]] = ("wait",)

    def reset(self, *, seed=None, options=None):
        return "waiting", {}

    def step(self, action: str) -> StepResult:
        return StepResult(obs=Observation(text="still waiting"), info={"score": math.inf})


class SilentEnv(EndlessEnv):
    example_actions: ClassVar[tuple[str, ...]] = ()


class BadResetEnv(EndlessEnv):
    def reset(self, *, seed=None, options=None):
        return 42, {}


_instances = count()


class DriftingEnv(EndlessEnv):
    """Deterministic per instance, but each new instance plays differently."""

    def __init__(self) -> None:
        self.n = next(_instances)

    def step(self, action: str) -> StepResult:
        return StepResult(obs=Observation(text=f"instance {self.n}"), terminated=True)


class UnguardedEnv:
    """A registry that forgets the rules of ``make``: check_env must notice."""

    def __init__(self, env: envpool.Env, spec: envpool.EnvSpec):
        self.env, self.spec = env, spec

    def reset(self, *, seed=None, options=None):
        obs, info = self.env.reset(seed=seed, options=options)
        return as_observation(obs), info

    def step(self, action: Any) -> StepResult:
        text = action.decode("utf-8", "replace") if isinstance(action, bytes) else action
        return self.env.step(text)

    def close(self) -> None:
        self.env.close()


class LaxRegistry(EnvRegistry):
    def make(self, id: str, **kwargs: Any) -> Any:
        guarded = super().make(id, **kwargs)
        return UnguardedEnv(guarded.env, guarded.spec)


def broken_registry(cls: type, registry: EnvRegistry | None = None, **options: Any) -> EnvRegistry:
    reg = registry or EnvRegistry()
    reg.register("broken-v0", entry_point=f"{__name__}:{cls.__name__}", **options)
    return reg


def problems_of(reg: EnvRegistry) -> str:
    with pytest.raises(EnvConformanceError) as e:
        check_env("broken-v0", reg)
    return str(e.value)


def test_check_env_reports_every_problem():
    report = problems_of(broken_registry(NoisyEnv, max_episode_steps=5))
    assert "reset() info is not JSON-serialisable" in report
    assert "twice gave different observations" in report
    assert "step('go') raised ValueError" in report and "non-finite" in report
    # make() closes an env once, whatever its close() does on a second call
    assert "close() call 2" not in report


def test_check_env_reports_an_endless_episode_and_non_json_numbers():
    report = problems_of(broken_registry(EndlessEnv))
    assert "did not end within 1000 steps (the spec sets no max_episode_steps)" in report
    assert "contains NaN or Infinity" in report


def test_check_env_reports_missing_examples_and_bad_resets():
    assert "example_actions must be a non-empty" in problems_of(broken_registry(SilentEnv))
    assert "reset(seed=1234) raised TypeError" in problems_of(broken_registry(BadResetEnv))


def test_check_env_reports_a_replay_that_differs():
    report = problems_of(broken_registry(DriftingEnv))
    assert "a fresh instance replaying seed 1234" in report and "differs at step 1" in report
    check_env("broken-v0", broken_registry(DriftingEnv, deterministic=False))  # honest flag: fine


def test_check_env_reports_a_registry_that_skips_the_rules():
    report = problems_of(broken_registry(DriftingEnv, LaxRegistry(), deterministic=False))
    assert "step() before reset() did not raise EnvOrderError" in report
    assert "a non-UTF-8 action was accepted" in report
    assert "an oversized action was accepted" in report
    assert "step() after the episode ended did not raise EnvOrderError" in report


def test_documented_example_runs(tmp_path):
    doc = (REPO / "docs" / "envpool-new-env.md").read_text()
    code = re.search(r"```python\n(# guess_env\.py\n.*?)```", doc, re.DOTALL)
    assert code is not None
    (tmp_path / "guess_env.py").write_text(code.group(1))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "guess_env.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    expected = re.search(r"prints:\n\n```text\n(.*?)```", doc, re.DOTALL)
    assert expected is not None and out.stdout == expected.group(1)


def test_docs_pool_example_runs_the_same_episode_in_a_container(tmp_path):
    doc = (REPO / "docs" / "envpool-new-env.md").read_text()
    for name in ("guess_env.py", "run_in_pool.py"):
        code = re.search(rf"```python\n(# {re.escape(name)}[^\n]*\n.*?)```", doc, re.DOTALL)
        assert code is not None, name
        (tmp_path / name).write_text(code.group(1))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "run_in_pool.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("I picked a number from 1 to 100. Guess it. | 50: go lower. | container ")


def test_check_env_catches_a_second_close_that_raises_when_nothing_guards_it():
    report = problems_of(broken_registry(NoisyEnv, LaxRegistry(), max_episode_steps=5))
    assert "close() call 2 raised RuntimeError" in report
