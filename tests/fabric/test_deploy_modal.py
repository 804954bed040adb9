"""``fabric deploy --backend modal``: the app's definitions and a local run, retries left to
the client, secrets, the runtime (one event loop per container, the invocation's deadline),
errors translated, no token; and that docs/deploy.md says what the CLI and the backend do."""

from __future__ import annotations

from pathlib import Path

import pytest
from sample_fns import REG
from typer.testing import CliRunner

from fabric.backends.base import ModalConfig
from fabric.deploy import plan_functions
from fabric.errors import ErrorCode
from fabric.protocol import Invocation

ROOT = Path(__file__).resolve().parents[2]


# -- Modal


def test_modal_app_definitions_and_local_run():
    from fabric.deploy.modal_ import build_app, modal_options

    plan = plan_functions(REG, ["add", "async_sleepy"], prefix="rl-")
    opts = modal_options(REG, plan[0])
    assert opts == {
        "name": "rl-add",
        "min_containers": 1,
        "buffer_containers": 1,
        "max_containers": 64,
        "scaledown_window": 60,
        "timeout": 30,
        "retries": 0,
        "cpu": 1.0,
        "memory": 512,
    }
    assert (
        modal_options(REG, plan[1])["min_containers"] == 0
        and modal_options(REG, plan[1])["buffer_containers"] == 0
    )
    app, functions = build_app(REG, plan)
    assert app.name == "rl-fabric" and set(functions) == {"add", "async_sleepy"}
    out = functions["add"].local(Invocation(function="add", payload={"a": 2, "b": 3}).model_dump(mode="json"))
    assert out["ok"] and out["value"] == 5 and out["worker"] == "modal:add"
    out = functions["async_sleepy"].local(
        Invocation(function="async_sleepy", payload={"seconds": 0}).model_dump(mode="json")
    )
    assert out["ok"]
    wrong = functions["add"].local(Invocation(function="boom", payload={}).model_dump(mode="json"))
    assert wrong["error"]["type"] == "UnknownFunction"
    bad = functions["add"].local({"function": "add", "payload": {"a": "x"}})
    assert bad["error"]["type"] == "InvalidArguments"


