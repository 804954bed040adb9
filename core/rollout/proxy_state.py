"""The LLM proxy's state: its replicas and groups, trajectories, turns in flight, latest
weights, recoveries and metrics, with the helpers every part of it uses (see
``core.rollout.llm_proxy``)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from core.rollout import engine_defaults
from core.rollout.engine_defaults import DEFAULT_AFFINITY
from core.rollout.replica_base import Replica, ReplicaGone, ReplicaLost
from core.rollout.scheduling import TurnScheduler
from core.rollout.wakes import Wakes, Woken

# one logger for the proxy, whichever of its modules speaks
log = logging.getLogger("core.rollout.llm_proxy")

T = TypeVar("T")

if TYPE_CHECKING:
    from core.config_sections import EngineConfig

#: The proxy's settings default to the job config's ``engine`` section's, read from the
#: module ``EngineConfig`` reads them from (one place says them): building ``EngineConfig()``
#: here imported the job config's pydantic models into the proxy's and every engine
#: replica's actor, a third of a second of CPU each at every job start.
_DEFAULTS = engine_defaults


def proxy_options(engine: EngineConfig) -> dict[str, Any]:
    """The ``LLMProxy`` keyword arguments the job config's ``engine`` section sets."""
    return {
        "recover_timeout_s": engine.recover_timeout_s,
        "max_engine_restarts": engine.max_restarts,
        "swap_timeout_s": engine.swap_timeout_s,
        "rejoin_first_s": engine.rejoin_first_s,
        "rejoin_max_s": engine.rejoin_max_s,
    }


class ProxyState:
    """The proxy's state and the small helpers every part of it uses (``LLMProxy`` is
    built of ``ProxyRouting``, ``ProxyWeights`` and ``ProxyRecovery`` over this)."""

    def __init__(
        self,
        groups: Mapping[str, Sequence[Replica]],
        *,
        affinity: Mapping[str, str] | None = None,
        recover_timeout_s: float = _DEFAULTS.RECOVER_TIMEOUT_S,
        max_engine_restarts: int = _DEFAULTS.MAX_RESTARTS,
        max_turn_retries: int = 3,
        scheduler: TurnScheduler | None = None,
        abort_timeout_s: float = 30.0,
        swap_timeout_s: float = _DEFAULTS.SWAP_TIMEOUT_S,
        rejoin_first_s: float | None = _DEFAULTS.REJOIN_FIRST_S,
        rejoin_max_s: float = _DEFAULTS.REJOIN_MAX_S,
    ):
        if not groups or not any(groups.values()):
            raise ValueError("the proxy needs at least one replica")
        self.groups: dict[str, list[Replica]] = {g: list(rs) for g, rs in groups.items()}
        # a group is a hardware kind, so a replica belongs to one: listed twice, each weight
        # update swapped it twice and num_replicas counted it twice
        home: dict[int, str] = {}
        for g, rs in self.groups.items():
            for r in rs:
                if id(r) in home:
                    raise ValueError(
                        f"replica {r.name} is listed twice (groups {home[id(r)]!r} and {g!r}): "
                        "give each group replicas of its own"
                    )
                home[id(r)] = g
        self.affinity = dict(affinity or {})
        unknown = sorted(set(self.affinity.values()) - set(self.groups))
        if unknown:
            raise ValueError(f"hw_affinity names groups without replicas: {unknown}")
        self.recover_timeout_s = recover_timeout_s
        self.max_engine_restarts = max_engine_restarts
        """How many times a replica's dead engine is restarted (as Ray restarts a dead
        process ``max_restarts`` times); one that dies again after that leaves for good."""
        self._engine_restarts: Counter[int] = Counter()  # id(replica) -> its engine's restarts
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
        # request ids whose abort is on its way, or stopped them (until their call ends): a
        # release and an abort that overlap (Ray runs an actor's calls in any order) both
        # found the turn in flight, and both aborts reached the engine
        self._stopping: set[str] = set()
        # trajectories released lately, with the last turn number they had sent here (-1:
        # none). Ray runs an actor's calls in any order: an abort that arrives after the
        # release (a group filled while its member was finishing) has nothing to stop and
        # must not stay in _aborted for the rest of the job, which nothing would release
        # again; a turn that arrives after it (its caller timed out or was cancelled as it
        # sent it) must not run for nobody (see ProxyRouting.generate)
        self._released: OrderedDict[str, int] = OrderedDict()
        self._turns: dict[str, int] = {}  # traj id -> the last turn number it sent (until released)
        self._latest: tuple[int, Any] | None = None  # (version, state or [ObjectRef]) published
        # weight updates under way whose weights no replica took yet (they may be refused)
        self._undecided = 0
        self._decided = asyncio.Event()  # set while there is none
        self._decided.set()
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
        # replicas dropped and never tried again (engine.rejoin_first_s null) that may be
        # alive (a reload failed, a ping went unanswered): what they were left running is
        # aborted at once (``ProxyRecovery._stop_left``), until one does not answer
        self._never_back: dict[int, Replica] = {}
        # id(replica) -> request ids of such a replica waiting for the aborts under way
        self._to_stop: dict[int, set[str]] = {}
        # group -> which of its replicas left it last, and why: what ``NoReplicaError`` says
        # once the group is empty (the job's RolloutError quotes that error, not the log)
        self._left: dict[str, str] = {}
        self.version = 0
        self.metrics: Counter[str] = Counter()
        self.scheduler = scheduler
        """Admission, placement and length prediction by ``core.sched`` policies (None: every
        turn goes to its replica at once, trajectory affinity, the engine's own FIFO)."""

    def group_of(self, tag: str) -> str:
        return self.affinity.get(tag, self.affinity.get(DEFAULT_AFFINITY, _first(self.groups)))

    def _healthy(self, replica: Replica) -> bool:
        """Not being recovered (a recovery in progress: it may hang, or serve old weights)."""
        task = self._recovering.get(id(replica))
        return task is None or task.done()

    def _in_group(self, replica: Replica) -> bool:
        return any(replica in group for group in self.groups.values())

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

    @property
    def num_replicas(self) -> int:
        return sum(len(rs) for rs in self.groups.values())


def _first(groups: Mapping[str, Any]) -> str:
    return DEFAULT_AFFINITY if DEFAULT_AFFINITY in groups else next(iter(groups))


def _unwrap(state: Any) -> Any:
    # ``[ObjectRef]`` stays wrapped through the proxy (Ray would resolve a bare ref in each
    # hop); the replica call unwraps it so Ray resolves it once, in the replica's process
    if isinstance(state, list) and len(state) == 1:
        return state[0]
    return state
