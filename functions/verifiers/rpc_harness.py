"""The tests' side of assert-style Python tests (run B): run ``test_code`` with the program's
names bound to ``Remote`` proxies of its objects, in a process the program cannot reach.

The verdict is this process's exit status (``rpc.PASSED`` once ``test_code`` ran to its
end, and then the tests it defined but did not call: ``rpc_collect``). Plain data comes
back from the program by value, as exact builtin types, so ``assert f(2) == 4`` is decided
by this process's own ``int.__eq__``. The rule for the program's other objects (a
``Remote``):

* a value of the tests never reaches the program through a comparison, an operator or
  ``in``, where it would let the program answer whatever passes (``abs(f(x) - y) < 1e-9``
  with a ``__sub__`` that returns 0). With plain data, a program object is never equal and
  not ordered (an object of a builtin type would have arrived by value); a subclass of a
  builtin type (a namedtuple, a ``Counter``, an ``int`` subclass) is compared, combined by
  operators (``-``, ``//``, ``round(x, 2)``, ``abs``, ``-x``, ``int()``, ``float()``) and
  searched (``in``) as its builtin data, fetched with that type's own methods and computed
  here (its ``len``, ``bool`` and ``hash``, which show the program no value, are computed
  there from that data: a big table is not copied for its length); another object's
  operator with a value of the tests is refused (``TypeError``), and ``y in obj`` compares
  here each item its iteration yields; ``isinstance(5, Cls)`` tells the program the type
  ``int``, not the value;
* between two program objects (``P(1) == P(1)``, ``V(1, 2) + V(3, 4)``) it is the program's
  own methods that decide: a test that combines two of the program's objects trusts its
  classes, as do its unary operations on an object of its own (``abs(v)``, ``len(v)``:
  they show it no value of the tests; ``int()``, ``float()``, ``len`` and the like must
  answer with that type);
* everything else (calls, attributes, items, iteration, ``repr``) runs the program's code,
  in the program's sandbox, and what comes back is data.

Arguments go to the program by value (a list/dict/set/bytearray/deque the call mutated is
updated in place here after the call); a function of the tests cannot be passed. Stdlib
only, like everything the zygote imports.
"""

from __future__ import annotations

import builtins
import collections
import operator
import os
import sys
import threading
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from functions.verifiers import rpc, rpc_collect
from functions.verifiers.rpc_errors import RemoteError as RemoteError
from functions.verifiers.rpc_errors import program_exception
from functions.verifiers.rpc_unittest import (
    empty_runs,
    run_failures,
    tests_ran,
    watch_doctest,
    watch_unittest,
)

#: What the tests hold by value (their own subclasses included: the tests are trusted).
_PLAIN = tuple(rpc.PLAIN_TYPES.values())
_COMPARE: dict[str, Callable[[Any, Any], Any]] = {
    op: getattr(operator, op) for op in ("eq", "ne", "lt", "le", "gt", "ge")
}
#: Names that, in test code, mean a module (`np.allclose`, `pytest.approx`): bound only to the
#: tests' own module, never to a program's object of that name.
_MODULE_ALIASES = frozenset(
    "np numpy pd pandas plt mpl matplotlib sp scipy sympy nx networkx torch tf pytest".split()
)
#: Names the program may not rebind for the tests: its own ``abs = lambda x: 0`` must not
#: turn ``assert abs(f(x) - 0.5) < 1e-9`` into a pass.
_BUILTIN_NAMES = frozenset(vars(builtins))


class Unsendable(TypeError):
    """A value of the tests that cannot go to the program (a function, an object of a class
    of the tests)."""


