"""Review 17 of the client: a throttle's ``Retry-After`` past ``max_retry_after_s`` ends the
call at once instead of holding it (an hour, for a proxy's ``Retry-After: 3600``); calls
refused by a closed client count in ``metrics()``; a side effect under an idempotency key cut
by the close ends ``OutcomeUnknown``, not ``Cancelled``; and the lambda backend's S3 spill
uploads are bounded by ``max_connections`` and by the call's deadline."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from client_fns import REG
from client_helpers import _ManualBackend, make
from sample_fns import REG as SAMPLE_REG

from fabric.backends.base import LambdaConfig
from fabric.backends.lambda_ import LambdaBackend
from fabric.client import Client, ClientConfig
from fabric.errors import ConfigError, ErrorCode
from fabric.protocol import Invocation, Result
from fabric.testing import FakeBackend

#: How long a test waits for what must happen at once before it fails instead of hanging.
_GUARD_S = 10.0


def _throttled(inv: Invocation, retry_after_s: float) -> Result:
    r = Result.failure(ErrorCode.THROTTLED, "Rate exceeded", function=inv.function, request_id=inv.request_id)
    assert r.error is not None
    r.error.retry_after_s = retry_after_s
    return r


# ---------------------------------------------------------------- Retry-After's bound


@pytest.mark.parametrize("key", [None, "k"])
async def test_a_retry_after_past_the_bound_ends_the_call_throttled_at_once(key):
    """A faulty proxy's ``Retry-After: 3600`` held a call without a deadline for an hour."""
    manual = _ManualBackend()
    c = Client(backend=manual, registry=manual.registry, config={"hedge": {"enabled": False}})
    async with c:
        call = asyncio.create_task(c.call("double", {"x": 1}, idempotency_key=key))
        inv, fut = await manual.next()
        fut.set_result(_throttled(inv, 3600.0))
        r = await asyncio.wait_for(call, _GUARD_S)
    assert r.error is not None and r.error.type == ErrorCode.THROTTLED and r.attempts == 1, r.error
    assert "Retry-After" in r.error.message and "3600" in r.error.message
    assert "max_retry_after_s" in r.error.message
    assert len(manual.invocations) == 1  # nothing sent into the hour asked for


async def test_a_retry_after_within_the_bound_is_waited_as_before():
    manual = _ManualBackend()
    config = {"hedge": {"enabled": False}, "max_retry_after_s": 0.5}
    async with Client(backend=manual, registry=manual.registry, config=config) as c:
        call = asyncio.create_task(c.call("double", {"x": 1}))
        inv, fut = await manual.next()
        fut.set_result(_throttled(inv, 0.3))
        refused_at = time.monotonic()
        inv2, fut2 = await asyncio.wait_for(manual.next(), _GUARD_S)
        gap = time.monotonic() - refused_at
        manual.answer(inv2, fut2)
        r = await call
    assert r.ok and r.attempts == 2, r.error
    assert gap >= 0.3, f"retried {gap:.3f} s after a 429 that said 0.3 s"


def test_the_bound_is_a_client_setting():
    assert ClientConfig().max_retry_after_s == 60.0
    assert ClientConfig(max_retry_after_s=None).max_retry_after_s is None  # the deadline only
    with pytest.raises(ConfigError, match="max_retry_after_s"):
        Client(backend=FakeBackend(), config={"max_retry_after_s": 0})


async def test_an_unbounded_retry_after_still_stops_at_the_deadline():
    manual = _ManualBackend()
    config = {"hedge": {"enabled": False}, "max_retry_after_s": None}
    async with Client(backend=manual, registry=manual.registry, config=config) as c:
        call = asyncio.create_task(c.call("double", {"x": 1}, deadline_s=5.0))
        inv, fut = await manual.next()
        fut.set_result(_throttled(inv, 3600.0))
        r = await asyncio.wait_for(call, _GUARD_S)
    assert r.error is not None and r.error.type == ErrorCode.THROTTLED
    assert "the deadline left no time for attempt 2" in r.error.message


# ---------------------------------------------------------------- the closed client's metrics


