"""``EnvSession``: one trajectory's handle on a pool, pinned to the container it claimed;
it replays a deterministic episode on a fresh container when its own is lost."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from envpool.api import MAX_ACTION_BYTES, Observation, StepResult, check_action
from envpool.connection import Connection, remote_error
from envpool.errors import (
    ContainerDied,
    EnvCloseHung,
    EnvHung,
    EnvLogicError,
    EnvOrderError,
    EnvRegistryError,
    EnvUsageError,
    GarbledFrame,
    InfraError,
    ProtocolError,
    SessionLost,
    StepTimeout,
)
from envpool.pool_config import PoolConfig
from envpool.results import checked, digest, raised
from envpool.runtimes.base import Container

if TYPE_CHECKING:
    from envpool.pool import EnvPool


log = logging.getLogger("envpool.pool")

_ToolCall = tuple[str, str]
"""A tool call as a replay knows it again: the tool's name, its arguments as canonical JSON."""

_ToolLog = dict[tuple[str, str, int], "asyncio.Future[str]"]
"""A request's tool calls, each a task of the pool's bridge (running, or what it answered),
by what the call is: the tool, its arguments, and which occurrence of that same call in the
request it is (the first, the second, ...).

Not by the order the calls reached the pool: an environment may call tools from threads of
its own, whose calls come in the order the scheduler gives them, another on a fresh
container. Matched by place, a call that came in another order ran its tool again (a side
effect twice), and one whose answer changes made the replay differ and lost the session.
What a deterministic environment asks is its state's; only the order of calls made at once
is not. Identical calls at once are the one thing this cannot tell apart: each gets one of
the recorded answers, and if that changes the episode the replay's check says so."""


def _tool_call(name: str, arguments: dict[str, Any]) -> _ToolCall:
    # (decoded from a frame: JSON-safe, its keys strings; sorted, two spellings of one
    # object are one call)
    return name, json.dumps(arguments, sort_keys=True, separators=(",", ":"))


def _tool_deadline(timeout_s: float) -> float:
    """When a tool call made from now on, in a request of ``timeout_s``, must end: a fifth
    of the request's time (at most 1 s) is kept for the environment to read the answer and
    reply, so that a tool that ends at its deadline ends inside the step, as a tool error,
    and not with it, as a ``StepTimeout`` (the container killed, the step retried)."""
    return time.monotonic() + timeout_s - min(1.0, timeout_s / 5)


def _retryable(e: BaseException) -> bool:
    # (not SessionLost, nor ToolMisconfigured: a fresh container would fail the same way)
    return isinstance(e, OSError) or (isinstance(e, InfraError) and e.retryable)


