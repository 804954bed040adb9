"""envpool, reviewed (17).

* A replay (or a retried step) answers an earlier tool call of the request from the
  request's record by what the call is (the tool, its arguments, and which occurrence of
  that same call it is), not by its place in the order the calls reached the pool: an
  environment's threads may ask in another order on a fresh container, and a call matched
  by place ran its tool again (a side effect twice; an answer that changed lost the session).
* The kubernetes runtime: a pod whose image the registry does not have (or will not give
  us) fails the claim at once, as the caller's to fix (``EnvUsageError``, naming the image),
  as the docker runtime's missing image does; it was a retryable start failure, a pod
  created and failed per attempt of every claim, the session then ``infra_failed``.
* A tool call still running when its step's container died is awaited by the retry's same
  call, not run again (the dead connection's wait for it was cancelled, the tool with it
  in name only: it ran on, and the retry ran it a second time); one that nothing will ask
  for any more (its session lost) is cancelled when its request ends.
* A mid-episode reset retried on a new container (the episode's lost) that raised there
  ends the episode: the next step is refused by the session ("call reset()"), not sent to
  an environment never reset.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest
from echo_bundle import IMAGE, write_env_bundle
from pool_util import alive, wait_for

from envpool.errors import EnvLogicError, EnvOrderError, EnvUsageError
from envpool.pool import EnvPool, SessionLost
from envpool.runtimes.k8s_fake import FakeKubernetesAPI

POOL = {"min_warm": 0, "runtime": {"heartbeat_s": 0.1}}

_PAIR = """
import threading
import envpool


