"""The wire between a Python program and its assert-style tests, which run in two sandboxes.

    program run (A, untrusted)              supervisor               tests run (B, trusted)
    solution.py's top-level code runs,      relays bytes             test_code runs with the
    then it answers requests:                                        program's names bound to
      fd 3 (requests)     <----------------  B's stdout  <---------  ``Remote`` proxies
      its stdout (answers) --------------->  B's fd 3    --------->

The tests run in a process of their own, so nothing the program does (read a descriptor,
patch builtins, trace frames, exit early) can reach the process whose exit status is the
verdict. They see the program only through the values that cross this channel.

Frames: a 4-byte big-endian length, then a JSON body. Why JSON and not pickle or marshal:
the tests parse what the program sent, and unpickling runs code; decoding here builds only
builtin values and ``Remote`` handles.

Values. Plain data travels by value and arrives as exact builtin types (so the tests'
comparisons are the tests' own C code): None, bool, str and finite floats as JSON; every
other value is a list whose first item is a tag::

    ["i", hex]  a large int        ["f", "nan"|"inf"|"-inf"]    ["c", re, im]  complex
    ["b", b64]  bytes              ["ba", b64]  bytearray
    ["l", [..]] list               ["t", [..]] tuple      ["s", [..]] set    ["fs", [..]] frozenset
    ["d", [[k, v], ..]] dict       ["q", num, den] Fraction   ["D", str] Decimal
    ["sl", start, stop, step]  a slice (``seq[1:3]``)     ["r", start, stop, step]  a range
    ["date", y, m, d]     ["time", h, m, s, us, fold, tz]     ["dt", y, m, d, h, m, s, us, fold, tz]
                          (``tz``: null, or [days, seconds, us, name or null], a fixed-offset
                          ``datetime.timezone``; another tzinfo makes it a handle)
    ["td", days, seconds, us]  a timedelta      ["dq", [..], maxlen or null]  a deque
    ["h", n, base, type]  an object that stays where it is, as handle n (from the program:
                          ``base`` names the builtin type it subclasses, or null)
    ["m", name, n]        a module (the tests bind their own module of that name if they
                          have one loaded, else the handle)

Requests (B to A) are ``[op, *args]``; answers are ``["ok", value, changed]`` (``changed``:
the new values of list/dict/set/bytearray arguments the call mutated, by position or name)
or ``["err", type name, message, traceback]``. The first frame from A is
``["hello", {name: value}]``: the program's global names once its top-level code ran.

JavaScript's pair uses the same framing and exit codes with values of its own
(``functions/verifiers/js/rpc_wire.js``).

Stdlib only: the zygote imports it, and both runs are forks of the zygote.
"""

from __future__ import annotations

import base64
import collections
import datetime
import decimal
import fractions
import json
import math
import operator
import os
import struct
import sys
import types
from collections.abc import Callable
from typing import Any

#: Largest frame either side sends or accepts.
MAX_FRAME = 16 << 20
#: Deepest nesting of containers sent by value (deeper ones stay in the program as handles).
MAX_DEPTH = 100
#: Most values in one frame.
MAX_ITEMS = 1 << 20
#: Ints beyond this travel as hex strings: JSON readers differ on large numbers, and a
#: decimal string of a huge int parses in quadratic time.
BIG = 1 << 63
HEADER = struct.Struct(">I")

#: The tests' exit codes (the verdict is one of them; any other is the tests' own exit).
PASSED = 0
ASSERTION_FAILED = 10
TESTS_RAISED = 11
PROTOCOL_ERROR = 12
PROGRAM_GONE = 13
#: The tests cannot judge any program (they ran nothing, a test needs pytest fixtures, a
#: ``check(candidate)`` has no candidate): the caller's error, not the program's.
TESTS_INVALID = 14
#: JavaScript: the tests ended with a promise of theirs unsettled and nothing left to run
#: (code after an ``await`` on it never ran): they did not run to their end.
UNFINISHED = 15
#: The last line of the tests' stderr when a test the harness ran itself (one the tests
#: defined but never called) failed: this prefix, then the test's name.
IN_COLLECTED = "rlfabric: in the tests' "
#: Beside the test code in its sandbox: the request's options for the harness, as JSON
#: (``{"entry_point": "add"}``); absent when there are none.
TEST_OPTIONS = "tests.json"

#: Builtin types a program's object may subclass; compared with plain data, such an object
#: is compared by its builtin data (``int.__int__`` and the like), never its own ``__eq__``.
BASES: dict[str, type] = {
    t.__name__: t for t in (int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset)
}


class ChannelError(BaseException):
    """The channel to the program is unusable. A ``BaseException``, so that test code's own
    ``except Exception`` cannot swallow it and go on to pass without the program."""


