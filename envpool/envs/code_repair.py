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
Where a run got less than its full isolation (a part the kernel or the container refused:
its PID, mount or network namespace, its own ``/proc`` or ``/dev/shm``, its module's
capabilities dropped), they also set ``info["isolation"]``, each part True or False
(``code_repair_runner.ISOLATION``), and the env logs a warning once.

Paths are relative to the work dir; absolute paths, ``..``, a symlink out and a file with
another link (a hard link, maybe to a file outside) are refused. Observations
never show the work dir's location, so a seed and a list of actions replay the same
episode.

How a run is judged, and why so: the policy's module is code the policy wrote, and the
process that imports it is the policy's to control (it can read that process's memory, print
anything, exit early, or return a value whose ``__eq__`` is always true). So that process
only *computes*: a subprocess (``python -I -B -u``, cwd the work dir, scrubbed environment, in
a PID namespace of its own where the kernel allows one, killed with whatever it started when
its results are in or at ``test_timeout_s``, CPU and file-size limits, ``memory_limit_bytes``
of address space per process and, where cgroups can be made, of memory for all its processes
together and at most ``max_processes`` processes and threads
(:mod:`envpool.envs.code_repair_limits`: a memory hog, many of them or a fork bomb
fails its run, saying which limit, rather than take the container down), dies with the
process that started it; :mod:`envpool.envs.code_repair_runner`) imports the module, evaluates each
check's call (``add(2, 3)``) and writes the value as plain JSON (numbers, strings, booleans,
None, lists, string-keyed dicts; anything else is a failure) or the exception it raised to a
file of its own. This process compares those values with the expected ones, which never
enter the subprocess. A module can still write that file itself, but a check passes only
with the right value, which is what a correct module returns: the worst it can do is what
any test-judged task allows, answers fitted to the visible tests. The ``test_*.py`` files
are the checks written out for the policy to read; they are restored before every run and
never executed.

