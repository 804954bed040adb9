"""What an adapter calls and how: one typed config, validated once at the edge.

The same settings arrive three ways, and all three meet here: keyword arguments in code
(``trl_reward("math_answer", backend="local")``), veRL's ``reward_kwargs`` (a Hydra mapping
passed with every call), and ``FABRIC_*`` environment variables (OpenRLHF loads a reward
file with no arguments at all). Given values win over the environment.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from fabric.backends.base import (
    InprocConfig,
    LambdaConfig,
    LocalConfig,
    ModalConfig,
    parse_backend_config,
)
from fabric.config_messages import one_line
from fabric.errors import ConfigError

#: ``IntegrationConfig`` field -> environment variable (``FABRIC_MODULES`` is the CLI's too)
ENV_VARS: dict[str, str] = {
    "function": "FABRIC_FUNCTION",
    "backend": "FABRIC_BACKEND",
    "endpoint_url": "FABRIC_ENDPOINT_URL",
    "modules": "FABRIC_MODULES",
    "builtins": "FABRIC_BUILTINS",
    "args": "FABRIC_ARGS",
    "constants": "FABRIC_CONSTANTS",
    "traj_param": "FABRIC_TRAJ_PARAM",
    "failure_score": "FABRIC_FAILURE_SCORE",
    "deadline_s": "FABRIC_DEADLINE_S",
    "components": "FABRIC_COMPONENTS",
}
_JSON_VARS = frozenset({"args", "constants"})
#: ``FABRIC_*`` variables of the project's own worker processes: not settings, not typos.
_OTHER_VARS = frozenset({"FABRIC_WORKER_FD", "FABRIC_WORKER_SHM", "FABRIC_PARENT_PID"})
#: Variables people reach for that are named otherwise.
_MEANT = {"FABRIC_TOKEN": "RL_FABRIC_TOKEN"}
_LIST_VARS = frozenset({"modules", "components"})


class IntegrationConfig(BaseModel):
    """One registered reward function, called from a trainer through a fabric ``Client``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    function: str = Field(min_length=1)
    """Name of the registered function (``math_answer``, ``exact_match``, your own)."""
    backend: str | dict[str, Any] | None = None
    """``local`` (warm worker processes, the default), ``inproc``, ``lambda`` (AWS, or a
    ``fabric serve`` with ``endpoint_url``), ``modal``, or a full backend config mapping
    (``{"type": "local", "max_workers": 4}``). ``None``: ``lambda`` when ``endpoint_url``
    is set, else ``local``."""
    endpoint_url: str | None = None
    """A ``fabric serve`` (``http://host:9000``): the pools are shared by every trainer
    process and job that points here (Reward-as-a-Service)."""
    token: SecretStr | None = None
    """Bearer token of that server (default ``$RL_FABRIC_TOKEN``)."""
    modules: tuple[str, ...] = ()
    """Where your own functions live (module, ``module:attr`` or ``file.py``), discovered
    besides the built-ins; a function you imported yourself is found without it."""
    builtins: bool = True
    """Discover the built-in ``functions`` package (math_answer, code_verify, ...)."""
    args: dict[str, str] = Field(default_factory=dict)
    """Parameter of the function -> where its value comes from in the trainer's batch (a
    dataset column, ``label``, ``extra_info.tests``). A parameter not named here is taken
    from the source of the same name, then from the framework's usual one (veRL's
    ``ground_truth``, OpenRLHF's ``label`` for ``ground_truth``)."""
    constants: dict[str, Any] = Field(default_factory=dict)
    """Parameter -> the same value for every call (``{"language": "cpp"}``)."""
    traj_param: str | None = None
    """The parameter that receives the trajectory (default ``traj``, else the first one)."""
    failure_score: float | None = None
    """Score a failed call with this instead of the framework's default (TRL: ``None``, no
    reward for that sample; veRL and OpenRLHF: an error). Opt-in: a failure is not a 0."""
    deadline_s: float = Field(300.0, gt=0)
    """A batch's calls must finish within this many seconds (retries included); a call past
    it fails as ``DeadlineExceeded``, which counts as a failure. ``math.inf``: no deadline."""
    components: tuple[str, ...] | None = None
    """Component names to report beside the score (veRL and OpenRLHF need the same keys for
    every sample). ``None``: the ones the function returns, as they are first seen."""

    @field_validator("failure_score")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("failure_score must be a finite number (a NaN reward poisons a batch)")
        return v

    @classmethod
    def parse(
        cls, given: Mapping[str, Any] | None = None, *, env: Mapping[str, str] | None = None
    ) -> IntegrationConfig:
        """Validate ``given`` (keyword arguments, veRL's ``reward_kwargs``) over the ``FABRIC_*``
        variables of ``env`` (default ``os.environ``); a ``ConfigError`` says what is wrong."""
        values: dict[str, Any] = _from_env(os.environ if env is None else env)
        values.update({k: plain(v) for k, v in (given or {}).items() if v is not None})
        if "function" not in values:
            raise ConfigError(
                "no reward function named: pass function=... (veRL: reward_kwargs.function) or set "
                f"${ENV_VARS['function']}"
            )
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            # worded as the other configs are: an unknown key names the closest setting
            raise ConfigError(f"bad fabric integration config: {one_line(e, cls)}") from None

    def backend_config(self) -> InprocConfig | LocalConfig | LambdaConfig | ModalConfig:
        backend = self.backend
        if backend is None:
            backend = "lambda" if self.endpoint_url else "local"
        body: dict[str, Any] = dict(backend) if isinstance(backend, Mapping) else {"type": backend}
        if self.endpoint_url is not None or self.token is not None:
            if body.get("type") != "lambda":
                raise ConfigError(
                    "endpoint_url and token are for backend 'lambda' (a fabric serve), "
                    f"not {body.get('type')!r}"
                )
            if self.endpoint_url is not None:
                body["endpoint_url"] = self.endpoint_url
            if self.token is not None:
                body["token"] = self.token
        return parse_backend_config(body)


