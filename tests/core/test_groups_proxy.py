"""GroupRunner with the real LLMProxy and EnvManager over fake engines and sessions: the
proxy forgets every trajectory of a redundant group, and a shutdown aborts each turn once."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from core.config import JobConfig
from core.rollout.engines.base import Completion, Engine, GenerateRequest
from core.rollout.env_manager import EnvManager
from core.rollout.groups import GroupRunner
from core.rollout.llm_proxy import LLMProxy, LocalReplica
from envpool.api import Observation, StepResult

#: Bounds a wait for a state the fakes reach in milliseconds, against a hang only: three test
#: workers on a loaded machine took over 5 s to get six in-process trajectories going
HANG_S = 60.0

# ----------------------------------------------------------------------------- with the real proxy


class _OneTokenEngine(Engine):
    name = "fake"

    async def _generate(self, request: GenerateRequest) -> Completion:
        await asyncio.sleep(0.01)  # a group's members get their turn in one batch
        return Completion(
            request_id=request.request_id,
            text="go",
            prompt_ids=[1],
            token_ids=[2],
            logprobs=[-0.1],
            policy_version=self.version,
            finish_reason="stop",
        )

    async def _abort(self, request_id: str) -> None: ...

    async def _load_weights(self, state: Any, version: int) -> None: ...


class _OneStepSession:
    async def reset(self, *, seed: int | None = None) -> tuple[Observation, dict[str, Any]]:
        return Observation(text="start"), {}

    async def step(self, action: Any) -> StepResult:
        await asyncio.sleep(0.001)
        return StepResult(obs=Observation(text="end"), reward=1.0, terminated=True)


class _Pool:
    @contextlib.asynccontextmanager
    async def session(self, env_id: str, **kw: Any) -> AsyncIterator[_OneStepSession]:
        yield _OneStepSession()


async def test_the_proxy_forgets_every_trajectory_of_a_redundant_group():
    # members finishing as their group fills release before the runner's abort arrives: the
    # proxy once kept those ids for the rest of the job (every redundant member leaked)
    cfg = JobConfig.from_dict(
        {
            "envs": [{"id": "latency-v0", "tag": "lat", "max_turns": 1}],
            "rewards": {"lat": [{"function": "unused"}]},
            "group_size": 2,
            "redundancy": 2,
        },
        check_references=False,
    )
    proxy = LLMProxy({"default": [LocalReplica(_OneTokenEngine())]})
    manager = EnvManager(cfg, _Pool(), proxy)  # type: ignore[arg-type]
    runner = GroupRunner(cfg, manager, proxy, submit=lambda t: None)
    for i in range(20):
        runner.start(cfg.envs[0], i, 0)
    async with asyncio.timeout(HANG_S):
        while runner.running() or runner._aborting or manager._releasing:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert runner.metrics["redundant_aborted"] + runner.metrics["extra"] > 0
    assert proxy._aborted == set(), f"{len(proxy._aborted)} ids left"
    assert proxy.stats()["trajectories"] == 0


class _HeldEngine(Engine):
    """A turn runs until it is aborted; each abort is counted and takes a replica's round trip."""

    name = "held"

    def __init__(self) -> None:
        super().__init__()
        self.aborts: Counter[str] = Counter()
        self._stop: dict[str, asyncio.Event] = {}

    async def _generate(self, request: GenerateRequest) -> Completion:
        await self._stop.setdefault(request.request_id, asyncio.Event()).wait()
        return Completion(
            request_id=request.request_id,
            text="",
            prompt_ids=[1],
            token_ids=[],
            logprobs=[],
            policy_version=self.version,
            finish_reason="abort",
        )

    async def _abort(self, request_id: str) -> None:
        self.aborts[request_id] += 1
        await asyncio.sleep(0.02)  # the replica's answer
        self._stop.setdefault(request_id, asyncio.Event()).set()

    async def _load_weights(self, state: Any, version: int) -> None: ...


class _AsRayActor:
    """The proxy as env managers and the runner reach it under Ray. Each call runs in the
    actor on its own: a caller that stops waiting (a cancelled trajectory) does not stop it.
    And Ray runs an async actor's calls in no guaranteed order (docs: "Actor Task Execution
    Order"): here a trajectory's abort reaches the actor just after its release, when one is
    sent (within a bound: a redundant member's abort has no release to follow)."""

    def __init__(self, proxy: LLMProxy) -> None:
        self.proxy = proxy
        self._released: dict[str, asyncio.Event] = {}
        self.calls: set[asyncio.Task[Any]] = set()

    async def _in_actor(self, coro: Any) -> Any:
        t = asyncio.ensure_future(coro)
        self.calls.add(t)
        t.add_done_callback(self.calls.discard)
        return await asyncio.shield(t)

    async def generate(self, traj_id: str, tag: str, request: GenerateRequest) -> Completion:
        c: Completion = await self._in_actor(self.proxy.generate(traj_id, tag, request))
        return c

    async def abort(self, traj_id: str) -> int:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                await self._released.setdefault(traj_id, asyncio.Event()).wait()
        n: int = await self._in_actor(self.proxy.abort(traj_id))
        return n

    async def release(self, traj_id: str) -> None:
        call = self._in_actor(self.proxy.release(traj_id))
        done = asyncio.ensure_future(call)
        await asyncio.sleep(0)  # the release is in the actor first
        self._released.setdefault(traj_id, asyncio.Event()).set()
        await done


