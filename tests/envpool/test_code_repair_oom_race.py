"""A test run's own OOM kill that lands after all its results are in (a background child
or thread still allocating when the last check returned) is noted, never taken for the run's
end: the run is judged on its results. One before its results are all in still fails the
run at its memory limit.

The race is made certain rather than waited for: the module wraps the runner's results file
so that, once the last result is written and the file closed, its processes together pass
the memory limit (the OOM kill then comes after every result, every time)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from test_code_repair_limits import MiB, _running_in, edit_action, needs_memory_cgroup

import envpool
import envpool.envs  # registers the built-ins

# forks `children` that each touch `mib` MiB and hold it until all have: together past the
# run's limit, so the kernel's OOM killer takes one of them and the rest wait for good (the
# run is ended at the kill, never at its timeout)
_HOLD_PAST_LIMIT = """
def _hold_past_limit(children, mib):
    import os
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    for _ in range(children):
        if os.fork() == 0:
            held = b"x" * (mib * 2**20)  # every byte written: every page touched
            os.write(ready_w, b"r")
            os.read(go_r, 1)
            os._exit(len(held) == 0)
    for _ in range(children):
        os.read(ready_r, 1)  # one child was killed before it wrote: this waits for good
"""

# the runner closes its results file once every result is written: past that close, the
# run passes its memory limit
_AFTER_RESULTS = """
import __main__

class _ThenHog:
    def __init__(self, real):
        self.real = real

    def write(self, text):
        return self.real.write(text)

    def flush(self):
        self.real.flush()

    def close(self):
        self.real.close()  # every result is in
        _hold_past_limit(6, 48)

__main__.results = _ThenHog(__main__.results)
"""

_CLAMP = "    return max(lo, min(x, hi))"


@contextlib.contextmanager
def _repair(tmp_path: Path, *edits: str):
    work = tmp_path / "work"
    work.mkdir()
    env = envpool.make(
        "code-repair-v1", workdir_root=str(work), test_timeout_s=20, memory_limit_bytes=160 * MiB
    )
    try:
        env.reset(options={"task": "mathutils"})
        for edit in (
            edit_action("mathutils.py", "    return a - b", "    return a + b"),
            *edits,
        ):  # the fix, and more
            assert env.step(edit).info["valid"], edit
        yield env, work
    finally:
        for pid in _running_in(work):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        env.close()


@needs_memory_cgroup
def test_an_oom_kill_after_every_result_is_in_leaves_a_passing_run_passed(tmp_path):
    # the run read "stopped at its memory limit: its processes together reached 160 MiB"
    # above five PASS lines: a correct fix told it had failed for its memory
    with _repair(
        tmp_path, edit_action("mathutils.py", _CLAMP, _CLAMP + "\n" + _HOLD_PAST_LIMIT + _AFTER_RESULTS)
    ) as (env, _):
        t0 = time.monotonic()
        res = env.step("run_tests")
        text = res.obs.text
        assert time.monotonic() - t0 < 15, text  # ended at the OOM kill, not at the timeout
        assert res.info["all_passed"] and res.info["outcome"] == "success", text
        assert text.startswith("Tests: 3 passed, 0 failed."), text
        assert "stopped at its memory limit" not in text, text
        # noted, as what it was: beside the results, not their cause
        note = "Every check reported its result; the test run's processes together also reached"
        assert note in text and "160 MiB" in text and "the results stand" in text, text
        res = env.step("submit")
        assert res.reward == 1.0, res.obs.text


def _clamp_hogs_on(x: int) -> str:
    """An edit after which ``clamp(x, ...)`` (a later check) passes the limit."""
    return edit_action(
        "mathutils.py",
        _CLAMP,
        f"    if x == {x}:\n        _hold_past_limit(6, 48)\n{_CLAMP}\n{_HOLD_PAST_LIMIT}",
    )


@needs_memory_cgroup
def test_an_oom_kill_before_every_result_is_in_still_fails_the_run_at_its_memory_limit(tmp_path):
    # the guard of the change above: four of five results in, the fifth check's OOM is the run's
    with _repair(tmp_path, _clamp_hogs_on(2)) as (env, _):
        res = env.step("run_tests")
        text = res.obs.text
        assert not res.info["all_passed"] and res.info["outcome"] == "test_failure", text
        assert "PASS test_mathutils.py::test_add_negative" in text, text
        assert "FAIL test_mathutils.py::test_clamp: clamp(2, 0, 3) did not finish" in text, text
        assert "stopped at its memory limit: its processes together reached 160 MiB" in text, text
        assert "Every check reported its result" not in text, text
