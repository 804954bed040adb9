"""``lean_logprobs.logprobs_and_entropy`` over a vocabulary split across tensor-parallel ranks.

Why: megatron-core's output layer is a ``ColumnParallelLinear``; with ``parallel_output=False``
every one of the TP ranks gathers the full ``[B, T, V]`` logits before the loss (Qwen2's
151,936 ids: 1.2 GB of bf16 per 4 x 1,024 positions, the same on every rank, and an
all-gather of them). With ``parallel_output=True`` each rank keeps its own columns
``[vocab_start, vocab_start + V_local)``, and this function takes the same numbers from the
shards, a chunk of rows at a time as ``lean_logprobs`` does:

* forward, per chunk, two all-reduces of a few floats a row: the MAX of the row maxima ``m``,
  then the SUM of ``S = sum e^(x - m)``, of ``sum e^(x - m) (x - m)``, of the target's
  ``x - m`` (from the rank that owns the id, 0 elsewhere) and of an ownership count. Then
  ``lse = m + log S``, ``logp = (x_t - m) - log S`` and ``H = log S - sum e^(x-m)(x-m) / S``:
  both terms of H are >= 0, so it is not the difference of two large numbers that
  ``lse - sum p x`` is (which lost 3e-4 in fp32 at a low temperature);
* backward: each rank's gradient for its own columns only, from the saved logsumexp and
  entropy, with the target's one-hot on the rank that owns it; no communication. megatron's
  ``ColumnParallelLinear`` all-reduces the gradient of its input, as for its own
  ``vocab_parallel_cross_entropy``.

Before the chunks one all-gather of six numbers a rank checks that the ranks agree (rows,
temperature, dtype) and that their shards tile ``[0, V)``; a rank whose own inputs are bad
still takes part in it, so every rank raises instead of the others waiting in a collective
forever. Shards may be uneven (megatron's are not: it divides V by TP).

The numbers are ``logprobs_and_entropy``'s on the gathered logits (the tests hold them
together, values and gradients, on 2 and 3 gloo processes).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from core.trainer.lean_logprobs import (
    CHUNK_ELEMENTS,
    _compute_dtype,
    _gradient,
    _NoSecondDerivative,
    _scaled,
)

# the fields of the all-gather: an error flag, B, C, vocab_start, V_local, T, compute itemsize
_FIELDS = 7


def vocab_parallel_logprobs_and_entropy(
    logits_shard: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    restrict_shard: Tensor | None = None,
    *,
    vocab_start: int,
    group: dist.ProcessGroup | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[Tensor, Tensor]:
    """``(log softmax(x)[target], entropy(softmax(x)))`` per position, ``x = (logits + restrict) / T``,
    with the vocabulary split over the ranks of ``group`` (the default group when None).

    ``logits_shard``: ``[B, C, V_local]``, this rank's columns ``vocab_start : vocab_start +
    V_local`` of the ``[B, C, V]`` logits, in any float dtype; ``targets``: ``[B, C]`` global
    token ids, the same on every rank; ``restrict_shard``: ``[B, V_local]``, this rank's columns
    of the additive mask (0 allowed, -1e9 not), or None (no restriction on this shard). Every
    rank of ``group`` calls it with the same ``B``, ``C`` and ``temperature`` and the same
    logits dtype; the shards must tile ``[0, V)``. Both outputs are ``[B, C]`` fp32 (float64 for
    float64 logits), the same on every rank, and carry gradients to this rank's shard only.
    Differentiable once, as ``logprobs_and_entropy``. A refused input raises ``ValueError`` on
    every rank of the group.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "vocab_parallel_logprobs_and_entropy needs torch.distributed initialised (the "
            "ranks' shards are combined by all-reduce); on one process use logprobs_and_entropy"
        )
    error = _local_error(logits_shard, targets, restrict_shard, temperature, vocab_start)
    info = torch.full((_FIELDS,), -1.0, dtype=torch.float64, device=logits_shard.device)
    info[0] = 1.0 if error else 0.0
    if logits_shard.ndim == 3:
        b, c, v = logits_shard.shape
        info[1:] = torch.tensor(
            [b, c, vocab_start, v, float(temperature), _compute_dtype(logits_shard).itemsize],
            dtype=torch.float64,
        )
    v_total, v_max = _agree(info, error, group)
    rows = max(1, chunk_elements // v_max)
    out: tuple[Tensor, Tensor] = _VocabParallelLogprobs.apply(
        logits_shard, targets, restrict_shard, float(temperature), rows, vocab_start, v_total, group
    )
    return out


def _local_error(
    logits: Tensor, targets: Tensor, restrict: Tensor | None, temperature: float, vocab_start: int
) -> str | None:
    """What ``logprobs_and_entropy`` would refuse, for this rank's shard; None if nothing."""
    if logits.ndim != 3:
        return f"logits_shard must be [B, C, V_local], got shape {tuple(logits.shape)}"
    if targets.shape != logits.shape[:2]:
        return f"targets {tuple(targets.shape)} do not match logits_shard {tuple(logits.shape[:2])}"
    if logits.shape[2] == 0:
        return f"logits_shard {tuple(logits.shape)} has no vocabulary column (V_local = 0)"
    want = (logits.shape[0], logits.shape[2])
    if restrict is not None and restrict.shape != want:
        return f"restrict_shard must be [B, V_local] = {want}, got {tuple(restrict.shape)}"
    if not temperature > 0:
        return f"temperature must be > 0, got {temperature}"
    if vocab_start < 0:
        return f"vocab_start must be >= 0, got {vocab_start}"
    return None


def _agree(info: Tensor, error: str | None, group: dist.ProcessGroup | None) -> tuple[int, int]:
    """Every rank's ``info``, checked alike on every rank: ``(V, the largest V_local)``."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(info) for _ in range(world)]
    dist.all_gather(parts, info, group=group)
    rows = [[float(x) for x in p.tolist()] for p in parts]
    me = dist.get_rank(group)
    if error is not None:
        raise ValueError(f"vocab-parallel logprobs, rank {me} of {world}: {error}")
    bad = [r for r, f in enumerate(rows) if f[0] != 0.0]
    if bad:
        raise ValueError(
            f"vocab-parallel logprobs: rank {bad[0]} of {world} refused its inputs (see its error)"
        )
    for i, name in ((1, "B"), (2, "C"), (5, "temperature"), (6, "compute dtype size")):
        seen = sorted({f[i] for f in rows})
        if len(seen) > 1:
            raise ValueError(f"vocab-parallel logprobs: the ranks disagree on {name}: {seen}")
    shards = sorted((int(f[3]), int(f[4]), r) for r, f in enumerate(rows))
    edge = 0
    for start, size, _ in shards:
        if start != edge:
            layout = ", ".join(f"rank {r}: [{s}, {s + n})" for s, n, r in shards)
            raise ValueError(
                f"vocab-parallel logprobs: the ranks' vocabulary shards do not tile [0, V) "
                f"without gaps or overlaps ({layout})"
            )
        edge = start + size
    return edge, max(size for _, size, _ in shards)


def _ownership(targets: Tensor, vocab_start: int, v_local: int) -> tuple[Tensor, Tensor]:
    """Per flat row: whether this rank holds the target's column, and its local index (0 where
    it does not: a valid index whose value is then masked out)."""
    local = targets.reshape(-1) - vocab_start
    owned = (local >= 0) & (local < v_local)
    return owned, torch.where(owned, local, torch.zeros_like(local))


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        targets: Tensor,
        restrict: Tensor | None,
        t: float,
        rows: int,
        vocab_start: int,
        v_total: int,
        group: dist.ProcessGroup | None,
    ) -> tuple[Tensor, Tensor]:
        b, c, v = logits.shape
        n = b * c
        flat = logits.reshape(n, v)
        owned, idx = _ownership(targets, vocab_start, v)
        dt = _compute_dtype(logits)
        logp = torch.empty(n, dtype=dt, device=logits.device)
        ent = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        owners = torch.empty_like(logp)
        for r0 in range(0, n, rows):  # the same rows on every rank: their collectives pair up
            r1 = min(n, r0 + rows)
            x = _scaled(flat, restrict, c, r0, r1, t)
            m = x.amax(dim=-1)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            x.sub_(m[:, None])  # y = x - m <= 0, in place
            sums = torch.empty(4, r1 - r0, dtype=dt, device=logits.device)
            tgt = x.gather(-1, idx[r0:r1, None]).squeeze(-1)
            sums[2] = torch.where(owned[r0:r1], tgt, torch.zeros_like(tgt))
            sums[3] = owned[r0:r1]
            e = torch.exp(x)  # the second chunk-sized buffer
            sums[0] = e.sum(-1)
            # a masked id has e = 0 exactly, so 0 * -1e9 adds 0
            sums[1] = e.mul_(x).sum(-1)
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            log_s = torch.log(sums[0])
            lse[r0:r1] = m + log_s
            logp[r0:r1] = sums[2] - log_s
            ent[r0:r1] = log_s - sums[1] / sums[0]
            owners[r0:r1] = sums[3]
        # all-reduced, so every rank sees the same counts and raises alike: a target outside
        # [0, V) (or targets that differ between ranks) would otherwise score as logit 0
        if n and bool((owners != 1).any()):
            row = int((owners != 1).nonzero()[0])
            raise ValueError(
                f"vocab-parallel logprobs: target {int(targets.reshape(-1)[row])} at flat row {row} "
                f"is held by {int(owners[row])} ranks, not one: a target outside [0, {v_total}) "
                "or targets that differ between ranks"
            )
        ctx.save_for_backward(logits, targets, restrict, lse, ent)
        ctx.t, ctx.rows, ctx.vocab_start = t, rows, vocab_start
        ctx.set_materialize_grads(False)
        return logp.view(b, c), ent.view(b, c)

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None) -> tuple[Tensor | None, ...]:
        logits, targets, restrict, lse, ent = ctx.saved_tensors
        none = (None,) * 7
        if g_logp is None and g_ent is None:
            return (None, *none)
        # as in lean_logprobs: worked out without a graph, and refused if differentiated again
        create_graph = torch.is_grad_enabled()
        with torch.no_grad():
            grad = _shard_gradient(
                logits, targets, restrict, lse, ent, g_logp, g_ent, ctx.t, ctx.rows, ctx.vocab_start
            )
        if create_graph:
            grad = _NoSecondDerivative.apply(grad, NO_SECOND_DERIVATIVE, logits, g_logp, g_ent)
        return (grad, *none)


NO_SECOND_DERIVATIVE = (
    "vocab_parallel_logprobs_and_entropy has no second derivative (its gradient was "
    "taken with create_graph=True and then differentiated again); for a Hessian-vector "
    "product or a gradient penalty gather the logits and use grpo.token_logprobs and "
    "grpo.entropy on (logits.float() + restrict) / T"
)


def _shard_gradient(
    logits: Tensor,
    targets: Tensor,
    restrict: Tensor | None,
    lse: Tensor,
    ent: Tensor,
    g_logp: Tensor | None,
    g_ent: Tensor | None,
    t: float,
    rows: int,
    vocab_start: int,
) -> Tensor:
    """d(sum g_logp * logp + g_ent * H) / d logits_shard: ``lean_logprobs._gradient`` with the
    global logsumexp and entropy, and the target's one-hot only where this shard holds it."""
    held, idx = _ownership(targets, vocab_start, logits.shape[-1])
    return _gradient(logits, idx, restrict, lse, ent, g_logp, g_ent, t, rows, held=held)
