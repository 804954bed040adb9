"""The RL job: rollout streams trajectories out to the reward functions, rewards flow back
into the sample buffer, the trainer steps within the asynchronous bound.

    fabric run examples/frozenlake/config.yaml        # or: python -m core.job CONFIG

    cfg = JobConfig.from_yaml("examples/frozenlake/config.yaml")
    summary = asyncio.run(Job(cfg).run())

What runs where (on one machine: a local Ray cluster, local fabric pools, process
containers):

* Ray actors: the engine replicas (``EngineReplicaActor``, restarted by Ray on a crash,
  placed by ``hw_affinity``), the ``LLMProxy`` in front of them, the ``TrainerActor``
  (started and killed by ``core.cluster``).
* This process's event loop: the env managers (one task per trajectory), the group runner
  (redundancy, re-runs), the ``RewardStream`` (fabric client) and the ``SampleBuffer``.
  They exchange only in-process callbacks, so none of them needs its own actor.

The step loop takes ``batch_size`` complete groups from the buffer, builds the samples and
their advantages, has the trainer step and hand its weights straight to the proxy (an
object ref: the weights never pass through this process), then advances the buffer's
bound. In ``async`` mode a launcher keeps groups starting meanwhile, at most ``alpha``
versions ahead of the trainer; in ``sync`` mode (the batch-level baseline) a step's groups
start together, move turn by turn in lockstep, and the trainer waits for the last one.
What each step records is counted by ``core.tally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core._job_setup import JobSetup
from core.buffer import SampleBuffer
from core.checkpoint import Checkpoints, start_problems
from core.cluster import Cluster, turn_scheduler
from core.config import JobConfig, builtin_env_ids
from core.env_images import JobImages
from core.errors import ConfigError, CoreError, DiskFullError, disk_full
from core.evaluation import EVAL_SEED_BASE, Evaluator
from core.policy.build import PolicyBundle
from core.report import JobProgress, RunDir
from core.rewards import RewardStream
from core.rollout.env_manager import EnvManager, TurnBarrier
from core.rollout.groups import GroupRunner
from core.tally import Tally
from core.trainer.batch import build_batch
from envpool.errors import ContainerStartError
from fabric._sigterm import TermAsInterrupt, term_as_interrupt
from fabric.registry import Registry

__all__ = ["EVAL_SEED_BASE", "Job", "containers_note", "interrupted_note", "load", "main", "turn_scheduler"]

log = logging.getLogger(__name__)


class Job(JobSetup):
    """The run, from the config's checks to the summary; the layers below hold the rest
    (see ``core._job_state``)."""

    def __init__(
        self,
        cfg: JobConfig,
        *,
        progress: bool = True,
        registry: Registry | None = None,
        resume: bool = False,
        allow_changes: Sequence[str] = (),
        source: str | None = None,
    ):
        """``resume``: continue from the newest checkpoint in ``cfg.run_dir`` (refused, naming
        the key, when there is none, the config changed, or ``steps`` is below it; at its
        step, only the final evaluation and the summary are left to do);
        ``allow_changes``: config keys (or sections) a resumed run may change all the same;
        ``source``: the config's file, named by the config errors the job finds."""
        self.cfg = cfg
        self.source = source
        self.resume = resume
        self.allow_changes = tuple(allow_changes)
        self._changes = []  # what allow_changes let through
        self.checkpoints = Checkpoints(cfg.run_dir, cfg.checkpoint.keep)
        self._resume_from = None
        self._checkpoint_s = []  # from the start of each to its commit
        self._checkpoint_blocked_s = []  # of which the step loop waited
        self._checkpoint_task = None  # one being written
        self._wall_before = 0.0  # training time of the run a resume continues
        self.registry = registry
        self.progress_enabled = progress
        self.rng = random.Random(cfg.seed)
        self.cluster = Cluster(cfg)  # the Ray actors
        self.pool = None
        self.runner = None
        self.buffer = None
        self.stream = None
        self.step = 0
        self.version = 0
        self.tally = Tally()  # accounting of finished trajectories, the train rows
        self._groups_live = 0  # started minus dropped (stale, given up): the launch budget
        self.evaluator = Evaluator(cfg)
        self.run_dir = None
        # consecutive groups given up with none completed (the error names tally.last_error)
        self._give_up_streak = 0
        self._fatal = None
        self._t0 = time.perf_counter()
        self._pretrained = {}

    # ------------------------------------------------------------------ the run
    async def run(self) -> dict[str, Any]:
        """Run the job; its summary. SIGTERM stops it as Ctrl-C does (``KeyboardInterrupt``
        once everything it started is stopped)."""
        # Left alone, SIGTERM met the handler Ray's core worker installs, which printed a C
        # stack trace and killed the driver on the spot: nothing of the job's shutdown ran
        try:
            return await term_as_interrupt(self._run)
        except OSError as e:
            # a full disk met where no write says its file (the images' cache, the initial
            # policy, a trace): one line all the same, naming the places it may be (the run
            # directory alone sent the user to the wrong disk when /tmp was the full one)
            full = disk_full(e, self.cfg.run_dir, where=self._writes_to())
            if full is None:
                raise
            raise full from e
        except ConfigError as e:
            if e.source is not None or self.source is None:
                raise
            # found after the load (the policy build, the cluster, the warm-up), where only
            # the key is known: "invalid job config (1 problem)" did not say which file
            raise ConfigError(e.problems, self.source).with_traceback(e.__traceback__) from None

    def _writes_to(self) -> str:
        """The places on disk the job writes to, for a full disk met where no file was named."""
        import tempfile

        run_dir = Path(self.cfg.run_dir)
        cache, tmp = self.cfg.images.cache_dir(run_dir), tempfile.gettempdir()
        places = [f"the run directory {str(run_dir)!r}"]
        if not cache.is_relative_to(run_dir):  # (under it by default: the same disk)
            places.append(f"the image cache {str(cache)!r}")
        return ", ".join([*places, f"the temp directory {tmp!r}"])

    async def _run(self, term: TermAsInterrupt) -> dict[str, Any]:
        cfg = self.cfg
        t_start = time.perf_counter()
        registry = self.registry if self.registry is not None else cfg.discover_functions()
        # the config was checked against what discovery found; a job given its own registry
        # checks against that one, or an unknown reward would fail every trajectory
        problems = cfg.reference_problems(registry, builtin_env_ids())
        # before the policy build (minutes of pretraining), not at the RunDir made after it
        bad_dir = RunDir.problem(Path(cfg.run_dir))
        if bad_dir is not None:
            problems.append(("run_dir", f"{bad_dir}; choose another (run_dir, or --run-dir)"))
        else:
            more, self._resume_from, self._changes = start_problems(
                cfg, self.checkpoints, resume=self.resume, allow=self.allow_changes
            )
            problems += more
        if problems:
            raise ConfigError(problems)
        fatal = self._fatal = asyncio.get_running_loop().create_future()
        try:
            with JobProgress(cfg.steps, enabled=self.progress_enabled) as progress:
                async with JobImages(cfg.envs, cfg.images, cfg.run_dir) as images:
                    if images.refs:
                        built = f", {images.published} built" if images.published else ""
                        progress.note(f"images: {', '.join(images.refs.values())}{built}")
                    summary = await self._run_with(images, registry, term, progress, t_start)
        finally:
            if fatal.done() and not fatal.cancelled():
                fatal.exception()  # the run may have stopped on it by another way (the same cause)
        summary["wall_s"] = round(time.perf_counter() - t_start, 1)
        assert self.run_dir is not None
        try:
            self.run_dir.finish(summary)
        except DiskFullError as e:
            # trained to the end, and no summary: failure.json says why, if it fits
            self._write_failure(e, t_start, self.run_dir, self.buffer, self.stream, self.runner)
            raise
        return summary

    async def _run_with(
        self,
        images: JobImages,
        registry: Registry,
        term: TermAsInterrupt,
        progress: JobProgress,
        t_start: float,
    ) -> dict[str, Any]:
        cfg = self.cfg
        resume = self._resume_from
        bundle: PolicyBundle | None = None
        if cfg.engine.backend == "torch":
            bundle = self._resumed_policy() if resume else await self._build_policy(progress, images)
        actions = self._action_ids(bundle)
        if not resume:  # a resumed run's, once its checkpoint has loaded (_restore)
            self._open_run_dir(progress)
        init = None
        if bundle is not None:
            init_dir = self.checkpoints.root.parent / "policy-init"  # absolute: the actors' cwd differs
            init = str(init_dir if resume else bundle.save(init_dir))
        # ray.init puts its own SIGTERM handler in place of ours: ours goes back at once, not
        # once the actors, the reward workers and the containers are up (a large model's load,
        # a slow setup hook), meanwhile a SIGTERM printed a C stack trace and ended the job
        # with exit code 15, or with a traceback
        async with (
            self.cluster.start(init, on_ray_init=term.reinstall) as proxy,
            self._fabric(registry, images) as (client, pool),
        ):
            proxy.on_died = proxy.on_disk_full = self._proxy_failed
            self.pool = pool
            if resume:
                try:
                    await self._restore(*resume, progress)
                except ConfigError:
                    raise  # a checkpoint that does not load: refused, as before the start
                except Exception as e:
                    # a load past trainer.call_timeout_s (TrainerTimeout), a trainer that died
                    # loading, a proxy that died taking the weights: failure.json says so, as
                    # for the same errors later
                    self._write_failure(e, t_start, self._open_run_dir(progress))
                    raise
            run_dir = self._open_run_dir(progress)
            buffer = self.buffer = SampleBuffer(
                cfg.group_size, cfg.alpha, on_abort=self._on_abort, version=self.version
            )
            stream = self.stream = RewardStream(client, cfg.rewards, self._deliver)
            manager = EnvManager(cfg, pool, proxy, actions=actions, images=images.refs)
            runner = self.runner = GroupRunner(
                cfg,
                manager,
                proxy,
                submit=stream.submit,
                on_finished=self.tally.finished,
                on_given_up=self._given_up,
                on_cancelled=self.tally.cancelled,
            )
            setup_s = time.perf_counter() - t_start
            todo = f"training steps {self.step + 1}-{cfg.steps}" if resume else f"training {cfg.steps} steps"
            if resume and self.step >= cfg.steps:
                todo = "no step left to train: the final evaluation and the summary"
            progress.note(f"ready in {setup_s:.1f}s; {todo} ({cfg.rollout.mode})")
            summary = await self._rollout(manager, runner, buffer, stream, run_dir, progress, t_start)
            summary["setup_s"] = round(setup_s, 1)
            if images.refs:
                summary["images"] = dict(images.refs)
            try:
                # routing, recoveries and the turn scheduler's counts, for the record
                summary["proxy"] = await self.proxy.call(self.proxy_handle.stats.remote())
            except Exception as e:
                self._write_failure(e, t_start, run_dir, buffer, stream, runner)
                raise
        return summary

    async def _rollout(
        self,
        manager: EnvManager,
        runner: GroupRunner,
        buffer: SampleBuffer,
        stream: RewardStream,
        run_dir: RunDir,
        progress: JobProgress,
        t_start: float,
    ) -> dict[str, Any]:
        """Train with the rollout going on, then stop it and drain the reward stream; the
        summary of the run (``failure.json`` of one that failed)."""
        try:
            async with stream:
                try:
                    ended = await self._train(manager, runner, buffer, stream, run_dir, progress)
                finally:
                    # a failed run too stops its rollouts before the cluster goes away
                    await runner.aclose()
        except Exception as e:
            # a rollout that cannot go on (RolloutError), an actor that died: its counts
            # were only in the error's text. (Ctrl-C writes none: resume.) Counted once the
            # stream has stopped, as a summary is: inside its block, failure.json had what it
            # was scoring still in flight, never among the cancelled
            self._write_failure(e, t_start, run_dir, buffer, stream, runner)
            raise
        # counted once the stream has drained (a clean exit scores and delivers every
        # trajectory in flight): taken at the last step, the counts left out what the drain
        # scored, and summary.json disagreed with the stream it reported on
        return self._summary(run_dir, *ended, buffer, stream, runner)

    async def _train(
        self,
        manager: EnvManager,
        runner: GroupRunner,
        buffer: SampleBuffer,
        stream: RewardStream,
        run_dir: RunDir,
        progress: JobProgress,
    ) -> tuple[float, dict[str, Any] | None, dict[str, Any] | None]:
        """The steps, then the final evaluation; the training time and the first and final
        evaluations (the summary's)."""
        cfg = self.cfg
        # a resumed run goes on with the earlier run's training time (rows' wall_s, step_s_mean)
        t0 = self._t0 = time.perf_counter() - self._wall_before
        launcher = asyncio.create_task(self._launch_loop(runner)) if cfg.rollout.mode == "async" else None
        eval_task: asyncio.Task[dict[str, Any]] | None = None
        start = self.step  # 0, or the step of the checkpoint a resumed run continues from
        first_eval: dict[str, Any] | None = None
        # from here on inside the cleanup below: a first evaluation that failed (or Ctrl-C
        # during it) left the launcher, started above, pending and starting groups
        try:
            if start:  # the untrained policy's evaluation is the earlier run's
                first_eval = next((e for e in self.evals if e["step"] == 0), None)
                every = cfg.rollout.eval_every
                if (
                    every
                    and start % every == 0
                    and start < cfg.steps
                    and all(e["step"] != start for e in self.evals)
                ):
                    # the earlier run died before it logged its evaluation of the checkpoint's
                    # step (it starts after the checkpoint); the weights are that step's: run it
                    run_dir.log(await self._evaluate(manager, start))
            else:
                first_eval = await self._evaluate(manager, 0) if cfg.rollout.eval_every else None
                if first_eval:
                    run_dir.log(first_eval)
            tokens_last, t_last = self.tally.counts["tokens"], time.perf_counter()  # restored on resume
            for step in range(start + 1, cfg.steps + 1):
                self.step = step
                self._raise_failed_checkpoint()
                tw = time.perf_counter()
                if cfg.rollout.mode == "sync":
                    barrier = TurnBarrier()
                    for _ in range(cfg.batch_size):
                        self._start_group(runner, barrier)
                groups = await self._unless_fatal(buffer.get_batch(cfg.batch_size))
                wait_s = time.perf_counter() - tw
                tt = time.perf_counter()
                trained = {s.id for g in groups for s in g.samples}
                self.evaluator.trained_on_trajectories(s.traj for g in groups for s in g.samples)
                self.tally.counts["aborted_trained"] += len(trained & runner.aborted_ids)
                self.tally.counts["masked_trained"] += sum(s.masked for g in groups for s in g.samples)
                batch = build_batch(groups, cfg.trainer, env_shares=cfg.env_return_shares)
                metrics_ref, state_ref = self.trainer_handle.step.options(num_returns=2).remote(batch)
                metrics = await self._from_trainer(metrics_ref, f"step {step}")
                # turns whose engine logprobs were not finite: masked by the trainer (it warns)
                self.tally.counts["nonfinite_logprob_trained"] += int(
                    metrics.get("nonfinite_logprob_samples", 0)
                )
                train_s = time.perf_counter() - tt
                if eval_task is not None and cfg.rollout.eval_exact:
                    run_dir.log(await eval_task)  # its turns all on the version it measures
                    eval_task = None
                tp = time.perf_counter()
                version = int(metrics["version"])
                await self.proxy.call(self.proxy_handle.update_weights.remote(version, [state_ref]))
                self.version = version
                buffer.advance(version)
                runner.forget_aborted_before(buffer.bound)
                runner.changed.set()
                publish_s = time.perf_counter() - tp
                now = time.perf_counter()
                tokens = self.tally.counts["tokens"]
                row = self.tally.train_row(
                    step, self.version, groups, metrics, now - t0, wait_s, train_s, publish_s, stream
                )
                row["tokens_per_s"] = (tokens - tokens_last) / max(now - t_last, 1e-9)
                tokens_last, t_last = tokens, now
                run_dir.log(row)
                every = cfg.checkpoint.every
                if every and (step % every == 0 or step == cfg.steps):
                    await self._save_checkpoint(step)
                if eval_task is not None and eval_task.done():
                    run_dir.log(eval_task.result())
                    eval_task = None
                if cfg.rollout.eval_every and step % cfg.rollout.eval_every == 0 and step < cfg.steps:
                    if eval_task is None:  # one at a time; in sync mode it runs between steps
                        eval_task = asyncio.create_task(self._evaluate(manager, step))
                        if cfg.rollout.mode == "sync":
                            run_dir.log(await eval_task)
                            eval_task = None
                progress.step(row, self.evals[-1]["success"] if self.evals else None)
            # the last step is trained, and nothing the rollouts play from here on can be:
            # left running through the last checkpoint's write and the evaluations, they
            # shared the engines with them, re-ran their failures and sent what finished to
            # be scored (the stream's drain then waited for it)
            if launcher is not None:
                launcher.cancel()
            await runner.aclose()
            await self._checkpoint_done()  # the last one is on disk before the run ends
        except BaseException as e:
            # a failed run keeps the checkpoint it was writing (a consistent copy of a step);
            # a stopped one (Ctrl-C) does not wait for the disk
            stopped = isinstance(e, (asyncio.CancelledError, KeyboardInterrupt))
            if launcher is not None:
                launcher.cancel()  # no group starts while the run stops (awaited below)
            if eval_task is not None:
                # an evaluation playing meanwhile (async mode) is stopped with the run: left
                # running, its episodes held sessions while the pool and the cluster closed
                eval_task.cancel()
                with contextlib.suppress(BaseException):
                    await eval_task
            # the rollouts too, before the wait for the checkpoint (up to
            # trainer.call_timeout_s): they played on meanwhile, for nothing to train on
            await runner.aclose()
            try:
                await self._checkpoint_done(cancel=stopped)
            except Exception:
                log.exception("the checkpoint being written when the run failed was not kept")
            raise
        finally:
            if launcher is not None:
                launcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await launcher
        train_wall = time.perf_counter() - t0
        if eval_task is not None:
            run_dir.log(await eval_task)
        # a run resumed after its last step (stopped in its final evaluation or its summary's
        # write) has the final evaluation logged already if it got that far: kept, not
        # played and logged twice
        final = next((e for e in self.evals if e["step"] == cfg.steps), None) if start == cfg.steps else None
        if final is None and cfg.rollout.eval_every:
            final = await self._evaluate(manager, cfg.steps)
            run_dir.log(final)
        return train_wall, first_eval, final

    # ------------------------------------------------------------------ evaluation
    async def _evaluate(self, manager: EnvManager, step: int) -> dict[str, Any]:
        row = await self.evaluator.run(manager, step, self.version)
        row["wall_s"] = round(time.perf_counter() - self._t0, 1)  # since training began, as train rows
        return row


