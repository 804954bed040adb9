"""``fabric run``: an RL job."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import typer
from rich.table import Table

from fabric.cli._app import (
    app,
    err,
    fail,
    require_extra,
)
from fabric.usercode import prints_to_stderr


@app.command(epilog="Example: fabric run examples/frozenlake/config.yaml --steps 20 --run-dir runs/try")
def run(
    config: Annotated[str, typer.Argument(help="A job config (YAML), e.g. examples/frozenlake/config.yaml.")],
    steps: Annotated[int | None, typer.Option(help="Override the config's training steps.")] = None,
    run_dir: Annotated[str | None, typer.Option(help="Override the config's run directory.")] = None,
    quiet: Annotated[bool, typer.Option(help="No progress display; print only the summary JSON.")] = False,
    resume: Annotated[
        bool,
        typer.Option(
            help="Continue from the newest checkpoint in the run directory (checkpoint.every writes "
            "them); --steps N to train on past the config's steps."
        ),
    ] = False,
    allow_change: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-change",
            metavar="KEY",
            help="With --resume: a config key (trainer.lr) or section (trainer) that may differ from "
            "the checkpoint's; repeatable. The change is said and kept in the summary.",
        ),
    ] = None,
) -> None:
    """Run an RL job: a local Ray cluster, local fabric pools, process containers."""
    if steps is not None and steps < 1:
        # the config's check named its key ("steps: must be >= 1"), as if the file said so
        fail(f"--steps must be >= 1 (got {steps})")
    try:
        from core.errors import CoreError
        from core.job import Job, containers_note, failure_note, interrupted_note, load
    except ImportError as e:  # the job needs the ray and train extras
        fail(f"the RL job needs its extras: pip install -e '.[ray,train,rewards]' ({e})")
    # imported only once the job is under way (Ray at the cluster's start, matplotlib for the
    # plots after the last step): without them a base install built the images and the
    # policy, or trained the whole run, before a traceback
    require_extra("fabric run", "ray,train,rewards", ("ray", "torch", "matplotlib", "numpy"))
    from envpool.errors import ContainerStartError

    job: Job | None = None
    try:
        # the config's fabric.discover modules are imported here, and Ray relays its actors'
        # prints to our sys.stdout: --quiet's stdout is the summary alone
        with prints_to_stderr():
            cfg = load(config, steps=steps, run_dir=run_dir)
            job = Job(cfg, progress=not quiet, resume=resume, allow_changes=allow_change or (), source=config)
            summary = asyncio.run(job.run())
    except CoreError as e:  # a bad config, or a rollout where every group fails
        fail(f"{e}{failure_note(job)}")
    except KeyboardInterrupt:
        # Ctrl-C or SIGTERM: the job stopped what it had started. Said, as `python -m core.job`
        # says it: the exit code alone left a log that ended mid-run with no word of why
        err.print(interrupted_note(job), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    except ContainerStartError as e:
        # an image that passed the start-up check but starts in no container
        fail(containers_note(cfg, e))
    if not quiet:
        _print_summary(summary)
    print(json.dumps(summary))


def _print_summary(summary: dict[str, Any]) -> None:
    table = Table("figure", "value", title="job summary")
    for k in (
        "mode",
        "steps",
        "train_wall_s",
        "step_s_mean",
        "untrained_success",
        "final_success",
        "final_success_sampled",
        "best_eval_success",
        "final_train_reward",
        "aborted_trained",
        "run_dir",
    ):
        table.add_row(k, str(summary.get(k)))
    err.print(table)
