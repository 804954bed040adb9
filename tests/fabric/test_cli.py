"""The ``fabric`` command, through typer's runner (the local backend spawns real workers):
``ls``, finding the user's modules, user code's prints kept off stdout, ``invoke`` and its
errors, ``run``'s errors, option values, the help pages and the benchmark scripts' usage.
``fabric serve`` is in test_cli_serve.py, ``fabric bench`` in test_cli_bench.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from cli_helpers import HERE, runner
from help_pages import command_paths, early_breaks

import fabric
from fabric.cli import app
from fabric.errors import ErrorCode


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


def test_a_module_of_no_functions_is_said(tmp_path):
    """``-m my.py`` whose function lacks its decorator: ``ls`` listed the built-ins alone and
    ``invoke``/``bench`` answered "unknown function", with no word that the module gave none."""
    mine = tmp_path / "undecorated_fns.py"
    mine.write_text("def my_reward(traj: str) -> float:\n    return 1.0\n")
    r = runner.invoke(app, ["ls", "--json", "-m", str(mine)])
    assert r.exit_code == 0, r.output
    assert "exact_match" in {s["name"] for s in json.loads(r.stdout)}  # stdout stays JSON
    assert f"warning: {str(mine)!r} defines no fabric function" in r.stderr
    assert "@fabric.reward" in r.stderr
    r = runner.invoke(app, ["ls", "--json", "-m", "sample_fns"])
    assert r.exit_code == 0 and "warning" not in r.stderr


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


def test_invoke_reads_a_payload_from_a_file_or_stdin(tmp_path):
    # an argument is at most 128 KiB on Linux: a long trajectory could not be sent at all
    traj = "x " * 100_000 + "The answer is 42."
    path = tmp_path / "payload.json"
    path.write_text(json.dumps({"traj": traj, "ground_truth": "42"}))
    r = runner.invoke(app, ["invoke", "exact_match", "--backend", "inproc", "--payload", f"@{path}"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["value"] == 1.0
    r = runner.invoke(
        app,
        ["invoke", "exact_match", "--backend", "inproc", "--payload", "@-"],
        input='{"traj": "The answer is 7.", "ground_truth": "8"}',
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["value"] == 0.0
    r = runner.invoke(app, ["invoke", "exact_match", "--payload", f"@{tmp_path / 'missing.json'}"])
    assert r.exit_code == 2 and "--payload @" in r.stderr and "cannot read it" in r.stderr, r.output
    # once: the path was said again in OSError's own text ("[Errno 2] ...: '/tmp/.../missing.json'")
    assert "cannot read it: No such file or directory\n" in r.stderr and "Errno" not in r.stderr, r.stderr
    path.write_text("[1, 2]")
    r = runner.invoke(app, ["invoke", "exact_match", "--payload", f"@{path}"])
    assert r.exit_code == 2 and "must be a JSON object" in r.stderr, r.output


@pytest.mark.parametrize(
    ("args", "code", "text"),
    [
        # bad input exits 2, whether the CLI or the client refuses it; a failed call exits 1
        (["invoke", "exact_matc", "--payload", "{}"], 2, "env_return, exact_match, format_reward"),
        (["invoke", "exact_matc", "--payload", "{}"], 2, "did you mean 'exact_match'?"),
        (["invoke", "exact_match", "--payload", "{not json"], 2, "--payload is not valid JSON"),
        (["invoke", "exact_match", "--payload", '{"traj": NaN}'], 2, "NaN is not JSON"),
        (["invoke", "exact_match", "--payload", "[1]"], 2, "JSON object"),
        # past Python's recursion limit: the parser's RecursionError was a traceback, exit 1
        (["invoke", "exact_match", "--payload", "[" * 100_000], 2, "--payload is nested too deeply"),
        (
            ["integrate", "openrlhf-serve", "-f", "exact_match", "--constant", "x=" + "[" * 100_000],
            2,
            "--constant x: the value is nested too deeply",
        ),
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
        # named as the integration config's keys ("deadline_s", "max_workers") or a backend
        # config's, not as the options given
        (
            ["integrate", "openrlhf-serve", "-f", "exact_match", "--workers", "0"],
            "error: --workers must be >= 1 (got 0)",
        ),
        (
            ["integrate", "openrlhf-serve", "-f", "exact_match", "--deadline-s", "0"],
            "error: --deadline-s must be > 0 (got 0)",
        ),
        # named as the config's key, beside the config file's name, as if the file said so
        (["run", "no-such-job.yaml", "--steps", "0"], "error: --steps must be >= 1 (got 0)"),
        (
            ["integrate", "openrlhf-serve", "-f", "exact_match", "--backend", "locl"],
            "error: --backend must be local, inproc, lambda or modal, got 'locl'",
        ),
    ],
)
def test_a_bad_option_value_is_one_line_naming_the_option(args, text):
    """pydantic's own text named the config model and the field, with a URL, over four lines."""
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert text in r.output and "pydantic" not in r.output and "validation error" not in r.output


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


def test_every_command_help_shows_an_example_and_explains_each_parameter():
    """No help page had an example, and `fabric ls --json` and the NAME of invoke and bench
    had no words at all: a new user had to guess a first command line."""
    root = typer.main.get_command(app)
    for path in command_paths(root):
        command = root
        for name in path:
            command = command.commands[name]  # type: ignore[attr-defined]
        if getattr(command, "commands", None):  # a group: its commands show theirs
            continue
        r = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        assert f"Example: fabric {' '.join(path)} " in r.stdout, (path, r.stdout)
        bare = [p.name for p in command.params if not getattr(p, "help", None) and p.name != "help"]
        assert bare == [], (path, bare)
