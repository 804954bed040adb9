"""How ``llm_judge`` fails: the final errors it raises, the transient one it retries, and
reading an endpoint's error response (``Retry-After``, the error message, a hint per status)."""

from __future__ import annotations

import time
from email.utils import parsedate_to_datetime

import httpx

from functions.rewards.judge_config import ENV_PREFIX


class JudgeError(Exception):
    """The judge answered, but not with something usable (a final error: not retried)."""


class JudgeResponseError(JudgeError):
    """The reply is not a chat completion, or holds no score in the rubric's range."""


class JudgeRejectedError(JudgeError):
    """The endpoint refused the request (a 4xx other than 408/429): fix the config."""


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


def _excerpt(text: str, n: int = 200) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")
