"""Keyed calls (``idempotency_key``): one execution per key, shared by the callers that
join it, each with its own deadline (the execution runs to the latest); what the key keeps
after a failure (a side effect that may have run is not run again); the metrics of a keyed
execution; the backends' ``extend_deadline`` and keyed calls in real workers."""

from __future__ import annotations

import asyncio
import time

import pytest
from client_fns import REG
from client_helpers import _ManualBackend, make

from fabric.backends.base import InprocConfig, LocalConfig, make_backend
from fabric.client import Client, ClientConfig
from fabric.errors import ErrorCode
from fabric.protocol import Invocation
from fabric.testing import Fault


async def test_idempotency_key_means_one_execution():
    c, fake = make()
    r1 = await c.call("double", {"x": 3}, idempotency_key="traj-1")
    r2 = await c.call("double", {"x": 3}, idempotency_key="traj-1")
    assert r1.value == r2.value == 6 and r2.cached and not r1.cached
    # concurrent calls with one key share a single execution
    rs = await asyncio.gather(
        *(c.call("nap", {"seconds": 0.05, "tag": 1}, idempotency_key="k") for _ in range(5))
    )
    assert all(r.value == 1 for r in rs)
    assert sum(fake.executions.values()) == 2
    assert c.metrics()["nap"]["cache_hits"] == 4


async def test_a_cached_answer_carries_its_own_latency_not_the_first_caller_s():
    # the cache kept the first caller's Result itself: its settle wrote that caller's
    # latency into what every later hit got (a 0.1 ms hit reported the 300 ms execution).
    # A hit's own is well under a millisecond: the bound is half the execution's, for a
    # loaded machine's scheduling
    c, _ = make()
    first = await c.call("nap", {"seconds": 0.3, "tag": 1}, idempotency_key="k")
    hit = await c.call("nap", {"seconds": 0.3, "tag": 1}, idempotency_key="k")
    assert hit.cached and first.timings.total_ms >= 300 and hit.timings.total_ms < 150
    assert (await c.call("nap", {"seconds": 0.3, "tag": 1}, idempotency_key="k")).timings.total_ms < 150
    assert first.timings.total_ms >= 300  # and a hit's latency does not leak back into it


async def test_retry_after_failure_keeps_the_idempotency_key():
    c, fake = make()
    fake.fail_next("double", ErrorCode.WORKER_LOST)
    r = await c.call("double", {"x": 1}, idempotency_key="t")
    assert r.ok and r.attempts == 2
    keys = {i.idempotency_key for i in fake.invocations}
    assert len(keys) == 1 and "double" in keys.pop()


async def test_side_effects_are_retried_only_when_the_call_did_not_run():
    c, fake = make()
    fake.fail_next("effect", ErrorCode.NOT_STARTED)
    r = await c.call("effect", {"x": 1})
    assert r.ok and r.attempts == 2  # never started: safe to retry
    fake.fail_next("effect", ErrorCode.WORKER_LOST)
    r = await c.call("effect", {"x": 1})
    assert not r.ok and r.error.type == ErrorCode.WORKER_LOST and r.attempts == 1  # may have run: not again
    fake.fail_next("effect", ErrorCode.TIMEOUT)
    assert (await c.call("effect", {"x": 1})).attempts == 1


async def test_a_cancelled_caller_leaves_the_keyed_execution_to_the_others():
    c, fake = make()
    async with c:
        owner = asyncio.create_task(c.call("nap", {"seconds": 0.3, "tag": 1}, idempotency_key="k"))
        await asyncio.sleep(0.05)
        waiter = asyncio.create_task(c.call("nap", {"seconds": 0.3, "tag": 1}, idempotency_key="k"))
        await asyncio.sleep(0.05)
        owner.cancel()
        r = await asyncio.wait_for(waiter, 2)
        assert r.ok and r.value == 1 and r.cached  # the execution went on; the waiter joined it
        assert len(fake.invocations) == 1


