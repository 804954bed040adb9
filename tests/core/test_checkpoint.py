"""Checkpoints and ``--resume``: the directory's bookkeeping, the config changes a resume may
not make, the job resumed after a crash, every resume the job refuses before anything starts,
and a checkpoint whose load or write fails.

The trainers' own training state (a resumed trainer goes on exactly as the uninterrupted one)
is in ``test_checkpoint_trainer``."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import job_faults_fns as faults
import pytest
import yaml
from job_helpers import FROZENLAKE, LATENCY, check_invariants, job_config, run_job, train_rows

from core.checkpoint import JOB_FILE, TRAINER_FILE, Checkpoints, config_changes, start_problems
from core.errors import ConfigError, TrainerTimeout
from core.job import Job, main
from core.trainer.base import TrainerError

# ----------------------------------------------------------------------------- the directory


def _write(ckpts: Checkpoints, step: int, **state) -> Path:
    part = ckpts.prepare(step)
    (part / TRAINER_FILE).write_bytes(b"weights")
    job = {"step": step, "version": step, "config": "{}", "rng": None, "counts": {}, "trained_tasks": []}
    return ckpts.commit(part, step, job | state)


def test_latest_names_the_newest_complete_checkpoint_and_old_ones_are_pruned(tmp_path):
    ckpts = Checkpoints(tmp_path, keep=2)
    assert ckpts.latest() is None
    for step in (2, 4, 6):
        _write(ckpts, step)
    assert ckpts.latest() == tmp_path.absolute() / "checkpoints" / "step-000006"
    assert sorted(p.name for p in ckpts.root.iterdir()) == ["latest", "step-000004", "step-000006"]
    assert Checkpoints.read(ckpts.latest())["step"] == 6
    # a crash mid-write leaves a .part directory behind: never the latest, cleared next time
    part = ckpts.prepare(8)
    (part / TRAINER_FILE).write_bytes(b"half")
    assert ckpts.latest().name == "step-000006"
    assert ckpts.prepare(8) == part and not any(part.iterdir())


def test_what_a_crash_left_half_written_is_removed_once_a_newer_checkpoint_is_complete(tmp_path):
    # a run that died writing the checkpoint of its last step (5), resumed with more steps,
    # never writes step 5 again: its .part (a whole training state) stayed on disk for good
    ckpts = Checkpoints(tmp_path)
    _write(ckpts, 4)
    (ckpts.prepare(5) / TRAINER_FILE).write_bytes(b"half")
    _write(ckpts, 6)
    assert sorted(p.name for p in ckpts.root.iterdir()) == ["latest", "step-000006"]


def test_a_latest_that_names_a_missing_or_foreign_checkpoint_is_an_error(tmp_path):
    ckpts = Checkpoints(tmp_path)
    path = _write(ckpts, 2)
    (path / TRAINER_FILE).unlink()
    with pytest.raises(ConfigError, match=r"step-000002.*incomplete or gone"):
        ckpts.latest()
    path = _write(ckpts, 3)
    (path / JOB_FILE).write_text(json.dumps({"format": 99, "step": 3}))
    with pytest.raises(ConfigError, match="format 99, not 1: point checkpoints/latest at an older"):
        Checkpoints.read(ckpts.latest())
    (path / JOB_FILE).write_text(json.dumps({"format": 1, "step": 3}))
    with pytest.raises(ConfigError, match="lacks version, config, rng, counts, trained_tasks: point"):
        Checkpoints.read(ckpts.latest())


def test_a_resume_from_an_earlier_step_replaces_the_line_of_checkpoints_after_it(tmp_path):
    for step in (2, 4, 6):
        _write(Checkpoints(tmp_path, keep=3), step)
    ckpts = Checkpoints(tmp_path, keep=2)
    (ckpts.root / "latest").write_text("step-000002\n")  # resumed from step 2
    _write(ckpts, 3)
    # step 6 is of the abandoned line (it would count towards keep and outlive the new
    # line's checkpoints), step 2 the one kept beside the new latest
    assert sorted(p.name for p in ckpts.root.iterdir()) == ["latest", "step-000002", "step-000003"]
    ckpts = Checkpoints(tmp_path, keep=1)
    for step in (999_999, 1_000_000):  # by number, not by name
        _write(ckpts, step)
    assert sorted(p.name for p in ckpts.root.iterdir()) == ["latest", "step-1000000"]


def test_config_changes_name_what_a_resumed_run_may_not_change():
    saved = {
        "steps": 4,
        "trainer": {"lr": 1e-3, "num_gpus": 0},
        "engine": {"replicas": 1, "kwargs": {"d_model": 16}},
        "envs": [{"id": "a", "kwargs": {}}],
        "fabric": {"workers": 1},
    }
    now = json.loads(json.dumps(saved))
    now |= {"steps": 9, "fabric": {"workers": 4}}
    now["engine"]["replicas"] = 2
    now["trainer"]["num_gpus"] = 1
    now["engine"] |= {"rejoin_first_s": None, "rejoin_max_s": 60.0}  # how long: may change
    assert config_changes(saved, now) == []  # length, infrastructure: may change
    now["trainer"]["lr"] = 2e-3
    now["engine"]["kwargs"]["d_model"] = 32
    now["envs"].append({"id": "b"})
    assert [k for k, _ in config_changes(saved, now)] == ["engine.kwargs.d_model", "envs", "trainer.lr"]
    said = dict(config_changes(saved, now))
    assert said["trainer.lr"] == "was 0.001 when the checkpoint was written, now 0.002"
    assert said["envs"] == "had 1 entries when the checkpoint was written, now 2"
    # a field only one side has is another release's, not the user's change
    newer = json.loads(json.dumps(saved))
    newer["trainer"]["step_adv"] = 0.0
    assert config_changes(saved, newer) == [] and config_changes(newer, saved) == []


def test_a_key_added_to_or_removed_from_a_mapping_the_user_fills_is_a_change(tmp_path):
    # kwargs, args, the rewards' tags: a key there, present or absent, is the user's, not a
    # field another release added; taken for one, a resume onto a bigger map, a reward with
    # an argument dropped or a trainer option added went on as if nothing had changed
    _earlier_run(tmp_path, rewards=[{"function": "env_return", "args": {}}])
    env = {**LATENCY, "kwargs": {"turns": 3, "sigma_s": 0.5}}  # mu_s dropped (its default is 0.05)
    cfg = job_config(
        tmp_path,
        env=env,
        checkpoint={"every": 2},
        trainer={"lr": 1e-3, "kwargs": {"weight_decay": 0.1}},
        engine={"kwargs": {"d_ff": 64}},  # the policy's shape: never, not even allowed
    )
    problems, _, _ = start_problems(cfg, Checkpoints(cfg.run_dir), resume=True, allow=["engine"])
    said = dict(problems)
    assert sorted(said) == [
        "engine.kwargs.d_ff",
        "envs[0].kwargs.mu_s",
        "envs[0].kwargs.sigma_s",
        "envs[0].kwargs.turns",
        "trainer.kwargs.weight_decay",
    ], said
    assert said["envs[0].kwargs.mu_s"].startswith("was 0.01 when the checkpoint was written, now unset;")
    assert said["envs[0].kwargs.sigma_s"].startswith("unset when the checkpoint was written, now 0.5;")
    assert "--allow-change engine.kwargs.d_ff" not in said["engine.kwargs.d_ff"]
    # the way out it names for a key the config no longer has is taken
    cfg = job_config(tmp_path, env=env, checkpoint={"every": 2})
    allow = ["envs[0].kwargs.mu_s", "envs[0].kwargs.sigma_s", "envs[0].kwargs.turns"]
    problems, _, changes = start_problems(cfg, Checkpoints(cfg.run_dir), resume=True, allow=allow)
    assert problems == [] and [k for k, _ in changes] == allow
    # a reward tag added is a change; a field of a section only one side has is not
    saved = {"rewards": {"a": [{"function": "f"}]}, "trainer": {"lr": 1e-3}}
    now = {"rewards": {"a": [{"function": "f", "new_field": 1}], "b": [{"function": "g"}]}, "trainer": {}}
    assert [k for k, _ in config_changes(saved, now)] == ["rewards.b"]


# ----------------------------------------------------------------------------- the job


def _earlier_run(tmp_path: Path, step: int = 2, **over) -> Path:
    """A run directory holding a checkpoint at ``step`` (written by hand: no Ray needed)."""
    cfg = job_config(tmp_path, checkpoint={"every": 2}, **over)
    ckpts = Checkpoints(cfg.run_dir)
    _write(ckpts, step, config=cfg.to_yaml())
    (Path(cfg.run_dir) / "policy-init").mkdir()
    return Path(cfg.run_dir)


@pytest.mark.parametrize(
    ("resume", "over", "key", "text"),
    [
        (True, {}, "run_dir", "nothing to resume"),
        (False, {"earlier": True}, "run_dir", "holds the checkpoint of an earlier run at step 2: --resume"),
        (True, {"earlier": True, "steps": 1}, "steps", "is 1, the checkpoint is at step 2: raise it"),
        (True, {"earlier": True, "trainer": {"lr": 5e-3}}, "trainer.lr", "was 0.001 when the checkpoint"),
        (
            True,
            {"earlier": True, "no_init": True},
            "run_dir",
            "(the initial policy), which is gone",
        ),
    ],
)
async def test_a_resume_that_cannot_go_on_is_refused_before_anything_starts(
    tmp_path, resume, over, key, text
):
    over = dict(over)
    if over.pop("earlier", False):
        run_dir = _earlier_run(tmp_path)
        if over.pop("no_init", False):
            (run_dir / "policy-init").rmdir()
    cfg = job_config(tmp_path, checkpoint={"every": 2}, **over)
    with pytest.raises(ConfigError) as e:
        await Job(cfg, progress=False, registry=faults.REG, resume=resume).run()
    assert [k for k, _ in e.value.problems] == [key] and text in str(e.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing written, nothing lost


@pytest.mark.parametrize(
    ("resume", "allow", "over", "text"),
    [
        (False, ["trainer.lr"], {}, "is for --resume"),
        (True, ["trainer.lrr"], {}, "'trainer.lrr' is no key of the config; did you mean trainer.lr"),
        (True, ["trainer.backend"], {}, "'trainer.backend' cannot change on resume"),
        (True, ["engine"], {"engine": {"model": "other"}}, "engine.model: was 'tiny-lm'"),
        (True, ["trainer.clip_eps"], {"trainer": {"lr": 5e-3}}, "--allow-change trainer.lr lets it change"),
        # the torch engine's policy comes from policy-init/: a new shape would be ignored
        (True, ["engine.kwargs"], {"engine": {"kwargs": {"d_model": 32}}}, "engine.kwargs.d_model: was 16"),
        (True, ["engine.kwargs.n_layers"], {}, "'engine.kwargs.n_layers' cannot change on resume"),
    ],
)
async def test_allow_change_lets_only_the_keys_it_names_change(tmp_path, resume, allow, over, text):
    _earlier_run(tmp_path)
    cfg = job_config(tmp_path, checkpoint={"every": 2}, **over)
    job = Job(cfg, progress=False, registry=faults.REG, resume=resume, allow_changes=allow)
    with pytest.raises(ConfigError) as e:
        await job.run()
    assert text in str(e.value)
    if "engine.model" in text:  # a section allowed does not open the keys the weights depend on
        assert "--allow-change engine.model" not in str(e.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_allowed_changes_are_let_through_and_said(tmp_path):
    _earlier_run(tmp_path)
    over = {"trainer": {"lr": 5e-3, "kl_coef": 0.1}, "batch_size": 3}
    cfg = job_config(tmp_path, checkpoint={"every": 2}, steps=4, **over)
    ckpts = Checkpoints(cfg.run_dir)
    problems, resume, changes = start_problems(cfg, ckpts, resume=True, allow=["trainer", "batch_size"])
    assert problems == [] and resume is not None and resume[1]["step"] == 2
    assert [k for k, _ in changes] == ["batch_size", "trainer.kl_coef", "trainer.lr"]
    assert dict(changes)["trainer.lr"] == "was 0.001 when the checkpoint was written, now 0.005"
    problems, _, _ = start_problems(cfg, ckpts, resume=True, allow=["trainer.lr"])
    assert [k for k, _ in problems] == ["batch_size", "trainer.kl_coef"]


def test_the_cli_says_why_a_resume_is_refused(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    data = {
        "envs": [FROZENLAKE],
        "rewards": {"frozenlake": [{"function": "env_return"}]},
        "run_dir": str(tmp_path / "run"),
    }
    path.write_text(yaml.safe_dump(data))
    assert main([str(path), "--quiet", "--resume"]) == 2
    assert "run_dir: nothing to resume" in capsys.readouterr().err
    assert main([str(path), "--quiet", "--resume", "--allow-change", "trainer.lrr"]) == 2
    assert "--allow-change: 'trainer.lrr' is no key of the config" in capsys.readouterr().err


@pytest.mark.ray
async def test_a_run_resumed_after_a_crash_trains_on_from_its_checkpoint(tmp_path, ray_cluster):
    # alpha 0: nothing stale, so approx_kl reads the engine against the trainer exactly;
    # with a reward that moves the weights every step, a replica that served the initial
    # weights after the resume reads far more than noise. Async: the launcher's budget too
    over = {
        "alpha": 0,
        "rewards": [{"function": "said_go"}],
        "trainer": {"lr": 3e-2},
        "rollout": {"eval_every": 2, "eval_episodes": 4},
    }
    cfg = job_config(tmp_path, steps=4, checkpoint={"every": 2, "keep": 2}, **over)
    _, first = await run_job(cfg)
    check_invariants(first, cfg)
    run_dir = tmp_path / "run"
    ckpts = Checkpoints(run_dir)
    assert ckpts.latest().name == "step-000004" and first["checkpoints"]["written"] == 2
    assert 0 < first["checkpoints"]["blocked_s"] <= first["checkpoints"]["seconds"]
    assert sorted(p.name for p in ckpts.root.iterdir()) == ["latest", "step-000002", "step-000004"]
    # as if the run had died after step 3: its last complete checkpoint is step 2's, and the
    # evaluation of step 2 (which starts after the checkpoint) was never logged
    (ckpts.root / "latest").write_text("step-000002\n")
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    kept = [x for x in lines if not (json.loads(x).get("kind") == "eval" and json.loads(x)["step"] == 2)]
    assert len(kept) == len(lines) - 1
    metrics.write_text("\n".join(kept) + "\n")
    at_2 = Checkpoints.read(ckpts.root / "step-000002")["counts"]
    # and with a lower learning rate (--allow-change trainer.lr), which the trainer must use
    lower = {**over, "trainer": {"lr": 1e-2}}
    resumed_cfg = job_config(tmp_path, steps=6, checkpoint={"every": 2, "keep": 2}, **lower)
    job = Job(resumed_cfg, progress=False, registry=faults.REG, resume=True, allow_changes=["trainer.lr"])
    summary = await job.run()
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 6 and job.version == 6
    assert summary["changed_on_resume"] == {
        "trainer.lr": "was 0.03 when the checkpoint was written, now 0.01"
    }
    rows = train_rows(run_dir)
    # the rows of steps 3-4 the crashed run logged are replaced by the resumed run's
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["version"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in rows] == [3e-2] * 2 + [1e-2] * 4
    assert all(r["approx_kl"] < 1e-4 for r in rows), [r["approx_kl"] for r in rows]
    evals = [e["step"] for e in summary["evals"]]
    # step 0's evaluation is the first run's, not repeated; step 2's lost one is run again
    assert evals == [0, 2, 4, 6]
    assert summary["evals"][1]["versions"] == [2, 2]  # played by the checkpoint's weights
    assert summary["untrained_success"] == first["untrained_success"]
    assert ckpts.latest().name == "step-000006"
    assert sorted(p.name for p in ckpts.root.iterdir()) == ["latest", "step-000004", "step-000006"]
    # the counts go on from the checkpoint's; the buffer is the resumed process's own
    done = summary["trajectories"]
    finished = done.get("ok", 0) + done.get("truncated", 0)
    assert finished >= at_2.get("ok", 0) + at_2.get("truncated", 0) + 4 * 4
    assert summary["buffer"]["served_groups"] == 4 * resumed_cfg.batch_size
    # the launcher counts the trained groups as before: one batch per version ahead, not the
    # 2 x batch_size more it started (all to go stale) when its budget began at 0
    assert summary["groups"]["groups_started"] <= (4 + 1) * resumed_cfg.batch_size, summary["groups"]
    # the rows' clock goes on from the earlier run's
    walls = [r["wall_s"] for r in rows]
    assert walls == sorted(walls), walls


@pytest.mark.ray
async def test_a_resume_whose_trainer_load_times_out_writes_failure_json(tmp_path, ray_cluster, monkeypatch):
    # every other fatal trainer edge (a step, a checkpoint's copy or write past
    # trainer.call_timeout_s) wrote failure.json; a resume whose load of the checkpoint
    # timed out stopped with TrainerTimeout and left the run directory without a word
    import threading

    from core.policy.build import build_policy

    cfg = job_config(tmp_path, checkpoint={"every": 2}, trainer={"lr": 1e-3, "call_timeout_s": 2})
    run_dir = Path(cfg.run_dir)
    build_policy(cfg).save(run_dir / "policy-init")  # the earlier run's policy, as built
    _write(Checkpoints(run_dir), 2, config=cfg.to_yaml())  # its trainer file is never read

    def wedge(actor: Any) -> None:  # holds the trainer's one thread: the load waits for ever
        threading.Event().wait()

    restore = Job._restore

    async def wedged(self: Job, *a: Any) -> None:
        self.trainer_handle.__ray_call__.remote(wedge)
        await restore(self, *a)

    monkeypatch.setattr(Job, "_restore", wedged)
    with pytest.raises(TrainerTimeout) as e:
        await Job(cfg, progress=False, registry=faults.REG, resume=True).run()
    assert "load of the checkpoint" in str(e.value) and "trainer.call_timeout_s=2" in str(e.value)
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["error"].startswith("TrainerTimeout: ") and "trainer.call_timeout_s=2" in failure["error"]
    assert not (run_dir / "summary.json").exists()


@pytest.mark.ray
async def test_a_trainer_that_dies_loading_a_checkpoint_does_not_condemn_the_checkpoint(
    tmp_path, ray_cluster, monkeypatch
):
    # a trainer actor killed while it loads (the OOM killer, a lost node) says nothing of the
    # file: it stopped with a config error whose remedy was "point checkpoints/latest at an
    # older step-* directory, or remove checkpoints/ to start over", and a user who followed
    # it threw away a sound checkpoint. It is a failure of the run, as the same death later
    from ray.exceptions import RayActorError

    from core.policy.build import build_policy

    cfg = job_config(tmp_path, checkpoint={"every": 2})
    run_dir = Path(cfg.run_dir)
    build_policy(cfg).save(run_dir / "policy-init")
    _write(Checkpoints(run_dir), 2, config=cfg.to_yaml())  # its trainer file is never read

    def die(actor: Any) -> None:
        os._exit(1)

    restore = Job._restore

    async def killed(self: Job, *a: Any) -> None:
        self.trainer_handle.__ray_call__.remote(die)  # runs before the load (one thread)
        await restore(self, *a)

    monkeypatch.setattr(Job, "_restore", killed)
    with pytest.raises(RayActorError):
        await Job(cfg, progress=False, registry=faults.REG, resume=True).run()
    failure = json.loads((run_dir / "failure.json").read_text())
    assert "Actor" in failure["error"] and "remove checkpoints/" not in failure["error"]
    assert Checkpoints(run_dir).latest() is not None


@pytest.mark.ray
async def test_a_checkpoint_the_trainer_cannot_read_is_refused_naming_the_file(tmp_path, ray_cluster):
    # and it leaves the earlier run's outputs as they were: refused "as before the start", but
    # the run directory had been opened for the resume already: the earlier run's summary.json
    # (or failure.json) and plots were removed, its config.yaml overwritten and its rows after
    # the checkpoint dropped, by a run that never began (one Ray job for both: it is slow)
    from core.policy.build import build_policy

    cfg = job_config(tmp_path, steps=5, checkpoint={"every": 2})
    run_dir = Path(cfg.run_dir)
    build_policy(cfg).save(run_dir / "policy-init")
    _write(Checkpoints(run_dir), 2, config=cfg.to_yaml())  # trainer.pt: b"weights", no torch file
    earlier = {
        "summary.json": '{"steps": 3}\n',
        "failure.json": '{"error": "RolloutError: ..."}\n',
        "reward.png": "png",
        "config.yaml": "steps: 3\n",
        "metrics.jsonl": "".join(json.dumps({"kind": "train", "step": s}) + "\n" for s in (1, 2, 3)),
    }
    for name, text in earlier.items():
        (run_dir / name).write_text(text)
    with pytest.raises(ConfigError) as e:
        await Job(cfg, progress=False, registry=faults.REG, resume=True).run()
    assert [k for k, _ in e.value.problems] == ["run_dir"]
    said = str(e.value)
    assert "cannot load" in said
    assert "step-000002/trainer.pt' (TrainerError: cannot read the checkpoint" in said
    assert "point checkpoints/latest at an older step-* directory" in said
    assert {name: (run_dir / name).read_text() for name in earlier if (run_dir / name).exists()} == earlier


async def test_a_failed_checkpoint_write_stops_the_run_at_the_next_step_not_the_next_checkpoint():
    # the write goes on beside training; its failure (a full disk) was found only by the next
    # checkpoint, checkpoint.every steps later, or at the end of the run
    async def write() -> None:
        raise TrainerError("checkpoint write of step 2: [Errno 28] No space left on device")

    job = Job.__new__(Job)
    job._checkpoint_task = asyncio.create_task(write())
    job._raise_failed_checkpoint()  # still being written: the step goes on
    await asyncio.sleep(0)
    with pytest.raises(TrainerError, match="No space left"):
        job._raise_failed_checkpoint()
    assert job._checkpoint_task is None  # raised once: the run's failure path finds nothing more
    await job._checkpoint_done()
