"""The program's side of assert-style Python tests (run A): once the program's top-level code
ran, answer the tests' requests about its objects (``functions.verifiers.rpc`` has the wire).

This runs in the program's own process, so the program can rewrite any of it; nothing here
is trusted. It only has to be right for an honest program: what the tests believe is
decided in the tests' process, from the values that arrive there.

Stdlib only, like everything the zygote imports.
"""

from __future__ import annotations

import collections
import operator
import traceback
from collections.abc import Callable
from typing import Any

from functions.verifiers import rpc

_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    name: getattr(operator, name)
    for name in (
        *("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul"),
        *("lshift", "rshift", "and_", "or_", "xor"),
        *("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul"),
        *("ilshift", "irshift", "iand", "ior", "ixor"),
        *("eq", "ne", "lt", "le", "gt", "ge", "contains"),
    )
}
_BINARY.update(divmod=divmod, isinstance=isinstance, round=round)
_UNARY: dict[str, Callable[[Any], Any]] = {
    **rpc.NUMERIC_UNARY,
    "bool": bool,
    "len": len,
    "hash": hash,
    "repr": repr,
    "str": str,
    "iter": iter,
    "dir": lambda o: sorted(str(n) for n in dir(o)),
}
_COPIES: dict[type, Callable[[Any], Any]] = {
    bytearray: bytearray.copy,
    list: list.copy,
    dict: dict.copy,
    set: set.copy,
    frozenset: frozenset.copy,
}
#: Unary operations that the tests take from a builtin type's subclass's builtin data
#: (numbers they compute themselves from its data; these spare them a big table's copy).
_ON_DATA = frozenset(("len", "bool", "hash"))
_BASE_TYPES = tuple(rpc.BASES.values())
#: Most values of one global name sent by value with the program's names.
HELLO_ITEMS = 10_000
#: What a mutated argument is sent back as (the tests update their own object in place).
_MUTABLE = (list, dict, set, bytearray, collections.deque)


class Server:
    """The program's objects the tests hold handles to, and the answers to their requests."""

    def __init__(self) -> None:
        self.objects: list[Any] = []  # handle -> object, kept alive so ids stay unique
        self.handles: dict[int, int] = {}  # id(object) -> handle: one object, one handle
        self.raised: dict[int, Exception] = {}  # iterator -> what it raised after a batch

    # -- values --------------------------------------------------------------------------------
    def encode(self, v: Any) -> Any:
        return rpc.Encoder(self._handle, exact=True).encode(v)

    def decode(self, x: Any) -> Any:
        return rpc.Decoder(self._object).decode(x)

    def _handle(self, v: Any) -> Any:
        if rpc.is_module(v):
            return ["m", str(getattr(v, "__name__", "")), self._ref(v)]
        scalar = _numpy_scalar(v)
        if scalar is not None:  # np.int64(6) from np.sum is the tests' 6, not an object
            return self.encode(scalar)
        base = next((name for name, t in rpc.BASES.items() if isinstance(v, t)), None)
        return ["h", self._ref(v), base, type(v).__name__[:100]]

    def _ref(self, v: Any) -> int:
        n = self.handles.get(id(v))
        if n is None:
            n = self.handles[id(v)] = len(self.objects)
            self.objects.append(v)
        return n

    def _object(self, x: list[Any]) -> Any:
        if x[0] != "h" or len(x) != 2 or type(x[1]) is not int:
            raise ValueError(f"not a handle: {x!r:.80}")
        return self.objects[x[1]]

    # -- requests ------------------------------------------------------------------------------
    def hello(self, namespace: dict[str, Any]) -> list[Any]:
        """The program's global names (the tests choose which to bind). Small plain values
        go by value; a big one (a precomputed table of a million primes) as a handle, so
        a program does not pay for sending what its tests may never look at."""
        names = {}
        for name, v in list(namespace.items()):
            if type(name) is str and not (name.startswith("__") and name.endswith("__")):
                try:
                    names[name] = rpc.Encoder(self._handle, exact=True, max_items=HELLO_ITEMS).encode(v)
                except Exception:
                    names[name] = self._handle(v)
        return ["hello", names]

    def answer(self, req: Any) -> list[Any]:
        result: Any = None
        try:
            op, *args = req
            if op == "call":
                f, raw_args, raw_kwargs = args
                pos, named = self.decode(raw_args), self.decode(raw_kwargs)
                result = self.decode(f)(*pos, **named)
                changed = self._changed(raw_args[1], list(pos)) + self._changed(
                    [v for _, v in raw_kwargs[1]], list(named.values()), list(named)
                )
                return ["ok", self.encode(result), changed]
            vals = [self.decode(a) for a in args[1:]]
            name: Any = args[0] if args else None
            if op == "getattr":
                result = getattr(vals[0], name)
            elif op == "setattr":
                setattr(vals[0], name, vals[1])
            elif op == "delattr":
                delattr(vals[0], name)
            elif op == "getitem":
                result = vals[0][vals[1]]
            elif op == "setitem":
                vals[0][vals[1]] = vals[2]
            elif op == "delitem":
                del vals[0][vals[1]]
            elif op == "binary":
                result = _BINARY[name](*vals)
            elif op == "unary":
                result = _UNARY[name](_as_data(vals[0]) if name in _ON_DATA else vals[0])
            elif op == "subclass":  # isinstance(5, Cls): the tests say the type, not the value
                result = issubclass(rpc.PLAIN_TYPES[name], vals[0])
            elif op == "format":
                result = format(vals[0], vals[1])
            elif op == "next":
                result = self._next(*vals)
            elif op == "base":
                result = _base(vals[0])
            else:
                raise ValueError(f"unknown request {op!r}")
            return ["ok", self.encode(result), []]
        except Exception as e:
            return self.error(e)

    def _changed(self, raw: list[Any], now: list[Any], keys: list[str] | None = None) -> list[Any]:
        """The arguments the call mutated, re-encoded (the tests passed copies)."""
        out = []
        for i, (before, v) in enumerate(zip(raw, now, strict=False)):
            if type(v) in _MUTABLE:
                after = self.encode(v)
                if after != before:
                    out.append([keys[i] if keys else i, after])
        return out

    def _next(self, it: Any, n: int) -> list[Any]:
        """Up to ``n`` items of an iterator, and whether it is exhausted. An exception after
        some items is raised at the next request, so no item is lost."""
        if id(it) in self.raised:
            raise self.raised.pop(id(it))
        items: list[Any] = []
        for _ in range(max(1, min(n, 1024))):
            try:
                items.append(next(it))
            except StopIteration:
                return [items, True]
            except Exception as e:
                if not items:
                    raise
                self.raised[id(it)] = e
                break
        return [items, False]

    @staticmethod
    def error(e: BaseException) -> list[Any]:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # from the program's own frames down
        try:
            text = "".join(traceback.format_exception(type(e), e, tb))[-4000:]
        except Exception:
            text = ""
        try:
            message = str(e)[:2000]
        except Exception:
            message = "(unprintable)"
        # the nearest builtin class it derives from, so the tests' ``except ValueError``
        # catches the program's ``class BadInput(ValueError)`` too
        base = next((c.__name__ for c in type(e).__mro__ if c.__module__ == "builtins"), "")
        return ["err", type(e).__name__[:100], message, text, base[:100]]


