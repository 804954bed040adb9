"""The trainer as a Ray actor: steps on finished samples, publishes versioned weights.

    trainer = ray.remote(TrainerActor).remote(cfg, bundle, ...)
    metrics_ref, state_ref = trainer.step.options(num_returns=2).remote(batch)
    await proxy.update_weights.remote(version, [state_ref])   # the weights never visit the driver

The job's ``TrainerConfig`` maps onto the backend's own config here; ``trainer.kwargs``
pass further backend options through (``weight_decay``, ``loss_agg``, ``num_threads``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

from core.config import TrainerConfig
from core.config_backends import backend_config
from core.errors import ConfigError
from core.policy.build import PolicyBundle
from core.trainer.base import Trainer, TrainerError, TrainSample


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

    def step(self, batch: Sequence[TrainSample]) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """One update; returns its metrics and the new weights (``num_returns=2``: the
        caller forwards the weights' object ref without fetching them)."""
        if self.cfg.lr_end is not None and hasattr(self.trainer, "set_lr"):
            frac = min(1.0, self.steps / max(self.total_steps - 1, 1))
            self.trainer.set_lr(self.cfg.lr + frac * (self.cfg.lr_end - self.cfg.lr))
        n_traj = len({s.trajectory_id for s in batch})
        if self.cfg.minibatch_size is not None and hasattr(self.trainer, "config"):
            # minibatch_size counts trajectories; the backend splits turns: same proportion
            per_update = math.ceil(len(batch) * min(1.0, self.cfg.minibatch_size / max(n_traj, 1)))
            self.trainer.config = self.trainer.config.model_copy(update={"mini_batch_size": per_update})
        metrics = self.trainer.step(batch)
        self.steps += 1
        return metrics, self.trainer.state()

    def version(self) -> int:
        return self.trainer.version

    def weights(self) -> dict[str, torch.Tensor]:
        """The current weights, for the engines (a resumed job publishes them first)."""
        return self.trainer.state()

    def save(self, path: str) -> None:
        """The training state and the schedule's position, to ``path``, on disk when this
        returns (written whole or not at all: a crash mid-write leaves the previous
        checkpoint as the latest)."""
        tmp = f"{path}.part"
        data = {"state": self.trainer.training_state(), "steps": self.steps, "total_steps": self.total_steps}
        with open(tmp, "wb") as f:
            torch.save(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load(self, path: str) -> int:
        """Back to what ``save`` wrote; the version it was at. The learning-rate schedule
        keeps the length it had: a run extended past it (``--resume --steps``) goes on at
        ``lr_end``, not back up a schedule stretched over the new length."""
        try:
            data = torch.load(path, map_location="cpu", weights_only=False)
            state, steps = data["state"], int(data["steps"])
        except Exception as e:  # truncated, not ours: say which file
            raise TrainerError(f"cannot read the checkpoint {path!r}: {type(e).__name__}: {e}") from None
        self.trainer.load_training_state(state)
        self.steps = steps
        self.total_steps = int(data.get("total_steps", self.total_steps))
        return self.trainer.version


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
