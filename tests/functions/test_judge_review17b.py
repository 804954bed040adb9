"""``llm_judge`` review 17, second part: a web page where the API should be is the judge's
setup's fault, and a burst of calls reuses the connections the last one opened."""

from __future__ import annotations

import asyncio
import json

import pytest
from judge_helpers import ENTRY, fake_openai, judge_maker

from fabric.errors import ErrorCode, Misconfigured
from fabric.protocol import encode_payload
from fabric.runner import FunctionRunner
from functions.fakes import Scripted
from functions.rewards.judge import Judge, llm_judge
from functions.rewards.judge_config import JudgeConfig
from functions.rewards.judge_errors import JudgeResponseError

srv = pytest.fixture(fake_openai, name="srv")
make_judge = pytest.fixture(judge_maker, name="make_judge")

_INDEX = b'<!doctype html>\n<html lang="en"><head><title>Open WebUI</title></head><body></body></html>'


# ----------------------------------------------------------------------------- a web page


@pytest.mark.parametrize(
    "headers", [{"Content-Type": "text/html; charset=utf-8"}, {"Content-Type": "application/octet-stream"}]
)
async def test_a_web_page_where_the_api_should_be_is_misconfigured(srv, make_judge, headers):
    # a base_url that points at a web UI (its index answers every path 200): every call gets
    # the page, whatever the response, and as the response's unreadable reply (UserError) a
    # failure_score scored every trajectory alike. Known by its content type, or its '<'
    srv.enqueue(Scripted(body=_INDEX, headers=headers))
    with pytest.raises(Misconfigured, match=r"answered 200 with a web page.*<!doctype html>.*BASE_URL") as e:
        await make_judge(srv).score("Paris")
    assert srv.base_url in str(e.value)
    assert len(srv.chat_requests) == 1  # not retried: the same page would come back


async def test_a_web_page_fails_the_call_misconfigured_through_the_runner(srv, make_judge):
    srv.enqueue(Scripted(body=_INDEX, headers={"Content-Type": "text/html"}))
    runner = FunctionRunner.from_entry(ENTRY)
    runner.ctx = make_judge(srv)
    ok, (code, message, _) = await runner.run_async(encode_payload({"traj": "x"}), 10)
    assert not ok and code == ErrorCode.MISCONFIGURED, message


async def test_other_bodies_that_are_not_json_stay_the_replys_error(srv, make_judge):
    srv.enqueue(Scripted(body=b"upstream connect error", headers={"Content-Type": "text/plain"}))
    with pytest.raises(JudgeResponseError, match=r"not JSON \(text/plain\): upstream connect error") as e:
        await make_judge(srv).score("Paris")
    assert not isinstance(e.value, Misconfigured)


# ----------------------------------------------------------------------------- connections


class _CountingServer:
    """A chat endpoint on 127.0.0.1 that counts the connections it accepts and answers a burst
    only once all ``burst`` requests are in (so they are surely concurrent, each on its own
    connection); HTTP/1.1 keep-alive, as a real server."""

    def __init__(self, burst: int):
        self.accepted = 0
        self._open = 0
        self._barrier = asyncio.Barrier(burst)
        self._closed = asyncio.Event()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> _CountingServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()
        if self._open:
            await self._closed.wait()  # the client closed its connections: every handler ends

    @property
    def base_url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/v1"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._open += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                await self._barrier.wait()
                body = json.dumps(
                    {
                        "model": "m",
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": "Score: 8/10"},
                                "finish_reason": "stop",
                            }
                        ],
                    }
                ).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection
        finally:
            writer.close()
            self._open -= 1
            if not self._open:
                self._closed.set()


async def test_a_second_burst_of_calls_reuses_the_connections_of_the_first():
    # llm_judge runs max_concurrency calls at once; httpx keeps only 20 idle connections by
    # default, so each burst reopened the rest (a TCP and TLS handshake each on a remote API)
    burst = llm_judge.__fabric_spec__.max_concurrency
    async with _CountingServer(burst) as server:
        config = JudgeConfig(model="m", base_url=server.base_url, rubric="Grade {response}. Score: N/10")
        async with Judge(config) as judge:
            for _ in range(2):
                results = await asyncio.gather(*(judge.score(f"answer {i}") for i in range(burst)))
                assert [r.score for r in results] == [0.8] * burst
                assert server.accepted == burst  # one connection per call in the first, none new after
