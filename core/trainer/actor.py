"""The trainer as a Ray actor: steps on finished samples, publishes versioned weights.

    trainer = ray.remote(TrainerActor).remote(cfg, bundle, ...)
    metrics_ref, state_ref = trainer.step.options(num_returns=2).remote(batch)
    await proxy.update_weights.remote(version, [state_ref])   # the weights never visit the driver

The job's ``TrainerConfig`` maps onto the backend's own config here; ``trainer.kwargs``
pass further backend options through (``weight_decay``, ``loss_agg``, ``num_threads``).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from core.config_backends import backend_config
from core.config_trainer import TrainerConfig  # not core.config, which imports every section
from core.errors import ConfigError, writing
from core.policy.bundle import PolicyBundle
from core.trainer.base import Trainer, TrainerError, TrainSample

log = logging.getLogger(__name__)


class TrainerActor:
    def __init__(
        self,
        cfg: TrainerConfig,
        bundle: PolicyBundle | str | None,
        *,
        total_steps: int,
        temperature: float,
        seed: int,
    ):
        self.cfg = cfg
        self.total_steps = total_steps
        if isinstance(bundle, str):
            bundle = PolicyBundle.load(bundle)
        self.trainer = make_trainer(cfg, bundle, temperature=temperature, seed=seed)
        self.steps = 0
        if cfg.minibatch_size is not None and not hasattr(self.trainer, "config"):
            # step() splits a batch through the backend's config.mini_batch_size; one with its
            # own step and no config had the setting ignored without a word, every batch one
            # update (refused here, before the engines start, as a rate it cannot take is)
            raise TrainerError(
                f"trainer.minibatch_size={cfg.minibatch_size}: the {self.trainer.name!r} trainer has "
                "no `config` to take it: set `config` in its __init__ (a pydantic model with "
                "`mini_batch_size`, turns per update, which the actor sets each step) and split its "
                "step by it, or leave trainer.minibatch_size unset (the whole batch, one update)"
            )
        if cfg.lr_end is not None:
            # the first step's rate, set now: a backend that cannot take one (no optimizer, no
            # set_lr of its own) fails here, not at its first step, after the engines started
            self.trainer.set_lr(self._lr_at(0, total_steps))
        self._schedule_note: str | None = None
        self._writes: dict[str, Future[None]] = {}  # snapshots being written, by path

    def step(self, batch: Sequence[TrainSample]) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """One update; returns its metrics and the new weights (``num_returns=2``: the
        caller forwards the weights' object ref without fetching them)."""
        if self.cfg.lr_end is not None:
            self.trainer.set_lr(self._lr_at(self.steps, self.total_steps))
        # a sample without a trajectory id is its own trajectory (as batch_advantages counts
        # it): a set of the ids made all of them one, and the whole batch a single update
        ids = [s.trajectory_id for s in batch]
        n_traj = len(set(ids) - {None}) + ids.count(None)
        if self.cfg.minibatch_size is not None:  # (a backend without a config was refused at start)
            # minibatch_size counts trajectories; the backend splits turns: same proportion
            per_update = math.ceil(len(batch) * min(1.0, self.cfg.minibatch_size / max(n_traj, 1)))
            self.trainer.config = self.trainer.config.model_copy(update={"mini_batch_size": per_update})
        metrics = self.trainer.step(batch)
        self.steps += 1
        return metrics, self.trainer.state()

    def _lr_at(self, step: int, total: int) -> float:
        """The learning rate of the step after ``step`` of them, on a ``total``-step schedule:
        linear from ``lr`` at its first step to ``lr_end`` at its last, ``lr_end`` after it (a
        one-step schedule: ``lr``, its first step's)."""
        assert self.cfg.lr_end is not None
        frac = min(1.0, step / max(total - 1, 1))
        return self.cfg.lr + frac * (self.cfg.lr_end - self.cfg.lr)

    def schedule_note(self) -> str | None:
        """What the last ``load`` did to the learning-rate schedule when the resumed run's
        ``steps`` differ from the saved run's (for the job's progress output), or None."""
        return self._schedule_note

    def version(self) -> int:
        return self.trainer.version

    def weights(self) -> dict[str, torch.Tensor]:
        """The current weights, for the engines (a resumed job publishes them first)."""
        return self.trainer.state()

    def save(self, path: str) -> None:
        """The training state and the schedule's position, to ``path``, on disk when this
        returns (written whole or not at all: a crash mid-write leaves the previous
        checkpoint as the latest)."""
        self.snapshot(path)
        self.written(path)

    def snapshot(self, path: str) -> float:
        """Copy the training state now (between steps, so it is one step's) and write it to
        ``path`` in a thread: the next ``step`` need not wait for the disk. ``written(path)``
        (in the ``io`` concurrency group, beside a running step) says when it is there. The
        seconds the copy took: what the step loop waits for a checkpoint."""
        t = time.perf_counter()
        if path in self._writes:
            raise TrainerError(f"{path!r} is being written already")
        data = {
            # the optimizer's state_dict holds its live moments, which the next step updates
            # in place: copied here, like the weights (to the CPU: the file is read there)
            "state": _copied(self.trainer.training_state()),
            "steps": self.steps,
            "total_steps": self.total_steps,
        }
        done: Future[None] = Future()
        self._writes[path] = done

        def write() -> None:
            try:
                _write_file(data, path)
            except BaseException as e:  # the waiter re-raises it
                done.set_exception(e)
            else:
                done.set_result(None)

        threading.Thread(target=write, name="checkpoint-writer", daemon=True).start()
        return time.perf_counter() - t

    def written(self, path: str) -> None:
        """Wait until ``snapshot(path)``'s file is whole and synced; its error, if it failed."""
        done = self._writes.get(path)
        if done is None:
            raise TrainerError(f"no snapshot of {path!r} is being written")
        try:
            done.result()
        finally:
            self._writes.pop(path, None)

    def load(self, path: str) -> int:
        """Back to what ``save`` wrote; the version it was at. A run extended past the
        saved schedule's length (``--resume --steps``) keeps it and goes on at ``lr_end``,
        not back up a schedule stretched over the new length. A run shortened follows the
        new length (the rate steps down to it at once): keeping the saved one, it ended
        short of ``lr_end`` (a decay to ``lr_end`` is what the config asks of its last step).
        ``schedule_note`` says which, when the lengths differ."""
        try:
            data = torch.load(path, map_location="cpu", weights_only=False)
            state, steps = data["state"], int(data["steps"])
        except Exception as e:  # truncated, not ours: say which file
            raise TrainerError(f"cannot read the checkpoint {path!r}: {type(e).__name__}: {e}") from None
        self.trainer.load_training_state(state)
        self.steps = steps
        saved = int(data.get("total_steps", self.total_steps))
        wanted, self.total_steps = self.total_steps, min(saved, self.total_steps)
        self._schedule_note = None
        if self.cfg.lr_end is not None and saved != wanted:
            end = self.cfg.lr_end
            if wanted < saved:
                self._schedule_note = (
                    f"the learning-rate schedule follows the new steps: {wanted} (was {saved}): "
                    f"it reaches lr_end {end:g} at step {wanted}; lr {self._lr_at(steps, wanted):.2g} "
                    f"at step {steps + 1} ({self._lr_at(steps, saved):.2g} on the saved schedule)"
                )
            else:
                self._schedule_note = (
                    f"the learning-rate schedule keeps its {saved} steps: steps {saved + 1} to "
                    f"{wanted} train at lr_end {end:g}"
                )
            log.info("%s", self._schedule_note)
        return self.trainer.version


def _write_file(data: dict[str, Any], path: str) -> None:
    """``data`` to ``path`` whole and synced, or not at all (a ``.part`` beside it)."""
    tmp = f"{path}.part"
    # a full disk: DiskFullError naming the file (the job says it in one line)
    with writing(tmp), open(tmp, "wb") as f:
        torch.save(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _copied(obj: Any) -> Any:
    """``obj`` with every tensor copied to the CPU (dicts, lists and tuples walked)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _copied(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copied(v) for v in obj)
    return obj


def make_trainer(
    cfg: TrainerConfig, bundle: PolicyBundle | None, *, temperature: float, seed: int
) -> Trainer:
    options = backend_config(cfg, temperature=temperature, seed=seed)
    if cfg.backend == "torch":
        from core.trainer.torch_ import TorchTrainer, TorchTrainerConfig

        threads = options.pop("num_threads", None)
        if threads is not None:
            torch.set_num_threads(int(threads))
        if bundle is None:
            raise ConfigError([("trainer.backend", "the torch trainer trains the torch engine's policy")])
        try:  # JobConfig checked it (trainer_problems); a TrainerActor built by hand may not be
            tcfg = TorchTrainerConfig(**options)
        except ValueError as e:
            raise ConfigError([("trainer.kwargs", str(e))]) from None
        return TorchTrainer(bundle.model(), tcfg)
    from core.trainer.base import trainer_registry

    return trainer_registry.create(cfg.backend, config=options)
