"""A zygote whose pool is gone while it tells the pool something (a container's ready
line or exit: its stdout's reader is dead) ends as it does when its stdin ends: its
containers' groups killed and their marks swept. It died of the BrokenPipeError instead,
with nothing swept: what its containers started outside their groups ran on under init."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from envpool import escapees

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_zygote_whose_pool_stopped_reading_sweeps_its_marks_as_it_ends(tmp_path):
    tok = escapees.token(tmp_path / "container")
    # a helper of the container's, in a session of its own, bearing its mark
    helper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        env={**os.environ, escapees.MARK: tok},
        start_new_session=True,
    )
    zygote = subprocess.Popen(
        [sys.executable, "-m", "envpool.zygote", str(os.getpid())],
        cwd=ROOT,
        env={**os.environ, escapees.MARK: escapees.PLACEHOLDER, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert zygote.stdin is not None and zygote.stdout is not None
        zygote.stdout.close()  # the pool reads no more (its stdin stays open: no end seen)
        # a container whose server cannot start: its error is the zygote's next line out
        req = b'{"req": 1, "opts": {"no such option": 1}, "cwd": "/", "env": {"%s": "%s"}}\n' % (
            escapees.MARK.encode(),
            tok.encode(),
        )
        zygote.stdin.write(req)
        zygote.stdin.flush()
        deadline = time.monotonic() + 60  # bounds a failure only
        while zygote.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert zygote.poll() is not None, "the zygote did not end"
        while _alive(helper.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        errors = zygote.stderr.read().decode() if zygote.stderr is not None else ""
        assert not _alive(helper.pid), f"the container's helper runs on; the zygote said: {errors}"
        assert "Traceback" not in errors, errors
    finally:
        for p in (zygote, helper):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(30)
