"""``fabric``: list, invoke and benchmark registered functions; run an RL job.

Functions are discovered from the built-in ``functions`` package, from ``--module/-m``
(module names, ``module:attr`` or ``file.py``), and from ``$FABRIC_MODULES``
(comma-separated). The core is async; this is its thin synchronous edge.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fabric.errors import ErrorCode, FabricError, UnknownFunctionError
from fabric.registry import Registry

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

ModulesOpt = Annotated[
    list[str] | None,
    typer.Option("--module", "-m", help="Module, package, module:attr or file.py to discover functions in."),
]
BackendOpt = Annotated[str, typer.Option(help="Backend: local (warm worker processes) or inproc.")]


def _registry(modules: list[str] | None) -> Registry:
    # `python -m fabric.cli` searches the current directory, the installed `fabric` script
    # does not: `-m my_rewards` next to my_rewards.py must work with both. Last, so a file
    # here cannot shadow an installed package (the built-in `functions` above all); worker
    # processes get this sys.path, so they import the module too
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    reg = Registry()
    targets = ["functions", *(modules or [])]
    targets += [m for m in os.environ.get("FABRIC_MODULES", "").split(",") if m.strip()]
    reg.discover(*targets)
    return reg


#: Failed calls that are the caller's mistake: ``invoke`` exits 2 for these, as for bad options
_BAD_INPUT = frozenset(
    {
        ErrorCode.UNKNOWN_FUNCTION,
        ErrorCode.INVALID_ARGUMENTS,
        ErrorCode.PAYLOAD_TOO_LARGE,
        ErrorCode.PAYLOAD_NOT_SERIALIZABLE,
    }
)


#: How a function of the user's own gets registered, for errors about an unknown one
_LOAD_YOURS = (
    "a function of your own registers when its module is loaded: "
    "-m MODULE (a module, module:attr or file.py) or $FABRIC_MODULES"
)


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON (payloads are strict JSON)")


def _payload_arg(text: str) -> dict[str, Any]:
    """``--payload``: a JSON object of keyword arguments; an error names the option."""
    try:
        args = json.loads(text, parse_constant=_no_constant)
    except ValueError as e:  # JSONDecodeError, or NaN/Infinity
        _fail(f"--payload is not valid JSON: {e}")
    if not isinstance(args, dict):
        _fail('--payload must be a JSON object of keyword arguments, e.g. \'{"traj": "..."}\'')
    return args


def _calls(n: int) -> str:
    return f"{n} call" if n == 1 else f"{n} calls"


def _fail(message: str, code: int = 2) -> NoReturn:
    # escaped (keys such as envs[0].id are not markup) and unwrapped (easy to grep and paste)
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


@app.command("ls")
def ls_cmd(modules: ModulesOpt = None, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List registered functions."""
    try:
        reg = _registry(modules)
    except FabricError as e:
        _fail(str(e))
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
    "refused as bad input: an unknown function, arguments the function does not take)."
)
def invoke(
    name: str,
    payload: Annotated[str, typer.Option(help="Keyword arguments as a JSON object.")] = "{}",
    modules: ModulesOpt = None,
    backend: BackendOpt = "local",
) -> None:
    args = _payload_arg(payload)
    try:
        reg = _registry(modules)
    except FabricError as e:
        _fail(str(e))

    async def run() -> Any:
        from fabric.client import Client

        async with Client(backend=backend, registry=reg) as c:
            return await c.call(name, args)

    try:
        result = asyncio.run(run())
    except FabricError as e:
        _fail(str(e))
    print(result.model_dump_json(indent=2, exclude={"index"}))
    if not result.ok:
        raise typer.Exit(2 if result.error is not None and result.error.type in _BAD_INPUT else 1)


