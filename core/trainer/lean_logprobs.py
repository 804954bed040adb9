"""Per-token logprobs and entropy from ``[B, C, V]`` logits, without fp32 copies of the whole
tensor.

Why: with a real vocabulary (Qwen2's 151,936 ids) the plain path (cast the logits to fp32,
add the sampler's restriction, divide by the temperature, ``log_softmax`` kept for the
backward pass, then the entropy's own ``log_softmax`` and ``exp``) peaked at 16.6 GB over
the bf16 logits at 4 x 1,024 completion tokens on an H200, about seven fp32 copies of
``[B, C, V]`` (2.5 GB each), more than the model. Here the softmax is taken a chunk of rows
at a time, in fp32, and the backward pass takes it again from the saved input logits and
each row's logsumexp, so what lives across the step is the logits in their own dtype (bf16
under autocast), two floats a row, and two chunk-sized buffers: 2.2 GB there, in the same
time (``benchmarks/logprob_memory.py``).

The numbers are those of ``grpo.token_logprobs`` and ``grpo.entropy`` on
``(logits.float() + restrict) / T`` (the tests hold the two paths together, values and
gradients, in float64 and bf16).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# fp32 elements in one chunk's [rows, V] temporaries (64 Mi: 256 MB, a few alive at once):
# large enough that a small vocabulary runs as one chunk, small enough beside a 70 GB card
CHUNK_ELEMENTS = 1 << 26


def logprobs_and_entropy(
    logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    restrict: Tensor | None = None,
    *,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[Tensor, Tensor]:
    """``(log softmax(x)[target], entropy(softmax(x)))`` per position, ``x = (logits + restrict) / T``.

    ``logits``: ``[B, C, V]`` in any float dtype (not copied to fp32 as a whole);
    ``targets``: ``[B, C]`` token ids; ``restrict``: ``[B, V]`` additive mask (0 allowed,
    -1e9 not) or None. Both outputs are ``[B, C]`` fp32 (float64 for float64 logits) and
    carry gradients to ``logits``;
    an output the loss does not use costs nothing in the backward pass. Differentiable once:
    a second derivative (a gradient taken with ``create_graph=True``, differentiated again)
    raises a ``RuntimeError``.
    """
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, C, V], got shape {tuple(logits.shape)}")
    if targets.shape != logits.shape[:2]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match logits {tuple(logits.shape[:2])}")
    if logits.shape[2] == 0:
        raise ValueError(f"logits {tuple(logits.shape)} have an empty vocabulary (V = 0): no id to score")
    want = (logits.shape[0], logits.shape[2])
    if restrict is not None and restrict.shape != want:
        raise ValueError(f"restrict must be [B, V] = {want}, got {tuple(restrict.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rows = max(1, chunk_elements // max(1, logits.shape[2]))
    out: tuple[Tensor, Tensor] = _LeanLogprobs.apply(logits, targets, restrict, float(temperature), rows)
    return out


def _scaled(logits2d: Tensor, restrict: Tensor | None, c: int, r0: int, r1: int, t: float) -> Tensor:
    """``(logits + restrict) / T`` for flat rows ``r0:r1`` in fp32, or float64 for float64
    logits (row ``r`` is batch ``r // C``)."""
    # always a fresh buffer (copy=True: fp32 logits would otherwise come back as a view, and the
    # callers work in place on it), then in place: one chunk-sized buffer
    x = logits2d[r0:r1].to(_compute_dtype(logits2d), copy=True)
    if restrict is not None:
        # batch by batch, each its one [V] row broadcast in place: a gather of the chunk's rows
        # of ``restrict`` would be a third chunk-sized buffer
        for b in range(r0 // c, (r1 - 1) // c + 1):
            lo, hi = max(r0, b * c), min(r1, (b + 1) * c)
            x[lo - r0 : hi - r0].add_(restrict[b])
    return x.div_(t) if t != 1.0 else x


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


class _LeanLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: Tensor, targets: Tensor, restrict: Tensor | None, t: float, rows: int
    ) -> tuple[Tensor, Tensor]:
        b, c, v = logits.shape
        flat = logits.reshape(b * c, v)
        tgt = targets.reshape(b * c)
        n = b * c
        logp = torch.empty(n, dtype=_compute_dtype(logits), device=logits.device)
        ent = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            x = _scaled(flat, restrict, c, r0, r1, t)
            lz = torch.logsumexp(x, dim=-1)
            x.sub_(lz[:, None])  # log p, in place
            logp[r0:r1] = x.gather(-1, tgt[r0:r1, None]).squeeze(-1)
            # H = -sum p log p, from log p itself as grpo.entropy takes it: lse - sum p x is the
            # same number as the difference of two large ones (a low temperature, logits with a
            # common offset) and lost 3e-4 in fp32; two chunk-sized buffers, x and p (a masked
            # id has p = 0 exactly, so 0 * -1e9 adds 0)
            ent[r0:r1] = torch.exp(x).mul_(x).sum(-1).neg_()
            lse[r0:r1] = lz
        ctx.save_for_backward(logits, targets, restrict, lse, ent)
        ctx.t, ctx.rows = t, rows
        # an unused output's gradient arrives as None, not as a tensor of zeros to multiply
        ctx.set_materialize_grads(False)
        return logp.view(b, c), ent.view(b, c)

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None) -> tuple[Tensor | None, ...]:
        logits, targets, restrict, lse, ent = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None, None
        # grad mode is on here only under create_graph=True: the gradient below takes each row's
        # logsumexp and entropy as constants and works in place, so differentiated again it is
        # wrong (or trips a version check); it is worked out without a graph and handed back
        # through a node, tied to everything it depends on, that refuses a second derivative
        create_graph = torch.is_grad_enabled()
        with torch.no_grad():
            grad = _gradient(logits, targets, restrict, lse, ent, g_logp, g_ent, ctx.t, ctx.rows)
        if create_graph:
            grad = _NoSecondDerivative.apply(grad, NO_SECOND_DERIVATIVE, logits, g_logp, g_ent)
        return grad, None, None, None, None


