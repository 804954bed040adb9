"""The ``envpool`` command (real containers for the benchmarks, kept small)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from help_pages import command_paths, early_breaks
from typer.testing import CliRunner

import envpool
from envpool.cli import app

runner = CliRunner()


def test_ls_lists_the_builtins():
    r = runner.invoke(app, ["ls", "--json"])
    assert r.exit_code == 0, r.output
    ids = {s["id"] for s in json.loads(r.stdout)}
    assert {"frozenlake-v1", "math-tools-v1", "code-repair-v1", "echo-v0"} <= ids
    r = runner.invoke(app, ["ls"])
    assert r.exit_code == 0 and "frozenlake-v1" in r.stdout


def test_ls_with_a_bad_module_is_a_clear_error():
    r = runner.invoke(app, ["ls", "-m", "no_such_module_xyz"])
    assert r.exit_code == 2 and "no_such_module_xyz" in r.output


def test_ls_with_a_module_that_exits_at_import_is_a_clear_error(tmp_path):
    """A script's sys.exit(3) outside its ``if __name__ == "__main__":`` ended ``envpool ls``
    with exit 3 and no word of why (``fabric ls`` names it)."""
    script = tmp_path / "exits_at_import.py"
    script.write_text("import sys\nsys.exit(3)\n")
    r = runner.invoke(app, ["ls", "-m", str(script)])
    assert r.exit_code == 2, r.output
    assert f"cannot import {str(script)!r}: it called sys.exit(3) as it was imported" in r.stderr


def test_ls_finds_a_module_in_the_current_directory_and_a_file(tmp_path, monkeypatch):
    """`envpool ls -m guess_env` next to guess_env.py: the installed `envpool` script has
    no current directory on sys.path (`python -m envpool.cli` has), and the import failed
    where `fabric ls -m` found the module. A file.py is taken too, as fabric's -m takes it."""
    from envpool.api import default_registry

    # what the two modules register is gone after the test: the registry's table is a copy
    # until then (builtins loaded first). A delitem of the ids (absent before the test)
    # undid nothing, and test_check_env.py, run after this module on the same pytest worker,
    # found the default registry two environments larger than a fresh interpreter's
    default_registry.ids()
    monkeypatch.setattr(default_registry, "_specs", dict(default_registry._specs))
    for stem in ("cwd_envs", "file_envs"):
        env_id = f"{stem.replace('_', '-')}-v0"
        (tmp_path / f"{stem}.py").write_text(
            f"import envpool\n\nenvpool.register({env_id!r}, entry_point='{stem}:Nothing')\n"
        )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cwd_envs", raising=False)
    r = runner.invoke(app, ["ls", "--json", "-m", "cwd_envs", "-m", str(tmp_path / "file_envs.py")])
    assert r.exit_code == 0, r.output
    assert {"cwd-envs-v0", "file-envs-v0"} <= {s["id"] for s in json.loads(r.stdout)}


