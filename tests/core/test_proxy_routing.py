"""LLMProxy routing: a trajectory's affinity to its replica, hardware groups, the release
of a trajectory and the turns that reach the proxy after it.

No Ray: the proxy is a plain object here; fakes are in ``proxy_fakes``."""

from __future__ import annotations

import asyncio

import pytest
from proxy_fakes import Fake, Recording, engine, req, tiny, until

from core.rollout.engines.base import GenerateRequest
from core.rollout.llm_proxy import (
    LLMProxy,
)


async def test_a_trajectory_sticks_to_the_replica_of_its_first_turn(tok):
    async with engine(tiny(tok), tok) as e1, engine(tiny(tok), tok) as e2:
        a, b = Recording(e1, "a"), Recording(e2, "b")
        proxy = LLMProxy({"default": [a, b]})
        # first turns together: t1 loads "a", so t2 starts on "b"
        first = await asyncio.gather(
            *(proxy.generate(t, "lake", req(metadata={"traj": t})) for t in ("t1", "t2"))
        )
        assert all(c.token_ids for c in first)
        for _ in range(2):  # later turns one at a time: both replicas idle, yet each sticks
            for traj in ("t2", "t1"):
                c = await proxy.generate(traj, "lake", req(metadata={"traj": traj}))
                assert c.finish_reason in ("stop", "length") and c.token_ids
        assert a.served == ["t1"] * 3 and b.served == ["t2"] * 3
        assert proxy.metrics["affinity_hits"] == 4  # turns 2 and 3 of both trajectories
        assert proxy.metrics["turns"] == 6
        assert proxy.stats()["trajectories"] == 2


async def test_a_new_trajectory_goes_to_the_least_loaded_replica():
    gate = asyncio.Event()
    r0, r1 = Fake("r0", gate=gate), Fake("r1", gate=gate)
    proxy = LLMProxy({"default": [r0, r1]})
    t_a = asyncio.create_task(proxy.generate("a", "x", req(request_id="a0")))
    await until(lambda: r0.generated == ["a0"])  # a tie: the first replica
    t_b = asyncio.create_task(proxy.generate("b", "x", req(request_id="b0")))
    await until(lambda: r1.generated == ["b0"])  # r0 has one in flight, r1 none
    t_a2 = asyncio.create_task(proxy.generate("a", "x", req(request_id="a1")))
    await until(lambda: r0.generated == ["a0", "a1"])  # sticky (both have one in flight)
    t_c = asyncio.create_task(proxy.generate("c", "x", req(request_id="c0")))
    await until(lambda: r1.generated == ["b0", "c0"])  # r0 has 2 in flight, r1 1
    gate.set()
    done = await asyncio.gather(t_a, t_b, t_a2, t_c)
    assert [c.text for c in done] == ["r0", "r1", "r0", "r1"]
    # all idle again: a new trajectory takes the first of the tied replicas
    c = await proxy.generate("d", "x", req(request_id="d0"))
    assert c.text == "r0"


async def test_tags_run_on_their_hardware_group_and_unknown_tags_on_the_default():
    d, h = Fake("d"), Fake("h")
    proxy = LLMProxy({"default": [d], "H800": [h]}, affinity={"frozenlake": "H800"})
    assert proxy.group_of("frozenlake") == "H800" and proxy.group_of("math") == "default"
    assert (await proxy.generate("t1", "frozenlake", req())).text == "h"
    assert (await proxy.generate("t2", "math", req())).text == "d"
    assert (await proxy.generate("t3", "never-named", req())).text == "d"
    # stickiness holds within the tag's group only: the tag decides the group every turn
    assert (await proxy.generate("t1", "frozenlake", req())).text == "h"
    assert (await proxy.generate("t1", "math", req())).text == "d"

    # "default" in the affinity map moves every other tag too
    proxy = LLMProxy({"H20": [d], "H800": [h]}, affinity={"frozenlake": "H800", "default": "H20"})
    assert (await proxy.generate("u1", "math", req())).text == "d"
    assert (await proxy.generate("u2", "frozenlake", req())).text == "h"
    # no "default" group and no default affinity: the first group
    proxy = LLMProxy({"H800": [h], "H20": [d]})
    assert proxy.group_of("anything") == "H800"


