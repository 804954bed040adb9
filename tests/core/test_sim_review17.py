"""A review of the rollout scheduling policies and the simulator: seeded property tests of
the simulator's accounting and of C-MLFQ against a model of its documented rules, and
regression tests for the bad inputs the review found passing silently (or hanging)."""

from __future__ import annotations

import json
import math
import random

import pytest

from core.sched import Request
from core.sched.placement import CacheAffinity, PresortedDP, speed_partition
from core.sched.queueing import CMLFQ
from core.sched.resources import anneal
from core.sim import EngineProfile, Simulator, TrajSpec, Turn, no_prediction, oracle, preset
from core.sim.reward import RewardPool, RewardStage, fixed_ms
from core.sim.trace import TraceError, load_trace

_OUTCOMES = ("ok", "tool_error", "test_failure", "timeout", "success")


def _workload(rng: random.Random, n: int) -> list[TrajSpec]:
    """Small trajectories with the degenerate cases in reach: zero-length turns and prompts,
    no tool latency, equal lengths, groups of one."""
    size = rng.choice([1, 2, 3])
    return [
        TrajSpec(
            f"t{i}",
            rng.choice([0, 10, 500]),
            tuple(
                Turn(
                    rng.choice([0, 1, 5, 50, 300]),
                    rng.choice([0.0, 10.0, 500.0]),
                    rng.choice(_OUTCOMES),
                    rng.choice([0, 64]),
                )
                for _ in range(rng.randint(1, 4))
            ),
            group=i // size,
        )
        for i in range(n)
    ]


def _settings(rng: random.Random, trajs: list[TrajSpec]) -> dict:
    workers = rng.randint(1, 3)
    mode = rng.choice(["trajectory", "batch"])
    return dict(
        workers=workers,
        profile=EngineProfile(
            max_batch=rng.choice([1, 2, 256]),
            prefill_blocks=rng.random() < 0.3,
            cache_tokens=rng.choice([0, 100, 2_000_000]),
        ),
        speeds=[rng.choice([1.0, 2.0]) for _ in range(workers)],
        scheduler=rng.choice(["fcfs", "rr", "sjf", "pps", "cmlfq"]),
        placement=rng.choice(["least_load", "cache_affinity", "presorted_dp"]),
        mode=mode,
        predictor=rng.choice([oracle, no_prediction]),
        keep_per_group=rng.choice([None, 1, 2]) if mode == "trajectory" else None,
        starts_ms={t.id: rng.choice([0.0, 100.0]) for t in trajs} if rng.random() < 0.3 else None,
    )


@pytest.mark.parametrize("chunk", range(4))
def test_random_steps_account_for_every_trajectory_once(chunk):
    for seed in range(chunk * 150, (chunk + 1) * 150):
        rng = random.Random(seed)
        trajs = _workload(rng, rng.randint(1, 10))
        kw = _settings(rng, trajs)
        sim = Simulator(trajs, **kw)
        res = sim.run()
        again = Simulator(trajs, **kw).run()
        assert (again.finish_ms, again.makespan_ms, again.events) == (
            res.finish_ms,
            res.makespan_ms,
            res.events,
        )
        aborted = set(res.meta.get("aborted", ()))
        # every trajectory ends exactly one way
        assert set(res.finish_ms) | aborted == {t.id for t in trajs}
        assert not set(res.finish_ms) & aborted
        assert res.makespan_ms == max(res.finish_ms.values())
        assert 0.0 <= res.utilisation <= 1.0 + 1e-9
        for w in sim.workers.values():
            assert not w.running  # no slot held past the end (an aborted turn's included)
            assert w.busy_ms <= res.makespan_ms + 1e-6
        starts = kw["starts_ms"] or {}
        for t in trajs:
            if t.id in res.finish_ms:  # never sooner than its tool calls alone allow
                floor = starts.get(t.id, 0.0) + sum(turn.tool_ms for turn in t.turns)
                assert res.finish_ms[t.id] >= floor - 1e-6
        if kw["keep_per_group"] is not None:
            groups: dict[int, list[str]] = {}
            for t in trajs:
                groups.setdefault(t.group, []).append(t.id)
            for ids in groups.values():  # exactly ``keep`` kept, the rest aborted
                kept = sum(1 for i in ids if i in res.finish_ms)
                assert kept == min(kw["keep_per_group"], len(ids))


