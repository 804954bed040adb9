"""The job's step loop and launcher with stand-in parts (no Ray): the launch budget, sync
mode's lockstep, a run that fails or ends stopping its rollouts, evaluation and reward
stream, and the counts its summary or failure.json keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from job_helpers import (
    job_config,
)

from core.config import JobConfig
from core.errors import ProxyDiedError, RolloutError
from core.job import Job

# ----------------------------------------------------------------------------- launch accounting


async def test_a_given_up_group_is_counted_out_of_the_launch_budget_once():
    # given up (out of re-runs), a group leaves the launch budget; left pending in the buffer,
    # its bound dropped it later as stale too, and each given-up group made the launcher
    # start one group more than its budget (one that could only go stale)
    from test_groups import FakeManager, FakeProxy
    from test_groups import job as group_job

    from core.buffer import SampleBuffer
    from core.rollout.groups import GroupRunner

    cfg = group_job(group_size=2, max_reruns=0)
    j = Job(cfg, progress=False)
    manager = FakeManager(default=(0.001, "infra_failed"))
    j.runner = GroupRunner(cfg, manager, FakeProxy(), submit=lambda t: None, on_given_up=j._given_up)  # type: ignore[arg-type]
    j.buffer = SampleBuffer(cfg.group_size, cfg.alpha, on_abort=j._on_abort)
    j._start_group(j.runner)
    assert j._groups_live == 1
    async with asyncio.timeout(5):
        while not j.tally.counts["given_up_groups"]:  # noqa: ASYNC110 - no event for "given up"
            await asyncio.sleep(0.005)
    assert j._groups_live == 0
    assert j.buffer.advance(cfg.alpha + 1) == []  # the trainer moves past the group's version
    assert j.tally.counts["stale_groups"] == 0 and j._groups_live == 0
    await j.runner.aclose()


def _sync_job_whose_first_group_fails() -> tuple[Job, Any, Any]:
    """A sync-mode job (group_size 2, no reruns) whose first group's members fail on infra
    at once and every later member plays 60 s: the job, its fake manager, a turn barrier."""
    from test_groups import FakeManager, FakeProxy
    from test_groups import job as group_job

    from core.buffer import SampleBuffer
    from core.rollout.env_manager import TurnBarrier
    from core.rollout.groups import GroupRunner

    cfg = group_job(group_size=2, max_reruns=0).model_copy(deep=True)
    cfg.rollout.mode = "sync"
    j = Job(cfg, progress=False)
    j._fatal = asyncio.get_running_loop().create_future()
    manager = FakeManager(script=[(0.001, "infra_failed")] * 2, default=(60.0, "ok"))
    j.runner = GroupRunner(cfg, manager, FakeProxy(), submit=lambda t: None, on_given_up=j._given_up)  # type: ignore[arg-type]
    j.buffer = SampleBuffer(cfg.group_size, cfg.alpha, on_abort=j._on_abort)
    barrier = TurnBarrier()
    return j, manager, barrier


async def test_a_sync_mode_group_given_up_is_replaced_in_the_steps_lockstep():
    # sync mode: a step's groups move turn by turn together (one TurnBarrier); the group
    # started in place of one given up ran on its own, outside the batch-level baseline
    j, manager, barrier = _sync_job_whose_first_group_fails()
    j._start_group(j.runner, barrier)
    try:
        async with asyncio.timeout(5):
            while len(manager.launched) < 4:  # noqa: ASYNC110 - no event for "replaced"
                await asyncio.sleep(0.001)
        assert j.tally.counts["given_up_groups"] == 1
        assert [b for _, _, _, b in manager.launched[2:]] == [barrier, barrier]
        assert barrier._members == 2  # the replacement's members; the given-up ones left
    finally:
        await j.runner.aclose()


async def test_a_sync_mode_group_given_up_once_the_job_is_failing_is_not_replaced():
    # the group that sets the fatal RolloutError was not replaced, but every later one given
    # up (its streak already past the limit) was: new groups started while the job stopped,
    # each holding an environment session the shutdown then had to cancel
    j, _, barrier = _sync_job_whose_first_group_fails()
    try:
        j._start_group(j.runner, barrier)  # started before the job was failing
        assert j._groups_live == 1
        j._fatal.set_exception(RolloutError("8 groups in a row were given up"))
        async with asyncio.timeout(5):
            while not j.tally.counts["given_up_groups"]:  # noqa: ASYNC110 - no event for "given up"
                await asyncio.sleep(0.001)
        # a replacement starts within _given_up, before it returns
        assert j.runner.metrics["groups_started"] == 1, "a group started after the job's fatal error"
        assert j.runner.metrics["trajectories_started"] == 2 and j._groups_live == 0
        # nor does the step loop's own start (sync mode: a step's groups) add any
        j._start_group(j.runner, barrier)
        assert j.runner.metrics["groups_started"] == 1 and j._groups_live == 0
    finally:
        await j.runner.aclose()
        j._fatal.exception()


async def test_a_rollout_stopped_by_a_failing_reward_says_the_rewards_error():
    # a reward that always raises gives up every group; the RolloutError said "the last
    # trajectory error: none recorded" (the reason was on the sample, never copied)
    from test_groups import FakeManager, FakeProxy
    from test_groups import job as group_job

    from core.buffer import SampleBuffer
    from core.rollout.groups import GroupRunner
    from core.sample import Sample
    from fabric.protocol import Trajectory

    cfg = group_job(group_size=2, max_reruns=0)
    j = Job(cfg, progress=False)
    j._fatal = asyncio.get_running_loop().create_future()
    j.runner = GroupRunner(cfg, FakeManager(), FakeProxy(), submit=lambda t: None, on_given_up=j._given_up)  # type: ignore[arg-type]
    j.buffer = SampleBuffer(cfg.group_size, cfg.alpha, on_abort=j._on_abort)
    n = max(8, 2 * cfg.batch_size)  # the groups given up in a row that stop the job
    groups = [j.runner.start(cfg.envs[0], i, 0) for i in range(n)]
    async with asyncio.timeout(5):
        while j.runner.running():  # noqa: ASYNC110 - no event for "idle"
            await asyncio.sleep(0.005)
    for g in groups:  # each full, then losing a member to its reward with no re-run left
        j.buffer.open_group(g.id, 0)
        traj = Trajectory(id=f"t-{g.id}", status="ok", task={"tag": "lat", "group_id": g.id})
        s = Sample(traj=traj, tag="lat", group_id=g.id, version=0, status="reward_failed")
        s.error = "always_raises: UserError: ValueError: my reward is broken"
        j._deliver(s)
    assert j._fatal.done()
    text = str(j._fatal.exception())
    assert "rewards.lat: always_raises: UserError: ValueError: my reward is broken" in text
    assert f"{n} reward_failed" in text
    await j.runner.aclose()


async def test_a_rollout_stopped_by_trajectories_that_raise_says_their_error():
    # run() itself raised (a proxy actor's OSError on every turn, a bug): the runner logged
    # it and kept it as the group's last error, but the job's RolloutError said "the last
    # trajectory error: none recorded", having looked only at infra_failed and reward_failed
    from test_groups import FakeManager, FakeProxy
    from test_groups import job as group_job

    from core.buffer import SampleBuffer
    from core.rollout.groups import GroupRunner

    cfg = group_job(group_size=2, max_reruns=0)
    j = Job(cfg, progress=False)
    j._fatal = asyncio.get_running_loop().create_future()
    manager = FakeManager(default=(0.001, "raise"))
    j.runner = GroupRunner(cfg, manager, FakeProxy(), submit=lambda t: None, on_given_up=j._given_up)  # type: ignore[arg-type]
    j.buffer = SampleBuffer(cfg.group_size, cfg.alpha, on_abort=j._on_abort)
    for _ in range(max(8, 2 * cfg.batch_size)):  # the groups given up in a row that stop the job
        j._start_group(j.runner)
    async with asyncio.timeout(5):
        await asyncio.wait({j._fatal})
    text = str(j._fatal.exception())
    assert "the last trajectory error: RuntimeError: a bug in the manager" in text, text
    await j.runner.aclose()


async def test_a_rollout_stopped_by_trajectories_that_raise_does_not_name_an_old_error():
    # the tally's last error is the last infra_failed or reward_failed trajectory of the run,
    # which may be hours old: it was named ahead of the given-up group's own error, so a job
    # stopped by runs that raise said an environment's crash of long ago was the cause
    from test_groups import FakeManager, FakeProxy
    from test_groups import job as group_job

    from core.buffer import SampleBuffer
    from core.rollout.groups import GroupRunner

    cfg = group_job(group_size=2, max_reruns=0)
    j = Job(cfg, progress=False)
    j._fatal = asyncio.get_running_loop().create_future()
    j.tally.last_error = "ContainerDied: an environment lost at step 3"
    manager = FakeManager(default=(0.001, "raise"))
    j.runner = GroupRunner(cfg, manager, FakeProxy(), submit=lambda t: None, on_given_up=j._given_up)  # type: ignore[arg-type]
    j.buffer = SampleBuffer(cfg.group_size, cfg.alpha, on_abort=j._on_abort)
    for _ in range(max(8, 2 * cfg.batch_size)):
        j._start_group(j.runner)
    async with asyncio.timeout(5):
        await asyncio.wait({j._fatal})
    text = str(j._fatal.exception())
    assert "the last trajectory error: RuntimeError: a bug in the manager" in text, text
    await j.runner.aclose()


async def test_a_step_stopped_while_it_waits_for_a_batch_takes_its_wait_along():
    # Ctrl-C (or SIGTERM) while the step loop waited for a batch cancelled only the wait for
    # "the batch or the fatal error": the batch's own wait stayed a waiter of the buffer,
    # pending past the job, to be handed the next complete groups
    from core.buffer import SampleBuffer

    cfg = job_config(Path("unused"))
    j = Job(cfg, progress=False)
    j._fatal = asyncio.get_running_loop().create_future()
    buffer = SampleBuffer(cfg.group_size, cfg.alpha)
    step = asyncio.create_task(j._unless_fatal(buffer.get_batch(cfg.batch_size)))
    while not buffer.metrics()["waiters"]:  # noqa: ASYNC110 - the wait began
        await asyncio.sleep(0)
    step.cancel()
    with pytest.raises(asyncio.CancelledError):
        await step
    assert buffer.metrics()["waiters"] == 0


async def test_a_run_that_fails_stops_the_evaluation_it_was_running(tmp_path, monkeypatch):
    # async mode: the step-1 evaluation plays while training goes on; the run failing
    # meanwhile (every group given up: RolloutError) left it playing, its sessions open while
    # the job wrote failure.json and closed the pool and the cluster under it
    from core.report import JobProgress, RunDir
    from fabric.protocol import Message, Trajectory

    cfg = job_config(tmp_path, steps=3, rollout={"eval_every": 1, "eval_episodes": 1})
    j = Job(cfg, progress=False)
    fatal = j._fatal = asyncio.get_running_loop().create_future()

    class Manager:  # the step-0 evaluation ends; the step-1 one plays until stopped
        playing: list[asyncio.Future[None]] = []

        async def run(self, task: Any, *, version: int) -> Trajectory:
            if task.group_id == "eval-0":
                msgs = [Message(role="user", content="m")]
                return Trajectory(status="ok", env_reward=0.0, messages=msgs)
            if not fatal.done():
                fatal.set_exception(RolloutError("every group given up"))
            fut = asyncio.get_running_loop().create_future()
            self.playing.append(fut)
            await fut
            raise AssertionError("never resolved")

    class Runner:  # what the step loop and the launcher use of a GroupRunner: nothing runs
        changed = asyncio.Event()
        aborted_ids: set[str] = set()

        def rolling_groups(self) -> int:
            return 1 << 30

        def forget_aborted_before(self, version: int) -> None:
            pass  # the stand-in buffer keeps no aborted ones

        async def aclose(self) -> None:
            pass  # the stand-in holds nothing to close

    class Stream:
        def metrics(self) -> dict[str, Any]:
            return {"scored": 0, "reward_ms": {"total": 0.0}}

    _stand_in_cluster(j, monkeypatch)
    buffer = j.buffer = _one_batch(cfg)  # step 1 trains, step 2 waits and fails
    manager = Manager()
    with pytest.raises(RolloutError):
        await j._train(
            manager,  # type: ignore[arg-type]
            Runner(),  # type: ignore[arg-type]
            buffer,
            Stream(),  # type: ignore[arg-type]
            RunDir(tmp_path / "run"),
            JobProgress(cfg.steps, enabled=False),
        )
    assert manager.playing and all(f.cancelled() for f in manager.playing)


def _stand_in_cluster(j: Job, monkeypatch: Any) -> None:
    """What the step loop uses of the job's Ray actors: a trainer whose steps publish
    version 1, a proxy that takes the weights; and no batch to build."""
    from types import SimpleNamespace

    import core.job

    def done(value: Any) -> asyncio.Future[Any]:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(value)
        return fut

    class Trainer:
        class step:  # the Ray handle's method
            @staticmethod
            def options(num_returns: int) -> Any:
                return SimpleNamespace(remote=lambda batch: (done({"version": 1}), None))

    async def call(aw: Any) -> None:
        pass  # the step loop's trainer calls need no answer here

    update = SimpleNamespace(remote=lambda version, refs: None)
    j.cluster = SimpleNamespace(  # type: ignore[assignment]
        trainer=Trainer, proxy=SimpleNamespace(update_weights=update), remote_proxy=SimpleNamespace(call=call)
    )
    monkeypatch.setattr(core.job, "build_batch", lambda groups, cfg, **kw: [])


def _one_batch(cfg: JobConfig) -> Any:
    """A buffer holding one batch of complete groups (one step's worth)."""
    from core.buffer import SampleBuffer
    from core.sample import Sample
    from fabric.protocol import RewardResult, Trajectory

    buffer = SampleBuffer(cfg.group_size, cfg.alpha)
    for g in range(cfg.batch_size):
        for i in range(cfg.group_size):
            t = Trajectory(id=f"{g}-{i}", status="ok", env_reward=1.0)
            buffer.put(
                Sample(traj=t, tag="latency", group_id=f"g{g}", version=0, reward=RewardResult(score=1.0))
            )
    return buffer


async def test_the_final_evaluation_plays_with_the_rollouts_stopped(tmp_path, monkeypatch):
    # async mode: once the last step is trained nothing the rollouts play can be trained,
    # yet they ran on through the final evaluation (sharing the engines with it, re-running
    # their failures, sending what finished to be scored and waiting for it in the drain)
    # and were stopped only after it
    from core.report import JobProgress, RunDir
    from core.rewards import RewardStream
    from fabric.protocol import Message, Trajectory

    cfg = job_config(tmp_path, steps=1, rollout={"eval_every": 1, "eval_episodes": 1})
    j = Job(cfg, progress=False)
    j._fatal = asyncio.get_running_loop().create_future()
    _stand_in_cluster(j, monkeypatch)
    buffer = j.buffer = _one_batch(cfg)

    class Runner:  # what the job uses of a GroupRunner; "rolling" until it is closed
        changed = asyncio.Event()
        aborted_ids: set[str] = set()
        metrics: dict[str, int] = {}
        closed = False

        def rolling_groups(self) -> int:
            return 1 << 30

        def forget_aborted_before(self, version: int) -> None:
            pass  # the stand-in buffer keeps no aborted ones

        async def aclose(self) -> None:
            self.closed = True

    runner = j.runner = Runner()  # type: ignore[assignment]
    rolling_at: dict[str, bool] = {}

    class Manager:
        async def run(self, task: Any, *, version: int) -> Trajectory:
            rolling_at[task.group_id] = not runner.closed
            return Trajectory(status="ok", env_reward=0.0, messages=[Message(role="user", content="m")])

    stream = j.stream = RewardStream(None, cfg.rewards, j._deliver)  # type: ignore[arg-type]
    summary = await j._rollout(
        Manager(),  # type: ignore[arg-type]
        runner,  # type: ignore[arg-type]
        buffer,
        stream,
        RunDir(tmp_path / "run"),
        JobProgress(cfg.steps, enabled=False),
        0.0,
    )
    assert summary["steps"] == 1 and [e["step"] for e in summary["evals"]] == [0, 1]
    assert rolling_at == {"eval-0": True, "eval-1": False}


@pytest.mark.parametrize("fails", [True, False])
async def test_a_run_stops_its_rollouts_before_it_waits_for_its_last_checkpoint(tmp_path, monkeypatch, fails):
    # a run that ends (its last step trained, or failed) waits for the checkpoint being
    # written (up to trainer.call_timeout_s, an hour by default), and its rollouts ran on
    # all that while: groups played, re-run and scored that nothing would ever train on
    from core.buffer import SampleBuffer
    from core.report import JobProgress, RunDir

    cfg = job_config(tmp_path, steps=1)
    j = Job(cfg, progress=False)
    j._fatal = asyncio.get_running_loop().create_future()
    _stand_in_cluster(j, monkeypatch)
    # failing: no batch, step 1 waits and meets the fatal error; else step 1 trains
    buffer = j.buffer = SampleBuffer(cfg.group_size, cfg.alpha) if fails else _one_batch(cfg)
    closed = asyncio.Event()

    class Runner:  # what the step loop uses of a GroupRunner; "rolling" until closed
        changed = asyncio.Event()
        aborted_ids: set[str] = set()

        def rolling_groups(self) -> int:
            return 1 << 30

        def forget_aborted_before(self, version: int) -> None:
            pass  # the stand-in buffer keeps no aborted ones

        async def aclose(self) -> None:
            closed.set()

    class Stream:
        def metrics(self) -> dict[str, Any]:
            return {"scored": 0, "reward_ms": {"total": 0.0}}

    rolling_while_written: list[bool] = []

    async def written() -> None:  # the checkpoint's write, as long as the rollouts go on
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2):
                await closed.wait()
        rolling_while_written.append(not closed.is_set())

    j._checkpoint_task = asyncio.create_task(written())
    train = j._train(
        None,  # type: ignore[arg-type]
        Runner(),  # type: ignore[arg-type]
        buffer,
        Stream(),  # type: ignore[arg-type]
        RunDir(tmp_path / "run"),
        JobProgress(cfg.steps, enabled=False),
    )
    if fails:
        j._fatal.set_exception(RolloutError("every group given up"))
        with pytest.raises(RolloutError):
            await train
    else:
        await train
        assert j.step == 1
    assert rolling_while_written == [False]


