"""Env managers: one asyncio loop per trajectory, never waiting on another trajectory.

    manager = EnvManager(cfg, pool, proxy, actions={"frozenlake": [12, 13, 14, 15]})
    traj = await manager.run(Task(env=cfg.envs[0], seed=7, group_id="g1"), version=3)

A trajectory is ``reset -> (generate -> step)* -> done``: its own environment session
(``async with pool.session``: every step reaches the same container), its own turns
through the LLM proxy (which keeps it on one engine replica). What the policy is shown each
turn is the environment's ``prompt`` config (``history``, ``drop_lines``, ``system``); the
trajectory records everything. A stateless tool call inside an environment (math-tools'
calculator) goes to the fabric through the pool's tool bridge.

Outcomes are data, never exceptions:

* ``ok`` / ``truncated`` (``max_turns`` reached, the environment's own step limit, or the
  conversation outgrew the model's context: the next turn's prompt left no room for a
  token): rewarded by the reward stream. ``info["finish_reason"]`` says which ending it was
  (``FINISH_REASONS``): ``"terminated"`` (``ok``), ``"max_turns"``, ``"env_truncated"`` or
  ``"context_full"``.
* ``aborted``: the proxy answered a turn with ``abort`` (the group had enough, or the
  trajectory went stale); never reaches the trainer.
* ``infra_failed``: the environment's container was lost beyond repair, the environment
  itself failed (raised, or hung past ``step_timeout_s``), the engine replicas are gone, the
  first prompt does not fit the model's context, or the trajectory outran
  ``rollout.trajectory_timeout_s``: masked, re-run by the group, never scored as zero.

A reply that is not a valid action is sent to the environment as it is: the environment
records it as invalid and decides the penalty (one too large to send at all is recorded as
an invalid turn by the manager).

What the trainer needs beyond the messages goes in ``traj.info``: ``turn_rewards`` (per
assistant turn, the environment's step reward) and ``turn_states`` (the state the turn was
taken in, for step-level advantages: the step/reset ``info["state"]`` if the environment
gives one, else ``info["position"]``, else the observation as shown), plus where the time
went (``gen_s``, ``env_s``). An environment that reports its tool calls (``info["calls"]``,
see ``core.rollout.tool_calls``) gets them kept per turn in ``turn_tool_calls``, from which
the reward stream gives the rewards the trajectory in the OpenAI tool-call shape; the
messages themselves stay the plain chat the policy was shown.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from core.config import EnvConfig, JobConfig
from core.errors import ProxyDiedError, where_raised
from core.rollout.engines.base import Completion, EngineError, GenerateRequest, PromptTooLongError
from core.rollout.scheduling import OUTCOMES
from core.rollout.tool_calls import TURN_CALLS_KEY, record_calls
from core.sample import GROUP_KEY, TAG_KEY, VERSION_KEY
from core.trainer.base import assistant_message
from envpool.api import Observation, StepResult
from envpool.errors import ActionError, EnvLogicError, EnvPoolError, ToolMisconfigured
from envpool.pool import EnvPool
from fabric.protocol import Message, Trajectory

log = logging.getLogger(__name__)
FINISH_REASONS = ("terminated", "max_turns", "env_truncated", "context_full")
"""``info["finish_reason"]`` of a finished (``ok`` / ``truncated``) trajectory: the environment
ended it (``ok``), it ran out of ``max_turns``, the environment cut it at its own step limit
(truncated, ``max_episode_steps``), or its conversation outgrew the model's context. An
``aborted`` or ``infra_failed`` one has none (``info["error_type"]`` says what failed)."""
_JOB_TASK_KEYS = frozenset({"env_id", "seed", TAG_KEY, GROUP_KEY})
"""What the job writes into every trajectory's ``task``; an environment's may not override them."""


def task_key(reset_text: str) -> str:
    """Which task an episode is, by the observation its reset gave: different seeds can give
    the same task (4x4 FrozenLake has a few thousand maps), so a held-out seed is not a
    held-out task. The job compares these keys to say which evaluation tasks training saw."""
    return hashlib.sha1(reset_text.encode()).hexdigest()[:16]


def first_observation(traj: Trajectory) -> str | None:
    """The reset observation: the trajectory's first user message."""
    return next((m.content for m in traj.messages if m.role == "user" and isinstance(m.content, str)), None)


class ProxyLike(Protocol):
    async def generate(self, traj_id: str, tag: str, request: GenerateRequest) -> Completion: ...

    async def abort(self, traj_id: str) -> int: ...

    async def release(self, traj_id: str) -> None: ...


