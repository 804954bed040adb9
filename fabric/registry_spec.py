"""The ``FunctionSpec`` of a decorated function (``make_spec``): its signature read and
checked, the decorator's options validated. Split from ``fabric.registry``, which
re-exports its names."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, get_type_hints

from pydantic import ValidationError

from fabric.errors import RegistryError, SignatureError, validation_problems
from fabric.registry_code import FunctionCode, capture_code
from fabric.registry_imports import entry_point_of
from fabric.spec import CTX_PARAM, FunctionSpec, Kind, ParamSpec, Resources, RetryPolicy


def _params_of(fn: Callable[..., Any], kind: Kind) -> tuple[tuple[ParamSpec, ...], bool]:
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise SignatureError(f"cannot read the signature of {name}: {e}") from None
    try:
        hints = get_type_hints(fn)
    except Exception:  # unresolvable forward references: validate those params as Any
        hints = {}
    params: list[ParamSpec] = []
    accepts_extra = False
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            raise SignatureError(
                f"{name}: *{p.name} is not supported; payloads are keyword arguments, "
                "so declare each argument by name"
            )
        if p.kind is p.POSITIONAL_ONLY:
            raise SignatureError(f"{name}: positional-only parameter {p.name!r} cannot be passed by name")
        if p.kind is p.VAR_KEYWORD:
            accepts_extra = True
            continue
        if p.name == CTX_PARAM:
            continue  # filled by the worker with the setup hook's return value
        hint = hints.get(p.name, p.annotation)
        ann = "Any" if hint is inspect.Parameter.empty else getattr(hint, "__name__", str(hint))
        params.append(ParamSpec(name=p.name, required=p.default is p.empty, annotation=ann))
    if kind == "reward" and not params and not accepts_extra:
        raise SignatureError(f"reward {name} takes no arguments; it needs at least the trajectory")
    return tuple(params), accepts_extra


#: FunctionSpec fields that ``make_spec`` derives from the function: never decorator options.
_DERIVED = frozenset({"version", "entry", "params", "is_async", "accepts_extra"})


def make_spec(
    fn: Callable[..., Any],
    *,
    kind: Kind,
    name: str | None = None,
    setup: Callable[[], Any] | None = None,
    retry: RetryPolicy | dict[str, Any] | None = None,
    resources: Resources | dict[str, Any] | None = None,
    code: FunctionCode | None = None,
    **options: Any,
) -> FunctionSpec:
    """The spec of ``fn``. ``code``: ``capture_code(fn, setup)``, taken by the caller that
    keeps it (the decorator), else here."""
    if not callable(fn) or inspect.isclass(fn):
        raise SignatureError(f"@{kind} decorates a function, got {fn!r}")
    derived = sorted(_DERIVED & options.keys())
    if derived:
        # read from the function itself; passed, they raised a bare TypeError (given twice)
        raise RegistryError(
            f"bad options for function {name or getattr(fn, '__name__', fn)!r}: "
            f"{', '.join(derived)} cannot be set, the decorator reads them from the function"
        )
    if not isinstance(getattr(fn, "__name__", None), str) or not hasattr(fn, "__qualname__"):
        # a functools.partial, a callable object: no name to register or to import it by
        raise SignatureError(
            f"@{kind} decorates a function defined with def; {fn!r} has no __name__ (a partial or a "
            "callable object): wrap it in a function"
        )
    if setup is not None and not callable(setup):
        raise SignatureError(f"setup= must be a callable, got {setup!r}")
    if setup is not None and not hasattr(setup, "__qualname__"):
        raise SignatureError(f"setup= must be a function defined with def (workers import it), got {setup!r}")
    if setup is not None:
        try:
            setup_params = inspect.signature(setup).parameters
        except (TypeError, ValueError) as e:
            raise SignatureError(f"cannot read the signature of the setup hook {setup!r}: {e}") from None
        if setup_params:
            raise SignatureError("the setup hook takes no arguments; it runs once per worker")
    params, accepts_extra = _params_of(fn, kind)
    fn_name = name if name is not None else fn.__name__  # name="" is refused, not ignored
    description = options.pop("description", None)
    if description is None:
        description = inspect.cleandoc(fn.__doc__ or "").split("\n\n")[0]
    try:
        return FunctionSpec(
            name=fn_name,
            kind=kind,
            entry=entry_point_of(fn),
            description=description,
            version=(code or capture_code(fn, setup)).version,
            is_async=inspect.iscoroutinefunction(fn),
            setup=entry_point_of(setup) if setup is not None else None,
            params=params,
            accepts_extra=accepts_extra,
            # validated as part of the spec: an error names retry.max_attempts, not max_attempts
            retry=retry if retry is not None else RetryPolicy(),
            resources=resources if resources is not None else Resources(),
            **options,
        )
    except ValidationError as e:
        raise RegistryError(
            f"bad options for function {fn_name!r}: {validation_problems(e, FunctionSpec)}"
        ) from None
