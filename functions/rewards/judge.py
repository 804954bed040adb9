"""``llm_judge``: a model grades the response against a rubric, through any OpenAI-compatible
chat endpoint (OpenAI, vLLM, SGLang, a gateway).

Configuration is a ``JudgeConfig``; the reward reads it from the environment once per worker
(its setup hook): every field can be set as ``RL_FABRIC_JUDGE_<FIELD>`` (for example
``RL_FABRIC_JUDGE_MODEL``, ``RL_FABRIC_JUDGE_TIMEOUT_S``,
``RL_FABRIC_JUDGE_REQUESTS_PER_MINUTE``), and the endpoint and key fall back to the OpenAI
SDK's ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``.

How a call goes:

* the rubric is filled in (``{question}``, ``{reference}``, ``{response}``, ``{min_score}``,
  ``{max_score}``) and sent as one user message, temperature 0;
* a token bucket per worker holds requests under ``requests_per_minute`` and
  ``tokens_per_minute`` (a request is charged ``chars / 4 + max_tokens`` up front, the
  ``usage`` of the reply settles the difference);
* 408, 429, 5xx, timeouts and network errors are retried with exponential backoff and
  jitter, or after the server's ``Retry-After``; other 4xx fail at once;
* the score is parsed from the reply (``Score: 7/10``, ``**8**``, ``{"score": 8}``,
  ``<score>3</score>``, else a number on the reply's last line) and normalised to [0, 1].

Failures are results, never fake scores: an endpoint that stays overloaded, failing or silent
raises ``Unavailable`` (retryable; the fabric may try the call again), and a reply that cannot
be read as a score raises ``JudgeResponseError`` (final: the same reply would fail again).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt
from tenacity.wait import wait_random_exponential

import fabric
from fabric.errors import ConfigError, Unavailable
from fabric.protocol import RewardResult, Trajectory

ENV_PREFIX = "RL_FABRIC_JUDGE_"
OPENAI_URL = "https://api.openai.com/v1"
#: Judge text kept in ``RewardResult.info`` (enough to audit a score, small on the wire).
MAX_INFO_CHARS = 2000

DEFAULT_RUBRIC = """\
You are a strict, fair grader. Grade the RESPONSE to the QUESTION for correctness, \
completeness and clarity. If a REFERENCE answer is given, a response that contradicts it is wrong.

QUESTION:
{question}

REFERENCE:
{reference}

RESPONSE:
{response}

Explain your judgement in a few sentences, then end with one line of the form \
"Score: N/{max_score}", where N is a whole number from {min_score} (worst) to {max_score} (best)."""

_PLACEHOLDER = re.compile(r"\{(question|reference|response|min_score|max_score)\}")


class JudgeError(Exception):
    """The judge answered, but not with something usable (a final error: not retried)."""


class JudgeResponseError(JudgeError):
    """The reply is not a chat completion, or holds no score in the rubric's range."""


class JudgeRejectedError(JudgeError):
    """The endpoint refused the request (a 4xx other than 408/429): fix the config."""


# ----------------------------------------------------------------------------- config


