"""``fabric serve``: the Lambda Invoke API over the local pools."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from fabric.cli._app import (
    LOAD_YOURS,
    SERVE_EXTRA,
    DrainOpt,
    ModulesOpt,
    app,
    bad_options,
    err,
    fail,
    listen_failed,
    load_registry,
    plural_calls,
    require_extra,
)
from fabric.errors import FabricError, UnknownFunctionError


@app.command(
    help="Serve the registered functions over the AWS Lambda Invoke API (for the lambda backend, "
    "boto3, the AWS CLI), with tokens and per-tenant quotas.",
    epilog="Example: fabric serve --port 9000 -m my_rewards.py, then: fabric invoke NAME -m my_rewards.py "
    "--backend lambda --endpoint-url http://127.0.0.1:9000 --token TOKEN (the token it prints)",
)
def serve(
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0 picks a free one).")] = 9000,
    token: Annotated[
        str | None,
        typer.Option(
            help="Bearer token of the one tenant 'default' (or $RL_FABRIC_TOKEN). Shown to anyone "
            "who runs ps: prefer --token-file or the variable."
        ),
    ] = None,
    token_file: Annotated[str | None, typer.Option(help="File holding the 'default' tenant's token.")] = None,
    tenants: Annotated[
        str | None,
        typer.Option(
            help="Tenants file (YAML): each tenant's token, quotas, max_connections, metrics "
            "access and invoke: false for a scrape-only token (see docs/serve.md)."
        ),
    ] = None,
    max_concurrency: Annotated[
        int | None,
        typer.Option(
            help="Calls the 'default' tenant may hold at once (64; with --tenants, each tenant's "
            "max_concurrency in the file)."
        ),
    ] = None,
    max_connections: Annotated[
        int | None,
        typer.Option(
            help="Connections the 'default' tenant may hold open (twice --max-concurrency; with "
            "--tenants, each tenant's max_connections in the file)."
        ),
    ] = None,
    keepalive_s: Annotated[
        float,
        typer.Option(help="Seconds an idle connection is kept open (longer than clients' and proxies')."),
    ] = 75.0,
    functions: Annotated[
        list[str] | None, typer.Option("--function", "-f", help="Serve only these functions (repeatable).")
    ] = None,
    workers: Annotated[
        int | None, typer.Option(help="Worker processes per function (default: CPUs).")
    ] = None,
    prefix: Annotated[
        str, typer.Option(help="Requests name functions PREFIX + name, as `fabric deploy --prefix` does.")
    ] = "",
    body_timeout_s: Annotated[
        float,
        typer.Option(
            help="Seconds a request's body may take to arrive after its headers (then 408), and an "
            "answer to be taken by its client (then its connection closes)."
        ),
    ] = 60.0,
    drain_s: DrainOpt = 30.0,
    modules: ModulesOpt = None,
) -> None:
    require_extra("fabric serve", "serve", SERVE_EXTRA)
    from pydantic import ValidationError

    from fabric.backends.base import TOKEN_ENV
    from fabric.serve import Gateway, ServeConfig, TenantConfig, load_tenants, new_token
    from fabric.serve.drain import SignalStop, close_in_two_steps, start_unless_stopped

    generated = None
    try:
        reg = load_registry(modules)
        for name in functions or ():
            try:
                reg.get(name)
            except UnknownFunctionError as e:  # names what is registered
                fail(f"--function: {e}; {LOAD_YOURS}")
        if tenants is not None:
            if token or token_file:
                fail("give --tenants or --token/--token-file, not both")
            for flag, given, key in (
                ("--max-concurrency", max_concurrency, "max_concurrency"),
                ("--max-connections", max_connections, "max_connections"),
            ):
                if given is not None:
                    # the default tenant's bound: with a tenants file there is none to take it
                    fail(
                        f"{flag} is the 'default' tenant's bound; with --tenants, give each "
                        f"tenant its {key} in the tenants file"
                    )
            tenant_map = load_tenants(tenants)
        else:
            secret = token or os.environ.get(TOKEN_ENV)
            if token_file is None and not secret:
                secret = generated = new_token()
            if token_file:
                # named as the option: the tenant's own check says "token_file", a tenants
                # file's key, which this command line has none of
                try:
                    Path(token_file).read_bytes()
                except OSError as e:
                    fail(f"--token-file {token_file}: cannot read it: {e.strerror or e}")
            source: dict[str, Any] = {"token_file": token_file} if token_file else {"token": secret}
            if max_concurrency is not None:  # else TenantConfig's default (64)
                source["max_concurrency"] = max_concurrency
            if max_connections is not None:  # else twice its max_concurrency
                source["max_connections"] = max_connections
            tenant_map = {"default": TenantConfig(**source)}
        cfg = ServeConfig(
            host=host,
            port=port,
            tenants=tenant_map,
            functions=functions,
            function_prefix=prefix,
            body_timeout_s=body_timeout_s,
            keepalive_s=keepalive_s,
            drain_s=drain_s,
            backend={"type": "local", "max_workers": workers},
        )
        gateway = Gateway(cfg, reg)
    except FabricError as e:
        fail(str(e))
    except ValidationError as e:  # a bad option value
        bad_options(e, {"function_prefix": "--prefix", "backend.local.max_workers": "--workers"})

    async def main() -> None:
        signals = SignalStop()
        stop = signals.event
        if not await start_unless_stopped(gateway.start(), stop):  # Ctrl-C during the warm-up
            await gateway.aclose()  # what the start had begun: its pools, its listener
            err.print("stopped during start-up", soft_wrap=True)
            signals.exit_if_signalled()
            return
        try:
            err.print(
                f"[bold]fabric serve[/] {len(gateway.served)} functions at {gateway.url} "
                f"(tenants: {', '.join(sorted(cfg.tenants))}); Ctrl-C stops",
                soft_wrap=True,
            )
            for name, why in sorted(gateway.not_ready.items()):
                first = why.splitlines()[0] if why else "no cause given"
                calls = "wait for a worker" if name in gateway.slow_to_start else "answer SetupFailed"
                err.print(f"[yellow]not ready:[/] {name}: {first} (its calls {calls})", soft_wrap=True)
            if generated:
                err.print(f"token (tenant 'default'): {generated}", soft_wrap=True)
            # a machine-readable line for scripts that start the server
            print(json.dumps({"url": gateway.url, "port": gateway.port}), flush=True)
            await stop.wait()
            stop.clear()
            if gateway.inflight:
                err.print(
                    f"stopping: waiting up to {cfg.drain_s:g} s for {plural_calls(gateway.inflight)} in "
                    "flight (Ctrl-C again: stop now)",
                    soft_wrap=True,
                )
        finally:
            # a second signal while the calls drain cancels them: the close then ends at once
            def say_stop_now() -> None:
                err.print(f"stopping now: {plural_calls(gateway.inflight)} cancelled", soft_wrap=True)

            await close_in_two_steps(gateway.aclose(), stop, gateway.stop_now, say_stop_now)
        signals.exit_if_signalled()  # drained and closed: after Ctrl-C exit 130, as fabric run does

    try:
        asyncio.run(main())
    except OSError as e:  # the port is taken, the address is not ours
        listen_failed(host, port, e)
    except FabricError as e:  # a function named with -f cannot start (SetupFailedError)
        fail(str(e))
    except KeyboardInterrupt:  # SIGINT or SIGTERM, once the server has closed
        raise typer.Exit(130) from None
