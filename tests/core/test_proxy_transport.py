"""How turns reach the LLMProxy: ``generate_many`` (a batch, answered as each finishes), the
``RemoteProxy`` handle of a dead actor, and the ``Coalescer`` that batches calls.

No Ray: the proxy is a plain object here; fakes are in ``proxy_fakes``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from proxy_fakes import Fake, req

from core.rollout.coalesce import Answer, Coalescer, answer_all
from core.rollout.engines.base import EngineError
from core.rollout.llm_proxy import (
    LLMProxy,
    NoReplicaError,
    ReplicaGone,
)


async def test_generate_many_answers_every_request_errors_included():
    gate = asyncio.Event()
    slow, fast = Fake("slow", gate=gate), Fake("fast")
    proxy = LLMProxy({"default": [slow], "fast": [fast], "dead": [Fake("dead", fail=[ReplicaGone("x")])]})
    proxy.affinity.update({"f": "fast", "d": "dead"})
    items = [
        ("t1", "s", req(request_id="q1")),
        ("t2", "f", req(request_id="q2")),
        ("t3", "d", req(request_id="q3")),
    ]
    seen: list[list[str]] = []
    answers: dict[str, Answer] = {}
    async for batch in proxy.generate_many(items):
        seen.append(sorted(a.request_id for a in batch))
        answers.update({a.request_id: a for a in batch})
        if {"q2", "q3"} <= set(answers):
            gate.set()
    assert seen[-1] == ["q1"]  # the slow one comes last, on its own
    assert answers["q1"].value.text == "slow" and answers["q2"].value.text == "fast"
    assert isinstance(answers["q3"].error, NoReplicaError) and answers["q3"].value is None


async def test_a_dead_proxy_actor_is_a_proxy_died_error_told_once():
    import ray.exceptions as rex

    from core.errors import ProxyDiedError
    from core.rollout.replicas import RemoteProxy

    calls: list[str] = []

    class Method:
        def __init__(self, name: str, error: BaseException):
            self.name, self.error = name, error

        def remote(self, *args: Any) -> Any:
            calls.append(self.name)

            async def fail() -> Any:
                raise self.error

            return fail()

    class Handle:
        abort = Method("abort", rex.ActorUnavailableError("unreachable for a while", None))
        release = Method("release", rex.ActorDiedError())

    told: list[ProxyDiedError] = []
    proxy = RemoteProxy(Handle(), on_died=told.append)
    with pytest.raises(rex.ActorUnavailableError):  # not death: left as it is
        await proxy.abort("t")
    for _ in range(2):
        with pytest.raises(ProxyDiedError, match=r"the LLM proxy actor died .*--resume"):
            await proxy.release("t")
    with pytest.raises(ProxyDiedError):
        await proxy.abort("t")
    assert calls == ["abort", "release"]  # once dead, no call goes out
    assert len(told) == 1


async def test_a_full_disk_in_the_proxy_actor_is_a_disk_full_error_told_once():
    # the actor's trace write (TurnScheduler.record) failed a turn after it ran: its error
    # came back as any turn's, and the job re-ran trajectories until it stopped on a
    # RolloutError that never said the disk was full
    from ray.exceptions import RayTaskError

    from core.errors import DiskFullError
    from core.rollout.replicas import RemoteProxy

    full = DiskFullError("/run/trace.jsonl")

    class Streaming:
        def remote(self, items: list[Any]) -> Any:
            async def stream() -> Any:
                yield ready([Answer(r.request_id, error=full) for _, _, r in items])

            return stream()

    class Generate:
        def options(self, **_: Any) -> Streaming:
            return Streaming()

    class Stats:
        def remote(self) -> Any:
            async def fail() -> Any:  # another call's error: Ray's, around the actor's
                raise RayTaskError("stats", "Traceback ...", full)

            return fail()

    class Handle:
        generate_many = Generate()
        stats = Stats()

    told: list[DiskFullError] = []
    proxy = RemoteProxy(Handle(), on_died=told.append, on_disk_full=told.append)  # type: ignore[arg-type]
    for turn in range(2):
        with pytest.raises(DiskFullError, match=r"trace\.jsonl"):
            await proxy.generate("t", "lake", req(request_id=f"t/{turn}"))
    with pytest.raises(DiskFullError, match=r"trace\.jsonl"):
        await proxy.call(Handle.stats.remote())
    assert [e.path for e in told] == ["/run/trace.jsonl"]  # once
    assert proxy.died is None  # alive: only the disk is full


# ----------------------------------------------------------------------------- coalescer


async def ready(value: Any) -> Any:
    return value


class Server:
    """The remote side of a Coalescer: runs each batch with ``answer_all`` and streams
    ``await``-able answer lists back, as Ray's streaming generator does."""

    def __init__(self, handle=None, *, break_after: int | None = None, drop: set[str] | None = None):
        self.batches: list[list[tuple[str, Any]]] = []
        self.handle = handle or self.double
        self.break_after = break_after
        self.drop = drop or set()

    @staticmethod
    async def double(x: Any) -> Any:
        await asyncio.sleep(0.001 * (5 - x) if isinstance(x, int) and x < 5 else 0)
        return 2 * x

    def send(self, items: list[tuple[str, Any]]):
        self.batches.append(list(items))

        async def stream():
            sent = 0
            work = ((rid, self.handle(x)) for rid, x in items if rid not in self.drop)
            async for answers in answer_all(work):
                if self.break_after is not None and sent >= self.break_after:
                    raise ConnectionError("actor died")
                sent += len(answers)
                yield ready(answers)

        return stream()


