"""The container's server (``envpool.server.Server``) driven over the wire protocol in this
process: its sessions on socket pairs, each accepted by ``serve`` as from a listener."""

from __future__ import annotations

import contextlib
import errno
import queue
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from echo_bundle import IMAGE
from pool_util import pool

from envpool.api import EnvRegistry
from envpool.errors import EnvOrderError, EnvUsageError
from envpool.protocol import MAX_FRAME, encode, recv_frame
from envpool.server import Server, sound_after


class _Listener:
    """What ``Server.serve`` accepts from: socket pairs handed over by the test; ``None``
    ends it (``accept`` raises, as a closed listener's would)."""

    def __init__(self) -> None:
        self.pending: queue.Queue[socket.socket | None] = queue.Queue()

    def accept(self) -> tuple[socket.socket, Any]:
        conn = self.pending.get()
        if conn is None:
            raise OSError("listener closed")
        return conn, None


class _Wire:
    def __init__(self, listener: _Listener) -> None:
        self.listener = listener
        self.clients: list[socket.socket] = []

    def connect(self) -> socket.socket:
        ours, theirs = socket.socketpair()
        ours.settimeout(30)  # only bounds a failure: every reply comes at once
        self.clients.append(ours)
        self.listener.pending.put(theirs)
        return ours

    @staticmethod
    def ask(sock: socket.socket, msg: dict[str, Any]) -> dict[str, Any]:
        sock.sendall(encode(msg))
        return recv_frame(sock)

    def open(self, token: str, env_id: str = "echo-v0", **kwargs: Any) -> socket.socket:
        sock = self.connect()
        hello = self.ask(sock, {"op": "open", "id": 0, "token": token, "env_id": env_id, "kwargs": kwargs})
        assert hello["ok"], hello
        return sock


@pytest.fixture
def wire() -> Iterator[_Wire]:
    registry = EnvRegistry()
    registry.register("echo-v0", entry_point="envpool.envs.echo:EchoEnv")
    server = Server(registry, {})
    listener = _Listener()

    def serve() -> None:
        with contextlib.suppress(OSError):
            server.serve(listener)  # type: ignore[arg-type]

    thread = threading.Thread(target=serve, name="envpool-test-server", daemon=True)
    thread.start()
    w = _Wire(listener)
    try:
        yield w
    finally:
        for sock in w.clients:
            sock.close()  # the session in progress ends (EOF), then the listener
        listener.pending.put(None)
        thread.join(30)
        assert not thread.is_alive()


def test_a_new_session_on_the_reused_environment_cannot_step_the_last_sessions_episode(wire):
    # the server keeps one environment across sessions (same id and kwargs): a session that
    # stepped first went on with the episode another trajectory left half-played
    first = wire.open("a")
    assert wire.ask(first, {"op": "reset", "id": 1, "token": "a", "args": {"seed": 1}})["ok"]
    assert wire.ask(first, {"op": "step", "id": 2, "token": "a", "args": {"action": "x"}})["ok"]
    assert wire.ask(first, {"op": "close", "id": 3, "token": "a"})["ok"]

    second = wire.open("b")
    reply = wire.ask(second, {"op": "step", "id": 1, "token": "b", "args": {"action": "y"}})
    assert not reply["ok"] and reply["error"]["type"] == EnvOrderError.__name__, reply
    assert wire.ask(second, {"op": "reset", "id": 2, "token": "b", "args": {"seed": 2}})["ok"]
    step = wire.ask(second, {"op": "step", "id": 3, "token": "b", "args": {"action": "y"}})
    assert step["ok"] and step["result"]["info"] == {"steps": 1}, step


@pytest.mark.parametrize("args", [["y"], "y", 5])
def test_request_args_that_are_not_an_object_are_a_protocol_error_not_the_environments(wire, args):
    # they reached the request's handler, whose AttributeError was reported as the
    # environment's own bug (an EnvLogicError with its traceback, "logic": true)
    sock = wire.open("a")
    assert wire.ask(sock, {"op": "reset", "id": 1, "token": "a", "args": {"seed": 1}})["ok"]
    reply = wire.ask(sock, {"op": "step", "id": 2, "token": "a", "args": args})
    assert not reply["ok"] and reply["error"]["type"] == "ProtocolError", reply
    assert "args" in reply["error"]["message"] and not reply["error"].get("logic")
    step = wire.ask(sock, {"op": "step", "id": 3, "token": "a", "args": {"action": "y"}})
    assert step["ok"], step  # the session goes on


