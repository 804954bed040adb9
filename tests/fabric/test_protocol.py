"""Wire models and payload encoding."""

from __future__ import annotations

import json
import time

import pytest
from pydantic import ValidationError

from fabric.errors import (
    RETRYABLE,
    ErrorCode,
    InvocationError,
    PayloadError,
    PayloadNotSerializableError,
    PayloadTooLargeError,
)
from fabric.protocol import (
    MAX_PAYLOAD_BYTES,
    ErrorInfo,
    Invocation,
    Message,
    Result,
    RewardResult,
    Timings,
    Trajectory,
    decode_payload,
    encode_payload,
)


def make_traj() -> Trajectory:
    return Trajectory(
        id="t1",
        messages=[
            Message(role="system", content="be brief"),
            Message(role="user", content="6*7?", policy_version=99),
            Message(role="assistant", content="thinking", policy_version=0),
            Message(
                role="assistant",
                content=None,
                tool_calls=[{"id": "c1", "function": {"name": "calc", "arguments": '{"e": "6*7"}'}}],
                policy_version=None,
            ),
            Message(role="tool", content="42", tool_call_id="c1"),
            Message(role="assistant", content="\\boxed{42}", policy_version=2),
            Message(role="user", content="thanks"),
        ],
        task={"ground_truth": "42"},
    )


# ----------------------------------------------------------------------------- encode_payload


def test_encode_json_safe_values() -> None:
    payload = {"a": 1, "b": [True, None, "x"], "c": 1.5, "d": {"e": "ü"}}
    raw = encode_payload(payload)
    assert raw == '{"a":1,"b":[true,null,"x"],"c":1.5,"d":{"e":"ü"}}'.encode()
    assert decode_payload(raw) == payload
    assert json.loads(raw) == payload


def test_encode_pydantic_models() -> None:
    traj = make_traj()
    raw = encode_payload({"traj": traj, "ground_truth": "42"})
    decoded = decode_payload(raw)
    assert decoded["ground_truth"] == "42"
    assert decoded["traj"]["id"] == "t1" and decoded["traj"]["status"] == "ok"
    assert decoded["traj"]["messages"][3]["tool_calls"][0]["type"] == "function"
    assert Trajectory.model_validate(decoded["traj"]) == traj
    assert decode_payload(encode_payload(RewardResult(score=0.5))) == {
        "score": 0.5,
        "components": {},
        "info": {},
    }


@pytest.mark.parametrize("bad", [object(), {"x": object()}, {"s": {object()}}, [1, {2: object()}]])
def test_encode_not_serialisable(bad: object) -> None:
    with pytest.raises(PayloadNotSerializableError) as ei:
        encode_payload(bad, what="payload of 'f'")
    msg = str(ei.value)
    assert msg.startswith("payload of 'f' is not JSON-serialisable: ")
    assert "object" in msg
    assert "Pass plain JSON types (dict, list, str, numbers, bool, None) or pydantic models." in msg
    assert isinstance(ei.value, PayloadError)
    assert ei.value.code == ErrorCode.PAYLOAD_NOT_SERIALIZABLE


def test_encode_too_large() -> None:
    big = "x" * MAX_PAYLOAD_BYTES  # plus two quotes: 2 bytes over the limit
    with pytest.raises(PayloadTooLargeError) as ei:
        encode_payload(big)
    msg = str(ei.value)
    assert "(6,291,458 bytes), over the 6 MiB (6,291,456-byte) limit" in msg
    assert "Send a reference instead" in msg
    assert ei.value.code == ErrorCode.PAYLOAD_TOO_LARGE
    # exactly at the limit is fine
    assert len(encode_payload("x" * (MAX_PAYLOAD_BYTES - 2))) == MAX_PAYLOAD_BYTES
    with pytest.raises(PayloadTooLargeError):
        encode_payload([1, 2, 3], limit=5)


