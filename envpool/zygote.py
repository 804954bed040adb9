"""The zygote: a pre-imported Python that forks containers (``python -m envpool.zygote``).

Starting ``python -m envpool.server`` costs ~150-200 ms of interpreter start and imports; a
fork of a process that already imported everything costs a few ms. The zygote reads one
JSON request per line on stdin, forks a child that becomes its own session (process
group), dies with the zygote, and runs ``envpool.server.run``; it answers on stdout once
the child is listening, and reports children that exit. It stays single-threaded so
forking it is safe.

The zygote is the only one that kills its children, and only while they are its unreaped
children: until a child is reaped its pid, which is its process group's id, cannot be
given to another process. The pool names a container by the request that forked it (a
pid it holds may be another process's by then); a child that exits on its own has its
group killed before it is reaped (what it left running goes with it), then is reported.
What a child started outside its group bears its mark (``envpool.escapees``, given in the
request's env): the pool sweeps it once the child is reported, in a thread of its own, not
here (a scan of ``/proc`` in this loop held up every other container's fork and reap). The
zygote keeps the mark until the pool says it swept it: should the pool die first, the
zygote's own end sweeps it.

    stdin   {"req": N, "opts": {...server options...}, "cwd": DIR, "env": {...}}
            {"req": N, "kill": R}       kill the group of request R's container, if still ours
            {"swept": R}                request R's container's mark was swept (no answer)
    stdout  {"req": N, "pid": P, "isolation": ...} | {"req": N, "error": "..."}
            {"req": N, "killed": true|false}
            {"exit": P, "code": C, "of": R}
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import selectors
import signal
import sys
from typing import Any

# imported once here, inherited by every container; and the sweep's module, loaded before
# _exit needs it (an import there, in a signal handler, could meet one half done)
import envpool.envs
import envpool.envs.code_repair_kill  # noqa: F401
import envpool.server as server
from envpool import escapees, isolation


def _child(req: dict[str, Any], ready_w: int, inherited: list[int], zygote: int) -> None:
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the zygote's: the others' are not its
        for fd in inherited:  # other containers' ready pipes
            os.close(fd)
        # stdin/stdout are the zygote's channel to the pool: never let an environment touch them
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(2, 1)
        os.close(devnull)
        os.setsid()  # its own process group: the pool kills a container as a whole
        # the zygote's pid, known before the fork: os.getppid() here is the reaper's already
        # when the zygote died first, and the container would live on, owned by nobody
        isolation.die_with_parent(zygote)
        env = req.get("env") or {}
        os.environ.update(env)
        if mark := env.get(escapees.MARK):  # before the environment's code runs
            escapees.mark_self(mark)
        os.chdir(req["cwd"])

        def ready(info: dict[str, Any]) -> None:
            os.write(ready_w, json.dumps(info).encode())
            os.close(ready_w)

        server.run(req["opts"], ready)
    except BaseException as e:  # report, never return into the zygote's loop
        try:
            os.write(ready_w, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        finally:
            os._exit(3)
    os._exit(0)


def _kill(pid: int | None) -> bool:
    """SIGKILL a child's process group (and the child, should it not lead one yet). Only
    for a child not reaped yet: its pid, the group's id, is still its own. No SIGTERM first:
    a child frozen by SIGSTOP runs no handler, and its stop would wait out a grace."""
    if pid is None:
        return False
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)
    return True


def _say(msg: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def _exit(children: dict[int, int], marks: dict[int, str]) -> None:
    """End the zygote with the pool gone: its children's groups first, then what bears their
    marks (theirs, and those of the children reaped that the pool did not say it swept). Its
    children die with it (PR_SET_PDEATHSIG), but what they started in their groups or outside
    them (an environment's helper) would run on under init, and nobody is left to kill it: the
    pool died, or closed without asking. Unreaped children all: their pids are still their
    groups' ids.

    Entered at once by both of the pool's deaths (stdin's end, and the SIGTERM of
    PR_SET_PDEATHSIG): SIGTERM is blocked first, so that it cannot run a second ``_exit``
    inside this one's sweep, which ended the process at its ``os._exit`` with the first's
    sweep cut short (an import of the sweep's module half done, a helper stopped and never
    killed: it ran on under init)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    for pid in list(children.values()):
        _kill(pid)
    try:
        escapees.sweep(set(marks.values()))
    except Exception as e:  # the groups are gone: the zygote must still end, but say so
        # (what bears the marks runs on under init: said on the pool's stderr, which is ours)
        with contextlib.suppress(Exception):
            os.write(2, f"envpool.zygote: the sweep at its end failed: {type(e).__name__}: {e}\n".encode())
    os._exit(0)


