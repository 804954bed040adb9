"""Conformance checks shipped for users' own test suites (like gymnasium's ``check_env``).

    import envpool.envs  # registers the built-ins
    from envpool.testing import check_env
    check_env("frozenlake-v1")

``check_env`` plays an environment through ``make`` and raises ``EnvConformanceError``
listing every problem it found, not just the first.
"""

from __future__ import annotations

import gc
import itertools
import os
import threading
from typing import Any

import pydantic_core
from pydantic import BaseModel

from envpool.api import EnvRegistry, EnvSpec, GuardedEnv, Observation, StepResult, default_registry
from envpool.errors import ActionError, EnvOrderError, EnvPoolError
from envpool.protocol import array_value

#: The seed the checks reset with.
CHECK_SEED = 1234
#: Steps an episode may take when its spec sets no ``max_episode_steps``.
UNBOUNDED_EPISODE_CAP = 1000
#: Episodes played after the first to look for a leak: a count of open files or threads
#: that grows with every one of them is reported (one that grows once is a cache).
LEAK_EPISODES = 3

Trace = list[tuple[Observation, float, bool, bool]]


class EnvConformanceError(EnvPoolError):
    def __init__(self, env_id: str, problems: list[str]):
        self.env_id = env_id
        self.problems = problems
        super().__init__(f"{env_id} fails conformance:\n  - " + "\n  - ".join(problems))


class _Stop(Exception):
    """A problem that leaves nothing further to check."""


def json_problem(value: Any) -> str | None:
    """Why ``value`` cannot cross a process boundary as strict JSON, or None. A numpy, torch
    or jax scalar or array can: it goes as its value (``envpool.protocol.array_value``)."""
    if isinstance(value, BaseModel):  # a model's own serializer quietly writes NaN as null
        value = value.model_dump()
    try:
        raw = pydantic_core.to_json(value, fallback=array_value)
    except (pydantic_core.PydanticSerializationError, TypeError, ValueError) as e:
        return f"not JSON-serialisable: {e}"
    if (b"NaN" in raw or b"Infinity" in raw) and raw != pydantic_core.to_json(
        value, inf_nan_mode="null", fallback=array_value
    ):
        return "contains NaN or Infinity, which JSON cannot carry"
    return None


def check_env(env_id: str, registry: EnvRegistry | None = None, *, seed: int = CHECK_SEED) -> None:
    """Raise ``EnvConformanceError`` listing every problem of a registered environment.

    Checks: the spec survives a JSON round trip; ``step`` before ``reset`` raises
    ``EnvOrderError``; ``reset`` returns ``(Observation, dict)``, JSON-safe, and (when the
    spec says ``deterministic``) the same observation for the same seed; every example
    action steps to a ``StepResult`` with a finite reward and JSON-safe info; a non-UTF-8
    and an oversized action raise ``ActionError``; an episode of example actions ends within
    ``max_episode_steps``, stepping after its end raises ``EnvOrderError``, and a fresh
    instance replays it identically when deterministic; a few more episodes do not each
    leave a file descriptor or a thread open; ``close()`` can be called twice."""
    reg = registry if registry is not None else default_registry
    spec = reg.spec(env_id)
    problems: list[str] = []
    if EnvSpec.model_validate_json(spec.model_dump_json()) != spec:
        problems.append("spec does not survive a JSON round trip")
    env = _make(reg, env_id)
    try:
        _Checker(reg, env, spec, seed, problems).run()
    except _Stop:  # a failed check the others depend on: its problem is recorded already
        pass
    finally:
        for i in (1, 2):
            try:
                env.close()
            except Exception as e:
                problems.append(f"close() call {i} raised {type(e).__name__}: {e}")
    if problems:
        raise EnvConformanceError(env_id, problems)


def _make(reg: EnvRegistry, env_id: str) -> GuardedEnv:
    try:
        return reg.make(env_id)
    except Exception as e:
        raise EnvConformanceError(env_id, [f"make() raised {type(e).__name__}: {e}"]) from e


