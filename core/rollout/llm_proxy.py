"""The LLM proxy: one front door to the policy's engine replicas (a Ray actor in the job).

    proxy = LLMProxy({"default": [replica_a, replica_b], "H800": [replica_c]},
                     affinity={"frozenlake": "H800"})
    c = await proxy.generate(traj_id, "frozenlake", GenerateRequest(...))   # one turn
    await proxy.abort(traj_id)                    # its turn in flight returns "abort"
    await proxy.update_weights(3, [state_ref])    # suspend, load, resume every replica

Routing. A tag's generation runs on the replicas of its hardware group (``hw_affinity``
maps tags to Ray custom resources; the job places each group's replicas on them). Within
the group a trajectory sticks to the replica that served its first turn (**trajectory
affinity**: that replica's prefix cache holds the conversation so far); a new trajectory
goes to the least loaded one. ``release`` ends a trajectory's affinity, and aborts a turn
it left running or waiting (its caller timed out or was cancelled: under Ray the proxy's
side of a call runs on without its caller, and after ``release`` nothing could stop it).

Weights. ``update_weights`` swaps every replica (suspend: the step in flight finishes;
load; resume) and remembers the latest version, so that a replica Ray restarted after a
crash gets it back before it serves again. Every completion carries the version that
produced it.

Replica loss. A call that fails because the replica's process died (``ReplicaLost``), or a
turn answered with weights older than the proxy published before it was sent (the process
died while idle and Ray restarted it on its initial weights, which no error said), is
recovered here: wait for Ray to restart the actor (``max_restarts``), reload the latest
weights, run the turn again (a turn has no side effects: it is only tokens). A replica
whose weight swap fails (the engine's own error) or takes past ``swap_timeout_s`` is
recovered too; an update fails only when no replica loaded its weights. While a replica
recovers its group's turns go to the others (the lost turn, new turns and those waiting
for a slot on it) when one is healthy, and weight updates skip it (its recovery loads the
latest); only a group with none healthy waits for a recovery, and a trajectory aborted or
released meanwhile stops waiting at once. A replica not back within ``recover_timeout_s``
(a ping or a reload it never answers included), or whose reload fails, leaves the group,
and the turns still running on it move to another replica; a group with none left fails
the turn with ``NoReplicaError``, which the env manager records as an ``infra_failed``
trajectory. A replica that left is tried again in the background (after
``rejoin_first_s``, backing off to ``rejoin_max_s``): once it answers, what it was running
is aborted, it gets the latest weights and rejoins its group. Only one gone for good
(``ReplicaGone``: Ray cannot place it) is never tried again.

The proxy actor itself is made without ``max_restarts`` (``core.cluster``): a restarted
proxy would come back from its constructor's arguments, at weights version 0 with no
record of the latest weights (a replica restarted after that is never reloaded, and its
stale turns are not even noticed), with every trajectory's affinity and abort flag and
every turn's request id gone (turns left running on the engines could not be stopped),
and with the turn scheduler's trace truncated. Its death stops the job with
``ProxyDiedError`` instead (``core.rollout.replicas.RemoteProxy``); resume from a
checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from core.config import DEFAULT_AFFINITY
from core.config_sections import EngineConfig
from core.rollout.coalesce import Answer, answer_all
from core.rollout.engines.base import Completion, Engine, EngineError, GenerateRequest
from core.rollout.scheduling import TurnScheduler
from core.rollout.wakes import Wakes, Woken
from core.sched import Request

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The proxy's settings default to the job config's (``engine``: one place says them).
_DEFAULTS = EngineConfig()


class ReplicaLost(EngineError):
    """The replica's process died or is restarting; the call may be retried on it later."""


class ReplicaGone(ReplicaLost):
    """The replica died for good (out of restarts)."""


class NoReplicaError(EngineError):
    """No replica is left to serve a tag's hardware group."""


