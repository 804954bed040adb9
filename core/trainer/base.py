"""The trainer contract: samples in, metrics and versioned weights out.

    trainer = trainer_registry.create("torch", model=model, config=TorchTrainerConfig(lr=1e-3))
    metrics = trainer.step(batch)          # one policy update per call -> version + 1
    update = trainer.publish()             # WeightUpdate(version, state)
    await engine.load_weights(update.state, update.version)

A ``TrainSample`` is one generated turn (or a whole multi-turn completion with the environment's
tokens masked out) as the sample buffer hands it over. It carries either its
``advantage`` or the ``reward`` of its trajectory; ``step`` computes group-normalised
advantages for the latter, over *trajectories* (a trajectory cut into several turn samples
counts once in its group's mean and std).

``step`` is synchronous: it is the trainer's whole job, and it runs in its own process (a
Ray actor) or a worker thread. The base class validates the batch, computes advantages,
times the step and bumps the version. Its ``_step`` is the update sequence both backends
share (``minibatch_updates`` over the backend's ``_update``, the learning rate reported):
a backend implements ``_update`` and ``state`` and sets ``config``, ``optimizer`` and
``_shuffle``; one with another kind of step overrides ``_step`` instead, and, without an
``optimizer``, ``lr`` and ``set_lr`` if it is to train on a schedule (``trainer.lr_end``),
and, without a ``config``, cannot take ``trainer.minibatch_size`` (the trainer actor sets
``config.mini_batch_size``; it refuses the setting for such a backend at start).
"""

from __future__ import annotations

import importlib
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.entropy_control import EntropyControl, entropy_ceiling
from core.errors import CoreError
from core.rollout.engines.base import Completion
from core.trainer.grpo import group_advantages
from fabric.protocol import Message, Trajectory

log = logging.getLogger(__name__)

#: Fields ``assistant_message`` adds to a turn so the trainer can rebuild it token-exactly.
TURN_FIELDS = ("prompt_ids", "token_ids", "logprobs")


class TrainerError(CoreError):
    """Base class of the trainers' errors."""


class NonFiniteGradient(TrainerError):
    """An update's gradient norm was NaN or infinite: that update was not applied."""


class UnknownTrainerError(TrainerError, KeyError):
    def __init__(self, name: str, known: list[str]):
        super().__init__(f"unknown trainer {name!r}; known trainers: {', '.join(known) or '(none)'}")

    def __str__(self) -> str:
        return str(self.args[0])


class TrainSample(BaseModel):
    """One training sequence: ``prompt_ids + completion_ids``, loss on the completion."""

    model_config = ConfigDict(extra="forbid")

    prompt_ids: list[int] = Field(min_length=1)
    completion_ids: list[int] = Field(min_length=1)
    old_logprobs: list[float]
    """Per completion token, under the weights that sampled it (``Completion.logprobs``;
    any value where ``mask`` is 0)."""
    mask: list[int] | None = None
    """Per completion token, 1 = train on it. ``None`` = all 1. Environment or tool tokens
    inside a multi-turn completion are 0; a sample that must not train is all 0."""
    advantage: float | None = None
    reward: float | None = None
    """The trajectory's reward; used when ``advantage`` is None."""
    group_id: str
    """Trajectories of one group share the prompt (same task, same seed)."""
    trajectory_id: str | None = None
    """Turn samples of one trajectory share it; ``None``: the sample is its own trajectory."""
    policy_version: int = Field(ge=0)
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    """The sampler's restriction (``GenerateRequest.allowed_token_ids``): the policy's
    distribution at every completion token is renormalised over these ids, as it was when
    the tokens were sampled."""

    @model_validator(mode="after")
    def _consistent(self) -> TrainSample:
        n = len(self.completion_ids)
        if len(self.old_logprobs) != n:
            raise ValueError(f"{n} completion ids but {len(self.old_logprobs)} old logprobs")
        if self.mask is not None and len(self.mask) != n:
            raise ValueError(f"{n} completion ids but a mask of {len(self.mask)}")
        if self.mask is not None and set(self.mask) - {0, 1}:
            raise ValueError("mask values are 0 or 1")
        if self.advantage is None and self.reward is None:
            raise ValueError("a sample needs an advantage or a reward")
        return self

    @property
    def token_mask(self) -> list[int]:
        return self.mask if self.mask is not None else [1] * len(self.completion_ids)


