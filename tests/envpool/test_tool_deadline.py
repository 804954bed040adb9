"""A tool call's time is bounded by its step's.

* the job's bridge (``fabric_tools``) sends the fabric call the time the step has left as its
  deadline: a tool that runs past it is the tool's failure, an ``error: ...`` observation
  inside the step (the container is kept, nothing is retried), where it was a ``StepTimeout``
  (the container killed, the step retried, the trajectory ``infra_failed``); a call that
  never ran in that time (queued behind ``max_concurrency``) is the fabric's (``ToolUnavailable``);
* the default bridge (``inprocess_tools``) runs tools on the pool's own bounded threads, each
  call within the function's ``timeout_s`` or the step's time, whichever is less;
* a non-string result is shown as JSON, not as a Python repr.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from echo_bundle import IMAGE

import fabric
from envpool.errors import InfraError
from envpool.pool import EnvPool, SessionLost
from envpool.pool_config import fabric_tools

# a heartbeat period well under the tool's time: a container waiting on a tool must not read as hung
POOL = {
    "min_warm": 0,
    "step_timeout_s": 3.0,
    "retry": {"attempts": 1},
    "runtime": {"heartbeat_s": 0.1},
}

REG = fabric.Registry()
HOLD = asyncio.Event()


@REG.tool(name="calculator", max_concurrency=1)
async def slow_calculator(expression: str) -> str:
    if expression == "hold":
        await HOLD.wait()
        return "held"
    await asyncio.sleep(60)  # far past the step's 3 s
    return "late"


async def test_a_fabric_tool_slower_than_the_step_is_a_tool_error_inside_it(images):
    async with fabric.Client(backend="inproc", registry=REG) as client:
        async with EnvPool(POOL, images=images, tool_caller=fabric_tools(client)) as p:
            async with p.session("bundle-echo-v0", image=IMAGE) as s:
                await s.reset(seed=1)
                r = await s.step("tool 6*7")
                assert r.obs.text.startswith("error: tool 'calculator' ran past")
                assert s.status == "ok" and s.failures == []
                # the same container goes on: not killed as hung, nor retried
                assert (await s.step("hello")).obs.text == "hello #2"
            stats = p.stats()
            assert stats.get("env_hung", 0) == 0 and stats.get("discarded", 0) == 0


async def test_a_fabric_tool_queued_past_the_steps_time_is_the_fabrics_failure(images):
    HOLD.clear()
    async with fabric.Client(backend="inproc", registry=REG) as client:
        holder = asyncio.create_task(client.call("calculator", {"expression": "hold"}))
        await asyncio.sleep(0.05)  # it holds the one slot
        try:
            async with EnvPool(POOL, images=images, tool_caller=fabric_tools(client)) as p:
                async with p.session("bundle-echo-v0", image=IMAGE) as s:
                    await s.reset(seed=1)
                    # never ran: the policy's call was not wrong, the step fails as the infra's
                    with pytest.raises(SessionLost, match="concurrency slot"):
                        await s.step("tool 6*7")
        finally:
            HOLD.set()
            assert (await holder).value == "held"


async def test_the_fabric_bridge_passes_its_deadline_on():
    async with fabric.Client(backend="inproc", registry=REG) as client:
        call = fabric_tools(client)
        out = await asyncio.wait_for(call("calculator", {"expression": "1"}, deadline_s=0.2), 10)
        assert out.startswith("error: tool 'calculator' ran past its 0.2 s time limit")


async def test_the_fabric_bridge_keeps_a_clients_sooner_default_deadline():
    # the step's time replaces the client's default deadline in client.call: not widened
    async with fabric.Client(backend="inproc", registry=REG, config={"default_deadline_s": 0.2}) as client:
        out = await asyncio.wait_for(
            fabric_tools(client)("calculator", {"expression": "1"}, deadline_s=20), 10
        )
        assert out.startswith("error: tool 'calculator' ran past its 0.2 s time limit")


@pytest.mark.parametrize(
    ("message", "ran"),
    [
        ("deadline passed while running; the call was cancelled", True),
        ("t: deadline passed before the backend answered; the call was abandoned", True),
        ("t: deadline passed while the call waited for a concurrency slot (...); nothing was sent", False),
        ("deadline passed while queued", False),
        ("deadline passed before the call started", False),
        ("deadline passed while waiting for room in the pool (it did not run)", False),
        ("t: the call was not sent: its deadline passed while all 8 connections were busy", False),
    ],
)
def test_a_deadline_is_the_tools_only_if_the_tool_ran(message, ran):
    from envpool.pool_config import ran_too_long

    # an answer without Result.started (a peer older than the field) is read by its message
    assert ran_too_long("DeadlineExceeded", message) is ran
    # one with it is read by it, whatever its message says
    assert ran_too_long("DeadlineExceeded", message, started=True)
    assert not ran_too_long("DeadlineExceeded", message, started=False)
    # (a tool past its own timeout_s is its too: test_tool_failures)
    assert not ran_too_long("UserError", message, started=True)


@pytest.mark.parametrize("started", [True, False])
async def test_the_fabric_bridge_reads_whether_the_tool_began_not_the_message(started):
    """A ``DeadlineExceeded`` in words the message match does not know (a backend's new
    wording): the answer's ``started`` says whose failure it is."""
    from envpool.errors import ToolUnavailable

    class Answers:
        registry = REG

        async def call(self, name, arguments, *, deadline_s=None):
            return fabric.Result.failure(
                "DeadlineExceeded",
                "deadline passed while waiting for a GPU",  # no _NOT_RUN phrase: read as run
                function=name,
                started=started,
            )

    call = fabric_tools(Answers())
    if started:
        assert (await call("calculator", {"expression": "1"}, deadline_s=1)).startswith("error: tool")
    else:
        with pytest.raises(ToolUnavailable, match="waiting for a GPU"):
            await call("calculator", {"expression": "1"}, deadline_s=1)


