"""Batch-level synchronous vs trajectory-level asynchronous rollout, and redundant rollouts,
on the real job (Ray actors, fabric reward pool, process containers).

    .venv/bin/python benchmarks/rollout_modes.py                 # both experiments, ~6 minutes
    .venv/bin/python benchmarks/rollout_modes.py --only modes    # or: --only redundancy

The environment is ``latency-v0``: each step sleeps N(mu, sigma) seconds in its container
(a tool call, a compile, a simulator tick), so the rollout's long tail is the environment's,
as in agentic RL. The policy is a tiny TinyLM replying one word (its cost is not what is
measured); the trainer trains it for real.

* **modes**: for sigma/mu in {0.1, 0.5, 1.0}, the same job in ``rollout.mode: sync``
  (a step's groups start together, every turn waits for the whole batch, the trainer waits
  for the last trajectory) and ``async`` (trajectory-level loops, groups keep starting
  within ``alpha``=1). Reported: mean step time (first ``--warmup`` steps excluded) and the
  ratio sync/async.
* **redundancy**: 5% of rollouts are slow (10x) or failing (the container dies mid-episode;
  ``tail: rollout``, so the slowness is the machine's, not the task's: another rollout of
  the same task, or the replay in a fresh container, escapes it), async
  mode, ``redundancy`` 0 vs 2 extra rollouts per group, under ``alpha`` 0 (the trainer
  waits for each batch: the tail is on the critical path) and 1 (the next batch is already
  rolling: the buffer hides much of the tail). Reported: step time, aborted trajectories,
  and how many aborted ones reached the trainer (must be 0).

One Ray cluster serves every run; each run is a fresh ``Job`` (new actors, pools, containers).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from core.config import JobConfig
from core.job import Job


def config(
    *,
    mode: str,
    mu: float,
    sigma: float,
    steps: int,
    run_dir: str,
    redundancy: int = 0,
    slow_prob: float = 0.0,
    fail_prob: float = 0.0,
    batch_size: int = 4,
    group_size: int = 4,
    turns: int = 4,
    alpha: int = 1,
    tail: str = "task",
) -> JobConfig:
    return JobConfig.from_dict(
        {
            "engine": {
                "backend": "torch",
                "max_new_tokens": 1,
                "kwargs": {"d_model": 16, "n_layers": 1, "n_heads": 2, "max_len": 64},
            },
            "envs": [
                {
                    "id": "latency-v0",
                    "tag": "latency",
                    "max_turns": turns,
                    "kwargs": {
                        "mu_s": mu,
                        "sigma_s": sigma,
                        "turns": turns,
                        "slow_prob": slow_prob,
                        "slow_factor": 10.0,
                        "fail_prob": fail_prob,
                        "tail": tail,
                    },
                    "actions": ["go", "wait"],
                    "prompt": {"history": 0},
                }
            ],
            "rewards": {"latency": [{"function": "env_return"}]},
            "batch_size": batch_size,
            "group_size": group_size,
            "redundancy": redundancy,
            "alpha": alpha,
            "steps": steps,
            "trainer": {"lr": 1e-3},
            "rollout": {"mode": mode, "eval_every": 0, "max_reruns": 8, "trajectory_timeout_s": 120},
            "fabric": {"backend": "local", "workers": 1},
            "envpool": {
                "runtime": "process",
                "min_warm": batch_size * (group_size + redundancy),
                "max_containers": 4 * batch_size * (group_size + redundancy),
                # a dead container is replaced quickly; the failing episode then fails again
                "retry": {"attempts": 2, "initial_backoff_s": 0.05, "max_backoff_s": 0.2},
            },
            "run_dir": run_dir,
            "seed": 0,
        }
    )


async def run_one(cfg: JobConfig, warmup: int) -> dict[str, Any]:
    job = Job(cfg, progress=False)
    summary = await job.run()
    assert job.run_dir is not None
    rows = job.run_dir.rows  # the train rows, as written to metrics.jsonl
    walls = [r["wall_s"] for r in rows]
    steps = [b - a for a, b in zip(walls[warmup:], walls[warmup + 1 :], strict=False)]
    return {
        "mode": cfg.rollout.mode,
        "redundancy": cfg.redundancy,
        "step_s_mean": round(statistics.fmean(steps), 3),
        "step_s_median": round(statistics.median(steps), 3),
        "steps_timed": len(steps),
        "aborted": summary["groups"].get("aborted", 0),
        "redundant_aborted": summary["groups"].get("redundant_aborted", 0),
        "infra_failed": summary["trajectories"].get("infra_failed", 0),
        "reruns": summary["groups"].get("reruns", 0),
        "aborted_trained": summary["aborted_trained"],
        "masked_trained": summary["masked_trained"],
        "wall_s": summary["wall_s"],
    }


async def modes(args: argparse.Namespace, tmp: str) -> list[dict[str, Any]]:
    out = []
    for ratio in args.ratios:
        row: dict[str, Any] = {"sigma_over_mu": ratio, "mu_s": args.mu}
        for mode in ("sync", "async"):
            cfg = config(
                mode=mode,
                mu=args.mu,
                sigma=ratio * args.mu,
                steps=args.steps,
                run_dir=f"{tmp}/{mode}-{ratio}",
            )
            r = await run_one(cfg, args.warmup)
            row[mode] = r
            print(f"  sigma/mu={ratio} {mode}: step {r['step_s_mean']} s", file=sys.stderr, flush=True)
        row["speedup_async_over_sync"] = round(row["sync"]["step_s_mean"] / row["async"]["step_s_mean"], 2)
        out.append(row)
    return out


async def redundancy(args: argparse.Namespace, tmp: str) -> list[dict[str, Any]]:
    out = []
    for alpha in args.redundancy_alphas:
        res: dict[str, Any] = {"alpha": alpha, "slow_prob": 0.04, "fail_prob": 0.01, "slow_factor": 10.0}
        res["mu_s"] = args.mu
        for red in (0, 2):
            cfg = config(
                mode="async",
                mu=args.mu,
                sigma=0.1 * args.mu,
                steps=args.redundancy_steps,
                run_dir=f"{tmp}/redundancy-{alpha}-{red}",
                redundancy=red,
                slow_prob=0.04,
                fail_prob=0.01,
                alpha=alpha,
                tail="rollout",  # straggling/crashing machines: another rollout escapes them
            )
            r = await run_one(cfg, args.warmup)
            res[f"redundancy_{red}"] = r
            print(f"  alpha={alpha} redundancy={red}: step {r['step_s_mean']} s", file=sys.stderr, flush=True)
        res["speedup_redundant"] = round(
            res["redundancy_0"]["step_s_mean"] / res["redundancy_2"]["step_s_mean"], 2
        )
        out.append(res)
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        num_cpus=os.cpu_count() or 1,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
    )
    t0 = time.perf_counter()
    result: dict[str, Any] = {"benchmark": "rollout_modes", "cpus": os.cpu_count()}
    try:
        with tempfile.TemporaryDirectory(prefix="rollout-modes-") as tmp:
            if args.only in (None, "modes"):
                result["modes"] = await modes(args, tmp)
            if args.only in (None, "redundancy"):
                result["redundancy"] = await redundancy(args, tmp)
    finally:
        ray.shutdown()
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["modes", "redundancy"])
    ap.add_argument("--mu", type=float, default=0.2, help="mean environment step latency (s)")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.5, 1.0], help="sigma/mu values")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="first steps not timed")
    ap.add_argument("--redundancy-steps", type=int, default=16)
    ap.add_argument(
        "--redundancy-alphas",
        type=int,
        nargs="+",
        default=[0, 1],
        help="asynchronous bounds to compare redundancy 0 vs 2 under (0: the trainer waits for every batch)",
    )
    args = ap.parse_args()
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
