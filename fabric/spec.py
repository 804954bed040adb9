"""``FunctionSpec``: everything the fabric knows about a registered function, as data.

A spec is JSON-safe on purpose: the same object drives the local worker pool, the
terraform variables of the Lambda deployment and the Modal app definition.

Its numbers and flags are strict (``strict=True``): pydantic's lax mode took ``warm=True``
as 1, ``max_concurrency="8"`` as 8 and ``side_effects="yes"`` as True, so a typo or a value
read from the environment and never converted passed unseen. An int is still a float.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Kind = Literal["reward", "tool", "function"]

#: The parameter through which a function receives what its setup hook returned.
CTX_PARAM = "ctx"


class RetryPolicy(BaseModel):
    """How the client retries retryable failures (never user errors)."""

    model_config = ConfigDict(extra="forbid")
    max_attempts: int = Field(3, ge=1, le=20, strict=True)
    """Attempts in all, the first one included."""
    # finite: an infinite backoff slept for good before a retry of a call with no deadline
    initial_backoff_s: float = Field(0.05, gt=0, allow_inf_nan=False, strict=True)
    """Scale of the exponential backoff; each wait is drawn uniformly (full jitter)."""
    max_backoff_s: float = Field(2.0, gt=0, allow_inf_nan=False, strict=True)


class Resources(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cpu: float = Field(
        1.0, gt=0, allow_inf_nan=False, strict=True
    )  # JSON has no inf: the spec would not load
    gpu: int = Field(0, ge=0, strict=True)
    gpu_type: str | None = None


class ParamSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    required: bool
    annotation: str = "Any"


class FunctionSpec(BaseModel):
    """A registered function, as data."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    #: Fields the decorator fills from the function itself (``fabric.registry_spec.make_spec``):
    #: never listed as options in an "unknown key" message.
    CONFIG_HIDDEN: ClassVar[frozenset[str]] = frozenset(
        {"kind", "entry", "version", "params", "is_async", "accepts_extra"}
    )
    name: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_\-]{0,63}$")
    """Unique within a registry; also the Lambda/Modal function name (64 chars max)."""
    kind: Kind = "function"
    entry: str
    """``module:attr`` (or ``path/to/file.py:attr``) the worker imports."""
    description: str = ""
    timeout_s: float = Field(30.0, gt=0, le=900, strict=True)
    """Per-call limit; a call past it has its worker killed and replaced (Lambda caps at 900 s)."""
    memory_mb: int = Field(512, ge=128, le=10240, strict=True)
    warm: int = Field(1, ge=0, strict=True)
    """Instances kept ready (local workers, Lambda provisioned concurrency, Modal min_containers)."""
    max_concurrency: int = Field(64, ge=1, strict=True)
    """Calls in flight at once for this function, across all its instances."""
    max_batch: int = Field(32, ge=1, strict=True)
    """Most calls coalesced into one message to a worker."""
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    version: str
    """Hash of the function's (and its setup hook's) source and of their modules' files: part
    of every idempotency key (``fabric.registry_code.capture_code``)."""
    resources: Resources = Field(default_factory=Resources)
    side_effects: bool = Field(False, strict=True)
    """True for tools that change the world: never hedged, retries deduplicated by key."""
    hedge: bool = Field(True, strict=True)
    """False for calls that cost money each time (an LLM judge behind a paid API): a hedge
    would pay for the same answer twice, and slow calls are where hedges fire."""
    is_async: bool = False
    setup: str | None = None
    """``module:attr`` of the hook run once per warm worker; its return value is passed as ``ctx``."""
    params: tuple[ParamSpec, ...] = ()
    accepts_extra: bool = False
    """The function takes ``**kwargs``."""
    examples: tuple[dict[str, Any], ...] = ()
    """Example payloads; ``fabric.testing.check_function`` runs them."""

    @field_validator("entry")
    @classmethod
    def _entry_shape(cls, v: str) -> str:
        mod, sep, attr = v.partition(":")
        if not sep or not mod or not attr:
            raise ValueError(f"entry must look like 'module:attr', got {v!r}")
        return v

    @model_validator(mode="after")
    def _warm_le_max(self) -> FunctionSpec:
        if self.warm > self.max_concurrency:
            raise ValueError(f"warm={self.warm} exceeds max_concurrency={self.max_concurrency}")
        return self

    @property
    def hedgeable(self) -> bool:
        return self.hedge and not self.side_effects

    def check_args(self, payload: dict[str, Any]) -> str | None:
        """Cheap client-side argument check: a message naming the problem, or None."""
        names = payload.keys()
        missing = [p.name for p in self.params if p.required and p.name not in names]
        unexpected = [] if self.accepts_extra else [k for k in names if k not in self._param_names]
        if not missing and not unexpected:
            return None
        parts = []
        if missing:
            parts.append("missing " + ", ".join(repr(m) for m in missing))
        if unexpected:
            parts.append("unexpected " + ", ".join(repr(u) for u in unexpected))
        sig = ", ".join(p.name + ("" if p.required else "=…") for p in self.params)
        return f"{self.name}({sig}): " + "; ".join(parts)

    @cached_property
    def _param_names(self) -> frozenset[str]:
        return frozenset(p.name for p in self.params)
