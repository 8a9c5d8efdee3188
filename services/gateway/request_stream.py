"""One Generate request at the gateway, across the decode nodes that serve it.

Lifecycle (one RequestStream per client call; `replies()` yields GenerateResponses):
  attempt: a mesh request id minted here -> Route (excluding the nodes that failed this
    request) -> the decode node's stream -> per message: detokenize, stop strings, reply
  the attempt ends without a finish:
    refused: UNAVAILABLE or RESOURCE_EXHAUSTED before the attempt's first token (the node
      just died and is not yet expired, or it is full) -> exclude it, next attempt (at
      most MAX_REFUSALS in all)
    broken: UNAVAILABLE after tokens (the node died, or its engine failed), or no message
      for timeouts.progress_s while the node is gone: not a live, unstalled member and not
      answering SERVING to a health probe (stopped, or its step hung) ->
      migrate: exclude it, next attempt with prompt = the original prompt + every token
      the client has, max_tokens = what remains, resume_position = tokens so far (so a
      seeded request draws what it would have), prompt_logprobs off (the client has them:
      they come once, on the first message), and what remains of the deadline; at
      most gateway.max_migrations. The client's stream has no seam: detokenizer and stop
      strings live here and carry on; usage counts the original prompt and every token.
  no node to route to (none registered, every one it tried excluded, the meta-server
    unreachable or just restarted): wait for one, asking again every NODE_WAIT_POLL_S, for
    up to timeouts.node_wait_s from the first route that found none until an attempt
    streams (then UNAVAILABLE, also when no poll is left before the deadline); a node this request failed on
    is routed to again once `exclusion_lapse_s` (one membership TTL) has passed since, by
    when a stopped or dead node has left the members and a working one has registered
    again; the refusal budget starts over then. A mesh that said RESOURCE_EXHAUSTED is
    not waited for (the client hears it at once).
  anything else -> PublicError with the status (UNAVAILABLE for unknown ones) and a plain
    message with an error id; what the node or meta-server said goes to the log under
    that id (services/gateway/public_errors.py)
Deadline: timeouts.request_s, or the client's own if sooner; every hop gets what remains.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from common import timeline
from common.config import TimeoutConfig
from common.engine.stop_strings import StopStringMatcher
from common.model.detokenizer import IncrementalDetokenizer
from protos.pdmesh.v1 import common_pb2, engine_pb2, gateway_pb2, meta_pb2
from services.gateway.decode_client import DecodeClient
from services.gateway import public_errors
from services.gateway.meta_client import NO_NODE_PREFIX, MetaClient
from services.gateway.public_errors import PublicError

log = logging.getLogger("pdmesh.gateway")
PASS_THROUGH = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
MAX_REFUSALS = 3
REFUSED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
BROKEN = (grpc.StatusCode.UNAVAILABLE,)
HEALTH_PROBE_S = 0.5   # a stopped node never answers; a working one does within milliseconds
NODE_WAIT_POLL_S = 0.25   # a node registers within one heartbeat (TTL / 3): a few asks a heartbeat
WAITABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED)


class NodeStopped(Exception):
    """The decode stream sent nothing for progress_s and its node left the mesh."""


class RequestStream:
    def __init__(self, *, meta: MetaClient, decode: DecodeClient, timeouts: TimeoutConfig,
                 max_migrations: int, model_id: str, tokenizer, prompt_ids: list[int], params,
                 request: gateway_pb2.GenerateRequest, deadline: float, block_hashes,
                 metrics=None, arrival: float | None = None, exclusion_lapse_s: float = 5.0,
                 load_report=None):
        """metrics: a GatewayMetrics (services/gateway/metrics.py) this request is counted
        in, None = not counted; arrival: the request's time.perf_counter() at the gateway;
        exclusion_lapse_s: the mesh's membership TTL (meta_server.ttl_seconds);
        load_report: a LoadReporter (services/gateway/load_report.py) told of the request
        when it ends (with metrics only), None = not reported."""
        self.meta, self.decode, self.timeouts = meta, decode, timeouts
        self.max_migrations, self.model_id = max_migrations, model_id
        self.prompt_ids, self.params, self.request, self.deadline = prompt_ids, params, request, deadline
        self.block_hashes = block_hashes          # async (token ids) -> block hash chain
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.matcher = StopStringMatcher(params.stop)
        self.tokens: list[int] = []               # every token the client has
        self.excluded: dict[str, float] = {}      # node id -> when this request failed on it
        self.no_node_since: float | None = None   # the wait for a decode node began (module docstring)
        self.exclusion_lapse_s = exclusion_lapse_s
        self.refusals = 0
        self.migrations = 0
        self.last_refusal: tuple[grpc.StatusCode, str] | None = None   # code, internal details
        self.metrics, self.load_report = metrics, load_report
        self.arrival = time.perf_counter() if arrival is None else arrival

    def replies(self) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        return self._replies() if self.metrics is None else self._counted()

    async def _counted(self) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """_replies, timed and counted in self.metrics."""
        timer = self.metrics.timer(self.arrival)
        ended = "abort"   # unless it finishes or fails: the client left
        try:
            async with contextlib.aclosing(self._replies()) as replies:   # closed (call cancelled) at once
                async for reply in replies:
                    timer.on_reply(len(reply.token_ids), reply.finish_reason, len(self.prompt_ids))
                    yield reply
        except Exception:
            ended = "error"
            raise
        finally:
            timer.end(ended)
            if self.load_report is not None:
                self.load_report.add(len(self.prompt_ids), timer.num_tokens, timer.ttft_s, timer.token_gaps_s)

    async def _replies(self) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        while True:
            route = await self._route()
            node = route.decode
            downstream = self._downstream(route)
            timeline.link(self.request.request_id, downstream.request_id)
            timeline.mark("gateway.decode_sent", self.request.request_id)
            call = self.decode.generate(node.address, downstream, _remaining(self.deadline))
            sent_here = 0
            try:
                async for msg in self._watched(call, node):
                    self.no_node_since = None            # a node serves it: any later wait is a new one
                    if not self.tokens:
                        timeline.mark("gateway.first_in", self.request.request_id)
                    reply, done = self._reply(msg, first=not self.tokens)
                    sent_here += len(msg.token_ids)
                    yield reply
                    if done:
                        return
                raise self._error(grpc.StatusCode.UNAVAILABLE, public_errors.NODE_FAILED,
                                  f"decode node {node.node_id} ended the stream without a finish")
            except grpc.aio.AioRpcError as e:
                self._after_failure(node.node_id, sent_here, e.code(), e.details())
            except NodeStopped as e:
                self._after_failure(node.node_id, sent_here, grpc.StatusCode.UNAVAILABLE, str(e))
            finally:
                call.cancel()

    # ---- one attempt -------------------------------------------------------------------
    async def _route(self) -> meta_pb2.RouteResponse:
        """A route, waiting for a decode node when there is none (module docstring). The
        wait is the request's: it starts at the first route that found no node and ends
        only when an attempt streams a message, so neither a node that keeps refusing nor
        a meta-server that keeps failing stretches it past node_wait_s; every call in it
        (the meta client's leader following included) is bounded by its end."""
        started = time.monotonic()
        waited_from = None         # this call's part of the wait (the metrics)
        hashes = None              # the prompt does not change while it waits
        answered = None            # the last answer that was not a call cut by the wait's own end
        try:
            while True:
                wait_end = min(self.deadline, (self.no_node_since or started) + self.timeouts.node_wait_s)
                try:
                    if hashes is None:
                        hashes = await self.block_hashes(self.prompt_ids + self.tokens, deadline=wait_end)
                    return await self._route_once(hashes, wait_end)
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and answered is not None:
                        e = answered       # the call ran out of the wait: what the mesh said before
                    elif e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        answered = e
                    said = f"Route: {e.code().name} {e.details()}"
                    now = time.monotonic()
                    if now >= self.deadline:
                        raise self._error(grpc.StatusCode.DEADLINE_EXCEEDED, public_errors.DEADLINE_PASSED, said)
                    full = self.last_refusal is not None and self.last_refusal[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
                    if full or e.code() not in WAITABLE:
                        raise self._route_error(e, said) from None
                    if self.no_node_since is None:
                        self.no_node_since = started
                    # the wait is over, or no poll is left before the deadline: UNAVAILABLE
                    # (what a client's retry policy retries), not the deadline's status
                    if now >= wait_end or now + NODE_WAIT_POLL_S >= self.deadline:
                        raise self._route_error(e, said) from None
                    if waited_from is None:
                        waited_from = now
                        log.info("no decode node for client id %r (%s); waiting up to %gs for one",
                                 self.request.request_id, said, wait_end - now)
                        if self.metrics is not None:
                            self.metrics.node_waiting.inc()
                    await asyncio.sleep(min(NODE_WAIT_POLL_S, wait_end - now))
        finally:
            if waited_from is not None and self.metrics is not None:
                self.metrics.node_waiting.dec()
                self.metrics.node_wait.observe(time.monotonic() - waited_from)

    async def _route_once(self, hashes: list[bytes], wait_end: float) -> meta_pb2.RouteResponse:
        now = time.monotonic()
        lapsed = [n for n, at in self.excluded.items() if now - at >= self.exclusion_lapse_s]
        if lapsed:      # gone from the members by now, or registered again: worth another try
            for node_id in lapsed:
                del self.excluded[node_id]
            self.refusals, self.last_refusal = 0, None
        asked = meta_pb2.RouteRequest(
            request_id=uuid.uuid4().hex, model_id=self.model_id, num_prompt_tokens=len(self.prompt_ids + self.tokens),
            block_hashes=hashes, exclude_node_ids=list(self.excluded))
        timeline.link(self.request.request_id, asked.request_id)
        timeline.mark("gateway.route_sent", self.request.request_id)
        route = await self.meta.route(asked, timeout=min(self.timeouts.route_s, _remaining(wait_end)),
                                      deadline=wait_end)
        timeline.mark("gateway.routed", self.request.request_id)
        return route

    def _route_error(self, e: grpc.aio.AioRpcError, said: str) -> PublicError:
        if self.last_refusal is not None:   # no other decode node: what the last one said
            code, internal = self.last_refusal
            return self._error(code, _refused(code), f"{internal}; then {said}")
        no_node = e.code() == grpc.StatusCode.UNAVAILABLE and (e.details() or "").startswith(NO_NODE_PREFIX)
        return self._error(grpc.StatusCode.UNAVAILABLE,
                           public_errors.NO_DECODE_NODE if no_node else public_errors.NO_ROUTE, said)

    def _downstream(self, route: meta_pb2.RouteResponse) -> engine_pb2.DecodeRequest:
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(self.request.sampling)
        sampling.max_tokens = self.params.max_tokens - len(self.tokens)
        if self.tokens:
            sampling.ClearField("prompt_logprobs")   # sent with the first message already
        out = engine_pb2.DecodeRequest(
            request_id=uuid.uuid4().hex,  # the mesh's id of this attempt
            prompt_token_ids=self.prompt_ids + self.tokens, sampling=sampling,
            client_request_id=self.request.request_id, resume_position=len(self.tokens))
        if not route.local_prefill:
            out.prefill.CopyFrom(route.prefill)
            out.prefill_fallbacks.extend(route.prefill_fallbacks)
        return out

    async def _watched(self, call, node) -> AsyncIterator[engine_pb2.DecodeResponse]:
        """call's messages; NodeStopped when none came for progress_s and the node is gone
        (a live, slow node is waited for: e.g. a long queue). One watchdog task per call,
        so that a message costs nothing beyond the read."""
        last = time.monotonic()
        stopped = False

        async def watchdog() -> None:
            nonlocal stopped
            check_at = last + self.timeouts.progress_s
            while True:
                await asyncio.sleep(max(check_at - time.monotonic(), 0.0))
                silent_since = last
                if time.monotonic() - silent_since < self.timeouts.progress_s:
                    check_at = silent_since + self.timeouts.progress_s
                elif await self._gone(node) and last == silent_since:   # still silent
                    stopped = True
                    call.cancel()
                    return
                else:
                    check_at = time.monotonic() + self.timeouts.progress_s

        watch = asyncio.ensure_future(watchdog())
        try:
            async for msg in call:
                last = time.monotonic()
                yield msg
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as e:
            # the watchdog's cancel ends the read with either, depending on where it was
            ours = stopped and (isinstance(e, asyncio.CancelledError) or e.code() == grpc.StatusCode.CANCELLED)
            if not ours or asyncio.current_task().cancelling():
                raise   # a real error, or the client left: not a migration
            raise NodeStopped(f"decode node {node.node_id} sent nothing for "
                              f"{self.timeouts.progress_s:g}s and is gone") from None
        finally:
            watch.cancel()

    async def _gone(self, node) -> bool:
        """Whether the node can no longer serve the call: it is not a live, unstalled
        member (or the meta-server cannot tell now) and it does not answer SERVING to a
        health probe either. Both, so that neither a meta-server that just restarted (no
        members yet) nor a slow health answer moves a request off a working node."""
        try:
            members = await self.meta.call("ListMembers", meta_pb2.ListMembersRequest(),
                                           timeout=min(self.timeouts.route_s, _remaining(self.deadline)),
                                           deadline=self.deadline)
            if any(n.node_id == node.node_id and not n.load.stalled for n in members.nodes):
                return False
        except grpc.aio.AioRpcError:
            pass
        return not await self.decode.serving(node.address, HEALTH_PROBE_S)

    def _reply(self, msg: engine_pb2.DecodeResponse, first: bool) -> tuple[gateway_pb2.GenerateResponse, bool]:
        """The client's message for msg, and whether it is the last one."""
        text, stopped = self.matcher.feed(self.detok.add(msg.token_ids))
        reply = gateway_pb2.GenerateResponse(token_ids=msg.token_ids, logprobs=msg.logprobs)
        if first:
            reply.prefill_timing.CopyFrom(msg.prefill_timing)
            reply.prompt_logprobs.extend(msg.prompt_logprobs)
        self.tokens.extend(msg.token_ids)
        if stopped:
            reply.text, reply.finish_reason = text, "stop"
        elif msg.finish_reason:
            tail, _ = self.matcher.feed(self.detok.flush())
            reply.text, reply.finish_reason = text + tail + self.matcher.flush(), msg.finish_reason
        else:
            reply.text = text
            return reply, False
        reply.usage.CopyFrom(msg.usage)
        reply.usage.prompt_tokens, reply.usage.completion_tokens = len(self.prompt_ids), len(self.tokens)
        # after a migration the node's cache hit may cover earlier output tokens too
        reply.usage.cached_prompt_tokens = min(msg.usage.cached_prompt_tokens, len(self.prompt_ids))
        reply.migrations = self.migrations
        return reply, True

    def _after_failure(self, node_id: str, sent_here: int, code: grpc.StatusCode, details: str) -> None:
        """The attempt on node_id failed: return to try the next one, or raise PublicError."""
        internal = f"decode node {node_id}: {code.name} {details}"
        in_time = time.monotonic() < self.deadline
        if sent_here == 0 and code in REFUSED and self.refusals + 1 < MAX_REFUSALS and in_time:
            self.refusals += 1
            log.warning("decode node %s answered %s for client id %r (%s); routing again",
                        node_id, code.name, self.request.request_id, details)
            self.last_refusal = (code, internal)
            self.excluded[node_id] = time.monotonic()
            return
        if sent_here > 0 and code in BROKEN and self.migrations < self.max_migrations and in_time:
            self.migrations += 1
            if self.metrics is not None:
                self.metrics.migrations.inc()
            log.warning("decode node %s broke the stream of client id %r after %d tokens (%s %s); "
                        "migrating (%d of at most %d)", node_id, self.request.request_id, len(self.tokens),
                        code.name, details, self.migrations, self.max_migrations)
            self.excluded[node_id] = time.monotonic()
            return
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            # the engine's own validation (common/engine/validation.py), which the gateway
            # ran first: a node configured apart from the gateway (e.g. max_model_len)
            raise self._error(code, f"the decode node refused the request: {(details or '')[:200]}", internal)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise self._error(code, public_errors.DEADLINE_PASSED, internal)
        public = _refused(code) if code in REFUSED and not self.tokens else public_errors.NODE_FAILED
        raise self._error(code if code in PASS_THROUGH else grpc.StatusCode.UNAVAILABLE, public, internal)

    def _error(self, code: grpc.StatusCode, public: str, internal: str) -> PublicError:
        return public_errors.mesh_error(code, public, internal, self.request.request_id)


def _refused(code: grpc.StatusCode) -> str:
    """What the client is told when the decode nodes refused the request before any token."""
    return public_errors.MESH_FULL if code == grpc.StatusCode.RESOURCE_EXHAUSTED else public_errors.NO_DECODE_NODE


def _remaining(deadline: float) -> float:
    """Seconds left until deadline; a tiny positive value once it passed (the call then
    fails DEADLINE_EXCEEDED at once)."""
    return max(deadline - time.monotonic(), 1e-3)
