"""The circuit breaker: it opens after consecutive infrastructure failures and lets one
probe through after its cooldown; a probe cut off by its own deadline or cancelled while it
waits for a slot leaves it half open; a caller's deadline (a keyed run cut at it, a plain
inproc call past it) is no failure of the backend; retries stop once it opens."""

from __future__ import annotations

import asyncio

import pytest
from client_fns import REG
from client_helpers import make

from fabric.backends.base import InprocConfig, LocalConfig
from fabric.client import Client, ClientConfig
from fabric.errors import ErrorCode
from fabric.testing import Fault


async def test_circuit_opens_after_consecutive_infra_failures_and_recovers():
    c, fake = make(breaker={"failure_threshold": 3, "cooldown_s": 0.2})
    fake.fail_next("double", ErrorCode.WORKER_LOST, times=3)
    r = await c.call("double", {"x": 1})
    assert not r.ok and r.attempts == 3
    n = len(fake.invocations)
    r = await c.call("double", {"x": 1})
    assert r.error.type == ErrorCode.CIRCUIT_OPEN and "retry in" in r.error.message
    assert len(fake.invocations) == n  # failed fast, nothing sent
    await asyncio.sleep(0.25)
    fake.inject("double", Fault(delay_s=0.1))
    probe = asyncio.create_task(c.call("double", {"x": 1}))
    await asyncio.sleep(0.02)
    r = await c.call("double", {"x": 1})
    assert r.error.type == ErrorCode.CIRCUIT_OPEN and "probe" in r.error.message  # one probe at a time
    assert (await probe).ok  # the probe went through and closed the circuit
    assert (await c.call("double", {"x": 1})).ok


async def test_a_probe_cut_off_by_its_own_deadline_leaves_the_circuit_half_open():
    c, fake = make(breaker={"failure_threshold": 3, "cooldown_s": 0.05}, hedge={"enabled": False})
    fake.fail_next("double", ErrorCode.TRANSPORT, times=3)
    assert not (await c.call("double", {"x": 1})).ok  # three attempts: the circuit opens
    await asyncio.sleep(0.06)
    fake.inject("double", Fault(delay_s=1.0))  # the backend still does not answer
    probe = await c.call("double", {"x": 1}, deadline_s=0.05)
    assert probe.error.type == ErrorCode.DEADLINE_EXCEEDED
    assert c._fns["double"].consecutive_failures == 3  # says nothing of the backend: not a reset
    # not closed: the next call is the next probe, and only it goes
    fake.inject("double", Fault(delay_s=0.1))
    nxt = asyncio.create_task(c.call("double", {"x": 1}))
    await asyncio.sleep(0.02)
    r = await c.call("double", {"x": 2})
    assert r.error.type == ErrorCode.CIRCUIT_OPEN and "probe" in r.error.message
    assert (await nxt).ok  # an answer: the circuit closes
    assert (await c.call("double", {"x": 3})).ok


@pytest.mark.parametrize("config", [LocalConfig(max_workers=1), InprocConfig()], ids=["local", "inproc"])
async def test_keyed_runs_cut_at_their_callers_deadline_do_not_open_the_circuit(config):
    """A keyed async run cut at its deadline is a FunctionTimeout (it may have run part way),
    which is retryable: the breaker counted it as an infrastructure failure, and three
    callers with short deadlines opened the circuit on a healthy backend."""
    cfg = ClientConfig.model_validate({"breaker": {"failure_threshold": 3, "cooldown_s": 30}})
    async with Client(backend=config, registry=REG, config=cfg) as c:
        await c.warmup(["nap"])
        for i in range(3):
            r = await c.call("nap", {"seconds": 5.0}, idempotency_key=f"k{i}", deadline_s=0.5)
            assert r.error.type in (ErrorCode.DEADLINE_EXCEEDED, ErrorCode.TIMEOUT)
            await asyncio.wait_for(asyncio.gather(*c._executions), 5)  # the run was cut
        # each execution's outcome: cut at the deadline, in its worker (not "never started")
        assert c.metrics()["nap"]["errors"] == {ErrorCode.TIMEOUT: 3}
        assert c._fns["nap"].consecutive_failures == 0
        r = await c.call("nap", {"seconds": 0, "tag": 7})
        assert r.ok and r.value == 7, r.error