async def test_a_deadline_passed_while_the_call_waited_in_its_workers_queue_is_the_fabrics():
    """A synchronous worker takes calls in batches and runs them one after another: a call
    sent behind a slow one waits there, not yet started, and its deadline passes. It never
    ran, so it is the fabric's failure, not the tool's: the text of the answer ("deadline
    passed while running") said it ran, and the policy was told its call was too slow."""
    from tool_fns import REG as LOCAL

    from envpool.errors import ToolUnavailable

    async with fabric.Client(backend={"type": "local", "max_workers": 1}, registry=LOCAL) as client:
        await client.warmup(["sleeper"])
        # its first answer says a call is quick: from then on calls go out to it in batches
        assert (await client.call("sleeper", {"seconds": 0})).ok
        busy = asyncio.create_task(client.call("sleeper", {"seconds": 1.5}))
        await asyncio.sleep(0)  # sent first: the tool call below is queued behind it, in the worker
        with pytest.raises(ToolUnavailable, match="DeadlineExceeded"):
            await fabric_tools(client)("sleeper", {"seconds": 0}, deadline_s=0.5)
        assert (await busy).ok


# -- the default bridge: the pool's own threads, each call bounded

THREADS = fabric.Registry()
RELEASE = threading.Event()
RAN_ON: list[str] = []


@THREADS.tool(name="calculator", timeout_s=60)
def blocking_calculator(expression: str) -> str:
    RAN_ON.append(threading.current_thread().name)
    if expression == "quick":
        return "42"
    RELEASE.wait(30)  # (released by the test: no thread is left behind)
    return "late"


@THREADS.tool(name="short", timeout_s=0.5)
def short(expression: str) -> str:
    RELEASE.wait(30)
    return "late"


@THREADS.tool(name="down")
def down(expression: str) -> str:
    raise fabric.Unavailable("the tool's dependency is down")


@pytest.fixture
def blocking_tools(monkeypatch):
    monkeypatch.setattr(fabric, "default_registry", THREADS)
    RELEASE.clear()
    RAN_ON.clear()
    yield
    RELEASE.set()


async def test_a_hung_inprocess_tool_is_a_tool_error_on_the_pools_own_threads(images, blocking_tools):
    async with EnvPool(POOL, images=images) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            r = await s.step("tool 6*7")
            assert r.obs.text.startswith("error: tool 'calculator' ran past")
            assert s.status == "ok" and s.failures == []
            assert (await s.step("tool quick")).obs.text == "42"  # a thread of its own
        # not the loop's default executor, which the image cache and docker runtime share
        assert RAN_ON and all(n.startswith("envpool-tool") for n in RAN_ON)
        stats = p.stats()
        # the hung thread cannot be killed: it is counted until it ends
        assert stats["tool_timeouts"] == 1 and stats["tool_threads_stuck"] == 1
        assert stats.get("discarded", 0) == 0
        RELEASE.set()
        for _ in range(500):
            if p.stats()["tool_threads_stuck"] == 0:
                break
            await asyncio.sleep(0.01)
        assert p.stats()["tool_threads_stuck"] == 0


async def test_an_inprocess_tool_gets_its_timeout_s_if_that_is_less(blocking_tools):
    from envpool.tool_threads import InprocessTools

    async with InprocessTools(threads=2) as tools:
        out = await asyncio.wait_for(tools("short", {"expression": "1"}, deadline_s=20), 10)
        assert out.startswith("error: tool 'short' ran past its 0.5 s time limit")
        # a tool that says its dependency failed is still the infrastructure's
        with pytest.raises(InfraError, match="dependency is down"):
            await tools("down", {"expression": "1"}, deadline_s=20)
        RELEASE.set()


