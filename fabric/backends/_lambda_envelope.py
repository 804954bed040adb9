"""The request body the Lambda backend sends: the fabric ``Invocation`` as JSON
(``envelope``), its payload bytes spliced in as the client encoded them once."""

from __future__ import annotations

import json

from fabric.protocol import Invocation


def envelope(inv: Invocation, payload: bytes | None = None) -> bytes:
    """The ``Invocation`` as JSON, its payload bytes spliced in as encoded once by the client
    (or ``payload``: a spill pointer)."""
    raw = inv.raw_payload if payload is None else payload
    return _envelope_head(inv) + raw + b"}"


def _envelope_head(inv: Invocation) -> bytes:
    """The envelope up to its payload: ``envelope`` is this, the payload and ``}``."""
    head = {
        "function": inv.function,
        "request_id": inv.request_id,
        "idempotency_key": inv.idempotency_key,
        # a keyed execution's call (wait_for_run) goes as it always has: with no deadline and
        # no mark. A handler deployed from older code refuses a field it does not know
        # (InvalidArguments, which the client would keep under the key), and a run cut at a
        # deadline there is not recorded under the key (the handler drops its in-progress
        # record), so another client process would run a side effect again. The run is bounded
        # by the function's timeout_s; each caller's own deadline bounds its wait.
        "deadline": None if inv.wait_for_run else inv.deadline,
        "tenant": inv.tenant,
        "attempt": inv.attempt,
        "hedge": inv.hedge,
    }
    return json.dumps(head, separators=(",", ":"))[:-1].encode() + b',"payload":'