async def test_calls_within_the_window_go_in_one_batch_and_answers_find_their_callers():
    server = Server()
    co = Coalescer(server.send, window_s=0.01)
    # the server answers in reverse order (larger x sleeps less): answers are matched by id
    out = await asyncio.gather(*(co.call(f"r{i}", (f"r{i}", i)) for i in range(5)))
    assert out == [0, 2, 4, 6, 8]
    assert len(server.batches) == 1 and [rid for rid, _ in server.batches[0]] == [f"r{i}" for i in range(5)]
    assert (co.calls, co.requests) == (1, 5)
    # calls apart in time go in separate batches
    assert await co.call("a", ("a", 10)) == 20
    assert await co.call("b", ("b", 11)) == 22
    assert len(server.batches) == 3 and co.calls == 3


async def test_a_full_batch_is_sent_at_once():
    server = Server()
    co = Coalescer(server.send, window_s=10.0, max_batch=2)  # the window alone would take 10 s
    async with asyncio.timeout(2):
        out = await asyncio.gather(co.call("a", ("a", 1)), co.call("b", ("b", 2)))
    assert out == [2, 4] and [len(b) for b in server.batches] == [2]


async def test_an_error_answer_reaches_only_its_caller():
    async def handle(x):
        if x == "boom":
            raise KeyError("bad request")
        return x.upper()

    co = Coalescer(Server(handle).send)
    out = await asyncio.gather(
        co.call("1", ("1", "a")),
        co.call("2", ("2", "boom")),
        co.call("3", ("3", "c")),
        return_exceptions=True,
    )
    assert out[0] == "A" and out[2] == "C"
    assert isinstance(out[1], KeyError) and co.calls == 1


async def test_a_transport_failure_reaches_every_unanswered_caller_of_the_batch():
    server = Server(break_after=0)
    co = Coalescer(server.send, on_error=lambda e: EngineError(f"transport: {e}"), window_s=0.005)
    out = await asyncio.gather(*(co.call(f"r{i}", (f"r{i}", i)) for i in range(3)), return_exceptions=True)
    assert all(isinstance(e, EngineError) and "actor died" in str(e) for e in out)
    assert co.calls == 1
    # the coalescer is still usable: the next batch goes through
    server.break_after = None
    assert await co.call("again", ("again", 3)) == 6

    def broken_send(items):
        raise ConnectionError("cannot reach the actor")

    co2 = Coalescer(broken_send, on_error=lambda e: EngineError(str(e)))
    out = await asyncio.gather(co2.call("x", 1), co2.call("y", 2), return_exceptions=True)
    assert [str(e) for e in out] == ["cannot reach the actor"] * 2


async def test_answered_callers_keep_their_answers_when_the_transport_breaks_later():
    async def handle(x):
        await asyncio.sleep(0 if x == 0 else 0.05)
        return x

    server = Server(handle, break_after=1)
    co = Coalescer(server.send)
    out = await asyncio.gather(
        co.call("fast", ("fast", 0)), co.call("slow", ("slow", 1)), return_exceptions=True
    )
    assert out[0] == 0 and isinstance(out[1], ConnectionError)


