"""`grpc` backend: writes carried as a client stream of KVTransfer.Write chunks, reads as a
server stream of KVTransfer.Read chunks, for hosts where Mooncake cannot be installed.

Receiver: every engine serves KVTransfer on its own small sync gRPC server (thread pool) at
`endpoint` = host:port (port 0 picks a free one). Each WriteChunk's bytes are copied into
registered memory after checking that [remote_address, + len(data)) lies inside one
registered region; otherwise the RPC ends with INVALID_ARGUMENT and nothing more of that
stream is applied. The ack carries the bytes written. A ReadRequest is checked whole first
(every range inside one registered region, else INVALID_ARGUMENT naming the range and
nothing sent); then the ranges' bytes are streamed in order, packed into ReadChunks of the
reader's chunk_bytes.

Writer and reader: one channel per peer, kept until close() or an UNAVAILABLE failure; a
write batch is one RPC whose ranges are split into chunks of at most `chunk_bytes`; a read
batch is one RPC whose chunks are copied into the local ranges in order, and the total
checked against the request. WriteChunks and ReadChunks are encoded and decoded by hand
(common/transfer/grpc_wire.py). Nothing checks the local addresses of a batch: they must be
valid memory of this process (registered or not).

Security (plain arguments, filled in by the services): `interceptors` of the receiver's
server (who may write or read), `server_credentials` to bind it with TLS, and
`channel_factory(peer, options)` for the writer's and reader's channels (carrying the
caller's identity); by default none (unit tests).

Thread-safety: `write` and `read` may be called from several threads at once (each call is
its own RPC); the server applies concurrent streams in parallel, so writers must not overlap
ranges.
"""
from __future__ import annotations

import ctypes
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc

from common.transfer.base import Region, TransferEngine, TransferError, regions_hold, without_region
from common.transfer.grpc_wire import (bytes_address, decode_chunk, encode_chunk, encode_read_chunks,
                                       scatter_read_chunks)
from protos.pdmesh.v1 import transfer_pb2

SERVICE = "pdmesh.v1.KVTransfer"
UNSETTLED_CODES = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                   grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN)
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


@dataclass(frozen=True)
class _PeerCalls:
    channel: grpc.Channel
    write: grpc.StreamUnaryMultiCallable
    read: grpc.UnaryStreamMultiCallable


