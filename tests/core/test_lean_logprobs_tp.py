"""The vocab-parallel logprob/entropy path on real processes (gloo over 127.0.0.1) against
``logprobs_and_entropy`` on the gathered logits: values, gradients, refusals.

One world of 3 processes is started once for the module: its ranks run every case (the
3-way cases on the default group, with an uneven split; the 2-way ones on a subgroup of
ranks 0 and 1, as megatron's TP group is one) and write what they got to a file; the tests
below compare it here, in the parent, with the single-process function on the full tensor.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

from core.trainer.lean_logprobs import logprobs_and_entropy  # noqa: E402
from core.trainer.lean_logprobs_tp import vocab_parallel_logprobs_and_entropy  # noqa: E402

WORLD = 3
TIMEOUT_S = 90.0  # the whole world; a hung collective fails the module instead of the suite

SPLIT2 = ((0, 6), (6, 11))
SPLIT3 = ((0, 4), (4, 6), (6, 11))  # uneven: 4, 2 and 5 columns


@dataclass(frozen=True)
class Case:
    name: str
    split: tuple[tuple[int, int], ...]  # each rank's [start, end); 2 ranks: the subgroup {0, 1}
    dtype: str = "float64"
    b: int = 3
    c: int = 5
    t: float = 1.0
    mask: str = "none"  # "none", "odd" (odd ids not allowed), "upper" (ids >= 6 not allowed)
    chunk_rows: int | None = None  # None: the default chunk (every row at once here)
    use: str = "both"  # which outputs the loss uses: "logp", "ent", "both", "none" (no_grad)
    scale: float = 3.0
    offset: float = 0.0
    seed: int = 0
    unit_weights: bool = False  # the loss's weights on logp and H: 1, or random
    # per rank overrides that make the inputs bad: {rank: {"restrict_cols": n, "t": t, "b": b,
    # "start": s, "target": id}}
    bad: dict[int, dict[str, Any]] = field(default_factory=dict, hash=False)

    @property
    def v(self) -> int:
        return self.split[-1][1]


def _inputs(case: Case) -> tuple[Any, Any, Any, Any, Any]:
    """The full logits, targets, restriction and the loss's weights, the same in every process."""
    g = torch.Generator().manual_seed(case.seed)
    dtype = getattr(torch, case.dtype)
    v = case.v
    logits = (torch.randn(case.b, case.c, v, generator=g, dtype=torch.float64) * case.scale + case.offset).to(
        dtype
    )
    targets = torch.randint(0, v, (case.b, case.c), generator=g)
    restrict = None
    if case.mask == "odd":
        restrict = torch.zeros(case.b, v)
        restrict[:, 1::2] = -1e9
        targets = targets - targets % 2
    elif case.mask == "upper":
        restrict = torch.zeros(case.b, v)
        restrict[:, 6:] = -1e9  # the last shard is wholly masked: it holds no target
        targets = targets % 6
    if case.b * case.c:
        allowed = [i for i in range(v) if restrict is None or restrict[0, i] == 0]
        # a target on every rank that has an allowed id
        for k, (s, e) in enumerate(case.split):
            own = [i for i in allowed if s <= i < e]
            if own and k < case.c:
                targets[0, k] = own[0]
    w_logp = torch.randn(case.b, case.c, dtype=torch.float64, generator=g)
    w_ent = torch.randn(case.b, case.c, dtype=torch.float64, generator=g)
    if case.unit_weights:
        w_logp, w_ent = torch.ones_like(w_logp), torch.ones_like(w_ent)
    return logits, targets, restrict, w_logp, w_ent


def _chunk_elements(case: Case) -> int:
    widest = max(e - s for s, e in case.split)
    return 1 << 26 if case.chunk_rows is None else case.chunk_rows * widest


def _loss(logp: Any, ent: Any, case: Case, w_logp: Any, w_ent: Any) -> Any:
    terms = []
    if case.use in ("logp", "both"):
        terms.append((logp.double() * w_logp).sum())
    if case.use in ("ent", "both"):
        terms.append((ent.double() * w_ent).sum())
    return sum(terms)