async def test_a_call_cancelled_within_the_window_never_reaches_the_server():
    ran: list[Any] = []

    async def handle(x):
        ran.append(x)
        return x

    server = Server(handle)
    co = Coalescer(server.send, window_s=0.05)
    gone = asyncio.create_task(co.call("gone", ("gone", "late turn")))
    kept = asyncio.create_task(co.call("kept", ("kept", "turn")))
    await asyncio.sleep(0)  # both are waiting in the window
    gone.cancel()  # e.g. its trajectory was aborted
    assert await kept == "turn"
    assert gone.cancelled()
    assert server.batches == [[("kept", "turn")]] and ran == ["turn"]
    assert (co.calls, co.requests) == (1, 1)
    # a window whose every caller was cancelled sends nothing at all
    alone = asyncio.create_task(co.call("alone", ("alone", "nobody")))
    await asyncio.sleep(0)
    alone.cancel()
    await asyncio.sleep(0.1)  # past the window
    assert len(server.batches) == 1 and ran == ["turn"] and co.calls == 1


async def test_a_request_the_server_never_answers_fails_instead_of_hanging():
    co = Coalescer(Server(drop={"lost"}).send)
    async with asyncio.timeout(2):
        out = await asyncio.gather(
            co.call("kept", ("kept", 1)), co.call("lost", ("lost", 2)), return_exceptions=True
        )
    assert out[0] == 2
    assert isinstance(out[1], RuntimeError) and "did not answer" in str(out[1])


async def test_answer_all_yields_as_they_finish_and_cancels_the_rest_when_closed():
    events = {name: asyncio.Event() for name in ("a", "b", "bad", "fast", "slow")}
    cancelled: list[str] = []

    async def job(name: str) -> str:
        try:
            await events[name].wait()
        except asyncio.CancelledError:
            cancelled.append(name)
            raise
        if name == "bad":
            raise ValueError("bad")
        return name

    def shown(answers: list[Answer]) -> list[tuple[str, Any, str | None]]:
        return [(x.request_id, x.value, type(x.error).__name__ if x.error else None) for x in answers]

    gen = answer_all([(n, job(n)) for n in ("a", "b", "bad")])
    events["b"].set()
    assert shown(await anext(gen)) == [("b", "b", None)]
    events["bad"].set()
    assert shown(await anext(gen)) == [("bad", None, "ValueError")]  # an exception is an answer
    events["a"].set()
    assert shown(await anext(gen)) == [("a", "a", None)]
    with pytest.raises(StopAsyncIteration):
        await anext(gen)

    gen = answer_all([("fast", job("fast")), ("slow", job("slow"))])
    events["fast"].set()
    assert shown(await anext(gen)) == [("fast", "fast", None)]
    await gen.aclose()  # the caller went away: the work still running is cancelled
    await asyncio.sleep(0)
    assert cancelled == ["slow"]


async def test_two_calls_with_one_request_id_in_one_window_each_get_their_own_answer():
    # a request id is the caller's (a retry or a user may reuse one): answers go by id, so two
    # in one batch were ambiguous and one caller waited for good. They go in separate batches
    server = Server()
    co = Coalescer(server.send, window_s=0.01)
    async with asyncio.timeout(2):
        out = await asyncio.gather(
            co.call("same", ("same", 1)), co.call("other", ("other", 2)), co.call("same", ("same", 3))
        )
    assert out == [2, 4, 6]
    assert [[rid for rid, _ in b] for b in server.batches] == [["same", "other"], ["same"]]
    assert (co.calls, co.requests) == (2, 3)

    # the engine refuses an id already in flight: the second caller gets that refusal, the
    # first its answer, as without coalescing
    inflight: set[str] = set()

    async def engine(item: tuple[str, int]) -> int:
        rid, x = item
        if rid in inflight:
            raise EngineError(f"request id {rid!r} is already in flight")
        inflight.add(rid)
        try:
            await asyncio.sleep(0.02)
            return x
        finally:
            inflight.discard(rid)

    co = Coalescer(Server(lambda x: engine(x)).send, window_s=0.01)
    async with asyncio.timeout(2):
        out = await asyncio.gather(
            co.call("dup", ("dup", ("dup", 1))), co.call("dup", ("dup", ("dup", 2))), return_exceptions=True
        )
    assert out[0] == 1 and isinstance(out[1], EngineError) and "already in flight" in str(out[1])
