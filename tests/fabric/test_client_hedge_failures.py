"""A hedge whose sending fails: the backend's ``submit`` raised inside the hedge's timer
callback, after the hedge had taken its room (a ``max_concurrency`` slot, or one of the
hedges' allowance past the limit). That room was never given back: a slot lost for good
(one fewer call at a time, and with every slot lost no call ever sent again), or the
allowance used up, after which no saturated call was hedged again."""

from __future__ import annotations

import asyncio
import logging

import pytest
from client_fns import REG

from fabric.client import Client, ClientConfig
from fabric.protocol import Invocation, Result
from fabric.testing import FakeBackend, Fault


class HedgeRefusingBackend(FakeBackend):
    """A FakeBackend whose ``submit`` raises for a hedge while ``refuse`` is set (a backend
    whose dispatch broke: a closed executor, a bug)."""

    def __init__(self) -> None:
        super().__init__(REG)
        self.refuse = True
        self.refused = 0

    def _submit(self, inv: Invocation) -> asyncio.Future[Result]:
        if inv.hedge and self.refuse:
            self.refused += 1
            raise RuntimeError("dispatch broke")
        return super()._submit(inv)


def make(**hedge) -> tuple[Client, HedgeRefusingBackend]:
    fake = HedgeRefusingBackend()
    cfg = ClientConfig.model_validate({"hedge": {"min_samples": 5, "max_share": 1.0, **hedge}})
    return Client(backend=fake, registry=REG, config=cfg), fake


async def test_a_hedge_that_could_not_be_sent_gives_its_slot_back(caplog: pytest.LogCaptureFixture):
    c, fake = make()
    await c.map("two_at_a_time", [{"seconds": 0}] * 10)  # the hedge delay's samples
    warm_refused = fake.refused  # (a slow warm-up call may have been hedged, and refused)
    with caplog.at_level(logging.WARNING, logger="fabric.client"):
        for _ in range(3):
            fake.inject("two_at_a_time", Fault(delay_s=0.2))  # a straggler, due a hedge
            r = await c.call("two_at_a_time", {"seconds": 0})
            assert r.ok and not r.hedged  # the primary's answer: the hedge was not sent
    assert fake.refused - warm_refused == 3 and not any(i.hedge for i in fake.invocations)
    assert c.metrics()["two_at_a_time"]["hedges"] == 0  # none was sent
    assert "could not send a hedge of two_at_a_time" in caplog.text and "dispatch broke" in caplog.text
    sem = c._fns["two_at_a_time"].sem
    assert sem.take_now() and sem.take_now(), "a slot the failed hedges took was never given back"
    sem.release()
    sem.release()
    # and hedging goes on once the backend sends again
    fake.refuse = False
    fake.inject("two_at_a_time", Fault(delay_s=5.0))
    r = await asyncio.wait_for(c.call("two_at_a_time", {"seconds": 0}), 2.5)
    assert r.ok and r.hedged


async def test_a_saturated_call_whose_hedge_could_not_be_sent_gives_the_allowance_back():
    """Past the limit: every slot held, the hedge takes one of the allowance (1 here)."""
    c, fake = make(over_limit_share=0.5)
    await c.map("two_at_a_time", [{"seconds": 0}] * 10)
    # (a warm-up call slow enough to be hedged once the p95 is known was refused too: a clean
    # clone's run counted 5)
    warm_refused = fake.refused
    for _ in range(2):
        fake.inject("two_at_a_time", Fault(delay_s=0.2), Fault(delay_s=0.2))  # both straggle
        a, b = await asyncio.gather(*(c.call("two_at_a_time", {"seconds": 0}) for _ in range(2)))
        assert a.ok and b.ok and not a.hedged and not b.hedged
    # each caller's hedge tried in each round: the allowance a refused one took came back
    assert fake.refused - warm_refused == 4
    fn = c._fns["two_at_a_time"]
    assert fn.hedges_over_limit == 0, "the allowance the failed hedges took was never given back"
    fake.refuse = False
    fake.inject("two_at_a_time", Fault(delay_s=5.0), Fault(delay_s=0.2))
    a, b = await asyncio.wait_for(
        asyncio.gather(*(c.call("two_at_a_time", {"seconds": 0}) for _ in range(2))), 2.5
    )
    assert a.ok and b.ok and [a.hedged, b.hedged].count(True) >= 1
