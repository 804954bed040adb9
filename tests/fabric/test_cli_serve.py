"""``fabric serve`` (and ``integrate openrlhf-serve``) as a command: an unknown function,
--body-timeout-s, Ctrl-C (a drain, then a stop; during the warm-up), a closed stdout and a
host that does not resolve, the connection options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from cli_helpers import HERE, runner

import fabric
from fabric.cli import app


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
            assert proc.wait(30) == 130  # as fabric run and fabric bench exit on Ctrl-C
            assert time.monotonic() - t0 < 20
            assert s.recv(4096) == b""  # no answer: the connection dropped (the client retries)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert "stopping now: 1 call cancelled" in log.read_text()


@pytest.mark.parametrize(("sig", "status"), [("SIGINT", 130), ("SIGTERM", 0)])
@pytest.mark.parametrize("command", [["serve"], ["integrate", "openrlhf-serve"]])
def test_a_server_stopped_by_ctrl_c_exits_130_and_by_sigterm_0(tmp_path, command, sig, status):
    """The servers drained and exited 0 on Ctrl-C, where fabric run and fabric bench exit
    130: a script could not tell an interrupted server from one that ended by itself. SIGTERM
    (a supervisor's stop: systemd, Kubernetes) is a server's normal end: 0, which systemd
    counts a clean stop (it would count 130 or 143 a failure)."""
    import signal

    root = str(Path(fabric.__file__).resolve().parent.parent)
    args = [*command, "-f", "exact_match", "--port", "0", "--workers", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric.cli", *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": root},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert "url" in json.loads(proc.stdout.readline())  # serving
        proc.send_signal(getattr(signal, sig))
        _, errors = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == status, errors
    assert "Traceback" not in errors, errors


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
    assert proc.returncode == 130, errors
    assert took < 10, took  # not the setup's 30 s
    assert "stopped during start-up" in errors and out == ""  # it never served


def test_serve_connection_options_reach_the_servers_config(monkeypatch):
    """--max-connections and --keepalive-s: the server's bounds on its connections had no
    option (a tenants file could set max_connections; keepalive_s only code)."""
    seen = []

    class Stop(fabric.FabricError):
        """Raised where the server would start: the command ends there, exit 2."""

    def gateway(cfg, reg):
        seen.append(cfg)
        raise Stop("stop before serving")

    monkeypatch.setattr("fabric.serve.Gateway", gateway)
    args = ["serve", "-f", "exact_match", "--port", "0", "--token", "t" * 20]
    r = runner.invoke(app, [*args, "--max-connections", "3", "--keepalive-s", "5"])
    assert r.exit_code == 2 and "stop before serving" in r.output, r.output
    cfg = seen.pop()
    assert cfg.keepalive_s == 5 and cfg.tenants["default"].max_connections == 3
    runner.invoke(app, args)
    cfg = seen.pop()  # the defaults: 75 s, twice the tenant's 64 calls
    assert cfg.keepalive_s == 75 and cfg.tenants["default"].connection_limit == 128


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--max-connections", "0"], "--max-connections must be >= 1 (got 0)"),
        (["--keepalive-s", "0"], "--keepalive-s must be > 0"),
        (["--keepalive-s", "nan"], "--keepalive-s must be > 0"),
        (["--max-connections", "3", "--tenants", "tenants.yaml"], "give each tenant its max_connections"),
    ],
)
def test_bad_connection_options_are_refused_naming_the_option(extra, said):
    r = runner.invoke(app, ["serve", "-f", "exact_match", "--port", "0", *extra])
    assert r.exit_code == 2 and said in " ".join(r.output.split()), r.output


def test_openrlhf_serve_on_a_port_in_use_says_it_once():
    """asyncio's bind error carries its own sentence as strerror: the message read "cannot
    listen on 127.0.0.1:P: error while attempting to bind on address ('127.0.0.1', P):
    address already in use; another process listens there ..."."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        port = s.getsockname()[1]
        r = runner.invoke(app, ["integrate", "openrlhf-serve", "-f", "exact_match", "--port", str(port)])
    finally:
        s.close()
    said = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use; another process" in said, said
    assert "attempting to bind" not in said, said


def test_a_token_file_that_cannot_be_read_is_named_as_the_option(tmp_path):
    """It was named as a tenants file's key: "cannot read token_file '...'"."""
    missing = tmp_path / "no-token"
    r = runner.invoke(app, ["serve", "-f", "exact_match", "--token-file", str(missing)])
    said = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert f"--token-file {missing}: cannot read it: No such file or directory" in said, said


def test_openrlhf_serve_of_an_unknown_function_says_how_yours_registers():
    """fabric serve -f and fabric deploy -f say how a function of your own is found; this
    said only "unknown function 'nope'; known functions: ..."."""
    r = runner.invoke(app, ["integrate", "openrlhf-serve", "-f", "nope", "--port", "0"])
    said = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert "--function: unknown function 'nope'" in said and "-m MODULE" in said, said