@dataclass(frozen=True)
class WeightUpdate:
    """What the trainer publishes: a full ``state_dict`` (CPU tensors) and its version."""

    version: int
    state: Mapping[str, torch.Tensor]


def batch_advantages(batch: Sequence[TrainSample], *, eps: float = 1e-6, scale: bool = True) -> list[float]:
    """Each sample's advantage: its own if set, else its trajectory's group-normalised
    reward. Trajectories, not samples, are the members of a group."""
    traj_reward: dict[str, float] = {}
    traj_group: dict[str, str] = {}
    keys: list[str] = []
    for i, s in enumerate(batch):
        key = s.trajectory_id if s.trajectory_id is not None else f"#sample{i}"
        keys.append(key)
        if s.advantage is not None:
            continue
        assert s.reward is not None  # the model's validator requires one of the two
        old = traj_reward.setdefault(key, s.reward)
        if old != s.reward or traj_group.setdefault(key, s.group_id) != s.group_id:
            raise TrainerError(f"trajectory {key!r} has samples with different rewards or groups")
    names = list(traj_reward)
    adv = group_advantages(
        [traj_reward[k] for k in names], [traj_group[k] for k in names], eps=eps, scale=scale
    )
    by_traj = dict(zip(names, adv.tolist(), strict=True))
    return [s.advantage if s.advantage is not None else by_traj[k] for s, k in zip(batch, keys, strict=True)]


def without_nonfinite_logprobs(batch: Sequence[TrainSample]) -> tuple[list[TrainSample], list[int]]:
    """``batch`` with every sample whose engine logprob is NaN or infinite at a trained
    token masked whole (its old logprobs zeroed), and the indices of those samples.

    A NaN behaviour logprob makes the token's ratio NaN, which the log-ratio clamp passes no
    gradient through: the update went on and reported a NaN loss, ratio and KL, with nothing
    said. Such a value is a fault of the engine for that sequence (an overflow in its
    forward), so the turn's other logprobs are not trusted either: the turn does not train,
    its trajectory's reward still counts in its group's advantages."""
    out: list[TrainSample] = []
    bad: list[int] = []
    for i, s in enumerate(batch):
        mask = s.token_mask
        if all(math.isfinite(lp) for lp, m in zip(s.old_logprobs, mask, strict=True) if m):
            out.append(s)
            continue
        bad.append(i)
        n = len(s.completion_ids)
        out.append(s.model_copy(update={"mask": [0] * n, "old_logprobs": [0.0] * n}))
    return out, bad


def minibatch_updates(
    update: Callable[[list[TrainSample], list[float]], dict[str, float] | None],
    batch: Sequence[TrainSample],
    advantages: list[float],
    *,
    size: int | None,
    epochs: int,
    shuffle: torch.Generator,
) -> dict[str, float]:
    """A step's updates (both backends' ``_step``): ``epochs`` passes over ``batch`` in
    mini-batches of ``size`` (None: the whole batch), shuffled by ``shuffle``; the metrics
    averaged over the updates made, with ``tokens`` and ``updates``. An update whose
    gradient is not finite is not applied (``NonFiniteGradient``); one after others of the
    step says that those were (the weights moved, the version did not)."""
    size = size or len(batch)
    tokens = sum(sum(s.token_mask) for s in batch)
    if tokens == 0:  # every sample masked (infra failures): nothing to learn from
        return {"tokens": 0.0, "updates": 0.0, "skipped": 1.0}
    sums: dict[str, float] = {}
    updates = 0
    for _ in range(epochs):
        order = torch.randperm(len(batch), generator=shuffle).tolist()
        for start in range(0, len(order), size):
            idx = order[start : start + size]
            try:
                stats = update([batch[i] for i in idx], [advantages[i] for i in idx])
            except NonFiniteGradient as e:
                if updates == 0:
                    raise
                # "update skipped" alone read as a step that changed nothing
                raise NonFiniteGradient(
                    f"{e}; the step's {updates} earlier mini-batch update(s) were applied, so "
                    "the weights moved but the version did not: do not publish them"
                ) from e
            if stats is None:
                continue
            updates += 1
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v
    metrics = {k: v / max(updates, 1) for k, v in sums.items()}
    metrics.update(tokens=float(tokens), updates=float(updates))
    return metrics


