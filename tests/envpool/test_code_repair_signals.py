"""What a ``code-repair-v1`` test run's module reaches by signal, where it runs as the env
process's own user (``run_uid_base=None``, or a server that is not root) in a PID namespace
of its own: its own session, never the env server's process group. ``kill(0)`` and a
``killpg`` of its own group end the run (its checks fail), never the env. Without a PID
namespace the run stays in the server's group (``RUNNER``'s comment says why): there only a
uid of the run's own (a root server's ``run_uid_base``) keeps the server out of its reach."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from code_repair_helpers import CLONE_NEWPID, CLONE_NEWUSER, kernel_allows, run_env_script

from envpool.envs.code_repair_user import DEFAULT_RUN_UID_BASE

# the module says where it runs (its pid, 2 in a PID namespace of its own; its user
# namespace's uid map), then signals its process group
_WHERE = "import os, signal\nprint('PID', os.getpid(), 'MAP', open('/proc/self/uid_map').read().split())\n"
_ATTACKS = {
    "kill_0_sigterm": _WHERE + "os.kill(0, signal.SIGTERM)\n",
    "killpg_own_group_sigkill": _WHERE + "os.killpg(os.getpgid(0), signal.SIGKILL)\n",
}

# setpriv takes CAP_SYS_ADMIN from root: the server may not make namespaces itself, and the
# run takes a user namespace of its own (which maps root alone: run_uid_base=None)
_NO_SYS_ADMIN = ["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin"]


def _run_env(
    tmp_path: Path, attack: str, prefix: list[str], uid_base: int | None = None, pid_namespace: bool = True
) -> tuple[int, str]:
    """The env's exit status and output."""
    # (ENV_SCRIPT: a run whose module signals, then the same module without the signal)
    return run_env_script(tmp_path, attack, prefix=prefix, uid_base=uid_base, pid_namespace=pid_namespace)


def _check(returncode: int, text: str, where: str, pid_namespace: bool = True) -> None:
    # the env process lived on (it died by SIGTERM or SIGKILL when the run was in its
    # process group), and closed its env
    assert returncode == 0 and "ENV ALIVE" in text.splitlines(), (returncode, text)
    first, second = (json.loads(line) for line in text.splitlines() if line.startswith("{"))
    assert where in first["text"], first["text"]  # the route expected
    # the signal ended the run (the runner is in the group it signalled): reported as any run
    # that ended before its results, each check failed, never a timeout nor an infra error
    info = dict(first["info"])
    # the isolation is reported where a part is missing: without a PID namespace, that one
    isolation = info.pop("isolation", None)
    assert (isolation is None) == pid_namespace, first
    assert isolation is None or not isolation["pid_ns"], first
    assert info == {"passed": 0, "failed": 3, "all_passed": False, "outcome": "test_failure"}, first
    assert second["info"]["all_passed"], second["text"]  # the next run in the same env


@pytest.mark.skipif(os.geteuid() != 0, reason="the module runs as root there (run_uid_base=None)")
@pytest.mark.skipif(not kernel_allows(CLONE_NEWPID), reason="the kernel refuses a PID namespace here")
@pytest.mark.parametrize("attack", sorted(_ATTACKS))
def test_a_modules_signal_to_its_group_spares_the_env_on_the_root_route(tmp_path, attack):
    # root with CAP_SYS_ADMIN makes the PID namespace itself, and with run_uid_base=None the
    # module runs as root: it may signal any process, and its group was the env server's
    _check(*_run_env(tmp_path, _ATTACKS[attack], []), "PID 2 MAP ['0', '0', '4294967295']")


@pytest.mark.skipif(
    os.geteuid() == 0 and shutil.which("setpriv") is None, reason="drops CAP_SYS_ADMIN from root (setpriv)"
)
@pytest.mark.skipif(
    not kernel_allows(CLONE_NEWUSER | CLONE_NEWPID),
    reason="the kernel refuses a user namespace with a PID namespace here",
)
@pytest.mark.parametrize("attack", sorted(_ATTACKS))
def test_a_modules_signal_to_its_group_spares_the_env_on_the_user_namespace_route(tmp_path, attack):
    # the module runs as the env process's user (root without CAP_SYS_ADMIN here, or this
    # test's user), which may signal the env process: its group was the env server's
    prefix = _NO_SYS_ADMIN if os.geteuid() == 0 else []
    uid = str(os.getuid())  # a user namespace that maps only this user, to itself
    _check(*_run_env(tmp_path, _ATTACKS[attack], prefix), f"PID 2 MAP {[uid, uid, '1']}")


@pytest.mark.skipif(os.geteuid() != 0, reason="a uid of the run's own is taken only by root")
@pytest.mark.parametrize("attack", sorted(_ATTACKS))
def test_without_a_pid_namespace_a_module_of_a_uid_of_its_own_spares_the_env(tmp_path, attack):
    # the fallback keeps the run in the env server's process group (the script's comment says
    # why), where a module run as the server's user kills the server by it: the remedy is a
    # root server with a run_uid_base, whose module may signal no process of the server's
    _check(
        *_run_env(tmp_path, _ATTACKS[attack], [], uid_base=DEFAULT_RUN_UID_BASE, pid_namespace=False),
        "MAP ['0', '0', '4294967295']",
        pid_namespace=False,
    )
