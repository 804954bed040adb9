"""Calls under an idempotency key (``KeyedCalls``, between ``Attempts`` and ``Client``):
one execution per key, shared by every caller with the key, each waiting within its own
deadline (the execution's is the latest of theirs); then what the key keeps (the answer, or
``OutcomeUnknown`` for a side effect that may have run), which later callers get instead of
a new execution."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import sys
import time
from typing import Any

from fabric.client_attempts import Attempts
from fabric.client_state import Execution, FnState, Sent
from fabric.errors import FINAL_ERRORS, RETRYABLE, SAFE_TO_RETRY, ErrorCode
from fabric.protocol import Invocation, Result

#: Failures after which a call may have run, in part or whole (the worker died in it, it ran
#: past its timeout, the transport lost the answer, the function reported a dependency down):
#: for a function with side effects, the effect may have happened.
_MAY_HAVE_RUN: frozenset[str] = RETRYABLE - SAFE_TO_RETRY


def _own(value: Any) -> Any:
    """A copy of a key's kept value for one holder (the cache, or one caller): a value shared
    by reference let a caller that changed its answer in place (a score normalised, a list
    appended to) change what every later caller with the key got. JSON from the wire, so a
    deep copy is plain; scalars, the usual reward, are immutable and shared as they are."""
    if value is None or isinstance(value, str | int | float):
        return value
    return copy.deepcopy(value)


def _digest(raw: bytes) -> bytes:
    """What tells a key's payloads apart: a digest of the payload's JSON as sent (the same
    arguments with a dict's keys in another order differ too; build them in one order)."""
    return hashlib.blake2b(raw, digest_size=16).digest()


#: What an entry of the cache costs beside its value and messages, about: the key, the
#: digest, the ``Result`` and its ``Timings`` as Python objects, the dict's slot.
_ENTRY_BYTES = 400


def _approx_bytes(key: str, result: Result) -> int:
    """About how much memory ``result`` kept under ``key`` holds: its value's encoded size
    (JSON, as it came over the wire), its error's text, and ``_ENTRY_BYTES``. A scalar, the
    usual reward, costs no encoding."""
    value = result.value
    if value is None or isinstance(value, bool | int | float):
        n = 8
    elif isinstance(value, str):
        n = len(value)
    else:
        try:
            n = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=repr))
        except (ValueError, TypeError, RecursionError):  # not JSON (a fake backend's object)
            n = sys.getsizeof(value)
    err = result.error
    if err is not None:
        n += len(err.message) + len(err.traceback or "")
    return n + len(key) + _ENTRY_BYTES


def _effect_key(name: str, user_key: str, scope: str) -> str:
    """Where an ``OutcomeUnknown`` is kept for every code of the function: ``name:*:key``
    (a version, a hash, is never ``*``, so it names no code's key), in the tenant's
    ``scope`` (``KeyedCalls._scope``)."""
    return f"{name}:*:{user_key}{scope}"


