"""The run directory: what a job leaves behind, and its live progress display.

    runs/frozenlake/
      config.yaml      the config with every default filled in
      metrics.jsonl    one JSON object per training step (and one per evaluation)
      reward.png       reward and success rate per step (evaluation on held-out tasks too)
      time.png         where each step's time went
      summary.json     the final figures (also printed)
      failure.json     instead, a run the rollout stopped (RolloutError): why, and its counts
      trace.jsonl      one line per turn (``rollout.trace``)

A directory is reused as it is: what an earlier run left there that this one may not write
again (its summary, plots and trace: an interrupted run writes none) is removed at the start,
so every file in it is this run's.

The time breakdown has two views, because in an asynchronous job they overlap: the
trainer's wall time per step (waiting for a batch / training / publishing weights), and
per trajectory, the mean time in generation, environment and reward.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from core.errors import DiskFullError, writing

#: Outputs written at the end of a run (or only with some settings): an earlier run's are removed.
STALE_OUTPUTS = ("summary.json", "failure.json", "reward.png", "time.png", "trace.jsonl")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def strict_json(obj: Any, indent: int | None = None) -> str:
    """JSON that every reader takes: a NaN or infinite figure (a diverged loss) is ``null``,
    where Python's default writes ``NaN``, which jq, pandas' strict mode and browsers refuse."""
    return json.dumps(_finite(obj), indent=indent, allow_nan=False)


def _write_whole(path: Path, text: str) -> None:
    """``text`` in ``path`` whole, or no file: a full disk left an empty ``failure.json``
    (a cut-off ``summary.json``), where tools look for the run's record."""
    part = path.with_name(path.name + ".part")
    try:
        part.write_text(text)
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


class RunDir:
    def __init__(self, path: Path, *, resume_step: int | None = None):
        """``resume_step``: a run resumed from the checkpoint of that step keeps the rows
        logged up to it (those after it were of steps it trains again) and appends."""
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        for name in STALE_OUTPUTS:
            (path / name).unlink(missing_ok=True)
        self.rows: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        metrics = path / "metrics.jsonl"
        if resume_step is None:
            self._metrics = metrics.open("w")
            return
        kept = self._rows_until(resume_step)
        # the kept rows go to a new file that replaces the old one whole: a kill meanwhile
        # leaves the earlier run's rows as they were
        part = path / "metrics.jsonl.part"
        part.write_text("".join(strict_json(row) + "\n" for row in kept))
        os.replace(part, metrics)
        for row in kept:
            (self.evals if row.get("kind") == "eval" else self.rows).append(row)
        self._metrics = metrics.open("a")

    def _rows_until(self, step: int) -> list[dict[str, Any]]:
        try:
            lines = (self.path / "metrics.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        rows = []
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # the last line of a run killed mid-write
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                rows.append(row)
        return rows

    @staticmethod
    def problem(path: Path) -> str | None:
        """Why ``path`` cannot be a run directory (None: it can), checked without creating
        anything, so that a job can refuse it before its long set-up rather than after."""
        if path.exists():
            if not path.is_dir():
                return f"{str(path)!r} is a file, not a directory"
            return None if os.access(path, os.W_OK | os.X_OK) else f"cannot write in {str(path)!r}"
        parent = path.absolute().parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            return f"{str(parent)!r} is a file, not a directory"
        if not os.access(parent, os.W_OK | os.X_OK):
            return f"cannot create {str(path)!r}: {str(parent)!r} is not writable"
        return None

    # Every write below raises a full disk as ``DiskFullError`` naming its file (a line that
    # says what to do, where it was a traceback of a bare OSError: a flush names no file)

    def write_config(self, text: str) -> None:
        path = self.path / "config.yaml"
        with writing(path):
            path.write_text(text)

    def log(self, row: dict[str, Any]) -> None:
        (self.evals if row.get("kind") == "eval" else self.rows).append(row)
        with writing(self.path / "metrics.jsonl"):
            self._append(strict_json(row) + "\n")

    def _append(self, line: str) -> None:
        self._metrics.write(line)
        self._metrics.flush()

    def _close_metrics(self) -> None:
        with writing(self.path / "metrics.jsonl"):
            self._metrics.close()  # flushes (and closes the file even when that fails)

    def finish(self, summary: dict[str, Any]) -> None:
        self._close_metrics()
        # the plots first: summary.json is what tools read as a finished run, so a full disk
        # that stops the plots leaves none (failure.json says why)
        self.plot()
        path = self.path / "summary.json"
        with writing(path):
            _write_whole(path, strict_json(summary, indent=2) + "\n")

    def fail(self, failure: dict[str, Any]) -> None:
        """A run that stopped on an error: ``failure.json`` (never ``summary.json``, which
        tools read as a finished run), and the plots of the steps it trained."""
        with contextlib.suppress(DiskFullError, OSError):  # the run's own error says why
            self._close_metrics()
        path = self.path / "failure.json"
        with writing(path):
            _write_whole(path, strict_json(failure, indent=2) + "\n")
        self.plot()

    def plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")  # no display; must precede pyplot
        import matplotlib.pyplot as plt

        if not self.rows:
            return
        steps = [r["step"] for r in self.rows]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(steps, [r["reward_mean"] for r in self.rows], label="reward (train batch)", alpha=0.7)
        ax.plot(steps, [r["success"] for r in self.rows], label="success (train, sampled)", alpha=0.7)
        if self.evals:
            ax.plot(
                [e["step"] for e in self.evals],
                [e["success"] for e in self.evals],
                "o-",
                label="success (held-out seeds, greedy)",
            )
            if all("success_sampled" in e for e in self.evals):
                ax.plot(
                    [e["step"] for e in self.evals],
                    [e["success_sampled"] for e in self.evals],
                    "s--",
                    label="success (held-out seeds, sampled)",
                )
            unseen = [e for e in self.evals if e.get("success_unseen") is not None]
            if unseen:
                ax.plot(
                    [e["step"] for e in unseen],
                    [e["success_unseen"] for e in unseen],
                    "^:",
                    label="success (tasks never trained on, greedy)",
                )
        ax.set_xlabel("step")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        ax.set_title("reward curve")
        fig.tight_layout()
        _save(fig, self.path / "reward.png")

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        bottom = [0.0] * len(steps)
        for key, label in (
            ("wait_s", "waiting for a batch"),
            ("train_s", "training"),
            ("publish_s", "weights"),
        ):
            vals = [r["time"][key] for r in self.rows]
            a1.bar(steps, vals, bottom=bottom, label=label, width=1.0)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        a1.set_xlabel("step")
        a1.set_ylabel("seconds")
        a1.set_title("trainer wall time per step")
        a1.legend()
        bottom = [0.0] * len(steps)
        for key, label in (("gen_s", "generation"), ("env_s", "environment"), ("reward_s", "reward")):
            vals = [r["time"][key] for r in self.rows]
            a2.bar(steps, vals, bottom=bottom, label=label, width=1.0)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        a2.set_xlabel("step")
        a2.set_title("per trajectory (mean), overlapping the trainer")
        a2.legend()
        fig.tight_layout()
        _save(fig, self.path / "time.png")


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    try:
        with writing(path):
            fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)  # a figure left open on an error stayed in pyplot's memory


