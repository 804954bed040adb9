"""Client behaviour against the shipped FakeBackend: retries, deadlines, hedging,
idempotency, the circuit breaker, streaming and metrics."""

from __future__ import annotations

import asyncio
import time

import pytest
from client_fns import REG

from fabric.backends.base import InprocConfig, LocalConfig, make_backend
from fabric.client import Client, ClientConfig
from fabric.errors import ConfigError, ErrorCode
from fabric.protocol import Invocation
from fabric.testing import FakeBackend, Fault


def make(**cfg) -> tuple[Client, FakeBackend]:
    fake = FakeBackend(REG)
    return Client(backend=fake, registry=REG, config=ClientConfig.model_validate(cfg)), fake


def test_a_bad_client_config_is_a_config_error_naming_the_key():
    """A typo in config= raised pydantic's ValidationError: not a FabricError, which the
    SDK's exceptions derive from (docs/fabric.md), and it named the model, not the key."""
    with pytest.raises(ConfigError) as e:
        Client(backend="inproc", registry=REG, config={"hedge": {"enabeld": False}})
    assert "hedge.enabeld: unknown key (did you mean 'enabled'?)" in str(e.value)
    with pytest.raises(ConfigError, match=r"breaker\.cooldown_s: must be > 0.0 \(got -1\)"):
        Client(backend="inproc", registry=REG, config={"breaker": {"cooldown_s": -1}})


@pytest.mark.parametrize(
    ("backend", "text"),
    [
        # the type is right: the key is what failed ("known types: ..." sent you looking)
        (
            {"type": "local", "max_worker": 2},
            "local backend config: max_worker: unknown key (did you mean 'max_workers'?)",
        ),
        (
            {"type": "lambada"},
            "unknown type 'lambada' (did you mean 'lambda'?); known types: inproc, local, lambda, modal",
        ),
        ({"max_workers": 2}, "no 'type'; known types: inproc, local"),
    ],
)
def test_a_bad_backend_config_says_what_failed(backend, text):
    with pytest.raises(ConfigError) as e:
        Client(backend=backend, registry=REG)
    assert text in str(e.value)
    assert ("known types" in str(e.value)) == (backend.get("type") != "local")


def test_a_backend_config_may_be_any_mapping_and_a_bad_token_is_not_shown():
    from types import MappingProxyType

    from fabric.backends.base import parse_backend_config

    # the type check took only a dict: any other mapping, which pydantic took, was refused
    assert parse_backend_config(MappingProxyType({"type": "local", "max_workers": 2})).max_workers == 2
    # a token typed unquoted in YAML is an int: refused, without its value
    with pytest.raises(ConfigError) as e:
        parse_backend_config({"type": "lambda", "token": 123456789012, "endpoint_url": "http://x"})
    assert "token: Input should be a valid string" in str(e.value) and "123456789012" not in str(e.value)


def test_a_bad_backend_config_never_shows_its_values():
    """A lambda config carries a token: the error names the keys, not what they hold."""
    with pytest.raises(ConfigError) as e:
        Client(backend={"type": "lambada", "token": "s3cret-token"}, registry=REG)
    assert "s3cret-token" not in str(e.value) and "'token'" in str(e.value) and "'lambda'" in str(e.value)


async def test_retryable_failures_are_retried_with_backoff():
    c, fake = make()
    fake.fail_next("double", ErrorCode.WORKER_LOST, times=2)
    r = await c.call("double", {"x": 4})
    assert r.ok and r.value == 8 and r.attempts == 3
    assert [i.attempt for i in fake.invocations] == [1, 2, 3]
    assert c.metrics()["double"]["retries"] == 2


async def test_retries_stop_at_max_attempts():
    c, fake = make()
    fake.fail_next("double", ErrorCode.THROTTLED, times=10)
    r = await c.call("double", {"x": 1})
    assert not r.ok and r.error.type == ErrorCode.THROTTLED and r.retryable and r.attempts == 3
    assert len(fake.invocations) == 3