async def test_a_caller_joining_a_keyed_execution_keeps_its_own_deadline():
    c, fake = make()
    async with c:
        owner = asyncio.create_task(c.call("nap", {"seconds": 3.0, "tag": 3}, idempotency_key="k"))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        r = await c.call("nap", {"seconds": 3.0, "tag": 3}, idempotency_key="k", deadline_s=0.2)
        elapsed = time.monotonic() - t0
        # its own deadline (0.2 s), not the shared execution's end (3 s)
        assert r.error.type == ErrorCode.DEADLINE_EXCEEDED and elapsed < 1.5, (elapsed, r.error)
        assert (await owner).value == 3  # giving up did not cancel the shared execution
        assert len(fake.invocations) == 1


async def test_metrics_count_a_keyed_execution_s_outcome_not_its_starter_s_give_up():
    c, fake = make()
    async with c:
        # the starter gives up at 0.1 s, a joiner at 0.15 s; the execution ends well at 0.6 s
        starter = asyncio.create_task(
            c.call("nap", {"seconds": 0.6, "tag": 7}, idempotency_key="k", deadline_s=0.1)
        )
        await asyncio.sleep(0.05)
        joiner = await c.call("nap", {"seconds": 0.6, "tag": 7}, idempotency_key="k", deadline_s=0.1)
        assert (await starter).error.type == joiner.error.type == ErrorCode.DEADLINE_EXCEEDED
        m = c.metrics()["nap"]
        assert (m["ok"], m["errors"]) == (0, {}) and m.get("gave_up") == 2  # nothing ended yet
        await asyncio.wait_for(asyncio.gather(*c._executions), 2)
        m = c.metrics()["nap"]
        # the execution's real outcome, once, with its latency; the give-ups are not errors
        assert (m["calls"], m["ok"], m["errors"], m["gave_up"]) == (2, 1, {}, 2)
        assert sum(m["latency_ms"]["buckets"].values()) == 1 and m["latency_ms"]["sum"] >= 550
        # the same when it fails: its failure is counted, not the starter's DeadlineExceeded
        fake.inject("double", Fault(code=ErrorCode.UNAVAILABLE, delay_s=0.1))
        r = await c.call("double", {"x": 1}, idempotency_key="d", deadline_s=0.05)
        assert r.error.type == ErrorCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(asyncio.gather(*c._executions), 2)
        assert c.metrics()["double"]["errors"] == {"Unavailable": 1}
        assert c.metrics()["double"]["gave_up"] == 1
    assert len(fake.invocations) == 2  # one of each (no retry: the execution's deadline had passed)


async def test_a_keyed_execution_that_sent_nothing_counts_once_as_a_give_up():
    """Its caller's deadline passes while the execution waits for the only concurrency slot:
    nothing is sent, and the call counts once, in gave_up (not in errors too)."""
    c, fake = make()
    async with c:
        busy = asyncio.create_task(c.call("one_at_a_time", {"seconds": 0.4}))  # holds the slot
        await asyncio.sleep(0.01)
        r = await c.call("one_at_a_time", {"seconds": 0.0}, idempotency_key="k", deadline_s=0.1)
        assert r.error.type == ErrorCode.DEADLINE_EXCEEDED
        assert (await busy).ok
        await asyncio.wait_for(asyncio.gather(*c._executions), 2)
        m = c.metrics()["one_at_a_time"]
        assert (m["calls"], m["ok"], m["errors"], m["gave_up"]) == (2, 1, {}, 1)
        assert sum(m["latency_ms"]["buckets"].values()) == 1  # the busy call's
    assert len(fake.invocations) == 1


async def test_closing_the_client_ends_the_keyed_executions_nobody_waits_for():
    c, _ = make()
    t0 = time.monotonic()
    async with c:
        r = await c.call("nap", {"seconds": 30}, idempotency_key="k", deadline_s=0.05)
        assert r.error.type == ErrorCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 5