async def test_a_shutdown_stops_each_running_trajectory_once():
    # aclose asked the proxy to abort every running trajectory and cancelled it too: the
    # cancelled trajectory's release aborts the turn it left running, so each turn had two
    # aborts in flight, and under Ray (calls to an async actor run in any order) both
    # reached the engine replica. Each is stopped once now: cancelled, its turn aborted by
    # its release
    cfg = JobConfig.from_dict(
        {
            "envs": [{"id": "latency-v0", "tag": "lat", "max_turns": 1}],
            "rewards": {"lat": [{"function": "unused"}]},
            "group_size": 2,
        },
        check_references=False,
    )
    engine = _HeldEngine()
    proxy = LLMProxy({"default": [LocalReplica(engine)]})
    remote = _AsRayActor(proxy)
    manager = EnvManager(cfg, _Pool(), remote)  # type: ignore[arg-type]
    runner = GroupRunner(cfg, manager, remote, submit=lambda t: None)
    for i in range(2):
        runner.start(cfg.envs[0], i, 0)
    async with asyncio.timeout(HANG_S):
        while engine.num_inflight < 4:  # noqa: ASYNC110 - every turn reached the engine
            await asyncio.sleep(0.002)
    turns = set(engine._inflight)
    await runner.aclose()
    async with asyncio.timeout(HANG_S):
        while remote.calls:  # the actor's side of the calls ends too
            await asyncio.gather(*remote.calls, return_exceptions=True)
    assert dict(engine.aborts) == dict.fromkeys(turns, 1)
    assert engine.num_inflight == 0 and proxy.stats()["trajectories"] == 0 and proxy._aborted == set()
    assert runner.running() == 0 and runner.metrics["aborted"] == 4
    await proxy.aclose()


class _HeldUnlessStepping(_HeldEngine):
    """Holds the turns of tag ``held`` until aborted; answers the others at once."""

    async def _generate(self, request: GenerateRequest) -> Completion:
        if request.metadata.get("tag") == "held":
            return await super()._generate(request)
        return Completion(
            request_id=request.request_id,
            text="go",
            prompt_ids=[1],
            token_ids=[2],
            logprobs=[-0.1],
            policy_version=self.version,
            finish_reason="stop",
        )


class _StepHangs:
    """A session whose step never returns (an environment step in progress)."""

    def __init__(self, stepping: list[int]) -> None:
        self.stepping = stepping

    async def reset(self, *, seed: int | None = None) -> tuple[Observation, dict[str, Any]]:
        return Observation(text="start"), {}

    async def step(self, action: Any) -> StepResult:
        self.stepping.append(1)
        await asyncio.Event().wait()
        raise AssertionError("never answered")


class _PoolByEnv:
    def __init__(self) -> None:
        self.stepping: list[int] = []

    @contextlib.asynccontextmanager
    async def session(self, env_id: str, **kw: Any) -> AsyncIterator[Any]:
        hangs = (kw.get("env_kwargs") or {}).get("turns") == 9
        yield _StepHangs(self.stepping) if hangs else _OneStepSession()


async def test_a_shutdown_aborts_each_turn_once_whatever_each_member_was_doing():
    # at aclose: group a's members are being aborted already (a stale group: the runner's
    # abort in flight), group b's are in a turn, group c's in an environment step. Each
    # turn in flight is aborted once (a's by the runner's abort, b's by the release of the
    # cancelled trajectory), a member in a step has no turn to abort, and the proxy forgets
    # every one of them
    cfg = JobConfig.from_dict(
        {
            "envs": [
                {"id": "latency-v0", "tag": "held", "max_turns": 1},
                {"id": "latency-v0", "tag": "stepping", "max_turns": 1, "kwargs": {"turns": 9}},
            ],
            "rewards": {"held": [{"function": "unused"}], "stepping": [{"function": "unused"}]},
            "group_size": 2,
        },
        check_references=False,
    )
    engine = _HeldUnlessStepping()
    proxy = LLMProxy({"default": [LocalReplica(engine)]})
    remote = _AsRayActor(proxy)
    pool = _PoolByEnv()
    manager = EnvManager(cfg, pool, remote)  # type: ignore[arg-type]
    runner = GroupRunner(cfg, manager, remote, submit=lambda t: None)
    a = runner.start(cfg.envs[0], 0, 0)
    runner.start(cfg.envs[0], 1, 0)
    runner.start(cfg.envs[1], 2, 0)
    async with asyncio.timeout(HANG_S):
        while engine.num_inflight < 4 or len(pool.stepping) < 2:  # noqa: ASYNC110
            await asyncio.sleep(0.002)
    turns = set(engine._inflight)
    runner.abort_group(a.id, "stale")
    assert a.aborting == set(a.running)
    await runner.aclose()
    async with asyncio.timeout(HANG_S):
        while remote.calls:
            await asyncio.gather(*remote.calls, return_exceptions=True)
    assert dict(engine.aborts) == dict.fromkeys(turns, 1)
    assert engine.num_inflight == 0 and proxy.stats()["trajectories"] == 0 and proxy._aborted == set()
    assert runner.running() == 0 and runner.metrics["aborted"] == 6
    await proxy.aclose()
