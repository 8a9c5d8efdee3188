"""A starting node's weights from a live peer (engine.load_format auto | peer): the
WeightSource that reads a weight seed's memory one-sided and checks every byte.

Lifecycle of one load (fill):
    seeds       the meta-server's live members whose NodeInfo.weight_seed has this rank's
                identity and tensor-parallel size and whose transfer backend is ours, in
                seed_order (loaders spread over the seeds); none reachable: the disk
    per seed    OpenWeights (a lease; the seed registers its weights) -> the manifest
                must lay out exactly this model's parameters (ManifestMismatch) -> an
                empty pool registered with our transfer engine -> each bucket read
                one-sided (bounded by timeouts.weight_read_s) while the previous one is
                checksummed on another thread; RenewWeights between reads every third of
                the lease -> every checksum equal -> the parameters become views of the
                pool -> CloseWeights; the pool is unregistered either way
    failure     a checksum mismatch, a seed that dies or stalls, a refusal, a manifest of
                another layout: the next seed, then the disk ("auto"), or a ValueError
                naming every seed tried ("peer"). One log line says where the weights
                came from and why. Nothing half-read is used: the parameters are bound
                only after every bucket verified.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time

import grpc
import torch

from common.model.weight_pool import ManifestMismatch, Manifest, WeightPool
from common.runner.weight_source import DiskWeights, LoadedWeights, parameter_bytes
from common.transfer.base import TransferEngine, TransferError
from protos.pdmesh.v1 import common_pb2, meta_pb2, meta_pb2_grpc, weights_pb2, weights_pb2_grpc

log = logging.getLogger("pdmesh.node")


def seed_order(loader_id: str, seeds: list[common_pb2.NodeInfo]) -> list[common_pb2.NodeInfo]:
    """The order a loader tries seeds in: by a hash of (loader, seed) (rendezvous hashing),
    so that loaders starting together spread over the seeds, and one loader's order is
    the same at every attempt."""
    def rank(seed: common_pb2.NodeInfo) -> bytes:
        return hashlib.blake2b(f"{loader_id}\0{seed.node_id}".encode(), digest_size=8).digest()
    return sorted(seeds, key=rank)


class PeerLoadError(RuntimeError):
    """One seed could not serve this load (why, for the log line)."""


class PeerWeights:
    def __init__(self, mesh, node_id: str, transfer: TransferEngine, disk: DiskWeights, strict: bool,
                 tensor_parallel_size: int = 1, rank: int = 0, credentials=None):
        """disk: the fallback ("auto"; strict: "peer", none)."""
        self.mesh, self.node_id, self.transfer = mesh, node_id, transfer
        self.disk, self.strict = disk, strict
        self.tp_size, self.rank = tensor_parallel_size, rank
        self.credentials = credentials
        self.timeouts = mesh.timeouts

    def _channel(self, address: str):
        from services.security.client_auth import mesh_channel
        return mesh_channel(address, self.credentials, sync=True)

    def seeds(self, identity: str) -> list[common_pb2.NodeInfo]:
        """Live seeds of this identity and TP size on our transfer backend, shuffled; []
        when no meta-server answers (the disk then)."""
        addresses = list(self.mesh.gateway.meta_addresses) or [self.mesh.meta.address]
        for address in addresses:
            channel = self._channel(address)
            try:
                reply = meta_pb2_grpc.MetaServerStub(channel).ListMembers(
                    meta_pb2.ListMembersRequest(), timeout=self.timeouts.weight_call_s)
            except grpc.RpcError as e:
                log.info("weights: meta-server %s did not list the mesh (%s)", address, e.code().name)
                continue
            finally:
                channel.close()
            return seed_order(self.node_id, [
                n for n in reply.nodes if n.weight_seed.identity == identity
                and max(n.weight_seed.tensor_parallel_size, 1) == self.tp_size
                and n.transfer_backend == self.transfer.name and n.node_id != self.node_id])
        return []

    def fill(self, model: torch.nn.Module, identity: str, keep_pool: bool) -> LoadedWeights:
        start = time.perf_counter()
        seeds = self.seeds(identity)
        tried: list[str] = []
        for seed in seeds:
            try:
                pool = self._read(seed, model, identity)
            except (PeerLoadError, ManifestMismatch, TransferError) as e:
                tried.append(f"{seed.node_id}: {e}")
                continue
            except grpc.RpcError as e:
                tried.append(f"{seed.node_id}: {e.code().name} {e.details() or ''}".rstrip())
                continue
            pool.bind(model)
            seconds = time.perf_counter() - start
            log.info("weights: %.1f MB from seed %s in %.2fs (%.0f MB/s), every bucket's checksum equal%s",
                     pool.nbytes / 1e6, seed.node_id, seconds, pool.nbytes / 1e6 / max(seconds, 1e-9),
                     f" (after {'; '.join(tried)})" if tried else "")
            return LoadedWeights("peer", seconds, parameter_bytes(model), pool if keep_pool else None,
                                 seed=seed.node_id, tried=tried)
        why = "; ".join(tried) if tried else "no live weight seed of this model identity and sharding in the mesh"
        if self.strict:
            raise ValueError(f"engine.load_format is peer but no weight seed could serve {self.node_id}: {why}")
        log.info("weights: from the disk (%s)", why)
        loaded = self.disk.fill(model, identity, keep_pool)
        loaded.tried = tried
        return loaded

    def _read(self, seed: common_pb2.NodeInfo, model: torch.nn.Module, identity: str) -> WeightPool:
        """The seed's pool for our rank, every bucket verified; raises on any failure."""
        t = self.timeouts
        channel = self._channel(seed.address)
        stub = weights_pb2_grpc.WeightSeedStub(channel)
        try:
            opened = time.monotonic()    # the seed's lease runs from its answer: renew by this clock
            reply = stub.OpenWeights(weights_pb2.OpenWeightsRequest(
                identity=identity, tensor_parallel_size=self.tp_size, loader_node_id=self.node_id),
                timeout=t.weight_call_s)
            lease = weights_pb2.WeightLease(lease_id=reply.lease_id)
            try:
                if len(reply.ranks) != self.tp_size:
                    raise PeerLoadError(f"answered {len(reply.ranks)} ranks, expected {self.tp_size}")
                rank = reply.ranks[self.rank]
                pool = WeightPool.for_manifest(model, Manifest.from_proto(rank.manifest))
                renewal = Renewal(lambda: stub.RenewWeights(lease, timeout=t.weight_call_s), reply.lease_s, opened)
                self.pull(pool, rank.transfer_endpoint, rank.base_address, renewal)
                return pool
            finally:
                try:
                    stub.CloseWeights(lease, timeout=t.weight_call_s)
                except grpc.RpcError:
                    pass    # the lease lapses by itself
        finally:
            channel.close()

    def pull(self, pool: WeightPool, endpoint: str, base_address: int, renewal: "Renewal | None" = None) -> None:
        """Every bucket of the seed's pool at (endpoint, base_address) into pool, then
        checked: PeerLoadError naming the buckets whose checksums differ; TransferError
        when a read failed. The pool is registered with our transfer engine only while
        the reads run, and checked only after it is unregistered (a peer could write into
        it while it is registered). A read that gave up with ranges still in flight
        (unsettled) may yet land: the pool is then kept, registered, for the life of the
        process, and never used."""
        region = self.transfer.register(pool.address, pool.nbytes)
        faulted = None
        try:
            faulted = Prefault(pool)
            for i in range(pool.manifest.num_buckets):
                if i == 1:
                    _wait_at_gate()
                if renewal is not None:
                    renewal.due()
                faulted.wait(i)
                offset, length = pool.manifest.bucket_range(i)
                self.transfer.read(endpoint, [(pool.address + offset, base_address + offset, length)],
                                   timeout_s=self.timeouts.weight_read_s)
        except TransferError as e:
            faulted.stop()          # set: only a read raises TransferError
            if e.unsettled:
                _QUARANTINED.append((pool, region))
                log.error("weights: a read from %s gave up with bytes in flight: its %.1f MB buffer stays allocated "
                          "and registered, unused, until this process ends", endpoint, pool.nbytes / 1e6)
                raise
            self.transfer.unregister(region)
            raise
        except BaseException:
            if faulted is not None:
                faulted.stop()
            self.transfer.unregister(region)
            raise
        self.transfer.unregister(region)
        bad = pool.failed_buckets()
        if bad:
            raise PeerLoadError(f"checksum mismatch in bucket(s) {bad[:5]} of {pool.manifest.num_buckets}")


