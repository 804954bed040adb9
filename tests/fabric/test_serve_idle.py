"""How ``fabric serve`` tells an idle connection from a busy one: aiohttp has no public
way, so it reads the handler's private ``_waiter``. These tests fail loudly when an aiohttp
upgrade drops that name (the idle-closing of ``max_connections`` would silently stop), and
check that without it every connection reads as busy, with one warning, not an error on
every new connection."""

from __future__ import annotations

import asyncio
import logging

from aiohttp.web_protocol import RequestHandler

from fabric.serve import app


def test_the_installed_aiohttp_handler_has_the_waiter_serve_reads():
    # set in RequestHandler.__init__ (a slot): a rename shows here, not as 429s in production
    assert "_waiter" in getattr(RequestHandler, "__slots__", ()) or hasattr(RequestHandler, "_waiter")


class _Conn:
    def __init__(self, waiter: object) -> None:
        self._waiter = waiter


async def test_a_connection_waiting_for_its_next_request_is_idle_and_one_reading_is_not():
    loop = asyncio.get_running_loop()
    assert app._idle(_Conn(loop.create_future()))  # type: ignore[arg-type]
    done = loop.create_future()
    done.set_result(None)
    assert not app._idle(_Conn(done))  # type: ignore[arg-type]
    assert not app._idle(_Conn(None))  # type: ignore[arg-type]


def test_without_the_waiter_every_connection_reads_busy_and_one_warning_says_why(monkeypatch, caplog):
    monkeypatch.setattr(app, "_warned_no_waiter", False)
    with caplog.at_level(logging.WARNING, logger="fabric.serve"):
        assert not app._idle(object())  # type: ignore[arg-type]
        assert not app._idle(object())  # type: ignore[arg-type]
    warnings = [r for r in caplog.records if "_waiter" in r.getMessage()]
    assert len(warnings) == 1
    assert "429" in warnings[0].getMessage()
