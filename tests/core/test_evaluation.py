"""The evaluation row: the versions that played it, and the unseen split as of its start.

The manager is a fake that plays each task as a one-turn episode; training goes on while it
plays (a new version published, a task trained on), as it does in async mode."""

from __future__ import annotations

import asyncio
import json

import pytest

from core import evaluation
from core.config import JobConfig
from core.evaluation import EVAL_SEED_BASE, Evaluator
from core.rollout.env_manager import Task, task_key
from fabric.protocol import Message, Trajectory


def _cfg(episodes: int = 4) -> JobConfig:
    return JobConfig.from_dict(
        {
            "envs": [{"id": "latency-v0", "tag": "lat"}],
            "rewards": {"lat": [{"function": "unused"}]},
            "rollout": {"eval_episodes": episodes},
        },
        check_references=False,
    )


class TrainingMeanwhile:
    """Plays half the episodes on the version asked, then 'publishes' version + 1 and trains
    on the first evaluation task, then plays the rest on the new version."""

    def __init__(self, evaluator: Evaluator) -> None:
        self.evaluator = evaluator
        self.current: int | None = None
        self.played = 0
        self.published = asyncio.Event()

    async def run(self, task: Task, *, version: int) -> Trajectory:
        if self.current is None:
            self.current = version
        self.played += 1
        if self.played > 4:  # the later half waits for the new weights
            await self.published.wait()
        elif self.played == 4:
            self.current = version + 1
            self.evaluator.trained_on([task_key(f"map {EVAL_SEED_BASE}")])
            self.published.set()
        v = self.current if self.played > 4 else version
        return Trajectory(
            id=f"{task.seed}-{task.greedy}",
            status="ok",
            env_reward=1.0,
            messages=[
                Message(role="user", content=f"map {task.seed}"),
                Message(role="assistant", content="go", policy_version=v),
            ],
        )


async def test_the_row_says_which_versions_played_it_and_judges_unseen_as_of_its_start():
    ev = Evaluator(_cfg(episodes=4))  # 8 episodes: greedy and sampled per seed
    row = await ev.run(TrainingMeanwhile(ev), step=3, version=3)  # type: ignore[arg-type]
    assert row["version"] == 3 and row["versions"] == [3, 4]
    # the task trained on while it ran still counts as unseen: the row measures version 3
    assert row["episodes_unseen"] == row["episodes"] == 4
    assert ev.trained_tasks == {task_key(f"map {EVAL_SEED_BASE}")}


async def test_a_row_played_by_its_own_version_only_says_so():
    class Still:
        async def run(self, task: Task, *, version: int) -> Trajectory:
            msgs = [
                Message(role="user", content="m"),
                Message(role="assistant", content="a", policy_version=version),
            ]
            return Trajectory(id=str(task.seed), status="ok", env_reward=0.0, messages=msgs)

    row = await Evaluator(_cfg(episodes=2)).run(Still(), step=0, version=0)  # type: ignore[arg-type]
    assert row["versions"] == [0, 0] and row["success"] == 0.0


async def test_an_episode_that_raises_stops_the_others():
    # the proxy died under one episode (ProxyDiedError: the job stops on it): gather raised it
    # and left the other episodes playing, their sessions open while the job shut down
    from core.errors import ProxyDiedError

    class OneRaises:
        def __init__(self) -> None:
            self.waiting: list[asyncio.Future[None]] = []
            self.cancelled = 0

        async def run(self, task: Task, *, version: int) -> Trajectory:
            if task.seed == EVAL_SEED_BASE and task.greedy:
                while len(self.waiting) < 3:  # noqa: ASYNC110 - the others are playing
                    await asyncio.sleep(0)
                raise ProxyDiedError("the LLM proxy actor died")
            fut = asyncio.get_running_loop().create_future()
            self.waiting.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            raise AssertionError("never resolved")

    manager = OneRaises()
    with pytest.raises(ProxyDiedError):
        await Evaluator(_cfg(episodes=2)).run(manager, step=1, version=1)  # type: ignore[arg-type]
    assert manager.cancelled == 3 and all(f.done() for f in manager.waiting)


