"""``fabric ls``, ``fabric invoke`` and ``fabric bench``."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import typer
from rich.table import Table

from fabric.cli._app import (
    BAD_INPUT,
    EndpointUrlOpt,
    ModalAppOpt,
    ModulesOpt,
    PrefixOpt,
    RegionOpt,
    TokenOpt,
    TransportOpt,
    app,
    bad_options,
    err,
    fail,
    load_registry,
    out,
    payload_arg,
    remote_backend,
)
from fabric.errors import FabricError
from fabric.usercode import prints_to_stderr


@app.command("ls", epilog="Example: fabric ls -m my_rewards.py --json")
def ls_cmd(
    modules: ModulesOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print every field as one JSON array.")] = False,
) -> None:
    """List registered functions."""
    try:
        reg = load_registry(modules)
    except FabricError as e:
        fail(str(e))
    if as_json:
        print(json.dumps([s.model_dump(mode="json") for s in reg.specs()], indent=2))
        return
    specs = reg.specs()
    # on a narrow terminal (80 columns, or a pipe) the short columns keep their width, the
    # entry folds, and the version and the description (the longest) are left out
    wide = out.width >= 120
    table = Table(
        title=f"{len(reg)} functions" + ("" if wide else " (--json or a wider terminal: all fields)")
    )
    table.add_column("name", no_wrap=True, min_width=min(max((len(s.name) for s in specs), default=4), 28))
    cols = (
        ("kind", "version", "warm", "max conc.", "timeout s")
        if wide
        else ("kind", "warm", "conc.", "timeout")
    )
    for col in cols:
        table.add_column(col, no_wrap=True, min_width=len(col))
    table.add_column("entry", overflow="fold", ratio=1)
    if wide:
        table.add_column("description", ratio=1)
    for s in specs:
        limits = [str(s.warm), str(s.max_concurrency), f"{s.timeout_s:g}"]
        if wide:
            table.add_row(s.name, s.kind, s.version[:12], *limits, s.entry, s.description)
        else:
            table.add_row(s.name, s.kind, *limits, s.entry)
    out.print(table)


@app.command(
    help="Call a function once and print its Result as JSON (exit 1 if the call failed, 2 if it was "
    "refused as bad input: an unknown function, arguments the function does not take).",
    epilog="Example: fabric invoke exact_match --backend inproc --payload "
    '\'{"traj": "The answer is: Paris.", "ground_truth": "paris"}\'',
)
def invoke(
    name: Annotated[str, typer.Argument(help="A registered function (fabric ls lists them).")],
    payload: Annotated[
        str,
        typer.Option(help="Keyword arguments as a JSON object; @FILE reads it from a file, @- from stdin."),
    ] = "{}",
    modules: ModulesOpt = None,
    backend: Annotated[
        str,
        typer.Option(
            help="local (warm worker processes), inproc (this process), lambda (a `fabric serve` at "
            "--endpoint-url, or AWS) or modal (a `fabric deploy --backend modal` app).",
        ),
    ] = "local",
    endpoint_url: EndpointUrlOpt = None,
    token: TokenOpt = None,
    prefix: PrefixOpt = None,
    transport: TransportOpt = "auto",
    modal_app: ModalAppOpt = None,
    region: RegionOpt = None,
) -> None:
    args = payload_arg(payload)
    remote = remote_backend(
        backend,
        endpoint_url=endpoint_url,
        token=token,
        prefix=prefix,
        transport=transport,
        modal_app=modal_app,
        region=region,
    )
    try:
        reg = load_registry(modules)
    except FabricError as e:
        fail(str(e))

    async def run() -> Any:
        from fabric.client import Client

        async with Client(backend=remote or backend, registry=reg) as c:
            return await c.call(name, args)

    try:
        with prints_to_stderr():  # --backend inproc runs the setup hook and the call here
            result = asyncio.run(run())
    except FabricError as e:
        fail(str(e))
    print(result.model_dump_json(indent=2, exclude={"index"}))
    if not result.ok:
        raise typer.Exit(2 if result.error is not None and result.error.type in BAD_INPUT else 1)


@app.command(epilog="Example: fabric bench exact_match --n 2000 --concurrency 16 --workers 2")
def bench(
    name: Annotated[str, typer.Argument(help="The registered function to call (fabric ls lists them).")],
    n: Annotated[int, typer.Option("--n", help="Timed calls.")] = 20_000,
    concurrency: Annotated[int, typer.Option(help="Callers issuing calls back to back.")] = 64,
    backend: Annotated[
        str, typer.Option(help="local (warm worker processes) or lambda (boto3 to --endpoint-url or AWS).")
    ] = "local",
    endpoint_url: EndpointUrlOpt = None,
    token: TokenOpt = None,
    prefix: PrefixOpt = None,
    region: RegionOpt = None,
    transport: TransportOpt = "auto",
    baseline: Annotated[
        str | None,
        typer.Option(
            help="Same-run baseline: 'ray' (the function on round-robin Ray actors) or 'fn:NAME' "
            "(another registered function under the same load and payload)."
        ),
    ] = None,
    workers: Annotated[
        int | None, typer.Option(help="Worker processes / Ray actors (default: CPUs).")
    ] = None,
    payload: Annotated[
        str | None,
        typer.Option(help="JSON payload, or @FILE / @- (stdin) (default: the function's first example)."),
    ] = None,
    straggler_rate: Annotated[float, typer.Option(help="Share of calls whose reply is held back.")] = 0.0,
    straggler_ms: Annotated[float, typer.Option(help="How long a straggling reply is held back.")] = 200.0,
    hedge: Annotated[
        bool, typer.Option("--hedge/--no-hedge", help="Hedged requests after the observed p95.")
    ] = True,
    compare_hedge: Annotated[
        bool, typer.Option(help="Also run with hedging flipped, in the same run.")
    ] = False,
    modules: ModulesOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Closed-loop benchmark of one function, with same-run baselines."""
    from pydantic import ValidationError

    from fabric.bench import BenchConfig, run_bench

    args = payload_arg(payload) if payload is not None else None
    # checked here, before the bench's in-process measurement: the lambda run builds its own
    # config (its connections sized to --concurrency)
    remote_backend(
        backend, endpoint_url=endpoint_url, token=token, prefix=prefix, transport=transport, region=region
    )
    try:
        reg = load_registry(modules)
        cfg = BenchConfig(
            function=name,
            n=n,
            concurrency=concurrency,
            backend=backend,
            endpoint_url=endpoint_url,
            token=token,
            function_prefix=prefix,
            region=region,
            transport=transport,
            baseline=baseline,
            workers=workers,
            payload=args,
            hedge=hedge,
            compare_hedge=compare_hedge,
            straggler_rate=straggler_rate,
            straggler_ms=straggler_ms,
        )
    except ValidationError as e:
        bad_options(e, {"function_prefix": "--prefix"})
    except (FabricError, ValueError) as e:
        fail(str(e))
    if as_json:
        try:
            with prints_to_stderr():  # Ray relays its actors' prints to our sys.stdout
                result = asyncio.run(run_bench(cfg, reg))
        except FabricError as e:
            fail(str(e))
        print(json.dumps(result))
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description:>16}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as prog:
        tasks: dict[str, Any] = {}

        def progress(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = prog.add_task(label, total=total)
            prog.update(tasks[label], completed=done)

        try:
            with prints_to_stderr():
                result = asyncio.run(run_bench(cfg, reg, progress))
        except FabricError as e:
            fail(str(e))
    table = Table("metric", "value", title=f"fabric bench {name}")
    for k, v in result.items():
        table.add_row(k, f"{v:,.3f}" if isinstance(v, float) else str(v))
    out.print(table)
