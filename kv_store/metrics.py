"""The KV tiers' Prometheus series, read from the tiers' counters at scrape time (nothing on the hot path).

| name | type | labels |
|---|---|---|
| splitserve_worker_kv_tier_used_bytes | gauge | worker, role, tier (host, disk, redis) |
| splitserve_worker_kv_tier_capacity_bytes | gauge | worker, role, tier (0: bounded by the store) |
| splitserve_worker_kv_tier_{hits,misses,errors,evictions}_total | counter | worker, role, tier |
| splitserve_worker_kv_tier_{read,write}_bytes_total | counter | worker, role, tier |
| splitserve_worker_kv_store_blocks_{stored,fetched}_total | counter | worker, role |
| splitserve_worker_kv_store_records_refused_total | counter | worker, role |
| splitserve_worker_kv_store_writes_dropped_total | counter | worker, role |

Hit rate of a tier = rate(hits) / (rate(hits) + rate(misses)). Registered on the worker's own registry
(which adds `model_name`), so the series come out of the worker's metrics port.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kv_store.worker_tiers import WorkerKVTiers

_TIER_GAUGES = {"used_bytes": "Bytes the tier holds now.", "capacity_bytes": "The tier's size (0: the store's own)."}
_TIER_COUNTERS = {
    "hits": "Block lookups the tier answered.",
    "misses": "Block lookups the tier did not hold (or could not answer).",
    "errors": "Calls to the tier that failed (each pauses a shared store for kv_store.retry_after_s).",
    "evictions": "Blocks the tier dropped to make room.",
    "read_bytes": "Bytes read from the tier.",
    "write_bytes": "Bytes written to the tier.",
}
_WORKER_COUNTERS = {
    "blocks_stored": ("kv_store_blocks_stored", "Blocks queued for writing to the tiers."),
    "blocks_fetched": ("kv_store_blocks_fetched", "Blocks loaded into the pool from a tier instead of computed."),
    "records_refused": ("kv_store_records_refused", "Records found but corrupt or of another layout (computed)."),
    "writes_dropped": ("kv_store_writes_dropped", "Write batches dropped because the writer fell behind."),
}


class KVTierCollector(Collector):
    def __init__(self, worker_id: str, role: str, tiers: WorkerKVTiers):
        self.worker_id, self.role, self.tiers = worker_id, role, tiers

    def collect(self) -> Iterator[Metric]:
        stats = self.tiers.stats()
        worker = stats.pop("worker")
        identity = [self.worker_id, self.role]
        for key, doc in _TIER_GAUGES.items():
            gauge = GaugeMetricFamily(f"splitserve_worker_kv_tier_{key}", doc, labels=["worker", "role", "tier"])
            for tier, counters in stats.items():
                gauge.add_metric([*identity, tier], counters[key])
            yield gauge
        for key, doc in _TIER_COUNTERS.items():
            family = CounterMetricFamily(f"splitserve_worker_kv_tier_{key}", doc, labels=["worker", "role", "tier"])
            for tier, counters in stats.items():
                family.add_metric([*identity, tier], counters[key])
            yield family
        for key, (name, doc) in _WORKER_COUNTERS.items():
            family = CounterMetricFamily(f"splitserve_worker_{name}", doc, labels=["worker", "role"])
            family.add_metric(identity, worker[key])
            yield family
