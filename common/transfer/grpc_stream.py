"""`grpc` backend: writes carried as a client stream of KVTransfer.Write chunks, for hosts
where Mooncake cannot be installed.

Receiver: every engine serves KVTransfer on its own small sync gRPC server (thread pool) at
`endpoint` = host:port (port 0 picks a free one). Each WriteChunk's bytes are copied into
registered memory after checking that [remote_address, + len(data)) lies inside one
registered region; otherwise the RPC ends with INVALID_ARGUMENT and nothing more of that
stream is applied. The ack carries the bytes written.

Writer: one channel per peer, kept until close() or an UNAVAILABLE failure; a batch is one RPC whose ranges are split
into chunks of at most `chunk_bytes`. Chunks are encoded and decoded by hand in
WriteChunk's wire format (byte-identical to transfer_pb2.WriteChunk, whose clients work
unchanged) so that each chunk's payload is copied once on each side instead of three times.

Thread-safety: `write` may be called from several threads at once (each call is its own
RPC); the server applies concurrent streams in parallel, so writers must not overlap ranges.
"""
from __future__ import annotations

import ctypes
import threading
from concurrent import futures

import grpc

from common.transfer.base import Region, TransferEngine, TransferError, regions_hold
from protos.pdmesh.v1 import transfer_pb2

METHOD = "/pdmesh.v1.KVTransfer/Write"
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def encode_chunk(remote_address: int, local_address: int, length: int) -> bytes:
    """WriteChunk(remote_address, data=<length bytes at local_address>), serialized."""
    header = (b"\x08" + _varint(remote_address) if remote_address else b"") + b"\x12" + _varint(length)
    return b"".join((header, (ctypes.c_char * length).from_address(local_address)))


def decode_chunk(buf: bytes) -> tuple[int, int, int]:
    """(remote_address, offset of data in buf, length of data) of a serialized WriteChunk;
    ValueError if malformed."""
    address, offset, length, pos = 0, 0, 0, 0
    try:
        while pos < len(buf):
            tag, pos = _read_varint(buf, pos)
            field, wire = tag >> 3, tag & 7
            if wire == 0:
                value, pos = _read_varint(buf, pos)
                if field == 1:
                    address = value
            elif wire == 2:
                size, pos = _read_varint(buf, pos)
                if field == 2:
                    offset, length = pos, size
                pos += size
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            else:
                raise ValueError(f"wire type {wire}")
    except IndexError:
        raise ValueError("truncated WriteChunk") from None
    if pos != len(buf):
        raise ValueError("truncated WriteChunk")
    return address, offset, length


def _bytes_address(buf: bytes) -> int:
    return ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value


class GrpcStreamTransfer(TransferEngine):
    name = "grpc"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_workers: int = 4,
                 chunk_bytes: int = 1 << 20, timeout_s: float = 60.0):
        if not 0 < chunk_bytes <= MAX_MESSAGE_BYTES - 64:
            raise ValueError(f"chunk_bytes {chunk_bytes} must be in (0, {MAX_MESSAGE_BYTES - 64}]")
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self._regions: tuple[Region, ...] = ()
        self._calls: dict[str, tuple[grpc.Channel, grpc.StreamUnaryMultiCallable]] = {}
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers, "kv-recv"),
                                   options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)])
        handler = grpc.stream_unary_rpc_method_handler(
            self._serve_write, response_serializer=transfer_pb2.WriteAck.SerializeToString)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("pdmesh.v1.KVTransfer", {"Write": handler}),))
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if not bound:
            raise TransferError(f"grpc transfer: cannot bind {host}:{port}")
        self._server.start()
        self._endpoint = f"{host}:{bound}"

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, address: int, length: int) -> Region:
        region = Region.checked(address, length)
        with self._lock:
            self._regions = self._regions + (region,)
        return region

    def _contains(self, address: int, length: int) -> bool:
        return regions_hold(self._regions, address, length)

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
                              f"region registered on {self._endpoint}: "
                              + ", ".join(f"({r.address:#x}, {r.length})" for r in self._regions))
            ctypes.memmove(address, _bytes_address(buf) + offset, length)
            total += length
        return transfer_pb2.WriteAck(bytes_written=total)

    def _call_for(self, peer: str) -> grpc.StreamUnaryMultiCallable:
        with self._lock:
            if peer not in self._calls:
                channel = grpc.insecure_channel(peer, options=CHANNEL_OPTIONS)
                call = channel.stream_unary(METHOD, request_serializer=None,
                                            response_deserializer=transfer_pb2.WriteAck.FromString)
                self._calls[peer] = (channel, call)
            return self._calls[peer][1]

    def _forget(self, peer: str) -> None:
        """Drops a failed peer's channel (closed once no call uses it) so that the next write
        connects afresh instead of waiting out the channel's reconnect backoff."""
        with self._lock:
            self._calls.pop(peer, None)

    def _chunks(self, batch: list[tuple[int, int, int]]):
        step = self.chunk_bytes
        for local, remote, length in batch:
            for off in range(0, length, step):
                yield encode_chunk(remote + off, local + off, min(step, length - off))

    def write(self, peer: str, batch: list[tuple[int, int, int]]) -> int:
        if any(length < 0 for _, _, length in batch):
            raise ValueError(f"negative length in write batch to {peer}")
        total = sum(length for _, _, length in batch)
        if not total:
            return 0
        try:
            ack = self._call_for(peer)(self._chunks(batch), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._forget(peer)
            raise TransferError(f"grpc write of {total} bytes to {peer} failed: "
                                f"{exc.code().name}: {exc.details()}") from None
        if ack.bytes_written != total:
            raise TransferError(f"grpc write to {peer}: acked {ack.bytes_written} of {total} bytes")
        return total

    def close(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, {}
        for channel, _ in calls.values():
            channel.close()
        self._server.stop(grace=None).wait()
        self._regions = ()
