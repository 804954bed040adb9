"""Review of the Modal backend and its deploy against the installed modal: the image's
Python is the deploying interpreter's (the functions are cloudpickled), and what Modal
refuses while the app is built is said as a deploy error."""

from __future__ import annotations

import sys

import pytest
from sample_fns import REG

from fabric.deploy import plan_functions


@pytest.fixture
def no_modal_token(monkeypatch, tmp_path):
    monkeypatch.delenv("MODAL_TOKEN_ID", raising=False)
    monkeypatch.delenv("MODAL_TOKEN_SECRET", raising=False)
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "modal.toml"))
    monkeypatch.setenv("HOME", str(tmp_path))


def test_the_modal_image_runs_the_python_that_pickled_the_functions(monkeypatch):
    """The functions are deployed ``serialized=True``: cloudpickle sends their code by value,
    and a code object made by one Python minor version does not load in another (Modal:
    "Try changing the Python version in your Modal image to match your local Python
    version"). The image was always Python 3.11, so a deploy from 3.12 or 3.13 (which
    rl-fabric supports) made functions no container could load. It is the deploying
    interpreter's version now."""
    import modal
    from modal._image import _validate_python_version

    from fabric.deploy.modal_ import build_app

    asked: list[str | None] = []
    real = modal.Image.debian_slim

    def recording(*args, **kwargs):
        asked.append(kwargs.get("python_version"))
        return real(*args, **kwargs)

    monkeypatch.setattr(modal.Image, "debian_slim", recording)
    plan = plan_functions(REG, ["add"], prefix="rl-")
    monkeypatch.setattr(sys, "version_info", (3, 12, 9, "final", 0))
    try:
        build_app(REG, plan)
        # what Modal makes of it (None: the local version)
        series = [_validate_python_version(v, "2025.06") for v in asked]
    finally:
        monkeypatch.undo()
    assert series == ["3.12"], asked


def test_a_warm_above_max_concurrency_is_a_deploy_error_not_a_traceback(
    no_modal_token, tmp_path, monkeypatch
):
    """``--warm N`` sets every function's ``min_containers``; Modal refuses one above
    ``max_containers`` (the function's ``max_concurrency``) while the app is built, before
    the deploy's own error handling: `fabric deploy --backend modal --warm 100` ended in
    InvalidError's traceback. It says which function and what to pass."""
    from typer.testing import CliRunner

    from fabric.cli import app

    monkeypatch.chdir(tmp_path)
    args = ["deploy", "--backend", "modal", "--prune", "-m", "sample_fns", "-f", "add", "--warm", "100"]
    r = CliRunner().invoke(app, args)
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "Traceback" not in r.output, (r.exit_code, r.output, r.exception)
    assert "add" in said and "--warm 100" in said and "max_concurrency=64" in said, said


def test_what_modal_refuses_while_the_app_is_built_is_a_deploy_error(monkeypatch):
    """``build_app`` ran outside ``deploy_modal``'s translation of Modal's errors: an option
    Modal refuses when the function is defined (not when the app deploys) came out as its
    exception instead of a ``DeployError`` saying so."""
    import fabric.deploy.modal_ as modal_deploy
    from fabric.deploy.plan import DeployError

    plan = plan_functions(REG, ["add"], prefix="rl-")
    real = modal_deploy.modal_options
    monkeypatch.setattr(
        modal_deploy, "modal_options", lambda reg, fn: {**real(reg, fn), "scaledown_window": 1}
    )
    with pytest.raises(DeployError, match="InvalidError: `scaledown_window` must be between 2 and 3600"):
        modal_deploy.deploy_modal(REG, plan, echo=lambda m: None)


