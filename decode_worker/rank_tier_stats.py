"""Rank 0 of a tensor-parallel decode instance: the KV-tier counters of its other ranks, for its metrics.

Every rank stores its own heads of the blocks its sequences fill (decode_worker/shard_store.py), so each
has tiers and counters of its own; the instance's metrics are rank 0's plus these (kv_store/metrics.py).
Asked at scrape time, on the exporter's thread (never the engine's or the event loop's), all ranks at
once with one bounded wait. A rank that does not answer in time (busy, dying) counts with its last
answer, so the instance's counters never fall between scrapes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import ray

from common.actor_api import DecodeRankHandle

log = logging.getLogger(__name__)
TIMEOUT_S = 1.0  # one scrape waits this long for the ranks; Prometheus' own scrape timeout is 10 s


class OtherRankTierStats:
    def __init__(self, ranks: Sequence[DecodeRankHandle], timeout_s: float = TIMEOUT_S):
        self.ranks, self.timeout_s = tuple(ranks), timeout_s
        self._last: list[dict[str, dict[str, int]] | None] = [None] * len(self.ranks)

    def __call__(self) -> list[dict[str, dict[str, int]]]:
        """Each rank's latest counters (`WorkerKVTiers.stats()`), in rank order; a rank never heard from is left out."""
        try:
            refs = [rank.kv_tier_stats() for rank in self.ranks]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
            answered = {ref.hex() for ref in ready}
            for i, ref in enumerate(refs):
                if ref.hex() in answered:
                    self._last[i] = ray.get(ref)
        except Exception:  # a rank that fails to answer keeps its last counters
            log.debug("could not read another rank's KV-tier counters", exc_info=True)
        return [stats for stats in self._last if stats is not None]
