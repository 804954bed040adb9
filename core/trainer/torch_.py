"""``TorchTrainer``: GRPO on a ``TinyLM`` with AdamW, for the CPU default.

A ``step(batch)`` shuffles the batch (seeded) into mini-batches and makes one optimizer
update per mini-batch, ``epochs`` times over: the first mini-batch is exactly on-policy
(ratio 1), later ones are slightly off-policy, which is what the clipped ratio is for.
Sequences are right-padded ``prompt + completion``; the loss covers completion tokens
whose sample mask is 1.

With ``kl_coef > 0`` a frozen copy of the initial policy (or the ``reference`` given) is
the KL anchor, estimated with k3 on the sampled tokens.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from core.config_backends import TorchTrainerConfig as TorchTrainerConfig  # torch-free, for the job config
from core.entropy_control import EntropyControl, entropy_target_problem
from core.policy.tiny_lm import TinyLM
from core.trainer.base import (
    NonFiniteGradient,
    Trainer,
    TrainerError,
    TrainSample,
    load_module_training_state,
    module_training_state,
)
from core.trainer.grpo import aggregate, kl_k3, policy_loss
from core.trainer.lean_logprobs import logprobs_and_entropy


class TorchTrainer(Trainer):
    name = "torch"
    config: TorchTrainerConfig

    def __init__(
        self,
        model: TinyLM,
        config: TorchTrainerConfig | None = None,
        *,
        reference: TinyLM | None = None,
        version: int = 0,
    ) -> None:
        config = config or TorchTrainerConfig()
        # the vocabulary is the tokenizer's, unknown to the job config (which checks a target
        # against envs[].actions, the choices of a constrained reply)
        vocab = model.config.vocab_size
        problem = entropy_target_problem(config.entropy_target, vocab, "a token of this model")
        if problem:
            raise TrainerError(problem)
        super().__init__(
            version=version,
            adv_eps=config.adv_eps,
            scale_advantages=config.scale_advantages,
            entropy=EntropyControl.from_config(config),
            vocab_size=vocab,
            loss_agg=config.loss_agg,
        )
        self.config = config
        self.model = model.train()
        self.reference: TinyLM | None = None
        if config.kl_coef > 0:
            self.reference = copy.deepcopy(reference if reference is not None else model)
            self.reference.eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self._shuffle = torch.Generator().manual_seed(config.seed)

    def state(self) -> dict[str, Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def _training_state(self) -> dict[str, Any]:
        return module_training_state(self.model, self.optimizer, self.reference, self._shuffle)

    def _load_training_state(self, state: Mapping[str, Any]) -> None:
        load_module_training_state(
            state, self.model, self.optimizer, self.reference, self._shuffle, config=self.config
        )

    def _check_samples(self, batch: Sequence[TrainSample]) -> None:
        _check_lengths(batch, self.model.config.max_len)
        vocab = self.model.config.vocab_size
        for s in batch:
            bad = [
                t
                for t in (*s.prompt_ids, *s.completion_ids, *(s.allowed_token_ids or ()))
                if not 0 <= t < vocab
            ]
            if bad:
                raise TrainerError(f"token id {bad[0]} is outside the model's vocab_size={vocab}")

    def _update(self, samples: list[TrainSample], advantages: list[float]) -> dict[str, float] | None:
        cfg = self.config
        ids, attn, targets, mask, old = _pack(samples, self.model.config.max_len)
        if not mask.any():
            return None
        adv = torch.tensor(advantages, dtype=torch.float32)
        restrict = _restriction(samples, self.model.config.vocab_size)
        distinct = _distinct_inputs(samples)
        # only the positions from the shortest prompt's last token on score a completion
        # token: the columns before it (most of a long prompt and a short reply) are masked
        # out of every sum, and their softmax and entropy were a fifth of the step
        start = max(0, min(len(s.prompt_ids) for s in samples) - 1)
        targets, mask, old = targets[:, start:], mask[:, start:], old[:, start:]
        logits = _run_once(self.model, ids, attn, distinct, start)
        logp, ent_tok = logprobs_and_entropy(logits, targets, cfg.temperature, restrict)
        pg, stats = policy_loss(
            logp,
            old,
            adv,
            mask,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            clip_ratio_c=cfg.clip_ratio_c,
            agg=cfg.loss_agg,
        )
        # entropy at the trained positions only (with a gradient when it is rewarded)
        ent = aggregate(ent_tok if self.entropy_coef > 0 else ent_tok.detach(), mask, cfg.loss_agg)
        loss = pg - self.entropy_coef * ent
        kl = torch.zeros(())
        if self.reference is not None:
            with torch.no_grad():
                ref_logits = _run_once(self.reference, ids, attn, distinct, start)
                ref, _ = logprobs_and_entropy(ref_logits, targets, cfg.temperature, restrict)
            kl = aggregate(kl_k3(logp, ref, mask), mask, cfg.loss_agg)
            loss = loss + cfg.kl_coef * kl
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), cfg.grad_clip if cfg.grad_clip is not None else math.inf
        )
        if not torch.isfinite(norm):
            # one bad batch must not poison the weights the engines will load
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteGradient(f"non-finite gradient norm ({float(norm)}); update skipped")
        self.optimizer.step()
        return {
            "loss": loss.item(),
            "pg_loss": pg.item(),
            "kl": kl.item(),
            "clip_frac": float(stats["clip_frac"]),
            "dual_clip_frac": float(stats["dual_clip_frac"]),
            "ratio_mean": float(stats["ratio_mean"]),
            "approx_kl": float(stats["approx_kl"]),
            "entropy": ent.item(),
            "grad_norm": float(norm),
        }


def _distinct_inputs(samples: list[TrainSample]) -> tuple[Tensor, Tensor] | None:
    """The samples that feed the model tokens no earlier sample fed it (``rows``), and for
    each sample the row of those giving its logits (``inverse``); ``None`` when all differ.

    A group's members share a prompt, and with a short history window so do all turns taken
    in the same state: with one-token replies most of a batch repeated an input, and the
    forward and backward passes (most of a step) ran it again for each. The logits of equal
    inputs are equal (the model is a pure function of its input, no dropout), and the gradient
    through a shared row is the sum of its samples': the same update, each input run once.
    """
    first: dict[tuple[int, ...], int] = {}
    rows: list[int] = []
    inverse: list[int] = []
    for i, s in enumerate(samples):
        key = (*s.prompt_ids, *s.completion_ids[:-1])  # the model's input (``_pack``'s ids)
        if key not in first:
            first[key] = len(rows)
            rows.append(i)
        inverse.append(first[key])
    if len(rows) == len(samples):
        return None
    return torch.tensor(rows), torch.tensor(inverse)


def _run_once(
    model: torch.nn.Module, ids: Tensor, attn: Tensor, distinct: tuple[Tensor, Tensor] | None, start: int
) -> Tensor:
    """``model(ids, attn)[:, start:]``, each distinct input run once (``_distinct_inputs``)."""
    if distinct is None:
        return model(ids, attn)[:, start:]  # type: ignore[no-any-return]
    rows, inverse = distinct
    return model(ids[rows], attn[rows])[:, start:][inverse]  # type: ignore[no-any-return]


def _restriction(samples: list[TrainSample], vocab_size: int) -> Tensor | None:
    """Per sample, 0 for allowed ids and a large negative number for the others (finite, so
    entropy's ``p * log p`` stays 0 rather than NaN); ``None`` when nothing is restricted."""
    if all(s.allowed_token_ids is None for s in samples):
        return None
    out = torch.zeros(len(samples), vocab_size)
    for i, s in enumerate(samples):
        if s.allowed_token_ids is not None:
            out[i] = -1e9
            out[i, s.allowed_token_ids] = 0.0
    return out


def _check_lengths(samples: Sequence[TrainSample], max_len: int) -> None:
    longest = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    if longest > max_len:
        raise TrainerError(f"a sample of {longest} tokens exceeds the model's max_len={max_len}")


def _pack(samples: list[TrainSample], max_len: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Right-padded inputs plus per-position targets, loss mask and old logprobs.

    Position ``t`` predicts token ``t + 1``, so completion token ``j`` of a sample (at
    position ``len(prompt) + j``) is scored by the logits at ``len(prompt) + j - 1``.
    """
    _check_lengths(samples, max_len)
    width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples) - 1
    b = len(samples)
    ids = torch.zeros(b, width, dtype=torch.long)
    attn = torch.zeros(b, width, dtype=torch.bool)
    targets = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width)
    old = torch.zeros(b, width)
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.completion_ids
        n, p = len(seq) - 1, len(s.prompt_ids)
        ids[i, :n] = torch.tensor(seq[:-1])
        attn[i, :n] = True
        targets[i, :n] = torch.tensor(seq[1:])
        c = len(s.completion_ids)
        mask[i, p - 1 : p - 1 + c] = torch.tensor(s.token_mask, dtype=torch.float32)
        old[i, p - 1 : p - 1 + c] = torch.tensor(s.old_logprobs, dtype=torch.float32)
    return ids, attn, targets, mask, old
