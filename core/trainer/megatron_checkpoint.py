"""The megatron trainer's checkpoint files (``MegatronTrainer.save_checkpoint``, read back with
``MegatronTrainerConfig.checkpoint``): one file per tensor/pipeline-parallel rank.

    policy.pt                              tp = pp = 1: the one file (the name it always had)
    policy.tp0-of-2.pp0-of-1.pt            tp = 2: rank 0's shard
    policy.tp1-of-2.pp0-of-1.pt            tp = 2: rank 1's shard

Every rank of a tp x pp > 1 trainer holds a different shard of the weights; written under one
name, the ranks overwrote each other and the last one's shard was the checkpoint. The layout
is in each name, so a loader with another tp x pp is refused by name, and in each file
(``layout_fields``), so a shard given as the checkpoint, or renamed, is refused too
(``check_layout``). Pure file logic, torch.load aside: tested on the CPU.
"""

from __future__ import annotations

import glob
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from core.trainer.base import TrainerError

#: The ``format`` field of a checkpoint written by ``save_checkpoint``.
CHECKPOINT_FORMAT = "rl-fabric/megatron-gpt/1"

_SHARD = re.compile(r"\.tp(\d+)-of-(\d+)\.pp(\d+)-of-(\d+)")


def shard_file(path: Path, tp: int, pp: int, tp_rank: int, pp_rank: int) -> Path:
    """The file of rank (``tp_rank``, ``pp_rank``)'s shard of the checkpoint saved as
    ``path``: ``path`` itself at tp = pp = 1, else the rank and the layout before its suffix."""
    if not (0 <= tp_rank < tp and 0 <= pp_rank < pp):
        raise ValueError(f"rank {tp_rank} of tp {tp}, {pp_rank} of pp {pp}")
    if tp == pp == 1:
        return path
    return path.with_name(f"{path.stem}.tp{tp_rank}-of-{tp}.pp{pp_rank}-of-{pp}{path.suffix}")


def saved_layouts(path: Path) -> set[tuple[int, int]]:
    """The tp x pp layouts of the shard files of the checkpoint saved as ``path`` found on
    disk (the single file ``path`` itself not counted: its contents say what it holds)."""
    pattern = f"{glob.escape(path.stem)}.tp*-of-*.pp*-of-*{glob.escape(path.suffix)}"
    found = set()
    for f in path.parent.glob(pattern):
        middle = f.name[len(path.stem) : len(f.name) - len(path.suffix)]
        m = _SHARD.fullmatch(middle)
        if m:
            found.add((int(m[2]), int(m[4])))
    return found


def own_shard_file(path: Path, tp: int, pp: int, tp_rank: int, pp_rank: int) -> Path:
    """The file this rank loads of the checkpoint saved as ``path``: its own shard's; else
    ``path`` itself where that is a file (a single-GPU checkpoint: ``check_layout`` refuses it
    at tp x pp > 1); a ``TrainerError`` when only shards of another tp x pp are there. When
    nothing is, its own shard's path (``read_checkpoint`` says it is missing)."""
    own = shard_file(path, tp, pp, tp_rank, pp_rank)
    if own.is_file() or path.is_file():
        return own if own.is_file() else path
    other = sorted(saved_layouts(path) - {(tp, pp)})
    if other:
        saved = " and ".join(f"{t} x {p}" for t, p in other)
        raise TrainerError(
            f"checkpoint {path} was saved with tensor x pipeline parallel = {saved}; this trainer "
            f"runs {tp} x {pp}: load it with the tensor_parallel_size and pipeline_parallel_size "
            "it was saved with"
        )
    return own


def layout_fields(tp: int, pp: int, tp_rank: int, pp_rank: int) -> dict[str, int]:
    """What a checkpoint file records of the rank that wrote it."""
    return {
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "tensor_parallel_rank": tp_rank,
        "pipeline_parallel_rank": pp_rank,
    }


def check_layout(ckpt: Mapping[str, Any], source: str, tp: int, pp: int, tp_rank: int, pp_rank: int) -> None:
    """Refuse a checkpoint (``read_checkpoint``'s, or a training state; ``source`` names it)
    that is not this rank's shard. One written before the ranks were recorded is a single-GPU
    one unless it says otherwise (its ``tensor_parallel_size``)."""
    saved = (int(ckpt.get("tensor_parallel_size", 1)), int(ckpt.get("pipeline_parallel_size", 1)))
    if saved != (tp, pp):
        raise TrainerError(
            f"{source} was saved with tensor x pipeline parallel = {saved[0]} x {saved[1]}; "
            f"this trainer runs {tp} x {pp}: load it with the tensor_parallel_size and "
            "pipeline_parallel_size it was saved with"
        )
    if tp * pp > 1 and "tensor_parallel_rank" not in ckpt:
        raise TrainerError(
            f"{source} was written before checkpoints carried their rank: the ranks of its "
            f"tp x pp = {tp} x {pp} run wrote one file, and whose shard it holds is unknown"
        )
    rank = (int(ckpt.get("tensor_parallel_rank", 0)), int(ckpt.get("pipeline_parallel_rank", 0)))
    if rank != (tp_rank, pp_rank):
        raise TrainerError(
            f"{source} holds the shard of tensor rank {rank[0]}, pipeline rank {rank[1]}; "
            f"this rank is tensor rank {tp_rank}, pipeline rank {pp_rank}"
        )


def read_checkpoint(path: Path) -> dict[str, Any]:
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise TrainerError(f"cannot read megatron checkpoint {path}: {e}") from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise TrainerError(f"{path} is not a checkpoint written by MegatronTrainer.save_checkpoint")
    return ckpt
