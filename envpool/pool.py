"""``EnvPool``: session-affine pools of warm containers.

    async with EnvPool() as pool:
        async with pool.session("frozenlake-v1") as s:     # claims a container, pins to it
            obs, info = await s.reset(seed=7)
            res = await s.step("right")

Every call of a session goes to the container it claimed. Containers are started ahead
of demand (``min_warm`` idle per image), reused across episodes, recycled after
``max_episodes`` or any failure, and replaced in the background. Infrastructure failures
(a dead container, missed heartbeats, a timeout with no sign of life, a failed image
fetch) are retried with exponential backoff and full jitter; a deterministic environment's
session survives the loss of its container by replaying its actions on a fresh one. A
session that cannot be saved ends ``infra_failed`` (``SessionLost``): masked from
training, never a fake zero. Environment bugs and usage errors are never retried; nor is
a request that runs past its timeout while its container heartbeats (``EnvHung``: the
environment's code hangs, and a replay would hang again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, defaultdict, deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pydantic_core

from envpool.api import EnvRegistry, default_registry
from envpool.connection import AsyncToolCaller
from envpool.errors import EnvUsageError, InfraError, PoolClosed, SessionLost, ToolUnavailable
from envpool.pool_config import (
    ImageResolver,
    PinningImageResolver,
    PoolConfig,
    RetryConfig,
    digest_of,
    inprocess_tools,
    parse_pool_config,
    takes_deadline,
)
from envpool.pool_stop import ContainerStopper
from envpool.runtimes.base import Container, Runtime, make_runtime
from envpool.session import EnvSession
from envpool.tool_threads import InprocessTools

log = logging.getLogger(__name__)

# these lived here first: still importable from envpool.pool
__all__ = [
    "EnvPool",
    "EnvSession",
    "ImageResolver",
    "PoolClosed",
    "PoolConfig",
    "RetryConfig",
    "SessionLost",
    "digest_of",
    "inprocess_tools",
]


class EnvPool:
    def __init__(
        self,
        config: PoolConfig | dict[str, Any] | None = None,
        *,
        registry: EnvRegistry | None = None,
        images: ImageResolver | None = None,
        tool_caller: AsyncToolCaller | None = None,
    ):
        self.config = parse_pool_config(config)
        self.registry = registry if registry is not None else default_registry
        self.images = images
        self.metrics: Counter[str] = Counter()
        self._tools: InprocessTools | None = None
        if tool_caller is None or tool_caller is inprocess_tools:
            # without a bridge every tool call would be an error observation: wrong training
            # data. The default runs on threads of the pool's own, not the loop's default
            # executor, which a hung tool would starve for the image cache and the runtime
            self._tools = InprocessTools(self.config.tool_threads, self.metrics)
            tool_caller = self._tools
        self.tool_caller: AsyncToolCaller = tool_caller
        self._tool_deadlines = takes_deadline(self.tool_caller)
        """Whether the bridge takes ``deadline_s=`` (the time its call has: see ``_call_tool``)."""
        self._runtime: Runtime = make_runtime(self.config.runtime)
        self._idle: dict[str | None, deque[Container]] = defaultdict(deque)
        self._wanted: dict[str | None, int] = {}
        """Images kept warm -> idle containers wanted: an image that started (a cold claim, a
        prewarm), until it is pruned (``_unwant``): idle past ``warm_idle_s``, failing for
        good, or the least recently asked for when the wants exceed ``max_containers``."""
        self._asked: dict[str | None, float] = {}
        """Image -> when a session last asked for it or held it (or it was prewarmed): the
        prune's clock."""
        self._claimed: dict[str, Container] = {}
        self._prestart_failures: Counter[str | None] = Counter()
        self._prestart_after: dict[str | None, float] = {}
        self._starting: Counter[str | None] = Counter()
        # resolved (and replaced) whenever capacity may have freed up; waiters shield it, so a
        # cancelled claimer (an aborted trajectory) cannot disturb the others. (A Condition
        # under wait_for can fail to re-acquire its lock when the waiter is cancelled.)
        self._changed: asyncio.Future[None] | None = None
        self._closed = False
        self._close_done: asyncio.Future[bool] | None = None  # resolves to whether the close finished
        """Resolved when the close ends: a second ``aclose`` waits for the first's."""
        self._maint: asyncio.Task[None] | None = None
        self._idle_probe: asyncio.Task[None] | None = None
        self._idle_probed = 0.0  # when the last probe of the idle containers began
        self._bg: set[asyncio.Task[Any]] = set()
        self._stopper = ContainerStopper(
            self._runtime,
            self.config,
            images,
            self.metrics,
            spawn=self._spawn_bg,
            kick=self._kick,
            closed=lambda: self._closed,
        )
        self.claim_ms: deque[float] = deque(maxlen=10_000)

    @property
    def runtime(self) -> Runtime:
        return self._runtime

    @runtime.setter
    def runtime(self, runtime: Runtime) -> None:
        """Another runtime (a test's stand-in): the stops go to it too."""
        self._runtime = self._stopper.runtime = runtime

    async def __aenter__(self) -> EnvPool:
        import envpool.envs  # noqa: F401 - the built-in environments

        try:
            reaped = await self.runtime.reap_orphans()
        except Exception as e:  # a cluster that cannot be listed must not stop the pool
            self.metrics[f"reap_orphans_failed:{type(e).__name__}"] += 1
        else:
            self.metrics["orphans_reaped"] += len(reaped)
        self._maint = asyncio.get_running_loop().create_task(self._maintain())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        # a second close returns once the first has ended: its caller may go on to rely on the
        # containers being stopped. A first close cut short (cancelled, or a stop that raised)
        # stopped nothing for sure: the next close (a waiting one, or a later call) closes
        # again, rather than return at once over a runtime still running containers
        while (done := self._close_done) is not None and not (done.done() and done.result() is False):
            if await asyncio.shield(done):
                return
        self._closed = True
        self._close_done = done = asyncio.get_running_loop().create_future()
        finished = False
        try:
            if self._maint is not None:
                self._maint.cancel()
            for t in list(self._bg):
                t.cancel()
            await asyncio.gather(*self._bg, *([self._maint] if self._maint else []), return_exceptions=True)
            self._notify_changed()  # claimers waiting for capacity learn the pool closed
            if self.runtime.close_timeout_s is None:  # a stop that hangs must not hang the close
                self.runtime.close_timeout_s = self.config.stop_timeout_s
            try:
                await self.runtime.aclose()
            finally:
                self._stopper.unpin_stopped()
                if self._tools is not None:
                    self._tools.close()
            finished = True
        finally:
            done.set_result(finished)  # (a cancelled close too: those waiting on it go on)

    # ------------------------------------------------------------------ sessions
    @contextlib.asynccontextmanager
    async def session(
        self, env_id: str, *, image: str | None = None, env_kwargs: dict[str, Any] | None = None
    ) -> AsyncIterator[EnvSession]:
        """Claim a container for ``env_id`` (from ``image``, or the built-ins) and pin a
        session to it until the block ends."""
        spec = self.registry.spec(env_id) if image is None else None  # unknown id: a clear error now
        try:  # and kwargs the container cannot be sent, before a container is claimed for them
            pydantic_core.to_json(env_kwargs or {})
        except pydantic_core.PydanticSerializationError as e:
            raise EnvUsageError(f"{env_id}: env_kwargs must be JSON-safe to reach a container: {e}") from None
        s = EnvSession(
            self, env_id, image, env_kwargs or {}, deterministic=spec.deterministic if spec else True
        )
        try:
            await s._with_recovery("claim", s._attach)
            yield s
        finally:
            await s._detach()

    async def prewarm(self, image: str | None = None, n: int | None = None) -> None:
        """Start up to ``n`` (default ``min_warm``) idle containers for ``image``, as many as
        the pool has room for, and wait for them; from then on the pool keeps ``n`` warm
        (until no session has asked for it in ``warm_idle_s``), starting the rest as slots
        free. With every slot taken (sessions, other starts) it starts nothing and returns at
        once, keeping the want: a wait for room would last as long as the sessions holding
        it, and the job's start-up prewarms its images one after another. If every start it
        made failed, the first start error is raised (``ImageNotFound`` for a wrong
        reference) and the image is not kept warm: only an image that starts is retried in
        the background. More than ``max_containers`` (or fewer than 0) is refused
        (``EnvUsageError``), as ``PoolConfig`` refuses such a ``min_warm``."""
        n = self.config.min_warm if n is None else n
        if n < 0:  # (kept, it lowered the wants' sum that bounds the other images' wants)
            raise EnvUsageError(f"prewarm(n={n}): n is a count of containers, 0 or more")
        if n > self.config.max_containers:
            # kept, the want could never be met: the housekeeping chased it every tick, and it
            # let go of every other image's warm containers to make room for it
            raise EnvUsageError(
                f"prewarm(n={n}) of {image or 'the built-ins'}: more than max_containers "
                f"({self.config.max_containers}) can never be warm; lower n or raise max_containers"
            )
        need = max(n - len(self._idle.get(image, ())) - self._starting[image], 0)
        if need:
            starts = [self._start_idle(image, background=False) for _ in range(need)]
            try:
                results = await asyncio.gather(*starts, return_exceptions=True)
            except BaseException:
                # cancelled (a caller that gave up) after some of them started: the image is
                # kept warm all the same, else they stayed idle, of an image no prune looks
                # at, until the pool closed
                if self._idle.get(image):
                    self._keep_warm(image, max(self._wanted.get(image, 0), n))
                raise
            errors = [r for r in results if isinstance(r, BaseException)]
            # those that found no room tried nothing: they do not make the failed ones' image
            # one that starts (it was kept warm when no start of it had worked)
            if errors and True not in results:
                raise errors[0]
        self._keep_warm(image, max(self._wanted.get(image, 0), n))

    async def _call_tool(self, name: str, arguments: dict[str, Any], by: float | None) -> str:
        """A session's tool call through the bridge, to be answered by ``by`` (monotonic: the
        time its request has left, less a reserve). A bridge that takes ``deadline_s=`` gets
        it, so that a slow tool ends inside the step rather than with it; one that does not
        (a caller's own, written before) is called as it was, and cancelled at ``by``: left
        to run, a hung tool held the step to its ``step_timeout_s``, which then failed as a
        step with "a tool call still pending", naming no tool. Not given the time, such a
        bridge cannot say whether the tool ran past it or never ran (it may queue calls), so
        its call is the infrastructure's failure (``ToolUnavailable``), not the policy's."""
        if by is None:
            return await self.tool_caller(name, arguments)
        left = max(0.0, by - time.monotonic())
        if self._tool_deadlines:
            return await self.tool_caller(name, arguments, deadline_s=left)
        bound = asyncio.timeout(left)
        try:
            async with bound:
                return await self.tool_caller(name, arguments)
        except TimeoutError:
            if not bound.expired():  # (the bridge's own: the policy sees it, as any of its errors)
                raise
            raise ToolUnavailable(
                f"tool {name!r} did not answer in the {left:.3g} s its step had left and was cancelled "
                "(the pool's tool bridge takes no deadline_s=; one that does is told the time and can "
                "answer a slow tool inside it)"
            ) from None

    def stats(self) -> dict[str, Any]:
        claims = sorted(self.claim_ms)
        return {
            **self.metrics,
            "containers": len(self.runtime.live),
            "idle": sum(len(q) for q in self._idle.values()),
            "claimed": len(self._claimed),
            "warm_images": len(self._wanted),
            "leaked": len(self.runtime.leaked),
            "claim_p50_ms": claims[len(claims) // 2] if claims else None,
            "runtime": dict(self.runtime.metrics),
        }

    # ------------------------------------------------------------------ containers
    async def _bundle(self, image: str | None) -> tuple[Path | None, str | None]:
        """The unpacked bundle of ``image`` for a container on this machine, and the digest
        pinned for it in the image cache (None where the cache does not evict)."""
        if image is None:
            return None, None
        if not self.runtime.uses_local_bundle:
            digest_of(image)  # a bad reference is refused here; the container fetches the bundle
            return None, None
        if self.images is None:
            raise ValueError(f"image {image!r} given but the pool has no image cache (EnvPool(images=...))")
        digest = digest_of(image)
        if isinstance(self.images, PinningImageResolver):
            return await self.images.acquire(digest), digest
        return await self.images.get(digest), None

    async def _new_container(self, image: str | None) -> Container:
        if self._closed:
            raise PoolClosed("the pool is closed")
        self._starting[image] += 1
        try:
            bundle, pinned = await self._bundle(image)
            try:
                if self._closed:
                    # closed while the image was fetched: the runtime's close is done or under
                    # way, and what a start made now would outlive it
                    raise PoolClosed("the pool was closed while an image was fetched")
                c = await self.runtime.start(image, bundle, timeout_s=self.config.runtime.start_timeout_s)
            except BaseException as e:
                if pinned is not None:
                    self._stopper.release_pin(pinned)
                if self._closed and isinstance(e, Exception) and not isinstance(e, PoolClosed):
                    # the runtime refused, closed under it: the claim ends as a closed pool's
                    raise PoolClosed("the pool was closed while a container started") from e
                raise
            if pinned is not None:
                self._stopper.pinned[c.id] = pinned
            if self._closed:
                # it started after the runtime's close stopped everything it knew: nothing
                # else will (a remote container would run on, idle in a closed pool)
                await self._stop(c)
                raise PoolClosed("the pool was closed while a container started")
            return c
        finally:
            self._starting[image] -= 1
            if not self._starting[image]:
                del self._starting[image]  # keyed by image: bounded by the images starting now
            self._kick()

    async def _start_idle(self, image: str | None, *, background: bool = True) -> bool:
        """Start an idle container of ``image`` (none at ``max_containers``); whether one
        was made idle. In the background a failure is counted and backs the image off; else
        it is raised."""
        if len(self.runtime.live) + sum(self._starting.values()) >= self.config.max_containers:
            return False
        try:
            c = await self._new_container(image)
        except Exception as e:  # background work: count it, back off, never crash the loop
            self.metrics[f"prestart_failed:{type(e).__name__}"] += 1
            if not background:
                raise
            if not (isinstance(e, InfraError) and getattr(e, "retryable", True)):
                # gone for good (ImageNotFound: the image was deleted; a setup error): no backoff
                # makes it start, and retrying it would last as long as the pool
                log.warning(
                    "envpool: image %s no longer starts (%s: %s); it is no longer kept warm",
                    image or "built-ins",
                    type(e).__name__,
                    e,
                )
                self._unwant(image, type(e).__name__)
                return False
            self._prestart_failures[image] += 1
            delay = min(30.0, 0.2 * 2 ** self._prestart_failures[image])
            self._prestart_after[image] = time.monotonic() + delay
            return False
        self._prestart_failures.pop(image, None)
        if background and image not in self._wanted:  # let go of while it started
            await self._stop(c)
            return False
        self._idle[image].append(c)
        self._notify_changed()
        return True

    async def _stop(self, c: Container) -> None:
        await self._stopper.stop(c)

    async def _stop_and_kick(self, c: Container) -> None:
        await self._stopper.stop_and_kick(c)

    def _notify_changed(self) -> None:
        fut, self._changed = self._changed, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _changed_future(self) -> asyncio.Future[None]:
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        return self._changed

    async def _claim(self, image: str | None) -> Container:
        """An idle container of ``image`` (warm claim), else a new one (cold), else wait."""
        if image in self._wanted:  # (a bad reference is not remembered: it never started)
            self._asked[image] = time.monotonic()
        deadline = time.monotonic() + self.config.claim_timeout_s
        # the stop of the idle container this claim evicted to make room: not waited for
        # (a stop may take up to stop_timeout_s, and one of ours may come back idle
        # meanwhile); its end wakes the claim. One at a time: a claim needs one slot
        evicting: asyncio.Task[None] | None = None
        while True:
            changed = self._changed_future()  # taken before looking: no wake-up can slip by
            if self._closed:
                raise PoolClosed("the pool is closed")
            # re-read after every probe: the image may have been let go meanwhile (_unwant),
            # its idle containers taken to be stopped (get: no entry for an image never started)
            while idle := self._idle.get(image):
                c = idle.popleft()
                try:
                    ok = await self.runtime.alive(c)
                except BaseException:
                    # a probe that failed (a remote API hiccup) or was cancelled says nothing
                    # of the container: back first in line, not lost holding a slot until close
                    # (unless its image was let go meanwhile: then it is stopped like the rest)
                    if image in self._wanted and not self._closed:
                        self._idle[image].appendleft(c)
                    elif not self._closed:
                        self._spawn_bg(self._stop(c))
                    raise
                if ok:
                    self.metrics["claims_warm"] += 1
                    return c
                self.metrics["idle_died"] += 1
                if not self._closed:  # (else the runtime's close stops it)
                    # in the background: the next idle container must not wait for this stop
                    self._spawn_bg(self._stop_and_kick(c))
            if len(self.runtime.live) + sum(self._starting.values()) < self.config.max_containers:
                c = await self._new_container(image)
                self.metrics["claims_cold"] += 1  # (one that started: a failed start is no claim)
                # only an image that starts is kept warm: a bad one must not be retried forever
                if image not in self._wanted:
                    self._keep_warm(image, self.config.min_warm)
                return c
            if evicting is None or evicting.done():
                evicting = self._evict_idle_other_than(image)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SessionLost(f"no container free in {self.config.claim_timeout_s:g} s (max_containers)")
            # notified when capacity frees up; the short timeout is a backstop for any path
            # that frees it silently (a container found dead, a failed start). Not wait_for:
            # on Python 3.11 it swallows a cancellation (an aborted claim) that lands with
            # the wake-up, and the claim would go on
            await asyncio.wait((changed,), timeout=min(remaining, 0.05))

    def _kick(self) -> None:
        """Wake claimers waiting for capacity (from sync code too)."""
        if not self._closed:
            self._notify_changed()

    def _evict_idle_other_than(self, image: str | None) -> asyncio.Task[None] | None:
        """Stop an idle container of another image to make room, in the background (its end
        wakes the claimers): its task, or None if there is none to evict."""
        for other, q in self._idle.items():
            if other != image and q:
                self.metrics["evicted_idle"] += 1
                return self._spawn_bg(self._stop_and_kick(q.popleft()))
        return None

    async def _release(self, c: Container, *, healthy: bool) -> None:
        self._claimed.pop(c.id, None)
        if self._closed:
            await self._stop(c)  # a session that outlived its pool still cleans up
            return
        try:
            if c.reaped:
                # the reaper let it go and is stopping it (its stop may have failed and be
                # retried): a slow session's clean goodbye must not make it idle for another
                self.metrics["released_reaped"] += 1
                await self._stop(c)
            elif not healthy or c.failed or c.episodes >= self.config.max_episodes:
                self.metrics["recycled" if healthy and not c.failed else "discarded"] += 1
                await self._stop(c)
            elif c.image not in self._wanted:  # no longer kept warm (pruned): nobody wants it idle
                self.metrics["released_unwanted"] += 1
                await self._stop(c)
            else:
                self._idle[c.image].append(c)
        finally:  # a cancelled stop frees its slot all the same: claimers must hear of it
            self._notify_changed()

    async def _maintain(self) -> None:
        """Replenish warm containers, drop dead idle ones, reap leaked sessions."""
        while not self._closed:
            await asyncio.sleep(0.1)
            try:
                now = time.monotonic()
                self._prune_idle_images(now)
                self._stopper.retry_leaked(now)
                self._probe_idle(now)
                self._stopper.unpin_stopped()  # a stop whose caller was cancelled went on
                # no more starts than there are free slots: each start past them found no
                # room and returned, spawned again every tick while sessions held the slots
                room = self.config.max_containers - len(self.runtime.live) - sum(self._starting.values())
                for image, want in list(self._wanted.items()):
                    if room <= 0:
                        break
                    if now < self._prestart_after.get(image, 0.0):
                        continue
                    missing = min(want - len(self._idle[image]) - self._starting[image], room)
                    for _ in range(max(missing, 0)):
                        self._spawn_bg(self._start_idle(image))
                    room -= max(missing, 0)
                for c in list(self._claimed.values()):
                    if not c.in_flight and now - c.last_active > self.config.session_ttl_s:
                        # a session idle this long was leaked (its owner forgot it): reclaim
                        self.metrics["reaped"] += 1
                        c.reaped = True
                        self._claimed.pop(c.id, None)
                        # in the background: a stop that hangs (up to stop_timeout_s) must not
                        # stall the warm containers' replenishment and the rest of housekeeping
                        self._spawn_bg(self._stop_and_kick(c))
            except Exception as e:  # housekeeping must not die silently
                self.metrics[f"maintenance_error:{type(e).__name__}"] += 1

    def _probe_idle(self, now: float) -> None:
        """Drop the idle containers that died waiting (OOM-killed, a node gone), every
        ``runtime.idle_probe_s``, so that the replenishment replaces them: else each counted
        as warm, held a slot, and the claim that took it found it dead and started cold."""
        for image, q in list(self._idle.items()):  # what the runtime knows without asking:
            for c in [c for c in q if self.runtime.known_dead(c)]:  # ahead of the replenishment
                self._drop_dead_idle(image, c)
        every = self.runtime.idle_probe_s
        if every is None or now - self._idle_probed < every:
            return
        if self._idle_probe is not None and not self._idle_probe.done():
            return  # a slow one (an API that hangs) is not doubled
        self._idle_probed = now
        # in the background: API calls must not stall the rest of housekeeping
        self._idle_probe = self._spawn_bg(self._probe_idle_remote())

    async def _probe_idle_remote(self) -> None:
        """One probe of each idle container, one at a time (an API call each)."""
        for image, q in list(self._idle.items()):
            for c in list(q):
                if not any(x is c for x in q):
                    continue  # claimed (or let go) meanwhile: its claim probes it itself
                try:
                    ok = await self.runtime.alive(c)
                except Exception as e:  # a probe that failed says nothing of the container
                    self.metrics[f"idle_probe_failed:{type(e).__name__}"] += 1
                    continue
                if not ok:
                    self._drop_dead_idle(image, c)

    def _drop_dead_idle(self, image: str | None, c: Container) -> None:
        q = self._idle.get(image)
        if q is None or not any(x is c for x in q):
            return  # claimed (or let go) while it was probed
        del q[next(i for i, x in enumerate(q) if x is c)]
        self.metrics["idle_died"] += 1
        self._spawn_bg(self._stop_and_kick(c))

    # ------------------------------------------------------------------ warm images
    def _keep_warm(self, image: str | None, n: int) -> None:
        """Keep ``n`` idle containers of ``image``. The wants are bounded by the pool's size:
        past ``max_containers`` the least recently asked images are let go (else the pool
        would keep trying to warm more than it can hold, for every image a run ever used)."""
        self._wanted[image] = n
        self._asked[image] = time.monotonic()
        while sum(self._wanted.values()) > self.config.max_containers and len(self._wanted) > 1:
            oldest = min((i for i in self._wanted if i != image), key=lambda i: self._asked.get(i, 0.0))
            self._unwant(oldest, "capacity")

    def _prune_idle_images(self, now: float) -> None:
        """Let go of the images no session has used for ``warm_idle_s`` (asked for, or held
        open): a run that moves on from an image (a dataset with an image per task) must not
        keep its containers warm, nor its bookkeeping, until the pool closes."""
        in_use = {c.image for c in self._claimed.values()}
        for image in list(self._wanted):
            if image in in_use:
                self._asked[image] = now  # the window starts when its last session ends
            elif now - self._asked.get(image, now) > self.config.warm_idle_s:
                self._unwant(image, "idle")

    def _unwant(self, image: str | None, why: str) -> None:
        """Stop keeping ``image`` warm: its idle containers are stopped, and one still claimed
        is stopped when its session ends. A session that asks for it again starts it cold."""
        self._wanted.pop(image, None)
        self._asked.pop(image, None)
        self._prestart_failures.pop(image, None)
        self._prestart_after.pop(image, None)
        idle = self._idle.pop(image, None) or deque()
        doomed = list(idle)
        idle.clear()  # a claim probing this image holds the same deque: nothing left to take
        for c in doomed:
            if not self._closed:  # (a closing pool's runtime stops them all)
                self._spawn_bg(self._stop(c))
        self.metrics[f"warm_dropped:{why}"] += 1
        self._kick()

    def _spawn_bg(self, coro: Any) -> asyncio.Task[Any]:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)
        return t
