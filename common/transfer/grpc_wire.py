"""The `grpc` backend's chunks, encoded and decoded by hand in protobuf wire format,
byte-identical to transfer_pb2.WriteChunk and transfer_pb2.ReadChunk (whose clients work
unchanged), so that each chunk's payload is copied once on each side instead of three times
(measured for ReadChunk on loopback, 2 busy cores, 64 MiB reads: 0.56-0.70 GB/s, as fast
as writes, instead of 0.40-0.46 GB/s with transfer_pb2 messages).

    WriteChunk  [0x08 <varint remote_address>] 0x12 <varint len> <data>
    ReadChunk   0x0a <varint len> <data>

Decoding accepts any valid serialization (fields in any order, unknown fields skipped, the
last occurrence of a field wins).
"""
from __future__ import annotations

import ctypes
from collections.abc import Iterable, Iterator


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """(the protobuf varint at buf[pos], the position after it); ValueError when too long,
    IndexError when it runs past the end."""
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


def _scan(buf: bytes, message: str) -> dict[tuple[int, int], int | tuple[int, int]]:
    """{(field number, wire type): value} of a serialized message: a varint's value, a
    length-delimited field's (offset in buf, length). ValueError if malformed."""
    fields: dict[tuple[int, int], int | tuple[int, int]] = {}
    pos = 0
    try:
        while pos < len(buf):
            tag, pos = read_varint(buf, pos)
            field, wire = tag >> 3, tag & 7
            if wire == 0:
                fields[field, wire], pos = read_varint(buf, pos)
            elif wire == 2:
                size, pos = read_varint(buf, pos)
                fields[field, wire] = (pos, size)
                pos += size
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            else:
                raise ValueError(f"wire type {wire}")
    except IndexError:
        raise ValueError(f"truncated {message}") from None
    if pos != len(buf):
        raise ValueError(f"truncated {message}")
    return fields


def bytes_address(buf: bytes) -> int:
    """Address of the first byte of an immutable bytes object (valid while it lives)."""
    return ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value


def encode_chunk(remote_address: int, local_address: int, length: int) -> bytes:
    """WriteChunk(remote_address, data=<length bytes at local_address>), serialized."""
    header = (b"\x08" + encode_varint(remote_address) if remote_address else b"") + b"\x12" + encode_varint(length)
    return b"".join((header, (ctypes.c_char * length).from_address(local_address)))


def decode_chunk(buf: bytes) -> tuple[int, int, int]:
    """(remote_address, offset of data in buf, length of data) of a serialized WriteChunk;
    ValueError if malformed."""
    fields = _scan(buf, "WriteChunk")
    offset, length = fields.get((2, 2), (0, 0))
    return fields.get((1, 0), 0), offset, length


def encode_read_chunks(ranges: Iterable[tuple[int, int]], chunk_bytes: int) -> Iterator[bytes]:
    """Serialized ReadChunks whose data, concatenated, is the bytes of the (address, length)
    ranges in order; every chunk's data but the last's is exactly chunk_bytes long."""
    pieces: list = []
    size = 0
    for address, length in ranges:
        off = 0
        while off < length:
            n = min(chunk_bytes - size, length - off)
            pieces.append((ctypes.c_char * n).from_address(address + off))
            size, off = size + n, off + n
            if size == chunk_bytes:
                yield b"".join([b"\x0a" + encode_varint(size), *pieces])
                pieces, size = [], 0
    if pieces:
        yield b"".join([b"\x0a" + encode_varint(size), *pieces])


def decode_read_chunk(buf: bytes) -> tuple[int, int]:
    """(offset of data in buf, length of data) of a serialized ReadChunk; ValueError if
    malformed."""
    return _scan(buf, "ReadChunk").get((1, 2), (0, 0))


def scatter_read_chunks(chunks: Iterable[bytes], ranges: Iterable[tuple[int, int]]) -> int:
    """Copies the data of serialized ReadChunks, concatenated, into the (address, length)
    ranges in order; returns the bytes copied. ValueError if a chunk is malformed or the
    chunks hold more bytes than the ranges (then every range was filled)."""
    targets = iter(ranges)
    address = left = received = 0
    for buf in chunks:
        pos, size = decode_read_chunk(buf)
        base, end = bytes_address(buf), pos + size
        while pos < end:
            while not left:
                target = next(targets, None)
                if target is None:
                    raise ValueError(f"more than the {received} bytes requested")
                address, left = target
            n = min(left, end - pos)
            ctypes.memmove(address, base + pos, n)
            address, left, pos, received = address + n, left - n, pos + n, received + n
    return received