def _check_names(env: Mapping[str, str]) -> None:
    """A ``FABRIC_*`` variable that is all but the name of a setting is a typo: refused, as
    a misspelt ``reward_kwargs`` key is, rather than silently leaving the default (a
    ``FABRIC_FAILURE_SCROE`` made failures raise; a ``FABRIC_DEADLINE`` left 300 s)."""
    import difflib

    known = sorted(ENV_VARS.values())
    for var in env:
        if not var.startswith("FABRIC_") or var in known or var in _OTHER_VARS:
            continue
        meant = _MEANT.get(var) or next(iter(difflib.get_close_matches(var, known, n=1, cutoff=0.85)), None)
        if meant is not None:
            raise ConfigError(
                f"${var} is not a fabric integration setting: did you mean ${meant}? "
                f"(the settings: {', '.join('$' + k for k in known)})"
            )


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    _check_names(env)
    out: dict[str, Any] = {}
    for field, var in ENV_VARS.items():
        raw = env.get(var)
        if raw is None or not raw.strip():
            continue
        if field == "backend" and raw.strip().startswith("{"):  # a backend config mapping
            try:
                out[field] = json.loads(raw)
            except ValueError as e:
                raise ConfigError(f"${var} must be a backend name or a JSON object: {e}") from None
        elif field in _JSON_VARS:
            try:
                out[field] = json.loads(raw)
            except ValueError as e:
                raise ConfigError(f"${var} must be a JSON object: {e}") from None
        elif field in _LIST_VARS:
            out[field] = tuple(p.strip() for p in raw.split(",") if p.strip())
        else:
            out[field] = raw.strip()
    return out


def plain(value: Any) -> Any:
    """``value`` as plain JSON-shaped Python: numpy and torch values (``tolist``), mappings
    (Hydra's ``DictConfig``) and sequences (``ListConfig``, tuples) become dicts and lists."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    tolist = getattr(value, "tolist", None)
    if callable(tolist):  # numpy arrays and scalars, torch tensors
        return plain(tolist())
    if isinstance(value, bytes | bytearray):
        return value
    if isinstance(value, list | tuple | set | frozenset) or _is_sequence(value):
        return [plain(v) for v in value]
    return value


def _is_sequence(value: Any) -> bool:
    from collections.abc import Sequence

    return isinstance(value, Sequence)
