"""The meta-server's Prometheus metrics, read from its MetaControl at scrape time
(common/metrics.py serves them on meta_server.metrics_port, on the event loop):
  routed_total{node, role, policy}   requests routed to the node (decode and prefill
                                     picks alike) under that policy
  route_decisions_total              Route answers (one per attempt of a request)
  local_prefill_total                of those, prefilled on the decode node itself
  nodes{role, state}                 members by state: up | draining | down
  meta_leader                        1 while this meta-server may route (the leader, or
                                     the only one), else 0

With the planner on (meta_server.planner.enabled), its last decision (none before the
first: the families are then absent; docs/planner.md):
  planner_desired_nodes{role}        the nodes to run: what an autoscaler follows
  planner_wanted_nodes{role}         the formula's count, before limits and hysteresis
  planner_current_nodes{role}        live, undrained nodes at the decision
  planner_decisions_total            decisions made
  planner_request_rate               its inputs over the interval: requests/s that ended,
  planner_mean_prompt_tokens,        their mean prompt and output tokens,
  planner_mean_output_tokens
  planner_prefix_hit_rate            share of routed prompt tokens a cache held,
  planner_prefill_queue_tokens       prompt tokens waiting at prefill nodes,
  planner_decode_kv_usage            used / total KV blocks of the decode nodes,
  planner_observed_ttft_seconds,     mean TTFT and ITL the gateways saw (absent when no
  planner_observed_itl_seconds       request got a first token / a second token)
"""
from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.metrics import name
from services.meta_server.planner import ROLES


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
        yield from planner_families(c.planner)


PLANNER_INPUTS = (   # (metric, help, value of a PlannerInputs)
    ("planner_request_rate", "Client requests a second that ended in the planner's last interval.",
     lambda i: i.request_rate),
    ("planner_mean_prompt_tokens", "Mean prompt tokens of those requests.", lambda i: i.sample.mean_prompt_tokens),
    ("planner_mean_output_tokens", "Mean output tokens of those requests.", lambda i: i.sample.mean_output_tokens),
    ("planner_prefix_hit_rate", "Share of the routed prompt tokens a cache held.", lambda i: i.sample.prefix_hit_rate),
    ("planner_prefill_queue_tokens", "Prompt tokens waiting at prefill nodes.",
     lambda i: i.sample.prefill_queue_tokens),
    ("planner_decode_kv_usage", "Used / total KV blocks of the decode nodes.", lambda i: i.decode_kv_usage),
    ("planner_observed_ttft_seconds", "Mean time to first token the gateways saw.",
     lambda i: i.sample.observed_ttft_s),
    ("planner_observed_itl_seconds", "Mean inter-token latency the gateways saw.", lambda i: i.sample.observed_itl_s),
)


def planner_families(loop):
    """The planner's families (module docstring); nothing when it is off or has not decided."""
    if loop is None or loop.last is None:
        return
    last = loop.last
    current = {"prefill": last.inputs.sample.prefill_nodes, "decode": last.inputs.sample.decode_nodes}
    for metric, text, counts in (("planner_desired_nodes", "Nodes the planner wants running.", last.decision.nodes),
                                 ("planner_wanted_nodes", "The planner's formula before limits and hysteresis.",
                                  last.decision.wanted),
                                 ("planner_current_nodes", "Live, undrained nodes at the planner's decision.",
                                  current)):
        family = GaugeMetricFamily(name(metric), text, labels=["role"])
        for role in ROLES:
            family.add_metric([role], counts[role])
        yield family
    yield CounterMetricFamily(name("planner_decisions"), "Planner decisions.", value=loop.num_decisions)
    for metric, text, value in PLANNER_INPUTS:
        family = GaugeMetricFamily(name(metric), text)
        if value(last.inputs) is not None:
            family.add_metric([], value(last.inputs))
        yield family


def meta_registry(control) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(MetaCollector(control))
    return registry
