"""Reading an OpenAI-compatible endpoint's refusals (shared by llm_judge and the openai engine)."""

from __future__ import annotations

from datetime import UTC, datetime
from email.utils import format_datetime

import httpx
import pytest

from functions.openai_api import error_message, excerpt, retry_after_s


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),  # OpenAI's precise header wins
        ({"retry-after-ms": "soon", "retry-after": "9"}, 9.0),  # unreadable: the standard one
        ({"retry-after": "7"}, 7.0),
        ({"retry-after": "-3"}, 0.0),
        ({"retry-after": "tomorrow"}, None),
        # nan slips past every cap (comparisons are False) and asyncio.sleep(nan) never returns
        ({"retry-after": "nan"}, None),
        ({"retry-after-ms": "NaN", "retry-after": "2"}, 2.0),
        ({"retry-after": "inf"}, float("inf")),  # kept: over any cap, so refused or capped
        ({}, None),
    ],
)
def test_retry_after_in_its_forms(headers, expected):
    assert retry_after_s(httpx.Headers(headers)) == expected


def test_retry_after_as_an_http_date_counts_from_now():
    at = datetime(2026, 1, 1, 12, 0, 30, tzinfo=UTC)
    headers = httpx.Headers({"retry-after": format_datetime(at, usegmt=True)})
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC).timestamp()
    assert retry_after_s(headers, now=lambda: now) == pytest.approx(30.0)
    assert retry_after_s(headers, now=lambda: now + 60) == 0.0  # already past


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"error": {"message": "model not found", "type": "x"}}', "model not found"),
        (b'{"error": "Unauthorized"}', "Unauthorized"),  # some servers send a bare string
        (b"<html>\n  Bad   Gateway\n</html>", "<html> Bad Gateway </html>"),
        (b"", "(empty body)"),
    ],
)
def test_error_message_reads_openai_errors_and_falls_back_to_the_body(body, expected):
    assert error_message(httpx.Response(400, content=body)) == expected


def test_excerpt_is_one_short_line():
    assert excerpt("a\n" * 500, n=20) == "a a a a a a a a a..."
    assert len(excerpt("x" * 1000)) == 300
