"""MetaServer gRPC servicer: membership RPCs (taken by the embedded registry; refused
with FAILED_PRECONDITION where nodes register in etcd), Route, and the gateways'
ReportRequests for the planner. Thin: converts messages to MetaControl calls (a report to
the PlannerLoop) and maps errors to status codes. Only mesh members reach it
(services/security); even so every string a member sends is bounded (INVALID_ARGUMENT),
and a node_id held by another live process is PERMISSION_DENIED."""
from __future__ import annotations

import grpc

from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from services.meta_server.control import MetaControl
from services.meta_server.load_window import totals_from_report
from services.meta_server.node_info_check import MAX_FIELD_CHARS, node_info_error
from services.meta_server.registry import RegistrationConflictError, RegistrationRefusedError, expert_tokens_of
from services.meta_server.router import NoNodeError, RouteRequest
from services.meta_server.store_hits import StoreHits
from services.security.server_auth import peer_service_name
from common.timeline import mark


def route_request(request: meta_pb2.RouteRequest, store_hit_blocks: int = 0) -> RouteRequest:
    return RouteRequest(model_id=request.model_id, num_prompt_tokens=request.num_prompt_tokens,
                        block_hashes=tuple(request.block_hashes),
                        exclude_node_ids=frozenset(request.exclude_node_ids),
                        store_hit_blocks=store_hit_blocks)


async def _membership_call(context, method, *args):
    """A Register/Heartbeat/Deregister call on MetaControl; where nodes register in etcd
    the registry refuses it: FAILED_PRECONDITION saying so; another live process holds
    the node_id: PERMISSION_DENIED."""
    try:
        return method(*args)
    except RegistrationRefusedError as e:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
    except RegistrationConflictError as e:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))


async def _check_caller(context, node_id: str, instance_id: str) -> None:
    """With TLS, a node may register, report and leave only as itself (its certificate's
    service:NAME is the node_id)."""
    if len(instance_id) > MAX_FIELD_CHARS:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"instance_id must be at most {MAX_FIELD_CHARS} characters")
    caller = peer_service_name(context)
    if caller is not None and caller != node_id:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "a node may register only under its own name")


class MetaServicer(meta_pb2_grpc.MetaServerServicer):
    def __init__(self, control: MetaControl, store_hits: StoreHits | None = None):
        self.control = control
        self.store_hits = store_hits

    async def Register(self, request, context):
        error = node_info_error(request.node)
        if error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        await _check_caller(context, request.node.node_id, request.instance_id)
        ttl = await _membership_call(context, self.control.register, request.node, request.instance_id)
        return meta_pb2.RegisterResponse(ttl_seconds=ttl)

    async def Heartbeat(self, request, context):
        await _check_caller(context, request.node_id, request.instance_id)
        expert_tokens = expert_tokens_of(request.expert_tokens) if request.HasField("expert_tokens") else None
        if not await _membership_call(context, self.control.heartbeat, request.node_id, request.load,
                                      request.instance_id, expert_tokens):
            await context.abort(grpc.StatusCode.NOT_FOUND, "this node is not registered; register again")
        return meta_pb2.HeartbeatResponse()

    async def Deregister(self, request, context):
        await _check_caller(context, request.node_id, request.instance_id)
        await _membership_call(context, self.control.deregister, request.node_id, request.instance_id)
        return meta_pb2.DeregisterResponse()

    async def Route(self, request, context):
        mark("meta.route_in", request.request_id)
        standby = self.control.standby_reason()
        if standby:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, standby)
        store_hit_blocks = 0
        if self.store_hits is not None and self.control.policy() == "cache_aware":
            store_hit_blocks = await self.store_hits.leading_hits(
                self.control.live_members(), request.model_id, request.block_hashes)
        try:
            decision = self.control.route(route_request(request, store_hit_blocks))
        except NoNodeError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        reply = meta_pb2.RouteResponse(decode=decision.decode.info,
                                       local_prefill=decision.local_prefill)
        if decision.prefill is not None:
            reply.prefill.CopyFrom(decision.prefill.info)
            reply.prefill_fallbacks.extend(m.info for m in decision.prefill_fallbacks)
        mark("meta.route_out", request.request_id)
        return reply

    async def ListMembers(self, request, context):
        return meta_pb2.ListMembersResponse(nodes=[m.info for m in self.control.live_members()])

    async def ReportRequests(self, request, context):
        """A gateway's sums for the planner (load_window.py); dropped when it is off."""
        planner = self.control.planner
        if planner is None:
            return meta_pb2.ReportRequestsResponse(accepted=False)
        standby = self.control.standby_reason()
        if standby:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, standby)
        try:
            totals = totals_from_report(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        planner.report(totals)
        return meta_pb2.ReportRequestsResponse(accepted=True)
