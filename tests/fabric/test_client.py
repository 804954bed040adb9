"""Client behaviour against the shipped FakeBackend: a bad config, retries, deadlines,
bad payloads, streaming and metrics. Keyed calls (idempotency), hedging, the circuit
breaker and concurrency slots have their own test_client_*.py modules."""

from __future__ import annotations

import asyncio
import time

import pytest
from client_fns import REG
from client_helpers import make

from fabric.backends.base import InprocConfig, LocalConfig
from fabric.client import Client
from fabric.errors import ConfigError, ErrorCode
from fabric.protocol import Invocation
from fabric.testing import Fault


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


def test_a_misspelt_backend_name_is_not_called_a_config_with_keys():
    # Client(backend="locl") and fabric invoke --backend inprc said "bad backend config (with
    # keys ['type'])": keys the caller never wrote, as a plain name has none
    with pytest.raises(ConfigError) as e:
        Client(backend="locl", registry=REG)
    said = str(e.value)
    assert said.startswith("bad backend 'locl': unknown type 'locl' (did you mean 'local'?); known types:")
    assert "with keys" not in said


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


async def test_stream_refuses_a_max_inflight_below_one():
    c, _ = make()
    for bad in (0, -3):
        with pytest.raises(ConfigError, match="max_inflight must be >= 1"):
            async for _ in c.stream("double", [{"x": 1}], max_inflight=bad):
                pass  # never reached: refused before the first result


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


async def test_a_stream_whose_calls_raise_raises_instead_of_hanging():
    """A call that raises (here a misspelt keyword, passed on to every payload's call) never
    reached the consumer: its task died holding its ``max_inflight`` slot, which only the
    consumer gives back, so past ``max_inflight`` payloads the producer waited for a slot and
    the consumer for a result, for good. With fewer payloads it raised, from the producer."""
    c, _ = make()
    for n in (3, 10):

        async def consume(n: int = n) -> list:
            payloads = [{"x": i} for i in range(n)]
            return [r async for r in c.stream("double", payloads, max_inflight=4, deadlin=5)]

        with pytest.raises(TypeError, match="deadlin"):
            await asyncio.wait_for(consume(), 5)


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
