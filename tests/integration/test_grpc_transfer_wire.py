"""The `grpc` transfer backend's wire format: plain protobuf clients of KVTransfer work
against it (Write and Read), and the hand-encoded chunks equal protobuf's encoding."""
from __future__ import annotations

import os

import pytest

from common.transfer import create_transfer
from tests.integration.test_transfer_backends import Buffer


def test_grpc_receiver_accepts_protobuf_clients():
    import grpc

    from common.transfer.grpc_transfer import CHANNEL_OPTIONS
    from protos.pdmesh.v1 import transfer_pb2, transfer_pb2_grpc
    receiver = create_transfer("grpc")
    dst = Buffer(bytes(64))
    receiver.register(dst.address, 64)
    with grpc.insecure_channel(receiver.endpoint, options=CHANNEL_OPTIONS) as channel:
        stub = transfer_pb2_grpc.KVTransferStub(channel)
        chunks = [transfer_pb2.WriteChunk(remote_address=dst.address + 8, data=b"abc"),
                  transfer_pb2.WriteChunk(data=b"", remote_address=dst.address)]
        assert stub.Write(iter(chunks)).bytes_written == 3
        with pytest.raises(grpc.RpcError) as exc:
            stub.Write(iter([transfer_pb2.WriteChunk(remote_address=dst.address + 62, data=b"xyz")]))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not inside a region registered" in exc.value.details()
    receiver.close()
    assert dst.bytes()[8:11] == b"abc" and dst.bytes().count(0) == 61


def test_grpc_chunk_codec_matches_protobuf():
    from common.transfer.grpc_wire import decode_chunk, encode_chunk
    from protos.pdmesh.v1 import transfer_pb2
    payload = Buffer(os.urandom(300))
    for address in (0, 1, 127, 128, 0x7F12_3456_789A, 2**64 - 1):
        wire = encode_chunk(address, payload.address, 300)
        assert wire == transfer_pb2.WriteChunk(remote_address=address, data=payload.bytes()).SerializeToString()
        parsed_address, offset, length = decode_chunk(wire)
        assert (parsed_address, wire[offset:offset + length]) == (address, payload.bytes())
    reordered = b"\x12\x02hi" + b"\x08\x05" + b"\x1d\x00\x00\x00\x00"
    assert decode_chunk(reordered) == (5, 2, 2)
    with pytest.raises(ValueError, match="truncated"):
        decode_chunk(b"\x12\x05hi")


def test_grpc_read_serves_protobuf_clients():
    import grpc

    from common.transfer.grpc_transfer import CHANNEL_OPTIONS
    from protos.pdmesh.v1 import transfer_pb2, transfer_pb2_grpc
    receiver = create_transfer("grpc")
    src = Buffer(bytes(range(64)))
    receiver.register(src.address, 64)
    Range = transfer_pb2.ReadRange
    with grpc.insecure_channel(receiver.endpoint, options=CHANNEL_OPTIONS) as channel:
        stub = transfer_pb2_grpc.KVTransferStub(channel)
        request = transfer_pb2.ReadRequest(ranges=[Range(remote_address=src.address + 8, length=4),
                                                   Range(remote_address=src.address, length=0),
                                                   Range(remote_address=src.address + 60, length=3)],
                                           chunk_bytes=3)
        assert [c.data for c in stub.Read(request)] == [bytes([8, 9, 10]), bytes([11, 60, 61]), bytes([62])]
        bad = transfer_pb2.ReadRequest(ranges=[Range(remote_address=src.address, length=4),
                                               Range(remote_address=src.address + 62, length=3)])
        received = []
        with pytest.raises(grpc.RpcError) as exc:
            received.extend(stub.Read(bad))
        assert received == [] and exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (f"ranges[1] ({src.address + 62:#x}, 3 bytes) is not inside a region registered on "
                f"{receiver.endpoint}: ({src.address:#x}, 64)") == exc.value.details()
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Read(transfer_pb2.ReadRequest(chunk_bytes=1 << 30)))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chunk_bytes" in exc.value.details()
    receiver.close()


def test_grpc_read_chunk_codec_matches_protobuf():
    from common.transfer.grpc_wire import decode_read_chunk, encode_read_chunks, scatter_read_chunks
    from protos.pdmesh.v1 import transfer_pb2
    src = Buffer(os.urandom(300))
    ranges = [(src.address + 10, 100), (src.address, 5), (src.address + 200, 100)]
    data = src.bytes()[10:110] + src.bytes()[:5] + src.bytes()[200:300]
    wire = list(encode_read_chunks(ranges, 128))
    assert wire == [transfer_pb2.ReadChunk(data=data[:128]).SerializeToString(),
                    transfer_pb2.ReadChunk(data=data[128:]).SerializeToString()]
    offset, length = decode_read_chunk(wire[1])
    assert wire[1][offset:offset + length] == data[128:]
    assert decode_read_chunk(b"\x08\x05" + wire[1]) == (offset + 2, length)  # unknown field skipped
    dst = Buffer(bytes(205))
    assert scatter_read_chunks(wire, [(dst.address + 5, 200), (dst.address, 5)]) == 205
    assert dst.bytes() == data[200:] + data[:200]
    with pytest.raises(ValueError, match="more than the 200 bytes requested"):
        scatter_read_chunks(wire, [(dst.address, 200)])
    with pytest.raises(ValueError, match="truncated ReadChunk"):
        decode_read_chunk(b"\x0a\x05hi")


def test_grpc_receiver_admits_only_the_mesh():
    """The receiver of a service is wired with the mesh's rules (services/node/engine_node.py
    grpc_transfer_security): an anonymous Write or Read is UNAUTHENTICATED and changes
    nothing; a writer holding the cluster secret writes."""
    import grpc

    from common.transfer.grpc_transfer import CHANNEL_OPTIONS
    from protos.pdmesh.v1 import transfer_pb2, transfer_pb2_grpc
    from services.node.engine_node import grpc_transfer_security
    receiver = create_transfer("grpc", **grpc_transfer_security())
    writer = create_transfer("grpc", **grpc_transfer_security())
    dst, src = Buffer(bytes(64)), Buffer(b"k" * 64)
    receiver.register(dst.address, 64)
    writer.register(src.address, 64)
    with grpc.insecure_channel(receiver.endpoint, options=CHANNEL_OPTIONS) as channel:
        stub = transfer_pb2_grpc.KVTransferStub(channel)
        with pytest.raises(grpc.RpcError) as exc:
            stub.Write(iter([transfer_pb2.WriteChunk(remote_address=dst.address, data=b"evil")]))
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Read(transfer_pb2.ReadRequest(ranges=[transfer_pb2.ReadRange(
                remote_address=dst.address, length=8)])))
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert dst.bytes() == bytes(64)
    writer.write(receiver.endpoint, [(src.address, dst.address, 64)])
    assert dst.bytes() == b"k" * 64
    writer.close()
    receiver.close()