class SomeRaise:
    """Plays each task as a one-turn episode that succeeds; the seeds in ``raising`` raise a
    bug of the manager's (not an EnvPoolError/EngineError, which are infra_failed data)."""

    def __init__(self, raising: set[int]) -> None:
        self.raising = raising

    async def run(self, task: Task, *, version: int) -> Trajectory:
        if task.seed - EVAL_SEED_BASE in self.raising:
            raise KeyError(f"a bug on seed {task.seed}")
        msgs = [
            Message(role="user", content=f"map {task.seed}"),
            Message(role="assistant", content="go", policy_version=version),
        ]
        return Trajectory(id=f"{task.seed}-{task.greedy}", status="ok", env_reward=1.0, messages=msgs)


class InfraFails:
    """Every greedy episode (or every one) ends ``infra_failed``: a dead container, say."""

    def __init__(self, *, sampled_too: bool) -> None:
        self.sampled_too = sampled_too

    async def run(self, task: Task, *, version: int) -> Trajectory:
        msgs = [
            Message(role="user", content="m"),
            Message(role="assistant", content="a", policy_version=version),
        ]
        if task.greedy or self.sampled_too:
            return Trajectory(id=f"{task.seed}-{task.greedy}", status="infra_failed", messages=msgs)
        return Trajectory(id=f"{task.seed}-s", status="ok", env_reward=1.0, messages=msgs)


@pytest.mark.parametrize("sampled_too", [True, False])
async def test_an_evaluation_with_no_episode_to_score_reports_no_success_not_0(caplog, sampled_too):
    # every episode infra_failed: the row read success 0.0 over 0 episodes, a policy that
    # fails every task, which the summary's untrained/final/best success then repeated
    ev = Evaluator(_cfg(episodes=3))
    with caplog.at_level("WARNING", logger="core.evaluation"):
        row = await ev.run(InfraFails(sampled_too=sampled_too), step=4, version=4)  # type: ignore[arg-type]
    assert row["success"] is None and row["return_mean"] is None and row["episodes"] == 0
    assert row["infra_failed"] == (6 if sampled_too else 3)
    if sampled_too:
        assert row["success_sampled"] is None and row["episodes_sampled"] == 0
    else:
        assert row["success_sampled"] == 1.0 and row["episodes_sampled"] == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == (2 if sampled_too else 1)
    assert "evaluation at step 4: no greedy episode finished to be scored (3 played, 3 of them" in warnings[0]
    assert "its success is None, not 0" in warnings[0]
    # what reads the rows skips it: the best of the evaluations, the progress line's latest
    assert evaluation.best_success([{"success": 0.25}, row]) == 0.25
    assert evaluation.best_success([row]) is None


async def test_an_episode_that_raises_is_counted_not_the_end_of_the_run(caplog):
    # one episode's unexpected error failed the whole evaluation, and the run with it, where
    # the same error in a training rollout is counted and the trajectory re-run
    ev = Evaluator(_cfg(episodes=4))
    with caplog.at_level("ERROR", logger="core.evaluation"):
        row = await ev.run(SomeRaise({1, 2}), step=5, version=5)  # type: ignore[arg-type]
    # seeds 1 and 2 raise, greedy and sampled: 4 of 8 episodes; the others are the measure
    assert row["episodes_failed"] == 4
    assert row["episodes"] == row["episodes_sampled"] == 2
    assert row["success"] == row["success_sampled"] == 1.0
    # said once, with the first error and its traceback, not once per episode
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].exc_info is not None
    assert "4 of 8 evaluation episodes raised" in errors[0].getMessage()
    assert "KeyError" in errors[0].getMessage()
    row = await ev.run(SomeRaise(set()), step=6, version=6)  # type: ignore[arg-type]
    assert row["episodes_failed"] == 0


async def test_an_evaluation_whose_every_episode_raises_stops_the_run():
    # a bug that fails every episode is no measurement: loud, as every group given up is
    from core.errors import RolloutError

    with pytest.raises(RolloutError, match=r"all 4 evaluation episodes .*KeyError") as caught:
        await Evaluator(_cfg(episodes=2)).run(SomeRaise({0, 1}), step=2, version=2)  # type: ignore[arg-type]
    assert isinstance(caught.value.__cause__, KeyError)


class Maps:
    """One-turn episodes whose task (reset observation) is ``map <seed>``: seed-determined."""

    async def run(self, task: Task, *, version: int) -> Trajectory:
        msgs = [
            Message(role="user", content=f"map {task.seed}"),
            Message(role="assistant", content="go", policy_version=version),
        ]
        return Trajectory(id=f"{task.seed}-{task.greedy}", status="ok", env_reward=1.0, messages=msgs)


