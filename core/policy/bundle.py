"""The job's policy as the engines and the trainer receive it: tokenizer, model shape,
initial weights (``core.policy.build`` makes it in the driver).

    bundle = PolicyBundle.load(directory)   # what bundle.save(directory) wrote
    bundle.model()                          # a TinyLM holding the initial weights

A module of its own, importing only the model and the tokenizer: the engine replicas and
the trainer actor, new processes at every job's start, load a bundle and need nothing of
how it is built (the job config, the corpus, pretraining: 0.4 s of CPU per process).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.policy.tiny_lm import TinyLM, TinyLMConfig
from core.policy.tokenizer import WordTokenizer


@dataclass(frozen=True)
class PolicyBundle:
    tokenizer: dict[str, Any]
    """``WordTokenizer.to_dict()`` (plain data: ships through Ray without pickling code)."""
    model_config: dict[str, Any]
    state: dict[str, torch.Tensor]
    pretrained: dict[str, float] = field(default_factory=dict)
    """``PretrainReport.as_dict()`` when the weights were pretrained here (for the summary)."""
    tasks: frozenset[str] = frozenset()
    """``task_key``s of the episodes it was pretrained on: tasks the policy has seen."""

    def model(self) -> TinyLM:
        m = TinyLM(TinyLMConfig.model_validate(self.model_config))
        m.load_state_dict(self.state)
        return m

    def tok(self) -> WordTokenizer:
        return WordTokenizer.from_dict(self.tokenizer)

    def save(self, directory: str | Path) -> Path:
        """``save_pretrained`` + ``tokenizer.json``: what ``engine.model: <dir>`` loads, and
        what actors load from (a Ray actor restarted after a crash reads it again, so its
        constructor arguments are a path, not an object that may be gone)."""
        d = Path(directory)
        self.model().save_pretrained(d)
        self.tok().save(d / "tokenizer.json")
        return d

    @classmethod
    def load(cls, directory: str | Path) -> PolicyBundle:
        d = Path(directory)
        model = TinyLM.from_pretrained(d)
        return cls(
            tokenizer=WordTokenizer.load(d / "tokenizer.json").to_dict(),
            model_config=model.config.model_dump(),
            state=dict(model.state_dict()),
        )
