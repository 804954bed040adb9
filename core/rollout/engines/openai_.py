"""``OpenAIEngine``: the policy served by any OpenAI-compatible chat server (vLLM's or SGLang's
``serve``, a gateway, the OpenAI API), through ``POST {base_url}/chat/completions``.

    engine = OpenAIEngine(model="Qwen/Qwen2.5-7B-Instruct", base_url="http://gpu-3:8000/v1",
                          dialect="vllm")
    async with engine:
        c = await engine.generate(GenerateRequest(messages=[...], max_new_tokens=256))

The server's weights are not ours: ``load_weights`` only records the version it is given (so
completions carry the version the proxy believes in) and publishes nothing. Use it to roll out
a fixed policy (evaluation, a frozen opponent, a judge-like actor), or point it at a server
whose weights something else updates.

What a completion carries depends on what the server says:

* ``text``, ``finish_reason`` (``stop``/``length``; a ``content_filter`` or tool-call end is a
  ``stop``; a server-side abort is an ``abort``), and the ``usage`` counts, summed in
  ``engine.stats``. A reply that calls tools (a server given ``tools`` in ``extra_body``)
  has its calls in the text, each on a line of its own after the content, as
  ``{"name": ..., "arguments": "<json>"}``: the action an environment reads;
* ``token_ids``/``logprobs``/``prompt_ids`` only when the server names token *ids*: the
  ``vllm`` dialect asks vLLM for them (``return_token_ids``, ``return_tokens_as_token_ids``)
  with ``logprobs: true``. A plain OpenAI server names tokens by their text, which cannot be
  paired with ids for training, so from it they stay empty.

``allowed_token_ids`` (a closed action vocabulary) is sent as vLLM's own
``allowed_token_ids`` field in the ``vllm`` dialect. The standard API has no exact way to do
it, so the ``openai`` dialect refuses such requests: ``logit_bias`` (+100 on the allowed ids)
only makes the others unlikely, is capped at 300 ids by OpenAI, and its logprobs are not of
the renormalised distribution the trainer applies, so a GRPO ratio built on them would be
wrong. (vLLM reports logprobs *before* the restriction, and before the temperature, unless
the server runs with ``--logprobs-mode processed_logprobs``: start it so whenever its
logprobs are trained on. Under its default, ``raw_logprobs``, a turn sampled at temperature
0.7 carries the temperature-1 logprobs, and the trainer's importance ratio is off from the
first step; the client cannot tell, so it is the server's flag to set.)

Requests are not streamed: an aborted request closes its connection (vLLM aborts a request
whose client went away) and returns a ``finish_reason="abort"`` completion with no text.
Each HTTP attempt is bounded by ``timeout_s``; 408, 429, 5xx, timeouts and connection errors
are retried with full-jitter exponential backoff (or after the server's ``Retry-After``);
other 4xx fail at once with the server's message, and so does a 200 that is a web page (a
``base_url`` at a web UI: HTML where JSON should be). The turn's ``max_new_tokens`` goes as
``max_completion_tokens`` to OpenAI's API (its reasoning models refuse ``max_tokens``) and as
``max_tokens`` to any other server; ``max_tokens_field`` chooses. A prompt that fits with a
reply limit that does not (vLLM's server refuses it with a 400) is sent again asking for the
tokens that fit, as the other engines generate to the context's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
from collections.abc import Mapping
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt
from tenacity.wait import wait_random_exponential

from core.rollout.engines.base import (
    Completion,
    Engine,
    EngineError,
    FinishReason,
    GenerateRequest,
    PromptTooLongError,
    options_error,
)
from functions.openai_api import error_message, excerpt, is_web_page, retry_after_s

OPENAI_URL = "https://api.openai.com/v1"

_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",  # vLLM: the server aborted it (shutdown, preemption)
    "tool_calls": "stop",
    "function_call": "stop",
    "content_filter": "stop",  # the server ended the turn; the text is what it kept
}


# the reply limit too: one in extra_body went beside the engine's own (or was overwritten by
# it), so max_new_tokens was silently not the limit
_RESERVED_BODY = frozenset({"model", "messages", "stream", "n", "max_tokens", "max_completion_tokens"})


class OpenAIEngineConfig(BaseModel):
    """Where the server is and how to talk to it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["openai"] = "openai"
    model: str = Field(min_length=1)
    """The model name as the server knows it (``served-model-name`` for vLLM)."""
    base_url: str = OPENAI_URL
    """API root ending in ``/v1``; ``/chat/completions`` is appended."""
    api_key: SecretStr | None = None
    """Sent as ``Authorization: Bearer``; ``None`` reads ``api_key_env``."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the key when ``api_key`` is not given (local servers
    often need none)."""
    dialect: Literal["openai", "vllm"] = "openai"
    """``vllm``: the server is vLLM's, so ask for token ids and logprobs and send
    ``allowed_token_ids`` (fields the OpenAI API rejects)."""
    logprobs: bool | None = None
    """Ask for per-token logprobs (``logprobs: true``). ``None``: yes in the vllm dialect, no
    in the openai one (some OpenAI models refuse it, and without ids they cannot be used)."""
    timeout_s: float = Field(300.0, gt=0)
    """Limit on one HTTP attempt, connection to last byte (a long turn takes a while)."""
    max_retries: int = Field(3, ge=0, le=10)
    """Retries after the first attempt, for 408/429/5xx, timeouts and connection errors."""
    backoff_s: float = Field(0.5, gt=0)
    """Retry n waits a random time up to ``backoff_s * 2**n`` (full jitter)."""
    max_backoff_s: float = Field(30.0, gt=0)
    """Cap on one wait, a server's ``Retry-After`` included."""
    max_concurrency: int = Field(64, ge=1)
    """HTTP requests in flight at once; more wait their turn (an abort still finds them)."""
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] | None = None
    """The request field a turn's ``max_new_tokens`` is sent as (``None``:
    ``max_completion_tokens`` to OpenAI's API, ``max_tokens`` to any other server). OpenAI's
    reasoning models (o-series, gpt-5) refuse ``max_tokens``, every OpenAI chat model reads
    ``max_completion_tokens``; vLLM reads both, some other servers only ``max_tokens``."""
    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Merged into every request body (``top_p``, vendor options); not the fields the engine
    sets itself (``model``, ``messages``, ``stream``, ``n``, ``max_tokens``,
    ``max_completion_tokens``: ``max_tokens_field`` names the reply limit's field)."""
    headers: dict[str, str] = Field(default_factory=dict)
    """Extra HTTP headers on every request."""

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {v!r}")
        return v

    @field_validator("extra_body")
    @classmethod
    def _extra(cls, v: dict[str, Any]) -> dict[str, Any]:
        reserved = sorted(set(v) & _RESERVED_BODY)
        if reserved:
            raise ValueError(f"may not set {reserved}: the engine sets them")
        return v

    @property
    def reply_limit_field(self) -> str:
        """The request field that carries ``max_new_tokens`` (see ``max_tokens_field``)."""
        if self.max_tokens_field is not None:
            return self.max_tokens_field
        return "max_completion_tokens" if self.base_url.rstrip("/") == OPENAI_URL else "max_tokens"

    @property
    def wants_logprobs(self) -> bool:
        return self.dialect == "vllm" if self.logprobs is None else self.logprobs


class OpenAIEngineError(EngineError):
    """The server refused a request, or stayed unreachable or failing through every retry.
    ``status`` is the last HTTP status (``None``: no answer); ``retryable`` says whether the
    same request may succeed later (overload, outage) or never will (a 4xx)."""

    def __init__(self, message: str, *, status: int | None = None, retryable: bool = False):
        super().__init__(message)
        self.status = status
        self.retryable = retryable


class _Transient(Exception):
    """One attempt failed in a way a later attempt may not (408/429/5xx, timeout, network)."""

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class OpenAIEngine(Engine):
    name = "openai"

    def __init__(self, config: OpenAIEngineConfig | None = None, *, version: int = 0, **options: Any):
        """Give a config, or its fields as keywords (``make_engine`` passes the job's
        ``engine.model`` and ``engine.kwargs`` so)."""
        super().__init__(version=version)
        if config is not None and options:
            raise EngineError(f"give an OpenAIEngineConfig or its fields, not both (got {sorted(options)})")
        self.config = config if config is not None else _validate(OpenAIEngineConfig, options)
        cfg = self.config
        key = cfg.api_key.get_secret_value() if cfg.api_key else os.environ.get(cfg.api_key_env)
        if not key and cfg.base_url.rstrip("/") == OPENAI_URL:
            raise EngineError(
                f"the OpenAI API needs a key: set {cfg.api_key_env} or api_key "
                "(or point base_url at your own server)"
            )
        self._headers = {**cfg.headers, **({"Authorization": f"Bearer {key}"} if key else {})}
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"
        self._client: httpx.AsyncClient | None = None
        self._slots = asyncio.Semaphore(cfg.max_concurrency)
        self._tasks: dict[str, asyncio.Task[dict[str, Any]]] = {}
        self.stats = {
            "requests": 0,
            "http_attempts": 0,
            "retries": 0,
            "aborts": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
        }

    # -- hooks
    async def _start(self) -> None:
        # an AsyncClient belongs to the loop that made it: made here, on the engine's loop
        self._client = httpx.AsyncClient(
            headers=self._headers,
            timeout=httpx.Timeout(self.config.timeout_s),
            limits=httpx.Limits(max_connections=self.config.max_concurrency),
        )

    async def _close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def _abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()  # closes the connection: the server drops the request

    async def _load_weights(self, state: Mapping[str, Any], version: int) -> None:
        """Nothing to load: the server's weights are not ours. The base records ``version``,
        which later completions carry."""

    async def _generate(self, request: GenerateRequest) -> Completion:
        body = self._body(request)
        version = self._version
        rid = request.request_id
        task = asyncio.create_task(self._complete(rid, body), name=f"openai-{rid}")
        self._tasks[rid] = task
        self.stats["requests"] += 1
        try:
            # wait() does not cancel the task when *we* are cancelled: do it ourselves
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            self._tasks.pop(rid, None)
        if task.cancelled():
            self.stats["aborts"] += 1
            return Completion.not_run(request, self._version)  # not streamed: nothing came back
        return self._completion(request, task.result(), version)

    # -- request and answer
    def _body(self, request: GenerateRequest) -> dict[str, Any]:
        cfg = self.config
        if request.messages is None:
            raise EngineError(
                "the openai engine sends chats: give messages, not prompt_ids "
                "(token prompts need the torch or vllm engine)"
            )
        if request.allowed_token_ids is not None and cfg.dialect != "vllm":
            raise EngineError(
                "the openai engine cannot constrain sampling to allowed_token_ids on a plain "
                "OpenAI server (logit_bias is neither exact nor gives the renormalised logprobs): "
                "use `actions` with the torch or vllm engine, or dialect='vllm' if the server is vLLM"
            )
        body: dict[str, Any] = {
            **cfg.extra_body,
            "model": cfg.model,
            # our own stamp is not part of the OpenAI message schema
            "messages": [
                m.model_dump(exclude_none=True, exclude={"policy_version"}) for m in request.messages
            ],
            cfg.reply_limit_field: request.max_new_tokens,
            "temperature": request.temperature,
            "n": 1,
            "stream": False,
        }
        if request.stop:
            body["stop"] = list(request.stop)
        if request.seed is not None:
            body["seed"] = request.seed
        if cfg.wants_logprobs:
            body["logprobs"] = True
        if cfg.dialect == "vllm":
            body["return_token_ids"] = True  # vLLM >= 0.10.2
            body["return_tokens_as_token_ids"] = True  # older vLLM: ids inside the logprobs
            if request.allowed_token_ids is not None:
                body["allowed_token_ids"] = list(request.allowed_token_ids)
        return body

    def _completion(self, request: GenerateRequest, data: dict[str, Any], version: int) -> Completion:
        try:
            choice = data["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise OpenAIEngineError(
                f"{self.url} answered JSON that is not a chat completion (no choices[0].message): "
                f"{excerpt(str(data))}"
            ) from None
        usage = data.get("usage")
        if isinstance(usage, dict):
            for k in ("prompt_tokens", "completion_tokens"):
                if isinstance(usage.get(k), int):
                    self.stats[k] += usage[k]
        ids, logprobs = _token_ids_and_logprobs(choice) if self.config.wants_logprobs else ([], [])
        prompt_ids = data.get("prompt_token_ids")
        raw_reason = choice.get("finish_reason")
        return Completion(
            request_id=request.request_id,
            text=_reply_text(message),
            prompt_ids=list(prompt_ids) if isinstance(prompt_ids, list) and ids else [],
            token_ids=ids,
            logprobs=logprobs,
            policy_version=version,
            finish_reason=_FINISH.get(str(raw_reason), "stop"),  # unknown or missing: it ended
            allowed_token_ids=request.allowed_token_ids,
            metadata=request.metadata,
        )

    # -- HTTP with retries
    async def _complete(self, rid: str, body: dict[str, Any]) -> dict[str, Any]:
        cfg = self.config
        backoff = wait_random_exponential(multiplier=cfg.backoff_s, max=cfg.max_backoff_s)

        def wait(state: RetryCallState) -> float:
            self.stats["retries"] += 1
            exc = state.outcome.exception() if state.outcome else None
            if isinstance(exc, _Transient) and exc.retry_after is not None:
                return min(exc.retry_after, cfg.max_backoff_s)  # the server knows when it has room
            return float(backoff(state))

        retrying = AsyncRetrying(
            stop=stop_after_attempt(cfg.max_retries + 1),
            wait=wait,
            retry=retry_if_exception_type(_Transient),
            reraise=True,
        )
        try:
            data: dict[str, Any] = await retrying(self._attempt, rid, body)
        except _Transient as e:
            n = cfg.max_retries + 1
            raise OpenAIEngineError(
                f"{self.url} failed {n} attempt{'s' if n > 1 else ''} (last: {e}); "
                f"is the server up and serving {cfg.model!r}? The request can be retried later.",
                status=e.status,
                retryable=True,
            ) from None
        return data

    async def _attempt(self, rid: str, body: dict[str, Any]) -> dict[str, Any]:
        cfg = self.config
        client = self._client
        if client is None:
            raise EngineError("the openai engine is not started")
        resp = await self._post(client, rid, body)
        field = cfg.reply_limit_field
        room = _room_left(resp, body.get(field, 0))
        if room is not None:
            # the prompt fits but max_tokens does not (vLLM refuses it): generate what fits, as
            # the torch and vllm engines do (finish_reason "length"), not a failed turn
            resp = await self._post(client, rid, {**body, field: room})
        status = resp.status_code
        if status in (408, 429) or status >= 500:
            after = retry_after_s(resp.headers) if status in (429, 503) else None
            raise _Transient(f"HTTP {status}: {error_message(resp)}", status, after)
        if status >= 400:
            message = error_message(resp)
            # OpenAI names it by its code; its message need not say "context length" ("Your
            # input exceeds the context window"); vLLM's does, with no such code
            if status == 400 and (
                "context length" in message.lower() or _error_code(resp) == "context_length_exceeded"
            ):
                raise PromptTooLongError(f"{self.url}: {message}")
            raise OpenAIEngineError(
                f"{self.url} refused the request (HTTP {status}: {message}); {_hint(status, cfg)}",
                status=status,
            )
        try:
            data = resp.json()
        except ValueError:
            kind = resp.headers.get("content-type", "no content type")
            if is_web_page(resp):
                # base_url at a web UI or a login page (its index answers every path 200): no
                # turn will ever get a completion from it, so say it is the setup, not the reply
                raise OpenAIEngineError(
                    f"{self.url} answered {status} with a web page ({kind}), not a chat completion: "
                    f"{excerpt(resp.text, 100)}; set base_url to the OpenAI-compatible API root "
                    "(ending in /v1)",
                    status=status,
                ) from None
            raise OpenAIEngineError(
                f"{self.url} answered {status} with a body that is not JSON ({kind}): "
                f"{excerpt(resp.text)}; is base_url the OpenAI-compatible API root (ending in /v1)?",
                status=status,
            ) from None
        if not isinstance(data, dict):
            raise OpenAIEngineError(f"{self.url} answered JSON that is not an object: {excerpt(resp.text)}")
        return data

    async def _post(self, client: httpx.AsyncClient, rid: str, body: dict[str, Any]) -> httpx.Response:
        cfg = self.config
        async with self._slots:
            self.stats["http_attempts"] += 1
            try:
                # httpx's timeout is per read; this one bounds the whole attempt
                async with asyncio.timeout(cfg.timeout_s):
                    return await client.post(self.url, json=body, headers={"X-Request-Id": rid})
            except (TimeoutError, httpx.TimeoutException):
                raise _Transient(f"no answer within timeout_s={cfg.timeout_s:g} s") from None
            except httpx.UnsupportedProtocol as e:
                raise OpenAIEngineError(f"bad base_url {cfg.base_url!r}: {e}") from None
            except httpx.TransportError as e:
                raise _Transient(f"{type(e).__name__}: {e or 'connection failed'}") from None


def _reply_text(message: Any) -> str:
    """The turn's text: its content, then each tool call the server parsed out of it (a
    request given ``tools`` through ``extra_body``: ``content`` is null then) on a line of
    its own, as the JSON environments read (``{"name": ..., "arguments": "<json>"}``,
    OpenAI's function object; math-tools takes it). Read as the content alone, a turn that
    called a tool was empty text: the environment never got the call."""
    text = str(message.get("content") or "") if isinstance(message, dict) else ""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not isinstance(calls, list):
        legacy = message.get("function_call") if isinstance(message, dict) else None
        calls = [{"function": legacy}] if isinstance(legacy, dict) else []
    lines = [text] if text else []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict):
            call = {"name": fn.get("name"), "arguments": fn.get("arguments")}
            lines.append(json.dumps(call, ensure_ascii=False))
    return "\n".join(lines)