class KeyedCalls(Attempts):
    """The idempotency part of a ``Client``; its state is the client's (set in its ``__init__``)."""

    _cache: dict[str, tuple[bytes, Result, int]]
    """What each key keeps, with the digest of the payload it was made for (``_digest``) and
    its size (``_approx_bytes``), oldest first (at most ``idempotency_cache_size`` keys and
    ``idempotency_cache_bytes``)."""
    _cache_bytes: int
    """The sizes in ``_cache`` together."""
    _inflight: dict[str, Execution]
    """The execution in flight under each key."""
    _executions: set[asyncio.Task[Result]]
    """The executions' tasks: they outlive their callers, and end with the client."""

    async def _call_keyed(
        self,
        fn: FnState,
        user_key: str,
        payload: dict[str, Any],
        raw: bytes,
        request_id: str,
        deadline: float | None,
        hedge: bool | None,
        tenant: str | None,
        t0: float,
    ) -> Result:
        """A call under an idempotency key: the key's cached answer, else its execution
        (joined when one is in flight, else started), waited for until this caller's own
        deadline."""
        spec = fn.spec
        m = fn.metrics
        key = f"{spec.name}:{spec.version}:{user_key}"  # as sent (the handler adds the tenant)
        scope = self._scope(tenant)
        here = key + scope  # the key in this client's cache and in flight
        digest = _digest(raw)
        entry = self._cache.get(here)
        if entry is None and spec.side_effects:
            # an effect that may have happened under earlier code under this key: still
            # unknown, whatever code is registered now (_conclude)
            entry = self._cache.get(_effect_key(spec.name, user_key, scope))
        ex = self._inflight.get(here)
        if entry is not None:
            # an OutcomeUnknown holds whatever the payload: no effect runs again under the key
            err = entry[1].error
            other = entry[0] != digest and (err is None or err.type != ErrorCode.OUTCOME_UNKNOWN)
        else:
            other = ex is not None and ex.digest != digest
        if other:
            # the answer (or the run) under the key is another payload's: given to this one, a
            # key reused for another trajectory was scored as the first, silently (the Lambda
            # handler refuses it so too)
            why = (
                f"{spec.name}: idempotency key {user_key!r} was already used with another payload; "
                "give each payload a key of its own"
            )
            return self._refuse(m, ErrorCode.INVALID_ARGUMENTS, why, spec.name, request_id)
        if entry is not None:
            hit = entry[1]
            m.cache_hits += 1
            # its own timings: the kept ones are the execution's, and a shallow copy would share them
            timings = hit.timings.model_copy(update={"total_ms": (time.perf_counter() - t0) * 1e3})
            # no cold start either: it ran nowhere (the kept answer's flag is its execution's)
            return hit.model_copy(
                update={
                    "cached": True,
                    "cold_start": False,
                    "request_id": request_id,
                    "timings": timings,
                    "value": _own(hit.value),
                }
            )
        joined = ex is not None
        if ex is None:
            refusal, probe = self._breaker_admits(fn)
            if refusal is not None:
                return self._refuse(m, ErrorCode.CIRCUIT_OPEN, refusal, spec.name, request_id)
            inv = Invocation.fast(
                function=spec.name,
                payload=payload,
                request_id=request_id,
                idempotency_key=key,
                # each call sent carries the execution's deadline as it is then, the latest of
                # its callers' (Execution.deadline): an async handler is cancelled there, in the
                # worker, when no caller can use its answer any more. wait_for_run: the backend
                # answers with the run's own outcome, never early while it runs (a synchronous
                # handler runs on past a deadline), so the key stays busy while it may run, and
                # a cut run is a FunctionTimeout: for a side effect, OutcomeUnknown. The
                # remote backends send neither (Invocation.wait_for_run)
                deadline=deadline,
                tenant=tenant or self.config.tenant,
                attempt=1,
                hedge=False,
                wait_for_run=True,
                raw=raw,
            )
            # its retry budget and the code its key names: the spec's as the key is made
            sent = Sent(spec.retry, key_version=spec.version)
            ex = self._inflight[here] = Execution(deadline, digest, fn, sent)
            ex.task = asyncio.create_task(self._execute(fn, inv, user_key, sent, ex, hedge, probe, t0))
            self._executions.add(ex.task)
            ex.task.add_done_callback(self._executions.discard)
        elif ex.join(deadline):
            # a later deadline than the execution had: what was sent moves with it where the
            # backend sent one (the local pool, inproc); the execution's retries go on until this one
            self.backend.extend_deadline(spec.name, key, ex.deadline)
        task = ex.task
        assert task is not None
        # asyncio.wait never cancels the task: a caller that gives up leaves it to the others
        await asyncio.wait((task,), timeout=None if deadline is None else max(deadline - time.time(), 0.0))
        if not task.done():
            # not the execution's outcome (that one is counted when it ends): a give-up
            m.gave_up += 1
            return Result.failure(
                ErrorCode.DEADLINE_EXCEEDED,
                f"{spec.name}: deadline passed while the call under idempotency key {user_key!r} was in "
                "progress; it goes on for the callers still waiting (a synchronous handler to its end), "
                "and a later call with this key gets the answer it leaves",
                function=spec.name,
                request_id=request_id,
                # the execution goes on for others: waiting for a slot, or sent; not known
                # here, and read as begun (as a remote call that did not answer in time is)
                started=True,
            )
        if task.cancelled():  # closed before it had an outcome to count: each caller's own
            result = Result.failure(
                ErrorCode.CANCELLED,
                f"{spec.name}: the client closed before the call under idempotency key {user_key!r} ended",
                function=spec.name,
                request_id=request_id,
            )
        else:
            result = task.result()
            if ex.unsent:  # nothing was sent, every caller's deadline had passed: this one's too
                m.gave_up += 1
                return result if not joined else result.model_copy(update={"request_id": request_id})
            if not joined:
                return result  # the execution counted its outcome as it ended (_execute)
            # no new execution for this caller: its own copy of what the key keeps (the answer,
            # or OutcomeUnknown for a side effect that may have run: what any later caller with
            # the key gets, not the raw failure), "cached"; a failure the key does not keep
            # (the key is free again) is this caller's failure, counted as such
            kept = ex.kept
            timings = result.timings.model_copy(update={"total_ms": (time.perf_counter() - t0) * 1e3})
            result = (kept or result).model_copy(
                update={
                    "value": _own((kept or result).value),
                    "cached": kept is not None,
                    "cold_start": False,
                    "request_id": request_id,
                    "timings": timings,
                }
            )
            if kept is not None:
                m.cache_hits += 1
                return result
        self._settle(fn, result, t0)
        return result

    async def _execute(
        self,
        fn: FnState,
        inv: Invocation,
        user_key: str,
        sent: Sent,
        ex: Execution,
        hedge: bool | None,
        probe: bool,
        t0: float,
    ) -> Result:
        """The execution under a key: attempts and retries, then what a later caller with
        the key gets (``_conclude``), and the key is free again. Its outcome goes into the
        metrics here, once, timed from its starter's call (``t0``): the starter may have
        given up long before. Its attempts go to the code its key names only
        (``sent.key_version``), under the retry budget the function had then (``sent.retry``)."""
        scope = self._scope(inv.tenant)
        assert inv.idempotency_key is not None
        key = inv.idempotency_key + scope  # as _call_keyed keeps it
        cut = False  # the client's close cut it while a side effect may have run
        try:
            await fn.sem.acquire()
            try:
                if ex.deadline is not None and ex.deadline <= time.time():
                    # every caller gave up while it waited for a slot: nothing was sent, and
                    # there is no outcome to count (each caller counts in gave_up, the ones
                    # whose wait ended before this too)
                    ex.unsent = True
                    result = Result.failure(
                        ErrorCode.DEADLINE_EXCEEDED,
                        "deadline passed before the call was sent",
                        function=inv.function,
                        request_id=inv.request_id,
                        started=False,
                    )
                elif self._spec_now(fn).version != sent.key_version:
                    # registered again with new code while it waited for a slot: nothing was sent
                    result = Result.failure(
                        ErrorCode.NOT_STARTED,
                        f"{inv.function}: registered again with new code while the call under "
                        f"idempotency key {user_key!r} waited for a concurrency slot; nothing was sent, "
                        "since the key names the old code. Call again: the new code runs under a key "
                        "of its own",
                        function=inv.function,
                        request_id=inv.request_id,
                    )
                else:
                    # asked again: the circuit may have opened while it waited for a slot
                    refusal, probe = (None, probe) if probe else self._breaker_admits(fn)
                    if refusal is not None:
                        # nothing is sent; the key is free again, as after any failure that did not run it
                        result = Result.failure(
                            ErrorCode.CIRCUIT_OPEN,
                            refusal + "; nothing was sent",
                            function=inv.function,
                            request_id=inv.request_id,
                        )
                    else:
                        try:
                            result = await self._attempt(fn, inv, hedge, lambda: ex.deadline, sent)
                            if not result.ok and self._should_retry(self._may_have_effects(fn, sent), result):
                                result = await self._retry(fn, inv, result, hedge, lambda: ex.deadline, sent)
                        except asyncio.CancelledError:
                            # the close cancels executions (their callers only stop waiting).
                            # Answered Cancelled, the callers were told nothing of an effect that
                            # may have happened (a backend may run a call on after it is let go),
                            # and one that called again with the key through a new client ran it
                            # again: OutcomeUnknown, as for any keyed side effect that may have run
                            if not (
                                self._closed
                                and self._may_have_effects(fn, sent)
                                and self._may_have_run(sent.copies, sent.began_when_cut)
                            ):
                                raise
                            cut = True
                            result = self._cut_by_close(inv, user_key)
                            task = asyncio.current_task()
                            if task is not None:
                                task.uncancel()  # the close's own request, answered by this outcome
            finally:
                # held while a copy it let go still runs (a primary that lost to its hedge)
                self._release_when_settled(fn, sent.copies, fn.sem.release)
            ran = result.version
            if cut:
                ex.kept = self._keep_unknown(fn.spec.name, key, user_key, result, ex.digest, scope)
            elif ran is not None and ran != sent.key_version and self.config.version_check != "off":
                # the answer of other code than the key names (a deployment made before the
                # function was edited): not that code's answer, so not kept under its key (a
                # call with the key after a redeploy runs the code the key names), unless the
                # function has side effects: they happened, and must not happen twice. What is
                # kept says the version that gave it (Result.version), never the key's
                if not self._may_have_effects(fn, sent):
                    ex.kept = None
                elif result.error is not None and result.error.type == ErrorCode.VERSION_MISMATCH:
                    # refused, but it ran
                    ex.kept = self._refused(fn, key, user_key, result, ex.digest, scope)
                else:
                    # read as the caller's own code's outcome is: kept raw, a WorkerLost was
                    # served (retryable) to every later caller instead of OutcomeUnknown, and
                    # a call that did not start held the key for good
                    ex.kept = self._conclude(fn, key, user_key, result, True, ex.digest, scope)
                    self._keep_too_large(fn, key, user_key, result, ex)
            else:
                ex.kept = self._conclude(
                    fn,
                    key,
                    user_key,
                    result,
                    not result.ok and self._may_have_effects(fn, sent),
                    ex.digest,
                    scope,
                )
                if self._may_have_effects(fn, sent):
                    self._keep_too_large(fn, key, user_key, result, ex)
            if not ex.unsent:
                self._settle(fn, result, t0)
            return result
        finally:
            if probe:
                fn.probing = False
            if self._inflight.get(key) is ex:
                del self._inflight[key]

    def _before_cut(self) -> None:
        """Before the close cancels the executions: ask the backend whether the attempt each
        has out has begun (``Sent.began_when_cut``), while it still holds the call (cancelled,
        its record goes): a side effect it had not begun is no unknown outcome."""
        for ex in self._inflight.values():
            out = [f for f in ex.sent.copies if not f.done()]
            if out:
                ex.sent.began_when_cut = self._began(ex.fn, out)

    def _conclude(
        self,
        fn: FnState,
        key: str,
        user_key: str,
        result: Result,
        side_effects: bool,
        digest: bytes,
        scope: str,
    ) -> Result | None:
        """Remember what a later caller with the key gets instead of a new execution: the
        function's own answer; or, for a function with side effects whose call may have run
        (WorkerLost, FunctionTimeout, ...), a final ``OutcomeUnknown``, since running it
        again could apply the effect twice. After other failures (the call did not run, or
        a pure function) the next caller with the key runs it again. Returns what the key
        keeps (None: nothing, the key is free), which the callers that joined get too.

        The key names the code (``name:version:key``): an answer is the answer of the code
        that gave it, and the function registered again with new code answers under a key of
        its own. An ``OutcomeUnknown`` is no answer but a fact about the world (an effect may
        have happened) that new code does not make known: it is kept for every code of the
        function too (``_effect_key``), and a call of code registered with side effects gets
        it (one without has no effect to apply twice). Kept under the old code's key only, a
        caller retrying with the same key after a re-registration ran the effect again."""
        err = result.error
        if err is None or err.type in FINAL_ERRORS:
            return self._remember(key, result, digest)
        if side_effects and err.type in _MAY_HAVE_RUN:
            name = fn.spec.name
            unknown = Result.failure(
                ErrorCode.OUTCOME_UNKNOWN,
                f"{name}: the call under idempotency key {user_key!r} ended with {err.type} "
                f"({err.message}) and may have run; {name} has side effects, so it is not run "
                "again under this key, by this code or code registered later. Check whether its "
                "effect happened; to run it again, call with a new idempotency key",
                function=name,
                request_id=result.request_id,
            )
            return self._keep_unknown(name, key, user_key, unknown, digest, scope)
        return None

    def _keep_unknown(
        self, name: str, key: str, user_key: str, unknown: Result, digest: bytes, scope: str
    ) -> Result | None:
        """Keep ``OutcomeUnknown`` ``unknown`` under ``key`` and for every code of the function
        (``_effect_key``); returns what ``key`` keeps."""
        self._remember(_effect_key(name, user_key, scope), unknown, digest)
        return self._remember(key, unknown, digest)

    @staticmethod
    def _cut_by_close(inv: Invocation, user_key: str) -> Result:
        """The outcome of a keyed side effect that the client's close cut while it may have run."""
        name = inv.function
        return Result.failure(
            ErrorCode.OUTCOME_UNKNOWN,
            f"{name}: the client closed while the call under idempotency key {user_key!r} was in "
            f"flight, and it may have run (a backend may run a call on after it is let go); {name} "
            "has side effects, so its outcome is unknown. Check whether its effect happened before "
            "calling again with this key from another client (the Lambda handler keeps keys itself; "
            "the local backends do not); to run it again, call with a new idempotency key",
            function=name,
            request_id=inv.request_id,
            started=True,
        )

    def _keep_too_large(self, fn: FnState, key: str, user_key: str, result: Result, ex: Execution) -> None:
        """For a function with side effects whose answer ``result`` was too large to keep
        (``ex.kept`` None): keep ``_not_kept`` instead, else the next call with the key would
        apply the effect again (the callers that joined still get the answer itself)."""
        if ex.kept is None and result.ok and self._cache_on:
            self._remember(key, self._not_kept(fn.spec.name, user_key, result), ex.digest)

    def _refused(
        self, fn: FnState, key: str, user_key: str, result: Result, digest: bytes, scope: str
    ) -> Result | None:
        """What the key keeps for a call of a function with side effects whose answer came
        from other code and was refused (``version_check="refuse"``): it ran, so its effect
        happened. The ``VersionMismatch`` itself under the key, or, too large to keep, an
        ``OutcomeUnknown`` (as for an answer too large: ``_not_kept``); and an
        ``OutcomeUnknown`` for every code of the function (``_effect_key``), as ``_conclude``
        keeps for an effect that may have run: kept under this code's key only, a call with
        the key after the function was registered again (the fix made) ran the effect again,
        and the caller never had its answer."""
        if not self._cache_on:
            return None
        name = fn.spec.name
        unknown = Result.failure(
            ErrorCode.OUTCOME_UNKNOWN,
            f"{name}: the call under idempotency key {user_key!r} ran other code than this "
            f"client's (version {result.version}), whose answer was refused "
            f"(ClientConfig.version_check='refuse'); {name} has side effects, so it is not run "
            "again under this key, by this code or code registered later. Check whether its effect "
            "happened; to run it again, call with a new idempotency key",
            function=name,
            request_id=result.request_id,
            started=True,
        )
        unknown.version = result.version  # what a key keeps says the code that gave it
        self._remember(_effect_key(name, user_key, scope), unknown, digest)
        kept = self._remember(key, result, digest)
        return kept if kept is not None else self._remember(key, unknown, digest)

    def _scope(self, tenant: str | None) -> str:
        """What keeps the keys of a call's tenant apart from other tenants' in this client:
        nothing for the client's own (``ClientConfig.tenant``), else the tenant after a NUL.
        The Lambda handler scopes a key by its tenant; one key space here for every tenant
        the calls named (``tenant=``) refused another tenant's call with the key as another
        payload's, or answered it with the first tenant's execution, its effect not applied."""
        if tenant is None or tenant == self.config.tenant:
            return ""
        return "\x00" + tenant

    @property
    def _cache_on(self) -> bool:
        return self.config.idempotency_cache_size > 0

    @staticmethod
    def _not_kept(name: str, user_key: str, result: Result) -> Result:
        """What a key keeps for an answer of a function with side effects too large to keep."""
        return Result.failure(
            ErrorCode.OUTCOME_UNKNOWN,
            f"{name}: the call under idempotency key {user_key!r} ran and answered, but its answer "
            f"(about {_approx_bytes('', result):,} bytes) is larger than idempotency_cache_bytes and "
            f"was not kept; {name} has side effects, so it is not run again under this key. Raise "
            "idempotency_cache_bytes to keep such answers, or call with a new idempotency key",
            function=name,
            request_id=result.request_id,
        )

    def _remember(self, key: str, result: Result, digest: bytes) -> Result | None:
        """Keep ``result`` under ``key``, made for the payload of ``digest``; returns it, or
        None when no cache is kept."""
        cache = self._cache
        max_keys, max_bytes = self.config.idempotency_cache_size, self.config.idempotency_cache_bytes
        if max_keys == 0:
            return None
        size = _approx_bytes(key, result)
        if size > max_bytes:
            # kept, it would drop every other answer and still not fit: returned, not kept
            # (the key runs again), and what is kept stays
            return None
        old = cache.pop(key, None)  # (an effect key kept again: its new entry is the newest)
        if old is not None:
            self._cache_bytes -= old[2]
        while cache and (len(cache) >= max_keys or self._cache_bytes + size > max_bytes):
            # dicts keep insertion order: drop the oldest
            self._cache_bytes -= cache.pop(next(iter(cache)))[2]
        # a copy: the caller that ran it gets ``result`` itself, and settles its own latency into it
        # (and may change its value in place)
        kept = result.model_copy(update={"timings": result.timings.model_copy(), "value": _own(result.value)})
        cache[key] = (digest, kept, size)
        self._cache_bytes += size
        return kept
