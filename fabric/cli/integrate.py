"""``fabric integrate``: fabric rewards for trainers with a reward hook of their own."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Annotated, Any

import typer

from fabric.cli._app import (
    LOAD_YOURS,
    SERVE_EXTRA,
    TOO_DEEP,
    DrainOpt,
    ModulesOpt,
    app,
    err,
    fail,
    listen_failed,
    no_constant,
    require_extra,
)
from fabric.errors import FabricError, UnknownFunctionError
from fabric.usercode import prints_to_stderr, search_cwd

integrate_app = typer.Typer(
    help="Serve fabric rewards to trainers that already have a reward hook (TRL, veRL, OpenRLHF); "
    "see docs/integrations.md.",
    no_args_is_help=True,
)
app.add_typer(integrate_app, name="integrate")


def _pairs(items: list[str] | None, option: str, *, as_json: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"{option} takes PARAM=VALUE, got {item!r}")
        if as_json:
            try:
                out[key] = json.loads(value, parse_constant=no_constant)
            except RecursionError:
                fail(TOO_DEEP.format(f"{option} {key}: the value is"))
            except ValueError as e:
                fail(f"{option} {key}: the value is not JSON ({e}); quote text as JSON: '{key}=\"text\"'")
        else:
            out[key] = value
    return out


@integrate_app.command(
    "openrlhf-serve",
    help="Serve a reward function as OpenRLHF's remote reward model: POST /get_reward takes "
    '{"query", "prompts", "labels"} and answers {"rewards", "scores", "extra_logs"}. Train with '
    "--reward.remote_url http://HOST:PORT/get_reward.",
    epilog="Example: fabric integrate openrlhf-serve -f math_answer --port 8000",
)
def openrlhf_serve(
    function: Annotated[str, typer.Option("--function", "-f", help="The reward function to serve.")],
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port (0 picks a free one).")] = 8000,
    backend: Annotated[
        str | None, typer.Option(help="local (warm worker processes, default), inproc, or lambda.")
    ] = None,
    endpoint_url: Annotated[
        str | None, typer.Option(help="Call a fabric serve at this URL instead (backend lambda).")
    ] = None,
    arg: Annotated[
        list[str] | None,
        typer.Option(
            "--arg",
            help="PARAM=SOURCE: where a parameter's value comes from (label, prompt, query, label.KEY "
            "for a JSON label). Default: the source of the same name; ground_truth <- label.",
        ),
    ] = None,
    constant: Annotated[
        list[str] | None, typer.Option("--constant", help="PARAM=JSON: the same value for every call.")
    ] = None,
    failure_score: Annotated[
        float | None,
        typer.Option(help="Score failed calls with this (default: answer 502, which OpenRLHF retries)."),
    ] = None,
    deadline_s: Annotated[
        float,
        typer.Option(
            help="Seconds a request's calls may take; below OpenRLHF's 180 s request timeout, so a slow "
            "request is answered 502 with the calls past it named instead of hung up on."
        ),
    ] = 150.0,
    workers: Annotated[int | None, typer.Option(help="Worker processes per function (local).")] = None,
    drain_s: DrainOpt = 30.0,
    max_body_mb: Annotated[
        int,
        typer.Option(
            min=1,
            help="Largest request body, in MiB (a micro-batch of samples; each sample's call is still "
            "limited to 6 MiB).",
        ),
    ] = 256,
    modules: ModulesOpt = None,
) -> None:
    require_extra("fabric integrate openrlhf-serve", "serve", SERVE_EXTRA)
    from fabric.integrations.config import IntegrationConfig
    from fabric.integrations.openrlhf import serve as serve_openrlhf

    options: dict[str, Any] = {
        "function": function,
        "endpoint_url": endpoint_url,
        "modules": tuple(modules or ()),
        "args": _pairs(arg, "--arg", as_json=False),
        "constants": _pairs(constant, "--constant", as_json=True),
        "failure_score": failure_score,
        "deadline_s": deadline_s,
    }
    # checked here to name the options: the integration config's errors name its keys
    # (deadline_s, a backend's max_workers)
    if backend is not None and backend not in ("local", "inproc", "lambda", "modal"):
        fail(f"--backend must be local, inproc, lambda or modal, got {backend!r}")
    if workers is not None and workers < 1:
        fail(f"--workers must be >= 1 (got {workers})")
    if not deadline_s > 0:  # NaN too
        fail(f"--deadline-s must be > 0 (got {deadline_s:g})")
    if workers is not None:
        if backend not in (None, "local"):
            fail("--workers is for the local backend")
        options["backend"] = {"type": "local", "max_workers": workers}
    elif backend is not None:
        options["backend"] = backend
    search_cwd()  # -m my_rewards next to my_rewards.py, as for the other commands
    try:
        config = IntegrationConfig.parse(options, env={})
    except FabricError as e:
        fail(str(e))

    stdout = sys.stdout  # the URL line's; the user's prints (its modules, inproc calls): stderr

    def ready(url: str) -> None:
        err.print(
            f"[bold]fabric integrate openrlhf-serve[/] {function} at {url}; Ctrl-C stops", soft_wrap=True
        )
        print(json.dumps({"url": url}), file=stdout, flush=True)

    try:
        with prints_to_stderr():
            asyncio.run(
                serve_openrlhf(
                    config,
                    host=host,
                    port=port,
                    ready=ready,
                    drain_s=drain_s,
                    say=lambda text: err.print(text, soft_wrap=True),
                    max_body_bytes=max_body_mb * 1024 * 1024,
                )
            )
    except OSError as e:
        listen_failed(host, port, e)
    except UnknownFunctionError as e:  # names what is registered; said as serve's -f says it
        fail(f"--function: {e}; {LOAD_YOURS}")
    except FabricError as e:  # a bad module
        fail(str(e))
    except KeyboardInterrupt:  # SIGINT or SIGTERM, once the server has closed
        raise typer.Exit(130) from None
