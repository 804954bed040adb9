"""The inference-engine contract the LLM proxy talks to, one sibling module per backend.

    engine = engine_registry.create("torch", model=model, tokenizer=tok)
    async with engine:
        c = await engine.generate(GenerateRequest(messages=[...], max_new_tokens=8))
        c.text, c.token_ids, c.logprobs, c.policy_version, c.finish_reason

        await engine.suspend()                       # finish the step in flight, then hold
        await engine.load_weights(state, version=3)  # new weights, new version stamp
        await engine.resume()

The base class owns the lifecycle (start/close, the suspend gate, request bookkeeping,
validation); a backend implements narrow hooks (``_generate``, ``_abort``,
``_load_weights``, ``_start``/``_close``, ``_pause``). Every lifecycle method is async, as
the core is: a remote backend (vLLM, an OpenAI-compatible server) does I/O in each of them.

Outcomes are data: an aborted request returns a ``Completion`` with
``finish_reason="abort"`` and what it had generated so far; only misuse (a bad request, a
closed engine, a prompt over the context) raises, and an engine that cannot serve any more
(``EngineDeadError``: vLLM's engine core process died, the torch engine's batching loop
ended). A dead engine fails every later call at once until ``restart``; the LLM proxy counts
that as its replica's loss (``core.rollout.replica_base``), not as one turn's error.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import uuid
from abc import ABC, abstractmethod
from collections.abc import Coroutine, Mapping
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from core.errors import CoreError
from fabric.protocol import Message

FinishReason = Literal["stop", "length", "abort"]

log = logging.getLogger(__name__)


class EngineError(CoreError):
    """Base class of the engines' errors."""


def options_error(backend: str, e: ValidationError) -> EngineError:
    """An engine's invalid ``engine.kwargs``, every problem on one line, named by key."""
    problems = "; ".join(
        f"{'.'.join(map(str, err['loc'])) or '(config)'}: {err['msg'].removeprefix('Value error, ')}"
        for err in e.errors()
    )
    return EngineError(f"invalid {backend} engine options: {problems}")


class EngineDeadError(EngineError):
    """The engine cannot serve any more, though its process is up (vLLM's engine core
    process died; the torch engine's batching loop ended): every later ``generate`` raises
    it at once, until ``restart``."""


class EngineClosedError(EngineError):
    """``generate`` on an engine that was closed (or is closing)."""


class PromptTooLongError(EngineError, ValueError):
    """The prompt leaves no room for a single new token within the model's context."""


class UnknownEngineError(EngineError, KeyError):
    def __init__(self, name: str, known: list[str]):
        self.name, self.known = name, known
        super().__init__(f"unknown engine {name!r}; known engines: {', '.join(known) or '(none)'}")

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class GenerateRequest(BaseModel):
    """One turn to generate: a chat (rendered by the engine's template) or prompt ids."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    """Unique among the engine's requests in flight; ``abort`` names it."""
    messages: list[Message] | None = None
    """OpenAI-style chat; the engine appends the assistant generation prompt."""
    prompt_ids: list[int] | None = None
    """Token ids to continue as they are (no template)."""
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    """0 = greedy. Logprobs are of the distribution sampled from (logits / temperature);
    a greedy request reports the untempered (temperature 1) logprobs."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings, cut from the text (not from the token ids). The end-of-turn token
    always stops."""
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    """Sample only these ids (vLLM's ``SamplingParams.allowed_token_ids``): constrained
    decoding over a closed action vocabulary. Logprobs are of the renormalised distribution,
    so training must apply the same restriction (the completion carries the list on)."""
    seed: int | None = None
    """Seeds this request's sampler; ``None`` draws from the engine's seeded stream."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Carried through untouched (trajectory id, turn index, tag)."""

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.messages is None) == (self.prompt_ids is None):
            raise ValueError("give exactly one of messages or prompt_ids")
        if self.prompt_ids is not None and not self.prompt_ids:
            raise ValueError("prompt_ids is empty")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        return self