async def test_user_errors_are_never_retried():
    c, fake = make()
    r = await c.call("fail_user", {"x": 1})
    assert not r.ok and r.error.type == ErrorCode.USER_ERROR and "KeyError" in r.error.message
    assert len(fake.invocations) == 1


async def test_deadline_bounds_the_retries():
    c, fake = make()
    # every attempt takes 0.1 s and fails retryably; the policy would allow 20 attempts
    fake.inject("slow_retry", *(Fault(code=ErrorCode.TRANSPORT, delay_s=0.1) for _ in range(20)))
    t0 = time.monotonic()
    r = await c.call("slow_retry", {"x": 1}, deadline_s=0.25)
    assert not r.ok and time.monotonic() - t0 < 1.0  # the 20 attempts would take 2 s
    assert 2 <= len(fake.invocations) <= 4
    assert fake.invocations[0].deadline is not None  # the deadline travels with the call


@pytest.mark.parametrize("backend", ["inproc", "local"])
async def test_a_deadline_of_no_time_is_no_deadline_or_refused(backend):
    """deadline_s=math.inf (or 1e300) raised OverflowError inside the backend's nanosecond
    clock, NaN a ValueError: the caller got an exception instead of a Result."""
    cfg = InprocConfig() if backend == "inproc" else LocalConfig(warm=1, max_workers=1)
    async with Client(backend=cfg, registry=REG) as c:
        for endless in (float("inf"), 1e300):
            r = await c.call("double", {"x": 4}, deadline_s=endless)
            assert r.ok and r.value == 8, r.error
        r = await c.call("double", {"x": 4}, deadline_s=float("nan"))
        assert not r.ok and r.error.type == ErrorCode.INVALID_ARGUMENTS and "NaN" in r.error.message
        r = await c.call("double", {"x": 4}, deadline_s=float("nan"), idempotency_key="k")
        assert not r.ok and r.error.type == ErrorCode.INVALID_ARGUMENTS


def test_an_invocation_on_the_wire_carries_a_finite_deadline():
    for bad in (float("nan"), float("inf"), 1e300, 0.0, -1.0):
        with pytest.raises(ValueError):
            Invocation.model_validate({"function": "double", "deadline": bad})
    assert Invocation.model_validate({"function": "double", "deadline": time.time() + 5}).deadline


async def test_retry_backoff_never_sleeps_past_the_deadline():
    # a backoff of up to 5 s (full jitter) against a 0.3 s deadline: the retries stop when the
    # next sleep would end after the deadline, for a keyed execution as for a plain call
    c, _ = make()
    async with c:
        for key in (None, None, "k1", "k2"):
            t0 = time.monotonic()
            r = await c.call("overloaded", {}, deadline_s=0.3, idempotency_key=key)
            elapsed = time.monotonic() - t0
            assert not r.ok and elapsed < 1.0, f"deadline 0.3 s, answered after {elapsed:.2f} s ({r.error})"


async def test_a_deadline_during_retries_keeps_the_cause():
    c, fake = make()
    r = await c.call("overloaded", {}, deadline_s=0.3)
    # the real failure, not a made-up "deadline passed before a retry could start"
    assert r.error.type == ErrorCode.UNAVAILABLE and r.retryable
    assert "judge endpoint overloaded" in r.error.message and "deadline left no time" in r.error.message
    assert r.attempts == len(fake.invocations) < 5


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
    # latency into what every later hit got (a 0.1 ms hit reported the 80 ms execution)
    c, _ = make()
    first = await c.call("nap", {"seconds": 0.08, "tag": 1}, idempotency_key="k")
    hit = await c.call("nap", {"seconds": 0.08, "tag": 1}, idempotency_key="k")
    assert hit.cached and first.timings.total_ms >= 80 and hit.timings.total_ms < 40
    assert (await c.call("nap", {"seconds": 0.08, "tag": 1}, idempotency_key="k")).timings.total_ms < 40
    assert first.timings.total_ms >= 80  # and a hit's latency does not leak back into it


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


