"""What the Lambda entry points' test modules (test_handler*.py) share besides their
fixtures (handler_fixtures.py): a direct invoke, stdout's JSON lines and EMF metrics, and
the SQS event source mapping emulated the way Lambda does it: receive, call
``sqs_handler``, delete every record not listed in ``batchItemFailures``."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("aws_lambda_powertools")
boto3 = pytest.importorskip("boto3")
moto = pytest.importorskip("moto")

from handler_fns import LambdaContext  # noqa: E402

from fabric.protocol import Invocation, Result  # noqa: E402
from functions import handler  # noqa: E402

TABLE = "rl-fabric-idempotency"
# the two built-ins the tests use, not the whole package: these tests do not depend on every
# other built-in importing (tests/test_conformance.py covers that, and test_default_modules)
MODULES = "functions.rewards.exact_match,functions.tools.calculator,handler_fns"
REGION = "us-east-1"
TRAJ = {
    "messages": [
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "So the answer is \\boxed{42}.", "policy_version": 3},
    ]
}


# ----------------------------------------------------------------------------- helpers


def invoke(
    function: str, payload: dict[str, Any] | None = None, ctx: LambdaContext | None = None, **fields: Any
) -> Result:
    event = Invocation(function=function, payload=payload or {}, **fields).model_dump(mode="json")
    return call(event, ctx)


def call(event: Any, ctx: LambdaContext | None = None) -> Result:
    out = handler.handler(event, ctx or LambdaContext())
    json.dumps(out)  # what Lambda does with the reply
    return Result.model_validate(out)


def stdout_json(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def emf(lines: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """The EMF blobs that carry ``metric``."""
    return [
        line
        for line in lines
        if "_aws" in line
        and any(m["Name"] == metric for m in line["_aws"]["CloudWatchMetrics"][0]["Metrics"])
    ]


def send(sqs: Any, url: str, body: Any, reply_to: str | None = None) -> str:
    attrs = {handler.REPLY_TO_ATTRIBUTE: {"DataType": "String", "StringValue": reply_to}} if reply_to else {}
    text = body if isinstance(body, str) else Invocation.model_validate(body).model_dump_json()
    message_id: str = sqs.send_message(QueueUrl=url, MessageBody=text, MessageAttributes=attrs)["MessageId"]
    return message_id


def deliver(sqs: Any, url: str, ctx: LambdaContext | None = None) -> tuple[dict[str, Any], list[str]]:
    """One poll of the event source mapping: receive a batch, run ``sqs_handler``, delete the
    records it did not report as failed. Returns the response and the batch's message ids."""
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    got = sqs.receive_message(
        QueueUrl=url,
        MaxNumberOfMessages=10,
        VisibilityTimeout=0,  # a failed record is at once visible again (no real waiting)
        AttributeNames=["All"],
        MessageAttributeNames=["All"],
    )
    messages = got.get("Messages", [])
    if not messages:  # Lambda polls but never invokes with an empty batch
        return {"batchItemFailures": []}, []
    event = {
        "Records": [
            {
                "messageId": m["MessageId"],
                "receiptHandle": m["ReceiptHandle"],
                "body": m["Body"],
                "attributes": m["Attributes"],
                "messageAttributes": {
                    k: {
                        "stringValue": v.get("StringValue"),
                        "binaryValue": None,
                        "stringListValues": [],
                        "binaryListValues": [],
                        "dataType": v["DataType"],
                    }
                    for k, v in m.get("MessageAttributes", {}).items()
                },
                "md5OfBody": m["MD5OfBody"],
                "eventSource": "aws:sqs",
                "eventSourceARN": arn,
                "awsRegion": REGION,
            }
            for m in messages
        ]
    }
    response = handler.sqs_handler(event, ctx or LambdaContext())
    failed = {f["itemIdentifier"] for f in response["batchItemFailures"]}
    for m in messages:
        if m["MessageId"] not in failed:
            sqs.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
    return response, [m["MessageId"] for m in messages]


def drain(sqs: Any, url: str) -> list[Result]:
    out: list[Result] = []
    while True:
        got = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, MessageAttributeNames=["All"])
        if not got.get("Messages"):
            return out
        for m in got["Messages"]:
            result = Result.model_validate_json(m["Body"])
            assert m["MessageAttributes"]["request_id"]["StringValue"] == result.request_id
            assert m["MessageAttributes"]["ok"]["StringValue"] == str(result.ok).lower()
            out.append(result)
            sqs.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
