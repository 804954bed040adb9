"""The idempotency of the Lambda handler: an invocation with an ``idempotency_key`` runs
once under it (aws-lambda-powertools' idempotency, in DynamoDB), and what the store keeps
under a key (a final answer, or the ``OutcomeUnknown`` of a side effect that may have run)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from fabric.errors import FINAL_ERRORS, SAFE_TO_RETRY, ErrorCode, pickled_whole
from fabric.protocol import Invocation, Result
from functions._handler_base import SERVICE, TABLE_ENV, TTL_ENV, _ContainerBase

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabric.runner import FunctionRunner
    from fabric.spec import FunctionSpec

#: Results larger than this, as powertools stores them (``_stored_bytes``), are returned but
#: not stored for idempotency: a DynamoDB item holds at most 400 KB, and the rest is headroom
#: for the key, the payload hash, the status and expiry attributes and their names.
MAX_CACHED_RESULT_BYTES = 350_000
#: What the idempotency store keeps under a key: the function's own answers, and the
#: ``OutcomeUnknown`` an SQS-triggered side effect that may have run concludes with.
_KEPT_ERRORS = FINAL_ERRORS | {ErrorCode.OUTCOME_UNKNOWN}


class _NotCached(Exception):
    """Raised out of the idempotent region so that powertools deletes the in-progress record
    instead of storing the outcome (powertools stores whatever the function *returns*)."""

    def __init__(self, result: Result):
        super().__init__(result.error.type if result.error else "not cached")
        self.result = result

    def __reduce__(self) -> tuple[Any, ...]:
        return pickled_whole(self)  # its message is the error's type, not the Result


def _run_recorded(*, key: dict[str, Any], run: Callable[[], Result]) -> Result:
    """The function powertools makes idempotent (``key`` is what it hashes). Only a final
    answer is returned, and so stored: a success or one of ``FINAL_ERRORS``, the same rule
    as the client's own cache (or an ``OutcomeUnknown`` the SQS path concludes with). A
    retryable failure or a passed deadline must let the next call with the key run again,
    and a result too large for a DynamoDB item cannot be kept."""
    result = run()
    final = result.ok or (result.error is not None and result.error.type in _KEPT_ERRORS)
    if not final or _stored_bytes(result) > MAX_CACHED_RESULT_BYTES:
        raise _NotCached(result)
    return result


def _stored_bytes(result: Result) -> int:
    """The size of the item attribute powertools writes for ``result``: its persistence layer
    stores ``json.dumps(..., sort_keys=True)`` of the serializer's dict, ASCII-escaped, so a
    CJK character takes 6 bytes (``\\uXXXX``), not the 1 character or 3 UTF-8 bytes of
    ``model_dump_json``."""
    return len(json.dumps(result.model_dump(mode="json"), sort_keys=True).encode())


def _read_stored(data: dict[str, Any]) -> Result | None:
    """A ``Result`` read back from the store, or None when this code cannot read it. During a
    rolling deploy a newer handler may have stored a ``Result`` with a field this code does
    not know yet: read strictly (``extra="forbid"``), that record failed every call with its
    key until it expired. Fields it does not know are dropped, as the client drops them from a
    newer handler's reply (``_lambda_replies._as_result``); writing stays strict."""
    try:
        return Result.model_validate(data)
    except ValidationError as e:
        unknown = [err["loc"] for err in e.errors() if err["type"] == "extra_forbidden"]
        if not unknown or len(unknown) < e.error_count():
            return None  # a field it knows that it cannot read: no answer it can give
    known = copy.deepcopy(data)
    for loc in unknown:
        *path, last = loc
        parent: Any = known
        for part in path:
            parent = parent[part]
        del parent[last]
    try:
        return Result.model_validate(known)
    except ValidationError:
        return None


class _Unreadable:
    """What powertools answers for a completed record this code cannot read (its response
    hook's stand-in for the ``Result``): ``_run_once`` drops the record and runs the call."""

    __slots__ = ("record",)

    def __init__(self, record: Any):
        self.record = record


class _LenientSerializer:
    """powertools' ``PydanticSerializer(Result)``, reading leniently (``_read_stored``): a
    record it cannot read at all is logged and read as None, which ``_mark_cached`` turns into
    an ``_Unreadable``. powertools calls only ``to_dict`` and ``from_dict``; not a subclass of
    its serializer base, so that importing this module does not import powertools (an
    optional extra, imported when a table is set)."""

    def __init__(self, logger: Any):
        self.logger = logger

    def to_dict(self, data: Result) -> dict[str, Any]:
        return data.model_dump(mode="json")

    def from_dict(self, data: dict[str, Any]) -> Result | None:
        result = _read_stored(data)
        if result is None:
            self.logger.warning(
                "cannot read an idempotency record (written by another version of the handler?); "
                "treating it as absent and running the call",
                extra={"record_fields": sorted(data)[:20]},
            )
        return result


