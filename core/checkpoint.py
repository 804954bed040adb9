"""The job's checkpoints: what ``fabric run CONFIG --resume`` continues from.

    <run_dir>/checkpoints/
      step-000040/trainer.pt   the trainer's training state (``TrainerActor.save``): weights,
                               optimizer moments, KL anchor, shuffle generator, version
      step-000040/job.json     the job's side: step, version, the launcher's random state,
                               the trajectory counts, the tasks trained on, the pretraining
      latest                   the name of the newest complete checkpoint

A checkpoint is written under ``step-000040.part`` and renamed once whole; ``latest`` is
replaced (atomically) after that. The trainer writes its file from a thread while training
goes on (``TrainerActor.snapshot``); the job commits once it is there. A crash at any point
leaves the previous checkpoint as the latest, never a half-written one. What is not saved:
trajectories in flight (a resumed run starts its rollouts afresh from the saved weights, as
the asynchronous bound allows anyway) and the reward functions' caches.

A resumed run must be the same run: every key of the config but those that only say how
long, where and on what it runs (``RESUMABLE``) must be as it was, or the resume is refused
naming the key. ``--allow-change KEY`` lets a key (or a section) change all the same (a
learning rate lowered after a spike, a KL weight added); the change is said and recorded.
Never those the checkpoint's weights depend on (``fixed_keys``): a resumed run loads them.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import shutil
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel

from core.config import JobConfig
from core.config_backends import MODEL_KEYS
from core.errors import ConfigError, writing

FORMAT = 1
ROOT = "checkpoints"
REMEDY = "point checkpoints/latest at an older step-* directory, or remove checkpoints/ to start over"
#: What ``job.json`` must hold (the job writes each of them).
JOB_KEYS = ("step", "version", "config", "rng", "counts", "trained_tasks")
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
    "engine.recover_timeout_s",
    "engine.swap_timeout_s",
    "engine.rejoin_first_s",
    "engine.rejoin_max_s",
    "engine.start_timeout_s",
    "engine.hw_affinity",
    "trainer.num_gpus",
    "trainer.call_timeout_s",
)

#: Config keys no ``--allow-change`` lets change: the checkpoint's weights are of that policy,
#: built that way, in that trainer's format (a resumed torch engine loads ``policy-init/``
#: whatever the config says, so a change there would be silently ignored).
FIXED = ("engine.backend", "engine.model", "engine.pretrain", "trainer.backend")


def fixed_keys(cfg: JobConfig) -> tuple[str, ...]:
    """``FIXED``, and for the torch engine the policy's shape in ``engine.kwargs``: a resumed
    run builds that policy from ``policy-init/``, whatever the kwargs say now."""
    if cfg.engine.backend != "torch":
        return FIXED
    return FIXED + tuple(f"engine.kwargs.{k}" for k in MODEL_KEYS)


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
                [
                    (
                        "run_dir",
                        f"{str(self.root / 'latest')!r} names {name!r}, incomplete or gone: {REMEDY}",
                    )
                ]
            )
        return path

    def prepare(self, step: int) -> Path:
        """An empty directory for the checkpoint of ``step`` (a leftover of a crash is cleared)."""
        part = self.root / f"{_name(step)}.part"
        shutil.rmtree(part, ignore_errors=True)
        with writing(part):
            part.mkdir(parents=True)
        return part

    def commit(self, part: Path, step: int, job_state: dict[str, Any]) -> Path:
        """Complete the checkpoint ``prepare`` gave (its trainer file written and synced):
        the job's state beside it, renamed into place, named by ``latest``, each step on disk
        before the next (a power cut must not leave ``latest`` naming empty files); then
        older ones pruned, and what a crash left half-written."""
        _write_synced(part / JOB_FILE, json.dumps({"format": FORMAT, **job_state}, indent=1) + "\n")
        _sync_dir(part)
        final = self.root / _name(step)
        shutil.rmtree(final, ignore_errors=True)  # a run resumed before this step wrote it once
        os.replace(part, final)
        _sync_dir(self.root)
        _write_synced(self.root / "latest.part", final.name + "\n")
        os.replace(self.root / "latest.part", self.root / "latest")
        _sync_dir(self.root)
        for old_step, old in self._done():
            # beyond this step: a line of checkpoints a resume from an earlier one replaced
            if old != final and (old_step > step or old_step <= self._keep_from(step)):
                shutil.rmtree(old, ignore_errors=True)
        # what a crash left half-written (one checkpoint is written at a time, and this one
        # is in place): cleared otherwise only when the same step is written again, which a
        # run resumed past it, or with another ``every``, never does
        for part in self.root.glob("step-*.part"):
            shutil.rmtree(part, ignore_errors=True)
        return final

    def _done(self) -> list[tuple[int, Path]]:
        out = []
        for p in self.root.glob("step-*"):
            if p.is_dir() and not p.name.endswith(".part"):
                with contextlib.suppress(ValueError):
                    out.append((int(p.name.removeprefix("step-")), p))
        return sorted(out)

    def _keep_from(self, step: int) -> int:
        """The newest step to remove: the ``keep`` newest at or below ``step`` stay."""
        steps = [s for s, _ in self._done() if s <= step]
        return steps[-self.keep - 1] if len(steps) > self.keep else -1

    @staticmethod
    def read(path: Path) -> dict[str, Any]:
        state: dict[str, Any] = json.loads((path / JOB_FILE).read_text())
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            got = state.get("format") if isinstance(state, dict) else None
            raise ConfigError(
                [("run_dir", f"{str(path)!r} is a checkpoint of format {got}, not {FORMAT}: {REMEDY}")]
            )
        missing = [k for k in JOB_KEYS if k not in state]
        if missing:
            raise ConfigError([("run_dir", f"{str(path / JOB_FILE)!r} lacks {', '.join(missing)}: {REMEDY}")])
        return state


def _write_synced(path: Path, text: str) -> None:
    with writing(path), path.open("w") as f:  # a full disk: DiskFullError, naming the file
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sync_dir(path: Path) -> None:
    """A rename is durable once its directory is synced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _name(step: int) -> str:
    return f"step-{step:06d}"


