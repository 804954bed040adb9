"""The job's policy, built once in the driver and shipped to the engines and the trainer.

    bundle = build_policy(cfg)          # tokenizer, model shape, initial weights
    bundle.model()                      # a TinyLM holding the initial weights

``engine.model: tiny-lm`` (the embedded default) trains a word tokenizer on text the job's
own environments produce (seeded random episodes, with the configured action words or the
environment's example actions, played in a child process: ``core/policy/corpus.py``) and
initialises a ``TinyLM`` from ``seed``; with ``engine.pretrain.steps`` it then pretrains it
on those episodes (``core/policy/pretrain.py``). Any other value is a directory written by
``TinyLM.save_pretrained`` holding a ``tokenizer.json`` too (a policy trained earlier,
e.g. by ``benchmarks/frozenlake_learning.py --save``).

Every replica and the trainer start from the same ``state`` (one copy, put in Ray's object
store by the job), so version 0 means the same weights everywhere.
"""

from __future__ import annotations

import threading
from pathlib import Path

from core.config import JobConfig
from core.config_backends import MODEL_KEYS as MODEL_KEYS  # engine.kwargs that shape the TinyLM
from core.errors import ConfigError
from core.policy.bundle import PolicyBundle as PolicyBundle  # its home; the actors import it from there
from core.policy.corpus import CORPUS_EPISODES, play_envs
from core.policy.pretrain import OnStep, pretrain, transition_sequences
from core.policy.tiny_lm import TinyLM, TinyLMConfig
from core.policy.tokenizer import WordTokenizer
from core.rollout.env_manager import task_key

TINY_LM = "tiny-lm"


def build_policy(
    cfg: JobConfig,
    *,
    on_pretrain_step: OnStep | None = None,
    stop: threading.Event | None = None,
    bundles: dict[str, Path] | None = None,
) -> PolicyBundle:
    """The job's policy. Blocking (corpus play, pretraining: minutes); ``stop`` set from
    another thread makes it raise ``StoppedError`` soon after, nothing left running.
    ``bundles``: ``envs[].image`` -> its unpacked image (``core.env_images.JobImages``), which
    the corpus child loads as a container does."""
    if cfg.engine.backend != "torch":
        raise ConfigError([("engine.backend", "build_policy builds the torch engine's policy only")])
    shape = {k: v for k, v in cfg.engine.kwargs.items() if k in MODEL_KEYS}
    pre = cfg.engine.pretrain
    report: dict[str, float] = {}
    tasks: frozenset[str] = frozenset()
    if cfg.engine.model == TINY_LM:
        played = play_envs(
            cfg,
            max(CORPUS_EPISODES, pre.episodes) if pre.steps else CORPUS_EPISODES,
            stop=stop,
            bundles=bundles,
        )
        tok = WordTokenizer.train(played.texts)
        try:
            mcfg = TinyLMConfig(vocab_size=tok.vocab_size, **shape)
        except ValueError as e:
            raise ConfigError([("engine.kwargs", f"not a valid tiny-lm shape: {e}")]) from None
        model = TinyLM(mcfg, seed=cfg.seed)
        if pre.steps:
            data = transition_sequences(cfg, tok, played.episodes, mcfg.max_len)
            if len(data.seqs) < 2:
                raise ConfigError(
                    [
                        (
                            "engine.pretrain",
                            f"random play gave {len(data.seqs)} transitions; pretraining needs 2 or more",
                        )
                    ]
                )
            report = pretrain(model, data, pre, seed=cfg.seed, on_step=on_pretrain_step, stop=stop).as_dict()
            tasks = frozenset(task_key(e.texts[0]) for e in played.episodes)
    else:
        path = Path(cfg.engine.model)
        if not (path / "tokenizer.json").is_file():
            raise ConfigError(
                [
                    (
                        "engine.model",
                        f"{str(path)!r} is neither {TINY_LM!r} nor a directory holding a saved TinyLM "
                        "and its tokenizer.json",
                    )
                ]
            )
        model = TinyLM.from_pretrained(path)
        tok = WordTokenizer.load(path / "tokenizer.json")
        if shape:
            raise ConfigError([("engine.kwargs", "model shape keys apply to a new tiny-lm only")])
    missing = [a for e in cfg.envs for a in (e.actions or []) if _single_id(tok, a) is None]
    if missing:
        raise ConfigError([("envs[].actions", f"not single tokens of the policy's vocabulary: {missing}")])
    return PolicyBundle(
        tokenizer=tok.to_dict(),
        model_config=model.config.model_dump(),
        state={k: v.detach().clone() for k, v in model.state_dict().items()},
        pretrained=report,
        tasks=tasks,
    )


def _single_id(tok: WordTokenizer, word: str) -> int | None:
    ids = tok.encode(word)
    return ids[0] if len(ids) == 1 and ids[0] != tok.token_to_id("<unk>") else None


def action_ids(tok: WordTokenizer, words: list[str]) -> list[int]:
    out = []
    for w in words:
        i = _single_id(tok, w)
        if i is None:
            raise ValueError(f"{w!r} is not one token of the policy's vocabulary")
        out.append(i)
    return out