@app.command()
def bench(
    name: str,
    n: Annotated[int, typer.Option("--n", help="Timed calls.")] = 20_000,
    concurrency: Annotated[int, typer.Option(help="Callers issuing calls back to back.")] = 64,
    backend: Annotated[
        str, typer.Option(help="local (warm worker processes) or lambda (boto3 to --endpoint-url or AWS).")
    ] = "local",
    endpoint_url: Annotated[
        str | None, typer.Option(help="With --backend lambda: a `fabric serve` URL (default: AWS).")
    ] = None,
    token: Annotated[
        str | None, typer.Option(help="`fabric serve` token (default: $RL_FABRIC_TOKEN).")
    ] = None,
    prefix: Annotated[str, typer.Option(help="With --backend lambda: deployed name prefix.")] = "",
    transport: Annotated[
        str, typer.Option(help="With --backend lambda: auto, boto3 or http (aiohttp; fabric serve only).")
    ] = "auto",
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
        str | None, typer.Option(help="JSON payload (default: the function's first example).")
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
    from fabric.bench import BenchConfig, run_bench

    args = _payload_arg(payload) if payload is not None else None
    try:
        reg = _registry(modules)
        cfg = BenchConfig(
            function=name,
            n=n,
            concurrency=concurrency,
            backend=backend,
            endpoint_url=endpoint_url,
            token=token,
            function_prefix=prefix,
            transport=transport,
            baseline=baseline,
            workers=workers,
            payload=args,
            hedge=hedge,
            compare_hedge=compare_hedge,
            straggler_rate=straggler_rate,
            straggler_ms=straggler_ms,
        )
    except (FabricError, ValueError) as e:
        _fail(str(e))
    if as_json:
        try:
            result = asyncio.run(run_bench(cfg, reg))
        except FabricError as e:
            _fail(str(e))
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
            result = asyncio.run(run_bench(cfg, reg, progress))
        except FabricError as e:
            _fail(str(e))
    table = Table("metric", "value", title=f"fabric bench {name}")
    for k, v in result.items():
        table.add_row(k, f"{v:,.3f}" if isinstance(v, float) else str(v))
    out.print(table)


@app.command(
    help="Serve the registered functions over the AWS Lambda Invoke API (for the lambda backend, "
    "boto3, the AWS CLI), with tokens and per-tenant quotas."
)
def serve(
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0 picks a free one).")] = 9000,
    token: Annotated[
        str | None, typer.Option(help="Bearer token of the one tenant 'default' (or $RL_FABRIC_TOKEN).")
    ] = None,
    token_file: Annotated[str | None, typer.Option(help="File holding the 'default' tenant's token.")] = None,
    tenants: Annotated[
        str | None, typer.Option(help="Key file: tenants with tokens and quotas (see docs/serve.md).")
    ] = None,
    max_concurrency: Annotated[
        int, typer.Option(help="Calls the 'default' tenant may hold at once (with --token/--token-file).")
    ] = 64,
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
        typer.Option(help="Seconds a request's body may take to arrive after its headers (then 408)."),
    ] = 60.0,
    drain_s: Annotated[
        float,
        typer.Option(help="On Ctrl-C, seconds the calls in flight get to finish (a second Ctrl-C: none)."),
    ] = 30.0,
    modules: ModulesOpt = None,
) -> None:
    from fabric.backends.base import TOKEN_ENV
    from fabric.serve import Gateway, ServeConfig, TenantConfig, load_tenants, new_token

    generated = None
    try:
        reg = _registry(modules)
        for name in functions or ():
            try:
                reg.get(name)
            except UnknownFunctionError as e:  # names what is registered
                _fail(f"--function: {e}; {_LOAD_YOURS}")
        if tenants is not None:
            if token or token_file:
                _fail("give --tenants or --token/--token-file, not both")
            tenant_map = load_tenants(tenants)
        else:
            secret = token or os.environ.get(TOKEN_ENV)
            if token_file is None and not secret:
                secret = generated = new_token()
            source: dict[str, Any] = {"token_file": token_file} if token_file else {"token": secret}
            tenant_map = {"default": TenantConfig(max_concurrency=max_concurrency, **source)}
        cfg = ServeConfig(
            host=host,
            port=port,
            tenants=tenant_map,
            functions=functions,
            function_prefix=prefix,
            body_timeout_s=body_timeout_s,
            drain_s=drain_s,
            backend={"type": "local", "max_workers": workers},
        )
        gateway = Gateway(cfg, reg)
    except FabricError as e:
        _fail(str(e))
    except ValueError as e:  # pydantic's, for a bad option value
        _fail(str(e))

    async def main() -> None:
        import signal

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await gateway.start()
        try:
            err.print(
                f"[bold]fabric serve[/] {len(gateway.served)} functions at {gateway.url} "
                f"(tenants: {', '.join(sorted(cfg.tenants))}); Ctrl-C stops",
                soft_wrap=True,
            )
            for name, why in sorted(gateway.not_ready.items()):
                first = why.splitlines()[0] if why else name
                err.print(f"[yellow]not ready:[/] {first} (its calls answer SetupFailed)", soft_wrap=True)
            if generated:
                err.print(f"token (tenant 'default'): {generated}", soft_wrap=True)
            # a machine-readable line for scripts that start the server
            print(json.dumps({"url": gateway.url, "port": gateway.port}), flush=True)
            await stop.wait()
            stop.clear()
            if gateway.inflight:
                err.print(
                    f"stopping: waiting up to {cfg.drain_s:g} s for {_calls(gateway.inflight)} in "
                    "flight (Ctrl-C again: stop now)",
                    soft_wrap=True,
                )
        finally:
            # a second signal while the calls drain cancels them: the close then ends at once
            closing = asyncio.create_task(gateway.aclose())
            again = asyncio.create_task(stop.wait())
            await asyncio.wait({closing, again}, return_when=asyncio.FIRST_COMPLETED)
            if not closing.done():
                err.print(f"stopping now: {_calls(gateway.inflight)} cancelled", soft_wrap=True)
                gateway.stop_now()
            again.cancel()
            await closing

    try:
        asyncio.run(main())
    except OSError as e:  # the port is taken, the address is not ours
        _fail(f"cannot listen on {host}:{port}: {e.strerror or e}")
    except FabricError as e:  # a function named with -f cannot start (SetupFailedError)
        _fail(str(e))


