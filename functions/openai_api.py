"""Reading an OpenAI-compatible endpoint's answers, shared by every client of one in this
project (``llm_judge``, the ``openai`` rollout engine): how long a 429/503 asks us to wait,
the error message of a refusal, a web page where JSON should be, and a short excerpt of a
body that is not what we expected."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from email.utils import parsedate_to_datetime

import httpx


def retry_after_s(headers: httpx.Headers, now: Callable[[], float] = time.time) -> float | None:
    """Seconds the server asked us to wait: ``retry-after-ms`` (OpenAI), else ``Retry-After``
    as seconds or as an HTTP date; ``None`` when absent or unreadable (our own backoff
    decides then). ``nan`` counts as unreadable; ``inf`` is kept (it is over any cap)."""
    ms = _seconds(headers.get("retry-after-ms"))
    if ms is not None:
        return max(ms / 1000, 0.0)
    # absent or not milliseconds: try the standard header
    value = headers.get("retry-after")
    if not value:
        return None
    seconds = _seconds(value)
    if seconds is not None:
        return max(seconds, 0.0)
    try:  # not seconds: an HTTP date
        return max(parsedate_to_datetime(value).timestamp() - now(), 0.0)
    except (TypeError, ValueError):
        return None


def _seconds(value: str | None) -> float | None:
    """``value`` as a number, or ``None``. float() also reads "nan", which every comparison
    with a cap lets through and asyncio.sleep(nan) never returns from: a hang, so refuse it."""
    if not value:
        return None
    try:
        v = float(value)
    except ValueError:
        return None
    return None if math.isnan(v) else v


def error_message(resp: httpx.Response) -> str:
    """The ``error.message`` of OpenAI's error JSON (or a bare ``error`` string, as some
    servers send); else an excerpt of the body itself."""
    with contextlib.suppress(ValueError, AttributeError):
        err = resp.json().get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
    return excerpt(resp.text)


def is_web_page(resp: httpx.Response) -> bool:
    """An HTML page (by its content type, or a body that opens with a tag): no API's reply, but
    a ``base_url`` at a web UI or a login page, whose index answers every path 200."""
    media = resp.headers.get("content-type", "").split(";")[0].strip().lower()
    return media in ("text/html", "application/xhtml+xml") or resp.text.lstrip().startswith("<")


def excerpt(text: str, n: int = 300) -> str:
    """``text`` on one line, cut to ``n`` characters, for an error message."""
    text = " ".join(text.split())
    if not text:
        return "(empty body)"
    return text if len(text) <= n else text[: n - 3] + "..."