@pytest.mark.parametrize("backend", ["fake", "inproc"])
async def test_a_call_waiting_for_a_concurrency_slot_ends_at_its_deadline(backend):
    fake = FakeBackend(REG)
    async with Client(backend=fake if backend == "fake" else "inproc", registry=REG) as c:
        busy = asyncio.create_task(c.call("one_at_a_time", {"seconds": 1.0}))  # holds the only slot
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        r = await c.call("one_at_a_time", {"seconds": 0.0}, deadline_s=0.1)
        assert time.monotonic() - t0 < 0.5  # at its deadline, not when the slot frees (1 s)
        assert r.error.type == ErrorCode.DEADLINE_EXCEEDED
        assert "waited for a concurrency slot" in r.error.message and "nothing was sent" in r.error.message
        assert (await busy).ok
        assert (await c.call("one_at_a_time", {"seconds": 0.0}, deadline_s=0.5)).ok  # no slot leaked
        assert c.metrics()["one_at_a_time"]["errors"] == {"DeadlineExceeded": 1}
    if backend == "fake":
        assert [i.payload["seconds"] for i in fake.invocations] == [1.0, 0.0]  # not the one that gave up


@pytest.mark.parametrize("hedged", [False, True])
async def test_a_backend_that_does_not_answer_by_the_deadline_is_left_at_the_deadline(hedged):
    # the fake, like Lambda or Modal, does not stop a call at its caller's deadline
    c, fake = make(hedge={"enabled": hedged, "min_samples": 1})
    async with c:
        assert (await c.call("nap", {"seconds": 0})).ok  # the hedge delay's first sample
        fake.inject("nap", Fault(delay_s=5), Fault(delay_s=5))  # the call, and its hedge
        t0 = time.monotonic()
        r = await c.call("nap", {"seconds": 0}, deadline_s=0.2)
        assert r.error.type == ErrorCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 1
        assert len(fake.invocations) == (3 if hedged else 2)
        await asyncio.sleep(0)  # the copies were cancelled, not left to run
        assert not [t for t in asyncio.all_tasks() if "_invoke" in repr(t.get_coro())]


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


async def _warm_latency(c: Client, n: int = 30) -> None:
    await c.map("nap", [{"seconds": 0.001}] * n)


async def test_hedge_fires_after_p95_and_first_answer_wins():
    c, fake = make(hedge={"min_samples": 20, "max_share": 0.5})
    await _warm_latency(c)
    fake.inject("nap", Fault(delay_s=5.0))  # the primary straggles, the hedge does not
    t0 = time.monotonic()
    r = await c.call("nap", {"seconds": 0.001, "tag": 9})
    assert r.ok and r.value == 9 and r.hedged
    assert time.monotonic() - t0 < 2.5  # the hedge's answer, not the straggler's (5 s)
    m = c.metrics()["nap"]
    assert m["hedges"] == 1 and m["hedge_wins"] == 1
    assert (
        fake.invocations[-1].hedge
        and fake.invocations[-1].idempotency_key == fake.invocations[-2].idempotency_key
    )


async def test_a_hedge_fires_after_the_current_p95_when_the_p95_dropped():
    c, fake = make(hedge={"min_samples": 5})
    async with c:
        fake.inject("nap", *(Fault(delay_s=0.5) for _ in range(5)))
        await c.map("nap", [{"seconds": 0}] * 5)  # the first p95: 0.5 s
        fake.inject("nap", Fault(delay_s=3.0))
        x = asyncio.create_task(c.call("nap", {"seconds": 0}))  # its hedge is due in 0.5 s
        await asyncio.sleep(0.01)
        for _ in range(123):  # the 128th latency recomputes the p95: under a millisecond now
            await c.call("nap", {"seconds": 0})
        fake.inject("nap", Fault(delay_s=3.0))
        t0 = time.monotonic()
        y = await c.call("nap", {"seconds": 0})  # its hedge is due in min_delay_ms, not after x's
        assert y.ok and y.hedged and time.monotonic() - t0 < 0.2
        assert (await x).hedged


