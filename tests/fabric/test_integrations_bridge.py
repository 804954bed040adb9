"""fabric.integrations' bridge, the event loop thread the synchronous adapters call through:
started lazily, closed (also at exit when left open), safe across fork, rewards sent to
another process, and cancellation (Ctrl-C, a cancelled task, a reward closed mid-batch)
reaching the batch on the bridge."""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
import threading
import time
from pathlib import Path

import pytest
from integ_fns import REG
from integ_helpers import LOCAL1, call_trl, fake_backend, msgs, trl_kwargs
from test_local_backend import alive

from fabric.integrations import IntegrationConfig, build_trajectory
from fabric.integrations.trl import trl_async_reward, trl_reward
from fabric.protocol import Trajectory
from fabric.registry import Registry
from fabric.testing import FakeBackend

# integ_helpers: a FakeBackend over integ_fns.REG
fake = pytest.fixture(fake_backend, name="fake")


# ----------------------------------------------------------------------------- the bridge


def test_bridge_starts_lazily_closes_workers_and_restarts():
    reward = trl_reward("contains", registry=REG, backend={"type": "local", "max_workers": 1, "warm": 1})
    assert not reward._bridge.started  # nothing runs until the first call
    assert not any(t.name == "fabric-trl-contains" for t in threading.enumerate())
    out, _ = call_trl(reward, ["p"], ["1"], **trl_kwargs(1, answer=["1"]))
    assert out == [1.0]
    pids = reward.adapter._client.backend.stats()["contains"]["pids"]
    assert pids and all(alive(p) for p in pids)
    reward.close()
    assert not any(t.name == "fabric-trl-contains" for t in threading.enumerate())
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)
    reward.close()  # idempotent
    out, _ = call_trl(reward, ["p"], ["2"], **trl_kwargs(1, answer=["1"]))  # starts again
    assert out == [0.0]
    reward.close()


EXIT_WITHOUT_CLOSE = """
import json, sys
sys.path.insert(0, {here!r})
import integ_fns
from fabric.integrations.trl import trl_reward
backend = {"type": "local", "max_workers": 1, "warm": 1}
reward = trl_reward("contains", registry=integ_fns.REG, backend=backend)
assert reward(prompts=["p"], completions=["1"], answer=["1"]) == [1.0]
print(json.dumps(reward.adapter._client.backend.stats()["contains"]["pids"]), flush=True)
# no close(): the exit backstop ends the bridge and its workers
"""


def test_the_exit_backstop_closes_a_bridge_left_open(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", EXIT_WITHOUT_CLOSE.replace("{here!r}", repr(str(Path(__file__).parent)))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # an atexit hook ran after concurrent.futures' own: "cannot schedule new futures after
    # interpreter shutdown" from the pool's close, with a traceback, at every such exit
    assert "Traceback" not in done.stderr and "closing the fabric client failed" not in done.stderr, (
        done.stderr
    )
    pids = json.loads(done.stdout)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids and not any(alive(p) for p in pids)


@pytest.mark.parametrize("state", ["open", "never_started", "closed"])
def test_a_fork_while_another_thread_holds_the_bridge_lock_does_not_hang_the_child(state):
    # open: its lock reset in the child; never started or closed: not in _OPEN while the lock
    # is held (inside _ensure, or close() waiting for the workers), which once hung the child
    import multiprocessing as mp
    import queue

    reward = trl_reward("contains", registry=REG, backend="inproc")
    try:
        if state != "never_started":
            assert call_trl(reward, ["p"], ["1"], **trl_kwargs(1, answer=["1"]))[0] == [1.0]
        if state == "closed":
            reward.close()
        ctx = mp.get_context("fork")
        answers = ctx.Queue()

        def child() -> None:
            answers.put(call_trl(reward, ["p"], ["2"], **trl_kwargs(1, answer=["2"]))[0])

        with reward._bridge._lock:  # as when another thread is starting or closing the bridge
            proc = ctx.Process(target=child, daemon=True)
            proc.start()
        try:
            assert answers.get(timeout=60) == [1.0]  # the child's lock was never released
        except queue.Empty:
            pytest.fail(f"the forked child waited forever on a lock the parent held at the fork ({state})")
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    finally:
        reward.close()


def test_a_fork_while_the_module_level_rewards_are_being_built_does_not_hang_the_child():
    # veRL's reward_for and OpenRLHF's reward_func hold a module lock while building the first
    # reward (registry discovery, imports): a child forked then must not inherit it held
    import multiprocessing as mp

    from fabric.integrations import _openrlhf as openrlhf_mod
    from fabric.integrations import _verl

    ctx = mp.get_context("fork")
    for module in (_verl, openrlhf_mod):
        answers = ctx.Queue()

        def child(module=module, answers=answers) -> None:
            answers.put(module._LOCK.acquire(timeout=5))

        with module._LOCK:
            proc = ctx.Process(target=child, daemon=True)
            proc.start()
        try:
            assert answers.get(timeout=20) is True, f"{module.__name__}._LOCK was still held in the child"
        finally:
            proc.join(10)


def test_trajectories_from_prompts_and_completions():
    t = build_trajectory(msgs("hi"), [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert [m.role for m in t.messages] == ["system", "user", "assistant"] and t.final_text() == "hi"
    t = build_trajectory(
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "f", "arguments": {}}}],
            }
        ],
        "prompt",
    )
    assert [m.role for m in t.messages] == [
        "user",
        "assistant",
    ]  # a tool call of another shape is kept as a turn


