"""The container's server's sessions (``Server``): one at a time over a connection, the
environment made (or reused) at its open, each request answered, the tool calls the
environment makes sent to the pool, and heartbeats while a request runs. Split from
``envpool.server``, which re-exports its names."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from typing import Any

from envpool.protocol import HEADER, MAX_FRAME, FrameError, encode, error_payload, recv_frame
from envpool.server_errors import _ENV_RAISES, _env_error_payload, jsonable, sound_after


class Server:
    def __init__(self, registry: Any, fault: dict[str, float]):
        self.registry = registry
        self.env: Any = None
        self.env_key: tuple[str, str] | None = None
        self.write_lock = threading.Lock()
        self.conn: socket.socket | None = None
        self.busy = threading.Event()
        self.fault = fault
        self.rng = random.Random()
        self.closed_said: dict[str, Any] = {}
        """What this session's open says of the previous environment's close (``open_env``)."""
        self.queued: deque[dict[str, Any]] = deque()
        """Frames read while the environment waited on a tool's answer (``call_tool``), read
        again, in order, before the socket: the session's goodbye, sent while a step ran, was
        thrown away there, never answered, and the pool discarded a healthy container."""
        self.reading = threading.Condition()
        """Guards the socket's reads, ``queued``, ``answers`` and ``reader``: one thread reads
        the socket at a time and hands each frame to the thread it is for (``read``)."""
        self.reader = False
        """Whether a thread is reading the socket now (the others wait on ``reading``)."""
        self.answers: dict[int, str] = {}
        """Tool results read by another thread than the one whose call they answer."""
        self.asking: set[int] = set()
        """The tool calls waiting for their results (``tool_id``)."""
        self.phase: str | None = None
        """What the server does during a request that is not the request's own code, said in
        its heartbeats: ``"close"`` while an open closes the previous environment, so that
        an open that hangs there is blamed on that close, not on the new constructor."""

    # -- io
    def send(self, msg: dict[str, Any]) -> None:
        data = encode(msg)
        if len(data) > MAX_FRAME:  # the environment's answer is too big: its bug, not the pool's
            message = f"reply of {len(data):,} bytes is over the {MAX_FRAME:,}-byte frame limit"
            err = {"type": "ObservationTooLarge", "message": message, "logic": True, "reusable": True}
            data = encode({"id": msg.get("id"), "ok": False, "error": err})
        self.write(data)

    def write(self, data: bytes) -> None:
        with self.write_lock:
            if self.conn is not None:
                self.conn.sendall(data)

    def heartbeat(self, interval: float) -> None:
        while True:
            time.sleep(interval)
            if self.busy.is_set():
                with contextlib.suppress(OSError):
                    self.beat()

    def beat(self) -> None:
        """One heartbeat, with the ``phase`` read under the write lock: a beat of a phase
        that has ended never follows the beat that said it ended."""
        with self.write_lock:
            msg: dict[str, Any] = {"op": "heartbeat"}
            if self.phase is not None:
                msg["phase"] = self.phase
            if self.conn is not None:
                self.conn.sendall(encode(msg))

    def recv(self, conn: socket.socket) -> dict[str, Any]:
        """The session's next request."""
        msg = self.read(conn, None)
        assert isinstance(msg, dict)
        return msg

    def read(self, conn: socket.socket, tool_id: int | None) -> dict[str, Any] | str:
        """The next request (``tool_id`` None), or the result of the tool call ``tool_id``.
        An environment may call tools from threads of its own, and the session's loop reads
        its next request while one of them may still wait: each reading the socket itself,
        two read it at once (one a frame's header, the other its body), and a thread that
        read another's answer dropped it (that one waited for good). So one thread reads
        at a time and hands on what it reads that is another's: a request to ``queued``, a
        tool result to ``answers``."""
        with self.reading:
            while True:
                if tool_id is None and self.queued:
                    return self.queued.popleft()
                if tool_id is not None and tool_id in self.answers:
                    return self.answers.pop(tool_id)
                if not self.reader:
                    self.reader = True
                    break
                self.reading.wait()
        try:
            while True:
                msg = recv_frame(conn)  # (outside the lock: the others wait for what it brings)
                with self.reading:
                    if msg.get("op") != "tool_result":
                        if tool_id is None:
                            return msg
                        self.queued.append(msg)  # (a request, the goodbye most often: read after this one)
                    elif msg.get("tool_id") == tool_id and tool_id is not None:
                        return str(msg.get("result", ""))
                    elif msg.get("tool_id") in self.asking:
                        self.answers[msg["tool_id"]] = str(msg.get("result", ""))
                    # (else an answer nobody waits for: dropped, as before)
                    self.reading.notify_all()
        finally:
            with self.reading:
                self.reader = False
                self.reading.notify_all()  # the next waiter reads, or finds its frame

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Ask the pool to run a fabric tool; the container itself has no network."""
        tool_id = self.rng.getrandbits(48)
        data = encode({"op": "tool", "tool_id": tool_id, "name": name, "arguments": arguments})
        if len(data) - HEADER.size > MAX_FRAME:
            # the policy's arguments (or what the environment built of them) are too big to
            # send: text for the policy, as the fabric's PayloadTooLarge is. Through ``send``
            # it became an ObservationTooLarge reply with no request id, a protocol error
            # that ended the session (and this call waited for an answer that never came)
            return (
                f"error: the tool call's arguments are {len(data) - HEADER.size:,} bytes as JSON, "
                f"too big for the {MAX_FRAME:,}-byte frame limit; the tool was not run"
            )
        conn = self.conn
        assert conn is not None
        with self.reading:
            self.asking.add(tool_id)
        try:
            self.write(data)
            result = self.read(conn, tool_id)
        finally:
            with self.reading:
                self.asking.discard(tool_id)
                self.answers.pop(tool_id, None)
        assert isinstance(result, str)
        return result

    # -- sessions
    def serve(self, listener: socket.socket) -> None:
        while True:
            conn, _ = listener.accept()
            self.conn = conn
            try:
                self.session(conn)
            except (EOFError, ConnectionError, OSError):
                pass  # the pool hung up: wait for the next session
            except (FrameError, ValueError, TypeError) as e:
                # a garbled request ends that connection, never the container
                with contextlib.suppress(OSError):
                    self.send(
                        {"id": None, "ok": False, "error": {"type": "ProtocolError", "message": str(e)}}
                    )
            finally:
                with self.write_lock:
                    self.conn = None
                with self.reading:
                    self.queued.clear()  # (the last connection's: none of the next session's)
                    self.answers.clear()
                conn.close()

    def session(self, conn: socket.socket) -> None:
        hello = recv_frame(conn)
        token = hello.get("token")
        kwargs = hello.get("kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            # the client's mistake, not the constructor's: said as the protocol's
            message = f"open: kwargs must be a JSON object, not {type(kwargs).__name__}"
            self.send({"id": 0, "ok": False, "error": {"type": "ProtocolError", "message": message}})
            return
        self.busy.set()  # a slow constructor still heartbeats
        try:
            self.open_env(str(hello.get("env_id")), kwargs or {})
        except _ENV_RAISES as e:  # (its sys.exit() too: see ``handle``)
            from envpool.errors import EnvPoolError

            err = _env_error_payload(e)
            if not isinstance(e, EnvPoolError):  # (an unknown id is the registry's, by its name)
                err["logic"] = True  # the constructor's own, whatever its class is called
            if sound_after(e, kwargs) and not self.closed_said.get("retire"):
                # a clean error of the environment's code (or an id this image lacks, or a
                # path that is not there): this process is as sound as before, and its
                # container may serve the next session. Not after a MemoryError or an OSError
                # of resources: the constructor may have run it short of memory, file
                # descriptors or disk, or left them held; the pool replaces it
                err["reusable"] = True
            self.send({"id": 0, "ok": False, "error": err})
            return
        finally:
            self.busy.clear()
        spec = self.env.spec
        info = {
            "pid": os.getpid(),
            "deterministic": spec.deterministic,
            "max_action_bytes": spec.max_action_bytes,
            **self.closed_said,
        }
        self.send({"id": 0, "ok": True, "result": info})
        while True:
            msg = self.recv(conn)
            rid = int(msg.get("id", -1))
            if msg.get("token") != token:
                from envpool.errors import SessionTokenError

                refused = SessionTokenError("this request carries another session's token; it was refused")
                self.send({"id": rid, "ok": False, "error": error_payload(refused)})
                continue
            op = msg.get("op")
            if op == "close":
                self.send({"id": rid, "ok": True, "result": None})
                return
            self.send(self.handle(rid, op, msg.get("args")))

    def open_env(self, env_id: str, kwargs: dict[str, Any]) -> None:
        """Make (or reuse) the session's environment. What the open says of the previous
        one's close, where that raised, goes to ``closed_said``: ``close_error``, and
        ``retire`` where the process may no longer be sound after it (``sound_after``)."""
        said: dict[str, Any] = {}
        self.closed_said = said
        key = (env_id, json.dumps(kwargs, sort_keys=True))
        if self.env_key != key:
            # forgotten before its close: one that raises leaves none behind, closed, under its kwargs
            env, old, self.env, self.env_key = self.env, self.env_key, None, None
            if env is not None:
                self.phase = "close"
                try:
                    # said at once: a close that holds the interpreter lock silences the beats
                    with contextlib.suppress(OSError):
                        self.beat()
                    env.close()
                except _ENV_RAISES as e:
                    # the last session's environment's bug, not this session's: raised into this
                    # open, it failed a session that had done nothing wrong (not retried, and
                    # blamed on its own env_kwargs). Said to the pool (and logged here) instead
                    traceback.print_exc(file=sys.stderr)
                    said["close_error"] = f"{type(e).__name__}: {e}"[:1000]
                    if not sound_after(e, json.loads(old[1]) if old else None):
                        said["retire"] = True  # short of memory, say: the pool runs no episode here
                finally:
                    self.phase = None
                    with contextlib.suppress(OSError):
                        self.beat()  # the close is over: what hangs from here is the constructor
            self.env = self.registry.make(env_id, tool_caller=self.call_tool, **kwargs)
            self.env_key = key
        else:
            # reused: the last session's episode (half played, maybe) is not this one's
            self.env.require_reset()

    def handle(self, rid: int, op: Any, args: Any) -> dict[str, Any]:
        from envpool.errors import EnvUsageError

        if args is None:
            args = {}
        elif not isinstance(args, dict):  # a bug of the client's, not the environment's
            message = f"{op}: args must be a JSON object, not {type(args).__name__}"
            return {"id": rid, "ok": False, "error": {"type": "ProtocolError", "message": message}}
        self.busy.set()
        try:
            self.maybe_crash()
            if op == "ping":
                result: Any = {"pid": os.getpid()}
            elif op == "reset":
                obs, info = self.env.reset(seed=args.get("seed"), options=args.get("options"))
                result = jsonable("reset", {"obs": obs, "info": info})
            elif op == "step":
                result = jsonable("step", self.env.step(args.get("action")))
            else:
                return {
                    "id": rid,
                    "ok": False,
                    "error": {"type": "ProtocolError", "message": f"unknown op {op!r}"},
                }
            return {"id": rid, "ok": True, "result": result}
        except EnvUsageError as e:
            return {"id": rid, "ok": False, "error": {**error_payload(e), "reusable": True}}
        except _ENV_RAISES as e:  # the environment's own bug: data for the caller, the server lives on
            # its sys.exit() or KeyboardInterrupt too: left to end the process, the pool read
            # it as a dead container, retried and replayed the step on fresh ones until its
            # attempts ran out (SessionLost). No signal to this process raises one here: it
            # ignores SIGINT (``envpool.server.run``: the pool stops it, by SIGKILL), and a SIGTERM's default
            # action ends it without unwinding; only a handler the environment installed
            # itself could, and then the signal was the environment's to take
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-6))[-4000:]
            err = {**_env_error_payload(e, traceback=tb), "logic": True}
            if sound_after(e, [json.loads(self.env_key[1]) if self.env_key else None, args]):
                # as for a failed open: after a MemoryError or an OSError of resources this
                # process may be short of memory, file descriptors or disk (or hold them
                # still), so the pool plays this episode out on it and then retires it
                err["reusable"] = True
            return {"id": rid, "ok": False, "error": err}
        finally:
            self.busy.clear()

    def maybe_crash(self) -> None:
        # fault injection for benchmarks and tests: the whole container dies mid-request
        if self.fault.get("crash_rate") and self.rng.random() < self.fault["crash_rate"]:
            os._exit(17)
        if self.fault.get("hang_rate") and self.rng.random() < self.fault["hang_rate"]:
            # or freezes: every thread stops, the heartbeat's too, as in a frozen container (a
            # sleep here heartbeated on, and read as the environment hanging: EnvHung)
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(3600)  # (should it be continued)