async def test_a_keyed_call_is_hedged_under_its_key_and_its_answer_cached():
    c, fake = make(hedge={"min_samples": 20, "max_share": 0.5})
    async with c:
        await _warm_latency(c)
        fake.inject("nap", Fault(delay_s=5.0))  # the primary straggles, the hedge does not
        t0 = time.monotonic()
        r = await c.call("nap", {"seconds": 0.001, "tag": 9}, idempotency_key="h")
        assert r.ok and r.value == 9 and r.hedged and not r.cached
        assert time.monotonic() - t0 < 2.5  # the hedge's answer, not the straggler's (5 s)
        primary, dup = fake.invocations[-2:]
        assert dup.hedge and dup.idempotency_key == primary.idempotency_key
        assert fake.executions[primary.idempotency_key] == 1  # the straggler was cancelled
        again = await c.call("nap", {"seconds": 0.001, "tag": 9}, idempotency_key="h")
        assert again.cached and again.value == 9 and len(fake.invocations) == 32


async def test_a_keyed_hedge_that_did_not_start_in_time_does_not_win_over_its_running_primary():
    """A keyed execution's copy answered DeadlineExceeded never started (its backend does not
    answer such a call early once it runs): like a retryable failure, it waits for the other
    copy, which may be running, instead of ending the execution with a failure."""
    c, fake = make(hedge={"min_samples": 20, "max_share": 0.5})
    async with c:
        await _warm_latency(c)
        # the primary straggles and then succeeds; the hedge is answered as queued past its deadline
        fake.inject("nap", Fault(delay_s=0.5), Fault(code=ErrorCode.DEADLINE_EXCEEDED))
        r = await c.call("nap", {"seconds": 0.001, "tag": 9}, idempotency_key="h", deadline_s=5)
        assert r.ok and r.value == 9 and r.hedged, r.error
        assert fake.invocations[-1].hedge and c.metrics()["nap"]["hedge_wins"] == 0


async def test_no_hedge_when_disabled_or_for_side_effects():
    c, fake = make(hedge={"min_samples": 20, "enabled": False})
    await _warm_latency(c)
    fake.inject("nap", Fault(delay_s=0.3))
    r = await c.call("nap", {"seconds": 0.001})
    assert r.ok and not r.hedged
    c2, fake2 = make(hedge={"min_samples": 5})
    await c2.map("effect", [{"x": i} for i in range(10)])
    fake2.inject("effect", Fault(delay_s=0.3))
    r = await c2.call("effect", {"x": 1})
    assert r.ok and not r.hedged and not any(i.hedge for i in fake2.invocations)


async def test_a_function_declared_hedge_false_is_never_hedged_not_even_when_asked():
    c, fake = make(hedge={"min_samples": 5})
    await c.map("paid_nap", [{"seconds": 0.001}] * 10)
    fake.inject("paid_nap", Fault(delay_s=0.3))
    r = await c.call("paid_nap", {"seconds": 0.001, "tag": 4}, hedge=True)
    assert r.ok and r.value == 4 and not r.hedged
    assert not any(i.hedge for i in fake.invocations) and c.metrics()["paid_nap"]["hedges"] == 0
    # the same straggler on a function that allows hedges is hedged: the setting is what differs
    await _warm_latency(c)
    fake.inject("nap", Fault(delay_s=0.3))
    assert (await c.call("nap", {"seconds": 0.001})).hedged


