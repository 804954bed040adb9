"""Tenant isolation in ``fabric serve``: does a flooding job hurt another job's latency?

One server (its own process, ``fabric serve --tenants``), three tenants: ``victim``,
``flood`` (a quota) and ``flood-unbounded`` (a quota far above what the server holds).
The victim calls the function one call at a time (a reward stream's critical path) and we
report its p50/p99:

* alone (the unloaded value);
* while ``flood`` hammers the same function from another process, with the fabric client
  and many calls in flight (a training job's reward stream gone wild);
* while ``flood-unbounded`` does the same (the same-run baseline: what the quota buys);
* ``--raw-flood``: the flooder ignores 429 and re-sends at once (a misbehaving client);
* ``--flood-rps N``: the flood tenant also has ``max_rps: N`` (pacing: its excess requests
  wait, costing the server nothing, instead of being refused over and over).

The default function is ``io_reward`` (benchmarks/serve_fns.py: 10 ms of waiting, as an LLM
judge): tenants then share the pool's slots, which is what quotas and fair admission
protect. ``--function exact_match`` measures a microsecond function, where the flood's
HTTP parsing itself fills the server's one core.

    .venv/bin/python benchmarks/serve_isolation.py [--calls 1000] [--flood-connections 128]

Prints one JSON object; ``p99_ratio_flooded`` is the figure (goal: <= 2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from fabric.backends.base import LambdaConfig
from fabric.client import Client
from fabric.metrics import percentile
from fabric.registry import Registry

TOKENS = {
    "victim": "victim-token-0123456789abcdef",
    "flood": "flood-token-0123456789abcdef",
    "flood-unbounded": "flood-unbounded-token-0123456789",
}
PAYLOADS: dict[str, dict[str, Any]] = {
    "io_reward": {"answer": "4", "wait_ms": 10.0},
    "exact_match": {"traj": {"messages": [{"role": "assistant", "content": "4"}]}, "ground_truth": "4"},
}
FNS = str(Path(__file__).with_name("serve_fns.py"))

CLIENT_FLOODER = """
import asyncio, sys
from fabric.backends.base import LambdaConfig
from fabric.client import Client
from fabric.registry import Registry
url, token, connections, function = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
payload = {payload}
async def main():
    reg = Registry()
    reg.discover("functions", sys.argv[5])
    cfg = LambdaConfig(endpoint_url=url, token=token, transport="http", max_connections=connections)
    async with Client(backend=cfg, registry=reg) as c:
        async def worker():
            while True:
                await c.call(function, payload, hedge=False)
        await asyncio.gather(*(worker() for _ in range(connections)))
asyncio.run(main())
"""

RAW_FLOODER = """
import asyncio, json, sys
import aiohttp
url, token, connections, function = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
body = json.dumps({payload})
async def main():
    counts = {{}}
    async with aiohttp.ClientSession(headers={{"Authorization": "Bearer " + token}},
                                     connector=aiohttp.TCPConnector(limit=connections)) as s:
        async def worker():
            while True:
                async with s.post(url + f"/2015-03-31/functions/{{function}}/invocations", data=body) as r:
                    await r.read()
                    counts[r.status] = counts.get(r.status, 0) + 1
        await asyncio.gather(*(worker() for _ in range(connections)))
    print(json.dumps({{str(k): v for k, v in counts.items()}}))
asyncio.run(main())
"""


def start_server(
    workdir: Path, flood_quota: int, flood_rps: float | None, function: str
) -> tuple[subprocess.Popen[str], str]:
    tenants = workdir / "tenants.yaml"
    quotas = {"victim": 8, "flood": flood_quota, "flood-unbounded": 100_000}
    rps = f", max_rps: {flood_rps}" if flood_rps else ""
    tenants.write_text(
        "tenants:\n"
        + "".join(
            f"  {name}: {{token: {TOKENS[name]}, max_concurrency: {quotas[name]}"
            + (rps if name == "flood" else "")
            + "}\n"
            for name in TOKENS
        )
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fabric.cli",
            "serve",
            "--port",
            "0",
            "--tenants",
            str(tenants),
            "-f",
            function,
            "-m",
            FNS,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit("fabric serve did not start")
    return proc, json.loads(line)["url"]


async def victim(url: str, calls: int, function: str) -> dict[str, float]:
    reg = Registry()
    reg.discover("functions", FNS)
    payload = PAYLOADS[function]
    cfg = LambdaConfig(endpoint_url=url, token=TOKENS["victim"], transport="http")
    async with Client(backend=cfg, registry=reg) as c:
        for _ in range(100):
            await c.call(function, payload)
        lat = []
        for _ in range(calls):
            r = await c.call(function, payload, hedge=False)
            if not r.ok:
                raise SystemExit(f"victim call failed: {r.error}")
            lat.append(r.timings.total_ms)
    lat.sort()
    return {"p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99), "mean_ms": statistics.fmean(lat)}


def flood(url: str, tenant: str, connections: int, function: str, raw: bool) -> subprocess.Popen[bytes]:
    code = (RAW_FLOODER if raw else CLIENT_FLOODER).format(payload=repr(PAYLOADS[function]))
    return subprocess.Popen(
        [sys.executable, "-c", code, url, TOKENS[tenant], str(connections), function, FNS],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def flooded(url: str, tenant: str, calls: int, args: argparse.Namespace) -> dict[str, float]:
    proc = flood(url, tenant, args.flood_connections, args.function, args.raw_flood)
    try:
        await asyncio.sleep(3.0)  # the flood is at full speed before the victim measures
        return await victim(url, calls, args.function)
    finally:
        proc.terminate()
        proc.wait()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=1000, help="victim calls per phase")
    ap.add_argument("--function", choices=sorted(PAYLOADS), default="io_reward")
    ap.add_argument("--raw-flood", action="store_true", help="the flooder ignores 429 and re-sends at once")
    ap.add_argument("--flood-connections", type=int, default=128)
    ap.add_argument("--flood-quota", type=int, default=8, help="the flood tenant's max_concurrency")
    ap.add_argument("--flood-rps", type=float, default=None, help="the flood tenant's max_rps (pacing)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server, url = start_server(Path(tmp), args.flood_quota, args.flood_rps, args.function)
        try:
            alone = await victim(url, args.calls, args.function)
            quota = await flooded(url, "flood", args.calls, args)
            unbounded = await flooded(url, "flood-unbounded", args.calls, args)
            alone_again = await victim(url, args.calls, args.function)
        finally:
            server.terminate()
            server.wait(timeout=30)
    out = {
        "function": args.function,
        "flooder": "raw (ignores 429)" if args.raw_flood else "fabric client (backs off on 429)",
        "cpus": os.cpu_count(),
        "victim_calls": args.calls,
        "flood_connections": args.flood_connections,
        "flood_quota": args.flood_quota,
        "flood_rps": args.flood_rps,
        "alone": alone,
        "flooded": quota,
        "flooded_unbounded": unbounded,
        "alone_after": alone_again,
        "p99_ratio_flooded": quota["p99_ms"] / alone["p99_ms"],
        "p99_ratio_flooded_unbounded": unbounded["p99_ms"] / alone["p99_ms"],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
