"""The LLM proxy's recovery of lost replicas: wait for Ray's restart, reload the latest
weights, drop a replica that does not come back, and let it rejoin once it answers (see
``core.rollout.llm_proxy``, "Replica loss")."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Coroutine
from typing import Any

from core.rollout.proxy_state import ProxyState, _unwrap
from core.rollout.replica_base import Replica, ReplicaEngineDead, ReplicaGone, ReplicaLost
from core.rollout.wakes import Woken

# one logger for the proxy, whichever of its modules speaks
log = logging.getLogger("core.rollout.llm_proxy")

#: The least time a recovery's ping is given, even at its deadline (one last chance).
MIN_PING_S = 1.0


class ProxyRecovery(ProxyState):
    """Replica loss: a lost turn moves on or waits, the replica is recovered (pinged,
    reloaded) or dropped, and a dropped one rejoins when it answers again."""

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
                self._orphan(replica, rid)
            # a replica that will rejoin aborts ``rid`` first, and its actor remembers an id
            # its abort found nowhere (answering it aborted when it comes): the turn moves
            # on under an id of its own, which a later loss can send back to that replica
            return rerun_id if id(replica) in self._rejoining else rid
        # the first run may have gone on in the engine, holding a batch slot to its end: it
        # is stopped, and the rerun goes under an id of its own whether or not the abort
        # found it (the engine refuses an id in flight, and a stopped run leaves it only at
        # its next step; a replica actor answers an id it was asked to abort and did not
        # know as aborted, since the abort may have overtaken its turn)
        await self._abort_one(replica, rid)
        return rerun_id

    def _after_last_loss(self, replica: Replica, rid: str, e: ReplicaLost) -> None:
        """A turn's call on ``replica`` was lost for the last time (the turn fails): the
        replica's recovery starts and the lost run is stopped once it answers, as after any
        other loss (``_after_lost``), without the turn waiting for either."""
        gone = isinstance(e, ReplicaGone)
        recovery = self._spawn_recover(replica, gone=gone)
        if not gone:
            self._in_background(self._abort_when_back(recovery, replica, rid))

    def _in_background(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_when_back(self, recovery: asyncio.Task[None], replica: Replica, rid: str) -> None:
        await asyncio.shield(recovery)
        if self._in_group(replica):
            await self._abort_one(replica, rid)
        else:
            self._orphan(replica, rid)

    def _orphan(self, replica: Replica, rid: str) -> None:
        """Remember ``rid`` to abort before the replica, out of its group, rejoins; one that
        never will is sent the abort now if it may be alive (no rejoin), and keeps nothing
        (its ids were kept for the job's life)."""
        if id(replica) in self._rejoining:
            self._orphans.setdefault(id(replica), set()).add(rid)
        elif id(replica) in self._never_back:
            self._stop_left(replica, {rid})

    def _stop_left(self, replica: Replica, rids: set[str]) -> None:
        """Abort what a replica dropped for good was left running, in the background: its
        turns moved to other replicas, and, alive, it ran them on to ``max_new_tokens`` for
        nobody, on a card it may share with the trainer or another replica. The ids that
        turn up while an abort is under way go in the next round (``_stop_rounds``)."""
        if not rids:
            return
        pending = self._to_stop.get(id(replica))
        if pending is not None:
            pending.update(rids)
            return
        self._to_stop[id(replica)] = set(rids)
        self._in_background(self._stop_rounds(replica))

    async def _stop_rounds(self, replica: Replica) -> None:
        """Best effort and bounded: each round sends every abort at once, within one
        ``abort_timeout_s`` (a replica dropped for not answering answers no abort either:
        one warning, not one per turn), and a replica that does not answer, or is down, is
        sent none again."""
        key = id(replica)
        try:
            while rids := self._to_stop.get(key):
                self._to_stop[key] = set()
                try:
                    async with asyncio.timeout(self.abort_timeout_s):
                        results = await asyncio.gather(
                            *(replica.abort(rid) for rid in rids), return_exceptions=True
                        )
                except TimeoutError:
                    self.metrics["abort_timeouts"] += 1
                    self._never_back.pop(key, None)
                    log.warning(
                        "engine replica %s, dropped, did not answer the aborts of the %d turns it "
                        "was left running within %g s; given up (they run on to their end there)",
                        replica.name,
                        len(rids),
                        self.abort_timeout_s,
                    )
                    return
                for res in results:
                    if isinstance(res, BaseException) and not isinstance(res, Exception):
                        raise res
                self.metrics["left_running_aborted"] += sum(res is True for res in results)
                errors = [res for res in results if isinstance(res, Exception)]
                if any(isinstance(res, ReplicaLost) for res in errors):
                    self._never_back.pop(key, None)  # down or cut off: none is sent again
                    return
                if errors:
                    self.metrics["abort_errors"] += len(errors)
                    log.warning(
                        "engine replica %s, dropped, failed %d aborts: %r",
                        replica.name,
                        len(errors),
                        errors[0],
                    )
        finally:
            self._to_stop.pop(key, None)

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
            if self._undecided:
                # an update under way publishes its weights once a replica takes them, and
                # none if every one refuses them: this replica would otherwise load weights
                # that may never be published. Awaited (a swap's time, swap_timeout_s at
                # most) off the deadline: the wait is the update's, not this replica's
                waited = time.monotonic()
                await self._decided.wait()
                deadline += time.monotonic() - waited
            try:
                # bounded: a replica wedged (or on a node cut off) never answers, and the
                # deadline below is only looked at when a ping fails; the reload too (one
                # that answers pings but hangs in its swap held the recovery for good)
                async with asyncio.timeout(max(deadline - time.monotonic(), MIN_PING_S)):
                    try:
                        version = await replica.ping()
                    except ReplicaEngineDead as e:
                        # its process is up, its engine is not: restarted (a Ray actor exits
                        # for Ray to restart it; the pings below wait for the new one)
                        why = await self._restart(replica, e)
                        if why is not None:
                            return why
                        version = await replica.ping()
                    # again after each reload: a newer version published meanwhile skipped
                    # this replica (it was being recovered, or out of its group)
                    while self._latest is not None and version < self._latest[0]:
                        version, state = self._latest
                        await replica.swap(version, _unwrap(state))
                        self.metrics["weights_reloaded"] += 1
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
                continue
            except Exception as e:
                # the engine's own error (a RayTaskError: out of memory while loading): it
                # cannot serve the weights; left in its group it failed every turn sent to it
                self.metrics["recover_errors"] += 1
                return f"its reload failed: {type(e).__name__}: {e}"
            if self._undecided:
                continue  # one began meanwhile (it skipped this replica): wait for it
            if version > (self._latest[0] if self._latest is not None else self.version):
                # the swap of an update every other replica refused was lost on its way back,
                # yet loaded: an engine never goes back to older weights, so it serves none
                # until a newer version is published (its rejoin loads that)
                return f"it holds weights version {version}, which were refused (never published)"
            return None  # no await since the last check: it holds the published weights

    async def _restart(self, replica: Replica, e: ReplicaEngineDead) -> str | None:
        """Restart the replica's dead engine: None once asked, else why it failed (the
        engine's own error: it cannot serve, and is dropped as a failed reload is)."""
        done = self._engine_restarts[id(replica)]
        if done >= self.max_engine_restarts:
            # an engine that dies after every restart (a model that no longer fits, a bad
            # driver) was restarted for good, a model load each time: it leaves, as a Ray
            # actor out of max_restarts does
            raise ReplicaGone(
                f"its engine died again after {done} restart(s) (engine.max_restarts: "
                f"{self.max_engine_restarts}): {e}"
            )
        self._engine_restarts[id(replica)] = done + 1
        self.metrics["engine_restarts"] += 1
        log.warning("engine replica %s: its engine is dead (%s); restarting it", replica.name, e)
        try:
            await replica.restart()
        except ReplicaLost:
            raise
        except Exception as err:
            self.metrics["recover_errors"] += 1
            return f"its engine died and its restart failed: {type(err).__name__}: {err}"
        return None

    def _drop(self, replica: Replica, why: str, *, rejoin: bool) -> None:
        """Take the replica out of its group; the calls running on it end with
        ``ReplicaGone`` (their turns move on), and with ``rejoin`` it is tried again later."""
        home = next((g for g, rs in self.groups.items() if replica in rs), None)
        if home is None:
            return
        self.groups[home].remove(replica)
        self.metrics["replicas_removed"] += 1
        again = rejoin and self.rejoin_first_s is not None
        running = {rid for calls in self._inflight.values() for rid, r in calls.items() if r is replica}
        if again:
            self._orphans.setdefault(id(replica), set()).update(running)
        elif rejoin:
            # never tried again, yet maybe alive (its reload failed, it answered too late):
            # what it runs is stopped now, not at a rejoin that never comes (a replica gone
            # for good has nothing running)
            self._never_back[id(replica)] = replica
            self._stop_left(replica, running)
        self._left[home] = f"{replica.name}: {why}" + (
            "; it is tried again in the background" if again else ""
        )
        self._wakes.wake(("calls", id(replica)))
        self._wakes.wake(("slot", id(replica)))
        log.error(
            "engine replica %s left its group: %s; %d replicas left%s",
            replica.name,
            why,
            self.num_replicas,
            "; it is tried again in the background" if again else "",
        )
        if again:
            self._rejoining[id(replica)] = asyncio.ensure_future(self._rejoin(replica, home))

    async def _rejoin(self, replica: Replica, home: str) -> None:
        """Try the dropped replica again now and then: once it answers, stop what it was
        running when it left, load it the latest weights and put it back in its group."""
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
                self.groups[home].append(replica)
                self.metrics["replicas_rejoined"] += 1
                log.warning("engine replica %s is back; %d replicas", replica.name, self.num_replicas)
                return
        finally:
            self._rejoining.pop(id(replica), None)
            left = self._orphans.pop(id(replica), set())
            if self._in_group(replica):
                # recorded while the aborts above ran (a recovery that ended meanwhile)
                for rid in left:
                    self._in_background(self._abort_one(replica, rid))
            # else gone for good (or the proxy closes): they are never aborted
