"""What a prefill, decode or `both` node runs besides its servicer: the engine, the KV
cache registered with the transfer engine, and membership (a NodeRegistration: stay
registered and report the node's load every TTL/3, with the meta-server or in etcd).

At tensor_parallel_size > 1 every rank has its own transfer engine and registration (the
workers make theirs with node_transfer); NodeInfo.kv_ranks lists them, rank 0 first.

Lifecycle: await EngineNode.create(...) loads the model (on a worker thread) and registers the KV cache -> start(address)
begins membership -> close() leaves the mesh, stops the engine and the transfer engine.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from common.config import MeshConfig, NodeConfig
from common.engine.async_engine import AsyncEngine
from common.engine.llm_engine import LLMEngine
from common.parallel import check_role
from common.parallel.rank_writes import RankWriters, WorkerSender
from common.parallel.shard import plan_shard
from common.transfer.base import TransferEngine
from common.transfer.kv_writes import KVSender
from common.kv_layout import KVLayout
from common.transfer.factory import create_transfer
from protos.pdmesh.v1 import common_pb2, engine_pb2
from services.node import grpc_util
from services.kv_store.client import KVStoreClient
from services.kv_store.rank_clients import RankStoreClients
from services.node.metrics import NodeMetrics
from services.node.node_registration import NodeRegistration, create_registration
from services.prefill.kv_destination import Staging, StagingPool

log = logging.getLogger("pdmesh.node")

STAGING_MAX_BYTES = 256 << 20    # a TP > 1 prefill node's staging blocks (kv_destination.StagingPool)


def transfer_options(mesh: MeshConfig, advertised_host: str) -> dict:
    """Backend keyword arguments for a service advertised at advertised_host (an empty
    transfer.hostname means that host); every call ends within timeouts.transfer_s. The
    `grpc` backend's receiver is a gRPC port: PlaintextBindError when it would bind a
    non-loopback host without TLS or security.allow_plaintext (bind_policy.py)."""
    t = mesh.transfer
    hostname = t.hostname or advertised_host
    timeout_s = mesh.timeouts.transfer_s
    if t.backend == "mooncake":
        return dict(hostname=hostname, protocol=t.protocol, metadata_server=t.metadata_server,
                    device_name=t.device_name, timeout_s=timeout_s)
    if t.backend == "grpc":
        from services.security.bind_policy import check_bind
        security = grpc_transfer_security()
        check_bind(hostname, 0, security["server_credentials"] is not None, mesh.security.allow_plaintext,
                   "transfer (grpc backend)")
        return dict(host=hostname, timeout_s=timeout_s, **security)
    return {}


def grpc_transfer_security(credentials=None) -> dict:
    """The `grpc` transfer backend's receiver admits only the mesh (as every gRPC server
    does) and its writer dials with the mesh's identity."""
    from services.security.client_auth import mesh_channel
    from services.security.credentials import process_credentials
    from services.security.server_auth import SyncAuthInterceptor
    creds = credentials or process_credentials()
    server_credentials = None
    if creds.tls is not None:
        server_credentials = grpc.ssl_server_credentials([(creds.tls.key, creds.tls.cert)],
                                                         root_certificates=creds.tls.ca, require_client_auth=True)
    from services.node.malformed_requests import SyncMalformedRequestInterceptor
    return dict(interceptors=(SyncAuthInterceptor(creds, tls_peers=creds.tls is not None),
                              SyncMalformedRequestInterceptor()),
                server_credentials=server_credentials,
                channel_factory=lambda peer, options: mesh_channel(peer, creds, options=options, sync=True))


def node_transfer(mesh: MeshConfig, advertised_host: str) -> TransferEngine:
    """A new transfer engine of the mesh's backend for a service advertised at
    advertised_host (a module function, so that tensor-parallel workers can be handed it)."""
    return create_transfer(mesh.transfer.backend, **transfer_options(mesh, advertised_host))


class NodeBytes:
    """KV bytes every rank of a node moved: rank 0's transfer engine and, at TP > 1, its
    workers' (what they reported to rank 0's RankWriters)."""

    def __init__(self, transfer: TransferEngine, writers: RankWriters | None):
        self.transfer, self.writers = transfer, writers

    @property
    def bytes_written(self) -> int:
        """Acknowledged by the peers."""
        return self.transfer.bytes_written + (self.writers.bytes_written if self.writers else 0)

    @property
    def bytes_read(self) -> int:
        return self.transfer.bytes_read + (self.writers.bytes_read if self.writers else 0)


