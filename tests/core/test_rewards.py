"""RewardStream through a real fabric.Client (``inproc``, or the shipped ``FakeBackend`` where
a test scripts infrastructure faults): weighted combination, idempotency, masking of failed
rewards, timeouts and unavailable functions, open circuits, non-blocking submission and
clean shutdown."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from core.buffer import SampleBuffer
from core.config import RewardConfig
from core.errors import StreamClosedError
from core.rewards import OutagePolicy, RewardStream
from core.sample import Sample
from fabric.client import Client, ClientConfig
from fabric.errors import ErrorCode, Unavailable
from fabric.protocol import RewardResult, Trajectory
from fabric.registry import Registry
from fabric.testing import FakeBackend

REG = Registry()
FAST_RETRY = {"max_attempts": 3, "initial_backoff_s": 0.001, "max_backoff_s": 0.002}
CALLS: Counter[str] = Counter()
"""Executions of ``counted`` per trajectory id: the side effect idempotency must bound."""
GATE: dict[str, asyncio.Event] = {}


@REG.reward
def const(traj: Trajectory, *, value: float) -> float:
    return value


@REG.reward
def counted(traj: Trajectory) -> float:
    CALLS[traj.id] += 1
    return 1.0


@REG.reward
def structured(traj: Trajectory) -> RewardResult:
    return RewardResult(score=0.5, components={"a": 1.0, "b": 0.0}, info={"why": "half"})


@REG.reward
def answer_is(traj: Trajectory, *, ground_truth: str) -> float:
    return float(traj.final_text() == ground_truth)


@REG.reward
def boom(traj: Trajectory) -> float:
    raise RuntimeError("the verifier crashed")


@REG.reward(retry=FAST_RETRY)
def unavailable(traj: Trajectory) -> float:
    raise Unavailable("judge endpoint overloaded")


@REG.reward(retry=FAST_RETRY)
def flaky_once(traj: Trajectory) -> float:
    CALLS[f"flaky:{traj.id}"] += 1
    if CALLS[f"flaky:{traj.id}"] == 1:
        raise Unavailable("first call fails")
    return 1.0


@REG.reward(timeout_s=0.05, retry={"max_attempts": 2, "initial_backoff_s": 0.001})
async def sleepy(traj: Trajectory) -> float:
    await asyncio.sleep(10)
    return 1.0


@REG.reward
async def gated(traj: Trajectory) -> float:
    await GATE["open"].wait()
    return 1.0


@REG.reward
def not_a_number(traj: Trajectory) -> str:
    return "high"


@REG.reward(retry={"max_attempts": 1})
def once(traj: Trajectory) -> float:
    return 1.0


@pytest.fixture(autouse=True)
def _fresh_state():
    CALLS.clear()
    GATE["open"] = asyncio.Event()
    yield
    GATE["open"].set()


def traj(tid: str = "t1", tag: str = "t", group: str = "g", version: int = 0, **kw) -> Trajectory:
    t = Trajectory(id=tid, task={"tag": tag, "group_id": group, **kw.pop("task", {})}, **kw)
    t.info["start_version"] = version
    return t


def spec(function: str, weight: float = 1.0, **kw) -> RewardConfig:
    return RewardConfig(function=function, weight=weight, **kw)


class Sink:
    """The deliver callback: records what came back."""

    def __init__(self) -> None:
        self.samples: list[Sample] = []

    def __call__(self, s: Sample) -> None:
        self.samples.append(s)

    def by_id(self) -> dict[str, Sample]:
        return {s.id: s for s in self.samples}


async def test_components_are_combined_with_their_weights():
    rewards = {
        "t": [spec("const", 3.0, args={"value": 1.0}), spec("const", 1.0, name="zero", args={"value": 0.0})]
    }
    sink = Sink()
    async with Client("inproc", registry=REG) as client, RewardStream(client, rewards, sink) as stream:
        assert stream.submit(traj())
    [s] = sink.samples
    assert s.status == "ok" and s.reward is not None
    assert s.reward.score == pytest.approx(0.75) and s.reward.components == {"const": 1.0, "zero": 0.0}
    assert (s.tag, s.group_id, s.version) == ("t", "g", 0)


async def test_structured_results_and_task_args():
    rewards = {
        "t": [spec("structured"), spec("answer_is", task_args={"ground_truth": "answer"})],
    }
    t = traj(task={"answer": "right"}, messages=[{"role": "assistant", "content": "right"}])
    sink = Sink()
    async with Client("inproc", registry=REG) as client, RewardStream(client, rewards, sink) as stream:
        stream.submit(t)
        stream.submit(traj("t2", task={"answer": "left"}, messages=[{"role": "assistant", "content": "up"}]))
    got = sink.by_id()
    assert got["t1"].score == pytest.approx(0.75) and got["t2"].score == pytest.approx(0.25)
    assert got["t1"].reward is not None and got["t1"].reward.info["structured"]["info"] == {"why": "half"}


async def test_a_client_that_raises_masks_the_sample_and_keeps_the_worker():
    """The fabric client never raises, but a client of one's own (or a bug in scoring) did,
    and the worker task died with it: the sample never came back, and once all of the
    stream's workers had died, nothing was scored again and the job waited for ever."""

    class Raising:
        async def call(self, *args, **kwargs):
            raise RuntimeError("client bug")

    sink = Sink()
    rewards = {"t": [spec("const", args={"value": 1.0})]}
    async with RewardStream(Raising(), rewards, sink, concurrency=1) as stream:  # type: ignore[arg-type]
        assert stream.submit(traj("a")) and stream.submit(traj("b"))
    got = sink.by_id()
    assert {k: s.status for k, s in got.items()} == {"a": "reward_failed", "b": "reward_failed"}
    assert "RuntimeError: client bug" in (got["b"].error or "")
    assert stream.metrics()["failures"] == {"stream_error": 2}


