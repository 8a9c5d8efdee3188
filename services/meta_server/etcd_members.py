"""Membership from etcd: the meta-server's registry mirrors the node keys that nodes keep
on their etcd leases (common/cluster/etcd.py), instead of Register/Heartbeat RPCs.

A node key added -> registered (never expired by time: its lease is the liveness);
updated -> its load refreshed; removed (lease expired or revoked) -> marked down. While
etcd is unreachable the view keeps its last state, so routing goes on unchanged.
"""
from __future__ import annotations

import logging
import math

from common.cluster.base import ChangeKind, MemberChange
from protos.pdmesh.v1 import common_pb2

log = logging.getLogger("pdmesh.meta")


class EtcdMembers:
    def __init__(self, cluster, control):
        self.cluster, self.control = cluster, control
        self.view = cluster.member_view(on_change=self._on_change)

    async def start(self) -> None:
        await self.view.start()

    def _on_change(self, change: MemberChange) -> None:
        if change.kind == ChangeKind.REMOVED:
            if self.control.registry.mark_down(change.node_id):
                log.info("node %s left (etcd lease gone)", change.node_id)
            return
        info = common_pb2.NodeInfo.FromString(change.value)
        if not self.control.heartbeat(info.node_id, info.load):
            self.control.register(info, math.inf)
            log.info("node %s (%s) joined through etcd", info.node_id, info.role)

    async def close(self) -> None:
        await self.view.close()
