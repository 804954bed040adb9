"""CPU of the C/C++ verifier's declaration read (``functions/verifiers/native/cdecls.py``) of a
``#include <bits/stdc++.h>`` program, without and with libclang's precompiled header of the
library (``native_pch.clang_header``).

    .venv/bin/python benchmarks/clang_pch_read.py               # ~30 s on 2 cores
    .venv/bin/python benchmarks/clang_pch_read.py --rounds 15

Prints one JSON object. The header is built once into a temporary directory (as the
verifier builds its own at first use); then each round reads a program (its text differs
from round to round) once without the header and once with it, alternating which goes
first, each read a ``python cdecls.py`` child process as the sandbox runs it (no sandbox
here: the figure is the read's own). CPU is the child's user + system time; both reads'
outputs must be equal and the read with the header must say it used it, or the run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from functions.verifiers import native, native_pch

PROGRAM = (
    "#include<assert.h>\n#include<bits/stdc++.h>\nusing namespace std;\n"
    "std::vector<long> incr_list_{i}(std::vector<long> l) {{ for (auto& x : l) x += {i}; return l; }}\n"
    "long long add(long long a, long long b) {{ return a + b; }}\n"
)


def read(work: Path, code: str, pch: str | None) -> tuple[str, float, float]:
    """``cdecls.py``'s stdout for ``code``, and the read's CPU and wall seconds."""
    run = Path(tempfile.mkdtemp(dir=work))
    for name, data in native.parse_files("cpp", code, pch).items():
        (run / name).write_bytes(data)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "cdecls.py"], cwd=run, capture_output=True, timeout=300)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"the read failed: {done.stderr.decode(errors='replace')[-2000:]}")
    if pch is not None and "rlfabric: read after the precompiled header" not in done.stderr.decode():
        sys.exit(f"the read did not use the precompiled header: {done.stderr.decode(errors='replace')}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return done.stdout.decode(), cpu, wall


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="reads of each kind (%(default)s), after a warm-up")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    if not native.available():
        sys.exit("libclang is not installed: pip install 'rl-fabric[verifiers]'")
    with tempfile.TemporaryDirectory(prefix="rlfabric-pch-bench-") as tmp:
        work = Path(tmp)
        # the verifier's directory is root's and shared: this run builds its own
        native_pch.PCH_DIR = str(work)
        native_pch.prepare_pch_dir = lambda: (str(work),)
        t0 = time.perf_counter()
        header = native_pch.clang_header(native.CLANG_PCH_TEXT, native.parse_args("cpp"))
        build_s = time.perf_counter() - t0
        if header is None:
            sys.exit("libclang could not build the precompiled header")
        pch = header + ".pch"
        cpu: dict[str, list[float]] = {"without": [], "with": []}
        wall: dict[str, list[float]] = {"without": [], "with": []}
        for i in range(a.rounds + 1):
            code = PROGRAM.format(i=i)
            order = [("without", None), ("with", pch)]
            outs = {}
            for kind, p in order if i % 2 == 0 else order[::-1]:
                outs[kind], c, w = read(work, code, p)
                if i:  # round 0 warms the page cache for both
                    cpu[kind].append(c)
                    wall[kind].append(w)
            if outs["with"] != outs["without"]:
                sys.exit(f"the reads differ for round {i}: {outs}")
        p50 = {k: statistics.median(v) for k, v in cpu.items()}
        print(
            json.dumps(
                {
                    "bench": "clang_pch_read",
                    "rounds": a.rounds,
                    "pch_mb": round(os.path.getsize(pch) / 2**20, 1),
                    "pch_build_s": round(build_s, 2),
                    "cpu_p50_s_without": round(p50["without"], 3),
                    "cpu_p50_s_with": round(p50["with"], 3),
                    "cpu_ratio_without_vs_with": round(p50["without"] / p50["with"], 2),
                    "wall_p50_s_without": round(statistics.median(wall["without"]), 3),
                    "wall_p50_s_with": round(statistics.median(wall["with"]), 3),
                    "load_avg_1m": round(os.getloadavg()[0], 2),
                }
            )
        )


if __name__ == "__main__":
    main()