class Replica(ABC):
    """How the proxy reaches one engine: in this process or as a Ray actor."""

    name: str = "replica"

    @abstractmethod
    async def generate(self, request: GenerateRequest) -> Completion: ...

    @abstractmethod
    async def abort(self, request_id: str) -> bool: ...

    @abstractmethod
    async def swap(self, version: int, state: Any) -> None:
        """Suspend, load ``state`` as ``version``, resume."""

    @abstractmethod
    async def ping(self) -> int:
        """The replica's weights version (raises ``ReplicaLost`` while it is down)."""


class LocalReplica(Replica):
    """An engine in the proxy's own process (tests, single-process runs)."""

    def __init__(self, engine: Engine, name: str = "local"):
        self.engine, self.name = engine, name

    async def generate(self, request: GenerateRequest) -> Completion:
        return await self.engine.generate(request)

    async def abort(self, request_id: str) -> bool:
        return await self.engine.abort(request_id)

    async def swap(self, version: int, state: Any) -> None:
        await swap_weights(self.engine, version, state)

    async def ping(self) -> int:
        return self.engine.version


def proxy_options(engine: EngineConfig) -> dict[str, Any]:
    """The ``LLMProxy`` keyword arguments the job config's ``engine`` section sets."""
    return {
        "recover_timeout_s": engine.recover_timeout_s,
        "swap_timeout_s": engine.swap_timeout_s,
        "rejoin_first_s": engine.rejoin_first_s,
        "rejoin_max_s": engine.rejoin_max_s,
    }


async def swap_weights(engine: Engine, version: int, state: Mapping[str, Any]) -> None:
    await engine.swap(state, version)