def main() -> None:
    children: dict[int, int] = {}  # req -> pid, of the children not reaped yet
    marks: dict[int, str] = {}  # req -> mark, of the children the pool has not swept yet
    # SIGTERM, not SIGKILL, when the pool dies (its crash runs no close): time to kill the groups
    signal.signal(signal.SIGTERM, lambda *_: _exit(children, marks))
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(sys.argv[1]):
        _exit(children, marks)
    me = os.getpid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, None)
    pending: dict[int, tuple[int, bytearray]] = {}  # ready pipe -> (req, bytes so far)
    reqs: dict[int, int] = {}  # the same, pid -> req
    buf = b""
    try:
        while True:
            for key, _ in sel.select(timeout=0.05):
                fd = key.fd
                if key.data is None:  # a request (or the pool went away)
                    data = os.read(fd, 65536)
                    if not data:
                        _exit(children, marks)
                    buf += data
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        req = json.loads(line)
                        if "swept" in req:  # the pool swept its mark: the zygote's end need not
                            marks.pop(int(req["swept"]), None)
                            continue
                        if "kill" in req:  # a container the pool stops
                            _say({"req": req["req"], "killed": _kill(children.get(int(req["kill"])))})
                            continue
                        r, w = os.pipe()
                        pid = os.fork()
                        if pid == 0:
                            os.close(r)
                            sel.close()
                            _child(req, w, list(pending), me)
                        os.close(w)
                        children[req["req"]], reqs[pid] = pid, req["req"]
                        if mark := (req.get("env") or {}).get(escapees.MARK):
                            marks[req["req"]] = mark
                        pending[r] = (req["req"], bytearray())
                        sel.register(r, selectors.EVENT_READ, pid)
                else:
                    chunk = os.read(fd, 65536)
                    req_id, got = pending[fd]
                    got += chunk
                    try:
                        # whole once it parses (no prefix of a JSON object does): not at the pipe's
                        # end, which a process the container forked (at import, say) holds open
                        info = json.loads(bytes(got))
                    except ValueError:
                        if chunk:
                            continue
                        info = (
                            {"error": "garbled ready message"}
                            if got
                            else {"error": "the container exited before it was ready"}
                        )
                    if not isinstance(info, dict):
                        info = {"error": "garbled ready message"}
                    sel.unregister(fd)
                    os.close(fd)
                    del pending[fd]
                    _say({"req": req_id, "pid": key.data, **info})
            while True:  # reap, and tell the pool which containers are gone
                try:
                    # WNOWAIT: found, not reaped yet (what it left in its group dies first)
                    found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:
                    break
                if found is None:
                    break
                pid = found.si_pid
                _kill(pid)
                of = reqs.pop(pid, None)  # (what it started outside its group: the pool sweeps it)
                _, status = os.waitpid(pid, 0)
                if of is not None:
                    del children[of]
                _say({"exit": pid, "code": os.waitstatus_to_exitcode(status), "of": of})

    except BaseException as e:
        # the pool gone while the zygote told it something (a reap's report, a ready line:
        # BrokenPipeError on stdout, which can come before stdin's end is read), or a bug:
        # the zygote ends as when the pool goes, its containers' groups and marks with it,
        # or what they started outside their groups ran on under init
        if not isinstance(e, BrokenPipeError):
            with contextlib.suppress(Exception):
                os.write(2, f"envpool.zygote: {type(e).__name__}: {e}\n".encode())
        _exit(children, marks)


if __name__ == "__main__":
    main()