def _cmlfq_model_level(req: Request, level: int, now: float, aging_s: float) -> tuple[float, float, int]:
    """The documented rule: one level up per ``aging_s`` waited (strictly longer), re-stamped
    with when it went up; the pop order is (level, stamp, seq)."""
    up = 0
    while up < level and now - req.arrival > (up + 1) * aging_s:
        up += 1
    return (level - up, req.arrival + up * aging_s, req.seq)


def test_cmlfq_follows_its_documented_rules_on_random_traffic():
    moves = {"tool_error": 1, "test_failure": 1, "timeout": 2, "ok": 0, None: 0}
    for seed in range(400):
        rng = random.Random(seed)
        levels = rng.randint(1, 4)
        aging = rng.choice([0.0, 1.0, 2.0, math.inf])
        quantum = tuple(sorted(rng.choice([0, 5, 10, 50]) for _ in range(levels - 1)))
        q = CMLFQ(levels=levels, quantum_tokens=quantum, aging_s=aging)
        store: dict[str, int] = {}
        tokens: dict[str, int] = {}
        waiting: dict[int, tuple[Request, int]] = {}
        now = 0.0
        for _ in range(40):
            now += rng.choice([0.0, 0.25, 0.5, 1.0, 3.0])
            busy = {r.trajectory for r, _ in waiting.values()}
            free = [f"t{i}" for i in range(6) if f"t{i}" not in busy]
            if free and rng.random() < 0.55:
                t = rng.choice(free)
                outcome = rng.choice([None, *_OUTCOMES])
                tokens[t] = tokens.get(t, 0) + rng.choice([0, 3, 7, 20])
                req = Request(t, arrival=now, tokens_so_far=tokens[t], last_outcome=outcome)
                if outcome == "success":
                    level = 0
                else:
                    level = store.get(t, 0) + moves[outcome]
                    level = max([level] + [i + 1 for i, b in enumerate(quantum) if tokens[t] > b])
                    level = min(max(level, 0), levels - 1)
                store[t] = level
                q.push(req, now)
                waiting[req.seq] = (req, level)
                continue
            got = q.pop(now)
            if not waiting:
                assert got is None
                continue
            keys = {seq: _cmlfq_model_level(r, lv, now, aging) for seq, (r, lv) in waiting.items()}
            want = min(keys, key=keys.__getitem__)
            assert got is not None and got.seq == want, (seed, keys)
            store[got.trajectory] = keys[want][0]  # aging's lift is the trajectory's level
            assert q.level_of(got.trajectory) == store[got.trajectory]
            del waiting[want]


# ------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize(
    "bad",
    [
        # nan passed the "< 0" checks: every finish time and the makespan came out nan
        lambda: Turn(float("nan")),
        lambda: Turn(10, 0.0, "ok", float("nan")),
        lambda: TrajSpec("a", float("nan"), (Turn(10),)),
        # inf: the turn never completes, and its trajectory finishes at inf
        lambda: Turn(float("inf")),
        lambda: Turn(10, 0.0, "ok", float("inf")),
        lambda: TrajSpec("a", float("inf"), (Turn(10),)),
    ],
)
def test_a_nan_or_infinite_turn_or_prompt_is_refused_where_the_workload_is_built(bad):
    with pytest.raises(ValueError, match="finite"):
        bad()


@pytest.mark.parametrize(
    ("speeds", "lengths"),
    [
        ([-1.0], [5.0, 3.0]),  # a makespan of -5.3 (anneal's search on it never ended)
        ([1.0, 0.0], [5.0, 3.0]),  # ZeroDivisionError
        ([float("nan")], [5.0, 3.0]),
        ([1.0], [float("nan"), 3.0]),  # a nan makespan, silently
        ([1.0], [5.0, -3.0]),
        ([1.0], [float("inf"), 3.0]),
    ],
)
def test_speed_partition_refuses_bad_speeds_and_lengths(speeds, lengths):
    with pytest.raises(ValueError, match="finite"):
        speed_partition(lengths, speeds)


