"""In-process transfer backend for unit tests: write and read = ctypes.memmove between
regions that engines of this process registered, with fault injection.

Endpoints ("fake:1", "fake:2", ...) live in a class-level directory until close(). Stricter
than the TCP backends, as RDMA is: the local range of a write or read must lie in a region
this engine registered, and the remote range in one the peer registered. Every range is
checked before any byte moves, so a failed call copies nothing. Fault injection
(fail_next, fail_peer, delay_s, hold) applies to writes and reads alike. `hold()` keeps
later calls in flight, bytes not yet copied, until `release_held()` (they land then) or
`close()` (they never land, as the writes of a process that died). Counters: num_writes /
num_bytes (written), num_reads / num_bytes_read, num_held (in flight now). All methods are
thread-safe.
"""
from __future__ import annotations

import ctypes
import itertools
import threading
import time

from common.transfer.base import Region, TransferEngine, TransferError, regions_hold, without_region


class FakeTransfer(TransferEngine):
    name = "fake"
    _directory: dict[str, FakeTransfer] = {}
    _ids = itertools.count(1)
    _directory_lock = threading.Lock()

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.num_writes = 0
        self.num_bytes = 0
        self.num_reads = 0
        self.num_bytes_read = 0
        self._regions: tuple[Region, ...] = ()
        self._lock = threading.Lock()
        self._fail_next: list[BaseException] = []
        self._failed_peers: set[str] = set()
        self._holding = False
        self._held = threading.Condition(self._lock)
        self._closed = False
        self.num_held = 0
        with self._directory_lock:
            self._endpoint = f"fake:{next(self._ids)}"
            self._directory[self._endpoint] = self

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, address: int, length: int) -> Region:
        region = Region.checked(address, length)
        with self._lock:
            self._regions = self._regions + (region,)
        return region

    def unregister(self, region: Region) -> None:
        with self._lock:
            self._regions = without_region(self._regions, region)

    def fail_next(self, n: int = 1, error: BaseException | None = None) -> None:
        """The next n writes or reads raise `error` (default TransferError) and copy nothing."""
        with self._lock:
            self._fail_next += [error or TransferError("injected failure")] * n

    def fail_peer(self, endpoint: str) -> None:
        """Every later write to or read from `endpoint` by this engine raises TransferError."""
        with self._lock:
            self._failed_peers.add(endpoint)

    def heal_peer(self, endpoint: str) -> None:
        with self._lock:
            self._failed_peers.discard(endpoint)

    def hold(self) -> None:
        """Later writes and reads stay in flight until release_held() or close()."""
        with self._lock:
            self._holding = True

    def release_held(self) -> None:
        """Let the held calls copy their bytes and return; stop holding."""
        with self._lock:
            self._holding = False
            self._held.notify_all()

    def contains(self, address: int, length: int) -> bool:
        return regions_hold(self._regions, address, length)

    def write(self, peer: str, batch: list[tuple[int, int, int]], timeout_s: float | None = None) -> int:
        total = self._copy(peer, batch, to_peer=True)
        with self._lock:
            self.num_writes += 1
            self.num_bytes += total
        self.count_written(total)
        return total

    def read(self, peer: str, batch: list[tuple[int, int, int]], timeout_s: float | None = None) -> int:
        total = self._copy(peer, batch, to_peer=False)
        with self._lock:
            self.num_reads += 1
            self.num_bytes_read += total
        self.count_read(total)
        return total

    def _copy(self, peer: str, batch: list[tuple[int, int, int]], to_peer: bool) -> int:
        """Injected faults, then every range checked, then the memmoves; returns the bytes."""
        with self._lock:
            injected = self._fail_next.pop(0) if self._fail_next else None
            peer_failed = peer in self._failed_peers
            if self._holding:
                self.num_held += 1
                while self._holding and not self._closed:
                    self._held.wait()
                self.num_held -= 1
                if self._closed:
                    raise TransferError(f"{self.endpoint} closed with the call in flight")
        if self.delay_s:
            time.sleep(self.delay_s)
        if injected is not None:
            raise injected
        if peer_failed:
            raise TransferError(f"peer {peer} unreachable (injected)")
        target = self._directory.get(peer)
        if target is None:
            raise TransferError(f"peer {peer} unreachable: no such fake endpoint")
        for local, remote, length in batch:
            if length < 0:
                raise TransferError(f"negative length {length}")
            if length and not self.contains(local, length):
                raise TransferError(f"local range ({local:#x}, {length}) not registered on {self.endpoint}")
            if length and not target.contains(remote, length):
                raise TransferError(f"remote range ({remote:#x}, {length}) not registered on {peer}")
        total = 0
        for local, remote, length in batch:
            if length:
                dst, src = (remote, local) if to_peer else (local, remote)
                ctypes.memmove(dst, src, length)
                total += length
        return total

    def close(self) -> None:
        with self._directory_lock:
            self._directory.pop(self._endpoint, None)
        with self._lock:
            self._closed = True
            self._held.notify_all()
        self._regions = ()
