"""KVStore servicer: protobuf at the edge, services/kv_store/store.py inside.

Status codes: INVALID_ARGUMENT (bad space, hashes, token ids or pin_id, or a pin_id the
store still holds: the message names the field), PERMISSION_DENIED (a new key space for
a model no live node serves with that layout), UNAVAILABLE (the mesh's members cannot be
listed to tell), RESOURCE_EXHAUSTED (kv_store.max_spaces key spaces exist), NOT_FOUND
(CommitPut of an unknown or expired put_id).
"""
from __future__ import annotations

import grpc

from common.kv_layout import KVLayout
from protos.pdmesh.v1 import kv_store_pb2, kv_store_pb2_grpc
from services.kv_store.store import KVStore, Space, SpaceRefused, SpacesExhausted, space_key
from services.node.members_view import MembersUnavailable


class KVStoreServicer(kv_store_pb2_grpc.KVStoreServicer):
    def __init__(self, store: KVStore):
        self.store = store

    @staticmethod
    async def _space_args(space, context) -> tuple[str, KVLayout, int]:
        try:
            layout = KVLayout.from_proto(space.layout)
        except (ValueError, TypeError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"space.layout: {e}")
        try:
            space_key(layout, space.head_offset)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return space.model_id, layout, space.head_offset

    async def _admit(self, model_id: str, layout: KVLayout, head_offset: int, context) -> None:
        """Before a call that may make a key space."""
        try:
            await self.store.admit_space(model_id, layout, head_offset)
        except SpaceRefused as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except MembersUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot tell whether a live node serves "
                                f"space.model_id: {e}")

    def _region(self, space: Space) -> kv_store_pb2.StoreRegion:
        return kv_store_pb2.StoreRegion(transfer_backend=self.store.transfer.name,
                                        transfer_endpoint=self.store.transfer.endpoint,
                                        layout=space.memory.layout.to_proto())

    async def Lookup(self, request, context):
        model_id, layout, offset = await self._space_args(request.space, context)
        try:
            total, in_memory = await self.store.lookup(model_id, layout, list(request.block_hashes), offset)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return kv_store_pb2.LookupResponse(num_hits=total, num_memory_hits=in_memory)

    async def ReservePut(self, request, context):
        model_id, layout, offset = await self._space_args(request.space, context)
        await self._admit(model_id, layout, offset, context)
        try:
            put_id, indices, slots, space = self.store.reserve_put(
                model_id, layout, list(request.block_hashes), list(request.token_ids), offset)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except SpacesExhausted as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        return kv_store_pb2.ReservePutResponse(put_id=put_id, indices=indices, slot_ids=slots,
                                               region=self._region(space),
                                               lease_seconds=self.store.timeouts.kv_store_reserve_lease_s)

    async def CommitPut(self, request, context):
        try:
            num = self.store.commit_put(request.put_id)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"put_id {request.put_id!r} is unknown or its lease expired")
        return kv_store_pb2.CommitPutResponse(num_committed=num)

    async def PinGet(self, request, context):
        model_id, layout, offset = await self._space_args(request.space, context)
        if self.store.redis is not None:   # a Redis hit makes the space
            await self._admit(model_id, layout, offset, context)
        try:
            pin_id, slots, promoted, space = await self.store.pin_get(
                model_id, layout, list(request.block_hashes), list(request.token_ids), offset,
                request.pin_id)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except SpacesExhausted as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        reply = kv_store_pb2.PinGetResponse(pin_id=pin_id, slot_ids=slots, num_promoted=promoted,
                                            lease_seconds=self.store.timeouts.kv_store_pin_lease_s)
        if space is not None:
            reply.region.CopyFrom(self._region(space))
            reply.generations.extend(self.store.generations(space, slots))
        return reply

    async def Release(self, request, context):
        valid = self.store.release(request.pin_id, list(request.slot_ids), list(request.generations))
        return kv_store_pb2.ReleaseResponse(valid=valid)

    async def Stats(self, request, context):
        return kv_store_pb2.StatsResponse(**self.store.stats())