async def test_a_plain_inproc_call_past_its_deadline_is_deadline_exceeded():
    """inproc cut a running plain call at min(timeout_s, deadline) and answered FunctionTimeout
    ("ran past its 0.043 s limit", a limit the function does not have), which also counted
    toward the circuit breaker: a burst of short deadlines opened it on a healthy backend."""
    cfg = ClientConfig.model_validate({"breaker": {"failure_threshold": 3, "cooldown_s": 30}})
    async with Client(backend=InprocConfig(), registry=REG, config=cfg) as c:
        rs = await asyncio.gather(*(c.call("nap", {"seconds": 5.0}, deadline_s=0.1) for _ in range(5)))
        assert [r.error.type for r in rs] == [ErrorCode.DEADLINE_EXCEEDED] * 5, [r.error for r in rs]
        assert c._fns["nap"].consecutive_failures == 0
        r = await c.call("nap", {"seconds": 0, "tag": 7})
        assert r.ok and r.value == 7, r.error


async def test_a_probe_cancelled_while_it_waits_for_a_slot_does_not_jam_the_circuit():
    c, fake = make(breaker={"failure_threshold": 3, "cooldown_s": 0.05})
    fake.fail_next("double", ErrorCode.WORKER_LOST, times=3)
    assert not (await c.call("double", {"x": 1})).ok  # the circuit opens
    await asyncio.sleep(0.06)
    fn = c._fns["double"]
    for _ in range(fn.spec.max_concurrency):  # every slot busy: the probe will queue for one
        await fn.sem.acquire()
    probe = asyncio.create_task(c.call("double", {"x": 1}))
    await asyncio.sleep(0.01)
    assert fn.probing  # admitted as the probe, waiting for a slot
    probe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probe
    for _ in range(fn.spec.max_concurrency):
        fn.sem.release()
    r = await c.call("double", {"x": 1})  # the next call is the probe: it goes and closes the circuit
    assert r.ok, r.error
    assert (await c.call("double", {"x": 2})).ok


async def test_retries_stop_once_the_circuit_opens():
    """The circuit opened after the second failure in a row, but the call that failed went on
    retrying against the backend it had just declared down, all 20 of its attempts: calls
    fail fast while the circuit is open, and a retry is no exception (nor, half-open, is it
    the one probe)."""
    c, fake = make(breaker={"failure_threshold": 2, "cooldown_s": 30}, hedge={"enabled": False})
    fake.fail_next("slow_retry", ErrorCode.TRANSPORT, times=20)
    r = await c.call("slow_retry", {"x": 1})
    assert r.error.type == ErrorCode.TRANSPORT and r.attempts == 2, r
    assert "circuit" in r.error.message and len(fake.invocations) == 2


async def test_function_timeouts_do_not_open_the_circuit():
    """A FunctionTimeout is the function running past its timeout_s on an input (a reward
    job scores it as the output's fault): the backend ran it and stopped it, as it should.
    The breaker counted each as an infrastructure failure, so a few hard inputs in a row
    opened the circuit and failed every other input's calls for the cooldown."""
    c, fake = make(breaker={"failure_threshold": 3, "cooldown_s": 30}, hedge={"enabled": False})
    fake.fail_next("slow_retry", ErrorCode.TIMEOUT, times=5)
    r = await c.call("slow_retry", {"x": 1})
    assert r.ok and r.attempts == 6, r  # retried as before, and never refused by the circuit
    assert (await c.call("double", {"x": 2})).ok


async def test_a_function_timeout_does_not_reset_a_run_of_infrastructure_failures():
    """Nor is it an answer that says the infrastructure works: between two lost workers it
    neither counts nor closes the circuit."""
    c, fake = make(breaker={"failure_threshold": 3, "cooldown_s": 30}, hedge={"enabled": False})
    codes = [ErrorCode.WORKER_LOST, ErrorCode.WORKER_LOST, ErrorCode.TIMEOUT, ErrorCode.WORKER_LOST]
    fake.inject("slow_retry", *(Fault(code=code) for code in codes))
    r = await c.call("slow_retry", {"x": 1})
    assert r.error.type == ErrorCode.WORKER_LOST and r.attempts == 4, r
    assert "circuit" in r.error.message and c._fns["slow_retry"].consecutive_failures == 3
