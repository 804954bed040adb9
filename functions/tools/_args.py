"""Checks the tools share on what a policy passes them: its mistakes come back as a
``ValueError`` that says what to pass instead (the policy reads the message)."""

from __future__ import annotations

import json


def holds_json_arguments(text: str, name: str) -> bool:
    """Whether ``text`` is a JSON object with the argument ``name``: the policy put its whole
    call (``{"query": "..."}``) in the one string argument."""
    s = text.strip()
    if not (s.startswith("{") and s.endswith("}")):
        return False
    try:
        obj = json.loads(s)
    except ValueError:  # JSONDecodeError, and a number too long to convert
        return False
    return isinstance(obj, dict) and name in obj


def utf8(text: str, what: str) -> bytes:
    """``text`` as UTF-8; a lone surrogate (which no UTF-8 encodes) is a ``ValueError``
    naming where it is, not the codec's error."""
    try:
        return text.encode()
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} is not valid Unicode text: U+{ord(text[e.start]):04X} at character {e.start} "
            "is a lone surrogate; send UTF-8 text"
        ) from None
