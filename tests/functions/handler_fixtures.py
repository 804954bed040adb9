"""The fixtures of the Lambda entry points' test modules (test_handler*.py): a fresh
container per test (autouse), moto's AWS in-process, the idempotency table, SQS and its
reply queue. A module imports them by their functions' names (``*_fixture``; pytest knows
them by ``name=``), so that a test's argument of the fixture's name redefines no import,
and imports those its fixtures need too (table, sqs and replies need aws; replies, sqs)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("aws_lambda_powertools")
boto3 = pytest.importorskip("boto3")
moto = pytest.importorskip("moto")

from handler_fns import CALLS  # noqa: E402
from handler_helpers import MODULES, REGION, TABLE  # noqa: E402

from functions import handler  # noqa: E402

# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True, name="lambda_env")
def lambda_env_fixture(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A fresh container per test, fake credentials, and the handler_fns module served."""
    for name, value in {
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SECURITY_TOKEN": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "POWERTOOLS_TRACE_DISABLED": "1",
        "POWERTOOLS_METRICS_NAMESPACE": "rl-fabric-test",
        "POWERTOOLS_LOG_LEVEL": "INFO",
        handler.MODULES_ENV: MODULES,
    }.items():
        monkeypatch.setenv(name, value)
    for name in (
        handler.FUNCTIONS_ENV,
        handler.TABLE_ENV,
        handler.REPLY_QUEUE_ENV,
        "AWS_LAMBDA_FUNCTION_NAME",
        "AWS_LAMBDA_INITIALIZATION_TYPE",
        "AWS_PROFILE",
        "POWERTOOLS_IDEMPOTENCY_DISABLED",
        "POWERTOOLS_METRICS_DISABLED",
    ):
        monkeypatch.delenv(name, raising=False)
    CALLS.clear()
    handler.reset()
    yield
    handler.reset()


@pytest.fixture(name="aws")
def aws_fixture() -> Iterator[None]:
    with moto.mock_aws():
        yield


@pytest.fixture(name="table")
def table_fixture(aws: None, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The idempotency table, as powertools' DynamoDBPersistenceLayer expects it."""
    ddb = boto3.client("dynamodb", region_name=REGION)
    ddb.create_table(
        TableName=TABLE,
        KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    monkeypatch.setenv(handler.TABLE_ENV, TABLE)
    return ddb


@pytest.fixture(name="sqs")
def sqs_fixture(aws: None) -> Any:
    return boto3.client("sqs", region_name=REGION)


@pytest.fixture(name="replies")
def replies_fixture(sqs: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    url: str = sqs.create_queue(QueueName="rl-fabric-replies")["QueueUrl"]
    monkeypatch.setenv(handler.REPLY_QUEUE_ENV, url)
    return url
