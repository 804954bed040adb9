"""Every ending of a finished trajectory is counted, not only a full context: summary.json's
``trajectories.finish_reasons`` says how many episodes were cut at ``max_turns``, which was
otherwise a plain ``truncated`` count among the environment's own step limits."""

from __future__ import annotations

from core.tally import Tally
from fabric.protocol import Trajectory


def finished(tally: Tally, *endings: tuple[str, str | None]) -> None:
    for i, (status, reason) in enumerate(endings):
        info = {"finish_reason": reason} if reason else {"error": "x", "error_type": "SessionLost"}
        tally.finished(Trajectory(id=f"t{i}", status=status, info=info))  # type: ignore[arg-type]


def test_every_finish_reason_is_counted():
    tally = Tally()
    finished(
        tally,
        ("ok", "terminated"),
        ("ok", "terminated"),
        ("truncated", "max_turns"),
        ("truncated", "max_turns"),
        ("truncated", "max_turns"),
        ("truncated", "env_truncated"),
        ("truncated", "context_full"),
        ("infra_failed", None),  # an infra_failed trajectory has no ending to count
    )
    assert tally.finish_reasons == {"terminated": 2, "max_turns": 3, "env_truncated": 1, "context_full": 1}
    # the key the summary had for full contexts is kept (tests and users read it)
    assert tally.counts["context_full"] == 1


def test_the_summary_trajectories_carry_the_finish_reasons_beside_the_errors():
    tally = Tally()
    finished(tally, ("truncated", "max_turns"), ("infra_failed", None), ("ok", "terminated"))
    out = tally.trajectories()
    assert out["finish_reasons"] == {"max_turns": 1, "terminated": 1}
    assert out["errors"] == {"SessionLost": 1}
    assert out["ok"] == 1 and out["truncated"] == 1 and out["infra_failed"] == 1


def test_the_finish_reasons_survive_a_checkpoint():
    # a resumed run's summary counts the endings of the whole job, as its status counts
    tally = Tally()
    finished(tally, ("truncated", "max_turns"), ("infra_failed", None))
    resumed = Tally()
    resumed.restore(tally.state())
    finished(resumed, ("truncated", "max_turns"))  # ids t0: a fresh window after a resume
    assert resumed.finish_reasons == {"max_turns": 2}
    assert resumed.errors == {"SessionLost": 1} and resumed.counts["truncated"] == 2
    # a checkpoint of an earlier release has no finish_reasons
    old = Tally()
    old.restore({"counts": {"ok": 3}, "errors": {}})
    assert old.finish_reasons == {} and old.counts["ok"] == 3
