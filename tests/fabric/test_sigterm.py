"""SIGTERM as Ctrl-C for a command's main coroutine (``fabric._sigterm``)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from fabric._sigterm import term_as_interrupt


def test_sigterm_stops_the_coroutine_as_ctrl_c_does_after_a_library_took_the_handler():
    if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        pytest.skip("SIGTERM is handled here already: the helper leaves such a handler alone")
    stopped: list[bool] = []

    async def body(term) -> None:
        # what ray.init does: its handler exits the process, skipping every async with exit
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(15))
        term.reinstall()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(30)
        finally:
            stopped.append(True)  # the way out ran

    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        asyncio.run(term_as_interrupt(body))
    assert stopped == [True]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # put back as it was


def test_a_sigterm_a_library_handler_takes_before_the_reinstall_stops_as_ctrl_c_does():
    # ray.init puts its handler (sys.exit(15)) in place as it starts, and the job puts its own
    # back once ray.init has returned, seconds later: a SIGTERM meanwhile ended the job with
    # exit code 15 and no word, where it says "interrupted" and exits with 130
    if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        pytest.skip("SIGTERM is handled here already: the helper leaves such a handler alone")
    stopped: list[bool] = []

    async def body(term) -> None:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(15))
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # within the library's own (blocking) start
        finally:
            stopped.append(True)

    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        asyncio.run(term_as_interrupt(body))
    assert stopped == [True]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