async def test_a_run_that_fails_in_its_first_evaluation_leaves_no_launcher_running(tmp_path):
    # async mode: the launcher starts before the untrained policy's evaluation, which ran
    # outside the step loop's cleanup: an evaluation that failed (a dead proxy) or a Ctrl-C
    # during it left the launcher task pending, starting groups on a closed runner
    from core.buffer import SampleBuffer
    from core.report import JobProgress, RunDir

    cfg = job_config(tmp_path, steps=1, rollout={"eval_every": 1, "eval_episodes": 1})
    j = Job(cfg, progress=False)
    j._fatal = asyncio.get_running_loop().create_future()
    j.buffer = SampleBuffer(cfg.group_size, cfg.alpha)

    class Runner:
        changed = asyncio.Event()

        def rolling_groups(self) -> int:
            return 1 << 30

        async def aclose(self) -> None:
            pass  # the stand-in holds nothing to close

    class Manager:
        async def run(self, task: Any, *, version: int) -> Any:
            raise ProxyDiedError("the LLM proxy actor died")

    with pytest.raises(ProxyDiedError):
        await j._train(
            Manager(),  # type: ignore[arg-type]
            Runner(),  # type: ignore[arg-type]
            j.buffer,
            None,  # type: ignore[arg-type]
            RunDir(tmp_path / "run"),
            JobProgress(cfg.steps, enabled=False),
        )
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert leftover == []


