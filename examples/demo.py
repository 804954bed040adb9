"""`make showcase`: a one-minute tour of the fabric and envpool (`make demo` runs the RL job).

Part 1, the fabric: a reward and a tool registered in this script are called through the
local warm pools; a user error comes back as data; a small benchmark against a direct call.
Part 2, envpool: environments in containers (zygote-forked processes with their own
network namespace): a FrozenLake episode, then a math episode whose calculator calls the
container brokers through the pool to the fabric. The "policy" is scripted here; in the RL
job it is the LLM.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import deque

from rich.console import Console

import envpool
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
def word_count(text: str) -> int:
    """Count the words of a text."""
    return len(text.split())


async def main() -> None:
    console.rule("[bold]rl-fabric showcase[/] (the fabric SDK and envpool; `make demo` runs the RL job)")
    fabric.default_registry.discover("functions")  # the built-ins (rewards, verifiers, tools)
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
        # the built-ins this tour calls (llm_judge, registered too, needs RL_FABRIC_JUDGE_MODEL)
        await client.backend.warmup(
            ["exact_match", "length_penalised_match", "word_count", "calculator", "code_verify"]
        )
        console.print(
            f"warm pools ready in {(time.perf_counter() - t0) * 1e3:.0f} ms: "
            f"{ {k: v['ready'] for k, v in client.backend.stats().items()} }"
        )
        r = await client.call("exact_match", {"traj": traj, "ground_truth": "12"}, idempotency_key=traj.id)
        console.print(f"exact_match -> {r.value}  (worker {r.worker}, {r.timings.total_ms:.2f} ms)")
        r = await client.call("length_penalised_match", {"traj": traj, "ground_truth": "12"})
        console.print(f"length_penalised_match -> {json.dumps(r.value)}")
        r = await client.call("word_count", {"text": "tools are functions too"})
        console.print(f"word_count('tools are functions too') -> {r.value}")
        r = await client.call("calculator", {"expression": "(3 + 4) * 6"})
        console.print(f"built-in calculator('(3 + 4) * 6') -> {r.value}")
        r = await client.call("calculator", {"expression": "__import__('os')"})
        console.print(f"a handler that raises is data: ok={r.ok} {r.error.type}: {r.error.message}")
        program = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
        cases = [{"stdin": "2 3", "expected_stdout": "5"}, {"stdin": "10 -4", "expected_stdout": "6"}]
        r = await client.call("code_verify", {"traj": program, "tests": cases})
        verdicts = [c["status"] for c in r.value["info"]["cases"]] if r.ok else r.error
        console.print(
            f"code_verify (sandboxed, warm) -> score {r.value['score'] if r.ok else '-'} {verdicts}"
        )
        r = await client.call(
            "python", {"code": "import socket\nsocket.create_connection(('127.0.0.1', 22))"}
        )
        last = (
            next((line for line in str(r.value).splitlines() if "Error" in line), r.value)
            if r.ok
            else r.error
        )
        console.print(f"python tool, no network in the sandbox -> {last}")
        rs = await client.map(
            "exact_match", [{"traj": f"the answer is {i}", "ground_truth": "7"} for i in range(10)]
        )
        console.print(f"map over 10 payloads -> {[r.value for r in rs]}")
    console.rule("bench: exact_match through local pools (5,000 calls at concurrency 64)")
    out = await run_bench(
        BenchConfig(function="exact_match", n=5000, concurrency=64), fabric.default_registry
    )
    keys = ("throughput_per_s", "p50_ms", "p99_ms", "cold_start_ms", "errors")
    console.print_json(json.dumps({k: round(out[k], 3) for k in keys}))
    # the overhead over a direct call means something only one call at a time: at 64 it is
    # mostly the queue (fabric.md, "Bench")
    console.rule("bench: the pools' overhead over a direct call (1,000 calls, one at a time)")
    one = await run_bench(BenchConfig(function="exact_match", n=1000, concurrency=1), fabric.default_registry)
    console.print_json(json.dumps({k: round(one[k], 3) for k in ("p50_ms", "overhead_p50_ms")}))
    console.print("Full benchmark with the Ray-actor baseline: [bold]make bench[/]")
    await envpool_demo()


def shortest_path(grid: list[str]) -> list[str]:
    """The scripted FrozenLake policy: breadth-first search over the map."""
    n = len(grid)
    moves = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
    todo: deque[tuple[tuple[int, int], list[str]]] = deque([((0, 0), [])])
    seen = {(0, 0)}
    while todo:
        (r, c), path = todo.popleft()
        if grid[r][c] == "G":
            return path
        for name, (dr, dc) in moves.items():
            rr, cc = r + dr, c + dc
            if 0 <= rr < n and 0 <= cc < n and (rr, cc) not in seen and grid[rr][cc] != "H":
                seen.add((rr, cc))
                todo.append(((rr, cc), [*path, name]))
    return []


async def envpool_demo() -> None:
    console.rule("envpool: environments in session-affine containers")
    async with fabric.Client(backend="local") as tools:

        async def call_tool(name: str, arguments: dict) -> str:  # the pool's bridge to the fabric
            r = await tools.call(name, arguments)
            return str(r.value) if r.ok else f"error: {r.error.message if r.error else ''}"

        async with envpool.EnvPool({"min_warm": 1}, tool_caller=call_tool) as pool:
            t0 = time.perf_counter()
            async with pool.session("frozenlake-v1") as s:
                obs, info = await s.reset(seed=0)
                console.print(
                    f"claimed container {s.container.id} ({s.container.isolation}) in "
                    f"{(time.perf_counter() - t0) * 1e3:.0f} ms (cold: the first of this pool)"
                )
                console.print(obs.text)
                for action in shortest_path(info["map"]):
                    res = await s.step(action)
                console.print(f"scripted path -> reward {res.reward}, terminated={res.terminated}")
            question = {
                "question": "A crate holds 17 rows of 23 bottles, plus 4 loose ones. How many bottles?",
                "answer": "395",
            }
            async with pool.session("math-tools-v1") as s:
                obs, _ = await s.reset(seed=1, options=question)
                console.print(obs.text.splitlines()[0])
                call = {"tool": "calculator", "arguments": {"expression": "17 * 23 + 4"}}
                res = await s.step(json.dumps(call))
                console.print(f"tool call through the pool and the fabric -> {res.obs.text.splitlines()[0]}")
                number = re.findall(r"-?\d+", res.obs.text)[0]
                res = await s.step(f"Answer: {number}")
                console.print(f"answer {number} -> reward {res.reward}")
            console.print(f"pool: {json.dumps({k: v for k, v in pool.stats().items() if k != 'runtime'})}")
    console.print("Benchmarks: [bold].venv/bin/envpool bench latency | resets | cold-image[/]")


if __name__ == "__main__":
    asyncio.run(main())
