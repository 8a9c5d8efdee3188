"""A prototype of the engine core in its own process (as vLLM V1's EngineCoreProc), for
bench/engine_process.py: the LLMEngine steps in a child process; the serving process
keeps only its event loop and an asyncio client of the core. Colocated only (no remote
prefill, no KV transfer); product code does not use it.

    core = EngineCoreClient(EngineConfig(...))      # spawns the core, waits until it is ready
    async for out in core.generate(rid, prompt_token_ids, params):   # StepOutputs, as AsyncEngine
        ...
    core.shutdown()                                 # the child is gone when it returns

The wire: one multiprocessing Pipe (a Unix socketpair), each message a pickled tuple.
- client -> core: a list of commands, batched (the first command queued schedules one
  flush with call_soon, which sends every command queued by then in one message):
  ("add", core_id, prompt_token_ids, params, resume_position), ("abort", core_id), ("stop",). core_id is fresh per generate
  call (the caller's request_id stays in the client), so an aborted request's outputs
  still in the pipe never reach a later request of the same id.
- core -> client: ("ready", info) once the engine is built (or ("error", traceback)),
  then ("out", outputs, num_waiting, step_s) once per step that produced tokens: every
  StepOutput of the step as a plain tuple (OUTPUT_FIELDS), batched, and how long the
  step took; ("reject", core_id, message) for an add the engine refused; ("dead",
  traceback) when a step raised.

Lifecycle of a request here: generate() validates (ValueError), queues "add" -> the core
adds it before its next step -> its tokens come back in the "out" message of each step
-> the last one has finished set. Leaving the `async for` early queues "abort" and
returns at once (fire and forget: outputs of steps already sent are dropped). The core
exits on "stop" or when the pipe closes (its parent died), so it never outlives it.

Single-threaded on both sides: the core receives, steps and sends on its main thread
(between steps it blocks on the pipe only when it has nothing to run); the client reads
the pipe from the event loop (loop.add_reader), so no thread of the serving process
competes with the loop for the GIL.
"""
from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import signal
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection

from common.config import EngineConfig
from common.engine.async_engine import EngineDeadError
from common.engine.llm_engine import StepOutput
from common.engine.sampling_params import SamplingParams
from common.engine.validation import validate_request

OUTPUT_FIELDS = ("request_id", "new_token_ids", "finished", "finish_reason", "num_prompt_tokens",
                 "num_cached_tokens", "new_logprobs", "queue_s")


# ---- the core process ----------------------------------------------------------------
def core_main(config: EngineConfig, conn: Connection) -> None:
    """The child's entry point: build the engine, then receive commands, step, send.
    SIGINT and SIGTERM are ignored: the parent ends the core ("stop", or closing the pipe),
    also when a signal to its process group stops both."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch

    from common.engine.llm_engine import LLMEngine
    try:
        engine = LLMEngine(config)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", {"vocab_size": engine.vocab_size, "max_model_len": engine.max_model_len,
                         "model_id": engine.model_id, "block_size": engine.block_size,
                         "torch_threads": torch.get_num_threads()}))
    stuck = False   # the last step scheduled nothing: only a command can help
    try:
        while True:
            idle = stuck or not engine.has_unfinished()
            if idle or conn.poll():
                for command in conn.recv():   # blocks only when idle: nothing to step
                    if command[0] == "stop":
                        return
                    _apply(engine, conn, command)
                    stuck = False
                continue   # drain every batch queued meanwhile before the next step
            start = time.perf_counter()
            outs = engine.step()
            step_s = time.perf_counter() - start
            stuck = engine.last_step_empty
            if outs:
                conn.send(("out", [tuple(getattr(o, f) for f in OUTPUT_FIELDS) for o in outs],
                           len(engine.scheduler.waiting), step_s))
    except (EOFError, OSError):
        return   # the serving process is gone
    except BaseException:
        try:
            conn.send(("dead", traceback.format_exc()))
        except OSError:
            pass


def _apply(engine, conn: Connection, command: tuple) -> None:
    if command[0] == "add":
        _, rid, prompt, params, resume_position = command
        try:
            engine.add_request(rid, prompt, params, resume_position=resume_position)
        except ValueError as e:
            conn.send(("reject", rid, str(e)))
    elif command[0] == "abort":
        engine.abort(command[1])
    else:
        raise ValueError(f"unknown core command {command[0]!r}; allowed: add, abort, stop")


# ---- the client, on the serving process's event loop -----------------------------------
class _Box:
    """One request's outputs (or the exception that ends it), read on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request_id: str):
        self._loop, self._items, self._waiter = loop, deque(), None
        self.request_id = request_id

    def put(self, item) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self):
        while not self._items:
            self._waiter = self._loop.create_future()
            await self._waiter
        return self._items.popleft()