Whose the module's code is: where this process is root (a container's usual user, and the
``process`` runtime's wherever the server runs as root, with no container around it), the
module runs as an unprivileged uid of the run's own, ``run_uid_base`` + the pid of the run's
first process, with a group of its own and no supplementary groups
(:mod:`envpool.envs.code_repair_user`, which says why so): it cannot write its cgroups' limits
(``pids.max``, ``memory.limit_in_bytes``: root's), root's files, nor signal or trace this
process or another run's. The work dir is handed to that uid before each run, so the module
reads and writes there as before. A root process that cannot take the uid (no
``CAP_SETUID``, a user namespace without it) refuses the run (``EnvUsageError``) rather than
run the module as root; ``run_uid_base=None`` runs it as this process's user, for a container
that is itself the sandbox. A process that is not root runs the module as its own user, as
ever: then what the module may touch besides the work dir (this process included, where it
has no PID namespace) is bounded by the container, the sandbox for adversarial code.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import re
import stat
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

from envpool.api import Env, Observation, StepResult
from envpool.envs.code_repair_judge import judge, parse_results, verdict
from envpool.envs.code_repair_limits import (
    DEFAULT_MAX_PROCESSES,
    DEFAULT_MEMORY_BYTES,
    MIN_MAX_PROCESSES,
    MIN_MEMORY_BYTES,
    describe_bytes,
)
from envpool.envs.code_repair_runner import (
    MAX_FILE_BYTES,
    MAX_RAW_OUTPUT_BYTES,
    MAX_RESULTS_BYTES,
    RUNNER,
    kill_left_in,
    kill_tree,
    run_checks,
)
from envpool.envs.code_repair_tasks import TASKS, TASKS_BY_NAME, Check, Raises, Task, Test, render_tests
from envpool.envs.code_repair_user import (
    DEFAULT_RUN_UID_BASE,
    check_run_uid_base,
    remove_tree,
    run_uid_base_for,
)

log = logging.getLogger(__name__)

MAX_VIEW_CHARS = 20_000
MAX_OUTPUT_CHARS = 4_000
MAX_LISTED_CHARS = 1_000
"""Of the names of files the policy's code made, listed in an answer."""


# the runner's and the judge's names are re-exported: they lived here before the split
__all__ = [
    "MAX_FILE_BYTES",
    "MAX_RESULTS_BYTES",
    "RUNNER",
    "TASKS",
    "TASKS_BY_NAME",
    "Check",
    "CodeRepairEnv",
    "Raises",
    "Task",
    "Test",
    "judge",
    "kill_left_in",
    "kill_tree",
    "parse_blocks",
    "parse_results",
    "render_tests",
    "verdict",
]


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

    def __init__(
        self,
        test_timeout_s: float = 10.0,
        workdir_root: str | None = None,
        memory_limit_bytes: int = DEFAULT_MEMORY_BYTES,
        max_processes: int = DEFAULT_MAX_PROCESSES,
        run_uid_base: int | None = DEFAULT_RUN_UID_BASE,
    ):
        if not 0 < test_timeout_s < math.inf:  # NaN too
            raise ValueError(f"test_timeout_s must be a positive number of seconds, got {test_timeout_s!r}")
        if type(memory_limit_bytes) is not int or memory_limit_bytes < MIN_MEMORY_BYTES:
            raise ValueError(
                f"memory_limit_bytes must be an int of at least {MIN_MEMORY_BYTES} (32 MiB: the "
                f"interpreter itself needs about 15), got {memory_limit_bytes!r}"
            )
        if type(max_processes) is not int or max_processes < MIN_MAX_PROCESSES:
            raise ValueError(
                f"max_processes must be an int of at least {MIN_MAX_PROCESSES} (a run has up to 3 "
                f"processes of its own), got {max_processes!r}"
            )
        self.run_uid_base = check_run_uid_base(run_uid_base)
        """Where this process is root, a test run's module runs as uid ``run_uid_base`` + its
        keeper's pid (``code_repair_user``); None: as this process's user."""
        self.test_timeout_s = test_timeout_s
        self.memory_limit_bytes = memory_limit_bytes
        """Address space of each process of a test run (``RLIMIT_AS``) and, where a memory
        cgroup can be made, the memory of all its processes together."""
        self.max_processes = max_processes
        """Processes and threads of a test run at once, where a pids cgroup can be made."""
        self.workdir_root = workdir_root
        self._rng: random.Random | None = None
        self.task: Task | None = None
        self.workdir: Path | None = None
        self._warned_isolation = False

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
            remove_tree(self.workdir)  # (a symlink the policy's code put there: unlinked)
            self.workdir = None

    def _repair_workdir(self) -> None:
        """The work dir as a directory of this process's again, should the policy's code (it
        runs there, as this process's user) have removed it or put something else in its
        place: a step answers, on what is left, rather than raise (an infra failure, the work
        dir in its message) or follow a symlink out. (It runs as the run's uid where this
        process is root, and owns the work dir then; as this process's user elsewhere.)"""
        assert self.workdir is not None
        try:
            mode: int | None = self.workdir.lstat().st_mode
        except FileNotFoundError:
            mode = None
        except OSError:
            return
        with contextlib.suppress(OSError):
            if mode is not None and stat.S_ISDIR(mode):
                if mode & 0o700 != 0o700:  # chmod-ed (this process's user is not always root)
                    os.chmod(self.workdir, 0o700)
                return
            if mode is not None:
                self.workdir.unlink()
            self.workdir.mkdir(mode=0o700)

    # -- actions
    def step(self, action: str) -> StepResult:
        if self.workdir is None or self.task is None:
            raise RuntimeError("the environment was closed; call reset()")
        self._repair_workdir()
        text = action.replace("\r\n", "\n").strip()
        first, _, rest = text.partition("\n")
        cmd, _, arg = first.strip().partition(" ")
        cmd = cmd.lower()
        if cmd == "view" and not rest.strip():
            return self._reply(*self._view(arg.strip()))
        if cmd == "edit":
            return self._reply(*self._edit(arg.strip(), rest))
        if cmd in ("run_tests", "submit") and not arg.strip() and not rest.strip():
            passed, failed, output, timed_out, isolation = self._run_tests()
            solved = failed == 0 and passed == self.task.n_tests
            # the schedulers' signal (info["outcome"]): a failing run is not a tool error
            outcome = "success" if solved else "timeout" if timed_out else "test_failure"
            info: dict[str, Any] = {
                "passed": passed,
                "failed": failed,
                "all_passed": solved,
                "outcome": outcome,
            }
            if isolation is not None and not all(isolation.values()):
                info["isolation"] = isolation  # a reduced isolation is never silent
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
        try:
            with os.scandir(self.workdir) as entries:
                return sorted(e.name for e in entries if e.is_file())
        except OSError:  # the policy's code made it unreadable
            return []

    def _listing(self) -> str:
        """The work dir's files for an answer: the task's first, then others up to
        ``MAX_LISTED_CHARS`` (the policy's code may have made thousands)."""
        assert self.task is not None
        files = self._files()
        own = {"README.md", *self.task.files}
        shown = [f for f in files if f in own]
        budget = MAX_LISTED_CHARS
        for f in files:
            if f not in own:
                if len(f) + 2 > budget:
                    break
                shown.append(f)
                budget -= len(f) + 2
        more = len(files) - len(shown)
        return ", ".join(shown) + (f" and {more:,} more" if more else "")

    def _resolve(self, name: str) -> Path | str:
        """The file's path inside the work dir, or a message saying why not."""
        assert self.workdir is not None
        name = name.strip().strip("'\"`")
        if not name:
            return f"Name a file. Files: {self._listing()}"
        p = PurePosixPath(name)
        if p.is_absolute() or ".." in p.parts or "\\" in name or "\x00" in name:
            return f"Refused {name!r}: paths are relative to the task dir, without '..'."
        root = self.workdir.resolve()
        try:
            full = (root / p).resolve()
            if not full.is_relative_to(root):
                return f"Refused {name!r}: it points outside the task dir."
            is_file = full.is_file()
            if is_file and full.stat().st_nlink > 1:
                # a hard link, maybe to a file outside that the policy's code may not read or
                # write, but this process (root) may: where fs.protected_hardlinks is 0 a
                # module running as a uid of its own can link any file on its file system
                return f"Refused {name[:100]!r}: it has another link, maybe to a file outside the task dir."
        except OSError:  # a name the file system refuses (too long, a symlink loop): the
            # policy's mistake, answered like any other bad name; the error would show the
            # work dir, and raised it would mask the episode as an infra failure
            is_file = False
        if not is_file:
            return f"No such file {name[:100]!r}. Files: {self._listing()}"
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

    def _run_tests(self) -> tuple[int, int, str, bool, dict[str, bool] | None]:
        """``(passed, failed, output, timed out, isolation)``: the checks run in a subprocess,
        judged here; the isolation the run got (``RunOutput.isolation``)."""
        assert self.workdir is not None and self.task is not None
        task, root = self.task, self.workdir
        # only the module is the policy's; the test files are restored so a view shows them
        # (written anew, never through what the policy's code put in their place: a
        # directory, a symlink or a hard link out)
        test_file = root / task.test_file
        with contextlib.suppress(OSError):  # they are never run: a view says what is wrong
            if test_file.is_dir() and not test_file.is_symlink():
                remove_tree(test_file)  # (however deep: shutil.rmtree recurses)
            else:
                test_file.unlink(missing_ok=True)
            with open(test_file, "x", encoding="utf-8") as f:
                f.write(task.files[task.test_file])
        checks = task.checks()
        spec = {
            "module": task.module.removesuffix(".py"),
            "imports": list(task.imports),
            "calls": [c.call for _, c in checks],
        }
        run = run_checks(
            root,
            spec,
            self.test_timeout_s,
            memory_bytes=self.memory_limit_bytes,
            max_processes=self.max_processes,
            run_uid_base=run_uid_base_for(self.run_uid_base),
        )
        timed_out = run.timed_out
        self._warn_if_reduced(run.isolation)
        hide = [str(root), str(root.resolve()), "/proc/self/cwd"]  # (the runner's path to it, at times)
        results = parse_results(run.results, len(checks))
        passed, lines = judge(task, checks, results, timed_out)
        # every check reported: the run is judged on that, and an OOM kill (a child or thread
        # still allocating when the last check returned, its kill counted once the results were
        # in) is noted, not read as the run's end. The note claims no order: where no OOM event
        # ends the run, the kill may have come during a check whose result still came. Not an
        # import that failed: the module's code ran then, and the kill may be what failed it
        all_in = "import" not in results and len(results) == len(checks)
        shown = _hide(run.output, hide).strip()
        if run.output_bytes > MAX_RAW_OUTPUT_BYTES:  # only its end was read
            cut = f"[... output cut: the run wrote {run.output_bytes:,} bytes; its end follows]"
            shown = f"{cut}\n{shown[-MAX_OUTPUT_CHARS:]}"
        elif len(shown) > MAX_OUTPUT_CHARS:
            shown = f"[... {len(shown) - MAX_OUTPUT_CHARS} characters cut]\n" + shown[-MAX_OUTPUT_CHARS:]
        limit = describe_bytes(self.memory_limit_bytes)
        if timed_out:
            lines.append(f"The test run timed out after {self.test_timeout_s:g} s.")
        if run.out_of_memory:
            lines.append(
                f"The test run ran out of memory: at most {limit} "
                "of address space per process (memory_limit_bytes)."
            )
        if run.memory_limit_hit and all_in:
            lines.append(
                "Every check reported its result; the test run's processes together also reached its "
                f"memory limit, {limit} (memory_limit_bytes, for the whole run), and the kernel killed "
                "one of them; the results stand."
            )
        elif run.memory_limit_hit:
            lines.append(
                "The test run was stopped at its memory limit: its processes together reached "
                f"{limit} (memory_limit_bytes, for the whole run), and the kernel killed one of them."
            )
        if run.container_memory_kill and all_in:
            lines.append(
                "Every check reported its result; the kernel also killed one of the test run's "
                "processes for the memory of its container, which ran short; the results stand."
            )
        elif run.container_memory_kill:
            lines.append(
                "The test run was stopped when the kernel killed one of its processes for the memory "
                f"of its container, which ran short (the run's own limit, {limit} together, was not "
                "reached)."
            )
        if run.process_limit_hit:
            lines.append(
                f"The test run hit its process limit: at most {self.max_processes} processes and "
                "threads at once (max_processes); a fork or a thread start failed."
            )
        report = _hide("\n".join(lines), hide)
        if shown:
            report += f"\nOutput of the run:\n{shown}"
        return passed, task.n_tests - passed, report, timed_out, run.isolation

    def _warn_if_reduced(self, isolation: dict[str, bool] | None) -> None:
        """One warning per env, at its first run that got less than its full isolation."""
        if isolation is None or all(isolation.values()) or self._warned_isolation:
            return
        self._warned_isolation = True
        missing = ", ".join(name for name, on in isolation.items() if not on)
        log.warning(
            "code-repair: a test run got less than its full isolation here (without: %s), a part "
            "the kernel or the container refused; each such run's info['isolation'] says so. "
            "See docs/envpool-new-env.md (Resources)",
            missing,
        )


def _hide(text: str, prefixes: list[str]) -> str:
    """``text`` without the work dir's location (so that episodes replay alike)."""
    for prefix in prefixes:
        text = text.replace(prefix + os.sep, "").replace(prefix, ".")
    return text


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
