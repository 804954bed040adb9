"""``llm_judge``: a model grades the response against a rubric, through any OpenAI-compatible
chat endpoint (OpenAI, vLLM, SGLang, a gateway).

Configuration is a ``JudgeConfig``; the reward reads it from the environment once per worker
(its setup hook): every field can be set as ``RL_FABRIC_JUDGE_<FIELD>`` (for example
``RL_FABRIC_JUDGE_MODEL``, ``RL_FABRIC_JUDGE_TIMEOUT_S``,
``RL_FABRIC_JUDGE_REQUESTS_PER_MINUTE``), and the endpoint and key fall back to the OpenAI
SDK's ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``.

How a call goes:

* the rubric is filled in (``{question}``, ``{reference}``, ``{response}``, ``{min_score}``,
  ``{max_score}``, ``{nonce}``) and sent as one user message, at ``temperature`` (0 by
  default; no ``seed`` unless ``extra_body`` sets one, so a verdict is as repeatable as the
  endpoint's greedy decoding, which batching can vary; the nonces differ per call), its length
  capped by ``max_tokens`` (sent as ``max_completion_tokens`` to OpenAI's API, whose reasoning
  models refuse ``max_tokens``; ``max_tokens_field`` chooses); ``{response}``
  becomes the response between ``<response-NONCE>`` tags, the nonce random per call, so a
  response cannot close them and go on as the rubric; ``{nonce}`` is a second per-call
  nonce (six letters, never in the response) for the verdict line;
* the response is sent whole, never cut (the judge sees its end, where the final answer, or
  an instruction injected for the judge, sits); one too long for ``tokens_per_minute`` fails
  the call before it is sent, one too long for the model's context is refused by the
  endpoint (``JudgeRejectedError``): final errors, never scores;
* a token bucket per worker holds requests under ``requests_per_minute`` and
  ``tokens_per_minute`` (a request is charged ``chars / 4 + max_tokens`` up front, the
  ``usage`` of the reply settles the difference);
* 408, 429 (but ``insufficient_quota``), 5xx, timeouts, network errors and a reply the
  server aborted (vLLM's ``finish_reason`` ``abort``) are retried with exponential backoff and
  jitter, or after the server's ``Retry-After`` and a small random jitter (up to a fifth of it
  more, at most 1 s: calls that got a 429 together do not all come back at one instant);
  other 4xx fail at once. Retries, waits and each attempt's timeout stay within the time the
  reward's run has left (its ``timeout_s``, or the call's deadline if sooner), so an
  endpoint that stays down ends in the judge's own ``Unavailable``, saying how long it
  tried, not in the run's bare timeout;
* the reply is the message's content, a string or a list of parts (``[{"type": "text",
  "text": ...}]``: its text parts, one a line; a refusal part is no text);
* the score is the judge's verdict line, ``Verdict NONCE: N/10`` as the default rubric asks
  (the response cannot know the nonce, so cannot forge the line); failing that, a reply that
  is one JSON object, or a line that begins with its score as a verdict line does (a garbled
  nonce, ``Score: 7/10``), and nothing else: a reply without them fails, as a judge that
  refuses to grade an injection names the score it demanded. Under a rubric without
  ``{nonce}``, the latest score in the reply in the form the rubric asks for
  (``Score: 7/10``, ``<score>3</score>``, ``{"score": 8}``) or another form where it ends
  the reply, leaving out any whose text the response carries (the judge quoting it): see
  ``judge_score`` for the rules and what they cannot tell. The score is normalised to [0, 1].

Failures are results, never fake scores: an endpoint that stays overloaded, failing or silent
raises ``Unavailable`` (retryable; the fabric may try the call again), and a reply that cannot
be read as a score raises ``JudgeResponseError`` (final: the same reply would fail again), as
does a reply cut short (``finish_reason`` ``length``: past ``max_tokens``, or
``content_filter``), whatever score-like text it holds: it stops before the verdict, or in it.
A fault of the judge's own setup raises ``JudgeMisconfigured`` (``fabric.Misconfigured``: the
call fails ``Misconfigured``, which a reward's ``failure_score`` never scores, as it would every
trajectory alike): the endpoint refusing the key (401/403), knowing neither the model nor the
URL (404), redirecting it (3xx, not followed) or answering with a web page (a ``base_url``
at a web UI: HTML where JSON should be; another body that is not JSON stays
``JudgeResponseError``), refusing a setting the model does not take
(400 ``unsupported_parameter`` or ``unsupported_value``: ``max_tokens`` or ``temperature`` 0
on an OpenAI reasoning model) or an account out of credit (429 ``insufficient_quota``, never
retried), a ``rubric`` argument without ``{response}``, no model configured when no setup hook
read the config. Another 4xx
(a 400 for a response past the model's context) stays ``JudgeRejectedError``.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable
from secrets import token_hex
from typing import Any

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type
from tenacity.wait import wait_random_exponential

import fabric
from fabric.errors import ConfigError, Unavailable
from fabric.protocol import RewardResult, Trajectory
from fabric.runner import time_left_s
from functions.openai_api import error_message, excerpt, is_web_page, retry_after_s
from functions.rewards.judge_config import DEFAULT_RUBRIC, ENV_PREFIX, OPENAI_URL, JudgeConfig
from functions.rewards.judge_errors import (
    _MISCONFIGURED_STATUSES,
    _NO_QUOTA,
    _REJECT_HINTS,
    _UNSUPPORTED_SETTING,
    JudgeError,
    JudgeMisconfigured,
    JudgeRejectedError,
    JudgeResponseError,
    _Transient,
)
from functions.rewards.judge_ratelimit import RateLimiter, TokenBucket, estimate_tokens
from functions.rewards.judge_reply import _ABORTED, _error_code, _finish_reason, reply_text
from functions.rewards.judge_score import parse_score, verdict_nonce

# the config, errors, rate limits, reply reading and score parsing live in their own
# modules; their public names stay importable from here
__all__ = [
    "DEFAULT_RUBRIC",
    "ENV_PREFIX",
    "MAX_INFO_CHARS",
    "OPENAI_URL",
    "Judge",
    "JudgeConfig",
    "JudgeError",
    "JudgeMisconfigured",
    "JudgeRejectedError",
    "JudgeResponseError",
    "RateLimiter",
    "TokenBucket",
    "estimate_tokens",
    "judge_from_env",
    "llm_judge",
    "parse_score",
    "retry_after_s",
]

#: Judge text kept in ``RewardResult.info`` (enough to audit a score, small on the wire).
MAX_INFO_CHARS = 2000

#: The jitter on a server's ``Retry-After``: up to this share of it more, at most this long.
_JITTER_SHARE = 0.2
_JITTER_MAX_S = 1.0

#: Calls one worker runs at once (the reward's ``max_concurrency`` and ``max_batch``).
_CALLS_AT_ONCE = 64

_PLACEHOLDER = re.compile(r"\{(question|reference|response|min_score|max_score|nonce)\}")


def _delimit(response: str, *others: str) -> str:
    """``response`` between ``<response-NONCE>`` tags, the nonce random per call: the response
    is the policy's text, and one that knew the closing tag could close it and write to the
    judge as the rubric. A nonce found in the response (or the rest of the prompt) is drawn
    again, so the closing tag appears once, where it is put."""
    while True:
        tag = f"response-{token_hex(8)}"
        if not any(tag in text for text in (response, *others)):
            return f"<{tag}>\n{response}\n</{tag}>"


# ----------------------------------------------------------------------------- the judge


async def _closes_with_loop(client: httpx.AsyncClient) -> AsyncGenerator[None, None]:
    # kept suspended for the life of its event loop: loop runners (asyncio.run, pytest) close
    # pending async generators at shutdown, which closes the client while its loop still runs
    try:
        yield
    finally:
        await client.aclose()


class Judge:
    """A configured judge: rate limiter and HTTP clients, shared by the calls of one worker.

    An ``httpx.AsyncClient`` belongs to one event loop, so there is one per loop, made on
    first use (a worker has one loop; ``asyncio.run`` callers get a fresh one each time). Use
    ``async with Judge(...)`` or ``aclose()``; a client still open when its loop shuts down is
    closed then.
    ``clock`` and ``sleep`` are injectable so tests can check waits without waiting, and ``rng``
    (the jitter on a ``Retry-After``) so they can seed it."""

    def __init__(
        self,
        config: JudgeConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
    ):
        self.config = config
        self._rng = rng if rng is not None else random.Random()
        self.limiter = RateLimiter(config.requests_per_minute, config.tokens_per_minute, clock)
        self._clock = clock
        self._sleep = sleep
        self._clients: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[httpx.AsyncClient, AsyncGenerator[None, None]]
        ] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self.url = config.base_url.rstrip("/") + "/chat/completions"

    async def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._clients.get(loop)
        if entry is not None:
            return entry[0]
        key = self.config.api_key
        client = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {key.get_secret_value()}"} if key else {},
            timeout=httpx.Timeout(self.config.timeout_s),
            # as many idle connections kept as calls run at once: httpx keeps 20 by default, so
            # each burst of calls reopened the rest (a TCP and a TLS handshake each, on a remote
            # API); max_connections stays httpx's default
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=_CALLS_AT_ONCE),
        )
        closer = _closes_with_loop(client)
        await closer.__anext__()
        with self._lock:
            self._clients[loop] = (client, closer)
        return client

    async def __aenter__(self) -> Judge:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close this event loop's client (others close with their loops)."""
        with self._lock:
            entry = self._clients.pop(asyncio.get_running_loop(), None)
        if entry is not None:
            await entry[1].aclose()

    async def score(
        self,
        response: str,
        *,
        question: str = "",
        reference: str | None = None,
        rubric: str | None = None,
        time_limit_s: float | None = None,
    ) -> RewardResult:
        """Grade ``response``; the score is normalised to [0, 1]. ``time_limit_s`` bounds the
        whole call, retries and waits included (``llm_judge`` passes what its run has left):
        the judge gives up with ``Unavailable`` a little before it."""
        cfg = self.config
        deadline = None if time_limit_s is None else self._clock() + time_limit_s
        template = cfg.rubric if rubric is None else rubric
        if "{response}" not in template:
            # a rubric given with the call (a reward's args, a task's) is only checked here; it
            # is the job's config, not the response: every call with it fails alike
            raise JudgeMisconfigured(
                "the rubric must contain {response}, or the judge never sees the answer; fix the "
                "rubric argument (or RL_FABRIC_JUDGE_RUBRIC)"
            )
        others = (template, question, reference or "")
        # the verdict line's nonce: never in the response (drawn again), so no copy of the
        # response can carry the judge's verdict line
        nonce = verdict_nonce()
        while any(nonce in text.lower() for text in (response, *others)):
            nonce = verdict_nonce()
        fill = {
            "question": question or "(not given)",
            "reference": reference if reference else "(none)",
            "response": _delimit(response, *others),
            "min_score": f"{cfg.min_score:g}",
            "max_score": f"{cfg.max_score:g}",
            "nonce": nonce,
        }
        # only the known placeholders: a rubric may show JSON with literal braces
        prompt = _PLACEHOLDER.sub(lambda m: fill[m.group(1)], template)
        body = {
            "model": cfg.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": cfg.temperature,
            cfg.reply_limit_field: cfg.max_tokens,
            **cfg.extra_body,
        }
        tokens = estimate_tokens(prompt, cfg.max_tokens)
        if cfg.tokens_per_minute is not None and tokens > cfg.tokens_per_minute:
            # max_tokens is below the budget (the config checks), so it is the prompt that does
            # not fit, and the response is its part that varies: a runaway completion
            raise ValueError(
                f"this request needs ~{tokens} tokens, more than tokens_per_minute="
                f"{cfg.tokens_per_minute:g} allows at all; the response ({len(response)} characters) "
                f"is {100 * len(response) // len(prompt)}% of the prompt: if it is a runaway "
                "completion, cap the policy's output length; else raise tokens_per_minute if the "
                "provider allows"
            )
        data, attempts = await self._complete(body, tokens, deadline)
        text = reply_text(data, self.url)
        raw = parse_score(
            text,
            cfg.min_score,
            cfg.max_score,
            rubric=template,
            nonce=nonce if "{nonce}" in template else None,
            response=response,
        )
        return RewardResult(
            score=(raw - cfg.min_score) / (cfg.max_score - cfg.min_score),
            components={"raw_score": raw},
            info={
                "model": data.get("model", cfg.model),
                "judgement": text[-MAX_INFO_CHARS:],
                "usage": data.get("usage"),
                "attempts": attempts,
            },
        )

    async def _complete(
        self, body: dict[str, Any], tokens: int, deadline: float | None
    ) -> tuple[dict[str, Any], int]:
        cfg = self.config
        started = self._clock()
        # kept back from the deadline: the time to return the judge's own error before the
        # run's limit cuts it off (a twentieth of the time, from 0.25 s up to a second, at most a
        # quarter of a short limit); a retry is only made with at least as long again for its
        # attempt
        budget = 0.0 if deadline is None else deadline - started
        reserve = min(1.0, max(0.25, 0.05 * budget), 0.25 * budget)
        # full jitter, as the fabric client's own retries: spread retries of many calls apart
        backoff = wait_random_exponential(multiplier=cfg.backoff_s, max=cfg.max_backoff_s)
        why_stopped = [""]  # what the stop below decided, for the error

        def wait(state: RetryCallState) -> float:
            exc = state.outcome.exception() if state.outcome else None
            if isinstance(exc, _Transient) and exc.retry_after is not None:
                # the server knows when it will have room; the calls it told so at once (a burst
                # over its rate limit) would all come back at that same instant and meet the
                # limit again: each waits a little more, never less than it was told
                after = exc.retry_after
                return after + self._rng.uniform(0.0, min(_JITTER_SHARE * after, _JITTER_MAX_S))
            return float(backoff(state))

        def past_deadline(state: RetryCallState) -> bool:
            # tenacity computes the wait before it asks to stop: a retry whose pause would
            # pass the call's time limit is not waited out
            if deadline is None:
                return False
            pause = state.upcoming_sleep
            if self._clock() + pause + reserve < deadline - reserve:
                return False
            exc = state.outcome.exception() if state.outcome else None
            asked = exc.retry_after if isinstance(exc, _Transient) else None
            # the server's Retry-After, as it said it (the pause adds the jitter)
            what = f"its retry after {asked:g} s" if asked is not None else "a retry"
            left_now = max(0.0, deadline - self._clock())
            why_stopped[0] = f"; {what} would pass the call's time limit ({left_now:.1f} s left)"
            return True

        async def attempt() -> dict[str, Any]:
            left = None if deadline is None else deadline - reserve - self._clock()
            return await self._attempt(body, tokens, left)

        if deadline is not None and deadline - reserve - started <= 0:
            raise self._unavailable(started, 0, None, "; no time was left before the call's time limit")
        retrying = AsyncRetrying(
            stop=lambda state: state.attempt_number > cfg.max_retries or past_deadline(state),
            wait=wait,
            retry=retry_if_exception_type(_Transient),
            sleep=self._sleep,
            reraise=True,
        )
        try:
            data: dict[str, Any] = await retrying(attempt)
        except _Transient as e:
            n = int(retrying.statistics.get("attempt_number", 1))
            raise self._unavailable(started, n, e, why_stopped[0]) from None
        return data, int(retrying.statistics.get("attempt_number", 1))

    def _unavailable(self, started: float, attempts: int, last: _Transient | None, why: str) -> Unavailable:
        took = self._clock() - started
        tried = f"{self.url} failed {attempts} attempt{'s' if attempts != 1 else ''}{why}"
        if last is None:
            return Unavailable(f"llm_judge: the judge was unavailable for {took:.1f} s: {tried}")
        return Unavailable(
            f"llm_judge: the judge was unavailable for {took:.1f} s: {tried}; last: {last}. {last.hint}"
        )

    async def _attempt(self, body: dict[str, Any], tokens: int, left: float | None) -> dict[str, Any]:
        """One request; ``left``: the seconds the call has left (``None``: no limit), which
        bound the rate limiter's wait and the request's own timeout."""
        cfg = self.config
        if left is None or cfg.max_wait_s <= left:
            wait = self.limiter.reserve(tokens, cfg.max_wait_s)
        else:  # the call's time limit is the nearer bound: the error names it, not max_wait_s
            wait = self.limiter.reserve(tokens, left, f"the {left:.1f} s the call's time limit leaves")
        if wait > 0:
            await self._sleep(wait)
            left = None if left is None else left - wait
        limit = cfg.timeout_s if left is None else max(0.0, min(cfg.timeout_s, left))
        client = await self._client()
        try:
            # httpx's timeout is per read; this one bounds the whole attempt (a trickling server)
            async with asyncio.timeout(limit):
                resp = await client.post(self.url, json=body)
        except (TimeoutError, httpx.TimeoutException):
            self.limiter.settle(tokens, 0)  # no completion: the request counts, its tokens do not
            within = (
                f"timeout_s={cfg.timeout_s:g} s"
                if limit == cfg.timeout_s
                else f"{limit:.1f} s (what the call's time limit left)"
            )
            raise _Transient(
                f"no answer within {within}",
                f"Raise {ENV_PREFIX}TIMEOUT_S if the model is slow, or check the server.",
            ) from None
        except httpx.UnsupportedProtocol as e:
            self.limiter.settle(tokens, 0)
            raise JudgeMisconfigured(
                f"bad base_url {cfg.base_url!r}: {e}; set {ENV_PREFIX}BASE_URL to the API root (http://.../v1)"
            ) from None
        except httpx.TransportError as e:
            self.limiter.settle(tokens, 0)
            raise _Transient(
                f"{type(e).__name__}: {e or 'connection failed'}",
                f"Is the server up at {ENV_PREFIX}BASE_URL={cfg.base_url}?",
            ) from None
        status = resp.status_code
        code = _error_code(resp) if status in (400, 429) else ""
        if status == 429 and code == _NO_QUOTA:
            # the account is out of credit: retried, each call spent its time limit on it and
            # then failed retryable, which a failure_score scored for every trajectory alike
            self.limiter.settle(tokens, 0)
            raise JudgeMisconfigured(
                f"{self.url} refused the request (HTTP 429 {code}: {error_message(resp)}); the "
                "account has no quota left: check its plan and billing, or use another key"
            )
        if status == 408 or status == 429 or status >= 500:
            self.limiter.settle(tokens, 0)
            after = retry_after_s(resp.headers) if status in (429, 503) else None
            if after is not None and after > cfg.max_retry_after_s:
                raise Unavailable(
                    f"llm_judge: {self.url} answered {status} and asks to retry after {after:g} s, "
                    f"over max_retry_after_s={cfg.max_retry_after_s:g}; the call can be retried later"
                )
            hint = (
                f"The endpoint is over its limits: set {ENV_PREFIX}REQUESTS_PER_MINUTE / "
                f"{ENV_PREFIX}TOKENS_PER_MINUTE below them."
                if status == 429
                else "The endpoint is failing; the call is retryable."
            )
            raise _Transient(f"HTTP {status}: {error_message(resp)}", hint, after)
        if 300 <= status < 400:
            # http:// to https://, a moved path: the same for every request (its body, no chat
            # completion, failed each call as the response's unreadable reply). Not followed: a
            # 301/302 makes the POST a GET, and the key would go where the server says
            self.limiter.settle(tokens, 0)
            where = resp.headers.get("location") or "(no Location header)"
            raise JudgeMisconfigured(
                f"{self.url} answered HTTP {status}: it redirects to {where}; set "
                f"{ENV_PREFIX}BASE_URL to the API root there (redirects are not followed)"
            )
        if status >= 400:
            self.limiter.settle(tokens, 0)  # refused: nothing was generated, so nothing is charged
            hint = _REJECT_HINTS.get(status, "check the model name and extra_body options")
            # 401/403/404: the key, the model or the URL, the same for every response; another
            # 4xx may be this request's own (a response past the model's context)
            refused = JudgeMisconfigured if status in _MISCONFIGURED_STATUSES else JudgeRejectedError
            if status == 400 and code in _UNSUPPORTED_SETTING:
                # a setting the model does not take (OpenAI's reasoning models: max_tokens,
                # temperature 0): in every request, so the judge's setup, not this response
                refused = JudgeMisconfigured
                hint = (
                    f"the model does not take a setting the judge sends: for an OpenAI reasoning "
                    f"model set {ENV_PREFIX}TEMPERATURE=1 and {ENV_PREFIX}MAX_TOKENS_FIELD="
                    f"max_completion_tokens, or drop the option from {ENV_PREFIX}EXTRA_BODY"
                )
            raise refused(f"{self.url} refused the request (HTTP {status}: {error_message(resp)}); {hint}")
        try:
            data = resp.json()
        except ValueError:
            kind = resp.headers.get("content-type", "no content type")
            if is_web_page(resp):
                # a base_url that points at a web UI or a login page (its index answers every
                # path 200): every request gets the page, whatever the response, and as the
                # response's unreadable reply a failure_score scored every trajectory alike
                self.limiter.settle(tokens, 0)
                raise JudgeMisconfigured(
                    f"{self.url} answered {status} with a web page ({kind}), not a chat completion: "
                    f"{excerpt(resp.text, 100)}; set {ENV_PREFIX}BASE_URL to the OpenAI-compatible "
                    "API root (ending in /v1)"
                ) from None
            raise JudgeResponseError(
                f"{self.url} answered {status} with a body that is not JSON "
                f"({kind}): {excerpt(resp.text)}; "
                f"is {ENV_PREFIX}BASE_URL the OpenAI-compatible API root (ending in /v1)?"
            ) from None
        if not isinstance(data, dict):
            raise JudgeResponseError(f"{self.url} answered JSON that is not an object: {excerpt(resp.text)}")
        usage = data.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("total_tokens"), int):
            self.limiter.settle(tokens, usage["total_tokens"])
        reason = _finish_reason(data)
        if reason in _ABORTED:
            # the server stopped the request, not the judge (vLLM: its engine shut down, paused
            # for sleep mode or a weight update, scaled down) and still answered 200: the text
            # stops anywhere, in the verdict too, so it is no verdict; another attempt may finish
            raise _Transient(
                f"the server aborted the reply (finish_reason {reason!r}) before it ended",
                "The server stopped the request (shut down, paused, scaled down); the call is retryable.",
            )
        return data


