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
    runs every ``test_*`` function of the test files in a subprocess (``python -I -B``,
    cwd the work dir, scrubbed environment, killed after ``test_timeout_s`` with whatever it
    started) and shows a pass/fail summary with the (truncated) output. The subprocess stays
    in the caller's process group, so killing a container kills its test run; it also dies
    with the process that started it and has a CPU limit of about ``test_timeout_s``.
``submit``
    ends the episode: reward 1.0 when every test of the task passes, else 0.0.

For the schedulers, ``info["valid"]`` is False on an unknown, refused or failed action, and
``run_tests``/``submit`` set ``info["outcome"]``: ``"success"`` when every test passes,
``"timeout"`` when the run was killed at ``test_timeout_s``, else ``"test_failure"``.

Paths are relative to the work dir; absolute paths and ``..`` are refused. Observations
never show the work dir's location, so a seed and a list of actions replay the same
episode. The tests are restored from the task before every run, so only the module can be
changed; this is not a sandbox for adversarial code (that is the container's job).

Known limitation, a reward hack: the tests and the policy's module run in one process,
which also prints the verdict. The module can read the result line's nonce (a global of the
runner's ``__main__``), print ``@@result <nonce> <n> 0`` and ``os._exit(0)`` at import, and
pass every task; a value whose ``__eq__`` always returns True passes the ``==`` tests. Do
not train a policy that may game its reward on this env as it is. A fix judges outside the
process that runs policy code: the tests' calls there, their results serialised to JSON and
compared in this process against expected values kept outside the work dir.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

from envpool.api import Env, Observation, StepResult

MAX_VIEW_CHARS = 20_000
MAX_OUTPUT_CHARS = 4_000


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    files: dict[str, str]
    """File name -> content; ``test_*.py`` files are the (read-only) tests."""
    n_tests: int
    fix: tuple[tuple[str, str, str], ...]
    """``(file, search, replace)`` edits that solve the task (for the test suite)."""


TASKS: tuple[Task, ...] = (
    Task(
        name="mathutils",
        description="add() returns the wrong value.",
        files={
            "mathutils.py": '''"""Small numeric helpers."""


def add(a, b):
    """The sum of a and b."""
    return a - b


def clamp(x, lo, hi):
    """x limited to the range [lo, hi]."""
    return max(lo, min(x, hi))
''',
            "test_mathutils.py": """from mathutils import add, clamp


def test_add():
    got = add(2, 3)
    assert got == 5, f"add(2, 3) returned {got!r}, expected 5"


def test_add_negative():
    got = add(-4, 1)
    assert got == -3, f"add(-4, 1) returned {got!r}, expected -3"


def test_clamp():
    assert clamp(5, 0, 3) == 3 and clamp(-1, 0, 3) == 0 and clamp(2, 0, 3) == 2
""",
        },
        n_tests=3,
        fix=(("mathutils.py", "    return a - b", "    return a + b"),),
    ),
    Task(
        name="stats",
        description="mean() gives wrong results.",
        files={
            "stats.py": '''"""Descriptive statistics."""


def mean(xs):
    """The arithmetic mean of a non-empty list of numbers."""
    if not xs:
        raise ValueError("mean of an empty list")
    return sum(xs) / (len(xs) - 1)


def median(xs):
    """The middle value (the mean of the two middle values for an even count)."""
    s = sorted(xs)
    mid = len(s) // 2
    if len(s) % 2:
        return s[mid]
    return (s[mid - 1] + s[mid]) / 2
''',
            "test_stats.py": """from stats import mean, median


def test_mean():
    got = mean([2, 4, 9])
    assert got == 5, f"mean([2, 4, 9]) returned {got!r}, expected 5"


def test_mean_of_one():
    got = mean([7])
    assert got == 7, f"mean([7]) returned {got!r}, expected 7"


def test_mean_empty():
    try:
        mean([])
    except ValueError:
        return
    raise AssertionError("mean([]) did not raise ValueError")


def test_median():
    assert median([3, 1, 2]) == 2 and median([4, 1, 3, 2]) == 2.5
""",
        },
        n_tests=4,
        fix=(("stats.py", "sum(xs) / (len(xs) - 1)", "sum(xs) / len(xs)"),),
    ),
    Task(
        name="fizzbuzz",
        description="fizzbuzz() never says FizzBuzz.",
        files={
            "fizzbuzz.py": '''"""The counting game."""


def fizzbuzz(n):
    """'Fizz' for multiples of 3, 'Buzz' for multiples of 5, 'FizzBuzz' for both, else n."""
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "Buzz"
    if n % 15 == 0:
        return "FizzBuzz"
    return str(n)
''',
            "test_fizzbuzz.py": """from fizzbuzz import fizzbuzz


def test_plain():
    assert fizzbuzz(7) == "7", fizzbuzz(7)


def test_fizz_and_buzz():
    assert (fizzbuzz(9), fizzbuzz(10)) == ("Fizz", "Buzz"), (fizzbuzz(9), fizzbuzz(10))


def test_fizzbuzz():
    got = fizzbuzz(30)
    assert got == "FizzBuzz", f"fizzbuzz(30) returned {got!r}, expected 'FizzBuzz'"
""",
        },
        n_tests=3,
        fix=(
            (
                "fizzbuzz.py",
                '    if n % 3 == 0:\n        return "Fizz"',
                '    if n % 15 == 0:\n        return "FizzBuzz"\n    if n % 3 == 0:\n        return "Fizz"',
            ),
        ),
    ),
    Task(
        name="words",
        description="word_count() miscounts text with irregular spacing.",
        files={
            "words.py": '''"""Text helpers."""


def word_count(text):
    """How many whitespace-separated words ``text`` has."""
    return len(text.split(" "))
''',
            "test_words.py": """from words import word_count


def test_simple():
    assert word_count("hello world") == 2, word_count("hello world")


def test_irregular_spacing():
    got = word_count("  many   spaces\\there ")
    assert got == 3, f"word_count returned {got!r}, expected 3"


def test_empty():
    got = word_count("")
    assert got == 0, f"word_count('') returned {got!r}, expected 0"
""",
        },
        n_tests=3,
        fix=(("words.py", 'text.split(" ")', "text.split()"),),
    ),
)
TASKS_BY_NAME = {t.name: t for t in TASKS}

# Runs as `python -I -B -c RUNNER PARENT_PID` in the work dir. The result line carries a
# nonce read from stdin, so a stray print in the module cannot pass for it by accident. It
# dies with the process that started it (PR_SET_PDEATHSIG, set here rather than in a
# preexec_fn, which is not safe in a process with threads, as a container's server is).
RUNNER = r"""
import ctypes, importlib, os, sys, traceback
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
except Exception:
    pass  # not Linux: the timeout and the CPU limit still apply
if os.getppid() != int(sys.argv[1]):  # its parent died before prctl took effect
    os._exit(1)
root = os.getcwd()
sys.path.insert(0, root)
nonce = sys.stdin.readline().strip()
passed = failed = 0
for fname in sorted(f for f in os.listdir(root) if f.startswith("test_") and f.endswith(".py")):
    try:
        mod = importlib.import_module(fname[:-3])
    except BaseException as e:
        failed += 1
        print(f"ERROR {fname}: {type(e).__name__}: {e}", flush=True)
        continue
    for name, fn in list(vars(mod).items()):
        if not (name.startswith("test_") and callable(fn) and getattr(fn, "__module__", "") == mod.__name__):
            continue
        try:
            fn()
        except BaseException as e:
            failed += 1
            frame = traceback.extract_tb(e.__traceback__)[-1]
            print(f"FAIL {fname}::{name}: {type(e).__name__}: {e}", flush=True)
            print(f"    at {os.path.basename(frame.filename)}:{frame.lineno}: {frame.line}", flush=True)
        else:
            passed += 1
            print(f"PASS {fname}::{name}", flush=True)
print(f"@@result {nonce} {passed} {failed}", flush=True)
"""
_RESULT = re.compile(r"^@@result (\S+) (\d+) (\d+)$", re.MULTILINE)

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
        module = next(f for f in task.files if not f.startswith("test_"))
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
        """``(passed, failed, output, timed out)``."""
        assert self.workdir is not None and self.task is not None
        root = self.workdir
        for fname, content in self.task.files.items():  # only the module is the policy's
            if fname.startswith("test_"):
                (root / fname).write_text(content, encoding="utf-8")
        nonce = secrets.token_hex(8)
        env = {"PATH": os.defpath, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": str(root)}
        with tempfile.TemporaryFile() as out:
            # in this process's group, not a session of its own: a container is killed as a
            # whole (its process group), and a test run must go with it
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", RUNNER, str(os.getpid())],
                cwd=root,
                env=env,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            timed_out = False
            try:
                # a backstop should the timeout below never come (this process stopped):
                # SIGKILL past about test_timeout_s of CPU (soft = hard: no SIGXCPU core dump)
                cpu_s = math.ceil(self.test_timeout_s) + 1
                with contextlib.suppress(OSError, ValueError):
                    resource.prlimit(proc.pid, resource.RLIMIT_CPU, (cpu_s, cpu_s))
                proc.communicate(f"{nonce}\n".encode(), timeout=self.test_timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                kill_tree(proc.pid)
                proc.wait()
            out.seek(0)
            raw = out.read(1_000_000).decode("utf-8", errors="replace")
        for prefix in {str(root), str(root.resolve())}:
            raw = raw.replace(prefix + os.sep, "").replace(prefix, ".")
        found = [m for m in _RESULT.finditer(raw) if m.group(1) == nonce]
        shown = _RESULT.sub("", raw).strip()
        if len(shown) > MAX_OUTPUT_CHARS:
            shown = f"[... {len(shown) - MAX_OUTPUT_CHARS} characters cut]\n" + shown[-MAX_OUTPUT_CHARS:]
        if not found:
            why = f"timed out after {self.test_timeout_s:g} s" if timed_out else "did not finish"
            return 0, self.task.n_tests, f"The test run {why}.\n{shown}".strip(), timed_out
        return int(found[-1].group(2)), int(found[-1].group(3)), shown, False


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
