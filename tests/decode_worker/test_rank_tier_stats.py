"""A TP decode instance's KV-store metrics count every rank: rank 0 exports its own counters plus its other
ranks' (asked over Ray at scrape time, real actors), and a rank that is slow or dead counts with its last
answer, so the instance's counters never fall between scrapes (valid exposition, checked by promtool)."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess

import pytest
import ray
import torch
from prometheus_client import generate_latest

from common.actor_api import DecodeRankHandle
from common.kv_store_config import KVStoreConfig
from common.metric_identity import ModelRegistry
from decode_worker.rank_tier_stats import OtherRankTierStats
from engine.block_hash import HashNamespace, hash_blocks
from engine.kv_cache_manager import KVCacheManager
from engine.kv_quant import kv_format
from engine.kv_storage import KVCacheStorage
from kv_store.metrics import KVTierCollector, sum_tier_stats
from kv_store.worker_tiers import WorkerKVTiers

pytestmark = pytest.mark.timeout(120)
BLOCK = 4


@ray.remote(num_cpus=0)
class Rank:
    """Another rank's answer to `kv_tier_stats` (what `DecodeWorker.kv_tier_stats` returns), settable."""

    def __init__(self) -> None:
        self.stats: dict[str, dict[str, int]] = {}
        self.delay_s = 0.0

    def set(self, stats: dict[str, dict[str, int]], delay_s: float = 0.0) -> None:
        self.stats, self.delay_s = stats, delay_s

    async def kv_tier_stats(self) -> dict[str, dict[str, int]]:
        await asyncio.sleep(self.delay_s)
        return self.stats


def rank_stats(stored: int, write_bytes: int) -> dict[str, dict[str, int]]:
    tier = {"hits": 0, "misses": 0, "errors": 0, "evictions": 0, "read_bytes": 0, "write_bytes": write_bytes}
    worker = {"blocks_stored": stored, "blocks_fetched": 0, "records_refused": 0, "writes_dropped": 0}
    return {"host": tier | {"used_bytes": write_bytes, "capacity_bytes": 1 << 20}, "worker": worker}


def sample(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted((labels | {"model_name": "demo"}).items()))
    found = re.search(rf"^{name}{{{re.escape(wanted)}}} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{name}{{{wanted}}} not in the exposition"
    return float(found.group(1))


def test_sum_tier_stats_adds_every_counter_and_keeps_tiers_only_some_ranks_have():
    a = rank_stats(3, 300)
    b = rank_stats(2, 200) | {"redis": {"hits": 5}}
    total = sum_tier_stats([a, b])
    assert total["worker"]["blocks_stored"] == 5 and total["host"]["write_bytes"] == 500
    assert total["host"]["capacity_bytes"] == 2 << 20 and total["redis"] == {"hits": 5}
    assert a == rank_stats(3, 300), "the parts are not changed"


def test_rank_0_exports_the_sum_of_its_ranks_and_a_silent_rank_keeps_its_last_counters(ray_session, tmp_path):
    storage = KVCacheStorage(kv_format("int8", torch.float32), 2, 2, 8, BLOCK, 8)
    box: list[WorkerKVTiers] = []
    kv = KVCacheManager(8, BLOCK, on_event=lambda event: box[0].on_kv_event(event))
    box.append(WorkerKVTiers(KVStoreConfig(host_tier_bytes=1 << 20, host_tier="memory"), storage, kv))
    tiers = box[0]
    tokens = list(range(3 * BLOCK + 1))
    kv.allocate("s", len(tokens))
    kv.cache_blocks("s", tokens, hash_blocks(HashNamespace("m", BLOCK, ""), tokens[: 3 * BLOCK]), 3 * BLOCK)
    assert tiers.writer.flush(10.0) and tiers.blocks_stored == 3
    own_write_bytes = tiers.stats()["host"]["write_bytes"]
    assert own_write_bytes > 0

    ranks = [Rank.remote() for _ in range(2)]
    ray.get([ranks[0].set.remote(rank_stats(4, 1000)), ranks[1].set.remote(rank_stats(5, 2000))], timeout=30)
    others = OtherRankTierStats([DecodeRankHandle(r) for r in ranks], timeout_s=0.5)
    registry = ModelRegistry("demo")
    registry.register(KVTierCollector("d0", "decode", tiers, others))

    def scrape() -> str:
        return generate_latest(registry).decode()

    text = scrape()
    stored = sample(text, "splitserve_worker_kv_store_blocks_stored_total", role="decode", worker="d0")
    assert stored == 3 + 4 + 5
    written = sample(text, "splitserve_worker_kv_tier_write_bytes_total", role="decode", tier="host", worker="d0")
    assert written == own_write_bytes + 1000 + 2000
    promtool = shutil.which("promtool") or "/usr/bin/promtool"  # `make test` installs Debian's prometheus
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    # rank 2 is busy past the scrape's wait: it counts with its last answer; rank 1 moved on
    ray.get([ranks[0].set.remote(rank_stats(6, 1500)), ranks[1].set.remote(rank_stats(9, 9000), 5.0)], timeout=30)
    stored = sample(scrape(), "splitserve_worker_kv_store_blocks_stored_total", role="decode", worker="d0")
    assert stored == 3 + 6 + 5
    # rank 1 dies: still its last answer, so the instance's counter does not fall
    ray.kill(ranks[0])
    stored = sample(scrape(), "splitserve_worker_kv_store_blocks_stored_total", role="decode", worker="d0")
    assert stored == 3 + 6 + 5
    tiers.close()
