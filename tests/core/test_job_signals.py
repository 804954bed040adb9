"""Ctrl-C and SIGTERM stop the job promptly, in pretraining and in training, and leave
no process behind.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import yaml
from job_helpers import (
    FROZENLAKE,
    TINY,
    job_config,
    job_process,
    stopped_by_sigterm,
)


@pytest.mark.parametrize(
    ("entry", "sig"),
    [
        (["core.job"], "SIGINT"),
        (["core.job"], "SIGTERM"),
        # `fabric run` exited with 130 too, but said nothing: a log showed a job that stopped
        # mid-run with no word of why
        (["fabric.cli", "run"], "SIGINT"),
    ],
)
def test_ctrl_c_during_pretraining_stops_the_job_promptly(tmp_path, entry, sig):
    # the policy build (corpus play, pretraining: a minute or more) ran inside Job.run's
    # coroutine: asyncio.run's first Ctrl-C only cancels the main task, at its next await,
    # so the job went on until pretraining was over (174 s measured on a loaded machine).
    # SIGTERM stops it the same way (it killed the process outright, the build's threads
    # and children with it)
    import signal
    import subprocess
    import sys

    data = {
        "engine": {
            "backend": "torch",
            "max_new_tokens": 1,
            "kwargs": {**TINY, "max_len": 256},
            "pretrain": {"steps": 1_000_000, "episodes": 50},
        },
        "envs": [{**FROZENLAKE, "max_turns": 2}],
        "rewards": {"frozenlake": [{"function": "env_return"}]},
        "steps": 1,
        "rollout": {"eval_every": 0},
        "run_dir": str(tmp_path / "run"),
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    root = Path(__file__).resolve().parents[2]
    p = subprocess.Popen(
        [sys.executable, "-m", *entry, str(path)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as in a terminal
    )
    try:
        assert p.stdout is not None
        seen = []
        for line in p.stdout:  # until pretraining runs (not a terminal: plain progress lines)
            seen.append(line)
            if line.startswith("pretrain 1/"):
                break
        assert seen and seen[-1].startswith("pretrain 1/"), "".join(seen)
        p.send_signal(getattr(signal, sig))
        # promptly: the stop (the build's next check, its threads and children ended, the
        # interpreter's exit) took 5-14 s on a loaded 2-core machine, and went past 15 s in a
        # full run; a job that went on with its 1,000,000 pretraining steps never stops
        try:
            rest, _ = p.communicate(timeout=45)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{sig} during pretraining did not stop the job within 45 s") from None
        assert p.returncode == 130 and rest.strip().endswith("interrupted"), rest
        assert "Traceback" not in rest, rest
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _descendants(pid: int) -> set[int]:
    """Every live process under ``pid`` (by parent links, read from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # the command name may hold spaces and parentheses: the ppid is after the last ')'
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    out: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


def _alive(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


@pytest.mark.ray
def test_sigterm_during_training_stops_the_job_as_ctrl_c_does(tmp_path):
    # SIGTERM (kill, a scheduler's stop) met the signal handler Ray's core worker installs in
    # the driver: a C stack trace on stderr and the process gone at once (exit 143 or 134),
    # none of the job's shutdown run
    import signal
    import time

    p, _ = job_process(tmp_path, steps=1_000_000, envpool={"min_warm": 2})
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert p.poll() is None, p.communicate()[1]
            assert time.monotonic() < deadline, "the job trained no step within 240 s"
            time.sleep(0.2)
        started = _descendants(p.pid)  # Ray's processes, its actors, the zygote, containers
        assert started
        stopped_by_sigterm(p)
        deadline = time.monotonic() + 20  # reaped by their own parents, which are going too
        while (left := {q for q in started if _alive(q)}) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"left running after SIGTERM: {sorted(left)}"
        assert metrics.read_text().count("\n") >= 2  # what it logged is kept
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


SLOW_SETUP = """
import os
import time
from pathlib import Path

import fabric


def _setup():
    Path(os.environ["SLOW_SETUP_MARK"]).touch()
    time.sleep(120)


@fabric.reward(warm=1, setup=_setup)
def slow_setup(traj) -> float:
    return 0.0
"""


@pytest.mark.ray
def test_sigterm_while_the_actors_and_pools_start_stops_the_job_as_ctrl_c_does(tmp_path):
    # ray.init puts its own SIGTERM handlers in place of the job's (a C stack trace, then
    # sys.exit(15)), and the job put its own back only once the actors, the reward workers
    # and the containers were up: a SIGTERM meanwhile (a large model's load, a slow reward
    # setup) ended the job with exit code 15 and no word, or with the C stack trace and a
    # Python traceback ("Task exception was never retrieved")
    import signal
    import time

    p, mark = job_process(
        tmp_path,
        "slow_setup_rewards",
        SLOW_SETUP,
        "SLOW_SETUP_MARK",
        rewards={"latency": [{"function": "slow_setup"}]},
        fabric={"discover": ["slow_setup_rewards"]},
    )
    try:
        deadline = time.monotonic() + 240
        while not mark.exists():  # Ray is up, its actors made; the reward's worker sets up
            assert p.poll() is None, p.communicate()[1]
            assert time.monotonic() < deadline, "the reward's setup did not start within 240 s"
            time.sleep(0.1)
        started = _descendants(p.pid)
        stopped_by_sigterm(p)
        deadline = time.monotonic() + 20
        while (left := {q for q in started if _alive(q)}) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"left running after SIGTERM: {sorted(left)}"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_an_interrupted_run_with_a_checkpoint_is_told_how_to_go_on(tmp_path):
    # "interrupted" alone left the user to find out that the run could be continued, and how
    from core.checkpoint import Checkpoints
    from core.job import Job, interrupted_note

    job = Job(job_config(tmp_path, checkpoint={"every": 2}))
    assert interrupted_note(job) == "interrupted"  # nothing to resume: nothing more to say
    assert interrupted_note(None) == "interrupted"  # stopped before the job was made
    part = job.checkpoints.prepare(2)
    (part / "trainer.pt").write_bytes(b"")
    job.checkpoints.commit(part, 2, {"step": 2})
    note = interrupted_note(job)
    latest = Checkpoints(job.cfg.run_dir).latest()
    assert latest is not None
    assert note == f"interrupted; --resume continues from its latest checkpoint, {latest}", note
    # stopped in the final evaluation: --resume finishes it (the final evaluation, the
    # summary); --steps N above the checkpoint's trains on
    part = job.checkpoints.prepare(job.cfg.steps)
    (part / "trainer.pt").write_bytes(b"")
    last = job.checkpoints.commit(part, job.cfg.steps, {"step": job.cfg.steps})
    note = interrupted_note(job)
    assert note == (
        "interrupted after its last step; --resume runs its final evaluation and writes its "
        f"summary (--resume --steps N, N > 3, trains on) from {last}"
    ), note
    (job.checkpoints.root / "latest").write_text("step-000099\n")  # names one that is gone
    assert interrupted_note(job) == "interrupted"  # the resume itself says what is wrong
