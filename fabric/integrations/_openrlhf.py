"""The OpenRLHF adapter's implementation; ``fabric/integrations/openrlhf.py`` is the file
OpenRLHF loads (``--reward.remote_url``, ``--remote_rm_url``), and its module doc says how.

OpenRLHF loads a reward file by *path*, as a module named ``reward_func`` that is not in
``sys.modules``. Were ``reward_func`` defined in that file, it would belong to a module nobody
can import, and OpenRLHF 0.8's ``RemoteRewardModel``, which runs it as a Ray task
(``ray.remote(reward_module.reward_func)``), could not pickle it: cloudpickle copies such a
function by value with the globals it reads, and this module's lock does not pickle. Defined
here, it is pickled by reference and rebuilt by import in the Ray worker, and the file loaded
by path shares this module's reward with any other import.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from fabric.backends.base import Backend
from fabric.integrations.base import (
    RewardAdapter,
    Sample,
    Score,
    SyncBridge,
    _json_object,
    build_trajectory,
    resolve_function,
)
from fabric.integrations.config import IntegrationConfig, plain
from fabric.integrations.errors import (
    BadBatchError,
    IntegrationError,
    MissingArgumentError,
    RefusedArgumentsError,
    RewardCallError,
)
from fabric.registry import Registry

log = logging.getLogger("fabric.integrations.openrlhf")

#: The HTTP form's limit on a request body (``--max-body-mb``). A body carries a whole
#: micro-batch (older OpenRLHF posts it to one server), so it is not the 6 MiB limit of one
#: call, which each sample's payload still meets (a sample over it fails alone).
DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024

_ALIASES = {"ground_truth": "label"}

#: End-of-sequence markers a query carries (OpenRLHF decodes with special tokens): the
#: response is read without them, so an answer is not "42<|im_end|>".
EOS_MARKERS: tuple[str, ...] = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "</s>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek's, in full-width bars
)


class OpenRLHFReward:
    """``reward_func(queries, prompts, labels)`` for a fabric function."""

    def __init__(
        self,
        function: str | Callable[..., Any] | IntegrationConfig,
        *,
        registry: Registry | None = None,
        backend_instance: Backend | None = None,
        eos_markers: Sequence[str] = EOS_MARKERS,
        **options: Any,
    ):
        fn = None
        if isinstance(function, IntegrationConfig):
            self.config = function
        else:
            name, fn = resolve_function(function)
            self.config = IntegrationConfig.parse({"function": name, **options})
        self.adapter = RewardAdapter(
            self.config, registry=registry, function=fn, aliases=_ALIASES, backend=backend_instance
        )
        self.eos_markers = tuple(eos_markers)
        self._bridge = SyncBridge(self.adapter, name=f"fabric-openrlhf-{self.config.function}")

    def samples(self, queries: Any, prompts: Any, labels: Any) -> list[Sample]:
        for what, value in (("queries", queries), ("prompts", prompts), ("labels", labels)):
            if not isinstance(value, list | tuple):
                raise BadBatchError(f"{what} must be a list, not {type(value).__name__}")
        if not len(queries) == len(prompts) == len(labels):
            raise BadBatchError(
                f"{len(queries)} queries, {len(prompts)} prompts and {len(labels)} labels: "
                "one of each per sample"
            )
        out = []
        for i, (query, prompt, label) in enumerate(zip(queries, prompts, labels, strict=True)):
            if not isinstance(query, str) or not isinstance(prompt, str):
                raise BadBatchError(f"sample #{i}: query and prompt must be text")
            label = plain(label)
            sources: dict[str, Any] = {"query": query, "prompt": prompt, "label": label}
            inner = (
                label if isinstance(label, dict) else _json_object(label) if isinstance(label, str) else None
            )
            if inner:
                sources = {**inner, **sources}
            task = {"ground_truth": label} if isinstance(label, str) else {}
            traj = build_trajectory(self.response(query, prompt), prompt, task=task, what=f"query #{i}")
            out.append(Sample(traj, sources))
        return out

    def response(self, query: str, prompt: str) -> str:
        """The response in ``query`` (prompt + response, as decoded): after the prompt when the
        query repeats it, or after the prompt's end when OpenRLHF cut a long prompt from the
        left; without a trailing end-of-sequence marker."""
        if query.startswith(prompt):
            text = query[len(prompt) :]
        else:
            at = query.find(prompt) if prompt else -1
            if at >= 0:
                text = query[at + len(prompt) :]
            else:
                # scoring the whole query would score the prompt too (an answer in a few-shot
                # example): drop the longest end of the prompt the query starts with
                text = query[_kept_prompt(query, prompt) :]
        stripped = True
        while stripped:
            stripped = False
            text = text.rstrip()
            for marker in self.eos_markers:
                if marker and text.endswith(marker):
                    text, stripped = text[: -len(marker)], True
        return text

    def result(self, scores: list[Score]) -> dict[str, Any]:
        self.adapter.check(scores, none_ok=False)
        rewards = [s.value for s in scores]
        logs: dict[str, list[float]] = {}
        for s in scores:
            for k, v in self.adapter.report(s).items():
                logs.setdefault(k, []).append(v)
        if self.config.failure_score is not None:
            logs["fabric_failed"] = [1.0 if s.failed else 0.0 for s in scores]
        return {"rewards": rewards, "scores": rewards, "extra_logs": logs}

    def __call__(self, queries: Any, prompts: Any, labels: Any) -> dict[str, Any]:
        try:
            return self.result(self._bridge.run(self.samples(queries, prompts, labels)))
        except IntegrationError as e:
            # OpenRLHF logs a reward function's exception at INFO only: say it louder here
            log.warning("%s", e)
            raise

    async def score_async(self, queries: Any, prompts: Any, labels: Any) -> dict[str, Any]:
        """For a server on its own loop: the adapter's client lives on that loop."""
        return self.result(await self.adapter.score(self.samples(queries, prompts, labels)))

    def close(self) -> None:
        self._bridge.close()

    def __enter__(self) -> OpenRLHFReward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: How much of the query's start is looked up in the prompt to find where a left-truncated
