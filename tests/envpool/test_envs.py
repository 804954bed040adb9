"""The built-in environments, the calculator tool and the ``check_env`` conformance checker."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from itertools import count
from pathlib import Path
from typing import Any, ClassVar

import pytest

import envpool
import envpool.envs  # registers the built-ins
from envpool.api import EnvRegistry, Observation, StepResult, as_observation
from envpool.envs.frozenlake import FrozenLakeEnv
from envpool.errors import EnvOrderError
from envpool.testing import EnvConformanceError, check_env
from fabric.registry import Registry
from functions.tools.calculator import MAX_INT_BITS, OPENAI_SCHEMA, calculator

REPO = Path(__file__).resolve().parents[2]


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
    # the call as the env ran it, for the rewards (core.rollout.tool_calls)
    calls = [{"name": "calculator", "arguments": '{"expression": "2 ** 10"}', "output": "1024"}]
    assert res.info == {"tool": "calculator", "tool_calls": 2, "valid": True, "calls": calls}
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
    # a refused tool call is reported for the rewards, with why; a reply that is none is not
    calls = res.info.pop("calls", [])
    refused = not says.startswith("No tool call")
    assert [c["refused"] in res.obs.text for c in calls] == ([True] if refused else [])
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


def test_a_closed_environment_refuses_a_reset_too():
    # close() promised "a closed environment takes no more steps", but a reset() went to the
    # user's closed environment (its files and subprocesses gone) and reopened the episode
    env = envpool.make("echo-v0")
    env.reset(seed=1)
    env.close()
    with pytest.raises(EnvOrderError, match="closed"):
        env.reset(seed=2)
    with pytest.raises(EnvOrderError):
        env.step("hello")
    env.close()  # still idempotent


class PairlessResetEnv(EndlessEnv):
    def __init__(self, shape: Any = "hi") -> None:
        self.shape = shape

    def reset(self, *, seed=None, options=None):
        return self.shape


@pytest.mark.parametrize("shape", ["hi", "ready", ("ready", None), ("ready", ["seed", 1])])
def test_a_reset_that_is_not_an_observation_and_an_info_dict_says_so(shape):
    # a bare two-letter string unpacked into obs "h" and info "i", then dict("i") raised
    # "dictionary update sequence element #0 has length 1"; (obs, None): "NoneType is not iterable"
    env = broken_registry(PairlessResetEnv).make("broken-v0", shape=shape)
    with pytest.raises(TypeError, match=r"broken-v0: reset\(\) must return \(observation, info dict\)"):
        env.reset(seed=1)


class MutatedResultEnv(EndlessEnv):
    """Builds a valid result, then sets a field of the wrong type (no validation on assignment)."""

    def step(self, action: str) -> StepResult:
        res = StepResult(obs=Observation(text="ok"))
        if action == "obs":
            res.obs = "plain text"  # type: ignore[assignment]
        elif action == "text":
            res.obs.text = 7  # type: ignore[assignment]
        elif action == "flag":
            res.terminated = "no"  # type: ignore[assignment]
        return res


@pytest.mark.parametrize("action", ["obs", "text"])
def test_a_result_of_the_wrong_types_is_the_environments_error_where_it_ran(action):
    # it passed make()'s checks (an instance was never validated again) and failed on the
    # pool's side as a raw ValidationError, after the container had run the step
    env = broken_registry(MutatedResultEnv).make("broken-v0")
    env.reset(seed=1)
    with pytest.raises(ValueError, match="obs"):
        env.step(action)


def test_a_result_flag_of_the_wrong_type_reads_the_same_on_both_sides():
    # terminated="no": the server's done was the truthy string (the episode over, the next
    # step refused), the pool's the parsed False (the episode going on)
    env = broken_registry(MutatedResultEnv).make("broken-v0")
    env.reset(seed=1)
    res = env.step("flag")
    assert res.terminated is False and res.done is False
    assert StepResult.model_validate(res.model_dump()).done is res.done
    assert env.step("again").obs.text == "ok"  # not "step() after the episode ended"


class MutatedObservationEnv(EndlessEnv):
    def reset(self, *, seed=None, options=None):
        obs = Observation(text="ready")
        obs.text = 7  # type: ignore[assignment]
        return obs, {}


def test_a_reset_observation_of_the_wrong_types_is_the_environments_error_where_it_ran():
    env = broken_registry(MutatedObservationEnv).make("broken-v0")
    with pytest.raises(ValueError, match="text"):
        env.reset(seed=1)