VALUE_CASES = [
    Case(f"{len(split)}ranks-chunk{rows}-{mask}-t{t}", split, t=t, mask=mask, chunk_rows=rows)
    for split in (SPLIT2, SPLIT3)
    for rows in (1, 2, 7, None)  # 1 row, 2 rows, 7 (across the batch boundary at C = 5), all
    for mask in ("none", "odd", "upper")
    for t in (1.0, 0.7)
] + [
    Case("3ranks-use-logp", SPLIT3, use="logp", chunk_rows=2, t=0.9, mask="odd"),
    Case("3ranks-use-ent", SPLIT3, use="ent", chunk_rows=2, t=0.9, mask="odd"),
    Case("2ranks-bf16", ((0, 32), (32, 64)), dtype="bfloat16", b=2, c=4, chunk_rows=3, mask="upper"),
    Case("3ranks-bf16", ((0, 21), (21, 43), (43, 64)), dtype="bfloat16", b=2, c=4, chunk_rows=3, mask="odd"),
    Case("3ranks-fp32-no-grad", SPLIT3, dtype="float32", use="none", mask="odd"),
    Case("2ranks-no-rows", SPLIT2, b=0, t=0.7, mask="odd"),
    Case("3ranks-no-completion-tokens", SPLIT3, c=0),
]

# a low temperature or a common offset: H taken as lse - sum p x lost 3e-4 in fp32
# (unit weights: the tolerance below is lean_logprobs' own test's, for a gradient of sum H)
EXACT_CASES = [
    Case(
        f"{len(split)}ranks-fp32-{name}",
        split,
        dtype="float32",
        b=2,
        c=4,
        use="ent",
        unit_weights=True,
        scale=scale,
        offset=offset,
        t=t,
    )
    for split in (((0, 500), (500, 1000)), ((0, 333), (333, 667), (667, 1000)))
    for name, scale, offset, t in (("peaked-t0.3", 8.0, 0.0, 0.3), ("offset-100", 3.0, 100.0, 1.0))
]

ERROR_CASES = {
    # case, what every rank's error says (or, per rank, what that rank's says)
    "gap": (Case("gap", ((0, 4), (5, 8), (8, 11))), {0: "do not tile", 1: "do not tile", 2: "do not tile"}),
    "overlap": (
        Case("overlap", ((0, 6), (6, 11)), bad={1: {"start": 5}}),
        {0: "do not tile", 1: "do not tile"},
    ),
    "bad-restrict-on-rank-1": (
        Case("bad-restrict", SPLIT3, mask="odd", bad={1: {"restrict_cols": 3}}),
        {
            0: "rank 1 of 3 refused",
            1: r"rank 1 of 3: restrict_shard must be \[B, V_local\]",
            2: "rank 1 of 3 refused",
        },
    ),
    "temperature-mismatch": (
        Case("t-mismatch", SPLIT3, t=0.7, bad={2: {"t": 0.8}}),
        dict.fromkeys(range(3), "disagree on temperature"),
    ),
    "B-mismatch": (Case("b-mismatch", SPLIT2, bad={0: {"b": 2}}), dict.fromkeys(range(2), "disagree on B")),
    "target-outside-the-vocabulary": (
        Case("target-11", SPLIT3, bad={r: {"target": 11} for r in range(3)}),
        dict.fromkeys(range(3), r"target 11 at flat row 0 is held by 0 ranks"),
    ),
    "zero-temperature-everywhere": (
        Case("t0", SPLIT2, t=0.0),
        dict.fromkeys(range(2), "temperature must be > 0"),
    ),
}

# after the refusals, to show the group is still in step
AFTER_ERRORS = Case("3ranks-after-errors", SPLIT3, t=0.7, mask="odd", chunk_rows=2, seed=5)