def test_modal_functions_leave_retries_to_the_client(monkeypatch):
    """Modal retried a lost or timed-out container max_attempts - 1 times, side effects
    included (a call that may have run, run again), and the client retried each of those
    again: up to 3 x 3 runs. Modal retries nothing now; the client applies the retry policy
    with its idempotency and side-effect rules."""
    import modal

    from fabric.deploy.modal_ import build_app, modal_options

    plan = plan_functions(REG, ["add", "append_line"], prefix="rl-")
    assert REG.get("append_line").side_effects and REG.get("add").retry.max_attempts > 1
    assert [modal_options(REG, fn)["retries"] for fn in plan] == [0, 0]
    seen = []
    real = modal.App.function

    def recording(self, *args, **kwargs):
        seen.append(kwargs.get("retries"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(modal.App, "function", recording)
    build_app(REG, plan)
    assert seen == [0, 0]


def test_modal_functions_get_the_secrets_named_at_deploy(monkeypatch):
    """`fabric deploy --backend modal` gave its functions no way to receive variables (a
    judge's model and API key): every such function failed its setup on Modal. Each Modal
    secret named with --modal-secret is attached to every function (its keys become their
    environment); the option is Modal's only."""
    import modal

    from fabric.cli import app
    from fabric.deploy.modal_ import build_app

    plan = plan_functions(REG, ["add", "boom"], prefix="rl-")
    seen = []
    real = modal.App.function

    def recording(self, *args, **kwargs):
        seen.append(sorted(s.name for s in kwargs.get("secrets", [])))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(modal.App, "function", recording)
    build_app(REG, plan, secrets=["judge-keys", "hf"])
    assert seen == [["hf", "judge-keys"], ["hf", "judge-keys"]]
    seen.clear()
    build_app(REG, plan)
    assert seen == [[], []]
    r = CliRunner().invoke(app, ["deploy", "--modal-secret", "judge-keys", "-m", "sample_fns", "-f", "add"])
    assert r.exit_code == 2 and "--modal-secret" in r.output and "modal" in r.output


def test_modal_image_carries_the_package_data_the_zip_carries(monkeypatch, tmp_path):
    """The image added the code with ``add_local_python_source``, whose default takes ``.py``
    files only: ``search`` found no corpus (``functions/data/corpus``) and the JS verifier
    no ``functions/verifiers/js`` on Modal. It carries what the Lambda zip does: every file,
    less dotfiles and dot-directories (``.env``, ``.venv``) and bytecode."""
    import modal
    from modal.file_pattern_matcher import NON_PYTHON_FILES
    from modal.mount import _Mount

    from fabric.deploy.modal_ import build_app

    calls = []
    real = modal.Image.add_local_python_source

    def recording(self, *modules, **kwargs):
        calls.append((modules, kwargs))
        return real(self, *modules, **kwargs)

    monkeypatch.setattr(modal.Image, "add_local_python_source", recording)
    build_app(REG, plan_functions(REG, ["add"], prefix="rl-"))
    [(modules, kwargs)] = calls
    mount = _Mount._from_local_python_packages(*modules, ignore=kwargs.get("ignore", NON_PYTHON_FILES))
    files = {str(remote) for entry in mount.entries for _, remote in entry.get_files_to_upload()}
    assert "/root/functions/data/corpus/pi.txt" in files
    assert "/root/functions/verifiers/js/rpc_server.js" in files
    assert "/root/functions/tools/search.py" in files
    assert not [f for f in files if f.endswith((".pyc", ".pyo")) or "/." in f or "__pycache__" in f]


def test_modal_image_carries_a_file_entry_from_anywhere(monkeypatch, tmp_path):
    """A ``file.py`` entry went to ``add_local_python_source`` by its module name, which Modal
    looks up on sys.path: one outside it (``-m rewards/my_fns.py``) failed the deploy
    (ModuleNotMountable), or another module of that name went instead. The file itself is
    added where the runtime loads it (the container's working directory, /root)."""
    import modal
    from modal.mount import _Mount

    from fabric.deploy.modal_ import build_app
    from fabric.registry import Registry

    src = tmp_path / "rewards" / "far_away_fns.py"
    src.parent.mkdir()
    src.write_text(
        "from fabric.registry import Registry\nREG = Registry()\n"
        "@REG.function\ndef far_away(x: int) -> int:\n    return x\n"
    )
    reg = Registry()
    reg.discover(str(src))
    calls = []
    for method in ("add_local_python_source", "add_local_file"):
        real = getattr(modal.Image, method)

        def recording(self, *args, _method=method, _real=real, **kwargs):
            calls.append((_method, args, kwargs))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(modal.Image, method, recording)
    build_app(reg, plan_functions(reg, ["far_away"]))
    files = set()
    for method, args, kwargs in calls:
        if method == "add_local_file":
            files.add((str(args[0]), str(args[1])))
        else:
            mount = _Mount._from_local_python_packages(*args, ignore=kwargs.get("ignore"))
            files |= {
                (str(local), str(remote)) for e in mount.entries for local, remote in e.get_files_to_upload()
            }
    assert (str(src), "/root/far_away_fns.py") in files


@pytest.fixture
def echo_port():
    """A line echo server on 127.0.0.1, in a thread (the Modal runtime's calls are blocking)."""
    import socketserver
    import threading

    class Echo(socketserver.StreamRequestHandler):
        def handle(self):
            for line in self.rfile:
                self.wfile.write(line)

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo) as server:
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield server.server_address[1]
        finally:
            server.shutdown()
            thread.join(5)


def test_modal_runtime_keeps_one_event_loop_per_container(echo_port):
    """Each async call ran under its own asyncio.run, which closes its loop: a connection or
    client made on the first call (or in a setup hook) was bound to a closed loop on the
    second, which failed with UserError "Event loop is closed". One loop serves the
    container's calls, as in the Lambda handler."""
    from fabric.deploy import modal_runtime

    def call(text):
        inv = Invocation(function="echo_pooled", payload={"port": echo_port, "text": text})
        return modal_runtime.run("echo_pooled", "sample_fns", inv.model_dump(mode="json"))

    try:
        outs = [call(t) for t in ("a", "b", "c", "")]
        assert [(o["ok"], o["value"]) for o in outs] == [(True, "a"), (True, "b"), (True, "c"), (True, "")], [
            o["error"] for o in outs
        ]
    finally:
        modal_runtime.reset()


def test_modal_runtime_honours_the_invocations_deadline(tmp_path):
    """A call that reached its container after its deadline (queued behind a cold start, a
    burst past max_containers) still ran: a side effect happened after the client had given
    the call up. And an async call ran for the function's whole timeout_s past the deadline.
    The Lambda handler and the local workers refuse a late call (DeadlineExceeded) and bound
    an async one by the deadline; the Modal runtime now does too."""
    import time

    from fabric.deploy import modal_runtime

    path = tmp_path / "effects.txt"
    late = Invocation(
        function="append_line", payload={"path": str(path), "line": "x"}, deadline=time.time() - 1
    )
    try:
        out = modal_runtime.run("append_line", "sample_fns", late.model_dump(mode="json"))
        assert out["error"]["type"] == ErrorCode.DEADLINE_EXCEEDED and out["started"] is False, out
        assert not path.exists()  # the effect never happened
        soon = Invocation(function="async_sleepy", payload={"seconds": 5}, deadline=time.time() + 0.3)
        t0 = time.monotonic()
        out = modal_runtime.run("async_sleepy", "sample_fns", soon.model_dump(mode="json"))
        assert time.monotonic() - t0 < 3 and not out["ok"], out  # not the function's 30 s timeout
        # a call with no deadline (a keyed execution's, as the backend sends it) runs
        out = modal_runtime.run(
            "append_line", "sample_fns", late.model_copy(update={"deadline": None}).model_dump(mode="json")
        )
        assert out["ok"] and path.read_text() == "x\n", out
    finally:
        modal_runtime.reset()


@pytest.fixture
def no_modal_token(monkeypatch, tmp_path):
    monkeypatch.delenv("MODAL_TOKEN_ID", raising=False)
    monkeypatch.delenv("MODAL_TOKEN_SECRET", raising=False)
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "modal.toml"))
    monkeypatch.setenv("HOME", str(tmp_path))


