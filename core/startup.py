"""The job's start-up checks that need the fabric client and the envpool running: the
configured reward functions' workers, and the containers of every image the entries play,
are started before the first group, so that a setup hook that raises or an image that starts
in no container is a config error naming its key, not a stop after many failed groups."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from core.config import JobConfig
from core.env_images import JobImages
from core.errors import ConfigError, where_raised

log = logging.getLogger(__name__)

WARM_ATTEMPTS = 3
"""Warm-up tries of a reward whose setup hook raises before it is a config error."""


async def prewarm_images(cfg: JobConfig, pool: Any, images: JobImages) -> None:
    """Warm containers of every image the entries play (None: the built-ins) before the
    first group. An image that passed the start-up check but starts in no container (a
    device, a licence server it needs is missing) is a config error named under the
    entries that play it, as any other problem of theirs is; it was a raw traceback."""
    from envpool.errors import ContainerStartError

    for image in dict.fromkeys(images.refs.get(e.image) if e.image else None for e in cfg.envs):
        try:
            await pool.prewarm(image)
        except ContainerStartError as e:
            if image is None:  # the built-ins: the host's trouble, not the config's
                raise
            where = [i for i, env in enumerate(cfg.envs) if env.image and images.refs.get(env.image) == image]
            raise ConfigError(
                [(f"envs[{i}].image", f"its containers do not start: {e}") for i in where]
            ) from None


async def warm_rewards(cfg: JobConfig, client: Any, *, retry_s: float) -> None:
    """Start the configured reward functions' warm workers before the first group. A setup
    hook that raises in each of ``WARM_ATTEMPTS`` tries, ``retry_s`` apart (or an import that
    fails), is a config error naming the reward: found by the calls instead, it masked every
    trajectory and the job stopped only after ``max(8, 2 x batch_size)`` groups of
    ``max_reruns`` re-runs, with a ``RolloutError``."""
    from fabric.errors import SetupFailedError

    keys: dict[str, list[str]] = {}  # function -> the config keys that name it
    for tag, specs in cfg.rewards.items():
        for j, spec in enumerate(specs):
            keys.setdefault(spec.function, []).append(f"rewards.{tag}[{j}].function")

    async def warm(function: str) -> None:
        # a setup that fails once (a model download cut off) is not a config error: the
        # pool starts workers again after its cooldown, and so does this, a few times; an
        # import that fails is the code's, and fails the same way every time
        for attempt in range(1, WARM_ATTEMPTS + 1):
            try:
                return await client.warmup([function])
            except SetupFailedError as e:
                if attempt == WARM_ATTEMPTS or _import_failed(e):
                    raise
                log.warning(
                    "reward %s: its workers did not start (%s); trying again in %g s",
                    function,
                    e.message,
                    retry_s,
                )
                await asyncio.sleep(retry_s)

    # one warmup per function: each failure is mapped to its keys (a warmup of several
    # raises for the first and only names the others)
    outcomes = await asyncio.gather(*(warm(f) for f in keys), return_exceptions=True)
    problems: list[tuple[str, str]] = []
    for function, outcome in zip(keys, outcomes, strict=True):
        if isinstance(outcome, SetupFailedError):
            where = where_raised(outcome.traceback)
            why = f"its workers cannot start: {outcome.message}{f' ({where})' if where else ''}"
            problems += [(key, why) for key in keys[function]]
        elif isinstance(outcome, Exception):
            # the machinery, not the function (a slow start): the calls retry; nothing lost
            log.warning("warming up reward %s failed: %s", function, outcome)
        elif isinstance(outcome, BaseException):
            raise outcome
    if problems:
        raise ConfigError(problems)


def _import_failed(e: Any) -> bool:
    """Whether a worker's setup failed importing the function's module (no retry mends it)."""
    last = (e.traceback or e.message or "").strip().splitlines()[-1:] or [""]
    return last[0].startswith(("ModuleNotFoundError", "ImportError", "SyntaxError", "IndentationError"))