class JudgeConfig(BaseModel):
    """Where the judge is and how to use it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1)
    """Model name as the endpoint knows it (``gpt-4o-mini``, ``Qwen/Qwen2.5-72B-Instruct``)."""
    base_url: str = OPENAI_URL
    """API root, ending in ``/v1``; ``/chat/completions`` is appended."""
    api_key: SecretStr | None = None
    """Sent as ``Authorization: Bearer``; local servers often need none."""
    rubric: str = DEFAULT_RUBRIC
    """Prompt template; must contain ``{response}``."""
    min_score: float = 0.0
    max_score: float = 10.0
    """The rubric's scale; parsed scores are normalised from it to [0, 1]."""
    temperature: float = Field(0.0, ge=0)
    max_tokens: int = Field(512, ge=1)
    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Merged into every request body (``{"seed": 0}``, vendor options)."""
    timeout_s: float = Field(60.0, gt=0)
    """Limit on each attempt, connection to last byte."""
    max_retries: int = Field(3, ge=0, le=10)
    """Retries after the first attempt, for 408/429/5xx, timeouts and network errors."""
    backoff_s: float = Field(0.5, gt=0)
    """Backoff scale: retry n waits a random time up to ``backoff_s * 2**(n-1)`` (full jitter)."""
    max_backoff_s: float = Field(30.0, gt=0)
    max_retry_after_s: float = Field(60.0, gt=0)
    """A ``Retry-After`` longer than this is not waited out: the call fails (retryable) now."""
    requests_per_minute: float | None = Field(None, gt=0)
    """Cap on requests sent by one worker (``None``: no cap). Set it below the provider's limit."""
    tokens_per_minute: float | None = Field(None, gt=0)
    """Cap on tokens (prompt + completion) by one worker (``None``: no cap)."""
    max_wait_s: float = Field(120.0, ge=0)
    """Longest a call waits for the rate limiter before failing (retryable)."""

    @model_validator(mode="after")
    def _check(self) -> JudgeConfig:
        if self.max_score <= self.min_score:
            raise ValueError(f"max_score ({self.max_score:g}) must be above min_score ({self.min_score:g})")
        if "{response}" not in self.rubric:
            raise ValueError("the rubric must contain {response}, or the judge never sees the answer")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if self.api_key is None and self.base_url.rstrip("/") == OPENAI_URL:
            raise ValueError(
                f"the OpenAI API needs a key: set OPENAI_API_KEY or {ENV_PREFIX}API_KEY "
                f"(or point {ENV_PREFIX}BASE_URL at your own server)"
            )
        return self

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> JudgeConfig:
        """The config from ``RL_FABRIC_JUDGE_*`` (then ``OPENAI_*``) variables and ``overrides``;
        ``ConfigError`` naming the variables when it is incomplete or invalid."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is None or raw == "":
                continue
            try:
                values[name] = json.loads(raw) if name == "extra_body" else raw
            except ValueError as e:
                raise ConfigError(f"{ENV_PREFIX}EXTRA_BODY must be a JSON object: {e}") from None
        for name, fallback in (("base_url", "OPENAI_BASE_URL"), ("api_key", "OPENAI_API_KEY")):
            if name not in values and env.get(fallback):
                values[name] = env[fallback]
        values.update(overrides)
        if not values.get("model"):
            raise ConfigError(
                f"llm_judge needs a model: set {ENV_PREFIX}MODEL (e.g. gpt-4o-mini) "
                "or pass JudgeConfig(model=...)"
            )
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            problems = "; ".join(
                f"{ENV_PREFIX}{'.'.join(map(str, err['loc'])).upper() or '*'}: {err['msg']}"
                for err in e.errors(include_url=False)
            )
            raise ConfigError(f"bad llm_judge config: {problems}") from None


# ----------------------------------------------------------------------------- rate limits


class TokenBucket:
    """``per_minute`` units a minute, bursting up to one minute's worth. Reservations may take
    the level below zero: each caller learns how long to wait, so waiters queue in order."""

    def __init__(self, per_minute: float, now: float):
        self.capacity = per_minute
        self.rate = per_minute / 60.0
        self.level = per_minute
        self.last = now

    def reserve(self, cost: float, now: float) -> float:
        """Take ``cost`` and return the seconds until it is covered."""
        self.level = min(self.capacity, self.level + (now - self.last) * self.rate)
        self.last = now
        self.level -= cost
        return 0.0 if self.level >= 0 else -self.level / self.rate

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


class RateLimiter:
    """Requests-per-minute and tokens-per-minute buckets of one worker. Thread-safe (sync
    functions run in threads on some backends); waiting is the caller's, so it never blocks
    an event loop."""

    def __init__(
        self,
        requests_per_minute: float | None,
        tokens_per_minute: float | None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.clock = clock
        now = clock()
        self.requests = TokenBucket(requests_per_minute, now) if requests_per_minute else None
        self.tokens = TokenBucket(tokens_per_minute, now) if tokens_per_minute else None
        self._lock = threading.Lock()

    def reserve(self, tokens: int, max_wait_s: float = float("inf")) -> float:
        """Reserve one request of ``tokens`` and return how long to wait before sending it;
        ``Unavailable`` (nothing reserved) when that is over ``max_wait_s``."""
        if self.tokens is not None and tokens > self.tokens.capacity:
            raise ValueError(
                f"one request needs ~{tokens} tokens, more than tokens_per_minute="
                f"{self.tokens.capacity:g}: raise tokens_per_minute or lower max_tokens"
            )
        with self._lock:
            now = self.clock()
            wait_r = self.requests.reserve(1, now) if self.requests else 0.0
            wait_t = self.tokens.reserve(tokens, now) if self.tokens else 0.0
            wait = max(wait_r, wait_t)
            if wait > max_wait_s:
                if self.requests:
                    self.requests.give_back(1)
                if self.tokens:
                    self.tokens.give_back(tokens)
        if wait > max_wait_s:
            raise Unavailable(
                f"llm_judge is rate limited: the next request slot is {wait:.1f} s away, over "
                f"max_wait_s={max_wait_s:g} (requests_per_minute, tokens_per_minute bound one worker); "
                "send fewer concurrent calls or raise the limits if the provider allows"
            )
        return wait

    def settle(self, estimated: int, actual: int) -> None:
        """Correct a reservation with the tokens the reply says were used."""
        if self.tokens is not None:
            with self._lock:
                self.tokens.give_back(estimated - actual)


def estimate_tokens(prompt: str, max_tokens: int) -> int:
    """Upper-ish estimate of a request's tokens before sending it: ~4 characters a token
    (English BPE) for the prompt, plus the most the reply may use (providers charge that)."""
    return len(prompt) // 4 + 1 + max_tokens


# ----------------------------------------------------------------------------- score parsing

_NUM = r"[-+]?\d+(?:\.\d+)?"
_OF = rf"\s*(?:/|out\s+of)\s*({_NUM})"
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL | re.IGNORECASE)
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")
_JSON_OBJ = re.compile(r"\{[^{}]*\}")
_TAG = re.compile(rf"<score>\s*({_NUM})(?:{_OF})?\s*</score>", re.IGNORECASE)
_LABEL = re.compile(
    rf"\b(?:score|rating|grade)\b[\s*_:=]*(?:is|of)?[\s*:=]*({_NUM})(\s*%)?\**(?:{_OF})?", re.IGNORECASE
)
_BOLD = re.compile(rf"\*\*\s*({_NUM})(?:{_OF})?\s*\*\*")
_LAST = re.compile(rf"({_NUM})(\s*%)?(?:{_OF})?")
_SCORE_KEYS = ("score", "rating", "grade")


def _on_scale(num: str, percent: str | None, den: str | None, lo: float, hi: float) -> float:
    """A matched number on the rubric's scale: ``8/10`` on a 0-10 rubric is 8; ``4/5`` on it
    is 8 (a fraction of the range); ``80%`` likewise."""
    n = float(num)
    if percent:
        return lo + n / 100 * (hi - lo)
    if den is None or float(den) == hi:
        return n
    if float(den) <= 0:
        raise JudgeResponseError(f"score {num}/{den} has a zero or negative denominator")
    return lo + n / float(den) * (hi - lo)


def _json_score(text: str, lo: float, hi: float) -> float | None:
    candidates = [_FENCE.sub("", text.strip()), *_JSON_OBJ.findall(text)[::-1]]
    for cand in candidates:
        try:
            obj = json.loads(cand)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        for key in _SCORE_KEYS:
            value = obj.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
            if isinstance(value, str):
                return parse_score(value, lo, hi)
    return None


def parse_score(text: str, lo: float = 0.0, hi: float = 10.0) -> float:
    """The score a judge gave, on the rubric's ``[lo, hi]`` scale. Looks for, in order: a JSON
    object with a ``score``, ``<score>N</score>``, a labelled ``Score: N`` (``/M``, ``out of M``,
    ``%``), a bold ``**N**``, and last the last number of the last line; the last match of a
    kind wins (a verdict follows its reasoning). ``JudgeResponseError`` when there is none or
    it is out of range."""
    body = _THINK.sub("", text)  # a reasoning model's scratch work is not its verdict
    raw = _json_score(body, lo, hi)
    lines = body.strip().splitlines()
    # an unlabelled number is trusted only on the last line: earlier ones are reasoning ("2 + 2")
    last_line = lines[-1] if lines else ""
    if raw is None:
        for pattern in (_TAG, _LABEL, _BOLD, _LAST):
            matches = pattern.findall(last_line if pattern is _LAST else body)
            if matches:
                m = matches[-1]
                if pattern is _TAG or pattern is _BOLD:
                    raw = _on_scale(m[0], None, m[1] or None, lo, hi)
                else:
                    raw = _on_scale(m[0], m[1].strip() or None, m[2] or None, lo, hi)
                break
    if raw is None:
        raise JudgeResponseError(
            f"no score in the judge's reply {_excerpt(text)}; make the rubric ask for a final "
            f'line "Score: N/{hi:g}" (or check that the model follows instructions)'
        )
    if not lo <= raw <= hi:
        raise JudgeResponseError(
            f"the judge's score {raw:g} is outside the rubric's range [{lo:g}, {hi:g}] "
            f"(reply {_excerpt(text)}); check min_score/max_score against the rubric"
        )
    return raw


def _excerpt(text: str, n: int = 200) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


# ----------------------------------------------------------------------------- the judge


class _Transient(Exception):
    """An attempt that may succeed if repeated (status 408/429/5xx, timeout, network)."""

    def __init__(self, message: str, hint: str, retry_after: float | None = None):
        super().__init__(message)
        self.hint = hint
        self.retry_after = retry_after


def retry_after_s(headers: httpx.Headers) -> float | None:
    """Seconds the server asked us to wait: ``retry-after-ms`` (OpenAI), ``Retry-After`` as
    seconds or as an HTTP date; ``None`` when absent or unreadable."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(float(ms) / 1000, 0.0)
        except ValueError:
            pass  # not milliseconds: try the standard header
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass  # not seconds: an HTTP date, below
    try:
        return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError):
        return None


