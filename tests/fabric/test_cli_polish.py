"""What a user meets at the ``fabric`` command's edges: ``--version`` (of ``envpool`` too), a
server command without the ``serve`` extra, ``invoke`` against a ``fabric serve`` and the
backends it refuses, and a tenants file whose token is too short."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from cli_helpers import HERE, runner

import fabric
from envpool.cli import app as envpool_app
from fabric.cli import app

ROOT = str(Path(fabric.__file__).resolve().parent.parent)


@pytest.mark.parametrize("cli", [app, envpool_app], ids=["fabric", "envpool"])
def test_version_prints_the_package_version(cli):
    """There was no --version: "No such option: --version", exit 2."""
    r = runner.invoke(cli, ["--version"])
    assert r.exit_code == 0, r.output
    assert r.stdout == f"rl-fabric {version('rl-fabric')}\n"


# aiohttp (and prometheus_client, the serve extra's other half) made unimportable: None in
# sys.modules is what Python's import system reads as "not installed"
_WITHOUT = (
    "import sys\n"
    "sys.modules[{module!r}] = None\n"
    "sys.argv = ['fabric', *sys.argv[1:]]\n"
    "from fabric.cli import main\n"
    "main()\n"
)


@pytest.mark.parametrize("module", ["aiohttp", "prometheus_client"])
@pytest.mark.parametrize(
    "command",
    [["serve"], ["integrate", "openrlhf-serve"]],
    ids=["serve", "openrlhf-serve"],
)
def test_a_server_command_without_the_serve_extra_names_it(tmp_path, command, module):
    """Both printed a traceback ending in "ModuleNotFoundError: import of aiohttp halted"."""
    _refused_without(
        tmp_path, module, [*command, "-f", "exact_match", "--port", "0"], "pip install 'rl-fabric[serve]'"
    )


def _refused_without(tmp_path: Path, module: str, args: list[str], install: str) -> None:
    """``fabric ARGS`` with ``module``'s import blocked: one line naming it and saying
    ``install``, exit 2, no traceback, nothing on stdout."""
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT.format(module=module), *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, str(HERE)])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert install in done.stderr and module in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("module", ["ray", "torch", "matplotlib"])
def test_fabric_run_without_the_job_extras_names_them(tmp_path, module):
    """Without ray it built the images and the policy, then printed a traceback ending in
    "ModuleNotFoundError: No module named 'ray'" (a base install, `pip install -e .`)."""
    shutil.copytree(Path(ROOT, "examples", "own_env"), tmp_path / "examples" / "own_env")
    args = ["run", "examples/own_env/config.yaml", "--steps", "1"]
    _refused_without(tmp_path, module, args, "[ray,train,rewards]'")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("{token: short}", "a token must have at least 16 characters"),
        ("{token_file: missing.token}", "cannot read token_file"),
    ],
    ids=["short-token", "no-token-file"],
)
def test_a_tenants_file_token_problem_names_the_tenant_and_the_file(tmp_path, monkeypatch, body, said):
    """It said only "a token must have at least 16 characters": which of the file's tenants,
    and which file, were left to guess, where its other errors name both."""
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "tenants.yaml"
    f.write_text(f"tenants:\n  job-a: {{token: {'a' * 20}}}\n  job-b: {body}\n")
    r = runner.invoke(app, ["serve", "--tenants", str(f), "-f", "exact_match", "--port", "0"])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert f"tenants file {str(f)!r}, tenant 'job-b': {said}" in text


def test_invoke_calls_a_fabric_serve(tmp_path, monkeypatch):
    """invoke had no --endpoint-url or --token: it could not reach a `fabric serve`, and its
    lambda backend's error then told it to use a transport it had no option for."""
    monkeypatch.delenv("RL_FABRIC_TOKEN", raising=False)
    token = "t" * 20
    serve = ["serve", "-f", "exact_match", "--workers", "1", "--port", "0", "--token", token]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric.cli", *serve],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = json.loads(proc.stdout.readline())["url"]
        payload = json.dumps({"traj": "The answer is 42.", "ground_truth": "42"})
        call = ["invoke", "exact_match", "--payload", payload, "--backend", "lambda", "--endpoint-url", url]
        r = runner.invoke(app, [*call, "--token", token])
        assert r.exit_code == 0, r.output
        result = json.loads(r.stdout)
        assert result["ok"] and result["value"] == 1.0
        r = runner.invoke(app, [*call, "--token", "x" * 20, "--transport", "http"])  # a wrong token
        assert r.exit_code == 1 and json.loads(r.stdout)["error"]["type"] == "Unauthorized", r.output
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("command", ["invoke", "bench"])
@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--endpoint-url", "http://127.0.0.1:9"], "--endpoint-url is for --backend lambda"),
        (["--token", "t" * 20], "--token is for --backend lambda"),
        (["--prefix", "rl-fabric-"], "--prefix is for --backend lambda"),
        (["--transport", "http"], "--transport is for --backend lambda"),
    ],
)
def test_the_lambda_options_are_refused_with_another_backend(command, args, said):
    # bench said so of --endpoint-url only, and used none of the others
    r = runner.invoke(app, [command, "exact_match", "--backend", "local", *args])
    assert r.exit_code == 2, r.output
    assert said in " ".join(r.output.split())


