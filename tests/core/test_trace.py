"""Trace replay (``core.sim.trace``) and engine profiling (``core.sim.calibrate``)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
from tiny_models import completion

from core.rollout.engines.base import Completion, Engine, GenerateRequest
from core.sim import Simulator
from core.sim.calibrate import profile_engine
from core.sim.engine import EngineProfile
from core.sim.trace import TraceError, load_trace, trace_workload


def line(traj: str, turn: int, ready: float, start: float, end: float, tokens: int, **kw: Any) -> str:
    row = {"trajectory": traj, "turn": turn, "ready": ready, "start": start, "end": end, "gen_tokens": tokens}
    return json.dumps({**row, **kw})


def write(tmp_path: Path, *lines: str) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_a_trace_becomes_trajectories_with_their_tool_times_outcomes_and_starts(tmp_path):
    p = write(
        tmp_path,
        line("a", 0, 1.0, 1.0, 1.5, 10, prompt_tokens=30),
        line("b", 0, 1.2, 1.5, 1.6, 5, prompt_tokens=12),
        line("a", 1, 1.75, 1.8, 2.0, 7, prompt_tokens=48, outcome="test_failure"),
    )
    w = trace_workload(load_trace(p))
    a, b = sorted(w.trajectories, key=lambda t: t.id)
    assert a.prompt_tokens == 30 and [(t.gen_tokens, round(t.tool_ms), t.outcome) for t in a.turns] == [
        (10, 250, "test_failure"),  # the tool call took ready(1) - end(0); the next turn said how it went
        (7, 0, "ok"),
    ]
    assert b.turns[0].gen_tokens == 5 and b.turns[0].tool_ms == 0
    assert w.starts_ms == {"a": 0.0, "b": pytest.approx(200.0)}
    assert w.makespan_ms == pytest.approx(1000.0) and w.skipped == 0


def test_a_trajectory_with_a_missing_turn_is_skipped_and_counted(tmp_path):
    p = write(tmp_path, line("a", 0, 0, 0, 1, 3), line("b", 0, 0, 0, 1, 3), line("b", 2, 2, 2, 3, 3))
    w = trace_workload(load_trace(p))
    assert [t.id for t in w.trajectories] == ["a"] and w.skipped == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{nope", "trace.jsonl:1: not JSON"),
        ("[1, 2]", "trace.jsonl:1: a turn is a JSON object, got list"),
        (json.dumps({"trajectory": "a", "turn": 0}), "trace.jsonl:1: missing ready, start, end, gen_tokens"),
        (line("a", 0, 2.0, 1.0, 3.0, 4), "trace.jsonl:1: needs ready <= start <= end"),
        (
            line("a", 0, 0, 0, 1, 4).replace('"gen_tokens": 4', '"gen_tokens": "many"'),
            "trace.jsonl:1: invalid literal",
        ),
        ("", "holds no turns"),
    ],
)
def test_a_bad_trace_is_refused_with_the_line_and_the_reason(tmp_path, text, message):
    with pytest.raises(TraceError, match=re.escape(message)):
        load_trace(write(tmp_path, text))


def test_a_missing_trace_says_how_to_get_one(tmp_path):
    with pytest.raises(TraceError, match=re.escape("rollout.trace: true")):
        load_trace(tmp_path / "none.jsonl")
    with pytest.raises(TraceError, match="missing turn"):
        trace_workload(load_trace(write(tmp_path, line("a", 1, 0, 0, 1, 3))))


def test_the_replay_of_a_one_engine_trace_matches_its_makespan():
    # one trajectory, two turns of 10 tokens at 10 ms a token, a 50 ms tool call between
    from core.sim.trace import TraceTurn

    turns = [TraceTurn("a", 0, 0.0, 0.0, 0.1, 10), TraceTurn("a", 1, 0.15, 0.15, 0.25, 10)]
    w = trace_workload(turns)
    profile = EngineProfile(batch_sizes=(1,), step_ms_table=(10.0,), prefill_ratio=0.0)
    sim = Simulator(w.trajectories, profile=profile, starts_ms=w.starts_ms).run()
    assert sim.makespan_ms == pytest.approx(w.makespan_ms) == pytest.approx(250.0)


class ClockEngine(Engine):
    """An engine with a known cost model on a virtual clock: a burst of ``b`` requests of
    ``n`` tokens takes ``(1 + b) * n`` ms plus 0.01 ms per prompt token (each request of the
    burst adds its share), so the profile it yields is known exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.now_ms = 0.0
        self.joined = 0

    async def _start(self) -> None: ...

    async def _close(self) -> None: ...

    async def _pause(self) -> None: ...

    async def _abort(self, request_id: str) -> None: ...

    async def _load_weights(self, state: Any, version: int) -> None: ...

    async def _generate(self, request: GenerateRequest) -> Completion:
        self.joined += 1
        for _ in range(3):
            await asyncio.sleep(0)  # the rest of the burst joins
        b, n = self.joined, request.max_new_tokens
        self.now_ms += ((1 + b) * n) / b + 0.01 * len(request.prompt_ids or [])
        await asyncio.sleep(0)
        self.joined = 0
        return completion(request, n)


async def test_profile_engine_measures_step_time_by_batch_size_and_prefill_cost():
    eng = ClockEngine()

    def make(prompt: int, tokens: int) -> GenerateRequest:
        return GenerateRequest(prompt_ids=[1] * prompt, max_new_tokens=tokens)

    def clock() -> float:
        return eng.now_ms / 1000

    async with eng:
        p = await profile_engine(
            eng, make, batch_sizes=(1, 4), tokens=12, repeats=1, long_prompt=400, clock=clock
        )
        assert p.step_ms_table == pytest.approx((2.0, 5.0))  # (1 + b) ms an iteration
        assert p.prefill_ratio == pytest.approx(0.01 / 2.0)  # a prompt token over a decode step
        assert p.max_batch == 4 and p.cache_tokens == 0
        with pytest.raises(ValueError, match="tokens >= 2"):
            await profile_engine(eng, make, tokens=1)
