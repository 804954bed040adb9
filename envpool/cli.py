"""``envpool``: list environments and benchmark the pool (JSON with ``--json``)."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from envpool.errors import EnvPoolError
from fabric.registry import import_module_or_file, import_problem
from fabric.usercode import prints_to_stderr, search_cwd
from fabric.version import VersionOpt

app = typer.Typer(
    help="envpool: stateful environments in session-affine container pools.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
bench_app = typer.Typer(
    help="Benchmarks, each against a baseline measured in the same run.", no_args_is_help=True
)
app.add_typer(bench_app, name="bench")
out = Console()
err = Console(stderr=True)
ModulesOpt = Annotated[
    list[str] | None, typer.Option("--module", "-m", help="Module or file.py that registers environments.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


@app.callback()
def _options(version: VersionOpt = False) -> None:
    # no docstring: the app's help= stays the help of `envpool --help`
    pass


def _emit(result: dict[str, Any], as_json: bool, title: str) -> None:
    if as_json:
        print(json.dumps(result))
        return
    table = Table("metric", "value", title=title)
    for k, v in result.items():
        if not isinstance(v, dict):
            table.add_row(k, f"{v:,.3f}" if isinstance(v, float) else str(v))
    out.print(table)


@app.command("ls", epilog="Example: envpool ls -m my_envs.py --json")
def ls_cmd(modules: ModulesOpt = None, as_json: JsonOpt = False) -> None:
    """List registered environments (the built-ins and those of --module)."""
    import envpool.envs  # noqa: F401
    from envpool.api import default_registry

    # found in the current directory, and as a file.py, as `fabric ls -m` finds them
    search_cwd()
    for m in modules or []:
        try:
            with prints_to_stderr():  # an import-time print would come before --json's answer
                import_module_or_file(m)
        except (Exception, SystemExit) as e:  # the user's module may raise anything at import
            # a script's sys.exit outside its `if __name__ == "__main__":` ended the command
            # with that code and no word of why
            what = (
                f"it called sys.exit({e.code!r}) as it was imported; a script's exit belongs under "
                "`if __name__ == '__main__':`"
                if isinstance(e, SystemExit)
                else import_problem(m, e)
            )
            why = f"cannot import {m!r}: {what}"
            err.print(f"[bold red]error:[/] {escape(why)}", soft_wrap=True)
            raise typer.Exit(2) from None
    specs = [default_registry.spec(i) for i in default_registry.ids()]
    if as_json:
        print(json.dumps([s.model_dump(mode="json") for s in specs], indent=2))
        return
    table = Table(
        "id", "entry point", "max steps", "deterministic", "description", title=f"{len(specs)} environments"
    )
    for s in specs:
        table.add_row(
            s.id, s.entry_point, str(s.max_episode_steps or "-"), str(s.deterministic), s.description
        )
    out.print(table)


def _progress() -> tuple[Any, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cols = (TextColumn("{task.description:>10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    prog = Progress(*cols, console=err, transient=True)
    tasks: dict[str, Any] = {}

    def update(label: str, done: int, total: int) -> None:
        if label not in tasks:
            tasks[label] = prog.add_task(label, total=total)
        prog.update(tasks[label], completed=done)

    return prog, update


@bench_app.command("latency", epilog="Example: envpool bench latency --json")
def bench_latency(as_json: JsonOpt = False) -> None:
    """Warm claim and step round trip (echo-v0) vs the same step in-process."""
    from envpool.bench import latency

    _emit(asyncio.run(latency()), as_json, "envpool latency")


@bench_app.command("resets", epilog="Example: envpool bench resets --n 500 --concurrency 8")
def bench_resets(
    n: Annotated[int, typer.Option("--n", min=1, help="Resets in all.")] = 10_000,
    concurrency: Annotated[int, typer.Option(min=1, help="Sessions resetting at once.")] = 32,
    fetch_error_rate: Annotated[
        float, typer.Option(min=0, max=1, help="Share of image fetches that fail.")
    ] = 0.05,
    crash_rate: Annotated[float, typer.Option(min=0, max=1, help="Share of containers that crash.")] = 0.01,
    as_json: JsonOpt = False,
) -> None:
    """N resets under injected image-fetch errors and container crashes."""
    from envpool.bench import resets

    prog, update = _progress()
    try:
        with prog:
            result = asyncio.run(
                resets(n, concurrency, fetch_error_rate, crash_rate, None if as_json else update)
            )
    except EnvPoolError as e:
        err.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(1) from None
    _emit(result, as_json, "envpool resets")


@bench_app.command(
    "cold-image",
    # one string: typer's command list keeps a docstring's line breaks
    help="SESSIONS sessions reset at once on an uncached image: tiered cache vs every container "
    "fetching on its own, from the same bandwidth-limited origin.",
    epilog="Example: envpool bench cold-image --sessions 16 --size-mb 4",
)
def bench_cold_image(
    sessions: Annotated[int, typer.Option(min=1, help="Sessions reset at once.")] = 64,
    # at most 1 GiB: the bundle is made in memory (inf or 1e12 was an OverflowError traceback)
    size_mb: Annotated[float, typer.Option(min=0.01, max=1024, help="Image data in MiB.")] = 8.0,
    bandwidth_mbps: Annotated[float, typer.Option(min=0.1, help="Origin link in MB/s.")] = 40.0,
    as_json: JsonOpt = False,
) -> None:
    from envpool.bench import cold_image

    prog, update = _progress()
    with prog:  # tens of seconds at the defaults: each storm's sessions as they reset
        result = asyncio.run(cold_image(sessions, size_mb, bandwidth_mbps, None if as_json else update))
    if as_json:
        print(json.dumps(result))
        return
    flat = {
        "sessions": result["sessions"],
        "bundle_bytes": result["bundle_bytes"],
        "p99_ratio": result["p99_ratio"],
    }
    for side in ("tiered", "own_fetch"):
        flat.update({f"{side}_{k}": v for k, v in result[side].items()})
    _emit(flat, False, "envpool cold-image")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
