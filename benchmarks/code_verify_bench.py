"""The code verifier's benchmark figures (issue: built-in functions), one JSON object per line.

    .venv/bin/python benchmarks/code_verify_bench.py        # ~1 minute on 2 cores

Both runs are `fabric bench code_verify` on its first example (a trivial Python program,
one stdin/stdout case) through the local backend, hedging off:
  latency     concurrency 1: p50 per run, warm sandbox vs the same verifier starting one
              `python` subprocess per run under the same limits (code_verify_subprocess),
              measured in the same run
  throughput  concurrency 8: runs per second through the warm sandboxes
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

FABRIC = str(Path(sys.executable).with_name("fabric"))


def bench(*args: str) -> dict:
    cmd = [FABRIC, "bench", "code_verify", "--no-hedge", *args, "--json"]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--latency-n", type=int, default=1000, help="timed calls of the latency run (%(default)s)"
    )
    ap.add_argument(
        "--throughput-n", type=int, default=3000, help="timed calls of the throughput run (%(default)s)"
    )
    args = ap.parse_args(argv)
    r = bench("--n", str(args.latency_n), "--concurrency", "1", "--baseline", "fn:code_verify_subprocess")
    print(
        json.dumps(
            {
                "run": "latency",
                "p50_ms": r["p50_ms"],
                "p99_ms": r["p99_ms"],
                "baseline_p50_ms": r["baseline_p50_ms"],
                "p50_ratio_baseline_vs_warm": r["p50_ratio_baseline_vs_main"],
                "errors": r["errors"] + r["baseline_errors"],
            }
        )
    )
    r = bench("--n", str(args.throughput_n), "--concurrency", "8")
    print(
        json.dumps(
            {
                "run": "throughput",
                "runs_per_s": r["throughput_per_s"],
                "p50_ms": r["p50_ms"],
                "errors": r["errors"],
            }
        )
    )


if __name__ == "__main__":
    main()