async def test_modal_backend_without_a_token_fails_at_once(no_modal_token):
    import time

    from fabric.backends.modal_ import ModalBackend

    async with ModalBackend(REG, ModalConfig()) as b:
        t0 = time.monotonic()
        r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error.type == ErrorCode.UNAUTHORIZED and not r.retryable
    assert "modal token new" in r.error.message and time.monotonic() - t0 < 10


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("ResourceExhaustedError", ErrorCode.THROTTLED),  # Modal's rate limit: nothing ran
        ("PermissionDeniedError", ErrorCode.UNAUTHORIZED),
        ("InvalidError", ErrorCode.SETUP_FAILED),  # the deployment's, not the function's answer
        ("RequestSizeError", ErrorCode.PAYLOAD_TOO_LARGE),
        ("AuthError", ErrorCode.UNAUTHORIZED),
        ("NotFoundError", ErrorCode.UNKNOWN_FUNCTION),
        ("FunctionTimeoutError", ErrorCode.TIMEOUT),
        ("ConnectionError", ErrorCode.TRANSPORT),
        ("InternalFailure", ErrorCode.TRANSPORT),
        ("ServiceError", ErrorCode.TRANSPORT),
    ],
)
async def test_modal_errors_are_translated(name, code):
    """Everything but AuthError, NotFoundError and the timeout was a retryable TransportError:
    a rate limit was not retried for a side effect (TransportError may have run), and a
    refused permission, an invalid or too large request were retried to no end."""
    import modal.exception

    from fabric.backends.modal_ import ModalBackend
    from fabric.errors import RETRYABLE

    class Raising:
        """A deployed function whose ``.remote.aio`` raises what Modal's client raised."""

        @property
        def remote(self):
            return self

        async def aio(self, envelope):
            raise getattr(modal.exception, name)("refused")

    class FakeModal(ModalBackend):
        def _function(self, name):  # the lookup hook: no Modal account here
            return Raising()

    async with FakeModal(REG, ModalConfig()) as b:
        r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error.type == code and r.retryable == (code in RETRYABLE), r.error
    assert name in r.error.message and r.worker == "modal"


async def test_a_modal_container_that_cannot_import_the_runtime_is_setup_failed():
    """The container's entry imports fabric's runtime; an image without it (or without one of
    its dependencies) raises ImportError there, which Modal re-raises here. It was a retryable
    TransportError: every call was retried to its attempts, and a side effect's ended
    OutcomeUnknown, though the function never ran and never will until the app is redeployed."""
    from fabric.backends.modal_ import ModalBackend
    from fabric.errors import FINAL_ERRORS

    class Raising:
        @property
        def remote(self):
            return self

        async def aio(self, envelope):
            raise ModuleNotFoundError("No module named 'pydantic'", name="pydantic")

    class FakeModal(ModalBackend):
        def _function(self, name):
            return Raising()

    async with FakeModal(REG, ModalConfig()) as b:
        r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error.type == ErrorCode.SETUP_FAILED and not r.retryable, r.error
    assert r.error.type not in FINAL_ERRORS  # not the function's answer, kept under a key
    assert "No module named 'pydantic'" in r.error.message
    assert "fabric deploy --backend modal" in r.error.message  # what to do


