"""``llm_judge`` review 17, second part: a web page where the API should be is the judge's
setup's fault, and a burst of calls reuses the connections the last one opened."""

from __future__ import annotations

import pytest
from judge_helpers import ENTRY, fake_openai, judge_maker

from fabric.errors import ErrorCode, Misconfigured
from fabric.protocol import encode_payload
from fabric.runner import FunctionRunner
from functions.fakes import Scripted
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
