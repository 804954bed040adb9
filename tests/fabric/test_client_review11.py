"""Review 11 of the client: the circuit breaker holds for calls that were admitted before it
opened and still wait for a concurrency slot, and for hedges; a call whose deadline has
already passed is not sent; a key's kept answer is not shared by reference with its callers,
nor given to a caller with another payload; ``map`` and ``stream`` refuse one idempotency key
for many payloads; cold-start answers stay out of the latency the client hedges after; a
backend future without a ``Result`` is a failed ``Result``; request ids are unique across a
fleet of clients."""

from __future__ import annotations

import asyncio

import pytest
from client_helpers import _ManualBackend

from fabric.client import Client, ClientConfig
from fabric.errors import ConfigError, ErrorCode
from fabric.protocol import Invocation, Result
from fabric.registry import Registry
from fabric.testing import FakeBackend

REG = Registry()


@REG.function(max_concurrency=1, retry={"max_attempts": 1})
async def single(x: int) -> int:
    return x


@REG.function()
def parts(x: int) -> dict:
    return {"score": x, "components": [x]}


class _Manual(_ManualBackend):
    """``_ManualBackend`` on this module's registry."""

    def __init__(self) -> None:
        super().__init__()
        self.registry = REG


def _client(backend, **cfg) -> Client:
    return Client(backend=backend, registry=REG, config=ClientConfig.model_validate(cfg))


async def _answer_all(m: _Manual, code: ErrorCode) -> int:
    """Answer every invocation sent with ``code`` until none comes for a while; how many."""
    n = 0
    while True:
        try:
            inv, fut = await asyncio.wait_for(m.next(), 0.5)
        except TimeoutError:
            return n
        m.answer(inv, fut, code)
        n += 1


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "keyed"])
async def test_calls_waiting_for_a_slot_are_not_sent_once_the_circuit_opened(keyed):
    """The breaker was asked only as a call began: the callers already waiting in line for a
    concurrency slot (a ``map`` over a batch) each sent their call once they got one, into a
    circuit that had opened meanwhile: a backend down was hit by the whole batch, one call
    per slot at a time, instead of failing fast after ``failure_threshold`` failures."""
    m = _Manual()
    c = _client(m, breaker={"failure_threshold": 3, "cooldown_s": 60}, hedge={"enabled": False})
    kw = [{"idempotency_key": f"k{i}"} if keyed else {} for i in range(10)]
    calls = [asyncio.create_task(c.call("single", {"x": i}, **kw[i])) for i in range(10)]
    sent = await _answer_all(m, ErrorCode.TRANSPORT)
    results = await asyncio.gather(*calls)
    assert sent == 3  # max_concurrency=1, one attempt each: the circuit opened at the 3rd
    codes = [r.error.type for r in results]
    assert codes.count(ErrorCode.TRANSPORT) == 3
    assert codes.count(ErrorCode.CIRCUIT_OPEN) == 7
    await c.aclose()


async def test_a_call_that_finds_the_circuit_open_after_its_cooldown_is_its_probe():
    """Asked again once the call has its slot, the breaker still lets the one probe through:
    here the circuit opened, and its cooldown ended, while the call waited in line."""
    m = _Manual()
    c = _client(m, breaker={"failure_threshold": 1, "cooldown_s": 60}, hedge={"enabled": False})
    first = asyncio.create_task(c.call("single", {"x": 0}))
    inv, fut = await m.next()
    second = asyncio.create_task(c.call("single", {"x": 1}))  # admitted: the circuit is closed
    await asyncio.sleep(0)
    fn = c._fns["single"]
    fn.consecutive_failures, fn.breaker_open_until = 1, 0.0  # opened by others; cooldown over
    m.answer(inv, fut, ErrorCode.CANCELLED)  # an outcome that says nothing of the backend
    assert (await first).error.type == ErrorCode.CANCELLED
    inv, fut = await asyncio.wait_for(m.next(), 1.0)  # it went, as the probe
    assert fn.probing
    third = await c.call("single", {"x": 2})
    assert third.error.type == ErrorCode.CIRCUIT_OPEN and "probe" in third.error.message
    m.answer(inv, fut)
    assert (await second).ok
    assert fn.consecutive_failures == 0 and not fn.probing
    await c.aclose()


@pytest.mark.parametrize("deadline_s", [0.0, -1.0])
async def test_a_call_whose_deadline_already_passed_is_not_sent(deadline_s):
    """A deadline that had passed when the call was made (a remaining budget computed as 0
    or less) was sent all the same when a slot was free: a remote function ran for a caller
    that was answered DeadlineExceeded (here, the in-process fake answered it ok)."""
    fake = FakeBackend(REG)
    async with _client(fake) as c:
        r = await c.call("parts", {"x": 1}, deadline_s=deadline_s)
        assert r.error is not None and r.error.type == ErrorCode.DEADLINE_EXCEEDED
        assert "not sent" in r.error.message
        assert fake.invocations == []
        assert c.metrics()["parts"]["errors"] == {ErrorCode.DEADLINE_EXCEEDED: 1}