def _map(i: int) -> str:
    return task_key(f"map {EVAL_SEED_BASE + i}")


async def test_the_trained_tasks_kept_are_bounded_past_the_cap(monkeypatch):
    # every distinct task trained on was kept, and written whole into every checkpoint's
    # job.json: 200k unique prompts (a math dataset) made it 4.4 MB, growing without end
    monkeypatch.setattr(evaluation, "MAX_TRAINED_TASKS", 10, raising=False)
    ev = Evaluator(_cfg(episodes=4))
    await ev.run(Maps(), step=0, version=0)  # type: ignore[arg-type]
    ev.trained_on([_map(1)])
    ev.trained_on(task_key(f"prompt {i}") for i in range(1000))
    ev.trained_on([_map(2)])  # after the cap too
    # only what the unseen split needs: the evaluation's tasks trained on
    assert ev.trained_tasks == {_map(1), _map(2)}
    row = await ev.run(Maps(), step=1, version=1)  # type: ignore[arg-type]
    assert row["episodes_unseen"] == 2 and row["episodes_untracked"] == 0
    assert row["success_unseen"] == 1.0

    # across a checkpoint: job.json's keys, through JSON, into a fresh evaluator
    saved = json.loads(json.dumps(ev.state()))
    assert len(json.dumps(saved)) < 1000
    again = Evaluator(_cfg(episodes=5))  # a resume may ask for more episodes
    again.restore(saved)
    again.trained_on([_map(3), task_key("prompt x")])
    assert again.trained_tasks == {_map(1), _map(2), _map(3)}
    row = await again.run(Maps(), step=2, version=2)  # type: ignore[arg-type]
    # seed 4 is a task first met past the cap: whether training saw it is not known
    assert row["episodes_unseen"] == 1 and row["episodes_untracked"] == 1


async def test_an_old_checkpoint_of_every_trained_task_resumes(monkeypatch):
    # job.json of an earlier release: trained_tasks only, however many
    monkeypatch.setattr(evaluation, "MAX_TRAINED_TASKS", 10, raising=False)
    ev = Evaluator(_cfg(episodes=4))
    ev.rows.append({"kind": "eval", "step": 0})  # the run's rows, restored from metrics.jsonl
    ev.restore({"trained_tasks": [_map(1)] + [task_key(f"prompt {i}") for i in range(50)]})
    # its evaluation tasks are known only once one runs: nothing is dropped before that
    ev.trained_on([task_key("prompt y")])
    assert len(ev.trained_tasks) == 52
    row = await ev.run(Maps(), step=3, version=3)  # type: ignore[arg-type]
    assert row["episodes_unseen"] == 3 and row["episodes_untracked"] == 0
    assert ev.trained_tasks == {_map(1)}  # narrowed once it knew them


def test_without_evaluations_the_trained_tasks_stop_at_the_cap(monkeypatch):
    monkeypatch.setattr(evaluation, "MAX_TRAINED_TASKS", 10, raising=False)
    cfg = _cfg(episodes=4)
    cfg.rollout.eval_every = 0
    ev = Evaluator(cfg)
    ev.trained_on(task_key(f"prompt {i}") for i in range(1000))
    assert len(ev.trained_tasks) <= 10


class GreedyRaises(SomeRaise):
    """Every greedy episode raises (a bug in the greedy path); the sampled ones succeed."""

    async def run(self, task: Task, *, version: int) -> Trajectory:
        if task.greedy:
            raise KeyError("a bug of greedy decoding")
        return await super().run(task, version=version)


async def test_an_evaluation_whose_every_greedy_episode_raises_stops_the_run():
    # the greedy half all raised and the sampled half played: the row said success 0.0 over
    # 0 episodes, which the plot and learning_report read as a policy that fails every task,
    # and the run went on measuring nothing, a line in the log per evaluation
    from core.errors import RolloutError

    with pytest.raises(RolloutError, match=r"all 3 greedy evaluation episodes .*KeyError"):
        await Evaluator(_cfg(episodes=3)).run(GreedyRaises(set()), step=2, version=2)  # type: ignore[arg-type]
