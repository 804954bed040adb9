"""`make demo`: a short showcase of the fabric (the RL job will take this slot once it exists).

It registers a reward and a tool in a script, calls them through the local warm pools,
shows a user error coming back as data, and runs a small benchmark against a direct call.
"""

from __future__ import annotations

import asyncio
import json
import time

from rich.console import Console

import fabric
from fabric.bench import BenchConfig, run_bench

console = Console()


# a user-defined reward and tool: plain Python, one decorator each
@fabric.reward(warm=1, examples=({"traj": "The answer is 12.", "ground_truth": "12"},))
def length_penalised_match(traj: fabric.Trajectory | str, *, ground_truth: str) -> fabric.RewardResult:
    """Exact match, minus a small penalty for long answers."""
    text = traj if isinstance(traj, str) else traj.final_text()
    match = 1.0 if ground_truth in text else 0.0
    penalty = min(len(text) / 2000, 0.2)
    return fabric.RewardResult(score=match - penalty, components={"match": match, "length_penalty": -penalty})


@fabric.tool(warm=1)
def calculator(expression: str) -> str:
    """Evaluate + - * / on numbers (no names, no calls)."""
    allowed = set("0123456789+-*/(). ")
    if not set(expression) <= allowed:
        raise ValueError(f"unsupported characters in {expression!r}")
    return str(eval(expression, {"__builtins__": {}}, {}))


async def main() -> None:
    console.rule("[bold]rl-fabric demo[/] (the fabric SDK; the RL job is not built yet)")
    fabric.default_registry.discover("functions")  # the built-ins, exact_match among them
    console.print("registered:", ", ".join(fabric.default_registry.names()))
    traj = fabric.Trajectory(
        messages=[
            fabric.Message(role="user", content="What is 3 * 4?"),
            fabric.Message(
                role="assistant", content="3 * 4 = 12, so the answer is \\boxed{12}.", policy_version=3
            ),
        ],
        task={"ground_truth": "12"},
    )
    async with fabric.Client(backend="local") as client:
        t0 = time.perf_counter()
        await client.backend.warmup()
        console.print(
            f"warm pools ready in {(time.perf_counter() - t0) * 1e3:.0f} ms: "
            f"{ {k: v['ready'] for k, v in client.backend.stats().items()} }"
        )
        r = await client.call("exact_match", {"traj": traj, "ground_truth": "12"}, idempotency_key=traj.id)
        console.print(f"exact_match -> {r.value}  (worker {r.worker}, {r.timings.total_ms:.2f} ms)")
        r = await client.call("length_penalised_match", {"traj": traj, "ground_truth": "12"})
        console.print(f"length_penalised_match -> {json.dumps(r.value)}")
        r = await client.call("calculator", {"expression": "(3 + 4) * 6"})
        console.print(f"calculator('(3 + 4) * 6') -> {r.value}")
        r = await client.call("calculator", {"expression": "__import__('os')"})
        console.print(f"a handler that raises is data: ok={r.ok} {r.error.type}: {r.error.message}")
        rs = await client.map(
            "exact_match", [{"traj": f"the answer is {i}", "ground_truth": "7"} for i in range(10)]
        )
        console.print(f"map over 10 payloads -> {[r.value for r in rs]}")
    console.rule("bench: exact_match, 5,000 calls at concurrency 64, local pools vs a direct call")
    out = await run_bench(
        BenchConfig(function="exact_match", n=5000, concurrency=64), fabric.default_registry
    )
    keys = ("throughput_per_s", "p50_ms", "p99_ms", "overhead_p50_ms", "cold_start_ms", "errors")
    console.print_json(json.dumps({k: round(out[k], 3) for k in keys}))
    console.print("Full benchmark with the Ray-actor baseline: [bold]make bench[/]")


if __name__ == "__main__":
    asyncio.run(main())
