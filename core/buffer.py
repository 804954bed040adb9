"""``SampleBuffer``: rewarded trajectories in, complete GRPO groups out, within the
asynchronous bound.

    async with SampleBuffer(group_size=8, alpha=1, on_abort=rollout.abort_group) as buf:
        buf.put(sample)                      # from the reward stream, never blocks
        groups = await buf.get_batch(16)     # the trainer; oldest groups first
        buf.advance(new_version)             # after publishing weights: drops what is too old
        buf.drop(group_id)                   # the rollout side gave a group up

One asyncio event loop owns it (later: one Ray actor), so no method needs a lock and only
``get_batch`` awaits.

Semantics:

* **Groups.** Samples are keyed by ``group_id``. A group is *complete* with ``group_size``
  trainable samples; it then waits in the ready queue for the trainer. Samples that arrive
  for it later (redundant rollouts) are dropped as ``extra``; at completion ``on_abort(gid,
  "complete")`` tells the rollout side to abort the group's rollouts still running.
* **Masking.** ``infra_failed``, ``reward_failed`` and ``aborted`` samples never count toward
  a group and never reach the trainer; they are counted by status. Their trajectory id stays
  free, so a re-run of the same trajectory is still accepted.
* **Asynchronous bound.** With trainer version ``V`` the bound is ``V - alpha``: a trajectory
  started under ``v < V - alpha`` is stale. A group is all-or-nothing and as old as its oldest
  member, so a stale member makes the whole group stale: ``advance(V)`` drops every pending
  or ready group whose oldest member is below the bound, counts its samples as ``stale`` and
  calls ``on_abort(gid, "stale")`` so the rollout side stops the group's in-flight rollouts;
  a stale sample that arrives later is dropped the same way. ``open_group`` lets the rollout
  side register a group before its first sample, and tells it when starting is pointless.
* **Given up.** ``drop(gid)``: the rollout side gave the group up (out of re-runs); it is
  closed at once, what it had and whatever arrives for it later is counted as ``given_up``,
  and the bound never drops it again (nor reports it ``stale``: it was counted once already).
* **Exactly once.** A trajectory id that was already accepted is ignored (``duplicate``).
  Ids (and closed group ids) are remembered for the last ``memory`` of each.
* **Batches.** ``await get_batch(n)`` returns ``n`` complete groups, oldest policy version
  first (they are the nearest to the bound), waiting as long as needed or ``timeout``.
  Waiters are served in arrival order; a waiter that times out or is cancelled takes nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from core.errors import BufferClosedError
from core.sample import Sample

log = logging.getLogger(__name__)

AbortReason = Literal["complete", "stale"]
AbortCallback = Callable[[str, AbortReason], None]
PutOutcome = Literal["accepted", "completed", "duplicate", "masked", "extra", "stale", "given_up", "closed"]
"""What ``put`` did: ``completed`` when this sample completed its group; ``extra`` for a
sample of a group that is already complete or served; ``given_up`` for one of a group the
rollout side dropped; ``closed`` after ``close()``."""


@dataclass(slots=True)
class Group:
    """A GRPO group: trajectories of one task, scored, within the asynchronous bound."""

    id: str
    version: int
    """The oldest start version among its members."""
    samples: list[Sample] = field(default_factory=list)
    seq: int = 0
    """Completion order, to break version ties (oldest first)."""

    @property
    def scores(self) -> list[float]:
        return [s.score for s in self.samples]


class SampleBuffer:
    def __init__(
        self,
        group_size: int,
        alpha: int,
        *,
        version: int = 0,
        on_abort: AbortCallback | None = None,
        memory: int = 200_000,
    ):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        self.group_size = group_size
        self.alpha = alpha
        self.on_abort = on_abort
        self._version = version
        self._memory = max(memory, 1)
        self._pending: dict[str, Group] = {}
        self._ready: dict[str, Group] = {}
        self._closed_groups: OrderedDict[str, Literal["served", "stale", "given_up"]] = OrderedDict()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._waiters: deque[tuple[int, asyncio.Future[list[Group]]]] = deque()
        self._seq = itertools.count()
        self._closed = False
        # metrics
        self._accepted = 0
        self._completed = 0
        self._served_groups = 0
        self._served_samples = 0
        self._dropped: Counter[str] = Counter()
        self._staleness: Counter[int] = Counter()
        self._wait_total = 0.0
        self._wait_last = 0.0
        self._wait_max = 0.0
        self._wait_count = 0
        self._abort_errors = 0

    async def __aenter__(self) -> SampleBuffer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ state
    @property
    def version(self) -> int:
        return self._version

    @property
    def bound(self) -> int:
        """The oldest start version still usable."""
        return self._version - self.alpha

    def is_stale(self, version: int) -> bool:
        return version < self.bound

    def ready_groups(self) -> int:
        return len(self._ready)

    # ------------------------------------------------------------------ rollout side
    def open_group(self, group_id: str, version: int) -> bool:
        """Register a group about to start under ``version``; False when there is no point
        starting it (already closed, or stale already)."""
        if self._closed or group_id in self._closed_groups or group_id in self._ready:
            return False
        if self.is_stale(version):
            return False
        g = self._pending.get(group_id)
        if g is None:
            self._pending[group_id] = Group(group_id, version)
        else:
            g.version = min(g.version, version)
        return True

    def put(self, sample: Sample) -> PutOutcome:
        """Add a finished trajectory (scored, or masked). Never blocks."""
        if self._closed:
            self._dropped["closed"] += 1
            return "closed"
        if sample.id in self._seen:
            self._dropped["duplicate"] += 1
            return "duplicate"
        if sample.masked:
            self._dropped[sample.status] += 1
            return "masked"
        if sample.reward is None:
            raise ValueError(f"trajectory {sample.id} is 'ok' but has no reward; score it or mask it")
        self._remember(self._seen, sample.id, None)
        gid = sample.group_id
        if gid in self._ready or self._closed_groups.get(gid) == "served":
            self._dropped["extra"] += 1
            return "extra"
        if self._closed_groups.get(gid) == "given_up":
            self._dropped["given_up"] += 1
            return "given_up"
        if self._closed_groups.get(gid) == "stale" or self.is_stale(sample.version):
            self._dropped["stale"] += 1
            if gid not in self._closed_groups:
                self._drop_stale(gid)
            return "stale"
        g = self._pending.get(gid)
        if g is None:
            g = self._pending[gid] = Group(gid, sample.version)
        g.version = min(g.version, sample.version)
        g.samples.append(sample)
        self._accepted += 1
        if len(g.samples) < self.group_size:
            return "accepted"
        del self._pending[gid]
        g.seq = next(self._seq)
        self._ready[gid] = g
        self._completed += 1
        self._notify(gid, "complete")
        self._wake()
        return "completed"

    def drop(self, group_id: str) -> None:
        """The rollout side gave the group up: close it now. Left pending, the bound would
        drop it later as stale and report it (``on_abort``) a second time, so the launcher
        would count it out twice and start one group too many. Not called back: the caller
        knows. A group already complete is left alone (it is the trainer's)."""
        if group_id in self._ready or self._closed_groups.get(group_id) == "served":
            return
        g = self._pending.pop(group_id, None)
        if g is not None:
            self._dropped["given_up"] += len(g.samples)
        self._remember(self._closed_groups, group_id, "given_up")

    # ------------------------------------------------------------------ trainer side
    def advance(self, version: int) -> list[str]:
        """The trainer published ``version``: drop every group that fell out of the bound and
        return their ids (``on_abort(gid, "stale")`` is also called for each)."""
        if version < self._version:
            raise ValueError(f"versions only go up: {version} < current {self._version}")
        self._version = version
        stale = [g.id for g in (*self._pending.values(), *self._ready.values()) if self.is_stale(g.version)]
        for gid in stale:
            self._drop_stale(gid)
        return stale

    # the timeout is part of the contract, not a convenience: on expiry nothing is taken and
    # the error says how far the buffer got (an outer asyncio.timeout also takes nothing)
    async def get_batch(self, n_groups: int, timeout: float | None = None) -> list[Group]:  # noqa: ASYNC109
        """``n_groups`` complete groups, oldest version first. Waits for them; after
        ``timeout`` seconds raises ``TimeoutError`` having taken nothing."""
        if n_groups < 1:
            raise ValueError(f"n_groups must be >= 1, got {n_groups}")
        if self._closed:
            raise BufferClosedError("the sample buffer is closed")
        t0 = time.monotonic()
        if not self._waiters and len(self._ready) >= n_groups:
            groups = self._take(n_groups)
        else:
            fut: asyncio.Future[list[Group]] = asyncio.get_running_loop().create_future()
            waiter = (n_groups, fut)
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout(timeout):
                    groups = await fut
            except TimeoutError:
                self._give_back(fut)
                raise TimeoutError(
                    f"{len(self._ready)} of {n_groups} groups ready after {timeout} s "
                    f"({len(self._pending)} pending)"
                ) from None
            except BaseException:  # cancelled: what was handed over goes back
                self._give_back(fut)
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                    # it may have held up the waiters behind it, whose groups may be ready
                    # already: served at the next put only, they could wait out their timeout
                    self._wake()
        waited = time.monotonic() - t0
        self._wait_total += waited
        self._wait_last = waited
        self._wait_max = max(self._wait_max, waited)
        self._wait_count += 1
        for g in groups:
            self._served_groups += 1
            self._served_samples += len(g.samples)
            for s in g.samples:
                self._staleness[self._version - s.version] += 1
        return groups

    def close(self) -> None:
        """Stop: waiting ``get_batch`` calls raise ``BufferClosedError``; later puts are
        counted as ``closed``."""
        self._closed = True
        while self._waiters:
            _, fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(BufferClosedError("the sample buffer was closed"))

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, Any]:
        served = sum(self._staleness.values())
        return {
            "version": self._version,
            "bound": self.bound,
            "pending_groups": len(self._pending),
            "pending_samples": sum(len(g.samples) for g in self._pending.values()),
            "ready_groups": len(self._ready),
            "waiters": len(self._waiters),
            "accepted": self._accepted,
            "completed_groups": self._completed,
            "served_groups": self._served_groups,
            "served_samples": self._served_samples,
            "dropped": dict(self._dropped),
            "abort_callback_errors": self._abort_errors,
            "staleness": dict(sorted(self._staleness.items())),
            "staleness_mean": sum(k * v for k, v in self._staleness.items()) / served if served else 0.0,
            "trainer_wait_s": {
                "total": self._wait_total,
                "last": self._wait_last,
                "max": self._wait_max,
                "count": self._wait_count,
            },
        }

    # ------------------------------------------------------------------ internals
    def _take(self, n: int) -> list[Group]:
        groups = sorted(self._ready.values(), key=lambda g: (g.version, g.seq))[:n]
        for g in groups:
            del self._ready[g.id]
            self._remember(self._closed_groups, g.id, "served")
        return groups

    def _give_back(self, fut: asyncio.Future[list[Group]]) -> None:
        """A waiter gave up: if groups were handed to it meanwhile, they go back (and still
        obey the bound, which may have moved)."""
        if not fut.done():
            fut.cancel()
            return
        if fut.cancelled() or fut.exception() is not None:
            return
        for g in fut.result():
            self._closed_groups.pop(g.id, None)
            self._ready[g.id] = g
            if self.is_stale(g.version):
                self._drop_stale(g.id)
        self._wake()

    def _wake(self) -> None:
        """Hand complete groups to the waiters, first come first served."""
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if len(self._ready) < n:
                return
            self._waiters.popleft()
            fut.set_result(self._take(n))

    def _drop_stale(self, gid: str) -> None:
        g = self._pending.pop(gid, None) or self._ready.pop(gid, None)
        if g is not None:
            self._dropped["stale"] += len(g.samples)
        self._remember(self._closed_groups, gid, "stale")
        self._notify(gid, "stale")

    def _notify(self, gid: str, reason: AbortReason) -> None:
        if self.on_abort is None:
            return
        try:
            self.on_abort(gid, reason)
        except Exception:  # the rollout side's bug must not corrupt the buffer's state
            self._abort_errors += 1
            log.exception("on_abort(%r, %r) raised", gid, reason)

    def _remember(self, memory: OrderedDict[str, Any], key: str, value: Any) -> None:
        memory[key] = value
        if len(memory) > self._memory:
            memory.popitem(last=False)  # the oldest: exactly-once holds within the window
