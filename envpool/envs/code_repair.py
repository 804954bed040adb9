"""Multi-turn code repair: fix a small buggy Python module until its tests pass.

Each reset (seeded, or ``options={"task": name}``) copies one built-in task into a fresh
private work dir: a module with a bug, its tests (``test_*.py``, read-only) and a README.
One action per turn:

``view <file>``
    the file with line numbers.
``edit <file>`` followed by one or more search/replace blocks::

        edit mathutils.py
        <<<<<<< SEARCH
            return a - b
        =======
            return a + b
        >>>>>>> REPLACE

    Each SEARCH text must occur exactly once in the file (indentation included); the
    blocks apply in order, all or none. An empty REPLACE deletes the text.
``run_tests``
    runs the tests and shows a pass/fail line per test, with the output of the run
    (truncated).
``submit``
    ends the episode: reward 1.0 when every test of the task passes, else 0.0.

For the schedulers, ``info["valid"]`` is False on an unknown, refused or failed action, and
``run_tests``/``submit`` set ``info["outcome"]``: ``"success"`` when every test passes,
``"timeout"`` when the run was killed at ``test_timeout_s``, else ``"test_failure"``.

Paths are relative to the work dir; absolute paths and ``..`` are refused. Observations
never show the work dir's location, so a seed and a list of actions replay the same
episode.

How a run is judged, and why so: the policy's module is code the policy wrote, and the
process that imports it is the policy's to control (it can read that process's memory,
print anything, exit early, or return a value whose ``__eq__`` is always true). So that
process only *computes*: a subprocess (``python -I -B``, cwd the work dir, scrubbed
environment, killed with whatever it started when its results are in or at ``test_timeout_s``,
CPU and file-size limits, dies with the process that started it) imports the module, evaluates each check's
call (``add(2, 3)``) and writes the value as plain JSON (numbers, strings, booleans, None,
lists, string-keyed dicts; anything else is a failure) or the exception it raised to a file
of its own. This process compares those values with the expected ones, which never enter
the subprocess. A module can still write that file itself, but a check passes only with
the right value, which is what a correct module returns: the worst it can do is what any
test-judged task allows, answers fitted to the visible tests. The ``test_*.py`` files are
the checks written out for the policy to read; they are restored before every run and
never executed. The subprocess runs as this process's user: what it may touch besides the
work dir (this process included, with ``ptrace``) is bounded by the container, which is the
sandbox for adversarial code, not this env.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

from envpool.api import Env, Observation, StepResult
from envpool.envs.code_repair_tasks import TASKS, TASKS_BY_NAME, Check, Raises, Task, Test, render_tests

MAX_VIEW_CHARS = 20_000
MAX_OUTPUT_CHARS = 4_000
MAX_RESULTS_BYTES = 2_000_000
"""What is read of the subprocess's results file (each value is capped at 100 kB)."""
MAX_FILE_BYTES = 16 * 2**20
"""RLIMIT_FSIZE of a test run: a module writing without end is killed, not the disk filled."""


__all__ = [
    "TASKS",
    "TASKS_BY_NAME",
    "Check",
    "CodeRepairEnv",
    "Raises",
    "Task",
    "Test",
    "parse_blocks",
    "render_tests",
]


