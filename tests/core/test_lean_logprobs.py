"""The chunked logprob/entropy path against the plain one (``grpo.token_logprobs`` and
``grpo.entropy`` on ``(logits + restrict) / T``): values and gradients, every chunking."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from core.trainer.grpo import entropy, token_logprobs  # noqa: E402
from core.trainer.lean_logprobs import logprobs_and_entropy  # noqa: E402


def _case(dtype: torch.dtype, *, b: int = 3, c: int = 5, v: int = 11, seed: int = 0, masked: bool = True):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, c, v, generator=g, dtype=torch.float64) * 3).to(dtype)
    targets = torch.randint(0, v, (b, c), generator=g)
    restrict = None
    if masked:
        restrict = torch.zeros(b, v, dtype=torch.float32)
        restrict[:, v // 2 :] = -1e9  # the upper half of the vocabulary is not allowed...
        targets = targets % (v // 2)  # ...and the sampled tokens are all allowed ones
    return logits, targets, restrict


def _plain(logits, targets, restrict, t):
    x = logits.float() if logits.dtype != torch.float64 else logits
    if restrict is not None:
        x = x + restrict[:, None, :].to(x.dtype)
    return token_logprobs(x, targets, t), entropy(x, t)


@pytest.mark.parametrize("chunk_elements", [1, 11 * 2, 11 * 7, 1 << 26])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("t", [1.0, 0.7])
def test_values_and_gradients_match_the_plain_path(chunk_elements, masked, t):
    # chunks of 1 row, of 2 and of 7 (across the batch boundary at 5), and all rows at once
    logits, targets, restrict = _case(torch.float64, masked=masked)
    w_logp = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w_ent = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    a = logits.clone().requires_grad_(True)
    logp, ent = logprobs_and_entropy(a, targets, t, restrict, chunk_elements=chunk_elements)
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()

    b = logits.clone().requires_grad_(True)
    ref_logp, ref_ent = _plain(b, targets, restrict, t)
    ((ref_logp * w_logp).sum() + (ref_ent * w_ent).sum()).backward()
    # the chunks are worked on in place: never the caller's logits
    assert torch.equal(a.detach(), logits)

    # the plain path casts to fp32, this one keeps float64 (gradcheck needs it): fp32's tolerance
    torch.testing.assert_close(logp.double(), ref_logp.double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent.double(), atol=1e-5, rtol=1e-5)
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
    if masked:
        assert bool((a.grad[..., 6:] == 0).all()), "a masked id got a gradient"


@pytest.mark.parametrize("use", ["logp", "ent"])
def test_an_unused_output_adds_nothing_to_the_gradient(use):
    logits, targets, restrict = _case(torch.float64)
    a = logits.clone().requires_grad_(True)
    logp, ent = logprobs_and_entropy(a, targets, 0.9, restrict, chunk_elements=22)
    (logp if use == "logp" else ent).sum().backward()
    b = logits.clone().requires_grad_(True)
    ref_logp, ref_ent = _plain(b, targets, restrict, 0.9)
    (ref_logp if use == "logp" else ref_ent).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


def test_bf16_logits_keep_their_dtype_and_match_the_fp32_cast():
    logits, targets, restrict = _case(torch.bfloat16, b=2, c=4, v=64)
    a = logits.clone().requires_grad_(True)
    logp, ent = logprobs_and_entropy(a, targets, 1.0, restrict, chunk_elements=64 * 3)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    (logp.sum() - 0.1 * ent.sum()).backward()
    assert a.grad is not None and a.grad.dtype == torch.bfloat16
    b = logits.clone().requires_grad_(True)
    ref_logp, ref_ent = _plain(b, targets, restrict, 1.0)
    (ref_logp.sum() - 0.1 * ref_ent.sum()).backward()
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.grad.float(), b.grad.float(), atol=1e-2, rtol=1e-2)


def test_gradcheck_in_float64():
    logits, targets, restrict = _case(torch.float64, b=2, c=3, v=5, masked=False)
    a = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: logprobs_and_entropy(x, targets, 0.8, restrict, chunk_elements=10), (a,)
    )


def test_under_no_grad_it_is_a_plain_forward():
    logits, targets, restrict = _case(torch.float32)
    with torch.no_grad():
        logp, ent = logprobs_and_entropy(logits, targets, 1.0, restrict)
    assert not logp.requires_grad and not ent.requires_grad
    ref_logp, ref_ent = _plain(logits, targets, restrict, 1.0)
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(ent, ref_ent)


@pytest.mark.parametrize(
    ("logits", "targets", "restrict", "t", "match"),
    [
        (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long), None, 1.0, r"\[B, C, V\]"),
        (torch.zeros(2, 3, 4), torch.zeros(2, 2, dtype=torch.long), None, 1.0, "targets"),
        (torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 5), 1.0, "restrict"),
        (torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), None, 0.0, "temperature"),
    ],
)
def test_bad_shapes_and_temperature_are_refused(logits, targets, restrict, t, match):
    with pytest.raises(ValueError, match=match):
        logprobs_and_entropy(logits, targets, t, restrict)


def test_the_memory_benchmark_runs_and_both_paths_agree():
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "logprob_memory.py"
    args = ["--device", "cpu", "--vocab", "64", "--batch", "2", "--tokens", "8", "--rounds", "1"]
    out = subprocess.run(
        [sys.executable, str(script), *args], check=True, capture_output=True, text=True, timeout=120
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["shape"] == [2, 8, 64] and res["rounds"] == 1
    assert res["loss_diff"] < 1e-5
    assert res["plain_peak_mb"] >= 0 and res["lean_peak_mb"] >= 0


@pytest.mark.parametrize(
    ("offset", "scale", "t"),
    [(0.0, 8.0, 0.3), (100.0, 3.0, 1.0), (40.0, 4.0, 0.5)],
    ids=["peaked-low-temperature", "offset-100", "offset-40-t0.5"],
)
def test_fp32_entropy_is_as_exact_as_the_plain_path_for_large_scaled_logits(offset, scale, t):
    # a low temperature or logits with a common offset make x = logits / T large beside the
    # entropy: written as lse - sum p x, H is the difference of two such numbers and lost
    # 3e-4 in fp32 (the plain path, -sum p log p, 5e-7), and the entropy's gradient with it
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 4, 1000, generator=g, dtype=torch.float64) * scale + offset).float()
    targets = torch.randint(0, 1000, (2, 4), generator=g)
    a = logits.clone().requires_grad_(True)
    _, ent = logprobs_and_entropy(a, targets, t)
    ent.sum().backward()
    # the exact entropy of the same fp32 logits, and its gradient, in float64
    b = logits.double().requires_grad_(True)
    logp = torch.log_softmax(b / t, dim=-1)
    exact = -(logp.exp() * logp).sum(-1)
    exact.sum().backward()
    assert (entropy(logits, t).double() - exact).abs().max() < 1e-5  # what the plain path holds
    # what is left is the rounding of the row's logsumexp itself (about 103 here: fp32 steps by
    # 7.6e-6), which log p = x - lse carries; 3e-5 is ten times under the cancellation's error
    torch.testing.assert_close(ent.double(), exact.detach(), atol=3e-5, rtol=0)
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(a.grad.double(), b.grad, atol=3e-5, rtol=0)


@pytest.mark.parametrize("wrt", ["logits", "grad_output"])
@pytest.mark.parametrize("use", ["logp", "ent", "both"])
def test_a_second_derivative_is_refused_not_wrong(use, wrt):
    # the backward pass is not itself differentiable (it takes the row's logsumexp and entropy
    # as constants and works in place): differentiating it again read 2.2 off the true
    # Hessian-vector product of the entropy, silently, or failed on an in-place version check
    logits, targets, _ = _case(torch.float64, b=2, c=3, v=5, masked=False)
    a = logits.clone().requires_grad_(True)
    logp, ent = logprobs_and_entropy(a, targets, 0.8)
    out = {"logp": logp, "ent": ent, "both": logp + 0.5 * ent}[use]
    v = torch.ones_like(out, requires_grad=True)
    (g,) = torch.autograd.grad(out, a, v, create_graph=True)
    # the first derivative itself is the one taken without a graph
    (want,) = torch.autograd.grad(out, a, torch.ones_like(out), retain_graph=True)
    torch.testing.assert_close(g.detach(), want, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad((g**2).sum(), a if wrt == "logits" else v)


@pytest.mark.parametrize("shape", [(0, 3, 5), (2, 0, 5)], ids=["B=0", "C=0"])
@pytest.mark.parametrize("masked", [False, True])
def test_no_rows_give_empty_outputs_and_an_empty_gradient(shape, masked):
    b, c, v = shape
    a = torch.randn(*shape, requires_grad=True)
    restrict = torch.zeros(b, v) if masked else None
    logp, ent = logprobs_and_entropy(a, torch.zeros(b, c, dtype=torch.long), 0.7, restrict)
    assert logp.shape == ent.shape == (b, c)
    (logp.sum() + ent.sum()).backward()
    assert a.grad is not None and a.grad.shape == shape


def test_an_empty_vocabulary_is_refused_by_name():
    # no id to score: gather's IndexError ("index 0 is out of bounds") named neither
    with pytest.raises(ValueError, match="vocabulary"):
        logprobs_and_entropy(torch.zeros(2, 3, 0), torch.zeros(2, 3, dtype=torch.long))
