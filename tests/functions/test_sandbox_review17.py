"""What a run sees of its cores and of its process group, against what the same program sees
on a host (review 17)."""

from __future__ import annotations

import ast
import os
import shutil
import signal
from collections.abc import Iterator

import pytest
from sandbox_probe import wait_clean

from functions.verifiers import _linux
from functions.verifiers.sandbox import Limits, Sandbox, SandboxConfig

pytestmark = pytest.mark.skipif(_linux.supported() is not None, reason=str(_linux.supported()))

BASE_UID = 480_000  # apart from the other sandbox modules' (470_000, and 500_000 up)
LIMITS = Limits(cpu_s=2, wall_s=10, memory_mb=256)
HOST_CORES = sorted(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def one_core() -> Iterator[Sandbox]:
    """Runs of one core each: on this (small) machine, fewer than the host has."""
    with Sandbox(SandboxConfig(base_uid=BASE_UID, spares=1, cpus=1)) as sb:
        yield sb
    assert wait_clean(BASE_UID) == []


def run(box: Sandbox, code: str, limits: Limits = LIMITS) -> tuple[str, str]:
    out = box.run_python(code, limits=limits)
    return out.stdout.decode().strip(), f"{out.status} {out.exit_code} {out.stderr.decode()[-2000:]}"


# -- cores -----------------------------------------------------------------------------------
AFFINITY = (
    "import os, subprocess, sys\n"
    "print(sorted(os.sched_getaffinity(0)))\n"
    "child = 'import os; print(sorted(os.sched_getaffinity(0)))'\n"
    "print(subprocess.run([sys.executable, '-c', child], capture_output=True, text=True).stdout.strip())"
)


@pytest.mark.skipif(len(HOST_CORES) < 2, reason="one core: nothing to pin a run to fewer of")
def test_a_run_is_pinned_to_as_many_cores_as_it_sees(one_core):
    # os.cpu_count() said `cpus`, but sched_getaffinity (nproc, Node's availableParallelism,
    # Python 3.13's process_cpu_count, Go's GOMAXPROCS) listed every core of the host: on a
    # 64-core worker a pool sized from it started 64 workers past the run's nproc (32)
    stdout, why = run(one_core, AFFINITY)
    mine, childs = stdout.splitlines()
    cores = ast.literal_eval(mine)
    assert len(cores) == 1 and set(cores) <= set(HOST_CORES), why
    assert ast.literal_eval(childs) == cores, why  # its children inherit it


@pytest.mark.skipif(len(HOST_CORES) < 2, reason="one core: nothing to pin a run to fewer of")
@pytest.mark.skipif(shutil.which("nproc") is None, reason="nproc is not installed")
def test_an_execd_program_counts_the_cores_of_its_run(one_core):
    # (nproc honours OMP_NUM_THREADS, which every run has at 1: unset here, it asks the kernel)
    out = one_core.run(mode="exec", argv=[shutil.which("nproc") or ""], env={"OMP_NUM_THREADS": ""})
    assert out.stdout == b"1\n", out


def test_a_run_with_as_many_cores_as_the_host_is_not_pinned():
    cpus = len(HOST_CORES) + 1
    with Sandbox(SandboxConfig(base_uid=BASE_UID + 2000, spares=1, cpus=cpus)) as sb:
        stdout, why = run(sb, AFFINITY)
    assert stdout.splitlines() == [str(HOST_CORES)] * 2, why
    assert wait_clean(BASE_UID + 2000) == []


# -- the process group -------------------------------------------------------------------
def test_killpg_of_its_own_group_finds_the_program_alone(one_core):
    # getpgrp() was 1 (the run's init's group), and killpg(1, sig) is kill(-1, sig): every
    # process but the caller, so with no child alive it failed with ESRCH, where a host
    # signals the caller's own group (here ignored) and the program goes on
    code = (
        "import os, signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "os.killpg(os.getpgrp(), signal.SIGTERM)\nprint(3)"
    )
    stdout, why = run(one_core, code)
    assert stdout == "3", why


def test_killpg_of_its_own_group_ends_the_program_and_its_children(one_core):
    # kill(-1, ...) spared the caller: a program that ends itself and its workers this way
    # ran on (and printed) where on a host it dies of the signal
    code = (
        "import os, signal, subprocess\nchild = subprocess.Popen(['sleep', '30'])\n"
        "os.killpg(os.getpgrp(), signal.SIGTERM)\nprint('survived', flush=True)"
    )
    out = one_core.run_python(code, limits=LIMITS)
    assert (out.status, out.signal, out.stdout) == ("signaled", signal.SIGTERM, b""), out


def test_the_programs_group_is_neither_the_inits_nor_its_own(one_core):
    # not 1 (above), and not its own pid: a group leader may not setsid() (test_code_verify)
    code = "import os\nprint(os.getpgrp() not in (1, os.getpid()), os.getpgrp() == os.getpgid(0))"
    stdout, why = run(one_core, code)
    assert stdout == "True True", why
