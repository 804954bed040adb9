"""How ``llm_judge`` fails: the final errors it raises, the transient one it retries, and a
hint per refusing status (reading the endpoint's error response is ``functions.openai_api``)."""

from __future__ import annotations

from typing import Any

from fabric.errors import Misconfigured, pickled_whole
from functions.rewards.judge_config import ENV_PREFIX


class JudgeError(Exception):
    """The judge answered, but not with something usable (a final error: not retried)."""


class JudgeResponseError(JudgeError):
    """The reply is not a chat completion, or holds no score in the rubric's range."""


class JudgeRejectedError(JudgeError):
    """The endpoint refused the request (a 4xx other than 408/429): fix the config."""


class JudgeMisconfigured(JudgeRejectedError, Misconfigured):
    """The judge's own setup is wrong, whatever the response: the endpoint refused its key
    (401/403), knows neither its model nor its URL (404), redirects (3xx) or answers with a web
    page (HTML: the base URL is a web UI's), refused a setting the model does not
    take (400 ``unsupported_parameter``/``unsupported_value``) or the account's quota (429
    ``insufficient_quota``), the base URL is no HTTP URL, or its config is missing. The fabric
    reports it as ``Misconfigured``, which a reward's ``failure_score`` never scores: every
    trajectory would get that score."""


class _Transient(Exception):
    """An attempt that may succeed if repeated (status 408/429/5xx, timeout, network)."""

    def __init__(self, message: str, hint: str, retry_after: float | None = None):
        super().__init__(message)
        self.hint = hint
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[Any, ...]:
        return pickled_whole(self)  # made of parts, not of its message


#: Refusals that say the judge's setup is wrong, not the request this response made: a 400
#: (the prompt over the model's context) or a 413 may be the response's doing, these never are.
_MISCONFIGURED_STATUSES = frozenset({401, 403, 404})

_REJECT_HINTS = {
    401: f"check the API key (OPENAI_API_KEY or {ENV_PREFIX}API_KEY)",
    403: "the key is not allowed to use this model or endpoint",
    404: f"check base_url ({ENV_PREFIX}BASE_URL, the API root ending in /v1) and the model name",
}

#: OpenAI's ``error.code`` of a 400 for a setting the model does not take (``max_tokens`` or
#: ``temperature=0`` on a reasoning model): every request carries it, whatever the response.
#: Other 400s (``context_length_exceeded``) may be the response's own.
_UNSUPPORTED_SETTING = frozenset({"unsupported_parameter", "unsupported_value"})

#: OpenAI's ``error.code`` (and ``type``) of a 429 for an account out of credit: no wait
#: fixes it, unlike a rate limit's 429.
_NO_QUOTA = "insufficient_quota"
