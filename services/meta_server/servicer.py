"""MetaServer gRPC servicer: membership RPCs (taken by the embedded registry; refused
with FAILED_PRECONDITION where nodes register in etcd) and Route. Thin: converts messages
to MetaControl calls and maps errors to status codes. Only mesh members reach it
(services/security); even so every string a member sends is bounded (INVALID_ARGUMENT),
and a node_id held by another live process is PERMISSION_DENIED."""
from __future__ import annotations

import re

import grpc

from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from services.meta_server.control import MetaControl
from services.meta_server.registry import RegistrationConflictError, RegistrationRefusedError
from services.meta_server.router import NoNodeError, RouteRequest
from services.meta_server.store_hits import StoreHits


def route_request(request: meta_pb2.RouteRequest, store_hit_blocks: int = 0) -> RouteRequest:
    return RouteRequest(model_id=request.model_id, num_prompt_tokens=request.num_prompt_tokens,
                        block_hashes=tuple(request.block_hashes),
                        exclude_node_ids=frozenset(request.exclude_node_ids),
                        store_hit_blocks=store_hit_blocks)


NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
MAX_FIELD_CHARS = 256     # address, model_id, transfer endpoint, instance_id
TRANSFER_BACKENDS = ("mooncake", "grpc", "fake")


def node_info_error(node) -> str:
    """Why a NodeInfo cannot be registered, "" if it can."""
    if not NODE_ID.fullmatch(node.node_id):
        return ("node.node_id must be 1-128 characters of letters, digits and . _ : - "
                "(starting with a letter or digit)")
    if node.role not in ("prefill", "decode", "both"):
        return "node.role must be one of prefill, decode, both"
    if not node.address:
        return "node.address is required"
    for name in ("address", "model_id", "transfer_endpoint"):
        if len(getattr(node, name)) > MAX_FIELD_CHARS:
            return f"node.{name} must be at most {MAX_FIELD_CHARS} characters"
    if node.transfer_backend and node.transfer_backend not in TRANSFER_BACKENDS:
        return f"node.transfer_backend must be one of {', '.join(TRANSFER_BACKENDS)}"
    if len(node.transfer_listen_addresses) > 8 or any(len(a) > MAX_FIELD_CHARS for a in node.transfer_listen_addresses):
        return f"node.transfer_listen_addresses: at most 8 of at most {MAX_FIELD_CHARS} characters each"
    return ""


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


async def _check_instance(context, instance_id: str) -> None:
    if len(instance_id) > MAX_FIELD_CHARS:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"instance_id must be at most {MAX_FIELD_CHARS} characters")


class MetaServicer(meta_pb2_grpc.MetaServerServicer):
    def __init__(self, control: MetaControl, store_hits: StoreHits | None = None):
        self.control = control
        self.store_hits = store_hits

    async def Register(self, request, context):
        error = node_info_error(request.node)
        if error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        await _check_instance(context, request.instance_id)
        ttl = await _membership_call(context, self.control.register, request.node, request.instance_id)
        return meta_pb2.RegisterResponse(ttl_seconds=ttl)

    async def Heartbeat(self, request, context):
        await _check_instance(context, request.instance_id)
        if not await _membership_call(context, self.control.heartbeat, request.node_id, request.load,
                                      request.instance_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, "this node is not registered; register again")
        return meta_pb2.HeartbeatResponse()

    async def Deregister(self, request, context):
        await _check_instance(context, request.instance_id)
        await _membership_call(context, self.control.deregister, request.node_id, request.instance_id)
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
