"""AsyncEngine: the engine for services. A step loop runs on its own thread; asyncio
callers add requests and iterate their tokens.

    async for out in engine.generate("req-1", prompt_token_ids, params):
        out.new_token_ids, out.finished, out.finish_reason

Disaggregated decode: `generate(..., remote=handler)` admits the request into
REMOTE_PREFILL; the engine then awaits `handler.run(block_ids, num_cached_tokens)` (a
prefill node writes the KV and returns the first token) and commits it, or prefills
locally when run raises. If the caller leaves meanwhile, `handler.cancel()` is awaited
before the blocks are freed, so no write can land in a reused block.

Disaggregated prefill: `prefill(...)` computes a prompt with its blocks held after the
first token until `release(request_id)`; `on_computed` is called on the step thread.
With `external=loader` the admitted request first waits in REMOTE_PREFILL while
`loader.load(block_ids, num_cached_tokens)` fills leading blocks from elsewhere (the
kv-store); it then computes only the rest (from scratch past the local hits when load
raises). Cancel safety as for remote prefill: `loader.cancel()` is awaited first.

Validation happens in the caller (ValueError before anything is queued). Adds, aborts
and commits run between steps, so the event loop never waits for a step: when the step
thread is idle (no step running, no command queued) they run at once on the caller's
thread, under the engine lock; otherwise they are queued for the step thread, which
applies them in order before its next step. Either way one thread at a time touches the
engine, and commands apply in submission order. `abort` returns once the request's blocks
are freed; leaving the `async for` early aborts the request the same way.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Callable, Protocol

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine, StepOutput
from common.engine.sampling_params import SamplingParams

log = logging.getLogger("pdmesh.engine")


class EngineDeadError(RuntimeError):
    """The step loop crashed; no request can make progress."""


class RemotePrefill(Protocol):
    async def run(self, block_ids: list[int], num_cached_tokens: int) -> int:
        """Have a prefill node fill the blocks; return the first token. Raise to make
        the decode node prefill locally."""

    async def cancel(self) -> None:
        """Stop the prefill node writing; return once no write can land any more."""


class ExternalKV(Protocol):
    async def load(self, block_ids: list[int], num_cached_tokens: int) -> int:
        """Fill the blocks past num_cached_tokens (the local prefix hit) with KV from
        elsewhere; return how many leading prompt tokens hold KV now (whole blocks, at
        least num_cached_tokens, less than the prompt). Raise to compute them here."""

    async def cancel(self) -> None:
        """Stop filling; return once nothing can land in the blocks any more."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine | EngineConfig):
        self.engine = engine if isinstance(engine, LLMEngine) else LLMEngine(engine)
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Condition()
        self._engine_lock = threading.Lock()   # held while the engine runs commands or a step
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._remote: dict[str, RemotePrefill | ExternalKV] = {}
        self._remote_tasks: dict[str, asyncio.Task] = {}
        self.engine.scheduler.on_remote_admit = self._on_remote_admit
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="pdmesh-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model: str, **engine_args: Any) -> "AsyncEngine":
        return cls(EngineConfig.from_kwargs(model, **engine_args))

    # ---- caller side (event loop) --------------------------------------------------
    def _submit(self, command: Callable[[], None]) -> None:
        """Queue command for the step thread. EngineDeadError once the engine is shut down."""
        with self._wake:
            if self._stopped:
                raise EngineDeadError("the engine is shut down")
            self._commands.append(command)
            self._wake.notify()

    def _run_now(self, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """Run fn here if the step thread is idle and nothing is queued before it:
        (True, result), or (False, None) when it must be queued. fn's exception propagates.
        Takes _wake, then the engine lock, in the step thread's order; never blocks on a step."""
        with self._wake:
            if self._stopped or self._commands or not self._engine_lock.acquire(blocking=False):
                return False, None
            try:
                return True, fn()
            finally:
                self._engine_lock.release()
                if self.engine.has_unfinished():
                    self._wake.notify()  # fn left work for a step

    async def _run_on_engine(self, fn: Callable[[], Any]) -> Any:
        """Run fn between steps (at once when the step thread is idle, see the module
        docstring) and return its result."""
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        ran, result = self._run_now(fn)
        if ran:
            return result
        command = _Command(fn, asyncio.get_running_loop())
        self._submit(command)
        return await command.done

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, *, remote: RemotePrefill | None = None,
                       external: ExternalKV | None = None,
                       **add_options: Any) -> AsyncIterator[StepOutput]:
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if remote is not None and external is not None:
            raise ValueError("remote and external are exclusive")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        handler = remote or external

        def add() -> None:
            self._add(request_id, prompt_token_ids, params, handler is not None, add_options)

        self._queues[request_id] = (loop, queue)
        if handler is not None:
            self._remote[request_id] = handler
        try:  # a ValueError leaves nothing queued: added at once (add_request validates) or not yet
            added, _ = self._run_now(add)
            if not added:
                self.engine.validate_request(request_id, prompt_token_ids, params)
        except BaseException:
            self._queues.pop(request_id, None)
            self._remote.pop(request_id, None)
            raise
        finished = False
        try:
            if not added:
                await self._run_on_engine(add)
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
            self._remote.pop(request_id, None)
            if not finished and self._error is None and not self._stopped:
                await asyncio.shield(self._abort_safely(request_id, handler))

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             remote_prefill: bool, add_options: dict[str, Any]) -> None:
        """Engine side of generate: queue the request; a remote one is admitted at once
        when no step work is pending (its handler starts without waiting for a step)."""
        self.engine.add_request(request_id, prompt_token_ids, params, remote_prefill=remote_prefill,
                                **add_options)
        if remote_prefill:
            self.engine.admit_remote()

    async def _abort_safely(self, request_id: str, remote: RemotePrefill | ExternalKV | None) -> None:
        task = self._remote_tasks.get(request_id)
        if task is not None and remote is not None:
            try:
                await remote.cancel()
            except Exception:
                log.exception("cancelling the remote prefill of %s failed", request_id)
            await asyncio.wait([task])
        await self._run_on_engine(lambda: self.engine.abort(request_id))

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      on_computed: Callable[[Any, int, int], None] | None = None,
                      external: ExternalKV | None = None) -> StepOutput:
        """Compute the prompt, sample the first token; the blocks stay held until
        release(request_id) (also when this raises after the first token)."""
        async for out in self.generate(request_id, prompt_token_ids, params, external=external,
                                       hold_blocks=True, on_computed=on_computed):
            if out.finished:
                return out
        raise EngineDeadError(f"prefill of {request_id} ended without a token")

    async def release(self, request_id: str) -> bool:
        return await self._run_on_engine(lambda: self.engine.release(request_id))

    # ---- remote prefill (decode side) ----------------------------------------------
    def _on_remote_admit(self, seq) -> None:
        """Engine side (step thread, or the caller's when admitted at once): the sequence
        got its blocks; start its remote prefill on the caller's loop."""
        entry = self._queues.get(seq.request_id)
        remote = self._remote.get(seq.request_id)
        if entry is None or remote is None:
            self.engine.fallback_local(seq.request_id)
            return
        block_ids, cached = list(seq.block_ids), seq.num_computed_tokens
        loop = entry[0]
        if _running_loop() is loop:  # admitted at once by the caller (see _add)
            loop.call_soon(self._start_remote, seq.request_id, remote, block_ids, cached)
        else:
            loop.call_soon_threadsafe(self._start_remote, seq.request_id, remote, block_ids, cached)

    def _start_remote(self, request_id: str, remote: RemotePrefill | ExternalKV,
                      block_ids: list[int], cached: int) -> None:
        work = self._external_load if hasattr(remote, "load") else self._remote_prefill
        task = asyncio.get_running_loop().create_task(work(request_id, remote, block_ids, cached))
        self._remote_tasks[request_id] = task
        task.add_done_callback(lambda _: self._remote_tasks.pop(request_id, None))

    async def _remote_prefill(self, request_id: str, remote: RemotePrefill, block_ids: list[int],
                              cached: int) -> None:
        try:
            first = await remote.run(block_ids, cached)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("remote prefill of %s failed (%s); prefilling locally", request_id, e)
            await self._run_on_engine(lambda: self.engine.fallback_local(request_id))
            return
        if request_id not in self._remote:
            return  # the caller left; _abort_safely frees the blocks

        def commit():
            if request_id not in self.engine.scheduler.remote:
                return None
            return self.engine.commit_remote(request_id, first)

        out = await self._run_on_engine(commit)
        entry = self._queues.get(request_id)
        if out is not None and entry is not None:
            entry[1].put_nowait(out)

    async def _external_load(self, request_id: str, loader: ExternalKV, block_ids: list[int],
                             cached: int) -> None:
        try:
            num_tokens = await loader.load(block_ids, cached)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("loading the KV of %s failed (%s); computing it here", request_id, e)
            num_tokens = cached
        if request_id not in self._remote:
            return  # the caller left; _abort_safely frees the blocks

        def commit() -> None:
            if request_id not in self.engine.scheduler.remote:
                return
            try:
                self.engine.commit_loaded(request_id, num_tokens)
            except ValueError as e:
                log.error("KV loaded for %s is unusable (%s); computing it here", request_id, e)
                self.engine.commit_loaded(request_id, cached)

        await self._run_on_engine(commit)

    async def abort(self, request_id: str) -> bool:
        """Abort and free the request's blocks; True if it was live."""
        aborted = await self._run_on_engine(lambda: self.engine.abort(request_id))
        entry = self._queues.get(request_id)
        if aborted and entry is not None:
            while not entry[1].empty():  # tokens of steps before the abort are dropped
                entry[1].get_nowait()
            entry[1].put_nowait(StepOutput(request_id, [], True, "abort", 0, 0))
        return aborted

    async def stats(self) -> dict[str, int]:
        return await self._run_on_engine(self.engine.stats)

    def shutdown(self) -> None:
        """Stop the step thread. Commands queued before still run (the step thread drains
        them before it exits); any later call fails with EngineDeadError, and so do queued
        ones if the thread does not exit in time: no caller waits forever."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)
        self._fail_queued(EngineDeadError("the engine is shut down"))

    def _fail_queued(self, error: BaseException) -> None:
        with self._wake:
            commands = list(self._commands)
            self._commands.clear()
        for command in commands:
            if isinstance(command, _Command):
                command.fail(error)

    # ---- step thread --------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stopped and not self._commands and not self.engine.has_unfinished():
                        self._wake.wait()
                    commands = list(self._commands)
                    self._commands.clear()
                    self._engine_lock.acquire()  # before _wake is released: keeps command order
                try:
                    for command in commands:
                        command()
                    if self._stopped:
                        # no command is queued after the flag (see _submit): run the last
                        # ones, so that no caller waits forever on one that never ran
                        with self._wake:
                            commands = list(self._commands)
                            self._commands.clear()
                        for command in commands:
                            command()
                        return
                    if self.engine.has_unfinished():
                        for out in self.engine.step():
                            entry = self._queues.get(out.request_id)
                            if entry is not None:
                                entry[0].call_soon_threadsafe(entry[1].put_nowait, out)
                finally:
                    self._engine_lock.release()
        except BaseException as e:
            log.exception("engine step loop died")
            self._error = e
            for loop, queue in list(self._queues.values()):
                loop.call_soon_threadsafe(queue.put_nowait, e)
            self._fail_queued(EngineDeadError(str(e)))


class _Command:
    """fn to run on the step thread; its result or exception settles `done` on loop."""

    def __init__(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop):
        self.fn, self.loop = fn, loop
        self.done: asyncio.Future = loop.create_future()

    def __call__(self) -> None:
        try:
            result = self.fn()
        except BaseException as e:  # delivered to the caller
            self.fail(e)
        else:
            self._settle(result, None)

    def fail(self, error: BaseException) -> None:
        self._settle(None, error)

    def _settle(self, result: Any, error: BaseException | None) -> None:
        try:
            self.loop.call_soon_threadsafe(_settle, self.done, result, error)
        except RuntimeError:  # the caller's loop is closed: nobody waits any more
            pass


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
