"""``fabric bench``: its figures (overhead, hedging, stragglers, failed calls left out),
SIGTERM, bad options, functions that fail, hang, print or are async, the bound on direct
calls, and the Ray baseline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import cli_fns
import pytest
from aws_fakes import free_port
from cli_helpers import HERE, runner

import fabric
from fabric.cli import app


def test_bench_json_has_the_figures():
    r = runner.invoke(app, ["bench", "exact_match", "--n", "400", "--concurrency", "8", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    for key in ("throughput_per_s", "p50_ms", "p99_ms", "overhead_p50_ms", "cold_start_ms"):
        assert out[key] > 0, key
    assert out["errors"] == 0 and out["n"] == 400
    # at 8 callers the p50 is mostly queueing for a worker: the overhead says so
    assert "--concurrency 8: mostly queueing" in out["overhead_note"]


def test_bench_stopped_by_sigterm_shuts_down_as_on_ctrl_c(tmp_path):
    # SIGTERM killed it on the spot (exit -15); with --baseline ray it met Ray's handler
    root = str(Path(fabric.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, str(HERE)])}
    args = ["bench", "exact_match", "--n", "10000000", "--concurrency", "2", "--workers", "1", "--json"]
    p = subprocess.Popen(
        [sys.executable, "-m", "fabric.cli", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (workers := _workers_of(p.pid)):  # the bench's pool is up
            assert p.poll() is None and time.monotonic() < deadline, p.returncode
            time.sleep(0.02)
        p.terminate()
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err[-1500:]
    assert not [w for w in workers if Path(f"/proc/{w}").exists()]


def _workers_of(pid: int) -> list[int]:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    found = []
    for child in children:
        try:
            if b"fabric.worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(int(child))
        except OSError:
            pass  # gone while we looked: not a live worker
    return found


def test_bench_overhead_is_unqualified_only_one_call_at_a_time():
    r = runner.invoke(app, ["bench", "exact_match", "--n", "200", "--concurrency", "1", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["overhead_p50_ms"] > 0 and "overhead_note" not in out


def test_a_negative_overhead_is_flagged_as_noise():
    # code_verify with an assert-style test measured -0.6 ms: a bare negative figure reads as
    # "the fabric is faster than calling the function"
    r = runner.invoke(
        app,
        ["bench", "cli_slower_in_the_bench", "-m", "cli_fns", "--n", "40", "--concurrency", "1", "--json"],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["overhead_p50_ms"] < 0 and out["overhead_note"].startswith("negative: the call itself")


def test_bench_compare_hedge_with_stragglers():
    r = runner.invoke(
        app,
        [
            "bench",
            "exact_match",
            "--n",
            "600",
            "--concurrency",
            "8",
            "--straggler-rate",
            "0.05",
            "--straggler-ms",
            "100",
            "--compare-hedge",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["hedge_off_p99_ms"] >= 100  # 5% stragglers show at p99 without hedging
    assert out["hedges"] > 0


def test_bench_rejects_bad_options():
    r = runner.invoke(app, ["bench", "exact_match", "--n", "0", "--json"])
    assert r.exit_code == 2 and "n" in r.output
    r = runner.invoke(app, ["bench", "exact_match", "--baseline", "spark", "--n", "10", "--json"])
    assert r.exit_code == 2 and "baseline" in r.output
    # a baseline function nobody registered is named as the baseline, near miss first
    r = runner.invoke(app, ["bench", "exact_match", "--baseline", "fn:exact_mach", "--n", "10", "--json"])
    assert r.exit_code == 2 and "--baseline fn:exact_mach" in r.output, r.output
    assert "did you mean 'exact_match'" in r.output
    r = runner.invoke(app, ["bench", "exact_match", "--payload", "{x", "--n", "10", "--json"])
    assert r.exit_code == 2 and "--payload is not valid JSON" in r.output
    r = runner.invoke(app, ["bench", "exact_match", "--payload", "[1]", "--n", "10", "--json"])
    assert r.exit_code == 2 and "--payload must be a JSON object" in r.output


def test_bench_refuses_stragglers_where_only_one_side_would_get_them():
    # stragglers reached only the local backend's run: a Ray baseline or a lambda run was
    # compared (ratio_vs_baseline, straggler_rate in the JSON) as if under the same load
    straggle = ["--straggler-rate", "0.01", "--straggler-ms", "200", "--n", "10", "--json"]
    for extra in (["--baseline", "ray"], ["--backend", "lambda", "--endpoint-url", "http://127.0.0.1:9"]):
        r = runner.invoke(app, ["bench", "exact_match", *straggle, *extra])
        assert r.exit_code == 2, r.output
        assert "--straggler-rate" in r.output and extra[0] in r.output


def _bench(name: str, *extra: str) -> object:
    return runner.invoke(
        app, ["bench", name, "-m", "cli_fns", "--n", "20", "--concurrency", "2", "--json", *extra]
    )


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("cli_raises", "cli_raises raised ValueError: bad trajectory"),
        ("cli_bad_setup", "cli_bad_setup: the setup hook raised RuntimeError: no model here"),
        ("cli_hangs", "cli_hangs: a call on the bench payload ran past 0.3 s"),
    ],
)
def test_bench_of_a_function_that_fails_in_process_is_a_clear_error(name, text):
    """The direct (in-process) measurement called the function unguarded: a raising handler
    or setup hook ended the CLI with a traceback, a hung one hung it."""
    cli_fns.RELEASE.clear()
    try:
        r = _bench(name)
    finally:
        cli_fns.RELEASE.set()  # the abandoned cli_hangs call ends
    assert r.exit_code == 2, r.output
    assert text in r.output
    assert isinstance(r.exception, SystemExit)  # typer's exit, not a traceback


def test_bench_of_a_function_that_fails_in_workers_says_why():
    r = _bench("cli_fails_in_workers")
    assert r.exit_code == 2, r.output
    assert "cold-start call failed: UserError: RuntimeError: this worker cannot score" in r.output


def test_bench_reports_failed_calls_and_leaves_them_out_of_the_figures():
    r = _bench("cli_fails_every_other_call_in_workers")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert 0 < out["errors"] < 20 and out["error_types"] == {"UserError": out["errors"]}
    assert out["first_error"].startswith("UserError:") and "even call" in out["first_error"]
    # the rates count answers only: 20 calls, of which errors failed
    assert out["throughput_per_s"] == pytest.approx((20 - out["errors"]) / out["elapsed_s"])


def test_bench_slow_share_is_of_the_answered_calls_like_the_other_figures():
    """Every reply held back 20 ms: every answered call is slow. slow_share divided by all the
    calls, failed ones (left out of every other figure) included, and read about 0.5."""
    r = _bench("cli_fails_every_other_call_in_workers", "--straggler-rate", "1", "--straggler-ms", "20")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert 0 < out["errors"] < 20 and out["p50_ms"] >= 10
    assert out["slow_share"] == 1.0


@pytest.mark.parametrize("transport", ["http", "boto3"])
def test_bench_where_every_call_fails_is_an_error_not_a_figure(transport, monkeypatch):
    """A load whose every call failed (nothing listening at --endpoint-url, no credentials)
    printed exit 0 and a throughput: the speed of failing, 59,000 calls/s."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "RL_FABRIC_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    args = ["bench", "exact_match", "--backend", "lambda", "--endpoint-url", url, "--transport", transport]
    if transport == "http":
        args += ["--token", "t0k3n"]
    r = runner.invoke(app, [*args, "--n", "4", "--concurrency", "2", "--json"])
    assert r.exit_code == 2, r.output
    assert "every one of the" in r.output and "calls failed, first with" in r.output
    if transport == "boto3":  # boto3 signs before it connects: no credentials says what to do
        assert "NoCredentialsError" in r.output and "aws configure" in r.output