class EnvSession:
    """One trajectory's handle: every call goes to the container it holds.

    A ``reset()`` or ``step()`` cancelled before it returned (a timeout around it, an
    aborted trajectory) ends the episode: its container may still be running the request,
    so the episode's state is unknown. The next ``step()`` raises ``EnvOrderError``; a
    ``reset()`` starts a new episode on a fresh container. So does a failure that took the
    episode's container and was not recovered from (a new container that could not make
    the environment): a ``step()`` never reaches a container that did not run the episode."""

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
        self._log: list[tuple[str, dict[str, Any], _ToolLog]] = []
        """The episode so far, as a replay rebuilds it: its reset, then every request the
        environment ran, those that raised (``EnvLogicError``) included: the environment
        ran them and may have changed its state before it raised. With each, the tool calls
        it made and what they answered (``_tool``)."""
        self._tools_now: _ToolLog | None = None
        """The tool calls of the request under way (its earlier attempts' and, in a replay,
        the original's): a call made again is answered from here, not run again."""
        self._tool_seen: Counter[_ToolCall] = Counter()
        """How many times this attempt of the request under way has made each call so far."""
        self._tool_runs: set[asyncio.Future[str]] = set()
        """The tool calls running now: one still running when the request ends was made by an
        attempt whose container was lost, and nothing will ask for its answer (cancelled)."""
        self._tool_by: float | None = None
        """When (monotonic) a tool call of the request under way must be answered by: its
        deadline less a reserve for the environment to take the answer and reply (``_tool_deadline``)."""
        self._trace: list[str] = []
        """What each request of ``_log`` gave: its digest, or the error type it raised."""
        self._done = True
        self._closed = False
        self._interrupted = False
        """A request was cut off before its reply (cancelled): the container may still be
        running it, so its state is unknown and it is not reused."""
        self._cut_short: str | None = None
        """Why the episode ended without an end: its last request hung (``EnvHung``), or its
        reply broke the protocol (``ProtocolError``)."""
        self._busy: str | None = None
        """The ``reset``/``step`` under way: a second one at once is refused (an episode is
        one sequence: two at once ran in either order, and a replay could not rebuild it)."""

    # -- public
    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Observation, dict]:
        with self._one_at_a_time("reset"):
            return await self._reset(seed, options)

    async def step(self, action: str | bytes) -> StepResult:
        with self._one_at_a_time("step"):
            return await self._step(action)

    @contextlib.contextmanager
    def _one_at_a_time(self, op: str) -> Iterator[None]:
        if self._busy is not None:
            raise EnvOrderError(
                f"{self.env_id}: {op}() while this session's {self._busy}() is under way; "
                "await it first (a session is one episode's calls, one after another)"
            )
        self._busy = op
        try:
            yield
        except BaseException as e:
            self._end_if_cut_off(op, e)
            raise
        finally:
            self._busy = None
            for run in list(self._tool_runs):
                run.cancel()

    def _end_if_cut_off(self, op: str, e: BaseException) -> None:
        """End the episode if ``op`` left it where no request of it can go on: cancelled (its
        container may still be running the request, and the caller cannot know whether it
        ran), or failed with the episode's container lost and not replaced by one that ran
        the episode (a step sent to a fresh one would reach an environment never reset)."""
        if self._closed or self.status != "ok":
            return  # (its own error says so first)
        if not isinstance(e, Exception):
            self._cut_short, self._done = f"{op}() was cancelled before it returned", True
        elif not self._done and self.conn is None:
            self._cut_short = f"{op}() failed ({type(e).__name__}) and the episode's container was lost"
            self._done = True

    async def _reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[Observation, dict]:
        self._check_alive()
        if seed is None:  # a random episode all the same, but one a replay can rebuild
            seed = secrets.randbits(31)
        args = {"seed": seed, "options": options}
        tools: _ToolLog = {}
        c = self.container
        if c is not None and (c.episodes >= self._cfg.max_episodes or c.failed or self._interrupted):
            # its episodes are spent, an error may have left its server broken (``_retire``),
            # or it may still be running a request that was cancelled: a new one starts on a
            # fresh container, as the next session's would (the reset below claims it)
            self._log, self._trace, self._done = [], [], True
            await self._drop_container(healthy=not (c.failed or self._interrupted))
        self._interrupted = False  # (what a cancelled request was left running on is gone)
        try:
            result = await self._with_recovery(
                "reset", lambda: self._call("reset", args, self._cfg.reset_timeout_s, tools)
            )
        except EnvLogicError as e:
            # an episode under way goes on from whatever state the failed reset left, on the
            # container that ran it; a reset retried on a new one (the episode's lost) raised
            # where the episode never ran, and its next step would reach an environment never
            # reset: the episode ends there
            if not self._done and self.container is c:
                self._ran_and_raised("reset", args, tools, e)
            elif not self._done and self.conn is not None:  # (with none: _end_if_cut_off's)
                self._cut_short = "reset() raised on a new container (the episode's was lost)"
                self._done = True
            raise
        self._log, self._done, self._cut_short = [("reset", args, tools)], False, None
        self._trace = [digest(result)]
        if self.container is not None:
            self.container.episodes += 1
        self.pool.metrics["resets"] += 1
        return Observation.model_validate(result["obs"]), result.get("info") or {}

    async def _step(self, action: str | bytes) -> StepResult:
        self._check_alive()
        text = check_action(action, self.max_action_bytes)
        if self._done:
            if self._cut_short:
                raise EnvOrderError(f"{self.env_id}: the episode ended when {self._cut_short}; call reset()")
            raise EnvOrderError(
                f"{self.env_id}: step() before reset() (or after the episode ended); call reset()"
            )
        args = {"action": text}
        tools: _ToolLog = {}  # (shared by its attempts: a retry does not run a tool call again)
        try:
            result = await self._with_recovery(
                "step", lambda: self._call("step", args, self._cfg.step_timeout_s, tools), replay=True
            )
        except EnvLogicError as e:
            self._ran_and_raised("step", args, tools, e)
            raise
        res = StepResult.model_validate(result)
        self._log.append(("step", args, tools))
        self._trace.append(digest(result))
        self._done = res.done
        self.pool.metrics["steps"] += 1
        return res

    # -- internals
    def _ran_and_raised(self, op: str, args: dict[str, Any], tools: _ToolLog, e: EnvLogicError) -> None:
        """Record a request the environment raised on as part of the episode: a replay runs
        it again and expects the same error type (else the episode differs and the session
        is lost). Not one that hung (``EnvHung`` ends the episode), nor one the environment
        never ran (its container failed to make it: no container is attached any more)."""
        if not isinstance(e, EnvHung) and self.conn is not None and self._log:
            self._log.append((op, args, tools))
            self._trace.append(raised(e))

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

    async def _call(self, op: str, args: dict[str, Any], timeout_s: float, tools: _ToolLog) -> Any:
        if self.conn is None:  # the container was lost: a retry claims a new one
            self._check_alive()
            await self._attach()
        assert self.conn is not None and self.container is not None
        c = self.container
        c.last_active = time.monotonic()
        c.in_flight += 1
        self._tools_now = tools  # (after the attach: a constructor's calls are not op's)
        self._tool_seen = Counter()
        self._tool_by = _tool_deadline(timeout_s)
        try:
            reply = await self.conn.exchange({"op": op, "token": self.token, "args": args}, timeout_s)
            if reply["ok"]:
                return checked(op, reply["result"])
            err = reply["error"]
            e = remote_error(err)
            if isinstance(e, EnvLogicError) and err.get("reusable") is not True:
                self._retire(c)
            raise e
        except ProtocolError as e:
            # a bug of the server's (or of the pool's): no retry, no replay (it would break the
            # same way). Nothing more the container sends is to be trusted: discarded, and the
            # episode is over; a reset() starts a new one on a fresh container
            self._protocol_error(e)
            self._cut_short, self._done = f"{op}() got a reply that broke the session protocol", True
            await self._drop_container(healthy=False)
            raise type(e)(f"{self.env_id}: {e}") from None  # (a GarbledFrame stays one)
        except EnvHung as e:
            # the environment's bug, not the container's: no retry, no replay (it would hang
            # again). The container is still running the request: discard it; the episode is
            # over, and a reset() starts a new one on a fresh container.
            self.pool.metrics["env_hung"] += 1
            self._cut_short, self._done = f"{op}() hung", True
            await self._drop_container(healthy=False)
            raise EnvHung(f"{self.env_id}: {e}", op=e.op, timeout_s=e.timeout_s) from None
        except BaseException as e:
            if not isinstance(e, Exception):  # cancelled mid-request (an aborted trajectory)
                self._interrupted = True
            raise
        finally:
            self._tools_now = None
            c.in_flight -= 1
            c.last_active = time.monotonic()

    async def _tool(self, name: str, arguments: dict[str, Any]) -> str:
        """The session's tool bridge: the pool's, but a call the request under way made
        before (in an attempt that lost its container, or in the original of a replayed
        request) is answered with what it answered then, or awaited if it still runs (its
        container died while the tool ran: the connection's wait for it is cancelled, not
        the tool). Run again, a tool with side effects had them twice, and one whose answer
        changes (a live search, a counter) made a replay differ from the episode the policy
        saw, which lost the session. A call that failed (the bridge raised) runs again."""
        tools = self._tools_now
        if tools is None:  # (a constructor's call, made at every attach: no request's)
            return await self.pool._call_tool(name, arguments, self._tool_by)
        call = _tool_call(name, arguments)
        # counted as the call comes, before any await: two at once are two occurrences
        key = (*call, self._tool_seen[call])
        self._tool_seen[call] += 1
        run = tools.get(key)
        if run is None or (run.done() and (run.cancelled() or run.exception() is not None)):
            run = tools[key] = asyncio.ensure_future(self.pool._call_tool(name, arguments, self._tool_by))
            self._tool_runs.add(run)
            run.add_done_callback(self._tool_ran)
        return await asyncio.shield(run)

    def _tool_ran(self, run: asyncio.Future[str]) -> None:
        self._tool_runs.discard(run)
        if not run.cancelled():
            run.exception()  # (read: one nobody waits for any more is not logged as unretrieved)

    def _protocol_error(self, e: ProtocolError) -> None:
        """Count a protocol error of the container's; a garbled frame apart too (bytes that
        are no frame: most often output printed to the session socket, which asks another fix
        of the server's author than a malformed reply does)."""
        self.pool.metrics["protocol_errors"] += 1
        if isinstance(e, GarbledFrame):
            self.pool.metrics["garbled_frames"] += 1

    def _retire(self, c: Container) -> None:
        """The environment raised (a request, or the previous environment's close at the
        open) and its server did not say it is sound after it (envpool's
        says so of anything but a MemoryError or an OSError not about a path the caller
        named, which may have left the process short of memory, file descriptors or disk, or
        without a file of its own; a server of another language that does not say it is
        taken at its silence). The error is part of the episode, which goes on on
        this container as the policy saw it (and a replay repeats it); but no other episode
        runs on it: the next reset claims a fresh one, and its release discards it."""
        if not c.failed:
            c.failed = True
            self.pool.metrics["retired_unsound"] += 1

    async def _attach(self) -> None:
        """Claim a container and open the session connection (the handshake makes the env)."""
        t0 = time.perf_counter()
        c = await self.pool._claim(self.image)
        self.pool._claimed[c.id] = c
        if self._closed or self.status != "ok":
            # the session's block ended (or the session was lost) while the claim waited, and
            # its _detach has run: nothing else would release the container (but the reaper,
            # session_ttl_s later). Unused, it goes back to the pool
            await self.pool._release(c, healthy=True)
            self._check_alive()
        c.last_active = time.monotonic()
        self.container = c
        try:
            rt = self._cfg.runtime
            conn = await Connection.open(
                c.endpoint,
                heartbeat_s=rt.heartbeat_s,
                misses=self._cfg.heartbeat_misses,
                tool_caller=self._tool,
                cpu_probe=functools.partial(self.pool.runtime.cpu_seconds, c),
                close_timeout_s=self._cfg.close_timeout_s,
            )
            self.conn = conn
            hello = {"op": "open", "id": 0, "token": self.token, "env_id": self.env_id, "kwargs": self.kwargs}
            c.in_flight += 1  # a slow constructor is no leak either
            self._tool_by = _tool_deadline(self._cfg.reset_timeout_s)  # (a constructor's tool calls)
            try:
                reply = await conn.exchange(hello, self._cfg.reset_timeout_s)
            finally:
                c.in_flight -= 1
                c.last_active = time.monotonic()
            info = checked("open", reply["result"]) if reply["ok"] else {}
        except EnvHung as e:  # its constructor hangs: as a hung step, not retried
            closing = self.conn is not None and self.conn.phase == "close"
            await self._drop_container(healthy=False)
            if closing:
                # not this session's constructor (it never ran), but the container's previous
                # environment's close: its container is discarded, and the claim retried
                self.pool.metrics["env_close_hung"] += 1
                log.warning("envpool: %s: its previous environment's close hangs; discarded", c.id)
                limit = "close_timeout_s" if e.op == "close" else "reset_timeout_s"
                raise EnvCloseHung(
                    f"{c.id}: the previous environment's close() did not return in {e.timeout_s:g} s "
                    f"({limit}; before {self.env_id} was made there); the container was discarded"
                ) from None
            self.pool.metrics["env_hung"] += 1
            raise EnvHung(f"{self.env_id}: {e}", op=e.op, timeout_s=e.timeout_s) from None
        except ProtocolError as e:  # (the connection is closed: the server broke the protocol)
            self._protocol_error(e)
            await self._drop_container(healthy=False)
            raise type(e)(f"{self.env_id}: {e}") from None  # (a GarbledFrame stays one)
        except BaseException:
            await self._drop_container(healthy=False)
            raise
        if self._closed:  # (the block ended during the open: its _detach let the container go)
            await self._drop_container(healthy=False)
            self._check_alive()
        if not reply["ok"]:
            await self._open_failed(reply["error"])
        if info.get("close_error"):  # (another session's environment's bug: said, not this one's)
            self.pool.metrics["env_close_failed"] += 1
            log.warning("envpool: %s: its previous environment's close raised %s", c.id, info["close_error"])
        if info.get("retire"):
            self._retire(c)
        # the container knows its environments (an image registers its own)
        self.deterministic = info.get("deterministic", self.deterministic)
        self.max_action_bytes = info.get("max_action_bytes", self.max_action_bytes)
        self.pool.claim_ms.append((time.perf_counter() - t0) * 1e3)

    async def _open_failed(self, err: dict[str, Any]) -> NoReturn:
        """The environment could not be made (a bad env kwarg, an id the image does not have,
        a constructor that raises): the session fails, not retried. The server answered and
        waits for the next session; its container goes back to the pool only if the server
        says it is sound (``"reusable": true``: envpool's server says so of any error but a
        MemoryError or an OSError not about a path the caller named, which may have left the
        process short of memory, file descriptors or disk, or without a file of its own:
        ``envpool.server.sound_after``). Without that word
        (a server of another language that does not say it) the container is replaced: a
        cold start, rather than the next session on a broken container."""
        e = remote_error(err)
        if isinstance(e, ProtocolError):  # (kwargs the server could not read): a bug of one side
            self._protocol_error(e)
            await self._drop_container(healthy=False)
            raise ProtocolError(f"{self.env_id}: {e}")
        self.pool.metrics["open_failed"] += 1
        await self._drop_container(healthy=err.get("reusable") is True)
        if type(e) is EnvLogicError:
            raise EnvLogicError(
                f"{self.env_id}: making the environment with env_kwargs {self.kwargs!r} raised {e}",
                remote_type=e.remote_type,
                traceback=e.traceback,
            )
        raise e

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
        # its own time, after what the requests ahead of it have (a step still running in
        # another task): the server answers it once they are done. Counted from its sending,
        # it ran out behind a step longer than it, and the healthy container was discarded
        timeout_s = self.conn.busy_for() + self._cfg.close_timeout_s
        try:
            await self.conn.request({"op": "close", "token": self.token}, timeout_s)
        except Exception as e:  # it did not answer the goodbye: discard it rather than reuse it
            if isinstance(e, ProtocolError):  # (a stray frame broke it while nothing waited)
                self._protocol_error(e)
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
        rc = self._cfg.retry
        try:
            # the first attempt runs outside tenacity: almost every call succeeds on it, and
            # setting the retry machinery up was ~6-8% of a driver's busy time (every reset
            # and step). A failure becomes tenacity's first attempt (raised again there), so
            # the attempts, backoff and what is retried are tenacity's, as they were
            try:
                return await self._attempt(what, call, replay, retry=False)
            except (InfraError, OSError) as e:
                if not _retryable(e):
                    raise
                first: BaseException | None = e
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(rc.attempts),
                wait=wait_random_exponential(multiplier=rc.initial_backoff_s, max=rc.max_backoff_s),
                retry=retry_if_exception(_retryable),
                reraise=True,
            ):
                with attempt:
                    if first is not None:
                        failed, first = first, None
                        raise failed
                    return await self._attempt(what, call, replay, retry=True)
        except (InfraError, OSError) as e:
            self._lose()
            # nothing runs on its container any more (a dead one, or the one a replay that
            # differed ran on): let it go now, not when the block ends
            await self._drop_container(healthy=False)
            if not _retryable(e):  # (SessionLost; a misconfigured tool's, as it came)
                raise
            raise SessionLost(f"{what} failed after {rc.attempts} attempts: {e}") from e
        raise AssertionError("unreachable")

    async def _attempt(self, what: str, call: Any, replay: bool, *, retry: bool) -> Any:
        """One attempt of ``_with_recovery``: a retry replays the episode first (``replay``);
        an infrastructure failure is noted and its container dropped before it is raised."""
        try:
            if retry:
                self.pool.metrics[f"{what}_retries"] += 1
                if replay:
                    await self._replay()
            return await call()
        except (InfraError, OSError) as e:
            if isinstance(e, SessionLost):
                raise
            self._note(e)
            if self.container is not None and self.container.reaped:
                raise SessionLost(f"the reaper reclaimed this session's container: {e}") from e
            if replay and not self.deterministic and _retryable(e):
                msg = f"{self.env_id} is not deterministic: its episode cannot be rebuilt ({e})"
                raise SessionLost(msg) from e
            await self._drop_container(healthy=False)
            raise

    async def _replay(self) -> None:
        """Rebuild the episode on a fresh container: same reset, same actions, and the same
        observations, rewards and episode ends, checked step by step (``info`` may differ);
        a request that raised (an environment bug) runs again and must raise the same error
        type. Anything else loses the session: a rebuilt episode that differs from the one
        the policy saw would be wrong training data."""
        self._check_alive()  # (the session's block ended during the backoff: claim nothing)
        self.pool.metrics["replays"] += 1
        if not self._log:
            return
        timeouts = {"reset": self._cfg.reset_timeout_s, "step": self._cfg.step_timeout_s}
        seen = []
        try:
            if self.conn is None:  # (its constructor raising is no request of the episode)
                await self._attach()
            for op, args, tools in self._log:
                try:
                    seen.append(digest(await self._call(op, args, timeouts[op], tools)))
                except EnvHung:
                    raise
                except EnvLogicError as e:
                    seen.append(raised(e))
                if op == "reset" and self.container is not None:
                    # an episode this container ran: it counts toward its recycling (else
                    # max_episodes=1 handed it to the next trajectory in this one's state)
                    self.container.episodes += 1
        except (EnvLogicError, EnvUsageError, EnvRegistryError) as e:
            # (EnvRegistryError: the new container's image did not register the id)
            self._check_alive()  # (not a session closed meanwhile: that is said as such)
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