async def test_a_component_call_that_raises_stops_the_others_of_its_sample():
    # the sample is masked at once, and the other components' calls stop with it: they ran
    # on as orphans of the gather (a call of the client's holding its slot), past the close
    started, stopped = asyncio.Event(), asyncio.Event()

    class HalfRaising:
        async def call(self, function, *args, **kwargs):
            if function == "const":
                await started.wait()  # the other call is under way
                raise RuntimeError("client bug")
            started.set()
            try:
                await asyncio.Event().wait()
            finally:
                stopped.set()

    sink = Sink()
    rewards = {"t": [spec("const", args={"value": 1.0}), spec("counted")]}
    stream = RewardStream(HalfRaising(), rewards, sink, concurrency=1)  # type: ignore[arg-type]
    stream.start()
    assert stream.submit(traj("a"))
    await stream.join()
    assert [s.status for s in sink.samples] == ["reward_failed"]
    assert stopped.is_set(), "the sibling call is still running"
    await stream.aclose()


async def test_a_missing_task_key_masks_without_calling():
    rewards = {"t": [spec("answer_is", task_args={"ground_truth": "answer"})]}
    sink = Sink()
    async with Client("inproc", registry=REG) as client, RewardStream(client, rewards, sink) as stream:
        stream.submit(traj())
    [s] = sink.samples
    assert s.status == "reward_failed" and "task lacks 'answer'" in (s.error or "")
    # what the task has, and where the key comes from: the error reaches the user as the
    # job's RolloutError, and "(task_args)" alone did not say which side to fix
    assert "its task has group_id, tag" in (s.error or "")
    assert "reset's info['task']" in (s.error or "")
    assert client.metrics() == {}  # nothing was sent
    assert stream.metrics()["failures"] == {"answer_is:MissingTaskKey": 1}


async def test_a_duplicated_trajectory_counts_once():
    rewards = {"t": [spec("counted")]}
    sink = Sink()
    async with Client("inproc", registry=REG) as client, RewardStream(client, rewards, sink) as stream:
        assert stream.submit(traj())
        assert not stream.submit(traj())  # still in flight
        await stream.join()
        assert not stream.submit(traj())  # already scored
    assert CALLS["t1"] == 1 and len(sink.samples) == 1
    assert stream.metrics()["duplicate"] == 2 and stream.metrics()["submitted"] == 1


async def test_the_idempotency_key_holds_across_streams_on_one_client():
    # e.g. a restarted stream actor re-sending what it had: the client answers from its cache
    rewards = {"t": [spec("counted")]}
    a, b = Sink(), Sink()
    async with Client("inproc", registry=REG) as client:
        async with RewardStream(client, rewards, a) as s1:
            s1.submit(traj())
        async with RewardStream(client, rewards, b) as s2:
            s2.submit(traj())
        assert client.metrics()["counted"]["cache_hits"] == 1
    assert CALLS["t1"] == 1 and a.samples[0].score == b.samples[0].score == 1.0