def test_modal_deploy_without_a_token_is_a_clear_error(no_modal_token, tmp_path, monkeypatch):
    from fabric.cli import app

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["deploy", "--backend", "modal", "--prune", "-m", "sample_fns", "-f", "add"])
    assert r.exit_code == 2 and "modal token new" in r.output, r.output


def test_deploy_docs_say_how_modal_errors_are_translated():
    """docs/deploy.md's list of Modal's errors and the fabric codes they become is the
    backend's table: it still said InvalidError is InvalidArguments after the backend made it
    SetupFailed (a user reading it would expect such a failure kept under the key and
    scored by failure_score)."""
    import re

    from fabric.backends.modal_ import _ERRORS

    text = " ".join((ROOT / "docs" / "deploy.md").read_text().split())
    start = text.index("Modal's errors become fabric's")
    paragraph = text[start : text.index("Offline,", start)]
    codes = {str(c) for c in ErrorCode}
    for name, code in _ERRORS:
        after = paragraph[paragraph.index(f"`{name}`") + len(name) + 2 :]
        said = next(t for t in re.findall(r"`([A-Za-z]+)`", after) if t in codes)
        assert said == str(code), f"docs/deploy.md says {name} is {said}; the backend makes it {code}"


def test_deploy_docs_commands_exist():
    # the deploy guide's commands use options the CLI has
    text = (ROOT / "docs" / "deploy.md").read_text()
    from fabric.cli import app

    help_text = CliRunner().invoke(app, ["deploy", "--help"], terminal_width=200).output
    for opt in (
        "--direct",
        "--plan-only",
        "--prefix",
        "--endpoint-url",
        "--no-deps",
        "--image",
        "--warm",
        "--keep-warm",
    ):
        assert opt in text and opt in help_text, opt


def test_the_modal_app_is_named_at_deploy_and_at_the_call(tmp_path, monkeypatch):
    """Every Modal deploy went to the app 'rl-fabric' (no option named it): two teams in one
    workspace, or two sets of functions, deployed over each other's app. --modal-app names
    it at deploy, and `fabric invoke --backend modal --modal-app` calls it."""
    import fabric.deploy.modal_ as modal_deploy
    from fabric.cli import app
    from fabric.cli._app import remote_backend

    seen: dict = {}

    def fake_deploy(registry, plan, *, app_name="rl-fabric", secrets=(), pip=(), echo):
        seen.update(app_name=app_name, names=[f.deployed_name for f in plan])

    monkeypatch.setattr(modal_deploy, "deploy_modal", fake_deploy)
    monkeypatch.chdir(tmp_path)
    args = ["deploy", "--backend", "modal", "--prune", "-m", "sample_fns", "-f", "add"]
    r = CliRunner().invoke(app, [*args, "--modal-app", "team-a"])
    assert r.exit_code == 0, r.output
    assert seen == {"app_name": "team-a", "names": ["rl-fabric-add"]}
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and seen["app_name"] == "rl-fabric", r.output
    r = CliRunner().invoke(app, ["deploy", "-m", "sample_fns", "-f", "add", "--modal-app", "team-a"])
    assert r.exit_code == 2 and "--modal-app is for --backend modal" in " ".join(r.output.split()), r.output

    cfg = remote_backend(
        "modal", endpoint_url=None, token=None, prefix=None, transport="auto", modal_app="team-a"
    )
    assert isinstance(cfg, ModalConfig) and cfg.app_name == "team-a" and cfg.function_prefix == "rl-fabric-"
    r = CliRunner().invoke(app, ["invoke", "add", "--backend", "lambda", "--modal-app", "team-a"])
    assert r.exit_code == 2 and "--modal-app is for --backend modal" in " ".join(r.output.split()), r.output


