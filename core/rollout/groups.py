"""Groups of rollouts: redundancy with prompt abort, re-runs of failures, stale aborts.

    runner = GroupRunner(cfg, manager, proxy, submit=stream.submit)
    runner.start(task_env, seed, group_id, version)    # group_size + redundancy trajectories
    runner.reward_failed(sample)                       # a scored-out member: run another
    runner.abort_group(gid, "stale")                   # the buffer's on_abort callback

A group runs ``group_size + redundancy`` trajectories of one task. The first ``group_size``
to finish (``ok`` or ``truncated``) go to the reward stream; at that moment the others are
aborted at once: their LLM request (the proxy answers ``abort``) and their environment
session (the task is cancelled, the session context releases the container). A trajectory
that finishes in the race after the group filled is dropped here (``extra``), so no group
ever sends more than ``group_size`` trajectories to be scored.

An ``infra_failed`` trajectory goes to the stream too (the buffer counts it, masked) and,
while the group is short of ``group_size`` finished-or-running trajectories, a replacement
starts (same task, new trajectory id); so does one for a member whose reward failed. A
member whose abort was asked for counts as gone at once (a group that filled, then lost a
member to a failed reward, does not wait for its redundant rollouts' aborts to go through,
and never takes one that finishes in that race). After
``rollout.max_reruns`` replacements the group is given up (its members are aborted; the
buffer's bound drops what it had).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from core.buffer import AbortReason
from core.config import EnvConfig, JobConfig
from core.errors import DiskFullError, ProxyDiedError
from core.rollout.env_manager import EnvManager, ProxyLike, Task, TurnBarrier
from core.sample import Sample
from fabric.protocol import Trajectory

log = logging.getLogger(__name__)


@dataclass
class GroupState:
    id: str
    env: EnvConfig
    seed: int
    version: int
    barrier: TurnBarrier | None = None
    running: dict[str, asyncio.Task[Trajectory]] = field(default_factory=dict)
    aborting: set[str] = field(default_factory=set)
    """Members of ``running`` whose abort was asked for: they no longer count toward the group
    (a group reopened by a failed reward while they are being stopped needs a replacement
    now, not when their abort, a Ray round trip, is through)."""
    finished: int = 0
    reruns: int = 0
    closed: str | None = None
    """Why no more trajectories of this group are wanted: ``full``, ``stale``, ``given_up``."""
    last_error: str | None = None
    """Why its last member failed (infra_failed, reward_failed, a manager bug): said when the
    group is given up."""


class GroupRunner:
    def __init__(
        self,
        cfg: JobConfig,
        manager: EnvManager,
        proxy: ProxyLike,
        *,
        submit: Callable[[Trajectory], object],
        on_finished: Callable[[Trajectory], None] | None = None,
        on_given_up: Callable[[GroupState], None] | None = None,
        on_cancelled: Callable[[str], None] | None = None,
    ):
        self.cfg = cfg
        self.manager = manager
        self.proxy = proxy
        self.submit = submit
        self.on_finished = on_finished
        """Called with every trajectory that ends (any status): the job's accounting."""
        self.on_cancelled = on_cancelled
        """Called with the id of every run cancelled before it ended (a redundant member or a
        stale group's, aborted inside an environment step): it ends with no trajectory, and
        the job's accounting counts it aborted, as one stopped at its LLM turn."""
        self.on_given_up = on_given_up
        """Called when a group is given up (out of re-runs): the job starts another."""
        self.groups: dict[str, GroupState] = {}
        self.changed = asyncio.Event()
        """Set whenever a group fills or closes (the launcher waits on it)."""
        self.metrics: Counter[str] = Counter()
        self.aborted_ids: set[str] = set()
        """The trajectories this runner aborted or asked to stop (the job checks none of them
        is trained on), until their version falls out of the asynchronous bound
        (``forget_aborted_before``)."""
        self._aborted_by_version: dict[int, list[str]] = {}
        self._aborting: set[asyncio.Task[None]] = set()
        self._closing = False  # set by aclose: a shutdown launches nothing new

    # ------------------------------------------------------------------ starting
    def start(
        self,
        env: EnvConfig,
        seed: int,
        version: int,
        *,
        group_id: str | None = None,
        barrier: TurnBarrier | None = None,
    ) -> GroupState:
        gid = group_id or uuid.uuid4().hex[:12]
        g = GroupState(gid, env, seed, version, barrier)
        self.groups[gid] = g
        self.metrics["groups_started"] += 1
        for _ in range(self.cfg.group_size + self.cfg.redundancy):
            self._launch(g)
        return g

    def _launch(self, g: GroupState) -> None:
        traj_id = uuid.uuid4().hex
        if g.barrier is not None:
            g.barrier.join()
        task = asyncio.create_task(
            self.manager.run(
                Task(g.env, g.seed, g.id), version=g.version, traj_id=traj_id, barrier=g.barrier
            ),
            name=f"traj-{traj_id[:8]}",
        )
        g.running[traj_id] = task
        self.metrics["trajectories_started"] += 1
        task.add_done_callback(functools.partial(self._done, g, traj_id))

    # ------------------------------------------------------------------ outcomes
    def _done(self, g: GroupState, traj_id: str, task: asyncio.Task[Trajectory]) -> None:
        g.running.pop(traj_id, None)
        dropped = traj_id in g.aborting  # this runner asked it to stop: it is no member any more
        g.aborting.discard(traj_id)
        if task.cancelled():
            self.metrics["aborted"] += 1
            if self.on_cancelled is not None:
                self.on_cancelled(traj_id)
            self._aborted(g, traj_id)
            # an open group that loses a member (cancelled from outside the runner) needs
            # another, or it waits forever for a trajectory nobody runs
            self._maybe_rerun(g)
            self._after(g)
            return
        exc = task.exception()
        if isinstance(exc, ProxyDiedError | DiskFullError):
            # the job stops on it (RemoteProxy.on_died, on_disk_full); a re-run would fail the
            # same way, and a traceback logged for every trajectory in flight said nothing more
            self.metrics["proxy_died" if isinstance(exc, ProxyDiedError) else "disk_full"] += 1
            g.last_error = f"{type(exc).__name__}: {exc}"
            self._after(g)
            return
        if exc is not None:  # a bug in the manager: keep the job going, count it loudly
            log.error("trajectory %s raised", traj_id, exc_info=exc)
            self.metrics["errors"] += 1
            g.last_error = f"{type(exc).__name__}: {exc}"
            self._maybe_rerun(g)
            self._after(g)
            return
        traj = task.result()
        if self.on_finished is not None:
            self.on_finished(traj)
        self.metrics[traj.status] += 1
        if traj.status == "aborted" or dropped:
            # one asked to stop that finished in the race is no member either: the job's
            # check that nothing aborted is trained covers it too
            self._aborted(g, traj_id)
        if traj.status in ("ok", "truncated"):
            if g.closed is not None or dropped:
                # finished in the race after the group filled (its abort came too late); a
                # group reopened meanwhile has launched its replacement already
                self.metrics["extra"] += 1
            else:
                g.finished += 1
                self.submit(traj)
                if g.finished >= self.cfg.group_size:
                    self._close(g, "full")
        elif traj.status == "infra_failed":
            g.last_error = str(traj.info.get("error") or "infra_failed")
            self.submit(traj)  # masked: the buffer counts it, never scores it
            self._maybe_rerun(g)
        else:
            # aborted: the group (or the bound) asked for it, and then the group is closed or
            # replaced it already; an open group that lost it otherwise needs another
            self._maybe_rerun(g)
        self._after(g)

    def _aborted(self, g: GroupState, traj_id: str) -> None:
        self.aborted_ids.add(traj_id)
        self._aborted_by_version.setdefault(g.version, []).append(traj_id)

    def forget_aborted_before(self, version: int) -> None:
        """Drop the aborted ids of groups started under an older version than ``version``
        (the buffer's bound after an advance): the buffer never serves such a group, so the
        job's check needs them no more. A long job's set stays as small as the bound's
        window (about ``alpha + 1`` steps' redundant aborts), not every abort since it began."""
        for v in [v for v in self._aborted_by_version if v < version]:
            self.aborted_ids.difference_update(self._aborted_by_version.pop(v))

    def reward_failed(self, sample: Sample) -> None:
        """A member's reward failed for good (masked): the group needs another trajectory."""
        g = self.groups.get(sample.group_id)
        if g is None or g.closed in ("stale", "given_up"):
            return
        g.finished -= 1
        g.last_error = f"reward_failed, rewards.{sample.tag}: {sample.error}"  # (as the tally's)
        if g.closed == "full":
            g.closed = None
        self._maybe_rerun(g)

    def _maybe_rerun(self, g: GroupState) -> None:
        live = len(g.running) - len(g.aborting)  # members being aborted will not finish
        # closing, cancellations are the shutdown's (Ctrl-C): a replacement would only start
        # an environment session nobody will wait for
        if self._closing or g.closed is not None or g.finished + live >= self.cfg.group_size:
            return
        if g.reruns >= self.cfg.rollout.max_reruns:
            # with its last error: "given up" alone sent the user looking for a cause that
            # was logged nowhere (an environment that raised on some seeds)
            log.warning(
                "group %s given up after %d re-runs; the last error: %s", g.id, g.reruns, g.last_error
            )
            self.metrics["given_up"] += 1
            self._close(g, "given_up")
            if self.on_given_up is not None:
                self.on_given_up(g)
            self._after(g)  # nothing may be running (a reward failed late): forget it now
            return
        g.reruns += 1
        self.metrics["reruns"] += 1
        self._launch(g)

    def _after(self, g: GroupState) -> None:
        if not g.running and g.closed is not None and g.closed != "full":
            self.groups.pop(g.id, None)
        self.changed.set()

    # ------------------------------------------------------------------ aborting
    def abort_group(self, gid: str, reason: AbortReason) -> None:
        """The buffer's ``on_abort``: ``complete`` (scored and ready: forget the group) or
        ``stale`` (out of the asynchronous bound: stop its rollouts)."""
        g = self.groups.get(gid)
        if g is None:
            return
        if reason == "complete":
            self._close(g, g.closed or "full")
            self.groups.pop(gid, None)
            return
        self.metrics["stale_groups"] += 1
        self._close(g, "stale")
        self._after(g)  # forgotten now if nothing runs; else when its last rollout ends

    def _close(self, g: GroupState, why: str) -> None:
        first = g.closed is None
        g.closed = why
        # members whose abort is in flight already (a group that filled, reopened on a failed
        # reward and fills again) are neither aborted nor counted twice
        stopping = [(tid, task) for tid, task in g.running.items() if tid not in g.aborting]
        if first and why == "full" and stopping:
            self.metrics["redundant_aborted"] += len(stopping)
        for traj_id, task in stopping:
            g.aborting.add(traj_id)
            t = asyncio.ensure_future(self._abort(traj_id, task))
            self._aborting.add(t)
            t.add_done_callback(self._aborting.discard)
        self.changed.set()

    async def _abort(self, traj_id: str, task: asyncio.Task[Trajectory]) -> None:
        with contextlib.suppress(Exception):
            await self.proxy.abort(traj_id)  # stops the turn in flight on its engine replica
        # cancelling also stops a trajectory inside a (slow) environment step, and its
        # session context releases the container; cancelling alone would not reach the
        # engine (a Ray call's remote side runs on when its caller stops waiting)
        if not task.done():
            task.cancel()

    # ------------------------------------------------------------------ introspection
    def rolling_groups(self) -> int:
        """Groups still short of ``group_size`` finished trajectories."""
        return sum(1 for g in self.groups.values() if g.closed is None)

    def running(self) -> int:
        return sum(len(g.running) for g in self.groups.values())

    async def aclose(self) -> None:
        """Stop every rollout, each by one path. A running trajectory is cancelled, which
        ends its environment step and session; its release then aborts the turn it left in
        flight (the proxy's ``release`` does, as for any cancelled trajectory). One whose abort
        is in flight already (a redundant member, a stale group's) is left to that abort,
        which cancels it next. Closing the groups the usual way (``_close``) added an abort
        of its own to every cancelled one: two aborts of each turn in flight, both reaching
        the engine under Ray (an async actor runs a caller's calls in no guaranteed order,
        so the release's came before the abort could mark the trajectory aborted)."""
        self._closing = True
        tasks: list[asyncio.Task[Trajectory]] = []
        for g in list(self.groups.values()):
            g.closed = "given_up"
            for traj_id, task in g.running.items():
                tasks.append(task)
                if traj_id not in g.aborting:
                    task.cancel()
        self.changed.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        # aborts started meanwhile (a trajectory's end can close its group) are awaited
        # too: one left unstarted when the loop closes is a coroutine never awaited
        while self._aborting:
            await asyncio.gather(*self._aborting, return_exceptions=True)
        drain = getattr(self.manager, "drain", None)
        if drain is not None:
            await drain()
