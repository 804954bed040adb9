"""Judging programs: run a submission against its test cases and say what happened.

Two kinds of tests: stdin/stdout cases (each case is a fresh run; the output is compared
line by line, trailing whitespace ignored) and assert-style test code (run once; it passes
when it runs to its end). Python's and JavaScript's assert-style tests run in a sandbox of
their own, next to the program's, and see the program only through values
(``Sandbox.run_pair``, ``functions.verifiers.rpc``, ``functions/verifiers/js``), and so do
C and C++ tests: they call the program's functions through stubs (``functions.verifiers.native``).
Only with ``c_asserts="in_process"`` are C and C++ tests appended to the submission, proving
they ran to their end with a marker line (which a program can forge: docs/code-verifier.md).
Every case gets one status:

    Finished              ran and produced the expected output (or its asserts held)
    Failed                ran and produced something else (or an assertion failed)
    TimeLimitExceeded     CPU or wall-clock limit (or not run: past ``Verifier.budget_s``)
    MemoryLimitExceeded   the runtime ran out of memory under the address-space limit
    RuntimeError          crashed, exited non-zero, wrote past the stdout (or channel) cap, did not compile,
                          or was too long to run (over ``MAX_CODE_BYTES``)
    SandboxError          the sandbox failed, not the program: the only retryable status

A case that hits a ``SandboxError`` is retried once on a fresh sandbox before it is reported.
Python or JavaScript tests that cannot judge any program (they ran nothing, see
``functions.verifiers.rpc_collect``; they do not compile; JavaScript's never used the
program) get no status: ``verify`` raises ``InvalidTests``.
"""

from __future__ import annotations

import atexit
import functools
import json
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from functions.verifiers import rpc
from functions.verifiers.errors import SandboxError
from functions.verifiers.languages import Language, get_language
from functions.verifiers.sandbox import Limits, PairOutcome, RunOutcome, Sandbox
from functions.verifiers.verdicts import SEVERITY, CaseResult, Status, classify, classify_pair
from functions.verifiers.verify_native import NativeAsserts

MAX_CODE_BYTES = 256 * 1024
MAX_CASES = 512
#: How long one ``verify`` may take (``Verifier.budget_s``): under ``code_verify``'s 120 s
#: timeout, which kills the worker, its zygote with it, and retries the call.
BUDGET_S = 100.0
#: The languages whose assert-style tests run in a sandbox of their own (``Sandbox.run_pair``).
PAIRED = frozenset(("python", "javascript"))


