"""The meta-server's Prometheus metrics, read from its MetaControl at scrape time
(common/metrics.py serves them on meta_server.metrics_port, on the event loop):
  routed_total{node, role, policy}   requests routed to the node (decode and prefill
                                     picks alike) under that policy
  route_decisions_total              Route answers (one per attempt of a request)
  local_prefill_total                of those, prefilled on the decode node itself
  nodes{role, state}                 members by state: up | draining | down
  meta_leader                        1 while this meta-server may route (the leader, or
                                     the only one), else 0
"""
from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.metrics import name


class MetaCollector:
    def __init__(self, control):
        self.control = control

    def collect(self):
        c = self.control
        routed = CounterMetricFamily(name("routed"), "Requests routed to a node, by policy.",
                                     labels=["node", "role", "policy"])
        for (node_id, role, policy), n in sorted(c.routed_total.items()):
            routed.add_metric([node_id, role, policy], n)
        yield routed
        yield CounterMetricFamily(name("route_decisions"), "Route answers.", value=c.router.num_routed)
        yield CounterMetricFamily(name("local_prefill"), "Routes that prefill on the decode node.",
                                  value=c.router.num_local_prefill)
        nodes = GaugeMetricFamily(name("nodes"), "Members by role and state.", labels=["role", "state"])
        for (role, state), n in sorted(Counter((s.info.role, s.state) for s in c.list_nodes()).items()):
            nodes.add_metric([role, state], n)
        yield nodes
        yield GaugeMetricFamily(name("meta_leader"), "1 while this meta-server routes.",
                                value=1 if c.standby_reason() is None else 0)


def meta_registry(control) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(MetaCollector(control))
    return registry
