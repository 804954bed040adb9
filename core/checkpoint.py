"""The job's checkpoints: what ``fabric run CONFIG --resume`` continues from.

    <run_dir>/checkpoints/
      step-000040/trainer.pt   the trainer's training state (``TrainerActor.save``): weights,
                               optimizer moments, KL anchor, shuffle generator, version
      step-000040/job.json     the job's side: step, version, the launcher's random state,
                               the trajectory counts, the tasks trained on, the pretraining
      latest                   the name of the newest complete checkpoint

A checkpoint is written under ``step-000040.part`` and renamed once whole; ``latest`` is
replaced (atomically) after that. A crash at any point leaves the previous checkpoint as the
latest, never a half-written one. What is not saved: trajectories in flight (a resumed run
starts its rollouts afresh from the saved weights, as the asynchronous bound allows anyway)
and the reward functions' caches.

A resumed run must be the same run: every key of the config but those that only say how
long, where and on what it runs (``RESUMABLE``) must be as it was, or the resume is refused
naming the key.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from core.errors import ConfigError

FORMAT = 1
ROOT = "checkpoints"
TRAINER_FILE = "trainer.pt"
JOB_FILE = "job.json"

#: Config keys a resumed run may change (and everything under them).
RESUMABLE = (
    "steps",
    "run_dir",
    "checkpoint",
    "rollout",
    "fabric",
    "envpool",
    "images",
    "engine.replicas",
    "engine.num_gpus",
    "engine.max_restarts",
    "engine.hw_affinity",
    "trainer.num_gpus",
)


class Checkpoints:
    def __init__(self, run_dir: Path, keep: int = 1) -> None:
        self.root = Path(run_dir).absolute() / ROOT  # the trainer actor has its own cwd
        self.keep = keep

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        try:
            name = (self.root / "latest").read_text().strip()
        except FileNotFoundError:
            return None
        path = self.root / name
        if not (path / JOB_FILE).is_file() or not (path / TRAINER_FILE).is_file():
            raise ConfigError(
                [("run_dir", f"{str(self.root / 'latest')!r} names {name!r}, which is incomplete or gone")]
            )
        return path

    def prepare(self, step: int) -> Path:
        """An empty directory for the checkpoint of ``step`` (a leftover of a crash is cleared)."""
        part = self.root / f"{_name(step)}.part"
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        return part

    def commit(self, part: Path, step: int, job_state: dict[str, Any]) -> Path:
        """Complete the checkpoint ``prepare`` gave (its trainer file written): the job's
        state beside it, renamed into place, named by ``latest``; older ones pruned."""
        (part / JOB_FILE).write_text(json.dumps({"format": FORMAT, **job_state}, indent=1) + "\n")
        final = self.root / _name(step)
        shutil.rmtree(final, ignore_errors=True)  # a run resumed before this step wrote it once
        os.replace(part, final)
        tmp = self.root / "latest.part"
        tmp.write_text(final.name + "\n")
        os.replace(tmp, self.root / "latest")
        done = sorted(p for p in self.root.glob("step-*") if p.is_dir() and not p.name.endswith(".part"))
        for old in done[: -self.keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final

    @staticmethod
    def read(path: Path) -> dict[str, Any]:
        state: dict[str, Any] = json.loads((path / JOB_FILE).read_text())
        if state.get("format") != FORMAT:
            raise ConfigError(
                [("run_dir", f"{str(path)!r} is a checkpoint of format {state.get('format')}, not {FORMAT}")]
            )
        return state


def _name(step: int) -> str:
    return f"step-{step:06d}"


def config_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, str]]:
    """The keys (outside ``RESUMABLE``) whose values differ between two config dumps, as
    config problems."""
    a, b = _flat(saved), _flat(now)
    out = []
    for key in sorted(a.keys() | b.keys()):
        if any(key == r or key.startswith(r + ".") or key.startswith(r + "[") for r in RESUMABLE):
            continue
        if a.get(key, _MISSING) != b.get(key, _MISSING):
            was = "unset" if key not in a else repr(a[key])
            is_ = "unset" if key not in b else repr(b[key])
            out.append((key, f"was {was} when the checkpoint was written, now {is_}"))
    return out


_MISSING = object()


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out |= _flat(v, f"{prefix}.{k}" if prefix else str(k))
        return out or {prefix: {}}
    if isinstance(d, list):
        out = {}
        for i, v in enumerate(d):
            out |= _flat(v, f"{prefix}[{i}]")
        return out or {prefix: []}
    return {prefix: d}