def _token_ids_and_logprobs(choice: dict[str, Any]) -> tuple[list[int], list[float]]:
    """The sampled ids with their logprobs, when the server names ids (else both empty: a
    completion's ids and logprobs must pair up)."""
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if not isinstance(content, list) or not content:
        return [], []
    logprobs = [float(t["logprob"]) for t in content]
    ids: list[int] = []
    given = choice.get("token_ids")
    if isinstance(given, list):
        ids = [int(i) for i in given]
    else:  # older vLLM: "token_id:123" in place of the token text
        for t in content:
            i = _id_of(t.get("token"))
            if i is None:
                return [], []  # named by text only (a plain OpenAI server)
            ids.append(i)
    if len(ids) != len(logprobs):
        raise OpenAIEngineError(f"the server returned {len(ids)} token ids but {len(logprobs)} logprobs")
    return ids, logprobs


def _id_of(token: Any) -> int | None:
    if isinstance(token, str) and token.startswith("token_id:"):
        with contextlib.suppress(ValueError):
            return int(token.removeprefix("token_id:"))
    return None


#: vLLM's server on a prompt that fits with a max_tokens that does not
_TOO_LARGE = re.compile(
    r"maximum context length is (\d+) tokens and your request has (\d+) input tokens", re.IGNORECASE
)