def _run(case: Case, rank: int, group: Any) -> dict[str, Any]:
    """This rank's share of one case."""
    logits, targets, restrict, w_logp, w_ent = _inputs(case)
    bad = case.bad.get(rank, {})
    s, e = case.split[rank]
    start = bad.get("start", s)
    shard = logits[..., start:e].clone()
    rs = None if restrict is None else restrict[:, start:e]
    if "restrict_cols" in bad:
        rs = torch.zeros(case.b, bad["restrict_cols"])
    if "b" in bad:
        shard, targets = shard[: bad["b"]], targets[: bad["b"]]
        rs = None if rs is None else rs[: bad["b"]]
    if "target" in bad:
        targets = targets.clone()
        targets[0, 0] = bad["target"]
    t = bad.get("t", case.t)
    shard.requires_grad_(case.use != "none")
    kwargs = {"vocab_start": start, "group": group, "chunk_elements": _chunk_elements(case)}
    try:
        if case.use == "none":
            with torch.no_grad():
                logp, ent = vocab_parallel_logprobs_and_entropy(shard, targets, t, rs, **kwargs)
        else:
            logp, ent = vocab_parallel_logprobs_and_entropy(shard, targets, t, rs, **kwargs)
            loss = _loss(logp, ent, case, w_logp, w_ent)
            if case.b * case.c:
                loss.backward()
            else:  # nothing to sum: still a backward through the function
                (logp.sum() + ent.sum()).backward()
    except (ValueError, RuntimeError) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    grad = None if shard.grad is None else shard.grad.clone()
    return {
        "logp": logp.detach(),
        "ent": ent.detach(),
        "grad": grad,
        "requires_grad": logp.requires_grad,
        "dtype": str(logp.dtype),
    }


