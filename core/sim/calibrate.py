"""Measure a real engine's profile for the simulator (``EngineProfile``).

The simulator charges a decode iteration over ``b`` running requests ``step_ms(b)`` and a
prompt token ``prefill_ratio`` decode tokens. Both are measured here on the engine itself,
through the ``Engine`` ABC, so the same code profiles the torch engine on a CPU and vLLM
on a GPU:

* for each batch size ``b``, ``b`` requests sent together, once for ``tokens`` tokens and
  once for 1 token: the difference over ``tokens - 1`` is one decode iteration;
* one request with a long prompt against one with a short prompt, 1 token each: the
  difference per prompt token, over ``step_ms(1)``, is the prefill ratio.

Every point is the median of ``repeats`` runs (machines are noisy). The engine must
generate the tokens asked for (no early end-of-turn): the request's real token count is
what is divided by, so an engine that stops early skews nothing, it only measures less.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

from core.rollout.engines.base import Engine, GenerateRequest
from core.sim.engine import EngineProfile

MakeRequest = Callable[[int, int], GenerateRequest]
"""``(prompt_tokens, max_new_tokens) -> request`` (a fresh request id each call)."""


async def _burst(
    engine: Engine, make: MakeRequest, b: int, prompt: int, tokens: int, clock: Callable[[], float]
) -> tuple[float, float]:
    """Seconds for ``b`` requests sent together, and the mean tokens they generated."""
    t0 = clock()
    done = await asyncio.gather(*(engine.generate(make(prompt, tokens)) for _ in range(b)))
    return clock() - t0, statistics.fmean(len(c.token_ids) for c in done)


async def profile_engine(
    engine: Engine,
    make: MakeRequest,
    *,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
    tokens: int = 32,
    prompt: int = 16,
    long_prompt: int = 256,
    repeats: int = 3,
    max_batch: int | None = None,
    cache_tokens: int = 0,
    prefill_blocks: bool = True,
    clock: Callable[[], float] = time.perf_counter,
) -> EngineProfile:
    """The engine's profile. The defaults describe the torch engine: no prefix cache
    between turns (``cache_tokens=0``: it re-reads every prompt) and a prefill pass that
    holds up the decode step (``prefill_blocks``)."""
    if tokens < 2 or repeats < 1 or not batch_sizes or long_prompt <= prompt:
        raise ValueError("need tokens >= 2, repeats >= 1, batch sizes, and long_prompt > prompt")
    await _burst(engine, make, 1, prompt, tokens, clock)  # warm-up: allocator, threads, caches
    steps = []
    for b in batch_sizes:
        per_step = []
        for _ in range(repeats):
            full, n = await _burst(engine, make, b, prompt, tokens, clock)
            first, _ = await _burst(engine, make, b, prompt, 1, clock)
            per_step.append(1000 * max(full - first, 1e-6) / max(n - 1, 1))
        steps.append(statistics.median(per_step))
    # a profile's step time never falls as the batch grows (noise can say otherwise)
    for k in range(1, len(steps)):
        steps[k] = max(steps[k], steps[k - 1])
    short = statistics.median([(await _burst(engine, make, 1, prompt, 1, clock))[0] for _ in range(repeats)])
    long = statistics.median(
        [(await _burst(engine, make, 1, long_prompt, 1, clock))[0] for _ in range(repeats)]
    )
    per_prompt_ms = 1000 * max(long - short, 0.0) / (long_prompt - prompt)
    return EngineProfile(
        batch_sizes=tuple(batch_sizes),
        step_ms_table=tuple(steps),
        max_batch=max_batch or max(batch_sizes),
        prefill_ratio=per_prompt_ms / steps[0],
        cache_tokens=cache_tokens,
        prefill_blocks=prefill_blocks,
    )


def scaled(profile: EngineProfile, factor: float) -> EngineProfile:
    """``profile`` with every step ``factor`` times longer: the overheads a micro-benchmark
    of the engine does not see (the event loop serving many trajectories, the proxy, the
    GIL), fitted once on a calibration run (real makespan over simulated)."""
    if factor <= 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    return dataclasses.replace(profile, step_ms_table=tuple(x * factor for x in profile.step_ms_table))
