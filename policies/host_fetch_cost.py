"""Each prefill worker's host tier as a routing location: what a worker pays to fetch blocks of a prompt
back from its own host tier, in the prefill tokens `cache_aware` counts cost in
(policies/routing/host_tier_choice.py; docs/architecture.md#kv-tiers).

Which blocks a worker's host tier holds comes from the prefix index (workers publish host-tier events:
`PrefixMatch.num_host_blocks`); this prices them. Price: fetch_tokens(worker, n) = fetch_s(n blocks'
bytes) / per_token_s, with fetch_s fitted per worker (latency + bytes / bandwidth) from what that worker
measured on its own fetches served wholly by its host tier (`StoreReads.host_fetched_bytes` /
`host_fetch_s`: read, checked and loaded into the pool), and per_token_s the prefill cost model's fitted
per-token time (the pull planner's). A worker whose fetches were not seen yet is priced by the prior:
HOST_READ_LATENCY_S plus its bytes at `kv_store.host_read_prior_bytes_per_s` (`host_read_prior`).
"""

from __future__ import annotations

import math

from common.kv_store_config import KVStoreConfig
from common.messages import StoreReads
from policies.admission import PrefillCostModel
from policies.admission.cost_model import TransferCostModel, TransferTimeFit
from policies.admission.step_stats import TransferStep

# A cold router's guess for a host tier (memory next to the worker: no network, but a checksum and a copy
# into the pool per block): 1 ms of engine hops, then the configured bandwidth (2 GB/s by default). Each
# worker's own fit replaces it after 8 reported intervals with host-tier fetches; docs/performance.md has
# what CPU workers measure.
HOST_READ_LATENCY_S = 0.001


def host_read_prior(config: KVStoreConfig) -> TransferTimeFit:
    """The host-tier read time assumed for a worker that has reported no host-tier fetch yet."""
    return TransferTimeFit(latency_s=HOST_READ_LATENCY_S, per_byte_s=1.0 / config.host_read_prior_bytes_per_s)


HOST_READ_PRIOR = host_read_prior(KVStoreConfig())
MIN_PER_TOKEN_S = 1e-9  # a fit that says tokens are free would price every fetch out


class HostFetchCost:
    """`cache_aware`'s `HostTierLocation` for a router. Used from the router's event loop only."""

    def __init__(self, block_bytes: int, prefill_cost: PrefillCostModel, read_prior: TransferTimeFit = HOST_READ_PRIOR):
        self.block_bytes, self.prefill_cost, self.read_prior = block_bytes, prefill_cost, read_prior
        self._models: dict[str, TransferCostModel] = {}  # worker → its fitted host-tier reads
        self._seen: dict[tuple[str, int], StoreReads] = {}  # (worker, epoch) → its last report

    def fetch_tokens(self, worker_id: str, num_blocks: int) -> int:
        """A fetch of `num_blocks` blocks from the worker's host tier, in prefill tokens (0 for none)."""
        if num_blocks <= 0:
            return 0
        fetch_s = self.fit(worker_id).time_s(num_blocks * self.block_bytes)
        return math.ceil(fetch_s / max(self.prefill_cost.fit().per_token_s, MIN_PER_TOKEN_S))

    def fit(self, worker_id: str) -> TransferTimeFit:
        model = self._models.get(worker_id)
        return self.read_prior if model is None else model.fit()

    def bandwidth_bytes_per_s(self, worker_id: str) -> float:
        """The worker's fitted host-tier read bandwidth (the prior's until it reported fetches)."""
        return self.fit(worker_id).bandwidth_bytes_per_s

    def observe_stats(self, worker_id: str, role: str, epoch: int, stats) -> None:
        """WorkerMonitor listener: a prefill worker's host-tier fetches since its last report feed its model."""
        reads: StoreReads | None = getattr(stats, "store_reads", None)
        if role != "prefill" or reads is None:
            return
        last = self._seen.get((worker_id, epoch)) or StoreReads(reads.layout, 0, 0.0)
        self._seen[(worker_id, epoch)] = reads
        moved_bytes, took_s = reads.host_fetched_bytes - last.host_fetched_bytes, reads.host_fetch_s - last.host_fetch_s
        if moved_bytes > 0 and took_s > 0:
            model = self._models.setdefault(worker_id, TransferCostModel(prior=self.read_prior))
            model.observe(TransferStep(moved_bytes, took_s))
