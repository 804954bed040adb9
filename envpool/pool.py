"""``EnvPool``: session-affine pools of warm containers.

    async with EnvPool() as pool:
        async with pool.session("frozenlake-v1") as s:     # claims a container, pins to it
            obs, info = await s.reset(seed=7)
            res = await s.step("right")

Every call of a session goes to the container it claimed. Containers are started ahead
of demand (``min_warm`` idle per image), reused across episodes, recycled after
``max_episodes`` or any failure, and replaced in the background. Infrastructure failures
(a dead container, missed heartbeats, a timeout, a failed image fetch) are retried with
exponential backoff and full jitter; a deterministic environment's session survives the
loss of its container by replaying its actions on a fresh one. A session that cannot be
saved ends ``infra_failed`` (``SessionLost``): masked from training, never a fake zero.
Environment bugs and usage errors are never retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import time
from collections import Counter, defaultdict, deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal, Protocol

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from envpool.api import (
    MAX_ACTION_BYTES,
    EnvRegistry,
    Observation,
    StepResult,
    check_action,
    default_registry,
    inprocess_tool_caller,
)
from envpool.connection import AsyncToolCaller, Connection
from envpool.errors import (
    ContainerDied,
    EnvLogicError,
    EnvOrderError,
    EnvPoolError,
    EnvUsageError,
    InfraError,
    StepTimeout,
)
from envpool.runtimes.base import Container, ProcessRuntimeConfig, Runtime, RuntimeConfig, make_runtime


class PoolClosed(EnvPoolError):
    """The pool was closed: no new claims."""


class SessionLost(InfraError):
    """The session's container failed and the session could not be saved: the trajectory
    is ``infra_failed``."""

    retryable = False


_SEEN = ("obs", "reward", "terminated", "truncated")


def _digest(result: dict[str, Any]) -> str:
    """What the policy saw of a reset or step, for checking a replay: the observation, the
    reward and the episode's end. Not ``info``: determinism is asked of these only (as
    ``check_env`` checks it), and info may well carry timings that differ on every run."""
    return hashlib.sha256(pydantic_core.to_json({k: result.get(k) for k in _SEEN})).hexdigest()


def _retryable(e: BaseException) -> bool:
    return isinstance(e, InfraError | OSError) and not isinstance(e, SessionLost)


class RetryConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    attempts: int = Field(5, ge=1)
    initial_backoff_s: float = Field(0.05, gt=0)
    max_backoff_s: float = Field(2.0, gt=0)


class PoolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    runtime: RuntimeConfig = Field(default_factory=ProcessRuntimeConfig)
    """Where containers run: ``process`` (the embedded default), ``kubernetes``, ``docker``, ``modal``."""

    @field_validator("runtime", mode="before")
    @classmethod
    def _default_runtime_type(cls, v: Any) -> Any:
        # {"heartbeat_s": 0.1} means the embedded default; other kinds name their type
        if isinstance(v, dict) and "type" not in v:
            return {**v, "type": "process"}
        return v

    min_warm: int = Field(2, ge=0)
    """Idle containers kept ready per image (once the image has been used or prewarmed)."""
    max_containers: int = Field(64, ge=1)
    """All containers of the pool, idle and claimed."""
    max_episodes: int = Field(100, ge=1)
    """A container is recycled after this many episodes."""
    reset_timeout_s: float = Field(60.0, gt=0)
    step_timeout_s: float = Field(30.0, gt=0)
    heartbeat_misses: int = Field(4, ge=1)
    """A request whose container sends neither reply nor heartbeat for this many heartbeat
    periods is declared hung: the container is killed and replaced."""
    claim_timeout_s: float = Field(120.0, gt=0)
    session_ttl_s: float = Field(3600.0, gt=0)
    """The reaper reclaims a container whose session made no request for this long (leaked);
    that session then ends ``infra_failed``."""
    retry: RetryConfig = Field(default_factory=RetryConfig)


class ImageResolver(Protocol):
    """What the pool needs of an image cache: the unpacked bundle of an image reference."""

    async def get(self, digest: str) -> Path: ...


async def inprocess_tools(name: str, arguments: dict[str, Any]) -> str:
    """The default tool bridge: the fabric tool runs in this process, as ``envpool.make``
    runs it (in a thread: a tool may block). A job passes its fabric client's instead."""
    return await asyncio.to_thread(inprocess_tool_caller, name, arguments)


