"""code-repair runs the policy's module as an unprivileged uid of its own where the env
process is root: with the ``process`` runtime (no container) the module ran as root, and
raised its own cgroup's limits, wrote root's files and could signal or trace the env process.
These tests need root (they skip elsewhere: there the module never ran as root)."""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import envpool
import envpool.envs  # registers the built-ins
from envpool.envs import code_repair_limits, code_repair_runner
from envpool.envs.code_repair import CodeRepairEnv
from envpool.envs.code_repair_user import DEFAULT_RUN_UID_BASE, RUN_UID_SPAN

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the uid is dropped only where the env process is root (euid 0)"
)

_REPO = str(Path(__file__).resolve().parents[2])


def _edit(search: str, replace: str) -> str:
    return f"edit mathutils.py\n<<<<<<< SEARCH\n{search}\n=======\n{replace}\n>>>>>>> REPLACE"


FIX = ("    return a - b", "    return a + b")


@pytest.fixture(params=[True, False], ids=["pid_namespace", "fallback"])
def pid_namespace(request, monkeypatch):
    monkeypatch.setattr(code_repair_runner, "PID_NAMESPACE", request.param)
    return request.param


@contextlib.contextmanager
def _env(tmp_path: Path, **kwargs: Any) -> Iterator[Any]:
    """An env on the mathutils task whose work dirs are under ``tmp_path/work``. (Above it,
    pytest's dirs are root's alone: the module reaches its work dir by its cwd, not by path.)"""
    work = tmp_path / "work"
    work.mkdir()
    env = envpool.make("code-repair-v1", workdir_root=str(work), test_timeout_s=10, **kwargs)
    try:
        env.reset(options={"task": "mathutils"})
        yield env
    finally:
        env.close()


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A root-owned dir that every user may search (pytest's tmp_path is under a dir of mode
    0700, which a non-root module could not reach whatever the file's own mode)."""
    path = Path(tempfile.mkdtemp(prefix="code-repair-uid-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# (a) the run's pids cgroup: its pids.max raised to "max", then forks past max_processes
_RAISE_OWN_PIDS_MAX = """
import os as _os, time as _time
for _line in open("/proc/self/cgroup").read().splitlines():
    _h, _ctl, _path = _line.split(":", 2)
    if "pids" in _ctl.split(","):
        try:
            with open(f"/sys/fs/cgroup/pids{_path}/pids.max", "w") as _f:
                _f.write("max")
            print("PIDS.MAX WRITTEN")
        except OSError as _e:
            print("PIDS.MAX REFUSED:", type(_e).__name__)
_forked = 0
for _ in range(20):
    try:
        if _os.fork() == 0:
            _time.sleep(30)
            _os._exit(0)
        _forked += 1
    except OSError:
        pass  # the pids cgroup refused the fork: counted by its absence
print("FORKED", _forked)
"""


@pytest.mark.skipif(not code_repair_limits.pids_cgroup_available(), reason="no pids cgroup can be made here")
def test_a_module_cannot_raise_its_own_process_cap(tmp_path, pid_namespace):
    # as root, the module wrote "max" into its own pids.max and forked past max_processes:
    # every test passed and no limit was reported
    with _env(tmp_path, max_processes=8) as env:
        env.step(_edit(*FIX))
        assert env.step(_edit("def add", _RAISE_OWN_PIDS_MAX + "\ndef add")).info["valid"]
        text = env.step("run_tests").obs.text
        assert "PIDS.MAX REFUSED: PermissionError" in text, text
        assert "PIDS.MAX WRITTEN" not in text, text
        assert "hit its process limit: at most 8 processes" in text, text
        forked = int(re.search(r"FORKED (\d+)", text)[1])  # type: ignore[index]
        assert forked < 8, text


# (b) a root-owned file outside the work dir
def test_a_module_cannot_write_a_root_owned_file(tmp_path, pid_namespace, open_dir):
    target = open_dir / "root-owned.txt"
    target.write_text("root's\n")
    target.chmod(0o644)
    code = (
        "try:\n"
        f"    open({str(target)!r}, 'a').write('the module was here\\n')\n"
        "    print('WROTE ROOT FILE')\n"
        "except OSError as _e:\n"
        "    print('ROOT FILE REFUSED:', type(_e).__name__)\n"
    )
    with _env(tmp_path) as env:
        env.step(_edit(*FIX))
        env.step(_edit("def add", code + "def add"))
        res = env.step("run_tests")
        assert "ROOT FILE REFUSED: PermissionError" in res.obs.text, res.obs.text
        assert target.read_text() == "root's\n"
        assert res.info["all_passed"], res.obs.text


# (c) the env process (this test's), and the run's own parent (the keeper, or the namespace's init)
def test_a_module_cannot_signal_or_trace_the_env_process(tmp_path, pid_namespace):
    me = os.getpid()
    code = (
        "import os as _os\n"
        f"for _name, _pid in (('env', {me}), ('parent', _os.getppid())):\n"
        "    try:\n"
        "        _os.kill(_pid, 0)\n"
        "        print('SIGNALLED', _name)\n"
        "    except OSError as _e:\n"
        "        print('SIGNAL REFUSED', _name, type(_e).__name__)\n"
        "try:\n"
        f"    open('/proc/{me}/mem', 'rb').close()\n"
        "    print('OPENED MEM')\n"
        "except OSError as _e:\n"
        "    print('MEM REFUSED', type(_e).__name__)\n"
    )
    with _env(tmp_path) as env:
        env.step(_edit(*FIX))
        env.step(_edit("def add", code + "def add"))
        text = env.step("run_tests").obs.text
        # (in a PID namespace the env process has no pid at all: ProcessLookupError; and none
        # in the /proc of that namespace: FileNotFoundError)
        assert re.search(r"SIGNAL REFUSED env (PermissionError|ProcessLookupError)", text), text
        assert "SIGNAL REFUSED parent PermissionError" in text, text
        assert re.search(r"MEM REFUSED (PermissionError|FileNotFoundError)", text), text
        assert "SIGNALLED" not in text and "OPENED MEM" not in text, text


def _ids_of_run(env: Any) -> list[int | list[int]]:
    """``[uid, gid, groups]`` of the module's process, through a check's value."""
    env.step(
        _edit("    return a - b", "    import os\n    return [os.getuid(), os.getgid(), os.getgroups()]")
    )
    text = env.step("run_tests").obs.text
    found = re.search(r"add\(2, 3\) returned \[(\d+), (\d+), \[([\d, ]*)\]\]", text)
    assert found, text
    groups = [int(g) for g in found[3].split(",") if g.strip()]
    return [int(found[1]), int(found[2]), groups]


# (e) the uid inside
def test_the_module_runs_as_an_unprivileged_uid_of_its_own(tmp_path, pid_namespace):
    with _env(tmp_path) as env:
        uid, gid, groups = _ids_of_run(env)
        assert uid != 0 and DEFAULT_RUN_UID_BASE <= uid < DEFAULT_RUN_UID_BASE + RUN_UID_SPAN  # type: ignore[operator]
        assert gid == uid and groups == []
        again, _, _ = _ids_of_run(env)  # a uid per run (from its keeper's pid)
        assert DEFAULT_RUN_UID_BASE <= again < DEFAULT_RUN_UID_BASE + RUN_UID_SPAN  # type: ignore[operator]


def test_a_base_of_none_runs_as_this_process_user(tmp_path):
    with _env(tmp_path, run_uid_base=None) as env:
        assert _ids_of_run(env)[0] == 0


# (d) an honest module keeps its work dir: it reads its files, writes scratch files (run after
# run, each under another uid) and keeps them
_SCRATCH = """
import os as _os, tempfile as _tempfile
with open("scratch.txt", "a") as _f:
    _f.write("run\\n")
_os.makedirs("cache", exist_ok=True)
with open("cache/entry", "w") as _f:
    _f.write("x")
with _tempfile.NamedTemporaryFile(dir=".") as _t:
    _t.write(b"tmp")
print("SCRATCH", open("scratch.txt").read().count("run"), open("README.md").read()[:1])
"""


def test_an_honest_module_writes_its_work_dir_run_after_run(open_dir, pid_namespace):
    # (under a root every user may search: tempfile names its file by absolute path)
    with _env(open_dir) as env:
        env.step(_edit(*FIX))
        env.step(_edit("def add", _SCRATCH + "\ndef add"))
        for n in (1, 2, 3):
            res = env.step("run_tests")
            assert res.info["all_passed"], res.obs.text
            assert f"SCRATCH {n} #" in res.obs.text, res.obs.text
        assert (env.env.workdir / "scratch.txt").read_text() == "run\n" * 3
        assert env.step("submit").reward == 1.0


def test_a_hard_link_out_is_never_handed_to_the_run(tmp_path, open_dir):
    # the work dir is handed to the run's uid before each run: a file with another link (to
    # one outside, made while a module ran as root, or where the kernel allows links to
    # others' files) stays whose it was
    outside = open_dir / "outside.txt"
    outside.write_text("root's\n")
    with _env(tmp_path) as env:
        os.link(outside, env.env.workdir / "link.txt")
        env.step(_edit(*FIX))
        assert env.step("run_tests").info["all_passed"]
        assert outside.stat().st_uid == 0


@pytest.mark.parametrize("base", [-1, 0, 999, 2**31 - 10, 1.5, True, "1900000000"])
def test_a_bad_run_uid_base_is_refused(base):
    with pytest.raises(ValueError, match="run_uid_base"):
        CodeRepairEnv(run_uid_base=base)


def test_a_run_uid_base_whose_uids_hold_a_real_user_or_group_is_refused():
    # in range, yet runs would take uids and gids of the host's users: `nobody` (65534) is
    # on every host; a range from a real user's uid names that user
    with pytest.raises(ValueError, match=r"hold .*'nobody'.*pick a base above every uid and gid in use"):
        CodeRepairEnv(run_uid_base=60_000)
    user = pwd.getpwuid(os.getuid())
    if user.pw_uid >= 1000:  # (root's 0 is below any base)
        with pytest.raises(ValueError, match=f"user {user.pw_name!r}"):
            CodeRepairEnv(run_uid_base=user.pw_uid)
    # a base whose span holds no id in use passes: the default, and one just past nobody
    assert CodeRepairEnv(run_uid_base=DEFAULT_RUN_UID_BASE).run_uid_base == DEFAULT_RUN_UID_BASE
    past = max([u.pw_uid for u in pwd.getpwall()] + [g.gr_gid for g in grp.getgrall()]) + 1
    if past <= 2**31 - RUN_UID_SPAN:
        assert CodeRepairEnv(run_uid_base=past).run_uid_base == past


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_root_that_cannot_setuid_refuses_to_run_the_module(tmp_path):
    # root without CAP_SETUID (a container's capabilities trimmed): never the module as root
    script = (
        "import envpool, envpool.envs\n"
        "from envpool.errors import EnvUsageError\n"
        f"env = envpool.make('code-repair-v1', workdir_root={str(tmp_path)!r})\n"
        "env.reset(options={'task': 'mathutils'})\n"
        "try:\n"
        "    env.step('run_tests')\n"
        "except EnvUsageError as e:\n"
        "    print('REFUSED:', e)\n"
        "else:\n"
        "    print('RAN')\n"
        "env.close()\n"
    )
    out = subprocess.run(
        [
            "setpriv",
            "--bounding-set",
            "-setuid,-setgid",
            "--inh-caps",
            "-setuid,-setgid",
            sys.executable,
            "-c",
            script,
        ],
        env={**os.environ, "PYTHONPATH": _REPO},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "REFUSED:" in out.stdout and "run_uid_base" in out.stdout, out.stdout + out.stderr