def _error_message(resp: httpx.Response) -> str:
    try:
        err = resp.json().get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    except (ValueError, AttributeError):
        pass  # not OpenAI's error JSON: show the body itself
    return _excerpt(resp.text)


_REJECT_HINTS = {
    401: f"check the API key (OPENAI_API_KEY or {ENV_PREFIX}API_KEY)",
    403: "the key is not allowed to use this model or endpoint",
    404: f"check base_url ({ENV_PREFIX}BASE_URL, the API root ending in /v1) and the model name",
}


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
    ``clock`` and ``sleep`` are injectable so tests can check waits without waiting."""

    def __init__(
        self,
        config: JudgeConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self.config = config
        self.limiter = RateLimiter(config.requests_per_minute, config.tokens_per_minute, clock)
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
        self, response: str, *, question: str = "", reference: str | None = None, rubric: str | None = None
    ) -> RewardResult:
        """Grade ``response``; the score is normalised to [0, 1]."""
        cfg = self.config
        template = cfg.rubric if rubric is None else rubric
        if "{response}" not in template:
            raise ValueError("the rubric must contain {response}, or the judge never sees the answer")
        fill = {
            "question": question or "(not given)",
            "reference": reference if reference else "(none)",
            "response": response,
            "min_score": f"{cfg.min_score:g}",
            "max_score": f"{cfg.max_score:g}",
        }
        # only the known placeholders: a rubric may show JSON with literal braces
        prompt = _PLACEHOLDER.sub(lambda m: fill[m.group(1)], template)
        body = {
            "model": cfg.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": cfg.temperature,
            "max_tokens": cfg.max_tokens,
            **cfg.extra_body,
        }
        data, attempts = await self._complete(body, estimate_tokens(prompt, cfg.max_tokens))
        text = self._text(data)
        raw = parse_score(text, cfg.min_score, cfg.max_score)
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

    async def _complete(self, body: dict[str, Any], tokens: int) -> tuple[dict[str, Any], int]:
        cfg = self.config
        # full jitter, as the fabric client's own retries: spread retries of many calls apart
        backoff = wait_random_exponential(multiplier=cfg.backoff_s, max=cfg.max_backoff_s)

        def wait(state: RetryCallState) -> float:
            exc = state.outcome.exception() if state.outcome else None
            if isinstance(exc, _Transient) and exc.retry_after is not None:
                return exc.retry_after  # the server knows when it will have room
            return float(backoff(state))

        retrying = AsyncRetrying(
            stop=stop_after_attempt(cfg.max_retries + 1),
            wait=wait,
            retry=retry_if_exception_type(_Transient),
            sleep=self._sleep,
            reraise=True,
        )
        try:
            data: dict[str, Any] = await retrying(self._attempt, body, tokens)
        except _Transient as e:
            n = cfg.max_retries + 1
            raise Unavailable(
                f"llm_judge: {self.url} failed {n} attempt{'s' if n > 1 else ''}; last: {e}. {e.hint}"
            ) from None
        return data, int(retrying.statistics.get("attempt_number", 1))

    async def _attempt(self, body: dict[str, Any], tokens: int) -> dict[str, Any]:
        cfg = self.config
        wait = self.limiter.reserve(tokens, cfg.max_wait_s)
        if wait > 0:
            await self._sleep(wait)
        client = await self._client()
        try:
            # httpx's timeout is per read; this one bounds the whole attempt (a trickling server)
            async with asyncio.timeout(cfg.timeout_s):
                resp = await client.post(self.url, json=body)
        except (TimeoutError, httpx.TimeoutException):
            self.limiter.settle(tokens, 0)  # no completion: the request counts, its tokens do not
            raise _Transient(
                f"no answer within timeout_s={cfg.timeout_s:g} s",
                f"Raise {ENV_PREFIX}TIMEOUT_S if the model is slow, or check the server.",
            ) from None
        except httpx.UnsupportedProtocol as e:
            raise JudgeRejectedError(f"bad base_url {cfg.base_url!r}: {e}") from None
        except httpx.TransportError as e:
            self.limiter.settle(tokens, 0)
            raise _Transient(
                f"{type(e).__name__}: {e or 'connection failed'}",
                f"Is the server up at {ENV_PREFIX}BASE_URL={cfg.base_url}?",
            ) from None
        status = resp.status_code
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
            raise _Transient(f"HTTP {status}: {_error_message(resp)}", hint, after)
        if status >= 400:
            hint = _REJECT_HINTS.get(status, "check the model name and extra_body options")
            raise JudgeRejectedError(
                f"{self.url} refused the request (HTTP {status}: {_error_message(resp)}); {hint}"
            )
        try:
            data = resp.json()
        except ValueError:
            raise JudgeResponseError(
                f"{self.url} answered {status} with a body that is not JSON "
                f"({resp.headers.get('content-type', 'no content type')}): {_excerpt(resp.text)}; "
                f"is {ENV_PREFIX}BASE_URL the OpenAI-compatible API root (ending in /v1)?"
            ) from None
        if not isinstance(data, dict):
            raise JudgeResponseError(f"{self.url} answered JSON that is not an object: {_excerpt(resp.text)}")
        usage = data.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("total_tokens"), int):
            self.limiter.settle(tokens, usage["total_tokens"])
        return data

    def _text(self, data: dict[str, Any]) -> str:
        try:
            choice = data["choices"][0]
            text = choice["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise JudgeResponseError(
                f"{self.url} answered JSON that is not a chat completion (no choices[0].message.content): "
                f"{_excerpt(json.dumps(data))}"
            ) from None
        if not isinstance(text, str) or not text.strip():
            reason = choice.get("finish_reason") if isinstance(choice, dict) else None
            more = " (it ran out of tokens: raise max_tokens)" if reason == "length" else ""
            raise JudgeResponseError(f"the judge returned no text, finish_reason={reason!r}{more}")
        return text


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
        judge = _shared[key] = judge_from_env()
    return judge


def _first_user_text(traj: Trajectory) -> str:
    return next((m.content for m in traj.messages if m.role == "user" and m.content), "")


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
    max_concurrency=64,
    max_batch=64,
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

    ``question`` defaults to the first user message, ``reference`` to ``task["reference"]``
    (or ``task["ground_truth"]``), ``rubric`` to the configured template."""
    judge: Judge = ctx if isinstance(ctx, Judge) else _shared_judge()
    if isinstance(traj, str):
        response, q, ref = traj, question or "", reference
    else:
        response = traj.final_text()
        q = question if question is not None else _first_user_text(traj)
        task_ref = traj.task.get("reference", traj.task.get("ground_truth"))
        ref = reference if reference is not None else (None if task_ref is None else str(task_ref))
    return await judge.score(response, question=q, reference=ref, rubric=rubric)