async def test_calls_refused_by_the_closed_client_count_in_metrics():
    c, fake = make()
    assert (await c.call("double", {"x": 1})).ok
    await c.aclose()
    await c.call("double", {"x": 2})
    await c.call("double", {"x": 2}, idempotency_key="k")
    await c.map("double", [{"x": 3}, {"x": 4}])
    await c.call("effect", {"x": 1})  # a function not called before the close
    m = c.metrics()
    assert m["double"]["calls"] == 5 and m["double"]["ok"] == 1, m["double"]
    assert m["double"]["errors"] == {ErrorCode.BACKEND_CLOSED: 4}, m["double"]
    assert m["effect"]["calls"] == 1 and m["effect"]["errors"] == {ErrorCode.BACKEND_CLOSED: 1}
    unknown = await c.call("no_such_function", {})
    assert unknown.error is not None and unknown.error.type == ErrorCode.BACKEND_CLOSED
    assert "no_such_function" not in c.metrics()  # as an unknown name is not counted when open
    assert len(fake.invocations) == 1


async def test_a_call_refused_while_it_waited_for_a_slot_counts_once():
    c, _ = make()
    holder = asyncio.create_task(c.call("one_at_a_time", {"seconds": 0.2}))
    await asyncio.sleep(0.05)  # sent: it holds the function's only slot
    waiting = asyncio.create_task(c.call("one_at_a_time", {"seconds": 0.2}))
    await asyncio.sleep(0.05)  # in line for the slot
    await c.aclose()
    await holder
    assert (await waiting).error.type == ErrorCode.BACKEND_CLOSED
    m = c.metrics()["one_at_a_time"]
    assert (m["calls"], m["ok"], m["errors"]) == (2, 1, {ErrorCode.BACKEND_CLOSED: 1}), m


# ---------------------------------------------------------------- a keyed side effect cut by the close


async def _sent(fake: FakeBackend, n: int = 1) -> None:
    for _ in range(int(_GUARD_S / 0.005)):
        if len(fake.invocations) >= n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("never sent")


async def test_a_side_effect_cut_by_the_close_is_outcome_unknown_to_every_caller(tmp_path):
    """It ended ``Cancelled``, which says nothing of the effect: the caller, told nothing
    ran, called again with the key through a new client, and the effect ran twice wherever
    the backend had let the cut run go on (a remote one does)."""
    payload = {"path": str(tmp_path / "deliveries"), "seconds": 30}
    c, fake = make()
    first = asyncio.create_task(c.call("deliver", payload, idempotency_key="b"))
    await _sent(fake)
    joined = asyncio.create_task(c.call("deliver", payload, idempotency_key="b"))
    await asyncio.sleep(0)  # it joins the execution
    await c.aclose()
    for r in (await first, await joined):
        assert r.error is not None and r.error.type == ErrorCode.OUTCOME_UNKNOWN, r.error
        assert not r.retryable and r.started is True
        assert "client closed" in r.error.message and "new idempotency key" in r.error.message
    m = c.metrics()["deliver"]
    assert m["calls"] == 2 and m["errors"] == {ErrorCode.OUTCOME_UNKNOWN: 1} and m["cache_hits"] == 1, m
    assert len(fake.invocations) == 1


async def test_a_pure_function_cut_by_the_close_stays_cancelled():
    c, fake = make()
    call = asyncio.create_task(c.call("nap", {"seconds": 30}, idempotency_key="a"))
    await _sent(fake)
    await c.aclose()
    assert (await call).error.type == ErrorCode.CANCELLED  # nothing to apply twice


class _Queued(FakeBackend):
    """Says of every call let go that it had not begun (a call still queued)."""

    def started(self, function: str, fut: asyncio.Future[Result]) -> bool | None:
        return False


async def test_a_side_effect_the_backend_had_not_begun_at_the_close_stays_cancelled(tmp_path):
    fake = _Queued(REG)
    c = Client(backend=fake, registry=REG)
    call = asyncio.create_task(
        c.call("deliver", {"path": str(tmp_path / "d"), "seconds": 30}, idempotency_key="b")
    )
    await _sent(fake)
    await c.aclose()
    assert (await call).error.type == ErrorCode.CANCELLED  # it never ran: nothing unknown


async def test_a_side_effect_cut_in_its_backoff_after_a_throttle_stays_cancelled():
    """Its one attempt was refused (a throttle: it did not run), and the close came while it
    waited out the Retry-After: nothing ran, nothing is unknown."""
    manual = _ManualBackend()
    c = Client(backend=manual, registry=REG)
    call = asyncio.create_task(c.call("effect", {"x": 1}, idempotency_key="k"))
    inv, fut = await manual.next()
    fut.set_result(_throttled(inv, 5.0))
    await asyncio.sleep(0.05)  # in its backoff
    await c.aclose()
    r = await asyncio.wait_for(call, _GUARD_S)
    assert r.error is not None and r.error.type == ErrorCode.CANCELLED, r.error
    assert len(manual.invocations) == 1