async def test_one_idempotency_key_runs_a_side_effect_once(tmp_path):
    """The first caller's deadline passes while the call runs on in its worker (the worker is
    not killed for a caller's deadline); a second caller with the key joins that execution
    instead of paying a second time, and a later one gets the cached answer."""
    path = tmp_path / "payments"
    payload = {"path": str(path), "amount": 5, "seconds": 0.6}
    async with Client(backend=LocalConfig(max_workers=2), registry=REG) as c:
        await c.warmup(["charge"])
        first = asyncio.create_task(c.call("charge", payload, idempotency_key="order-1", deadline_s=0.2))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(c.call("charge", payload, idempotency_key="order-1"))
        r1, r2 = await asyncio.gather(first, second)
        assert path.read_text().split() == ["5"], "one idempotency key, two executions of a side effect"
        assert r1.error.type == ErrorCode.DEADLINE_EXCEEDED and "goes on" in r1.error.message
        assert r2.ok and r2.value == 5 and r2.cached
        r3 = await c.call("charge", payload, idempotency_key="order-1", deadline_s=0.2)
        assert r3.ok and r3.cached
    assert path.read_text().split() == ["5"]


async def test_a_keyed_async_call_stops_in_its_worker_when_its_callers_deadline_passes(tmp_path):
    """The execution's deadline goes to the worker, which cancels the async handler there
    instead of letting it run to its timeout_s (10 s) for nobody. Cut part way, a side
    effect may have happened: the key keeps OutcomeUnknown, as after any worker timeout."""
    path = tmp_path / "deliveries"
    # margins for a loaded 2-core machine: the call must have started in its worker before
    # the deadline (else it is a "not started" DeadlineExceeded, which leaves the key free)
    payload = {"path": str(path), "seconds": 2.0}
    async with Client(backend=LocalConfig(max_workers=1), registry=REG) as c:
        await c.warmup(["deliver"])
        r = await c.call("deliver", payload, idempotency_key="parcel-1", deadline_s=0.8)
        # the caller's wait and the worker's cut end at the same deadline: whichever the loop
        # sees first (its own give-up, or the execution's cut answered in time) is its answer
        assert r.error.type in (ErrorCode.DEADLINE_EXCEEDED, ErrorCode.TIMEOUT)
        await asyncio.wait_for(asyncio.gather(*c._executions), 5)
        await asyncio.sleep(2.0)  # past the handler's own end, had it run on
        assert not path.exists(), "the handler ran on after every caller had given up"
        again = await c.call("deliver", payload, idempotency_key="parcel-1")
        assert again.error.type == ErrorCode.OUTCOME_UNKNOWN and ErrorCode.TIMEOUT in again.error.message
        stats = c.backend.stats()["deliver"]
        assert stats["timeouts"] == 0 and stats["lost"] == 0  # cancelled in the worker, not killed
        assert c.metrics()["deliver"]["errors"] == {ErrorCode.TIMEOUT: 1}


@pytest.mark.parametrize("backend", [LocalConfig(max_workers=1), "inproc"], ids=["local", "inproc"])
async def test_a_joiner_with_a_later_deadline_extends_the_keyed_call_in_its_worker(tmp_path, backend):
    """The execution runs to the latest deadline of its callers: a joiner with a later one
    (or none) moves the deadline of the call already running, so the handler is not cut at
    the starter's deadline and the joiner gets the one execution's answer."""
    path = tmp_path / "deliveries"
    payload = {"path": str(path), "seconds": 0.9}
    async with Client(backend=backend, registry=REG) as c:
        await c.warmup(["deliver"])
        for key, later in (("parcel-1", 5.0), ("parcel-2", None)):
            starter = asyncio.create_task(c.call("deliver", payload, idempotency_key=key, deadline_s=0.5))
            await asyncio.sleep(0.1)  # the call is running in the worker, with the starter's deadline
            joiner = await c.call("deliver", payload, idempotency_key=key, deadline_s=later)
            assert joiner.ok and joiner.value == "delivered" and joiner.cached, joiner.error
            assert (await starter).error.type == ErrorCode.DEADLINE_EXCEEDED
    assert path.read_text().split() == ["delivered", "delivered"]  # one execution per key


