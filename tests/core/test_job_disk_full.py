"""A full disk (``ENOSPC``) while the job writes its metrics, plots or checkpoints ends the
run with one line that names the file and says what to do (exit code 2, ``failure.json``
where it fits), not with a traceback of a bare ``OSError`` (exit code 1). The disk is never
filled: the writes are made to raise as a full disk does."""

from __future__ import annotations

import errno
import json
import os
import pickle
from pathlib import Path

import pytest
import yaml
from job_helpers import job_config

from core.checkpoint import Checkpoints
from core.errors import DiskFullError
from core.job import main
from core.report import RunDir


def _full(*_: object, **__: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a flush raises it: no file named


def _one_line(text: str, path: Path) -> None:
    assert "\n" not in text and f"no space left on the device to write {str(path)!r}" in text, text
    assert "free space there" in text and "--resume" in text, text


def test_run_dir_writes_on_a_full_disk_raise_one_error_naming_the_file(tmp_path, monkeypatch):
    run_dir = RunDir(tmp_path)
    row = {"kind": "train", "step": 1, "reward_mean": 0.0, "success": 0.0}
    run_dir.log(row)
    monkeypatch.setattr(RunDir, "_append", lambda self, line: _full())
    with pytest.raises(DiskFullError) as e:
        run_dir.log({**row, "step": 2})
    _one_line(str(e.value), tmp_path / "metrics.jsonl")
    monkeypatch.undo()

    # the plots are written before summary.json: a full disk leaves no summary of a finished
    # run (tools read it as one), and the open figure is closed
    import matplotlib.figure
    import matplotlib.pyplot as plt

    run_dir = RunDir(tmp_path / "b")
    run_dir.log(
        {**row, "time": {k: 0.0 for k in ("wait_s", "train_s", "publish_s", "gen_s", "env_s", "reward_s")}}
    )
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", _full)
    with pytest.raises(DiskFullError) as e:
        run_dir.finish({"steps": 1})
    _one_line(str(e.value), tmp_path / "b" / "reward.png")
    assert not (tmp_path / "b" / "summary.json").exists() and plt.get_fignums() == []


def test_a_checkpoint_on_a_full_disk_raises_one_error_naming_the_file(tmp_path, monkeypatch):
    from ray.exceptions import RayTaskError

    from core.job import Job
    from core.trainer import actor

    ckpts = Checkpoints(tmp_path / "checkpoints")
    part = ckpts.prepare(2)
    monkeypatch.setattr(os, "fsync", _full)
    with pytest.raises(DiskFullError) as e:
        ckpts.commit(part, 2, {"step": 2})
    _one_line(str(e.value), part / "job.json")
    monkeypatch.undo()
    assert ckpts.latest() is None  # the previous one (none here) stays the latest

    # the trainer actor's file: raised there, sent back by Ray (pickled by its path), and
    # said by the job as the one line, not as Ray's error with the actor's traceback
    monkeypatch.setattr(actor.torch, "save", lambda *a, **k: _full())
    path = str(part / "trainer.pt")
    with pytest.raises(DiskFullError) as e:
        actor._write_file({}, path)
    _one_line(str(e.value), Path(path + ".part"))
    back = pickle.loads(pickle.dumps(e.value))
    assert str(back) == str(e.value)
    wrapped = RayTaskError("written", "Traceback (most recent call last): ...", back).as_instanceof_cause()
    job = Job(job_config(tmp_path))

    async def call() -> None:
        raise wrapped

    import asyncio

    with pytest.raises(DiskFullError) as e:
        asyncio.run(job._from_trainer(call(), "checkpoint write of step 2"))
    assert type(e.value) is DiskFullError and str(e.value) == str(back)


def _fsync_full_for(name: str):
    real = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(name):
            _full()
        real(fd)

    return fsync


@pytest.mark.ray
@pytest.mark.parametrize("where", ["metrics", "checkpoint", "plot"])
def test_a_full_disk_ends_the_run_with_one_line_and_failure_json(
    tmp_path, ray_cluster, monkeypatch, capsys, where
):
    cfg = job_config(tmp_path, steps=2, checkpoint={"every": 1})
    path = tmp_path / "job.yaml"
    path.write_text(cfg.to_yaml())
    run = Path(cfg.run_dir)
    if where == "metrics":  # the second train row (step 2's)
        real, calls = RunDir._append, []

        def append(self: RunDir, line: str) -> None:
            calls.append(line)
            if len(calls) == 2:
                _full()
            real(self, line)

        monkeypatch.setattr(RunDir, "_append", append)
        named = run / "metrics.jsonl"
    elif where == "checkpoint":  # the job's side of step 1's checkpoint
        monkeypatch.setattr(os, "fsync", _fsync_full_for("job.json"))
        named = run / "checkpoints" / "step-000001.part" / "job.json"
    else:  # the plots, once every step trained
        import matplotlib.figure

        monkeypatch.setattr(matplotlib.figure.Figure, "savefig", _full)
        named = run / "reward.png"
    assert main([str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and last.endswith(f"(the counts: {run / 'failure.json'})"), last
    _one_line(last, named)
    failure = json.loads((run / "failure.json").read_text())
    assert failure["error"].startswith("DiskFullError: no space left"), failure
    assert not (run / "summary.json").exists()
    assert yaml.safe_load((run / "config.yaml").read_text())["steps"] == 2


@pytest.mark.ray
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (every write: ENOSPC)")
def test_a_full_disk_under_the_proxy_actors_trace_ends_the_run_with_one_line(
    tmp_path, ray_cluster, monkeypatch, capsys
):
    # trace.jsonl is written in the proxy actor, where no monkeypatch reaches: its scheduler,
    # made here and pickled there, writes to /dev/full. Its OSError came back as every turn's
    # error: trajectories re-run until the job stopped on a RolloutError naming no disk
    import core.cluster
    from core.rollout.scheduling import TurnScheduler

    def full_trace(cfg: object) -> TurnScheduler:
        return TurnScheduler("fcfs", slots=core.cluster.engine_batch(cfg), trace="/dev/full")  # type: ignore[arg-type]

    monkeypatch.setattr(core.cluster, "turn_scheduler", full_trace)
    cfg = job_config(tmp_path, steps=2)
    path = tmp_path / "job.yaml"
    path.write_text(cfg.to_yaml())
    run = Path(cfg.run_dir)
    assert main([str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "RolloutError" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: "), last
    _one_line(last, Path("/dev/full"))
    failure = json.loads((run / "failure.json").read_text())
    assert failure["error"].startswith("DiskFullError: no space left"), failure


async def test_a_full_disk_no_write_named_names_each_place_the_job_writes_to(tmp_path, monkeypatch):
    # met where no write says its file (the image cache's unpack, a temp file): the error
    # named the run directory alone, sending the user to free space on the wrong disk
    import tempfile

    from core.job import Job

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    cfg = job_config(tmp_path, images={"dir": str(tmp_path / "cache")})
    job = Job(cfg, progress=False)

    async def full(term: object) -> None:
        _full()

    monkeypatch.setattr(job, "_run", full)
    with pytest.raises(DiskFullError) as got:
        await job.run()
    text = str(got.value)
    assert f"the run directory {str(cfg.run_dir)!r}" in text and "to write" not in text, text
    assert f"the image cache {str(tmp_path / 'cache')!r}" in text, text
    assert f"the temp directory {str(tmp_path / 'tmp')!r}" in text and "--resume" in text, text
    # the cache under the run directory (the default) is its disk: not said twice
    job = Job(job_config(tmp_path), progress=False)
    monkeypatch.setattr(job, "_run", full)
    with pytest.raises(DiskFullError) as got:
        await job.run()
    assert "image cache" not in str(got.value)