def test_bench_json_stays_parseable_when_the_function_prints():
    r = _bench("cli_prints")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["errors"] == 0
    assert "debug: a" in r.stderr  # like a worker's prints


def test_bench_of_an_async_function_awaits_it():
    """The direct measurement called an async function without awaiting it: 'coroutine was
    never awaited', and direct_p50_ms was the cost of creating a coroutine."""
    r = _bench("cli_async")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["direct_p50_ms"] >= 2  # it sleeps 2 ms
    assert out["overhead_p50_ms"] == pytest.approx(out["p50_ms"] - out["direct_p50_ms"])


def test_bench_direct_calls_are_bounded_by_time():
    """2,000 direct calls came before any timed one whatever --n said: 40 s for a 20 ms
    function. About a second of them now."""
    before = cli_fns.SLOW_CALLS
    r = _bench("cli_slow", "--n", "4")
    assert r.exit_code == 0, r.output
    direct = cli_fns.SLOW_CALLS - before  # workers are other processes: these ran here
    assert 3 <= direct <= 60, direct
    assert json.loads(r.stdout)["direct_p50_ms"] >= 20


@pytest.mark.ray
def test_bench_ray_baseline_runs_side_by_side():
    r = runner.invoke(
        app, ["bench", "exact_match", "--n", "300", "--concurrency", "8", "--baseline", "ray", "--json"]
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["baseline"] == "ray" and out["baseline_throughput_per_s"] > 0
    assert out["ratio_vs_baseline"] == pytest.approx(
        out["throughput_per_s"] / out["baseline_throughput_per_s"]
    )
    assert out["baseline_errors"] == 0


@pytest.mark.ray
def test_the_ray_baseline_leaves_failed_calls_out_of_its_figures_as_the_fabric_does():
    # its failed calls counted as latencies (and in its throughput), the fabric's did not
    r = _bench("cli_fails_every_other_call", "--n", "400", "--concurrency", "4", "--baseline", "ray")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert 150 <= out["baseline_errors"] <= 250, out  # every second call in each actor
    assert 150 <= out["errors"] <= 250, out
