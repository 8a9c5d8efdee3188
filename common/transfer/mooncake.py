"""`mooncake` backend: the Mooncake Transfer Engine, one-sided writes into a peer's
registered memory.

Configuration only, same code everywhere:
- CPU hosts: `pip install mooncake-transfer-engine-non-cuda` (its engine.so also needs the
  system's libibverbs.so.1, Debian package `libibverbs1`), protocol "tcp".
- RoCE / InfiniBand: protocol "rdma", `device_name` selects the NIC (e.g. "mlx5_0", or a
  comma-separated list), `hostname` is this node's address on that network.
- Ascend: the `mooncake-transfer-engine-npu` package, protocol "ascend" (HCCS / RoCE between
  NPUs); device memory is registered the same way.
`metadata_server` "P2PHANDSHAKE" needs no extra service (a peer is addressed as
host:rpc_port); an "etcd://host:port" URL works too.

Useful environment variables of the engine (read when it starts): MC_TCP_SLICE_SIZE (bytes
per socket read/write, default 64 KiB), MC_TCP_LANES_PER_PEER (connections per peer,
default 4), MC_TRANSFER_TIMEOUT (seconds before a sync write gives up, default 30).

Thread-safety: Mooncake's Python binding releases the GIL and guards its own state with a
mutex, and every write allocates its own batch, so `write` needs no lock here.
"""
from __future__ import annotations

from common.transfer.base import Region, TransferEngine, TransferError


def _import_engine():
    try:
        from mooncake.engine import TransferEngine as MooncakeEngine
    except ImportError as exc:
        raise RuntimeError(
            "the mooncake transfer backend needs the Mooncake Transfer Engine: "
            "`pip install mooncake-transfer-engine-non-cuda` on CPU hosts (plus the system "
            "package libibverbs1), `mooncake-transfer-engine-npu` on Ascend, "
            f"`mooncake-transfer-engine` on CUDA hosts ({exc})") from exc
    return MooncakeEngine


class MooncakeTransfer(TransferEngine):
    name = "mooncake"

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp",
                 metadata_server: str = "P2PHANDSHAKE", device_name: str = ""):
        self._engine = _import_engine()()
        ret = self._engine.initialize(hostname, metadata_server, protocol, device_name)
        if ret != 0:
            raise TransferError(f"mooncake initialize({hostname!r}, {metadata_server!r}, "
                                f"{protocol!r}, {device_name!r}) returned {ret}")
        self._endpoint = f"{hostname}:{self._engine.get_rpc_port()}"
        self._regions: list[Region] = []

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, address: int, length: int) -> Region:
        if address <= 0 or length <= 0:
            raise ValueError(f"region ({address:#x}, {length}) must have address > 0 and length > 0")
        ret = self._engine.register_memory(address, length)
        if ret != 0:
            raise TransferError(f"mooncake register_memory({address:#x}, {length}) returned {ret}")
        region = Region(address, length)
        self._regions.append(region)
        return region

    def write(self, peer: str, batch: list[tuple[int, int, int]]) -> int:
        if any(length < 0 for _, _, length in batch):
            raise ValueError(f"negative length in write batch to {peer}")
        batch = [w for w in batch if w[2]]
        if not batch:
            return 0
        local, remote, lengths = (list(col) for col in zip(*batch))
        ret = self._engine.batch_transfer_sync_write(peer, local, remote, lengths)
        if ret != 0:
            raise TransferError(f"mooncake write of {len(batch)} ranges ({sum(lengths)} bytes) "
                                f"to {peer} failed with {ret} (peer unreachable, range not "
                                "registered there, or timeout)")
        return sum(lengths)

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        for region in self._regions:
            engine.unregister_memory(region.address)
        self._regions.clear()