class StdioCase(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stdin: str = ""
    expected_stdout: str = Field(..., description="compared line by line, trailing whitespace ignored")


class CodeTests(BaseModel):
    """Exactly one of ``cases`` (stdin/stdout) or ``test_code`` (assert-style)."""

    model_config = ConfigDict(extra="forbid")
    cases: list[StdioCase] | None = Field(None, max_length=MAX_CASES)
    test_code: str | None = Field(None, max_length=MAX_CODE_BYTES)
    entry_point: str | None = Field(None, max_length=200)
    """Python ``test_code`` only: the program's function that HumanEval-style tests check.
    If they define ``check(candidate)`` and never call it, the verifier calls
    ``check(<entry_point>)`` (the program's, never a function of the tests of that name)."""
    c_asserts: Literal["apart", "in_process"] = "apart"
    """C and C++ ``test_code``: ``"apart"`` runs the tests in a sandbox of their own, calling
    the program's functions through stubs (tests that use a declaration the channel cannot
    carry are not run: the case says which); ``"in_process"`` appends the tests to the
    program, as before, where a program can forge a pass (docs/code-verifier.md): only for
    tests that need more, and never against a policy that may learn to forge."""

    @model_validator(mode="after")
    def _one_kind(self) -> CodeTests:
        if (self.cases is None) == (self.test_code is None):
            raise ValueError(
                "give exactly one of cases=[{stdin, expected_stdout}, ...] or test_code='assert ...'"
            )
        if self.cases is not None and not self.cases:
            raise ValueError("cases is empty: a submission with no test cases cannot be judged")
        if self.entry_point is not None:
            if self.test_code is None:
                raise ValueError("entry_point goes with test_code (the function its check(candidate) checks)")
            if not self.entry_point.isidentifier():
                raise ValueError(f"entry_point {self.entry_point!r:.60} is not a Python name")
        if self.c_asserts != "apart" and self.test_code is None:
            raise ValueError("c_asserts goes with test_code (C and C++ assert-style tests)")
        return self


class VerifyResult(BaseModel):
    status: Status
    passed: int
    total: int
    pass_fraction: float
    language: str
    compile: CaseResult | None = None
    cases: list[CaseResult]
    total_ms: float

    @property
    def retryable(self) -> bool:
        return self.status == "SandboxError"


class Runner(Protocol):
    """What runs one program: a ``Sandbox`` (or the benchmark's subprocess baseline)."""

    def run(
        self,
        *,
        mode: Literal["python", "exec"],
        files: dict[str, bytes] | None = None,
        entry: str | None = None,
        argv: list[str] | None = None,
        stdin: bytes = b"",
        limits: Limits | None = None,
        executable: tuple[str, ...] = (),
        collect: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        marker: str | None = None,
    ) -> RunOutcome: ...

    def run_pair(
        self,
        *,
        files: dict[str, bytes],
        entry: str,
        test_files: dict[str, bytes],
        test_entry: str,
        limits: Limits | None = None,
        argv: list[str] | None = None,
        test_argv: list[str] | None = None,
        executable: tuple[str, ...] = (),
        test_executable: tuple[str, ...] = (),
    ) -> PairOutcome: ...


#: The marker the supervisor leaves on fd 3 (after the start message); a harness reads it
#: only once the tests ran, so it is in no source, argv, environment or binary of the run.
_C_WRAPPER = """
#undef main
#include <stdio.h>
int main(void) {
    /* unprototyped call: works for main(void) and main(int, char **) alike */
    int rc = ((int (*)())__rlfabric_tests_main)();
    char __rlfabric_m[80];
    FILE *__rlfabric_f = rc == 0 ? fdopen(3, "r") : NULL;
    if (__rlfabric_f && fgets(__rlfabric_m, sizeof __rlfabric_m, __rlfabric_f)) {
        printf("\\n%s", __rlfabric_m); fflush(stdout);
    }
    return rc;
}
"""
_CPP_WRAPPER = """
#undef main
#include <cstdio>
template <class R, class... A> static int __rlfabric_call(R (*f)(A...)) {
    if constexpr (sizeof...(A) == 0) return f(); else return f(0, nullptr);
}
int main() {
    int rc = __rlfabric_call(&__rlfabric_tests_main);
    char m[80];
    std::FILE *f = rc == 0 ? fdopen(3, "r") : nullptr;
    if (f && std::fgets(m, sizeof m, f)) { std::printf("\\n%s", m); std::fflush(stdout); }
    return rc;
}
"""
#: Appended to a JavaScript program whose tests run apart: once its top-level code ran, it
#: answers their requests; the function evaluates a name in the program's module scope,
#: where its const, let, class and function declarations live (``js/rpc_server.js``).
JS_SERVE = (
    '\n;require("./rpc_server.js").serve((__rlfabric_n, __rlfabric_v, __rlfabric_set) =>'
    ' __rlfabric_set ? eval(__rlfabric_n + " = __rlfabric_v") : eval(__rlfabric_n));\n'
)


@functools.cache
def js_files() -> dict[str, bytes]:
    """The JavaScript side of the pair (``functions/verifiers/js``): wire, server, harness."""
    here = Path(__file__).with_name("js")
    return {name: (here / name).read_bytes() for name in ("rpc_wire.js", "rpc_server.js", "rpc_harness.js")}


def with_tests(lang: Language, code: str, test_code: str) -> str:
    """The program with its assert-style tests appended and, after them, what prints the
    run's marker (C and C++; Python's and JavaScript's tests run apart, see
    ``Sandbox.run_pair``)."""
    if lang.name in PAIRED:
        raise ValueError(f"{lang.name}'s assert-style tests run in a sandbox of their own (Sandbox.run_pair)")
    wrapper = _CPP_WRAPPER if lang.name == "cpp" else _C_WRAPPER
    return f"{code}\n#define main __rlfabric_tests_main\n{test_code}\n{wrapper}"


class Verifier(NativeAsserts):
    """Runs submissions in a ``Sandbox``. Thread-safe; one per worker."""

    def __init__(
        self,
        sandbox: Runner,
        limits: Limits | None = None,
        parallel: int = 4,
        tests_binaries: int = 128,
        budget_s: float = BUDGET_S,
    ) -> None:
        """``tests_binaries``: how many compiled C/C++ tests' binaries to keep (0: none).
        The tests' source is the test code and stubs rendered from the program's validated
        signature, with none of its text: in RL, every sample of a prompt that declares
        the function alike gets the same source, and compiles it once.

        ``budget_s``: how long one ``verify`` may take, compile included: a stdin/stdout case
        that could not end by then at its wall limit is not run, and judged
        ``TimeLimitExceeded`` (each case's limits bound that case only)."""
        self.sandbox = sandbox
        self.limits = limits or Limits()
        self.budget_s = budget_s
        self._cases = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="verify-case")
        self._tests_binaries = tests_binaries
        self._tests_cache: OrderedDict[bytes, dict[str, bytes]] = OrderedDict()
        self._tests_lock = threading.Lock()

    def verify(
        self, code: str, tests: CodeTests, language: str = "python", limits: Limits | None = None
    ) -> VerifyResult:
        """Judge ``code``. Bad input from the caller (an unknown language) raises
        ``ValueError``, and so do Python or JavaScript tests that cannot judge any program
        (``InvalidTests``: they ran nothing); a program too long to run is the program's
        fault, judged 0."""
        t0 = time.monotonic()
        lang = get_language(language)
        if tests.entry_point is not None and lang.name != "python":
            raise ValueError("entry_point is for Python test_code (HumanEval's check(candidate))")
        size = len(code.encode())
        if size > MAX_CODE_BYTES:
            # the policy wrote it: a score of 0, not an error that would mask the trajectory
            too_long = CaseResult(
                status="RuntimeError", message=f"not run: program too long: {size} bytes > {MAX_CODE_BYTES}"
            )
            return self._result(lang, None, [too_long] * len(tests.cases or [None]), t0)
        limits = limits or self.limits
        if limits.wall_s > self.budget_s:
            raise ValueError(
                f"limits.wall_s {limits.wall_s:g} s is over the verifier's budget_s {self.budget_s:g} s: "
                "no case could run"
            )
        deadline = t0 + self.budget_s
        if tests.test_code is not None and lang.name in PAIRED:
            case = self._pair_tests(lang, code, tests.test_code, tests.entry_point, limits)
            return self._result(lang, None, [case], t0)
        if tests.test_code is not None and tests.c_asserts == "apart":
            compiled_case, case = self._native_tests(lang, code, tests.test_code, limits)
            return self._result(lang, compiled_case, [case], t0)
        # c_asserts="in_process": the tests passed only if the program also ran past them,
        # which a random line printed after them proves (an early exit(0) would skip the
        # asserts; a program that reads fd 3 forges it: docs/code-verifier.md)
        marker = None if tests.test_code is None else f"rlfabric-tests-done-{secrets.token_hex(8)}"
        source = code if tests.test_code is None else with_tests(lang, code, tests.test_code)
        files = {lang.source_file: source.encode()}
        compiled = None
        if lang.compile_argv is not None:
            compiled = self._compile(lang, files)
            if compiled[0].status != "Finished":
                n = len(tests.cases or [None])
                skipped = CaseResult(
                    status=compiled[0].status, message="not run: the program did not compile"
                )
                return self._result(lang, compiled[0], [skipped] * n, t0)
            files = compiled[1]
        expected_list: list[str | None] = [c.expected_stdout for c in tests.cases] if tests.cases else [None]
        stdins = [c.stdin for c in tests.cases] if tests.cases else [""]
        # cases are independent runs: in parallel, as many at once as there are warm sandboxes
        results = list(
            self._cases.map(
                lambda s, e: self._case(lang, files, s.encode(), e, limits, marker, deadline),
                stdins,
                expected_list,
            )
        )
        return self._result(lang, compiled[0] if compiled else None, results, t0)

    def _compile(
        self,
        lang: Language,
        files: dict[str, bytes],
        argv: tuple[str, ...] | None = None,
        artifact: str | None = None,
    ) -> tuple[CaseResult, dict[str, bytes]]:
        argv, artifact = argv or lang.compile_argv, artifact or lang.artifact
        assert argv is not None and artifact is not None
        try:
            out = self._run(lang.resolved(argv), files, b"", lang.compile_limits, collect=(artifact,))
        except SandboxError as e:
            return CaseResult(status="SandboxError", message=str(e)), {}
        verdict = classify(out, lang, lang.compile_limits, None)
        if verdict.status == "Finished" and artifact not in out.files:
            verdict = verdict.model_copy(
                update={"status": "RuntimeError", "message": "the compiler produced nothing"}
            )
        elif verdict.status != "Finished":
            verdict = verdict.model_copy(
                update={"status": "RuntimeError", "message": "compile error: " + verdict.message}
            )
        return verdict, {artifact: out.files.get(artifact, b"")}

    def _pair_tests(
        self, lang: Language, code: str, test_code: str, entry_point: str | None, limits: Limits
    ) -> CaseResult:
        """Python's or JavaScript's assert-style tests, in a sandbox of their own next to the
        program's (``Sandbox.run_pair``)."""
        argv = test_argv = None
        run_limits = limits
        if lang.name == "javascript":
            js = js_files()
            files = {
                lang.source_file: (code + JS_SERVE).encode(),
                "rpc_wire.js": js["rpc_wire.js"],
                "rpc_server.js": js["rpc_server.js"],
            }
            entry, test_entry = lang.source_file, "tests.js"
            test_files = {"tests.js": test_code.encode(), "rpc_wire.js": js["rpc_wire.js"]}
            test_files["rpc_harness.js"] = js["rpc_harness.js"]
            run_limits, node = _runtime(lang, limits)
            argv = lang.resolved((*node, entry))
            test_argv = lang.resolved((*node, "rpc_harness.js", test_entry))
        else:
            files, entry = {"solution.py": code.encode()}, "solution.py"
            test_files, test_entry = {"tests.py": test_code.encode()}, "tests.py"
            if entry_point is not None:  # the harness's options, beside the tests
                test_files[rpc.TEST_OPTIONS] = json.dumps({"entry_point": entry_point}).encode()
        last = None
        for _ in range(2):
            try:
                pair = self.sandbox.run_pair(
                    files=files,
                    entry=entry,
                    test_files=test_files,
                    test_entry=test_entry,
                    limits=run_limits,
                    argv=argv,
                    test_argv=test_argv,
                )
            except SandboxError as e:
                last = CaseResult(status="SandboxError", message=str(e))
                continue
            return classify_pair(pair, lang, limits)
        assert last is not None
        return last

    def _case(
        self,
        lang: Language,
        files: dict[str, bytes],
        stdin: bytes,
        expected: str | None,
        limits: Limits,
        marker: str | None = None,
        deadline: float = float("inf"),
    ) -> CaseResult:
        if time.monotonic() + limits.wall_s > deadline:
            budget = f"{self.budget_s:g} s budget"
            return CaseResult(
                status="TimeLimitExceeded",
                message=f"not run: a {limits.wall_s:g} s case would end past the verification's {budget} "
                "(the others used it)",
            )
        if expected is not None:
            # the right answer must fit under the stdout cap, or it is killed at the cap: room
            # for twice its size (what is not compared, trailing blanks and \r, may double it)
            room = 2 * len(expected.encode()) + 4096
            if room > limits.stdout_bytes:
                limits = limits.model_copy(update={"stdout_bytes": room})
        run_limits, runtime = _runtime(lang, limits)
        argv = [*runtime, *lang.run_argv[1:]]
        last = None
        for _ in range(2):
            try:
                if lang.mode == "python":
                    out = self.sandbox.run(
                        mode="python",
                        entry=lang.source_file,
                        files=files,
                        stdin=stdin,
                        limits=run_limits,
                        marker=marker,
                    )
                else:
                    out = self._run(
                        lang.resolved(tuple(argv)),
                        files,
                        stdin,
                        run_limits,
                        executable=(lang.artifact or "",),
                        marker=marker,
                    )
            except SandboxError as e:
                last = CaseResult(status="SandboxError", message=str(e))
                continue
            return classify(out, lang, limits, expected, marker)
        assert last is not None
        return last

    def _run(
        self,
        argv: list[str],
        files: dict[str, bytes],
        stdin: bytes,
        limits: Limits,
        collect: tuple[str, ...] = (),
        executable: tuple[str, ...] = (),
        marker: str | None = None,
    ) -> RunOutcome:
        return self.sandbox.run(
            mode="exec",
            argv=argv,
            files=files,
            stdin=stdin,
            limits=limits,
            collect=collect,
            executable=executable,
            marker=marker,
        )

    @staticmethod
    def _result(
        lang: Language, compiled: CaseResult | None, cases: list[CaseResult], t0: float
    ) -> VerifyResult:
        passed = sum(c.status == "Finished" for c in cases)
        worst = min((c.status for c in cases), key=SEVERITY.index)
        return VerifyResult(
            status=worst,
            passed=passed,
            total=len(cases),
            pass_fraction=passed / len(cases),
            language=lang.name,
            compile=compiled,
            cases=cases,
            total_ms=round((time.monotonic() - t0) * 1000, 3),
        )


def _runtime(lang: Language, limits: Limits) -> tuple[Limits, list[str]]:
    """A run's limits and the start of its command (``run_argv[0]`` and its flags)."""
    if not (lang.run_memory_floor_mb or lang.run_nproc_floor):
        return limits, list(lang.run_argv[:1])
    # V8 reserves gigabytes of address space up front: its RLIMIT_AS is raised, and the run's
    # memory cgroup (plus the heap flag, for a clear message) bounds what it uses
    raised = limits.model_copy(
        update={
            "address_space_mb": max(limits.memory_mb, lang.run_memory_floor_mb),
            "nproc": max(limits.nproc, lang.run_nproc_floor),
        }
    )
    return raised, [lang.run_argv[0], f"--max-old-space-size={limits.memory_mb}"]


_default: Verifier | None = None
_default_lock = threading.Lock()


def default_verifier() -> Verifier:
    """The worker's shared verifier (one zygote serves every function of the process)."""
    global _default
    with _default_lock:
        if _default is None:
            sandbox = Sandbox()
            sandbox.start()
            atexit.register(sandbox.close)
            _default = Verifier(sandbox)
        return _default
