"""A word-level tokenizer for the built-in environments' text, with a chat template.

The embedded-default policy is a tiny LM trained from scratch, so its vocabulary is small
and closed: words (letters), single digits, single punctuation marks and ``\\n`` (a grid's
row break carries meaning). Everything else maps to ``<unk>``. Digits are split one by one
so numbers never run out of vocabulary.

Chat template (OpenAI-style messages)::

    <bos> <|user|> words ... <|end|> <|assistant|> right <|end|> <|user|> ... <|assistant|>

Every turn opens with its role token and closes with ``<|end|>``; a generation prompt ends
with ``<|assistant|>`` and the model closes its own turn by emitting ``<|end|>`` (the
engine's stop token). Message text is tokenized by the same regex as everything else, so a
message that literally contains ``<|end|>`` yields the pieces ``<``, ``|``, ``end``, ...:
no text can forge a special token.

``decode`` joins words with single spaces and glues punctuation to its neighbour, a number's
digits, a snake_case name and a quoted string's quotes, so ``decode(encode(t))`` equals ``t``
up to whitespace around punctuation (``12*7`` comes back as ``12 * 7``). The vocabulary is
built deterministically (by count, then alphabetically) and saved as JSON.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

PAD, UNK, BOS, EOS, END = "<pad>", "<unk>", "<bos>", "<eos>", "<|end|>"
ROLES = ("system", "user", "assistant", "tool")
ROLE_TOKENS = {role: f"<|{role}|>" for role in ROLES}
SPECIALS: tuple[str, ...] = (PAD, UNK, BOS, EOS, *ROLE_TOKENS.values(), END)

_PIECE = re.compile(r"\n|[A-Za-z]+|\d|[^\sA-Za-z\d]")
# no space before these, no space after the opening ones (the decoder's only rules)
_CLOSE = set(".,:;!?)]}")
_OPEN = set("([{")
_FORMAT = "word-tokenizer/v1"


class WordTokenizer:
    """Maps text to ids and back; ``encode_chat`` renders an OpenAI-style message list."""

    def __init__(self, words: Iterable[str]):
        vocab = list(SPECIALS)
        seen = set(vocab)
        for w in words:
            if w in seen:
                continue
            if not _is_piece(w):
                raise ValueError(f"{w!r} is not a single piece the tokenizer can produce")
            seen.add(w)
            vocab.append(w)
        self.vocab: list[str] = vocab
        self._ids = {w: i for i, w in enumerate(vocab)}
        self.pad_id, self.unk_id, self.bos_id, self.eos_id, self.end_id = (
            self._ids[t] for t in (PAD, UNK, BOS, EOS, END)
        )
        self.role_ids = {role: self._ids[tok] for role, tok in ROLE_TOKENS.items()}
        self.special_ids = frozenset(range(len(SPECIALS)))

    # -- building
    @classmethod
    def train(
        cls, texts: Iterable[str], *, min_count: int = 1, max_words: int | None = None
    ) -> WordTokenizer:
        """A vocabulary of the pieces in ``texts``: most frequent first, ties alphabetical
        (so the same corpus always gives the same ids, whatever its order)."""
        counts = Counter(p for t in texts for p in tokenize(t))
        ranked = sorted((w for w, n in counts.items() if n >= min_count), key=lambda w: (-counts[w], w))
        return cls(ranked[:max_words] if max_words is not None else ranked)

    # -- text
    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def stop_ids(self) -> frozenset[int]:
        """Tokens that end a generated turn."""
        return frozenset({self.end_id, self.eos_id})

    def token_to_id(self, token: str) -> int:
        return self._ids.get(token, self.unk_id)

    def id_to_token(self, token_id: int) -> str:
        if not 0 <= token_id < len(self.vocab):
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {len(self.vocab)})")
        return self.vocab[token_id]

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(p, self.unk_id) for p in tokenize(text)]

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        out: list[str] = []
        for i in map(int, ids):  # a tensor's 0-d elements are never "in" a set of ints
            tok = self.id_to_token(i)
            if skip_special and i in self.special_ids and i != self.unk_id:
                continue
            out.append(tok)
        return detokenize(out)

    # -- chat
    def encode_chat(self, messages: Sequence[Any], *, add_generation_prompt: bool = True) -> list[int]:
        """``<bos>`` + one ``<|role|> ... <|end|>`` block per message (+ ``<|assistant|>``).

        Messages are dicts or objects with ``role`` and ``content`` (``fabric.Message``);
        ``content=None`` (an assistant turn that only called tools) is an empty turn.
        """
        ids = [self.bos_id]
        for n, m in enumerate(messages):
            role, content = _role_content(m)
            if role not in self.role_ids:
                raise ValueError(f"message {n}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
            ids.append(self.role_ids[role])
            ids.extend(self.encode(content or ""))
            ids.append(self.end_id)
        if add_generation_prompt:
            ids.append(self.role_ids["assistant"])
        return ids

    # -- persistence
    def to_dict(self) -> dict[str, Any]:
        return {"format": _FORMAT, "specials": list(SPECIALS), "vocab": self.vocab[len(SPECIALS) :]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WordTokenizer:
        if data.get("format") != _FORMAT:
            raise ValueError(f"not a {_FORMAT} tokenizer file (format={data.get('format')!r})")
        if list(data.get("specials", [])) != list(SPECIALS):
            # ids of the specials are baked into models trained with them
            raise ValueError(f"tokenizer file has specials {data.get('specials')}, expected {list(SPECIALS)}")
        return cls(data["vocab"])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=0, ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> WordTokenizer:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WordTokenizer) and self.vocab == other.vocab

    def __hash__(self) -> int:
        return hash(tuple(self.vocab))

    def __repr__(self) -> str:
        return f"WordTokenizer(vocab_size={self.vocab_size})"


def tokenize(text: str) -> list[str]:
    """The pieces of ``text``: words, single digits, single marks, newlines."""
    return _PIECE.findall(text)


def detokenize(pieces: Sequence[str]) -> str:
    """The text of ``pieces``: words with single spaces between them, punctuation glued to
    its neighbour, and what the policy must be able to write exactly: a number's digits
    together ("37", "3.5"), a snake_case name ("run_tests"), and a quoted string with its
    quotes against it ('{"tool": "calculator"}' parses as JSON). Digits used to decode
    apart ("Answer: 3 7"), so the tiny policy could not answer with any number above 9."""
    out: list[str] = []
    prev = before = ""
    quoted = False  # inside a "..." opened by the last unmatched quote
    for p in pieces:
        opening = p == '"' and not quoted
        glue = (
            not out
            or prev == "\n"
            or p == "\n"
            or p in _CLOSE
            or prev in _OPEN
            or (p.isdigit() and prev.isdigit())
            or (p.isdigit() and prev == "." and before.isdigit())
            or p == "_"
            or prev == "_"
            or (p == '"' and quoted)  # a closing quote
            or (prev == '"' and quoted)  # the first piece inside the quotes
        )
        out.append(p if glue else " " + p)
        if p == '"':
            quoted = opening
        before, prev = prev, p
    return "".join(out)


def _is_piece(word: str) -> bool:
    return _PIECE.fullmatch(word) is not None


def _role_content(m: Any) -> tuple[str, str | None]:
    if isinstance(m, Mapping):
        return m.get("role", ""), m.get("content")
    return getattr(m, "role", ""), getattr(m, "content", None)
