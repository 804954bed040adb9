"""Replay of a real rollout's trace in the simulator.

The LLM proxy's turn scheduler writes one JSON line per turn (``rollout.trace: true`` in a
job, ``<run_dir>/trace.jsonl``)::

    {"trajectory": "...", "turn": 0, "ready": 0.012, "start": 0.013, "end": 0.41,
     "prompt_tokens": 57, "gen_tokens": 24, "outcome": null, "replica": "default-0", ...}

(times in seconds from the proxy's start). ``trace_workload`` turns it back into what the
simulator runs: each trajectory's turns with their generated tokens, the time its tool or
environment call took (the next turn's ``ready`` minus this turn's ``end``: everything the
trajectory did away from the engine) and the tool outcome the next turn reported, plus
when the trajectory started. Running the simulator on it with the engine's measured
profile (``core.sim.calibrate``) and comparing makespans checks the simulator against the
real path.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from core.sched.base import Outcome
from core.sim.workload import TrajSpec, Turn

_OUTCOMES = set(get_args(Outcome))
_REQUIRED = ("trajectory", "turn", "ready", "start", "end", "gen_tokens")


class TraceError(ValueError):
    """A trace that cannot be replayed: says which line and what is wrong."""


@dataclass(frozen=True)
class TraceTurn:
    trajectory: str
    turn: int
    ready: float
    start: float
    end: float
    gen_tokens: int
    prompt_tokens: int = 0
    outcome: Outcome | None = None
    replica: str | None = None


def load_trace(path: str | Path) -> list[TraceTurn]:
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"no trace at {path}; run the job with rollout.trace: true to write one")
    out = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                out.append(_parse(line, f"{path}:{n}"))
    if not out:
        raise TraceError(f"{path} holds no turns")
    return out


def _parse(line: str, where: str) -> TraceTurn:
    try:
        row: Any = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: a turn is a JSON object, got {type(row).__name__}")
    missing = [k for k in _REQUIRED if k not in row]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    try:
        turn = TraceTurn(
            trajectory=str(row["trajectory"]),
            turn=int(row["turn"]),
            ready=float(row["ready"]),
            start=float(row["start"]),
            end=float(row["end"]),
            gen_tokens=int(row["gen_tokens"]),
            prompt_tokens=int(row.get("prompt_tokens") or 0),
            outcome=row.get("outcome") if row.get("outcome") in _OUTCOMES else None,
            replica=row.get("replica"),
        )
    except (TypeError, ValueError) as e:
        raise TraceError(f"{where}: {e}") from None
    # JSON's Infinity parses: a -inf ready made every start inf, an inf end the makespan
    if not all(math.isfinite(x) for x in (turn.ready, turn.end)):
        raise TraceError(f"{where}: ready, start and end must be finite numbers of seconds")
    if not turn.ready <= turn.start <= turn.end or min(turn.gen_tokens, turn.prompt_tokens, turn.turn) < 0:
        raise TraceError(
            f"{where}: needs ready <= start <= end, gen_tokens >= 0, prompt_tokens >= 0 and turn >= 0"
        )
    return turn


@dataclass
class TraceWorkload:
    trajectories: list[TrajSpec]
    starts_ms: dict[str, float]
    """When each trajectory's first turn became ready, from the trace's first turn."""
    makespan_ms: float
    """From the first turn ready to the last turn's end: what the real run took."""
    skipped: int = 0
    """Trajectories left out: a turn missing in the middle (the trace was cut)."""


def trace_workload(turns: Iterable[TraceTurn]) -> TraceWorkload:
    by_traj: dict[str, list[TraceTurn]] = {}
    for t in turns:
        by_traj.setdefault(t.trajectory, []).append(t)
    if not by_traj:
        raise TraceError("the trace holds no turns")
    t0 = min(t.ready for ts in by_traj.values() for t in ts)
    specs, starts, skipped = [], {}, 0
    for tid, ts in by_traj.items():
        ts.sort(key=lambda t: t.turn)
        if [t.turn for t in ts] != list(range(len(ts))):
            skipped += 1
            continue
        spec_turns = []
        for k, t in enumerate(ts):
            nxt = ts[k + 1] if k + 1 < len(ts) else None
            tool_ms = 1000 * max(nxt.ready - t.end, 0.0) if nxt else 0.0
            outcome = nxt.outcome if nxt is not None and nxt.outcome is not None else "ok"
            # what joined the context besides the reply: the tool's output
            tool_tokens = max(nxt.prompt_tokens - t.prompt_tokens - t.gen_tokens, 0) if nxt else 0
            spec_turns.append(Turn(t.gen_tokens, tool_ms, outcome, tool_tokens))
        specs.append(TrajSpec(tid, ts[0].prompt_tokens, tuple(spec_turns)))
        starts[tid] = 1000 * (ts[0].ready - t0)
    if not specs:
        raise TraceError(f"every trajectory of the trace has a missing turn ({skipped} skipped)")
    end = max(t.end for ts in by_traj.values() for t in ts)
    return TraceWorkload(specs, starts, 1000 * (end - t0), skipped)
