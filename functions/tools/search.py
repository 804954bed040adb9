"""``search``: BM25 retrieval over a local corpus, for tool-using policies.

The corpus is read once per warm worker (the tool's setup hook) into an inverted index, so
a call only walks the postings of the query's terms and keeps the top ``k`` with a heap.

Which corpus: ``RL_FABRIC_SEARCH_CORPUS`` (read when a worker starts) names either

* a directory of ``.txt`` / ``.md`` files, searched recursively (hidden files and folders
  ignored, symlinked folders not followed): one document per file, its id the file's path
  relative to the directory, its title the first line (a Markdown ``#`` heading marker
  stripped) or, when that line is empty or longer than ``MAX_TITLE_CHARS``, the file name; or
* a ``.jsonl`` file: one ``{"id": ..., "title": ..., "text": ...}`` object a line (only
  ``text`` is required; ``id`` defaults to the line number, ``title`` to the id).

Unset (or empty), it is the corpus shipped in ``functions/data/corpus``: about fifty short
factual documents on science, geography, mathematics, programming and history, for examples
and tests. A relative path is relative to the worker's working directory.

Bad corpora: a path that is missing, neither a directory nor a ``.jsonl`` file, or
unreadable, or one that yields no document at all, is a ``CorpusError`` (a ``ValueError``);
as the setup hook's error, every call fails with ``SetupFailed`` and that message. Single
bad documents (a file that cannot be read, is not UTF-8, is empty or over ``MAX_DOC_BYTES``;
a JSONL line that is not a JSON object with a non-empty string ``text``, or repeats an id)
are skipped with one ``CorpusWarning`` listing them, so one stray file does not take a
large corpus down; ``load_documents(path, strict=True)`` refuses them instead.

Scoring is Okapi BM25 (``k1=1.5``, ``b=0.75``) with the non-negative idf
``ln(1 + (N - n + 0.5) / (n + 0.5))`` (Lucene's), so a document that contains a query term
always scores above zero. Each distinct query term counts once. Terms (``tokenize``) are
words of the NFKC-normalised, case-folded text: runs of Unicode word characters and the
combining marks within them (``café`` composed or not, Devanagari ``भाषा``), English
stopwords dropped, plural endings stripped (``stem``: a singular and its plural meet,
``cookie``/``cookies``, ``prize``/``prizes``); Chinese, Japanese and Korean runs, written
without spaces, are indexed as overlapping character pairs (``東京は`` as ``東京``, ``京は``),
so a query of two or more such characters finds them inside a run, and a single character
only where it stands alone.

The corpus path is deliberately not an argument of the tool: the policy picks the words,
never which files the worker reads. To search another corpus from Python, use
``load_index(path)`` (or the cached ``get_index(path)``) and ``BM25Index.search``.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import threading
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import Strict

import fabric
from functions.tools._args import holds_json_arguments, utf8
from functions.tools._search_text import _CJK, _WORD, tokenize

# the text rules live in their own module; these stay importable from here
from functions.tools._search_text import STOPWORDS as STOPWORDS
from functions.tools._search_text import stem as stem

#: Environment variable naming the corpus (a directory or a ``.jsonl`` file).
CORPUS_ENV = "RL_FABRIC_SEARCH_CORPUS"
#: The corpus shipped with the package (package data of ``functions``).
DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "data" / "corpus"
#: File suffixes read from a corpus directory.
DOC_SUFFIXES = frozenset({".txt", ".md"})

#: Longest query accepted, in characters.
MAX_QUERY_CHARS = 500
DEFAULT_K = 3
#: Most hits one call returns (each is a title and a snippet in the policy's context).
MAX_K = 20
#: Largest document read, in bytes; larger ones are skipped (split them).
MAX_DOC_BYTES = 1 << 20
#: A first line longer than this is text, not a title.
MAX_TITLE_CHARS = 120
#: Snippet length in words, and in characters at most.
SNIPPET_WORDS = 40
SNIPPET_CHARS = 320
#: Words of context kept before the first matching term of a snippet.
_SNIPPET_LEAD = 8
#: Candidate snippet windows looked at per document (bounds the work on huge documents).
_SNIPPET_CANDIDATES = 500
K1 = 1.5
B = 0.75


class CorpusError(ValueError):
    """The corpus cannot be used; the message says what to fix."""


class CorpusWarning(UserWarning):
    """Some documents of the corpus were skipped (listed in the message)."""


# ----------------------------------------------------------------------------- corpus


@dataclass(frozen=True, slots=True)
class Document:
    id: str
    title: str
    text: str
    """The body, without the title (both are indexed)."""


def _split_title(text: str, fallback: str) -> tuple[str, str]:
    first, _, rest = text.partition("\n")
    title = first.strip().lstrip("#").strip()
    if title and len(title) <= MAX_TITLE_CHARS:
        return title, rest.strip()
    return fallback, text


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); convert it, "
            "e.g. iconv -f latin1 -t utf-8"
        ) from None


def _read_document(path: Path, doc_id: str) -> Document:
    """One document file; ``ValueError`` saying why it is skipped."""
    try:
        size = path.stat().st_size
        if size > MAX_DOC_BYTES:
            raise ValueError(f"{size:,} bytes, over the {MAX_DOC_BYTES:,}-byte limit; split it")
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot be read ({e.strerror or e})") from None
    text = _decode(data).strip()
    if not text:
        raise ValueError("empty")
    fallback = path.stem.replace("_", " ").replace("-", " ").strip() or path.name
    title, body = _split_title(text, fallback)
    return Document(id=doc_id, title=title, text=body)


def _from_directory(root: Path, skipped: list[str]) -> list[Document]:
    try:
        os.listdir(root)
    except OSError as e:
        raise CorpusError(f"search corpus directory {root} cannot be read ({e.strerror or e})") from None

    def unreadable(e: OSError) -> None:
        where = Path(str(e.filename))
        shown = where.relative_to(root).as_posix() if where.is_relative_to(root) else str(where)
        skipped.append(f"{shown}: directory cannot be read ({e.strerror or e})")

    docs: list[Document] = []
    for folder, dirs, files in os.walk(root, onerror=unreadable):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = Path(folder, name)
            if name.startswith(".") or path.suffix.lower() not in DOC_SUFFIXES:
                continue
            doc_id = path.relative_to(root).as_posix()
            try:
                docs.append(_read_document(path, doc_id))
            except ValueError as e:
                skipped.append(f"{doc_id}: {e}")
    return docs


def _from_jsonl(path: Path, skipped: list[str]) -> list[Document]:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CorpusError(f"search corpus {path} cannot be read ({e.strerror or e})") from None
    docs: list[Document] = []
    seen: set[str] = set()
    for n, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            if len(raw) > MAX_DOC_BYTES:
                raise ValueError(f"{len(raw):,} bytes, over the {MAX_DOC_BYTES:,}-byte limit; split it")
            try:
                obj = json.loads(_decode(raw))
            except json.JSONDecodeError as e:
                raise ValueError(f"not JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"not a JSON object but {type(obj).__name__}")
            text, doc_id, title = obj.get("text"), obj.get("id", n), obj.get("title")
            if not isinstance(text, str) or not text.strip():
                raise ValueError('needs a non-empty string "text"')
            if isinstance(doc_id, bool) or not isinstance(doc_id, str | int):
                raise ValueError('"id" must be a string or an integer')
            doc_id = str(doc_id)
            if title is not None and not isinstance(title, str):
                raise ValueError('"title" must be a string')
            if doc_id in seen:
                raise ValueError(f"repeats id {doc_id!r}")
        except ValueError as e:
            skipped.append(f"line {n}: {e}")
            continue
        seen.add(doc_id)
        docs.append(Document(id=doc_id, title=(title or "").strip() or doc_id, text=text.strip()))
    return docs


def load_documents(path: str | os.PathLike[str], *, strict: bool = False) -> list[Document]:
    """The documents of a corpus directory or ``.jsonl`` file (see the module's docstring).

    Raises ``CorpusError`` for an unusable corpus; bad single documents are skipped with a
    ``CorpusWarning``, or raise ``CorpusError`` when ``strict``."""
    p = Path(path).expanduser()
    hint = (
        f"point {CORPUS_ENV} at a directory of .txt/.md files (one document per file) or at a "
        ".jsonl file of {'id', 'title', 'text'} objects, or unset it to use the shipped corpus"
    )
    skipped: list[str] = []
    if p.is_dir():
        docs = _from_directory(p, skipped)
        kind = "no .txt or .md documents"
    elif p.suffix.lower() == ".jsonl" and p.is_file():
        docs = _from_jsonl(p, skipped)
        kind = "no documents"
    elif not p.exists():
        raise CorpusError(f"search corpus {p} does not exist; {hint}")
    else:
        raise CorpusError(f"search corpus {p} is neither a directory nor a .jsonl file; {hint}")
    if skipped:
        listed = "\n  ".join(skipped[:20]) + (
            f"\n  ... and {len(skipped) - 20} more" if len(skipped) > 20 else ""
        )
        message = f"{p}: {len(skipped)} document(s) skipped:\n  {listed}"
        if strict:
            raise CorpusError(message)
        if docs:
            warnings.warn(message, CorpusWarning, stacklevel=2)
    if not docs:
        extra = f" ({len(skipped)} skipped: {'; '.join(skipped[:3])})" if skipped else ""
        raise CorpusError(f"search corpus {p} has {kind}{extra}; {hint}")
    return docs


# ----------------------------------------------------------------------------- index


@dataclass(frozen=True, slots=True)
class Hit:
    id: str
    title: str
    score: float
    snippet: str


@dataclass(frozen=True, slots=True)
class Results:
    query: str
    terms: tuple[str, ...]
    """The query's distinct index terms (empty: nothing searchable in it)."""
    hits: tuple[Hit, ...]
    matched: int
    """Documents containing at least one term (``hits`` are the best of them)."""

    def to_text(self) -> str:
        """The results as text for a policy to read."""
        if not self.hits:
            return (
                f'No documents match "{self.query}". Try other words: synonyms, a more general '
                "term, or the name of the thing you are looking for."
            )
        head = (
            f'Top {len(self.hits)} of {self.matched} matching documents for "{self.query}":'
            if self.matched > len(self.hits)
            else f'{self.matched} matching document{"s" if self.matched > 1 else ""} for "{self.query}":'
        )
        parts = [head]
        for i, h in enumerate(self.hits, 1):
            parts.append(f"[{i}] {h.title} (id: {h.id}, score {h.score:.2f})\n{h.snippet}")
        return "\n\n".join(parts)


class BM25Index:
    """An Okapi BM25 index over ``documents``: an inverted index of term -> postings
    ``(document, term frequency)``, with per-document length norms precomputed."""

    def __init__(self, documents: Sequence[Document], *, k1: float = K1, b: float = B, source: str = ""):
        if not documents:
            raise CorpusError("no documents to index")
        if k1 < 0 or not 0 <= b <= 1:
            raise ValueError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        self.documents = tuple(documents)
        self.k1, self.b, self.source = k1, b, source
        postings: dict[str, list[tuple[int, int]]] = {}
        lengths: list[int] = []
        for i, doc in enumerate(self.documents):
            text = f"{doc.title}\n{doc.text}"
            terms = tokenize(text)
            counts = Counter(terms)
            if any(_CJK.search(t) for t in counts):
                # a CJK run's single characters are postings too (a one-character query finds
                # them), not length: a pair query scores as it did before they were indexed
                counts = Counter(tokenize(text, document=True))
            lengths.append(len(terms))
            for term, tf in counts.items():
                postings.setdefault(term, []).append((i, tf))
        n_docs = len(self.documents)
        self.avgdl = sum(lengths) / n_docs
        avgdl = self.avgdl or 1.0  # every document empty of terms: no query matches anyway
        self.lengths = tuple(lengths)
        self._norm = tuple(k1 * (1 - b + b * dl / avgdl) for dl in lengths)
        self._postings = {t: tuple(p) for t, p in postings.items()}
        self.idf = {t: math.log(1 + (n_docs - len(p) + 0.5) / (len(p) + 0.5)) for t, p in postings.items()}

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], *, strict: bool = False, **params: float) -> BM25Index:
        return cls(load_documents(path, strict=strict), source=str(path), **params)

    def __len__(self) -> int:
        return len(self.documents)

    def scores(self, query: str) -> dict[int, float]:
        """BM25 score of every document (by position) that contains a query term."""
        k1 = self.k1
        acc: dict[int, float] = {}
        for term in dict.fromkeys(tokenize(query)):
            plist = self._postings.get(term)
            if plist is None:
                continue
            idf = self.idf[term]
            for i, tf in plist:
                acc[i] = acc.get(i, 0.0) + idf * tf * (k1 + 1) / (tf + self._norm[i])
        return acc

    def search(self, query: str, k: int = DEFAULT_K) -> Results:
        """The ``k`` best documents for ``query`` (ties: the earlier document first)."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        terms = tuple(dict.fromkeys(tokenize(query)))
        scores = self.scores(query)
        top = heapq.nlargest(k, scores.items(), key=lambda kv: (kv[1], -kv[0]))
        hits = tuple(
            Hit(
                id=self.documents[i].id,
                title=self.documents[i].title,
                score=score,
                snippet=self._snippet(self.documents[i], terms),
            )
            for i, score in top
        )
        return Results(query=" ".join(query.split()), terms=terms, hits=hits, matched=len(scores))

    def _snippet(self, doc: Document, terms: Iterable[str]) -> str:
        """About ``SNIPPET_WORDS`` words of the document around the densest cluster of
        query terms (weighted by idf), with ``…`` where text was cut."""
        text = doc.text or doc.title
        words = list(_WORD.finditer(text))
        if not words:
            return text[:SNIPPET_CHARS]
        weight = {t: self.idf.get(t, 0.0) for t in terms}
        # the query terms in each word of the text as written (a CJK run holds several)
        seen: dict[str, set[str]] = {}

        def terms_in(w: str) -> set[str]:
            return seen[w] if w in seen else seen.setdefault(w, weight.keys() & tokenize(w, document=True))

        found = [terms_in(m.group()) for m in words]
        hits = [j for j, ts in enumerate(found) if ts]
        best_start, best = 0, -1.0
        for j in hits[:_SNIPPET_CANDIDATES]:
            start = max(0, j - _SNIPPET_LEAD)
            present = set().union(*found[start : start + SNIPPET_WORDS])
            value = sum(weight[t] for t in present)
            if value > best:  # the earliest of equally good windows
                best_start, best = start, value
        end = min(len(words), best_start + SNIPPET_WORDS)
        lo = words[best_start].start() if best_start > 0 else 0
        hi = words[end - 1].end() if end < len(words) else len(text)
        snippet, cut_after = " ".join(text[lo:hi].split()), end < len(words)
        if len(snippet) > SNIPPET_CHARS:
            snippet, cut_after = snippet[:SNIPPET_CHARS].rsplit(" ", 1)[0], True
        return ("…" if best_start > 0 else "") + snippet + ("…" if cut_after else "")


# ----------------------------------------------------------------------------- per worker

_cache: dict[str, BM25Index] = {}
_cache_lock = threading.Lock()


def corpus_path() -> Path:
    """The corpus ``RL_FABRIC_SEARCH_CORPUS`` names, or the shipped one."""
    value = os.environ.get(CORPUS_ENV, "").strip()
    return Path(value).expanduser() if value else DEFAULT_CORPUS


def load_index(path: str | os.PathLike[str], *, strict: bool = False) -> BM25Index:
    """A fresh index of the corpus at ``path`` (not cached)."""
    return BM25Index.from_path(path, strict=strict)


def get_index(path: str | os.PathLike[str] | None = None) -> BM25Index:
    """The index of ``path`` (default: ``corpus_path()``), built on first use and kept for
    the life of the process; ``clear_cache()`` forgets it (after the files changed)."""
    p = Path(path).expanduser() if path is not None else corpus_path()
    key = str(p.resolve())
    with _cache_lock:
        index = _cache.get(key)
        if index is None:
            index = _cache[key] = BM25Index.from_path(p)
        return index


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()


def default_index() -> BM25Index:
    """The setup hook: the index of the configured corpus, built once per worker."""
    return get_index()


# ----------------------------------------------------------------------------- the tool

#: The OpenAI-style tool schema a policy is shown.
OPENAI_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "description": (
            "Search a local collection of short reference documents by keywords (BM25 ranking). "
            "Returns the best matching documents, each with its title, id, score and a snippet."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "query": {
                    "type": "string",
                    "description": "keywords to look for, for example: speed of light in a vacuum",
                },
                "k": {
                    "type": "integer",
                    "description": f"how many documents to return (default {DEFAULT_K})",
                    "minimum": 1,
                    "maximum": MAX_K,
                },
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}


def check_arguments(query: str, k: int) -> str:
    """The stripped query; ``ValueError`` saying what is wrong with the arguments."""
    if not isinstance(query, str):
        raise ValueError(f"query must be a string, got {type(query).__name__}")
    text = query.strip()
    utf8(text, "query")  # echoed in the answer, which must encode as the observation's text
    if not text:
        raise ValueError("empty query: pass the words to look for, e.g. 'speed of light'")
    if holds_json_arguments(text, "query"):
        raise ValueError(
            'query holds the JSON arguments ({"query": ...}): pass the words themselves as the '
            "string (and k as its own argument), e.g. speed of light"
        )
    if len(text) > MAX_QUERY_CHARS:
        raise ValueError(
            f"query is {len(text)} characters, over the {MAX_QUERY_CHARS} limit; use a few keywords"
        )
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ValueError(f"k must be an integer from 1 to {MAX_K}, got {k!r}")
    if not tokenize(text):
        raise ValueError(
            f"query {text!r} has no searchable words (only stopwords, punctuation or spaces); "
            "use content words, e.g. 'tallest mountain'"
        )
    return text


@fabric.tool(
    setup=default_index,
    warm=1,
    timeout_s=10,
    examples=(
        {"query": "speed of light in a vacuum"},
        {"query": "tallest mountain on Earth", "k": 2},
        {"query": "binary search sorted array", "k": 5},
    ),
)
def search(
    query: str,
    # strict: the fabric validates arguments in pydantic's lax mode, which turned k=True into
    # 1 and k="3" into 3, both of which check_arguments refuses from a direct call
    k: Annotated[int, Strict()] = DEFAULT_K,
    ctx: BM25Index | None = None,
) -> str:
    """Search the local corpus (BM25) and return the ``k`` best documents as text."""
    text = check_arguments(query, k)
    index = ctx if ctx is not None else get_index()
    return index.search(text, k).to_text()
