"""The JSON behind the KV-memory dashboard (GET /api/cluster) and `pdmesh top`.

    view = ClusterView(control, kv_store_address)      # one per meta-server
    doc = await view.snapshot()                        # a dict, json.dumps-able
    await view.close()

What it holds (every value as the meta-server last heard it: a node's load is its last
heartbeat's, up to TTL/3 old):

    {"time": unix seconds, "policy": str, "leader": bool,
     "nodes": [{"node_id", "role", "state" (up | draining | down), "address", "model_id",
                "seconds_since_heartbeat", "num_routed",
                "load": {"running", "waiting", "stalled"},
                "blocks": {"total", "used", "cached", "free", "quarantined"},
                "transfer_bytes_written", "transfer_bytes_per_s",
                "experts": {"layers": [int], "num_tokens": [[int]]}}, ...],   # role, id order;
                                                         # "experts": MoE nodes only
     "totals": {"total", "used", "cached", "free", "quarantined"},         # over up/draining nodes
     "router": {"num_routed", "num_local_prefill", "num_query_blocks", "num_hit_blocks",
                "prefix_hit_rate"},        # predicted hits on the prefilling node (PrefixIndex)
     "transfer_bytes_per_s": float,        # sum over nodes
     "kv_store": null | {"address", "reachable", ...StatsResponse fields}}

Block segments of a node add up to its total:
    ┌──── used ────┬ quarantined ┬── cached ──┬──── free ────┐
    held by requests  held until   free, still   free, no
    (not quarantined) writers done a prefix hit  content
i.e. used = used_blocks - quarantined, cached = cached_blocks, free = free_blocks - cached.

Expert load (a Mixture-of-Experts node): num_tokens[i][e] is how many tokens the router
of MoE layer layers[i] sent to expert e since the node started, as last reported
(NodeStatus.expert_tokens: the registry keeps them beside the member, from heartbeats or
the node's expert-tokens key in etcd; never part of the NodeInfo); the page and
`pdmesh top` show each as a share of its layer's sum.

Transfer rates are the difference of a node's transfer_bytes_written between its last
two heartbeats seen, over their time apart (0 until two were seen; a restarted node's
counter going down counts as 0). The kv-store's Stats is asked with a short deadline; when it does not
answer, "reachable" is false and the rest is absent. Without a kv-store address (the
meta-server was started without one) "kv_store" is null.

Thread-safety: the meta-server's event loop only (snapshot mutates the rate samples).
"""
from __future__ import annotations

import time

import grpc
from google.protobuf import json_format

from protos.pdmesh.v1 import kv_store_pb2, kv_store_pb2_grpc
from services.meta_server.control import MetaControl, NodeStatus

SEGMENTS = ("used", "quarantined", "cached", "free")


def node_blocks(load) -> dict[str, int]:
    """A NodeLoad's blocks as the dashboard's segments (they add up to total)."""
    total, free = load.total_blocks, load.free_blocks
    cached = min(load.cached_blocks, free)
    held = max(total - free, 0)
    quarantined = min(load.quarantined_blocks, held)
    return {"total": total, "used": held - quarantined, "quarantined": quarantined,
            "cached": cached, "free": free - cached}


def expert_entry(expert_tokens: dict[int, list[int]]) -> dict:
    """A node's expert counts as its entry's "experts" (layers in the order reported)."""
    return {"layers": list(expert_tokens), "num_tokens": [list(row) for row in expert_tokens.values()]}


def node_entry(status: NodeStatus, bytes_per_s: float = 0.0) -> dict:
    info, load = status.info, status.info.load
    entry = {"node_id": info.node_id, "role": info.role, "state": status.state, "address": info.address,
             "model_id": info.model_id, "seconds_since_heartbeat": round(status.seconds_since_heartbeat, 3),
             "num_routed": status.num_routed,
             "load": {"running": load.running, "waiting": load.waiting, "stalled": load.stalled},
             "blocks": node_blocks(load), "transfer_bytes_written": load.transfer_bytes_written,
             "transfer_bytes_per_s": round(bytes_per_s, 1)}
    if status.expert_tokens:
        entry["experts"] = expert_entry(status.expert_tokens)
    return entry


def router_entry(router) -> dict:
    queries, hits = router.num_query_blocks, router.num_hit_blocks
    return {"num_routed": router.num_routed, "num_local_prefill": router.num_local_prefill,
            "num_query_blocks": queries, "num_hit_blocks": hits,
            "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0}


def build_cluster(statuses: list[NodeStatus], router, policy: str, leader: bool, now: float,
                  rates: dict[str, float] | None = None, kv_store: dict | None = None) -> dict:
    """The /api/cluster document from plain inputs (pure; unit-tested with exact values).
    rates: node_id -> transfer bytes/s; kv_store: the "kv_store" entry (None = no store)."""
    rates = rates or {}
    nodes = [node_entry(s, rates.get(s.info.node_id, 0.0)) for s in statuses]
    totals = dict.fromkeys(("total", *SEGMENTS), 0)
    for n in nodes:
        if n["state"] != "down":
            for key in totals:
                totals[key] += n["blocks"][key]
    return {"time": round(now, 3), "policy": policy, "leader": leader, "nodes": nodes, "totals": totals,
            "router": router_entry(router),
            "transfer_bytes_per_s": round(sum(n["transfer_bytes_per_s"] for n in nodes), 1),
            "kv_store": kv_store}


class ClusterView:
    def __init__(self, control: MetaControl, kv_store_address: str = "", timeout_s: float = 0.5,
                 clock=time.time):
        self.control, self.kv_store_address, self.timeout_s, self.clock = control, kv_store_address, timeout_s, clock
        self._samples: dict[str, tuple] = {}   # node_id -> (previous, last) (heartbeat time, bytes)
        self._channel = self._stub = None
        if kv_store_address:
            from services.node import grpc_util
            self._channel = grpc_util.channel(kv_store_address)
            self._stub = kv_store_pb2_grpc.KVStoreStub(self._channel)

    def _rates(self, statuses: list[NodeStatus], now: float) -> dict[str, float]:
        """Bytes/s between a node's last two heartbeats (a sample per heartbeat, not per
        snapshot, so a page and `pdmesh top` polling at once see the same rate)."""
        rates = {}
        for s in statuses:
            node_id, written = s.info.node_id, s.info.load.transfer_bytes_written
            beat = now - s.seconds_since_heartbeat
            prev, cur = self._samples.get(node_id, (None, None))
            if cur is None or beat - cur[0] > 0.05:
                prev, cur = cur, (beat, written)
                self._samples[node_id] = (prev, cur)
            if prev is not None and cur[0] > prev[0]:
                rates[node_id] = max(cur[1] - prev[1], 0) / (cur[0] - prev[0])
        return rates

    async def kv_store_entry(self) -> dict | None:
        if self._stub is None:
            return None
        try:
            reply = await self._stub.Stats(kv_store_pb2.StatsRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            return {"address": self.kv_store_address, "reachable": False, "error": e.code().name}
        stats = json_format.MessageToDict(reply, preserving_proto_field_name=True,
                                          always_print_fields_with_no_presence=True)
        for key, value in stats.items():      # int64 fields come as strings in proto JSON
            if isinstance(value, str) and value.lstrip("-").isdigit():
                stats[key] = int(value)
        return {"address": self.kv_store_address, "reachable": True, **stats}

    async def snapshot(self) -> dict:
        c = self.control
        statuses = c.list_nodes()
        now = self.clock()
        return build_cluster(statuses, c.router, c.policy(), c.standby_reason() is None, now,
                             self._rates(statuses, now), await self.kv_store_entry())

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