class LLMProxy:
    def __init__(
        self,
        groups: Mapping[str, Sequence[Replica]],
        *,
        affinity: Mapping[str, str] | None = None,
        recover_timeout_s: float = _DEFAULTS.recover_timeout_s,
        max_turn_retries: int = 3,
        scheduler: TurnScheduler | None = None,
        abort_timeout_s: float = 30.0,
        swap_timeout_s: float = _DEFAULTS.swap_timeout_s,
        rejoin_first_s: float | None = _DEFAULTS.rejoin_first_s,
        rejoin_max_s: float = _DEFAULTS.rejoin_max_s,
    ):
        if not groups or not any(groups.values()):
            raise ValueError("the proxy needs at least one replica")
        self.groups: dict[str, list[Replica]] = {g: list(rs) for g, rs in groups.items()}
        self.affinity = dict(affinity or {})
        unknown = sorted(set(self.affinity.values()) - set(self.groups))
        if unknown:
            raise ValueError(f"hw_affinity names groups without replicas: {unknown}")
        self.recover_timeout_s = recover_timeout_s
        self.max_turn_retries = max_turn_retries
        self.abort_timeout_s = abort_timeout_s
        """How long an abort waits for a replica's answer (it is given up after, counted)."""
        self.swap_timeout_s = swap_timeout_s
        """How long a weight update waits for one replica's swap (a long turn delays it:
        the engine drains first) before the replica counts as lost and is recovered in the
        background: one stuck replica held ``update_weights``, so the job's step loop, for
        good."""
        self.rejoin_first_s = rejoin_first_s
        """How long after a replica left its group it is first tried again (None: never);
        each failed try doubles the wait, up to ``rejoin_max_s`` (``engine.rejoin_*_s``)."""
        self.rejoin_max_s = rejoin_max_s
        self._sticky: dict[str, Replica] = {}  # trajectory id -> its replica
        self._placement_logged: set[str] = set()  # kinds of placement-policy fault logged so far
        self._load: Counter[int] = Counter()  # id(replica) -> turns in flight
        self._inflight: dict[str, dict[str, Replica]] = {}  # traj id -> {request id: replica}
        self._aborted: set[str] = set()  # trajectories aborted (until released)
        # trajectories released lately: an abort that arrives after the release (a group
        # filled while its member was finishing) has nothing to stop and must not stay in
        # _aborted for the rest of the job, which nothing would release again
        self._released: OrderedDict[str, None] = OrderedDict()
        self._latest: tuple[int, Any] | None = None  # (version, state or [ObjectRef])
        self._recovering: dict[int, asyncio.Task[None]] = {}
        self._rejoining: dict[int, asyncio.Task[None]] = {}  # replicas out of their group
        self._background: set[asyncio.Task[Any]] = set()  # aborts of turns that moved on
        # waits ended early: ("calls", id(replica)) the calls running on a replica (its drop
        # ends them), ("slot", id(replica)) the turns waiting for a slot on it (its recovery
        # or drop sends them elsewhere), ("traj", traj id) the turns of a trajectory waiting
        # for a recovery (its abort ends them)
        self._wakes = Wakes()
        # id(replica) -> request ids that may still run in its engine, though nothing waits
        # for them (it left its group meanwhile): aborted before it rejoins
        self._orphans: dict[int, set[str]] = {}
        self.version = 0
        self.metrics: Counter[str] = Counter()
        self.scheduler = scheduler
        """Admission, placement and length prediction by ``core.sched`` policies (None: every
        turn goes to its replica at once, trajectory affinity, the engine's own FIFO)."""

    # ------------------------------------------------------------------ routing
    def group_of(self, tag: str) -> str:
        return self.affinity.get(tag, self.affinity.get(DEFAULT_AFFINITY, _first(self.groups)))

    def _healthy(self, replica: Replica) -> bool:
        """Not being recovered (a recovery in progress: it may hang, or serve old weights)."""
        task = self._recovering.get(id(replica))
        return task is None or task.done()

    def _in_group(self, replica: Replica) -> bool:
        return any(replica in group for group in self.groups.values())

    async def _pick(self, traj_id: str, tag: str, sreq: Request | None) -> Replica | None:
        """The replica for the trajectory's turn among the healthy ones of its group; with
        none healthy, wait for a recovery to end and return None (the caller looks again)."""
        group = self.group_of(tag)
        replicas = self.groups.get(group) or []
        if not replicas:
            raise NoReplicaError(f"no engine replica left for tag {tag!r} (group {group!r})")
        healthy = [r for r in replicas if self._healthy(r)]
        if healthy:
            sticky = self._sticky.get(traj_id)
            if sticky is not None and sticky in replicas and sticky not in healthy:
                self.metrics["turns_rerouted"] += 1  # its replica is being recovered
            return self._route(traj_id, healthy, sreq)
        # asyncio.wait leaves the recoveries running when this caller goes away
        recoveries = [self._recovering[id(r)] for r in replicas]
        try:
            await self._wakes.wait(
                [("traj", traj_id)], asyncio.wait(recoveries, return_when=asyncio.FIRST_COMPLETED)
            )
        except Woken:
            pass  # its trajectory was aborted (the caller finds it so) or released
        return None

    def _route(self, traj_id: str, replicas: list[Replica], sreq: Request | None = None) -> Replica:
        r = self._sticky.get(traj_id)
        if self.scheduler is not None and sreq is not None:
            by_id = {id(x): x for x in replicas}
            sticky = id(r) if r is not None and r in replicas else None
            try:
                chosen = self.scheduler.place(sreq, list(by_id), sticky)
            except Exception:
                # a placement policy is pluggable code: its bug must not fail the turn, which
                # is served where affinity puts it (each kind of fault logged once, all counted)
                if "raised" not in self._placement_logged:
                    self._placement_logged.add("raised")
                    log.exception("the placement policy failed; routing by trajectory affinity instead")
                self.metrics["placement_errors"] += 1
                chosen = None
            if chosen is not None and chosen not in by_id:
                if "not a candidate" not in self._placement_logged:
                    self._placement_logged.add("not a candidate")
                    log.error(
                        "the placement policy chose replica %r, not a candidate; routing by affinity", chosen
                    )
                self.metrics["placement_errors"] += 1
                chosen = None
            if chosen is not None:
                self._sticky[traj_id] = by_id[chosen]
                return by_id[chosen]
        if r is not None and r in replicas:
            self.metrics["affinity_hits"] += 1
            return r
        r = min(replicas, key=lambda x: self._load[id(x)])
        self._sticky[traj_id] = r
        return r

    # ------------------------------------------------------------------ requests
    async def generate(self, traj_id: str, tag: str, request: GenerateRequest) -> Completion:
        """One turn of trajectory ``traj_id``. An aborted trajectory gets ``abort`` at once."""
        self._released.pop(traj_id, None)  # an id used again is live again
        sched = self.scheduler
        sreq = None
        if sched is not None:
            sreq = sched.request(
                traj_id, int(request.metadata.get("turn", 0)), _prompt_size(request), request.metadata
            )
        ready = sched.now() if sched is not None else 0.0
        rid = request.request_id
        lost = 0  # calls lost to a replica so far (rerun up to max_turn_retries times)
        while True:
            # released: its caller went away (timed out, cancelled) while this waited for a
            # recovery or a slot; rerun for nobody, the turn took a slot and left its affinity
            if traj_id in self._aborted or traj_id in self._released:
                return _aborted(request, self.version)
            replica = await self._pick(traj_id, tag, sreq)
            if replica is None:  # waited for a recovery
                continue
            if sched is not None and sreq is not None:
                try:
                    # a replica that breaks meanwhile (its recovery begins, or it leaves its
                    # group) sends the turn back to pick a healthy one, as a new turn would
                    admitted = await self._wakes.wait([("slot", id(replica))], sched.admit(id(replica), sreq))
                except Woken:
                    continue
                if not admitted:
                    return _aborted(request, self.version)
                if traj_id in self._aborted or traj_id in self._released:  # meanwhile
                    sched.done(id(replica))
                    return _aborted(request, self.version)
                if not self._healthy(replica) or not self._in_group(replica):
                    sched.done(id(replica))  # it broke while the turn waited for its slot
                    continue
            start = sched.now() if sched is not None else 0.0
            sent = request if rid == request.request_id else request.model_copy(update={"request_id": rid})
            self._inflight.setdefault(traj_id, {})[rid] = replica
            self._load[id(replica)] += 1
            # every replica holds this version (update_weights returned; a replica it missed
            # is being recovered): a turn dispatched now comes from it or a newer one
            expected = self.version
            try:
                c = await self._on(replica, replica.generate(sent))
                if c.policy_version < expected and c.finish_reason != "abort":
                    # the process died while idle and Ray restarted it before this call, which
                    # no error told: it serves its initial weights. Reloaded like a lost one
                    self.metrics["stale_weights_turns"] += 1
                    raise ReplicaLost(
                        f"{replica.name} answered with weights version {c.policy_version}, below the "
                        f"{expected} it was given: it restarted"
                    )
            except ReplicaLost as e:
                self.metrics["replica_lost"] += 1
                log.warning("replica %s lost during a turn of %s: %s", replica.name, traj_id, e)
                self._sticky.pop(traj_id, None)
                if lost == self.max_turn_retries:
                    raise
                lost += 1
                rerun_id = f"{request.request_id}#rerun{lost}"
                rid = await self._after_lost(replica, traj_id, tag, rid, rerun_id, e)
                if traj_id not in self._aborted and traj_id not in self._released:
                    self.metrics["turns_rerun"] += 1  # (else it ends aborted, next)
                continue
            finally:
                self._load[id(replica)] -= 1
                self._inflight.get(traj_id, {}).pop(sent.request_id, None)
                if sched is not None:
                    sched.done(id(replica))
            self.metrics["turns"] += 1
            self.metrics["tokens"] += len(c.token_ids)
            if sched is not None and sreq is not None:
                sched.finished_turn(traj_id, len(c.token_ids))
                sched.record(
                    trajectory=traj_id,
                    tag=tag,
                    turn=sreq.turn,
                    ready=round(ready, 6),
                    start=round(start, 6),
                    end=round(sched.now(), 6),
                    prompt_tokens=len(c.prompt_ids) or sreq.prompt_tokens,
                    gen_tokens=len(c.token_ids),
                    predicted_total=sreq.predicted_total,
                    outcome=sreq.last_outcome,
                    replica=replica.name,
                    finish=c.finish_reason,
                )
            if rid != request.request_id:
                c = c.model_copy(update={"request_id": request.request_id})
            return c

    async def _after_lost(
        self, replica: Replica, traj_id: str, tag: str, rid: str, rerun_id: str, e: ReplicaLost
    ) -> str:
        """A turn's call on ``replica`` was lost: start its recovery and say the request id
        the turn runs again under. Another healthy replica of the group runs it at once;
        without one it waits for this one's recovery (or its trajectory's abort)."""
        gone = isinstance(e, ReplicaGone)
        recovery = self._spawn_recover(replica, gone=gone)
        group = self.groups.get(self.group_of(tag)) or []
        if not gone and any(self._healthy(r) for r in group):
            # unreachable is not dead (Ray's ActorUnavailableError): its first run may go on
            # in the engine, so the rerun gets an id of its own, and the first run is
            # stopped once the replica answers again (or before it rejoins its group)
            self._in_background(self._abort_when_back(recovery, replica, rid))
            return rerun_id
        try:
            await self._wakes.wait([("traj", traj_id)], asyncio.shield(recovery))
        except Woken:
            # aborted: the turn ends now (its caller finds it so), and its first run, which
            # may go on in the engine, is stopped once the replica is back
            if not gone:
                self._in_background(self._abort_when_back(recovery, replica, rid))
            return rid
        if not self._in_group(replica):
            if not gone:
                self._orphans.setdefault(id(replica), set()).add(rid)
            return rid
        if await self._abort_one(replica, rid):
            # the first run went on in the engine, holding a batch slot to its end; it is
            # stopped, and the rerun goes under an id of its own (the engine refuses an id
            # in flight, and the stopped run leaves it only at its next step)
            return rerun_id
        return rid

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_when_back(self, recovery: asyncio.Task[None], replica: Replica, rid: str) -> None:
        await asyncio.shield(recovery)
        if self._in_group(replica):
            await self._abort_one(replica, rid)
        else:
            self._orphans.setdefault(id(replica), set()).add(rid)

    async def _on(self, replica: Replica, call: Coroutine[Any, Any, T]) -> T:
        """Await a call on ``replica``; ``ReplicaGone`` if the replica leaves its group first
        (a replica dropped while stuck: the calls running on it would never end), or had
        left it before the call (an update listed it, then its recovery dropped it before
        its swap began: no drop would end that call any more)."""
        if not self._in_group(replica):
            call.close()
            raise ReplicaGone(f"{replica.name} left its group before the call")
        try:
            return await self._wakes.wait([("calls", id(replica))], call)
        except Woken:
            raise ReplicaGone(f"{replica.name} left its group while the call ran") from None

    async def generate_many(
        self, items: list[tuple[str, str, GenerateRequest]]
    ) -> AsyncIterator[list[Answer]]:
        """Coalesced turns (see ``core.rollout.coalesce``), answered as each finishes."""
        async for answers in answer_all(
            (req.request_id, self.generate(tid, tag, req)) for tid, tag, req in items
        ):
            yield answers

    async def abort(self, traj_id: str) -> int:
        """Abort the trajectory's turn in flight (and any it starts later, until
        ``release``). Returns how many requests were stopped."""
        if traj_id in self._released:  # it ended already
            return 0
        self._aborted.add(traj_id)
        self._wakes.wake(("traj", traj_id))  # its turns waiting for a recovery end now
        if self.scheduler is not None:
            self.scheduler.cancel(traj_id)
        inflight = list(self._inflight.get(traj_id, {}).items())
        stopped = sum(await asyncio.gather(*(self._abort_one(replica, rid) for rid, replica in inflight)))
        self.metrics["aborts"] += stopped
        return stopped

    async def _abort_one(self, replica: Replica, request_id: str) -> bool:
        """One request's abort, bounded: a replica alive but stuck (a hung GPU call holding
        its loop) answers neither its turn nor the abort, and the trajectory timeout, a
        group's redundant aborts and the job's shutdown all end in this call."""
        try:
            async with asyncio.timeout(self.abort_timeout_s):
                return bool(await replica.abort(request_id))
        except ReplicaLost:
            return False  # the turn fails on its own; nothing to stop
        except TimeoutError:
            self.metrics["abort_timeouts"] += 1
            log.warning(
                "replica %s did not answer the abort of %s within %.0f s; given up",
                replica.name,
                request_id,
                self.abort_timeout_s,
            )
            return False
        except Exception as e:
            # the engine's own error (a RayTaskError): raised on, it stopped a release half-way
            # (the trajectory's affinity, abort flag and scheduler state kept for good)
            self.metrics["abort_errors"] += 1
            log.warning("replica %s failed the abort of %s: %r", replica.name, request_id, e)
            return False

    async def release(self, traj_id: str) -> None:
        """The trajectory ended: forget its affinity and abort flag. A turn of it still
        running or waiting for a slot (its caller timed out or was cancelled; a Ray call's
        remote side outlives its caller) is aborted first: it would hold its replica's batch
        slot and its scheduler slot to its end, and this is the last moment anything knows
        its request ids."""
        left = (
            bool(self._inflight.get(traj_id))
            or self._wakes.waiting(("traj", traj_id))
            or (self.scheduler is not None and self.scheduler.waiting_of(traj_id) > 0)
        )
        if left and traj_id not in self._aborted:  # abort() stopped them already otherwise
            await self.abort(traj_id)
        self._sticky.pop(traj_id, None)
        aborted = left or traj_id in self._aborted
        self._aborted.discard(traj_id)
        self._released[traj_id] = None
        if len(self._released) > RELEASED_WINDOW:
            self._released.popitem(last=False)
        self._inflight.pop(traj_id, None)
        if self.scheduler is not None:
            # an aborted (or cut-off) trajectory's length says nothing about how long it would
            # have run
            self.scheduler.release(traj_id, learn=not aborted)

    # ------------------------------------------------------------------ weights
    async def update_weights(self, version: int, state: Any) -> None:
        """Install ``state`` (a state dict, or ``[ObjectRef]`` of one) as ``version`` on every
        replica. A replica that is down gets it when it comes back."""
        if version < self.version:
            raise EngineError(f"weights version {version} is older than the proxy's {self.version}")
        previous, self._latest = self._latest, (version, state)
        t0 = time.perf_counter()
        # a replica being recovered is skipped: its recovery loads the latest weights before
        # it serves, and a stuck one held every update for swap_timeout_s again
        replicas = [r for rs in self.groups.values() for r in rs if self._healthy(r)]
        results = await asyncio.gather(
            *(self._swap_within(r, version, _unwrap(state)) for r in replicas), return_exceptions=True
        )
        for res in results:
            if isinstance(res, BaseException) and not isinstance(res, Exception):
                raise res
        lost = [(r, res) for r, res in zip(replicas, results, strict=True) if isinstance(res, ReplicaLost)]
        failed = [
            (r, res)
            for r, res in zip(replicas, results, strict=True)
            if isinstance(res, Exception) and not isinstance(res, ReplicaLost)
        ]
        for r, err in failed:
            self.metrics["swap_errors"] += 1
            log.error("replica %s failed to load weights version %d: %r", r.name, version, err)
        if failed and not any(res is None for res in results):
            # no replica took them: the weights are at fault (a shape no engine accepts), not
            # a replica; each keeps the weights it holds, and the job stops on the error
            self._latest = previous
            for r, err in lost:
                self._spawn_recover(r, gone=isinstance(err, ReplicaGone))
            raise failed[0][1]
        for r, err in lost:
            self._spawn_recover(r, gone=isinstance(err, ReplicaGone))
        # the engine's own error (out of memory while loading): left in service it would
        # serve the old weights (every turn found stale); its recovery routes around it,
        # reloads the latest, and drops it if the reload fails too
        for r, _ in failed:
            self._spawn_recover(r, gone=False)
        self.version = version
        self.metrics["weight_updates"] += 1
        self.metrics["weight_update_ms"] += round((time.perf_counter() - t0) * 1000)

    async def _swap_within(self, replica: Replica, version: int, state: Any) -> None:
        try:
            async with asyncio.timeout(self.swap_timeout_s):
                await self._on(replica, replica.swap(version, state))
        except TimeoutError:
            self.metrics["swap_timeouts"] += 1
            log.warning(
                "replica %s did not swap in weights version %d within %g s; recovering it",
                replica.name,
                version,
                self.swap_timeout_s,
            )
            took = f"the weights swap took over {self.swap_timeout_s:g} s"
            raise ReplicaLost(f"{replica.name}: {took}") from None

    # ------------------------------------------------------------------ recovery
    def _spawn_recover(self, replica: Replica, *, gone: bool) -> asyncio.Task[None]:
        task = self._recovering.get(id(replica))
        if task is None or task.done():
            task = asyncio.ensure_future(self._do_recover(replica, gone=gone))
            self._recovering[id(replica)] = task
            self._wakes.wake(("slot", id(replica)))  # its waiting turns go to a healthy one
        return task

    async def _do_recover(self, replica: Replica, *, gone: bool) -> None:
        if not self._in_group(replica):
            return  # it left its group already (its rejoin, if any, is under way)
        if gone:
            self._drop(replica, "gone for good", rejoin=False)
            return
        try:
            why = await self._revive(replica, time.monotonic() + self.recover_timeout_s)
        except ReplicaGone as e:
            self._drop(replica, f"gone for good ({e})", rejoin=False)
            return
        if why is None:
            self.metrics["replicas_recovered"] += 1
        else:
            self._drop(replica, why, rejoin=True)

    async def _revive(self, replica: Replica, deadline: float, *, retry: bool = True) -> str | None:
        """Ping the replica and load it the latest weights, a lost ping or swap tried again
        with backoff until ``deadline`` (with ``retry``): None once it is back with them, else
        why not. ``ReplicaGone`` (for good) is raised."""
        delay = 0.05
        while True:
            try:
                # bounded: a replica wedged (or on a node cut off) never answers, and the
                # deadline below is only looked at when a ping fails; the reload too (one
                # that answers pings but hangs in its swap held the recovery for good)
                async with asyncio.timeout(max(deadline - time.monotonic(), MIN_PING_S)):
                    version = await replica.ping()
                    # again after each reload: a newer version published meanwhile skipped
                    # this replica (it was being recovered, or out of its group)
                    while self._latest is not None and version < self._latest[0]:
                        version, state = self._latest
                        await replica.swap(version, _unwrap(state))
                        self.metrics["weights_reloaded"] += 1
                return None
            except TimeoutError:
                self.metrics["ping_timeouts"] += 1
                return "it did not answer (a ping, or the weights' reload) by the recover timeout"
            except ReplicaGone:
                raise
            except ReplicaLost as e:
                # a lost ping or a lost swap alike: back off and try again until the deadline
                if not retry or time.monotonic() > deadline:
                    return f"not back by the recover timeout ({e})"
                await asyncio.sleep(random.uniform(0, delay))  # full jitter
                delay = min(delay * 2, 2.0)
            except Exception as e:
                # the engine's own error (a RayTaskError: out of memory while loading): it
                # cannot serve the weights; left in its group it failed every turn sent to it
                self.metrics["recover_errors"] += 1
                return f"its reload failed: {type(e).__name__}: {e}"

    def _drop(self, replica: Replica, why: str, *, rejoin: bool) -> None:
        """Take the replica out of its group(s); the calls running on it end with
        ``ReplicaGone`` (their turns move on), and with ``rejoin`` it is tried again later."""
        homes = [g for g, rs in self.groups.items() if replica in rs]
        if not homes:
            return
        for g in homes:
            self.groups[g].remove(replica)
        self.metrics["replicas_removed"] += 1
        orphans = self._orphans.setdefault(id(replica), set())
        orphans.update(rid for calls in self._inflight.values() for rid, r in calls.items() if r is replica)
        self._wakes.wake(("calls", id(replica)))
        self._wakes.wake(("slot", id(replica)))
        again = rejoin and self.rejoin_first_s is not None
        log.error(
            "engine replica %s left its group: %s; %d replicas left%s",
            replica.name,
            why,
            self.num_replicas,
            "; it is tried again in the background" if again else "",
        )
        if again:
            self._rejoining[id(replica)] = asyncio.ensure_future(self._rejoin(replica, homes))

    async def _rejoin(self, replica: Replica, homes: list[str]) -> None:
        """Try the dropped replica again now and then: once it answers, stop what it was
        running when it left, load it the latest weights and put it back in its groups."""
        assert self.rejoin_first_s is not None
        delay = self.rejoin_first_s
        try:
            while True:
                await asyncio.sleep(random.uniform(delay / 2, delay))
                delay = min(delay * 2, self.rejoin_max_s)
                # one try each time (a replica out of restarts answers every ping at once with
                # ReplicaLost), bounded by the recover timeout (a wedged one never answers)
                deadline = time.monotonic() + self.recover_timeout_s
                try:
                    if await self._revive(replica, deadline, retry=False) is not None:
                        continue
                    orphans = self._orphans.pop(id(replica), set())
                    await asyncio.gather(*(self._abort_one(replica, rid) for rid in orphans))
                    # the aborts took a while: weights published meanwhile are loaded too
                    if await self._revive(replica, deadline, retry=False) is not None:
                        continue
                except ReplicaGone as e:
                    log.error("engine replica %s is gone for good: %s", replica.name, e)
                    return
                # no await since the last check of its weights: it joins with the latest
                for g in homes:
                    self.groups.setdefault(g, []).append(replica)
                self.metrics["replicas_rejoined"] += 1
                log.warning("engine replica %s is back; %d replicas", replica.name, self.num_replicas)
                return
        finally:
            self._rejoining.pop(id(replica), None)

    async def aclose(self) -> None:
        """Stop the background work: recoveries, rejoins, aborts of turns that moved on."""
        tasks = [*self._recovering.values(), *self._rejoining.values(), *self._background]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.scheduler is not None:
            self.scheduler.close()

    # ------------------------------------------------------------------ introspection
    @property
    def num_replicas(self) -> int:
        return sum(len(rs) for rs in self.groups.values())

    def stats(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "replicas": {g: [r.name for r in rs] for g, rs in self.groups.items()},
            "trajectories": len(self._sticky),
            **self.metrics,
            **({"scheduler": self.scheduler.stats()} if self.scheduler is not None else {}),
        }


