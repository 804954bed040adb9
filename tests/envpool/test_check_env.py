"""The ``check_env`` conformance checker: every registered environment passes it, and what it
reports of environments that break the contract; the documented examples run."""

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
from envpool.errors import EnvOrderError
from envpool.testing import EnvConformanceError, check_env

REPO = Path(__file__).resolve().parents[2]


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


class NumpyInfoEnv(envpool.Env):
    """Infos and a reward of numpy values: the pool sends them as their values."""

    example_actions: ClassVar[tuple[str, ...]] = ("a",)

    def reset(self, *, seed=None, options=None):
        import numpy as np

        self.n = 0
        return "start", {"board": np.arange(3), "seed": np.int64(seed or 0)}

    def step(self, action: str) -> StepResult:
        import numpy as np

        self.n += 1
        info = {"n": np.int64(self.n), "probs": np.array([0.5, 0.5])}
        return StepResult(
            obs=Observation(text="x"), reward=np.float32(1.0), terminated=self.n >= 2, info=info
        )


def test_numpy_values_in_infos_conform():
    # they cross into the pool as their values (as the fabric's protocol sends them): an
    # environment that a pool runs was reported "not JSON-serialisable"
    pytest.importorskip("numpy")
    check_env("broken-v0", broken_registry(NumpyInfoEnv))