def _room_left(resp: httpx.Response, asked: int) -> int | None:
    """The tokens the context has left after the prompt, when ``resp`` is vLLM's refusal of a
    reply limit (``asked``) over them and there is room for at least one (else None: no retry)."""
    if resp.status_code != 400:
        return None
    m = _TOO_LARGE.search(error_message(resp))
    if m is None:
        return None
    room = int(m.group(1)) - int(m.group(2))
    return room if 1 <= room < asked else None


def _error_code(resp: httpx.Response) -> str | None:
    """The ``error.code`` of OpenAI's error JSON, if it has one."""
    with contextlib.suppress(ValueError, AttributeError):
        code = resp.json().get("error", {}).get("code")
        return code if isinstance(code, str) else None
    return None


def _hint(status: int, cfg: OpenAIEngineConfig) -> str:
    return {
        401: f"check the API key ({cfg.api_key_env} or api_key)",
        403: "the key may not use this model or endpoint",
        404: f"check base_url (the API root ending in /v1) and that the server serves {cfg.model!r}",
    }.get(status, "the same request will fail again: fix it (model, options, extra_body)")


def _validate(cls: type[OpenAIEngineConfig], options: dict[str, Any]) -> OpenAIEngineConfig:
    try:
        return cls(**options)
    except ValidationError as e:
        raise options_error("openai", e) from None
