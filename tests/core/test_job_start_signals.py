"""SIGTERM while ``ray.init`` starts Ray's processes stops the job as Ctrl-C does, and leaves
none of them running."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from job_helpers import job_process, stopped_by_sigterm

# Imported by the job as its fabric.discover module (before it starts Ray, and before the
# job puts its SIGTERM handler in place): Ray's start waits, once its processes (the GCS,
# the raylet and the agents the raylet starts) are up, so that the test's SIGTERM lands
# inside ray.init at a known point. The agents are named (ray::...) only once they run,
# seconds after the raylet on a loaded machine: the start waits for them itself (bounded,
# against a hang only) before it says it is up. It then stays inside ray.init until the
# job's handler has taken the SIGTERM (bounded: a handler that never runs leaves the job
# to the test's 60 s). It slept 8 s there instead, which the stopping job waited out in
# full (a stop waits for the start), and which a loaded machine could outlast before the
# test's signal came, leaving the stop to a later point of the job
SLOW_RAY_START = """
import os
import threading
import time
from pathlib import Path

import ray._private.node

from fabric._sigterm import TermAsInterrupt

_start = ray._private.node.Node.start_ray_processes
_on_term = TermAsInterrupt._on_term
_term_taken = threading.Event()


def _on_term_seen(self):
    _on_term(self)
    _term_taken.set()


def _agents_run():
    sid = os.getsid(0)  # the job's session, which Ray's processes keep
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and (stat.parent / "cmdline").read_bytes().startswith(b"ray::"):
                return True
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return False


def _slow_start(self, *args, **kwargs):
    out = _start(self, *args, **kwargs)
    deadline = time.monotonic() + 90
    while not _agents_run() and time.monotonic() < deadline:
        time.sleep(0.05)
    Path(os.environ["RAY_STARTED_MARK"]).touch()
    _term_taken.wait(90)
    return out


if "RAY_STARTED_MARK" in os.environ:
    ray._private.node.Node.start_ray_processes = _slow_start
    TermAsInterrupt._on_term = _on_term_seen
"""


def _session(sid: int) -> dict[int, str]:
    """The live processes of session ``sid`` (the job's: it was started in its own), by pid:
    Ray's agents keep it, though their command line no longer names the job's temp dir."""
    out: dict[int, str] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[3]) == sid:
                out[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().split(b"\0")[0].decode()
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return out


@pytest.mark.ray
def test_sigterm_while_ray_starts_leaves_none_of_its_processes(tmp_path):
    # ray.init installs its own SIGTERM handler as it begins (sys.exit(15)), and the SystemExit
    # came out of wherever its start was: raised before ray.init had recorded the node it
    # started, nothing shut that node down, and the raylet's agents (ray::DashboardAgent,
    # ray::RuntimeEnvAgent) ran on for 30 s and more after the job had gone
    import signal
    import time

    p, mark = job_process(tmp_path, "slow_ray_start", SLOW_RAY_START, "RAY_STARTED_MARK")
    try:
        deadline = time.monotonic() + 120
        while not mark.exists():
            assert p.poll() is None, p.communicate()[1]
            assert time.monotonic() < deadline, "Ray's processes did not start within 120 s"
            time.sleep(0.05)
        # the raylet's agents run: the start waited for them before it made the mark
        assert any(cmd.startswith("ray::") for cmd in _session(p.pid).values()), _session(p.pid)
        err = stopped_by_sigterm(p)
        assert "SIGTERM handler is not set" not in err, err[-2000:]  # Ray's word off the main thread
        # Ray's shutdown stops its processes gracefully (a second or two each); left alone,
        # the agents ran on for 30 s and more
        deadline = time.monotonic() + 15
        while (left := _session(p.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"left running after SIGTERM: {left}"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for pid in _session(p.pid):  # what the job left: its own session's, no one else's
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


async def test_a_start_cancelled_twice_still_shuts_the_started_ray_down(monkeypatch):
    # the second cancellation (a second Ctrl-C) left the wait for the start: Ray came up
    # after, and nothing shut it down
    import asyncio
    import threading

    import ray

    from core import cluster

    gate, up, shut = threading.Event(), threading.Event(), []
    monkeypatch.setattr(ray, "init", lambda **_: (gate.wait(30), up.set()))
    monkeypatch.setattr(ray, "is_initialized", up.is_set)
    monkeypatch.setattr(ray, "shutdown", lambda: shut.append(True))
    task = asyncio.ensure_future(cluster.start_ray())
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done()  # still waiting for the start, which nothing can interrupt
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert shut == [True]