def test_too_large_refused_before_sending() -> None:
    inv = Invocation(function="f", payload={"blob": "y" * (7 * 1024 * 1024)})
    with pytest.raises(
        PayloadTooLargeError, match=r"payload is 7\.00 MiB \(7,340,0\d\d bytes\), over the 6 MiB"
    ):
        _ = inv.raw_payload


def test_encode_nan_is_strict_json() -> None:
    def reject(token: str) -> None:
        raise ValueError(f"non-standard JSON token {token}")

    try:
        raw = encode_payload({"score": float("nan")})
    except PayloadNotSerializableError:
        return  # refusing it is fine too
    json.loads(raw, parse_constant=reject)


# ----------------------------------------------------------------------------- Result


def test_unwrap() -> None:
    assert Result(ok=True, function="f", value={"v": 1}).unwrap() == {"v": 1}
    r = Result.failure(ErrorCode.USER_ERROR, "ValueError: boom", function="f", request_id="r1")
    with pytest.raises(InvocationError) as ei:
        r.unwrap()
    assert ei.value.result is r
    assert str(ei.value) == "f: UserError: ValueError: boom"


@pytest.mark.parametrize("code", list(ErrorCode))
def test_failure_retryable_from_code(code: ErrorCode) -> None:
    expected = code in {
        "WorkerLost",
        "NotStarted",
        "FunctionTimeout",
        "Throttled",
        "TransportError",
        "Unavailable",
    }
    r = Result.failure(code, "m")
    assert r.ok is False and r.value is None
    assert r.retryable is expected
    assert r.error is not None and r.error.type == code.value
    assert Result.failure(code.value, "m").retryable is expected  # a plain string works too


def test_failure_fields() -> None:
    r = Result.failure("WorkerLost", "worker died", function="f", request_id="r1", worker="w3")
    assert (r.function, r.request_id, r.worker, r.attempts) == ("f", "r1", "w3", 1)
    assert r.retryable is True
    assert Result.failure("UserError", "x").retryable is False
    assert RETRYABLE == {
        "WorkerLost",
        "NotStarted",
        "FunctionTimeout",
        "Throttled",
        "TransportError",
        "Unavailable",
    }
    assert Result(ok=True).retryable is False


def test_error_info_of() -> None:
    e = ErrorInfo.of(ErrorCode.TIMEOUT, "slow", traceback="tb")
    assert (e.type, e.message, e.retryable, e.traceback) == ("FunctionTimeout", "slow", True, "tb")
    assert json.loads(e.model_dump_json())["type"] == "FunctionTimeout"
    assert ErrorInfo.of("SomethingNew", "x").retryable is False


def test_a_throttles_retry_after_stays_off_the_wire() -> None:
    """``ErrorInfo.retry_after_s`` is this process's reading of a 429: an older peer's
    ``ErrorInfo`` refuses a field it does not know, and its reader then took the whole Result
    for a plain value."""
    r = Result.failure(ErrorCode.THROTTLED, "slow down")
    assert r.error is not None and r.error.retry_after_s is None
    r.error.retry_after_s = 2.0
    assert "retry_after_s" not in json.loads(r.model_dump_json())["error"]
    assert Result.model_validate_json(r.model_dump_json()).error == ErrorInfo.of(
        ErrorCode.THROTTLED, "slow down"
    )


def test_result_json_round_trip() -> None:
    fail = Result.failure(
        ErrorCode.WORKER_LOST, "died", function="f", request_id="r1", traceback="Traceback...", worker="w1"
    )
    back = Result.model_validate_json(fail.model_dump_json())
    assert back == fail
    assert back.error == ErrorInfo(
        type="WorkerLost", message="died", retryable=True, traceback="Traceback..."
    )
    assert back.retryable is True
    ok = Result(
        ok=True,
        function="g",
        request_id="r2",
        value={"score": 1.0, "xs": [1, 2]},
        timings=Timings(queue_ms=1.5, exec_ms=2.5, total_ms=4.0),
        cold_start=True,
        attempts=2,
        hedged=True,
        cached=True,
        index=7,
    )
    again = Result.model_validate_json(ok.model_dump_json())
    assert again == ok and again.timings.exec_ms == 2.5 and again.index == 7
    with pytest.raises(ValidationError):
        Result.model_validate({"ok": True, "surprise": 1})


