"""Review 17b of the Modal backend: two of Modal's client errors it read as a transport
fault, against the installed modal's exceptions (a fake deployed function raises them)."""

from __future__ import annotations

from sample_fns import REG

from fabric.backends.base import ModalConfig
from fabric.errors import FINAL_ERRORS, RETRYABLE, SAFE_TO_RETRY, ErrorCode
from fabric.protocol import Invocation


async def _invoked_raising(error: Exception):
    """A call through the backend to a deployed function whose ``.remote.aio`` raises
    ``error``, as Modal's client raised it."""
    from fabric.backends.modal_ import ModalBackend

    class Raising:
        @property
        def remote(self):
            return self

        async def aio(self, envelope):
            raise error

    class FakeModal(ModalBackend):
        def _function(self, name):  # the lookup hook: no Modal account here
            return Raising()

    async with FakeModal(REG, ModalConfig()) as b:
        return await b.invoke(Invocation(function="add", payload={"a": 1}))


async def test_a_full_input_queue_is_not_started():
    """Modal's client raises a plain ``Exception("Could not create function call - the input
    queue seems to be full")`` when the server took none of the inputs it put (nothing is
    queued, nothing ran). It was a TransportError, which may have run: a side-effecting
    function's call was not retried, and ended OutcomeUnknown under its key. It is
    NotStarted: retryable, and safe to retry for a side effect."""
    r = await _invoked_raising(Exception("Could not create function call - the input queue seems to be full"))
    assert r.error.type == ErrorCode.NOT_STARTED and r.retryable, r.error
    assert r.error.type in SAFE_TO_RETRY
    assert "input queue seems to be full" in r.error.message and r.worker == "modal"


async def test_another_plain_exception_is_still_a_transport_fault():
    r = await _invoked_raising(Exception("something else"))
    assert r.error.type == ErrorCode.TRANSPORT, r.error


async def test_unimplemented_is_final_and_says_to_upgrade_modal():
    """``UnimplementedError`` is gRPC's UNIMPLEMENTED: Modal's server does not implement
    what this client asked (a modal package too old, or too new, for it). Every call and
    every retry asks the same: it was a TransportError retried to its attempts. It is
    SetupFailed, final, and not the function's answer (not kept under a key)."""
    import modal.exception

    r = await _invoked_raising(modal.exception.UnimplementedError("not implemented"))
    assert r.error.type == ErrorCode.SETUP_FAILED and not r.retryable, r.error
    assert r.error.type not in RETRYABLE and r.error.type not in FINAL_ERRORS
    assert "UnimplementedError" in r.error.message and "pip install -U modal" in r.error.message