def assistant_message(completion: Completion) -> Message:
    """The trajectory's record of a generated turn: the text for the chat, plus what
    training needs (prompt ids, token ids, logprobs, version) as extra fields."""
    return Message(
        role="assistant",
        content=completion.text,
        policy_version=completion.policy_version,
        **{
            "prompt_ids": completion.prompt_ids,
            "token_ids": completion.token_ids,
            "logprobs": completion.logprobs,
            "allowed_token_ids": completion.allowed_token_ids,
        },
    )


def turn_samples(traj: Trajectory, *, reward: float, group_id: str) -> list[TrainSample]:
    """One ``TrainSample`` per generated turn of ``traj`` (messages made by
    ``assistant_message``), all carrying the trajectory's ``reward``. Turns with no tokens
    (aborted before the first) are skipped; a turn without the token fields is an error:
    its trajectory was not recorded for training."""
    out = []
    for n, m in enumerate(traj.messages):
        if m.role != "assistant":
            continue
        extra = m.model_extra or {}
        missing = [f for f in TURN_FIELDS if f not in extra]
        if missing or m.policy_version is None:
            raise TrainerError(
                f"trajectory {traj.id} message {n}: an assistant turn lacks {missing or ['policy_version']} "
                "(record turns with assistant_message(completion))"
            )
        if not extra["token_ids"]:
            continue
        out.append(
            TrainSample(
                prompt_ids=extra["prompt_ids"],
                completion_ids=extra["token_ids"],
                old_logprobs=extra["logprobs"],
                reward=reward,
                group_id=group_id,
                trajectory_id=traj.id,
                policy_version=m.policy_version,
                allowed_token_ids=extra.get("allowed_token_ids"),
            )
        )
    return out


class StepSettings(Protocol):
    """What the shared step reads of a backend's ``config`` (both backends' pydantic configs;
    the trainer actor sets ``mini_batch_size`` through ``model_copy``)."""

    mini_batch_size: int | None
    epochs: int

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Self: ...


