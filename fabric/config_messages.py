"""How a config's problems are worded, for the fabric's configs and the job's alike: each
error of pydantic's ``ValidationError`` as ``(key, message)``, the key written the way the
YAML or the dict reads (``hedge.enabled``, ``envs[1].id``), an unknown key naming the
allowed ones and the closest match (pydantic's own text names the model and says only
"Extra inputs are not permitted")."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails


def listing(names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(names) if names else "(none)"


def hint(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def config_key(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def allowed_keys(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """Field names of the model at ``loc`` (for "unknown key" messages); [] if unknown. Not
    those a model names in ``CONFIG_HIDDEN`` (a class attribute): fields it fills itself,
    which a caller offered them was told to write (a decorator's derived ``entry``)."""
    ann = _unwrap(_resolve(model, loc)[1])
    if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
        return []
    hidden: frozenset[str] = getattr(ann, "CONFIG_HIDDEN", frozenset())
    return [k for k in ann.model_fields if k not in hidden]


def _resolve(model: type[BaseModel], loc: tuple[int | str, ...]) -> tuple[tuple[int | str, ...], Any]:
    """``loc`` as the config reads it, and the annotation it reaches (None past what is known).
    A tagged union's member is in pydantic's path under its tag (``runtime.process.x``) though
    the config has no such key (``runtime: {type: process, x: ...}``): the tag is dropped from
    the key, and the walk goes on in that member's model."""
    ann: Any = model
    shown: list[int | str] = []
    for part in loc:
        ann = _unwrap(ann)
        member = _tagged_member(ann, part)
        if member is not None:
            ann = member
            continue
        shown.append(part)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            field = ann.model_fields.get(part) if isinstance(part, str) else None
            ann = None if field is None else field.annotation
        elif get_origin(ann) is list:
            ann = get_args(ann)[0]
        elif get_origin(ann) is dict:
            ann = get_args(ann)[1]
        else:
            ann = None
    return tuple(shown), ann


def _tagged_member(ann: Any, tag: int | str) -> type[BaseModel] | None:
    """The model of the union ``ann`` whose tag (a ``Literal`` field's value) is ``tag``."""
    if get_origin(ann) not in (Union, UnionType) or not isinstance(tag, str):
        return None
    for member in map(_unwrap, get_args(ann)):
        if isinstance(member, type) and issubclass(member, BaseModel):
            for field in member.model_fields.values():
                if get_origin(field.annotation) is Literal and tag in get_args(field.annotation):
                    return member
    return None


def _unwrap(ann: Any) -> Any:
    """``M`` for ``Annotated[M, ...]`` and ``M | None``."""
    if get_origin(ann) is Annotated:
        return _unwrap(get_args(ann)[0])
    if get_origin(ann) in (Union, UnionType):
        models = [a for a in get_args(ann) if a is not type(None)]
        return _unwrap(models[0]) if len(models) == 1 else ann
    return ann


_BOUNDS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}


def describe(err: ErrorDetails, model: type[BaseModel]) -> tuple[str, str]:
    """One error of validating ``model`` as ``(key, message)``."""
    loc, kind, ctx = tuple(err["loc"]), err["type"], err.get("ctx") or {}
    key = config_key(_resolve(model, loc)[0])
    if kind == "union_tag_invalid":  # a mistyped type: its key, and the types there are
        field, tag = str(ctx.get("discriminator", "")).strip("'"), str(ctx.get("tag"))
        known = [t.strip().strip("'") for t in str(ctx.get("expected_tags", "")).split(",") if t.strip()]
        return (
            f"{key}.{field}" if key else field,
            f"unknown {field} {tag!r}{hint(tag, known)}; known: {', '.join(known)}",
        )
    if kind == "extra_forbidden":
        allowed = allowed_keys(model, loc[:-1])
        msg = "unknown key" + (
            f"{hint(str(loc[-1]), allowed)}; allowed: {', '.join(allowed)}" if allowed else ""
        )
    elif kind == "missing":
        msg = "required key is missing"
    elif kind in _BOUNDS:
        op, name = _BOUNDS[kind]
        secret = bool(loc) and _SECRET.search(str(loc[-1])) is not None
        msg = f"must be {op} {ctx[name]}" + ("" if secret else f" (got {err['input']!r})")
    elif kind == "value_error":
        msg = str(ctx.get("error", err["msg"]))
    else:
        shown = err["input"]
        secret = bool(loc) and _SECRET.search(str(loc[-1])) is not None
        got = "" if secret or isinstance(shown, dict | list) else f" (got {shown!r})"
        msg = f"{err['msg']}{got}"
    return key, msg


# a key whose value is not shown back (a token typed unquoted in YAML is an int, refused
# with its value: into logs and terminals)
_SECRET = re.compile(r"token|secret|password|passwd|credential|api_?key|access_key", re.IGNORECASE)


def problems(e: ValidationError, model: type[BaseModel]) -> list[tuple[str, str]]:
    """Every error of ``e`` (raised validating ``model``) as ``(key, message)``."""
    return [describe(err, model) for err in e.errors(include_url=False)]


def one_line(e: ValidationError, model: type[BaseModel]) -> str:
    """``problems`` as one line, for a ``ConfigError`` message."""
    return "; ".join(f"{key}: {msg}" if key else msg for key, msg in problems(e, model))


def yaml_problem(e: Exception) -> str:
    """PyYAML's error as one line with its place (``line 2, column 1: expected ... (while
    parsing a flow sequence from line 1)``): its own text ran over four lines, named the
    file "<unicode string>" and drew a caret under the line it quoted."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is None or problem is None:  # a plain YAMLError: no place to give
        return " ".join(str(e).split())
    said = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, context_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context:
        # where the unclosed bracket or quote began, when that is not where it was noticed
        if context_mark is not None and context_mark.line != mark.line:
            context += f" from line {context_mark.line + 1}"
        said += f" ({context})"
    return said
