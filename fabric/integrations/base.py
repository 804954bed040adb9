"""What every framework adapter shares: samples in, scores out, over one fabric ``Client``.

* ``RewardAdapter`` (async): one registered function. It turns a trainer's sample (a
  trajectory plus the named values the trainer has for it: dataset columns, a label, a
  ground truth) into the function's keyword arguments, sends a batch through
  ``Client.map`` (concurrently, answers in input order, one deadline for the batch) and
  reads each ``Result`` back as a ``Score``. A failed call is a failed ``Score``, never 0.
* ``SyncBridge`` (in ``fabric.integrations.bridge``, exported here too): trainers call
  reward functions synchronously, from their own threads.
  The bridge owns one event loop on a daemon thread, started on the first call, where the
  adapter's ``Client`` lives; ``close()`` ends it (and an exit backstop, for a trainer
  that never closes). Any thread may call it; so may a coroutine on another loop (``arun``,
  which starts the bridge off that loop). A caller that stops waiting (Ctrl-C in ``run``, a
  cancelled ``arun``) cancels its batch on the bridge's loop.
* ``build_trajectory``: a framework's prompt and completion (text or chat messages) as a
  fabric ``Trajectory``.

Framework modules (``trl``, ``verl``, ``openrlhf``) only translate their calling convention
into ``Sample`` lists and ``Score`` lists into what their trainer expects.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from fabric.backends.base import Backend
from fabric.errors import ErrorCode

# the bridge lives in its own module; both stay importable from here
from fabric.integrations.bridge import DEADLINE_GRACE_S as DEADLINE_GRACE_S
from fabric.integrations.bridge import SyncBridge as SyncBridge
from fabric.integrations.config import IntegrationConfig, plain
from fabric.integrations.errors import (
    BadBatchError,
    MissingArgumentError,
    RefusedArgumentsError,
    RewardCallError,
    UnexpectedArgumentError,
)
from fabric.protocol import ErrorInfo, Message, Result, Trajectory
from fabric.registry import Registry, default_registry
from fabric.spec import FunctionSpec

log = logging.getLogger("fabric.integrations")

#: Error type of a function's answer that is not a reward (not a number, no "score").
BAD_REWARD_VALUE = "BadRewardValue"

#: Error type of a row held back because a required parameter's value is null (TRL: a mixed
#: dataset's row without that column); the row fails alone, the others are scored.
NULL_ARGUMENT = "NullArgument"

#: Failures of the setup, not of a sample: the function's own (``Misconfigured``, a setup hook
#: that raised), or the way to it (a token refused, a server that does not serve the function,
#: other code deployed). Every sample fails alike, so no score (nor TRL's ``None``) stands in.
SETUP_ERRORS = frozenset(
    {
        ErrorCode.MISCONFIGURED,
        ErrorCode.SETUP_FAILED,
        ErrorCode.UNAUTHORIZED,
        ErrorCode.UNKNOWN_FUNCTION,
        ErrorCode.VERSION_MISMATCH,
    }
)


@dataclass
class Sample:
    """One completion to score: the trajectory and the named values the trainer gave for it."""

    traj: Trajectory
    sources: Mapping[str, Any] = field(default_factory=dict)
    """Dataset columns, ``label``, ``ground_truth``, ``extra_info``...; a dotted name
    (``extra_info.tests``) reaches into a mapping."""


@dataclass
class Score:
    value: float | None
    """The reward; ``failure_score`` for a failed call when one is set, else ``None``."""
    components: dict[str, float] = field(default_factory=dict)
    error: ErrorInfo | None = None
    """Why the call failed (also set when ``failure_score`` stood in for it)."""

    @property
    def failed(self) -> bool:
        return self.error is not None


# ----------------------------------------------------------------------------- trajectories


def _text_of(content: Any) -> str | None:
    """A message's content as text: a string, or the text parts of a list of content parts
    (``[{"type": "text", "text": ...}]``, as multimodal chat templates write it)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
        return "".join(parts)
    raise TypeError(f"message content must be text or a list of content parts, not {type(content).__name__}")