class Trainer(ABC):
    """One policy being trained; ``version`` counts the updates it has made."""

    name: str = ""

    # set by a backend that takes the shared step (``_step``): its settings, the optimizer
    # whose rate ``lr`` is, and the generator that orders the mini-batches (checkpointed)
    config: StepSettings
    optimizer: torch.optim.Optimizer
    _shuffle: torch.Generator

    def __init__(
        self,
        *,
        version: int = 0,
        adv_eps: float = 1e-6,
        scale_advantages: bool = True,
        entropy: EntropyControl | None = None,
        vocab_size: int | None = None,
        loss_agg: str = "token_mean",
    ) -> None:
        self._version = version
        self._adv_eps = adv_eps
        self._scale = scale_advantages
        self.entropy = entropy if entropy is not None else EntropyControl(coef=0.0)
        self._vocab_size = vocab_size
        self._loss_agg = loss_agg
        self._said_out_of_reach = False

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient of the next update (steered with a target)."""
        return self.entropy.coef

    @property
    def version(self) -> int:
        return self._version

    @property
    def lr(self) -> float:
        return float(self._rated_optimizer().param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        """Change the learning rate from the next update on (a schedule lives with the caller,
        which knows whether it counts steps or wall time)."""
        if not 0 < lr < math.inf:  # inf passed "lr > 0", and the next update made the weights NaN
            raise ValueError(f"learning rate must be positive and finite, got {lr}")
        for group in self._rated_optimizer().param_groups:
            group["lr"] = lr

    def _rated_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose rate ``lr`` and ``set_lr`` are. A backend with its own step may
        have none (``optimizer`` is only annotated here): its AttributeError named neither the
        backend nor what it lacks."""
        optimizer: torch.optim.Optimizer | None = getattr(self, "optimizer", None)
        if optimizer is None:
            raise TrainerError(
                f"the {self.name!r} trainer has no optimizer, so no learning rate to read or set "
                "(a learning-rate schedule, trainer.lr_end, sets it each step): set `optimizer` "
                "in its __init__, or implement `lr` and `set_lr`"
            )
        return optimizer

    def step(self, batch: Sequence[TrainSample]) -> dict[str, float]:
        """One policy update on ``batch``; returns its metrics (``version`` included)."""
        if not batch:
            raise TrainerError("step() needs a non-empty batch")
        t0 = time.perf_counter()
        advantages = batch_advantages(batch, eps=self._adv_eps, scale=self._scale)
        batch, bad = without_nonfinite_logprobs(batch)
        if bad:
            first = batch[bad[0]]
            log.warning(
                "%d of %d samples have a non-finite engine logprob at a trained token (the first: "
                "trajectory %r, policy version %d); they are masked out of this update: check the "
                "inference engine's logprobs",
                len(bad),
                len(batch),
                first.trajectory_id,
                first.policy_version,
            )
        coef = self.entropy.coef
        metrics = self._step(batch, advantages)
        metrics["nonfinite_logprob_samples"] = float(len(bad))
        if self.entropy.target is not None:
            metrics.update(self._entropy_ceiling(batch))
        self._version += 1
        # the coefficient this update used; the next one's is steered by what it measured
        self.entropy.update(metrics.get("entropy"))
        # per trajectory, as batch_advantages counts them: not weighted by its turn samples
        rewards = list(
            {
                s.trajectory_id if s.trajectory_id is not None else i: s.reward
                for i, s in enumerate(batch)
                if s.reward is not None
            }.values()
        )
        metrics.update(
            entropy_coef=coef,
            version=float(self._version),
            samples=float(len(batch)),
            advantage_abs_mean=sum(map(abs, advantages)) / len(advantages),
            step_s=time.perf_counter() - t0,
        )
        if rewards:
            metrics["reward_mean"] = sum(rewards) / len(rewards)
        return metrics

    def _entropy_ceiling(self, batch: Sequence[TrainSample]) -> dict[str, float]:
        """``entropy_max``: the most mean entropy this batch could measure
        (``core.entropy_control.entropy_ceiling``), and a warning, once, when the target is not
        below it. Checked here, not only against the widest choice (the config, the
        vocabulary): with mixed action counts the ceiling is the mean of ``ln(n)`` over the
        trained tokens, which the mix's turn counts decide."""
        if self._vocab_size is None:
            return {}
        turns = [
            (sum(s.token_mask), len(set(s.allowed_token_ids)) if s.allowed_token_ids else self._vocab_size)
            for s in batch
        ]
        top = entropy_ceiling(turns, self._loss_agg)
        if top is None:
            return {}
        target = self.entropy.target
        if target is not None and target >= top and not self._said_out_of_reach:
            self._said_out_of_reach = True
            log.warning(
                "entropy_target %g nats is not below %.3g, the most mean entropy this batch's "
                "trained tokens can have (the mean of ln(choices) over them; fewer choices in some "
                "turns lower it below ln of the widest): the coefficient will only rise to "
                "entropy_coef_max; choose a lower target (said once; entropy_max in the step metrics)",
                target,
                top,
            )
        return {"entropy_max": top}

    def publish(self) -> WeightUpdate:
        return WeightUpdate(version=self._version, state=self.state())

    @abstractmethod
    def state(self) -> dict[str, torch.Tensor]:
        """The policy's weights, detached copies on the CPU (safe to ship and to keep)."""

    def _step(self, batch: Sequence[TrainSample], advantages: list[float]) -> dict[str, float]:
        """The step's updates (``minibatch_updates``: ``config.epochs`` passes in mini-batches
        of ``config.mini_batch_size``, each one ``_update``) and their metrics, with ``lr``
        when an update ran. Both backends' step; ``advantages`` are per sample of ``batch``."""
        # all of them before the first update: one failing in its own mini-batch left the
        # updates of those before it applied, the weights moved and the version not. A batch
        # with no trained token makes no update and is skipped unchecked, as it always was
        if any(any(s.token_mask) for s in batch):
            self._check_samples(batch)
        metrics = minibatch_updates(
            self._update,
            batch,
            advantages,
            size=self.config.mini_batch_size,
            epochs=self.config.epochs,
            shuffle=self._shuffle,
        )
        if "skipped" not in metrics:
            metrics["lr"] = self.lr
        return metrics

    def _check_samples(self, batch: Sequence[TrainSample]) -> None:
        """Raise a ``TrainerError`` for a sample the model cannot take (too long, an id outside
        its vocabulary); the shared step asks before any update."""
        return  # a backend whose model takes any sample

    def _update(self, samples: list[TrainSample], advantages: list[float]) -> dict[str, float] | None:
        """One optimizer update over a mini-batch (``advantages`` per sample): its metrics, or
        None when no token of it trains. A gradient that is not finite is not applied: raise
        ``NonFiniteGradient``."""
        raise NotImplementedError(f"the {self.name!r} trainer implements neither _step nor _update")

    # -- checkpoints (a job resumed after a crash or a preemption) ---------------------------
    def training_state(self) -> dict[str, Any]:
        """What a resumed run needs to go on as this one would have: the weights, the
        optimizer's moments, the KL anchor, the shuffle generator, the version and the
        steered entropy coefficient. ``torch.save``-able; backend-specific inside (resume
        with the same backend). The optimizer's tensors are its live state, which the next
        step updates in place: save it, or copy it (``TrainerActor.snapshot``), before then."""
        return {
            "trainer": self.name,
            "version": self._version,
            **self.entropy.state(),
            **self._training_state(),
        }

    def load_training_state(self, state: Mapping[str, Any]) -> None:
        if state.get("trainer") != self.name:
            raise TrainerError(
                f"the checkpoint is of the {state.get('trainer')!r} trainer, not {self.name!r}: "
                "resume with the trainer.backend it was written with"
            )
        self._load_training_state(state)
        self._version = int(state["version"])
        self.entropy.load(state)

    def _training_state(self) -> dict[str, Any]:
        raise TrainerError(f"the {self.name!r} trainer cannot write checkpoints")

    def _load_training_state(self, state: Mapping[str, Any]) -> None:
        raise TrainerError(f"the {self.name!r} trainer cannot read checkpoints")


