"""`mooncake` backend: the Mooncake Transfer Engine, one-sided writes into and reads out of a
peer's registered memory.

Configuration only, same code everywhere:
- CPU hosts: `pip install mooncake-transfer-engine-non-cuda` (its engine.so also needs the
  system's libibverbs.so.1, Debian package `libibverbs1`), protocol "tcp".
- RoCE / InfiniBand: protocol "rdma", `device_name` selects the NIC (e.g. "mlx5_0", or a
  comma-separated list), `hostname` is this node's address on that network.
- Ascend: the `mooncake-transfer-engine-npu` package, protocol "ascend" (HCCS / RoCE between
  NPUs); device memory is registered the same way.
`metadata_server` "P2PHANDSHAKE" needs no extra service (a peer is addressed as
host:rpc_port); "etcd://host:port", "redis://..." or "http://..." select a metadata store.

Environment variables of the engine, read when it starts: MC_TCP_SLICE_SIZE (the asio
buffer per socket operation, default 64 KiB), MC_TCP_LANES_PER_PEER (connections per peer,
default 4). Neither changes the loopback bandwidth beyond the noise: asio issues at most
64 KiB per send/recv whatever the slice, and that syscall size is what bounds the tcp
protocol (docs/benchmarks.md, "KV transfer").

How a write or read runs: each range is submitted as its own transfer, at most
`max_inflight` at once (writes: `transfer_submit_write`; reads: `batch_transfer_async` of one
range with opcode Read, as the binding has no `transfer_submit_read`; its
`batch_transfer_async_read` + `get_batch_transfer_status` crash the process). The TCP
transport refuses a peer's transfers beyond
MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER + MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER (1024 each),
so one `batch_transfer_sync_write` of ~2,100+ ranges fails outright (the bench model's
4,096-token prompt pushed into scattered blocks is 4,096 ranges); keep max_inflight x
concurrent transfers to one peer under that too. Completion is polled with short sleeps: the
binding's `batch_transfer_sync_write` busy-waits on a core, which on a small host starves the
transport's own I/O thread (measured: ~20-50% slower on 2 cores). A transfer that fails or
passes its timeout (the call's `timeout_s`, else the engine's) raises TransferError after
its in-flight ranges have ended, waiting up to one more timeout for them; ranges still
pending after that are reported (`unsettled`): they may yet land.

The peer checks the remote range of a write or read against its registered memory (failing
that range fast); the local range is checked only by transports that need it registered
(rdma, not tcp: over tcp a read lands at any local address given).

Listeners: the engine binds its handshake port and its TCP data port to every interface
(0.0.0.0 / [::]) whatever `hostname` is, and no setting of it changes that. So right after
initialize, the listeners it opened get a socket filter that admits only connections
addressed to `hostname` (common/transfer/listen_guard.py): as if bound there. A filter the
kernel refuses is logged as an error and the listener stays open to every interface;
`listen_addresses` says which (docs/security-data-plane.md has the firewall rules).

Thread-safety: Mooncake's Python binding releases the GIL and guards its own state with a
mutex, and every range is its own engine batch, so `write` and `read` need no lock here.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

from common.transfer import listen_guard
from common.transfer.base import Region, TransferEngine, TransferError

log = logging.getLogger("pdmesh.transfer")
# One engine starts at a time in this process, so that the listeners opened meanwhile are its own.
_START_LOCK = threading.Lock()


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
                 metadata_server: str = "P2PHANDSHAKE", device_name: str = "",
                 max_inflight: int = 128, timeout_s: float = 30.0):
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.max_inflight = max_inflight
        self.timeout_s = timeout_s
        engine_cls = _import_engine()
        self._read_opcode = engine_cls.TransferOpcode.Read
        self._engine = engine_cls()
        with _START_LOCK:
            before = self._snapshot()
            ret = self._engine.initialize(hostname, metadata_server, protocol, device_name)
            if ret != 0:
                raise TransferError(f"mooncake initialize({hostname!r}, {metadata_server!r}, "
                                    f"{protocol!r}, {device_name!r}) returned {ret}")
            self._listeners = self._guard(before, hostname)
        self._endpoint = f"{hostname}:{self._engine.get_rpc_port()}"
        self._regions: list[Region] = []

    @staticmethod
    def _snapshot() -> dict[int, listen_guard.Listener] | None:
        try:
            return listen_guard.own_listeners()
        except OSError as e:
            log.error("mooncake: cannot list this process's sockets (%s): its listeners stay open to "
                      "every interface of this machine", e)
            return None

    def _guard(self, before, hostname: str) -> list[listen_guard.Listener]:
        """The listeners initialize opened, filtered to `hostname` where the kernel allows."""
        if before is None:
            return []
        try:
            opened = listen_guard.opened_since(before)
        except OSError as e:
            log.error("mooncake: cannot list this process's sockets (%s)", e)
            return []
        try:
            guarded = listen_guard.restrict(opened, hostname)
        except (OSError, ValueError) as e:
            log.error("mooncake: listeners %s stay open to every interface of this machine; could not "
                      "filter them to %s (%s): firewall them (docs/security-data-plane.md)",
                      [a for l in opened for a in l.addresses], hostname, e)
            return opened
        log.info("mooncake: listening at %s", ", ".join(a for l in guarded for a in l.addresses))
        return guarded

    @property
    def listen_addresses(self) -> tuple[str, ...]:
        """The handshake and TCP data listeners, "host:port" each (a wildcard host: open to
        every interface; the filter failed)."""
        return tuple(a for listener in self._listeners for a in listener.addresses)

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, address: int, length: int) -> Region:
        region = Region.checked(address, length)
        ret = self._engine.register_memory(address, length)
        if ret != 0:
            raise TransferError(f"mooncake register_memory({address:#x}, {length}) returned {ret}")
        self._regions.append(region)
        return region

    def unregister(self, region: Region) -> None:
        if region not in self._regions:
            raise ValueError(f"region ({region.address:#x}, {region.length}) is not registered")
        ret = self._engine.unregister_memory(region.address)
        self._regions.remove(region)
        if ret != 0:
            raise TransferError(f"mooncake unregister_memory({region.address:#x}) returned {ret}")

    def write(self, peer: str, batch: list[tuple[int, int, int]], timeout_s: float | None = None) -> int:
        return self._transfer("write", peer, batch, self._engine.transfer_submit_write, timeout_s)

    def read(self, peer: str, batch: list[tuple[int, int, int]], timeout_s: float | None = None) -> int:
        return self._transfer("read", peer, batch, self._submit_read, timeout_s)

    def _submit_read(self, peer: str, local: int, remote: int, length: int) -> int:
        return self._engine.batch_transfer_async(peer, [local], [remote], [length], self._read_opcode)

    def _transfer(self, op: str, peer: str, batch: list[tuple[int, int, int]], submit,
                  timeout_s: float | None) -> int:
        """Runs `submit(peer, local, remote, length) -> batch id (0: refused)` for every
        non-empty range, at most max_inflight pending, and waits for all of them."""
        if any(length < 0 for _, _, length in batch):
            raise ValueError(f"negative length in {op} batch with {peer}")
        batch = [w for w in batch if w[2]]
        total = sum(length for _, _, length in batch)
        timeout_s = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout_s
        pending: deque[int] = deque()
        delay = 2e-5
        try:
            for local, remote, length in batch:
                if len(pending) >= self.max_inflight:
                    delay = self._wait_first(op, peer, pending, deadline, delay)
                batch_id = submit(peer, local, remote, length)
                if not batch_id:
                    raise TransferError(f"mooncake {op} with {peer} refused at submit "
                                        "(peer unreachable or its metadata unknown)")
                pending.append(batch_id)
            while pending:
                delay = self._wait_first(op, peer, pending, deadline, delay)
        except TransferError as e:
            # ranges still pending may land: wait for each to end, with a grace of its own
            # (the deadline may have passed already); any still pending after it is unsettled
            if not self._drain(pending, time.monotonic() + timeout_s):
                raise TransferError(f"{e} ({len(pending)} range(s) still in flight)", unsettled=True) from None
            raise
        (self.count_written if op == "write" else self.count_read)(total)
        return total

    def _wait_first(self, op: str, peer: str, pending: deque[int], deadline: float,
                    delay: float) -> float:
        """Blocks until pending[0] completes and pops it, sleeping `delay` between polls,
        doubling up to 1 ms; returns the delay reached (the binding's own sync calls spin a
        core instead)."""
        while (status := self._engine.transfer_check_status(pending[0])) == 0:
            if time.monotonic() > deadline:
                raise TransferError(f"mooncake {op} with {peer} timed out")
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)
        pending.popleft()
        if status != 1:
            raise TransferError(f"mooncake {op} with {peer} failed with status {status} (peer gone, "
                                "range not registered there, or timeout)")
        return delay

    def _drain(self, pending: deque[int], deadline: float) -> bool:
        """Wait until every pending range has ended (True) or the deadline passed (False)."""
        while pending and time.monotonic() < deadline:
            if self._engine.transfer_check_status(pending[0]) != 0:
                pending.popleft()
            else:
                time.sleep(1e-3)
        return not pending

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        for region in self._regions:
            engine.unregister_memory(region.address)
        self._regions.clear()