async def test_a_kept_answer_is_not_shared_with_its_callers():
    """The cache kept the caller's value by reference and gave every later caller the same
    object: a caller that changed its reward in place (normalised a score, appended to a
    list) changed the answer every later caller with the key got."""
    fake = FakeBackend(REG)
    async with _client(fake) as c:
        r1 = await c.call("parts", {"x": 1}, idempotency_key="t1")
        r1.value["score"] = 99
        r2 = await c.call("parts", {"x": 1}, idempotency_key="t1")
        assert r2.cached and r2.value == {"score": 1, "components": [1]}
        r2.value["components"].append(5)
        r3 = await c.call("parts", {"x": 1}, idempotency_key="t1")
        assert r3.value == {"score": 1, "components": [1]}
        assert fake.executions["parts:" + REG.get("parts").version + ":t1"] == 1


async def test_callers_that_joined_an_execution_get_values_of_their_own():
    m = _Manual()
    c = _client(m, hedge={"enabled": False})
    a = asyncio.create_task(c.call("parts", {"x": 1}, idempotency_key="t"))
    inv, fut = await m.next()
    b = asyncio.create_task(c.call("parts", {"x": 1}, idempotency_key="t"))
    await asyncio.sleep(0)
    fut.set_result(Result.built(True, function=inv.function, request_id=inv.request_id, value={"s": [1]}))
    ra, rb = await asyncio.gather(a, b)
    assert rb.cached and ra.value == rb.value == {"s": [1]}
    ra.value["s"].append(2)
    assert rb.value == {"s": [1]}
    assert (await c.call("parts", {"x": 1}, idempotency_key="t")).value == {"s": [1]}
    await c.aclose()


async def test_map_and_stream_refuse_one_idempotency_key_for_many_payloads():
    """``map(name, payloads, idempotency_key=k)`` gave every payload's call the one key: the
    first payload's answer came back for all of them, marked cached (a batch of rewards
    scored as its first trajectory)."""
    fake = FakeBackend(REG)
    async with _client(fake) as c:
        with pytest.raises(ConfigError, match="idempotency_key"):
            await c.map("parts", [{"x": 1}, {"x": 2}], idempotency_key="batch")
        with pytest.raises(ConfigError, match="idempotency_key"):
            async for _ in c.stream("parts", [{"x": 1}, {"x": 2}], idempotency_key="batch"):
                pass  # refused before the first result
        assert fake.invocations == []


async def test_cold_start_answers_stay_out_of_the_hedge_delay():
    """The hedge delay is the observed p95 of answered attempts; a cold start's answer (a
    worker's import and setup hook, waited for by the calls queued at a job's start) is no
    straggler of a warm pool, and kept in the window it set the p95, and so the hedge delay,
    at the cold-start time for the next thousands of calls."""

    class Cold(FakeBackend):
        def _submit(self, inv: Invocation) -> asyncio.Future:
            fut = asyncio.get_running_loop().create_future()
            r = Result.built(True, function=inv.function, request_id=inv.request_id, value=1)
            r.cold_start = inv.payload["x"] == 1
            fut.set_result(r)
            return fut

    async with _client(Cold(REG)) as c:
        await c.call("parts", {"x": 1})
        window = c._fns["parts"].metrics.window
        assert len(window.samples) == 0
        await c.call("parts", {"x": 2})
        assert len(window.samples) == 1
        assert c.metrics()["parts"]["cold_starts"] == 1