def _messages(value: Any, default_role: str, what: str) -> list[Message]:
    if isinstance(value, str):
        return [Message(role=default_role, content=value)]  # type: ignore[arg-type]
    if not isinstance(value, list | tuple) or not all(isinstance(m, Mapping) for m in value):
        raise BadBatchError(
            f"{what} must be a string or a list of chat messages ({{'role': ..., 'content': ...}}), "
            f"got {type(value).__name__}"
        )
    out: list[Message] = []
    for m in value:
        try:
            body = {**m, "content": _text_of(m.get("content"))}
            try:
                out.append(Message.model_validate(body))
            except ValidationError:
                # a framework's tool-call shape may differ from OpenAI's (no id, arguments as a
                # dict): keep the turn's role and text, which is what rewards read
                out.append(Message(role=m.get("role"), content=body["content"]))
        except (TypeError, ValidationError) as e:
            raise BadBatchError(f"{what}: a message is not a chat message ({m!r:.200}): {e}") from None
    return out


def build_trajectory(
    completion: Any,
    prompt: Any = None,
    *,
    task: Mapping[str, Any] | None = None,
    what: str = "completion",
) -> Trajectory:
    """A ``Trajectory`` of ``prompt`` (text: a user turn; or chat messages) followed by
    ``completion`` (text: an assistant turn; or chat messages, ending with an empty assistant
    turn when they have none)."""
    messages = [] if prompt is None else _messages(prompt, "user", what.replace("completion", "prompt"))
    said = _messages(completion, "assistant", what)
    if not any(m.role == "assistant" for m in said):
        # a completion with no assistant turn (none generated) said nothing: rewards read the
        # last assistant turn, which would be the prompt's (a few-shot example's answer)
        said.append(Message(role="assistant", content=""))
    return Trajectory(messages=messages + said, task=dict(task or {}))


def lookup(sources: Mapping[str, Any], name: str) -> tuple[bool, Any]:
    """``(found, value)`` of ``name`` in ``sources``; ``a.b`` looks ``b`` up in mapping ``a``
    (a JSON object in a string counts: labels often carry one)."""
    if name in sources:
        return True, sources[name]
    head, dot, rest = name.partition(".")
    if dot and head in sources:
        inner = sources[head]
        if isinstance(inner, str):
            inner = _json_object(inner)
        if isinstance(inner, Mapping):
            return lookup(inner, rest)
    return False, None


def _json_object(text: str) -> Mapping[str, Any] | None:
    import json

    s = text.strip()
    if not (s.startswith("{") and s.endswith("}")):
        return None
    try:
        value = json.loads(s)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# ----------------------------------------------------------------------------- the adapter


def resolve_function(function: str | Callable[..., Any]) -> tuple[str, Callable[..., Any] | None]:
    """A function name, or a decorated function (its registered name)."""
    if isinstance(function, str):
        return function, None
    spec = getattr(function, "__fabric_spec__", None)
    if not isinstance(spec, FunctionSpec):
        raise TypeError(
            f"{function!r} is not a fabric function: pass a registered name or a function decorated "
            "with @fabric.reward"
        )
    return spec.name, function


