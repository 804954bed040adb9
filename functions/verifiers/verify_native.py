"""The C and C++ assert-style tests' steps of ``Verifier`` (``c_asserts="apart"``): the
program's declarations read by libclang in the sandbox, stubs rendered for the tests, both
compiles (precompiled headers, the tests' binaries cached), the refusals by name (a
library's function, a name the tests' headers declare too), then the pair's run. A mixin, so
that ``verify.py`` keeps the languages' shared path; the design is in docs/code-verifier.md.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from fabric.errors import Misconfigured
from functions.verifiers import native, native_collide, native_link, native_pch
from functions.verifiers.errors import InvalidTests, SandboxError
from functions.verifiers.languages import Language
from functions.verifiers.sandbox import Limits, RunOutcome
from functions.verifiers.verdicts import CaseResult, classify, classify_pair

if TYPE_CHECKING:
    from functions.verifiers.verify import Runner

T = TypeVar("T")


class NativeAsserts:
    """What ``Verifier`` gives these steps: its sandbox, its case threads, the tests'
    binaries it keeps, its compile and run."""

    sandbox: Runner
    _cases: ThreadPoolExecutor
    _tests_binaries: int
    _tests_cache: OrderedDict[bytes, dict[str, bytes]]
    _tests_lock: threading.Lock

    if TYPE_CHECKING:

        def _compile(
            self,
            lang: Language,
            files: dict[str, bytes],
            argv: tuple[str, ...] | None = None,
            artifact: str | None = None,
        ) -> tuple[CaseResult, dict[str, bytes]]: ...

        def _run(
            self,
            argv: list[str],
            files: dict[str, bytes],
            stdin: bytes,
            limits: Limits,
            collect: tuple[str, ...] = (),
            executable: tuple[str, ...] = (),
            marker: str | None = None,
        ) -> RunOutcome: ...

    def _native_tests(
        self, lang: Language, code: str, test_code: str, limits: Limits
    ) -> tuple[CaseResult | None, CaseResult]:
        """C's or C++'s assert-style tests in a sandbox of their own, calling the program's
        functions through stubs (``functions.verifiers.native``): the compile's verdict and
        the case's."""
        if not native.available():
            raise ValueError(
                "C and C++ assert-style tests need libclang to read the program's declarations:"
                " pip install 'rl-fabric[verifiers]' (or CodeTests(c_asserts='in_process'), which a"
                " program can forge)"
            )
        with contextlib.ExitStack() as held:  # libclang's precompiled header, until the read ends
            pch = self._clang_pch(lang.name, code, held)
            parsed = self._attempt(
                lambda: self.sandbox.run(
                    mode="python",
                    entry="cdecls.py",
                    files=native.parse_files(lang.name, code, pch),
                    limits=native.read_limits(lang.compile_limits, pch),
                )
            )
        if isinstance(parsed, CaseResult):
            return None, parsed
        if parsed.exit_code == native.NO_LIBCLANG and native.NO_LIBCLANG_LINE in parsed.stderr:
            # the worker's setup, not the program's fault: no score
            # the import's error from cdecls.py's own line, without the marker or its newline
            line = parsed.stderr.split(native.NO_LIBCLANG_LINE, 1)[1].splitlines()[:1]
            why = (line[0] if line else b"").decode(errors="replace").strip()[:300]
            raise Misconfigured(
                f"the sandbox's Python cannot import libclang: {why}; install libclang for the "
                "Python the sandbox runs"
            )
        instead = (
            "judge this task with stdin/stdout cases (or c_asserts='in_process', which a program can forge)"
        )
        try:
            if parsed.status != "exited" or parsed.exit_code != 0:
                why = classify(parsed, lang, lang.compile_limits, None).message
                raise native.BadDeclarations(why or "it printed nothing")
            plan = native.plan(json.loads(parsed.stdout), lang.name, test_code)
        except native.Unsupported as e:
            return None, CaseResult(status="RuntimeError", message=f"not run: {e}; {instead}")
        except (native.BadDeclarations, ValueError) as e:  # the program's text, not ours
            msg = f"not run: the program's declarations could not be read: {str(e)[:300]}"
            return None, CaseResult(status="RuntimeError", message=msg)
        tests_argv = native.tests_compile_argv(lang)
        # a function the tests call that a library of their binary defines too: its stub is a
        # variable, and tests that declare the library's function do not compile (native_link)
        link = (tests_argv[0], *(a for a in tests_argv if a.startswith("-l")))
        library = frozenset(native_link.library_names(link, [f.name for f in plan.functions]))
        if lang.name == "c" and (c_refused := native_link.c_refusal(library)) is not None:
            return None, CaseResult(status="RuntimeError", message=f"not run: {c_refused}; {instead}")
        ext = "cpp" if lang.name == "cpp" else "c"
        head = dict([native.header(lang.name)])
        tests_src = native.tests_source(lang.name, test_code, plan, library).encode()
        program_argv = lang.compile_argv
        with contextlib.ExitStack() as held:  # the precompiled headers, until both compiles end
            if lang.name == "cpp" and "bits/stdc++.h" in plan.includes and self._pch_shared():
                tests_argv = self._with_pch(tests_argv, "tests", held) or tests_argv
                program_argv = self._with_pch(program_argv, "program", held)
            tests_job = self._cases.submit(
                self._compile_tests, lang, {**head, f"tests.{ext}": tests_src}, tests_argv
            )
            if plan.functions:
                program_src = native.program_source(lang.name, code, plan).encode()
                compiled, program = self._compile(lang, {**head, lang.source_file: program_src}, program_argv)
            else:  # a function the tests call is missing (their compile says which), or none is
                compiled, program = CaseResult(status="Finished"), {}
            tests_compiled, tests = tests_job.result()
            refused_std = None
            if lang.name == "cpp" and tests_compiled.status == "Finished" and compiled.status == "Finished":
                refused_std = self._collides(lang, test_code, plan, library, tests_argv)
        if isinstance(refused_std, CaseResult):
            return None, refused_std
        if refused_std is not None:  # a name the tests' headers declare too (std's)
            return None, CaseResult(status="RuntimeError", message=f"not run: {refused_std}; {instead}")
        if not plan.functions and tests_compiled.status == "Finished":
            # they compile without any function of the program: they cannot judge it
            raise InvalidTests("the tests call none of the program's functions: they cannot judge it")
        refused = None
        if tests_compiled.status == "RuntimeError":
            refused = native_link.refusal(library, tests_compiled.stderr) or native.refusal(
                plan, tests_compiled.stderr
            )
        if refused is not None:  # a library's function, or a variable or type of the program's
            return None, CaseResult(status="RuntimeError", message=f"not run: {refused}; {instead}")
        if compiled.status != "Finished":
            return compiled, CaseResult(
                status=compiled.status, message="not run: the program did not compile"
            )
        if tests_compiled.status != "Finished":
            failed = tests_compiled.model_copy(
                update={
                    "message": "the tests did not compile with the program's functions: "
                    + tests_compiled.message
                }
            )
            return failed, CaseResult(
                status=tests_compiled.status, message="not run: the tests did not compile"
            )
        pair = self._attempt(
            lambda: self.sandbox.run_pair(
                files=program,
                entry="main",
                test_files=tests,
                test_entry="tests",
                limits=limits,
                argv=["./main"],
                test_argv=["./tests"],
                executable=("main",),
                test_executable=("tests",),
            )
        )
        return compiled, pair if isinstance(pair, CaseResult) else classify_pair(pair, lang, limits)

    def _collides(
        self,
        lang: Language,
        test_code: str,
        plan: native.Plan,
        library: frozenset[str],
        argv: tuple[str, ...],
    ) -> str | CaseResult | None:
        """Why the C++ tests are refused: a function of the program they call has a name
        their headers declare too, and some call of it compiles without its stub, so it
        means that other one (``native_collide``); a case if the check could not run."""
        names = [f.name for f in plan.functions]
        prelude = native.names_prelude(plan, test_code)
        if prelude is not None:  # else: a header of theirs not read on the host: check all
            flags = tuple(a for a in argv[1 : argv.index("-o")] if a.startswith("-std="))
            declared = native_collide.declared_names(argv[0], flags, prelude, str(native.NATIVE))
            names = [n for n in names if n in declared]
        head = dict([native.header(lang.name)])
        # the tests' own argv (their precompiled header too), checked only: nothing is built
        at = argv.index("-o")
        syntax = (*argv[:at], "-fsyntax-only", *argv[at + 2 :])
        for name in names:
            src = native.tests_source(lang.name, test_code, plan, library, omit=name).encode()
            key = native_collide.verdict_key(syntax, name, src)
            known, why = native_collide.checked(key)
            if known:
                if why is not None:
                    return why
                continue
            files = {**head, "tests.cpp": src}
            out = self._attempt(
                functools.partial(self._run, lang.resolved(syntax), files, b"", lang.compile_limits)
            )
            if isinstance(out, CaseResult):
                return out
            if out.status != "exited":
                return CaseResult(
                    status="SandboxError",
                    message=f"the tests' compile without the stub of {name!r} did not finish: {out.status}",
                )
            why = native_collide.refusal(name, out.exit_code, out.stderr.decode(errors="replace"), test_code)
            native_collide.remember(key, why)
            if why is not None:
                return why
        return None

    def _pch_shared(self) -> bool:
        """Whether every run of the sandbox sees ``native_pch.PCH_DIR`` (read-only)."""
        return native_pch.PCH_DIR in str(getattr(self.sandbox, "shared", "")).split(",")

    def _clang_pch(self, lang: str, code: str, held: contextlib.ExitStack) -> str | None:
        """The ``.pch`` the read of ``code`` may start from (held until ``held`` closes), or
        None: a program that may include ``<bits/stdc++.h>``, where the runs see it."""
        if not native.wants_clang_pch(lang, code) or not self._pch_shared():
            return None
        path = native_pch.clang_header(native.CLANG_PCH_TEXT, native.parse_args(lang))
        if path is None or not native_pch.hold(path, held, ".pch"):
            return None
        return path + ".pch"

    @staticmethod
    def _with_pch(
        argv: tuple[str, ...] | None, side: str, held: contextlib.ExitStack
    ) -> tuple[str, ...] | None:
        """``argv`` with the precompiled header of its side first, where it can be built
        (held until ``held`` closes: no cleanup removes it under the compile)."""
        if argv is None or "-o" not in argv:
            return argv
        flags = argv[1 : argv.index("-o")]
        path = native_pch.header(native.pch_text(side), argv[0], flags)
        if path is None or not native_pch.hold(path, held):
            return argv
        return (argv[0], "-include", path, *argv[1:])

    def _compile_tests(
        self, lang: Language, files: dict[str, bytes], argv: tuple[str, ...]
    ) -> tuple[CaseResult, dict[str, bytes]]:
        """The tests' compile, or the binary an earlier one made of the same files and
        argv (only a success is kept: a compile the machine's load timed out is not the
        source's verdict)."""
        key = hashlib.sha256(
            json.dumps([argv, sorted((k, v.hex()) for k, v in files.items())]).encode()
        ).digest()
        with self._tests_lock:
            hit = self._tests_cache.get(key)
            if hit is not None:
                self._tests_cache.move_to_end(key)
                return CaseResult(status="Finished"), hit
        compiled, binary = self._compile(lang, files, argv, "tests")
        if compiled.status == "Finished" and self._tests_binaries > 0:
            with self._tests_lock:
                self._tests_cache[key] = binary
                while len(self._tests_cache) > self._tests_binaries:
                    self._tests_cache.popitem(last=False)
        return compiled, binary

    @staticmethod
    def _attempt(run: Callable[[], T]) -> T | CaseResult:
        """``run()``, once more on a fresh sandbox if the sandbox failed; a ``SandboxError``
        case if it failed twice."""
        try:
            return run()
        except SandboxError:
            pass  # once more, below, on a fresh sandbox
        try:
            return run()
        except SandboxError as e:
            return CaseResult(status="SandboxError", message=str(e))
