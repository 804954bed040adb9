"""A lone surrogate (half of a UTF-16 pair: ``"\\ud800"``) in a payload. JSON text is
UTF-8, which cannot carry one, and the JSON layers refused it with their own words
("unexpected end of hex escape", a codec error). Each edge where a payload is encoded or
parsed refuses it as bad input saying where it is and what to do, and nothing else is
lost: the pool that refused it goes on serving."""

from __future__ import annotations

import httpx
import pytest
from sample_fns import REG
from typer.testing import CliRunner

from fabric.backends.local import LocalBackend
from fabric.cli import app
from fabric.client import Client
from fabric.errors import ErrorCode, PayloadNotSerializableError
from fabric.protocol import Invocation, decode_payload, encode_payload
from fabric.serve import Gateway, ServeConfig, TenantConfig

LONE = "\ud800"


@pytest.mark.parametrize(
    ("payload", "where"),
    [
        ({"x": LONE}, "$.x"),
        ({"a": [1, {"b c": "ok" + LONE}]}, '$.a[1]["b c"]'),
        ({"k" + LONE: 1}, "a key of $"),
    ],
)
def test_encoding_names_where_the_lone_surrogate_is(payload, where):
    with pytest.raises(PayloadNotSerializableError) as e:
        encode_payload(payload)
    message = str(e.value)
    assert f"payload has a lone surrogate at {where}" in message, message
    assert "not valid UTF-8" in message and "codec" not in message, message


@pytest.mark.parametrize(
    "raw",
    [b'{"x": "\\ud800"}', b'{"x": "\xed\xa0\x80"}'],  # escaped, and as (invalid) UTF-8 bytes
)
def test_parsing_names_where_the_lone_surrogate_is(raw):
    with pytest.raises(ValueError) as e:  # what a parse error was: its callers catch it
        decode_payload(raw)
    message = str(e.value)
    assert "payload has a lone surrogate at $.x" in message and "hex escape" not in message, message


def test_other_bad_json_keeps_its_parser_message():
    with pytest.raises(ValueError, match="EOF") as e:
        decode_payload(b'{"x": ')
    assert "surrogate" not in str(e.value)


async def test_client_call_refuses_it_as_bad_input_and_the_pool_goes_on():
    async with Client(backend="local", registry=REG) as c:
        first = await c.call("pid", {"tag": "a"})
        assert first.ok, first.error
        bad = await c.call("pid", {"tag": "a" + LONE})
        assert not bad.ok and bad.error is not None
        assert bad.error.type == ErrorCode.PAYLOAD_NOT_SERIALIZABLE and not bad.error.retryable
        assert "lone surrogate at $.tag" in bad.error.message, bad.error.message
        again = await c.call("pid", {"tag": "b"})
        assert again.ok and again.value == first.value


async def test_the_local_pipe_refuses_it_as_bad_input_and_the_pool_goes_on():
    """A backend used without the client (fabric serve's envelopes, a test) encodes at
    submit; a payload encoded elsewhere, with the surrogate escaped (Python's json.dumps
    writes one), reaches the worker, whose parse said "unexpected end of hex escape"."""
    async with LocalBackend(REG) as b:
        first = await b.submit(Invocation(function="pid", payload={"tag": "a"}))
        assert first.ok, first.error
        bad = await b.submit(Invocation(function="pid", payload={"tag": LONE}))
        assert not bad.ok and bad.error is not None and "lone surrogate at $.tag" in bad.error.message
        inv = Invocation(function="pid", payload={})
        inv.raw = b'{"tag": "\\ud800"}'
        bad = await b.submit(inv)
        assert not bad.ok and bad.error is not None
        assert bad.error.type == ErrorCode.INVALID_ARGUMENTS, bad.error
        assert "lone surrogate at $.tag" in bad.error.message, bad.error.message
        assert "hex escape" not in bad.error.message
        again = await b.submit(Invocation(function="pid", payload={"tag": "b"}))
        assert again.ok and again.value == first.value, again.error


def test_fabric_invoke_payload_names_the_option_and_the_place():
    r = CliRunner().invoke(
        app, ["invoke", "pid", "-m", "sample_fns", "--backend", "inproc", "--payload", '{"tag": "\\ud800"}']
    )
    assert r.exit_code == 2, r.output
    assert "--payload has a lone surrogate at $.tag" in r.output, r.output


async def test_fabric_serve_answers_400_saying_where_and_goes_on():
    token = "token-surrogate-0123456789"
    cfg = ServeConfig(port=0, tenants={"a": TenantConfig(token=token)}, warm=False)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    path = "/2015-03-31/functions/pid/invocations"
    async with Gateway(cfg, REG) as g, httpx.AsyncClient(base_url=g.url, timeout=30) as http:
        first = await http.post(path, content=b'{"tag": "a"}', headers=headers)
        assert first.status_code == 200, first.text
        for body in (
            b'{"tag": "\\ud800"}',
            b'{"tag": "\xed\xa0\x80"}',
            b'{"function": "pid", "payload": {"tag": "\\udfff"}}',  # an envelope
        ):
            r = await http.post(path, content=body, headers=headers)
            assert r.status_code == 400, r.text
            assert r.headers["x-amzn-ErrorType"] == "InvalidRequestContentException"
            message = r.json()["message"]
            assert "lone surrogate at $." in message and "hex escape" not in message, message
        again = await http.post(path, content=b'{"tag": "b"}', headers=headers)
        assert again.status_code == 200 and again.json() == first.json()
        assert g.quotas.held == {"a": 0}