_SCALARS = (bool, int, float, complex, str, bytes)


def _numpy_scalar(v: Any) -> Any:
    """The Python value of a numpy scalar (``np.int64``, ``np.float64``, ``np.bool_``), or
    None: what an honest numpy solution returns is compared as the number it is (an array
    stays an object of the program). numpy is not imported here: its types say who they are."""
    if type(v).__module__ != "numpy" or getattr(v, "ndim", None) != 0:
        return None
    try:
        x = v.item()
    except Exception:
        return None
    return x if type(x) in _SCALARS else None


def _as_data(v: Any) -> Any:
    """``v``, or its builtin data where its type subclasses a builtin type."""
    return v if type(v) in _BASE_TYPES or not isinstance(v, _BASE_TYPES) else _base(v)


def _base(v: Any) -> Any:
    """The builtin data of an instance of a builtin type's subclass, read with that type's
    own methods (its subclass may override them)."""
    if isinstance(v, bool | int):
        return int.__int__(v)
    if isinstance(v, float):
        return float.__float__(v)
    if isinstance(v, complex):
        return complex(complex.real.__get__(v), complex.imag.__get__(v))  # type: ignore[attr-defined]
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, bytes):
        return bytes.__bytes__(v)  # type: ignore[attr-defined]
    for t, copy in _COPIES.items():
        if isinstance(v, t):
            return copy(v)
    if isinstance(v, tuple):
        return tuple(tuple.__iter__(v))
    raise TypeError(f"{type(v).__name__} subclasses no builtin type")


def serve(namespace: dict[str, Any], fd_in: int, fd_out: int) -> int:
    """Answer requests from ``fd_in`` on ``fd_out`` until the tests are done (EOF). A
    ``SystemExit`` raised by a program function ends the program, as it would anywhere."""
    server = Server()
    rpc.send(fd_out, server.hello(namespace))
    while True:
        req = rpc.recv(fd_in)
        if req is None:
            return 0
        reply = server.answer(req)
        try:
            rpc.send(fd_out, reply)
        except ValueError as e:  # over the frame limit: said instead of the value
            rpc.send(fd_out, Server.error(e))
