"""What the job's test modules share: tiny job configs (batch 2 x group 2, a few steps,
one-token replies) on the fault-injecting registry of ``job_faults_fns``, a runner, and the
invariants every job keeps, faults or not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import job_faults_fns as faults

from core.config import JobConfig
from core.job import Job

TINY = {"d_model": 16, "n_layers": 1, "n_heads": 2, "max_len": 64}
LATENCY = {
    "id": "latency-v0",
    "tag": "latency",
    "max_turns": 2,
    "kwargs": {"mu_s": 0.01, "turns": 2},
    "actions": ["go", "wait"],
    "prompt": {"history": 0},
}
FROZENLAKE = {
    "id": "frozenlake-v1",
    "tag": "frozenlake",
    "max_turns": 4,
    "kwargs": {"size": 4, "slippery": False},
    "actions": ["left", "right", "up", "down"],
    "prompt": {"history": 0, "drop_lines": ["Legend:"]},
}
TRAIN_KEYS = {"step", "version", "reward_mean", "success", "staleness_mean", "time"}
DRIFT_KEYS = {"approx_kl", "clip_frac", "ratio_mean", "grad_norm"}
TIME_KEYS = {"wait_s", "train_s", "publish_s", "gen_s", "env_s", "reward_s"}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def job_config(tmp_path: Path, *, env: dict[str, Any] = LATENCY, rewards: list | None = None, **over: Any):
    data = {
        "engine": {"backend": "torch", "max_new_tokens": 1, "kwargs": TINY},
        "envs": [env],
        "rewards": {env["tag"]: rewards or [{"function": "env_return"}]},
        "batch_size": 2,
        "group_size": 2,
        "alpha": 1,
        "steps": 3,
        "trainer": {"lr": 1e-3},
        "rollout": {"eval_every": 0, "max_reruns": 3},
        "fabric": {"backend": "local", "workers": 1},
        "envpool": {
            "runtime": "process",
            "min_warm": 2,
            "max_containers": 32,
            "retry": {"attempts": 2, "initial_backoff_s": 0.01, "max_backoff_s": 0.05},
        },
        "run_dir": str(tmp_path / "run"),
        "seed": 0,
    }
    return JobConfig.from_dict(_merge(data, over), registry=faults.REG)


async def run_job(cfg: JobConfig) -> tuple[Job, dict[str, Any]]:
    job = Job(cfg, progress=False, registry=faults.REG)
    summary = await job.run()
    return job, summary


def check_invariants(summary: dict[str, Any], cfg: JobConfig) -> None:
    """What holds for every job, faults or not."""
    assert summary["steps"] == cfg.steps
    assert summary["aborted_trained"] == 0
    assert summary["masked_trained"] == 0
    assert summary["trajectories"].get("double_count", 0) == 0
    assert summary["rewards"]["duplicate"] == 0
    assert summary["buffer"]["dropped"].get("duplicate", 0) == 0
    assert summary["buffer"]["served_groups"] == cfg.steps * cfg.batch_size
    assert summary["buffer"]["served_samples"] == cfg.steps * cfg.batch_size * cfg.group_size
    # every trained trajectory within the asynchronous bound
    assert summary["buffer"]["staleness"]
    assert all(0 <= int(k) <= cfg.alpha for k in summary["buffer"]["staleness"])


def train_rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "train"]


def job_process(
    tmp_path: Path, module: str | None = None, code: str = "", mark_env: str = "JOB_MARK", **over: Any
) -> tuple[Any, Path]:
    """``python -m core.job`` on a one-step job (``over``: other config) in a session of its
    own, with ``code`` as the importable module ``module`` (a discover module, a reward; none
    when None) and ``$mark_env`` naming a file it may touch to say how far the start got; the
    process and that file."""
    import os
    import subprocess
    import sys

    import yaml

    if module is not None:
        (tmp_path / f"{module}.py").write_text(code)
    mark = tmp_path / "mark"
    data = {
        "engine": {"max_new_tokens": 1, "kwargs": TINY},
        "envs": [LATENCY],
        "rewards": {"latency": [{"function": "env_return"}]},
        "batch_size": 2,
        "group_size": 2,
        "steps": 1,
        "rollout": {"eval_every": 0},
        "fabric": {"workers": 1, "discover": ["functions", *([module] if module else [])]},
        "envpool": {"min_warm": 1},
        "run_dir": str(tmp_path / "run"),
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_merge(data, over)))
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "core.job", str(path)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{tmp_path}", mark_env: str(mark)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own session: its processes are told by it
    )
    return proc, mark


def stopped_by_sigterm(proc: Any) -> str:
    """SIGTERM ``proc`` (a ``job_process``): it must stop as Ctrl-C does (exit 130,
    "interrupted", no traceback) within 60 s; its stderr."""
    import signal
    import subprocess

    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("SIGTERM did not stop the job within 60 s") from None
    assert proc.returncode == 130 and err.strip().endswith("interrupted"), (proc.returncode, err[-2000:])
    assert "SIGTERM received" not in err and "Traceback" not in err, err[-2000:]
    return err