class ProtocolError(ChannelError):
    """The program sent something that is not a frame or value of this protocol."""


class ProgramGone(ChannelError):
    """The program exited, or closed the channel, before it answered."""


# -- frames ------------------------------------------------------------------------------------
def send(fd: int, message: Any) -> None:
    """Write one frame (``ValueError`` if it is over ``MAX_FRAME``; nothing is sent then)."""
    body = json.dumps(message, separators=(",", ":"), allow_nan=False, check_circular=False).encode()
    if len(body) > MAX_FRAME:
        raise ValueError(f"a value of {len(body)} bytes is over the {MAX_FRAME}-byte limit of the channel")
    view = memoryview(HEADER.pack(len(body)) + body)
    while view:
        view = view[os.write(fd, view) :]


def recv(fd: int) -> Any:
    """Read one frame; None at a clean end of the channel (EOF between frames)."""
    head = _read_exactly(fd, HEADER.size, eof_ok=True)
    if head is None:
        return None
    (size,) = HEADER.unpack(head)
    if size > MAX_FRAME:
        raise ProtocolError(f"a frame of {size} bytes announced, over the {MAX_FRAME}-byte limit")
    body = _read_exactly(fd, size, eof_ok=False) or b""
    try:
        return json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, an int too long to parse
        raise ProtocolError(f"a frame that is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None


def _no_constant(name: str) -> Any:
    raise ProtocolError(f"a bare {name} in a frame (non-finite floats are tagged)")


def _read_exactly(fd: int, n: int, eof_ok: bool) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        try:
            chunk = os.read(fd, min(n - len(data), 1 << 20))
        except OSError as e:
            raise ProgramGone(f"reading the channel: {e}") from None
        if not chunk:
            if eof_ok and not data:
                return None
            raise ProgramGone("the channel ended in the middle of a frame")
        data += chunk
    return bytes(data)


# -- values ------------------------------------------------------------------------------------
class Encoder:
    """Turns a value into its JSON form. ``handle`` is what happens to anything that is not
    plain data: the program keeps it and sends a handle; the tests send the handles of the
    program's own objects and refuse anything else. ``exact``: only exact builtin types are
    plain (the program's side: a subclass keeps its behaviour as a handle); otherwise
    subclasses travel as their builtin base (the tests' side, whose values are trusted)."""

    def __init__(self, handle: Callable[[Any], Any], exact: bool, max_items: int = MAX_ITEMS) -> None:
        self.handle = handle
        self.exact = exact
        self.items = 0
        self.max_items = max_items

    def encode(self, v: Any, depth: int = 0) -> Any:
        self.items += 1
        if self.items > self.max_items:
            raise ValueError(f"more than {self.max_items} values to send at once")
        t = type(v) if self.exact else plain_type(v)
        if v is None:
            return None
        if t is bool:
            return v  # bool has no subclasses
        if t is str:
            return str.__str__(v)
        if t is int:
            n = int.__int__(v)
            return n if -BIG < n < BIG else ["i", format(n, "x")]
        if t is float:
            x = float.__float__(v)
            return x if math.isfinite(x) else ["f", repr(x)]
        if t is complex:
            c = complex(complex.real.__get__(v), complex.imag.__get__(v))  # type: ignore[attr-defined]
            return ["c", self.encode(c.real, depth), self.encode(c.imag, depth)]
        if t is bytes or t is bytearray:
            return ["b" if t is bytes else "ba", base64.b64encode(bytes(v)).decode()]
        if t is fractions.Fraction:
            return ["q", self.encode(v.numerator), self.encode(v.denominator)]
        if t is decimal.Decimal:
            return ["D", str(v)]
        if type(v) is slice:  # for items: seq[1:3]
            return ["sl", *(self.encode(x, depth + 1) for x in (v.start, v.stop, v.step))]
        if (t is not dict and t not in _TAGS) or depth >= MAX_DEPTH:
            special = _SPECIAL.get(t) if t is not None and depth < MAX_DEPTH else None
            encoded = special(self, v, depth + 1) if special is not None else None
            return self.handle(v) if encoded is None else encoded
        d = depth + 1
        if t is dict:
            return ["d", [[self.encode(k, d), self.encode(x, d)] for k, x in dict.items(v)]]
        tag = _TAGS[t]
        return [tag, [self.encode(x, d) for x in t.__iter__(v)]]  # type: ignore[attr-defined]


_TAGS: dict[type, str] = {list: "l", tuple: "t", set: "s", frozenset: "fs"}


def _tz(tz: Any) -> Any:
    """A datetime's or time's tzinfo: null, or a fixed-offset ``datetime.timezone`` as its
    offset and name; ``...`` for any other (its value then stays where it is)."""
    if tz is None:
        return None
    if type(tz) is not datetime.timezone:
        return ...
    offset, *name = tz.__getinitargs__()  # type: ignore[attr-defined]
    return [offset.days, offset.seconds, offset.microseconds, str(name[0]) if name else None]


def _encode_time(e: Encoder, v: Any, d: int) -> Any:
    tz = _tz(v.tzinfo)
    if tz is ...:
        return None
    return ["time", v.hour, v.minute, v.second, v.microsecond, v.fold, tz]


def _encode_datetime(e: Encoder, v: Any, d: int) -> Any:
    tz = _tz(v.tzinfo)
    if tz is ...:
        return None
    return ["dt", v.year, v.month, v.day, v.hour, v.minute, v.second, v.microsecond, v.fold, tz]


_deque_items = collections.deque.__iter__


#: Value types of the standard library that travel by value (their encoders return None for a
#: value that cannot: a datetime with a tzinfo of its own).
_SPECIAL: dict[type, Callable[[Encoder, Any, int], Any]] = {
    range: lambda e, v, d: ["r", e.encode(v.start, d), e.encode(v.stop, d), e.encode(v.step, d)],
    datetime.date: lambda e, v, d: ["date", v.year, v.month, v.day],
    datetime.time: _encode_time,
    datetime.datetime: _encode_datetime,
    datetime.timedelta: lambda e, v, d: ["td", v.days, v.seconds, v.microseconds],
    collections.deque: lambda e, v, d: ["dq", [e.encode(x, d) for x in _deque_items(v)], v.maxlen],
}
_PLAIN_ORDER = (
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    bytearray,
    list,
    tuple,
    dict,
    set,
    frozenset,
    fractions.Fraction,
    decimal.Decimal,
    range,
    datetime.datetime,  # before date, its base
    datetime.date,
    datetime.time,
    datetime.timedelta,
    collections.deque,
)
#: The plain types by name (``isinstance(5, Cls)`` with a class of the program asks it
#: ``issubclass(int, Cls)``: the name of the type, never the tests' value).
PLAIN_TYPES: dict[str, type] = {t.__name__: t for t in (type(None), *_PLAIN_ORDER)}


def plain_type(v: Any) -> type | None:
    """The plain type ``v`` is an instance of (its base, for a subclass), or None."""
    if v is None:
        return type(None)
    return next((t for t in _PLAIN_ORDER if isinstance(v, t)), None)


class Decoder:
    """Turns the JSON form back into values. Anything malformed is a ``ProtocolError``.
    ``handle`` makes the object for ``["h", ...]`` / ``["m", ...]``."""

    def __init__(self, handle: Callable[[list[Any]], Any]) -> None:
        self.handle = handle
        self.items = 0

    def decode(self, x: Any, depth: int = 0) -> Any:
        self.items += 1
        if self.items > MAX_ITEMS:
            raise ProtocolError(f"more than {MAX_ITEMS} values in one frame")
        t = type(x)
        if x is None or t is bool or t is str or t is int or t is float:
            return x
        if t is not list or not x or type(x[0]) is not str:
            raise ProtocolError(f"not a value of this protocol: {_brief(x)}")
        if depth > MAX_DEPTH:
            raise ProtocolError(f"values nested deeper than {MAX_DEPTH}")
        tag, args = x[0], x[1:]
        try:
            return self._tagged(tag, args, depth + 1)
        except (TypeError, ValueError, KeyError, IndexError, ArithmeticError, decimal.InvalidOperation) as e:
            raise ProtocolError(f"a malformed {tag!r} value ({type(e).__name__}: {str(e)[:200]})") from None

    def _tagged(self, tag: str, args: list[Any], d: int) -> Any:
        if tag in ("h", "m"):
            return self.handle([tag, *args])
        if tag in ("c", "q"):
            a, b = _arity(tag, args, 2)
            x, y = self.decode(a, d), self.decode(b, d)
            if tag == "c":
                if type(x) is not float or type(y) is not float:
                    raise TypeError("the parts of a complex must be floats")
                return complex(x, y)
            if type(x) is not int or type(y) is not int:
                raise TypeError("the parts of a Fraction must be ints")
            return fractions.Fraction(x, y)
        if tag == "sl":
            return slice(*(self.decode(a, d) for a in _arity(tag, args, 3)))
        if tag in _STDLIB_TAGS:
            return self._stdlib(tag, args, d)
        (arg,) = _arity(tag, args, 1)
        if tag == "i":
            return int(_str(arg), 16)
        if tag == "f":
            if arg not in ("nan", "inf", "-inf"):
                raise ValueError(f"{_brief(arg)} is not a non-finite float")
            return float(arg)
        if tag in ("b", "ba"):
            raw = base64.b64decode(_str(arg), validate=True)
            return raw if tag == "b" else bytearray(raw)
        if tag == "D":
            return decimal.Decimal(_str(arg))
        if tag in _CONTAINERS:
            return _CONTAINERS[tag](self.decode(v, d) for v in _list(arg))
        if tag == "d":
            return dict(self._pair(p, d) for p in _list(arg))
        raise ValueError(f"unknown tag {tag!r}")

    def _stdlib(self, tag: str, args: list[Any], d: int) -> Any:
        """The standard library's value types, rebuilt by their own constructors (which
        check each field's range) from exact ints."""
        if tag == "r":
            start, stop, step = (_int(self.decode(a, d)) for a in _arity(tag, args, 3))
            return range(start, stop, step)
        if tag == "date":
            return datetime.date(*_ints(_arity(tag, args, 3)))
        if tag == "time":
            *fields, tz = _arity(tag, args, 6)
            h, m, s, us, fold = _ints(fields)
            return datetime.time(h, m, s, us, _timezone(tz), fold=fold)
        if tag == "dt":
            *fields, tz = _arity(tag, args, 9)
            y, mo, day, h, m, s, us, fold = _ints(fields)
            return datetime.datetime(y, mo, day, h, m, s, us, _timezone(tz), fold=fold)
        if tag == "td":
            return _timedelta(args)
        if tag == "dq":
            items, maxlen = _arity(tag, args, 2)
            values = [self.decode(v, d) for v in _list(items)]
            if maxlen is not None and (type(maxlen) is not int or not 0 <= maxlen or len(values) > maxlen):
                raise ValueError(f"a deque of {len(values)} items with a maxlen of {_brief(maxlen)}")
            return collections.deque(values, maxlen)
        raise AssertionError(tag)  # unreachable: _STDLIB_TAGS lists the tags above

    def _pair(self, p: Any, d: int) -> tuple[Any, Any]:
        k, v = _arity("d", _list(p), 2)
        return self.decode(k, d), self.decode(v, d)


_CONTAINERS: dict[str, type] = {"l": list, "t": tuple, "s": set, "fs": frozenset}
_STDLIB_TAGS = frozenset(("r", "date", "time", "dt", "td", "dq"))


def _arity(tag: str, args: list[Any], n: int) -> list[Any]:
    if len(args) != n:
        raise ValueError(f"{len(args)} fields instead of {n}")
    return args


def _int(x: Any) -> int:
    if type(x) is not int:
        raise TypeError(f"expected an int, got {_brief(x)}")
    return x


def _ints(xs: list[Any]) -> list[int]:
    return [_int(x) for x in xs]


def _timedelta(fields: list[Any]) -> datetime.timedelta:
    """A timedelta from its normalized fields (as ``days``, ``seconds``, ``microseconds``
    hold them: seconds below a day, microseconds below a second)."""
    days, seconds, us = _ints(_arity("td", fields, 3))
    if not (0 <= seconds < 86_400 and 0 <= us < 1_000_000):
        raise ValueError("a timedelta's seconds or microseconds out of their range")
    return datetime.timedelta(days, seconds, us)


def _timezone(x: Any) -> datetime.timezone | None:
    if x is None:
        return None
    *offset, name = _arity("tz", _list(x), 4)
    if name is not None:
        return datetime.timezone(_timedelta(offset), _str(name))
    return datetime.timezone(_timedelta(offset))


def _str(x: Any) -> str:
    if type(x) is not str:
        raise TypeError(f"expected a string, got {_brief(x)}")
    return x


def _list(x: Any) -> list[Any]:
    if type(x) is not list:
        raise TypeError(f"expected a list, got {_brief(x)}")
    return x


def _brief(x: Any) -> str:
    text = json.dumps(x)[:80] if type(x) in (list, dict, str, int, float, bool) or x is None else "?"
    return text


#: The numeric unary operations, by their name on the wire: the program's server applies
#: them to its objects, the tests to a builtin subclass's data (its own methods unasked).
NUMERIC_UNARY: dict[str, Callable[[Any], Any]] = {
    "neg": operator.neg,
    "pos": operator.pos,
    "abs": abs,
    "invert": operator.invert,
    "index": operator.index,
    "int": int,
    "float": float,
    "complex": complex,
    "round": round,
}


def is_module(v: Any) -> bool:
    return type(v) is types.ModuleType


def loaded_module(name: Any) -> Any:
    """The tests' own module ``name`` if they have it loaded (never imported on the program's
    word: an import runs code), else None."""
    return sys.modules.get(name) if type(name) is str else None
