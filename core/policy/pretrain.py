"""Pretraining a new ``tiny-lm`` on random play before RL: the base model RL starts from.

    seqs = transition_sequences(cfg, tok, played.episodes, max_len)
    report = pretrain(model, seqs, cfg.engine.pretrain, seed=cfg.seed)

Each sequence is one transition of a random-play episode, encoded with the chat template
exactly as the policy is shown it (``EnvManager.context``: the system message, the history
window, ``drop_lines`` cut) followed by the action and the next observation:

    <bos> <|user|> obs_k <|end|> <|assistant|> a_k <|end|> <|user|> obs_k+1 <|end|>

The loss is next-token cross-entropy on every token. Predicting the start of ``obs_k+1``
("You moved right. You fell into a hole.") needs the tile the action reaches, read off
``obs_k``: the attention pattern the policy needs later to choose a move. The action
tokens are uniform random, so the pretrained policy still picks moves at random (its
untrained success rate is the random policy's); what changes is that RL's reward has
something to select from.

The held-out loss is measured on the transitions of tasks (maps) kept out of training
entirely: random seeds repeat maps, so a split by transition would score memorised ones.

Deterministic for a config: the episodes are seeded, the held-out split and the batches
come from ``seed``, and the model's initialisation is seeded by the caller.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.config import JobConfig, PretrainConfig
from core.errors import ConfigError, StoppedError
from core.policy.corpus import Episode
from core.policy.tiny_lm import TinyLM
from core.policy.tokenizer import WordTokenizer
from core.rollout.env_manager import EnvManager, task_key
from fabric.protocol import Message

#: Share of the tasks (and so of the sequences) kept out of training to report the held-out loss.
HELD_OUT = 0.05
#: Callback per optimizer step: (step, total steps, training loss).
OnStep = Callable[[int, int, float], None]


@dataclass(frozen=True)
class PretrainReport:
    steps: int
    sequences: int
    held_out_loss_before: float
    held_out_loss_after: float
    seconds: float

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "sequences": self.sequences,
            "held_out_loss_before": round(self.held_out_loss_before, 4),
            "held_out_loss_after": round(self.held_out_loss_after, 4),
            "seconds": round(self.seconds, 1),
        }


@dataclass(frozen=True)
class Transitions:
    seqs: list[list[int]]
    tasks: list[str]
    """``task_key`` of the episode each sequence comes from (the held-out split's unit)."""


def transition_sequences(
    cfg: JobConfig, tok: WordTokenizer, episodes: Sequence[Episode], max_len: int
) -> Transitions:
    """One token sequence per transition, cut to ``max_len``: the prompt and the action come
    first, so a cut loses the end of the next observation only; a prompt and action that do
    not fit are a ``ConfigError`` (the policy could not be shown that prompt either)."""
    out = Transitions([], [])
    for ep in episodes:
        env = cfg.envs[ep.env]
        task = task_key(ep.texts[0])
        messages = [Message(role="system", content=env.prompt.system)] if env.prompt.system else []
        messages.append(Message(role="user", content=ep.texts[0]))
        for action, nxt in zip(ep.actions, ep.texts[1:], strict=False):
            prompt = [*EnvManager.context(messages, env), Message(role="assistant", content=action)]
            need = len(tok.encode_chat(prompt, add_generation_prompt=False))
            if need > max_len:
                raise ConfigError(
                    [
                        (
                            "engine.kwargs.max_len",
                            f"a prompt of envs[{ep.env}] ({env.id}) and its action take {need} tokens; "
                            f"the model's context is {max_len}: raise max_len or shorten the prompt "
                            "(envs[].prompt.history, drop_lines)",
                        )
                    ]
                )
            shown = [*prompt, Message(role="user", content=EnvManager.shown(nxt, env))]
            out.seqs.append(tok.encode_chat(shown, add_generation_prompt=False)[:max_len])
            out.tasks.append(task)
            messages += [Message(role="assistant", content=action), Message(role="user", content=nxt)]
    return out


def pretrain(
    model: TinyLM,
    data: Transitions,
    cfg: PretrainConfig,
    *,
    seed: int,
    on_step: OnStep | None = None,
    stop: threading.Event | None = None,
) -> PretrainReport:
    """``cfg.steps`` AdamW steps of next-token prediction on ``data`` (batches drawn with
    replacement across steps, without within one); ``model`` is trained in place. The
    held-out loss is on the sequences of ``HELD_OUT`` of the tasks, never trained on.
    Raises ``StoppedError`` at the first step after ``stop`` is set."""
    seqs = data.seqs
    if len(seqs) < 2:
        raise ValueError(f"pretraining needs at least 2 transitions, got {len(seqs)}")
    t0 = time.perf_counter()
    rng = random.Random(seed)
    train, held = held_out_split(data, rng)
    before = _loss(model, held)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    model.train()
    size = min(cfg.batch_size, len(train))
    for step in range(cfg.steps):
        if stop is not None and stop.is_set():
            raise StoppedError(f"pretraining stopped after {step} of {cfg.steps} steps")
        ids, attn = _pad(rng.sample(train, size))
        loss = _lm_loss(model, ids, attn)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if on_step is not None:
            on_step(step + 1, cfg.steps, loss.item())
    after = _loss(model, held)
    return PretrainReport(cfg.steps, len(seqs), before, after, time.perf_counter() - t0)


def held_out_split(data: Transitions, rng: random.Random) -> tuple[list[list[int]], list[list[int]]]:
    """(train, held out): every sequence of ``HELD_OUT`` of the tasks is held out, so no
    held-out map was trained on; where every episode is one task, the unit is the sequence."""
    of = data.tasks if len(set(data.tasks)) > 1 else [str(i) for i in range(len(data.seqs))]
    units = sorted(set(of))
    rng.shuffle(units)
    held_units = set(units[: max(1, int(len(units) * HELD_OUT))])
    held = [s for s, u in zip(data.seqs, of, strict=True) if u in held_units]
    train = [s for s, u in zip(data.seqs, of, strict=True) if u not in held_units]
    return train, held


def _pad(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, batch))
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    attn = torch.zeros(len(batch), width, dtype=torch.bool)
    for i, s in enumerate(batch):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = True
    return ids, attn


def _lm_loss(model: TinyLM, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1], attn[:, :-1])
    targets = ids[:, 1:].masked_fill(~attn[:, 1:], -100)  # no loss on padding
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def _loss(model: TinyLM, seqs: list[list[int]], batch: int = 256) -> float:
    """Mean next-token loss per token over ``seqs``."""
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(seqs), batch):
            ids, attn = _pad(seqs[i : i + batch])
            n = int(attn[:, 1:].sum())
            total += _lm_loss(model, ids, attn).item() * n
            tokens += n
    model.train(was_training)
    return total / max(tokens, 1)