async def test_the_summary_counts_what_the_reward_stream_scored_while_it_drained(tmp_path, monkeypatch):
    # a run that finishes drains its reward stream (every trajectory in flight is scored
    # and delivered), but the summary's counts were taken before: what was scored in the
    # drain was missing from summary.json (rewards.scored, the buffer's accepted samples)
    from core.report import JobProgress, RunDir
    from core.rewards import RewardStream
    from fabric.protocol import Result, Trajectory

    cfg = job_config(tmp_path, steps=1)
    j = Job(cfg, progress=False)
    j._fatal = asyncio.get_running_loop().create_future()
    _stand_in_cluster(j, monkeypatch)
    buffer = j.buffer = _one_batch(cfg)
    accepted_before = buffer.metrics()["accepted"]
    closing = asyncio.Event()

    class Client:  # a reward that answers only once the stream drains
        async def call(self, function: str, payload: Any, **kw: Any) -> Result:
            await closing.wait()
            return Result(ok=True, function=function, value=1.0)

    class Stream(RewardStream):
        async def aclose(self, **kw: Any) -> None:
            closing.set()
            await super().aclose(**kw)

    class Runner:  # nothing runs: the late trajectory below is the rollout's last
        changed = asyncio.Event()
        aborted_ids: set[str] = set()
        metrics: dict[str, int] = {}

        def rolling_groups(self) -> int:
            return 1 << 30

        def forget_aborted_before(self, version: int) -> None:
            pass  # the stand-in buffer keeps no aborted ones

        async def aclose(self) -> None:
            pass  # the stand-in holds nothing to close

    runner = j.runner = Runner()  # type: ignore[assignment]
    stream = j.stream = Stream(Client(), cfg.rewards, j._deliver)  # type: ignore[arg-type]
    late = Trajectory(id="late", status="ok", env_reward=1.0, task={"tag": "latency", "group_id": "late"})
    stream.submit(late, version=1)
    summary = await j._rollout(
        None,  # type: ignore[arg-type]
        runner,  # type: ignore[arg-type]
        buffer,
        stream,
        RunDir(tmp_path / "run"),
        JobProgress(cfg.steps, enabled=False),
        0.0,
    )
    assert stream.metrics()["scored"] == 1  # the drain scored it
    assert summary["rewards"]["scored"] == 1 and summary["rewards"]["in_flight"] == 0
    assert summary["buffer"]["accepted"] == accepted_before + 1