@pytest.mark.parametrize(
    ("lengths", "budget", "speedup"),
    [
        ([5.0, 3.0], 4, {1: -1.0}),  # hung for good (speed_partition's bisection)
        ([5.0, 3.0], 4, {1: 1.0, 2: 0.0}),  # ZeroDivisionError
        ([float("nan"), 3.0], 4, None),  # ([1, 1, 1, 1], nan)
        ([-5.0, 3.0], 4, None),  # a plan for a negative length
        # a degree-0 worker costs no GPU: splitting a 1 into 0 + 1 made free workers
        ([5.0, 3.0], 4, {0: 1.0, 1: 1.0}),
        ([5.0, 3.0], 2.5, None),  # TypeError from deep inside
    ],
)
def test_anneal_refuses_bad_lengths_budgets_and_speedups(lengths, budget, speedup):
    with pytest.raises(ValueError):
        anneal(lengths, budget, speedup, iterations=50)


@pytest.mark.parametrize(
    "build",
    [
        # nan failed every comparison: every trajectory went to the least-loaded worker, moving
        # at every turn, silently; inf did so whenever that worker was idle ((1 + inf) * 0)
        lambda: CacheAffinity(slack=float("nan")),
        lambda: CacheAffinity(slack=float("inf")),
        lambda: CacheAffinity(slack=-0.5),
        # refused only when the first placement ran (c = 0 as a ZeroDivisionError there)
        lambda: PresortedDP(c=0.0),
        lambda: PresortedDP(c=float("nan")),
        lambda: PresortedDP(interference=0.0),
        lambda: PresortedDP(interference=float("inf")),
    ],
)
def test_placement_options_are_checked_when_the_placement_is_built(build):
    with pytest.raises(ValueError, match="finite"):
        build()


@pytest.mark.parametrize("levels", [2.5, True, "3"])
def test_cmlfq_levels_must_be_a_whole_number(levels):
    # 2.5 failed as a TypeError from a slice; True (YAML's yes) ran as 1 level
    with pytest.raises(ValueError, match="levels"):
        CMLFQ(levels=levels)


@pytest.mark.parametrize(
    "times",
    [
        '"ready": -Infinity, "start": 0.0, "end": 0.5',  # every start came out inf (ready - t0)
        '"ready": 0.0, "start": 0.1, "end": Infinity',  # an infinite real makespan
    ],
)
def test_a_trace_line_with_an_infinite_time_is_refused_with_its_line(tmp_path, times):
    path = tmp_path / "trace.jsonl"
    good = {"trajectory": "a", "turn": 0, "ready": 0.0, "start": 0.0, "end": 0.2, "gen_tokens": 4}
    bad = '{"trajectory": "b", "turn": 0, ' + times + ', "gen_tokens": 4}'
    path.write_text(json.dumps(good) + "\n" + bad + "\n")
    with pytest.raises(TraceError, match=r"trace\.jsonl:2: .*finite"):
        load_trace(path)


def test_an_unknown_preset_is_refused_even_for_no_trajectories():
    # the name was checked per trajectory: preset("nope", 0) returned an empty "nope" workload
    with pytest.raises(ValueError, match="unknown workload preset 'nope'"):
        preset("nope", 0)
    with pytest.raises(ValueError, match="n must be >= 0"):
        preset("coding", -3)  # an empty workload, silently
    with pytest.raises(ValueError, match="group_size >= 1"):
        preset("math", 4, group_size=0)  # ZeroDivisionError


@pytest.mark.parametrize("service", [-5.0, float("nan"), float("inf")])
def test_a_reward_service_time_that_is_not_finite_and_non_negative_is_refused(service):
    # a negative one ended rewards before they began, nan made busy time and utilisation nan
    pool = RewardPool(RewardStage(service_ms=fixed_ms(service)))
    with pytest.raises(ValueError, match="service"):
        pool.serve([(0.0, service)])


@pytest.mark.parametrize("max_batch", [2.5, True, float("inf")])
def test_an_engine_profile_batch_is_a_whole_number_of_slots(max_batch):
    # 2.5 ran 3 turns at once (free_slots 0.5 > 0), True ran one: both silently
    with pytest.raises(ValueError, match="max_batch"):
        EngineProfile(max_batch=max_batch)