async def test_a_retried_call_executes_once_under_one_key():
    fake = FakeBackend(REG)
    fake.fail_next("counted", ErrorCode.WORKER_LOST)  # the first attempt dies before running
    rewards = {"t": [spec("counted")]}
    sink = Sink()
    async with Client(fake, registry=REG) as client, RewardStream(client, rewards, sink) as stream:
        stream.submit(traj("abc"))
    assert sink.samples[0].score == 1.0 and CALLS["abc"] == 1
    [(key, n)] = fake.executions.items()
    version = REG.get("counted").version
    assert n == 1 and key == f"counted:{version}:abc:counted"  # trajectory + function + version
    assert len(fake.invocations) == 2 and stream.metrics()["outage_retries"] == 0


async def test_a_named_components_failure_names_its_function_too():
    # the error reaches the user (the job's RolloutError), who looks the function up
    sink = Sink()
    async with Client("inproc", registry=REG) as client:
        async with RewardStream(client, {"t": [spec("boom", name="verifier")]}, sink) as stream:
            stream.submit(traj())
    [s] = sink.samples
    assert (s.error or "").startswith("verifier (boom): UserError: RuntimeError")


async def test_a_reward_that_raises_masks_the_trajectory_not_zero():
    rewards = {"t": [spec("const", args={"value": 1.0}), spec("boom")]}
    sink = Sink()
    async with (
        Client("inproc", registry=REG) as client,
        SampleBuffer(group_size=2, alpha=1) as buf,
    ):

        def deliver(s: Sample) -> None:
            sink(s)
            buf.put(s)

        async with RewardStream(client, rewards, deliver) as stream:
            stream.submit(traj())
        [s] = sink.samples
        assert s.status == "reward_failed" and s.reward is None and s.masked
        assert "boom: UserError: RuntimeError: the verifier crashed" in (s.error or "")
        assert buf.metrics()["dropped"] == {"reward_failed": 1} and buf.metrics()["pending_samples"] == 0
        m = stream.metrics()
        assert m["reward_failed"] == 1 and m["scored"] == 0 and m["failures"] == {"boom:UserError": 1}
        assert client.metrics()["boom"]["calls"] == 1  # a user error is never retried


async def test_a_function_that_times_out_is_retried_by_the_client_then_masked():
    sink = Sink()
    async with (
        Client("inproc", registry=REG) as client,
        RewardStream(client, {"t": [spec("sleepy")]}, sink) as stream,
    ):
        stream.submit(traj())
    [s] = sink.samples
    assert s.status == "reward_failed" and ErrorCode.TIMEOUT in (s.error or "")
    assert client.metrics()["sleepy"]["retries"] == 1  # the function's policy: 2 attempts
    assert stream.metrics()["failures"] == {"sleepy:FunctionTimeout": 1}


async def test_failure_score_penalises_an_output_that_crashes_or_hangs_the_function():
    # masked and re-run, such an output never cost the policy anything
    rewards = {
        "t": [spec("const", args={"value": 1.0}), spec("boom", failure_score=0.0)],
        "h": [spec("sleepy", failure_score=-1.0)],
        "i": [spec("const", args={"value": 1.0}), spec("unavailable", failure_score=0.0)],
    }
    sink = Sink()
    async with Client("inproc", registry=REG) as client, RewardStream(client, rewards, sink) as stream:
        stream.submit(traj("crash"))
        stream.submit(traj("hang", tag="h"))
        stream.submit(traj("infra", tag="i"))
    by_id = {s.id: s for s in sink.samples}
    crash, hang = by_id["crash"].reward, by_id["hang"].reward
    assert by_id["crash"].status == "ok" and crash.score == 0.5  # (1.0 + 0.0) / 2
    assert crash.components == {"const": 1.0, "boom": 0.0}
    assert "UserError: RuntimeError: the verifier crashed" in crash.info["boom"]["info"]["failed"]
    assert by_id["hang"].status == "ok" and hang.score == -1.0
    # a dependency that is down is not the output's fault: masked as before
    assert by_id["infra"].status == "reward_failed" and by_id["infra"].masked
    m = stream.metrics()
    assert m["failure_scored"] == 2 and m["scored"] == 2 and m["reward_failed"] == 1
    assert m["failures"]["boom:UserError"] == 1 and m["failures"]["sleepy:FunctionTimeout"] == 1


