"""FakeTransfer semantics for writes and reads (range checks, fault injection, counters) and
the backend factory."""
from __future__ import annotations

import ctypes
import threading
import time

import pytest

from common.transfer import BACKENDS, TransferError, create_transfer
from common.transfer.fake import FakeTransfer


class Buffer:
    def __init__(self, data: bytes):
        self.raw = ctypes.create_string_buffer(data, len(data))
        self.address = ctypes.addressof(self.raw)

    def bytes(self) -> bytes:
        return self.raw.raw


@pytest.fixture
def pair():
    a, b = FakeTransfer(), FakeTransfer()
    src, dst = Buffer(bytes(range(256)) * 4), Buffer(bytes(1024))
    a.register(src.address, 1024)
    b.register(dst.address, 1024)
    yield a, b, src, dst
    a.close()
    b.close()


def test_write_copies_ranges_and_counts(pair):
    a, b, src, dst = pair
    n = a.write(b.endpoint, [(src.address, dst.address + 100, 10), (src.address + 500, dst.address, 4)])
    assert n == 14
    want = bytearray(1024)
    want[100:110] = src.bytes()[:10]
    want[0:4] = src.bytes()[500:504]
    assert dst.bytes() == bytes(want)
    assert (a.num_writes, a.num_bytes, b.num_writes) == (1, 14, 0)
    assert a.endpoint != b.endpoint and a.endpoint.startswith("fake:")


@pytest.mark.parametrize("local_off, remote_off, length, match", [
    (0, 1020, 8, "remote range .* not registered"),
    (1020, 0, 8, "local range .* not registered"),
    (0, 0, -1, "negative length"),
])
def test_out_of_range_is_transfer_error_and_copies_nothing(pair, local_off, remote_off, length, match):
    a, b, src, dst = pair
    batch = [(src.address, dst.address, 4), (src.address + local_off, dst.address + remote_off, length)]
    with pytest.raises(TransferError, match=match):
        a.write(b.endpoint, batch)
    assert dst.bytes() == bytes(1024) and a.num_writes == 0


def test_unknown_and_closed_peers_are_unreachable(pair):
    a, b, src, dst = pair
    with pytest.raises(TransferError, match="unreachable"):
        a.write("fake:999999", [(src.address, dst.address, 4)])
    b.close()
    with pytest.raises(TransferError, match="unreachable"):
        a.write(b.endpoint, [(src.address, dst.address, 4)])


def test_fail_next_counts_down_and_takes_a_custom_error(pair):
    a, b, src, dst = pair
    batch = [(src.address, dst.address, 4)]
    a.fail_next(2)
    a.fail_next(error=TimeoutError("slow"))
    for _ in range(2):
        with pytest.raises(TransferError, match="injected"):
            a.write(b.endpoint, batch)
    with pytest.raises(TimeoutError, match="slow"):
        a.write(b.endpoint, batch)
    assert a.write(b.endpoint, batch) == 4
    assert a.num_writes == 1


def test_fail_peer_until_healed(pair):
    a, b, src, dst = pair
    a.fail_peer(b.endpoint)
    with pytest.raises(TransferError, match=f"peer {b.endpoint} unreachable"):
        a.write(b.endpoint, [(src.address, dst.address, 4)])
    a.heal_peer(b.endpoint)
    assert a.write(b.endpoint, [(src.address, dst.address, 4)]) == 4


def test_delay_applies_to_every_write(pair):
    a, b, src, dst = pair
    a.delay_s = 0.05
    start = time.perf_counter()
    a.write(b.endpoint, [(src.address, dst.address, 4)])
    assert time.perf_counter() - start >= 0.05


def test_concurrent_writes_all_land_and_count(pair):
    a, b, src, dst = pair

    def worker(i: int) -> None:
        for _ in range(50):
            a.write(b.endpoint, [(src.address + 64 * i, dst.address + 64 * i, 64)])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (a.num_writes, a.num_bytes) == (400, 400 * 64)
    assert dst.bytes()[:512] == src.bytes()[:512]


def test_read_copies_ranges_and_counts(pair):
    a, b, src, dst = pair
    n = b.read(a.endpoint, [(dst.address + 100, src.address, 10), (dst.address, src.address + 500, 4)])
    assert n == 14
    want = bytearray(1024)
    want[100:110] = src.bytes()[:10]
    want[0:4] = src.bytes()[500:504]
    assert dst.bytes() == bytes(want)
    assert src.bytes() == bytes(range(256)) * 4
    assert (b.num_reads, b.num_bytes_read, b.num_writes, b.num_bytes) == (1, 14, 0, 0)
    assert (a.num_reads, a.num_writes) == (0, 0)


@pytest.mark.parametrize("local_off, remote_off, length, match", [
    (0, 1020, 8, "remote range .* not registered"),
    (1020, 0, 8, "local range .* not registered"),
    (0, 0, -1, "negative length"),
])
def test_read_out_of_range_is_transfer_error_and_copies_nothing(pair, local_off, remote_off, length, match):
    a, b, src, dst = pair
    batch = [(dst.address, src.address, 4), (dst.address + local_off, src.address + remote_off, length)]
    with pytest.raises(TransferError, match=match):
        b.read(a.endpoint, batch)
    assert dst.bytes() == bytes(1024) and (b.num_reads, b.num_bytes_read) == (0, 0)


def test_read_from_unknown_peer_is_unreachable(pair):
    _, b, src, dst = pair
    with pytest.raises(TransferError, match="unreachable"):
        b.read("fake:999999", [(dst.address, src.address, 4)])


def test_faults_apply_to_reads_and_share_the_queue_with_writes(pair):
    a, b, src, dst = pair
    read = [(dst.address, src.address, 4)]
    b.fail_next(2)
    b.fail_next(error=TimeoutError("slow"))
    with pytest.raises(TransferError, match="injected"):
        b.read(a.endpoint, read)
    with pytest.raises(TransferError, match="injected"):
        b.write(a.endpoint, [(dst.address, src.address, 4)])
    with pytest.raises(TimeoutError, match="slow"):
        b.read(a.endpoint, read)
    b.fail_peer(a.endpoint)
    with pytest.raises(TransferError, match=f"peer {a.endpoint} unreachable"):
        b.read(a.endpoint, read)
    assert dst.bytes() == bytes(1024) and src.bytes() == bytes(range(256)) * 4
    assert (b.num_reads, b.num_writes) == (0, 0)
    b.heal_peer(a.endpoint)
    b.delay_s = 0.05
    start = time.perf_counter()
    assert b.read(a.endpoint, read) == 4
    assert time.perf_counter() - start >= 0.05
    assert dst.bytes()[:4] == bytes([0, 1, 2, 3]) and (b.num_reads, b.num_bytes_read) == (1, 4)


def test_register_validates():
    engine = FakeTransfer()
    with pytest.raises(ValueError, match="length > 0"):
        engine.register(0x1000, 0)
    engine.close()


def test_factory_creates_backends_lazily():
    assert set(BACKENDS) == {"mooncake", "grpc", "fake"}
    engine = create_transfer("fake", delay_s=0.5)
    assert isinstance(engine, FakeTransfer) and engine.name == "fake" and engine.delay_s == 0.5
    engine.close()
    with pytest.raises(ValueError, match="unknown transfer backend 'nixl'; allowed: mooncake, grpc, fake"):
        create_transfer("nixl")