class EngineCoreClient:
    """What DecodeServicer needs of an engine (validate, num_waiting, generate), served by
    a core process. Not thread-safe: one event loop, the one generate first ran on."""

    def __init__(self, config: EngineConfig, start_timeout_s: float = 600.0):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._boxes: dict[str, _Box] = {}       # by core id
        self._live: set[str] = set()            # the callers' request ids in flight
        self._core_ids = itertools.count()
        self._pending: list[tuple] = []
        self._num_waiting = 0
        self._error: str | None = None
        self.step_s: list[float] = []           # each step's duration, as the core timed it
        ctx = multiprocessing.get_context("spawn")   # never fork a process that runs gRPC
        self._conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=core_main, args=(config, child), name="pdmesh-engine-core",
                                   daemon=True)
        self.process.start()
        child.close()
        if not self._conn.poll(start_timeout_s):
            self.shutdown()
            raise RuntimeError(f"the engine core did not start in {start_timeout_s:.0f} s")
        kind, info = self._conn.recv()
        if kind != "ready":
            self.shutdown()
            raise RuntimeError(f"the engine core failed to start:\n{info}")
        self.info = info
        self.vocab_size, self.max_model_len = info["vocab_size"], info["max_model_len"]

    # ---- the EngineView subset services use ----------------------------------------
    def validate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def num_waiting(self) -> int:
        """Waiting in the core at its last step, plus adds not yet sent."""
        return self._num_waiting + len(self._pending)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       remote=None, resume_position: int = 0) -> AsyncIterator[StepOutput]:
        if remote is not None:
            raise ValueError("the engine-core prototype prefills locally only (no remote KV)")
        if self._error is not None:
            raise EngineDeadError(self._error)
        self._attach()
        self.validate(request_id, prompt_token_ids, params)
        core_id = str(next(self._core_ids))   # fresh per call: a reused request_id never gets
        box = self._boxes[core_id] = _Box(self._loop, request_id)   # an aborted one's late outputs
        self._live.add(request_id)
        self._send(("add", core_id, list(prompt_token_ids), params, resume_position))
        finished = False
        try:
            while True:
                item = await box.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._boxes.pop(core_id, None)
            self._live.discard(request_id)
            if not finished and self._error is None:
                self._send(("abort", core_id))

    # ---- the pipe --------------------------------------------------------------------
    def _attach(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._conn.fileno(), self._on_readable)

    def _send(self, command: tuple) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(command)

    def _flush(self) -> None:
        commands, self._pending = self._pending, []
        if commands and self._error is None:
            try:
                self._conn.send(commands)
            except OSError as e:
                self._die(f"the engine core's pipe broke: {e}")

    def _on_readable(self) -> None:
        try:
            while self._conn.poll():
                self._handle(self._conn.recv())
        except (EOFError, OSError):
            self._die(f"the engine core exited (code {self.process.exitcode})")

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "out":
            self._num_waiting = message[2]
            self.step_s.append(message[3])
            boxes = self._boxes
            for fields in message[1]:
                box = boxes.get(fields[0])
                if box is not None:
                    box.put(StepOutput(box.request_id, *fields[1:]))
        elif kind == "reject":
            box = self._boxes.get(message[1])
            if box is not None:
                box.put(ValueError(message[2]))
        elif kind == "dead":
            self._die(f"the engine core's step raised:\n{message[1]}")

    def _die(self, reason: str) -> None:
        if self._error is None:
            self._error = reason
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._conn.fileno())
        for box in list(self._boxes.values()):
            box.put(EngineDeadError(self._error))

    # ---- lifetime ------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the core and wait for it to exit (killed past timeout_s); later and
        in-flight generate calls fail with EngineDeadError. Idempotent; call it on the
        client's loop while that runs, or after it closed."""
        if self._conn.closed:
            return
        loop_open = self._loop is not None and not self._loop.is_closed()
        if loop_open:
            self._loop.remove_reader(self._conn.fileno())
        try:
            self._conn.send([("stop",)])
        except OSError:
            pass   # the core is gone already
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._conn.close()
        self._error = self._error or "the engine core is shut down"
        if loop_open:
            for box in list(self._boxes.values()):
                box.put(EngineDeadError(self._error))