class GrpcTransfer(TransferEngine):
    name = "grpc"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_workers: int = 4,
                 chunk_bytes: int = 1 << 20, timeout_s: float = 60.0, interceptors: tuple = (),
                 server_credentials: grpc.ServerCredentials | None = None, channel_factory=None):
        if not 0 < chunk_bytes <= MAX_MESSAGE_BYTES - 64:
            raise ValueError(f"chunk_bytes {chunk_bytes} must be in (0, {MAX_MESSAGE_BYTES - 64}]")
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self._regions: tuple[Region, ...] = ()
        self._calls: dict[str, _PeerCalls] = {}
        self._lock = threading.Lock()
        self._channel_factory = channel_factory or (lambda peer, options: grpc.insecure_channel(peer, options=options))
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers, "kv-recv"),
                                   options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)],
                                   interceptors=tuple(interceptors))
        handlers = {
            "Write": grpc.stream_unary_rpc_method_handler(
                self._serve_write, response_serializer=transfer_pb2.WriteAck.SerializeToString),
            "Read": grpc.unary_stream_rpc_method_handler(
                self._serve_read, request_deserializer=transfer_pb2.ReadRequest.FromString,
                response_serializer=None),
        }
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        if server_credentials is None:
            bound = self._server.add_insecure_port(f"{host}:{port}")
        else:
            bound = self._server.add_secure_port(f"{host}:{port}", server_credentials)
        if not bound:
            raise TransferError(f"grpc transfer: cannot bind {host}:{port}")
        self._server.start()
        self._endpoint = f"{host}:{bound}"

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def listen_addresses(self) -> tuple[str, ...]:
        """The receiver's server binds exactly the configured host."""
        return (self._endpoint,)

    def register(self, address: int, length: int) -> Region:
        region = Region.checked(address, length)
        with self._lock:
            self._regions = self._regions + (region,)
        return region

    def unregister(self, region: Region) -> None:
        with self._lock:
            self._regions = without_region(self._regions, region)

    def _contains(self, address: int, length: int) -> bool:
        return regions_hold(self._regions, address, length)

    def _region_list(self) -> str:
        return ", ".join(f"({r.address:#x}, {r.length})" for r in self._regions)

    def _serve_write(self, chunks, context) -> transfer_pb2.WriteAck:
        total = 0
        for buf in chunks:
            try:
                address, offset, length = decode_chunk(buf)
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed WriteChunk: {exc}")
            if not length:
                continue
            if not self._contains(address, length):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"remote_address range ({address:#x}, {length} bytes) is not inside a "
                              f"region registered on {self._endpoint}: {self._region_list()}")
            ctypes.memmove(address, bytes_address(buf) + offset, length)
            total += length
        return transfer_pb2.WriteAck(bytes_written=total)

    def _serve_read(self, request: transfer_pb2.ReadRequest, context):
        step = request.chunk_bytes or self.chunk_bytes
        if step > MAX_MESSAGE_BYTES - 64:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"chunk_bytes {step} must be in (0, {MAX_MESSAGE_BYTES - 64}]")
        ranges = [(r.remote_address, r.length) for r in request.ranges]
        for i, (address, length) in enumerate(ranges):
            if length and not self._contains(address, length):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"ranges[{i}] ({address:#x}, {length} bytes) is not inside a region "
                              f"registered on {self._endpoint}: {self._region_list()}")
        yield from encode_read_chunks(ranges, step)

    def _calls_for(self, peer: str) -> _PeerCalls:
        with self._lock:
            if peer not in self._calls:
                channel = self._channel_factory(peer, CHANNEL_OPTIONS)
                self._calls[peer] = _PeerCalls(
                    channel,
                    channel.stream_unary(f"/{SERVICE}/Write", request_serializer=None,
                                         response_deserializer=transfer_pb2.WriteAck.FromString),
                    channel.unary_stream(f"/{SERVICE}/Read",
                                         request_serializer=transfer_pb2.ReadRequest.SerializeToString,
                                         response_deserializer=None))
            return self._calls[peer]

    def _forget(self, peer: str) -> None:
        """Drops a failed peer's channel (closed once no call uses it) so that the next call
        connects afresh instead of waiting out the channel's reconnect backoff."""
        with self._lock:
            self._calls.pop(peer, None)

    def _chunks(self, batch: list[tuple[int, int, int]]):
        step = self.chunk_bytes
        for local, remote, length in batch:
            for off in range(0, length, step):
                yield encode_chunk(remote + off, local + off, min(step, length - off))

    def write(self, peer: str, batch: list[tuple[int, int, int]], timeout_s: float | None = None) -> int:
        if any(length < 0 for _, _, length in batch):
            raise ValueError(f"negative length in write batch to {peer}")
        total = sum(length for _, _, length in batch)
        if not total:
            return 0
        try:
            ack = self._calls_for(peer).write(self._chunks(batch), timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as exc:
            raise self._failure(f"grpc write of {total} bytes to {peer}", peer, exc) from None
        if ack.bytes_written != total:
            raise TransferError(f"grpc write to {peer}: acked {ack.bytes_written} of {total} bytes")
        self.count_written(total)
        return total

    def read(self, peer: str, batch: list[tuple[int, int, int]], timeout_s: float | None = None) -> int:
        if any(length < 0 for _, _, length in batch):
            raise ValueError(f"negative length in read batch from {peer}")
        batch = [r for r in batch if r[2]]
        total = sum(length for _, _, length in batch)
        if not total:
            return 0
        request = transfer_pb2.ReadRequest(
            ranges=[transfer_pb2.ReadRange(remote_address=remote, length=length)
                    for _, remote, length in batch], chunk_bytes=self.chunk_bytes)
        try:
            chunks = self._calls_for(peer).read(request, timeout=timeout_s or self.timeout_s)
            received = scatter_read_chunks(chunks, [(local, length) for local, _, length in batch])
        except grpc.RpcError as exc:
            raise self._failure(f"grpc read of {total} bytes from {peer}", peer, exc) from None
        except ValueError as exc:
            chunks.cancel()
            raise TransferError(f"grpc read from {peer}: bad reply: {exc}") from None
        if received != total:
            raise TransferError(f"grpc read from {peer}: received {received} of {total} bytes")
        self.count_read(total)
        return total

    def _failure(self, what: str, peer: str, exc: grpc.RpcError) -> TransferError:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self._forget(peer)
        # the receiver refused a range (INVALID_ARGUMENT ...) after checking it: nothing in
        # flight; otherwise chunks it already received may still be applied
        unsettled = exc.code() in UNSETTLED_CODES
        return TransferError(f"{what} failed: {exc.code().name}: {exc.details()}", unsettled)

    def close(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, {}
        for calls_of_peer in calls.values():
            calls_of_peer.channel.close()
        self._server.stop(grace=None).wait()
        self._regions = ()