@pytest.mark.parametrize("config", [LocalConfig(max_workers=1), InprocConfig()], ids=["local", "inproc"])
async def test_calls_that_share_a_request_id_each_get_their_own_answer(config):
    """A request id is for tracing: the local pool batches the calls of one tick into one
    message (under ids of its own), so calls that share a request id, and even an idempotency
    key, sent together each get their own answer, keyed or not."""
    async with make_backend(config, REG) as b:
        await b.warmup(["nap"])
        invs = [
            Invocation(
                function="nap",
                payload={"seconds": 0.01 * (i % 2), "tag": i},
                request_id="same",
                idempotency_key="same-key" if i < 4 else None,
                deadline=time.time() + 30,
                wait_for_run=i % 2 == 0,
            )
            for i in range(6)
        ]
        async with asyncio.timeout(20):
            results = await asyncio.gather(*(b.submit(inv) for inv in invs))
        assert [r.value for r in results] == list(range(6)), [r.error for r in results]
        assert {r.request_id for r in results} == {"same"}


@pytest.mark.parametrize("config", [LocalConfig(max_workers=1), InprocConfig()], ids=["local", "inproc"])
async def test_extend_deadline_moves_where_a_keyed_async_call_is_cut(config):
    """``Backend.extend_deadline``, for each backend that can: a keyed execution's async call
    (``wait_for_run``) is cut at its deadline, and a move takes the cut to the new deadline
    (or to the function's own limit, for none), whether the call runs or has not started."""

    def keyed(key: str, seconds: float, deadline_s: float) -> Invocation:
        return Invocation(
            function="nap",
            payload={"seconds": seconds, "tag": 1},
            idempotency_key=key,
            deadline=time.time() + deadline_s,
            wait_for_run=True,
        )

    async with make_backend(config, REG) as b:
        await b.warmup(["nap"])

        async def case(key: str, seconds: float, deadline_s: float, to: float | None, after: float):
            fut = b.submit(keyed(key, seconds, deadline_s))
            if after:
                await asyncio.sleep(after)  # it runs, with the deadline it was sent with
            t0 = time.monotonic()
            if to != -1:
                assert b.extend_deadline("nap", key, None if to is None else time.time() + to)
            r = await fut
            return r, time.monotonic() - t0

        kept, later, none, unstarted, shorter = await asyncio.gather(
            case("kept", 1.0, 0.4, -1, 0),  # no move: cut at the deadline it was sent with
            case("later", 1.0, 0.4, 5.0, 0.2),
            case("none", 1.0, 0.4, None, 0.2),
            case("unstarted", 1.0, 0.2, 5.0, 0),  # moved before it started
            case("shorter", 5.0, 0.4, 0.8, 0.2),  # moved, and cut at the new deadline
        )
        assert kept[0].error.type == ErrorCode.TIMEOUT
        for r, _ in (later, none, unstarted):
            assert r.ok and r.value == 1, r.error
        r, waited = shorter
        assert r.error.type == ErrorCode.TIMEOUT and 0.6 < waited < 2.5, (r.error, waited)
        assert b.extend_deadline("nap", "kept", None)  # nothing under the key any more: nothing to move


@pytest.mark.parametrize("backend", [LocalConfig(max_workers=2), "inproc"], ids=["local", "inproc"])
async def test_a_keyed_sync_call_past_its_deadline_keeps_its_key_until_its_worker_answers(tmp_path, backend):
    """A synchronous handler cannot be stopped at the deadline it was sent with: the backend
    does not answer its call early, so the key stays busy while it runs, and a caller that
    comes after the first one gave up joins it instead of paying a second time (or being
    told OutcomeUnknown while the payment is still going through)."""
    path = tmp_path / "payments"
    payload = {"path": str(path), "amount": 5, "seconds": 0.6}
    async with Client(backend=backend, registry=REG) as c:
        await c.warmup(["charge"])
        first = await c.call("charge", payload, idempotency_key="order-1", deadline_s=0.2)
        assert first.error.type == ErrorCode.DEADLINE_EXCEEDED
        second = await c.call("charge", payload, idempotency_key="order-1", deadline_s=5)
        assert second.ok and second.value == 5 and second.cached
    assert path.read_text().split() == ["5"]