async def test_failure_json_counts_what_the_reward_stream_had_in_flight_as_cancelled(tmp_path, monkeypatch):
    # a run that fails stops its reward stream without a drain: what it was scoring is
    # cancelled (and counted so). failure.json was written before, inside the stream's
    # block: it said the trajectory was still in flight and left it out of the cancelled,
    # so its counts did not add up as a summary's do (submitted = scored + reward_failed +
    # cancelled + passed_masked, nothing in flight)
    from core.buffer import SampleBuffer
    from core.report import JobProgress, RunDir
    from core.rewards import RewardStream
    from fabric.protocol import Result, Trajectory

    cfg = job_config(tmp_path, steps=1)
    j = Job(cfg, progress=False)
    j._fatal = asyncio.get_running_loop().create_future()
    _stand_in_cluster(j, monkeypatch)
    buffer = j.buffer = SampleBuffer(cfg.group_size, cfg.alpha)  # no batch: step 1 waits
    calling = asyncio.Event()

    class Client:  # a reward that is being scored when the run fails
        async def call(self, function: str, payload: Any, **kw: Any) -> Result:
            calling.set()
            await asyncio.Event().wait()
            raise AssertionError("never answered")

    class Runner:
        changed = asyncio.Event()
        aborted_ids: set[str] = set()
        metrics: dict[str, int] = {}

        def rolling_groups(self) -> int:
            return 1 << 30

        async def aclose(self) -> None:
            pass  # the stand-in holds nothing to close

    runner = j.runner = Runner()  # type: ignore[assignment]
    stream = j.stream = RewardStream(Client(), cfg.rewards, j._deliver)  # type: ignore[arg-type]

    async def fail_while_scoring() -> None:
        await calling.wait()
        assert j._fatal is not None
        j._fatal.set_exception(RolloutError("every group given up"))

    stream.submit(
        Trajectory(id="t", status="ok", env_reward=1.0, task={"tag": "latency", "group_id": "g"}), version=0
    )
    failing = asyncio.create_task(fail_while_scoring())
    run_dir = RunDir(tmp_path / "run")
    with pytest.raises(RolloutError):
        await j._rollout(
            None,  # type: ignore[arg-type]
            runner,  # type: ignore[arg-type]
            buffer,
            stream,
            run_dir,
            JobProgress(cfg.steps, enabled=False),
            0.0,
        )
    await failing
    rewards = json.loads((run_dir.path / "failure.json").read_text())["rewards"]
    assert rewards == json.loads(json.dumps(stream.metrics()))  # what the stream counted in the end
    assert rewards["in_flight"] == 0 and rewards["cancelled"] == 1
