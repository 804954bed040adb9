"""The job's tally and the train rows of metrics.jsonl built from it."""

from __future__ import annotations

from typing import Any

from core.buffer import Group
from core.sample import Sample
from core.tally import Tally
from fabric.protocol import RewardResult, Trajectory


class FakeStream:
    """What a train row reads of the reward stream: its running totals."""

    def __init__(self) -> None:
        self.total_ms, self.scored = 0.0, 0

    def score(self, *ms: float) -> None:
        self.total_ms += sum(ms)
        self.scored += len(ms)

    def metrics(self) -> dict[str, Any]:
        mean = self.total_ms / self.scored if self.scored else 0.0
        return {"scored": self.scored, "reward_ms": {"mean": mean, "max": 0.0, "total": self.total_ms}}


def group(gid: str, *statuses: str) -> Group:
    samples = []
    for i, status in enumerate(statuses):
        traj = Trajectory(id=f"{gid}-{i}", status=status, info={"gen_s": 0.5, "env_s": 0.25})  # type: ignore[arg-type]
        s = Sample(traj=traj, tag="t", group_id=gid, version=0, status="ok")
        s.reward = RewardResult(score=float(i))
        samples.append(s)
    return Group(id=gid, version=0, samples=samples)


def row(tally: Tally, stream: FakeStream, step: int) -> dict[str, Any]:
    return tally.train_row(step, step, [group(f"g{step}", "ok", "ok")], {}, 1.0, 0.0, 0.0, 0.0, stream)  # type: ignore[arg-type]


def test_times_are_per_row_and_counts_run_totals():
    tally, stream = Tally(), FakeStream()
    for t in group("a", "ok", "truncated", "infra_failed").samples:
        tally.finished(t.traj)
    stream.score(1000.0, 3000.0)
    first = row(tally, stream, 1)
    assert first["time"]["reward_s"] == 2.0 and first["time"]["gen_s"] == 0.5
    tally.counts["given_up_groups"] += 1
    stream.score(100.0)  # the second step's rewards only: not averaged with the first's
    second = row(tally, stream, 2)
    assert second["time"]["reward_s"] == 0.1
    assert second["time"]["gen_s"] == 0.0  # nothing finished since the last row
    assert second["finished"]["ok"] == 1 and second["finished"]["infra_failed"] == 1  # run totals
    assert second["given_up_groups"] == 1
    assert row(tally, stream, 3)["time"]["reward_s"] == 0.0  # nothing scored since


def test_a_trajectory_counted_twice_is_recorded():
    tally = Tally()
    t = Trajectory(id="x", status="ok")
    tally.finished(t)
    tally.finished(t)
    assert tally.counts["double_count"] == 1


def test_the_double_count_check_remembers_a_window_not_the_whole_run(monkeypatch):
    import core.tally

    monkeypatch.setattr(core.tally, "SEEN_WINDOW", 3)
    tally = Tally()
    for i in range(5):
        tally.finished(Trajectory(id=str(i), status="ok"))
    assert list(tally._seen) == ["2", "3", "4"]  # bounded in a long job
    tally.finished(Trajectory(id="4", status="ok"))  # within the window: still caught
    assert tally.counts["double_count"] == 1


def test_a_failed_reward_is_the_last_error_with_its_function():
    # the reason is on the sample (its trajectory finished ok): a run whose reward always
    # raised stopped with "the last trajectory error: none recorded"
    tally = Tally()
    tally.finished(Trajectory(id="x", status="infra_failed", info={"error": "ContainerDied: gone"}))
    assert tally.last_error == "ContainerDied: gone"
    ok = Trajectory(id="y", status="ok")
    s = Sample(traj=ok, tag="coin", group_id="g", version=0, status="reward_failed")
    s.error = "always_raises: UserError: ValueError: my reward is broken"
    tally.reward_failed(s)
    assert tally.counts["reward_failed"] == 1
    assert "rewards.coin" in tally.last_error and "always_raises" in tally.last_error
    assert "my reward is broken" in tally.last_error


def test_infra_failed_trajectories_are_counted_by_their_error_type():
    # an environment that raised on some seeds showed only as an infra_failed count
    tally = Tally()
    for i, kind in enumerate(["EnvLogicError:KeyError", "EnvLogicError:KeyError", "SessionLost"]):
        tally.finished(Trajectory(id=str(i), status="infra_failed", info={"error": "x", "error_type": kind}))
    tally.finished(Trajectory(id="old", status="infra_failed", info={"error": "x"}))  # no type recorded
    tally.finished(Trajectory(id="ok", status="ok"))
    assert tally.errors == {"EnvLogicError:KeyError": 2, "SessionLost": 1, "unknown": 1}


def test_runs_cancelled_before_they_ended_are_counted_aborted():
    # a redundant member stopped inside a slow environment step ends with no trajectory:
    # finished.aborted counted only those the proxy stopped at their LLM turn
    tally, stream = Tally(), FakeStream()
    tally.finished(Trajectory(id="at-turn", status="aborted"))
    tally.cancelled("in-step")
    assert row(tally, stream, 1)["finished"]["aborted"] == 2


def test_a_failed_reward_moves_its_trajectory_out_of_ok_so_the_counts_add_up():
    # a trajectory whose reward failed was counted under ok (or truncated) and again under
    # reward_failed: the finished counts summed to more trajectories than had finished
    tally, stream = Tally(), FakeStream()
    samples = group("a", "ok", "truncated", "ok", "infra_failed").samples
    for s in samples:
        tally.finished(s.traj)
    for s in samples[1:3]:  # the truncated one and the second ok one
        s.status, s.error = "reward_failed", "UserError: boom"
        tally.reward_failed(s)
    finished = row(tally, stream, 1)["finished"]
    assert finished == {"ok": 1, "truncated": 0, "aborted": 0, "infra_failed": 1, "reward_failed": 2}
    assert sum(finished.values()) == len(samples)


def test_a_train_row_carries_the_dual_clip_and_the_masked_non_finite_logprob_turns():
    tally, stream = Tally(), FakeStream()
    metrics = {"dual_clip_frac": 0.25, "nonfinite_logprob_samples": 2.0}
    got = tally.train_row(1, 1, [group("g", "ok", "ok")], metrics, 1.0, 0.0, 0.0, 0.0, stream)  # type: ignore[arg-type]
    assert got["dual_clip_frac"] == 0.25 and got["nonfinite_logprob_samples"] == 2.0
