"""An engine node's Prometheus metrics (prefill, decode, both), every one labelled with
the node id (`node`). common/metrics.py serves them on nodes[].metrics_port.

Read from the engine at scrape time (EngineCollector: AsyncEngine.snapshot(), the
lock-free counts of common/engine/engine_view.py, and the transfer engine's byte counts):
  num_requests_running           in the running batch or waiting for remote KV
  num_requests_waiting           queued for admission
  kv_cache_usage_perc            used / total blocks (a fraction: 1 = full, as vLLM's)
  kv_blocks_total, kv_blocks_used (held by requests, quarantined ones included),
  kv_blocks_free (free now, prefix-cached ones included), kv_blocks_cached (free blocks
  that still hold a prefix-cache entry), kv_blocks_quarantined (held until their writer
  is known to have stopped): used + free = total, cached <= free, quarantined <= used
  prefix_cache_queries_total, prefix_cache_hits_total   prompt tokens looked up / found
  num_preemptions_total
  kv_transfer_bytes_total{direction}   write: acknowledged by peers; read: from peers
  moe_expert_tokens_total{layer,expert}   a Mixture-of-Experts model only (ExpertCollector):
                                 tokens the layer's router sent to the expert (each token
                                 once per top_k expert), from AsyncEngine.expert_tokens()
                                 (lock-free; exact once no request runs)
  weights_loaded_bytes{source,seed}, weights_load_seconds{source,seed}   where the
                                 parameters came from (engine.load_format: disk or peer)
  weight_seed_clients, weight_seed_leases_total   as a weight seed: loaders reading now,
                                 admitted so far
Observed by the servicers, per request:
  request_queue_time_seconds     arrival at this engine -> admission (StepOutput.queue_s)
  kv_transfer_seconds            prefill nodes: compute done -> every KV write
                                 acknowledged (PrefillTiming.transfer_ms)
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.metrics import TRANSFER_BUCKETS, TTFT_BUCKETS, name


class EngineCollector:
    """snapshot: () -> the engine's counters (AsyncEngine.snapshot()); transfer: has
    bytes_written and bytes_read. Called on the scraping thread (the event loop)."""

    def __init__(self, node_id: str, snapshot, transfer):
        self.node_id, self.snapshot, self.transfer = node_id, snapshot, transfer

    def collect(self):
        s = self.snapshot()
        node = [self.node_id]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name(metric), doc, labels=["node"])
            g.add_metric(node, value)
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name(metric), doc, labels=["node"])
            c.add_metric(node, value)
            return c

        total = s["total_blocks"]
        yield gauge("num_requests_running", "Requests in the running batch or waiting for remote KV.",
                    s["running"] + s["kv_remote"])
        yield gauge("num_requests_waiting", "Requests queued for admission.", s["waiting"])
        yield gauge("kv_cache_usage_perc", "KV-cache usage: used / total blocks (1 = full).",
                    s["used_blocks"] / total if total else 0.0)
        yield gauge("kv_blocks_total", "KV blocks of this node.", total)
        yield gauge("kv_blocks_used", "KV blocks held by requests (quarantined included).", s["used_blocks"])
        yield gauge("kv_blocks_free", "KV blocks free now (prefix-cached included).", s["free_blocks"])
        yield gauge("kv_blocks_cached", "Free KV blocks still holding a prefix-cache entry.", s["cached_blocks"])
        yield gauge("kv_blocks_quarantined", "KV blocks held until their writer is known to have stopped.",
                    s["quarantined_blocks"])
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s["prefix_query_tokens"])
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s["prefix_hit_tokens"])
        yield counter("num_preemptions", "Requests preempted (recomputed later).", s["preemptions"])
        yield counter("borrowed_core_steps", "Steps run with the prefill node's cores too (engine.borrow_cores).",
                      s["borrowed_core_steps"])
        moved = CounterMetricFamily(name("kv_transfer_bytes"), "KV bytes moved by the node's transfer engines (every rank).",
                                    labels=["node", "direction"])
        moved.add_metric([self.node_id, "write"], self.transfer.bytes_written)
        moved.add_metric([self.node_id, "read"], self.transfer.bytes_read)
        yield moved


class ExpertCollector:
    """expert_tokens: () -> MoE layer index -> tokens per expert (AsyncEngine.expert_tokens);
    no series when it is empty (a dense model). Called on the scraping thread."""

    def __init__(self, node_id: str, expert_tokens):
        self.node_id, self.expert_tokens = node_id, expert_tokens

    def collect(self):
        counts = self.expert_tokens()
        if not counts:
            return
        family = CounterMetricFamily(name("moe_expert_tokens"),
                                     "Tokens routed to the expert by the MoE layer's router (once per top_k choice).",
                                     labels=["node", "layer", "expert"])
        for layer, row in counts.items():
            for expert, num_tokens in enumerate(row):
                family.add_metric([self.node_id, str(layer), str(expert)], num_tokens)
        yield family


class WeightsCollector:
    """Where the node's weights came from (loaded: () -> (source, seed, bytes, seconds),
    EngineNode.weights_loaded) and, as a seed, its loaders (WeightSeedService or None)."""

    def __init__(self, node_id: str, loaded, seed):
        self.node_id, self.loaded, self.seed = node_id, loaded, seed

    def collect(self):
        source, seed, nbytes, load_s = self.loaded()
        labels = [self.node_id, source, seed]
        loaded = GaugeMetricFamily(name("weights_loaded_bytes"), "Parameter bytes this node loaded (every rank), by "
                                   "source (disk, peer or mixed) and the seed it read from.",
                                   labels=["node", "source", "seed"])
        loaded.add_metric(labels, nbytes)
        yield loaded
        seconds = GaugeMetricFamily(name("weights_load_seconds"), "Seconds the node took to fill its parameters "
                                    "(its slowest rank).", labels=["node", "source", "seed"])
        seconds.add_metric(labels, load_s)
        yield seconds
        if self.seed is not None:
            clients = GaugeMetricFamily(name("weight_seed_clients"), "Loaders reading this node's weights now.",
                                        labels=["node"])
            clients.add_metric([self.node_id], len(self.seed.leases))
            yield clients
            granted = CounterMetricFamily(name("weight_seed_leases"), "Loaders admitted to this node's weights.",
                                          labels=["node"])
            granted.add_metric([self.node_id], self.seed.leases_granted)
            yield granted


class NodeMetrics:
    """One engine node's registry: snapshot and transfer as EngineCollector's,
    expert_tokens as ExpertCollector's (None: no expert metrics). queue_time and
    kv_transfer are this node's children of the histograms (observe(seconds))."""

    def __init__(self, node_id: str, snapshot, transfer, registry: CollectorRegistry | None = None,
                 expert_tokens=None, weights=None):
        """weights: (LoadedWeights, WeightSeedService or None) for WeightsCollector."""
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.queue_time = Histogram(name("request_queue_time_seconds"), "Arrival at the engine to admission.",
                                    ["node"], buckets=TTFT_BUCKETS, registry=r).labels(node=node_id)
        self.kv_transfer = Histogram(name("kv_transfer_seconds"),
                                     "Prefill: compute done to every KV write acknowledged.",
                                     ["node"], buckets=TRANSFER_BUCKETS, registry=r).labels(node=node_id)
        r.register(EngineCollector(node_id, snapshot, transfer))
        if expert_tokens is not None:
            r.register(ExpertCollector(node_id, expert_tokens))
        if weights is not None:
            r.register(WeightsCollector(node_id, *weights))
