"""``RewardStream``: finished trajectories out to the fabric reward functions, rewarded
samples back, without ever blocking the rollout.

    async with fabric.Client(backend="local") as client:
        async with RewardStream(client, cfg.rewards, deliver=buffer.put) as stream:
            stream.submit(traj)          # returns at once; the sample reaches buffer.put later

Per trajectory: the reward components of its tag run concurrently, each as one
``client.call``; their results are combined by ``functions.rewards.compose.combine``
(weighted mean by default). ``concurrency`` worker tasks bound the trajectories in flight;
``submit`` only appends to an unbounded queue, so the rollout never waits on rewards (the
queue length is in ``metrics()``).

Failure is data. A component that fails for good marks the trajectory ``reward_failed``:
masked, never a zero reward, counted by function and error type. A component's
``failure_score`` stands in only for a failure the output caused (``UserError``,
``FunctionTimeout`` of a call that began); a ``Misconfigured`` function (its setup is
wrong: a judge whose key is refused) masks every trajectory with the message saying what
to fix, and the job, whose groups are then given up one after another, stops with it. ``infra_failed`` and
``aborted`` trajectories are not scored at all, only passed on (the buffer counts them).

Retries, and why the stream adds almost none. The client already retries every retryable
failure (timeouts, lost workers, throttling, ``Unavailable``) with exponential backoff and
full jitter, bounded by the function's ``RetryPolicy`` and the call's deadline; retrying
those again here would multiply attempts (3 x 3) and the load on a struggling pool for
nothing. The one failure the client never retries without having tried is
``CircuitOpen``: after a run of infrastructure failures it fails calls fast for a cooldown.
Scoring would then mask every trajectory of that window, so the stream waits (exponential
backoff, full jitter, ``OutagePolicy``) and calls again, by which time the circuit lets a
probe through. Everything else is final.

Exactly once. Every call carries the idempotency key ``<trajectory id>:<component>``; the
client prefixes the function name and version, so the key is trajectory + function +
function version (+ the component name, as one function may appear twice under a tag with
other arguments). A retry, a hedge, or a second stream over the same client reuses the
first execution. A trajectory id submitted again while in flight or after it was scored is
ignored (counted as ``duplicate``); after ``reward_failed`` a resubmission is scored anew.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.aio import gather_or_stop
from core.config import JobConfig, RewardConfig
from core.errors import StreamClosedError
from core.rollout.tool_calls import reward_trajectory
from core.sample import Sample
from fabric.errors import ErrorCode
from fabric.protocol import Result, RewardResult, Trajectory
from functions.rewards.compose import combine

if TYPE_CHECKING:
    from fabric.client import Client

log = logging.getLogger(__name__)

Deliver = Callable[[Sample], Awaitable[Any] | Any]

#: Failures after which the call did not run and the client does not retry by itself.
_OUTAGE = frozenset({ErrorCode.CIRCUIT_OPEN})
#: Failures that the trajectory's output can cause (the function raised on it, or hung on it
#: on every attempt): what ``RewardConfig.failure_score`` scores instead of masking. Never
#: ``Misconfigured``: the function's setup fails every output alike, and a score for it would
#: train the policy on a constant.
_OUTPUT_FAULTS = frozenset({ErrorCode.USER_ERROR, ErrorCode.TIMEOUT})


class OutagePolicy(BaseModel):
    """How long the stream waits out an open circuit before a reward counts as failed."""

    model_config = ConfigDict(extra="forbid")
    retries: int = Field(5, ge=0)
    initial_backoff_s: float = Field(1.0, gt=0)
    max_backoff_s: float = Field(10.0, gt=0)


class RewardStream:
    def __init__(
        self,
        client: Client,
        rewards: Mapping[str, Sequence[RewardConfig]],
        deliver: Deliver,
        *,
        concurrency: int = 64,
        normalize: bool = True,
        outage: OutagePolicy | None = None,
        memory: int = 200_000,
    ):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.client = client
        self.rewards = {tag: list(specs) for tag, specs in rewards.items()}
        for tag, specs in self.rewards.items():
            names = [s.component for s in specs]
            if len(set(names)) != len(names):  # combine() keys components by name
                raise ValueError(f"rewards.{tag}: component names must be unique, got {names}")
        self.deliver = deliver
        self.concurrency = concurrency
        self.normalize = normalize
        self.outage = outage or OutagePolicy()
        self._memory = max(memory, 1)
        self._queue: asyncio.Queue[Sample] = asyncio.Queue()
        self._workers: list[asyncio.Task[None]] = []
        self._inflight: set[str] = set()
        self._scored: OrderedDict[str, None] = OrderedDict()
        self._closed = False
        # metrics
        self._counts: Counter[str] = Counter()
        self._failures: Counter[str] = Counter()
        self._reward_ms_total = 0.0
        self._reward_ms_max = 0.0

    @classmethod
    def from_config(cls, client: Client, config: JobConfig, deliver: Deliver, **kw: Any) -> RewardStream:
        return cls(client, config.rewards, deliver, **kw)

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> RewardStream:
        self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # a clean exit delivers what was submitted; an error or a cancellation does not wait
        await self.aclose(drain=exc_type is None)

    def start(self) -> None:
        if self._closed:
            raise StreamClosedError("the reward stream was closed")
        if not self._workers:
            self._workers = [
                asyncio.create_task(self._work(), name=f"reward-stream-{i}") for i in range(self.concurrency)
            ]

    async def aclose(self, *, drain: bool = True, drain_timeout: float | None = None) -> None:
        """Stop taking trajectories; with ``drain`` first score and deliver the queued ones
        (for at most ``drain_timeout`` seconds). Whatever is left is dropped and counted as
        ``cancelled``."""
        self._closed = True
        try:
            if drain and self._workers:
                try:
                    async with asyncio.timeout(drain_timeout):
                        await self._queue.join()
                except TimeoutError:
                    log.warning(
                        "reward stream: drain timed out with %d trajectories left", len(self._inflight)
                    )
        finally:
            # also when the drain itself is cancelled (Ctrl-C at the job's end): workers left
            # running went on calling reward functions on a client being closed
            await self._stop_workers()

    async def _stop_workers(self) -> None:
        for t in self._workers:
            t.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        while not self._queue.empty():  # queued, never started
            self._inflight.discard(self._queue.get_nowait().id)
            self._queue.task_done()
            self._counts["cancelled"] += 1

    async def join(self) -> None:
        """Wait until every submitted trajectory was delivered."""
        await self._queue.join()

    # ------------------------------------------------------------------ input
    def submit(
        self,
        traj: Trajectory,
        *,
        tag: str | None = None,
        group_id: str | None = None,
        version: int | None = None,
    ) -> bool:
        """Queue a finished trajectory for scoring; returns at once. False when it is a
        duplicate (in flight or already scored), which is ignored. The keywords override the
        bookkeeping read from the trajectory (see ``core.sample``)."""
        if self._closed:
            raise StreamClosedError("the reward stream was closed")
        sample = Sample.of(traj, tag=tag, group_id=group_id, version=version)
        if sample.id in self._inflight or sample.id in self._scored:
            self._counts["duplicate"] += 1
            return False
        self._inflight.add(sample.id)
        self._counts["submitted"] += 1
        self._queue.put_nowait(sample)
        return True

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, Any]:
        scored = self._counts["scored"]
        return {
            "queued": self._queue.qsize(),
            "in_flight": len(self._inflight),
            **{
                k: self._counts[k] for k in ("submitted", "duplicate", "scored", "reward_failed", "cancelled")
            },
            "passed_masked": self._counts["infra_failed"] + self._counts["aborted"],
            "outage_retries": self._counts["outage_retries"],
            "failure_scored": self._counts["failure_scored"],  # components given failure_score
            "deliver_errors": self._counts["deliver_errors"],
            "failures": dict(self._failures),
            "reward_ms": {
                "mean": self._reward_ms_total / scored if scored else 0.0,
                "max": self._reward_ms_max,
                "total": self._reward_ms_total,
            },
        }

    # ------------------------------------------------------------------ internals
    async def _work(self) -> None:
        while True:
            sample = await self._queue.get()
            try:
                try:
                    await self._score(sample)
                except Exception as e:  # a bug here must not end the worker
                    # the worker died with it: the sample never came back (its group waited
                    # for ever) and, once every worker had, no reward was scored again
                    log.exception("reward stream: scoring %s raised", sample.id)
                    self._fail(sample, f"scoring raised {type(e).__name__}: {e}", "stream_error")
                await self._deliver(sample)
            except asyncio.CancelledError:  # closed without drain: lost, but counted
                self._counts["cancelled"] += 1
                raise
            finally:
                self._inflight.discard(sample.id)
                self._queue.task_done()

    async def _deliver(self, sample: Sample) -> None:
        try:
            out = self.deliver(sample)
            if inspect.isawaitable(out):
                await out
        except Exception:  # the consumer's bug: count it, keep scoring the others
            self._counts["deliver_errors"] += 1
            log.exception("reward stream: delivering %s raised", sample.id)
        if sample.status == "ok":
            self._remember_scored(sample.id)

    async def _score(self, sample: Sample) -> None:
        """Set ``sample.reward``, or mask it ``reward_failed`` with the reason."""
        if sample.masked:  # infra_failed / aborted: nothing to score, the buffer counts it
            self._counts[sample.status] += 1
            return
        t0 = time.perf_counter()
        specs = self.rewards.get(sample.tag)
        if not specs:
            self._fail(sample, f"no reward functions for tag {sample.tag!r}", "no_rewards")
            return
        payloads: list[dict[str, Any]] = []
        # the rewards get the environment's tool calls in the OpenAI shape; sample.traj (the
        # trainer's) stays the chat the policy was shown
        scored = reward_trajectory(sample.traj)
        for spec in specs:
            missing = sorted(k for k in spec.task_args.values() if k not in sample.traj.task)
            if missing:
                # what the task has, and where its keys come from: the job stops with this
                # error when no group completes, and "(task_args)" alone left the user to
                # guess whether the config or the environment was wrong
                has = ", ".join(sorted(sample.traj.task)) or "no key"
                self._fail(
                    sample,
                    f"{_label(spec)}: task lacks {', '.join(map(repr, missing))} (task_args); its "
                    f"task has {has}: have the environment's reset's info['task'] give it, or "
                    "map task_args to a key it has",
                    f"{spec.function}:MissingTaskKey",
                )
                return
            task_args = {param: sample.traj.task[key] for param, key in spec.task_args.items()}
            payloads.append({"traj": scored, **spec.args, **task_args})
        calls = (self._call(spec, p, sample.id) for spec, p in zip(specs, payloads, strict=True))
        results = await gather_or_stop(calls)
        components: dict[str, RewardResult | float] = {}
        errors: list[str] = []
        for spec, r in zip(specs, results, strict=True):
            value, problem = _value_of(r)
            if problem is not None:
                kind = r.error.type if r.error is not None else "BadValue"
                self._failures[f"{spec.function}:{kind}"] += 1
                # (a timeout that never began, no thread or worker free in time, is the
                # machinery's: the response did not cause it)
                ran = r.started is not False
                if spec.failure_score is not None and kind in _OUTPUT_FAULTS and ran:
                    self._counts["failure_scored"] += 1
                    # why, kept with the score (the trajectory is not masked: its record says so)
                    why = {"failed": (problem or "")[:500]}
                    components[spec.component] = RewardResult(score=spec.failure_score, info=why)
                    continue
                errors.append(f"{_label(spec)}: {problem}")
            else:
                assert value is not None
                components[spec.component] = value
        if errors:
            self._fail(sample, "; ".join(errors), None)
            return
        try:
            reward = combine(components, {s.component: s.weight for s in specs}, self.normalize)
        except ValueError as e:  # a non-finite score: garbage in must not train
            self._fail(sample, f"cannot combine components: {e}", "combine:ValueError")
            return
        if not math.isfinite(reward.score):
            # finite components whose weighted sum overflows (1e308 + 1e308): an inf score
            # makes its whole group's advantages NaN, and the weights with them
            self._fail(sample, f"the combined score is non-finite ({reward.score})", "combine:NonFinite")
            return
        sample.reward = reward
        ms = (time.perf_counter() - t0) * 1e3
        self._reward_ms_total += ms
        self._reward_ms_max = max(self._reward_ms_max, ms)
        self._counts["scored"] += 1

    async def _call(self, spec: RewardConfig, payload: dict[str, Any], traj_id: str) -> Result:
        key = f"{traj_id}:{spec.component}"
        policy = self.outage
        attempt = 0
        while True:
            r = await self.client.call(
                spec.function, payload, idempotency_key=key, deadline_s=spec.deadline_s
            )
            if r.ok or r.error is None or r.error.type not in _OUTAGE or attempt >= policy.retries:
                return r
            # the circuit is open: nothing ran; wait it out rather than mask the trajectory
            cap = min(policy.max_backoff_s, policy.initial_backoff_s * 2**attempt)
            attempt += 1
            self._counts["outage_retries"] += 1
            await asyncio.sleep(random.uniform(0, cap))

    def _fail(self, sample: Sample, error: str, failure: str | None) -> None:
        sample.status = "reward_failed"
        sample.reward = None
        sample.error = error
        self._counts["reward_failed"] += 1
        if failure is not None:
            self._failures[failure] += 1

    def _remember_scored(self, traj_id: str) -> None:
        self._scored[traj_id] = None
        if len(self._scored) > self._memory:
            self._scored.popitem(last=False)


def _label(spec: RewardConfig) -> str:
    """A component in an error: its function too when it has a name of its own (the error
    reaches the user, who looks the function up)."""
    return spec.function if spec.name is None else f"{spec.name} ({spec.function})"


def _value_of(r: Result) -> tuple[RewardResult | float | None, str | None]:
    """``(value, None)`` for a usable reward, ``(None, why)`` otherwise."""
    if not r.ok:
        assert r.error is not None
        return None, f"{r.error.type}: {r.error.message}"
    v = r.value
    if isinstance(v, dict):
        try:
            return RewardResult.model_validate(v), None
        except ValidationError as e:
            return None, f"returned a dict that is not a RewardResult: {e.error_count()} errors"
    if isinstance(v, int | float) and not isinstance(v, bool):
        if not math.isfinite(v):
            return None, f"non-finite score {v}"
        return float(v), None
    return None, f"a reward returns a number or a RewardResult, got {type(v).__name__}"