# Runs as `python -I -B -c RUNNER PARENT_PID RESULTS_FD DONE_FD` in the work dir, with the module's name, the
# test file's imports and the checks' calls as one JSON line on stdin (never the expected
# values). It writes one JSON line per check to RESULTS_FD, a file of its own: {"i", "value"}, or
# {"i", "raised": [the exception's class names, its MRO], "message", "at"}, or {"i",
# "not_plain": type, "repr"}; an import failure is {"import_error", "at"}. It dies with the
# process that started it (PR_SET_PDEATHSIG, set here rather than in a preexec_fn, which is
# not safe in a process with threads, as a container's server is). It is also a child subreaper:
# what the module's processes start stays in its tree when they exit (not reparented to pid
# 1). When done it writes one byte to DONE_FD and waits on the spec's pipe (moved off fd 0,
# which reads /dev/null for the module), alive, so that its parent kills the whole tree
# (kill_tree) after every run, not only on a timeout: a forked helper that sleeps no longer
# outlives the run. A module that writes DONE_FD early only cuts its
# own results short.
RUNNER = r"""
import ctypes, importlib, json, os, sys, traceback
try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    libc.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
except Exception:
    pass  # not Linux: the timeout and the CPU limit still apply
if os.getppid() != int(sys.argv[1]):  # its parent died before prctl took effect
    os._exit(1)
spec = json.loads(sys.stdin.readline())
# the wait below holds the spec's pipe on an fd of its own (not inherited by what the module
# runs); the module's stdin is empty, as the pipe was once its parent closed it after the spec
stdin_fd = os.dup(0)
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
# bound before the module runs: what it patches in os or sys cannot stop the end below
_write, _read, _exit, done_fd = os.write, os.read, os._exit, int(sys.argv[3])
results = os.fdopen(int(sys.argv[2]), "w", encoding="utf-8")

def send(obj):
    try:
        line = json.dumps(obj)
    except ValueError:  # an int past 4300 digits (Python's limit on int to str)
        line = json.dumps({"i": obj.get("i"), "too_large": -1})
    if len(line) > 100_000:
        line = json.dumps({"i": obj.get("i"), "too_large": len(line)})
    results.write(line + "\n")
    results.flush()

def text(f):
    try:
        return str(f())[:500]
    except BaseException:
        return "?"

def where(e):
    try:
        tb = traceback.extract_tb(e.__traceback__)
        return f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}: {tb[-1].line}" if tb else ""
    except BaseException:
        return ""

def mro(e):
    try:
        return [str(c.__name__) for c in type(e).__mro__]
    except BaseException:
        return ["?"]

def plain(x):
    t = type(x)
    if x is None or t in (bool, int, float, str):
        return x
    if t in (list, tuple):
        return [plain(v) for v in x]
    if t is dict and all(type(k) is str for k in x):
        return {k: plain(v) for k, v in x.items()}
    raise TypeError(t.__name__)

sys.path.insert(0, os.getcwd())
try:
    module = importlib.import_module(spec["module"])
    names = {}
    for name in spec["imports"]:
        if not hasattr(module, name):
            raise ImportError(f"cannot import name {name!r} from {spec['module']!r}")
        names[name] = getattr(module, name)
except BaseException as e:
    send({"import_error": f"{mro(e)[0]}: {text(lambda: e)}", "at": where(e)})
else:
    for i, call in enumerate(spec["calls"]):
        try:
            value = eval(call, dict(names))
        except BaseException as e:
            send({"i": i, "raised": mro(e), "message": text(lambda: e), "at": where(e)})
            continue
        try:
            out = plain(value)
        except BaseException:  # not a plain value, or nested too deep
            send({"i": i, "not_plain": type(value).__name__, "repr": text(lambda: repr(value))[:200]})
        else:
            send({"i": i, "value": out})
try:
    results.close()
    _write(done_fd, b"D")
    _read(stdin_fd, 1)  # the parent kills this process and its tree, or closes stdin
except BaseException:
    pass  # the module broke these fds: the parent sees the exit, and sweeps the work dir
_exit(0)
"""

HELP = """Actions (one per reply):
  view <file>      show a file with line numbers
  edit <file>      followed by one or more blocks:
                   <<<<<<< SEARCH
                   exact lines to find (indentation included)
                   =======
                   lines to put instead
                   >>>>>>> REPLACE
  run_tests        run the tests
  submit           finish; reward 1 if every test passes"""