async def test_a_hedge_takes_a_concurrency_slot_or_is_not_sent():
    """max_concurrency bounds the calls in flight, hedges included: a hedge sent while its
    caller held the only slot made two in flight (a limit a paid or rate-limited dependency
    relies on)."""
    c, fake = make(hedge={"min_samples": 5, "max_share": 1.0})
    await c.map("one_at_a_time", [{"seconds": 0}] * 10)
    fake.inject("one_at_a_time", Fault(delay_s=0.3))  # a straggler, due a hedge; no slot is free
    r = await c.call("one_at_a_time", {"seconds": 0})
    assert r.ok and not r.hedged
    assert not any(i.hedge for i in fake.invocations) and c.metrics()["one_at_a_time"]["hedges"] == 0
    # with a slot free the hedge takes it, and gives it back when it ends (here: it won)
    await c.map("two_at_a_time", [{"seconds": 0}] * 10)
    fake.inject("two_at_a_time", Fault(delay_s=5.0))
    r = await c.call("two_at_a_time", {"seconds": 0})
    assert r.ok and r.hedged and c.metrics()["two_at_a_time"]["hedge_wins"] == 1
    sem = c._fns["two_at_a_time"].sem
    assert sem.take_now() and sem.take_now() and not sem.take_now()  # both slots free again
    sem.release()
    sem.release()


async def test_a_saturated_function_is_hedged_within_its_allowance_past_the_limit():
    """Every slot held by a waiting caller (a saturated function) is exactly when a straggler
    needs a hedge: hedges may go past max_concurrency by over_limit_share of it, no more."""
    c, fake = make(hedge={"min_samples": 5, "max_share": 1.0, "over_limit_share": 0.5})
    await c.map("two_at_a_time", [{"seconds": 0}] * 10)
    fake.inject("two_at_a_time", Fault(delay_s=1.0))  # both callers' calls straggle
    a, b = await asyncio.gather(*(c.call("two_at_a_time", {"seconds": 0}) for _ in range(2)))
    # an allowance of int(0.5 * 2) = 1: one of the two stragglers is hedged, and wins
    assert a.ok and b.ok and [a.hedged, b.hedged].count(True) == 1
    fn = c._fns["two_at_a_time"]
    assert fn.hedges_over_limit == 0 and fn.sem.take_now() and fn.sem.take_now()  # all given back
    fn.sem.release()
    fn.sem.release()


async def test_the_over_limit_allowance_is_not_cut_by_float_rounding():
    """int(0.29 * 100) is 28 (0.29 * 100 == 28.999...): one hedge fewer than the documented
    share of the limit went over it."""
    from fabric.client_state import FnState

    fn = FnState(REG.get("double").model_copy(update={"max_concurrency": 100}), 0.95)
    while fn.sem.take_now():
        pass  # take every slot: the limit is full
    taken = [fn.take_hedge_slot(0.29) for _ in range(30)]
    assert sum(t is not None for t in taken) == 29


async def test_stream_refuses_a_max_inflight_below_one():
    c, _ = make()
    for bad in (0, -3):
        with pytest.raises(ConfigError, match="max_inflight must be >= 1"):
            async for _ in c.stream("double", [{"x": 1}], max_inflight=bad):
                pass  # never reached: refused before the first result


async def test_hedges_are_capped():
    c, fake = make(hedge={"min_samples": 20, "max_share": 0.0})
    await _warm_latency(c)
    for _ in range(8):
        fake.inject("nap", Fault(delay_s=0.2))
    await c.map("nap", [{"seconds": 0.001}] * 8)
    assert c.metrics()["nap"]["hedges"] == 5  # the burst allowance, then nothing


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


async def test_stream_yields_in_completion_order_and_takes_async_input():
    c, _ = make()
    order = [
        r.value async for r in c.stream("nap", [{"seconds": 0.2, "tag": 0}, {"seconds": 0.01, "tag": 1}])
    ]
    assert order == [1, 0]

    async def produce():
        for i in range(5):
            await asyncio.sleep(0.01)
            yield {"x": i}

    got = sorted([(r.index, r.value) async for r in c.stream("double", produce())])
    assert got == [(i, 2 * i) for i in range(5)]