async def test_a_container_that_cannot_load_the_deployed_function_is_setup_failed():
    """A Modal container loads the cloudpickled function before any input runs; when that
    fails (the app was deployed from another Python version, or another cloudpickle), the
    container reports the ``DeserializationError`` as a task failure, Modal fails the
    queued inputs with it and the client re-raises it. It was a retryable TransportError:
    every call retried to its attempts and a side effect's ended OutcomeUnknown, though no
    call can run until the app is redeployed (as for an ImportError in the container)."""
    import modal.exception

    from fabric.backends.base import ModalConfig
    from fabric.backends.modal_ import ModalBackend
    from fabric.errors import FINAL_ERRORS, ErrorCode
    from fabric.protocol import Invocation

    said = (
        "Deserialization failed due to a version mismatch between local and remote environments. "
        "Try changing the Python version in your Modal image to match your local Python version. "
    )

    class Unloadable:
        """A deployed function whose ``.remote.aio`` raises what Modal's client raised."""

        @property
        def remote(self):
            return self

        async def aio(self, *args, **kwargs):
            raise modal.exception.DeserializationError(said)

    class FakeModal(ModalBackend):
        def _function(self, name):  # the lookup hook: no Modal account here
            return Unloadable()

    async with FakeModal(REG, ModalConfig()) as b:
        r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error.type == ErrorCode.SETUP_FAILED and not r.retryable, r.error
    assert r.error.type not in FINAL_ERRORS  # not the function's answer, kept under a key
    assert "version mismatch" in r.error.message and "fabric deploy --backend modal" in r.error.message


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"function_prefix": "team.a-"}, "function_prefix"),  # Function.from_name refuses a '.'
        ({"function_prefix": "team a-"}, "function_prefix"),
        ({"app_name": "my rewards"}, "app_name"),  # Modal's names: letters, digits, '-', '_', '.'
        ({"app_name": "x" * 65}, "app_name"),
        ({"app_name": ""}, "app_name"),
    ],
)
def test_a_modal_config_naming_what_modal_refuses_is_refused_at_the_edge(config, key):
    """A ``ModalConfig`` took any app name and prefix: one Modal refuses failed every call,
    at the call (a '.' in the prefix as SetupFailed with Modal's hint to use
    ``Cls.from_name``), where a job found it after starting. It is a ``ConfigError`` naming
    the key, as ``fabric deploy`` refuses a bad ``--prefix``."""
    from fabric.backends.base import parse_backend_config
    from fabric.errors import ConfigError

    with pytest.raises(ConfigError, match=key):
        parse_backend_config({"type": "modal", **config})


def test_a_modal_config_takes_the_names_fabric_deploy_makes():
    from fabric.backends.base import ModalConfig, parse_backend_config

    cfg = parse_backend_config({"type": "modal", "app_name": "team-a.rewards_v2", "function_prefix": ""})
    assert isinstance(cfg, ModalConfig) and cfg.app_name == "team-a.rewards_v2"
    assert ModalConfig(function_prefix="team_a-").function_prefix == "team_a-"


@pytest.mark.parametrize(("option", "value"), [("--modal-app", "my app"), ("--prefix", "team.a-")])
def test_fabric_invoke_names_the_modal_option_modal_refuses(no_modal_token, option, value):
    from typer.testing import CliRunner

    from fabric.cli import app

    r = CliRunner().invoke(app, ["invoke", "add", "--backend", "modal", option, value, "-m", "sample_fns"])
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and f"{option} {value!r}" in said, (r.exit_code, r.output, r.exception)


def test_a_cold_async_call_on_modal_ends_before_modal_kills_its_container(tmp_path, monkeypatch):
    """Modal's ``timeout`` (the function's ``timeout_s``) counts from the input's start, and a
    cold container's first input imports the module and runs the setup hook in it. The runtime
    then gave the async call its whole ``timeout_s`` again: one that ran long was killed by
    Modal (FunctionTimeoutError) with its container and its set-up runner, so the next call
    was cold again, and with a slow setup every call was. As the Lambda handler bounds an async
    call by what Lambda leaves it, the runtime bounds it by what Modal's timeout leaves."""
    from fabric.deploy import modal_runtime
    from fabric.protocol import Invocation
    from fabric.runner import FunctionRunner

    src = tmp_path / "slow_setup_fns.py"
    src.write_text(
        "import asyncio, time\n"
        "from fabric.registry import Registry\n"
        "REG = Registry()\n"
        "def _setup():\n    time.sleep(0.5)\n    return 1\n"
        "@REG.function(timeout_s=2, setup=_setup)\n"
        "async def slow_setup(x: int, ctx: int) -> int:\n    return x + ctx\n"
    )
    given: list[float | None] = []
    real = FunctionRunner.run_async

    async def recording(self, raw, timeout_s, on_timer=None):
        given.append(timeout_s)
        return await real(self, raw, timeout_s, on_timer)

    monkeypatch.setattr(FunctionRunner, "run_async", recording)
    try:
        inv = Invocation(function="slow_setup", payload={"x": 1})
        out = modal_runtime.run("slow_setup", str(src), inv.model_dump(mode="json"))
        assert out["ok"] and out["value"] == 2 and out["cold_start"], out
        out = modal_runtime.run("slow_setup", str(src), inv.model_dump(mode="json"))
        assert out["ok"] and not out["cold_start"], out
    finally:
        modal_runtime.reset()
    # the cold call: Modal's 2 s less the 0.5 s setup and a margin; a warm one has its own
    assert given[0] is not None and given[0] <= 1.5 - modal_runtime.MODAL_MARGIN_S, given
    assert given[1] is not None and given[1] > 1.5 - modal_runtime.MODAL_MARGIN_S, given