async def test_a_joiner_s_later_deadline_reaches_a_keyed_call_waiting_in_a_sync_worker_s_batch(tmp_path):
    """The keyed call waits, unstarted, behind a slow call on the only (synchronous) worker,
    which took it with the starter's deadline and cannot take a later message: a joiner with
    a later deadline still gets the run, not a DeadlineExceeded before its own deadline."""
    path = tmp_path / "payments"
    async with Client(backend=LocalConfig(max_workers=1, warm=1), registry=REG) as c:
        await c.warmup(["charge"])
        busy = asyncio.create_task(
            c.call("charge", {"path": str(tmp_path / "a"), "amount": 1, "seconds": 1.2})
        )
        await asyncio.sleep(0.05)  # the busy call went to the worker first
        payload = {"path": str(path), "amount": 5}
        starter = asyncio.create_task(c.call("charge", payload, idempotency_key="order", deadline_s=0.4))
        await asyncio.sleep(0.15)  # the keyed call is on the worker, behind the busy one
        joiner = await c.call("charge", payload, idempotency_key="order", deadline_s=10)
        assert joiner.ok and joiner.value == 5 and joiner.cached, joiner.error
        assert (await starter).error.type == ErrorCode.DEADLINE_EXCEEDED and (await busy).ok
    assert path.read_text().split() == ["5"]


async def test_a_keyed_execution_sends_the_latest_deadline_of_its_callers():
    c, fake = make()
    async with c:
        # the first attempt fails (retryably) after 0.1 s; a joiner with a later deadline
        # came meanwhile: the retry carries the joiner's deadline
        fake.inject("double", Fault(code=ErrorCode.WORKER_LOST, delay_s=0.1))
        t0 = time.time()
        starter = asyncio.create_task(c.call("double", {"x": 2}, idempotency_key="k", deadline_s=0.5))
        await asyncio.sleep(0.05)  # before the first attempt's answer: timers fire in order
        t1 = time.time()
        joiner = await c.call("double", {"x": 2}, idempotency_key="k", deadline_s=2.0)
        assert joiner.ok and joiner.value == 4 and (await starter).ok
        first, retry = fake.invocations
        assert first.wait_for_run and retry.wait_for_run
        assert t0 + 0.5 <= first.deadline < t1 + 0.5
        assert t1 + 2.0 <= retry.deadline < t1 + 2.1
        # a caller with no deadline: none is sent
        await c.call("double", {"x": 3}, idempotency_key="k2")
        assert fake.invocations[-1].deadline is None


async def test_a_side_effect_that_may_have_run_is_not_run_again_under_its_key():
    c, fake = make()
    for code in (ErrorCode.WORKER_LOST, ErrorCode.TIMEOUT):
        fake.fail_next("effect", code)
        r = await c.call("effect", {"x": 1}, idempotency_key=f"pay-{code}")
        assert r.error.type == code and r.attempts == 1
        sent = len(fake.invocations)
        again = await c.call("effect", {"x": 1}, idempotency_key=f"pay-{code}")
        assert again.error.type == ErrorCode.OUTCOME_UNKNOWN and not again.retryable and again.cached
        assert code in again.error.message and "new idempotency key" in again.error.message
        assert len(fake.invocations) == sent  # nothing was sent
    assert (await c.call("effect", {"x": 1}, idempotency_key="pay-new")).ok  # a new key runs it
    # a call that provably did not run leaves the key free
    fake.fail_next("effect", ErrorCode.THROTTLED, times=3)
    assert (await c.call("effect", {"x": 1}, idempotency_key="pay-t")).error.type == ErrorCode.THROTTLED
    assert (await c.call("effect", {"x": 1}, idempotency_key="pay-t")).ok
    # a pure function runs again after an infrastructure failure
    fake.fail_next("double", ErrorCode.WORKER_LOST, times=3)
    assert (await c.call("double", {"x": 2}, idempotency_key="d")).error.type == ErrorCode.WORKER_LOST
    r = await c.call("double", {"x": 2}, idempotency_key="d")
    assert r.ok and r.value == 4 and not r.cached


