"""Server side of a call stream (contract in services/call_stream/__init__.py).

Each request runs its handler in its own task, so a slow call never holds up the others:
  handle(request) is a coroutine -> a unary call, answered once with its result;
  handle(request) is an async generator -> a streaming call, each yielded response sent
  at once, the last marked `end` (a bare end response is added when none was).
A CallError answers the call with its status; any other exception answers INTERNAL.
Answers are written from the call's own task (one write at a time per stream), so an
answer costs no extra event-loop turn.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, Awaitable, Callable

import grpc

from services.call_stream import CallError

log = logging.getLogger("pdmesh.call_stream")


class CallStreamServer:
    """One stream's calls. A request's timeout_s (0 = none) is its deadline: past it the
    call is stopped and answered DEADLINE_EXCEEDED. on_cancel(request), when given, is
    awaited before a call's task is cancelled (by cancel(), a `cancel` request, its
    deadline, or the end of the stream): the handler's own way to stop cleanly (e.g.
    stop KV writes and wait for those in flight) before its task unwinds."""

    def __init__(self, handle: Callable[[Any], Any], response_type,
                 on_cancel: Callable[[Any], Awaitable[Any]] | None = None):
        self._handle, self._response_type, self._on_cancel = handle, response_type, on_cancel
        self._streaming = "end" in response_type.DESCRIPTOR.fields_by_name
        self._tasks: dict[int, asyncio.Task] = {}
        self._requests: dict[int, Any] = {}
        self._cancel_codes: dict[int, grpc.StatusCode | None] = {}   # None: not answered
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._background_tasks: set[asyncio.Task] = set()
        self._answers: dict[int, asyncio.Task] = {}   # a cancelled call's answer being written
        self._context = None
        self._write_lock = asyncio.Lock()
        self._open = True

    async def serve(self, request_iterator, context) -> None:
        """Await from the servicer method (a coroutine, not a generator): reads requests
        until the client half-closes, then waits for every call to end. On exit by
        cancellation (the client went away) the calls still running are stopped and
        awaited first."""
        self._context = context
        try:
            async for request in request_iterator:
                self._start(request)
            while self._tasks or self._background_tasks:
                await asyncio.wait([*self._tasks.values(), *self._background_tasks])
        finally:
            self._open = False
            await asyncio.shield(self._cancel_all())

    async def cancel(self, call_id: int, code: grpc.StatusCode | None = grpc.StatusCode.CANCELLED) -> bool:
        """Stop that call (on_cancel first, then its task) and wait until its handler has
        finished; True if it was running. It is answered with code (None: not at all)."""
        task = self._tasks.get(call_id)
        if task is None:
            return False
        if call_id in self._cancel_codes:  # already being stopped (e.g. deadline + cancel request)
            await asyncio.wait([task])
            return True
        self._cancel_codes[call_id] = code
        if self._on_cancel is not None:
            try:
                await self._on_cancel(self._requests[call_id])
            except Exception:
                log.exception("stopping call %d failed", call_id)
        task.cancel()
        await asyncio.wait([task])
        answer = self._answers.pop(call_id, None)
        if answer is not None:
            await answer  # the cancelled call is answered before cancel() returns
        return True

    def _start(self, request) -> None:
        call_id = request.call_id
        loop = asyncio.get_running_loop()
        if self._streaming and request.cancel:
            if call_id in self._tasks:
                self._background(self.cancel(call_id, None))
            return
        if call_id in self._tasks:
            message = f"call_id {call_id} is already in use on this stream"
            self._background(self._write(self._error(call_id, grpc.StatusCode.INVALID_ARGUMENT, message)))
            return
        task = loop.create_task(self._run(call_id, request))
        self._tasks[call_id], self._requests[call_id] = task, request
        timeout = getattr(request, "timeout_s", 0.0)
        if timeout > 0:
            self._timers[call_id] = loop.call_later(timeout, self._expire, call_id)
        task.add_done_callback(lambda t: self._done(call_id, t))

    async def _run(self, call_id: int, request) -> None:
        """The call's task: run the handler and write its answers. Cancellation is
        answered by _done (the task may be cancelled before it starts)."""
        try:
            result = self._handle(request)
            if inspect.isasyncgen(result):
                async for response in result:
                    response.call_id = call_id
                    await self._write(response)
                    if response.end:
                        return
                response = self._response_type(call_id=call_id, end=True)
            else:
                response = await result
                response.call_id = call_id
        except CallError as e:
            response = self._error(call_id, e.code, e.message)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("call %d failed", call_id)
            response = self._error(call_id, grpc.StatusCode.INTERNAL, f"internal error: {e!r}")
        await self._write(response)

    async def _write(self, response) -> None:
        if not self._open:
            return
        try:
            async with self._write_lock:
                await self._context.write(response)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as e:
            log.info("answering call %d failed: %r", response.call_id, e)  # the stream is gone

    def _expire(self, call_id: int) -> None:
        self._background(self.cancel(call_id, grpc.StatusCode.DEADLINE_EXCEEDED))

    def _background(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background_tasks.add(task)  # referenced until done
        task.add_done_callback(self._background_tasks.discard)
        return task

    def _done(self, call_id: int, task: asyncio.Task) -> None:
        self._tasks.pop(call_id, None)
        self._requests.pop(call_id, None)
        timer = self._timers.pop(call_id, None)
        if timer is not None:
            timer.cancel()
        code = self._cancel_codes.pop(call_id, grpc.StatusCode.CANCELLED)
        if task.cancelled() and code is not None:
            expired = code == grpc.StatusCode.DEADLINE_EXCEEDED
            text = "deadline exceeded" if expired else "the call was cancelled"
            answer = self._answers[call_id] = self._background(self._write(self._error(call_id, code, text)))
            answer.add_done_callback(lambda _: self._answers.pop(call_id, None))

    def _error(self, call_id: int, code: grpc.StatusCode, message: str):
        response = self._response_type(call_id=call_id, code=code.value[0], message=message)
        if self._streaming:
            response.end = True
        return response

    async def _cancel_all(self) -> None:
        calls = list(self._tasks)
        if calls:
            await asyncio.gather(*(self.cancel(call_id, None) for call_id in calls))
        if self._background_tasks:
            await asyncio.wait(list(self._background_tasks))