@dataclass(frozen=True)
class Task:
    """One environment episode to play: which mix entry, which seed, which group."""

    env: EnvConfig
    seed: int
    group_id: str
    greedy: bool = False
    """Evaluation: temperature 0."""


class TurnBarrier:
    """Batch-level lockstep (``rollout.mode: sync``): a turn's generation starts only when
    every live trajectory of the batch has reached that turn, as a batch-level rollout
    generates for the whole batch, then steps every environment, then waits for the last."""

    def __init__(self) -> None:
        self._members = 0
        self._arrived = 0
        self._round = 0
        self._cond = asyncio.Condition()

    def join(self) -> None:
        self._members += 1

    async def leave(self) -> None:
        async with self._cond:
            self._members -= 1
            self._maybe_release()

    async def wait(self) -> None:
        async with self._cond:
            self._arrived += 1
            my_round = self._round
            self._maybe_release()
            try:
                await self._cond.wait_for(lambda: self._round != my_round)
            except BaseException:
                # a cancelled waiter (its trajectory aborted) must not stay counted, or the
                # next round would be released one member short
                if self._round == my_round:
                    self._arrived -= 1
                raise

    def _maybe_release(self) -> None:
        if self._members > 0 and self._arrived >= self._members:
            self._arrived = 0
            self._round += 1
            self._cond.notify_all()


