"""What the ``search`` test modules (``test_search.py``, ``test_search_corpus.py``) share:
a corpus file writer, and a fixture that unsets ``RL_FABRIC_SEARCH_CORPUS`` (each module
binds it as its autouse ``_no_corpus_env``, so a test reads the shipped corpus unless it
names another)."""

from __future__ import annotations

from pathlib import Path

import pytest

from functions.tools.search import CORPUS_ENV


def no_corpus_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CORPUS_ENV, raising=False)


def write(root: Path, rel: str, text: str | bytes) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path