# ----------------------------------------------------------------------------- the reward


def judge_from_env() -> Judge:
    """Setup hook: one judge per worker, configured from the environment."""
    return Judge(JudgeConfig.from_env())


_shared: dict[tuple[tuple[str, str], ...], Judge] = {}
_CONFIG_VARS = ("OPENAI_BASE_URL", "OPENAI_API_KEY")


def _shared_judge() -> Judge:
    # direct in-process calls (no setup hook ran) share a judge per environment, so its rate
    # limits hold across calls; a changed environment gets its own
    key = tuple(
        sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIX) or k in _CONFIG_VARS)
    )
    judge = _shared.get(key)
    if judge is None:
        try:
            judge = _shared[key] = judge_from_env()
        except ConfigError as e:
            # no setup hook ran (a direct call, a composite's component): the config error is
            # the call's, and it is the setup's fault, not the response's
            raise JudgeMisconfigured(f"llm_judge: {e}") from None
    return judge


def _question(traj: Trajectory) -> str:
    """The user turn the policy's answer answers: the last one before the policy's first turn.
    That turn is the first assistant turn with a policy version (an episode of the core job,
    whose later user turns are observations, not the task), else the final assistant turn (a
    trainer's chat prompt: its last user turn is the question, an earlier one may be a few-shot
    example's, whose answer, in the policy's prompt, would be graded as correct for it)."""
    msgs = traj.messages
    versioned = (i for i, m in enumerate(msgs) if m.role == "assistant" and m.policy_version is not None)
    final = next((i for i in range(len(msgs) - 1, -1, -1) if msgs[i].role == "assistant"), len(msgs))
    first = next(versioned, final)
    return next((m.content for m in reversed(msgs[:first]) if m.role == "user" and m.content), "")


