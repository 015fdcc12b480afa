"""A worker's tiers bound to a real pool: a block the pool caches is written, fetched back by hash into
other block ids bit for bit, and shows in the worker's metrics (with `model_name`, valid exposition)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from prometheus_client import generate_latest

from common.kv_store_config import KVStoreConfig
from common.metric_identity import ModelRegistry
from engine.block_hash import HashNamespace, hash_blocks
from engine.kv_cache_manager import KVCacheManager
from engine.kv_quant import kv_format
from engine.kv_storage import KVCacheStorage
from kv_store.metrics import KVTierCollector
from kv_store.worker_tiers import WorkerKVTiers

pytestmark = pytest.mark.timeout(60)
BLOCK = 4


def _worker(tmp_path, kind: str):
    storage = KVCacheStorage(kv_format("int8", torch.float32), 2, 2, 8, BLOCK, 8)
    box: list[WorkerKVTiers] = []
    kv = KVCacheManager(8, BLOCK, on_event=lambda event: box[0].on_kv_event(event))
    config = KVStoreConfig(host_tier_bytes=1 << 20, host_tier=kind, host_tier_dir=str(tmp_path))
    box.append(WorkerKVTiers(config, storage, kv))
    return storage, kv, box[0]


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_a_cached_block_is_written_then_fetched_into_another_pool(tmp_path, kind):
    storage, kv, tiers = _worker(tmp_path, kind)
    torch.manual_seed(0)
    storage.values.copy_(torch.randint(-100, 100, storage.values.shape, dtype=torch.int8))
    storage.scales.copy_(torch.rand(storage.scales.shape))
    tokens = list(range(3 * BLOCK + 1))
    hashes = hash_blocks(HashNamespace("m", BLOCK, ""), tokens[: 3 * BLOCK])
    blocks = kv.allocate("s", len(tokens))
    kv.cache_blocks("s", tokens, hashes, 3 * BLOCK)
    assert tiers.writer.flush(10.0) and tiers.blocks_stored == 3

    other_storage, _, other = _worker(tmp_path / "other", kind)
    other.reader = tiers.reader  # the second worker reads the first one's tiers (a shared store's view)
    records = other.fetch(hashes + hash_blocks(HashNamespace("m", BLOCK, ""), [9] * BLOCK))
    assert len(records) == 3, "the leading run: the fourth hash was never stored"
    other.load([7, 5, 6], records, lambda: None)
    for src, dst in zip(blocks[:3], (7, 5, 6), strict=True):
        assert torch.equal(storage.values[:, :, :, src], other_storage.values[:, :, :, dst])
        assert torch.equal(storage.scales[:, :, :, src], other_storage.scales[:, :, :, dst])
    assert other.blocks_fetched == 3

    registry = ModelRegistry("demo")
    registry.register(KVTierCollector("p0", "prefill", tiers))
    text = generate_latest(registry).decode()
    tier = "host" if kind == "memory" else "disk"
    assert (
        f'splitserve_worker_kv_tier_write_bytes_total{{model_name="demo",role="prefill",tier="{tier}",worker="p0"}}'
        in text
    )
    assert 'splitserve_worker_kv_store_blocks_stored_total{model_name="demo",role="prefill",worker="p0"} 3.0' in text
    promtool = shutil.which("promtool") or "/usr/bin/promtool"  # `make test` installs Debian's prometheus
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tiers.close()
    other.close()
