"""What test_code_verify_native.py and test_code_verify_native_decls.py share: a verdict,
a check that a program passes, and the tests of ``add`` with an honest program for them."""

from __future__ import annotations

from functions.verifiers.verify import CodeTests, Verifier


def run(v: Verifier, code: str, test_code: str, lang: str = "cpp"):
    return v.verify(code, CodeTests(test_code=test_code), lang)


def passes(v: Verifier, code: str, test_code: str, lang: str = "cpp") -> None:
    r = run(v, code, test_code, lang)
    assert r.status == "Finished", (r.compile, r.cases[0])


ADD_TESTS = {
    "cpp": "#include <cassert>\nint main() { assert(add(2, 3) == 5); assert(add(1, 1) == 2); return 0; }",
    "c": "#include <assert.h>\nint main(void) { assert(add(2, 3) == 5); assert(add(1, 1) == 2); return 0; }",
}
HONEST_ADD = "int add(int a, int b) { return a + b; }\n"
