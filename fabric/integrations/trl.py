"""rl-fabric rewards as TRL reward functions (``GRPOTrainer(reward_funcs=[...])``, RLOO too).

    from fabric.integrations.trl import trl_reward

    math_reward = trl_reward("math_answer")                    # warm local worker pools
    shared = trl_reward("code_verify", endpoint_url="http://rm:9000")  # a fabric serve
    trainer = GRPOTrainer(model=..., reward_funcs=[math_reward, shared], train_dataset=ds)
    trainer.train()
    math_reward.close()                                        # or `with trl_reward(...) as r:`

TRL's convention (``GRPOTrainer._calculate_rewards``, checked in TRL 1.16.0): the function is
called with keyword arguments ``prompts``, ``completions`` and ``completion_ids`` (lists,
one entry per completion), every dataset column but ``prompt`` (a list each), and
``trainer_state``, ``log_extra``, ``log_metric`` (and ``environments`` with an environment
factory). Prompts and completions are strings (standard datasets) or lists of chat messages
(conversational ones: a completion is ``[{"role": "assistant", "content": ...}]``). It
returns one float per completion, or ``None`` where the function does not apply: TRL makes
that NaN, leaves it out of that sample's sum, and a sample with no reward at all gets no
advantage. That is what a failed call returns here (unless ``failure_score`` is set). The
trainer logs ``rewards/<__name__>/mean``; ``__name__`` is the fabric function's name. An
async callable (``async def __call__``) runs on TRL's own event-loop thread, concurrently
with the other async reward functions: ``trl_async_reward`` (which also reads as a coroutine
function to ``inspect.iscoroutinefunction``, what earlier TRL releases check).

Dataset columns reach the function's parameters by name (a ``ground_truth`` column for
``math_answer``'s ``ground_truth``); ``args={"ground_truth": "answer"}`` names another column.
A null in a column a required parameter reads (a mixed dataset's row without it) fails that row
alone, as a failed call (``None``, or ``failure_score``; its error type ``NullArgument``), with
one warning a batch naming the rows and columns; the rest of the batch is scored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from fabric.backends.base import Backend
from fabric.integrations.base import (
    RewardAdapter,
    Sample,
    Score,
    SyncBridge,
    build_trajectory,
    resolve_function,
)
from fabric.integrations.config import IntegrationConfig
from fabric.integrations.errors import BadBatchError
from fabric.registry import Registry

#: Keyword arguments TRL passes that are not dataset columns.
TRL_EXTRAS = frozenset({"completion_ids", "trainer_state", "log_extra", "log_metric", "environments"})


class _TRLReward:
    def __init__(
        self,
        function: str | Callable[..., Any],
        *,
        registry: Registry | None = None,
        backend_instance: Backend | None = None,
        **options: Any,
    ):
        name, fn = resolve_function(function)
        self.config = IntegrationConfig.parse({"function": name, **options})
        # a null in a required column (a mixed dataset's row without it) fails that row, not
        # the batch: TRL gives it no reward (or failure_score) and the others are scored
        self.adapter = RewardAdapter(
            self.config, registry=registry, function=fn, backend=backend_instance, null_fails_row=True
        )
        self._bridge = SyncBridge(self.adapter, name=f"fabric-trl-{name}")
        # TRL names the reward in its logs (rewards/<name>/mean) by __name__
        self.__name__ = name
        self.__qualname__ = name
        # what pickling rebuilds from: a trainer that sends its reward functions to a spawned
        # process (TRL's experimental AsyncGRPOTrainer) pickles them, and the bridge's lock,
        # loop thread and client cannot travel; the copy starts its own on first use
        self._recipe = None if registry is not None or backend_instance is not None else (function, options)

    def __reduce__(self) -> tuple[Any, ...]:
        if self._recipe is None:
            raise TypeError(
                f"{type(self).__name__}({self.__name__!r}) was built with registry= or backend_instance=, "
                "which cannot be sent to another process; build it from a function name or a decorated "
                "function (and modules=... for your own)"
            )
        function, options = self._recipe
        return (_rebuild, (type(self), function, options))

    def samples(
        self, prompts: Sequence[Any], completions: Sequence[Any], kwargs: dict[str, Any]
    ) -> list[Sample]:
        # TRL passes lists: a string would be scored as one completion per character
        for what, values in (("completions", completions), ("prompts", prompts)):
            if not isinstance(values, list | tuple) and (what == "completions" or values is not None):
                raise BadBatchError(
                    f"{self.__name__}: {what} must be a list, one per completion, not {type(values).__name__}"
                )
        n = len(completions)
        if prompts is not None and len(prompts) != n:
            raise BadBatchError(f"{self.__name__}: {len(prompts)} prompts but {n} completions")
        columns: dict[str, Any] = {}
        for key, values in kwargs.items():
            if key in TRL_EXTRAS:
                continue
            if isinstance(values, list | tuple):
                if len(values) != n:
                    raise BadBatchError(
                        f"{self.__name__}: column {key!r} has {len(values)} values for {n} completions"
                    )
            columns[key] = values
        out = []
        for i, completion in enumerate(completions):
            sources = {k: (v[i] if isinstance(v, list | tuple) else v) for k, v in columns.items()}
            traj = build_trajectory(
                completion,
                None if prompts is None else prompts[i],
                task={k: v for k, v in sources.items() if k == "ground_truth"},
                what=f"completion #{i}",
            )
            out.append(Sample(traj, sources))
        return out

    def finish(self, scores: list[Score], kwargs: dict[str, Any]) -> list[float | None]:
        self.adapter.check(scores, none_ok=True)
        log_metric = kwargs.get("log_metric")
        if callable(log_metric) and scores:
            # per-batch means; TRL averages them over the logging step, next to kl and entropy
            log_metric(f"{self.__name__}/failed", sum(s.failed for s in scores) / len(scores))
            for key in self.adapter._keys:
                values = [s.components[key] for s in scores if key in s.components]
                if values:
                    log_metric(f"{self.__name__}/{key}", math.fsum(values) / len(values))
        return [s.value for s in scores]

    def close(self) -> None:
        """Close the fabric client and its worker pools (the next call starts them again)."""
        self._bridge.close()

    def __enter__(self) -> _TRLReward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__name__!r}, backend={self.adapter._backend!r})"


def _rebuild(
    cls: type[_TRLReward], function: str | Callable[..., Any], options: dict[str, Any]
) -> _TRLReward:
    return cls(function, **options)


class TRLReward(_TRLReward):
    """A synchronous TRL reward function running a fabric function (see the module doc)."""

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[float | None]:
        samples = self.samples(prompts, completions, kwargs)
        return self.finish(self._bridge.run(samples), kwargs)


async def _trl_call(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """The calling convention an ``AsyncTRLReward`` shows ``inspect`` (never called)."""
    raise NotImplementedError


class AsyncTRLReward(_TRLReward):
    """The same, as an async callable: TRL awaits it on its event-loop thread, together with
    its other async reward functions (the calls themselves run on the bridge's loop)."""

    def __init__(self, function: str | Callable[..., Any], **options: Any):
        super().__init__(function, **options)
        # TRL releases before is_async_callable pick async reward functions with
        # inspect.iscoroutinefunction(reward_func), False for an instance with an async
        # __call__: they called it as a sync function and iterated the coroutine it returned.
        # A function's attributes make inspect (and asyncio) read the instance as the coroutine
        # function it is, as they do Cython's functions; its signature is TRL's convention
        self.__code__ = _trl_call.__code__
        self.__defaults__ = _trl_call.__defaults__
        self.__kwdefaults__ = _trl_call.__kwdefaults__
        self.__annotations__ = dict(_trl_call.__annotations__)

    async def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[float | None]:
        samples = self.samples(prompts, completions, kwargs)
        return self.finish(await self._bridge.arun(samples), kwargs)


def trl_reward(function: str | Callable[..., Any], **options: Any) -> TRLReward:
    """A TRL reward function for the fabric function ``function`` (a name or a decorated
    function); ``options`` are ``IntegrationConfig`` fields (``backend``, ``endpoint_url``,
    ``args``, ``failure_score``, ``deadline_s``, ...)."""
    return TRLReward(function, **options)


def trl_async_reward(function: str | Callable[..., Any], **options: Any) -> AsyncTRLReward:
    """As ``trl_reward``, async (TRL runs async reward functions concurrently)."""
    return AsyncTRLReward(function, **options)
