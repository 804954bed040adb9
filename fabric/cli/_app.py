"""The ``fabric`` app, its consoles and what every command shares."""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from fabric.errors import ErrorCode
from fabric.protocol import lone_surrogate_problem
from fabric.registry import Registry
from fabric.usercode import prints_to_stderr, search_cwd
from fabric.version import VersionOpt

if TYPE_CHECKING:
    from pydantic import ValidationError

    from fabric.backends.base import LambdaConfig, ModalConfig

# A command's help is its docstring when that is one line, else help= as one string: typer's
# rich markup mode keeps a docstring's line breaks in the command list (`fabric --help` broke
# off at "2 if"); markdown mode reflows them but drops the `quotes` of plain-text help and puts
# each [default: ...] on a line of its own.
app = typer.Typer(
    help="rl-fabric: reward and tool functions as warm, resilient FaaS.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
err = Console(stderr=True)
out = Console()


@app.callback()
def _options(version: VersionOpt = False) -> None:
    # no docstring: the app's help= stays the help of `fabric --help`
    pass


ModulesOpt = Annotated[
    list[str] | None,
    typer.Option("--module", "-m", help="Module, package, module:attr or file.py to discover functions in."),
]
DrainOpt = Annotated[
    float,
    typer.Option(min=0, help="On Ctrl-C, seconds the calls in flight get to finish (a second Ctrl-C: none)."),
]
# the lambda backend's options, of `fabric bench` and `fabric invoke` (see remote_backend)
EndpointUrlOpt = Annotated[
    str | None, typer.Option(help="With --backend lambda: a `fabric serve` URL (default: AWS).")
]
TokenOpt = Annotated[str | None, typer.Option(help="`fabric serve` token (default: $RL_FABRIC_TOKEN).")]
PrefixOpt = Annotated[
    str | None,
    typer.Option(
        help="With --backend lambda or modal: deployed name prefix (default: rl-fabric-, as `fabric deploy` "
        "names them; none for a `fabric serve` with a token, as it serves them)."
    ),
]
ModalAppOpt = Annotated[
    str | None,
    typer.Option(
        help="With --backend modal: the Modal app the functions are deployed in (default: rl-fabric)."
    ),
]
RegionOpt = Annotated[
    str | None,
    typer.Option(
        help="With --backend lambda: the AWS region `fabric deploy` deployed to (default $AWS_REGION, "
        "$AWS_DEFAULT_REGION or us-east-1, as deploy's)."
    ),
]
TransportOpt = Annotated[
    str, typer.Option(help="With --backend lambda: auto, boto3 or http (aiohttp; fabric serve only).")
]


def load_registry(modules: list[str] | None) -> Registry:
    search_cwd()
    reg = Registry()
    yours = [*(modules or [])]
    yours += [m for m in os.environ.get("FABRIC_MODULES", "").split(",") if m.strip()]
    with prints_to_stderr():  # a module's import-time print would come before --json's answer
        reg.discover("functions")
        for target in yours:
            # one of no functions (their decorator forgotten) was silent: ls listed the
            # built-ins, invoke answered "unknown function"
            reg.discover_yours(target, warn=_warn)
    return reg


def _warn(text: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(text)}", soft_wrap=True)


#: Failed calls that are the caller's mistake: ``invoke`` exits 2 for these, as for bad options
BAD_INPUT = frozenset(
    {
        ErrorCode.UNKNOWN_FUNCTION,
        ErrorCode.INVALID_ARGUMENTS,
        ErrorCode.PAYLOAD_TOO_LARGE,
        ErrorCode.PAYLOAD_NOT_SERIALIZABLE,
    }
)


#: How a function of the user's own gets registered, for errors about an unknown one
LOAD_YOURS = (
    "a function of your own registers when its module is loaded: "
    "-m MODULE (a module, module:attr or file.py) or $FABRIC_MODULES"
)


#: A JSON option's value nested past what Python's parser takes (``[[[...`` 1000 deep)
TOO_DEEP = "{} nested too deeply: Python parses JSON arrays and objects up to about 1000 levels"


def no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON (payloads are strict JSON)")


def payload_arg(text: str) -> dict[str, Any]:
    """``--payload``: a JSON object of keyword arguments, or ``@PATH`` for one in a file
    (``@-``: standard input; an argument is at most 128 KiB on Linux, a trajectory can be
    more); an error names the option."""
    if text.startswith("@"):
        where = text[1:]
        try:
            text = sys.stdin.read() if where == "-" else Path(where).read_text(encoding="utf-8")
        except OSError as e:  # its own text says the path again, after an [Errno N]
            fail(f"--payload {text}: cannot read it: {e.strerror or e}")
        except UnicodeDecodeError as e:
            fail(f"--payload {text}: cannot read it: {e}")
    try:
        args = json.loads(text, parse_constant=no_constant)
    except RecursionError:  # the parser's, past Python's limit: it was a traceback
        fail(TOO_DEEP.format("--payload is"))
    except ValueError as e:  # JSONDecodeError, or NaN/Infinity
        fail(f"--payload is not valid JSON: {e}")
    # Python's parser takes a lone surrogate ("\\ud800", or an argument's undecodable
    # bytes): refused here, by name, not later as a codec error of the payload's encoding
    problem = lone_surrogate_problem(args, "--payload")
    if problem is not None:
        fail(problem)
    if not isinstance(args, dict):
        fail('--payload must be a JSON object of keyword arguments, e.g. \'{"traj": "..."}\'')
    return args


def plural_calls(n: int) -> str:
    return f"{n} call" if n == 1 else f"{n} calls"


def fail(message: str, code: int = 2) -> NoReturn:
    # escaped (keys such as envs[0].id are not markup) and unwrapped (easy to grep and paste)
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


#: What the server commands import from the ``serve`` extra (a base install has neither)
SERVE_EXTRA = ("aiohttp", "prometheus_client")


def require_extra(what: str, extra: str, modules: tuple[str, ...]) -> None:
    """Exit 2 naming the extra to install when one of its ``modules`` does not import, as the
    other optional dependencies are reported (``--baseline ray needs Ray: pip install
    'rl-fabric[ray]'``), instead of the traceback of the first import that needs it."""
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            missing = isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == module
            why = "" if missing else f" (it does not import: {e})"  # installed but broken
            fail(f"{what} needs {module}{why}: pip install 'rl-fabric[{extra}]'")


def remote_backend(
    backend: str,
    *,
    endpoint_url: str | None,
    token: str | None,
    prefix: str | None,
    transport: str,
    modal_app: str | None = None,
    region: str | None = None,
) -> LambdaConfig | ModalConfig | None:
    """The lambda backend's config from ``--endpoint-url``, ``--token``, ``--prefix`` and
    ``--transport`` (the modal backend's from ``--prefix``, where given: an app deployed under
    another prefix than its default); ``None`` for another backend, which none of them is for.
    Exit 2 on an option given to a backend that ignores it, or a bad value, named as its
    option (a bad ``--transport`` was pydantic's traceback, once the bench had begun)."""
    from pydantic import ValidationError

    from fabric.backends.base import LambdaConfig, ModalConfig, region_problem

    if modal_app is not None and backend != "modal":
        fail(f"--modal-app is for --backend modal, not {backend}")
    if backend != "lambda":
        given = {"--endpoint-url": endpoint_url, "--token": token, "--region": region}
        given["--transport"] = None if transport == "auto" else transport
        if backend != "modal":
            given["--prefix"] = prefix
        for option, value in given.items():
            if value is not None and (value or option == "--prefix"):  # --prefix "" is given too
                takes = "lambda or modal" if option == "--prefix" else "lambda (a `fabric serve` or AWS)"
                fail(f"{option} is for --backend {takes}, not {backend}")
        if backend != "modal":
            return None
        given_modal = {"function_prefix": prefix, "app_name": modal_app}
        chosen = {k: v for k, v in given_modal.items() if v is not None}
        try:
            return ModalConfig(**chosen) if chosen else None
        except ValidationError as e:
            bad_options(e, {"function_prefix": "--prefix", "app_name": "--modal-app"})
    if region is not None and endpoint_url is None:  # worded as deploy's --region
        problem = region_problem(region)
        if problem is not None:
            fail(f"--region {problem}")
    regional: dict[str, Any] = {} if region is None else {"region": region}
    try:
        return LambdaConfig(
            endpoint_url=endpoint_url, token=token, function_prefix=prefix, transport=transport, **regional
        )
    except ValidationError as e:
        bad_options(e, {"function_prefix": "--prefix"})


def bad_options(e: ValidationError, renamed: dict[str, str] | None = None) -> NoReturn:
    """Exit 2 on pydantic's errors for a config built from options, each on one line and
    named as the option it came from (``--n must be >= 1 (got 0)``): pydantic's own text
    named the config model, the field and a documentation URL, over four lines.
    ``renamed`` maps a config key to its option where the two differ."""
    from pydantic import BaseModel

    from fabric.config_messages import problems

    said = []
    for key, msg in problems(e, BaseModel):  # options make no unknown keys: no model to list
        if not key:  # a check of the options together: its message names what it checks
            said.append(msg)
            continue
        option = (renamed or {}).get(key) or "--" + key.split(".")[-1].replace("_", "-")
        said.append(f"{option} {msg.removeprefix('Input ')}")  # "--x should be a finite number"
    fail("; ".join(said))


_LISTEN_HINTS = {
    errno.EADDRINUSE: "; another process listens there (a fabric serve still running?): stop it, "
    "or pick another --port (--port 0 picks a free one)",
    errno.EADDRNOTAVAIL: "; it is not an address of this machine: --host 127.0.0.1 (this machine "
    "only) or 0.0.0.0 (every interface)",
    errno.EACCES: "; ports below 1024 need privileges: pick a --port above 1023",
}


def listen_failed(host: str, port: int, e: OSError) -> NoReturn:
    """Exit 2 on a server's ``OSError``: the port is taken, the address is not ours. A
    closed stdout (``fabric serve | head -0``) is raised on, for click to end quietly on:
    it was reported as "cannot listen on ...: Broken pipe"."""
    if e.errno == errno.EPIPE:
        raise e
    if isinstance(e, socket.gaierror):  # a --host that does not resolve (999.1.1.1, a typo)
        hint = (
            "; --host is neither an IP address nor a name that resolves: 127.0.0.1 (this machine "
            "only) or 0.0.0.0 (every interface)"
        )
    else:
        hint = _LISTEN_HINTS.get(e.errno or 0, "")
    # the system's words for an errno: asyncio's bind error (aiohttp's site, openrlhf-serve)
    # carries a sentence of its own as strerror, which said the address and port again
    why = os.strerror(e.errno) if e.errno and e.errno > 0 and not isinstance(e, socket.gaierror) else None
    fail(f"cannot listen on {host}:{port}: {why or e.strerror or e}{hint}")
