"""The pool's end of one session connection (``envpool.protocol``) to a container."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pydantic_core

from envpool.errors import (
    ActionError,
    ConnectionLost,
    EnvHung,
    EnvLogicError,
    EnvOrderError,
    EnvPoolError,
    EnvRegistryError,
    EnvUsageError,
    GarbledFrame,
    InfraError,
    ProtocolError,
    SessionTokenError,
    StepTimeout,
)
from envpool.protocol import HEADER, MAX_FRAME, SHOWN, FrameDecoder, FrameError, encode, reply_problem

#: A tool bridge: ``(name, arguments) -> text`` for the environment; one that also takes
#: ``deadline_s=`` is given the seconds the call has (``EnvPool._call_tool``).
AsyncToolCaller = Callable[..., Awaitable[str]]

_USAGE = {
    "EnvOrderError": EnvOrderError,
    "ActionError": ActionError,
    "SessionTokenError": SessionTokenError,
    "UnknownEnvError": EnvRegistryError,  # its constructor wants the id list; the message has it
    "EnvRegistryError": EnvRegistryError,
}


def remote_error(err: dict[str, Any]) -> EnvPoolError:
    """The exception a server-side error stands for, in this process's hierarchy: by its
    type's name, unless the server marks it the environment's own (``"logic": true``)."""
    kind = str(err.get("type", ""))
    msg = str(err.get("message", ""))
    if err.get("logic") is True:
        # the environment's own exception, whatever its class is called: one named like an
        # error of envpool's (xmlrpc.client.ProtocolError, an ActionError of its own) is no
        # protocol bug nor the caller's mistake, but part of the episode (a replay repeats it)
        return EnvLogicError(f"{kind}: {msg}", remote_type=kind, traceback=err.get("traceback"))
    if kind in _USAGE:
        return _USAGE[kind](msg)
    if kind == "ProtocolError":
        return ProtocolError(msg)
    return EnvLogicError(f"{kind}: {msg}", remote_type=kind, traceback=err.get("traceback"))


def _protocol_error(msg: dict[str, Any]) -> ProtocolError:
    err = msg.get("error")
    detail = f": {err.get('message')}" if isinstance(err, dict) and err.get("message") else ""
    return ProtocolError(
        f"the container answered with a reply that has no valid request id ({msg.get('id')!r}) "
        f"and the session connection was closed{detail}"
    )


def _garbled(e: FrameError) -> GarbledFrame:
    shown = repr(e.data) + (f" (its first {SHOWN} bytes)" if len(e.data) >= SHOWN else "")
    if e.too_large:  # a whole reply, too big: no stray output to look for
        return GarbledFrame(
            f"the container sent a frame over the frame limit ({e}): {shown}. Keep each reply "
            "under the limit (envpool's server answers one over it with an ObservationTooLarge "
            "error of the environment instead, and keeps its container). Not retried (the request "
            "may have run); the session connection was closed"
        )
    return GarbledFrame(
        f"the container sent a garbled frame ({e}): {shown}. Check that the server "
        "writes nothing but frames to the session socket (a 4-byte big-endian length, then that "
        "many bytes of a UTF-8 JSON object), nothing printed or logged to it, and that one "
        "thread at a time writes a frame whole. Not retried (the request may have run); the "
        "session connection was closed"
    )


def _unsendable(result: Any) -> str:
    """The tool error an environment gets for a tool result ``send`` refused."""
    try:
        size = len(pydantic_core.to_json(result))
    except pydantic_core.PydanticSerializationError as e:
        return f"error: the tool's result cannot be sent as JSON ({e})"
    return (
        f"error: the tool's result is {size:,} bytes as JSON, too big for the {MAX_FRAME:,}-byte frame limit"
    )


class Connection(asyncio.Protocol):
    """Requests with ids, heartbeats that keep a slow request alive, tool calls brokered
    back to the pool. A silent server (no reply, no heartbeat) is declared hung."""

    def __init__(
        self,
        *,
        heartbeat_s: float,
        misses: int,
        tool_caller: AsyncToolCaller | None,
        cpu_probe: Callable[[], float | None] | None = None,
        close_timeout_s: float | None = None,
    ):
        self.decoder = FrameDecoder()
        self.transport: asyncio.Transport | None = None
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.outstanding: set[int] = set()
        """Ids sent and not answered yet, those nobody waits for any more (a cancelled
        request's) included: a late reply to one is dropped, a reply to any other id is the
        server's error (``reply_problem``)."""
        self.last_seen = time.monotonic()
        self.last_frame = float("-inf")
        """When the container last sent anything (a reply, a heartbeat): proof it is alive."""
        self.phase: str | None = None
        """What the server's last heartbeat of the request under way said it was doing
        beyond the request's own code (``"close"``: an open closing the previous environment)."""
        self.phase_since = time.monotonic()
        """When the heartbeats began to say ``phase``."""
        self.close_timeout_s = close_timeout_s
        """How long the ``"close"`` phase may last: past it the request raises ``EnvHung``
        (``op="close"``), not at its own timeout (an open's is ``reset_timeout_s``)."""
        self.due: dict[int, float] = {}
        """When (monotonic) each request waited for now times out."""
        self.silence_s = heartbeat_s * misses
        self.tool_caller = tool_caller
        self.tool_seen = float("-inf")
        """When a brokered tool call last started or ended (see ``_timeout``)."""
        self.cpu_probe = cpu_probe
        """The container process's CPU seconds, where the runtime can read them (a local
        process): a second proof of life, for code that holds the interpreter lock (a C
        extension, a runaway regex) and so silences the heartbeat thread (see ``_computing``)."""
        self.cpu_mark: tuple[float, float] | None = None
        """(monotonic, CPU seconds) read late in a silence, not per request (a read costs
        ~12 us, 5% of a step's round trip): ``probe_s`` before it would count as hung."""
        self.probe_s = max(0.1, self.silence_s / 2)
        self.last_busy = float("-inf")
        """When the process was last seen on the CPU through a silence."""
        self.ids = itertools.count(1)
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.broken: ProtocolError | None = None
        """How the server broke the protocol, once it has: every later request raises it.
        A malformed reply may come while nothing waits (a stray one between requests); the
        closed connection alone read as a container that died (``ConnectionLost``), and the
        next request was retried on fresh containers."""
        self.tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def open(cls, endpoint: str, **kw: Any) -> Connection:
        """Connect to ``endpoint``: a Unix socket path or ``tcp://host:port``."""
        loop = asyncio.get_running_loop()
        try:
            if endpoint.startswith("tcp://"):
                host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
                _, conn = await loop.create_connection(lambda: cls(**kw), host, int(port))
            else:
                _, conn = await loop.create_unix_connection(lambda: cls(**kw), endpoint)
        except (OSError, ValueError) as e:
            raise ConnectionLost(f"cannot connect to the container at {endpoint}: {e}") from e
        return conn

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.last_seen = self.last_frame = time.monotonic()
        self.cpu_mark = None  # alive: a later silence is measured afresh
        try:
            frames = self.decoder.feed(data)
        except FrameError as e:
            # the whole frames read before the garbage are the server's answers (a reply, then
            # a stray print in the same read): delivered, not failed with it
            if self._dispatch(e.frames):
                # not a lost connection (retried): the server read the request and may have
                # run it, so a retry could run a step twice; and nothing after it can be framed
                self._broken(_garbled(e))
            return
        self._dispatch(frames)

    def _dispatch(self, frames: list[dict[str, Any]]) -> bool:
        """Hand each frame to its waiter; False once one broke the protocol (the connection
        is broken then, and the frames after it are not read)."""
        for msg in frames:
            op = msg.get("op")
            if op == "heartbeat":
                phase = msg.get("phase")
                phase = phase if isinstance(phase, str) else None
                if phase != self.phase:
                    self.phase, self.phase_since = phase, time.monotonic()
                continue
            if op == "tool":
                t = asyncio.get_running_loop().create_task(self._tool(msg))
                self.tasks.add(t)
                t.add_done_callback(self.tasks.discard)
                continue
            rid = msg.get("id")
            if not isinstance(rid, int) or isinstance(rid, bool):
                # the server answers a request it could not read with a null id, then hangs up:
                # an error of the protocol (a bug on one side), which no retry fixes
                self._broken(_protocol_error(msg))
                return False
            problem = reply_problem(msg, self.outstanding)
            if problem is not None:
                self._broken(
                    ProtocolError(
                        f"the container's reply to request {problem}; the session connection was closed"
                    )
                )
                return False
            self.outstanding.discard(rid)
            fut = self.waiting.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail_all(ConnectionLost("the container closed the session connection (it died?)"))
        if not self.closed.done():
            self.closed.set_result(None)

    def _broken(self, exc: ProtocolError) -> None:
        """The server broke the protocol (a malformed reply, a garbled frame): what waits
        fails with ``exc``, and the connection ends (nothing it sends after is to be trusted;
        the session discards the container).
        Kept for the requests still to come: one may be sent after it, nobody waiting now."""
        if self.broken is None:
            self.broken = exc
        self._fail_all(exc)
        if self.transport is not None:
            self.transport.close()

    def _fail_all(self, exc: Exception) -> None:
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(exc)
        self.waiting.clear()

    async def _tool(self, msg: dict[str, Any]) -> None:
        name, args = str(msg.get("name")), msg.get("arguments") or {}
        self.tool_seen = time.monotonic()
        if self.tool_caller is None:
            result = f"error: no tool bridge configured for {name!r}"
        else:
            try:
                result = await self.tool_caller(name, args)
            except InfraError as e:
                # the machinery failed, not the tool on these arguments: no observation (the
                # policy would learn that its call was wrong). The request that made the call
                # fails as an infrastructure failure; its environment waits for an answer that
                # will not come, so the connection ends (the session replaces the container)
                self._fail_all(e)
                if self.transport is not None:
                    self.transport.close()
                return
            except Exception as e:  # the policy sees the tool's failure as text
                result = f"error: {type(e).__name__}: {e}"
            finally:
                self.tool_seen = time.monotonic()
        reply = {"op": "tool_result", "tool_id": msg.get("tool_id"), "result": result}
        try:
            try:
                self.send(reply)
            except EnvUsageError:
                # a result that cannot be sent (over the frame limit, not JSON): raised here, in
                # a task nobody awaits, the environment waited for it until its step timed out,
                # then the step was retried and replayed, running the tool again. The
                # environment is told instead, as of any other failed tool call
                self.send({**reply, "result": _unsendable(result)})
        except (ConnectionLost, ProtocolError):
            pass  # the container went (or broke the protocol) while the tool ran: nobody takes it

    # -- requests
    def send(self, msg: dict[str, Any]) -> None:
        if self.broken is not None:
            # (its "may have run" is the earlier request's: this one never left)
            raise type(self.broken)(
                f"{self.broken}. This request was not sent: the connection broke before it"
            )
        if self.transport is None or self.transport.is_closing():
            raise ConnectionLost("the session connection is closed")
        try:
            data = encode(msg)
        except pydantic_core.PydanticSerializationError as e:
            raise EnvUsageError(
                f"cannot send {msg.get('op', 'a message')!r} to the container: {e}; its arguments "
                "(env_kwargs, reset options) must be JSON-safe"
            ) from None
        if len(data) - HEADER.size > MAX_FRAME:
            # the server would refuse it and hang up: the caller's mistake, said here, and the
            # container kept (not a ProtocolError, nor a reset connection read as a fault)
            raise EnvUsageError(
                f"cannot send {msg.get('op', 'a message')!r} to the container: {len(data):,} bytes, over "
                f"the {MAX_FRAME:,}-byte frame limit; keep its arguments (env_kwargs, reset options) smaller"
            )
        self.transport.write(data)

    async def request(self, msg: dict[str, Any], timeout_s: float) -> Any:
        """Send ``msg`` (its ``id`` set here unless given) and return the result; raises the
        remote error, ``EnvHung`` (too slow while the container heartbeats), ``StepTimeout``
        (silent past the heartbeat misses, or too slow with no sign of life),
        ``ProtocolError`` or ``ConnectionLost``."""
        reply = await self.exchange(msg, timeout_s)
        if reply["ok"]:
            return reply["result"]
        raise remote_error(reply["error"])

    async def exchange(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """``request``, but a reply that says the request failed is returned, not raised:
        for the caller that reads more of it (a failed open's ``reusable``)."""
        rid = msg.setdefault("id", next(self.ids))
        # sent before anything waits for a reply: a message that cannot be sent leaves no
        # future behind (no reply can arrive in between: there is no await)
        self.send(msg)
        self.outstanding.add(rid)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[rid] = fut
        sent = self.last_seen = time.monotonic()
        self.cpu_mark = None
        self.phase, self.phase_since = None, sent
        deadline = sent + timeout_s
        self.due[rid] = deadline
        try:
            while True:
                now = time.monotonic()
                wake = min(deadline, self.last_seen + self.silence_s)
                if self.phase == "close" and self.close_timeout_s is not None:
                    # (read as the wait wakes: a close is given up at most a heartbeat
                    # window, heartbeat_s x misses, after its budget ran out)
                    close_by = self.phase_since + self.close_timeout_s
                    if now >= close_by:
                        raise EnvHung(
                            f"{msg.get('op')}: the previous environment's close() did not return in "
                            f"{self.close_timeout_s:g} s while its container was alive",
                            op="close",
                            timeout_s=self.close_timeout_s,
                        )
                    wake = min(wake, close_by)
                if self.cpu_probe is not None and self.cpu_mark is None:
                    mark_at = self.last_seen + self.silence_s - self.probe_s
                    if now >= mark_at:
                        self._mark(now)
                    else:
                        wake = min(wake, mark_at)
                wait = wake - now
                if wait <= 0:
                    if now >= deadline:
                        raise self._timeout(str(msg.get("op")), timeout_s, sent)
                    if self._computing(now):
                        self.last_seen = now  # silent but running, not frozen: on to the deadline
                        continue
                    raise StepTimeout(f"the container missed its heartbeats for {self.silence_s:g} s (hung)")
                # not wait_for: on Python 3.11 it returns a reply that landed in the loop turn
                # this task was cancelled, and the cancellation (an aborted trajectory) is lost
                await asyncio.wait((fut,), timeout=wait)
                if fut.done():
                    reply = fut.result()
                    break
        finally:
            self.waiting.pop(rid, None)
            self.due.pop(rid, None)
        return reply  # (checked by reply_problem as it was read)

    def busy_for(self) -> float:
        """Seconds until the last of the requests waited for now times out (0 if none): the
        server answers in order, so a request sent now is answered after them."""
        return max((d - time.monotonic() for d in self.due.values()), default=0.0)

    def _timeout(self, op: str, timeout_s: float, sent: float) -> EnvPoolError:
        """Whose fault a request past its deadline is. Heartbeats heard during it (the server
        sends them from its own thread while the request runs) prove the container alive:
        the environment's code is what does not answer, and a retry would only hang again.
        Without that proof (no heartbeat yet: a timeout shorter than a heartbeat period), or
        with a tool call during the request (still pending, or one that took most of the time:
        a slow tool is not a hung environment), it stays an infrastructure timeout, retried on
        a fresh container."""
        if self.tasks:
            return StepTimeout(f"{op} took longer than {timeout_s:g} s (a tool call was still pending)")
        if self.tool_seen > sent:
            return StepTimeout(f"{op} took longer than {timeout_s:g} s (tool calls ran during it)")
        now = time.monotonic()
        if self.last_frame > sent and now - self.last_frame < self.silence_s:
            proof = "heartbeating"
        elif self._computing(now):
            proof = "running on the CPU, too busy to heartbeat: code that holds the interpreter lock"
        else:
            return StepTimeout(f"{op} took longer than {timeout_s:g} s (no recent heartbeat)")
        return EnvHung(
            f"{op} did not answer in {timeout_s:g} s while its container was alive ({proof}): "
            "the environment hangs on this input; not retried (a replay would hang the same way)",
            op=op,
            timeout_s=timeout_s,
        )

    def _mark(self, now: float) -> None:
        cpu = self.cpu_probe() if self.cpu_probe is not None else None
        if cpu is None:  # the runtime cannot tell (a remote one), or the process is gone
            self.cpu_probe = None
        else:
            self.cpu_mark = (now, cpu)

    def _computing(self, now: float) -> bool:
        """Whether the container's process spent at least a tenth of a core on the CPU since
        the last look: alive and working, only too busy to heartbeat (its code holds the
        interpreter lock). A frozen or stopped process, or one blocked in the kernel, uses
        none: that stays a hung container, replaced and replayed. (Half a core was asked
        before: on a loaded host, a spinning process given a third of a core read as frozen.)"""
        if self.cpu_probe is None or self.cpu_mark is None:
            return False
        t0, cpu0 = self.cpu_mark
        if now - t0 < 0.1:  # the kernel counts CPU time in clock ticks (10 ms): too short to tell
            return now - self.last_busy < self.silence_s
        cpu = self.cpu_probe()
        if cpu is None:
            return False
        self.cpu_mark = (now, cpu)
        if cpu - cpu0 < 0.1 * (now - t0):
            return False
        self.last_busy = now
        return True

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        for t in self.tasks:
            t.cancel()
