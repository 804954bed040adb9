"""Functions the local-backend tests run in real worker processes (top level, importable)."""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import time
from pathlib import Path

from fabric.registry import Registry

REG = Registry()
_SETUP_CALLS = 0


@REG.function(warm=1)
def add(a: int, b: int = 0) -> int:
    return a + b


@REG.function(warm=0)
def pid(tag: str = "") -> int:
    return os.getpid()


@REG.function(warm=0)
def boom(x: int) -> int:
    raise ValueError(f"bad x={x}")


@REG.function(warm=0, timeout_s=10)
def sleepy(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


@REG.function(warm=0, timeout_s=0.5, retry={"max_attempts": 1})
def hang() -> None:
    while True:
        pass


@REG.function(warm=1, timeout_s=0.5, retry={"max_attempts": 1})
def hang_or_echo(hang: bool, x: int) -> int:
    """Never retried: queued behind a call that hangs, a call must still be answered."""
    while hang:
        pass
    return x


@REG.function(warm=0, retry={"max_attempts": 2, "initial_backoff_s": 0.01})
def suicide() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@REG.function(warm=0, retry={"max_attempts": 3, "initial_backoff_s": 0.01})
def flaky(path: str, fail_times: int) -> int:
    """Dies (SIGKILL) on its first ``fail_times`` executions, counted in a file."""
    p = Path(path)
    n = int(p.read_text()) if p.exists() else 0
    p.write_text(str(n + 1))
    if n < fail_times:
        os.kill(os.getpid(), signal.SIGKILL)
    return n + 1


def _setup() -> dict:
    global _SETUP_CALLS
    _SETUP_CALLS += 1
    return {"pid": os.getpid(), "setup_calls": _SETUP_CALLS, "at": time.time()}


@REG.function(warm=1, setup=_setup)
def with_setup(x: int, ctx: dict) -> dict:
    return {"x": x, **ctx}


def _bad_setup() -> None:
    raise RuntimeError("model weights not found")


@REG.function(warm=0, setup=_bad_setup)
def bad_setup(x: int) -> int:
    return x


@REG.function(warm=0, max_concurrency=16)
async def async_sleepy(seconds: float) -> int:
    await asyncio.sleep(seconds)
    return os.getpid()


@REG.function(warm=0)
def big_result(n: int) -> str:
    return "x" * n


@REG.function(warm=0)
def not_json() -> object:
    return object()


@REG.function(warm=0, max_concurrency=2)
def limited(seconds: float) -> float:
    time.sleep(seconds)
    return time.time()


@REG.tool(warm=0, side_effects=True)
def append_line(path: str, line: str) -> int:
    with open(path, "a") as f:
        f.write(line + "\n")
    return len(Path(path).read_text().splitlines())


@REG.function(warm=0)
def exits() -> None:
    raise SystemExit(3)


@REG.tool(
    warm=0,
    timeout_s=0.5,
    max_batch=8,
    side_effects=True,
    retry={"max_attempts": 2, "initial_backoff_s": 0.01},
)
def maybe_hang(path: str, hang: bool) -> str:
    """Appends to ``path`` (a side effect), then hangs when asked."""
    with open(path, "a") as f:
        f.write("x")
    while hang:
        pass
    return "done"


def _second_worker_fails() -> None:
    # the first worker to start leaves a marker; any later one fails its setup
    marker = Path(os.environ["FABRIC_TEST_MARKER"])
    if marker.exists():
        raise RuntimeError("this worker cannot load its model")
    marker.write_text("taken")


@REG.function(warm=1, setup=_second_worker_fails)
def picky(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def _cleans_up_at_exit() -> None:
    # what a library holding a process or a file does (the code verifier's sandbox): an exit
    # handler that ends it
    marker = Path(os.environ["FABRIC_TEST_MARKER"])
    atexit.register(marker.write_text, str(os.getpid()))


@REG.function(warm=1, setup=_cleans_up_at_exit)
def exit_handler(x: int) -> int:
    return os.getpid()


def _fails_first_time() -> None:
    marker = Path(os.environ["FABRIC_TEST_MARKER"])
    if not marker.exists():
        marker.write_text("failed once")
        raise RuntimeError("transient setup failure")


@REG.function(warm=0, setup=_fails_first_time)
def recovers(x: int) -> int:
    return x


@REG.function(warm=0)
async def slow_write(path: str, seconds: float) -> str:
    await asyncio.sleep(seconds)
    Path(path).write_text("written")  # noqa: ASYNC240 - a tiny write is the side effect under test
    return "written"


@REG.function(warm=0, retry={"max_attempts": 20, "initial_backoff_s": 0.05, "max_backoff_s": 0.2})
def patient_sleep(seconds: float) -> float:
    """Retried often enough to outlast a throttling server (the quota tests)."""
    time.sleep(seconds)
    return seconds


def _first_worker_fails() -> str:
    """The first worker to run its setup fails at once (a flaky download, a GPU OOM); every
    later one succeeds, a little more slowly (so it is still starting when the first fails)."""
    try:
        fd = os.open(os.environ["FABRIC_TEST_MARKER"], os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        time.sleep(0.3)
        return "loaded"
    os.close(fd)
    raise RuntimeError("transient setup failure")


@REG.function(warm=2, setup=_first_worker_fails)
def first_setup_fails(x: int = 0, ctx: str = "") -> str:
    return ctx


def _raise(kind: str) -> None:
    if kind == "KeyboardInterrupt":
        raise KeyboardInterrupt
    if kind == "SystemExit":
        raise SystemExit(3)
    if kind == "GeneratorExit":
        raise GeneratorExit
    if kind == "CancelledError":
        raise asyncio.CancelledError("an inner task was cancelled")
    raise ValueError(kind)


@REG.function(warm=0, retry={"max_attempts": 3, "initial_backoff_s": 0.01})
def raises_base(kind: str) -> None:
    """Raises a BaseException that is not an Exception: the function's error, not a dead worker."""
    _raise(kind)


@REG.function(warm=0, retry={"max_attempts": 3, "initial_backoff_s": 0.01})
async def async_raises_base(kind: str) -> None:
    await asyncio.sleep(0)
    _raise(kind)


def _slow_setup() -> None:
    time.sleep(60)  # a model load far slower than the start timeout of the test


@REG.function(warm=0, setup=_slow_setup)
def slow_to_start(x: int = 0) -> int:
    return x


# a server's set of functions where one cannot start (fabric serve's warm-up)
SERVE_REG = Registry()


@SERVE_REG.function(warm=1)
def serve_add(a: int, b: int = 1) -> int:
    return a + b


@SERVE_REG.function(warm=1, setup=_bad_setup)
def serve_broken(x: int) -> int:
    return x


@REG.tool(warm=0, side_effects=True)
def append_then_sleep(path: str, line: str, seconds: float = 0.0) -> int:
    """Records that it ran, then holds its worker for ``seconds``."""
    with open(path, "a") as f:
        f.write(line + "\n")
    time.sleep(seconds)
    return len(Path(path).read_text().splitlines())


@REG.tool(warm=0, side_effects=True, timeout_s=1)
def effect_then(path: str, tag: int, then: str = "", size: int = 0) -> str:
    """Records ``tag`` in ``path`` (a side effect), then answers ``size`` bytes; ``then``
    "crash" or "hang" kills its worker or hangs, before recording anything."""
    if then == "crash":
        os._exit(7)
    if then == "hang":
        time.sleep(60)
    with open(path, "a") as f:
        f.write(f"{tag}\n")
    return "x" * size


@REG.function(warm=0, timeout_s=1, retry={"max_attempts": 1})
def leaves_a_child(pid_path: str = "", then: str = "", escape: bool = False) -> int:
    """With ``then``: starts a helper process (forked: it holds a copy of the worker's
    socket), writes its pid to ``pid_path``, then hangs past timeout_s ("hang") or ends the
    worker ("crash"). ``escape``: the helper leaves the worker's process group first."""
    if not then:
        return os.getpid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        if escape:
            os.setsid()
        os.write(w, b"x")
        time.sleep(30)
        os._exit(0)
    os.read(r, 1)  # the helper is where it will be (in a session of its own, with escape)
    Path(pid_path).write_text(str(pid))
    if then == "crash":
        os._exit(7)
    time.sleep(60)
    return 0


def _connections() -> dict:
    return {}


@REG.function(warm=0, setup=_connections)
async def echo_pooled(port: int, text: str, ctx: dict) -> str:
    """Echoes ``text`` over one connection kept for the container's life, as a pooled async
    client made once (an ``httpx.AsyncClient`` in a setup hook) does; "" closes it."""
    if "conn" not in ctx:
        ctx["conn"] = await asyncio.open_connection("127.0.0.1", port)
    reader, writer = ctx["conn"]
    if not text:
        del ctx["conn"]
        writer.close()
        await writer.wait_closed()
        return ""
    writer.write(text.encode() + b"\n")
    await writer.drain()
    return (await reader.readline()).decode().strip()