@pytest.mark.parametrize("command", ["invoke", "bench"])
def test_a_bad_transport_is_named_as_its_option(command):
    """bench printed pydantic's traceback for it (after its in-process measurement)."""
    args = [command, "exact_match", "--backend", "lambda", "--endpoint-url", "http://127.0.0.1:9"]
    r = runner.invoke(app, [*args, "--transport", "carrier-pigeon"])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "--transport should be 'auto', 'boto3' or 'http' (got 'carrier-pigeon')" in text
    assert "Traceback" not in text


def test_invoke_help_names_what_each_backend_reaches():
    """Its help said "Backend: local (warm worker processes) or inproc." while lambda and modal
    were taken, and lambda had no way to be pointed at a server."""
    r = runner.invoke(app, ["invoke", "--help"], env={"COLUMNS": "200"})
    text = " ".join(r.stdout.split())
    for option in ("--endpoint-url", "--token", "--prefix", "--transport"):
        assert option in text
    assert "lambda (a `fabric serve` at --endpoint-url, or AWS)" in text and "modal" in text


def test_a_bad_region_is_said_without_a_made_up_option(monkeypatch):
    # a check of the lambda config as a whole has no key: it was printed as "-- region: ..."
    monkeypatch.setenv("AWS_REGION", "bogus")
    r = runner.invoke(app, ["invoke", "exact_match", "--backend", "lambda"])
    assert r.exit_code == 2, r.output
    assert "error: region: 'bogus' is not an AWS region name" in " ".join(r.output.split())


def test_modal_takes_a_prefix_and_refuses_the_lambda_only_options():
    # an app deployed with `fabric deploy --backend modal --prefix X` could not be invoked:
    # --prefix was refused as lambda's alone
    from fabric.backends.base import ModalConfig
    from fabric.cli._app import remote_backend

    cfg = remote_backend("modal", endpoint_url=None, token=None, prefix="team-", transport="auto")
    assert isinstance(cfg, ModalConfig) and cfg.function_prefix == "team-"
    assert remote_backend("modal", endpoint_url=None, token=None, prefix=None, transport="auto") is None
    # an app deployed with --prefix "": its names are taken as given (an empty --prefix was dropped)
    cfg = remote_backend("modal", endpoint_url=None, token=None, prefix="", transport="auto")
    assert isinstance(cfg, ModalConfig) and cfg.function_prefix == ""
    r = runner.invoke(app, ["invoke", "exact_match", "--backend", "modal", "--token", "t" * 20])
    assert r.exit_code == 2 and "--token is for --backend lambda" in " ".join(r.output.split()), r.output
    r = runner.invoke(app, ["invoke", "exact_match", "--backend", "local", "--prefix", "x-"])
    assert "--prefix is for --backend lambda or modal, not local" in " ".join(r.output.split()), r.output


def test_invoke_takes_the_region_deploy_took(monkeypatch):
    """`fabric deploy --region eu-west-1` deployed there, and `fabric invoke --backend lambda`
    had no --region: it called $AWS_REGION's (or us-east-1), where every call was
    UnknownFunction, and only an environment variable could point it elsewhere."""
    from fabric.backends.base import LambdaConfig
    from fabric.cli._app import remote_backend

    monkeypatch.setenv("AWS_REGION", "us-east-1")
    cfg = remote_backend(
        "lambda", endpoint_url=None, token=None, prefix=None, transport="auto", region="eu-west-1"
    )
    assert isinstance(cfg, LambdaConfig) and cfg.region == "eu-west-1"
    r = runner.invoke(app, ["invoke", "exact_match", "--backend", "lambda", "--region", "bogus"])
    assert r.exit_code == 2 and "--region 'bogus' is not an AWS region name" in " ".join(r.output.split()), (
        r.output
    )
    r = runner.invoke(app, ["invoke", "exact_match", "--backend", "local", "--region", "eu-west-1"])
    assert r.exit_code == 2 and "--region is for --backend lambda" in " ".join(r.output.split()), r.output


