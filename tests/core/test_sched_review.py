"""Regression tests from an adversarial review of ``core/sched`` and ``core/sim``: each pins
a failure that was demonstrated before its fix."""

from __future__ import annotations

import pytest

from core.sim import EngineProfile, Worker


def test_a_blocking_prefill_of_an_evicted_request_does_not_stall_a_later_one():
    # 100 prompt tokens at 1 decode token each, 10 ms a token: a 1 s prefill that blocks
    p = EngineProfile(
        batch_sizes=(1,), step_ms_table=(10.0,), prefill_blocks=True, prefill_ratio=1.0, cache_tokens=0
    )
    w = Worker("w", p)
    w.admit(0.0, "a", 0, 5, 100, "a")
    assert w.next_completion_ms() == pytest.approx(1050.0)
    w.evict(10.0, "a")  # aborted 10 ms into its prefill: the worker is empty
    w.admit(100_000.0, "b", 1, 5, 0, "b")  # much later, nothing to prefill: 5 tokens
    # it was 101,040: the 990 ms of the evicted request's prefill were still charged
    assert w.next_completion_ms() == pytest.approx(100_050.0)
    assert w.busy_ms == pytest.approx(10.0)