def failure_note(job: Job | None) -> str:
    """`` (the counts: RUN_DIR/failure.json)`` for a job that wrote one, else ``""``."""
    failure = job.run_dir.path / "failure.json" if job is not None and job.run_dir else None
    return f" (the counts: {failure})" if failure is not None and failure.exists() else ""


def containers_note(cfg: JobConfig, e: ContainerStartError) -> str:
    """What a job whose environments' containers do not start says (a device or a licence
    server they need is missing: the user's to fix, as a bad config is, not a traceback).
    The error does not say whose containers they were: the job's environments are named."""
    ids = ", ".join(dict.fromkeys(env.id for env in cfg.envs))
    return f"the environments' containers do not start ({ids}): {e}"


def interrupted_note(job: Job | None) -> str:
    """What a run stopped by Ctrl-C or SIGTERM says: ``interrupted``, and where it has a
    checkpoint, how to go on from it."""
    latest, step = None, 0
    if job is not None:
        # a ``latest`` that names a checkpoint gone or incomplete: the resume says so
        with contextlib.suppress(CoreError, OSError, ValueError):
            latest = job.checkpoints.latest()
            step = int(latest.name.removeprefix("step-")) if latest is not None else 0
    if job is None or latest is None:
        return "interrupted"
    if step >= job.cfg.steps:  # stopped in the final evaluation: a resume finishes the run
        return (
            "interrupted after its last step; --resume runs its final evaluation and writes its "
            f"summary (--resume --steps N, N > {step}, trains on) from {latest}"
        )
    return f"interrupted; --resume continues from its latest checkpoint, {latest}"