def test_construction_refuses_no_replicas_and_unknown_groups():
    with pytest.raises(ValueError, match="at least one replica"):
        LLMProxy({})
    with pytest.raises(ValueError, match="at least one replica"):
        LLMProxy({"default": []})
    with pytest.raises(ValueError, match=r"groups without replicas: \['H800'\]"):
        LLMProxy({"default": [Fake("d")]}, affinity={"frozenlake": "H800"})


async def test_construction_refuses_a_replica_listed_twice():
    # a replica in two groups (or twice in one) was swapped twice by each weight update,
    # counted twice in num_replicas, and its drop took it out of both; groups are hardware
    # kinds, so one replica belongs to one
    r, other = Fake("r"), Fake("other")
    with pytest.raises(ValueError, match=r"replica r is listed twice \(groups 'default' and 'H800'\)"):
        LLMProxy({"default": [r], "H800": [other, r]})
    with pytest.raises(ValueError, match=r"replica r is listed twice \(groups 'default' and 'default'\)"):
        LLMProxy({"default": [r, r]})
    proxy = LLMProxy({"default": [r], "H800": [other]})
    await proxy.update_weights(1, ["W1"])
    assert r.swaps == [(1, "W1")] and proxy.num_replicas == 2


async def test_release_forgets_the_trajectory():
    hold = asyncio.Event()
    r0, r1 = Fake("r0", gate=hold, only={"c0"}), Fake("r1")
    proxy = LLMProxy({"default": [r0, r1]})
    assert (await proxy.generate("a", "x", req())).text == "r0"  # a tie: the first
    other = asyncio.create_task(proxy.generate("c", "x", req(request_id="c0")))
    await until(lambda: r0.generated[-1:] == ["c0"])  # r0 now has a turn in flight
    assert (await proxy.generate("a", "x", req())).text == "r0"  # sticky, though r0 is busier
    assert proxy.stats()["trajectories"] == 2
    await proxy.release("a")
    assert proxy.stats()["trajectories"] == 1  # only "c" is still known
    assert (await proxy.generate("a", "x", req())).text == "r1"  # routed afresh: least loaded
    hold.set()
    assert (await other).text == "r0"


async def test_release_aborts_a_turn_its_trajectory_left_running():
    # the caller of a turn went away (its trajectory timed out): under Ray the proxy's side
    # of the call runs on, holding the replica's batch slot; after release nothing knows its
    # request id, so release stops it
    r = Fake("r", gate=asyncio.Event(), only={"t/0"})
    proxy = LLMProxy({"default": [r]})
    turn = asyncio.ensure_future(proxy.generate("t", "x", req(request_id="t/0")))
    await until(lambda: r.generated == ["t/0"])
    await proxy.release("t")
    assert r.aborted == ["t/0"] and (await turn).finish_reason == "abort"
    assert proxy.metrics["aborts"] == 1 and proxy.stats()["trajectories"] == 0
    # the trajectory id is free again; a trajectory that ended cleanly aborts nothing
    assert (await proxy.generate("t", "x", req())).text == "r"
    await proxy.release("t")
    assert r.aborted == ["t/0"]


async def test_an_abort_after_the_release_is_not_kept():
    # a group fills while a member is finishing: the member's release reaches the proxy
    # before the runner's abort. The abort stops nothing and is not kept for the rest of the
    # job (nothing would release the id again); an id used again is live again
    r = Fake("r")
    proxy = LLMProxy({"default": [r]})
    assert (await proxy.generate("t", "x", req())).text == "r"
    await proxy.release("t")
    assert await proxy.abort("t") == 0
    assert proxy._aborted == set()
    assert (await proxy.generate("t", "x", req())).text == "r"
    assert await proxy.abort("t") == 0  # now it counts: later turns are aborted until released
    assert (await proxy.generate("t", "x", req())).finish_reason == "abort"
    await proxy.release("t")
    assert proxy._aborted == set()