async def test_a_joiner_of_a_side_effect_that_may_have_run_gets_what_its_key_keeps():
    """A caller that joined a side effect's execution which ended FunctionTimeout (or
    WorkerLost) gets the key's OutcomeUnknown, as a later caller does: it got the raw,
    retryable failure marked cached, while the key said OutcomeUnknown. The starter gets its
    call's own outcome, counted once."""
    c, fake = make()
    async with c:
        for code in (ErrorCode.TIMEOUT, ErrorCode.WORKER_LOST):
            key = f"pay-{code}"
            fake.inject("effect", Fault(code=code, delay_s=0.1))
            starter = asyncio.create_task(c.call("effect", {"x": 1}, idempotency_key=key))
            await asyncio.sleep(0.02)  # the execution is in flight
            joiner = await c.call("effect", {"x": 1}, idempotency_key=key)
            first = await starter
            assert first.error.type == code and not first.cached and first.attempts == 1
            assert joiner.error.type == ErrorCode.OUTCOME_UNKNOWN and joiner.cached, joiner.error
            assert not joiner.retryable and code in joiner.error.message
            assert joiner.request_id != first.request_id
            later = await c.call("effect", {"x": 1}, idempotency_key=key)
            assert later.error.type == ErrorCode.OUTCOME_UNKNOWN and later.cached
            assert later.error.message == joiner.error.message
        assert len(fake.invocations) == 2  # one execution per key, nothing sent again
        m = c.metrics()["effect"]
        assert m["errors"] == {ErrorCode.TIMEOUT: 1, ErrorCode.WORKER_LOST: 1} and m["cache_hits"] == 4


async def test_infrastructure_failures_are_not_cached_under_a_key():
    c, fake = make()
    fake.fail_next("double", ErrorCode.THROTTLED, times=3)
    r = await c.call("double", {"x": 5}, idempotency_key="k")
    assert not r.ok and r.error.type == ErrorCode.THROTTLED
    r = await c.call("double", {"x": 5}, idempotency_key="k")
    assert r.ok and r.value == 10 and not r.cached
    # a user error is the function's answer: cached
    await c.call("fail_user", {"x": 1}, idempotency_key="u")
    assert (await c.call("fail_user", {"x": 1}, idempotency_key="u")).cached


async def test_a_caller_that_joined_a_failed_execution_gets_it_uncached_and_counted():
    c, fake = make()
    # the one execution under the key fails for good (3 attempts), slowly enough to be joined
    fake.inject("double", *(Fault(code=ErrorCode.UNAVAILABLE, delay_s=0.05) for _ in range(3)))
    first, joined = await asyncio.gather(
        c.call("double", {"x": 1}, idempotency_key="k"), c.call("double", {"x": 1}, idempotency_key="k")
    )
    assert len(fake.invocations) == 3  # one execution, shared
    assert not first.ok and not joined.ok
    assert joined.cached is False  # the key does not keep a retryable failure of a pure function
    m = c.metrics()["double"]
    assert m["cache_hits"] == 0 and m["errors"].get("Unavailable") == 2
    assert (await c.call("double", {"x": 1}, idempotency_key="k")).ok  # the key is free again


async def test_closing_the_client_before_a_keyed_execution_ran_leaves_no_key_in_flight():
    c, fake = make()
    fake.inject("double", Fault(delay_s=5.0))
    call = asyncio.create_task(c.call("double", {"x": 1}, idempotency_key="k"))
    await asyncio.sleep(0)  # the caller made the execution's task, which has not run yet
    await c.aclose()
    r = await call
    assert not r.ok and r.error.type == ErrorCode.CANCELLED
    assert c._inflight == {}  # its clean-up never ran: the close did it


