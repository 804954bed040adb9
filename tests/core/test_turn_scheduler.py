"""The LLM proxy's turn scheduler: admission order under each policy, cancellation, placement,
prediction and the trace, on fake replicas (decisions) and on a real TorchEngine (the
progressive-priority claim: the longest trajectory finishes earlier than under round robin).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
from tiny_models import completion, stopless

from core.config import JobConfig
from core.errors import ConfigError, DiskFullError
from core.job import turn_scheduler
from core.policy.tiny_lm import TinyLM, TinyLMConfig
from core.policy.tokenizer import WordTokenizer
from core.rollout.engines.base import Completion, GenerateRequest
from core.rollout.engines.torch_ import TorchEngine, TorchEngineConfig
from core.rollout.llm_proxy import LLMProxy, LocalReplica, Replica
from core.rollout.scheduling import TurnScheduler

_ids = itertools.count()


class GatedReplica(Replica):
    """Runs a turn when the test opens its gate; records the order turns started in."""

    def __init__(self, name: str = "g") -> None:
        self.name = name
        self.started: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}

    async def generate(self, request: GenerateRequest) -> Completion:
        self.started.append(request.request_id)
        gate = self.gates.setdefault(request.request_id, asyncio.Event())
        await gate.wait()
        n = int(request.metadata.get("tokens", 1))
        return completion(request, n, "x")

    def open(self, rid: str) -> None:
        self.gates.setdefault(rid, asyncio.Event()).set()

    async def abort(self, request_id: str) -> bool:
        return False

    async def swap(self, version: int, state: Any) -> None:
        return None

    async def ping(self) -> int:
        return 0


def req(traj: str, turn: int = 0, prompt: int = 3, **meta: Any) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"{traj}/{turn}",
        prompt_ids=[2] * prompt,
        max_new_tokens=4,
        metadata={"turn": turn, **meta},
    )


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def order_under(policy: str, turns: list[tuple[str, int, dict[str, Any]]]) -> list[str]:
    """Occupy the one slot, queue ``turns`` behind it, then release them one by one."""
    rep = GatedReplica()
    proxy = LLMProxy({"default": [rep]}, scheduler=TurnScheduler(policy, slots=1))
    first = asyncio.ensure_future(proxy.generate("busy", "t", req("busy")))
    await settle()
    tasks = []
    for traj, turn, meta in turns:
        tasks.append(asyncio.ensure_future(proxy.generate(traj, "t", req(traj, turn, **meta))))
        await settle()
    assert rep.started == ["busy/0"]  # the rest wait in the proxy, not in the engine
    rep.open("busy/0")
    await first
    for _ in turns:
        await settle()
        rep.open(rep.started[-1])
    await asyncio.gather(*tasks)
    return rep.started[1:]


TURNS = [
    ("a", 3, {"predicted_total": 10}),
    ("b", 0, {"predicted_total": 500}),
    ("c", 1, {"predicted_total": 50}),
]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("fcfs", ["a/3", "b/0", "c/1"]),  # arrival
        ("rr", ["b/0", "c/1", "a/3"]),  # lowest turn first
        ("sjf", ["a/3", "c/1", "b/0"]),  # shortest predicted remaining first
        ("pps", ["b/0", "c/1", "a/3"]),  # longest predicted first
    ],
)
async def test_a_replica_runs_its_waiting_turns_in_the_policys_order(policy, expected):
    assert await order_under(policy, TURNS) == expected


async def test_cmlfq_serves_a_trajectory_whose_tool_call_succeeded_first():
    turns = [
        ("fails", 2, {"outcome": "test_failure"}),
        ("plain", 1, {"outcome": "ok"}),
        ("passes", 3, {"outcome": "success"}),
    ]
    # the failing one came first but drops a level, behind both
    assert await order_under("cmlfq", turns) == ["plain/1", "passes/3", "fails/2"]


async def one_busy_slot() -> tuple[GatedReplica, TurnScheduler, LLMProxy, asyncio.Future[Completion]]:
    """One replica with one slot, held by a turn ("busy/0") until the test opens it."""
    rep = GatedReplica()
    sched = TurnScheduler("fcfs", slots=1)
    proxy = LLMProxy({"default": [rep]}, scheduler=sched)
    busy = asyncio.ensure_future(proxy.generate("busy", "t", req("busy")))
    await settle()
    return rep, sched, proxy, busy


async def test_an_aborted_trajectory_leaves_the_line_and_its_place_goes_on():
    rep, sched, proxy, busy = await one_busy_slot()
    doomed = asyncio.ensure_future(proxy.generate("doomed", "t", req("doomed")))
    later = asyncio.ensure_future(proxy.generate("later", "t", req("later")))
    await settle()
    await proxy.abort("doomed")
    c = await asyncio.wait_for(doomed, 1)
    assert c.finish_reason == "abort" and rep.started == ["busy/0"]  # it never ran
    rep.open("busy/0")
    await busy
    await settle()
    assert rep.started == ["busy/0", "later/0"]
    rep.open("later/0")
    assert (await later).finish_reason == "length"
    assert sched.stats()["waiting"] == 0 and sched._replicas[id(rep)].running == 0


async def test_a_caller_that_goes_away_while_waiting_does_not_keep_a_slot():
    rep, sched, proxy, busy = await one_busy_slot()
    gone = asyncio.ensure_future(proxy.generate("gone", "t", req("gone")))
    await settle()
    gone.cancel()
    await settle()
    rep.open("busy/0")
    await busy
    nxt = asyncio.ensure_future(proxy.generate("next", "t", req("next")))
    await settle()
    assert rep.started == ["busy/0", "next/0"]
    rep.open("next/0")
    await nxt
    assert sched._replicas[id(rep)].running == 0


async def test_release_of_a_trajectory_whose_turn_waits_for_a_slot_takes_it_out_of_the_line():
    # its caller timed out while the turn waited: admitted later, the turn would run for
    # nobody and leave the trajectory known to the scheduler forever
    rep, sched, proxy, busy = await one_busy_slot()
    left = asyncio.ensure_future(proxy.generate("left", "t", req("left")))
    await settle()
    assert sched.waiting_of("left") == 1
    await proxy.release("left")
    assert (await asyncio.wait_for(left, 1)).finish_reason == "abort"
    rep.open("busy/0")
    await busy
    await proxy.release("busy")
    await settle()
    assert rep.started == ["busy/0"]  # it never ran
    assert sched.stats()["waiting"] == 0 and sched._trajs == {}
    assert sched.predictor.trajectories_seen == 1  # "busy" only: "left" was cut off


async def test_a_turn_that_ends_after_its_trajectory_was_released_is_not_remembered():
    rep, sched, proxy, busy = await one_busy_slot()
    await proxy.release("busy")  # the replica cannot abort it (a turn about to end): it runs on
    rep.open("busy/0")
    await busy
    assert sched._trajs == {} and sched._replicas[id(rep)].running == 0


async def test_the_predictor_learns_finished_trajectories_and_aborted_ones_only_as_lower_bounds():
    rep = GatedReplica()
    sched = TurnScheduler("pps", slots=4)
    proxy = LLMProxy({"default": [rep]}, scheduler=sched)
    for k in range(3):
        rep.open(f"t{k}/0")
        await proxy.generate(f"t{k}", "x", req(f"t{k}", 0, prompt=3 + 10 * k, tokens=5 + 20 * k))
        await proxy.release(f"t{k}")
    assert sched.predictor.trajectories_seen == 3
    short = sched.request("new-short", 0, 3, {})
    long = sched.request("new-long", 0, 23, {})
    assert short.predicted_total is not None and long.predicted_total is not None
    assert long.predicted_total > 2 * short.predicted_total  # a longer prompt, a longer trajectory
    rep.open("ab/0")
    await proxy.generate("ab", "x", req("ab", 0, tokens=999))
    await proxy.abort("ab")
    await proxy.release("ab")
    assert sched.predictor.trajectories_seen == 3  # not as a finished one
    assert sched.stats()["predictor_censored"] == 1


async def test_an_outcome_is_filed_under_the_turn_whose_tool_call_returned_it():
    sched = TurnScheduler("cmlfq")
    sched.request("t", 0, 5, {})
    sched.finished_turn("t", 7)
    sched.request("t", 1, 9, {"outcome": "test_failure"})
    sched.finished_turn("t", 4)
    r = sched.request("t", 2, 9, {"outcome": "bogus"})  # not an outcome: ignored
    assert r.last_outcome is None and r.tokens_so_far == 11
    assert sched._trajs["t"].turns == [(7, "test_failure"), (4, "ok")]


async def test_least_load_places_by_predicted_work_and_keeps_a_trajectory_where_it_is():
    a, b = GatedReplica("a"), GatedReplica("b")
    sched = TurnScheduler("fcfs", "least_load", slots=8)
    proxy = LLMProxy({"default": [a, b]}, scheduler=sched)
    for r in (a, b):
        for rid in ("big/0", "s1/0", "s2/0", "big/1"):
            r.open(rid)
    await proxy.generate("big", "t", req("big", 0, predicted_total=1000))
    await proxy.generate("s1", "t", req("s1", 0, predicted_total=10))
    await proxy.generate("s2", "t", req("s2", 0, predicted_total=10))
    await proxy.generate("big", "t", req("big", 1, predicted_total=1000))
    # the big one alone on one replica, both small ones on the other; big never moved
    assert sorted([a.started, b.started]) == [["big/0", "big/1"], ["s1/0", "s2/0"]]
    assert sched.migrations == 0


@pytest.mark.parametrize("fault", ["raises", "names an unknown replica", "picks a non-candidate"])
async def test_a_failing_placement_policy_falls_back_to_affinity(fault, caplog):
    a, b = GatedReplica("a"), GatedReplica("b")
    sched = TurnScheduler("fcfs", "least_load", slots=8)
    assert sched.placement is not None

    def broken(reqs, workers):
        if fault == "raises":
            raise RuntimeError("placement bug")
        return {r.trajectory: "no-such-replica" for r in reqs}  # TurnScheduler.place fails on it

    if fault == "picks a non-candidate":  # the scheduler itself answers a replica not offered
        sched.place = lambda req, candidates, sticky: max(candidates) + 1  # type: ignore[method-assign]
    else:
        sched.placement.place = broken  # type: ignore[method-assign]
    proxy = LLMProxy({"default": [a, b]}, scheduler=sched)
    for r in (a, b):
        for rid in ("x/0", "x/1", "y/0"):
            r.open(rid)
    for traj, turn in (("x", 0), ("y", 0), ("x", 1)):
        done = await proxy.generate(traj, "t", req(traj, turn))
        assert done.finish_reason != "abort"
    # every turn served; x stayed on its replica (affinity), the least-loaded took y
    home_x = a if "x/0" in a.started else b
    assert home_x.started[:1] == ["x/0"] and "x/1" in home_x.started
    # least_load keeps a placed trajectory, so x's second turn asked the policy only where
    # the stub replaced the scheduler's own placement
    errors = 3 if fault == "picks a non-candidate" else 2
    assert proxy.metrics["placement_errors"] == errors and proxy.metrics["turns"] == 3
    logged = [r.getMessage() for r in caplog.records if "placement policy" in r.getMessage()]
    assert len(logged) == 1  # logged once
    assert ("not a candidate" in logged[0]) is (fault == "picks a non-candidate")


async def test_presorted_dp_moves_a_trajectory_between_turns_when_its_prediction_changes():
    a, b = GatedReplica("a"), GatedReplica("b")
    sched = TurnScheduler("fcfs", "presorted_dp", slots=8)
    proxy = LLMProxy({"default": [a, b]}, scheduler=sched)
    for r in (a, b):
        for rid in ("x/0", "y/0", "z/0", "x/1", "y/1", "z/1"):
            r.open(rid)
    for t in "xyz":
        await proxy.generate(t, "t", req(t, 0, predicted_total=100))
    assert sorted(map(len, (a.started, b.started))) == [1, 2]
    assert sched.migrations == 0  # placing new trajectories moves nobody
    # z turns out long: the best split is now z alone against x and y together
    await proxy.generate("z", "t", req("z", 1, predicted_total=10_000))
    await proxy.generate("x", "t", req("x", 1, predicted_total=100))
    await proxy.generate("y", "t", req("y", 1, predicted_total=100))
    home_z = a if "z/1" in a.started else b
    assert [rid for rid in home_z.started if rid.endswith("/1")] == ["z/1"]
    assert sched.migrations == 1  # one of x, y moved, at its own next turn


async def test_the_trace_has_one_line_per_turn(tmp_path):
    rep = GatedReplica()
    path = tmp_path / "run" / "trace.jsonl"
    sched = TurnScheduler("rr", slots=2, trace=path)
    proxy = LLMProxy({"default": [rep]}, scheduler=sched)
    for turn in range(2):
        rep.open(f"t/{turn}")
        await proxy.generate("t", "lake", req("t", turn, tokens=3, **({"outcome": "ok"} if turn else {})))
    sched.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["trajectory"], r["turn"], r["gen_tokens"], r["tag"]) for r in rows] == [
        ("t", 0, 3, "lake"),
        ("t", 1, 3, "lake"),
    ]
    assert rows[1]["outcome"] == "ok" and rows[0]["outcome"] is None
    assert all(r["ready"] <= r["start"] <= r["end"] for r in rows)
    assert rows[0]["end"] <= rows[1]["ready"]


async def test_a_turn_that_ends_after_the_proxy_closed_does_not_wipe_the_trace(tmp_path):
    # aclose closes the trace but does not wait for the turns in flight; the next record
    # opened the file again for writing ("w"), and every line before was lost
    rep = GatedReplica()
    path = tmp_path / "trace.jsonl"
    proxy = LLMProxy({"default": [rep]}, scheduler=TurnScheduler("rr", slots=2, trace=path))
    late = asyncio.ensure_future(proxy.generate("late", "lake", req("late")))
    rep.open("early/0")
    await proxy.generate("early", "lake", req("early"))
    await proxy.aclose()
    rep.open("late/0")
    await late
    proxy.scheduler.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["trajectory"] for r in rows] == ["early", "late"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (every write: ENOSPC)")
def test_a_full_disk_under_the_trace_is_a_disk_full_error_naming_it():
    # the proxy actor writes the trace: a bare OSError reached the driver as any turn's error
    sched = TurnScheduler("rr", slots=2, trace="/dev/full")
    with pytest.raises(DiskFullError) as e:
        sched.record(trajectory="t", turn=0)
    assert e.value.path == "/dev/full"
    with pytest.raises(DiskFullError):  # the line it could not write, flushed again
        sched.close()
    sched.close()  # closed all the same


def test_bad_scheduler_settings_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown scheduler 'lifo'; known: cmlfq, fcfs, pps, rr, sjf"):
        TurnScheduler("lifo")
    with pytest.raises(ValueError, match="unknown placement 'random'"):
        TurnScheduler("fcfs", "random")
    with pytest.raises(ValueError, match="slots must be >= 1"):
        TurnScheduler("fcfs", slots=0)


def _cfg(**rollout: Any) -> JobConfig:
    data = {
        "envs": [{"id": "frozenlake-v1", "tag": "lake"}],
        "rewards": {"lake": [{"function": "env_return"}]},
        "rollout": rollout,
    }
    return JobConfig.from_dict(data, check_references=False)


def test_the_job_config_selects_the_scheduler_and_refuses_bad_ones():
    assert turn_scheduler(_cfg()) is None  # nothing asked: the plain path, no proxy queue
    s = turn_scheduler(_cfg(scheduler="pps", placement="presorted_dp"))
    assert s is not None and s.scheduler == "pps" and s.slots == 64 and s.placement is not None
    assert turn_scheduler(_cfg(scheduler="cmlfq", slots_per_replica=4)).slots == 4  # type: ignore[union-attr]
    bad = [
        ({"scheduler": "lifo"}, "rollout.scheduler: Input should be 'fcfs', 'rr', 'sjf', 'pps' or 'cmlfq'"),
        ({"placement": "random"}, "rollout.placement: Input should be 'affinity', 'least_load'"),
        ({"slots_per_replica": 0}, "rollout.slots_per_replica: must be >= 1 (got 0)"),
        (
            {"scheduler": "cmlfq", "scheduler_options": {"levels": 0}},
            "scheduler_options do not fit scheduler 'cmlfq': levels must be >= 1",
        ),
        ({"scheduler_options": {"levels": 3}}, "scheduler_options do not fit scheduler 'fcfs'"),
    ]
    for rollout, message in bad:
        with pytest.raises(ConfigError, match=re.escape(message)):
            _cfg(**rollout)


# ------------------------------------------------------------------ on a real engine

WORDS = "left right up down you are at row column the lake is frozen hole goal start".split()


async def _rollout(policy: str, *, hint: bool, rounds: int = 1, trace: Path | None = None) -> list[list[str]]:
    """Twelve short trajectories (2 turns) and one long one (8 turns), all at once, on one
    TorchEngine replica with 1 slot; the long one has the longer prompt. Returns, per round,
    the order trajectories finished in (trajectory ``NAME@ROUND`` in the trace)."""
    tok = WordTokenizer(WORDS)
    model = stopless(
        TinyLM(
            TinyLMConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2, max_len=256), seed=0
        ),
        tok,
    )
    engine = TorchEngine(model, tok, TorchEngineConfig(num_threads=1, batch_wait_ms=0.0))
    proxy = LLMProxy(
        {"default": [LocalReplica(engine)]}, scheduler=TurnScheduler(policy, slots=1, trace=trace)
    )
    spec = {"long": (8, 24), **{f"s{k}": (2, 4) for k in range(12)}}  # turns, prompt size
    orders = []
    async with engine:
        for rnd in range(rounds):
            finished: list[str] = []

            async def play(
                name: str, turns: int, prompt: int, rnd: int = rnd, finished: list[str] = finished
            ) -> None:
                tid = f"{name}@{rnd}"
                for turn in range(turns):
                    meta: dict[str, Any] = {"turn": turn}
                    if hint:
                        meta["predicted_total"] = 4 * turns
                    r = GenerateRequest(
                        request_id=f"{tid}/{turn}", prompt_ids=[2] * prompt, max_new_tokens=4, metadata=meta
                    )
                    c = await proxy.generate(tid, "t", r)
                    assert len(c.token_ids) == 4
                    await asyncio.sleep(0.002)  # the environment's step
                await proxy.release(tid)
                finished.append(name)

            await asyncio.gather(*(play(n, t, p) for n, (t, p) in spec.items()))
            orders.append(finished)
    return orders


async def test_on_the_torch_engine_progressive_priority_finishes_the_longest_trajectory_earlier():
    rr = (await _rollout("rr", hint=True))[0]
    pps = (await _rollout("pps", hint=True))[0]
    # round robin runs everyone's turn k before the long one's turn k + 1: it ends last;
    # longest-first starts its every turn as soon as it is back from its environment
    assert rr.index("long") == len(rr) - 1
    assert pps.index("long") < len(pps) // 2


async def test_with_the_learned_predictor_pps_finds_the_long_trajectory_after_one_round(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rounds = await _rollout("pps", hint=False, rounds=2, trace=trace)
    rows = [json.loads(line) for line in trace.read_text().splitlines()]

    def predicted(rnd: int, long: bool) -> list[float | None]:
        return [
            r["predicted_total"]
            for r in rows
            if r["trajectory"].endswith(f"@{rnd}") and r["trajectory"].startswith("long") == long
        ]

    # round 0 knows nothing (unknown predictions go first by arrival), so the long one ends last
    assert predicted(0, long=False) == [None] * 24
    assert rounds[0].index("long") == len(rounds[0]) - 1
    # round 1 has learned that the long prompt means a long trajectory: every one of its turns
    # is predicted longer than any short turn, so pps starts it whenever it is back from its
    # environment. How many short turns fit into its 2 ms environment steps depends on the
    # machine's speed, so the finishing position is only compared with round 0's.
    longs, shorts = predicted(1, long=True), predicted(1, long=False)
    assert None not in longs and None not in shorts and len(longs) == 8 and len(shorts) == 24
    assert min(x for x in longs if x is not None) > 2 * max(x for x in shorts if x is not None)
    assert rounds[1].index("long") < rounds[0].index("long")


# ----------------------------------------------------------------------------- C-MLFQ's levels


async def test_cmlfq_levels_move_on_turns_admitted_at_once_and_follow_a_migration():
    # a turn that found a free slot never went through the queue, so its outcome did not
    # move its trajectory's level (the simulator pushes every turn); and each replica kept
    # its own levels, so a trajectory that moved replica started again at 0
    s = TurnScheduler("cmlfq", slots=1)
    for k, meta in ((0, {}), (1, {"outcome": "tool_error"})):
        assert await s.admit(7, s.request("x", k, 100, meta))  # free slot: admitted at once
        s.finished_turn("x", 300)
        s.done(7)
    assert s._replicas[7].queue.level_of("x") == 1
    assert await s.admit(8, s.request("x", 2, 100, {"outcome": "timeout"}))
    s.done(8)
    assert s._replicas[8].queue.level_of("x") == 3 == s._replicas[7].queue.level_of("x")
    s.release("x")
    assert s._replicas[7].queue.level_of("x") == 0