#: prompt resumes: the candidates are its occurrences, each then checked to the prompt's end.
_HEAD_CHARS = 64


def _kept_prompt(query: str, prompt: str) -> int:
    """The length of the longest end of ``prompt`` that ``query`` starts with (0: none), as
    when OpenRLHF kept only a long prompt's last tokens. Only the offsets where the query's
    first characters occur in the prompt are checked (``str.find``), not every suffix."""
    head = query[:_HEAD_CHARS]
    if not head:
        return 0
    tail = prompt[-_HEAD_CHARS:]
    at = prompt.find(head)
    while at >= 0:  # the first fit is the longest
        kept = len(prompt) - at
        # cheap refusals first (too long for the query, the prompt's end not where it would
        # be), so a repetitive prompt does not compare its whole rest at every occurrence
        if kept <= len(query) and query.startswith(tail, kept - len(tail)) and query.startswith(prompt[at:]):
            return kept
        at = prompt.find(head, at + 1)
    # a kept end shorter than the head (the head ran into the response)
    for kept in range(min(len(head), len(prompt)) - 1, 0, -1):
        if query.startswith(prompt[-kept:]):
            return kept
    return 0


# ----------------------------------------------------------------------------- the file form

_DEFAULT: OpenRLHFReward | None = None
_LOCK = threading.Lock()


def _new_lock_in_child() -> None:
    # held by another thread of the parent at the fork (building the first reward), it would
    # never be released in the child: its first call would wait forever
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def reward_func(queries: Any, prompts: Any, labels: Any) -> dict[str, Any]:
    """OpenRLHF's ``reward_func``, configured by the ``FABRIC_*`` environment variables."""
    global _DEFAULT
    if _DEFAULT is None:
        with _LOCK:
            if _DEFAULT is None:
                _DEFAULT = OpenRLHFReward(IntegrationConfig.parse())
    return _DEFAULT(queries, prompts, labels)


# ----------------------------------------------------------------------------- the HTTP form