async def test_stream_reads_its_input_only_as_fast_as_it_is_consumed():
    c, fake = make()
    taken = 0

    def payloads():
        nonlocal taken
        for i in range(10_000):
            taken += 1
            yield {"x": i}

    agen = c.stream("double", payloads(), max_inflight=10)
    first = await agen.__anext__()
    await asyncio.sleep(0.1)
    assert first.ok and taken <= 11
    await agen.aclose()
    assert len(fake.invocations) <= 11


async def test_bad_payloads_never_reach_the_backend():
    c, fake = make()
    assert (await c.call("double", {"y": 1})).error.type == ErrorCode.INVALID_ARGUMENTS
    assert (await c.call("double", {"x": object()})).error.type == ErrorCode.PAYLOAD_NOT_SERIALIZABLE
    assert (await c.call("double", [1])).error.type == ErrorCode.INVALID_ARGUMENTS  # type: ignore[arg-type]
    unknown = await c.call("tripple", {"x": 1})
    assert unknown.error.type == ErrorCode.UNKNOWN_FUNCTION and "double" in unknown.error.message
    assert fake.invocations == []
    assert (await c.call("double", {"x": 2})).unwrap() == 4


async def test_metrics_snapshot():
    c, fake = make()
    fake.fail_next("double", ErrorCode.WORKER_LOST)
    await c.map("double", [{"x": i} for i in range(10)])
    await c.call("fail_user", {"x": 1})
    m = c.metrics()
    assert m["double"]["calls"] == 10 and m["double"]["ok"] == 10 and m["double"]["retries"] == 1
    assert m["fail_user"]["errors"] == {"UserError": 1}
    assert sum(m["double"]["latency_ms"]["buckets"].values()) == 10


async def test_metrics_quantiles_are_of_the_calls_like_the_histogram():
    c, fake = make(hedge={"enabled": False})
    # each call's first attempt fails after 0.3 s (a lost worker); its retry answers at once
    fake.inject("double", *(Fault(code=ErrorCode.WORKER_LOST, delay_s=0.3) for _ in range(20)))
    await c.map("double", [{"x": i} for i in range(20)])
    lat = c.metrics()["double"]["latency_ms"]
    assert sum(lat["buckets"].values()) == 20 and lat["sum"] / 20 >= 300
    assert 300 <= lat["p50"] <= lat["p95"] <= lat["p99"] <= 2000  # not the retries' own latency


class _ManualBackend(FakeBackend):
    """Answers each invocation when the test says so: no timing decides who answers first."""

    def __init__(self) -> None:
        super().__init__(REG)
        self.futures: list[asyncio.Future] = []
        self.submitted = asyncio.Event()

    def _submit(self, inv: Invocation) -> asyncio.Future:
        self.invocations.append(inv)
        fut = asyncio.get_running_loop().create_future()
        self.futures.append(fut)
        self.submitted.set()
        return fut

    async def next(self) -> tuple[Invocation, asyncio.Future]:
        """The next invocation sent, once it is."""
        while len(self.futures) <= self._taken:
            self.submitted.clear()
            await self.submitted.wait()
        self._taken += 1
        return self.invocations[self._taken - 1], self.futures[self._taken - 1]

    _taken = 0

    @staticmethod
    def answer(inv: Invocation, fut: asyncio.Future, code: ErrorCode | None = None) -> None:
        from fabric.protocol import Result

        fut.set_result(
            Result.built(True, function=inv.function, request_id=inv.request_id, value=0)
            if code is None
            else Result.failure(code, "injected", function=inv.function, request_id=inv.request_id)
        )


