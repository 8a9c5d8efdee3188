"""The kv-store's Prometheus metrics, read from KVStore.stats() at scrape time (common/
metrics.py serves them on kv_store.metrics_port, on the event loop); blocks summed over
the key spaces:
  kv_store_hits_total, kv_store_misses_total     blocks asked for and found / not found
  kv_store_evictions_total                       blocks evicted past the high watermark
  kv_store_expired_pins_total                    pins ended by their lease (a reader that never
                                                 released: stopped, or its answer lost)
  kv_store_redis_spills_total, kv_store_redis_promotions_total, kv_store_redis_errors_total
  kv_store_bytes_in_total, kv_store_bytes_out_total   block bytes put / read
  kv_store_blocks_used, kv_store_blocks_total, kv_store_blocks_pinned
  kv_store_redis_up                              1 when the Redis tier answers (0 without one)
  kv_store_spaces                                key spaces (model x layout) in memory
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.metrics import name

COUNTERS = (("hits", "hits", "Blocks found."), ("misses", "misses", "Blocks asked for and not found."),
            ("evictions", "evictions", "Blocks evicted from memory."),
            ("expired_pins", "expired_pins", "Pins ended by their lease, never released by their reader."),
            ("redis_spills", "redis_spilled", "Evicted blocks written to Redis."),
            ("redis_promotions", "redis_promoted", "Blocks read back from Redis."),
            ("redis_errors", "redis_errors", "Failed Redis calls."),
            ("bytes_in", "bytes_in", "Block bytes put."), ("bytes_out", "bytes_out", "Block bytes read."))
GAUGES = (("blocks_used", "blocks_used", "Slots reserved or holding a block."),
          ("blocks_total", "blocks_total", "Slots of every key space."),
          ("blocks_pinned", "blocks_pinned", "Blocks pinned by readers now."),
          ("redis_up", "redis_up", "1 when the Redis tier answers."),
          ("spaces", "num_spaces", "Key spaces in memory."))


class KVStoreCollector:
    def __init__(self, store):
        self.store = store   # a KVStore (services/kv_store/store.py)

    def collect(self):
        s = self.store.stats()
        for metric, key, doc in COUNTERS:
            yield CounterMetricFamily(name(f"kv_store_{metric}"), doc, value=s[key])
        for metric, key, doc in GAUGES:
            yield GaugeMetricFamily(name(f"kv_store_{metric}"), doc, value=int(s[key]))


def kv_store_registry(store) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(KVStoreCollector(store))
    return registry