# ---------------------------------------------------------------- spill uploads


class _BlockingS3:
    """Holds every upload until ``go`` is set; counts those at once."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.lock = threading.Lock()
        self.now = self.most = self.puts = 0

    def put_object(self, **_: object) -> None:
        with self.lock:
            self.puts += 1
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            self.go.wait(_GUARD_S)
        finally:
            with self.lock:
                self.now -= 1

    def close(self) -> None:
        pass


_BIG = {"blob": "x" * (7 * 1024 * 1024)}


async def _spilling(max_connections: int) -> tuple[LambdaBackend, _BlockingS3]:
    # a fabric serve that is not there: what is sent after the spill is refused NotStarted
    cfg = LambdaConfig(
        endpoint_url="http://127.0.0.1:1",
        token="t",
        spill_bucket="spill",
        region="us-east-1",
        max_connections=max_connections,
    )
    b = LambdaBackend(SAMPLE_REG, cfg)
    await b.start()
    b._s3.close()
    b._s3 = s3 = _BlockingS3()
    return b, s3


async def _until(cond, what: str) -> None:
    for _ in range(int(_GUARD_S / 0.005)):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(what)


async def test_spill_uploads_are_bounded_by_max_connections():
    """They ran on the loop's default executor: as many at once as it has threads, each a
    payload of over 6 MB, beside (and holding up) whatever else uses that executor."""
    b, s3 = await _spilling(max_connections=2)
    try:
        futs = [b.submit(Invocation(function="add", payload=_BIG)) for _ in range(5)]
        await _until(lambda: s3.puts >= 2, "no upload began")
        await asyncio.sleep(0.2)  # room for a third, were there any
        assert s3.most == 2, s3.most
        s3.go.set()
        results = await asyncio.wait_for(asyncio.gather(*futs), _GUARD_S)
        assert s3.puts == 5 and s3.most == 2
        assert all(r.error is not None and r.error.type == ErrorCode.NOT_STARTED for r in results)
    finally:
        s3.go.set()
        await b.aclose()


async def test_a_spill_waiting_past_its_deadline_is_not_uploaded():
    b, s3 = await _spilling(max_connections=1)
    try:
        holder = b.submit(Invocation(function="add", payload=_BIG))
        await _until(lambda: s3.puts == 1, "no upload began")
        late = Invocation(function="add", payload=_BIG, deadline=time.time() + 0.2)
        r = await asyncio.wait_for(b.invoke(late), _GUARD_S)
        assert r.error is not None and r.error.type == ErrorCode.DEADLINE_EXCEEDED, r.error
        assert r.started is False and "not sent" in r.error.message
        assert s3.puts == 1  # never uploaded
        s3.go.set()
        await holder
    finally:
        s3.go.set()
        await b.aclose()


async def test_a_call_whose_deadline_passes_during_its_upload_answers_at_the_deadline():
    """Its caller waited for the upload (up to botocore's 60 s read timeout), and the call
    went out after it, past its deadline."""
    b, s3 = await _spilling(max_connections=1)
    try:
        inv = Invocation(function="add", payload=_BIG, deadline=time.time() + 0.2)
        r = await asyncio.wait_for(b.invoke(inv), _GUARD_S)
        assert r.error is not None and r.error.type == ErrorCode.DEADLINE_EXCEEDED, r.error
        assert r.started is False and "not sent" in r.error.message
        assert s3.now == 1  # the upload runs on (boto3 cannot stop it), holding its slot
        s3.go.set()
        await _until(lambda: s3.now == 0, "the upload never ended")
        # its slot is back: the next call's upload goes
        s3.go.clear()
        nxt = b.submit(Invocation(function="add", payload=_BIG))
        await _until(lambda: s3.puts == 2, "the slot of the upload let go never came back")
        s3.go.set()
        assert (await asyncio.wait_for(nxt, _GUARD_S)).error.type == ErrorCode.NOT_STARTED
    finally:
        s3.go.set()
        await b.aclose()