class Connection:
    """The tests' end of the channel. One request at a time (a lock, for tests with
    threads); once broken (the program gone, or a malformed frame) it stays broken."""

    def __init__(self, fd_in: int, fd_out: int) -> None:
        self.fd_in = fd_in
        self.fd_out = fd_out
        self.lock = threading.RLock()
        self.remotes: dict[int, Remote] = {}
        self.broken: rpc.ChannelError | None = None

    def hello(self) -> dict[str, Any]:
        """The program's global names and their values, once its top-level code ran."""
        with self.lock:
            try:
                msg = rpc.recv(self.fd_in)
                if msg is None:
                    raise rpc.ProgramGone("the program exited before its top-level code ran to its end")
                if type(msg) is not list or len(msg) != 2 or msg[0] != "hello" or type(msg[1]) is not dict:
                    raise rpc.ProtocolError("the program's first frame is not its list of names")
                return {name: self.decode(v) for name, v in msg[1].items()}
            except rpc.ChannelError as e:
                self.broken = e
                raise

    def request(self, op: str, *args: Any) -> tuple[Any, list[Any]]:
        """Ask the program; its answer, and the arguments a call mutated (raw)."""
        frame = [op, *(self.encode(a) for a in args)]  # before the lock: may be Unsendable
        with self.lock:
            if self.broken is not None:
                raise type(self.broken)(*self.broken.args)
            try:
                try:
                    rpc.send(self.fd_out, frame)
                except OSError as e:  # the program's end of the channel is gone
                    raise rpc.ProgramGone(f"writing to the program: {e}") from None
                reply = rpc.recv(self.fd_in)
                if reply is None:
                    raise rpc.ProgramGone("the program exited (or closed the channel) before it answered")
                if type(reply) is list and len(reply) == 3 and reply[0] == "ok" and type(reply[2]) is list:
                    return self.decode(reply[1]), reply[2]
                if not (type(reply) is list and len(reply) in (4, 5) and reply[0] == "err"):
                    raise rpc.ProtocolError("an answer that is neither ok nor err")
                if not all(type(x) is str for x in reply[1:]):
                    raise rpc.ProtocolError("an error whose fields are not strings")
            except rpc.ChannelError as e:
                self.broken = e
                raise
        raise program_exception(*reply[1:])  # the program's own exception: the channel is fine

    def fail(self, message: str) -> rpc.ProtocolError:
        self.broken = rpc.ProtocolError(message)
        return self.broken

    def encode(self, v: Any) -> Any:
        if type(v) is Remote:  # the usual first argument of a request: no encoder needed
            return ["h", object.__getattribute__(v, "_rlf_n")]
        return rpc.Encoder(self._send_handle, exact=False).encode(v)

    def decode(self, x: Any) -> Any:
        return rpc.Decoder(self._remote).decode(x)

    @staticmethod
    def _send_handle(v: Any) -> list[Any]:
        if isinstance(v, Remote):
            return ["h", object.__getattribute__(v, "_rlf_n")]
        if isinstance(v, _PLAIN):
            raise Unsendable(f"a value nested deeper than {rpc.MAX_DEPTH} cannot be sent to the program")
        raise Unsendable(
            f"cannot pass {type(v).__name__} {v!r:.60} to the program: only plain values (None, bool, "
            "int, float, complex, str, bytes, list, tuple, dict, set, frozenset, Fraction, Decimal, "
            "range, deque, date, time, datetime with a fixed-offset timezone, timedelta) and the "
            "program's own objects cross to its sandbox"
        )

    def _remote(self, x: list[Any]) -> Any:
        if x[0] == "m" and len(x) == 3:  # a module: the tests' own, if they have it loaded
            module = rpc.loaded_module(x[1])
            if module is not None:
                return module
            x = ["h", x[2], None, "module"]
        if len(x) != 4 or type(x[1]) is not int or x[1] < 0 or type(x[3]) is not str:
            raise rpc.ProtocolError("a malformed handle")
        if x[2] is not None and x[2] not in rpc.BASES:
            raise rpc.ProtocolError(f"a handle whose base {x[2]!r:.40} is not a builtin type")
        remote = self.remotes.get(x[1])
        if remote is None:
            remote = self.remotes[x[1]] = Remote(x[1], x[2], x[3])
        return remote


def _ask(op: str, *args: Any) -> Any:
    return Remote._conn.request(op, *args)[0]


def _typed(value: Any, t: type, what: str) -> Any:
    if type(value) is not t:
        raise Remote._conn.fail(f"the program answered {what} with a {type(value).__name__}")
    return value