def test_a_completion_without_an_assistant_turn_is_not_read_from_the_prompt():
    # a few-shot chat prompt: an empty completion (or one of tool turns only) was scored as
    # the example's answer, the last assistant turn of the whole trajectory
    shot = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "6*7?"},
    ]
    for completion in ([], [{"role": "tool", "content": "2"}]):
        t = build_trajectory(completion, shot)
        assert t.final_text() == "" and t.messages[-1].role == "assistant"
    assert build_trajectory(msgs("42"), shot).final_text() == "42"


@pytest.mark.parametrize("deadline_s", [math.inf, 1e12])
def test_no_deadline_waits_for_the_batch(fake, deadline_s):
    # math.inf is the client's "no deadline"; the bridge waited deadline_s + grace seconds,
    # past threading.TIMEOUT_MAX: every synchronous batch still running then raised
    # OverflowError (and was cancelled)
    slow = {"delay_s": 0.5}
    with trl_reward(
        "slow_length", registry=REG, backend_instance=fake, deadline_s=deadline_s, constants=slow
    ) as r:
        assert r(prompts=["p"], completions=["abc"]) == [3.0]


def test_a_trl_reward_can_be_sent_to_another_process():
    """TRL's experimental AsyncGRPOTrainer pickles its reward functions into a spawned child:
    the bridge's lock, loop thread and client made a TRLReward unpicklable. A copy is rebuilt
    from the function and options, and starts its own bridge on first use."""
    import pickle

    prompts, completions = ["Capital of France?"], ["Paris"]
    for make in (trl_reward, trl_async_reward):
        original = make("exact_match", backend=LOCAL1)
        copy = pickle.loads(pickle.dumps(original))
        assert type(copy) is type(original) and copy.__name__ == "exact_match"
        try:
            call = copy(prompts, completions, ground_truth=["paris"])
            out = asyncio.run(call) if inspect.iscoroutine(call) else call
            assert out == [1.0]
        finally:
            copy.close()
            original.close()
    with pytest.raises(TypeError, match="registry= or backend_instance="):
        pickle.dumps(trl_reward("exact_match", registry=Registry(), backend=LOCAL1))


async def test_arun_cancelled_in_the_loop_turn_its_scores_arrive_is_cancelled(fake, monkeypatch):
    # asyncio.wait_for (Python 3.11) returns a result that lands in the loop turn its caller
    # is cancelled and drops the cancellation: a trainer's task cancelled (a step aborted, a
    # shutdown) just as its batch's scores came back went on as if never cancelled
    import concurrent.futures

    reward = trl_async_reward("contains", registry=REG, backend_instance=fake)
    try:
        # started first: arun starts a bridge on a thread of its own, and a cancel landing in
        # that wait (not the one for the scores) passed with wait_for too
        await asyncio.to_thread(reward._bridge._ensure)
        scores: concurrent.futures.Future[list] = concurrent.futures.Future()
        submitted: list[bool] = []

        def submit(coro: object) -> concurrent.futures.Future[list]:
            submitted.append(True)
            return scores

        monkeypatch.setattr(reward._bridge, "_submit", submit)  # the bridge's loop, played
        task = asyncio.ensure_future(reward._bridge.arun([]))
        await asyncio.sleep(0)  # it waits for the scores
        assert submitted, "arun is not waiting for the scores yet"
        scores.set_result([])  # handed to this loop in its next turn
        task.cancel()  # in that same turn
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        reward.close()