def digest_of(image: str) -> str:
    """``name@sha256:hex`` or ``sha256:hex`` -> ``sha256:hex`` (``InvalidImageRef`` otherwise)."""
    from envpool.images.bundle import ImageRef

    return ImageRef.parse(str(image)).digest


class EnvPool:
    def __init__(
        self,
        config: PoolConfig | dict[str, Any] | None = None,
        *,
        registry: EnvRegistry | None = None,
        images: ImageResolver | None = None,
        tool_caller: AsyncToolCaller | None = None,
    ):
        self.config = config if isinstance(config, PoolConfig) else PoolConfig.model_validate(config or {})
        self.registry = registry if registry is not None else default_registry
        self.images = images
        # without a bridge every tool call would be an error observation: wrong training data
        self.tool_caller: AsyncToolCaller = tool_caller if tool_caller is not None else inprocess_tools
        self.runtime: Runtime = make_runtime(self.config.runtime)
        self._idle: dict[str | None, deque[Container]] = defaultdict(deque)
        self._wanted: dict[str | None, int] = {}
        self._claimed: dict[str, Container] = {}
        self._prestart_failures: Counter[str | None] = Counter()
        self._prestart_after: dict[str | None, float] = {}
        self._starting: Counter[str | None] = Counter()
        # resolved (and replaced) whenever capacity may have freed up; waiters shield it, so a
        # cancelled claimer (an aborted trajectory) cannot disturb the others. (A Condition
        # under wait_for can fail to re-acquire its lock when the waiter is cancelled.)
        self._changed: asyncio.Future[None] | None = None
        self._closed = False
        self._maint: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        self.metrics: Counter[str] = Counter()
        self.claim_ms: deque[float] = deque(maxlen=10_000)

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
        if self._closed:
            return
        self._closed = True
        if self._maint is not None:
            self._maint.cancel()
        for t in list(self._bg):
            t.cancel()
        await asyncio.gather(*self._bg, *([self._maint] if self._maint else []), return_exceptions=True)
        self._notify_changed()  # claimers waiting for capacity learn the pool closed
        await self.runtime.aclose()

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
        """Start ``n`` (default ``min_warm``) idle containers for ``image`` and wait for them;
        from then on the pool keeps that many warm. If none of them starts, the first start
        error is raised (``ImageNotFound`` for a wrong reference) and the image is not kept
        warm: only an image that starts is retried in the background."""
        n = self.config.min_warm if n is None else n
        need = max(n - len(self._idle[image]) - self._starting[image], 0)
        if need:
            starts = [self._start_idle(image, background=False) for _ in range(need)]
            errors = [r for r in await asyncio.gather(*starts, return_exceptions=True) if r is not None]
            if len(errors) == need:
                raise errors[0]
        self._wanted[image] = max(self._wanted.get(image, 0), n)

    def stats(self) -> dict[str, Any]:
        claims = sorted(self.claim_ms)
        return {
            **self.metrics,
            "containers": len(self.runtime.live),
            "idle": sum(len(q) for q in self._idle.values()),
            "claimed": len(self._claimed),
            "claim_p50_ms": claims[len(claims) // 2] if claims else None,
            "runtime": dict(self.runtime.metrics),
        }

    # ------------------------------------------------------------------ containers
    async def _bundle(self, image: str | None) -> Path | None:
        if image is None:
            return None
        if not self.runtime.uses_local_bundle:
            digest_of(image)  # a bad reference is refused here; the container fetches the bundle
            return None
        if self.images is None:
            raise ValueError(f"image {image!r} given but the pool has no image cache (EnvPool(images=...))")
        return await self.images.get(digest_of(image))

    async def _new_container(self, image: str | None) -> Container:
        if self._closed:
            raise PoolClosed("the pool is closed")
        self._starting[image] += 1
        try:
            bundle = await self._bundle(image)
            return await self.runtime.start(image, bundle, timeout_s=self.config.runtime.start_timeout_s)
        finally:
            self._starting[image] -= 1
            self._kick()

    async def _start_idle(self, image: str | None, *, background: bool = True) -> None:
        """Start an idle container of ``image`` (none at ``max_containers``). In the
        background a failure is counted and backs the image off; else it is raised."""
        if len(self.runtime.live) + sum(self._starting.values()) >= self.config.max_containers:
            return
        try:
            c = await self._new_container(image)
        except Exception as e:  # background work: count it, back off, never crash the loop
            self.metrics[f"prestart_failed:{type(e).__name__}"] += 1
            if not background:
                raise
            self._prestart_failures[image] += 1
            delay = min(30.0, 0.2 * 2 ** self._prestart_failures[image])
            self._prestart_after[image] = time.monotonic() + delay
            return
        self._prestart_failures[image] = 0
        self._idle[image].append(c)
        self._notify_changed()

    async def _stop(self, c: Container) -> None:
        """Stop a container the pool gives up; a failure is counted, not raised (the session
        or housekeeping that let it go is done with it): the runtime keeps it tracked, and
        its aclose (and exit hook) tries again."""
        try:
            await self.runtime.stop(c)
        except Exception as e:
            self.metrics[f"stop_failed:{type(e).__name__}"] += 1

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
        deadline = time.monotonic() + self.config.claim_timeout_s
        while True:
            changed = self._changed_future()  # taken before looking: no wake-up can slip by
            if self._closed:
                raise PoolClosed("the pool is closed")
            idle = self._idle[image]
            while idle:
                c = idle.popleft()
                try:
                    ok = await self.runtime.alive(c)
                except BaseException:
                    # a probe that failed (a remote API hiccup) or was cancelled says nothing
                    # of the container: back first in line, not lost holding a slot until close
                    idle.appendleft(c)
                    raise
                if ok:
                    self.metrics["claims_warm"] += 1
                    return c
                self.metrics["idle_died"] += 1
                await self._stop(c)
            if len(self.runtime.live) + sum(self._starting.values()) < self.config.max_containers:
                self.metrics["claims_cold"] += 1
                c = await self._new_container(image)
                # only an image that starts is kept warm: a bad one must not be retried forever
                self._wanted.setdefault(image, self.config.min_warm)
                return c
            if not await self._evict_idle_other_than(image):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SessionLost(
                        f"no container free in {self.config.claim_timeout_s:g} s (max_containers)"
                    )
                # notified when capacity frees up; the short timeout is a backstop for any path
                # that frees it silently (a container found dead, a failed start)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(changed), min(remaining, 0.05))

    def _kick(self) -> None:
        """Wake claimers waiting for capacity (from sync code too)."""
        if not self._closed:
            self._notify_changed()

    async def _evict_idle_other_than(self, image: str | None) -> bool:
        for other, q in self._idle.items():
            if other != image and q:
                await self._stop(q.popleft())
                return True
        return False

    async def _release(self, c: Container, *, healthy: bool) -> None:
        self._claimed.pop(c.id, None)
        if self._closed:
            await self._stop(c)  # a session that outlived its pool still cleans up
            return
        try:
            if not healthy or c.failed or c.episodes >= self.config.max_episodes:
                self.metrics["recycled" if healthy and not c.failed else "discarded"] += 1
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
                for image, want in list(self._wanted.items()):
                    if now < self._prestart_after.get(image, 0.0):
                        continue
                    missing = want - len(self._idle[image]) - self._starting[image]
                    for _ in range(max(missing, 0)):
                        self._spawn_bg(self._start_idle(image))
                for c in list(self._claimed.values()):
                    if now - c.last_active > self.config.session_ttl_s:
                        # a session idle this long was leaked (its owner forgot it): reclaim
                        self.metrics["reaped"] += 1
                        c.reaped = True
                        self._claimed.pop(c.id, None)
                        await self._stop(c)
                        self._kick()
            except Exception as e:  # housekeeping must not die silently
                self.metrics[f"maintenance_error:{type(e).__name__}"] += 1

    def _spawn_bg(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)


class EnvSession:
    """One trajectory's handle: every call goes to the container it holds."""

    def __init__(
        self, pool: EnvPool, env_id: str, image: str | None, kwargs: dict[str, Any], *, deterministic: bool
    ):
        self.pool = pool
        self.env_id = env_id
        self.image = image
        self.kwargs = kwargs
        self.deterministic = deterministic
        self.token = os.urandom(16).hex()
        # an image's environments are registered inside its container: the server checks those
        self.max_action_bytes = (
            pool.registry.spec(env_id).max_action_bytes if image is None else MAX_ACTION_BYTES
        )
        self.container: Container | None = None
        self.conn: Connection | None = None
        self.status: Literal["ok", "infra_failed"] = "ok"
        self.failures: list[str] = []
        self._reset_args: dict[str, Any] | None = None
        self._actions: list[str] = []
        self._trace: list[str] = []
        self._done = True
        self._closed = False
        self._interrupted = False
        """A request was cut off before its reply (cancelled): the container may still be
        running it, so its state is unknown and it is not reused."""

    # -- public
    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Observation, dict]:
        self._check_alive()
        if seed is None:  # a random episode all the same, but one a replay can rebuild
            seed = secrets.randbits(31)
        args = {"seed": seed, "options": options}
        result = await self._with_recovery(
            "reset", lambda: self._call("reset", args, self._cfg.reset_timeout_s)
        )
        self._reset_args, self._actions, self._done = args, [], False
        self._trace = [_digest(result)]
        if self.container is not None:
            self.container.episodes += 1
        self.pool.metrics["resets"] += 1
        return Observation.model_validate(result["obs"]), result.get("info") or {}

    async def step(self, action: str | bytes) -> StepResult:
        self._check_alive()
        text = check_action(action, self.max_action_bytes)
        if self._done:
            raise EnvOrderError(
                f"{self.env_id}: step() before reset() (or after the episode ended); call reset()"
            )
        result = await self._with_recovery(
            "step", lambda: self._call("step", {"action": text}, self._cfg.step_timeout_s), replay=True
        )
        res = StepResult.model_validate(result)
        self._actions.append(text)
        self._trace.append(_digest(result))
        self._done = res.done
        self.pool.metrics["steps"] += 1
        return res

    # -- internals
    @property
    def _cfg(self) -> PoolConfig:
        return self.pool.config

    def _check_alive(self) -> None:
        if self._closed:
            # a call after the block would claim a container that nothing releases
            raise EnvOrderError(
                f"{self.env_id}: this session is closed (its `async with` block ended); "
                "open a new one with pool.session(...)"
            )
        if self.status == "infra_failed":
            raise SessionLost(
                f"session lost: {self.failures[-1] if self.failures else 'infrastructure failure'}"
            )

    async def _call(self, op: str, args: dict[str, Any], timeout_s: float) -> Any:
        if self.conn is None:  # the container was lost: a retry claims a new one
            self._check_alive()
            await self._attach()
        assert self.conn is not None and self.container is not None
        self.container.last_active = time.monotonic()
        try:
            return await self.conn.request({"op": op, "token": self.token, "args": args}, timeout_s)
        except BaseException as e:
            if not isinstance(e, Exception):  # cancelled mid-request (an aborted trajectory)
                self._interrupted = True
            raise
        finally:
            if self.container is not None:
                self.container.last_active = time.monotonic()

    async def _attach(self) -> None:
        """Claim a container and open the session connection (the handshake makes the env)."""
        t0 = time.perf_counter()
        c = await self.pool._claim(self.image)
        self.pool._claimed[c.id] = c
        c.last_active = time.monotonic()
        self.container = c
        try:
            rt = self._cfg.runtime
            conn = await Connection.open(
                c.endpoint,
                heartbeat_s=rt.heartbeat_s,
                misses=self._cfg.heartbeat_misses,
                tool_caller=self.pool.tool_caller,
            )
            self.conn = conn
            hello = {"op": "open", "id": 0, "token": self.token, "env_id": self.env_id, "kwargs": self.kwargs}
            info = await conn.request(hello, self._cfg.reset_timeout_s)
            # the container knows its environments (an image registers its own)
            self.deterministic = bool(info.get("deterministic", self.deterministic))
            self.max_action_bytes = int(info.get("max_action_bytes", self.max_action_bytes))
        except BaseException:
            await self._drop_container(healthy=False)
            raise
        self.pool.claim_ms.append((time.perf_counter() - t0) * 1e3)

    async def _detach(self) -> None:
        """Give the container back: reused after a clean goodbye, else discarded. A request
        cut off by a cancellation discards it at once: waiting for the environment to finish
        a step nobody wants would hold an aborted trajectory for seconds. A cancellation of
        the goodbye itself (a rollout is cancelled twice: aclose, then abort) discards it
        too; it must never stay claimed until the reaper."""
        self._closed = True
        if self.conn is None or self.container is None or self.status != "ok" or self._interrupted:
            await self._drop_container(healthy=False)
            return
        try:
            await self.conn.request({"op": "close", "token": self.token}, 5.0)
        except Exception:  # it did not answer the goodbye: discard it rather than reuse it
            healthy = False
        except BaseException:
            await self._drop_container(healthy=False)
            raise
        else:
            healthy = True
        await self._drop_container(healthy=healthy)

    async def _drop_container(self, *, healthy: bool) -> None:
        # the bookkeeping happens before the first await: a cancellation landing in the stop
        # leaves nothing claimed (the runtime finishes the stop it shields)
        conn, c = self.conn, self.container
        self.conn = self.container = None
        if conn is not None:
            conn.close()
        if c is not None:
            if not healthy:
                c.failed = True
            await self.pool._release(c, healthy=healthy)

    async def _with_recovery(self, what: str, call: Any, *, replay: bool = False) -> Any:
        """Run ``call``; on an infrastructure failure replace the container and try again
        (a step is retried after replaying the episode so far, if the env is deterministic)."""
        metrics = self.pool.metrics
        rc = self._cfg.retry
        first = True
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(rc.attempts),
                wait=wait_random_exponential(multiplier=rc.initial_backoff_s, max=rc.max_backoff_s),
                retry=retry_if_exception(_retryable),
                reraise=True,
            ):
                with attempt:
                    try:
                        if not first:
                            metrics[f"{what}_retries"] += 1
                            if replay:
                                await self._replay()
                        first = False
                        return await call()
                    except (InfraError, OSError) as e:
                        if isinstance(e, SessionLost):
                            raise
                        self._note(e)
                        if self.container is not None and self.container.reaped:
                            raise SessionLost(f"the reaper reclaimed this session's container: {e}") from e
                        if replay and not self.deterministic:
                            msg = f"{self.env_id} is not deterministic: its episode cannot be rebuilt ({e})"
                            raise SessionLost(msg) from e
                        await self._drop_container(healthy=False)
                        raise
        except SessionLost:
            self._lose()
            raise
        except (InfraError, OSError) as e:
            self._lose()
            raise SessionLost(f"{what} failed after {rc.attempts} attempts: {e}") from e
        raise AssertionError("unreachable")

    async def _replay(self) -> None:
        """Rebuild the episode on a fresh container: same reset, same actions, and the same
        observations, rewards and episode ends, checked step by step (``info`` may differ).
        Anything else loses the session: a rebuilt episode that differs from the one the
        policy saw would be wrong training data."""
        self.pool.metrics["replays"] += 1
        if self._reset_args is None:
            return
        try:
            result = await self._call("reset", self._reset_args, self._cfg.reset_timeout_s)
            seen = [_digest(result)]
            for a in self._actions:
                seen.append(_digest(await self._call("step", {"action": a}, self._cfg.step_timeout_s)))
        except (EnvLogicError, EnvUsageError) as e:
            raise SessionLost(f"replaying the episode on a new container failed: {e}") from e
        if seen != self._trace:
            raise SessionLost(
                f"{self.env_id}: the replayed episode differs from the original (not deterministic?)"
            )

    def _note(self, e: BaseException) -> None:
        names: dict[type[BaseException], str] = {
            StepTimeout: "hung_or_timeout",
            ContainerDied: "container_died",
        }
        kind = names.get(type(e), type(e).__name__)
        self.pool.metrics[f"infra:{kind}"] += 1
        self.failures.append(f"{type(e).__name__}: {e}")

    def _lose(self) -> None:
        if self.status != "infra_failed":
            self.status = "infra_failed"
            self.pool.metrics["sessions_infra_failed"] += 1
