"""Peak memory and time of the trainer's logprob + entropy step: the plain path (fp32 copies
of the whole ``[B, C, V]`` logits, as the trainers did before) against ``lean_logprobs``
(fp32 a chunk of rows at a time, the softmax taken again in the backward pass).

    python benchmarks/logprob_memory.py                      # CUDA if there is one, else CPU
    python benchmarks/logprob_memory.py --vocab 151936 --batch 4 --tokens 1024 --rounds 3

Prints one JSON object. Both variants run in the same process (CUDA: peak allocated bytes
over the logits themselves, from ``torch.cuda.max_memory_allocated``) or, on CPU, each in a
child process of its own (peak RSS over the child's RSS once its logits exist), alternated
``--rounds`` times; times are forward + backward, the median of the rounds.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.trainer.grpo import entropy, token_logprobs
from core.trainer.lean_logprobs import logprobs_and_entropy


def _inputs(a: argparse.Namespace, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn(a.batch, a.tokens, a.vocab, generator=g).to(device=device, dtype=torch.bfloat16)
    targets = torch.randint(0, a.vocab // 2, (a.batch, a.tokens), generator=g).to(device)
    restrict = torch.zeros(a.batch, a.vocab, device=device)
    restrict[:, a.vocab // 2 :] = -1e9  # a restricted action set, as the trainers see one
    return logits.requires_grad_(True), targets, restrict


def _step(
    variant: str, logits: torch.Tensor, targets: torch.Tensor, restrict: torch.Tensor, t: float
) -> float:
    if variant == "plain":
        x = logits.float() + restrict[:, None, :]
        logp, ent = token_logprobs(x, targets, t), entropy(x, t)
    else:
        logp, ent = logprobs_and_entropy(logits, targets, t, restrict)
    loss = -logp.mean() - 0.01 * ent.mean()  # an entropy bonus: both outputs carry gradients
    loss.backward()  # type: ignore[no-untyped-call]
    return float(loss.detach())


def _cuda_round(variant: str, a: argparse.Namespace) -> dict[str, float]:
    logits, targets, restrict = _inputs(a, "cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss = _step(variant, logits, targets, restrict, a.temperature)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base
    del logits, targets, restrict
    torch.cuda.empty_cache()
    return {"s": dt, "peak_bytes": float(peak), "loss": loss}


def _cpu_child(variant: str, a: argparse.Namespace) -> dict[str, float]:
    """One round in a fresh process: ru_maxrss is a high-water mark that never comes down."""
    logits, targets, restrict = _inputs(a, "cpu")
    before = _rss_bytes()
    t0 = time.perf_counter()
    loss = _step(variant, logits, targets, restrict, a.temperature)
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"s": dt, "peak_bytes": float(max(peak, 0)), "loss": loss}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=None, help="completion tokens per sample")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--child", choices=["plain", "lean"], help=argparse.SUPPRESS)
    a = p.parse_args()
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if a.tokens is None:
        a.tokens = 1024 if device == "cuda" else 64  # CPU: 4 x 64 x 151,936 is already 78 MB of bf16
    if a.child:
        print(json.dumps(_cpu_child(a.child, a)))
        return
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "lean": []}
    for _ in range(a.rounds):
        for variant in ("plain", "lean"):  # alternated: a drifting machine hits both alike
            if device == "cuda":
                runs[variant].append(_cuda_round(variant, a))
            else:
                cmd = [sys.executable, __file__, "--child", variant, "--device", "cpu"]
                cmd += ["--vocab", str(a.vocab), "--batch", str(a.batch), "--tokens", str(a.tokens)]
                cmd += ["--temperature", str(a.temperature)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                runs[variant].append(json.loads(out.strip().splitlines()[-1]))
    res: dict[str, object] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "shape": [a.batch, a.tokens, a.vocab],
        "logits_bytes": a.batch * a.tokens * a.vocab * 2,
        "rounds": a.rounds,
    }
    peak = {v: max(r["peak_bytes"] for r in rs) / 2**20 for v, rs in runs.items()}
    med = {v: statistics.median(r["s"] for r in rs) for v, rs in runs.items()}
    for v in runs:
        res[f"{v}_peak_mb"] = round(peak[v], 1)
        res[f"{v}_median_s"] = round(med[v], 4)
    res["peak_ratio_plain_vs_lean"] = round(peak["plain"] / max(peak["lean"], 1e-9), 2)
    res["time_ratio_lean_vs_plain"] = round(med["lean"] / med["plain"], 2)
    res["loss_diff"] = abs(runs["plain"][0]["loss"] - runs["lean"][0]["loss"])
    print(json.dumps(res))


if __name__ == "__main__":
    main()
