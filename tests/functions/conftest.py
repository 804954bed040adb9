"""Fixtures the assert-style verifier modules share: a module's sandbox and a checked
verifier per test, in the module's own uid range (``BASE_UID``) with its ``LIMITS``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sandbox_probe import checked_verifier, pair_sandbox

from functions.verifiers.sandbox import Sandbox
from functions.verifiers.verify import Verifier


@pytest.fixture(scope="module")
def pair_box(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    yield from pair_sandbox(request.module.BASE_UID)


@pytest.fixture
def pair_verifier(pair_box: Sandbox, request: pytest.FixtureRequest) -> Iterator[Verifier]:
    yield from checked_verifier(pair_box, request.module.BASE_UID, request.module.LIMITS)