async def test_an_unavailable_function_is_retried_by_the_client_only():
    sink = Sink()
    rewards = {"t": [spec("unavailable")], "u": [spec("flaky_once")]}
    async with Client("inproc", registry=REG) as client, RewardStream(client, rewards, sink) as stream:
        stream.submit(traj("down"))
        stream.submit(traj("flaky", tag="u"))
    got = sink.by_id()
    assert got["down"].status == "reward_failed" and "Unavailable" in (got["down"].error or "")
    assert client.metrics()["unavailable"]["retries"] == 2  # 3 attempts in all, not 3 x more
    assert got["flaky"].status == "ok" and got["flaky"].score == 1.0
    assert stream.metrics()["outage_retries"] == 0


async def test_an_open_circuit_is_waited_out(monkeypatch):
    monkeypatch.setattr("core.rewards.random.uniform", lambda lo, hi: hi)  # no jitter: deterministic
    fake = FakeBackend(REG)
    fake.fail_next("once", ErrorCode.THROTTLED)  # one infra failure opens the circuit (threshold 1)
    config = ClientConfig.model_validate({"breaker": {"failure_threshold": 1, "cooldown_s": 0.05}})
    outage = OutagePolicy(retries=10, initial_backoff_s=0.01, max_backoff_s=0.02)
    sink = Sink()
    async with (
        Client(fake, registry=REG, config=config) as client,
        RewardStream(client, {"t": [spec("once")]}, sink, outage=outage) as stream,
    ):
        stream.submit(traj("a"))
        await stream.join()
        stream.submit(traj("b"))  # refused fast while the circuit is open, then let through
    got = sink.by_id()
    assert got["a"].status == "reward_failed" and "Throttled" in (got["a"].error or "")
    assert got["b"].status == "ok" and stream.metrics()["outage_retries"] >= 1


async def test_an_open_circuit_that_stays_open_masks():
    fake = FakeBackend(REG)
    fake.fail_next("once", ErrorCode.THROTTLED)
    config = ClientConfig.model_validate({"breaker": {"failure_threshold": 1, "cooldown_s": 60}})
    sink = Sink()
    async with (
        Client(fake, registry=REG, config=config) as client,
        RewardStream(client, {"t": [spec("once")]}, sink, outage=OutagePolicy(retries=0)) as stream,
    ):
        stream.submit(traj("a"))
        await stream.join()
        stream.submit(traj("b"))
    assert "CircuitOpen" in (sink.by_id()["b"].error or "")


async def test_a_bad_return_value_masks():
    sink = Sink()
    async with (
        Client("inproc", registry=REG) as client,
        RewardStream(client, {"t": [spec("not_a_number")]}, sink) as stream,
    ):
        stream.submit(traj())
    assert sink.samples[0].status == "reward_failed" and "got str" in (sink.samples[0].error or "")
    assert stream.metrics()["failures"] == {"not_a_number:BadValue": 1}


async def test_infra_failed_and_aborted_trajectories_pass_through_unscored():
    sink = Sink()
    async with (
        Client("inproc", registry=REG) as client,
        RewardStream(client, {"t": [spec("counted")]}, sink) as stream,
    ):
        stream.submit(traj("x", status="infra_failed"))
        stream.submit(traj("y", status="aborted"))
    assert [s.status for s in sink.samples] == ["infra_failed", "aborted"]
    assert not CALLS and stream.metrics()["passed_masked"] == 2


async def test_submit_returns_at_once_while_rewards_compute():
    sink = Sink()
    async with Client("inproc", registry=REG) as client:
        async with RewardStream(client, {"t": [spec("gated")]}, sink, concurrency=2) as stream:
            for i in range(5):
                assert stream.submit(traj(f"t{i}"))  # synchronous: the rollout never awaits
            await asyncio.sleep(0.02)
            m = stream.metrics()
            assert m["in_flight"] == 5 and m["queued"] == 3 and not sink.samples  # 2 workers busy
            GATE["open"].set()
            await asyncio.wait_for(stream.join(), 1)
            assert len(sink.samples) == 5 and stream.metrics()["in_flight"] == 0


