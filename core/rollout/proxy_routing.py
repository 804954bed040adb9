"""The LLM proxy's routing of turns to replicas, admission to their slots, aborts and
releases (see ``core.rollout.llm_proxy``, "Routing")."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from core.rollout.coalesce import Answer, answer_all
from core.rollout.engines.base import Completion, GenerateRequest
from core.rollout.proxy_recovery import ProxyRecovery
from core.rollout.replica_base import NoReplicaError, Replica, ReplicaLost
from core.rollout.wakes import Woken
from core.sched import Request

# one logger for the proxy, whichever of its modules speaks
log = logging.getLogger("core.rollout.llm_proxy")

#: Released trajectory ids the proxy remembers (the newest), so a late abort is not kept
#: and a late turn is not run.
RELEASED_WINDOW = 65_536


class ProxyRouting(ProxyRecovery):
    """Turns: each to a healthy replica of its tag's group (trajectory affinity, the turn
    scheduler's admission and placement), rerun when its replica is lost; aborts and
    releases of trajectories."""

    async def _pick(self, traj_id: str, tag: str, sreq: Request | None) -> Replica | None:
        """The replica for the trajectory's turn among the healthy ones of its group; with
        none healthy, wait for a recovery to end and return None (the caller looks again)."""
        group = self.group_of(tag)
        replicas = self.groups.get(group) or []
        if not replicas:
            left = self._left.get(group)
            why = f"the last to leave it, {left}" if left is not None else "it was given none"
            raise NoReplicaError(
                f"no engine replica left for tag {tag!r} (group {group!r}); {why}. "
                "A replica slow to restart (a large model's load) needs a longer "
                "engine.recover_timeout_s; the proxy's log says why each one left"
            )
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

    async def generate(self, traj_id: str, tag: str, request: GenerateRequest) -> Completion:
        """One turn of trajectory ``traj_id``. An aborted trajectory gets ``abort`` at once,
        and so does a turn sent before its trajectory's release that arrives after it."""
        turn = _turn_of(request)
        released = self._released.get(traj_id)
        if released is not None:
            # Ray runs an actor's calls in any order: a caller that went away (timed out,
            # cancelled) as it sent this turn released the trajectory, and the release ran
            # first. The env manager numbers a trajectory's turns 0, 1, ... and sends one
            # only once the previous one was answered, from here: every turn but the last
            # reached the proxy before the release, so one numbered above the last seen was
            # sent before it. Run, it held a slot for nobody and left the affinity, the
            # scheduler's state and the load the release had cleared. An id used again (the
            # job never does: one uuid per trajectory, re-runs included) starts over at 0.
            if turn > released:
                self.metrics["turns_after_release"] += 1
                return Completion.not_run(request, self.version)
            del self._released[traj_id]  # an id used again is live again
        self._turns[traj_id] = max(turn, self._turns.get(traj_id, -1))
        sched = self.scheduler
        sreq = None
        if sched is not None:
            sreq = sched.request(traj_id, turn, _prompt_size(request), request.metadata)
        ready = sched.now() if sched is not None else 0.0
        rid = request.request_id
        lost = 0  # calls lost to a replica so far (rerun up to max_turn_retries times)
        while True:
            # released: its caller went away (timed out, cancelled) while this waited for a
            # recovery or a slot; rerun for nobody, the turn took a slot and left its affinity
            if traj_id in self._aborted or traj_id in self._released:
                return Completion.not_run(request, self.version)
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
                    return Completion.not_run(request, self.version)
                if traj_id in self._aborted or traj_id in self._released:  # meanwhile
                    sched.done(id(replica))
                    return Completion.not_run(request, self.version)
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
                    # the turn fails; its replica is recovered and the run it lost stopped all
                    # the same (left as it was, the replica stayed in routing as if healthy, and
                    # an unreachable one ran that turn on for nobody)
                    self._after_last_loss(replica, rid, e)
                    raise
                lost += 1
                rerun_id = f"{request.request_id}#rerun{lost}"
                # its first run is no longer the trajectory's to abort: _after_lost stops it
                # once the replica is back (an abort now reached a replica down, then it was
                # stopped again)
                self._inflight.get(traj_id, {}).pop(rid, None)
                rid = await self._after_lost(replica, traj_id, tag, rid, rerun_id, e)
                if traj_id not in self._aborted and traj_id not in self._released:
                    self.metrics["turns_rerun"] += 1  # (else it ends aborted, next)
                continue
            finally:
                self._load[id(replica)] -= 1
                self._inflight.get(traj_id, {}).pop(sent.request_id, None)
                self._stopping.discard(sent.request_id)
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
        calls = self._inflight.get(traj_id, {})
        # a replica dropped an instant ago still has the turns it ran listed here, until they
        # wake and clean up: they end without it (aborted, the trajectory finds), and its run
        # is stopped before the replica rejoins (a stuck one held this abort, too)
        inflight = [(rid, r) for rid, r in calls.items() if rid not in self._stopping and self._in_group(r)]
        stopped = sum(await asyncio.gather(*(self._stop(traj_id, r, rid) for rid, r in inflight)))
        self.metrics["aborts"] += stopped
        return stopped

    async def _stop(self, traj_id: str, replica: Replica, rid: str) -> bool:
        """Abort a turn's request once: another abort of it is skipped while this one is on
        its way, and after it if it stopped the request, until the turn's call ends (one
        that did not, found no such request or was not answered, leaves a later abort free
        to try again)."""
        self._stopping.add(rid)
        stopped = False
        try:
            stopped = await self._abort_one(replica, rid)
        finally:
            # (the turn's answer may have come back before the abort's)
            if not stopped or rid not in self._inflight.get(traj_id, {}):
                self._stopping.discard(rid)
        return stopped

    async def release(self, traj_id: str) -> None:
        """The trajectory ended: forget its affinity and abort flag. A turn of it still
        running or waiting for a slot (its caller timed out or was cancelled; a Ray call's
        remote side outlives its caller) is aborted first: it would hold its replica's batch
        slot and its scheduler slot to its end, and this is the last moment anything knows
        its request ids. A turn it sent that arrives after this is not run (``generate``)."""
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
        # (released twice, the mark keeps the turns the first saw)
        self._released[traj_id] = max(self._turns.pop(traj_id, -1), self._released.get(traj_id, -1))
        if len(self._released) > RELEASED_WINDOW:
            self._released.popitem(last=False)
        self._inflight.pop(traj_id, None)
        if self.scheduler is not None:
            # an aborted (or cut-off) trajectory would have run at least as long as it got:
            # learnt as that lower bound, not as its length
            self.scheduler.release(traj_id, finished=not aborted)


def _turn_of(request: GenerateRequest) -> int:
    """The turn's number in its trajectory, as the env manager sends it (0 when a caller
    gives none, or none that reads as a number: a turn must not fail on its metadata)."""
    try:
        return int(request.metadata.get("turn", 0))
    except (TypeError, ValueError):
        return 0


def _prompt_size(request: GenerateRequest) -> int:
    """A turn's prompt size before the engine tokenises it: ids, or characters of the chat
    (the predictor reads it on a log scale, so a consistent measure is what matters)."""
    if request.prompt_ids is not None:
        return len(request.prompt_ids)
    return sum(len(m.content or "") for m in request.messages or [])