@app.command(
    help="Deploy the registered functions: AWS Lambda (terraform or boto3) with a `live` alias and "
    "provisioned concurrency for warm functions, or a Modal app."
)
def deploy(
    backend: Annotated[
        str, typer.Option(help="lambda (terraform, or boto3 with --direct) or modal.")
    ] = "lambda",
    direct: Annotated[bool, typer.Option(help="Deploy with boto3 instead of terraform.")] = False,
    plan_only: Annotated[bool, typer.Option(help="terraform: init and plan, no apply.")] = False,
    prefix: Annotated[str, typer.Option(help="Deployed names are PREFIX + function name.")] = "rl-fabric-",
    region: Annotated[str | None, typer.Option(help="AWS region (default $AWS_REGION or us-east-1).")] = None,
    endpoint_url: Annotated[
        str | None, typer.Option(help="--direct against an AWS-compatible endpoint (moto, LocalStack).")
    ] = None,
    role_arn: Annotated[
        str | None, typer.Option(help="--direct: execution role (default: create PREFIXlambda).")
    ] = None,
    functions: Annotated[
        list[str] | None, typer.Option("--function", "-f", help="Deploy only these (repeatable).")
    ] = None,
    warm: Annotated[
        int | None,
        typer.Option(help="Provisioned concurrency for every function (default: each one's warm)."),
    ] = None,
    reserved: Annotated[bool, typer.Option(help="Cap each function at its max_concurrency.")] = False,
    terraform_dir: Annotated[str, typer.Option(help="Where fabric.auto.tfvars.json goes.")] = "terraform",
    out_dir: Annotated[str, typer.Option("--out", help="Where the package is built.")] = "build",
    deps: Annotated[
        bool, typer.Option("--deps/--no-deps", help="Put the dependencies in the zip (or use a layer).")
    ] = True,
    image: Annotated[
        str | None,
        typer.Option(help="Deploy this container image URI; its build context is written to OUT/image."),
    ] = None,
    architecture: Annotated[str, typer.Option(help="x86_64 or arm64.")] = "x86_64",
    modules: ModulesOpt = None,
) -> None:
    from pathlib import Path

    from fabric.deploy import DeployError, plan_functions

    if backend not in ("lambda", "modal"):
        _fail(f"--backend must be lambda or modal, got {backend!r}")
    if architecture not in ("x86_64", "arm64"):
        _fail(f"--architecture must be x86_64 or arm64, got {architecture!r}")
    try:
        reg = _registry(modules)
        plan = plan_functions(reg, functions, prefix=prefix, warm=warm, reserved=reserved)
        if backend == "modal":
            from fabric.deploy.modal_ import deploy_modal

            deploy_modal(reg, plan, echo=lambda m: err.print(escape(m), soft_wrap=True))
            return
        _deploy_lambda(
            plan,
            direct=direct,
            plan_only=plan_only,
            prefix=prefix,
            region=region
            or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION")
            or "us-east-1",
            endpoint_url=endpoint_url,
            role_arn=role_arn,
            terraform_dir=Path(terraform_dir),
            out=Path(out_dir),
            deps=deps,
            image=image,
            architecture=architecture,
        )
    except (DeployError, FabricError) as e:
        _fail(str(e))


