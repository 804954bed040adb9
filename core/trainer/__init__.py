"""Training: the ``Trainer`` ABC and ``TrainSample`` (``base``), GRPO math (``grpo``), backends
as sibling modules (``torch_``), imported only when named in ``trainer_registry``."""

from core.trainer.base import (
    TURN_FIELDS,
    Trainer,
    TrainerError,
    TrainerRegistry,
    TrainSample,
    UnknownTrainerError,
    WeightUpdate,
    assistant_message,
    batch_advantages,
    trainer_registry,
    turn_samples,
)

__all__ = [
    "TURN_FIELDS",
    "TrainSample",
    "Trainer",
    "TrainerError",
    "TrainerRegistry",
    "UnknownTrainerError",
    "WeightUpdate",
    "assistant_message",
    "batch_advantages",
    "trainer_registry",
    "turn_samples",
]