async def test_a_result_from_a_container_deployed_with_newer_code_is_still_its_result():
    """A container deployed from a newer fabric sends a Result with a field this client does
    not know: it failed validation and became a retryable TransportError, every call of the
    app retried to its attempts (a side effect's ended OutcomeUnknown) until the client was
    upgraded. The lambda backend reads such a Result as what it says; so does this one."""
    from fabric.backends.modal_ import ModalBackend
    from fabric.protocol import Result

    class Newer:
        @property
        def remote(self):
            return self

        async def aio(self, envelope):
            sent = Result.failure(
                ErrorCode.USER_ERROR,
                "bad x",
                function=envelope["function"],
                request_id=envelope["request_id"],
            )
            return {**sent.model_dump(mode="json"), "added_in_a_later_release": 1}

    class FakeModal(ModalBackend):
        def _function(self, name):
            return Newer()

    async with FakeModal(REG, ModalConfig()) as b:
        r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error.type == ErrorCode.USER_ERROR and r.error.message == "bad x", r.error


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("NotFoundError", "Secret 'judge-keyz' not found"),  # a misspelt --modal-secret
        ("InvalidError", "Function name is invalid"),
        ("ConnectionError", "Deadline exceeded"),
    ],
)
def test_a_deploy_modal_refuses_is_said_without_a_traceback(tmp_path, monkeypatch, name, said):
    """Only AuthError was translated: a secret that does not exist (a typo in --modal-secret),
    an option Modal refuses or a connection fault came out of `fabric deploy` as a traceback."""
    import modal.exception

    import fabric.deploy.modal_ as modal_deploy
    from fabric.cli import app

    class RefusedApp:
        def deploy(self):
            raise getattr(modal.exception, name)(said)

    monkeypatch.setattr(modal_deploy, "build_app", lambda *a, **kw: (RefusedApp(), {}))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["deploy", "--backend", "modal", "--prune", "-m", "sample_fns", "-f", "add"])
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and said in text and name in text, (r.exit_code, r.output, r.exception)
    assert "Traceback" not in r.output


def test_a_modal_deploy_of_some_functions_is_refused_unless_meant(monkeypatch, tmp_path):
    """A Modal app is deployed whole, with the functions its definition holds: `-f add`
    deployed an app of one function, and the functions an earlier deploy had put in it
    stopped under their callers, unsaid (terraform's path names what it would destroy and
    refuses it without --prune; nothing can list a Modal app offline)."""
    import fabric.deploy.modal_ as modal_deploy
    from fabric.cli import app

    deployed: list[list[str]] = []
    monkeypatch.setattr(
        modal_deploy, "deploy_modal", lambda reg, plan, **kw: deployed.append([f.name for f in plan])
    )
    monkeypatch.chdir(tmp_path)
    args = ["deploy", "--backend", "modal", "-m", "sample_fns"]
    r = CliRunner().invoke(app, [*args, "-f", "add"])
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "a Modal app is deployed whole" in said and "--prune" in said, r.output
    assert deployed == []
    assert CliRunner().invoke(app, [*args, "-f", "add", "--prune"]).exit_code == 0
    assert CliRunner().invoke(app, args).exit_code == 0  # all of them: nothing to lose
    assert deployed[0] == ["add"] and len(deployed[1]) > 1
    r = CliRunner().invoke(app, ["deploy", "--direct", "--prune", "-m", "sample_fns"])
    assert r.exit_code == 2 and "--direct removes nothing" in " ".join(r.output.split()), r.output


def test_the_deploy_guides_modal_commands_are_not_refused(tmp_path, monkeypatch):
    """The guide's Modal command deployed ``-f exact_match -f math_answer``, which the CLI
    refuses since a Modal deploy of some functions needs ``--prune`` (the app's others would
    be removed): a reader copying it got the refusal."""
    import shlex

    import fabric.deploy.modal_ as modal_deploy
    from fabric.cli import app

    deployed: list[list[str]] = []
    monkeypatch.setattr(
        modal_deploy, "deploy_modal", lambda registry, plan, **kw: deployed.append([f.name for f in plan])
    )
    monkeypatch.chdir(tmp_path)
    text = (ROOT / "docs" / "deploy.md").read_text()
    guide = ".venv/bin/fabric deploy --backend modal"
    commands = [line for line in text.splitlines() if line.startswith(guide)]
    assert commands
    for line in commands:
        r = CliRunner().invoke(app, shlex.split(line)[1:])
        assert r.exit_code == 0, f"{line}: {r.output}"
    assert len(deployed) == len(commands)