def module_training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    reference: torch.nn.Module | None,
    shuffle: torch.Generator,
) -> dict[str, Any]:
    """``Trainer.training_state`` for a backend holding one ``torch.nn.Module`` and one
    optimizer (both trainers here). The reference is kept apart: it is the frozen *initial*
    policy, which a resumed run cannot rebuild from the trained weights."""
    return {
        # megatron's modules also hold non-tensor ``_extra_state`` entries: kept as they are
        "model": {
            k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
            for k, v in model.state_dict().items()
        },
        "optimizer": optimizer.state_dict(),
        "reference": reference.state_dict() if reference is not None else None,
        "shuffle": shuffle.get_state(),
    }


def load_module_training_state(
    state: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    reference: torch.nn.Module | None,
    shuffle: torch.Generator,
    *,
    config: Any,
) -> None:
    """Back to ``module_training_state``. The optimizer's ``lr``, ``betas`` and
    ``weight_decay`` stay ``config``'s (the trainer's own): its saved groups carry the values
    it was written with, and a resume that changed one (``--allow-change trainer.lr``) must
    train with the new."""
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        # a checkpoint written with kl_coef 0 has no reference: this trainer's was built from
        # the same initial policy (the frozen anchor is never trained), so it stands as it is
        if reference is not None and state.get("reference") is not None:
            reference.load_state_dict(state["reference"])
    except (KeyError, RuntimeError, ValueError) as e:  # shapes, names, optimizer groups
        raise TrainerError(f"the checkpoint does not fit this trainer's model: {e}") from None
    for group in optimizer.param_groups:
        group.update(lr=config.lr, betas=tuple(config.betas), weight_decay=config.weight_decay)
    shuffle.set_state(state["shuffle"])


class TrainerRegistry:
    """Trainer name -> ``module:Class``, imported on first use (megatron is heavy)."""

    def __init__(self) -> None:
        self._entries: dict[str, str] = {}

    def register(self, name: str, entry_point: str) -> None:
        old = self._entries.get(name)
        if old is not None and old != entry_point:
            raise TrainerError(f"trainer {name!r} is already registered to {old}")
        self._entries[name] = entry_point

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str) -> type[Trainer]:
        try:
            entry = self._entries[name]
        except KeyError:
            raise UnknownTrainerError(name, self.names()) from None
        module, _, attr = entry.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise TrainerError(f"cannot load trainer {name!r} from {entry}: {e}") from e
        if not (isinstance(cls, type) and issubclass(cls, Trainer)):
            raise TrainerError(f"{entry} is not a Trainer subclass")
        return cls

    def create(self, name: str, **kwargs: Any) -> Trainer:
        return self.get(name)(**kwargs)


#: The default registry (tests build their own).
trainer_registry = TrainerRegistry()
trainer_registry.register("torch", "core.trainer.torch_:TorchTrainer")
trainer_registry.register("megatron", "core.trainer.megatron_:MegatronTrainer")