def _held_reward() -> tuple[Registry, threading.Event, threading.Event]:
    """A reward that runs until cancelled: (its registry, entered, cancelled)."""
    reg = Registry()
    entered, cancelled = threading.Event(), threading.Event()

    @reg.reward(name="held", warm=0, timeout_s=60, retry={"max_attempts": 1})
    async def held(traj: Trajectory) -> float:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 1.0

    return reg, entered, cancelled


def test_ctrl_c_during_a_synchronous_batch_cancels_it_on_the_bridge():
    """A KeyboardInterrupt in ``SyncBridge.run`` (Ctrl-C while the trainer waits for its
    rewards) left the batch running on the bridge's loop: its calls held their workers until
    they ended by themselves. It is cancelled there now."""
    import signal

    from fabric.integrations import RewardAdapter, Sample, SyncBridge

    reg, entered, cancelled = _held_reward()
    cfg = IntegrationConfig(function="held", builtins=False)
    bridge = SyncBridge(RewardAdapter(cfg, registry=reg, backend=FakeBackend(reg)))

    def ctrl_c() -> None:
        if entered.wait(30):
            os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupter = threading.Thread(target=ctrl_c)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            bridge.run([Sample(build_trajectory("hi"))])
        assert cancelled.wait(10), "the batch ran on after Ctrl-C"
    finally:
        interrupter.join()
        signal.signal(signal.SIGINT, previous)
        bridge.close()


async def test_arun_starts_the_bridge_without_blocking_the_callers_loop():
    """The first ``arun`` started the bridge (its loop, the client, a local backend's pools)
    synchronously, on the caller's event loop: the trainer's loop stood still until the
    client was up. It starts off that loop now."""
    from fabric.integrations import RewardAdapter, Sample, SyncBridge

    entered, go = threading.Event(), threading.Event()
    waited: list[bool] = []

    class SlowStart(FakeBackend):
        async def _start(self) -> None:
            entered.set()
            waited.append(await asyncio.get_running_loop().run_in_executor(None, go.wait, 10))

    cfg = IntegrationConfig(function="length", builtins=False)
    bridge = SyncBridge(RewardAdapter(cfg, registry=REG, backend=SlowStart(REG)))
    try:
        task = asyncio.ensure_future(bridge.arun([Sample(build_trajectory("four"))]))
        await asyncio.to_thread(entered.wait, 10)  # this loop runs on while the bridge starts
        go.set()
        scores = await task
        assert waited == [True], "the caller's loop stood still while the bridge started"
        assert [s.value for s in scores] == [4.0]
    finally:
        await asyncio.to_thread(bridge.close)


def test_closing_a_reward_while_a_batch_runs_cancels_it_and_the_caller_hears_at_once():
    """``close()`` (or the exit backstop) while another thread waited for a batch stopped the
    bridge's loop under the batch: its calls ran on, never finished, and the caller waited
    for the whole deadline and its grace (330 s by default; at exit, a non-daemon thread
    still scoring held the interpreter that long). The batch is cancelled now, and its
    caller gets ``RewardClosedError``."""
    from fabric.integrations import RewardAdapter, RewardClosedError, Sample, SyncBridge

    reg, entered, cancelled = _held_reward()
    cfg = IntegrationConfig(function="held", builtins=False)
    bridge = SyncBridge(RewardAdapter(cfg, registry=reg, backend=FakeBackend(reg)))
    outcome: list[BaseException | list] = []

    def score() -> None:
        try:
            outcome.append(bridge.run([Sample(build_trajectory("hi"))]))
        except BaseException as e:
            outcome.append(e)

    caller = threading.Thread(target=score, daemon=True)
    caller.start()
    try:
        assert entered.wait(30)
        bridge.close()
        assert cancelled.is_set(), "the batch ran on after close()"
        caller.join(30)
        assert not caller.is_alive(), "the caller still waits for a batch of a closed reward"
        [err] = outcome
        assert isinstance(err, RewardClosedError) and "held" in str(err), err
    finally:
        bridge.close()
