"""AsyncEngine: the engine for services. A step loop runs on its own thread; asyncio
callers add requests and iterate their tokens.

    async for out in engine.generate("req-1", prompt_token_ids, params):
        out.new_token_ids, out.finished, out.finish_reason

One inbox, one outbox per request:
- Inbox: every command (add, abort, commit, release, stats) is appended to one FIFO and
  runs in that order. Whoever holds the engine lock drains it: the step thread before
  each step, or the caller at once when the step thread is idle (no step running), so an
  idle engine answers without a thread hop.
- Forward window: while a step's forward pass runs (LLMEngine.forward_window: the step
  touches only its batch's sequences and their blocks' KV), the caller runs at once,
  under the inbox lock, the commands at the head of the inbox that leave the batch alone
  (`in_forward`: add, admit, commit or fail remote KV, release, stats; never abort); the
  step thread closes the window only after they ran. So a remote prefill is admitted and
  its Prefill call sent, and later its first token emitted, while a decode step runs;
  its sequence joins the batch at the next step boundary. A command that may touch the
  batch (abort), and every command queued behind it, waits for that boundary: a
  command waits at most for the step in flight.
- Outbox: every StepOutput the engine emits (a step's tokens, the first token a remote
  prefill commits, an abort's end) is appended to its request's Outbox by the thread that
  drained it from the engine, while that thread holds the engine lock (or, in the
  forward window, the inbox lock). An Outbox is a thread-safe FIFO that wakes its
  consumer's event loop; so a request's outputs arrive complete and in the order the
  engine produced them, however late the loop runs.

KV from elsewhere (`generate(..., remote=kv)`, a RemoteKV): the request is admitted
into KV_REMOTE; the engine then awaits `kv.fill(block_ids, num_cached_tokens)` and
commits what landed: a prefill node's first token (decode side) or the leading tokens the
kv-store provided (prefill side). When fill raises, the engine first asks `kv.cancel()`
whether any write can still land: confirmed, it computes the prompt here in the same
blocks; unconfirmed, in fresh blocks, while the old ones stay QUARANTINED until
`kv.settled()` returns. A caller that leaves meanwhile is handled the same way: cancel,
then the blocks are freed, or quarantined until settled.

Disaggregated prefill: `prefill(...)` computes a prompt; its blocks stay HELD after the
first token until `release(request_id)`; `on_computed` is called on the step thread.

Validation happens in the caller (ValueError before anything is queued). `abort` returns
once the request's blocks are freed (or quarantined); leaving the `async for` early
aborts the request the same way.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Callable

from common.timeline import mark
from common.config import EngineConfig
from common.engine.lifecycle import RequestState
from common.engine.llm_engine import LLMEngine, StepOutput
from common.engine.mailbox import Command, Outbox, running_loop, wake_all
from common.engine.engine_view import EngineView
from common.engine.remote_kv import KVFilled, RemoteKV
from common.engine.sampling_params import SamplingParams

log = logging.getLogger("pdmesh.engine")


class EngineDeadError(RuntimeError):
    """The step loop crashed or the engine is shut down; no request can make progress."""


class AsyncEngine(EngineView):
    def __init__(self, engine: LLMEngine | EngineConfig):
        self.engine = engine if isinstance(engine, LLMEngine) else LLMEngine(engine)
        self._inbox: deque[Callable[[], None]] = deque()   # Commands (tests queue plain callables)
        self._wake = threading.Condition()       # guards _inbox, _stopped, _forward_open
        self._engine_lock = threading.Lock()     # held while commands or a step run
        self._forward_open = False               # a step's forward pass runs: see the module doc
        self._outboxes: dict[str, Outbox] = {}
        self._remote: dict[str, RemoteKV] = {}
        self._fills: dict[str, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self.engine.scheduler.on_remote_admit = self._on_remote_admit
        self.engine.forward_window = self._forward_window
        self._stopped = False
        self._stuck = False   # the last step scheduled nothing (no block free): wait for a command
        self._error: BaseException | None = None
        self._busy_since: float | None = None   # the step thread holds the engine since then
        self._thread = threading.Thread(target=self._loop, name="pdmesh-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model: str, **engine_args: Any) -> "AsyncEngine":
        return cls(EngineConfig.from_kwargs(model, **engine_args))

    # ---- the inbox (caller side) ---------------------------------------------------
    async def _run_on_engine(self, fn: Callable[[], Any], in_forward: bool = False) -> Any:
        """Queue fn in the inbox and return its result once it ran: at once when the step
        thread is idle, or when fn leaves the running batch alone (in_forward: it calls
        only what LLMEngine allows inside forward_window) and a forward pass runs.
        EngineDeadError once the engine is shut down or dead."""
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        command = Command(fn, asyncio.get_running_loop(), in_forward)
        with self._wake:
            if not self._engine_lock.acquire(blocking=False):  # a step runs: queue behind it
                self._submit(command)
                if self._forward_open:
                    self._drain(in_forward=True)
            else:  # idle: drain it here, in order, without waking the step thread for it
                try:
                    self._submit(command, wake=False)
                    self._drain()
                finally:
                    self._engine_lock.release()
                if self.engine.has_unfinished():
                    self._wake.notify()  # the commands left work for a step
        return await command.done

    def _submit(self, command: Callable[[], None], wake: bool = True) -> None:
        """Append command to the inbox (and wake the step thread); EngineDeadError once the
        engine is shut down."""
        with self._wake:
            if self._stopped:
                raise EngineDeadError("the engine is shut down")
            self._inbox.append(command)
            if wake:
                self._wake.notify()

    def _drain(self, in_forward: bool = False) -> None:
        """Engine lock held: run every queued command in order, delivering what each emits.
        in_forward (inbox lock held, forward window open): only those at the head of the
        inbox that may run in the window."""
        while True:
            with self._wake:
                if not self._inbox or (in_forward and not getattr(self._inbox[0], "in_forward", False)):
                    return
                command = self._inbox.popleft()
                self._stuck = False   # a command may have made room: step again
            command()
            self._deliver(self.engine.take_outputs())

    @contextlib.contextmanager
    def _forward_window(self):
        """Step thread, around a step's forward pass (LLMEngine.forward_window): callers may
        run in_forward commands meanwhile; closing waits for one that is running. Commands
        queued just before it opened are run on their caller's loop."""
        with self._wake:
            self._forward_open = True
            head = self._inbox[0] if self._inbox else None
        if getattr(head, "in_forward", False):
            try:
                head.loop.call_soon_threadsafe(self._drain_in_window)
            except RuntimeError:   # its loop is closed: the next boundary drains it
                pass
        try:
            yield
        finally:
            with self._wake:
                self._forward_open = False

    def _drain_in_window(self) -> None:
        with self._wake:
            if self._forward_open:
                self._drain(in_forward=True)

    def _deliver(self, outs: list[StepOutput]) -> None:
        """Every output into its outbox, then one wake-up per event loop (not one per
        request: a step of 32 running requests would wake the loop 32 times, each a
        self-pipe write and a GIL hand-over while this thread goes on to the next step)."""
        waiters: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}
        for out in outs:
            box = self._outboxes.get(out.request_id)
            if box is not None:
                waiter = box.push(out)
                if waiter is not None:
                    waiters.setdefault(box.loop, []).append(waiter)
        for loop, ready in waiters.items():
            wake_all(loop, ready)

    # ---- requests --------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, *, remote: RemoteKV | None = None,
                       **add_options: Any) -> AsyncIterator[StepOutput]:
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        if request_id in self._outboxes:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.engine.validate_request(request_id, prompt_token_ids, params)
        box = self._outboxes[request_id] = Outbox(asyncio.get_running_loop())
        if remote is not None:
            self._remote[request_id] = remote
        finished = False
        try:
            await self._run_on_engine(lambda: self._add(request_id, prompt_token_ids, params,
                                                        remote is not None, add_options), in_forward=True)
            while True:
                item = await box.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(str(item)) from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._outboxes.pop(request_id, None)
            self._remote.pop(request_id, None)
            try:
                if not finished and self._error is None and not self._stopped:
                    await asyncio.shield(self._abort_safely(request_id, remote))
            finally:
                self._fills.pop(request_id, None)

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             kv_remote: bool, add_options: dict[str, Any]) -> None:
        """Engine side of generate: queue the request; a remote one is admitted at once
        unless a step must admit it (its fill starts without waiting for a step)."""
        self.engine.add_request(request_id, prompt_token_ids, params, kv_remote=kv_remote,
                                **add_options)
        if kv_remote:
            self.engine.admit_remote()

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      on_computed: Callable[[Any, int, int], None] | None = None,
                      remote: RemoteKV | None = None, resume_position: int = 0) -> StepOutput:
        """Compute the prompt, sample the first token; the blocks stay HELD until
        release(request_id) (also when this raises after the first token)."""
        async for out in self.generate(request_id, prompt_token_ids, params, remote=remote,
                                       hold_blocks=True, on_computed=on_computed,
                                       resume_position=resume_position):
            if out.finished:
                return out
        raise EngineDeadError(f"prefill of {request_id} ended without a token")

    async def release(self, request_id: str) -> bool:
        return await self._run_on_engine(lambda: self.engine.release(request_id), in_forward=True)

    async def abort(self, request_id: str) -> bool:
        """Abort and free the request's blocks (or quarantine them while a remote fill is
        unconfirmed); True if it was live. Its stream ends with finish_reason abort."""
        remote = self._remote.pop(request_id, None)   # no fill may start after this
        settled = True
        if remote is not None and request_id in self._fills:
            settled = await remote.cancel()
        aborted = await self._run_on_engine(lambda: self.engine.abort(request_id, settled))
        if aborted and not settled:
            self._free_when_settled(request_id, remote)
        box = self._outboxes.get(request_id)
        if aborted and box is not None:
            box.clear()  # tokens of steps before the abort are dropped
            box.put(StepOutput(request_id, [], True, "abort", 0, 0))
        return aborted

    async def _abort_safely(self, request_id: str, remote: RemoteKV | None) -> None:
        """The caller left: stop a fill in progress, then abort (quarantine if unconfirmed)."""
        settled = True
        fill = self._fills.get(request_id)
        if fill is not None and remote is not None:
            try:
                settled = await remote.cancel()
            except Exception:
                log.exception("cancelling the remote KV of %s failed", request_id)
                settled = False
            if not fill.done():
                fill.cancel()
                await asyncio.wait([fill])
        await self._run_on_engine(lambda: self.engine.abort(request_id, settled))
        if not settled:
            self._free_when_settled(request_id, remote)

    def _free_when_settled(self, request_id: str, remote: RemoteKV) -> None:
        async def free() -> None:
            try:
                await remote.settled()
            except Exception:
                log.exception("waiting for the remote writer of %s failed", request_id)
                return  # the blocks stay quarantined: better leaked than overwritten
            try:
                await self._run_on_engine(lambda: self.engine.release_quarantine(request_id), in_forward=True)
            except EngineDeadError:
                pass
        self._spawn(free())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- remote KV (on the caller's loop) --------------------------------------------
    def _on_remote_admit(self, seq) -> None:
        """Engine side (whoever drives the engine: the engine lock's holder, or a caller in
        the forward window): the sequence got its blocks; start its fill on the caller's loop."""
        box, remote = self._outboxes.get(seq.request_id), self._remote.get(seq.request_id)
        if box is None or remote is None:
            self.engine.fail_remote(seq.request_id, writer_settled=True)  # nobody fills it
            return
        args = (seq, remote, list(seq.block_ids), seq.num_computed_tokens)
        mark("decode.admitted", seq.request_id)
        loop = box._loop
        if running_loop() is loop:
            loop.call_soon(self._start_fill, *args)
            return
        try:
            loop.call_soon_threadsafe(self._start_fill, *args)
        except RuntimeError:  # the caller's loop is closed: nobody fills it
            self.engine.fail_remote(seq.request_id, writer_settled=True)

    def _start_fill(self, seq, remote: RemoteKV, block_ids: list[int], cached: int) -> None:
        request_id = seq.request_id
        if self._remote.get(request_id) is not remote or seq.state != RequestState.KV_REMOTE:
            return  # aborted (or left) before it started: nothing may write these blocks
        # kept until the request ends: a fill that ended with an error may still have
        # writers, and leaving the request then asks them to stop first
        self._fills[request_id] = asyncio.get_running_loop().create_task(
            self._fill(request_id, remote, block_ids, cached))

    async def _fill(self, request_id: str, remote: RemoteKV, block_ids: list[int], cached: int) -> None:
        try:
            filled = await remote.fill(block_ids, cached)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if request_id not in self._remote:
                return  # the caller left: _abort_safely settles it
            log.warning("remote KV of %s failed (%s); computing it here", request_id, e)
            settled = await remote.cancel()
            await self._run_on_engine(lambda: self.engine.fail_remote(request_id, settled), in_forward=True)
            if not settled:
                self._free_when_settled(request_id, remote)
            return
        if request_id in self._remote:
            await self._run_on_engine(lambda: self._commit(request_id, filled), in_forward=True)

    def _commit(self, request_id: str, filled: KVFilled) -> None:
        """Engine side (in_forward): the first token is emitted here, at once."""
        try:
            if filled.first_token is not None:
                self.engine.commit_remote(request_id, filled.first_token, filled.first_logprobs)
                mark("decode.committed", request_id)
            else:
                self.engine.commit_loaded(request_id, filled.num_tokens)
        except ValueError as e:   # the fill answered, so its writes have ended
            log.error("remote KV of %s is unusable (%s); computing it here", request_id, e)
            self.engine.fail_remote(request_id, writer_settled=True)

    async def stats(self) -> dict[str, int]:
        return await self._run_on_engine(self.engine.stats, in_forward=True)

    # ---- lifetime ------------------------------------------------------------------
    def shutdown(self) -> bool:
        """Stop the step thread. Commands queued before still run (the step thread drains
        them before it exits); any later call fails with EngineDeadError, and so do queued
        ones if the thread does not exit in time: no caller waits forever. True when the
        step thread has ended (False: it is still inside a step after the wait)."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)
        error = EngineDeadError("the engine is shut down")
        self._fail_queued(error)
        for box in list(self._outboxes.values()):
            box.put(error)   # no stream waits forever
        return not self._thread.is_alive()

    def _fail_queued(self, error: BaseException) -> None:
        with self._wake:
            commands = list(self._inbox)
            self._inbox.clear()
        for command in commands:
            if isinstance(command, Command):
                command.fail(error)

    # ---- step thread --------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stopped and not self._inbox and (self._stuck or not self.engine.has_unfinished()):
                        self._wake.wait()
                    stopping = self._stopped
                    self._engine_lock.acquire()  # before _wake is released: keeps command order
                    self._busy_since = time.monotonic()
                try:
                    self._drain()
                    if stopping:
                        return  # no command is queued after the flag (see _run_on_engine)
                    if self.engine.has_unfinished():
                        self._deliver(self.engine.step())
                        self._stuck = self.engine.last_step_empty
                finally:
                    self._busy_since = None
                    self._engine_lock.release()
        except BaseException as e:
            log.exception("engine step loop died")
            self._error = e
            for box in list(self._outboxes.values()):
                box.put(e)
            self._fail_queued(EngineDeadError(str(e)))
