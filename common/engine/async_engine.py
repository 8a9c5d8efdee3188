"""AsyncEngine: the engine for services. A step loop runs on its own thread; asyncio
callers add requests and iterate their tokens.

    async for out in engine.generate("req-1", prompt_token_ids, params):
        out.new_token_ids, out.finished, out.finish_reason

Validation happens in the caller (ValueError before anything is queued). Adds and aborts
are handed to the step thread through a command queue and applied between steps, so the
event loop never waits for a step. `abort` returns once the request's blocks are freed;
leaving the `async for` early aborts the request the same way.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Callable

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine, StepOutput
from common.engine.sampling_params import SamplingParams

log = logging.getLogger("pdmesh.engine")


class EngineDeadError(RuntimeError):
    """The step loop crashed; no request can make progress."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine | EngineConfig):
        self.engine = engine if isinstance(engine, LLMEngine) else LLMEngine(engine)
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Condition()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="pdmesh-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model: str, **engine_args: Any) -> "AsyncEngine":
        return cls(EngineConfig.from_kwargs(model, **engine_args))

    # ---- caller side (event loop) --------------------------------------------------
    def _submit(self, command: Callable[[], None]) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    async def _run_on_engine(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the step thread between steps and await its result."""
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def command() -> None:
            try:
                result = fn()
            except BaseException as e:  # delivered to the caller
                loop.call_soon_threadsafe(_settle, done, None, e)
            else:
                loop.call_soon_threadsafe(_settle, done, result, None)

        self._submit(command)
        return await done

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[StepOutput]:
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.engine.validate_request(request_id, prompt_token_ids, params)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (loop, queue)
        finished = False
        try:
            await self._run_on_engine(
                lambda: self.engine.add_request(request_id, prompt_token_ids, params))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(str(item)) from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished and self._error is None and not self._stopped:
                await asyncio.shield(self._run_on_engine(lambda: self.engine.abort(request_id)))

    async def abort(self, request_id: str) -> bool:
        """Abort and free the request's blocks; True if it was live."""
        aborted = await self._run_on_engine(lambda: self.engine.abort(request_id))
        entry = self._queues.get(request_id)
        if aborted and entry is not None:
            entry[1].put_nowait(StepOutput(request_id, [], True, "abort", 0, 0))
        return aborted

    async def stats(self) -> dict[str, int]:
        return await self._run_on_engine(self.engine.stats)

    def shutdown(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)

    # ---- step thread --------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stopped and not self._commands and not self.engine.has_unfinished():
                        self._wake.wait()
                    if self._stopped:
                        return
                    commands = list(self._commands)
                    self._commands.clear()
                for command in commands:
                    command()
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        entry = self._queues.get(out.request_id)
                        if entry is not None:
                            entry[0].call_soon_threadsafe(entry[1].put_nowait, out)
        except BaseException as e:
            log.exception("engine step loop died")
            self._error = e
            for loop, queue in list(self._queues.values()):
                loop.call_soon_threadsafe(queue.put_nowait, e)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
