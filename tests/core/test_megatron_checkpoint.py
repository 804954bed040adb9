"""The megatron trainer's checkpoint files (``core.trainer.megatron_checkpoint``): each
tensor/pipeline-parallel rank writes and reads its own shard's file, a single-GPU checkpoint
keeps its one name, and a checkpoint saved with another tp x pp is refused by name. Pure
file logic: runs on the CPU (the trainer that writes them needs a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.trainer.base import TrainerError
from core.trainer.megatron_checkpoint import (
    CHECKPOINT_FORMAT,
    check_layout,
    layout_fields,
    own_shard_file,
    read_checkpoint,
    shard_file,
)


def test_a_single_gpu_checkpoint_keeps_its_name_and_shards_carry_their_rank():
    path = Path("/ck/policy.pt")
    assert shard_file(path, 1, 1, 0, 0) == path  # as every checkpoint was written before
    names = {shard_file(path, 2, 2, t, p).name for t in range(2) for p in range(2)}
    assert names == {
        "policy.tp0-of-2.pp0-of-2.pt",
        "policy.tp1-of-2.pp0-of-2.pt",
        "policy.tp0-of-2.pp1-of-2.pt",
        "policy.tp1-of-2.pp1-of-2.pt",
    }
    assert shard_file(Path("/ck/step.7"), 2, 1, 1, 0) == Path("/ck/step.tp1-of-2.pp0-of-1.7")
    assert shard_file(Path("/ck/policy"), 2, 1, 1, 0) == Path("/ck/policy.tp1-of-2.pp0-of-1")
    with pytest.raises(ValueError, match="rank 2 of tp 2"):
        shard_file(path, 2, 1, 2, 0)


def save(file: Path, tp: int, pp: int, tp_rank: int, pp_rank: int) -> None:
    torch.save({"format": CHECKPOINT_FORMAT, **layout_fields(tp, pp, tp_rank, pp_rank)}, file)


def test_each_rank_reads_its_own_shard(tmp_path):
    path = tmp_path / "policy.pt"
    for t in range(2):
        save(shard_file(path, 2, 1, t, 0), 2, 1, t, 0)
    for t in range(2):
        file = own_shard_file(path, 2, 1, t, 0)
        assert file == shard_file(path, 2, 1, t, 0)
        ckpt = read_checkpoint(file)
        check_layout(ckpt, f"checkpoint {file}", 2, 1, t, 0)
        assert ckpt["tensor_parallel_rank"] == t


def test_a_checkpoint_saved_with_another_layout_is_refused_by_name(tmp_path):
    path = tmp_path / "policy.pt"
    for t in range(2):
        save(shard_file(path, 2, 1, t, 0), 2, 1, t, 0)
    with pytest.raises(
        TrainerError, match=r"saved with tensor x pipeline parallel = 2 x 1; this trainer runs 1 x 1"
    ):
        own_shard_file(path, 1, 1, 0, 0)
    with pytest.raises(TrainerError, match=r"= 2 x 1; this trainer runs 4 x 1"):
        own_shard_file(path, 4, 1, 3, 0)
    # a single file and no shard of this layout: the file's contents say what it holds
    single = tmp_path / "single.pt"
    save(single, 1, 1, 0, 0)
    assert own_shard_file(single, 2, 1, 1, 0) == single
    with pytest.raises(
        TrainerError,
        match=r"single.pt was saved with tensor x pipeline parallel = 1 x 1; this trainer runs 2 x 1",
    ):
        check_layout(read_checkpoint(single), f"checkpoint {single}", 2, 1, 1, 0)
    # nothing of it on disk: the path this rank wanted, for read_checkpoint to say it is missing
    assert own_shard_file(tmp_path / "none.pt", 2, 1, 1, 0) == tmp_path / "none.tp1-of-2.pp0-of-1.pt"
    with pytest.raises(TrainerError, match=r"cannot read megatron checkpoint .*none\.pt"):
        read_checkpoint(tmp_path / "none.pt")


def test_a_shard_is_loaded_only_by_the_rank_and_layout_it_was_written_for(tmp_path):
    # a shard's file given as the checkpoint itself (or renamed): its contents say whose it is
    shard = shard_file(tmp_path / "policy.pt", 2, 1, 1, 0)
    save(shard, 2, 1, 1, 0)
    ckpt = read_checkpoint(own_shard_file(shard, 1, 1, 0, 0))
    with pytest.raises(
        TrainerError, match=r"saved with tensor x pipeline parallel = 2 x 1; this trainer runs 1 x 1"
    ):
        check_layout(ckpt, f"checkpoint {shard}", 1, 1, 0, 0)
    with pytest.raises(
        TrainerError,
        match="holds the shard of tensor rank 1, pipeline rank 0; this rank is tensor rank 0, pipeline rank",
    ):
        check_layout(ckpt, f"checkpoint {shard}", 2, 1, 0, 0)
    check_layout(ckpt, f"checkpoint {shard}", 2, 1, 1, 0)


def test_a_checkpoint_written_before_the_layout_fields_is_a_single_gpu_one(tmp_path):
    old = tmp_path / "old.pt"
    torch.save({"format": CHECKPOINT_FORMAT, "tensor_parallel_size": 1}, old)
    assert own_shard_file(old, 1, 1, 0, 0) == old
    check_layout(read_checkpoint(old), f"checkpoint {old}", 1, 1, 0, 0)
    # one written by an earlier tp = 2 run: its ranks wrote the same file, whose rank is unknown
    torch.save({"format": CHECKPOINT_FORMAT, "tensor_parallel_size": 2}, old)
    with pytest.raises(TrainerError, match="saved with tensor x pipeline parallel = 2 x 1"):
        check_layout(read_checkpoint(old), f"checkpoint {old}", 1, 1, 0, 0)
    with pytest.raises(TrainerError, match="written before checkpoints carried their rank"):
        check_layout(read_checkpoint(old), f"checkpoint {old}", 2, 1, 0, 0)


def test_junk_is_not_a_checkpoint(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(TrainerError, match="cannot read megatron checkpoint"):
        read_checkpoint(tmp_path / "junk.pt")
    torch.save({"format": "other"}, tmp_path / "other.pt")
    with pytest.raises(TrainerError, match=r"not a checkpoint written by MegatronTrainer\.save_checkpoint"):
        read_checkpoint(tmp_path / "other.pt")