def _mark_cached(response: Any, idempotent_data: Any) -> Any:
    # powertools calls this only for a response read back from the store
    if response is None:  # the serializer could not read it
        return _Unreadable(idempotent_data)
    return response.model_copy(update={"cached": True}) if isinstance(response, Result) else response


def _payload_hash(payload: dict[str, Any]) -> str:
    # key order must not matter: a retry may rebuild the same payload in another order
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class _Idempotency(_ContainerBase):
    """The container's idempotency store: set up at cold start, used per invocation."""

    def _init_idempotency(self) -> None:
        self.table = os.environ.get(TABLE_ENV) or None
        if self.table is None:
            return  # idempotency off: its TTL does not matter, a bad one included
        raw_ttl = os.environ.get(TTL_ENV, "3600")
        try:
            ttl_s = int(raw_ttl)
        except ValueError:
            ttl_s = 0
        if ttl_s <= 0:
            raise ValueError(f"{TTL_ENV}={raw_ttl!r}: give the TTL as a whole number of seconds > 0")
        from aws_lambda_powertools.utilities.idempotency import (
            DynamoDBPersistenceLayer,
            IdempotencyConfig,
            idempotent_function,
        )

        self.idem_config = IdempotencyConfig(
            # the tenant, function and version scope the caller's key: two training jobs that
            # both say "traj-7" do not share results, nor do two versions of a function
            event_key_jmespath="[tenant, function, version, idempotency_key]",
            # the same key with another payload is refused instead of answered from the store
            payload_validation_jmespath="payload_hash",
            expires_after_seconds=ttl_s,
            response_hook=_mark_cached,
        )
        self._store = DynamoDBPersistenceLayer(table_name=self.table)
        self._idempotent = idempotent_function(
            _run_recorded,
            data_keyword_argument="key",
            persistence_store=self._store,
            config=self.idem_config,
            output_serializer=_LenientSerializer(self.logger),  # type: ignore[arg-type]
            # not the Lambda's name: the key already names the function, so every Lambda
            # serving it (aliases, a redeploy under another name) shares the records
            key_prefix=SERVICE,
        )

    def _key(self, inv: Invocation, spec: FunctionSpec) -> dict[str, Any]:
        """What powertools hashes (and validates) for an invocation's idempotency key."""
        return {
            "tenant": inv.tenant,
            "function": inv.function,
            "version": spec.version,
            "idempotency_key": inv.idempotency_key,
            "payload_hash": _payload_hash(inv.payload),
        }

    def _run_once(
        self, inv: Invocation, runner: FunctionRunner, run: Callable[[], Result], context: Any
    ) -> Result:
        """``run`` under the invocation's idempotency key (or plainly, with no table)."""
        if self._idempotent is None:
            return run()
        from aws_lambda_powertools.utilities.idempotency.exceptions import (
            BaseError,
            IdempotencyAlreadyInProgressError,
            IdempotencyValidationError,
        )
        from botocore.exceptions import BotoCoreError, ClientError

        if callable(getattr(context, "get_remaining_time_in_millis", None)):
            # an in-progress record left by a timed-out invocation expires with it
            self.idem_config.register_lambda_context(context)
        started = False

        def run_started() -> Result:
            nonlocal started
            started = True
            return run()

        key = self._key(inv, runner.spec)
        try:
            result = self._idempotent(key=key, run=run_started)
            if isinstance(result, _Unreadable) and runner.spec.side_effects:
                # the record says the call ran: run again, the effect would be applied twice
                return self._failure(
                    inv,
                    ErrorCode.OUTCOME_UNKNOWN,
                    f"the call under idempotency key {inv.idempotency_key!r} ran before, and its "
                    "record cannot be read by this version of the handler (another version wrote "
                    f"it); {inv.function} has side effects, so it is not run again under this key: "
                    "call it with a new key (or once the record expires)",
                    started=True,
                )
            if isinstance(result, _Unreadable):
                # a record no version of this code can answer with: dropped, and the call runs
                # as if the key had none (the record failed every call with the key until it
                # expired). Dropped only if it is still that record: a caller that raced here
                # and already put its own in-progress record in its place is not undone, and
                # this call then finds that one in progress
                try:
                    self._drop_unreadable(result.record)
                except (BotoCoreError, ClientError) as e:
                    # the table throttled or failed the delete: raised out of the handler, it
                    # became Lambda's error object, read by the client as a final UserError
                    self.logger.exception("cannot drop an unreadable idempotency record")
                    return self._failure(
                        inv,
                        ErrorCode.NOT_STARTED,
                        f"idempotency store ({self.table}): cannot drop the record of key "
                        f"{inv.idempotency_key!r}, which this version of the handler cannot read: {e}; "
                        "retry later",
                        started=False,
                    )
                result = self._idempotent(key=key, run=run_started)
                if isinstance(result, _Unreadable):  # written again meanwhile by another version
                    return self._failure(
                        inv,
                        ErrorCode.NOT_STARTED,
                        f"the idempotency record of key {inv.idempotency_key!r} cannot be read by this "
                        "version of the handler; retry later",
                        started=False,
                    )
            return result
        except _NotCached as e:
            return e.result
        except IdempotencyAlreadyInProgressError:
            # this call did not run; the one in progress will answer
            message = f"a call with idempotency key {inv.idempotency_key!r} is in progress; retry later"
            return self._failure(inv, ErrorCode.NOT_STARTED, message)
        except IdempotencyValidationError:
            message = f"idempotency key {inv.idempotency_key!r} was already used with another payload"
            return self._failure(inv, ErrorCode.INVALID_ARGUMENTS, message)
        except BaseError as e:
            self.logger.exception("idempotency store failed", extra={"function": inv.function})
            message = f"idempotency store ({self.table}): {e}"
            if not started:  # its in-progress record could not be written: nothing ran
                return self._failure(inv, ErrorCode.NOT_STARTED, message)
            # it ran, and its outcome could not be recorded (or its record dropped)
            return self._failure(inv, ErrorCode.TRANSPORT, message)

    def _drop_unreadable(self, record: Any) -> None:
        """Delete a completed record this code cannot read, if it is still the one read."""
        store = self._store
        try:
            store.client.delete_item(
                TableName=store.table_name,
                Key=store._get_key(record.idempotency_key),  # the store's own key layout
                ConditionExpression="#data = :data",
                ExpressionAttributeNames={"#data": store.data_attr},
                ExpressionAttributeValues={":data": {"S": record.response_data}},
            )
        except store.client.exceptions.ConditionalCheckFailedException:
            pass  # replaced meanwhile: the next read finds what replaced it

    def conclude(self, inv: Invocation, result: Result) -> Result:
        """``result``, or the final ``OutcomeUnknown`` of a side effect that may have run.
        Both entry points conclude so: on SQS a redelivery would apply the effect again, and
        on a direct invoke another client (or a retry from outside the fabric client) with
        the same key would run it again, the cut run's idempotency record being dropped."""
        err = result.error
        if err is None or not err.retryable or err.type in SAFE_TO_RETRY or inv.function not in self.served:
            return result
        spec = self.registry.get(inv.function)
        return self.conclude_unknown(inv, spec, result) if spec.side_effects else result

    def conclude_unknown(self, inv: Invocation, spec: FunctionSpec, result: Result) -> Result:
        """The final ``OutcomeUnknown`` of a side effect that may have run (``result`` is a
        retryable failure not in ``SAFE_TO_RETRY``), kept under the invocation's key as the
        client keeps it: running it again on a redelivery could apply the effect twice, and
        its own idempotency record was dropped (or never completed) with the failure."""
        err = result.error
        assert err is not None
        unknown = self._failure(
            inv,
            ErrorCode.OUTCOME_UNKNOWN,
            f"{spec.name}: the call ended with {err.type} ({err.message}) and may have run; "
            f"{spec.name} has side effects, so it is not run again"
            + (
                f" under idempotency key {inv.idempotency_key!r}. Check whether its effect happened; "
                "to run it again, send it with a new idempotency key"
                if inv.idempotency_key is not None
                else ". Check whether its effect happened"
            ),
        )
        unknown.timings, unknown.cold_start, unknown.worker = result.timings, result.cold_start, result.worker
        unknown.version = result.version  # the code that may have run, as the client's own says
        if self._idempotent is None or inv.idempotency_key is None:
            return unknown
        from aws_lambda_powertools.utilities.idempotency.exceptions import BaseError

        try:
            self._idempotent(key=self._key(inv, spec), run=lambda: unknown)
        except BaseError:  # still in progress (its success could not be written) or the store is down
            self.logger.exception(
                "could not keep OutcomeUnknown under the key", extra={"function": spec.name}
            )
        return unknown