def test_bench_takes_the_region_deploy_took(monkeypatch):
    """`fabric invoke` took --region (a deploy to eu-west-1 is called there) and `fabric
    bench --backend lambda` did not: it measured $AWS_REGION's functions, or none."""
    import asyncio

    from fabric.backends.base import LambdaConfig
    from fabric.bench import BenchConfig, _run_fabric

    monkeypatch.setenv("AWS_REGION", "us-east-1")
    seen: list[LambdaConfig] = []

    class Stop(Exception):
        """Ends the bench where it builds its client: the config is all this test reads."""

    def client(*, backend, **kw):
        seen.append(backend)
        raise Stop

    monkeypatch.setattr("fabric.bench.Client", client)
    cfg = BenchConfig(function="exact_match", backend="lambda", region="eu-west-1")
    with pytest.raises(Stop):
        asyncio.run(_run_fabric(cfg, None, {}, 1, True, None, "x"))
    assert isinstance(seen[0], LambdaConfig) and seen[0].region == "eu-west-1"
    r = runner.invoke(app, ["bench", "exact_match", "--backend", "lambda", "--region", "bogus"])
    assert r.exit_code == 2 and "--region 'bogus' is not an AWS region name" in " ".join(r.output.split())
    r = runner.invoke(app, ["bench", "exact_match", "--region", "eu-west-1"])
    assert r.exit_code == 2 and "--region is for --backend lambda" in " ".join(r.output.split()), r.output


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["run", "{}"], "envs: [\n"),
        (["serve", "--tenants", "{}"], "tenants: {a: [unclosed\n"),
    ],
)
def test_a_yaml_syntax_error_is_one_line_with_its_place(tmp_path, args, text):
    """PyYAML's own text ran over four lines, named the file "<unicode string>" and pointed
    at the place with a caret under a blank line."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    r = runner.invoke(app, [a.format(bad) for a in args])
    assert r.exit_code == 2, r.output
    said = r.stderr.strip()
    assert "\n" not in said.replace("\n  ", " "), said  # run's "(1 problem):" list may indent
    assert "<unicode string>" not in said and "line 2, column 1" in said, said
    assert str(bad) in said and "not valid YAML" in said, said


@pytest.mark.parametrize("cli", ["fabric", "envpool"])
def test_a_module_that_is_not_there_says_where_it_was_looked_for(tmp_path, monkeypatch, cli):
    """`-m nosuchmod` said only "No module named 'nosuchmod'" and `-m nosuch.py` a
    FileNotFoundError with its [Errno 2]: nothing of what to do. A module that is there but
    imports one that is not keeps Python's words: the fix is in that module, not the path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "needs_more.py").write_text("import nosuchdependency\n")
    the_app = app if cli == "fabric" else envpool_app
    r = runner.invoke(the_app, ["ls", "-m", "nosuchmod"])
    said = " ".join(r.stderr.split())
    assert r.exit_code == 2 and "'nosuchmod'" in said and "PYTHONPATH" in said, said
    assert "nosuchmod.py" in said and "Traceback" not in said, said
    r = runner.invoke(the_app, ["ls", "-m", "nosuch.py"])
    said = " ".join(r.stderr.split())
    assert r.exit_code == 2 and f"no such file: {tmp_path / 'nosuch.py'}" in said, said
    assert "Errno" not in said, said
    r = runner.invoke(the_app, ["ls", "-m", "needs_more.py"])
    said = " ".join(r.stderr.split())
    assert r.exit_code == 2 and "No module named 'nosuchdependency'" in said, said
    assert "PYTHONPATH" not in said, said


def test_ctrl_c_while_the_commands_load_exits_130_without_a_traceback():
    """`fabric serve` interrupted in its first half second (its commands' imports: typer,
    rich, the command modules) printed a KeyboardInterrupt traceback from inside importlib:
    `from fabric.cli import main`, the console script's first line, imported them all."""
    code = (
        "import sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'fabric.cli.calls':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        "sys.argv = ['fabric', 'ls']\n"
        "from fabric.cli import main\n"
        "main()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(fabric.__file__).parent.parent)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 130 and "Traceback" not in done.stderr, (done.returncode, done.stderr)
