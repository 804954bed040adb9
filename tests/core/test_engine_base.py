"""The engine contract's start: one start however many callers, each of them waiting for it.

Found on an H100: turns that reached a vLLM replica while it was still loading its tokenizer
went through ``start()`` at once (a flag was set before the start ran) and failed on
``None.apply_chat_template``; the job gave their group up."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from core.rollout.engines.base import Completion, Engine, EngineClosedError, GenerateRequest


class SlowStart(Engine):
    name = "slow-start"

    def __init__(self, fail_first: bool = False) -> None:
        super().__init__()
        self.fail_first = fail_first
        self.starts = 0
        self.ready = False
        self.gate = asyncio.Event()

    async def _start(self) -> None:
        self.starts += 1
        await self.gate.wait()  # a tokenizer loading in a thread, an engine process starting
        if self.fail_first and self.starts == 1:
            raise RuntimeError("the model is not there yet")
        self.ready = True

    async def _close(self) -> None: ...

    async def _pause(self) -> None: ...

    async def _abort(self, request_id: str) -> None: ...

    async def _load_weights(self, state: Any, version: int) -> None: ...

    async def _generate(self, request: GenerateRequest) -> Completion:
        assert self.ready, "generated before the engine had started"
        return Completion(
            request_id=request.request_id,
            text="go",
            token_ids=[1],
            logprobs=[-0.1],
            prompt_ids=[],
            policy_version=self.version,
            finish_reason="stop",
        )


def req() -> GenerateRequest:
    return GenerateRequest(prompt_ids=[1, 2], max_new_tokens=1)


async def test_every_caller_waits_for_the_one_start():
    e = SlowStart()
    turns = [asyncio.ensure_future(e.generate(req())) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert not any(t.done() for t in turns) and e.starts == 1
    e.gate.set()
    done = await asyncio.gather(*turns)
    assert [c.text for c in done] == ["go"] * 3 and e.starts == 1
    await e.start()  # started: returns at once
    assert e.starts == 1
    await e.aclose()


async def test_a_failed_start_reaches_every_waiter_and_the_next_call_tries_again():
    e = SlowStart(fail_first=True)
    turns = [asyncio.ensure_future(e.generate(req())) for _ in range(2)]
    await asyncio.sleep(0.01)
    e.gate.set()
    results = await asyncio.gather(*turns, return_exceptions=True)
    assert [str(r) for r in results] == ["the model is not there yet"] * 2
    assert (await e.generate(req())).text == "go" and e.starts == 2
    await e.aclose()


async def test_a_cancelled_waiter_does_not_cancel_the_start_for_the_others():
    e = SlowStart()
    first, second = (asyncio.ensure_future(e.generate(req())) for _ in range(2))
    await asyncio.sleep(0.01)
    first.cancel()
    await asyncio.sleep(0.01)
    e.gate.set()
    assert (await second).text == "go"
    with pytest.raises(asyncio.CancelledError):
        await first
    await e.aclose()


async def test_closing_while_it_starts_aborts_the_turns_and_leaves_no_start_behind():
    e = SlowStart()
    turn = asyncio.ensure_future(e.generate(req()))
    starter = asyncio.ensure_future(e.start())
    await asyncio.sleep(0.01)
    await e.aclose()
    assert e._starting is not None and e._starting.cancelled()
    assert (await turn).finish_reason == "abort"  # as any aborted turn: not a stray CancelledError
    with pytest.raises(EngineClosedError, match="closed while it started"):
        await starter
    with pytest.raises(EngineClosedError):
        await e.start()


async def test_an_abort_does_not_wait_for_the_model_to_load():
    e = SlowStart()
    r = req()
    turn = asyncio.ensure_future(e.generate(r))
    other = asyncio.ensure_future(e.generate(req()))
    await asyncio.sleep(0.01)
    assert await e.abort(r.request_id)
    c = await asyncio.wait_for(turn, 1)
    assert c.finish_reason == "abort" and c.token_ids == [] and not other.done()
    e.gate.set()  # the start went on for the others
    assert (await other).text == "go" and e.starts == 1
    await e.aclose()


async def test_a_start_that_failed_with_no_one_waiting_is_tried_again():
    e = SlowStart(fail_first=True)
    waiter = asyncio.ensure_future(e.start())
    await asyncio.sleep(0.01)
    waiter.cancel()
    await asyncio.sleep(0.01)
    e.gate.set()
    await asyncio.sleep(0.01)  # the start fails with no one left to tell
    await e.start()
    assert e.starts == 2 and e.ready
    await e.aclose()


# ----------------------------------------------------------------------------- weight swaps


class ChunkedLoad(SlowStart):
    """Loads a state in chunks with an await between them (vLLM's collective_rpc per
    chunk), after its start: the weights of each layer are the version that wrote them."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = [0] * 6
        self.seen: list[tuple[int, list[int]]] = []  # (stamped version, weights) per turn

    async def _load_weights(self, state: Any, version: int) -> None:
        await self.start()  # a restarted vLLM replica's reload waits for its start
        for i in range(len(self.layers)):
            self.layers[i] = state["v"]
            await asyncio.sleep(0.001 * (1 + version % 2))

    async def _generate(self, request: GenerateRequest) -> Completion:
        self.seen.append((self.version, list(self.layers)))
        return await super()._generate(request)


async def test_two_swaps_of_one_engine_load_one_after_the_other():
    # a replica's reload after a restart and the trainer's next publish both waited for the
    # start, then wrote their chunks at once: the engine served a mix of two versions
    e = ChunkedLoad()
    first = asyncio.create_task(e.swap({"v": 3}, 3))
    second = asyncio.create_task(e.swap({"v": 4}, 4))
    turns = [
        asyncio.create_task(e.generate(req().model_copy(update={"request_id": f"t{i}"}))) for i in range(3)
    ]
    await asyncio.sleep(0.01)
    e.gate.set()
    assert await first and await second
    await asyncio.gather(*turns)
    assert e.layers == [4] * 6 and e.version == 4
    assert all(layers == [v] * 6 for v, layers in e.seen), e.seen  # no turn on a mix
    # an older version arriving late is skipped, not loaded over the newer one
    assert not await e.swap({"v": 2}, 2) and e.layers == [4] * 6
    await e.aclose()


class SlowPause(SlowStart):
    """A pause that waits for the step in flight (the torch engine's loop, vLLM's sleep)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate.set()
        self.step_done = asyncio.Event()

    async def _pause(self) -> None:
        await self.step_done.wait()


async def test_a_swap_cancelled_while_it_waits_for_the_pause_reopens_the_gate():
    # the proxy gives a swap up at swap_timeout_s; cancelled inside suspend(), it closed the
    # gate and never reopened it: every later turn of the replica waited for good
    e = SlowPause()
    swap = asyncio.create_task(e.swap({"v": 1}, 1))
    await asyncio.sleep(0.01)
    assert e.suspended
    swap.cancel()
    with pytest.raises(asyncio.CancelledError):
        await swap
    assert not e.suspended and e.version == 0
    out = await asyncio.wait_for(e.generate(req()), 5)
    assert out.finish_reason == "stop"
    await e.aclose()