class Completion(BaseModel):
    """What a generated turn is, for the trajectory and for the trainer."""

    model_config = ConfigDict(extra="forbid")

    request_id: str
    text: str
    """The decoded turn: special tokens dropped, cut before a stop string."""
    prompt_ids: list[int]
    """The ids the model was conditioned on (the rendered chat)."""
    token_ids: list[int]
    """Every sampled id, the closing end-of-turn token included (the policy learns to stop)."""
    logprobs: list[float]
    """Per sampled token, under the weights that sampled it (the GRPO 'old' logprobs)."""
    policy_version: int
    """The oldest weights version that produced a token of this turn (all of them, unless
    new weights arrived mid-turn: the engine then re-reads the prefix under the new ones)."""
    finish_reason: FinishReason
    allowed_token_ids: list[int] | None = None
    """The request's restriction, if any (the logprobs are under it)."""
    metadata: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def not_run(cls, request: GenerateRequest, version: int) -> Completion:
        """The answer of a turn aborted before it ran (the engine, a replica or the proxy
        saw its abort first): no tokens, ``finish_reason="abort"``."""
        return cls(
            request_id=request.request_id,
            text="",
            prompt_ids=list(request.prompt_ids or []),
            token_ids=[],
            logprobs=[],
            policy_version=version,
            finish_reason="abort",
            allowed_token_ids=request.allowed_token_ids,
            metadata=request.metadata,
        )

    @model_validator(mode="after")
    def _aligned(self) -> Completion:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.logprobs)} logprobs")
        return self