def test_a_request_is_run_as_sent_the_server_keeps_no_replies(wire):
    # the server kept its last 64 replies (up to 16 MiB each, in every container) to answer a
    # repeated id from them, for a resend the pool never makes: a failed request's container is
    # discarded and its episode replayed on a fresh one. A repeated id only came back stale
    sock = wire.open("a")
    assert wire.ask(sock, {"op": "reset", "id": 1, "token": "a", "args": {"seed": 1}})["ok"]
    first = wire.ask(sock, {"op": "step", "id": 2, "token": "a", "args": {"action": "x"}})
    again = wire.ask(sock, {"op": "step", "id": 2, "token": "a", "args": {"action": "y"}})
    assert first["result"]["obs"]["text"] == "x" and first["result"]["info"] == {"steps": 1}, first
    assert again["id"] == 2 and again["result"]["obs"]["text"] == "y", again
    assert again["result"]["info"] == {"steps": 2}, again


def test_open_kwargs_that_are_not_an_object_are_a_protocol_error_not_the_constructors(wire):
    sock = wire.connect()
    hello = {"op": "open", "id": 0, "token": "a", "env_id": "echo-v0", "kwargs": "seed=1"}
    reply = wire.ask(sock, hello)
    assert not reply["ok"] and reply["error"]["type"] == "ProtocolError", reply
    assert "kwargs" in reply["error"]["message"]
    wire.open("b")  # the server waits for the next session


@pytest.mark.parametrize(
    ("exc", "sound"),
    [
        (ValueError("no such level"), True),
        (MemoryError(), False),
        (OSError(errno.ENOENT, "No such file or directory"), True),  # (a FileNotFoundError)
        (OSError(errno.ENOTDIR, "Not a directory"), True),
        (OSError(errno.EISDIR, "Is a directory"), True),
        (OSError(errno.EEXIST, "File exists"), True),
        (OSError(errno.ENAMETOOLONG, "File name too long"), True),
        (OSError(errno.EMFILE, "Too many open files"), False),
        (OSError(errno.ENOSPC, "No space left on device"), False),
        (OSError(errno.EAGAIN, "Resource temporarily unavailable"), False),
        (OSError(errno.EACCES, "Permission denied"), False),  # a sandbox's refusal too
        (OSError("no errno to tell"), False),
        (ConnectionResetError(), False),
    ],
    ids=repr,
)
def test_an_oserror_that_only_says_a_path_is_wrong_leaves_the_server_sound(exc, sound):
    # every OSError read as a container short of a resource: a bad path in env_kwargs cost
    # a cold start per session
    assert sound_after(exc) is sound


async def test_a_request_over_the_frame_limit_is_refused_before_it_is_sent(images):
    # sent, the server refused the frame and hung up: a ProtocolError, and the session's
    # container discarded for the caller's own mistake (over TCP, a reset connection could
    # even read as an infrastructure fault, retried on fresh containers)
    async with pool(images, min_warm=0) as p, p.session("bundle-echo-v0", image=IMAGE) as s:
        held = s.container
        with pytest.raises(EnvUsageError, match="frame limit"):
            await s.reset(seed=1, options={"x": "a" * MAX_FRAME})
        assert (await s.reset(seed=1))[0].text == "ready 1"
        assert s.container is held  # the session and its container go on
    assert p.stats().get("discarded", 0) == 0


async def test_an_injected_hang_freezes_the_container_an_infrastructure_fault_not_the_environments(images):
    # the hang fault slept with the heartbeat thread still beating: since a request that times
    # out while its container heartbeats is the environment hanging (EnvHung, never retried),
    # the chaos meant to exercise the frozen-container path exercised nothing of it
    from envpool.errors import EnvHung, SessionLost

    faults = {"heartbeat_s": 0.1, "faults": {"hang_rate": 1.0}}
    async with pool(images, min_warm=0, runtime=faults, reset_timeout_s=5, retry={"attempts": 2}) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            with pytest.raises(SessionLost) as lost:
                await s.reset(seed=1)
        assert not isinstance(lost.value.__cause__, EnvHung)
        stats = p.stats()
        assert stats.get("env_hung", 0) == 0 and stats.get("infra:hung_or_timeout", 0) == 2, stats


@pytest.mark.parametrize(
    ("filename", "given", "sound"),
    [
        ("/data/levels/7.txt", {"data_dir": "/data/levels"}, True),  # under a path the caller named
        ("levels/7.txt", {"level": "7"}, True),  # a name the caller gave, as the file's stem
        ("boards/x.txt", {"action": "boards/x.txt"}, True),
        ("/usr/local/bin/solver", {"level": "7"}, False),  # the environment's own program gone
        ("/opt/env/data.json", {}, False),  # its own data file, whatever the request was
        ("/opt/env/data.json", {"seed": 3, "options": None}, False),
        ("/opt/env/data.json", {"root": "/"}, False),  # every absolute path is under "/"
        ("/opt/env/data.json", {"data": 3}, False),  # a key names a parameter, not a path
    ],
)
def test_a_path_error_is_sound_only_for_a_path_the_caller_named(filename, given, sound):
    # any FileNotFoundError kept its container: one for the environment's own file or program
    # deleted from the container (by a module it ran, say) too, which every later session
    # there then failed on the same way
    exc = FileNotFoundError(errno.ENOENT, "No such file or directory", filename)
    assert sound_after(exc, given) is sound


