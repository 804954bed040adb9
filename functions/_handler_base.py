"""What the parts of the Lambda handler share: the environment variables it reads, the state
one execution environment keeps between invocations, and the failed ``Result`` of a call.

The container (``handler._Container``) is built in layers, each in its own module and each on
the one before: idempotency (``_handler_idempotency``), parsing and running a request
(``_handler_requests``), the entry points and their replies (``_handler_replies``). The state
is declared here, so that each layer type-checks on its own, and set in ``_Container.__init__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fabric.errors import ErrorCode
from fabric.protocol import Invocation, Result

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable
    from concurrent.futures import ThreadPoolExecutor

    from aws_lambda_powertools import Logger, Metrics
    from aws_lambda_powertools.utilities.batch import BatchProcessor

    from fabric.registry import Registry
    from fabric.runner import FunctionRunner

SERVICE = "rl-fabric"
MODULES_ENV = "RL_FABRIC_MODULES"
"""Comma-separated modules/packages (or ``file.py`` paths) whose functions this Lambda serves."""
FUNCTIONS_ENV = "RL_FABRIC_FUNCTIONS"
"""Optional comma-separated allow-list of function names; their setup hooks run at cold start."""
TABLE_ENV = "RL_FABRIC_IDEMPOTENCY_TABLE"
"""DynamoDB table (hash key ``id``, TTL attribute ``expiration``); unset: no idempotency."""
TTL_ENV = "RL_FABRIC_IDEMPOTENCY_TTL_S"
REPLY_QUEUE_ENV = "RL_FABRIC_REPLY_QUEUE_URL"
"""SQS queue that receives the ``Result`` of every SQS-triggered invocation."""
REPLY_TO_ATTRIBUTE = "reply_to"
"""SQS message attribute (String) naming the reply queue of one message; overrides the env."""


class _ContainerBase:
    """Everything one Lambda execution environment keeps between invocations (see
    ``handler._Container``, which sets it)."""

    logger: Logger
    namespace: str
    metrics: Metrics
    processor: BatchProcessor
    worker: str
    reply_queue_url: str | None
    _sqs: Any
    _s3: Any
    _fetcher: ThreadPoolExecutor | None
    """The threads that read spilled payloads (made at the first one)."""
    _resend: set[str]
    _runners: dict[str, FunctionRunner]
    _loop: asyncio.AbstractEventLoop | None
    _first_call: bool
    registry: Registry
    served: frozenset[str]
    table: str | None
    _idempotent: Callable[..., Any] | None
    _store: Any
    """The idempotency store (powertools' ``DynamoDBPersistenceLayer``), with a table."""
    init_error: str | None
    _began: bool
    """Whether the current invocation's function has begun to run (``_Requests._run``): a
    failure of the handler's own code after that may have left the function's effects."""
    _current: Invocation | None
    """The current direct invocation, once parsed (``_Replies.direct``)."""

    def take_cold(self) -> bool:
        cold, self._first_call = self._first_call, False
        return cold

    def _failure(
        self, inv: Invocation, code: ErrorCode, message: str, *, started: bool | None = None
    ) -> Result:
        return Result.failure(
            code, message, function=inv.function, request_id=inv.request_id, started=started
        )
