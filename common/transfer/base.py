"""KV data plane: one-sided writes into, and reads out of, a peer's registered memory.

Every node registers its whole KV cache once (`register`) and publishes
`endpoint` plus the region's base address in its NodeInfo. A writer then moves bytes
with `write(peer_endpoint, [(local_addr, remote_addr, length), ...])`: one batched call,
returning only when every byte is acknowledged by the receiver. A reader pulls bytes the
other way with `read(peer_endpoint, [(local_addr, remote_addr, length), ...])`, returning
only when every byte has arrived in local memory. Each call ends within its `timeout_s`
(the request's remaining time, at most timeouts.transfer_s; the backend's own default when
None): past it the call raises, and once it has raised nothing of it lands later unless
the error says `unsettled`. Either raises TransferError otherwise
(unreachable peer, remote range outside the peer's registered regions, local range not
registered where the backend needs it, injected fault).

Backends (common/transfer/factory.py): `mooncake` (Mooncake Transfer Engine, tcp here,
rdma on RoCE), `grpc` (bytes over gRPC streams; the peer serves the KVTransfer service),
`fake` (in-process memmove with fault injection, for unit tests).

Thread-safety: `write` and `read` may be called from several threads at once; `register`
and `close` are called once each, from the owning service.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass


class TransferError(RuntimeError):
    """A write or read did not complete; nothing is known about which bytes arrived.
    `unsettled`: some ranges were still in flight when the call gave up, so they may yet
    land (otherwise every range has ended, one way or the other)."""

    def __init__(self, message: str, unsettled: bool = False):
        super().__init__(message)
        self.unsettled = unsettled


@dataclass(frozen=True)
class Region:
    address: int
    length: int

    @classmethod
    def checked(cls, address: int, length: int) -> "Region":
        """ValueError unless address > 0 and length > 0."""
        if address <= 0 or length <= 0:
            raise ValueError(f"region ({address:#x}, {length}) must have address > 0 and length > 0")
        return cls(address, length)

    def holds(self, address: int, length: int) -> bool:
        return self.address <= address and address + length <= self.address + self.length


def without_region(regions: tuple[Region, ...], region: Region) -> tuple[Region, ...]:
    """regions less region; ValueError when it is not one of them."""
    if region not in regions:
        raise ValueError(f"region ({region.address:#x}, {region.length}) is not registered")
    i = regions.index(region)
    return regions[:i] + regions[i + 1:]


def regions_hold(regions, address: int, length: int) -> bool:
    """True if [address, address + length) lies inside one of the regions."""
    return any(r.holds(address, length) for r in regions)


class TransferEngine(ABC):
    name: str = "abstract"
    bytes_written: int = 0   # acknowledged by peers since this engine started (count_* below)
    bytes_read: int = 0      # arrived from peers
    _count_lock = threading.Lock()

    def count_written(self, n: int) -> None:
        with self._count_lock:
            self.bytes_written += n

    def count_read(self, n: int) -> None:
        with self._count_lock:
            self.bytes_read += n

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """How peers address this node (e.g. "127.0.0.1:15432")."""

    @abstractmethod
    def register(self, address: int, length: int) -> Region:
        """Expose [address, address + length) of this process's memory to peers' writes and
        reads. The memory must stay alive until close()."""

    @abstractmethod
    def unregister(self, region: Region) -> None:
        """Stop exposing a region register() returned: peers' reads and writes into it fail
        from now on (one in flight may still complete)."""

    @abstractmethod
    def write(self, peer: str, batch: list[tuple[int, int, int]], timeout_s: float | None = None) -> int:
        """Copy each (local_address, remote_address, length) to the peer; returns the
        number of bytes written once all are acknowledged. Raises TransferError."""

    @abstractmethod
    def read(self, peer: str, batch: list[tuple[int, int, int]], timeout_s: float | None = None) -> int:
        """Copy each (local_address, remote_address, length) from the peer's registered
        memory into local memory; returns the number of bytes read once all have arrived.
        Raises TransferError (then the local ranges hold unknown bytes)."""

    @property
    def listen_addresses(self) -> tuple[str, ...]:
        """Where this engine accepts peers' connections, as "host:port" ("0.0.0.0:P" or
        "[::]:P": every interface of this machine), for operators to see and firewall.
        () when it opens no listener of its own, or cannot tell. Optional."""
        return ()

    def close(self) -> None:
        """Release registrations and connections. Optional."""