async def test_async_deliver_and_a_failing_deliver():
    got: list[str] = []

    async def deliver(s: Sample) -> None:
        await asyncio.sleep(0)
        if s.id == "bad":
            raise RuntimeError("consumer bug")
        got.append(s.id)

    async with (
        Client("inproc", registry=REG) as client,
        RewardStream(client, {"t": [spec("counted")]}, deliver, concurrency=1) as stream,
    ):
        stream.submit(traj("bad"))
        stream.submit(traj("good"))
    assert got == ["good"] and stream.metrics()["deliver_errors"] == 1


async def test_closing_without_drain_cancels_and_counts():
    sink = Sink()
    async with Client("inproc", registry=REG) as client:
        stream = RewardStream(client, {"t": [spec("gated")]}, sink, concurrency=1)
        stream.start()
        stream.submit(traj("running"))
        stream.submit(traj("queued"))
        await asyncio.sleep(0.01)
        await stream.aclose(drain=False)
        assert not sink.samples and stream.metrics()["cancelled"] == 2
        assert stream.metrics()["in_flight"] == 0
        with pytest.raises(StreamClosedError):
            stream.submit(traj("late"))


async def test_an_error_in_the_block_does_not_wait_for_the_queue():
    sink = Sink()
    async with Client("inproc", registry=REG) as client:
        with pytest.raises(KeyError):
            async with RewardStream(client, {"t": [spec("gated")]}, sink) as stream:
                stream.submit(traj())
                raise KeyError("job failed")
        assert stream.metrics()["cancelled"] == 1


async def test_drain_timeout_bounds_a_clean_close():
    async with Client("inproc", registry=REG) as client:
        stream = RewardStream(client, {"t": [spec("gated")]}, Sink())
        stream.start()
        stream.submit(traj())
        await asyncio.wait_for(stream.aclose(drain_timeout=0.02), 1)
        assert stream.metrics()["cancelled"] == 1


async def test_a_trajectory_without_bookkeeping_is_refused_at_submit():
    async with Client("inproc", registry=REG) as client, RewardStream(client, {}, Sink()) as stream:
        with pytest.raises(ValueError, match="lacks task\\['tag'\\]"):
            stream.submit(Trajectory(task={"group_id": "g"}, info={"start_version": 0}))
        assert stream.submit(Trajectory(), tag="t", group_id="g", version=0)  # keywords work too


async def test_a_tag_without_rewards_masks():
    sink = Sink()
    async with Client("inproc", registry=REG) as client, RewardStream(client, {}, sink) as stream:
        stream.submit(traj(tag="unknown"))
    assert sink.samples[0].status == "reward_failed" and "no reward functions for tag" in (
        sink.samples[0].error or ""
    )


def test_component_names_must_be_unique():
    with pytest.raises(ValueError, match="component names must be unique"):
        RewardStream(None, {"t": [spec("counted"), spec("counted")]}, Sink())  # type: ignore[arg-type]


async def test_a_combined_score_that_overflows_masks():
    # each component is finite, their weighted sum is not (1e308 + 1e308): the score was inf,
    # and a group holding it trains on NaN advantages
    rewards = {
        "t": [spec("const", args={"value": 1e308}), spec("const", name="again", args={"value": 1e308})]
    }
    sink = Sink()
    async with Client("inproc", registry=REG) as client, RewardStream(client, rewards, sink) as stream:
        stream.submit(traj())
    [s] = sink.samples
    assert s.status == "reward_failed" and s.reward is None
    assert "non-finite" in (s.error or "")
    assert stream.metrics()["reward_failed"] == 1 and stream.metrics()["scored"] == 0


async def test_a_drain_cancelled_midway_still_stops_the_workers():
    # Ctrl-C while a clean close drains (the job's normal end) cancelled aclose before it
    # cancelled the workers: they went on calling reward functions on a client being closed
    async def deliver(s: Sample) -> None:
        pass  # where samples go does not matter to this test

    async with Client("inproc", registry=REG) as client:
        stream = RewardStream(client, {"t": [spec("gated")]}, deliver, concurrency=2)
        stream.start()
        workers = list(stream._workers)
        stream.submit(traj())
        closing = asyncio.create_task(stream.aclose())
        # until the close waits on the drain, with the trajectory in a worker
        while not stream._closed or stream.metrics()["queued"]:  # noqa: ASYNC110
            await asyncio.sleep(0)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert all(w.done() for w in workers) and stream.metrics()["in_flight"] == 0
        assert stream.metrics()["cancelled"] == 1


