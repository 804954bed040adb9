"""What test_code_verify_rpc.py and test_code_verify_rpc_channel.py share: the tests of
``add`` most cases use, and a verdict of one case."""

from __future__ import annotations

from functions.verifiers.sandbox import Limits
from functions.verifiers.verify import CodeTests, Verifier

TWO_ASSERTS = "assert add(2, 3) == 5\nassert add(1, 1) == 2\n"


def judge(verifier: Verifier, code: str, tests: str, limits: Limits | None = None):
    result = verifier.verify(code, CodeTests(test_code=tests), limits=limits)
    assert result.total == 1
    return result.cases[0]
