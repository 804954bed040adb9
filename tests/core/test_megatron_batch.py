"""The megatron trainer's micro-batch (``core.trainer.megatron_batch.pack_samples``), on the
CPU: which logits position scores which completion token, the padding, the restriction."""

from __future__ import annotations

import torch

from core.trainer.base import TrainSample
from core.trainer.megatron_batch import pack_samples


def sample(prompt: list[int], completion: list[int], allowed: list[int] | None = None) -> TrainSample:
    return TrainSample(
        prompt_ids=prompt,
        completion_ids=completion,
        old_logprobs=[-0.5 - i for i in range(len(completion))],
        mask=[1] * len(completion),
        group_id="g",
        reward=1.0,
        policy_version=0,
        allowed_token_ids=allowed,
    )


def test_each_completion_token_is_scored_by_the_position_before_it():
    a = sample([1, 2, 3], [4, 5])  # sequence 1 2 3 4 5: token 4 at 3 is scored by position 2
    b = sample([6], [7, 8, 9])  # 6 7 8 9: token 7 at 1 by position 0
    p = pack_samples([a, b], vocab_size=10, device=torch.device("cpu"))
    # the inputs: each sequence but its last token, right-padded to the longest (4 tokens)
    assert p.ids.tolist() == [[1, 2, 3, 4], [6, 7, 8, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert p.positions.tolist() == [[2, 3, 0], [0, 1, 2]]
    assert p.targets.tolist() == [[4, 5, 0], [7, 8, 9]]
    assert p.mask.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]  # padding never counts
    assert p.old.tolist() == [[-0.5, -1.5, 0.0], [-0.5, -1.5, -2.5]]
    assert p.restrict is None
    # the packed positions pick exactly the logits that predict the targets
    seqs = [[1, 2, 3, 4, 5], [6, 7, 8, 9]]
    for i, seq in enumerate(seqs):
        for j in range(int(p.mask[i].sum())):
            assert seq[int(p.positions[i, j]) + 1] == p.targets[i, j]


def test_a_restricted_sample_masks_the_other_ids_and_an_unrestricted_one_none():
    p = pack_samples(
        [sample([1], [2], allowed=[2, 5]), sample([1], [3])], vocab_size=6, device=torch.device("cpu")
    )
    assert p.restrict is not None and p.restrict.shape == (2, 6)
    assert p.restrict[0].tolist() == [-1e9, -1e9, 0.0, -1e9, -1e9, 0.0]
    assert p.restrict[1].tolist() == [0.0] * 6  # finite: entropy's p log p stays 0, not NaN
