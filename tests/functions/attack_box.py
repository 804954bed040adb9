"""What the attack modules (``test_sandbox_attacks_*.py``) share: their marks, and a module's
sandbox with the checks after every attack, in the module's own uid range (its ``BASE_UID``).

The attacks: hostile programs run for real, containment checked from outside. Every test is
one attack, and passes when it is contained (the review that wrote them found 16 holes; each
is fixed and its test passes). A hole found later belongs in these modules as an
``xfail(strict=True, reason="HOLE: ...")`` test until it is fixed. Each module's runs use a
uid range of its own (340 000, 360 000, 370 000 up), apart from the other sandbox suites and
from each other: ``make test`` may run two of them at once, on two workers.

Attacks that leave something behind on purpose (a stuck run, a leaked uid slot) get a
sandbox of their own (``own_sandbox``), closed (and checked clean) at the end of the test;
closing the sandbox ends whatever a hole left, and orphaned run PID 1s (see
test_sandbox_lifecycle.py) are killed by pid, so the suite leaves nothing running. The
programs call x86_64 syscall numbers directly (clone, keyctl, add_key, userfaultfd).

Each module binds the two fixtures::

    sandbox = pytest.fixture(module_sandbox, scope="module", name="sandbox")
    sb = pytest.fixture(after_each_attack, name="sb")
"""

from __future__ import annotations

import platform
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_probe import (
    FAST,
    GOOD,
    kill_orphaned_inits,
    live_in_range,
    settled_runs,
    wait_clean,
    wait_no_live,
)

from functions.verifiers import _linux
from functions.verifiers.sandbox import Sandbox, SandboxConfig

MARKS = [
    pytest.mark.skipif(_linux.supported() is not None, reason=str(_linux.supported())),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the attacks use x86_64 syscall numbers"),
]


def module_sandbox(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    base = request.module.BASE_UID
    with Sandbox(SandboxConfig(base_uid=base, spares=2, grace_s=2.0)) as sb:
        yield sb
    kill_orphaned_inits(base)
    assert wait_clean(base) == []
    assert live_in_range(base) == [] or wait_no_live(base)


def after_each_attack(sandbox: Sandbox, request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    """After every attack: nothing of it survives, the host's mounts are unchanged, the
    zygote has its spares back, and a good program is still judged right."""
    base = request.module.BASE_UID
    mounts_before = Path("/proc/self/mountinfo").read_text()
    yield sandbox
    assert wait_clean(base) == [], "processes of a finished run survived"
    assert Path("/proc/self/mountinfo").read_text() == mounts_before, "a run changed the host's mounts"
    assert sandbox._zygote is not None
    assert settled_runs(sandbox._zygote.pid, 2) == 2, "a run's namespace is stuck (uid slot leaked)"
    out = sandbox.run_python(GOOD, stdin=b"20 22\n", limits=FAST)
    assert (out.status, out.stdout) == ("exited", b"42\n")
