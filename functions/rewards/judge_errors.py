"""How ``llm_judge`` fails: the final errors it raises, the transient one it retries, and a
hint per refusing status (reading the endpoint's error response is ``functions.openai_api``)."""

from __future__ import annotations

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


_REJECT_HINTS = {
    401: f"check the API key (OPENAI_API_KEY or {ENV_PREFIX}API_KEY)",
    403: "the key is not allowed to use this model or endpoint",
    404: f"check base_url ({ENV_PREFIX}BASE_URL, the API root ending in /v1) and the model name",
}