class Remote:
    """One of the program's objects, which stays in the program's sandbox (see the module
    docstring for what is asked of the program and what is decided here)."""

    __slots__ = ("_rlf_base", "_rlf_n", "_rlf_type")
    _conn: ClassVar[Connection]

    def __init__(self, n: int, base: str | None, type_name: str) -> None:
        object.__setattr__(self, "_rlf_n", n)
        object.__setattr__(self, "_rlf_base", base)
        object.__setattr__(self, "_rlf_type", type_name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        value, changed = Remote._conn.request("call", self, args, kwargs)
        for item in changed:
            _update(args, kwargs, item)
        return value

    def __getattr__(self, name: str) -> Any:
        # special names are protocols the tests' libraries look up on an object (numpy's
        # __array_interface__ takes a raw pointer from it): none is the program's to answer
        if name.startswith("_rlf_") or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(name)
        return _ask("getattr", name, self)

    def __setattr__(self, name: str, value: Any) -> None:
        _ask("setattr", name, self, value)

    def __delattr__(self, name: str) -> None:
        _ask("delattr", name, self)

    def __getitem__(self, key: Any) -> Any:
        return _ask("getitem", None, self, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        _ask("setitem", None, self, key, value)

    def __delitem__(self, key: Any) -> None:
        _ask("delitem", None, self, key)

    def __len__(self) -> int:
        return _typed(_ask("unary", "len", self), int, "len()")  # type: ignore[no-any-return]

    def __bool__(self) -> bool:
        return _typed(_ask("unary", "bool", self), bool, "bool()")  # type: ignore[no-any-return]

    def __hash__(self) -> int:
        return _typed(_ask("unary", "hash", self), int, "hash()")  # type: ignore[no-any-return]

    def __index__(self) -> int:
        return self._unary("index", int)  # type: ignore[no-any-return]

    def __int__(self) -> int:
        return self._unary("int", int)  # type: ignore[no-any-return]

    def __float__(self) -> float:
        return self._unary("float", float)  # type: ignore[no-any-return]

    def __complex__(self) -> complex:
        return self._unary("complex", complex)  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        try:
            return _typed(_ask("unary", "repr", self), str, "repr()")  # type: ignore[no-any-return]
        except Exception:  # in an assert's message or a traceback: say what it is, at least
            return f"<{object.__getattribute__(self, '_rlf_type')} object of the program>"

    def __str__(self) -> str:
        return _typed(_ask("unary", "str", self), str, "str()")  # type: ignore[no-any-return]

    def __format__(self, spec: str) -> str:
        return _typed(_ask("format", None, self, spec), str, "format()")  # type: ignore[no-any-return]

    def __dir__(self) -> list[str]:
        names = _typed(_ask("unary", "dir", self), list, "dir()")
        return [_typed(n, str, "dir()") for n in names]

    def __contains__(self, item: Any) -> bool:
        if isinstance(item, Remote):  # two of the program's objects: its own __contains__
            return _typed(_ask("binary", "contains", self, item), bool, "in")  # type: ignore[no-any-return]
        if object.__getattribute__(self, "_rlf_base") is not None:
            return item in _data(self)
        # never asked of the program, which would see the tests' value: its items are
        # fetched and each compared here, as `in` does for an object with no __contains__
        try:
            it = _ask("unary", "iter", self)
        except TypeError:
            why = " (it is not iterable, and its __contains__ is not asked)"
            raise TypeError(_refusal(self, "in", item, True, why, "list(x), set(x)")) from None
        if not isinstance(it, Remote):
            raise Remote._conn.fail("the program answered iter() with a value, not an iterator")
        return any(x is item or x == item for x in _items(it))

    def __instancecheck__(self, obj: Any) -> bool:
        if isinstance(obj, Remote):
            return _typed(_ask("binary", "isinstance", obj, self), bool, "isinstance()")  # type: ignore[no-any-return]
        t = rpc.plain_type(obj)  # the program is told the value's type, never the value
        if t is None:
            raise Unsendable(f"cannot ask a class of the program about a {type(obj).__name__} of the tests")
        return _typed(_ask("subclass", t.__name__, self), bool, "isinstance()")  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[Any]:
        it = _ask("unary", "iter", self)
        if not isinstance(it, Remote):
            raise Remote._conn.fail("the program answered iter() with a value, not an iterator")
        return _items(it)

    def __next__(self) -> Any:
        items, _ = _batch(self, 1)
        if not items:
            raise StopIteration
        return items[0]

    def __round__(self, ndigits: Any = None) -> Any:
        if object.__getattribute__(self, "_rlf_base") is not None:
            data = _data(self)
            return round(data) if ndigits is None else round(data, ndigits)
        if ndigits is None:
            return _ask("unary", "round", self)
        return _ask("binary", "round", self, ndigits)  # a number of digits, not a value to match

    def __neg__(self) -> Any:
        return self._unary("neg")

    def __pos__(self) -> Any:
        return self._unary("pos")

    def __abs__(self) -> Any:
        return self._unary("abs")

    def __invert__(self) -> Any:
        return self._unary("invert")

    def _unary(self, name: str, t: type | None = None) -> Any:
        """A numeric unary operation: on a builtin type's subclass, the tests' own on its
        data; on another object of the program, its own (it sees no value of the tests), and
        ``int()``, ``float()``, ``complex()`` and an index must answer with that type."""
        if object.__getattribute__(self, "_rlf_base") is not None:
            return _UNARY[name](_data(self))
        value = _ask("unary", name, self)
        return value if t is None else _typed(value, t, f"{name}()")

    def __eq__(self, other: object) -> Any:
        return self._compare(other, "eq")

    def __ne__(self, other: object) -> Any:
        return self._compare(other, "ne")

    def __lt__(self, other: object) -> Any:
        return self._compare(other, "lt")

    def __le__(self, other: object) -> Any:
        return self._compare(other, "le")

    def __gt__(self, other: object) -> Any:
        return self._compare(other, "gt")

    def __ge__(self, other: object) -> Any:
        return self._compare(other, "ge")

    def _compare(self, other: object, op: str) -> Any:
        if isinstance(other, Remote):  # two of the program's objects: its own __eq__ decides
            return _ask("binary", op, self, other)
        if not isinstance(other, _PLAIN):  # the tests' own object: let it decide (or identity)
            return NotImplemented
        if object.__getattribute__(self, "_rlf_base") is None:
            # a program object is never equal to plain data, nor ordered with it
            return {"eq": False, "ne": True}.get(op, NotImplemented)
        return _COMPARE[op](_data(self), other)


def _data(remote: Remote) -> Any:
    """The builtin data of a program object whose type subclasses a builtin type, read there
    with that type's own methods (``int.__int__``, ``list.copy``), never its overrides."""
    base = object.__getattribute__(remote, "_rlf_base")
    return _typed(_ask("base", None, remote), rpc.BASES[base], "its builtin data")


#: What the tests compute themselves on a builtin subclass's data.
_UNARY = rpc.NUMERIC_UNARY
_SYMBOLS = {
    **{"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%", "pow": "**"},
    **{"matmul": "@", "lshift": "<<", "rshift": ">>", "and_": "&", "or_": "|", "xor": "^"},
}


def _refusal(remote: Remote, symbol: str, other: Any, reflected: bool, why: str = "", hint: str = "") -> str:
    mine = f"the program's {object.__getattribute__(remote, '_rlf_type')}"
    theirs = f"the tests' {type(other).__name__}"
    expr = f"{theirs} {symbol} {mine}" if reflected else f"{mine} {symbol} {theirs}"
    return (
        f"not computed: {expr}{why}: the program would see the tests' value and could answer "
        f"anything; convert its object to plain data first ({hint or 'float(x), int(x), list(x)'}), "
        "or combine it only with the program's own objects"
    )


def _symbol(name: str) -> str:
    if name in _SYMBOLS or name == "divmod":
        return _SYMBOLS.get(name, name)
    plain = name[1:]  # iadd, iand
    return _SYMBOLS.get(plain, _SYMBOLS.get(f"{plain}_", plain)) + "="


def _binary(name: str, reflected: bool = False) -> Callable[[Remote, Any], Any]:
    """An arithmetic operator. Between two of the program's objects: the program's own. With
    a value of the tests: computed here on a builtin subclass's data, else refused (sent to
    the program, the value would let it answer whatever passes: ``abs(f(x) - y) < 1e-9``)."""
    compute: Callable[[Any, Any], Any] = divmod if name == "divmod" else getattr(operator, name)
    symbol = _symbol(name)

    def method(self: Remote, other: Any) -> Any:
        if isinstance(other, Remote):
            return _ask("binary", name, *((other, self) if reflected else (self, other)))
        if not isinstance(other, _PLAIN):  # the tests' own object: let it decide
            return NotImplemented
        if object.__getattribute__(self, "_rlf_base") is None:
            raise TypeError(_refusal(self, symbol, other, reflected))
        data = _data(self)
        return compute(other, data) if reflected else compute(data, other)

    return method


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "lshift", "rshift"):
    setattr(Remote, f"__{_name}__", _binary(_name))
    setattr(Remote, f"__r{_name}__", _binary(_name, reflected=True))
    setattr(Remote, f"__i{_name}__", _binary(f"i{_name}"))
for _name, _op in (("and", "and_"), ("or", "or_"), ("xor", "xor")):  # operator's names
    setattr(Remote, f"__{_name}__", _binary(_op))
    setattr(Remote, f"__r{_name}__", _binary(_op, reflected=True))
    setattr(Remote, f"__i{_name}__", _binary(f"i{_name}"))
setattr(Remote, "__divmod__", _binary("divmod"))  # noqa: B010 (like the loops above)
setattr(Remote, "__rdivmod__", _binary("divmod", reflected=True))  # noqa: B010


def _batch(it: Remote, n: int) -> tuple[list[Any], bool]:
    answer = _ask("next", None, it, n)
    if type(answer) is not list or len(answer) != 2 or type(answer[0]) is not list:
        raise Remote._conn.fail("the program answered next() with something else than [items, done]")
    return answer[0], _typed(answer[1], bool, "next()")


def _items(it: Remote) -> Iterator[Any]:
    """A program iterator's items, fetched in growing batches (a round trip per item would
    make ``list(gen())`` of a long generator slow; one big batch would run an endless one
    forever)."""
    n = 1
    while True:
        items, done = _batch(it, n)
        yield from items
        if done:
            return
        n = min(2 * n, 1024)


def _update(args: tuple[Any, ...], kwargs: dict[str, Any], item: Any) -> None:
    """Mirror the program's in-place change of an argument (``nums.sort()``, ``grid[0][0] = 1``)
    on the tests' own object, which went over as a copy."""
    if type(item) is not list or len(item) != 2:
        raise Remote._conn.fail("a malformed list of mutated arguments")
    key, raw = item
    if type(key) is int and 0 <= key < len(args):
        target = args[key]
    elif type(key) is str and key in kwargs:
        target = kwargs[key]
    else:
        raise Remote._conn.fail(f"a mutated argument {key!r:.40} that was not passed")
    new: Any = Remote._conn.decode(raw)
    # the tests' object may be a subclass (a Counter, an OrderedDict): it went over as its
    # builtin data, which is what comes back; its own methods write it back (the tests' own
    # class: trusted, and an OrderedDict keeps its order only through them)
    base: Any
    for base in (bytearray, list, collections.deque, dict, set):
        if isinstance(target, base):
            break
    else:
        raise Remote._conn.fail(f"a mutated argument of a type that cannot change ({type(target).__name__})")
    if type(new) is not base:
        raise Remote._conn.fail(f"a mutated argument that changed type ({type(new).__name__})")
    if base is bytearray or base is list:
        target[:] = new
    elif base is collections.deque:
        target.clear()
        target.extend(new)
    else:
        target.clear()
        target.update(new)


def run_tests(source: str, entry: str, fd_in: int, fd_out: int) -> int:
    """Run the tests against the program on the other end of ``fd_in``/``fd_out``; the
    exit code is the verdict (``rpc.PASSED`` and friends). Messages go to stderr."""
    conn = Remote._conn = Connection(fd_in, fd_out)
    try:
        names = conn.hello()
    except rpc.ChannelError as e:
        return _channel_failed(e)
    # a real __main__ module, so unittest.main(), doctest and pickle find the tests' own
    # classes and functions (in a bare dict they found none: "Ran 0 tests ... OK")
    main = types.ModuleType("__main__")
    namespace = main.__dict__
    program = {name: value for name, value in names.items() if _bindable(name, value)}
    namespace.update(program)
    # the harness's own names last: the program's hello may not rebind them (a program's
    # "__builtins__" would become the tests' builtins: abs, set, sorted, all of its making)
    namespace.update(__name__="__main__", __builtins__=builtins, __file__=os.path.abspath(entry))
    sys.modules["__main__"] = main
    runs = watch_unittest()
    doctests = watch_doctest() if "doctest" in source else []
    try:
        compiled, plan = rpc_collect.prepare(source, entry)
        namespace[rpc_collect.RAN] = plan.ran
        exec(compiled, namespace)
        code = rpc.PASSED
    except rpc.ChannelError as e:
        return _channel_failed(e)
    except rpc_collect.Unrunnable as e:  # (prepare's: the text does not compile) no program's fault
        print(e, file=sys.stderr)
        return rpc.TESTS_INVALID
    except SystemExit as e:  # the tests' own exit: trusted, like the rest of them
        # 0 or None is a pass (unittest.main() exits with False when it succeeded)
        if e.code is None or (type(e.code) in (int, bool) and not e.code):
            code = rpc.PASSED  # (and the unittest runs below)
        elif failed := run_failures(runs, doctests):  # unittest.main() exits True: a test failed
            print(failed, file=sys.stderr)
            code = rpc.ASSERTION_FAILED
        elif empty := empty_runs(runs, doctests):  # (from Python 3.12, 5: no test ran)
            print(empty, file=sys.stderr)
            code = rpc.TESTS_INVALID
        else:
            print(f"the tests exited with {e.code!r}", file=sys.stderr)
            code = rpc.TESTS_RAISED
    except BaseException as e:
        _print_from_tests(e)
        code = rpc.ASSERTION_FAILED if isinstance(e, AssertionError) else rpc.TESTS_RAISED
    if conn.broken is not None:  # swallowed by a bare except of the tests: still no pass
        return _channel_failed(conn.broken)
    if code != rpc.PASSED:  # (a pass ran the text: prepare made its plan)
        return code
    if failed := run_failures(runs, doctests):
        print(failed, file=sys.stderr)
        return rpc.ASSERTION_FAILED
    if empty := empty_runs(runs, doctests):
        print(empty, file=sys.stderr)
        return rpc.TESTS_INVALID
    return _run_collected(plan, namespace, program, entry, runs, doctests)


def _run_collected(
    plan: rpc_collect.Plan,
    namespace: dict[str, Any],
    program: dict[str, Any],
    entry: str,
    runs: list[Any],
    doctests: list[tuple[str, int, int]],
) -> int:
    """Once the text ran to its end: the tests it defined and did not run (``rpc_collect``),
    then the rule that it must have tested something. A failure in one of them is the
    case's, and the last line of stderr names it (``rpc.IN_COLLECTED``)."""
    current = ""
    try:
        for current, call in rpc_collect.pending(plan, namespace, program, entry, runs):
            if current not in plan.ran:  # (each test notes its own call in plan.ran)
                call()
        if not (plan.acts or plan.ran or tests_ran(runs, doctests)):
            raise rpc_collect.Unrunnable(f"they ran nothing: {rpc_collect.HINT}")
    except rpc_collect.Unrunnable as e:
        print(e, file=sys.stderr)
        return rpc.TESTS_INVALID
    except rpc.ChannelError as e:
        return _channel_failed(e)
    except BaseException as e:
        _print_from_tests(e, entry)
        if current:
            print(f"{rpc.IN_COLLECTED}{current}", file=sys.stderr)
        return rpc.ASSERTION_FAILED if isinstance(e, AssertionError) else rpc.TESTS_RAISED
    if Remote._conn.broken is not None:
        return _channel_failed(Remote._conn.broken)
    if failed := run_failures(runs, doctests):
        print(failed, file=sys.stderr)
        return rpc.ASSERTION_FAILED
    return rpc.PASSED


def _bindable(name: object, value: Any) -> bool:
    """May the program's global ``name`` be bound for the tests? Not a builtin's name (its
    ``abs = lambda x: 0``), not a special name (``__builtins__``), and a standard-library
    module's name only for that module itself (its ``math = FakeMath()`` must not answer
    the tests' ``math.isclose`` when they forgot to import it)."""
    if type(name) is not str or not name.isidentifier() or name in _BUILTIN_NAMES:
        return False
    if name.startswith("__") and name.endswith("__"):
        return False
    if isinstance(value, Remote) and object.__getattribute__(value, "_rlf_type") == "module":
        # a module the tests do not have loaded: never the program's copy of it (its
        # `np.allclose = lambda *a: True` would answer the tests that forgot `import numpy`)
        return False
    if name in sys.stdlib_module_names:
        return isinstance(value, types.ModuleType) and value.__name__ == name
    if name in _MODULE_ALIASES:  # `np`, `pd`, `pytest`: only ever the tests' own module
        return isinstance(value, types.ModuleType)
    return True


def _channel_failed(e: rpc.ChannelError) -> int:
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
    return rpc.PROTOCOL_ERROR if isinstance(e, rpc.ProtocolError) else rpc.PROGRAM_GONE


def _print_from_tests(e: BaseException, entry: str | None = None) -> None:
    """The traceback from the tests' own frames down: the harness's would only confuse a
    reader (the first frame, or with ``entry``, every frame before the first of that file)."""
    tb = e.__traceback__.tb_next if e.__traceback__ else None
    while entry is not None and tb is not None and tb.tb_frame.f_code.co_filename != entry:
        tb = tb.tb_next
    try:
        traceback.print_exception(type(e), e, tb)
    except BaseException:
        os.write(2, f"\n{type(e).__name__}\n".encode())