class PairEnv(envpool.Env):
    '''Its step "pair" asks two tools from two threads; which thread's call reaches the pool
    first is the scheduler's. Here the file ``order`` decides it (read at each step), so
    that a test can make a fresh container's threads ask the other way round. "twice" asks
    the same call twice from one thread.'''

    def __init__(self, order):
        self.order = order

    def reset(self, *, seed=None, options=None):
        self.n = 0
        return f"ready {seed}", {}

    def step(self, action):
        self.n += 1
        if action == "twice":
            text = " ".join(self.call_tool("t", {"x": 1}) for _ in range(2))
        elif action == "pair":
            with open(self.order) as f:
                first, second = f.read().split()
            answers = {}
            went = threading.Event()

            def ask(name, after):
                if after:
                    went.wait()  # (the other thread's call is answered: it reached the pool first)
                answers[name] = self.call_tool(name, {"x": name})
                went.set()

            threads = [threading.Thread(target=ask, args=(first, False)),
                       threading.Thread(target=ask, args=(second, True))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            text = f"{answers['a']} {answers['b']}"
        else:
            text = f"{action} #{self.n}"
        return envpool.StepResult(obs=envpool.Observation(text=text))
"""


@pytest.mark.parametrize("answers", ["changing", "constant"])
async def test_a_replay_whose_threads_ask_in_another_order_runs_no_tool_again(tmp_path, answers):
    images = write_env_bundle(tmp_path / "b", "pair_env", _PAIR, {"pair-v0": "PairEnv"})
    order = tmp_path / "order"
    order.write_text("a b")
    calls: list[str] = []

    async def tools(name, arguments):
        calls.append(name)  # (a side effect: it must happen once per call the policy saw)
        return f"{name}{len(calls)}" if answers == "changing" else name

    async with EnvPool(POOL, images=images, tool_caller=tools) as p:
        async with p.session("pair-v0", image=IMAGE, env_kwargs={"order": str(order)}) as s:
            await s.reset(seed=1)
            seen = (await s.step("pair")).obs.text
            assert seen == ("a1 b2" if answers == "changing" else "a b")
            await s.step("next")
            order.write_text("b a")  # the fresh container's threads ask the other way round
            old = s.container.pid
            os.killpg(old, signal.SIGKILL)
            r = await s.step("last")  # replayed: reset, "pair" (answered from the record), "next"
            assert r.obs.text == "last #3" and s.status == "ok" and s.container.pid != old
            assert p.stats()["replays"] == 1
    assert calls == ["a", "b"]


async def test_the_same_call_twice_in_a_request_is_answered_each_time_as_it_was(tmp_path):
    # the occurrence counts: the second "t" of the replayed step gets the second answer
    images = write_env_bundle(tmp_path / "b", "pair_env", _PAIR, {"pair-v0": "PairEnv"})
    calls: list[str] = []

    async def tools(name, arguments):
        calls.append(name)
        return f"{name}{len(calls)}"

    async with EnvPool(POOL, images=images, tool_caller=tools) as p:
        async with p.session("pair-v0", image=IMAGE, env_kwargs={"order": "-"}) as s:
            await s.reset(seed=1)
            assert (await s.step("twice")).obs.text == "t1 t2"
            os.killpg(s.container.pid, signal.SIGKILL)
            assert (await s.step("last")).obs.text == "last #2"
            assert s.status == "ok" and p.stats()["replays"] == 1
            assert (await s.step("twice")).obs.text == "t3 t4"  # a new step's calls run
    assert calls == ["t"] * 4


# -- 2. kubernetes: an image the registry does not have


@pytest.fixture
def api() -> Iterator[FakeKubernetesAPI]:
    pytest.importorskip("kubernetes")
    with FakeKubernetesAPI() as fake:
        yield fake
        pids = fake.processes()
    assert not pids or all(not alive(p) for p in pids)


def k8s_pool(api: FakeKubernetesAPI, image: str) -> EnvPool:
    runtime = {
        "type": "kubernetes",
        "host": api.url,
        "image": image,
        "heartbeat_s": 0.2,
        "start_timeout_s": 15,
    }
    retry = {"attempts": 3, "initial_backoff_s": 0.01, "max_backoff_s": 0.05}
    return EnvPool({"runtime": runtime, "min_warm": 0, "retry": retry})


@pytest.mark.filterwarnings("ignore:HTTPResponse.getheaders:DeprecationWarning")
async def test_a_pod_image_the_registry_does_not_have_fails_the_claim_at_once(api):
    api.image_pull_error_for.add("rl-fabric-env:missing")
    async with k8s_pool(api, "rl-fabric-env:missing") as p:
        with pytest.raises(EnvUsageError, match=r"'rl-fabric-env:missing'.*not found.*runtime\.image"):
            async with p.session("echo-v0"):
                pass
        assert api.requests["POST pods"] == 1  # one pod, not one per attempt
        # a prewarm is refused as well, and the image is not kept warm (retried in the background)
        with pytest.raises(EnvUsageError, match="rl-fabric-env:missing"):
            await p.prewarm(n=1)
        assert api.requests["POST pods"] == 2 and p.stats().get("sessions_infra_failed", 0) == 0
    assert api.pod_names() == []  # the failed pods were deleted


# -- 3. a container that dies while a tool call of its step runs


async def test_a_step_whose_container_died_while_its_tool_ran_does_not_run_the_tool_again(images):
    # the retry's call of the same tool awaits the run under way: the connection's wait for
    # it was cancelled with the dead container, the tool ran on, and the retry ran it again
    calls = []

    async def tools(name, arguments):
        calls.append(arguments["expression"])
        if len(calls) == 1:
            # the tool's effect happened; its container dies, and the pool lets the container
            # go (the step's attempt failed) before the tool answers
            os.killpg(first.pid, signal.SIGKILL)
            await wait_for(lambda: s.container is not first)
        return f"result {len(calls)}"

    async with EnvPool(POOL, images=images, tool_caller=tools) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            first = s.container
            r = await s.step("tool 1+1")
            assert r.obs.text == "result 1" and s.container is not first
            assert p.stats()["step_retries"] == 1
    assert calls == ["1+1"]


async def test_a_tool_call_left_running_by_a_lost_request_is_cancelled_when_it_ends(images):
    ended = asyncio.Event()

    async def tools(name, arguments):
        os.killpg(pid, signal.SIGKILL)
        try:
            await asyncio.sleep(30)
        finally:
            ended.set()
        return "late"

    async with EnvPool(POOL, images=images, tool_caller=tools) as p:
        async with p.session("bundle-random-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            pid = s.container.pid
            with pytest.raises(SessionLost, match="not deterministic"):
                await s.step("tool 1+1")
            # nothing waits for its answer any more: not left running until its deadline
            await asyncio.wait_for(ended.wait(), 5)


_RESET_FAILS = """
import envpool


class ResetFailsEnv(envpool.Env):
    '''A reset with options {"fail": true} raises before it touches the episode.'''

    def reset(self, *, seed=None, options=None):
        if (options or {}).get("fail"):
            raise RuntimeError("bad options")
        self.n = 0
        return "ready", {}

    def step(self, action):
        self.n += 1
        return envpool.StepResult(obs=envpool.Observation(text=f"{action} #{self.n}"))
"""


async def test_a_reset_that_raised_on_a_fresh_container_ends_the_episode_it_never_ran(tmp_path):
    # the episode's container died, the reset was retried on a fresh one and raised there:
    # the session said the episode went on (as after a reset that raised on its own
    # container), and its next step reached an environment never reset, which refused it
    # as the caller's mistake ("step() before reset()", from the container)
    images = write_env_bundle(tmp_path / "b", "reset_env", _RESET_FAILS, {"reset-fails-v0": "ResetFailsEnv"})
    async with EnvPool(POOL, images=images) as p, p.session("reset-fails-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        assert (await s.step("a")).obs.text == "a #1"
        os.killpg(s.container.pid, signal.SIGKILL)
        with pytest.raises(EnvLogicError, match="bad options"):
            await s.reset(seed=2, options={"fail": True})
        assert p.stats()["reset_retries"] == 1
        with pytest.raises(
            EnvOrderError, match=r"the episode ended when reset\(\) raised on a new container"
        ):
            await s.step("b")
        assert (await s.reset(seed=3))[0].text == "ready" and (await s.step("c")).obs.text == "c #1"
        assert s.status == "ok"
