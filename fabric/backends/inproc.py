"""Run functions in the calling process: for tests and debugging, no isolation.

Synchronous functions run in a thread so a slow one does not stall the event loop and
``timeout_s`` can be reported; a thread cannot be killed, so a truly hung function keeps
its thread (use the local backend for isolation). Those threads are daemons owned by the
backend: a hung function cannot hold up ``asyncio.run``'s shutdown or the interpreter's
exit, as it did on ``asyncio.to_thread``'s executor (both wait for its threads).

A keyed execution's call (``Invocation.wait_for_run``) follows its deadline as the local
pool's does: an async handler is cancelled there, a synchronous one runs on, and the deadline
moves later (``extend_deadline``) when a caller with a later one joins the execution.

A close answers the calls under way ``BackendClosed``, as the local backend's does: an async
handler is cancelled (its clean-up waited for up to ``_CLOSE_GRACE_S``; one that swallows the
cancellation runs on, and its call is answered when it ends), a synchronous call still
waiting for a thread never runs, and one that runs cannot be interrupted: its call is
answered at once, its thread runs it to its end (nothing waits for it), its result discarded.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from fabric.backends.base import Backend, InprocConfig
from fabric.errors import ErrorCode
from fabric.protocol import Invocation, Result
from fabric.registry import Registry
from fabric.runner import FunctionRunner, not_set_up, outcome_to_result

_QUEUED, _RUNNING, _DROPPED = range(3)  # a _ThreadJob's states
# how long a close waits for the async handlers it cancelled to unwind: the local pool's
# grace for its workers to stop (STOP_GRACE_S), after which it kills them
_CLOSE_GRACE_S = 1.0


class _ThreadJob:
    """One call handed to the daemon threads. ``fut`` is its value for whoever awaits it;
    ``ended`` is done once no thread runs it any more (it ran, or was skipped as given up on
    before it began). Which of those a call given up on gets is decided under a lock, so a
    thread starting it and its caller asking (``drop``) cannot both win."""

    __slots__ = ("_lock", "_state", "call", "ended", "fut", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, call: Callable[[], Any]):
        self.loop = loop
        self.call = call
        self.fut: asyncio.Future[Any] = loop.create_future()
        self.ended: asyncio.Future[None] = loop.create_future()
        self._lock = threading.Lock()
        self._state = _QUEUED

    def begin(self) -> bool:
        """On the thread: whether to run the call (not given up on while it was queued)."""
        with self._lock:
            # fut.cancelled(): its wait timed out or was cancelled while it was queued
            self._state = _DROPPED if self._state == _DROPPED or self.fut.cancelled() else _RUNNING
            return self._state == _RUNNING

    @property
    def begun(self) -> bool:
        """Whether a thread has begun the call (it may have ended since): a snapshot."""
        return self._state == _RUNNING

    def drop(self) -> bool:
        """On the loop, for a call given up on: True when it has not begun and now never will."""
        with self._lock:
            if self._state == _QUEUED:
                self._state = _DROPPED
            return self._state == _DROPPED

    def finish(self, ran: bool, value: Any, error: BaseException | None) -> None:
        """On the loop, once the thread is through with the call."""
        if ran and not self.fut.done():  # else the caller stopped waiting (timeout, cancellation)
            if error is not None:
                self.fut.set_exception(error)
            else:
                self.fut.set_result(value)
        if not self.ended.done():
            self.ended.set_result(None)


class _DaemonThreads:
    """A thread pool of daemon threads that nobody joins (the stdlib's executors are
    joined at loop shutdown and at exit). Idle threads are reused, as in
    ``ThreadPoolExecutor``; a hung call keeps its thread and the next call gets another.

    Its cap is the sum of the ``max_concurrency`` of the synchronous functions it runs
    (``reserve``): what admits calls here (the client's slots, ``fabric serve``'s gate) admits
    that many of each, and a fixed cap (32 threads for every function together) left the rest
    waiting unseen in the queue, their wait counted against their timeout_s. Threads start
    only when calls need them."""

    def __init__(self) -> None:
        self._max = 0
        self._jobs: queue.SimpleQueue[_ThreadJob | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._threads = 0

    def reserve(self, threads: int) -> None:
        """Raise the cap by ``threads``: a synchronous function's ``max_concurrency`` (lower
        it by as many when the function is replaced)."""
        self._max += threads

    def run(self, fn: Callable[..., Any], *args: Any) -> _ThreadJob:
        ctx = contextvars.copy_context()  # as asyncio.to_thread does
        job = _ThreadJob(asyncio.get_running_loop(), lambda: ctx.run(fn, *args))
        self._jobs.put(job)
        if not self._idle.acquire(blocking=False) and self._threads < self._max:
            self._threads += 1
            threading.Thread(target=self._serve, name="fabric-inproc", daemon=True).start()
        return job

    def shutdown(self) -> None:
        """Idle threads end now, busy ones after their call; none is waited for."""
        for _ in range(self._threads):
            self._jobs.put(None)
        self._threads = 0

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            value: Any = None
            error: BaseException | None = None
            ran = job.begin()
            if ran:
                try:
                    value = job.call()
                except BaseException as e:  # handed to the awaiting task, like to_thread
                    error = e
            try:
                job.loop.call_soon_threadsafe(job.finish, ran, value, error)
            except RuntimeError:
                pass  # the loop is closed: nobody waits for this call any more
            self._idle.release()


class _KeyedCall:
    """A keyed execution's call (``wait_for_run``), as ``extend_deadline`` finds it: its
    deadline, and once an async handler runs, the timer that cuts it, when it started and
    the ``timeout_s`` of the code it runs."""

    __slots__ = ("deadline", "started", "timeout_s", "timer")

    def __init__(self, deadline: float | None):
        self.deadline = deadline
        self.started = 0.0  # the loop's clock
        # its own runner's: the function registered again since may have another
        self.timeout_s = 0.0
        self.timer: asyncio.Timeout | None = None

    def keep(self, timer: asyncio.Timeout) -> None:
        self.timer = timer
        self.started = asyncio.get_running_loop().time()


class InprocBackend(Backend):
    kind = "inproc"
    runs_registered_code = True

    def __init__(self, registry: Registry | None = None, config: InprocConfig | None = None):
        super().__init__(registry)
        self.config = config or InprocConfig()
        self._runners: dict[str, FunctionRunner] = {}
        self._calls = 0
        self._threads = _DaemonThreads()
        self._keyed: dict[str, set[_KeyedCall]] = {}
        """The keyed executions' calls under way, by idempotency key (an attempt and its hedge)."""
        self._on_threads: dict[asyncio.Future[Result], _ThreadJob] = {}
        """The calls a thread has or may still take, by their ``submit`` future (``settled``)."""
        self._tasks: set[asyncio.Task[Result]] = set()
        """The calls under way, which a close cancels (see the module docstring)."""

    async def _close(self) -> None:
        # a task that has not run yet would end cancelled without entering _run, which
        # answers the cancellation: one loop turn starts those submitted before the close
        await asyncio.sleep(0)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_CLOSE_GRACE_S)
        self._threads.shutdown()

    def _runner(self, name: str) -> FunctionRunner:
        runner = self._runners.get(name)
        spec = self.registry.get(name)
        if runner is None or runner.spec is not spec:
            # new, or registered again with new code (a notebook cell run again, a module
            # reloaded): the new code runs, under its own limits, set up anew; the old
            # runner's calls under way end as they are
            new = FunctionRunner(self.registry.callable(name), spec)
            new.setup()
            self._runners[name] = new
            if runner is not None and not runner.is_async:
                self._threads.reserve(-runner.spec.max_concurrency)
            if not new.is_async:  # a thread for each call of it that may be admitted
                self._threads.reserve(spec.max_concurrency)
            runner = new
        return runner

    def _submit(self, inv: Invocation) -> asyncio.Future[Result]:
        key = inv.idempotency_key
        if not inv.wait_for_run or key is None:
            return self._track_task(asyncio.ensure_future(self._invoke(inv)))
        # registered before its task first runs: a deadline moved meanwhile is the one it starts with
        call = _KeyedCall(inv.deadline)
        calls = self._keyed.setdefault(key, set())
        calls.add(call)

        def forget(_: object) -> None:
            calls.discard(call)
            if not calls and self._keyed.get(key) is calls:
                del self._keyed[key]

        task = asyncio.ensure_future(self._run(inv, call))
        task.add_done_callback(forget)
        return self._track_task(task)

    def _track_task(self, task: asyncio.Task[Result]) -> asyncio.Task[Result]:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def extend_deadline(self, function: str, idempotency_key: str, deadline: float | None) -> bool:
        calls = self._keyed.get(idempotency_key)
        if not calls:  # nothing under way: what is sent later carries the new deadline
            return True
        loop = asyncio.get_running_loop()
        for call in calls:
            call.deadline = deadline
            timer = call.timer
            if timer is None or timer.expired():  # not started (it reads the new one), or cut already
                continue
            end = call.started + call.timeout_s
            if deadline is not None:
                end = min(end, loop.time() + deadline - time.time())
            timer.reschedule(end)
        return True

    async def _invoke(self, inv: Invocation) -> Result:
        return await self._run(inv, None)

    async def _run(self, inv: Invocation, keyed: _KeyedCall | None) -> Result:
        try:
            runner = self._runner(inv.function)
        except Exception as e:  # an unknown name, or the setup hook raised: final
            return not_set_up(inv, e)
        timeout = runner.spec.timeout_s
        if keyed is not None:
            keyed.timeout_s = timeout
        deadline = inv.deadline if keyed is None else keyed.deadline
        started = time.time()
        remaining = None if deadline is None else deadline - started
        cut_by_deadline = False  # whether the deadline, not only timeout_s, may cut the run
        if remaining is not None:
            if remaining <= 0:
                return Result.failure(
                    ErrorCode.DEADLINE_EXCEEDED,
                    "deadline passed before the call started",
                    function=inv.function,
                    request_id=inv.request_id,
                    started=False,
                )
            if runner.is_async or not inv.wait_for_run:
                # a thread cannot be stopped: a wait cut at the deadline would free a keyed
                # execution's key while its handler still runs (see Invocation.wait_for_run)
                timeout = min(timeout, remaining)
                cut_by_deadline = True
        t0 = time.perf_counter()
        job: _ThreadJob | None = None
        began = True
        cut: bool | None = None  # whether a call cut at its time limit had begun
        try:
            if runner.is_async:
                ok, out = await runner.run_async(
                    inv.raw_payload, timeout, None if keyed is None else keyed.keep
                )
            else:
                # what the handler reads as left: its timeout_s, or the deadline if sooner
                limit = runner.spec.timeout_s if remaining is None else min(runner.spec.timeout_s, remaining)
                job = self._threads.run(runner.run, inv.raw_payload, time.monotonic() + limit)
                self._track(job)
                # not wait_for: on Python 3.11 an answer that lands in the loop turn this call
                # is cancelled (a losing hedge, a caller that gave up) wins over the cancel
                async with asyncio.timeout(timeout):
                    ok, out = await job.fut
        except TimeoutError:
            ok, out = False, (ErrorCode.TIMEOUT, f"{inv.function} ran past its {timeout:.3g} s limit", None)
            # a synchronous call waits for a free thread first (every one held by calls given
            # up on that run on): one that never got one never began, and now never will
            began = cut = job is None or not job.drop()
        except asyncio.CancelledError:
            if not self._closed:
                raise  # its caller's: a hedge that lost, a caller that gave up
            # the close's (_close): the call is answered, not cancelled under its caller
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            if job is None:
                what = "while the call ran; it was cancelled"
            elif job.drop():
                what = "while the call waited for a thread (it did not start)"
                began = False
            else:
                what = "while the call ran; its thread runs on, its result discarded"
            ok, out = False, (ErrorCode.BACKEND_CLOSED, f"backend closed {what}", None)
            cut = began
        finally:
            if keyed is not None:
                keyed.timer = None  # left: a later move has nothing to move (and would raise)
        exec_ms = (time.perf_counter() - t0) * 1e3
        self._calls += 1
        at_deadline = False
        if not ok and out[0] == ErrorCode.TIMEOUT and cut_by_deadline:
            # the deadline as it is now (a keyed call's may have moved): cut there, or at timeout_s
            deadline = inv.deadline if keyed is None else keyed.deadline
            at_deadline = deadline is not None and deadline < started + runner.spec.timeout_s
            if at_deadline and keyed is None:
                # a plain call is answered DeadlineExceeded at its deadline, as the local pool's
                # is (not a FunctionTimeout of a made-up limit, which a job scores as the output's)
                if not began:
                    what = "while it waited for a thread (it did not start)"
                elif runner.is_async:
                    what = "while running; the call was cancelled"
                else:
                    what = "while running; its thread runs on, its result discarded"
                ok, out = False, (ErrorCode.DEADLINE_EXCEEDED, f"deadline passed {what}", None)
                cut = began  # (its type says nothing of it by itself: a call cut as it ran began)
        if not ok and out[0] == ErrorCode.TIMEOUT and not began:
            # it waited its timeout_s for a thread and never ran: the backend's back-pressure,
            # answered as Lambda answers a function whose concurrency is all in use. Not the
            # function's FunctionTimeout, which says it ran past its limit: a reward job scored
            # that as the response's fault, and a side effect was not retried (and under a key
            # kept OutcomeUnknown) though it provably never ran. The circuit breaker counts it
            # as it counts every Throttled: an infrastructure failure, not the function's
            ok, out = (
                False,
                (
                    ErrorCode.THROTTLED,
                    f"{inv.function}: no thread came free within its {timeout:.3g} s limit (each is held "
                    "by a call that runs on past its answer); it did not start",
                    None,
                ),
            )
        result = outcome_to_result(
            inv, ok, out, exec_ms=exec_ms, worker="inproc", started=cut, version=runner.spec.version
        )
        if at_deadline and keyed is not None:
            result.cut_at_deadline = True  # the callers' deadline, not the infrastructure
        return result

    def _track(self, job: _ThreadJob) -> None:
        """Keep ``job`` under the ``submit`` future running this (``_submit`` made it the task
        of ``_run``) until its thread is through with it: a thread cannot be stopped, so a call
        answered early (its deadline, timeout_s) or cancelled runs on there (``settled``)."""
        task = asyncio.current_task()
        if task is None:
            return
        self._on_threads[task] = job
        job.ended.add_done_callback(lambda _: self._on_threads.pop(task, None))

    def settled(self, function: str, fut: asyncio.Future[Result]) -> asyncio.Future[None] | None:
        job = self._on_threads.get(fut)
        if job is not None and not job.ended.done() and not job.drop():
            return job.ended  # a thread runs it, or has begun to: it runs to its end
        if fut.done():
            return None
        # a task asked to cancel and still unwinding: an async handler's clean-up may take a
        # while (the local pool holds it until its worker answers the cancel, as this does)
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def unwound(_: object) -> None:
            if not ended.done():
                ended.set_result(None)

        fut.add_done_callback(unwound)
        return ended

    def started(self, function: str, fut: asyncio.Future[Result]) -> bool | None:
        # a synchronous call still waiting for a thread has not; an async handler (no job)
        # runs on the loop as soon as its task does: not known here, read as begun
        job = self._on_threads.get(fut)
        return None if job is None else job.begun

    def stats(self) -> dict[str, Any]:
        return {"calls": self._calls}
