"""``fabric serve``: the Lambda Invoke API over real local pools, spoken to over real HTTP:
payloads and envelopes, names and qualifiers, tokens, the body's limits, malformed requests,
Event and DryRun invocations, health and metrics, keyed executions, prefixed names. Start-up
and shutdown are in test_serve_lifecycle.py, tenants' quotas, rates and config in
test_serve_tenants.py."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

import httpx
import pytest
from sample_fns import REG

# test_serve_hardening.py, test_serve_slots.py and test_serve_review.py import these from here
from serve_helpers import PATH, TOKEN_A, TOKEN_B, auth, config

from fabric.errors import ConfigError
from fabric.protocol import Invocation
from fabric.serve import Gateway


@pytest.fixture
async def gw():
    async with Gateway(config(), REG) as g:
        yield g


@pytest.fixture
async def http(gw):
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        yield c


async def test_raw_payload_returns_the_bare_value(http):
    r = await http.post(PATH.format("add"), json={"a": 2, "b": 3}, headers=auth())
    assert r.status_code == 200 and r.json() == 5
    assert r.headers["x-amzn-RequestId"]


async def test_envelope_returns_a_result_and_the_tenant_comes_from_the_token(http):
    inv = Invocation(function="add", payload={"a": 1}, tenant="someone-else", idempotency_key="k1")
    r = await http.post(PATH.format("add"), content=inv.model_dump_json(), headers=auth(TOKEN_B))
    body = r.json()
    assert r.status_code == 200 and body["ok"] is True and body["value"] == 1
    assert body["request_id"] == inv.request_id and body["worker"]


@pytest.mark.parametrize(
    "name",
    [
        "add:live",
        "add:$LATEST",
        "arn:aws:lambda:us-east-1:123456789012:function:add",
        "arn:aws:lambda:us-east-1:123456789012:function:add:live",
        "123456789012:function:add",  # a partial ARN, as Lambda's Invoke takes
        "123456789012:function:add:live",
    ],
)
async def test_qualified_names_and_arns_are_served(http, name):
    r = await http.post(PATH.format(name), json={"a": 4}, headers=auth())
    assert r.status_code == 200 and r.json() == 4
    r = await http.post(
        PATH.format("add"), params={"Qualifier": REG.get("add").version}, json={"a": 4}, headers=auth()
    )
    assert r.json() == 4


async def test_function_error_sets_the_lambda_header(http):
    r = await http.post(PATH.format("boom"), json={"x": 7}, headers=auth())
    assert r.status_code == 200 and r.headers["X-Amz-Function-Error"] == "Unhandled"
    err = r.json()
    assert err["errorType"] == "UserError" and "bad x=7" in err["errorMessage"]
    assert any("ValueError" in line for line in err["stackTrace"])


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({}, 401, "MissingAuthenticationTokenException"),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, 401, "MissingAuthenticationTokenException"),
        ({"Authorization": "Bearer"}, 401, "MissingAuthenticationTokenException"),
        ({"Authorization": "Bearer wrong-token-0123456789"}, 403, "UnrecognizedClientException"),
        ({"Authorization": f"Bearer {TOKEN_A}x"}, 403, "UnrecognizedClientException"),
    ],
)
async def test_missing_or_wrong_token_runs_nothing(http, tmp_path, headers, status, code):
    out = tmp_path / "ran.txt"
    r = await http.post(PATH.format("append_line"), json={"path": str(out), "line": "x"}, headers=headers)
    assert r.status_code == status and r.headers["x-amzn-ErrorType"] == code
    await asyncio.sleep(0.2)
    assert not out.exists()


async def test_unknown_function_and_qualifier_are_404(http):
    r = await http.post(PATH.format("nope"), json={}, headers=auth())
    assert r.status_code == 404 and r.json()["__type"] == "ResourceNotFoundException"
    r = await http.post(PATH.format("add:v9"), json={}, headers=auth())
    assert r.status_code == 404 and "served qualifiers" in r.json()["message"]


async def test_functions_outside_the_allow_list_are_404():
    async with Gateway(config(functions=["add"]), REG) as g, httpx.AsyncClient(base_url=g.url) as c:
        assert (await c.post(PATH.format("add"), json={"a": 1}, headers=auth())).json() == 1
        assert (await c.post(PATH.format("boom"), json={"x": 1}, headers=auth())).status_code == 404


async def test_unknown_served_function_is_a_config_error():
    with pytest.raises(ConfigError, match="not registered: nope"):
        Gateway(config(functions=["add", "nope"]), REG)


async def test_oversize_payload_is_413_and_runs_nothing(http, tmp_path):
    out = tmp_path / "ran.txt"
    big = {"path": str(out), "line": "x" * (6 * 1024 * 1024)}
    r = await http.post(PATH.format("append_line"), json=big, headers=auth())
    assert r.status_code == 413 and r.headers["x-amzn-ErrorType"] == "RequestTooLargeException"
    # an Event's limit is 1 MB
    r = await http.post(
        PATH.format("append_line"),
        json={"path": str(out), "line": "x" * (1024 * 1024)},
        headers={**auth(), "X-Amz-Invocation-Type": "Event"},
    )
    assert r.status_code == 413
    await asyncio.sleep(0.2)
    assert not out.exists()


async def test_chunked_oversize_body_is_413():
    async with Gateway(config(max_body_bytes=1000), REG) as g, httpx.AsyncClient(base_url=g.url) as c:

        async def chunks():
            for _ in range(10):
                yield b"x" * 500

        r = await c.post(PATH.format("add"), content=chunks(), headers=auth())
        assert r.status_code == 413
        assert (await c.post(PATH.format("add"), json={"a": 2}, headers=auth())).json() == 2


@pytest.mark.parametrize(
    ("body", "headers", "code"),
    [
        (b"{not json", {}, "InvalidRequestContentException"),
        (b"[1, 2]", {}, "InvalidRequestContentException"),
        (b'"text"', {}, "InvalidRequestContentException"),
        (b'{"function": "add", "payload": 3}', {}, "InvalidRequestContentException"),
        (b'{"a": 1}', {"X-Amz-Invocation-Type": "Sometimes"}, "InvalidParameterValueException"),
        (b"\xff\xfe", {}, "InvalidRequestContentException"),
    ],
)
async def test_malformed_requests_are_400(http, body, headers, code):
    r = await http.post(PATH.format("add"), content=body, headers={**auth(), **headers})
    assert r.status_code == 400 and r.json()["__type"] == code


async def test_bad_arn_is_400(http):
    r = await http.post(PATH.format("arn:aws:lambda:function"), json={}, headers=auth())
    assert r.status_code == 400


async def test_empty_body_is_an_empty_payload(http):
    r = await http.post(PATH.format("add"), content=b"", headers=auth())
    assert r.headers["X-Amz-Function-Error"] == "Unhandled" and "missing 'a'" in r.json()["errorMessage"]


async def test_event_runs_in_the_background_and_dry_run_runs_nothing(http, tmp_path):
    out = tmp_path / "ran.txt"
    payload = {"path": str(out), "line": "event"}
    r = await http.post(
        PATH.format("append_line"), json=payload, headers={**auth(), "X-Amz-Invocation-Type": "DryRun"}
    )
    assert r.status_code == 204
    r = await http.post(
        PATH.format("append_line"), json=payload, headers={**auth(), "X-Amz-Invocation-Type": "Event"}
    )
    assert r.status_code == 202 and r.content == b""
    # until the line is in it: the file exists from the handler's open(), before its write
    # (polling for the file alone read it empty once, under load)
    for _ in range(200):
        if out.exists() and out.read_text() == "event\n":
            break
        await asyncio.sleep(0.02)
    assert out.read_text() == "event\n"
    r = await http.post(PATH.format("nope"), json={}, headers={**auth(), "X-Amz-Invocation-Type": "DryRun"})
    assert r.status_code == 404


async def test_healthz_is_open_and_metrics_need_a_token(http):
    r = await http.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert (await http.get("/metrics")).status_code == 401
    await http.post(PATH.format("add"), json={"a": 1}, headers=auth())
    await http.post(PATH.format("made-up-name"), json={}, headers=auth())
    text = (await http.get("/metrics", headers=auth())).text
    assert 'fabric_serve_requests_total{function="add",status="200",tenant="job-a"} 1.0' in text
    assert 'function="-",status="404"' in text  # made-up names share one label
    assert 'fabric_serve_tenant_limit{tenant="job-a"} 64.0' in text
    assert 'fabric_pool_calls_total{function="add"}' in text


async def test_a_thousand_malformed_requests_leave_the_server_serving(gw, http):
    rng = random.Random(7)
    host, port = "127.0.0.1", gw.port
    garbage_lines = [
        b"GARBAGE\r\n\r\n",
        b"POST /2015-03-31/functions/add/invocations HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
        b"POST /2015-03-31/functions/add/invocations HTTP/9.9\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"\x00\x01\x02\x03" * 64,
        b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
    ]
    statuses: dict[int, int] = {}
    for i in range(1000):
        kind = i % 4
        if kind == 0:  # raw bytes on a socket, then hang up
            _, writer = await asyncio.open_connection(host, port)
            writer.write(
                rng.choice(garbage_lines) + bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
            )
            await writer.drain()
            writer.close()
            continue
        if kind == 1:  # a random body
            body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
            r = await http.post(PATH.format("add"), content=body, headers=auth())
        elif kind == 2:  # random headers
            headers = {**auth(), "X-Amz-Invocation-Type": rng.choice(["", "event", "x" * 300, "DryRun"])}
            if rng.random() < 0.5:
                headers["Authorization"] = "Bearer " + "".join(
                    rng.choice("ab$%") for _ in range(rng.randrange(1, 40))
                )
            r = await http.post(PATH.format("add"), json={"a": rng.randrange(9)}, headers=headers)
        else:  # random paths and methods
            name = "".join(rng.choice("ab:/%$._-") for _ in range(rng.randrange(1, 30)))
            r = await http.request(
                rng.choice(["POST", "GET", "PUT", "DELETE"]),
                f"/2015-03-31/functions/{name}/invocations",
                headers=auth(),
            )
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (r.status_code, r.text)
    assert set(statuses) - {200, 204, 400, 401, 403, 404, 405} == set()
    for a in range(5):
        r = await http.post(PATH.format("add"), json={"a": a, "b": 1}, headers=auth())
        assert r.json() == a + 1


async def test_a_malformed_request_is_one_debug_line_not_an_error_traceback(gw, http, caplog):
    caplog.set_level(logging.DEBUG)
    _, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
    await writer.drain()
    await asyncio.wait_for(_.read(), 10)  # the 400, then the server hangs up
    writer.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    lines = [r.getMessage() for r in caplog.records if r.name == "fabric.serve"]
    assert any("malformed HTTP request" in m and "Content-Length" in m for m in lines), lines
    r = await http.post(PATH.format("add"), json={"a": 1, "b": 1}, headers=auth())
    assert r.json() == 2


def test_envelope_json_round_trips():
    from fabric.backends.lambda_ import envelope

    inv = Invocation(function="add", payload={"a": 1, "s": "é\n"}, idempotency_key="k", deadline=5.0)
    data = json.loads(envelope(inv))
    assert Invocation.model_validate(data).model_dump() == inv.model_dump()


def test_a_keyed_execution_s_envelope_is_what_an_older_handler_takes():
    """A keyed execution's call (``wait_for_run``) goes to a remote endpoint as before the
    mark existed: no mark (a handler or ``fabric serve`` deployed from older code refuses a
    field it does not know, InvalidArguments that the client would keep under the key) and no
    deadline (a Lambda handler cut there drops the key's record, and a side effect could run
    again from another client process)."""
    from fabric.backends.lambda_ import envelope

    old_fields = {
        "function",
        "payload",
        "request_id",
        "idempotency_key",
        "deadline",
        "tenant",
        "attempt",
        "hedge",
    }
    inv = Invocation(function="add", payload={"a": 1}, idempotency_key="k", deadline=5.0, wait_for_run=True)
    data = json.loads(envelope(inv))
    assert set(data) <= old_fields and data["deadline"] is None
    plain = json.loads(envelope(inv.model_copy(update={"wait_for_run": False})))
    assert set(plain) <= old_fields and plain["deadline"] == 5.0  # an unkeyed call keeps its deadline


async def test_a_keyed_execution_s_call_is_answered_by_its_run_not_at_its_deadline(http):
    """A call marked ``wait_for_run`` (fabric serve reads the mark, though a fabric client
    sends it only to its local pools): a synchronous handler runs on past the deadline, and the answer is the
    run's own, not an early DeadlineExceeded that would free the client's key while it runs."""
    from fabric.backends.lambda_ import envelope

    await http.post(PATH.format("sleepy"), json={"seconds": 0}, headers=auth())  # a warm worker
    for wait in (True, False):  # first the one that leaves its worker free
        inv = Invocation(
            function="sleepy",
            payload={"seconds": 0.5},
            idempotency_key=f"k-{wait}",
            deadline=time.time() + 0.2,
            wait_for_run=wait,
        )
        # no fabric client sends the mark (see the test above); fabric serve still reads it
        event = {**json.loads(envelope(inv)), "deadline": inv.deadline, "wait_for_run": wait}
        body = (await http.post(PATH.format("sleepy"), json=event, headers=auth())).json()
        if wait:
            assert body["ok"] and isinstance(body["value"], int), body["error"]
        else:
            assert body["error"]["type"] == "DeadlineExceeded", body


async def test_prefixed_names_as_deployed():
    async with Gateway(config(function_prefix="rl-"), REG) as g, httpx.AsyncClient(base_url=g.url) as c:
        assert (await c.post(PATH.format("rl-add"), json={"a": 3}, headers=auth())).json() == 3
        assert (await c.post(PATH.format("rl-add:live"), json={"a": 3}, headers=auth())).json() == 3
        assert (await c.post(PATH.format("add"), json={"a": 3}, headers=auth())).status_code == 404