def _second_derivative(rank: int, group: Any) -> str:
    case = Case("second-derivative", SPLIT2, t=0.8)
    logits, targets, _, _, _ = _inputs(case)
    s, e = case.split[rank]
    a = logits[..., s:e].clone().requires_grad_(True)
    logp, ent = vocab_parallel_logprobs_and_entropy(a, targets, 0.8, vocab_start=s, group=group)
    out = logp + 0.5 * ent
    (g,) = torch.autograd.grad(out, a, torch.ones_like(out), create_graph=True)
    try:
        torch.autograd.grad((g**2).sum(), a)
    except RuntimeError as err:
        return str(err)
    return "no error"


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own connections on the loopback too
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD + 1, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        pair = dist.new_group([0, 1])  # every rank makes it; only 0 and 1 use it
        results: dict[str, Any] = {}

        def run(case: Case) -> None:
            if len(case.split) == WORLD:
                results[case.name] = _run(case, rank, None)
            elif rank < 2:
                results[case.name] = _run(case, rank, pair)

        for case in VALUE_CASES + EXACT_CASES:
            run(case)
        for case, _ in ERROR_CASES.values():
            run(case)
        run(AFTER_ERRORS)
        if rank < 2:
            results["second-derivative"] = _second_derivative(rank, pair)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results, from one world of ``WORLD`` processes."""
    import time

    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("tp")
    # the parent holds the store on a port the OS picked (no race for a "free" port); the
    # ranks connect to it as clients
    store = dist.TCPStore("127.0.0.1", 0, WORLD + 1, is_master=True, wait_for_workers=False)
    ctx = mp.spawn(_worker, args=(store.port, str(out)), nprocs=WORLD, join=False)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"the {WORLD} gloo ranks did not finish within {TIMEOUT_S} s")
    finally:
        for p in ctx.processes:  # nothing left running, whatever happened
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        del store
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _ranks_of(case: Case, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [ranks[r][case.name] for r in range(len(case.split))]


def _reference(case: Case) -> tuple[Any, Any, Any]:
    logits, targets, restrict, w_logp, w_ent = _inputs(case)
    a = logits.clone().requires_grad_(True)
    logp, ent = logprobs_and_entropy(a, targets, case.t, restrict, chunk_elements=_chunk_elements(case))
    if case.use != "none":
        loss = _loss(logp, ent, case, w_logp, w_ent)
        if case.b * case.c:
            loss.backward()
        else:
            (logp.sum() + ent.sum()).backward()
    return logp.detach(), ent.detach(), a.grad


def _check_against_reference(case: Case, got: list[dict[str, Any]], *, values: float, grads: float) -> None:
    for r in got:
        assert "error" not in r, r["error"]
    ref_logp, ref_ent, ref_grad = _reference(case)
    for r in got:  # every rank holds the same numbers: the loss is the same on each
        assert torch.equal(r["logp"], got[0]["logp"]) and torch.equal(r["ent"], got[0]["ent"])
        assert r["dtype"] == str(ref_logp.dtype)
        torch.testing.assert_close(r["logp"], ref_logp, atol=values, rtol=values)
        torch.testing.assert_close(r["ent"], ref_ent, atol=values, rtol=values)
    if case.use == "none":
        assert not any(r["requires_grad"] for r in got)
        return
    # each rank's gradient is its own columns of the full one
    grad = torch.cat([r["grad"] for r in got], dim=-1)
    assert grad.dtype == ref_grad.dtype
    torch.testing.assert_close(grad.double(), ref_grad.double(), atol=grads, rtol=grads)
    if case.mask != "none" and case.b * case.c:
        _, _, restrict, _, _ = _inputs(case)
        assert bool((grad[..., restrict[0] != 0] == 0).all()), "a masked id got a gradient"


@pytest.mark.parametrize("case", VALUE_CASES, ids=[c.name for c in VALUE_CASES])
def test_values_and_gradients_are_the_single_process_ones(case: Case, ranks: list[dict[str, Any]]) -> None:
    got = _ranks_of(case, ranks)
    if case.b * case.c:
        _, targets, _, _, _ = _inputs(case)
        for s, e in case.split:  # the case puts a target on every rank that has an allowed id
            assert (case.mask == "upper" and s >= 6) or bool(((targets >= s) & (targets < e)).any())
    if case.dtype == "bfloat16":
        # both take fp32 from the same bf16 numbers; the gradients are rounded to bf16
        _check_against_reference(case, got, values=1e-5, grads=1e-2)
    elif case.dtype == "float32":
        _check_against_reference(case, got, values=1e-5, grads=1e-5)
    else:
        # float64 on both paths: what is left is the order of the sums
        _check_against_reference(case, got, values=1e-12, grads=1e-12)


@pytest.mark.parametrize("case", EXACT_CASES, ids=[c.name for c in EXACT_CASES])
def test_fp32_entropy_is_exact_for_large_scaled_logits(case: Case, ranks: list[dict[str, Any]]) -> None:
    got = _ranks_of(case, ranks)
    for r in got:
        assert "error" not in r, r["error"]
    logits, targets, _, _, _ = _inputs(case)
    b = logits.double().requires_grad_(True)
    logp = torch.log_softmax(b / case.t, dim=-1)
    exact = -(logp.exp() * logp).sum(-1)
    exact_logp = logp.gather(-1, targets[..., None]).squeeze(-1)
    exact.sum().backward()
    # as lean_logprobs' own test: within the rounding of the row's logsumexp (~103 here)
    torch.testing.assert_close(got[0]["ent"].double(), exact.detach(), atol=3e-5, rtol=0)
    torch.testing.assert_close(got[0]["logp"].double(), exact_logp.detach(), atol=3e-5, rtol=0)
    grad = torch.cat([r["grad"] for r in got], dim=-1)
    torch.testing.assert_close(grad.double(), b.grad, atol=3e-5, rtol=0)


@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_bad_inputs_are_refused_on_every_rank(name: str, ranks: list[dict[str, Any]]) -> None:
    case, want = ERROR_CASES[name]
    got = _ranks_of(case, ranks)
    for r, (res, pattern) in enumerate(zip(got, [want[k] for k in range(len(got))], strict=True)):
        assert "error" in res, f"rank {r} was not refused"
        assert res["error"].startswith("ValueError"), res["error"]
        assert re.search(pattern, res["error"]), f"rank {r}: {res['error']}"


def test_the_group_stays_in_step_after_refusals(ranks: list[dict[str, Any]]) -> None:
    _check_against_reference(AFTER_ERRORS, _ranks_of(AFTER_ERRORS, ranks), values=1e-12, grads=1e-12)


def test_a_second_derivative_is_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for r in range(2):
        assert "no second derivative" in ranks[r]["second-derivative"]


def test_without_a_process_group_it_says_what_to_use() -> None:
    if dist.is_initialized():  # the parent never joins the ranks' world; another test's may be live
        pytest.skip("a process group made by another test is live in this process")
    with pytest.raises(RuntimeError, match="logprobs_and_entropy"):
        vocab_parallel_logprobs_and_entropy(
            torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), vocab_start=0
        )