class CodeRepairEnv(Env):
    """A buggy module, its tests and a test runner, in a private temp dir per episode."""

    example_actions: ClassVar[tuple[str, ...]] = (
        "view README.md",
        "view ../outside.txt",
        "edit README.md\n<<<<<<< SEARCH\nnot in the file\n=======\nx\n>>>>>>> REPLACE",
        "run_tests",
        "submit",
    )

    def __init__(self, test_timeout_s: float = 10.0, workdir_root: str | None = None):
        self.test_timeout_s = test_timeout_s
        self.workdir_root = workdir_root
        self._rng: random.Random | None = None
        self.task: Task | None = None
        self.workdir: Path | None = None

    # -- lifecycle
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        if seed is not None or self._rng is None:
            self._rng = random.Random(seed)
        name = (options or {}).get("task")
        if name is not None and name not in TASKS_BY_NAME:
            raise ValueError(f"unknown task {name!r}; tasks: {', '.join(TASKS_BY_NAME)}")
        task = TASKS_BY_NAME[name] if name else TASKS[int(self._rng.random() * len(TASKS))]
        self._remove_workdir()
        self.workdir = Path(tempfile.mkdtemp(prefix="envpool-code-repair-", dir=self.workdir_root))
        self.task = task
        module = task.module
        readme = f"# {task.name}\n\n{task.description} Fix {module} so that the tests pass.\n"
        for fname, content in {"README.md": readme, **task.files}.items():
            (self.workdir / fname).write_text(content, encoding="utf-8")
        text = (
            f"Code repair task '{task.name}': {task.description}\n"
            f"Fix {module} so that its tests pass. Files: {', '.join(self._files())} "
            "(test files are read-only).\n\n" + HELP
        )
        return Observation(text=text), {"task": task.name, "files": self._files()}

    def close(self) -> None:
        self._remove_workdir()

    def _remove_workdir(self) -> None:
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    # -- actions
    def step(self, action: str) -> StepResult:
        if self.workdir is None or self.task is None:
            raise RuntimeError("the environment was closed; call reset()")
        text = action.replace("\r\n", "\n").strip()
        first, _, rest = text.partition("\n")
        cmd, _, arg = first.strip().partition(" ")
        cmd = cmd.lower()
        if cmd == "view" and not rest.strip():
            return self._reply(*self._view(arg.strip()))
        if cmd == "edit":
            return self._reply(*self._edit(arg.strip(), rest))
        if cmd in ("run_tests", "submit") and not arg.strip() and not rest.strip():
            passed, failed, output, timed_out = self._run_tests()
            solved = failed == 0 and passed == self.task.n_tests
            # the schedulers' signal (info["outcome"]): a failing run is not a tool error
            outcome = "success" if solved else "timeout" if timed_out else "test_failure"
            info = {"passed": passed, "failed": failed, "all_passed": solved, "outcome": outcome}
            summary = f"Tests: {passed} passed, {failed} failed."
            if cmd == "run_tests":
                return StepResult(obs=Observation(text=f"{summary}\n{output}"), info=info)
            verdict = "Solved" if solved else "Not solved"
            return StepResult(
                obs=Observation(text=f"Submitted. {summary} {verdict}; episode over."),
                reward=1.0 if solved else 0.0,
                terminated=True,
                info=info,
            )
        return self._reply(f"Unknown action {first.strip()[:60]!r}.\n{HELP}", False)

    def _reply(self, text: str, valid: bool) -> StepResult:
        """A view or edit's answer; ``valid`` False (a refused, failed or unknown action)
        is the schedulers' tool error."""
        return StepResult(obs=Observation(text=text), info={"valid": valid})

    def _files(self) -> list[str]:
        assert self.workdir is not None
        return sorted(p.name for p in self.workdir.iterdir() if p.is_file())

    def _resolve(self, name: str) -> Path | str:
        """The file's path inside the work dir, or a message saying why not."""
        assert self.workdir is not None
        name = name.strip().strip("'\"`")
        if not name:
            return f"Name a file. Files: {', '.join(self._files())}"
        p = PurePosixPath(name)
        if p.is_absolute() or ".." in p.parts or "\\" in name or "\x00" in name:
            return f"Refused {name!r}: paths are relative to the task dir, without '..'."
        root = self.workdir.resolve()
        try:
            full = (root / p).resolve()
            if not full.is_relative_to(root):
                return f"Refused {name!r}: it points outside the task dir."
            is_file = full.is_file()
        except OSError:  # a name the file system refuses (too long, a symlink loop): the
            # policy's mistake, answered like any other bad name; the error would show the
            # work dir, and raised it would mask the episode as an infra failure
            is_file = False
        if not is_file:
            return f"No such file {name[:100]!r}. Files: {', '.join(self._files())}"
        return full

    def _view(self, name: str) -> tuple[str, bool]:
        path = self._resolve(name)
        if isinstance(path, str):
            return path, False
        try:
            content = path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:  # the policy's code may have chmod-ed it
            return f"Refused {name[:100]!r}: it cannot be read ({e.strerror}).", False
        cut = len(content) > MAX_VIEW_CHARS
        lines = content[:MAX_VIEW_CHARS].splitlines()
        body = "\n".join(f"{i:4d} | {line}" for i, line in enumerate(lines, 1))
        return f"{name}:\n{body}" + ("\n[... truncated]" if cut else ""), True

    def _edit(self, name: str, blocks_text: str) -> tuple[str, bool]:
        path = self._resolve(name)
        if isinstance(path, str):
            return path, False
        if path.name.startswith("test_"):
            return f"Refused: {path.name} is a test file, and test files are read-only.", False
        blocks = parse_blocks(blocks_text)
        if isinstance(blocks, str):
            return f"Edit not applied: {blocks}", False
        try:
            content = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:  # the policy's code may have changed it
            why = e.strerror if isinstance(e, OSError) else "it is not UTF-8 text"
            return f"Refused {path.name}: it cannot be read ({why}).", False
        for i, (search, replace) in enumerate(blocks, 1):
            count = content.count(search)
            if count != 1:
                why = "not found" if count == 0 else f"found {count} times; include more lines"
                return (
                    f"Edit not applied: block {i}'s SEARCH text was {why} in {path.name} "
                    "(it must match exactly, indentation included). The file is unchanged."
                ), False
            content = content.replace(search, replace, 1)
        try:
            path.write_text(content, encoding="utf-8")
        except OSError as e:
            return f"Refused {path.name}: it cannot be written ({e.strerror}).", False
        return f"Edited {path.name}: {len(blocks)} block(s) applied.", True

    def _run_tests(self) -> tuple[int, int, str, bool]:
        """``(passed, failed, output, timed out)``: the checks run in a subprocess, judged here."""
        assert self.workdir is not None and self.task is not None
        task, root = self.task, self.workdir
        # only the module is the policy's; the test files are restored so a view shows them
        (root / task.test_file).write_text(task.files[task.test_file], encoding="utf-8")
        checks = task.checks()
        spec = {
            "module": task.module.removesuffix(".py"),
            "imports": list(task.imports),
            "calls": [c.call for _, c in checks],
        }
        env = {"PATH": os.defpath, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": str(root)}
        done_r, done_w = os.pipe()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as results:
            # in this process's group, not a session of its own: a container is killed as a
            # whole (its process group), and a test run must go with it
            argv = [sys.executable, "-I", "-B", "-c", RUNNER, str(os.getpid()), str(results.fileno())]
            try:
                proc = subprocess.Popen(
                    [*argv, str(done_w)],
                    cwd=root,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    pass_fds=(results.fileno(), done_w),
                )
            finally:
                os.close(done_w)
            try:
                timed_out = self._await_runner(proc, done_r, json.dumps(spec).encode() + b"\n", root)
            finally:
                os.close(done_r)
            out.seek(0)
            raw = out.read(1_000_000).decode("utf-8", errors="replace")
            results.seek(0)
            reported = results.read(MAX_RESULTS_BYTES).decode("utf-8", errors="replace")
        hide = [str(root), str(root.resolve())]
        passed, lines = judge(task, checks, parse_results(reported, len(checks)), timed_out)
        shown = _hide(raw, hide).strip()
        if len(shown) > MAX_OUTPUT_CHARS:
            shown = f"[... {len(shown) - MAX_OUTPUT_CHARS} characters cut]\n" + shown[-MAX_OUTPUT_CHARS:]
        if timed_out:
            lines.append(f"The test run timed out after {self.test_timeout_s:g} s.")
        report = _hide("\n".join(lines), hide)
        if shown:
            report += f"\nOutput of the run:\n{shown}"
        return passed, task.n_tests - passed, report, timed_out

    def _await_runner(self, proc: subprocess.Popen[bytes], done_r: int, spec: bytes, root: Path) -> bool:
        """Feed the runner its spec and wait for its done byte, its exit or the timeout; then
        kill it with everything it started. Whether it timed out."""
        # a backstop should the timeout below never come (this process stopped): SIGKILL
        # past about test_timeout_s of CPU (soft = hard: no SIGXCPU core dump)
        cpu_s = math.ceil(self.test_timeout_s) + 1
        with contextlib.suppress(OSError, ValueError):
            resource.prlimit(proc.pid, resource.RLIMIT_CPU, (cpu_s, cpu_s))
            resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
        assert proc.stdin is not None
        with contextlib.suppress(OSError):  # it died at once: its exit tells
            proc.stdin.write(spec)
            proc.stdin.flush()
        deadline = time.monotonic() + self.test_timeout_s
        timed_out = True
        # the done byte, or the runner's exit (it died, or the module ended the interpreter:
        # the done pipe stays open in whatever it forked, so its EOF cannot tell)
        watch = [done_r]
        with _exit_watch(proc.pid) as exited:
            while (left := deadline - time.monotonic()) > 0:
                ready, _, _ = select.select(watch + exited, [], [], left if exited else min(left, 0.05))
                if done_r in ready:
                    if os.read(done_r, 1):
                        timed_out = False
                        break
                    watch = []  # closed by the module: its exit, or the timeout, tells
                if (exited and exited[0] in ready) or (not exited and proc.poll() is not None):
                    timed_out = False
                    break
        if proc.returncode is None:  # not reaped (a zombie at worst): its pid is still its own
            kill_tree(proc.pid)  # it and all it started (a subreaper, it kept them in its tree)
        with contextlib.suppress(OSError):
            proc.stdin.close()
        proc.wait()
        # whether it ended by itself (the module ended the interpreter, or it crashed, or it
        # cut the runner's wait short after the done byte) before the kill cannot be told
        # apart from a kill: what it started left its tree then, but not this process group
        # nor the work dir. One scan of /proc, after every run
        kill_left_in(root)
        return timed_out


@contextlib.contextmanager
def _exit_watch(pid: int) -> Iterator[list[int]]:
    """``[a pidfd]`` that turns readable when ``pid`` exits, or ``[]`` where there is none
    (then the caller polls)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        yield []
        return
    try:
        yield [fd]
    finally:
        os.close(fd)


def _hide(text: str, prefixes: list[str]) -> str:
    """``text`` without the work dir's location (so that episodes replay alike)."""
    for prefix in prefixes:
        text = text.replace(prefix + os.sep, "").replace(prefix, ".")
    return text


def parse_results(text: str, n: int) -> dict[Any, dict[str, Any]]:
    """The subprocess's JSON lines by check index (the first line for an index counts), and
    under ``"import"`` its import failure. Lines that are not such objects are ignored."""
    found: dict[Any, dict[str, Any]] = {}
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if "import_error" in obj:
            found.setdefault("import", obj)
        elif type(obj.get("i")) is int and 0 <= obj["i"] < n:
            found.setdefault(obj["i"], obj)
    return found


def _plain(value: Any) -> Any:
    """An expected value as JSON gives it back (tuples as lists)."""
    return json.loads(json.dumps(value))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def verdict(check: Check, got: dict[str, Any] | None) -> str | None:
    """None when the reported result meets the check, else why not (for the policy)."""
    if got is None:
        return f"{check.call} did not finish"
    expect = check.expect
    if "raised" in got:
        names = got["raised"] if isinstance(got["raised"], list) else []
        if isinstance(expect, Raises) and expect.error in names:
            return None
        kind = str(names[0]) if names else "an exception"
        why = f"{check.call} raised {kind}: {got.get('message', '')}"
        return why + (f"\n    at {got['at']}" if got.get("at") else "")
    if "value" in got:
        if isinstance(expect, Raises):
            return f"{check.call} did not raise {expect.error} (it returned {_short(got['value'])})"
        if got["value"] == _plain(expect):  # plain JSON values on both sides: == is theirs
            return None
        return f"{check.call} returned {_short(got['value'])}, expected {expect!r}"
    if "not_plain" in got:
        return (
            f"{check.call} returned {str(got.get('repr', '?'))[:200]} (a {str(got['not_plain'])[:60]}; "
            "the tests compare plain values: numbers, strings, booleans, None, lists, dicts)"
        )
    if "too_large" in got:
        return f"{check.call} returned a value too large to compare"
    return f"{check.call} did not finish"


def judge(
    task: Task, checks: list[tuple[int, Check]], results: dict[Any, dict[str, Any]], timed_out: bool
) -> tuple[int, list[str]]:
    """``(tests passed, a line per test)``: a test passes when each of its checks does."""
    test_file = task.test_file
    if "import" in results:
        err = results["import"]
        line = f"ERROR {test_file}: {str(err.get('import_error', '?'))[:500]}"
        if err.get("at"):
            line += f"\n    at {str(err['at'])[:300]}"
        return 0, [line]
    failures: dict[int, str] = {}
    for i, (t, check) in enumerate(checks):
        if t in failures:
            continue  # a test stops at its first failing check
        why = verdict(check, results.get(i))
        if why is not None:
            failures[t] = why
    lines = []
    for t, test in enumerate(task.tests):
        where = f"{test_file}::{test.name}"
        lines.append(f"FAIL {where}: {failures[t]}" if t in failures else f"PASS {where}")
    return task.n_tests - len(failures), lines


def kill_left_in(root: Path) -> None:
    """SIGKILL every process of this process group whose working directory is under ``root``
    (an episode's work dir, this process's own never), each stopped first so none forks past
    the scan."""
    me, group, stopped, root = os.getpid(), os.getpgid(0), set[int](), root.resolve()
    for _ in range(100):  # a fork bomb outruns no scan for long: each pass stops what it saw
        found = []
        with contextlib.suppress(OSError):
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit() or (pid := int(entry.name)) == me or pid in stopped:
                    continue
                try:
                    if os.getpgid(pid) != group or not Path(os.readlink(f"/proc/{pid}/cwd")).is_relative_to(
                        root
                    ):
                        continue
                    os.kill(pid, signal.SIGSTOP)
                except OSError:  # gone meanwhile, or not ours to read
                    continue
                found.append(pid)
        if not found:
            break
        stopped.update(found)
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _children_by_parent() -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    try:
        entries = list(os.scandir("/proc"))
    except OSError:  # no /proc (not Linux): only the runner itself is killed
        return found
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # past the command name (which may hold spaces or parentheses): state, then ppid
        ppid = int(stat.rpartition(b")")[2].split()[1])
        found.setdefault(ppid, []).append(int(entry.name))
    return found


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` (a child of this process) and every process it started. They share
    their caller's process group (a group of their own would escape a container's kill), so
    they are found by parent; each is stopped first so that none forks behind the walk, and
    a stopped parent reaps nothing, so no pid found can pass to another process before the
    kill. (One that left the tree, reparented when its parent exited, is not found: the
    container's own kill takes it.)"""
    stopped: set[int] = set()
    todo = [root]
    while todo:
        for pid in todo:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        stopped.update(todo)
        tree = _children_by_parent()
        found: set[int] = set()
        frontier = [root]
        while frontier:
            for child in tree.get(frontier.pop(), ()):
                if child not in found:
                    found.add(child)
                    frontier.append(child)
        todo = sorted(found - stopped)
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def parse_blocks(text: str) -> list[tuple[str, str]] | str:
    """``[(search, replace), ...]`` from SEARCH/REPLACE blocks, or what is wrong with them."""
    blocks: list[tuple[str, str]] = []
    state, search, replace = "out", [], []  # type: ignore[var-annotated]
    for line in text.split("\n"):
        marker = line.strip()
        if state == "out":
            if re.fullmatch(r"<{5,9} ?SEARCH", marker):
                state, search, replace = "search", [], []
            elif marker:
                return f"expected '<<<<<<< SEARCH', got {line[:60]!r}"
        elif state == "search":
            if re.fullmatch(r"={5,9}", marker):
                state = "replace"
            else:
                search.append(line)
        elif re.fullmatch(r">{5,9} ?REPLACE", marker):
            if not "".join(search).strip():
                return "a SEARCH section is empty"
            blocks.append(("\n".join(search), "\n".join(replace)))
            state = "out"
        else:
            replace.append(line)
    if state != "out":
        return "a block is not closed (each needs '=======' and '>>>>>>> REPLACE' lines)"
    if not blocks:
        return "no SEARCH/REPLACE block after the 'edit <file>' line"
    return blocks