def test_started_on_the_wire_and_from_an_older_peer() -> None:
    """``Result.started``: whether the execution began. An older peer's answer has no such
    field and reads as saying nothing (``None``: its reader goes by type and message, as
    before). It is a field of the Result, not of its error: a reader with older code drops a
    Result field it does not know (``_as_result``), where one in ``ErrorInfo`` was refused."""
    old = {
        "ok": False,
        "function": "f",
        "request_id": "r",
        "error": {"type": "DeadlineExceeded", "message": "m", "retryable": False},
    }
    assert Result.model_validate(old).started is None
    new = Result.failure(ErrorCode.DEADLINE_EXCEEDED, "m", started=False)
    assert json.loads(new.model_dump_json())["started"] is False
    assert Result.model_validate_json(new.model_dump_json()).started is False
    assert new.error is not None and "started" not in new.error.model_dump()
    # said by the error's type where its maker says nothing more
    assert Result.failure(ErrorCode.NOT_STARTED, "m").started is False
    assert Result.failure(ErrorCode.TIMEOUT, "m").started is True
    assert Result.failure(ErrorCode.DEADLINE_EXCEEDED, "m").started is None  # either way: its maker says
    # refused before anything ran: by the backend (throttled, unknown, too big, credentials)
    # or by the client (its circuit open)
    for code in (
        ErrorCode.THROTTLED,
        ErrorCode.CIRCUIT_OPEN,
        ErrorCode.UNKNOWN_FUNCTION,
        ErrorCode.PAYLOAD_TOO_LARGE,
        ErrorCode.UNAUTHORIZED,
    ):
        assert Result.failure(code, "m").started is False, code
    assert Result.failure(ErrorCode.INVALID_ARGUMENTS, "m").started is None
    assert Result.built(True, function="f", request_id="r", value=1).started is True


# ----------------------------------------------------------------------------- Invocation


def test_invocation_defaults() -> None:
    a, b = Invocation(function="f"), Invocation(function="f")
    assert a.request_id != b.request_id
    assert len(a.request_id) == 32 and int(a.request_id, 16) >= 0
    assert (a.attempt, a.tenant, a.hedge, a.payload) == (1, "default", False, {})
    assert a.idempotency_key is None and a.deadline is None and a.remaining_s() is None
    c = Invocation(function="f", payload={"x": 1}, deadline=time.time() + 10)
    remaining = c.remaining_s()
    assert remaining is not None and 9.0 < remaining <= 10.0
    assert c.raw_payload == b'{"x":1}'
    assert c.raw_payload is c.raw_payload  # encoded once
    with pytest.raises(ValidationError):
        Invocation(function="f", retries=3)


# ----------------------------------------------------------------------------- RL data


def test_final_text_and_policy_versions() -> None:
    traj = make_traj()
    assert traj.final_text() == "\\boxed{42}"
    assert traj.policy_versions() == [0, 2]
    assert Trajectory(messages=[Message(role="user", content="hi")]).final_text() == ""
    assert Trajectory().final_text() == "" and Trajectory().policy_versions() == []
    empty_reply = Trajectory(messages=[Message(role="assistant", content="", policy_version=4)])
    assert empty_reply.final_text() == "" and empty_reply.policy_versions() == [4]
    # an empty last reply is the answer, never an earlier turn (a TRL chat prompt's few-shot
    # example scored for a completion that said nothing)
    shot = Trajectory(
        messages=[
            Message(role="user", content="2+2?"),
            Message(role="assistant", content="\\boxed{4}"),
            Message(role="user", content="1+3?"),
            Message(role="assistant", content=""),
        ]
    )
    assert shot.final_text() == ""