def _under(key: str, roots: Sequence[str]) -> bool:
    """Whether ``key`` is one of ``roots`` or inside one (``trainer.lr`` is under ``trainer``)."""
    return any(key == r or key.startswith(r + ".") or key.startswith(r + "[") for r in roots)


def config_changes(
    saved: dict[str, Any], now: dict[str, Any], allowed: Sequence[str] = (), fixed: Sequence[str] = FIXED
) -> list[tuple[str, str]]:
    """The keys (outside ``RESUMABLE`` and ``allowed``) whose values differ between two
    config dumps, as config problems."""
    a, b = _flat(saved), _flat(now)
    out: list[tuple[str, str]] = []
    # a key only one side has is a field another release added or removed (every dump has
    # every field), not a change of the user's, unless it is a key of a mapping the user
    # fills (kwargs, args, the rewards' tags), whose dump has only what the user wrote;
    # list entries added or removed differ in their siblings' indices or in the list's own
    # length, which are compared
    said: list[str] = []  # one-sided keys reported: what lies under them is said with them
    for key in sorted(a.keys() | b.keys()):
        if _under(key, RESUMABLE) or (_under(key, allowed) and not _under(key, fixed)):
            continue
        if key in a and key in b:
            if a[key] == b[key]:
                continue
            was, now_ = a[key], b[key]
            if isinstance(was, _Entries) and isinstance(now_, _Entries):
                out.append((key, f"had {was.n} entries when the checkpoint was written, now {now_.n}"))
            else:
                out.append((key, f"was {was!r} when the checkpoint was written, now {now_!r}"))
        elif not _under(key, said) and _user_key(key):
            said.append(key)
            was = f"was {a[key]!r}" if key in a else "unset"
            now_ = repr(b[key]) if key in b else "unset"
            out.append((key, f"{was} when the checkpoint was written, now {now_}"))
    return out


def _user_key(key: str) -> bool:
    """Whether ``key`` (as ``_flat`` names it) is a key of a mapping the user fills (an
    env's ``kwargs``, a reward's ``args``, a tag of ``rewards``), rather than a field of the
    config's models."""
    segments: list[str | int] = []
    for part in key.split("."):
        name, *indices = part.split("[")
        segments += [name, *(int(i.rstrip("]")) for i in indices)]
    return _in_mapping(JobConfig, segments)


def _in_mapping(typ: Any, path: list[str | int]) -> bool:
    """Whether the last of ``path`` (below a value of type ``typ``) is a key of a mapping."""
    while get_origin(typ) is Annotated:
        typ = get_args(typ)[0]
    origin = get_origin(typ)
    if origin in (Union, types.UnionType):
        return any(_in_mapping(t, path) for t in get_args(typ) if t is not type(None))
    if not path:
        return False
    head, rest = path[0], path[1:]
    if isinstance(typ, type) and issubclass(typ, BaseModel):
        field = typ.model_fields.get(str(head))
        # a field of the model (another release's, when only one side has it)
        return field is not None and bool(rest) and _in_mapping(field.annotation, rest)
    if origin in (list, tuple):
        # entries added or removed: the list's length says so
        return bool(rest) and isinstance(head, int) and _in_mapping(get_args(typ)[0], rest)
    if origin in (dict, Mapping):
        return not rest or _in_mapping(get_args(typ)[1], rest)
    # Any, or a value the models do not describe: the user's, to its leaves
    return bool(rest) or typ is Any


