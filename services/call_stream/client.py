"""Client side of a call stream (contract in services/call_stream/__init__.py).

One stream at a time per CallStreamClient: opened at the first call, opened again at
the next call after it broke. A reader task hands each response to its call; a write
lock keeps one write in flight (grpc allows no more per call).
"""
from __future__ import annotations

import asyncio
from typing import Callable

import grpc

from services.call_stream import STATUS_BY_VALUE, rpc_error

_BARE_FIELDS = {"call_id", "end", "code", "message"}
_KEPT = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


def _broken(e: Exception) -> grpc.aio.AioRpcError:
    """The error a call fails with when its stream broke: UNAVAILABLE (the peer or the
    connection went away; e.g. gRPC core's INTERNAL on a write to a dead connection),
    except a status the stream itself ended with that callers act on (UNIMPLEMENTED,
    CANCELLED)."""
    if isinstance(e, grpc.aio.AioRpcError):
        if e.code() in _KEPT:
            return rpc_error(e.code(), e.details())
        return rpc_error(grpc.StatusCode.UNAVAILABLE, f"the stream broke: {e.code().name} {e.details()}")
    return rpc_error(grpc.StatusCode.UNAVAILABLE, f"the stream is closed: {e}")


def _error_of(response) -> grpc.aio.AioRpcError | None:
    if not response.code:
        return None
    return rpc_error(STATUS_BY_VALUE.get(response.code, grpc.StatusCode.UNKNOWN), response.message)


class _Stream:
    """One open stream and the calls sent on it."""

    def __init__(self, call: grpc.aio.StreamStreamCall):
        self.call = call
        self.pending: dict[int, object] = {}    # call_id -> _Reply | StreamingCall
        self.write_lock = asyncio.Lock()
        self.closed = False
        self.close_error: grpc.aio.AioRpcError | None = None   # why we closed it
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def write(self, request) -> None:
        """Raises grpc.aio.AioRpcError (see _broken; and closes the stream) when it is broken."""
        try:
            async with self.write_lock:
                await self.call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            error = self.close_error or _broken(e)
            self.close(error)
            raise error from None

    async def _read(self) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the stream ended")
        try:
            while True:
                response = await self.call.read()
                if response is grpc.aio.EOF:
                    break
                entry = self.pending.get(response.call_id)
                if entry is not None and entry.deliver(response):
                    del self.pending[response.call_id]
        except grpc.aio.AioRpcError as e:
            error = _broken(e)
        except asyncio.CancelledError:
            error = self.close_error or rpc_error(grpc.StatusCode.CANCELLED, "the stream was closed")
            raise
        finally:
            self.closed = True
            for entry in self.pending.values():
                entry.fail(error)
            self.pending.clear()

    def close(self, error: grpc.aio.AioRpcError | None = None) -> None:
        """Cancel the stream; its open calls fail with error (default CANCELLED)."""
        if not self.closed:
            self.closed, self.close_error = True, error
        self.call.cancel()


class _Reply:
    """The one response of a unary call."""

    def __init__(self):
        self.future = asyncio.get_running_loop().create_future()

    def deliver(self, response) -> bool:
        if not self.future.done():
            self.future.set_result(response)
        return True

    def fail(self, error: Exception) -> None:
        if not self.future.done():
            self.future.set_exception(error)