def load_engine(mesh: MeshConfig, node: NodeConfig) -> tuple[TransferEngine, LLMEngine]:
    """The node's transfer engine (first: a loader reads a weight seed with it) and its
    engine, weights from the disk or a peer (engine.load_format)."""
    engine_config = mesh.engine_config(node)
    tp_size = engine_config.tensor_parallel_size
    check_role(node.role, tp_size, mesh.transfer.backend)
    transfer = node_transfer(mesh, node.advertised_host)
    try:
        # at TP > 1 each worker rank has its own transfer engine and KV registration
        return transfer, LLMEngine(engine_config, rank_transfer=(
            functools.partial(node_transfer, mesh, node.advertised_host) if tp_size > 1 else None),
            **weight_options(mesh, node, engine_config, transfer))
    except BaseException:
        transfer.close()
        raise


def weight_options(mesh: MeshConfig, node: NodeConfig, engine_config, transfer: TransferEngine) -> dict:
    """LLMEngine's weights, rank_weights and keep_weights for this node: every rank reads its
    own weights from the same rank of a seed (engine.load_format) and keeps them to serve
    (engine.weight_seed)."""
    from services.security.credentials import process_credentials
    tp = engine_config.tensor_parallel_size
    # a worker rank calls the meta-server and seeds as a mesh member: the mesh's identity only
    credentials = dataclasses.replace(process_credentials(), admin_token=None, api_keys=())
    return dict(weights=rank_weight_source(mesh, node.node_id, engine_config, credentials, transfer, 0),
                rank_weights=functools.partial(rank_weight_source, mesh, node.node_id, engine_config, credentials)
                if tp > 1 else None,
                keep_weights=engine_config.weight_seed)


def rank_weight_source(mesh: MeshConfig, node_id: str, engine_config, credentials, transfer, rank: int):
    """Rank `rank`'s WeightSource (a module function: TP workers are handed it with their
    own transfer engine)."""
    from common.runner.weight_source import DiskWeights
    disk = DiskWeights(engine_config.model, engine_config.weight_bucket_bytes)
    if engine_config.load_format == "peer" and transfer is None:
        raise ValueError("engine.load_format peer needs a transfer engine on every rank")
    if engine_config.load_format == "disk" or transfer is None:
        return disk
    from services.node.weight_loader import PeerWeights
    return PeerWeights(mesh, node_id, transfer, disk, strict=engine_config.load_format == "peer",
                       tensor_parallel_size=engine_config.tensor_parallel_size, rank=rank, credentials=credentials)


def _close_loaded(loading: asyncio.Future) -> None:
    if loading.cancelled() or loading.exception() is not None:
        return
    transfer, llm_engine = loading.result()
    llm_engine.close(graceful=False)
    transfer.close()


