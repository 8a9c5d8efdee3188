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
import time
from concurrent.futures import Future, ThreadPoolExecutor

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
            reply = stub.OpenWeights(weights_pb2.OpenWeightsRequest(
                identity=identity, tensor_parallel_size=self.tp_size, loader_node_id=self.node_id),
                timeout=t.weight_call_s)
            lease = weights_pb2.WeightLease(lease_id=reply.lease_id)
            try:
                if len(reply.ranks) != self.tp_size:
                    raise PeerLoadError(f"answered {len(reply.ranks)} ranks, expected {self.tp_size}")
                rank = reply.ranks[self.rank]
                pool = WeightPool.for_manifest(model, Manifest.from_proto(rank.manifest))
                self._pull(pool, rank, lambda: stub.RenewWeights(lease, timeout=t.weight_call_s), reply.lease_s)
                return pool
            finally:
                try:
                    stub.CloseWeights(lease, timeout=t.weight_call_s)
                except grpc.RpcError:
                    pass    # the lease lapses by itself
        finally:
            channel.close()

    def _pull(self, pool: WeightPool, rank: weights_pb2.RankWeights, renew, lease_s: float) -> None:
        buckets = pool.manifest.buckets()
        region = self.transfer.register(pool.address, pool.nbytes)
        renewed = time.monotonic()
        checks: list[Future] = []
        try:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-checksums") as hasher:
                for i, (offset, length) in enumerate(buckets):
                    if i == 1:
                        _wait_at_gate()
                    if time.monotonic() - renewed > lease_s / 3:
                        renew()
                        renewed = time.monotonic()
                    self.transfer.read(rank.transfer_endpoint, [(pool.address + offset, rank.base_address + offset,
                                                                 length)], timeout_s=self.timeouts.weight_read_s)
                    checks.append(hasher.submit(pool.verify, i))
                bad = [i for i, check in enumerate(checks) if not check.result()]
        finally:
            self.transfer.unregister(region)
        if bad:
            raise PeerLoadError(f"checksum mismatch in bucket(s) {bad[:5]} of {len(buckets)}")


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