class Prefault:
    """Writes a zero into every page of each bucket of a fresh pool, in order, on a thread
    of its own; the reader waits for a bucket's pages before reading into it. A fresh
    buffer's page faults then run beside the reads instead of inside the transfer's
    copies (1.1 GB from a peer here: 0.85 -> 1.2 GB/s). Never touches a bucket once its
    read may have begun."""

    PAGE = 4096

    def __init__(self, pool: WeightPool):
        self.pool = pool
        self.ready = [threading.Event() for _ in range(pool.manifest.num_buckets)]
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="weight-prefault", daemon=True).start()

    def _run(self) -> None:
        try:
            for i, ready in enumerate(self.ready):
                if self._stop.is_set():
                    return
                self.pool.bucket(i)[::self.PAGE].zero_()
                ready.set()
        finally:   # whatever happened, no reader waits forever (an unfaulted page only costs time)
            for ready in self.ready:
                ready.set()

    def wait(self, i: int) -> None:
        self.ready[i].wait()

    def stop(self) -> None:
        self._stop.set()


class Renewal:
    """Renews a seed's lease once a third of it has passed since the last renewal (or the
    open), between two bucket reads: timeouts.weight_lease_s is checked at load to outlast
    a third of itself plus one read's bound and one call."""

    def __init__(self, renew, lease_s: float, since: float):
        self.renew, self.lease_s, self.since = renew, lease_s, since

    def due(self) -> None:
        if time.monotonic() - self.since > self.lease_s / 3:
            started = time.monotonic()
            self.renew()
            self.since = started


# pools a read gave up on with bytes still in flight (PeerWeights.pull): kept alive and
# registered so that late bytes land in memory nobody uses
_QUARANTINED: list = []


GATE_ENV = "PDMESH_FAULT_WEIGHT_READ_GATE"
GATE_WAIT_S = 120.0


def _wait_at_gate() -> None:
    """Fault injection (tests; PDMESH_FAULT_INJECTION=1): with PDMESH_FAULT_WEIGHT_READ_GATE
    set to a path, a load holds after its first bucket until that file exists, so that a
    test can kill the seed mid-read."""
    gate = os.environ.get(GATE_ENV) if os.environ.get("PDMESH_FAULT_INJECTION") == "1" else None
    if not gate:
        return
    log.warning("fault injection: bucket 0 read; waiting for %s", gate)
    deadline = time.monotonic() + GATE_WAIT_S
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)
