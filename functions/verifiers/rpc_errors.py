"""The program's exceptions as the tests meet them (stdlib only, like the harness): the
builtin class of that name, or a ``RemoteError`` that keeps the nearest builtin base."""

from __future__ import annotations

import builtins
from typing import Any


class RemoteError(Exception):
    """The program raised an exception that is not one of Python's builtin ones (or an
    ``AssertionError``, which must not read as a failed test assertion)."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}" if message else type_name)
        self.type_name = type_name

    def __reduce__(self) -> tuple[Any, ...]:
        # as it is (its args, its attributes), not type(*args): the message is not one of its
        # parts (as fabric.errors.pickled_whole; the zygote imports the stdlib only)
        return (_made, (type(self), self.args), self.__dict__)


def _made(cls: type[BaseException], args: tuple[Any, ...]) -> BaseException:
    return cls.__new__(cls, *args)  # without __init__; unpickling sets the attributes


#: Builtin exceptions the program's may not become: an ``AssertionError`` must not read as a
#: failed assertion of the tests, and a ``StopIteration`` would silently end the tests' own
#: loop (``all(map(f, xs))`` is True when ``f`` raises it at once).
_NOT_AS_IS = (AssertionError, StopIteration, StopAsyncIteration)


def _builtin_exception(name: str) -> type[Exception] | None:
    cls = getattr(builtins, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)) or issubclass(cls, _NOT_AS_IS):
        return None
    return cls


def program_exception(type_name: str, message: str, trace: str, base: str = "") -> Exception:
    """The program's exception, as the builtin class of that name where there is one (so
    ``except ValueError`` works); one of the program's own classes as a ``RemoteError``
    that also derives from the nearest builtin class it does (``class BadInput(ValueError)``
    is caught by ``except ValueError``); never an ``AssertionError`` or ``StopIteration``."""
    cls = _builtin_exception(type_name)
    e: Exception | None = None
    if cls is not None:
        try:
            e = cls(message)
        except Exception:  # one that takes other arguments (UnicodeDecodeError)
            e = None
    if e is None:
        parent = _builtin_exception(base)
        if parent is not None and issubclass(parent, UnicodeError):
            parent = ValueError  # its str() reads fields a message cannot fill
        if parent is not None and issubclass(parent, BaseExceptionGroup):
            parent = None  # made from a list of exceptions, which did not travel
        try:
            if parent is None or parent is Exception:
                raise TypeError
            derived: Any = type(type_name, (parent, RemoteError), {"__module__": "program"})
            err = derived.__new__(derived)
            RemoteError.__init__(err, type_name, message)
            e = err
        except TypeError:  # no builtin base to add (or one that cannot be made so)
            e = RemoteError(type_name, message)
    if trace:
        e.add_note("raised in the program:\n" + trace.rstrip())
    return e
