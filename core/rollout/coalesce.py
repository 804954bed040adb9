"""Coalescing of turn requests into one Ray call, with answers streamed back one by one.

Every trajectory sends its own turns (trajectory-level: nobody waits for anybody), but one
Ray actor call per turn costs more CPU than a tiny policy's forward pass: on 2 cores the
hops (env manager -> proxy -> replica) ate as much as the model. A ``Coalescer`` gathers the
requests issued within ``window_s`` (1 ms by default, as the torch engine batches anyway)
into one call of a streaming generator method; the server runs them concurrently and
yields completions **as they finish**, so a short turn never waits for a long one in
its batch. It is transport batching, like HTTP/2 multiplexing, not batch-level rollout.

    coalescer = Coalescer(lambda items: handle.generate_many.options(num_returns="streaming").remote(items))
    c = await coalescer.call(request_id, item)

A caller cancelled before its batch goes out (within the window) is dropped from the batch:
its request never reaches the server. One cancelled after that is the server's to abort.

Answers find their callers by request id, so no batch holds one id twice: a call whose id is
already in the window (a retry, or a caller reusing an id) sends the window first and starts
the next one. Each caller gets its own answer, as without coalescing (an engine refuses an id
already in flight: that refusal is the second caller's answer).

A server method answers with ``Answer`` objects (the request id plus the value or an
exception, pickled); a transport failure (the actor died) fails every unanswered request of
the call with ``on_error(exc)``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass
class Answer:
    request_id: str
    value: Any = None
    error: BaseException | None = None


async def answer_all(pending: Iterable[tuple[str, Awaitable[Any]]]) -> AsyncIterator[list[Answer]]:
    """Server side: run every ``(request_id, awaitable)`` concurrently, yield answers as
    they complete (exceptions are answers too): those that finish together in one list,
    since each yielded item costs a Ray object (a batched forward pass ends many at once)."""

    async def one(rid: str, aw: Awaitable[Any]) -> Answer:
        try:
            return Answer(rid, await aw)
        except Exception as e:  # data for the caller, who raises it in the right request
            return Answer(rid, error=e)

    todo = {asyncio.ensure_future(one(rid, aw)) for rid, aw in pending}
    try:
        while todo:
            done, todo = await asyncio.wait(todo, return_when=asyncio.FIRST_COMPLETED)
            yield [t.result() for t in done]
    finally:
        for t in todo:
            t.cancel()


class Coalescer:
    def __init__(
        self,
        send: Callable[[list[Any]], Any],
        *,
        on_error: Callable[[BaseException], BaseException] = lambda e: e,
        window_s: float = 0.001,
        max_batch: int = 1024,
    ):
        self.send = send
        """Starts the remote call for a batch of items; returns Ray's streaming generator."""
        self.on_error = on_error
        self.window_s = window_s
        self.max_batch = max_batch
        self._waiting: list[tuple[str, Any, asyncio.Future[Any]]] = []
        self._ids: set[str] = set()
        """The request ids in ``_waiting``: the answers of a batch are matched by id."""
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.calls = 0
        self.requests = 0

    async def call(self, request_id: str, item: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if request_id in self._ids:
            self._flush()  # a second answer with this id would be ambiguous in one batch
        self._ids.add(request_id)
        self._waiting.append((request_id, item, fut))
        if len(self._waiting) >= self.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.window_s, self._flush)
        return await fut

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting, self._waiting = self._waiting, []
        self._ids = set()
        # a caller cancelled within the window (its trajectory was aborted, its group done)
        # has its future cancelled: its request is dropped here, so no turn runs for nobody
        live = [(rid, item, fut) for rid, item, fut in waiting if not fut.done()]
        if not live:
            return
        items = [item for _, item, _ in live]
        futures = {rid: fut for rid, _, fut in live}
        self.calls += 1
        self.requests += len(items)
        task = asyncio.ensure_future(self._run(items, futures))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, items: list[Any], futures: dict[str, asyncio.Future[Any]]) -> None:
        try:
            async for ref in self.send(items):
                answers: list[Answer] = await ref
                for answer in answers:
                    fut = futures.pop(answer.request_id, None)
                    if fut is None or fut.done():
                        continue
                    if answer.error is not None:
                        fut.set_exception(answer.error)
                    else:
                        fut.set_result(answer.value)
        except Exception as e:
            for fut in futures.values():
                if not fut.done():
                    fut.set_exception(self.on_error(e))
            return
        for fut in futures.values():  # the server ended without answering them: a bug there
            if not fut.done():
                fut.set_exception(self.on_error(RuntimeError("the server did not answer this request")))
