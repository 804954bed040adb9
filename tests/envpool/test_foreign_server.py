"""A pool driving a session-protocol server that is not envpool's (``foreign_server.py``,
the wire format by hand, as a server in another language speaks it): every reply it breaks
the protocol with is a ``ProtocolError`` that names what is wrong, never retried, and its
container is discarded."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from pool_util import alive, pool, swap_runtime, wait_for

from envpool.errors import EnvLogicError, EnvOrderError, GarbledFrame, ProtocolError
from envpool.runtimes.base import Container, Runtime

SERVER = Path(__file__).with_name("foreign_server.py")


class _ForeignRuntime(Runtime):
    """Each container is ``foreign_server.py`` in a process group of its own, in ``mode``."""

    kind = "foreign"

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.dir = Path(tempfile.mkdtemp(prefix="envpool-foreign-"))
        self.ids = itertools.count(1)

    async def _start(self, image: str | None, bundle: Path | None) -> Container:
        cid = f"f{next(self.ids)}"
        sock = self.dir / cid
        # a Popen, as the process runtime's: unreaped (its pid its group's) until _stop kills it
        proc = subprocess.Popen(  # noqa: ASYNC220
            [sys.executable, str(SERVER), str(sock), self.mode],
            stdin=subprocess.PIPE,  # the go of the modes that wait for the test's line
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        c = Container(id=cid, endpoint=str(sock), image=image, runtime=self.kind, pid=proc.pid, handle=proc)
        assert proc.stdout is not None
        line = await asyncio.to_thread(proc.stdout.readline)
        if line.strip() != b"ready":
            await self._stop(c)
            raise AssertionError(f"the foreign server did not start: {line!r}")
        return c

    async def _stop(self, c: Container) -> None:
        proc: subprocess.Popen[bytes] = c.handle
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait)
        assert proc.stdout is not None and proc.stdin is not None
        proc.stdout.close()
        proc.stdin.close()

    async def _alive(self, c: Container) -> bool:
        return c.handle.poll() is None

    async def aclose(self) -> None:
        await super().aclose()
        with contextlib.suppress(OSError):
            for p in self.dir.iterdir():
                p.unlink()
            self.dir.rmdir()


async def _foreign_pool(mode: str):
    p = pool(None, min_warm=0, runtime={"heartbeat_s": 0.5}, reset_timeout_s=10, step_timeout_s=10)
    await swap_runtime(p, _ForeignRuntime(mode))
    return p


async def test_a_foreign_server_that_keeps_the_protocol_plays_an_episode():
    async with await _foreign_pool("good") as p:
        async with p.session("echo-v0") as s:
            assert (await s.reset(seed=1))[0].text == "ready"
            assert (await s.step("a")).obs.text == "a #1"
        assert p.stats()["idle"] == 1 and p.stats().get("discarded", 0) == 0


@pytest.mark.parametrize(
    ("mode", "what"),
    [
        ("ok-not-bool", r"reply to request 2 has 'ok': 1, not true or false"),
        ("wrong-id", r"reply to request 1002, which this connection never sent"),
        ("error-shape", r"reply to request 2 has 'error': 'boom', not an object"),
        ("no-result", r"reply to request 2 says ok but has no 'result'"),
        ("reset-shape", r"result of reset is not what reset returns: obs: Field required"),
    ],
)
async def test_a_malformed_reply_to_a_reset_is_a_protocol_error_naming_the_fault(mode, what):
    async with await _foreign_pool(mode) as p:
        async with p.session("echo-v0") as s:
            pid = s.container.pid
            with pytest.raises(ProtocolError, match=what):
                await s.reset(seed=1)
            assert s.container is None  # discarded at once, not handed to the next session
        stats = p.stats()
        assert stats["discarded"] == 1 and stats["idle"] == 0 and stats["protocol_errors"] == 1, stats
        assert stats.get("reset_retries", 0) == 0  # a bug of one side: never retried
        await wait_for(lambda: not alive(pid))


async def test_a_malformed_step_result_is_a_protocol_error_and_ends_the_episode():
    async with await _foreign_pool("step-shape") as p:
        async with p.session("echo-v0") as s:
            await s.reset(seed=1)
            with pytest.raises(ProtocolError, match=r"result of step is not what step returns: reward"):
                await s.step("a")
            with pytest.raises(EnvOrderError, match=r"broke the session protocol; call reset"):
                await s.step("b")
        assert p.stats()["discarded"] == 1 and p.stats().get("step_retries", 0) == 0


async def test_an_open_whose_info_is_not_an_object_is_a_protocol_error():
    async with await _foreign_pool("open-info") as p:
        with pytest.raises(ProtocolError, match=r"result of open is not what open returns: .*'hello'"):
            async with p.session("echo-v0"):
                pass  # the session's entry raises: the body is not the test
        assert p.stats()["discarded"] == 1 and p.stats()["idle"] == 0


async def test_a_malformed_reply_while_nothing_waits_is_a_protocol_error_not_a_lost_connection():
    # it broke the connection with nobody to tell: the next step found it closed, read that
    # as a container that died (ConnectionLost), and was retried on fresh containers
    async with await _foreign_pool("stray-reply") as p:
        async with p.session("echo-v0") as s:
            await s.reset(seed=1)
            conn = s.conn
            await wait_for(lambda: conn.transport.is_closing())  # the stray reply was read
            with pytest.raises(
                ProtocolError, match=r"reply to request 999999, which this connection never sent"
            ):
                await s.step("a")
            assert s.container is None and s.status == "ok"
            with pytest.raises(EnvOrderError, match=r"broke the session protocol; call reset"):
                await s.step("b")
        stats = p.stats()
        assert stats["protocol_errors"] == 1 and stats["discarded"] == 1, stats
        assert stats.get("step_retries", 0) == 0 and stats.get("replays", 0) == 0, stats


@pytest.mark.parametrize(
    ("mode", "what"),
    [
        ("step-print", r"a length prefix of 1,145,389,653 bytes.*b.DEBUG stepping with \{"),
        (
            "step-not-json",
            r"a \d+-byte body that is not JSON.*b.\\x00\\x00\\x00.{1,4}\{'id': \d+, 'ok': True",
        ),
    ],
)
async def test_a_garbled_frame_is_a_protocol_error_never_retried(mode, what):
    # it was read as a lost connection (ConnectionLost) and the step was retried: replayed on
    # a fresh container, though the server may well have run the step (it answered, garbled)
    async with await _foreign_pool(mode) as p:
        async with p.session("echo-v0") as s:
            await s.reset(seed=1)
            pid = s.container.pid
            with pytest.raises(GarbledFrame, match=what) as err:
                await s.step("a")
            assert isinstance(err.value, ProtocolError)  # caught as any protocol bug
            message = str(err.value)
            assert message.startswith("echo-v0: the container sent a garbled frame")
            assert "Check that the server writes nothing but frames" in message and "Not retried" in message
            assert len(message) < 800  # what was received is cut short, not the whole stream
            assert s.container is None and s.status == "ok"  # discarded; the session lives on
            with pytest.raises(EnvOrderError, match=r"broke the session protocol; call reset"):
                await s.step("b")
        stats = p.stats()
        assert stats["protocol_errors"] == 1 and stats["discarded"] == 1, stats
        assert stats.get("step_retries", 0) == 0 and stats.get("replays", 0) == 0, stats
        await wait_for(lambda: not alive(pid))


async def test_a_well_formed_reply_over_the_frame_limit_is_not_said_to_be_garbled_output():
    # a foreign server's whole, well-formed reply over the limit (a big observation) read as
    # text printed to the socket, and its author was sent looking for a stray print
    async with await _foreign_pool("step-huge") as p:
        async with p.session("echo-v0") as s:
            await s.reset(seed=1)
            with pytest.raises(GarbledFrame) as err:
                await s.step("a")
            message = str(err.value)
            assert "a frame of 17,825,8" in message and "a JSON object by its start" in message, message
            assert "Keep each reply under the limit" in message and "ObservationTooLarge" in message, message
            assert "printed" not in message, message
            assert s.container is None
        stats = p.stats()
        assert stats["protocol_errors"] == 1 and stats.get("step_retries", 0) == 0, stats


async def test_a_foreign_servers_step_error_that_does_not_say_it_is_sound_retires_its_container():
    # envpool's server says "reusable": true of any error but a MemoryError or an OSError; one
    # that says nothing is taken at its silence: the episode goes on, no other runs there
    async with await _foreign_pool("step-error") as p:
        async with p.session("echo-v0") as s:
            await s.reset(seed=1)
            first = s.container
            with pytest.raises(EnvLogicError, match="ValueError: no such move"):
                await s.step("a")
            assert s.container is first and first.failed
        stats = p.stats()
        assert stats["retired_unsound"] == 1 and stats["discarded"] == 1 and stats["idle"] == 0, stats
