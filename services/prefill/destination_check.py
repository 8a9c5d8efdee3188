"""A prefill node writes only into a destination that a live decode node registered.

The data plane has no authentication of its own: whoever names a KVDestination in a
Prefill call would have this node write its KV one-sided into those bytes. So before
anything is written, the destination must be exactly what a live `decode` (or `both`)
member with that node_id published in its NodeInfo, as the meta-server lists it
(services/node/members_view.py):

  node_id            a live decode/both member          else PERMISSION_DENIED
  transfer_endpoint  the one it registered              else PERMISSION_DENIED
  layout             every field of its kv_layout        else PERMISSION_DENIED
                     (base address, strides, dtype, block size, num_blocks, layers,
                     heads, head_dim)
  block_ids          each in [0, layout.num_blocks)      else INVALID_ARGUMENT

(num_cached_tokens within the prompt and one block id per prompt block are checked with
the rest of the request, services/prefill/servicer.py.) What a check cannot tell: which
of the decode node's blocks belong to the caller's request. A mesh member that forges a
registered node's destination can still write into that node's other blocks; only mesh
members can call Prefill at all (services/security), and with TLS a caller may name only
itself (its certificate's `service:NAME`, checked by the servicer).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import grpc

from common.kv_layout import KVLayout
from protos.pdmesh.v1 import common_pb2, engine_pb2
from services.node.members_view import MembersUnavailable, MembersView

DESTINATION_ROLES = ("decode", "both")


class DestinationRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Destination:
    """A checked destination: what the registered member published."""
    node_id: str
    transfer_endpoint: str
    layout: KVLayout
    block_ids: tuple[int, ...]
    num_cached_tokens: int
    # (endpoint, layout) of each of the member's tensor-parallel ranks, rank 0 first (at
    # TP 1: transfer_endpoint and layout); the writes of rank pairs go there
    ranks: tuple[tuple[str, KVLayout], ...] = ()


def check_block_ids(dest: engine_pb2.KVDestination) -> None:
    """DestinationRefused(INVALID_ARGUMENT) naming the first block id outside
    [0, dest.layout.num_blocks) or repeating an earlier one."""
    num_blocks = dest.layout.num_blocks
    seen: set[int] = set()
    for i, block_id in enumerate(dest.block_ids):
        if not 0 <= block_id < num_blocks:
            raise DestinationRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"destination.block_ids[{i}] = {block_id} is outside [0, {num_blocks}) "
                                     "(destination.layout.num_blocks)")
        if block_id in seen:
            raise DestinationRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"destination.block_ids[{i}] = {block_id} repeats an earlier id "
                                     "(each prompt block has its own)")
        seen.add(block_id)


def mismatch(dest: engine_pb2.KVDestination, member: common_pb2.NodeInfo) -> list[str]:
    """The destination's fields that differ from what `member` registered ([] if none)."""
    if member.node_id != dest.node_id or member.role not in DESTINATION_ROLES:
        return ["destination.node_id"]
    diffs = [] if member.transfer_endpoint == dest.transfer_endpoint else ["destination.transfer_endpoint"]
    try:
        registered = KVLayout.from_proto(member.kv_layout)
        given = KVLayout.from_proto(dest.layout)
    except (ValueError, TypeError):
        return [*diffs, "destination.layout"]
    diffs += [f"destination.layout.{f.name}" for f in fields(KVLayout)
              if getattr(registered, f.name) != getattr(given, f.name)]
    return diffs


def member_ranks(member: common_pb2.NodeInfo, layout: KVLayout) -> tuple[tuple[str, KVLayout], ...]:
    """The (endpoint, layout) of each of a registered member's ranks; DestinationRefused
    (FAILED_PRECONDITION) when it runs at TP > 1 without publishing them (the meta-server
    admits only none or one per rank, node_info_check.py)."""
    size = max(member.tensor_parallel_size, 1)
    if size == 1:
        return ((member.transfer_endpoint, layout),)
    if len(member.kv_ranks) != size:
        raise DestinationRefused(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"decode node {_short(member.node_id)!r} runs at tensor_parallel_size {size} "
                                 "but published no KV cache per rank: it cannot receive KV")
    try:
        return tuple((r.transfer_endpoint, KVLayout.from_proto(r.layout)) for r in member.kv_ranks)
    except (ValueError, TypeError) as e:
        raise DestinationRefused(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"decode node {_short(member.node_id)!r} published a bad rank layout: {e}") from None


class DestinationCheck:
    def __init__(self, members: MembersView):
        self.members = members

    async def check(self, dest: engine_pb2.KVDestination) -> Destination:
        """The registered destination `dest` names; raises DestinationRefused (nothing has
        been written then): INVALID_ARGUMENT for a block id out of range, PERMISSION_DENIED
        when no live decode member registered exactly this destination, UNAVAILABLE when
        the members cannot be listed."""
        check_block_ids(dest)
        try:
            member = await self.members.find(lambda m: not mismatch(dest, m))
        except MembersUnavailable as e:
            raise DestinationRefused(grpc.StatusCode.UNAVAILABLE, f"cannot check the destination: {e}") from None
        if member is None:
            raise DestinationRefused(grpc.StatusCode.PERMISSION_DENIED, self._why(dest))
        layout = KVLayout.from_proto(member.kv_layout)
        return Destination(dest.node_id, member.transfer_endpoint, layout, tuple(dest.block_ids),
                           dest.num_cached_tokens, member_ranks(member, layout))

    def _why(self, dest: engine_pb2.KVDestination) -> str:
        same_id = [m for m in self.members.last() if m.node_id == dest.node_id and m.role in DESTINATION_ROLES]
        if not same_id:
            return (f"destination.node_id {_short(dest.node_id)!r} is not a live decode node of this mesh: "
                    "a prefill node writes only into destinations that decode nodes registered")
        return (f"destination does not match what decode node {_short(dest.node_id)!r} registered: "
                f"{', '.join(mismatch(dest, same_id[0]))} differ")


def _short(text: str, limit: int = 128) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
