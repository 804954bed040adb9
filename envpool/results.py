"""What the pool reads of a container's results: their shapes (``checked``: a server in
another language has no envpool code to keep it to them) and what the policy saw of them
(``digest``, ``raised``), which a replay must see again."""

from __future__ import annotations

import hashlib
from typing import Any

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from envpool.api import MAX_ACTION_BYTES, Observation, StepResult
from envpool.errors import EnvLogicError, ProtocolError

_SEEN = ("obs", "reward", "terminated", "truncated")


def digest(result: dict[str, Any]) -> str:
    """What the policy saw of a reset or step, for checking a replay: the observation, the
    reward and the episode's end. Not ``info``: determinism is asked of these only (as
    ``check_env`` checks it), and info may well carry timings that differ on every run."""
    return hashlib.sha256(pydantic_core.to_json({k: result.get(k) for k in _SEEN})).hexdigest()


def raised(e: EnvLogicError) -> str:
    """What the policy saw of a request the environment raised on: the exception's type (its
    message may carry addresses or timings)."""
    return f"raised {e.remote_type or type(e).__name__}"


class _ResetResult(BaseModel):
    obs: Observation
    info: dict[str, Any] | None = None


class _OpenResult(BaseModel):
    """What the pool reads of an open's result (a server may say more: its pid, say)."""

    model_config = ConfigDict(strict=True)
    deterministic: bool = True
    max_action_bytes: int = Field(MAX_ACTION_BYTES, gt=0)
    close_error: str | None = None  # what the previous environment's close raised (at this open)
    retire: bool = False  # the server may not be sound after it: no episode runs there (``_retire``)


_RESULTS: dict[str, type[BaseModel]] = {"open": _OpenResult, "reset": _ResetResult, "step": StepResult}


def checked(op: str, result: Any) -> Any:
    """``result`` if it has the shape ``op`` returns; else a ``ProtocolError`` naming what is
    wrong (a server in another language has no envpool code to keep it to the shape). An
    open's result comes back with only the fields the pool reads, those it gave."""
    model = _RESULTS.get(op)
    if model is None:
        return result
    try:
        valid = model.model_validate(result)
    except ValidationError as e:
        where = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or '(the result)'}: {err['msg']}" for err in e.errors()[:3]
        )
        raise ProtocolError(
            f"the result of {op} is not what {op} returns: {where} (got {_short(result)})"
        ) from None
    return valid.model_dump(exclude_unset=True) if op == "open" else result


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