class _Broken(_Manual):
    """A backend whose futures end without a ``Result``: raising (a bug, a library error it did
    not translate) or cancelled by itself (an executor shut down under its calls at close)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def _submit(self, inv: Invocation) -> asyncio.Future:
        fut = super()._submit(inv)
        if self.how == "raise":
            fut.set_exception(RuntimeError("Session is closed"))
        elif self.how == "cancel":
            fut.cancel()
        return fut


@pytest.mark.parametrize("how", ["raise", "cancel"])
async def test_a_backend_future_without_a_result_is_a_failed_result(how):
    """``await primary`` let a backend future's exception, or its own cancellation, out of
    ``Client.call`` (a CancelledError in a task no one cancelled: a ``gather`` over a batch
    read it as its own cancellation); a failed call is a ``Result``, never an exception."""
    b = _Broken(how)
    c = _client(b, hedge={"enabled": False})
    r = await c.call("single", {"x": 1})
    assert not r.ok
    assert r.error.type == (ErrorCode.TRANSPORT if how == "raise" else ErrorCode.CANCELLED)
    assert "RuntimeError: Session is closed" in r.error.message or how == "cancel"
    assert c.metrics()["single"]["errors"] == {r.error.type: 1}
    await c.aclose()


async def test_a_hedged_call_whose_primary_raises_is_answered_not_hung():
    """Hedged, the copy's done callback read ``f.result()``: a future that raised raised in
    the callback (logged by the loop), no answer was ever set, and the call waited for its
    deadline (or for good), its hedge sent meanwhile to a backend that had failed it."""
    m = _Manual()
    c = _client(m, hedge={"min_samples": 1, "min_delay_ms": 50})
    first = asyncio.create_task(c.call("single", {"x": 0}))
    inv, fut = await m.next()
    m.answer(inv, fut)
    assert (await first).ok  # one latency observed: the next call is hedged after it
    call = asyncio.create_task(c.call("single", {"x": 1}, deadline_s=5))
    inv, fut = await m.next()
    fut.set_exception(RuntimeError("boom"))
    r = await call
    assert r.error.type == ErrorCode.TRANSPORT and "RuntimeError: boom" in r.error.message
    assert len(m.invocations) == 2  # no hedge went for a call already answered
    await c.aclose()


async def test_request_ids_carry_enough_randomness_to_be_unique_across_a_fleet():
    """A plain call's idempotency key is ``name:version:<client prefix>-<n>``, and the Lambda
    handler deduplicates on it (per tenant) for its TTL. The prefix was 32 random bits: among
    10,000 client processes within a TTL (reward workers of a large job, restarted), two share
    one with a chance of about 1%, and then their n-th calls share a key: each call of the one
    refused by the handler as the same key with another payload, or answered with the other's
    result where the payloads agree."""
    fake = FakeBackend(REG)
    async with _client(fake) as c:
        await c.call("parts", {"x": 1})
    prefix = fake.invocations[0].request_id.rpartition("-")[0]
    assert len(prefix) >= 16 and int(prefix, 16) >= 0  # 64 bits: ~3e-12 for 10,000 clients


async def test_a_key_used_again_with_another_payload_is_refused_not_answered_from_the_cache():
    """The cache answered a key's later caller whatever its payload: a key reused for
    another trajectory (a key built from a batch index, a trajectory id that repeats across
    epochs) got the first payload's reward back, marked cached. The Lambda handler refuses
    it ("already used with another payload"); the client now does too, on every backend, and
    keeps the key's answer for the payload that made it."""
    fake = FakeBackend(REG)
    async with _client(fake) as c:
        assert (await c.call("parts", {"x": 1}, idempotency_key="t")).value["score"] == 1
        r = await c.call("parts", {"x": 2}, idempotency_key="t")
        assert r.error is not None and r.error.type == ErrorCode.INVALID_ARGUMENTS
        assert "another payload" in r.error.message and not r.cached
        again = await c.call("parts", {"x": 1}, idempotency_key="t")
        assert again.cached and again.value["score"] == 1
        assert len(fake.invocations) == 1


async def test_a_caller_with_another_payload_does_not_join_the_keys_execution():
    m = _Manual()
    c = _client(m, hedge={"enabled": False})
    first = asyncio.create_task(c.call("parts", {"x": 1}, idempotency_key="t"))
    inv, fut = await m.next()
    other = asyncio.create_task(c.call("parts", {"x": 2}, idempotency_key="t"))
    await asyncio.sleep(0)
    m.answer(inv, fut)
    assert (await first).ok
    r = await other  # it had joined: the answer for {"x": 1}, marked cached
    assert r.error is not None and r.error.type == ErrorCode.INVALID_ARGUMENTS
    assert c.metrics()["parts"]["errors"] == {ErrorCode.INVALID_ARGUMENTS: 1}
    await c.aclose()


async def test_no_hedge_is_sent_once_the_circuit_opened():
    """A straggler's hedge went whatever the circuit said: with the backend down and calls
    hanging in it (a connect timeout), the circuit opened on the failures that came back and
    still every straggler within the hedge share sent one more call into the backend down."""
    m = _Manual()
    c = _client(m, hedge={"min_samples": 1, "min_delay_ms": 50}, breaker={"failure_threshold": 1})
    first = asyncio.create_task(c.call("parts", {"x": 0}))
    inv, fut = await m.next()
    m.answer(inv, fut)
    assert (await first).ok  # one latency observed: calls are hedged after ~50 ms
    straggler = asyncio.create_task(c.call("parts", {"x": 1}))
    s_inv, s_fut = await m.next()
    failing = asyncio.create_task(c.call("parts", {"x": 2}))
    inv, fut = await m.next()
    m.answer(inv, fut, ErrorCode.TRANSPORT)  # the circuit opens (threshold 1)
    assert (await failing).error.type == ErrorCode.TRANSPORT
    await asyncio.sleep(0.1)  # past the straggler's hedge time (loop timers fire in order)
    assert len(m.invocations) == 3, [i.request_id for i in m.invocations]
    m.answer(s_inv, s_fut)
    assert (await straggler).ok and c.metrics()["parts"]["hedges"] == 0
    await c.aclose()
