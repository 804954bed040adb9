"""The ``fabric`` command, through typer's runner (the local backend spawns real workers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import cli_fns
import pytest
import typer
from aws_fakes import free_port
from help_pages import command_paths, early_breaks
from typer.testing import CliRunner

import fabric
from fabric.cli import app
from fabric.errors import ErrorCode

runner = CliRunner()
HERE = Path(__file__).resolve().parent


def _cli_process(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m fabric.cli`` in a process of its own (what happens at its exit counts)."""
    root = str(Path(fabric.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, str(HERE)])}
    return subprocess.run(
        [sys.executable, "-m", "fabric.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_ls_lists_builtins_and_user_modules():
    r = runner.invoke(app, ["ls", "--json", "-m", "sample_fns"])
    assert r.exit_code == 0, r.output
    names = {s["name"] for s in json.loads(r.stdout)}
    assert {"exact_match", "add", "boom"} <= names
    r = runner.invoke(app, ["ls"])
    assert r.exit_code == 0 and "exact_match" in r.stdout


def test_ls_stays_readable_on_a_narrow_terminal(monkeypatch):
    from fabric.cli import _app as cli

    monkeypatch.setattr(cli.out, "width", 80)
    r = runner.invoke(app, ["ls"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    row = next(line for line in lines if "exact_match" in line)
    # the name and the limits are whole, not cut to an ellipsis
    assert "…" not in row and "reward" in row and "functions" in row  # the entry, folded
    monkeypatch.setattr(cli.out, "width", 200)
    wide = runner.invoke(app, ["ls"]).stdout
    assert "description" in wide and "version" in wide


def test_ls_bad_module_is_a_clear_error():
    r = runner.invoke(app, ["ls", "-m", "no_such_module_xyz"])
    assert r.exit_code == 2 and "no_such_module_xyz" in r.output


def test_a_module_in_the_current_directory_is_found(tmp_path, monkeypatch):
    """``fabric ls -m my_rewards`` next to my_rewards.py: the installed ``fabric`` script
    has no current directory on sys.path (``python -m fabric.cli`` has), and the import
    failed; workers must find the module as well."""
    (tmp_path / "cli_cwd_rewards.py").write_text(
        "import fabric\n\n@fabric.reward\ndef cli_cwd_reward(traj: str) -> float:\n    return 0.5\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cli_cwd_rewards", raising=False)
    try:
        r = runner.invoke(app, ["ls", "--json", "-m", "cli_cwd_rewards"])
        assert r.exit_code == 0, r.output
        assert "cli_cwd_reward" in {s["name"] for s in json.loads(r.stdout)}
        r = runner.invoke(
            app, ["invoke", "cli_cwd_reward", "-m", "cli_cwd_rewards", "--payload", '{"traj": "a"}']
        )
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["value"] == 0.5
    finally:
        sys.modules.pop("cli_cwd_rewards", None)


CHATTY = """
import fabric
from fabric.registry import Registry

REG = Registry()
print("chatty: imported")


def _setup():
    print("chatty: setup")


@REG.reward(setup=_setup, examples=({"traj": "a"},))
def chatty(traj: str, *, ctx) -> float:
    print("chatty: called")
    return 1.0
"""


def test_user_code_prints_stay_off_stdout(tmp_path):
    """What the user's code printed in the CLI's own process (a module's import, and with
    --backend inproc its setup hook and call) came out on stdout before the JSON: `ls
    --json`, `invoke` and `bench --json` answers scripts could not parse."""
    mod = tmp_path / "chatty_fns.py"
    mod.write_text(CHATTY)
    r = runner.invoke(app, ["ls", "--json", "-m", str(mod)])
    assert r.exit_code == 0, r.output
    assert "chatty" in {s["name"] for s in json.loads(r.stdout)}
    assert "chatty: imported" in r.stderr
    r = runner.invoke(
        app, ["invoke", "chatty", "-m", str(mod), "--backend", "inproc", "--payload", '{"traj": "a"}']
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["value"] == 1.0
    assert "chatty: setup" in r.stderr and "chatty: called" in r.stderr
    # a fresh module: its import-time print again (the file above is imported once)
    mod = tmp_path / "chatty_bench_fns.py"
    mod.write_text(CHATTY)
    r = runner.invoke(
        app,
        ["bench", "chatty", "-m", str(mod), "--n", "10", "--concurrency", "1", "--workers", "1", "--json"],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["errors"] == 0
    assert "chatty: imported" in r.stderr


def test_run_quiet_keeps_stdout_for_its_summary(tmp_path):
    """`fabric run --quiet` prints only the summary JSON on stdout; the config's
    fabric.discover module printed there first."""
    (tmp_path / "chatty_run_fns.py").write_text(CHATTY)
    (tmp_path / "job.yaml").write_text(
        "envs: [{id: latency-v0, tag: latency}]\n"
        "rewards: {latency: [{function: chatyy}]}\n"  # refused once discovery has run
        f"fabric: {{discover: [{tmp_path / 'chatty_run_fns.py'}]}}\n"
        f"run_dir: {tmp_path / 'run'}\n"
    )
    r = runner.invoke(app, ["run", str(tmp_path / "job.yaml"), "--quiet"])
    assert r.exit_code == 2, r.output
    assert "did you mean 'chatty'" in r.stderr and "chatty: imported" in r.stderr
    assert r.stdout == ""


def test_invoke_prints_the_result():
    r = runner.invoke(
        app, ["invoke", "exact_match", "--payload", '{"traj": "The answer is 42.", "ground_truth": "42"}']
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["ok"] is True and out["value"] == 1.0


@pytest.mark.parametrize(
    ("args", "code", "text"),
    [
        # bad input exits 2, whether the CLI or the client refuses it; a failed call exits 1
        (["invoke", "exact_matc", "--payload", "{}"], 2, "env_return, exact_match, format_reward"),
        (["invoke", "exact_matc", "--payload", "{}"], 2, "did you mean 'exact_match'?"),
        (["invoke", "exact_match", "--payload", "{not json"], 2, "--payload is not valid JSON"),
        (["invoke", "exact_match", "--payload", '{"traj": NaN}'], 2, "NaN is not JSON"),
        (["invoke", "exact_match", "--payload", "[1]"], 2, "JSON object"),
        (["invoke", "exact_match", "--payload", '{"traj": "x"}'], 2, "missing 'ground_truth'"),
        (["invoke", "add", "-m", "sample_fns", "--payload", '{"a": "x"}', "--backend", "inproc"], 2, "a:"),
        (
            ["invoke", "boom", "-m", "sample_fns", "--payload", '{"x": 1}', "--backend", "inproc"],
            1,
            "ValueError",
        ),
        (["invoke", "add", "-m", "sample_fns", "--backend", "lambada"], 2, "known types"),
    ],
)
def test_invoke_errors(args, code, text):
    r = runner.invoke(app, args)
    assert r.exit_code == code, r.output
    assert text in r.output


def test_serve_of_an_unknown_function_names_the_known_ones_and_how_to_load_yours():
    """It said "--function names not registered: nonexistent" and stopped there."""
    r = runner.invoke(app, ["serve", "-f", "exact_match", "-f", "nonexistent", "--port", "0"])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "unknown function 'nonexistent'" in text
    assert "known functions: " in text and "exact_match" in text and "math_answer" in text
    assert "-m MODULE" in text and "file.py" in text
    # with its module, the same name is known: the command gets past the check (and then
    # fails on its bad port, before it serves)
    r = runner.invoke(app, ["serve", "-f", "add", "-m", "sample_fns", "--port", "-1"])
    assert r.exit_code == 2 and "unknown function" not in r.output and "port" in r.output, r.output


def test_serve_body_timeout_s_reaches_the_server(tmp_path):
    """ServeConfig.body_timeout_s had no option: a stalled body waited the 60 s default."""
    import socket

    token = "t" * 20
    root = str(Path(fabric.__file__).resolve().parent.parent)
    args = ["serve", "-f", "exact_match", "--workers", "1", "--port", "0", "--token", token]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric.cli", *args, "--body-timeout-s", "0.5"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([root, str(HERE)])},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = json.loads(proc.stdout.readline())["port"]
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(
                b"POST /2015-03-31/functions/exact_match/invocations HTTP/1.1\r\nHost: x\r\n"
                b"Authorization: Bearer " + token.encode() + b'\r\nContent-Length: 1000\r\n\r\n{"traj'
            )
            start = time.monotonic()
            reply = s.recv(4096)
            waited = time.monotonic() - start
    finally:
        proc.terminate()
        proc.wait(30)
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    assert b"within 0.5 s" in reply and waited < 20


def test_serve_drains_on_ctrl_c_and_a_second_one_stops_it_now(tmp_path):
    """Ctrl-C waited silently for aiohttp's 60 s shutdown timeout while a call ran; a
    second one did nothing."""
    import signal
    import socket

    import httpx

    token = "t" * 20
    root = str(Path(fabric.__file__).resolve().parent.parent)
    args = ["serve", "-m", "sample_fns", "-f", "sleepy", "--workers", "1", "--port", "0", "--token", token]
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fabric.cli", *args, "--drain-s", "60"],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([root, str(HERE)])},
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        assert proc.stdout is not None
        port = json.loads(proc.stdout.readline())["port"]
        body = b'{"seconds": 30}'
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(
                b"POST /2015-03-31/functions/sleepy/invocations HTTP/1.1\r\nHost: x\r\n"
                b"Authorization: Bearer "
                + token.encode()
                + b"\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            gauge = 'fabric_serve_tenant_inflight{tenant="default"} 1.0'
            metrics = ""
            for _ in range(300):  # the call holds its quota slot: it is in flight
                metrics = httpx.get(
                    f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"}
                ).text
                if gauge in metrics:
                    break
                time.sleep(0.05)
            assert gauge in metrics
            proc.send_signal(signal.SIGINT)
            for _ in range(300):
                if "stopping:" in log.read_text():
                    break
                time.sleep(0.05)
            assert "stopping: waiting up to 60 s for 1 call in flight" in log.read_text()
            assert proc.poll() is None  # draining: the call has 60 s
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            assert proc.wait(30) == 0
            assert time.monotonic() - t0 < 20
            assert s.recv(4096) == b""  # no answer: the connection dropped (the client retries)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert "stopping now: 1 call cancelled" in log.read_text()


@pytest.mark.parametrize("command", [["serve"], ["integrate", "openrlhf-serve"]])
def test_a_closed_stdout_is_no_listen_failure(tmp_path, command):
    """`fabric serve | head -0`: the URL line's BrokenPipeError was reported as
    "cannot listen on 127.0.0.1:0: Broken pipe" (exit 2). It ends as click ends on a closed
    pipe: exit 1, no traceback, nothing left running."""
    root = str(Path(fabric.__file__).resolve().parent.parent)
    args = [*command, "-f", "exact_match", "--port", "0", "--workers", "1"]
    r_fd, w_fd = os.pipe()
    os.close(r_fd)  # the reader is gone before the server announces itself
    try:
        done = subprocess.run(
            [sys.executable, "-m", "fabric.cli", *args],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": root},
            stdout=w_fd,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(w_fd)
    assert done.returncode == 1, done.stderr
    assert "cannot listen" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_host_that_does_not_resolve_says_what_to_give(capsys):
    import socket

    from fabric.cli._app import listen_failed

    with pytest.raises(typer.Exit) as ei:
        listen_failed("999.1.1.1", 0, socket.gaierror(-2, "Name or service not known"))
    assert ei.value.exit_code == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "cannot listen on 999.1.1.1:0: Name or service not known; --host is neither" in said
    r = runner.invoke(app, ["integrate", "openrlhf-serve", "-f", "exact_match", "--port", "70000"])
    assert r.exit_code == 2 and "--port" in r.output and "Traceback" not in r.output, r.output


def test_serve_ctrl_c_during_the_warm_up_stops_it(tmp_path):
    """Ctrl-C (once or twice) during the start-up was ignored until the warm pools had
    started (a slow setup: minutes); then the server announced itself and stopped."""
    import signal

    (tmp_path / "slow_setup_fns.py").write_text(
        "import pathlib, time\n"
        "import fabric\n\n"
        "def _setup():\n"
        "    pathlib.Path('setup-started').touch()\n"
        "    time.sleep(30)\n"
        "    return {}\n\n"
        "@fabric.function(warm=1, setup=_setup)\n"
        "def slow_start(x: int, ctx: dict) -> int:\n"
        "    return x\n"
    )
    root = str(Path(fabric.__file__).resolve().parent.parent)
    args = ["serve", "-m", "slow_setup_fns", "-f", "slow_start", "--workers", "1", "--port", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric.cli", *args, "--token", "t" * 20],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": root},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(600):  # until the warm-up runs the setup
            if (tmp_path / "setup-started").exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert (tmp_path / "setup-started").exists()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, errors = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, errors
    assert took < 10, took  # not the setup's 30 s
    assert "stopped during start-up" in errors and out == ""  # it never served


def test_invoke_inproc_ends_once_the_call_timed_out(tmp_path):
    """The FunctionTimeout result was ready after timeout_s, but asyncio.run (and then the
    interpreter's exit) waited for the hung handler's thread: the command never ended."""
    try:
        p = _cli_process(
            ["invoke", "cli_hangs", "-m", "cli_fns", "--backend", "inproc"], tmp_path, timeout=30
        )
    except subprocess.TimeoutExpired:
        pytest.fail("fabric invoke --backend inproc did not end after the handler's 0.3 s timeout")
    assert p.returncode == 1, p.stderr[-1500:]
    assert json.loads(p.stdout)["error"]["type"] == ErrorCode.TIMEOUT


def test_run_with_an_image_that_starts_in_no_container_is_a_clean_error(monkeypatch):
    # an image that passed the job's start-up check but fails in every container: the
    # ContainerStartError out of the pool's prewarm was a raw traceback, exit 1
    pytest.importorskip("core.job")
    import core.job
    from envpool.errors import ContainerStartError

    class Job:
        def __init__(self, cfg, **kw):
            pass  # a stand-in: only its run is under test

        async def run(self):
            raise ContainerStartError("container p1-1 failed to start: RuntimeError: no licence server")

    envs = [SimpleNamespace(id="coin-v0"), SimpleNamespace(id="frozenlake-v1")]
    monkeypatch.setattr(core.job, "load", lambda *a, **kw: SimpleNamespace(envs=envs))
    monkeypatch.setattr(core.job, "Job", Job)
    r = runner.invoke(app, ["run", "job.yaml"])
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert "coin-v0, frozenlake-v1" in r.output and "RuntimeError: no licence server" in r.output


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
    r = runner.invoke(app, ["bench", "exact_match", "--payload", "{x", "--n", "10", "--json"])
    assert r.exit_code == 2 and "--payload is not valid JSON" in r.output
    r = runner.invoke(app, ["bench", "exact_match", "--payload", "[1]", "--n", "10", "--json"])
    assert r.exit_code == 2 and "--payload must be a JSON object" in r.output


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["bench", "exact_match", "--n", "0"], "error: --n must be >= 1 (got 0)"),
        (
            ["bench", "exact_match", "--concurrency", "0", "--workers", "-1"],
            "error: --concurrency must be >= 1 (got 0); --workers must be >= 1 (got -1)",
        ),
        # an infinite hold kept the bench waiting for ever
        (["bench", "exact_match", "--straggler-ms", "inf"], "--straggler-ms should be a finite number"),
        (["bench", "exact_match", "--straggler-rate", "nan"], "--straggler-rate should be a finite number"),
        (["serve", "--port", "70000"], "error: --port must be <= 65535 (got 70000)"),
        (["serve", "--workers", "0"], "error: --workers must be >= 1 (got 0)"),
        (["serve", "--max-concurrency", "0"], "error: --max-concurrency must be >= 1 (got 0)"),
    ],
)
def test_a_bad_option_value_is_one_line_naming_the_option(args, text):
    """pydantic's own text named the config model and the field, with a URL, over four lines."""
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert text in r.output and "pydantic" not in r.output and "validation error" not in r.output


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


@pytest.mark.parametrize("columns", [80, 120])
def test_help_reads_as_whole_sentences(columns):
    """typer's command list kept a docstring's line breaks: `fabric --help` broke the invoke
    row off at "2 if" and went on with "it was refused" on a line of its own."""
    paths = command_paths(typer.main.get_command(app))
    assert ["integrate", "openrlhf-serve"] in paths
    for path in paths:
        r = runner.invoke(app, [*path, "--help"], env={"COLUMNS": str(columns)})
        assert r.exit_code == 0, r.output
        assert early_breaks(r.stdout, columns) == [], (path, r.stdout)


# -- the benchmark scripts' command lines (argparse, as the fabric command's options)


@pytest.mark.parametrize(
    "script",
    ["code_verify_bench.py", "sim_vs_real.py", "sim_repro.py", "length_predictor.py", "checkpoint_save.py"],
)
def test_a_benchmark_script_prints_its_usage_on_help(script):
    """They took no arguments: `--help` ran the whole benchmark (minutes for some) and
    printed its JSON."""
    path = Path(fabric.__file__).resolve().parent.parent / "benchmarks" / script
    out = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: {script}"), out.stdout
    first_doc_line = path.read_text().split('"""')[1].splitlines()[0]
    assert first_doc_line in out.stdout
    assert not [line for line in out.stdout.splitlines() if line.startswith("{")]  # no results
    bad = subprocess.run(
        [sys.executable, str(path), "--no-such-option"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "unrecognized arguments" in bad.stderr
