"""The engine's two hand-offs between threads (see common/engine/async_engine.py):
`Command`, one entry of the inbox, whose result settles a future on the caller's loop;
`Outbox`, one request's ordered outputs, put from any thread and read on its loop.
Both act at once when called on their loop's own thread, and never fail because that
loop has closed (nobody waits any more).
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Any, Callable


class Outbox:
    """One request's StepOutputs (or an exception), in order; put from any thread, get on
    the event loop that made it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: deque = deque()
        self._lock = threading.Lock()
        self._waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        """item: a StepOutput, or the exception that ends the stream."""
        waiter = self.push(item)
        if waiter is not None:
            wake_all(self._loop, [waiter])

    def push(self, item) -> asyncio.Future | None:
        """Queue item without waking the reader: the waiter to wake (with wake_all), or
        None when nobody waits. For a step's outputs to many outboxes of one loop, so that
        the loop is woken once per step, not once per request."""
        with self._lock:
            self._items.append(item)
            waiter, self._waiter = self._waiter, None
        return waiter

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    async def get(self):
        while True:
            with self._lock:
                if self._items:
                    return self._items.popleft()
                waiter = self._waiter = self._loop.create_future()
            await waiter

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


class Command:
    """fn to run on whichever thread holds the engine; its result or exception settles
    `done` on the caller's loop. in_forward: fn leaves the running batch alone, so it may
    run while a step's forward pass does."""

    def __init__(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop, in_forward: bool = False):
        self.fn, self.loop, self.in_forward = fn, loop, in_forward
        self.done: asyncio.Future = loop.create_future()
        self.queued_at = time.monotonic()   # how long it has waited: the engine's stall watch

    def __call__(self) -> None:
        try:
            result = self.fn()
        except BaseException as e:  # delivered to the caller
            self._settle(None, e)
        else:
            self._settle(result, None)

    def fail(self, error: BaseException) -> None:
        self._settle(None, error)

    def _settle(self, result: Any, error: BaseException | None) -> None:
        if running_loop() is self.loop:
            _set(self.done, result, error)
            return
        try:
            self.loop.call_soon_threadsafe(_set, self.done, result, error)
        except RuntimeError:  # the caller's loop is closed: nobody waits any more
            pass


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running on this thread, or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def wake_all(loop: asyncio.AbstractEventLoop, waiters: list[asyncio.Future]) -> None:
    """Wake the readers waiting on `waiters` (futures of loop): at once on loop's own
    thread, else with one call_soon_threadsafe for all of them (nothing when the loop has
    closed: nobody reads any more)."""
    if running_loop() is loop:
        _wake(*waiters)
        return
    try:
        loop.call_soon_threadsafe(_wake, *waiters)
    except RuntimeError:
        pass


def _wake(*waiters: asyncio.Future) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)


def _set(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
