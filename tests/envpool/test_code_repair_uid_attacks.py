"""Attacks on code-repair's uid drop (where the env process is root the policy's module runs as
a uid of the run's own: ``envpool.envs.code_repair_user``), each as the policy's module would
make it. Those that the drop stops stay as guards. These tests need root (they skip elsewhere:
there the module never runs as another uid)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import envpool
import envpool.envs  # registers the built-ins
from envpool.envs import code_repair_runner
from envpool.envs.code_repair_user import remove_tree

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the uid is dropped only where the env process is root (euid 0)"
)

FIX = ("    return a - b", "    return a + b")


def _edit(search: str, replace: str) -> str:
    return f"edit mathutils.py\n<<<<<<< SEARCH\n{search}\n=======\n{replace}\n>>>>>>> REPLACE"


@pytest.fixture(params=[True, False], ids=["pid_namespace", "fallback"])
def pid_namespace(request, monkeypatch):
    monkeypatch.setattr(code_repair_runner, "PID_NAMESPACE", request.param)
    return request.param


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A root-owned dir that every user may search."""
    path = Path(tempfile.mkdtemp(prefix="code-repair-attack-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        remove_tree(path)  # (however deep the module's tree: shutil.rmtree recurses)


@contextlib.contextmanager
def _env(root: Path, **kwargs: Any) -> Iterator[Any]:
    work = root / "work"
    work.mkdir()
    work.chmod(0o755)
    env = envpool.make("code-repair-v1", workdir_root=str(work), test_timeout_s=10, **kwargs)
    try:
        env.reset(options={"task": "mathutils"})
        yield env
    finally:
        env.close()


def _run_module(env: Any, code: str) -> str:
    """The run's output, with ``code`` run at the module's import (the bug fixed)."""
    env.step(_edit(*FIX))
    assert env.step(_edit("def add", code + "\ndef add")).info["valid"]
    return env.step("run_tests").obs.text


def _barrier_child(path: str) -> Path | None:
    """Under the highest dir above ``path`` that other users may not search (/root, 0700), the
    dir on ``path``'s way: what '..' from ``path`` reaches at most, should the run hold it."""
    parts = Path(os.path.realpath(path)).parts
    for i in range(1, len(parts) - 1):
        here = Path(*parts[: i + 1])
        if not here.stat().st_mode & stat.S_IXOTH:
            return Path(*parts[: i + 2])
    return None


# the interpreter's library, where a dir above it is root's alone (a pyenv under /root), is
# reached through what the runner holds: from there, '..' must reach nothing else of that dir
_CLIMB = """
import hashlib as _hashlib, json as _json, os as _os, sys as _sys
_seen = set()
_starts = [p for p in _sys.path if type(p) is str and p]
_starts += ["/proc/self/fd/" + _n for _n in _os.listdir("/proc/self/fd")]
for _start in _starts:
    _p = _start
    for _ in range(10):
        _p += "/.."
        try:
            _names = "/".join(sorted(_os.listdir(_p))).encode()
            _seen.add(_hashlib.sha256(_names).hexdigest()[:16])  # (the output is cut at 4000)
        except OSError:
            pass  # not listable from there: nothing seen at this level
print("SEEN " + _json.dumps(sorted(_seen)))
"""


@pytest.mark.skipif(
    _barrier_child(sysconfig.get_paths()["stdlib"]) is None,
    reason="the interpreter's library lies under no dir that only root may search",
)
def test_the_library_reached_through_the_runner_leads_no_further(open_dir, pid_namespace):
    hidden = _barrier_child(sysconfig.get_paths()["stdlib"])
    assert hidden is not None
    secret = hashlib.sha256("/".join(sorted(os.listdir(hidden))).encode()).hexdigest()[:16]
    with _env(open_dir) as env:
        text = _run_module(env, _CLIMB)
        seen = json.loads(re.search(r"SEEN (.*)", text)[1])  # type: ignore[index]
        assert env.step("run_tests").info["all_passed"]
    assert secret not in seen, f"the module listed {hidden}, under a dir of root's alone"


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
@pytest.mark.skipif(
    _barrier_child(sysconfig.get_paths()["stdlib"]) is None,
    reason="the interpreter's library lies under no dir that only root may search",
)
def test_root_without_mounts_refuses_rather_than_lend_the_library_by_fd(open_dir):
    # root with CAP_SETUID but not CAP_SYS_ADMIN (a trimmed container): no mount namespace to
    # lend the library in, which an fd would have lent with all that '..' reaches from it
    work = open_dir / "work"
    work.mkdir()
    work.chmod(0o755)
    script = (
        "import envpool, envpool.envs\n"
        "from envpool.errors import EnvUsageError\n"
        f"env = envpool.make('code-repair-v1', workdir_root={str(work)!r})\n"
        "env.reset(options={'task': 'mathutils'})\n"
        "try:\n"
        "    print('RAN', env.step('run_tests').obs.text)\n"
        "except EnvUsageError as e:\n"
        "    print('REFUSED:', e)\n"
        "env.close()\n"
    )
    out = subprocess.run(
        ["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin", sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "REFUSED:" in out.stdout and "install Python where every user may read it" in out.stdout, (
        out.stdout + out.stderr
    )


def _uids_alive(uid: int) -> list[int]:
    """The live processes of ``uid`` (not zombies: dead, they wait for a reaper, here maybe a
    pid 1 that reaps late)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                state = Path(f"/proc/{entry.name}/stat").read_bytes().rpartition(b")")[2].split()[0]
                if os.stat(f"/proc/{entry.name}").st_uid == uid and state not in (b"Z", b"X"):
                    found.append(int(entry.name))
    return found


# what the run leaves alive could race the next run's hand_over (the walk of its work dir,
# as root) or, once its keeper's pid (its uid) is reused, share a later run's uid
_DAEMON = """
import os as _os, time as _time
if _os.fork() == 0:
    _os.setsid()
    if _os.fork() == 0:
        _os.chdir("/")
        _time.sleep(60)
    _os._exit(0)
_time.sleep(0.2)
print("UID", _os.getuid())
"""


def test_nothing_of_a_run_outlives_it(open_dir, pid_namespace):
    with _env(open_dir) as env:
        text = _run_module(env, _DAEMON)
        uid = int(re.search(r"UID (\d+)", text)[1])  # type: ignore[index]
        assert uid != 0
        deadline = time.monotonic() + 5  # (a SIGKILL-ed process takes a moment to end)
        while (alive := _uids_alive(uid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive == [], f"processes of the run's uid {uid} outlived it"


def test_a_run_keeps_no_setuid_bit_for_the_next(open_dir, pid_namespace):
    # a setuid program of the run's own: the next run (another uid) could take the first's uid
    # by it, and with it whatever that uid still owns
    code = (
        "import os as _os, shutil as _shutil\n"
        "if not _os.path.exists('su'):\n"
        "    _shutil.copy('/bin/true', 'su')\n"
        "    _os.chmod('su', 0o6755)\n"
        "    _os.mkdir('sgid')\n"
        "    _os.chmod('sgid', 0o2777)\n"
    )
    with _env(open_dir) as env:
        _run_module(env, code)
        first = (env.env.workdir / "su").stat()
        assert first.st_mode & stat.S_ISUID  # (the run made it so)
        env.step("run_tests")  # handed to the next run's uid
        st = (env.env.workdir / "su").stat()
        assert st.st_uid != first.st_uid and not st.st_mode & (stat.S_ISUID | stat.S_ISGID), oct(st.st_mode)
        # (a setgid dir stays so: it gives what is made in it the dir's group, now the new run's)
        st = (env.env.workdir / "sgid").stat()
        assert st.st_uid == st.st_gid == (env.env.workdir / "su").stat().st_uid


def test_links_and_fifos_left_in_the_work_dir_are_never_followed(open_dir, pid_namespace):
    # the next run's hand_over walks the work dir as root: a symlink out, a fifo (an open of
    # which would block) and a symlinked dir stay as they are, what they point at untouched
    target = open_dir / "target"
    target.mkdir()
    (target / "f").write_text("root's\n")
    code = (
        "import os as _os\n"
        "if not _os.path.lexists('out'):\n"
        f"    _os.symlink({str(target / 'f')!r}, 'out')\n"
        f"    _os.symlink({str(target)!r}, 'outdir')\n"
        "    _os.mkfifo('fifo')\n"
    )
    with _env(open_dir) as env:
        _run_module(env, code)
        res = env.step("run_tests")
        assert res.info["all_passed"], res.obs.text
        assert (env.env.workdir / "fifo").is_fifo()
    assert target.stat().st_uid == 0 and (target / "f").stat().st_uid == 0
    assert stat.S_IMODE((target / "f").stat().st_mode) == 0o644


# a hard link out, which a module makes where fs.protected_hardlinks is 0 (or to a file of
# root's it may read and write): viewed and edited as root, by path, after the run
def test_a_module_cannot_hard_link_a_root_only_file(open_dir, pid_namespace):
    secret = open_dir / "secret"
    secret.write_text("root's secret\n")
    secret.chmod(0o600)
    code = (
        "import os as _os\n"
        "try:\n"
        f"    _os.link({str(secret)!r}, 'notes.txt')\n"
        "    print('LINKED')\n"
        "except OSError as _e:\n"
        "    print('LINK REFUSED', type(_e).__name__)\n"
    )
    with _env(open_dir) as env:
        text = _run_module(env, code)
        if Path("/proc/sys/fs/protected_hardlinks").read_text().strip() != "0":
            assert "LINK REFUSED PermissionError" in text, text
        view = env.step("view notes.txt")
        assert "root's secret" not in view.obs.text, view.obs.text


def test_a_hard_link_out_is_neither_viewed_nor_edited(open_dir):
    # as a module where fs.protected_hardlinks is 0 would leave it (made here by the test)
    secret = open_dir / "secret"
    secret.write_text("root's secret\n")
    secret.chmod(0o600)
    with _env(open_dir) as env:
        os.link(secret, env.env.workdir / "notes.txt")
        view = env.step("view notes.txt")
        assert "root's secret" not in view.obs.text and not view.info["valid"], view.obs.text
        edit = env.step("edit notes.txt\n<<<<<<< SEARCH\nroot's\n=======\nthe policy's\n>>>>>>> REPLACE")
        assert not edit.info["valid"], edit.obs.text
    assert secret.read_text() == "root's secret\n"


# the work dir between runs: its files were the last run's uid's, and that uid comes back to a
# later run (of any env) whose first process gets the same pid: it must not reach them then
def test_a_later_process_of_a_run_uid_cannot_reach_the_work_dir(open_dir, pid_namespace):
    with _env(open_dir) as env:
        text = _run_module(env, 'import os as _os\nprint("UID", _os.getuid())\n')
        uid = int(re.search(r"UID (\d+)", text)[1])  # type: ignore[index]
        workdir = env.env.workdir
        out = subprocess.run(
            ["/bin/sh", "-c", f"ls {workdir} && echo planted > {workdir}/mathutils.py && echo REACHED"],
            user=uid,
            group=uid,
            extra_groups=[],
            cwd="/",
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert "REACHED" not in out.stdout, out.stdout + out.stderr
        assert "planted" not in (workdir / "mathutils.py").read_text()
        assert env.step("run_tests").info["all_passed"]  # (handed to the next run all the same)


# a tree deeper than the walk's recursion: the next run's hand_over raised RecursionError (the
# step an infra failure, run after run); and the env's close too
_DEEP = """
import os as _os
if not _os.path.exists("d"):
    _fd = _os.open(".", _os.O_RDONLY)
    for _ in range(3000):
        _os.mkdir("d", dir_fd=_fd)
        _next = _os.open("d", _os.O_RDONLY, dir_fd=_fd)
        _os.close(_fd)
        _fd = _next
"""


def test_a_very_deep_tree_does_not_break_later_runs(open_dir):
    with _env(open_dir) as env:
        _run_module(env, _DEEP)
        res = env.step("run_tests")
        assert res.info["all_passed"], res.obs.text
        assert env.step("submit").reward == 1.0
        workdir = env.env.workdir
    assert not workdir.exists()  # (removed at close, however deep)


def test_removing_a_work_dir_follows_no_symlink(open_dir):
    outside = open_dir / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "f").write_text("kept")
    tree = open_dir / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "f").write_text("x")
    (tree / "a" / "out").symlink_to(outside)
    (tree / "a" / "b" / "outfile").symlink_to(outside / "sub" / "f")
    remove_tree(tree)
    assert not tree.exists() and (outside / "sub" / "f").read_text() == "kept"


def test_a_work_dir_opened_to_all_is_closed_again_after_the_run(open_dir, pid_namespace):
    # chmod 0777 of its own work dir (or an ACL entry, which the 0700 masks): between runs no
    # uid but root's enters it, whatever the last run made of its mode
    with _env(open_dir) as env:
        _run_module(env, 'import os as _os\n_os.chmod(".", 0o777)\n')
        st = env.env.workdir.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_root_of_a_user_namespace_without_the_uid_refuses(open_dir):
    # root inside a user namespace whose map holds root alone (rootless containers map a few
    # thousand ids): the run's uid is not in it, and the run refuses rather than run as root
    work = open_dir / "work"
    work.mkdir()
    work.chmod(0o755)
    script = (
        "import envpool, envpool.envs\n"
        "from envpool.errors import EnvUsageError\n"
        f"env = envpool.make('code-repair-v1', workdir_root={str(work)!r})\n"
        "env.reset(options={'task': 'mathutils'})\n"
        "try:\n"
        "    print('RAN', env.step('run_tests').obs.text)\n"
        "except EnvUsageError as e:\n"
        "    print('REFUSED:', e)\n"
        "env.close()\n"
    )
    out = subprocess.run(
        ["unshare", "--user", "--map-root-user", sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "unshare failed" in out.stderr:
        pytest.skip(f"no user namespace here: {out.stderr.strip()}")
    assert "REFUSED:" in out.stdout and "run_uid_base" in out.stdout, out.stdout + out.stderr


def test_a_module_cannot_read_root_processes_environ_fds_or_cwd(open_dir, pid_namespace):
    # /proc is not remounted for a run: the env process (and the run's keeper) are there by
    # their outer pids, and only their command lines may be read (the limit written down)
    me = os.getpid()
    code = (
        "import os as _os\n"
        f"for _pid in ({me}, _os.getppid()):\n"
        "    for _what, _f in (('environ', lambda p: open(f'/proc/{p}/environ', 'rb').read()),\n"
        "                      ('fd', lambda p: _os.listdir(f'/proc/{p}/fd')),\n"
        "                      ('cwd', lambda p: _os.readlink(f'/proc/{p}/cwd')),\n"
        "                      ('maps', lambda p: open(f'/proc/{p}/maps').read())):\n"
        "        try:\n"
        "            _f(_pid)\n"
        "            print('READ', _what, _pid)\n"
        "        except OSError as _e:\n"
        "            print('REFUSED', _what, type(_e).__name__)\n"
    )
    with _env(open_dir) as env:
        text = _run_module(env, code)
        assert "READ" not in text, text
        assert text.count("REFUSED") == 8, text


def test_a_library_reached_by_a_symlink_under_a_root_only_dir_is_lent(open_dir):
    # (not an attack: the mount's decision) a venv whose path runs through a dir of root's
    # alone by a symlink, to a dir every user may read: the path the module is given must be
    # one its uid can walk, so the dir is mounted, whatever its resolved path
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    (open_dir / "open").mkdir()
    venv = open_dir / "open" / "venv"
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (site := next(venv.glob("lib/python3*/site-packages"))).chmod(0o755)
    (site / "sitemark.py").write_text("MARK = 42\n")
    hidden = open_dir / "ro"
    hidden.mkdir(mode=0o700)
    (hidden / "link").symlink_to(venv)
    work = open_dir / "work"
    work.mkdir()
    work.chmod(0o755)
    edit = _edit("def add", "import sitemark\nprint(sitemark.MARK)\ndef add")
    script = (
        "import envpool, envpool.envs\n"
        f"env = envpool.make('code-repair-v1', workdir_root={str(work)!r})\n"
        "env.reset(options={'task': 'mathutils'})\n"
        f"env.step({edit!r})\n"
        "print(env.step('run_tests').obs.text)\n"
        "env.close()\n"
    )
    deps = [p for p in sys.path if p.endswith("site-packages")]
    out = subprocess.run(
        [str(hidden / "link" / "bin" / "python"), "-c", script],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), *deps])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Output of the run:\n42" in out.stdout, out.stdout + out.stderr
