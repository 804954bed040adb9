"""How a job config's problems are worded: pydantic's ``ValidationError`` turned into the
``(key, message)`` list ``ConfigError`` reports, and the hints those messages share.

Keys are written the way the YAML reads (``envs[1].id``, ``rewards.frozenlake[0].function``);
an unknown key names the allowed ones and the closest match. The cross-field problems
``JobConfig`` collects travel through pydantic as one custom error (``semantic_error``) and
are unpacked here into their own entries.
"""

from __future__ import annotations

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from fabric.config_messages import describe, hint, listing

__all__ = ["hint", "listing", "semantic_error", "validation_problems"]

_SEMANTICS = "job_semantics"  # error type carrying the cross-field problems as a list


def semantic_error(problems: list[tuple[str, str]]) -> PydanticCustomError:
    """The error a model validator raises to report ``problems`` (each under its own key)."""
    return PydanticCustomError(_SEMANTICS, "{count} problems", {"count": len(problems), "problems": problems})


def validation_problems(e: ValidationError, model: type[BaseModel]) -> list[tuple[str, str]]:
    """Every error of ``e`` (raised validating ``model``) as ``(key, message)``; the wording is
    the fabric's (``fabric.config_messages``), shared by every config of the project."""
    problems: list[tuple[str, str]] = []
    for err in e.errors(include_url=False):
        if err["type"] == _SEMANTICS:
            problems.extend((err.get("ctx") or {})["problems"])
        else:
            problems.append(describe(err, model))
    return problems