def test_ls_json_stays_parseable_when_a_module_prints(tmp_path, monkeypatch):
    """A module's import-time print came out on stdout before the JSON."""
    (tmp_path / "chatty_envs.py").write_text('print("chatty_envs: imported")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "chatty_envs", raising=False)
    r = runner.invoke(app, ["ls", "--json", "-m", "chatty_envs"])
    assert r.exit_code == 0, r.output
    assert "echo-v0" in {s["id"] for s in json.loads(r.stdout)}
    assert "chatty_envs: imported" in r.stderr


def test_bench_resets_accounts_for_every_reset():
    args = ["bench", "resets", "--n", "150", "--concurrency", "4", "--crash-rate", "0.05"]
    r = runner.invoke(app, [*args, "--fetch-error-rate", "0.2", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["accounted"] and out["ok"] + out["infra_failed"] == 150
    assert out["container_crashes"] > 0 and out["success_rate"] >= 0.95


def test_bench_latency_reports_claim_and_step_figures():
    r = runner.invoke(app, ["bench", "latency", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert 0 < out["warm_claim_p50_ms"] and 0 < out["step_rtt_p50_ms"] and out["direct_step_p50_ms"] > 0


def test_bench_cold_image_compares_both_ways():
    args = ["bench", "cold-image", "--sessions", "4", "--size-mb", "0.5", "--bandwidth-mbps", "20"]
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["tiered"]["origin_gets"] == 1 and out["own_fetch"]["origin_gets"] == 4


@pytest.mark.parametrize("size", ["inf", "1e12", "nan"])
def test_bench_cold_image_refuses_a_size_it_cannot_build(size):
    """--size-mb inf or 1e12 was an OverflowError traceback (exit 1)."""
    r = runner.invoke(app, ["bench", "cold-image", "--sessions", "1", "--size-mb", size])
    assert r.exit_code == 2 and "--size-mb" in r.output and r.exception is not None, r.output
    assert not isinstance(r.exception, OverflowError)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_bench_stopped_by_a_signal_removes_its_temp_dirs(tmp_path, sig):
    # Ctrl-C skipped the bundle dir's removal; SIGTERM killed the process on the spot (exit
    # -15), leaving it and the runtime's container dirs
    root = Path(envpool.__file__).resolve().parents[1]
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(root)}
    args = ["bench", "resets", "--n", "1000000", "--concurrency", "2", "--json"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "envpool.cli", *args],
        env=env,
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        # running: its bundle dir and a container's dir (N, in the runtime's root) exist
        while not (list(tmp_path.glob("envpool-bench-*")) and list(tmp_path.glob("envpool-p*/[0-9]*"))):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
            time.sleep(0.02)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr.decode()[-2000:]  # as Ctrl-C: stopped, not killed
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("columns", [80, 120])
def test_help_reads_as_whole_sentences(columns):
    """typer's command list kept a docstring's line breaks: `envpool bench --help` broke the
    cold-image row off at "every container" and went on on a line of its own."""
    paths = command_paths(typer.main.get_command(app))
    assert ["bench", "cold-image"] in paths
    for path in paths:
        r = runner.invoke(app, [*path, "--help"], env={"COLUMNS": str(columns)})
        assert r.exit_code == 0, r.output
        assert early_breaks(r.stdout, columns) == [], (path, r.stdout)


def test_every_command_help_shows_an_example_and_explains_each_option():
    """No help page had an example, and the options of `bench resets` and --sessions had no
    words at all."""
    root = typer.main.get_command(app)
    for path in command_paths(root):
        command = root
        for name in path:
            command = command.commands[name]  # type: ignore[attr-defined]
        if getattr(command, "commands", None):
            continue
        r = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        assert f"Example: envpool {' '.join(path)}" in r.stdout, (path, r.stdout)
        bare = [p.name for p in command.params if not getattr(p, "help", None) and p.name != "help"]
        assert bare == [], (path, bare)


def test_bench_cold_image_builds_the_largest_image_it_takes(tmp_path):
    """--size-mb 256 or more (the option takes up to 1024) was an OverflowError traceback:
    Random.randbytes takes fewer than 2**31 bits at once."""
    from envpool.bench import _write_weights

    path = tmp_path / "weights.bin"
    _write_weights(path, 2**28 + 3)
    assert path.stat().st_size == 2**28 + 3
    with path.open("rb") as f:  # the same bytes as before for a size that worked
        assert f.read(4096) == random.Random(0).randbytes(2**27)[:4096]


def test_bench_cold_image_reports_its_progress():
    """It showed nothing for its whole run (64 sessions of 8 MiB, twice, at 40 MB/s: tens of
    seconds) where resets shows a bar: it reports each session of both storms now."""
    import asyncio

    from envpool.bench import cold_image

    seen: list[tuple[str, int, int]] = []
    asyncio.run(cold_image(2, 0.05, 50, progress=lambda *a: seen.append(a)))
    assert seen[-1] == ("own fetch", 2, 2) and ("tiered", 2, 2) in seen, seen