class JobProgress:
    """A rich progress bar with the latest figures (or plain lines when not a terminal)."""

    def __init__(self, total_steps: int, *, enabled: bool = True, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.enabled = enabled
        self.live = enabled and self.console.is_terminal
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            MofNCompleteColumn(),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[figures]}"),
            console=self.console,
            transient=False,
        )
        self._task = self._progress.add_task("step", total=total_steps, figures="starting")
        self._pretrain: TaskID | None = None
        self._last_line = 0.0

    def __enter__(self) -> JobProgress:
        if self.live:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self._progress.stop()

    def step(self, row: dict[str, Any], eval_success: float | None) -> None:
        figures = (
            f"reward {row['reward_mean']:.3f}  success {row['success']:.2f}"
            + (f"  eval {eval_success:.2f}" if eval_success is not None else "")
            + f"  tok/s {row['tokens_per_s']:.0f}  stale {row['staleness_mean']:.2f}"
            + f"  wait {row['time']['wait_s']:.1f}s train {row['time']['train_s']:.1f}s"
        )
        if self.live:
            self._progress.update(self._task, completed=row["step"], figures=figures)
        elif self.enabled and time.monotonic() - self._last_line > 5.0:
            self._last_line = time.monotonic()
            self.console.print(f"step {row['step']}: {figures}", highlight=False, soft_wrap=True)

    def pretrain_step(self, step: int, total: int, loss: float) -> None:
        figures = f"next-token loss {loss:.3f}"
        if self.live:
            if self._pretrain is None:
                self._pretrain = self._progress.add_task("pretrain", total=total, figures=figures)
            self._progress.update(self._pretrain, completed=step, figures=figures)
        elif self.enabled and (time.monotonic() - self._last_line > 5.0 or step == total):
            self._last_line = time.monotonic()
            self.console.print(f"pretrain {step}/{total}: {figures}", highlight=False, soft_wrap=True)

    def note(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False, soft_wrap=True)
