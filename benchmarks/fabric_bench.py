"""The fabric SDK's benchmark figures (issue: fabric SDK), one JSON object per line.

    .venv/bin/python benchmarks/fabric_bench.py            # all runs, ~2 minutes on 2 cores
    .venv/bin/python benchmarks/fabric_bench.py --repeat 5 # the straggler runs 5 times

Each run is `fabric bench` with a baseline measured in the same run:
  throughput   exact_match, n=20000, concurrency 64, local pools vs round-robin Ray actors
  overhead     exact_match, n=5000, concurrency 1, pool call vs direct in-process call
  stragglers   exact_match, n=20000, concurrency 64, 1% of replies held 200 ms, hedging on vs off
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

FABRIC = str(Path(sys.executable).with_name("fabric"))


def bench(*args: str) -> dict:
    out = subprocess.run(
        [FABRIC, "bench", "exact_match", *args, "--json"], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3, help="straggler runs (the no-hedge p99 is noisy at 1%%)")
    args = ap.parse_args()
    # the Ray baseline runs last: its processes linger a few seconds after shutdown
    r = bench("--n", "5000", "--concurrency", "1")
    print(
        json.dumps(
            {
                "run": "overhead",
                "p50_ms": r["p50_ms"],
                "direct_p50_ms": r["direct_p50_ms"],
                "overhead_p50_ms": r["overhead_p50_ms"],
            }
        )
    )
    for rate in ("0.01", "0.02"):
        for i in range(args.repeat):
            r = bench(
                "--n",
                "20000",
                "--concurrency",
                "64",
                "--straggler-rate",
                rate,
                "--straggler-ms",
                "200",
                "--compare-hedge",
            )
            keys = (
                "hedge_on_p99_ms",
                "hedge_off_p99_ms",
                "p99_ratio_off_vs_on",
                "hedge_on_p999_ms",
                "hedge_off_p999_ms",
                "hedge_on_slow_share",
                "hedge_off_slow_share",
                "hedges",
            )
            print(json.dumps({"run": f"stragglers rate={rate} #{i + 1}", **{k: r[k] for k in keys}}))

    keep = ("throughput_per_s", "p50_ms", "p99_ms", "baseline_throughput_per_s", "ratio_vs_baseline")
    r = bench("--n", "20000", "--concurrency", "64", "--baseline", "ray")
    print(json.dumps({"run": "throughput", **{k: r[k] for k in keep}, "cold_start_ms": r["cold_start_ms"]}))


if __name__ == "__main__":
    main()