async def test_a_tool_call_that_finds_no_free_thread_in_time_is_the_infrastructures(images, blocking_tools):
    async with EnvPool({**POOL, "tool_threads": 1}, images=images) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            assert (await s.step("tool 6*7")).obs.text.startswith("error: tool 'calculator' ran past")
            # its thread still hangs: the next call cannot start (not the policy's doing)
            with pytest.raises(SessionLost, match="no free tool thread"):
                await s.step("tool quick")
        assert p.stats()["tool_calls_unstarted"] == 1


# -- a non-string result is shown as JSON

SHOWN = fabric.Registry()


@SHOWN.tool
def lookup(what: str) -> object:
    return {"dict": {"a": 1, "café": [1.5, None, True]}, "text": "plain 'text'", "odd": {1, 2}}[what]


@pytest.mark.parametrize(
    ("what", "shown"),
    [
        ("dict", '{"a":1,"café":[1.5,null,true]}'),  # not {'a': 1, ...}, Python's repr
        ("text", "plain 'text'"),  # a string as it is
    ],
)
async def test_a_tools_result_is_shown_as_json_by_both_bridges(monkeypatch, what, shown):
    from envpool.pool_config import inprocess_tools
    from envpool.tool_threads import InprocessTools

    monkeypatch.setattr(fabric, "default_registry", SHOWN)
    assert await inprocess_tools("lookup", {"what": what}) == shown
    async with InprocessTools(threads=1) as tools:
        assert await tools("lookup", {"what": what}) == shown
    async with fabric.Client(backend="inproc", registry=SHOWN) as client:
        assert await fabric_tools(client)("lookup", {"what": what}) == shown


def test_a_result_that_is_no_json_is_shown_as_text(monkeypatch):
    from envpool.api import inprocess_tool_caller

    monkeypatch.setattr(fabric, "default_registry", SHOWN)
    assert inprocess_tool_caller("lookup", {"what": "odd"}) == "{1, 2}"


# -- a tool whose own setup is wrong (``fabric.Misconfigured``) is not the policy's fault

UNSET = fabric.Registry()


@UNSET.tool
def search(query: str) -> str:
    raise fabric.Misconfigured("SEARCH_API_KEY is not set")


async def test_a_misconfigured_tool_is_the_infrastructures_in_both_bridges(monkeypatch):
    # the fabric bridge fails the step (MISCONFIGURED is no TOOL_ERRORS code); the default
    # bridge showed the policy "error: Misconfigured: ...", an observation teaching it that
    # its call was wrong, for a key no one set
    from envpool.pool_config import inprocess_tools
    from envpool.tool_threads import InprocessTools

    monkeypatch.setattr(fabric, "default_registry", UNSET)
    async with fabric.Client(backend="inproc", registry=UNSET) as client:
        with pytest.raises(InfraError, match="SEARCH_API_KEY"):
            await fabric_tools(client)("search", {"query": "x"})
    with pytest.raises(InfraError, match="SEARCH_API_KEY"):
        await inprocess_tools("search", {"query": "x"})
    async with InprocessTools(threads=1) as tools:
        with pytest.raises(InfraError, match="SEARCH_API_KEY"):
            await tools("search", {"query": "x"})


async def test_an_inprocess_tool_call_with_no_time_left_is_not_run(blocking_tools):
    # a step whose earlier tool call used up its time: the fabric bridge sends nothing
    # (DeadlineExceeded "not sent": ToolUnavailable, the step retried, that earlier call
    # answered from its record); the default bridge started the tool all the same and, the
    # thread picking it up at once, answered the policy "ran past its 0 s time limit"
    from envpool.errors import ToolUnavailable
    from envpool.tool_threads import InprocessTools

    async with InprocessTools(threads=1) as tools:
        for _ in range(20):
            with pytest.raises(ToolUnavailable, match="no time left"):
                await tools("calculator", {"expression": "1"}, deadline_s=0)
        assert RAN_ON == [] and tools.metrics["tool_threads_stuck"] == 0


@pytest.mark.parametrize("started", [True, False])
async def test_the_fake_backend_injects_whether_a_failed_call_began(started):
    # a test of a bridge or a job scripts a deadline that ran or did not, whatever its words
    from envpool.errors import ToolUnavailable
    from fabric.errors import ErrorCode
    from fabric.testing import FakeBackend, Fault

    fake = FakeBackend(REG)
    fake.inject("calculator", Fault(code=ErrorCode.DEADLINE_EXCEEDED, message="late", started=started))
    async with fabric.Client(backend=fake, registry=REG) as client:
        call = fabric_tools(client)
        if started:
            assert (await call("calculator", {"expression": "1"}, deadline_s=5)).startswith("error: tool")
        else:
            with pytest.raises(ToolUnavailable, match="late"):
                await call("calculator", {"expression": "1"}, deadline_s=5)