def main(argv: list[str] | None = None) -> int:
    """``python -m core.job CONFIG [--steps N] [--run-dir DIR] [--resume] [--allow-change KEY]
    [--quiet]``."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m core.job", description="Run an RL job from a YAML config.")
    ap.add_argument("config")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--run-dir")
    ap.add_argument(
        "--resume", action="store_true", help="continue from the run directory's newest checkpoint"
    )
    ap.add_argument(
        "--allow-change",
        action="append",
        default=[],
        metavar="KEY",
        help="with --resume: a config key (or section) that may differ from the checkpoint's",
    )
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    from fabric.usercode import prints_to_stderr

    job: Job | None = None
    try:
        # the config's fabric.discover modules are imported here, and Ray relays its actors'
        # prints to our sys.stdout: --quiet's stdout is the summary alone, as fabric run's
        with prints_to_stderr():
            cfg = load(args.config, steps=args.steps, run_dir=args.run_dir)
            job = Job(
                cfg,
                progress=not args.quiet,
                resume=args.resume,
                allow_changes=args.allow_change,
                source=args.config,
            )
            summary = asyncio.run(job.run())
    except CoreError as e:
        print(f"error: {e}{failure_note(job)}", file=sys.stderr)  # worded as fabric run's
        return 2
    except ContainerStartError as e:
        print(containers_note(cfg, e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the job stopped what it had started; no traceback
        print(interrupted_note(job), file=sys.stderr)
        return 130
    print(json.dumps(summary))
    return 0


def load(path: str, *, steps: int | None = None, run_dir: str | None = None) -> JobConfig:
    """The config at ``path`` with command-line overrides, validated once."""
    import yaml

    from fabric.usercode import search_cwd

    # `python -m core.job` finds a `fabric.discover` module in the working directory (beside
    # the config: my_rewards.py), the installed `fabric run` did not (ModuleNotFoundError)
    search_cwd()
    overrides: dict[str, Any] = {}
    if steps is not None:
        overrides["steps"] = steps
    if run_dir is not None:
        overrides["run_dir"] = run_dir
    if not overrides:
        return JobConfig.from_yaml(path)
    # the references (rewards, environments, their images) once, with the overrides applied
    cfg = JobConfig.from_yaml(path, check_references=False)
    data = yaml.safe_load(cfg.to_yaml())
    data.update(overrides)
    return JobConfig.from_dict(data, source=path)


if __name__ == "__main__":
    sys.exit(main())