class EnvManager:
    def __init__(
        self,
        cfg: JobConfig,
        pool: EnvPool,
        proxy: ProxyLike,
        *,
        actions: dict[str, list[int]] | None = None,
        images: dict[str, str] | None = None,
    ):
        self.cfg = cfg
        self.pool = pool
        self.proxy = proxy
        self.actions = actions or {}
        """Tag -> allowed token ids (constrained replies), from ``EnvConfig.actions``."""
        self.images = images or {}
        """``EnvConfig.image`` (a directory) -> the reference of the image the job built from
        it (``core.env_images.JobImages``); a reference stands for itself."""
        self._releasing: set[asyncio.Task[None]] = set()
        self._warned: set[str] = set()  # the environment errors said already (once per type)

    async def run(
        self, task: Task, *, version: int, traj_id: str | None = None, barrier: TurnBarrier | None = None
    ) -> Trajectory:
        env = task.env
        traj = Trajectory(
            id=traj_id or uuid.uuid4().hex,
            task={
                "env_id": env.id,
                "seed": task.seed,
                TAG_KEY: env.tag,
                GROUP_KEY: task.group_id,
            },
            info={VERSION_KEY: version, "turn_rewards": [], "turn_states": [], "gen_s": 0.0, "env_s": 0.0},
        )
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.cfg.rollout.trajectory_timeout_s):
                await self._play(task, traj, barrier)
        except TimeoutError:
            _fail(
                traj,
                f"trajectory ran over rollout.trajectory_timeout_s={self.cfg.rollout.trajectory_timeout_s}",
                "TrajectoryTimeout",
            )
        except (EnvPoolError, EngineError) as e:
            # EnvLogicError (the environment's own bug, EnvHung: it hangs on an action) lands
            # here too: masked like a lost container, since no reward for it would be true
            kind = type(e).__name__
            if isinstance(e, EnvLogicError) and e.remote_type and e.remote_type != kind:
                kind = f"{kind}:{e.remote_type}"  # EnvLogicError:KeyError
            _fail(traj, f"{type(e).__name__}: {e}", kind)
            if isinstance(e, EnvLogicError | ToolMisconfigured):
                self._warn_once(env, kind, e)
        finally:
            traj.info["wall_s"] = time.perf_counter() - t0
            if barrier is not None:
                await barrier.leave()
            if _running_loop() is loop:
                await self._release(traj)
            # else the garbage collector is closing a run whose loop was closed under it: no
            # release can be sent, and one scheduled anyway raised "There is no current event
            # loop" (or landed on whatever loop runs now) and left its coroutine never awaited
        return traj

    async def _release(self, traj: Trajectory) -> None:
        # shielded: a cancelled trajectory still frees its affinity; kept so that ``drain``
        # can wait for a release its cancelled caller no longer waits for
        release = asyncio.ensure_future(self._end(traj.id, abort=traj.status == "infra_failed"))
        self._releasing.add(release)
        release.add_done_callback(self._releasing.discard)
        try:
            await asyncio.shield(release)
        except ProxyDiedError:
            raise  # the job stops on it
        except Exception as e:
            # the trajectory is played: a release the proxy could not take (a Ray node briefly
            # unreachable) replaced it with its error, and the group runner threw the finished
            # work away as a manager bug and played it again
            log.warning("trajectory %s: the proxy's release failed (%s: %s)", traj.id, type(e).__name__, e)

    def _warn_once(self, env: EnvConfig, kind: str, e: EnvLogicError | ToolMisconfigured) -> None:
        """Say an environment's own error, or a tool's wrong setup, once per type: either is
        the user's to fix, and logged at INFO like a lost container it was nowhere to be seen
        (its trajectories masked and re-run, a group given up now and then). Once, since an
        environment that raises on one seed in three would flood the log."""
        if kind in self._warned:
            return
        self._warned.add(kind)
        where = where_raised(e.traceback) if isinstance(e, EnvLogicError) else None
        log.warning(
            "environment %s %s: %s%s; its trajectories are infra_failed (masked, re-run); "
            "said once per error type, counted in summary.json's trajectories.errors",
            env.id,
            "raised" if isinstance(e, EnvLogicError) else "called a misconfigured tool",
            e,
            f" ({where})" if where else "",
        )

    async def _end(self, traj_id: str, *, abort: bool) -> None:
        if abort:
            # an infra_failed trajectory. Timed out: the timeout cancelled only this side of
            # the turn in flight, and under Ray the proxy and the engine run it on (and it
            # holds a batch slot) until it ends by itself, which for a hung turn, the usual
            # reason for the timeout, is never. Whatever failed: it was cut short, and the
            # turn scheduler's predictor learns an aborted trajectory's length only as a lower
            # bound (a container lost at turn 2, learnt as finished, taught it that
            # trajectories are two turns long)
            with contextlib.suppress(Exception):
                await self.proxy.abort(traj_id)
        await self.proxy.release(traj_id)

    async def drain(self) -> None:
        """Wait for the proxy releases that cancelled trajectories left running."""
        while self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)

    def _take_task(self, env_id: str, traj: Trajectory, given: dict[str, Any]) -> None:
        """The environment's task metadata (ground truth for the rewards) into ``traj.task``,
        but never over the job's own keys: a ``tag`` there sent the trajectory to another
        reward, a ``group_id`` mixed it into another group's advantages. Said once per env."""
        clash = sorted(_JOB_TASK_KEYS & given.keys())
        if clash and f"task-keys:{env_id}" not in self._warned:
            self._warned.add(f"task-keys:{env_id}")
            log.warning(
                "environment %s returned task key(s) %s in reset's info['task']: the job's own keys "
                "(%s) are kept; rename them in the environment",
                env_id,
                ", ".join(clash),
                ", ".join(sorted(_JOB_TASK_KEYS)),
            )
        traj.task.update({k: v for k, v in given.items() if k not in _JOB_TASK_KEYS})

    async def _play(self, task: Task, traj: Trajectory, barrier: TurnBarrier | None) -> None:
        env, info = task.env, traj.info
        image = self.images.get(env.image, env.image) if env.image is not None else None
        async with self.pool.session(env.id, image=image, env_kwargs=env.kwargs) as session:
            te = time.perf_counter()
            obs, reset_info = await session.reset(seed=task.seed)
            info["env_s"] += time.perf_counter() - te
            if isinstance(reset_info.get("task"), dict):
                self._take_task(env.id, traj, reset_info["task"])
            if env.prompt.system:
                traj.messages.append(Message(role="system", content=env.prompt.system))
            traj.messages.append(Message(role="user", content=obs.text))
            state = _state(reset_info, self.shown(obs.text, env))
            traj.status = "truncated"
            outcome: str | None = None
            for turn in range(env.max_turns):
                if barrier is not None:
                    await barrier.wait()
                tg = time.perf_counter()
                try:
                    c = await self.proxy.generate(traj.id, env.tag, self._request(task, traj, turn, outcome))
                except PromptTooLongError as e:
                    if turn == 0:
                        raise  # the first prompt does not fit: no turn to score, a setup fault
                    # the conversation outgrew the model's context: the episode ends here, on
                    # the observation the policy was to answer, and is scored like one cut at
                    # max_turns. Masked and re-run, as an infrastructure fault, it overflowed
                    # again and only the short episodes were trained
                    info["gen_s"] += time.perf_counter() - tg
                    info["finish_reason"] = "context_full"
                    log.info("trajectory %s truncated at turn %d, its context is full: %s", traj.id, turn, e)
                    break
                info["gen_s"] += time.perf_counter() - tg
                if c.finish_reason == "abort":
                    traj.status = "aborted"
                    return
                traj.messages.append(assistant_message(c))
                te = time.perf_counter()
                try:
                    res = await session.step(c.text)
                except ActionError as e:  # not sendable at all (over the size limit): invalid
                    res = StepResult(obs=Observation(text=f"Invalid action: {e}"), info={"valid": False})
                info["env_s"] += time.perf_counter() - te
                info["turn_rewards"].append(res.reward)
                info["turn_states"].append(state)
                if res.info.get("valid") is False:
                    info["invalid"] = info.get("invalid", 0) + 1
                calls = record_calls(res.info)
                if calls or TURN_CALLS_KEY in info:
                    # for the rewards only (reward_trajectory); the chat the policy sees and
                    # is trained on stays the reply's text and the observation
                    turns = info.setdefault(TURN_CALLS_KEY, [[] for _ in info["turn_rewards"][:-1]])
                    turns.append(calls)
                traj.messages.append(Message(role="user", content=res.obs.text))
                state = _state(res.info, self.shown(res.obs.text, env))
                outcome = _outcome(res)
                if res.done:
                    # cut off by the environment's own step limit: truncated, as at max_turns,
                    # but its finish_reason tells the two apart
                    traj.status = "ok" if res.terminated else "truncated"
                    info["finish_reason"] = "terminated" if res.terminated else "env_truncated"
                    break
            else:
                # every turn played and the episode goes on: cut here, as the environment's
                # own limit would (an error or an abort above leaves no finish_reason)
                info["finish_reason"] = "max_turns"
            traj.env_reward = float(sum(info["turn_rewards"]))

    def _request(
        self, task: Task, traj: Trajectory, turn: int, outcome: str | None = None
    ) -> GenerateRequest:
        env = task.env
        meta: dict[str, Any] = {"trajectory_id": traj.id, "turn": turn, "tag": env.tag}
        if outcome is not None:
            meta["outcome"] = outcome  # the turn scheduler's causal signal (C-MLFQ, predictor)
        return GenerateRequest(
            request_id=f"{traj.id}/{turn}",
            messages=self.context(traj.messages, env),
            max_new_tokens=self.cfg.engine.max_new_tokens,
            temperature=0.0 if task.greedy else self.cfg.engine.temperature,
            allowed_token_ids=self.actions.get(env.tag),
            metadata=meta,
        )

    @staticmethod
    def context(messages: list[Message], env: EnvConfig) -> list[Message]:
        """What the policy sees: the system message, then the last ``history`` (reply,
        observation) pairs and the latest observation, with ``drop_lines`` cut."""
        system = [m for m in messages[:1] if m.role == "system"]
        rest = messages[len(system) :]
        history = env.prompt.history
        window = rest if history is None else rest[-(2 * history + 1) :]
        if env.prompt.drop_lines:
            window = [
                m.model_copy(update={"content": _drop(m.content or "", env.prompt.drop_lines)})
                if m.role == "user"
                else m
                for m in window
            ]
        return [*system, *window]

    @staticmethod
    def shown(text: str, env: EnvConfig) -> str:
        """An observation as the policy is shown it (``drop_lines`` cut)."""
        return _drop(text, env.prompt.drop_lines) if env.prompt.drop_lines else text


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _drop(text: str, prefixes: list[str]) -> str:
    return "\n".join(line for line in text.split("\n") if not line.startswith(tuple(prefixes)))


def _outcome(res: StepResult) -> str:
    """What the step returned, as the schedulers' tool outcome (sent with the next turn):
    the environment's own ``info["outcome"]`` when it gives one, else an invalid action is a
    tool error, else ``ok``. Only a step that does not end the episode is ever sent, so
    ``success`` comes from the environment alone (code-repair's passing ``run_tests``): a
    rule on a final step's reward would never reach the scheduler."""
    given = res.info.get("outcome")
    if isinstance(given, str) and given in OUTCOMES:
        return given
    if res.info.get("valid") is False:
        return "tool_error"
    return "ok"


def _state(info: dict[str, Any], shown: str) -> str:
    for key in ("state", "position"):
        if key in info:
            v = info[key]
            return v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    return shown


def _fail(traj: Trajectory, error: str, kind: str) -> None:
    traj.status = "infra_failed"
    # one that timed out after its last turn (leaving its session) had its ending set: it is
    # no finished trajectory now
    traj.info.pop("finish_reason", None)
    traj.info["error"] = error
    traj.info["error_type"] = kind  # what the job's summary counts errors by
    log.info("trajectory %s infra_failed: %s", traj.id, error)