def _first(groups: Mapping[str, Any]) -> str:
    return DEFAULT_AFFINITY if DEFAULT_AFFINITY in groups else next(iter(groups))


def _prompt_size(request: GenerateRequest) -> int:
    """A turn's prompt size before the engine tokenises it: ids, or characters of the chat
    (the predictor reads it on a log scale, so a consistent measure is what matters)."""
    if request.prompt_ids is not None:
        return len(request.prompt_ids)
    return sum(len(m.content or "") for m in request.messages or [])


def _unwrap(state: Any) -> Any:
    # ``[ObjectRef]`` stays wrapped through the proxy (Ray would resolve a bare ref in each
    # hop); the replica call unwraps it so Ray resolves it once, in the replica's process
    if isinstance(state, list) and len(state) == 1:
        return state[0]
    return state


#: The least time a recovery's ping is given, even at its deadline (one last chance).
MIN_PING_S = 1.0

#: Released trajectory ids the proxy remembers (the newest), so a late abort is not kept.
RELEASED_WINDOW = 65_536


def _aborted(request: GenerateRequest, version: int) -> Completion:
    return Completion(
        request_id=request.request_id,
        text="",
        prompt_ids=list(request.prompt_ids or []),
        token_ids=[],
        logprobs=[],
        policy_version=version,
        finish_reason="abort",
        allowed_token_ids=request.allowed_token_ids,
        metadata=request.metadata,
    )
