"""Reward functions the job tests score with, faults included (top level, importable: the
local backend's worker processes import them by module name; pytest puts ``tests/core`` on
``sys.path`` and the workers inherit it).

Faults are deterministic without any shared memory between the job and the workers: a
function *claims* one of ``n`` numbered slots in ``state_dir`` (``O_EXCL`` file creation,
atomic across processes) and misbehaves only when it got one, so exactly ``n`` calls fail,
whichever worker runs them. Each claimed slot records the trajectory id it failed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from fabric.protocol import Trajectory
from fabric.registry import Registry
from functions.rewards.env_return import env_return

REG = Registry()
REG.add(env_return)

#: The timeout of ``slow_once`` (kept short: a timed-out sync call costs its worker).
SLOW_TIMEOUT_S = 0.5


def _claim(state_dir: str, prefix: str, n: int, traj_id: str) -> bool:
    """Take one of ``n`` slots ``<prefix>-<k>`` (True), or find them all taken (False)."""
    for k in range(n):
        try:
            fd = os.open(os.path.join(state_dir, f"{prefix}-{k}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as f:
            f.write(traj_id)
        return True
    return False


def claimed(state_dir: str | Path, prefix: str) -> list[str]:
    """The trajectory ids recorded in the claimed slots (for the tests)."""
    return sorted(p.read_text() for p in Path(state_dir).glob(f"{prefix}-*"))


def _score(traj: Trajectory) -> float:
    return float(traj.env_reward or 0.0)


@REG.reward(warm=1)
def raise_first(traj: Trajectory, *, state_dir: str, n: int) -> float:
    """Raises (a user error: never retried) on the first ``n`` calls, then scores."""
    if _claim(state_dir, "raised", n, traj.id):
        raise RuntimeError(f"verifier crashed on {traj.id}")
    return _score(traj)


@REG.reward(warm=1, timeout_s=SLOW_TIMEOUT_S, retry={"max_attempts": 3, "initial_backoff_s": 0.01})
def slow_once(traj: Trajectory, *, state_dir: str, n: int) -> float:
    """On the first call for each of the first ``n`` trajectories it sleeps past its timeout
    (the pool kills the worker; the client retries); every other call scores at once and
    leaves a ``scored-<trajectory id>`` marker."""
    if _claim(state_dir, "slow", n, traj.id):
        time.sleep(SLOW_TIMEOUT_S * 20)
    Path(state_dir, f"scored-{traj.id}").touch()
    return _score(traj)


@REG.reward(warm=1, timeout_s=SLOW_TIMEOUT_S, retry={"max_attempts": 1})
def slow_no_retry(traj: Trajectory, *, state_dir: str, n: int) -> float:
    """``slow_once`` without retries: the timeout is final, the trajectory masked and re-run."""
    if _claim(state_dir, "slow", n, traj.id):
        time.sleep(SLOW_TIMEOUT_S * 20)
    Path(state_dir, f"scored-{traj.id}").touch()
    return _score(traj)


@REG.reward(warm=1)
def said_go(traj: Trajectory) -> float:
    """1.0 when the policy's first reply is ``go``: an untrained policy says it about half the
    time, so groups have advantages and every step moves the weights (``env_return`` of an
    untrained policy is mostly 0 everywhere, and a step on zero advantages changes nothing)."""
    replies = [m.content or "" for m in traj.messages if m.role == "assistant"]
    return 1.0 if replies and replies[0].strip().startswith("go") else 0.0