class _FifoConn:
    """A session socket whose reads are served to the threads blocked on it in the order
    they began to wait (a kernel may wake any of them): what one thread reads of a frame,
    its header say, the next waiting thread may read the rest of."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.data = bytearray()
        self.readers: list[int] = []
        self.sent: list[dict[str, Any]] = []

    def sendall(self, data: bytes) -> None:
        with self.cond:
            self.sent.append(recv_frame(_Bytes(data)))  # type: ignore[arg-type]
            self.cond.notify_all()

    def recv(self, n: int) -> bytes:
        me = threading.get_ident()
        with self.cond:
            self.readers.append(me)
            self.cond.notify_all()
            self.cond.wait_for(lambda: bool(self.data) and self.readers[0] == me, timeout=5)
            self.readers.remove(me)
            self.cond.notify_all()
            chunk = bytes(self.data[:n])
            del self.data[:n]
            return chunk  # (b"" after the wait ran out: EOF, as a closed socket's)

    def feed(self, msg: dict[str, Any]) -> None:
        with self.cond:
            self.data += encode(msg)
            self.cond.notify_all()

    def wait_for(self, check: Any) -> None:
        with self.cond:
            assert self.cond.wait_for(check, timeout=10), "the server did not get there"


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def recv(self, n: int) -> bytes:
        chunk, self.data = self.data[:n], self.data[n:]
        return chunk


def test_tool_calls_from_several_threads_each_get_their_own_answer():
    # an environment that calls tools from threads of its own: each call read the socket
    # itself, so two threads read it at once (one the header of a frame, the other its
    # body), and one that read another's answer dropped it (that one waited for good)
    server = Server(EnvRegistry(), {})
    conn = _FifoConn()
    server.conn = conn  # type: ignore[assignment]
    got: dict[str, Any] = {}

    def call(name: str) -> None:
        try:
            got[name] = server.call_tool(name, {})
        except BaseException as e:
            got[name] = e

    first = threading.Thread(target=call, args=("first",), daemon=True)
    first.start()
    conn.wait_for(lambda: len(conn.sent) == 1 and len(conn.readers) == 1)  # it reads, nothing yet
    second = threading.Thread(target=call, args=("second",), daemon=True)
    second.start()
    conn.wait_for(lambda: len(conn.sent) == 2)
    ids = {m["name"]: m["tool_id"] for m in conn.sent}
    conn.feed({"op": "tool_result", "tool_id": ids["second"], "result": "for the second"})
    conn.feed({"op": "tool_result", "tool_id": ids["first"], "result": "for the first"})
    first.join(30)
    second.join(30)
    assert got == {"first": "for the first", "second": "for the second"}


_THREADED_TOOLS = """
import threading
import envpool


class ThreadedToolsEnv(envpool.Env):
    def reset(self, *, seed=None, options=None):
        return "ready", {}

    def step(self, action):
        out = {}
        def call(name):
            out[name] = self.call_tool(name, {})
        threads = [threading.Thread(target=call, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return envpool.StepResult(obs=envpool.Observation(text=f"{out['a']} {out['b']}"))
"""


async def test_tool_calls_from_threads_of_a_container_get_their_own_answers(tmp_path):
    import asyncio

    from echo_bundle import write_env_bundle

    from envpool.pool import EnvPool

    images = write_env_bundle(
        tmp_path / "b", "threaded_env", _THREADED_TOOLS, {"threaded-v0": "ThreadedToolsEnv"}
    )
    both, answered_b = asyncio.Event(), asyncio.Event()
    asked: list[str] = []

    async def tool(name, arguments):
        asked.append(name)
        if len(asked) == 2:
            both.set()
        await both.wait()
        if name == "a":  # the second call's answer goes first
            await answered_b.wait()
            await asyncio.sleep(0.05)
        else:
            answered_b.set()
        return f"answer-{name}"

    cfg = {"min_warm": 0, "runtime": {"heartbeat_s": 0.1}, "step_timeout_s": 20}
    async with EnvPool(cfg, images=images, tool_caller=tool) as p:
        async with p.session("threaded-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            for _ in range(3):
                assert (await s.step("go")).obs.text == "answer-a answer-b"
                asked.clear()
                both.clear()
                answered_b.clear()