async def _manual_with_p95(**cfg) -> tuple[Client, _ManualBackend]:
    """A client whose ``nap`` has a p95 to hedge after (five quick answers)."""
    manual = _ManualBackend()
    c = Client(backend=manual, registry=REG, config=ClientConfig.model_validate(cfg))
    calls = [asyncio.create_task(c.call("nap", {"seconds": 0})) for _ in range(5)]
    for _ in range(5):
        manual.answer(*await manual.next())
    assert all(r.ok for r in await asyncio.gather(*calls))
    return c, manual


async def test_a_hedge_that_failed_too_is_no_win():
    """A primary failed retryably while its hedge ran on; the hedge failed as well. Both copies
    failed, the call was retried and answered: hedge_wins counted the failed hedge as a win."""
    c, manual = await _manual_with_p95(hedge={"min_samples": 5, "max_share": 1.0})
    call = asyncio.create_task(c.call("nap", {"seconds": 0}))
    primary, p = await manual.next()
    hedge, h = await manual.next()  # sent after the p95
    assert hedge.hedge and not primary.hedge
    manual.answer(primary, p, ErrorCode.WORKER_LOST)
    await asyncio.sleep(0)  # one loop turn: the primary's answer is seen (it waits for the hedge)
    manual.answer(hedge, h, ErrorCode.WORKER_LOST)
    retry, f = await manual.next()
    assert retry.attempt == 2
    manual.answer(retry, f)
    assert (await call).ok
    m = c.metrics()["nap"]
    assert m["hedges"] == 1 and m["hedge_wins"] == 0
    # a hedge whose answer is the call's, after its primary failed, is a win
    call = asyncio.create_task(c.call("nap", {"seconds": 0}))
    primary, p = await manual.next()
    hedge, h = await manual.next()
    manual.answer(primary, p, ErrorCode.WORKER_LOST)
    await asyncio.sleep(0)
    manual.answer(hedge, h)
    assert (await call).ok and c.metrics()["nap"]["hedge_wins"] == 1


async def test_a_failed_copy_never_wins_over_an_answer_that_came_in_the_same_loop_turn():
    """The primary's retryable failure and its hedge's answer came in one loop turn (two
    workers' replies read in one select): the failure's callback, run first, saw no copy
    still out and ended the call with it, so the call was retried though it had its answer."""
    c, manual = await _manual_with_p95(hedge={"min_samples": 5, "max_share": 1.0})
    call = asyncio.create_task(c.call("nap", {"seconds": 0}))
    primary, p = await manual.next()
    hedge, h = await manual.next()
    manual.answer(primary, p, ErrorCode.WORKER_LOST)
    manual.answer(hedge, h)  # before the primary's callback ran
    r = await call
    assert r.ok and r.attempts == 1 and r.hedged, r.error
    m = c.metrics()["nap"]
    assert m["retries"] == 0 and m["hedge_wins"] == 1 and len(manual.invocations) == 7
    # the other way round: the hedge failed, the primary answered, in one turn
    call = asyncio.create_task(c.call("nap", {"seconds": 0}))
    primary, p = await manual.next()
    hedge, h = await manual.next()
    manual.answer(hedge, h, ErrorCode.NOT_STARTED)
    manual.answer(primary, p)
    r = await call
    assert r.ok and r.attempts == 1 and c.metrics()["nap"]["hedge_wins"] == 1


async def test_a_call_hedged_then_retried_is_marked_hedged():
    """Result.hedged is "True when a hedge was sent for this call": a call whose first attempt
    was hedged (both copies failed) and whose retry answered came back hedged=False."""
    c, manual = await _manual_with_p95(hedge={"min_samples": 5, "max_share": 1.0})
    call = asyncio.create_task(c.call("nap", {"seconds": 0}))
    primary, p = await manual.next()
    hedge, h = await manual.next()
    manual.answer(primary, p, ErrorCode.WORKER_LOST)
    manual.answer(hedge, h, ErrorCode.WORKER_LOST)
    retry, f = await manual.next()
    # the retry is answered before its own hedge could be sent
    manual.answer(retry, f)
    r = await call
    assert r.ok and r.attempts == 2 and r.hedged
    assert [i.hedge for i in manual.invocations[5:]] == [False, True, False]


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