class EngineNode:
    @classmethod
    async def create(cls, mesh: MeshConfig, node: NodeConfig) -> "EngineNode":
        """The engine loads on a worker thread, so that the event loop keeps serving
        meanwhile (an in-process meta-server or weight seed answers the loader's calls;
        TP workers spawned from it are not armed with PR_SET_PDEATHSIG, their parent
        watch still ends them: common/parallel/worker.py). Cancelled while loading: what
        the load made is closed when it ends."""
        loading = asyncio.ensure_future(asyncio.to_thread(load_engine, mesh, node))
        try:
            transfer, llm_engine = await asyncio.shield(loading)
        except asyncio.CancelledError:
            loading.add_done_callback(_close_loaded)
            raise
        return cls(mesh, node, transfer, llm_engine)

    def __init__(self, mesh: MeshConfig, node: NodeConfig, transfer: TransferEngine, llm_engine: LLMEngine):
        """transfer, llm_engine: what load_engine made (EngineNode.create); the node owns
        them from here."""
        self.mesh, self.node = mesh, node
        engine_config = mesh.engine_config(node)
        self.transfer, self.llm_engine = transfer, llm_engine
        self.engine = AsyncEngine(self.llm_engine)
        tp = self.llm_engine.tp
        try:
            self.weight_seed = self._seed(engine_config)
            kv = self.llm_engine.kv_cache
            self.transfer.register(kv.data_ptr(), kv.numel() * kv.element_size())
            self.layout = KVLayout.of_cache(kv, self.llm_engine.kv_scales_id)
            self.kv_ranks = [common_pb2.KVRank(transfer_endpoint=self.transfer.endpoint,
                                               layout=self.layout.to_proto())]
            self.kv_ranks += [common_pb2.KVRank.FromString(raw) for raw in (tp.kv_ranks if tp is not None else ())]
            self.rank_layouts = [KVLayout.from_proto(r.layout) for r in self.kv_ranks]
            # a latent (MLA) cache is whole on every rank: its pushes never stage (kv_destination.py)
            staged = tp is not None and node.role == "prefill" and not self.layout.is_latent
            self.staging = self._staging() if staged else None
        except BaseException:   # no step thread or rank left behind by a node that did not start
            self.llm_engine.close(graceful=self.engine.shutdown())
            self.transfer.close()
            raise
        self.sender = KVSender(self.transfer, self.layout)
        self.rank_writers = tp.writers if tp is not None else None
        # threads for KV moves: at TP > 1 a kv-store transfer holds one per rank
        self.executor = ThreadPoolExecutor(max_workers=4 * engine_config.tensor_parallel_size,
                                           thread_name_prefix=f"{node.node_id}-kv")
        self.kv_store: KVStoreClient | RankStoreClients | None = None
        if mesh.kv_store is not None and node.role == "prefill":
            self.kv_store = self._store_client(mesh.kv_store.address)
        self.address = ""
        self.registration: NodeRegistration | None = None
        self.stalled = False        # set by NodeHealth: reported in load.stalled
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.peer_limits = grpc_util.PeerLimits(grpc_util.MAX_CALLS_PER_PEER)   # calls to peer nodes
        self.moved = NodeBytes(self.transfer, self.rank_writers)
        self.metrics = NodeMetrics(node.node_id, self.engine.snapshot, self.moved,   # served by the node server
                                   expert_tokens=self.engine.expert_tokens,
                                   weights=(self.weights_loaded, self.weight_seed))

    def _seed(self, engine_config):
        """The WeightSeed service of a node whose every rank keeps its weights, else None."""
        loaded = self.llm_engine.loaded_weights
        tp = self.llm_engine.tp
        others = tp.weight_ranks if tp is not None else []
        if loaded.pool is None or not all(others) or (tp is not None and tp.writers is None):
            loaded.pool = None     # a node serves all its ranks or none: rank 0's pool is not kept for nothing
            return None
        from common.runner.served_weights import RankPool
        from protos.pdmesh.v1 import weights_pb2
        from services.node.weight_seed import WeightSeedService
        ranks = [RankPool(0, self.transfer, loaded.pool)]
        if tp is not None:
            from common.parallel.rank_weights import WorkerRankPool
            ranks += [WorkerRankPool(r, tp.writers, weights_pb2.RankWeights.FromString(raw))
                      for r, raw in enumerate(others, start=1)]
        return WeightSeedService(self.node.node_id, self.llm_engine.weights_identity, ranks,
                                 engine_config.max_weight_clients, self.mesh.timeouts.weight_lease_s)

    def weights_loaded(self) -> tuple[str, str, int, float]:
        """(source, seed, bytes, seconds) of every rank's weights: "disk" or "peer" when
        all ranks agree, else "mixed"; the seed when all read the same one; the slowest
        rank's seconds."""
        first = self.llm_engine.loaded_weights
        ranks = [dict(source=first.source, seed=first.seed, nbytes=first.nbytes, seconds=first.seconds)]
        ranks += self.llm_engine.tp.loaded if self.llm_engine.tp is not None else []
        sources, seeds = {r["source"] for r in ranks}, {r["seed"] for r in ranks}
        return (sources.pop() if len(sources) == 1 else "mixed", seeds.pop() if len(seeds) == 1 else "",
                sum(r["nbytes"] for r in ranks), max(r["seconds"] for r in ranks))

    def _store_client(self, address: str) -> KVStoreClient | RankStoreClients:
        """The kv-store handle: at TP > 1 one client per rank, each storing that rank's
        heads in its own key space (rank_clients.py)."""
        model_id, timeouts = self.llm_engine.model_id, self.mesh.timeouts
        if self.rank_writers is None:
            return KVStoreClient(address, model_id, self.layout, self.sender, self.executor, timeouts)
        size = len(self.rank_layouts)
        engine = self.llm_engine
        offsets = [plan_shard(engine.model_config, size, r, engine.config.enable_expert_parallel).kv_head_start
                   for r in range(size)]
        senders = [self.sender] + [WorkerSender(self.rank_writers, r) for r in range(1, size)]
        return RankStoreClients([KVStoreClient(address, model_id, layout, sender, self.executor, timeouts,
                                               head_offset=offset, transfer_backend=self.transfer.name)
                                 for layout, sender, offset in zip(self.rank_layouts, senders, offsets)])

    def _staging(self) -> Staging:
        """Registered staging blocks holding every KV head, for pushes into decode nodes of
        a smaller TP size (kv_destination.StagedWrites): two full prefill chunks, cut to
        STAGING_MAX_BYTES but never below one chunk."""
        kv = self.llm_engine.kv_cache
        L, _, _, bs, heads, dim = kv.shape
        heads *= len(self.kv_ranks)
        per_block = L * 2 * bs * heads * dim * kv.element_size()
        chunk_blocks = -(-self.llm_engine.config.max_num_batched_tokens // bs) + 1
        num_blocks = max(chunk_blocks, min(STAGING_MAX_BYTES // per_block, 2 * chunk_blocks))
        buffer = torch.zeros(num_blocks * per_block // kv.element_size(), dtype=kv.dtype, device=kv.device)
        self.transfer.register(buffer.data_ptr(), buffer.numel() * buffer.element_size())
        tp = self.llm_engine.tp
        device = kv.device
        return Staging(StagingPool(buffer, L, num_blocks, bs, heads, dim),
                       gather=lambda ids: tp.gather_kv(kv, ids),
                       sender_for=lambda cache: KVSender(self.transfer, KVLayout.of_tensor(
                           cache, self.llm_engine.kv_scales_id)),
                       sync=None if device.type == "cpu" else (lambda: torch.accelerator.synchronize(device)))

    def node_info(self) -> common_pb2.NodeInfo:
        stats = self.engine.snapshot()
        return common_pb2.NodeInfo(
            node_id=self.node.node_id, role=self.node.role, address=self.address,
            model_id=self.engine.model_id, transfer_backend=self.transfer.name,
            transfer_endpoint=self.transfer.endpoint, kv_layout=self.layout.to_proto(),
            load=self.load(stats), max_model_len=self.engine.max_model_len,
            transfer_listen_addresses=self.listen_addresses(),
            tensor_parallel_size=self.llm_engine.config.tensor_parallel_size,
            kv_ranks=self.kv_ranks if len(self.kv_ranks) > 1 else (),
            weight_seed=self.weight_seed.info() if self.weight_seed is not None else None)

    def listen_addresses(self) -> list[str]:
        """What the transfer listeners of every rank of this node admit, rank 0's first."""
        own = list(self.transfer.listen_addresses)
        return own + [a for r in self.kv_ranks[1:] for a in r.listen_addresses if a not in own]

    def load(self, stats: dict[str, int]) -> common_pb2.NodeLoad:
        return common_pb2.NodeLoad(running=stats["running"] + stats["kv_remote"],
                                   waiting=stats["waiting"], free_blocks=stats["free_blocks"],
                                   total_blocks=stats["total_blocks"], stalled=self.stalled,
                                   cached_blocks=stats["cached_blocks"],
                                   quarantined_blocks=stats["quarantined_blocks"],
                                   transfer_bytes_written=self.moved.bytes_written)

    async def engine_stats(self, pending_transfers: int = 0) -> engine_pb2.EngineStats:
        s = await self.engine.stats()
        return engine_pb2.EngineStats(
            node_id=self.node.node_id, running=s["running"], waiting=s["waiting"],
            used_blocks=s["used_blocks"], free_blocks=s["free_blocks"],
            total_blocks=s["total_blocks"], pending_transfers=pending_transfers,
            prefix_hit_tokens=s["prefix_hit_tokens"], preemptions=s["preemptions"],
            quarantined_blocks=s["quarantined_blocks"], kv_remote=s["kv_remote"], held=s["held"],
            transfer_bytes_written=self.moved.bytes_written, transfer_bytes_read=self.moved.bytes_read,
            rank_bytes_written=self.rank_writers.bytes_written if self.rank_writers else 0,
            kv_blocks_staged=self.staging.pool.num_staged if self.staging else 0,
            rank_bytes_read=self.rank_writers.bytes_read if self.rank_writers else 0,
            borrowed_core_steps=s["borrowed_core_steps"],
            **dict(zip(("weights_source", "weights_seed", "weights_bytes", "weights_load_seconds"),
                       self.weights_loaded())),
            weight_leases_granted=self.weight_seed.leases_granted if self.weight_seed is not None else 0)


    def channel(self, address: str) -> grpc.aio.Channel:
        """A long-lived channel to a peer node (connections are reused across requests)."""
        if address not in self._channels:
            self._channels[address] = grpc_util.channel(address)
        return self._channels[address]

    # ---- membership ---------------------------------------------------------------
    def start(self, address: str) -> None:
        """Join the mesh as `address` (in a task of the running loop)."""
        self.address = address
        # expert counts go to the meta-server beside the heartbeat, never inside the NodeInfo
        self.registration = create_registration(self.mesh, self.node_info, self.engine.expert_tokens)
        self.registration.start()

    async def close(self) -> None:
        if self.registration is not None:
            await self.registration.close()
        if self.weight_seed is not None:
            await self.weight_seed.close()
        for ch in self._channels.values():
            await ch.close()
        if self.kv_store is not None:
            await self.kv_store.close()
        stepped_out = self.engine.shutdown()
        # its tensor-parallel ranks: the stop message is a collective, sent only once no
        # step can run beside it (else they are killed)
        self.llm_engine.close(graceful=stepped_out)
        self.executor.shutdown(wait=True)
        self.transfer.close()