class RewardServer:
    """OpenRLHF's remote reward over HTTP (aiohttp, as ``fabric serve``): ``POST /get_reward``
    (any path but ``/healthz``). ``async with RewardServer(config) as s:`` serves at ``s.url``.

    Answers: 200 with ``{"rewards", "scores", "extra_logs"}``; 400 for a body that is not the
    OpenRLHF shape or values the function refuses (a label of the wrong type, or none: a
    missing ``labels`` is named as missing); 413 for a body
    over ``max_body_bytes`` (a sample over the 6 MiB call limit fails alone); 502 when calls
    failed and there is no ``failure_score`` (with the failures listed), which OpenRLHF
    retries and then gives up on."""

    def __init__(
        self,
        config: IntegrationConfig,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        registry: Registry | None = None,
        backend_instance: Backend | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        drain_s: float = 30.0,
    ):
        from fabric.serve.drain import InFlight  # aiohttp's side: only a server needs it

        self.reward = OpenRLHFReward(config, registry=registry, backend_instance=backend_instance)
        self.host, self.port = host, port
        self.max_body_bytes = max_body_bytes
        self.drain_s = drain_s
        """On close, requests in flight get this long to finish; then they are cancelled."""
        self.requests = InFlight()
        self._runner: Any = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address in brackets
        return f"http://{host}:{self.port}/get_reward"

    async def __aenter__(self) -> RewardServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        from aiohttp import web

        from fabric.serve.drain import drain_timeout

        await self.reward.adapter.start()
        try:
            app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self.requests.middleware])
            app.router.add_get("/healthz", self._healthz)
            app.router.add_post("/{tail:.*}", self._score)
            # handler_cancellation: a request whose client hung up (OpenRLHF's 180 s timeout, after
            # which it posts the same request again) cancels its calls instead of running them on
            self._runner = web.AppRunner(
                app,
                access_log=None,
                handle_signals=False,
                handler_cancellation=True,
                shutdown_timeout=drain_timeout(self.drain_s),
            )
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
            await site.start()
        except BaseException:
            await self.aclose()
            raise
        server = site._server  # aiohttp exposes the bound port only here
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def aclose(self) -> None:
        from fabric.serve.drain import cleanup_within

        runner, self._runner = self._runner, None
        if runner is not None:
            await cleanup_within(runner, self.drain_s, self.requests.cancel)
        await self.reward.adapter.aclose()

    async def _healthz(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"status": "ok", "function": self.reward.config.function})

    async def _score(self, request: Any) -> Any:
        from aiohttp import web

        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body over {self.max_body_bytes} bytes")
        try:
            data = json.loads(body)
        except ValueError as e:
            return _error(400, f"body is not JSON: {e}")
        if not isinstance(data, dict):
            return _error(400, f"body must be {_SHAPE}")
        if "query" not in data:
            return _error(400, f'the body has no "query" field (expected {_FIELDS}: {_SHAPE})')
        queries = data["query"]
        # a function that needs no label (or prompt) is scored without one
        prompts = data.get("prompts", [""] * len(queries) if isinstance(queries, list) else None)
        labels = data.get("labels", [None] * len(queries) if isinstance(queries, list) else None)
        # only the labels' stand-ins (nulls) can be what the function refused or lacked: the
        # prompts' are empty strings, which a str parameter takes, so an absent "prompts"
        # beside a label of the wrong type was blamed for its refusal
        absent = ['"labels"'] if "labels" not in data else []
        try:
            return web.json_response(await self.reward.score_async(queries, prompts, labels))
        except RefusedArgumentsError as e:
            if not absent:
                return _error(400, str(e))
            # the refused values are the nulls that stood in for the absent field, not a
            # column of the wrong type
            return _error(
                400,
                f"the body has no {' or '.join(absent)} field (expected {_FIELDS}), and "
                f"{e.signature} needs it: it refused the arguments of {e.count} of {e.total} "
                f"samples without it; first: {e.first_refusal}",
            )
        except (BadBatchError, MissingArgumentError) as e:
            if absent and isinstance(e, MissingArgumentError):
                return _error(400, f"the body has no {' or '.join(absent)} field (expected {_FIELDS}): {e}")
            return _error(400, str(e))
        except RewardCallError as e:
            log.warning("%s", e)
            failures = [{"index": i, "type": err.type, "message": err.message} for i, err in e.failures]
            return _error(502, str(e), failures=failures)


_SHAPE = '{"query": [...], "prompts": [...], "labels": [...]}'
_FIELDS = '"query", "prompts", "labels"'


def _error(status: int, message: str, **extra: Any) -> Any:
    from aiohttp import web

    return web.json_response({"error": message, **extra}, status=status)


async def serve(
    config: IntegrationConfig,
    *,
    host: str,
    port: int,
    ready: Callable[[str], None] | None = None,
    drain_s: float = 30.0,
    say: Callable[[str], None] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> None:
    """Serve until SIGINT/SIGTERM (``fabric integrate openrlhf-serve``); then the requests in
    flight get ``drain_s`` to finish, and a second signal cancels them at once. ``say`` gets
    what to tell the user about it. Once closed after a SIGINT, raises ``KeyboardInterrupt``
    (Ctrl-C's exit status, 130, in the CLI); after SIGTERM it returns (exit 0)."""
    from fabric.serve.drain import SignalStop, close_in_two_steps, start_unless_stopped

    signals = SignalStop()
    stop = signals.event
    server = RewardServer(config, host=host, port=port, drain_s=drain_s, max_body_bytes=max_body_bytes)
    if not await start_unless_stopped(server.start(), stop):  # a signal during start-up
        await server.aclose()
        signals.exit_if_signalled()
        return
    try:
        if ready is not None:
            ready(server.url)
        await stop.wait()
        stop.clear()
        if server.requests and say is not None:
            say(
                f"stopping: waiting up to {drain_s:g} s for {len(server.requests)} requests in flight "
                "(Ctrl-C again: stop now)"
            )
    finally:

        def stopping_now() -> None:
            if say is not None:
                say(f"stopping now: {len(server.requests)} requests cancelled")

        await close_in_two_steps(server.aclose(), stop, server.requests.cancel, stopping_now)
    signals.exit_if_signalled()