class _RunsOnBackend(_ManualBackend):
    """A backend whose copies run on after their caller let them go (a synchronous handler in
    a local worker), until the test ends the run: ``settled`` says so, as the local pool's does."""

    def __init__(self) -> None:
        super().__init__()
        self.runs: dict[asyncio.Future, asyncio.Future] = {}

    def settled(self, function: str, fut: asyncio.Future) -> asyncio.Future | None:
        if not fut.cancelled():
            return None  # answered: its run is over
        return self.runs.setdefault(fut, asyncio.get_running_loop().create_future())

    def end_run(self, fut: asyncio.Future) -> None:
        self.runs.setdefault(fut, asyncio.get_running_loop().create_future()).set_result(None)


async def _sent_or_waiting(backend: _ManualBackend, n: int) -> int:
    """How many invocations were sent after the calls made so far took their turn."""
    for _ in range(n):
        await asyncio.sleep(0)  # each call runs up to its send or to its wait for a slot
    return len(backend.invocations)


async def test_a_slot_is_held_while_an_abandoned_call_still_runs_on_the_backend():
    """max_concurrency counts calls running, not callers waiting: a call abandoned at its
    deadline (the worker is not killed for it, a synchronous handler runs to its end) gave
    its slot back at once, and the next call ran beside it (two runs of a function limited
    to one, against the paid or rate-limited dependency the limit protects)."""
    backend = _RunsOnBackend()
    c = Client(
        backend=backend, registry=REG, config=ClientConfig.model_validate({"hedge": {"enabled": False}})
    )
    r = await c.call("one_at_a_time", {"seconds": 0}, deadline_s=0.05)
    assert r.error.type == ErrorCode.DEADLINE_EXCEEDED
    abandoned = backend.futures[0]
    assert abandoned.cancelled()
    nxt = asyncio.create_task(c.call("one_at_a_time", {"seconds": 0}))
    assert await _sent_or_waiting(backend, 5) == 1  # waits: the abandoned run holds the slot
    backend.end_run(abandoned)
    inv, fut = await backend.next()
    inv, fut = await backend.next()
    backend.answer(inv, fut)
    assert (await nxt).ok


async def test_a_hedge_loser_holds_its_slot_until_its_run_ends():
    """A hedge "takes one of the function's max_concurrency slots until it ends": the loser
    that a synchronous worker runs on after it was cancelled gave its slot back at once."""
    backend = _RunsOnBackend()
    c = Client(
        backend=backend,
        registry=REG,
        config=ClientConfig.model_validate({"hedge": {"min_samples": 5, "max_share": 1.0}}),
    )
    warm = [asyncio.create_task(c.call("two_at_a_time", {"seconds": 0})) for _ in range(5)]
    for _ in range(5):
        backend.answer(*await backend.next())
    await asyncio.gather(*warm)
    call = asyncio.create_task(c.call("two_at_a_time", {"seconds": 0}))
    primary, p = await backend.next()
    hedge, h = await backend.next()
    assert hedge.hedge
    backend.answer(primary, p)  # the primary wins; the hedge is cancelled, and runs on
    assert (await call).ok and h.cancelled()
    others = [asyncio.create_task(c.call("two_at_a_time", {"seconds": 0})) for _ in range(2)]
    assert await _sent_or_waiting(backend, 5) == 8  # one slot is free, the hedge's run holds the other
    backend.end_run(h)
    assert await _sent_or_waiting(backend, 5) == 9
    for _ in range(2):
        backend.answer(*await backend.next())
    assert all(r.ok for r in await asyncio.gather(*others))