class StreamingCall:
    """One streaming call: `async for response in call` yields its responses and raises
    grpc.aio.AioRpcError when it ends with an error (its own status, the stream's, or
    DEADLINE_EXCEEDED past its timeout). A bare last response (end set, nothing else) is
    not yielded. cancel() leaves the call: the server is told to stop it."""

    def __init__(self, client: "CallStreamClient", request, timeout: float | None):
        self._client, self._request = client, request
        self._queue: asyncio.Queue = asyncio.Queue()
        self._stream: _Stream | None = None     # set once the request is being sent
        self._ended = False                     # the last response (or an error) arrived
        self._left = False
        self._last_taken = False                # the caller has had the last response
        loop = asyncio.get_running_loop()
        self._timer = None if timeout is None else loop.call_later(timeout, self._expire, timeout)

    # ---- reader side
    def deliver(self, response) -> bool:
        self._queue.put_nowait(response)
        if response.end:
            self._finish()
        return response.end

    def fail(self, error: Exception) -> None:
        if not self._ended:
            self._queue.put_nowait(error)
            self._finish()

    def _finish(self) -> None:
        self._ended = True
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self, timeout: float) -> None:
        if self._ended:
            return
        self.fail(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"no end within {timeout:g}s"))
        self._tell_server_to_stop()

    # ---- caller side
    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._left:
            raise asyncio.CancelledError()
        if self._last_taken:
            raise StopAsyncIteration
        if self._stream is None:
            stream = self._stream = self._client._current()
            stream.pending[self._request.call_id] = self
            try:
                await stream.write(self._request)
            except grpc.aio.AioRpcError as e:
                stream.pending.pop(self._request.call_id, None)
                self.fail(e)
        while True:
            item = await self._queue.get()
            if isinstance(item, Exception):
                raise item
            error = _error_of(item)
            if error is not None:
                raise error
            if item.end:
                self._last_taken = True
                if {f.name for f, _ in item.ListFields()} <= _BARE_FIELDS:
                    raise StopAsyncIteration
            return item

    def cancel(self) -> None:
        """Leave the call (no-op once it ended): the server stops it; iterating it again
        raises CancelledError."""
        if self._left:
            return
        self._left = True
        if not self._ended:
            self._finish()
            self._tell_server_to_stop()

    def _tell_server_to_stop(self) -> None:
        stream = self._stream
        if stream is None:
            return  # never sent
        stream.pending.pop(self._request.call_id, None)
        if not stream.closed:
            stop = type(self._request)(call_id=self._request.call_id, cancel=True)
            self._client._background(stream.write(stop))


class CallStreamClient:
    """Client side: one stream at a time, opened by open_stream() (a stub's bidi method)
    at the first call and again after the previous one broke. Calls may be concurrent."""

    def __init__(self, open_stream: Callable[[], grpc.aio.StreamStreamCall]):
        self._open_stream = open_stream
        self._stream: _Stream | None = None
        self._next_id = 1
        self._tasks: set[asyncio.Task] = set()

    def _current(self) -> _Stream:
        if self._stream is None or self._stream.closed:
            self._stream = _Stream(self._open_stream())
        return self._stream

    def next_call_id(self) -> int:
        call_id, self._next_id = self._next_id, self._next_id + 1
        return call_id

    def _prepare(self, request, timeout: float | None) -> None:
        if not request.call_id:
            request.call_id = self.next_call_id()
        if timeout is not None and hasattr(request, "timeout_s"):
            request.timeout_s = timeout

    async def call(self, request, timeout: float | None = None):
        """A unary call: send request and return the OK response. request.call_id is set
        here unless the caller took one from next_call_id() (to cancel the call by id
        meanwhile); request.timeout_s (when the message has it) is set to timeout. Raises
        grpc.aio.AioRpcError: the response's status, the stream's when it broke first,
        DEADLINE_EXCEEDED after timeout seconds. Cancelling the caller forgets the call
        (its response is dropped); it does not stop anything on the server."""
        self._prepare(request, timeout)
        stream = self._current()
        reply = stream.pending[request.call_id] = _Reply()
        timer = None
        if timeout is not None:
            timer = asyncio.get_running_loop().call_later(timeout, lambda: reply.fail(rpc_error(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout:g}s on the stream")))
        try:
            try:
                await stream.write(request)
            except grpc.aio.AioRpcError as e:
                reply.fail(e)  # unless the reader failed it first
            response = await reply.future
        finally:
            stream.pending.pop(request.call_id, None)
            if timer is not None:
                timer.cancel()
        error = _error_of(response)
        if error is not None:
            raise error
        return response

    def open(self, request, timeout: float | None = None) -> StreamingCall:
        """A streaming call, sent when first iterated; timeout bounds the whole call."""
        self._prepare(request, timeout)
        return StreamingCall(self, request, timeout)

    def _background(self, coro) -> None:
        async def quietly():
            try:
                await coro
            except grpc.aio.AioRpcError:
                pass  # the stream broke: the server stops the call by itself
        task = asyncio.get_running_loop().create_task(quietly())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def reset(self) -> None:
        """Drop the stream (its open calls fail with CANCELLED); the next call opens one."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    async def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
            await asyncio.wait([stream.reader])
