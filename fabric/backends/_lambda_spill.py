"""Spilling a payload too large for Lambda's request to S3 (``LambdaSpill``, a layer of
``LambdaBackend``): the upload on a thread of the spill executor, bounded by
``max_connections`` and the call's deadline, and the envelope that points at it; with the
margin and the thread-to-loop hop the backend's boto3 calls share (``_UNSENT_MARGIN_S``,
``_call_soon``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fabric.backends._lambda_envelope import envelope
from fabric.backends._lambda_replies import LambdaReplies
from fabric.errors import ErrorCode
from fabric.protocol import Invocation, Result, encode_payload
from fabric.spill import aws_error, pointer, spill_key

#: A call waiting for a boto3 slot gives up this long before its deadline, so that its own
#: "not sent" answer reaches the client before the client's timer at the deadline fires.
_UNSENT_MARGIN_S = 0.01


class LambdaSpill(LambdaReplies):
    """The spill part of a ``LambdaBackend``: its executor, slots and S3 client are the
    backend's, made when it starts."""

    _spill_executor: ThreadPoolExecutor | None
    _spill_slots: asyncio.Semaphore | None
    _s3: Any
    _spilled: int

    async def _spill_bounded(self, inv: Invocation) -> bytes | Result:
        """``_spill`` on a thread of the spill executor once one of its ``max_connections``
        slots is free, within the call's deadline: a call whose deadline passes while it waits
        for a slot, or while its payload uploads, is answered ``DeadlineExceeded`` then, and
        not sent. An upload its caller gave up on runs on (boto3 cannot stop it) and keeps its
        slot until it ends. A keyed execution's call (``wait_for_run``) goes as it would have,
        however long."""
        slots, executor = self._spill_slots, self._spill_executor
        assert slots is not None and executor is not None
        deadline = inv.deadline if not inv.wait_for_run else None
        wait = None if deadline is None else deadline - time.time() - _UNSENT_MARGIN_S
        if wait is not None and wait <= 0:
            return self._spill_late(inv, "before its payload was spilled to S3")
        try:
            # as _invoke_boto3 waits for a connection (not wait_for: see there)
            async with asyncio.timeout(wait):
                await slots.acquire()
        except TimeoutError:
            return self._spill_late(
                inv,
                f"while it waited for one of the {self.config.max_connections} uploads of spilled "
                "payloads (max_connections) to end",
            )
        try:
            upload = executor.submit(self._spill, inv)
        except BaseException:  # the executor was shut down (the backend closed)
            slots.release()
            raise
        loop = asyncio.get_running_loop()
        upload.add_done_callback(lambda _: _call_soon(loop, slots.release))
        done = asyncio.wrap_future(upload)
        if deadline is None:
            return await done
        await asyncio.wait((done,), timeout=max(deadline - time.time() - _UNSENT_MARGIN_S, 0.0))
        if not done.done():
            return self._spill_late(inv, "while its payload was uploaded to S3 (the upload runs on)")
        return done.result()

    def _spill_late(self, inv: Invocation, when: str) -> Result:
        return self._fail(
            inv,
            ErrorCode.DEADLINE_EXCEEDED,
            f"{inv.function}: the call was not sent: its deadline passed {when}",
            started=False,  # Lambda was never called
        )

    # -- boto3: the blocking part, on a worker thread
    def _spill(self, inv: Invocation) -> bytes | Result:
        """Upload the payload, return the envelope that points at it (a thread's work)."""
        cfg = self.config
        assert cfg.spill_bucket is not None
        key = spill_key(cfg.spill_prefix, inv.tenant, inv.request_id)
        raw = inv.raw_payload
        try:
            self._s3.put_object(Bucket=cfg.spill_bucket, Key=key, Body=raw, ContentType="application/json")
        except Exception as e:  # botocore's errors
            # Lambda was not called: never a fault after which the call may have run (a side
            # effect's key would be kept OutcomeUnknown); a missing bucket or permission is
            # final, anything else may pass and is safe to retry
            where = f"s3://{cfg.spill_bucket}/{key}"
            code = str(aws_error(e).get("Code", ""))
            if code == "NoSuchBucket":
                return self._fail(
                    inv,
                    ErrorCode.SETUP_FAILED,
                    f"cannot spill the payload to {where}: LambdaConfig.spill_bucket names a bucket that "
                    "does not exist (terraform's output `bucket` is the deployment's)",
                )
            if type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
                # as on the call itself (final Unauthorized): no retry brings credentials
                return self._fail(
                    inv,
                    ErrorCode.UNAUTHORIZED,
                    f"cannot spill the payload to {where}: {type(e).__name__}: {e}; run `aws configure`, "
                    "set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY",
                )
            if code in ("ExpiredToken", "InvalidToken"):
                # S3's 400 for session credentials past their expiry (or malformed): no retry
                # brings new ones, as for Lambda's own ExpiredTokenException on the call
                return self._fail(
                    inv,
                    ErrorCode.UNAUTHORIZED,
                    f"cannot spill the payload to {where}: {e}; refresh the credentials (`aws sso login`, "
                    "a new AWS_SESSION_TOKEN, or a profile that renews them)",
                )
            if code in ("AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return self._fail(
                    inv,
                    ErrorCode.UNAUTHORIZED,
                    f"cannot spill the payload to {where}: {e} (the caller's credentials need s3:PutObject "
                    f"on {cfg.spill_prefix.rstrip('/')}/* of the bucket)",
                )
            return self._fail(
                inv,
                ErrorCode.NOT_STARTED,
                f"cannot spill the payload to {where} (the call was not sent): {e}",
            )
        self._spilled += 1
        return envelope(inv, encode_payload(pointer(cfg.spill_bucket, key, raw)))


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Any) -> None:
    """``callback`` on ``loop`` from a boto3 thread; nothing once the loop is closed."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)