class RewardAdapter:
    """One registered reward function, called in batches. ``async with`` or ``start``/``aclose``.

    ``aliases`` maps a parameter to the framework's usual source for it (OpenRLHF:
    ``ground_truth`` <- ``label``); ``backend`` replaces the configured one (tests pass a
    ``fabric.testing.FakeBackend``). ``null_fails_row``: a sample whose value for a required
    parameter is null is not sent but fails alone (``NULL_ARGUMENT``, scored as any failed
    call), where the function's refusal of it would fail the whole batch (TRL)."""

    def __init__(
        self,
        config: IntegrationConfig,
        *,
        registry: Registry | None = None,
        function: Callable[..., Any] | None = None,
        aliases: Mapping[str, str] | None = None,
        backend: Backend | None = None,
        null_fails_row: bool = False,
    ):
        self.config = config
        self.null_fails_row = null_fails_row
        self.registry = registry if registry is not None else default_registry
        if config.builtins:
            self.registry.discover("functions")
        for module in config.modules:
            self.registry.discover_yours(module)  # one of no functions is warned of, as -m is
        if function is not None:
            self.registry.add(function)
        # UnknownFunctionError lists the known names
        self.spec: FunctionSpec = self.registry.get(config.function)
        self.aliases = dict(aliases or {})
        self._backend = backend if backend is not None else config.backend_config()
        self.traj_param = self._traj_param()
        names = {p.name for p in self.spec.params}
        for where, given in (("args", config.args), ("constants", config.constants)):
            stray = sorted(set(given) - names - {self.traj_param})
            if stray and not self.spec.accepts_extra:
                raise UnexpectedArgumentError(
                    f"{where} names {', '.join(map(repr, stray))}, which {self._signature()} does not take"
                )
        self.as_text = self._annotation(self.traj_param) in ("str", "builtins.str")
        self._plan: dict[str, tuple[str, ...]] | None = None
        self._client: Any = None
        self._keys: list[str] = list(config.components or ())
        self.stats = {"batches": 0, "samples": 0, "failed": 0, "failure_scored": 0}

    # -- lifecycle
    async def start(self) -> None:
        if self._client is not None:
            return
        from fabric.client import Client

        client = Client(self._backend, registry=self.registry)
        await client.__aenter__()
        self._client = client

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def __aenter__(self) -> RewardAdapter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- the signature
    def _traj_param(self) -> str:
        names = [p.name for p in self.spec.params]
        chosen = self.config.traj_param or ("traj" if "traj" in names else (names[0] if names else None))
        if chosen is None or chosen not in names:
            raise MissingArgumentError(
                f"{self._signature()} has no parameter {chosen!r} to receive the trajectory; set traj_param"
            )
        return chosen

    def _annotation(self, name: str) -> str:
        return next((p.annotation for p in self.spec.params if p.name == name), "Any")

    def _signature(self) -> str:
        return (
            f"{self.spec.name}("
            + ", ".join(p.name + ("" if p.required else "=...") for p in self.spec.params)
            + ")"
        )

    def plan(self, first: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
        """Parameter -> its sources, in the order they are tried for each sample (``args``'s, else
        the parameter's own name, then the framework's alias), decided once from the first
        batch's sample against the function's spec: a required parameter with no source there
        is an error naming them all. An optional parameter is planned whether or not the first
        sample has it: each sample passes the value it has, or leaves the default (also for a
        null, a mixed dataset's "no value")."""
        if self._plan is not None:
            return self._plan
        plan: dict[str, tuple[str, ...]] = {}
        missing: list[str] = []
        for p in self.spec.params:
            if p.name == self.traj_param or p.name in self.config.constants:
                continue
            given = self.config.args.get(p.name)
            if given is not None:
                if p.required and not lookup(first, given)[0]:
                    raise MissingArgumentError(
                        f"args maps {p.name!r} of {self._signature()} to {given!r}, which the batch does "
                        f"not have; it has: {_shown(first)}"
                    )
                plan[p.name] = (given,)
                continue
            sources = (p.name, *((self.aliases[p.name],) if p.name in self.aliases else ()))
            if p.required and not any(lookup(first, src)[0] for src in sources):
                missing.append(p.name)
            plan[p.name] = sources
        if missing:
            raise MissingArgumentError(
                f"{self._signature()} needs {', '.join(map(repr, missing))}, which the batch does not "
                f"have; it has: {_shown(first)}. Name the source with args={{'{missing[0]}': 'COLUMN'}} "
                "or give a value with constants"
            )
        self._plan = plan
        return plan

    def payloads(self, samples: Sequence[Sample]) -> list[dict[str, Any]]:
        """The calls' keyword arguments, one per sample (with ``null_fails_row``, of the samples
        ``prepare`` does not hold back)."""
        return self.prepare(samples)[0]

    def prepare(self, samples: Sequence[Sample]) -> tuple[list[dict[str, Any]], dict[int, ErrorInfo]]:
        """``(payloads, held)``: the payloads to send, in order, and the samples held back by
        ``null_fails_row`` (index -> why), which ``score_payloads`` puts back in their places."""
        if not samples:
            return [], {}
        plan = self.plan(samples[0].sources)
        required = {p.name for p in self.spec.params if p.required}
        out = []
        held: dict[int, ErrorInfo] = {}
        for i, s in enumerate(samples):
            payload: dict[str, Any] = {
                self.traj_param: s.traj.final_text() if self.as_text else s.traj,
                **self.config.constants,
            }
            for param, sources in plan.items():
                for source in sources:
                    found, value = lookup(s.sources, source)
                    if found:
                        # a null is how a mixed dataset (parquet, HF datasets) says a row lacks
                        # the key: an optional parameter keeps its default (not the next
                        # source's value: a JSON label's text); a required one gets the null,
                        # which the function refuses (loudly, as a missing value), and which
                        # would fail the whole batch: with null_fails_row (TRL) the row alone
                        # fails, unsent
                        if value is None and param in required and self.null_fails_row:
                            held.setdefault(
                                i,
                                ErrorInfo.of(
                                    NULL_ARGUMENT,
                                    f"row #{i}: column {source!r} is null, and {param!r} of "
                                    f"{self._signature()} is required",
                                ),
                            )
                        elif value is not None or param in required:
                            payload[param] = plain(value)
                        break
                else:
                    if param in required:
                        raise MissingArgumentError(
                            f"sample #{i} has no {' or '.join(map(repr, sources))} for {param!r} of "
                            f"{self.spec.name} (a required parameter, which the first sample scored had); "
                            f"it has: {_shown(s.sources)}"
                        )
            if i not in held:
                out.append(payload)
        return out, held

    # -- calls
    async def score(self, samples: Sequence[Sample]) -> list[Score]:
        """Scores of ``samples`` in their order. Bad input raises before anything is sent;
        failed calls come back as failed ``Score``s."""
        return await self.score_payloads(*self.prepare(samples))

    async def score_payloads(
        self, payloads: list[dict[str, Any]], held: Mapping[int, ErrorInfo] | None = None
    ) -> list[Score]:
        """Scores of ``payloads`` in their order, with a failed ``Score`` for each of the
        samples ``prepare`` held back put back at its index."""
        await self.start()
        results: list[Result] = (
            await self._client.map(self.spec.name, payloads, deadline_s=self.config.deadline_s)
            if payloads
            else []
        )
        sent = iter(results)
        total = len(results) + len(held or ())
        scores = [
            self._failed(held[i]) if held and i in held else self._read(next(sent)) for i in range(total)
        ]
        self.stats["batches"] += 1
        self.stats["samples"] += len(scores)
        return scores

    def _read(self, r: Result) -> Score:
        if r.ok:
            value, components, problem = _reward_of(r.value)
            if problem is None:
                for k in components:
                    if self.config.components is None and k not in self._keys:
                        self._keys.append(k)
                return Score(value, components)
            error = ErrorInfo.of(BAD_REWARD_VALUE, f"{self.spec.name} returned {problem}")
        else:
            assert r.error is not None
            error = r.error
        return self._failed(error)

    def _failed(self, error: ErrorInfo) -> Score:
        self.stats["failed"] += 1
        if self.config.failure_score is not None:
            self.stats["failure_scored"] += 1
        return Score(self.config.failure_score, {}, error)

    def check(self, scores: Sequence[Score], *, none_ok: bool) -> None:
        """Log the batch's failures (once, a summary); raise ``RewardCallError`` for them when
        the framework has no "no reward" value (``none_ok`` False) and no ``failure_score``.
        Arguments the function refused (``InvalidArguments``) raise ``BadBatchError`` whatever
        the settings: the batch is wrong, not the calls, and no score may stand in for it; a
        setup that is wrong (``SETUP_ERRORS``: ``Misconfigured``, ``SetupFailed``, a token
        refused...) raises ``RewardCallError`` likewise."""
        failures = [(i, s.error) for i, s in enumerate(scores) if s.error is not None]
        if not failures:
            return
        invalid = [(i, e) for i, e in failures if e.type == ErrorCode.INVALID_ARGUMENTS]
        if invalid:
            # the batch's values do not fit the signature (a dataset column of the wrong type):
            # every such sample fails the same way, so neither None nor failure_score may stand in
            raise RefusedArgumentsError(self._signature(), len(invalid), len(scores), invalid[0])
        setup = [(i, e) for i, e in failures if e.type in SETUP_ERRORS]
        if setup:
            # the function's setup (a judge's key refused, its model unknown), the same for every
            # sample: a failure_score (or TRL's None) would train on a constant, or on nothing
            raise RewardCallError(
                self.spec.name,
                len(scores),
                setup,
                hint=f" ({setup[0][1].type}: its setup is wrong, not the samples; fix what the "
                "message says and run again: no failure_score stands in for it)",
            )
        scored = self.config.failure_score is not None
        outcome = (
            f"scored {self.config.failure_score:g} (failure_score)"
            if scored
            else ("no reward (None)" if none_ok else "raised")
        )
        # rows held back for a null (null_fails_row) are said apart, all of them (up to five):
        # the first failure of the batch may be another one
        nulls = [e.message for _, e in failures if e.type == NULL_ARGUMENT]
        if nulls:
            more = f"; and {len(nulls) - 5} more" if len(nulls) > 5 else ""
            log.warning(
                "%s: %d of %d rows have a null for a required parameter, %s: %s%s",
                self.spec.name,
                len(nulls),
                len(scores),
                outcome,
                "; ".join(nulls[:5]),
                more,
            )
        called = [(i, e) for i, e in failures if e.type != NULL_ARGUMENT]
        if called:
            i, e = called[0]
            log.warning(
                "%s: %d of %d calls failed, %s; first: #%d %s: %s",
                self.spec.name,
                len(called),
                len(scores),
                outcome,
                i,
                e.type,
                e.message.strip().splitlines()[0] if e.message.strip() else "",
            )
        if not scored and not none_ok:
            raise RewardCallError(
                self.spec.name,
                len(scores),
                failures,
                hint=" (set failure_score to give failed calls a score instead)",
            )

    def report(self, score: Score) -> dict[str, float]:
        """The components to report beside a score, with the same keys for every sample
        (NaN where this one has none): veRL and OpenRLHF stack them into arrays by key."""
        return {k: float(score.components.get(k, math.nan)) for k in self._keys}


def _reward_of(value: Any) -> tuple[float | None, dict[str, float], str | None]:
    """A function's answer as ``(score, components, problem)``: a number, or a
    ``RewardResult`` (a mapping with ``score``, as it arrives over the wire)."""
    try:  # an int past float's range (10**400) is an OverflowError: this sample's failure only
        if isinstance(value, bool | int | float):
            score = float(value)
            comps: dict[str, float] = {}
        elif isinstance(value, Mapping) and isinstance(value.get("score"), bool | int | float):
            score = float(value["score"])
            raw = value.get("components") or {}
            if not isinstance(raw, Mapping):
                return (
                    None,
                    {},
                    f"components of {type(raw).__name__} {raw!r:.100}, not a mapping of names to numbers",
                )
            comps = {str(k): float(v) for k, v in raw.items() if isinstance(v, bool | int | float)}
        else:
            return None, {}, f"{type(value).__name__} {value!r:.100}, not a number or a RewardResult"
    except OverflowError:
        return None, {}, "a number too large for a float"
    if not math.isfinite(score):
        return None, {}, f"a score of {score}, not a finite number"
    return score, comps, None


def _shown(sources: Mapping[str, Any]) -> str:
    return ", ".join(repr(k) for k in sources) or "(nothing)"