class Engine(ABC):
    """One model replica that generates many requests concurrently."""

    #: The registry name (``torch``, ``vllm``, ``openai``).
    name: str = ""

    def __init__(self, *, version: int = 0) -> None:
        self._version = version
        self._initial_version = version  # what a restarted backend serves (see restart)
        self._dead: EngineDeadError | None = None
        self._running = asyncio.Event()
        self._running.set()
        self._swap_lock = asyncio.Lock()
        self._loaded_any = False  # a version-0 load (a first publish) is not skipped
        self._starting: asyncio.Future[None] | None = None
        self._closed = False
        self._inflight: dict[str, asyncio.Event] = {}  # request id -> its abort flag

    # -- lifecycle (template methods)
    async def start(self) -> None:
        """Start the backend once; every caller waits until it has started. (A flag set
        before ``_start`` let a second caller through at once: turns that arrived while vLLM
        loaded its tokenizer failed on ``None``.) A failed start is raised to every waiter
        and tried again by the next call."""
        if self._closed:
            raise EngineClosedError(f"{self.name} engine is closed")
        starting = self._starting
        if starting is None or (starting.done() and not starting.cancelled() and starting.exception()):
            starting = self._starting = asyncio.ensure_future(self._start())
        try:
            # shielded: one waiter cancelled (an aborted turn) must not cancel the others' start
            await asyncio.shield(starting)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closed and starting.cancelled() and (task is None or not task.cancelling()):
                # aclose() stopped the start, not a cancel of ours: say so, not CancelledError
                raise EngineClosedError(f"{self.name} engine was closed while it started") from None
            raise

    async def aclose(self) -> None:
        """Abort what is in flight and release the backend; idempotent."""
        if self._closed:
            return
        self._closed = True
        for rid in list(self._inflight):
            await self.abort(rid)
        self._running.set()  # release waiters at the gate so they see the engine closed
        starting = self._starting
        if starting is not None and not starting.done():  # closed while it starts: no start left behind
            starting.cancel()
            await asyncio.wait([starting])  # its outcome is moot; a cancel of ours still propagates
        await self._close()

    async def restart(self) -> None:
        """Start a dead engine afresh (a no-op on a live one): abort what is in flight,
        close the backend and start it again (``_close``, then ``_start``). Its weights
        count as its initial ones again (version and all): a rebuilt vLLM engine loads the
        model from its checkpoint, so the proxy's recovery reloads the latest weights."""
        if self._dead is None:
            return
        if self._closed:
            raise EngineClosedError(f"{self.name} engine is closed")
        for rid in list(self._inflight):
            await self.abort(rid)
        starting, self._starting = self._starting, None
        if starting is not None and not starting.done():
            starting.cancel()
            await asyncio.wait([starting])
        try:
            await self._close()
        except Exception as e:  # a dead backend may fail its shutdown: it is replaced all the same
            log.warning("%s engine: closing the dead backend failed (%r); starting a new one", self.name, e)
        self._dead = None
        self._version, self._loaded_any = self._initial_version, False
        await self.start()

    @property
    def dead(self) -> EngineDeadError | None:
        """Why the engine cannot serve any more (None while it can)."""
        return self._dead

    def check_alive(self) -> None:
        """Raise ``EngineDeadError`` if the engine is dead (a replica's ping asks)."""
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))

    def _mark_dead(self, error: EngineDeadError) -> None:
        """A backend found its engine dead: every later call fails at once with ``error``'s
        message (the first cause is kept), until ``restart``."""
        if self._dead is None:
            self._dead = error

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def version(self) -> int:
        """The weights version new tokens are generated with."""
        return self._version

    @property
    def suspended(self) -> bool:
        return not self._running.is_set()

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    async def generate(self, request: GenerateRequest) -> Completion:
        """Generate one turn. Waits while the engine is suspended; returns a
        ``finish_reason="abort"`` completion if ``abort`` names it meanwhile."""
        if self._closed:
            raise EngineClosedError(f"{self.name} engine is closed")
        self.check_alive()
        rid = request.request_id
        if rid in self._inflight:
            raise EngineError(f"request id {rid!r} is already in flight")
        aborted = asyncio.Event()
        self._inflight[rid] = aborted  # before any await: a duplicate id cannot slip in
        try:
            await self._start_unless_aborted(aborted)
            if aborted.is_set():
                return Completion.not_run(request, self._version)
            # new work waits at the gate, where an abort still finds it; again after waking:
            # a resume wakes every waiter, and the next swap may have closed the gate before
            # this one runs
            while not self._running.is_set() and not aborted.is_set() and not self._closed:
                await _first_of(self._running.wait(), aborted.wait())
            if aborted.is_set():
                return Completion.not_run(request, self._version)
            if self._closed:
                raise EngineClosedError(f"{self.name} engine is closed")
            # looked at here, with no await before the backend queues the request: a
            # backend's loop that died meanwhile would otherwise never answer it
            self.check_alive()
            try:
                return await self._generate(request)
            except EngineDeadError as e:
                self._mark_dead(e)
                raise
        finally:
            self._inflight.pop(rid, None)

    async def _start_unless_aborted(self, aborted: asyncio.Event) -> None:
        """``start()``, or return as soon as the turn is aborted (an abort must not wait
        for a model to load); a failed start is raised unless the turn was aborted."""
        starting = asyncio.ensure_future(self.start())
        flag = asyncio.ensure_future(aborted.wait())
        try:
            await asyncio.wait({starting, flag}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            flag.cancel()
            if not starting.done():
                starting.cancel()  # this waiter only: the start itself is shielded
        if aborted.is_set():
            if starting.done() and not starting.cancelled():
                starting.exception()  # retrieved: an aborted turn does not report it
            return
        starting.result()

    async def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is (at the gate, queued or generating); its
        ``generate`` returns what it had. False when no such request is in flight (finished,
        or never sent): aborting is idempotent, so a group can abort its extras blindly."""
        aborted = self._inflight.get(request_id)
        if aborted is None:
            return False
        aborted.set()
        await self._abort(request_id)
        return True

    async def suspend(self) -> None:
        """Take no new step until ``resume``; returns once the step in flight is done, so
        weights can be swapped under no running forward pass."""
        self._running.clear()
        await self._pause()

    async def resume(self) -> None:
        self._running.set()

    async def swap(self, state: Mapping[str, Any], version: int) -> bool:
        """Suspend, load ``version``, resume: what the proxy does to publish. One swap at a
        time: a replica reloading the latest weights after a restart (its load waits for
        vLLM to start, a minute) and the trainer's next publish could otherwise load at
        once, the first to finish reopening the gate while the other still wrote its
        chunks (a mix of two versions, stamped one). A version at or below the engine's is
        skipped (a later one got there first). True when it was loaded."""
        async with self._swap_lock:
            # skipped by its number alone, not by its content: a version number names one set
            # of weights for good. The job's trainer numbers each step's weights one above the
            # last; an update every replica refused stops the job (no retry, and Ray retries
            # no actor call), so an engine that loaded a refused version (its answer lost) never
            # sees that number again; a --resume, which retrains from an earlier step and so
            # numbers other weights the same, runs new engine processes (the job kills its
            # actors on the way out). A same-numbered swap here is of the same weights: the
            # proxy's reload of what a swap it stopped waiting for (swap_timeout_s) went on to
            # load. A caller driving the proxy by hand must keep to that (LLMProxy.update_weights)
            if version <= self._version and self._loaded_any:
                return False
            try:
                # the suspend inside: a swap cancelled while it waits for the step in flight
                # (the proxy's swap_timeout_s) has closed the gate, and must reopen it
                await self.suspend()
                await self.load_weights(state, version)
            finally:
                await self.resume()
            return True

    async def load_weights(self, state: Mapping[str, Any], version: int) -> None:
        """Install new weights stamped ``version`` (never lower than the current one).

        Works while running too (the backend swaps them between steps), but the proxy
        suspends first so no turn straddles two versions."""
        if version < self._version:
            raise EngineError(f"weights version {version} is older than the engine's {self._version}")
        self.check_alive()  # (the torch engine's model would take them with its loop dead)
        try:
            await self._load_weights(state, version)
        except EngineDeadError as e:
            self._mark_dead(e)
            raise
        self._version = version
        self._loaded_any = True

    # -- hooks
    async def _start(self) -> None:  # noqa: B027 - optional hook
        """Start background work (a scheduler task, a client session)."""

    async def _close(self) -> None:  # noqa: B027 - optional hook
        """Stop background work; in-flight requests were aborted already."""

    async def _pause(self) -> None:  # noqa: B027 - optional hook
        """Return once no step is running (the gate is already closed)."""

    @abstractmethod
    async def _generate(self, request: GenerateRequest) -> Completion: ...

    @abstractmethod
    async def _abort(self, request_id: str) -> None:
        """Stop the request if the backend holds it (it may not have reached it yet)."""

    @abstractmethod
    async def _load_weights(self, state: Mapping[str, Any], version: int) -> None: ...


async def _first_of(*aws: Coroutine[Any, Any, Any]) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


class EngineRegistry:
    """Engine name -> ``module:Class``, imported on first use so a base install never
    imports a backend's SDK (vllm, openai) it does not use."""

    def __init__(self) -> None:
        self._entries: dict[str, str] = {}

    def register(self, name: str, entry_point: str) -> None:
        old = self._entries.get(name)
        if old is not None and old != entry_point:
            raise EngineError(f"engine {name!r} is already registered to {old}")
        self._entries[name] = entry_point

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str) -> type[Engine]:
        try:
            entry = self._entries[name]
        except KeyError:
            raise UnknownEngineError(name, self.names()) from None
        module, _, attr = entry.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise EngineError(f"cannot load engine {name!r} from {entry}: {e}") from e
        if not (isinstance(cls, type) and issubclass(cls, Engine)):
            raise EngineError(f"{entry} is not an Engine subclass")
        return cls

    def create(self, name: str, **kwargs: Any) -> Engine:
        return self.get(name)(**kwargs)


#: The default registry; backends register here (tests build their own).
engine_registry = EngineRegistry()
engine_registry.register("torch", "core.rollout.engines.torch_:TorchEngine")
engine_registry.register("vllm", "core.rollout.engines.vllm_:VLLMEngine")
engine_registry.register("openai", "core.rollout.engines.openai_:OpenAIEngine")