class _Checker:
    def __init__(self, reg: EnvRegistry, env: GuardedEnv, spec: EnvSpec, seed: int, problems: list[str]):
        self.reg, self.env, self.spec, self.seed, self.problems = reg, env, spec, seed, problems
        self.actions: tuple[str, ...] = tuple(getattr(type(env.env), "example_actions", ()))

    def fail(self, msg: str) -> None:
        self.problems.append(msg)

    def run(self) -> None:
        self.check_order_before_reset()
        if not self.actions or not all(isinstance(a, str) for a in self.actions):
            self.fail("example_actions must be a non-empty tuple of str (actions valid after reset)")
            self.actions = tuple(a for a in self.actions if isinstance(a, str))
        obs = self.reset(self.env)
        if self.spec.deterministic and self.reset(self.env) != obs:
            self.fail(f"reset(seed={self.seed}) twice gave different observations, but deterministic=True")
        self.check_examples()
        self.check_bad_actions()
        if self.actions:
            trace = self.check_episode()
            if trace is not None and self.spec.deterministic:
                self.check_replay(trace)
            if trace is not None:
                self.check_leaks()

    # -- pieces
    def check_order_before_reset(self) -> None:
        try:
            self.env.step(self.actions[0] if self.actions else "")
        except EnvOrderError:
            return
        except Exception as e:
            self.fail(f"step() before reset() raised {type(e).__name__}, not EnvOrderError: {e}")
            return
        self.fail("step() before reset() did not raise EnvOrderError")

    def reset(self, env: GuardedEnv) -> Observation:
        try:
            out = env.reset(seed=self.seed)
        except Exception as e:
            self.fail(f"reset(seed={self.seed}) raised {type(e).__name__}: {e}")
            raise _Stop from e
        if not (isinstance(out, tuple) and len(out) == 2):
            self.fail(f"reset() returned {type(out).__name__}, not (Observation, dict)")
            raise _Stop
        obs, info = out
        if not isinstance(obs, Observation) or not isinstance(info, dict):
            got = f"({type(obs).__name__}, {type(info).__name__})"
            self.fail(f"reset() returned {got}, not (Observation, dict)")
            raise _Stop
        for what, value in (("observation", obs), ("info", info)):
            problem = json_problem(value)
            if problem:
                self.fail(f"reset() {what} is {problem}")
        return obs

    def step(self, env: GuardedEnv, action: str) -> StepResult | None:
        try:
            res = env.step(action)
        except Exception as e:
            self.fail(f"step({action[:60]!r}) raised {type(e).__name__}: {e}")
            return None
        if not isinstance(res, StepResult):
            self.fail(f"step({action[:60]!r}) returned {type(res).__name__}, not StepResult")
            return None
        problem = json_problem(res)
        if problem:
            self.fail(f"step({action[:60]!r}) result is {problem}")
        return res

    def check_examples(self) -> None:
        self.reset(self.env)
        done = False
        for action in self.actions:
            if done:
                self.reset(self.env)
            res = self.step(self.env, action)
            done = res is None or res.done
            if res is None:
                self.reset(self.env)

    def check_bad_actions(self) -> None:
        limit = self.spec.max_action_bytes
        for label, bad in (("a non-UTF-8 action", b"\xff"), ("an oversized action", "x" * (limit + 1))):
            self.reset(self.env)
            try:
                self.env.step(bad)
            except ActionError:
                continue
            except Exception as e:
                self.fail(f"{label} raised {type(e).__name__}, not ActionError: {e}")
                continue
            self.fail(f"{label} was accepted; it must raise ActionError")

    def play(self, env: GuardedEnv) -> tuple[Trace, bool]:
        """An episode of cycled example actions from the check seed: its trace and whether it ended."""
        self.reset(env)
        cap = self.spec.max_episode_steps or UNBOUNDED_EPISODE_CAP
        trace: Trace = []
        for action in itertools.islice(itertools.cycle(self.actions), cap):
            res = self.step(env, action)
            if res is None:
                raise _Stop
            trace.append((res.obs, res.reward, res.terminated, res.truncated))
            if res.done:
                return trace, True
        return trace, False

    def check_episode(self) -> Trace | None:
        trace, ended = self.play(self.env)
        if not ended:
            limit = self.spec.max_episode_steps
            self.fail(
                f"an episode of example actions did not end within {len(trace)} steps"
                + ("" if limit else " (the spec sets no max_episode_steps)")
            )
            return None
        try:
            self.env.step(self.actions[0])
        except EnvOrderError:  # the contract: a step after the end is refused so
            pass
        except Exception as e:
            self.fail(f"step() after the episode ended raised {type(e).__name__}, not EnvOrderError: {e}")
        else:
            self.fail("step() after the episode ended did not raise EnvOrderError")
        return trace

    def check_replay(self, trace: Trace) -> None:
        try:
            fresh = self.reg.make(self.spec.id)
        except Exception as e:
            self.fail(f"a second make() raised {type(e).__name__}: {e}")
            return
        try:
            again, _ = self.play(fresh)
        finally:
            try:
                fresh.close()
            except Exception as e:  # listed, not raised: check_env reports every problem
                self.fail(f"close() of a second instance raised {type(e).__name__}: {e}")
        for i, (a, b) in enumerate(itertools.zip_longest(trace, again)):
            if a != b:
                self.fail(
                    f"a fresh instance replaying seed {self.seed} and the same actions differs at "
                    f"step {i + 1}, but deterministic=True"
                )
                return

    def check_leaks(self) -> None:
        """A container's server reuses one environment for session after session: what it
        opens each episode and never closes (a file, a subprocess's pipes, a thread) runs the
        container out of descriptors or memory some thousands of episodes in."""
        samples = []
        for _ in range(LEAK_EPISODES + 1):
            self.play(self.env)
            gc.collect()  # a file dropped in a reference cycle is closed, only later: no leak
            samples.append((_open_fds(), threading.active_count()))
        for i, what in ((0, "file descriptors"), (1, "threads")):
            counts: list[int] = [n for s in samples if (n := s[i]) is not None]
            if len(counts) == len(samples) and all(a < b for a, b in itertools.pairwise(counts)):
                self.fail(
                    f"open {what} grew with every episode ({' -> '.join(map(str, counts))} over "
                    f"{LEAK_EPISODES} episodes): reset() or step() leaves one open each time; close "
                    "what the previous episode opened"
                )


def _open_fds() -> int | None:
    """This process's open file descriptors, where ``/proc`` lists them (Linux)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None
