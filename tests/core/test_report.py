"""RunDir (config, metrics, summary, plots) and JobProgress (plain, disabled, live)."""

from __future__ import annotations

import contextlib
import io
import json
import resource
import signal
from collections.abc import Iterator

import pytest
from rich.console import Console

from core.report import JobProgress, RunDir

PNG = b"\x89PNG\r\n\x1a\n"


def row(step: int, reward: float = 0.5, success: float = 0.25) -> dict:
    return {
        "step": step,
        "reward_mean": reward,
        "success": success,
        "tokens_per_s": 1234.4,
        "staleness_mean": 0.5,
        "time": {
            "wait_s": 1.0,
            "train_s": 2.0,
            "publish_s": 0.1,
            "gen_s": 0.3,
            "env_s": 0.2,
            "reward_s": 0.05,
        },
    }


def test_run_dir_writes_config_metrics_summary_and_plots(tmp_path):
    run = RunDir(tmp_path / "runs" / "job")  # parents are created
    run.write_config("seed: 3\nsteps: 2\n")
    rows = [row(1, 0.1, 0.0), {"kind": "eval", "step": 1, "success": 0.5}, row(2, 0.9, 1.0)]
    for r in rows:
        run.log(r)
    # metrics are flushed as they come (a crashed job keeps them)
    lines = (run.path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == rows
    assert [r["step"] for r in run.rows] == [1, 2] and run.evals == [rows[1]]
    run.finish({"steps": 2, "final_success": 1.0})
    assert (run.path / "config.yaml").read_text() == "seed: 3\nsteps: 2\n"
    assert json.loads((run.path / "summary.json").read_text()) == {"steps": 2, "final_success": 1.0}
    for name in ("reward.png", "time.png"):
        data = (run.path / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 1000


def test_an_evaluation_with_no_episode_to_score_is_a_gap_in_the_plot(tmp_path):
    # success None (every episode infra_failed): plotted as a gap, not 0 nor an error
    run = RunDir(tmp_path)
    for r in (
        row(1),
        {"kind": "eval", "step": 1, "success": None, "success_sampled": None},
        row(2),
        {"kind": "eval", "step": 2, "success": 0.5, "success_sampled": 0.25},
    ):
        run.log(r)
    run.finish({"steps": 2})
    assert (tmp_path / "reward.png").read_bytes().startswith(PNG)


def test_non_finite_figures_are_written_as_null_so_any_json_reader_takes_them(tmp_path):
    run = RunDir(tmp_path)
    run.log({"kind": "eval", "step": 0, "loss": float("nan"), "x": [float("inf"), 1.5]})
    run.finish({"steps": 0, "best": {"loss": float("-inf")}})
    line = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line) == {"kind": "eval", "step": 0, "loss": None, "x": [None, 1.5]}
    assert json.loads((tmp_path / "summary.json").read_text()) == {"steps": 0, "best": {"loss": None}}
    assert run.evals[0]["x"] == [float("inf"), 1.5]  # what the plots read is left as it was


def test_run_dir_without_training_rows_writes_no_plots(tmp_path):
    run = RunDir(tmp_path)
    run.log({"kind": "eval", "step": 0, "success": 0.0})
    run.finish({"steps": 0})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"steps": 0}
    assert not (tmp_path / "reward.png").exists() and not (tmp_path / "time.png").exists()


def test_a_reused_run_dir_keeps_nothing_of_the_earlier_run(tmp_path):
    # an earlier run's summary and plots beside this run's metrics read as this run's
    first = RunDir(tmp_path)
    first.log(row(1))
    first.finish({"steps": 1})
    (tmp_path / "trace.jsonl").write_text("{}\n")
    (tmp_path / "notes.txt").write_text("mine")
    second = RunDir(tmp_path)  # interrupted: never finishes
    second.log(row(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "notes.txt"]


def test_run_dir_problem_says_why_a_path_cannot_be_one(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("a file")
    assert RunDir.problem(taken) == f"{str(taken)!r} is a file, not a directory"
    assert RunDir.problem(taken / "run" / "x") == f"{str(taken)!r} is a file, not a directory"
    assert RunDir.problem(tmp_path) is None and RunDir.problem(tmp_path / "new" / "run") is None
    assert not (tmp_path / "new").exists()  # checked, not created


@contextlib.contextmanager
def file_size_limit(n: int) -> Iterator[None]:
    """Writes that would take a file past ``n`` bytes fail (EFBIG), as on a full disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the error, not the signal's kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


@pytest.mark.parametrize("end", ["finish", "fail"])
def test_a_summary_or_failure_that_cannot_be_written_whole_is_not_left_half_written(tmp_path, end):
    # a full disk left failure.json empty (or summary.json cut off), where tools and the
    # job's own "(the counts: RUN_DIR/failure.json)" look for the run's record
    run = RunDir(tmp_path)
    run.log({"kind": "eval", "step": 0, "success": 0.0})
    with file_size_limit(1000), pytest.raises(OSError):
        getattr(run, end)({"error": "RolloutError: ...", "counts": "x" * 5000})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def plain_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False, width=200), out


def test_plain_progress_prints_step_lines_at_most_every_five_seconds():
    console, out = plain_console()
    with JobProgress(10, console=console) as p:
        assert not p.live
        p.note("run directory: runs/x")
        p.step(row(1), eval_success=0.75)
        p.step(row(2), eval_success=None)  # within 5 s of the last line: not printed
    lines = out.getvalue().splitlines()
    assert lines[0] == "run directory: runs/x"
    assert lines[1].startswith("step 1: reward 0.500  success 0.25  eval 0.75  tok/s 1234  stale 0.50")
    assert lines[1].endswith("wait 1.0s train 2.0s")
    assert len(lines) == 2


def test_disabled_progress_prints_nothing():
    console, out = plain_console()
    with JobProgress(10, enabled=False, console=console) as p:
        p.note("hello")
        p.step(row(1), eval_success=0.5)
    assert out.getvalue() == ""
    assert not p.live


def test_live_progress_on_a_terminal_shows_the_bar_and_figures():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160)
    with JobProgress(4, console=console) as p:
        assert p.live
        p.step(row(2), eval_success=None)
    text = out.getvalue()
    assert "2/4" in text and "reward 0.500" in text