async def test_a_keyed_call_made_while_the_client_closes_starts_no_execution(tmp_path):
    """``aclose`` cancelled the executions there were when it began, then forgot every key in
    flight: one started while it waited (a caller still at work as the client closed) ran
    on, no longer in flight, and the next caller with its key (on a backend the client does
    not own, which stays open) ran the side effect a second time beside it. The client is
    closed from the start of ``aclose``: neither call runs (test_client_closed)."""
    path = tmp_path / "deliveries"
    payload = {"path": str(path), "seconds": 0.3}
    c, _ = make()  # the FakeBackend is the test's: the client does not close it
    first = asyncio.create_task(c.call("nap", {"seconds": 30}, idempotency_key="a"))
    await asyncio.sleep(0)  # its execution runs
    closing = asyncio.create_task(c.aclose())
    await asyncio.sleep(0)  # the close cancelled it, and waits for it to end
    late = asyncio.create_task(c.call("deliver", payload, idempotency_key="b"))
    await asyncio.sleep(0)
    await closing
    again = await c.call("deliver", payload, idempotency_key="b")
    await asyncio.sleep(0.5)
    assert not path.exists()  # never delivered, let alone twice
    assert (await first).error.type == ErrorCode.CANCELLED
    assert (await late).error.type == ErrorCode.BACKEND_CLOSED  # refused: nothing in flight
    assert again.error.type == ErrorCode.BACKEND_CLOSED
    assert c._inflight == {}


async def test_an_idempotency_key_is_its_tenants_own():
    """The Lambda handler scopes a key by its tenant (two training jobs that both say
    "traj-7" share nothing), but the client kept one key space for every tenant its calls
    named (``tenant=``): another tenant's call with the key was refused as another payload's,
    or, with the same payload, answered from the first tenant's execution, its own side
    effect never applied."""
    c, fake = make()
    assert (await c.call("effect", {"x": 1}, idempotency_key="traj-7")).value == 1
    other = await c.call("effect", {"x": 2}, idempotency_key="traj-7", tenant="job-b")
    assert other.ok and other.value == 2
    same = await c.call("effect", {"x": 1}, idempotency_key="traj-8", tenant="job-b")
    mine = await c.call("effect", {"x": 1}, idempotency_key="traj-8")
    assert same.ok and mine.ok and not mine.cached  # each tenant's effect applied
    assert len(fake.invocations) == 4
    # the client's own tenant named is the same tenant: its key's kept answer
    assert (await c.call("effect", {"x": 1}, idempotency_key="traj-7", tenant="default")).cached
    # and what one tenant's key keeps after a run that may have had its effect is its own
    fake.fail_next("effect", ErrorCode.WORKER_LOST)
    assert not (await c.call("effect", {"x": 3}, idempotency_key="traj-9", tenant="job-b")).ok
    assert (await c.call("effect", {"x": 3}, idempotency_key="traj-9")).ok
    kept = await c.call("effect", {"x": 3}, idempotency_key="traj-9", tenant="job-b")
    assert kept.error.type == ErrorCode.OUTCOME_UNKNOWN


async def test_a_cached_answer_is_no_cold_start():
    """A call answered from its key's cache ran nowhere, but it carried the cold_start=True of
    the execution that made the answer (a caller that joined the execution got False)."""
    from fabric.protocol import Result

    manual = _ManualBackend()
    c = Client(
        backend=manual, registry=REG, config=ClientConfig.model_validate({"hedge": {"enabled": False}})
    )
    first = asyncio.create_task(c.call("nap", {"seconds": 0}, idempotency_key="k"))
    inv, fut = await manual.next()
    joined = asyncio.create_task(c.call("nap", {"seconds": 0}, idempotency_key="k"))
    fut.set_result(Result.built(True, function="nap", request_id=inv.request_id, value=1, cold_start=True))
    assert (await first).cold_start  # the one that ran on a cold worker
    assert (await joined).cached and not (await joined).cold_start
    hit = await c.call("nap", {"seconds": 0}, idempotency_key="k")
    assert hit.cached and hit.value == 1 and not hit.cold_start
    assert c.metrics()["nap"]["cold_starts"] == 1