NO_SECOND_DERIVATIVE = (
    "logprobs_and_entropy has no second derivative (its gradient was taken with "
    "create_graph=True and then differentiated again); for a Hessian-vector product or "
    "a gradient penalty use grpo.token_logprobs and grpo.entropy on "
    "(logits.float() + restrict) / T"
)


class _NoSecondDerivative(torch.autograd.Function):
    """``grad`` as it is, under a node whose backward raises ``refusal``: the gradient of
    ``logprobs_and_entropy`` (or of its vocab-parallel form) taken with ``create_graph=True``
    goes through it, with the tensors it depends on as inputs so that a derivative with
    respect to any of them reaches it (and is not read as "unused" or None)."""

    @staticmethod
    def forward(ctx: Any, grad: Tensor, refusal: str, *depends_on: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.refusal = refusal
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx: Any, *_: Any) -> Any:
        raise RuntimeError(ctx.refusal)


def _gradient(
    logits: Tensor,
    targets: Tensor,
    restrict: Tensor | None,
    lse: Tensor,
    ent: Tensor,
    g_logp: Tensor | None,
    g_ent: Tensor | None,
    t: float,
    rows: int,
    held: Tensor | None = None,
) -> Tensor:
    """d(sum g_logp * logp + g_ent * H) / d logits, a chunk of rows at a time, in the logits' dtype.

    ``held``: per flat row, whether ``logits`` hold its target's column at all (a vocabulary
    shard's, ``lean_logprobs_tp``: ``targets`` are then local column indices, any valid one
    where not held, and ``lse``/``ent`` the whole vocabulary's); None: every row's is here."""
    b, c, v = logits.shape
    flat = logits.reshape(b * c, v)
    tgt = targets.reshape(b * c)
    dt = _compute_dtype(logits)
    gl = None if g_logp is None else g_logp.reshape(b * c).to(dt)
    # the target's one-hot, weighted: 0 on the rows whose target another shard holds
    onehot = gl if gl is None or held is None else gl * held.reshape(b * c).to(dt)
    ge = None if g_ent is None else g_ent.reshape(b * c).to(dt)
    grad = torch.empty_like(flat)
    for r0 in range(0, b * c, rows):
        r1 = min(b * c, r0 + rows)
        # in place throughout: two chunk-sized fp32 buffers, the log-probabilities (which
        # become the gradient) and the probabilities
        gx = _scaled(flat, restrict, c, r0, r1, t).sub_(lse[r0:r1, None])  # log p
        p = torch.exp(gx)
        if ge is not None:
            # dH / dx_k = -p_k (log p_k + H); a masked id has p = 0 exactly (no 0 * inf)
            gx.add_(ent[r0:r1, None]).mul_(p).mul_(-ge[r0:r1, None])
        else:
            gx.zero_()
        if gl is not None and onehot is not None:
            # d logp_target / dx = onehot(target) - p
            gx.sub_(p.mul_(gl[r0:r1, None]))
            gx.scatter_add_(-1, tgt[r0:r1, None], onehot[r0:r1, None])
        if t != 1.0:
            gx.div_(t)
        grad[r0:r1] = gx
    return grad.view(b, c, v)