async def test_env_returns_share_is_its_share_of_the_score_the_stream_computes():
    # GiGPO's step rewards give each turn share * its turn reward and the rest of the score to
    # the last turn (build_batch): that holds only if the stream, as the job builds it, scores
    # a tag share * the environment's return + what its other components add, whatever the
    # weights; a tag of share 1 is scored exactly the sum of its turn rewards
    from core.config import JobConfig
    from functions.rewards.env_return import env_return

    reg = Registry()
    for fn in (env_return, const):
        reg.add(fn)
    rewards = {
        "lone": [{"function": "env_return", "weight": 2.5}],
        "watched": [
            {"function": "env_return", "weight": 0.3},
            {"function": "const", "weight": 0.0, "args": {"value": 7.0}},
        ],
        "twice": [
            {"function": "env_return", "name": "a", "weight": 1.0},
            {"function": "env_return", "name": "b", "weight": 3.0},
        ],
        "mixed": [
            {"function": "env_return", "weight": 1.0},
            {"function": "const", "weight": 3.0, "args": {"value": 0.4}},
        ],
        "three": [
            {"function": "env_return", "weight": 0.3},
            {"function": "const", "name": "c1", "weight": 0.5, "args": {"value": 1.0}},
            {"function": "const", "name": "c2", "weight": 0.2, "args": {"value": -0.5}},
        ],
        "judged": [{"function": "const", "args": {"value": 0.9}}],
    }
    # what the components other than env_return add to the score (their weighted mean part)
    rest = {"lone": 0.0, "watched": 0.0, "twice": 0.0, "mixed": 0.3, "three": 0.4, "judged": 0.9}
    cfg = JobConfig.from_dict(
        {"envs": [{"id": "latency-v0", "tag": t} for t in rewards], "rewards": rewards},
        check_references=False,
    )
    shares = cfg.env_return_shares
    assert shares == pytest.approx(
        {"lone": 1, "watched": 1, "twice": 1, "mixed": 0.25, "three": 0.3, "judged": 0}
    )
    turns = [0.1, -0.05, 0.7]
    sink = Sink()
    async with Client("inproc", registry=reg) as client:
        async with RewardStream.from_config(client, cfg, sink) as stream:
            for tag in rewards:
                t = traj(tag, tag=tag, env_reward=sum(turns))
                t.info["turn_rewards"] = turns
                stream.submit(t)
    want = {tag: shares[tag] * sum(turns) + rest[tag] for tag in rewards}
    assert {s.id: s.score for s in sink.samples} == pytest.approx(want)
    assert {s.id: s.score for s in sink.samples if shares[s.id] == 1} == pytest.approx(
        dict.fromkeys(["lone", "watched", "twice"], 0.75)
    )


async def test_every_trajectory_submitted_is_accounted_for_once_whatever_its_rewards_do():
    # submitted == scored + reward_failed + passed through masked + cancelled, and each comes
    # back once: a retry that succeeds scores once, a raise is a recorded failure, not a loss
    sink = Sink()
    rewards = {
        "ok": [spec("const", args={"value": 1.0})],
        "raises": [spec("boom")],
        "retried": [spec("flaky_once")],
        "bad": [spec("not_a_number")],
        "needs": [spec("answer_is", task_args={"ground_truth": "answer"})],
    }
    async with (
        Client("inproc", registry=REG) as client,
        RewardStream(client, rewards, sink, concurrency=3) as stream,
    ):
        for i, tag in enumerate([*rewards, "unknown"]):
            assert stream.submit(traj(f"t{i}", tag=tag))
        assert stream.submit(traj("x", status="infra_failed")) and stream.submit(traj("y", status="aborted"))
        assert not stream.submit(traj("t0", tag="ok"))  # in flight already: a duplicate
    m = stream.metrics()
    assert m["submitted"] == 8 and m["duplicate"] == 1 and m["in_flight"] == m["queued"] == 0
    assert m["scored"] + m["reward_failed"] + m["passed_masked"] + m["cancelled"] == m["submitted"]
    assert (m["scored"], m["reward_failed"], m["passed_masked"]) == (2, 4, 2)
    assert sorted(s.id for s in sink.samples) == ["t0", "t1", "t2", "t3", "t4", "t5", "x", "y"]
    assert CALLS["flaky:t2"] == 2 and sink.by_id()["t2"].status == "ok"