def _deploy_lambda(plan: Any, **o: Any) -> None:
    from fabric.deploy import DeployError
    from fabric.deploy.package import build_zip, image_context
    from fabric.deploy.terraform import run_terraform, terraform_binary
    from fabric.deploy.tfvars import tfvars, write_tfvars

    say = lambda m: err.print(escape(m), soft_wrap=True)  # noqa: E731
    if o["image"] is not None:
        if o["direct"]:
            raise DeployError("--direct deploys zip packages; deploy an --image with terraform")
        ctx = image_context(plan, o["out"] / "image", architecture=o["architecture"])
        say(f"image build context: {ctx} (build and push it as {o['image']})")
        values = tfvars(plan, region=o["region"], prefix=o["prefix"], image_uri=o["image"])
    else:
        if o["direct"] and o["endpoint_url"] is None:
            from fabric.deploy.direct import check_credentials

            check_credentials(o["region"])  # before packaging, which takes a while
        say(f"packaging {len(plan)} functions" + (" with dependencies (pip)" if o["deps"] else ""))
        zip_path = build_zip(
            plan, o["out"] / "fabric-lambda.zip", deps=o["deps"], architecture=o["architecture"]
        )
        say(f"package: {zip_path} ({zip_path.stat().st_size / 2**20:.1f} MiB)")
        if o["direct"]:
            from fabric.deploy.direct import DirectConfig, deploy_direct

            cfg = DirectConfig(
                region=o["region"],
                endpoint_url=o["endpoint_url"],
                role_arn=o["role_arn"],
                prefix=o["prefix"],
                architecture=o["architecture"],
            )
            done = deploy_direct(plan, zip_path, cfg, on_step=say)
            table = Table("function", "deployed as", "version", "warm", "alias ARN", title="deployed")
            for d in done:
                table.add_row(d.name, d.deployed_name, d.version, str(d.provisioned), d.alias_arn)
            out.print(table)
            print(json.dumps([d.model_dump() for d in done]))
            return
        values = tfvars(
            plan,
            region=o["region"],
            prefix=o["prefix"],
            zip_path=str(zip_path.resolve()),
            architecture=o["architecture"],
        )
    path = write_tfvars(values, o["terraform_dir"])
    say(f"wrote {path}")
    if terraform_binary() is None:
        last = "terraform plan" if o["plan_only"] else "terraform plan && terraform apply"
        say(f"terraform is not on PATH; run: cd {o['terraform_dir']} && terraform init && {last}")
        return
    run_terraform(o["terraform_dir"], plan_only=o["plan_only"], echo=say)


@app.command()
def run(
    config: Annotated[str, typer.Argument(help="A job config (YAML), e.g. examples/frozenlake/config.yaml.")],
    steps: Annotated[int | None, typer.Option(help="Override the config's training steps.")] = None,
    run_dir: Annotated[str | None, typer.Option(help="Override the config's run directory.")] = None,
    quiet: Annotated[bool, typer.Option(help="No progress display; print only the summary JSON.")] = False,
) -> None:
    """Run an RL job: a local Ray cluster, local fabric pools, process containers."""
    try:
        from core.errors import CoreError
        from core.job import Job, load
    except ImportError as e:  # the job needs the ray and train extras
        _fail(f"the RL job needs its extras: pip install -e '.[ray,train,rewards]' ({e})")
    try:
        cfg = load(config, steps=steps, run_dir=run_dir)
        summary = asyncio.run(Job(cfg, progress=not quiet).run())
    except CoreError as e:  # a bad config, or a rollout where every group fails
        _fail(str(e))
    if not quiet:
        _print_summary(summary)
    print(json.dumps(summary))


def _print_summary(summary: dict[str, Any]) -> None:
    table = Table("figure", "value", title="job summary")
    for k in (
        "mode",
        "steps",
        "train_wall_s",
        "step_s_mean",
        "untrained_success",
        "final_success",
        "final_success_sampled",
        "best_eval_success",
        "final_train_reward",
        "aborted_trained",
        "run_dir",
    ):
        table.add_row(k, str(summary.get(k)))
    err.print(table)


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
            _fail(f"{option} takes PARAM=VALUE, got {item!r}")
        if as_json:
            try:
                out[key] = json.loads(value, parse_constant=_no_constant)
            except ValueError as e:
                _fail(f"{option} {key}: the value is not JSON ({e}); quote text as JSON: '{key}=\"text\"'")
        else:
            out[key] = value
    return out


@integrate_app.command(
    "openrlhf-serve",
    help="Serve a reward function as OpenRLHF's remote reward model: POST /get_reward takes "
    '{"query", "prompts", "labels"} and answers {"rewards", "scores", "extra_logs"}. Train with '
    "--reward.remote_url http://HOST:PORT/get_reward.",
)
def openrlhf_serve(
    function: Annotated[str, typer.Option("--function", "-f", help="The reward function to serve.")],
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0 picks a free one).")] = 8000,
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
    modules: ModulesOpt = None,
) -> None:
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
    if workers is not None:
        if backend not in (None, "local"):
            _fail("--workers is for the local backend")
        options["backend"] = {"type": "local", "max_workers": workers}
    elif backend is not None:
        options["backend"] = backend
    cwd = os.getcwd()  # -m my_rewards next to my_rewards.py, as for the other commands
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        config = IntegrationConfig.parse(options, env={})
    except FabricError as e:
        _fail(str(e))

    def ready(url: str) -> None:
        err.print(
            f"[bold]fabric integrate openrlhf-serve[/] {function} at {url}; Ctrl-C stops", soft_wrap=True
        )
        print(json.dumps({"url": url}), flush=True)

    try:
        asyncio.run(serve_openrlhf(config, host=host, port=port, ready=ready))
    except OSError as e:
        _fail(f"cannot listen on {host}:{port}: {e.strerror or e}")
    except FabricError as e:  # an unknown function (with the known names), a bad module
        _fail(str(e))


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
