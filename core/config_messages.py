"""How a job config's problems are worded: pydantic's ``ValidationError`` turned into the
``(key, message)`` list ``ConfigError`` reports, and the hints those messages share.

Keys are written the way the YAML reads (``envs[1].id``, ``rewards.frozenlake[0].function``);
an unknown key names the allowed ones and the closest match. The cross-field problems
``JobConfig`` collects travel through pydantic as one custom error (``semantic_error``) and
are unpacked here into their own entries.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

_SEMANTICS = "job_semantics"  # error type carrying the cross-field problems as a list


def semantic_error(problems: list[tuple[str, str]]) -> PydanticCustomError:
    """The error a model validator raises to report ``problems`` (each under its own key)."""
    return PydanticCustomError(_SEMANTICS, "{count} problems", {"count": len(problems), "problems": problems})


def listing(names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(names) if names else "(none)"


def hint(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _key(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _allowed_keys(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """Field names of the model at ``loc`` (for "unknown key" messages); [] if unknown."""
    ann: Any = model
    for part in loc:
        ann = _unwrap(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            field = ann.model_fields.get(part) if isinstance(part, str) else None
            if field is None:
                return []
            ann = field.annotation
        elif get_origin(ann) is list:
            ann = get_args(ann)[0]
        elif get_origin(ann) is dict:
            ann = get_args(ann)[1]
        else:
            return []
    ann = _unwrap(ann)
    return list(ann.model_fields) if isinstance(ann, type) and issubclass(ann, BaseModel) else []


def _unwrap(ann: Any) -> Any:
    """``M`` for ``Annotated[M, ...]`` and ``M | None``."""
    if get_origin(ann) is Annotated:
        return _unwrap(get_args(ann)[0])
    if get_origin(ann) in (Union, UnionType):
        models = [a for a in get_args(ann) if a is not type(None)]
        return _unwrap(models[0]) if len(models) == 1 else ann
    return ann


def validation_problems(e: ValidationError, model: type[BaseModel]) -> list[tuple[str, str]]:
    """Every error of ``e`` (raised validating ``model``) as ``(key, message)``."""
    problems: list[tuple[str, str]] = []
    for err in e.errors(include_url=False):
        loc, kind, ctx = tuple(err["loc"]), err["type"], err.get("ctx") or {}
        if kind == _SEMANTICS:
            problems.extend(ctx["problems"])
            continue
        if kind == "extra_forbidden":
            allowed = _allowed_keys(model, loc[:-1])
            msg = "unknown key" + (
                f"{hint(str(loc[-1]), allowed)}; allowed: {', '.join(allowed)}" if allowed else ""
            )
        elif kind == "missing":
            msg = "required key is missing"
        elif kind in _BOUNDS:
            op, name = _BOUNDS[kind]
            msg = f"must be {op} {ctx[name]} (got {err['input']!r})"
        elif kind == "value_error":
            msg = str(ctx.get("error", err["msg"]))
        else:
            shown = err["input"]
            got = "" if isinstance(shown, dict | list) else f" (got {shown!r})"
            msg = f"{err['msg']}{got}"
        problems.append((_key(loc), msg))
    return problems


_BOUNDS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}
