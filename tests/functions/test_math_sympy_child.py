"""The ``math_answer`` reward's sympy child: the hard time limit on pathological input
(inside threads, no children left, concurrent calls agree with serial ones), and its
confinement (it dies with its parent, holds none of its descriptors, stops at its CPU
limit); a bad sympy timeout is a clear error."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from math_table import ROWS, judge

from fabric.protocol import encode_payload
from fabric.runner import FunctionRunner
from functions.rewards import math_sympy
from functions.rewards.math import is_equivalent, math_answer


def children() -> set[int]:
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            text = (task / "children").read_text().split()
        except FileNotFoundError:
            continue  # a thread that ended meanwhile (other tests' helper threads)
        pids.update(int(p) for p in text)
    return pids


# ----------------------------------------------------------------------------- time limit

NESTED = "2"
for _ in range(200):
    NESTED = "\\frac{1}{" + NESTED + "}"
PATHOLOGICAL = ["10^{10^{10}}", NESTED, "9**9**9", "9^{9^{9^{9}}}"]


def test_pathological_inputs_return_in_time_inside_threads():
    limit = 1.0
    before = children()

    def call(pred):
        t0 = time.monotonic()
        res = math_answer(f"\\boxed{{{pred}}}", ground_truth="7", sympy_timeout_s=limit)
        return res, time.monotonic() - t0

    with ThreadPoolExecutor(max_workers=len(PATHOLOGICAL)) as pool:
        outcomes = list(pool.map(call, PATHOLOGICAL))
    rules = []
    for res, elapsed in outcomes:
        assert res.score == 0.0
        # the limit, not the hours such a power takes (the slack: four children forked at
        # once on a loaded machine took 3.4 s once)
        assert elapsed < limit + 5, (res.info, elapsed)
        rules.append(res.info["decided_by"])
    assert "timeout" in rules  # the huge powers really ran into the limit
    assert next(r for r, _ in outcomes if r.info["decided_by"] == "timeout").info["timeout_s"] == limit
    assert children() <= before  # every child was killed and reaped


def test_no_children_left_after_many_calls():
    before = children()
    for row in ROWS[:60]:
        judge(row)
    assert is_equivalent("x^2-1", "(x-1)(x+1)") == (True, "sympy")
    assert children() <= before


def test_concurrent_calls_agree_with_serial_ones():
    rows = [r for r in ROWS if r["category"] in {"sqrt", "algebraic", "pi"}]
    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(judge, rows))
    assert got == [r["equivalent"] for r in rows]


# ----------------------------------------------------------------------------- the child's confinement
# A worker past its function's timeout_s is SIGKILLed. Its sympy child used to be reparented to
# init and compute on forever, holding the worker's socket (the pool waits for EOF on it), so
# the call never came back and the worker was never replaced.

_WORKER_LIKE = r"""
import sys
from functions.rewards.math import math_answer
print("ready", flush=True)
math_answer("\\boxed{9^{9^{9^{9}}}}", ground_truth="3", sympy_timeout_s=float(sys.argv[1]))
print("returned", flush=True)
"""


def _children_of(pid: int) -> set[int]:
    pids: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in task.read_text().split())
    return pids


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper (init in a container may never reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in {"Z", "X"}


@contextlib.contextmanager
def _worker_like(timeout_s: float):
    """A process computing 9^{9^{9^9}} in a sympy child: ``(process, child pid)``."""
    proc = subprocess.Popen([sys.executable, "-c", _WORKER_LIKE, str(timeout_s)], stdout=subprocess.PIPE)
    child = None
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 30  # importing sympy on a loaded machine
        while not (kids := _children_of(proc.pid)):
            assert time.monotonic() < deadline and proc.poll() is None, "no sympy child appeared"
            time.sleep(0.01)
        (child,) = kids
        yield proc, child
    finally:
        proc.kill()
        proc.wait()
        if child is not None and _alive(child):  # only without the fix: never leave it running
            os.kill(child, signal.SIGKILL)


def _gone_within(pid: int, seconds: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if not _alive(pid):
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux")
def test_the_sympy_child_dies_with_its_parent():
    with _worker_like(timeout_s=math_sympy.MAX_TIMEOUT_S) as (proc, child):
        time.sleep(0.2)  # let it settle into the computation
        proc.kill()
        proc.wait()
        assert _gone_within(child, 2.0) is not None, "the sympy child outlived its parent"
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 2.0)
        assert ready and proc.stdout.read() == b""  # EOF: nothing holds the parent's stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux")
def test_the_sympy_child_holds_no_file_descriptor_of_its_parent():
    with _worker_like(timeout_s=math_sympy.MAX_TIMEOUT_S) as (_, child):
        time.sleep(0.2)  # past the child's first steps
        fds = {int(fd): os.readlink(f"/proc/{child}/fd/{fd}") for fd in os.listdir(f"/proc/{child}/fd")}
    assert {fds[0], fds[1], fds[2]} == {os.devnull}, fds  # not the parent's stdout (our pipe)
    assert len(fds) == 4 and next(v for k, v in fds.items() if k > 2).startswith("pipe:"), fds


def test_a_sympy_call_works_in_a_process_with_many_open_descriptors():
    # select() refused the result pipe's descriptor once it was numbered 1024 or more
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"RLIMIT_NOFILE's hard limit is {hard}: cannot open 1024 descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    held: list[int] = []
    try:
        while not held or held[-1] < 1030:
            held.append(os.open(os.devnull, os.O_RDONLY))
        assert math_sympy.sympy_equivalent("\\sin^2 x + \\cos^2 x", "1") == (True, "sympy")
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_CPU and /proc are Linux")
def test_the_sympy_child_stops_at_its_cpu_limit_when_its_parent_cannot_kill_it():
    # a parent that is stopped (not dead) cannot kill its child at the deadline: RLIMIT_CPU
    # (ceil(timeout) + 1 = 2 s of CPU here) does
    with _worker_like(timeout_s=1.0) as (proc, child):
        proc.send_signal(signal.SIGSTOP)
        assert _gone_within(child, 20.0) is not None, "the sympy child ran past its CPU limit"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_a_child_whose_parent_died_before_prctl_exits_at_once():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            math_sympy._load_libc()
            math_sympy._confine_child(parent_pid=-1, keep_fd=w, timeout_s=1.0)  # "not my parent"
            os._exit(0)
        finally:
            os._exit(2)
    os.close(r)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1


@pytest.mark.parametrize("bad", [-1, 0, 0.0, float("nan"), float("inf"), math_sympy.MAX_TIMEOUT_S + 1, 60])
def test_a_bad_sympy_timeout_is_a_clear_error(bad):
    # 0 or a negative limit made every sympy answer a silent timeout (score 0); NaN an opaque error
    with pytest.raises(ValueError, match=r"sympy_timeout_s must be a number of seconds in \(0, 5.0\]"):
        math_answer("\\boxed{3}", ground_truth="3", sympy_timeout_s=bad)
    with pytest.raises(ValueError, match="sympy_timeout_s"):
        is_equivalent("2\\sqrt{2}", "\\sqrt{8}", timeout_s=bad)


def test_a_bad_sympy_timeout_in_a_payload_fails_the_call_as_a_user_error():
    runner = FunctionRunner.from_entry("functions.rewards.math:math_answer")
    for bad in (-1, 0, 60):
        ok, (code, message, _) = runner.run(
            encode_payload({"traj": "\\boxed{3}", "ground_truth": "3", "sympy_timeout_s": bad})
        )
        assert not ok and code == "UserError" and "sympy_timeout_s must be" in message
    ok, (code, message, _) = runner.run(b'{"traj": "x", "ground_truth": "3", "sympy_timeout_s": NaN}')
    assert not ok and code == "UserError" and "got nan" in message
    ok, _ = runner.run(encode_payload({"traj": "\\boxed{3}", "ground_truth": "3", "sympy_timeout_s": 5}))
    assert ok
    # the longest limit leaves half the function's own budget for extraction and the fork
    assert runner.spec.timeout_s >= 2 * math_sympy.MAX_TIMEOUT_S
