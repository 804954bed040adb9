"""The languages the code verifier runs, and how.

Python runs warm inside the zygote's interpreter. C, C++ and JavaScript are compiled (or
loaded) by their own toolchain inside the same sandbox; a language whose toolchain is not
installed is reported as unavailable rather than failing at run time.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import Literal

from fabric.config_messages import hint
from fabric.errors import Misconfigured
from functions.verifiers.sandbox import Limits


@dataclass(frozen=True)
class Language:
    name: str
    source_file: str
    #: command that turns ``source_file`` into ``artifact`` (None: interpreted)
    compile_argv: tuple[str, ...] | None = None
    artifact: str | None = None
    #: how a test case runs: "python" in the warm interpreter, or this argv
    mode: Literal["python", "exec"] = "exec"
    run_argv: tuple[str, ...] = ()
    #: what the toolchain needs beyond a test case's limits (V8 reserves address space up front)
    run_memory_floor_mb: int = 0
    run_nproc_floor: int = 0
    compile_limits: Limits = field(
        default_factory=lambda: Limits(cpu_s=20, wall_s=40, memory_mb=2048, nproc=64)
    )
    #: the stderr text its runtime prints when it runs out of memory
    oom_markers: tuple[bytes, ...] = ()
    #: the stderr text of a failed assertion (a test that failed, not a crash)
    assert_markers: tuple[bytes, ...] = ()
    aliases: tuple[str, ...] = ()

    def tool(self) -> str | None:
        """The toolchain binary, or None when it is not installed."""
        if self.mode == "python":
            return "python"
        binary = (self.compile_argv or self.run_argv)[0]
        return shutil.which(binary)

    def resolved(self, argv: tuple[str, ...]) -> list[str]:
        """``argv`` with its program made absolute (the sandbox has no PATH search of ours)."""
        first = shutil.which(argv[0]) if not argv[0].startswith(".") else argv[0]
        return [first or argv[0], *argv[1:]]


LANGUAGES: dict[str, Language] = {
    lang.name: lang
    for lang in (
        Language(
            name="python",
            source_file="solution.py",
            mode="python",
            oom_markers=(b"MemoryError",),
            assert_markers=(b"\nAssertionError",),
            aliases=("py", "python3"),
        ),
        Language(
            name="c",
            source_file="main.c",
            compile_argv=("gcc", "-O2", "-std=gnu17", "-o", "main", "main.c", "-lm"),
            artifact="main",
            run_argv=("./main",),
            oom_markers=(b"Cannot allocate memory",),
            assert_markers=(b"Assertion `",),
        ),
        Language(
            name="cpp",
            source_file="main.cpp",
            compile_argv=("g++", "-O2", "-std=gnu++17", "-o", "main", "main.cpp"),
            artifact="main",
            run_argv=("./main",),
            oom_markers=(b"std::bad_alloc",),
            assert_markers=(b"Assertion `",),
            aliases=("c++", "cxx"),
        ),
        Language(
            name="javascript",
            source_file="main.js",
            run_argv=("node", "main.js"),
            run_memory_floor_mb=4096,
            run_nproc_floor=32,
            oom_markers=(b"JavaScript heap out of memory", b"Fatal process OOM"),
            assert_markers=(b"AssertionError",),
            aliases=("js", "node"),
        ),
    )
}
_ALIASES = {alias: lang for lang in LANGUAGES.values() for alias in (lang.name, *lang.aliases)}


def get_language(name: str) -> Language:
    """The language called ``name`` (or an alias); ``ValueError`` lists the known ones."""
    lang = _ALIASES.get(name.strip().lower())
    if lang is None:
        near = hint(name.strip().lower(), sorted(_ALIASES))
        raise ValueError(
            f"unknown language {name!r}{near}; the code verifier runs: {', '.join(sorted(LANGUAGES))}"
        )
    if lang.tool() is None:
        binary = (lang.compile_argv or lang.run_argv)[0]
        # the worker's setup, not the submission's: Misconfigured, which no failure_score scores
        raise Misconfigured(
            f"language {lang.name!r} needs {binary!r}, which is not installed on this worker; install "
            "it there (or leave this language's tasks out)"
        )
    return lang
