"""Real transfer backends on loopback: Mooncake over TCP (P2PHANDSHAKE) and the gRPC stream.

Two engines in this process, and a peer in another process (this file run as a script:
`python test_transfer_backends.py peer BACKEND`, which registers a buffer, prints
{endpoint, address, length}, answers `sum` with the sha256 of the buffer and `fill SEED` by
filling it with random.Random(SEED).randbytes and printing "ok"). Writes and reads.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

from common.transfer import TransferError, create_transfer  # noqa: E402

PEER_BYTES = (3 << 20) + 4321

# A failing call must fail at once, for its cause, not by waiting out its timeout (which
# says "timed out" or DEADLINE_EXCEEDED): shown by the error each backend raises for each
# cause, never by seconds (those are printed, for a reader).
FAILS_AT_ONCE = {   # cause -> backend -> what its error says (any of)
    "refused range": {"grpc": ("INVALID_ARGUMENT",), "mooncake": ("failed with status -1",)},   # the peer checked it
    "no listener": {"grpc": ("Connection refused",), "mooncake": ("refused at submit",)},       # a refused connection
    # reached before, then its process exited: its connection refused or broken
    "peer gone": {"grpc": ("UNAVAILABLE",), "mooncake": ("failed with status -1", "refused at submit")},
}


def _mooncake_importable() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


BACKENDS = [
    pytest.param("mooncake", marks=pytest.mark.skipif(
        not _mooncake_importable(), reason="mooncake.engine cannot be imported")),
    "grpc",
]


class Buffer:
    def __init__(self, data: bytes):
        self.raw = ctypes.create_string_buffer(data, len(data))
        self.address = ctypes.addressof(self.raw)

    def bytes(self) -> bytes:
        return self.raw.raw


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fails_at_once(backend: str, cause: str, call, *args) -> TransferError:
    """Runs call(*args), which must raise the TransferError `backend` raises at once for
    `cause` (FAILS_AT_ONCE), not one of a timeout that ran out."""
    start = time.monotonic()
    with pytest.raises(TransferError) as err:
        call(*args)
    message = str(err.value)
    print(f"{backend} {cause}: failed after {time.monotonic() - start:.2f} s: {message}")
    assert any(said in message for said in FAILS_AT_ONCE[cause][backend]), message
    assert "timed out" not in message and "DEADLINE_EXCEEDED" not in message, message
    if cause == "refused range":
        assert not err.value.unsettled, "nothing of a refused range is in flight"
    return err.value


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def engines(backend):
    made = [create_transfer(backend), create_transfer(backend)]
    yield made
    for engine in made:
        engine.close()


@pytest.mark.parametrize("direction", ["write", "read"])
def test_kv_blocks_between_two_engines(engines, direction):
    """a's blocks into b's: KVSender on a pushes them, or KVSender on b fetches them."""
    torch = pytest.importorskip("torch")
    from common.kv_layout import KVLayout
    from common.transfer import KVSender
    a, b = engines
    torch.manual_seed(0)
    src = torch.randn(4, 2, 12, 16, 2, 32)
    dst = torch.zeros(4, 2, 14, 16, 2, 32)
    ls, ld = KVLayout.of_tensor(src), KVLayout.of_tensor(dst)
    a.register(ls.base_address, ls.span_bytes)
    b.register(ld.base_address, ld.span_bytes)
    src_ids, dst_ids = [0, 1, 2, 5, 9, 10], [3, 4, 5, 0, 12, 13]
    if direction == "write":
        moved = KVSender(a, ls).send_blocks(b.endpoint, ld, src_ids, dst_ids)
    else:
        moved = KVSender(b, ld).fetch_blocks(a.endpoint, ls, src_ids, dst_ids)
    assert moved == 4 * 2 * 6 * ls.block_bytes
    expected = torch.zeros_like(dst)
    expected[:, :, dst_ids] = src[:, :, src_ids]
    assert torch.equal(dst, expected)


def test_large_and_odd_ranges_arrive_exactly(engines):
    a, b = engines
    src, dst = Buffer(os.urandom(9 << 20)), Buffer(bytes(10 << 20))
    a.register(src.address, 9 << 20)
    b.register(dst.address, 10 << 20)
    batch = [(src.address + 3, dst.address + 1001, (9 << 20) - 3), (src.address, dst.address, 7)]
    assert a.write(b.endpoint, batch) == (9 << 20) + 4
    want = bytearray(10 << 20)
    want[1001:1001 + (9 << 20) - 3] = src.bytes()[3:]
    want[0:7] = src.bytes()[:7]
    assert dst.bytes() == bytes(want)


def test_batch_of_more_ranges_than_mooncake_queues_per_peer(engines):
    a, b = engines
    n = 3000  # one Mooncake batch of more than ~2,050 ranges to a peer is refused (queue full)
    src, dst = Buffer(os.urandom(64 * n)), Buffer(bytes(64 * n))
    a.register(src.address, 64 * n)
    b.register(dst.address, 64 * n)
    order = [(i * 7) % n for i in range(n)]
    assert a.write(b.endpoint, [(src.address + 64 * i, dst.address + 64 * j, 64)
                                for i, j in enumerate(order)]) == 64 * n
    want = bytearray(64 * n)
    for i, j in enumerate(order):
        want[64 * j:64 * j + 64] = src.bytes()[64 * i:64 * i + 64]
    assert dst.bytes() == bytes(want)


def move(direction: str, a, b, src: int, dst: int, length: int) -> int:
    """a's src bytes into b's dst: a writes them ("write") or b reads them ("read")."""
    if direction == "write":
        return a.write(b.endpoint, [(src, dst, length)])
    return b.read(a.endpoint, [(dst, src, length)])


@pytest.mark.parametrize("direction", ["write", "read"])
def test_concurrent_transfers(engines, direction):
    a, b = engines
    src, dst = Buffer(os.urandom(8 << 20)), Buffer(bytes(8 << 20))
    a.register(src.address, 8 << 20)
    b.register(dst.address, 8 << 20)
    errors = []

    def worker(i: int) -> None:
        try:
            off = i << 20
            move(direction, a, b, src.address + off, dst.address + off, 1 << 20)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and dst.bytes() == src.bytes()


@pytest.mark.parametrize("direction", ["write", "read"])
def test_out_of_range_address_fails_fast_then_engine_still_works(backend, engines, direction):
    a, b = engines
    src, dst = Buffer(os.urandom(4096)), Buffer(bytes(4096))
    a.register(src.address, 4096)
    b.register(dst.address, 4096)
    if direction == "write":   # the peer's (destination) range is out of bounds
        fails_at_once(backend, "refused range", a.write, b.endpoint, [(src.address, dst.address + 4000, 200)])
    else:                      # the peer's (source) range is out of bounds
        fails_at_once(backend, "refused range", b.read, a.endpoint, [(dst.address, src.address + 4000, 200)])
    assert dst.bytes() == bytes(4096)
    assert move(direction, a, b, src.address, dst.address, 4096) == 4096
    assert dst.bytes() == src.bytes()


def test_unreachable_peer_fails_fast(backend, engines):
    a, _ = engines
    src = Buffer(bytes(64))
    a.register(src.address, 64)
    fails_at_once(backend, "no listener", a.write, f"127.0.0.1:{free_port()}", [(src.address, 0x10000, 64)])


def test_read_large_odd_and_many_ranges_arrive_exactly(engines):
    a, b = engines
    n = 3000  # more ranges than one Mooncake batch to a peer may hold; many per gRPC chunk
    src, dst = Buffer(os.urandom(9 << 20)), Buffer(bytes(10 << 20))
    a.register(src.address, 9 << 20)
    b.register(dst.address, 10 << 20)
    data = src.bytes()
    batch = [(dst.address + 1001, src.address + 3, (9 << 20) - 3), (dst.address, src.address, 7)]
    assert b.read(a.endpoint, batch) == (9 << 20) + 4
    want = bytearray(10 << 20)
    want[1001:1001 + (9 << 20) - 3] = data[3:]
    want[0:7] = data[:7]
    assert dst.bytes() == bytes(want)

    order = [(i * 7) % n for i in range(n)]
    assert b.read(a.endpoint, [(dst.address + 64 * j, src.address + 64 * i, 64)
                               for i, j in enumerate(order)]) == 64 * n
    for i, j in enumerate(order):
        want[64 * j:64 * j + 64] = data[64 * i:64 * i + 64]
    assert dst.bytes() == bytes(want)


def test_read_from_unreachable_peer_fails_fast(backend, engines):
    a, _ = engines
    dst = Buffer(bytes(64))
    a.register(dst.address, 64)
    fails_at_once(backend, "no listener", a.read, f"127.0.0.1:{free_port()}", [(dst.address, 0x10000, 64)])
    assert dst.bytes() == bytes(64)


class PeerProcess:
    def __init__(self, backend: str):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, __file__, "peer", backend], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
        self.info = json.loads(self.proc.stdout.readline())

    def fill(self, seed: int) -> bytes:
        self.proc.stdin.write(f"fill {seed}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"
        return random.Random(seed).randbytes(PEER_BYTES)

    def checksum(self) -> str:
        self.proc.stdin.write("sum\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def peer_process(backend):
    peer = PeerProcess(backend)
    yield peer
    peer.stop()


def test_write_into_another_process(backend, engines, peer_process):
    a, _ = engines
    info = peer_process.info
    src = Buffer(os.urandom(PEER_BYTES))
    a.register(src.address, PEER_BYTES)
    base = info["address"]
    batch = [(src.address, base + 17, 2 << 20), (src.address + (2 << 20), base + (5 << 19), 777)]
    assert a.write(info["endpoint"], batch) == (2 << 20) + 777
    want = bytearray(PEER_BYTES)
    want[17:17 + (2 << 20)] = src.bytes()[:2 << 20]
    want[5 << 19:(5 << 19) + 777] = src.bytes()[2 << 20:(2 << 20) + 777]
    assert peer_process.checksum() == hashlib.sha256(want).hexdigest()

    peer_process.stop()
    fails_at_once(backend, "peer gone", a.write, info["endpoint"], [(src.address, base, 4096)])


def test_read_from_another_process(backend, engines, peer_process):
    a, _ = engines
    info = peer_process.info
    peer_bytes = peer_process.fill(seed=11)
    dst = Buffer(bytes(PEER_BYTES))
    a.register(dst.address, PEER_BYTES)
    base = info["address"]
    batch = [(dst.address + 5, base + 17, 2 << 20), (dst.address + (5 << 19), base + PEER_BYTES - 777, 777)]
    assert a.read(info["endpoint"], batch) == (2 << 20) + 777
    want = bytearray(PEER_BYTES)
    want[5:5 + (2 << 20)] = peer_bytes[17:17 + (2 << 20)]
    want[5 << 19:(5 << 19) + 777] = peer_bytes[-777:]
    assert dst.bytes() == bytes(want)

    fails_at_once(backend, "refused range", a.read, info["endpoint"], [(dst.address, base + PEER_BYTES - 10, 20)])
    assert a.read(info["endpoint"], [(dst.address, base, 4096)]) == 4096
    assert dst.bytes()[:4096] == peer_bytes[:4096]

    peer_process.stop()
    fails_at_once(backend, "peer gone", a.read, info["endpoint"], [(dst.address, base, 4096)])


def serve_peer(backend: str) -> None:
    engine = create_transfer(backend)
    buf = Buffer(bytes(PEER_BYTES))
    engine.register(buf.address, PEER_BYTES)
    print(json.dumps({"endpoint": engine.endpoint, "address": buf.address, "length": PEER_BYTES}),
          flush=True)
    for line in sys.stdin:
        command = line.split()
        if command == ["sum"]:
            print(hashlib.sha256(buf.bytes()).hexdigest(), flush=True)
        elif command[:1] == ["fill"]:
            ctypes.memmove(buf.address, random.Random(int(command[1])).randbytes(PEER_BYTES), PEER_BYTES)
            print("ok", flush=True)
        else:
            break
    engine.close()


if __name__ == "__main__" and sys.argv[1:2] == ["peer"]:
    serve_peer(sys.argv[2])
