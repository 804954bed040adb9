"""Reading a judge endpoint's reply: its text (``reply_text``), why it stopped
(``_finish_reason``) and the code of an error reply (``_error_code``).
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from functions.openai_api import excerpt
from functions.rewards.judge_errors import JudgeResponseError

#: ``finish_reason`` values of a reply that stopped before the judge did.
_CUT_SHORT = frozenset({"length", "content_filter"})
#: ``finish_reason`` values of a reply the server stopped (vLLM's, HTTP 200 all the same).
_ABORTED = frozenset({"abort"})


def reply_text(data: dict[str, Any], url: str) -> str:
    """The text of a chat completion's reply from ``url``: its message's content, a string or
    its text parts; a reply without text, refused or cut short raises ``JudgeResponseError``."""
    try:
        choice = data["choices"][0]
        text = choice["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise JudgeResponseError(
            f"{url} answered JSON that is not a chat completion (no choices[0].message.content): "
            f"{excerpt(json.dumps(data))}"
        ) from None
    reason = choice.get("finish_reason") if isinstance(choice, dict) else None
    if isinstance(text, list):
        text = _text_parts(text)
    if not isinstance(text, str) or not text.strip():
        refusal = choice["message"].get("refusal") if isinstance(choice["message"], dict) else None
        if isinstance(refusal, str) and refusal.strip():
            # OpenAI's models put a refusal there, content null: its words say why (most often
            # the response's own content), which "no text" hid
            raise JudgeResponseError(f"the judge refused to grade: {excerpt(refusal)}")
        more = " (it ran out of tokens: raise max_tokens)" if reason == "length" else ""
        raise JudgeResponseError(f"the judge returned no text, finish_reason={reason!r}{more}")
    if reason in _CUT_SHORT:
        # the reply stops before the judge's verdict, or in it ("Verdict NONCE: 1" of
        # "10/10"): what it wrote by then (a score it was weighing, its paraphrase of the
        # response's claim) is no verdict, and a policy that makes the judge reason at length
        # would be scored by it
        more = "it ran out of tokens: raise max_tokens" if reason == "length" else "the provider cut it"
        raise JudgeResponseError(
            f"the judge's reply was cut short, finish_reason={reason!r} ({more}); a cut reply "
            f"is not scored: {excerpt(text)}"
        )
    return text


def _error_code(resp: httpx.Response) -> str:
    """The ``error.code`` of OpenAI's error JSON, else its ``error.type`` (``insufficient_quota``
    comes as both); ``""`` when the body has neither (vLLM's code is the status, a number)."""
    try:
        err = resp.json().get("error")
    except (ValueError, AttributeError):
        return ""
    if not isinstance(err, dict):
        return ""
    code = err.get("code")
    return code if isinstance(code, str) and code else str(err.get("type") or "")


def _finish_reason(data: dict[str, Any]) -> Any:
    try:
        return data["choices"][0].get("finish_reason")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None


def _text_parts(parts: list[Any]) -> str:
    """The text of a message content given as parts (``[{"type": "text", "text": ...}]``, as
    some OpenAI-compatible servers answer; ``output_text`` in the Responses API's shape), one
    part a line: each is a block of the reply. A refusal, an image or a malformed part is no
    text."""
    return "\n".join(
        p["text"]
        for p in parts
        if isinstance(p, dict) and p.get("type") in ("text", "output_text") and isinstance(p.get("text"), str)
    )