class _Entries:
    """A list's length, flattened beside its entries (an entry added is a change too)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Entries) and other.n == self.n

    def __repr__(self) -> str:
        return f"a list of {self.n}"

    __hash__ = None  # type: ignore[assignment]


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out |= _flat(v, f"{prefix}.{k}" if prefix else str(k))
        return out or {prefix: {}}
    if isinstance(d, list):
        out = {prefix: _Entries(len(d))}
        for i, v in enumerate(d):
            out |= _flat(v, f"{prefix}[{i}]")
        return out
    return {prefix: d}


def allow_problems(
    allowed: Sequence[str],
    now: dict[str, Any],
    *,
    resume: bool,
    fixed: Sequence[str] = FIXED,
    earlier: dict[str, Any] | None = None,
) -> list[tuple[str, str]]:
    """What is wrong with the keys of ``--allow-change`` (checked before anything starts);
    a key of the checkpoint's config (``earlier``) is one too (an env's kwarg removed)."""
    if not allowed:
        return []
    if not resume:
        return [("--allow-change", "is for --resume: only a resumed run is compared with a checkpoint")]
    keys = list(_flat(now) | _flat(earlier or {}))
    # a section is a key too: `trainer` allows every trainer.* key
    known = set(keys) | {k.split(".")[0].split("[")[0] for k in keys}
    out = []
    for key in allowed:
        if _under(key, fixed):
            out.append(
                (
                    "--allow-change",
                    f"{key!r} cannot change on resume: the checkpoint's weights depend on it "
                    "(a new run_dir starts another run)",
                )
            )
        elif not any(_under(k, [key]) for k in keys):
            near = difflib.get_close_matches(key, sorted(known), n=3)
            hint = (
                f"; did you mean {', '.join(near)}?"
                if near
                else " (keys as in the config: trainer.lr, envs[0].weight)"
            )
            out.append(("--allow-change", f"{key!r} is no key of the config{hint}"))
    return out


def _way_out(key: str, fixed: Sequence[str]) -> str:
    return "" if _under(key, fixed) else f"--allow-change {key} lets it change; "


def start_problems(
    cfg: JobConfig, checkpoints: Checkpoints, *, resume: bool, allow: Sequence[str] = ()
) -> tuple[list[tuple[str, str]], tuple[Path, dict[str, Any]] | None, list[tuple[str, str]]]:
    """Whether a job may start in ``cfg.run_dir``: a resume needs a checkpoint of the same
    run (but for the keys ``allow`` names) at or below ``steps`` (at it, the training is over:
    the resume runs the final evaluation and writes the summary); a fresh start must not bury
    an earlier run's checkpoint. The problems, the checkpoint a resume goes on from (its
    path and ``job.json``), and the changes ``allow`` let through (key, what changed)."""
    now = yaml.safe_load(cfg.to_yaml())
    fixed = fixed_keys(cfg)
    try:
        latest = checkpoints.latest()
        saved = Checkpoints.read(latest) if latest is not None else None
        earlier = yaml.safe_load(saved["config"]) if saved is not None else None
    except ConfigError as e:
        return allow_problems(allow, now, resume=resume, fixed=fixed) or list(e.problems), None, []
    except (OSError, ValueError, yaml.YAMLError) as e:  # an unreadable or corrupt job.json
        return (
            allow_problems(allow, now, resume=resume, fixed=fixed)
            or [("run_dir", f"cannot read the checkpoint in {str(checkpoints.root)!r}: {e}; {REMEDY}")],
            None,
            [],
        )
    earlier = earlier if isinstance(earlier, dict) else {}
    bad_allow = allow_problems(allow, now, resume=resume, fixed=fixed, earlier=earlier)
    if bad_allow:
        return bad_allow, None, []
    if latest is None or saved is None:
        if not resume:
            return [], None, []
        nothing = (
            f"nothing to resume: {str(cfg.run_dir)!r} has no checkpoint "
            "(a run with checkpoint.every > 0 writes them); run without --resume"
        )
        return [("run_dir", nothing)], None, []
    step = int(saved["step"])
    if not resume:
        buried = (
            f"{str(cfg.run_dir)!r} holds the checkpoint of an earlier run at step {step}: "
            f"--resume continues it; to start over, remove {str(checkpoints.root)!r} "
            "or choose another run_dir"
        )
        return [("run_dir", buried)], None, []
    problems = [
        (
            key,
            f"{msg}; a resumed run must be the same run ({_way_out(key, fixed)}a new run_dir starts another)",
        )
        for key, msg in config_changes(earlier, now, allow, fixed)
    ]
    allowed = [c for c in config_changes(earlier, now) if _under(c[0], allow) and not _under(c[0], fixed)]
    # at the checkpoint's step: the training is over, and the resume runs what the earlier run
    # did not finish after it (its final evaluation, its summary); refused, the summary of a
    # run stopped in its final evaluation could only be had by training more
    if cfg.steps < step:
        problems.append(
            ("steps", f"is {cfg.steps}, the checkpoint is at step {step}: raise it to go on (--steps N)")
        )
    init = Path(cfg.run_dir) / "policy-init"
    if cfg.engine.backend == "torch" and not init.is_dir():
        problems.append(
            ("run_dir", f"the checkpoint needs {str(init)!r} (the initial policy), which is gone")
        )
    return problems, (latest, saved), allowed