def test_trajectory_defaults() -> None:
    a, b = Trajectory(), Trajectory()
    assert a.id != b.id
    assert (a.status, a.env_reward, a.task, a.info, a.messages) == ("ok", None, {}, {}, [])


@pytest.mark.parametrize("status", ["ok", "truncated", "aborted", "infra_failed"])
def test_status_valid(status: str) -> None:
    assert Trajectory(status=status).status == status


def test_status_and_extra_fields_validated() -> None:
    with pytest.raises(ValidationError, match="status"):
        Trajectory(status="done")
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        Trajectory(reward=1.0)
    with pytest.raises(ValidationError, match="role"):
        Message(role="robot", content="x")
    m = Message(role="assistant", content="x", reasoning="because")  # messages allow extras
    assert m.model_dump()["reasoning"] == "because"


def test_reward_result() -> None:
    r = RewardResult(score=1, components={"format": 0.5, "answer": 1.0}, info={"why": "ok"})
    assert r.score == 1.0 and isinstance(r.score, float)
    assert RewardResult.model_validate_json(r.model_dump_json()) == r
    assert RewardResult(score=0.0).components == {} and RewardResult(score=0.0).info == {}
    with pytest.raises(ValidationError):
        RewardResult()
    with pytest.raises(ValidationError):
        RewardResult(score="high")
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        RewardResult(score=1.0, weight=2)


def test_nan_inside_a_model_is_refused_not_turned_into_null() -> None:
    from fabric.protocol import to_strict_json

    with pytest.raises(ValueError, match="NaN or Infinity"):
        to_strict_json(RewardResult(score=float("nan")))
    with pytest.raises(PayloadNotSerializableError):
        encode_payload({"r": RewardResult(score=1.0, components={"x": float("inf")})})
    assert to_strict_json({"text": "NaN and Infinity are words"}) == b'{"text":"NaN and Infinity are words"}'


def test_raw_is_not_accepted_from_the_wire():
    from fabric.protocol import Invocation

    with pytest.raises(ValueError, match="'raw' is not a field"):
        Invocation.model_validate_json('{"function": "f", "payload": {"a": 1}, "raw": "e30="}')
    inv = Invocation.model_validate_json('{"function": "f", "payload": {"a": 1}}')
    assert inv.raw_payload == b'{"a":1}'


def test_a_function_raising_unavailable_fails_retryably_others_finally():
    from fabric.errors import Unavailable
    from fabric.runner import _user_error

    code, message, tb = _user_error(Unavailable("judge endpoint overloaded"))
    assert (code, message, tb) == (ErrorCode.UNAVAILABLE, "judge endpoint overloaded", None)
    assert Result.failure(code, message).retryable
    assert _user_error(ValueError("bad"))[0] == ErrorCode.USER_ERROR


def test_a_developer_turn_is_a_message():
    """The system turn of newer OpenAI-style chat templates (gpt-oss) was refused as an unknown
    role, so a trainer's conversational prompt with one could not become a Trajectory."""
    from fabric.protocol import Trajectory

    t = Trajectory(
        messages=[
            {"role": "developer", "content": "Answer in one word."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris"},
        ]
    )
    assert [m.role for m in t.messages] == ["developer", "user", "assistant"]
    assert t.final_text() == "Paris"


def test_array_library_values_are_written_as_their_values() -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    payload = {"a": np.float32(0.5), "b": np.arange(3), "c": torch.tensor(0.25), "d": np.bool_(True)}
    assert decode_payload(encode_payload(payload)) == {"a": 0.5, "b": [0, 1, 2], "c": 0.25, "d": True}
    with pytest.raises(PayloadNotSerializableError, match="NaN or Infinity"):
        encode_payload({"x": np.array([1.0, np.nan], dtype=np.float32)})  # still refused
