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
(which adds `model_name`), so the series come out of the worker's metrics port. A tensor-parallel decode
instance exports from rank 0 the sum over its ranks (each stores its heads of every block as a shard
record of its own: `blocks_stored` then counts shard records); the other ranks' counters are asked
for at scrape time, and a rank that does not answer counts with its last answer, so no counter falls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

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


TierStats = dict[str, dict[str, int]]  # `WorkerKVTiers.stats()`: tier name (and "worker") → counters


def sum_tier_stats(parts: Sequence[TierStats]) -> TierStats:
    """Several ranks' tier counters as one instance's: each tier's and the worker's summed key by key (a
    tier only some ranks have counts theirs)."""
    total: TierStats = {}
    for part in parts:
        for tier, counters in part.items():
            into = total.setdefault(tier, {})
            for key, value in counters.items():
                into[key] = into.get(key, 0) + value
    return total


class KVTierCollector(Collector):
    def __init__(
        self,
        worker_id: str,
        role: str,
        tiers: WorkerKVTiers,
        other_ranks: Callable[[], Sequence[TierStats]] | None = None,
    ):
        """`other_ranks`: the counters of the instance's other ranks (rank 0 of a TP decode instance)."""
        self.worker_id, self.role, self.tiers, self.other_ranks = worker_id, role, tiers, other_ranks

    def collect(self) -> Iterator[Metric]:
        stats = self.tiers.stats()
        if self.other_ranks is not None:
            stats = sum_tier_stats([stats, *self.other_ranks()])
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
