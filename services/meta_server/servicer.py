"""MetaServer gRPC servicer: membership RPCs (taken by the embedded registry; refused
with FAILED_PRECONDITION where nodes register in etcd) and Route. Thin: converts messages
to MetaControl calls and maps errors to status codes."""
from __future__ import annotations

import grpc

from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from services.meta_server.control import MetaControl
from services.meta_server.registry import RegistrationRefusedError
from services.meta_server.router import NoNodeError, RouteRequest
from services.meta_server.store_hits import StoreHits


def route_request(request: meta_pb2.RouteRequest, store_hit_blocks: int = 0) -> RouteRequest:
    return RouteRequest(model_id=request.model_id, num_prompt_tokens=request.num_prompt_tokens,
                        block_hashes=tuple(request.block_hashes),
                        exclude_node_ids=frozenset(request.exclude_node_ids),
                        store_hit_blocks=store_hit_blocks)


async def _membership_call(context, method, *args):
    """A Register/Heartbeat/Deregister call on MetaControl; where nodes register in etcd
    the registry refuses it: FAILED_PRECONDITION saying so."""
    try:
        return method(*args)
    except RegistrationRefusedError as e:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))


class MetaServicer(meta_pb2_grpc.MetaServerServicer):
    def __init__(self, control: MetaControl, store_hits: StoreHits | None = None):
        self.control = control
        self.store_hits = store_hits

    async def Register(self, request, context):
        node = request.node
        if not node.node_id or node.role not in ("prefill", "decode", "both") or not node.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "node.node_id, node.address and node.role (prefill|decode|both) are required")
        ttl = await _membership_call(context, self.control.register, node, request.ttl_seconds)
        return meta_pb2.RegisterResponse(ttl_seconds=ttl)

    async def Heartbeat(self, request, context):
        if not await _membership_call(context, self.control.heartbeat, request.node_id, request.load):
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"node {request.node_id!r} is not registered; register again")
        return meta_pb2.HeartbeatResponse()

    async def Deregister(self, request, context):
        await _membership_call(context, self.control.deregister, request.node_id)
        return meta_pb2.DeregisterResponse()

    async def Route(self, request, context):
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
        return reply

    async def ListMembers(self, request, context):
        return meta_pb2.ListMembersResponse(nodes=[m.info for m in self.control.live_members()])