def turn_of(traj_id: str, n: int) -> GenerateRequest:
    """Turn ``n`` of a trajectory as the env manager sends it (its number in the metadata)."""
    return req(request_id=f"{traj_id}/{n}", metadata={"trajectory_id": traj_id, "turn": n})


def assert_forgotten(proxy: LLMProxy, traj_id: str) -> None:
    """Nothing of the trajectory is left in the proxy (nor its turn scheduler)."""
    assert traj_id not in proxy._sticky and traj_id not in proxy._inflight
    assert traj_id not in proxy._aborted and sum(proxy._load.values()) == 0
    if proxy.scheduler is not None:
        assert traj_id not in proxy.scheduler._trajs
        assert proxy.scheduler.stats()["waiting"] == 0


# what the caller sends once it went away (a timeout: abort, then release; a cancelled
# caller: release), delivered before its last turn: Ray runs an async actor's calls in any
# order (and a coalesced turn waits up to a window before it is sent)
OVERTAKEN = [["release"], ["abort", "release"], ["release", "abort"]]


@pytest.mark.parametrize("seen", [0, 2])  # turns of the trajectory that reached the proxy first
@pytest.mark.parametrize("calls", OVERTAKEN, ids="+".join)
async def test_a_turn_that_reaches_the_proxy_after_its_trajectorys_release_is_not_run(seen, calls):
    # the turn began with "an id used again is live again": it cleared the release's mark
    # and ran to its end for nobody, holding an engine slot, and left its affinity, its
    # scheduler state and its replica's load behind for the rest of the job
    from core.rollout.scheduling import TurnScheduler

    r = Fake("r")
    proxy = LLMProxy({"default": [r]}, scheduler=TurnScheduler("fcfs", slots=1))
    for n in range(seen):
        assert (await proxy.generate("t", "x", turn_of("t", n))).text == "r"
    for call in calls:
        await getattr(proxy, call)("t")
    late = turn_of("t", seen)
    c = await asyncio.wait_for(proxy.generate("t", "x", late), 5)
    assert (c.finish_reason, c.token_ids, c.request_id) == ("abort", [], late.request_id)
    assert r.generated == [f"t/{n}" for n in range(seen)]  # it never reached the engine
    assert_forgotten(proxy, "t")
    assert proxy.metrics["turns_after_release"] == 1


async def test_an_id_used_again_after_its_release_is_live_again():
    # the job never uses a trajectory id twice (uuid4 per trajectory, re-runs included), but
    # a caller that does starts its turns over: not a turn sent before the release
    r = Fake("r")
    proxy = LLMProxy({"default": [r]})
    for n in range(2):
        await proxy.generate("t", "x", turn_of("t", n))
    await proxy.release("t")
    again = turn_of("t", 0)
    assert (await proxy.generate("t", "x", again)).text == "r" and r.generated[-1] == again.request_id
    await proxy.release("t")
    assert_forgotten(proxy, "t")


async def test_a_turn_whose_number_is_not_a_number_is_still_served():
    # the release's check reads the turn's number for every turn, with or without a turn
    # scheduler: a caller's odd metadata must not fail its turn
    r = Fake("r")
    proxy = LLMProxy({"default": [r]})
    assert (await proxy.generate("t", "x", req(metadata={"turn": "first"}))).text == "r"


async def test_an_abort_that_reaches_the_proxy_before_its_turn_still_aborts_it():
    # a group filled (or the trajectory timed out) as its member sent a turn; the abort is
    # delivered first. It is kept until the release, so the turn is answered aborted then
    from core.rollout.scheduling import TurnScheduler

    r = Fake("r")
    proxy = LLMProxy({"default": [r]}, scheduler=TurnScheduler("fcfs", slots=1))
    await proxy.generate("t", "x", turn_of("t", 0))
    assert await proxy.abort("t") == 0  # nothing in flight yet
    c = await asyncio.wait_for(proxy.generate("t", "x", turn_of("t", 1)), 5)
    assert c.finish_reason == "abort" and r.generated == ["t/0"]
    await proxy.release("t")
    assert_forgotten(proxy, "t")