_EXAMPLE_TRAJ = {
    "messages": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris.", "policy_version": 0},
    ],
    "task": {"reference": "Paris"},
}


@fabric.reward(
    setup=judge_from_env,
    timeout_s=300,
    warm=1,
    # the judge retries the endpoint itself (with Retry-After); the client only retries once
    # more, for a lost worker, so attempts do not multiply into minutes on a dead endpoint
    retry={"max_attempts": 2},
    # every call is a paid request, and a judge's slow tail is where hedges would fire
    hedge=False,
    max_concurrency=_CALLS_AT_ONCE,
    max_batch=_CALLS_AT_ONCE,
    examples=(
        {"traj": _EXAMPLE_TRAJ},
        {
            "traj": "def add(a, b):\n    return a + b",
            "question": "Write a Python function add(a, b) that returns the sum.",
            "rubric": "Rate this code from {min_score} to {max_score}.\n{question}\n{response}\nScore:",
        },
    ),
)
async def llm_judge(
    traj: Trajectory | str,
    *,
    question: str | None = None,
    reference: str | None = None,
    rubric: str | None = None,
    ctx: Any = None,
) -> RewardResult:
    """A model grades the final answer against a rubric; score in [0, 1], the judge's own
    score in ``components["raw_score"]`` and its text in ``info["judgement"]``.

    ``question`` defaults to the user message the answer answers (the last one before the
    policy's first turn: see ``_question``), ``reference`` to ``task["reference"]``
    (or ``task["ground_truth"]``), ``rubric`` to the configured template."""
    judge: Judge = ctx if isinstance(ctx, Judge) else _shared_judge()
    if isinstance(traj, str):
        response, q, ref = traj, question or "", reference
    else:
        response = traj.final_text()
        q = question if question is not None else _question(traj)
        task_ref = traj.task.get("reference", traj.task.get("ground_truth"))
        ref = reference if reference is not None else (None if task_ref is None else str(task_ref))
    # what the run has left (its timeout_s, or the call's deadline): the judge's retries stop
    # within it, so a dead endpoint is the judge's Unavailable, not the run's bare timeout
    return await judge.score(response, question=q, reference=ref, rubric=rubric, time_limit_s=time_left_s())
