"""`kv_store:` in the cluster config: KV block tiers beyond each worker's pool (kv_store/).

With `url` set, workers write every full prefix block to the shared store (Redis, or a Redis Cluster)
off the request's path, and fetch the blocks a prompt misses locally from it before computing them;
decode instances also write the blocks of running sequences as they fill, so a request migrated off a
dead instance resumes from stored blocks. `host_tier_bytes` adds a bounded tier on each worker's
host (records in memory on GPU workers, a memory-mapped file under `host_tier_dir` on CPU workers).
Checked with the rest of the cluster config; errors name the key (`kv_store.url: ...`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.config_parsing import ConfigError, check
from common.redis_url import parse_redis_url

HOST_TIER_KINDS = ("auto", "memory", "disk")


@dataclass(frozen=True)
class KVStoreConfig:
    # The shared store: redis://HOST:PORT[/DB], or a Redis Cluster as redis+cluster://HOST:PORT[,...]
    # (run it with maxmemory and maxmemory-policy allkeys-lru: eviction is the store's). None: off.
    url: str | None = None
    host_tier_bytes: int = 0  # each worker's host tier; 0: none
    host_tier: str = "auto"  # one of HOST_TIER_KINDS; auto: memory on a GPU worker, disk on a CPU worker
    host_tier_dir: str | None = None  # where a disk tier's file lives; None: the system's temp dir
    write_decode_blocks: bool = True  # decode instances store running sequences' blocks (migration resumes)
    timeout_s: float = 1.0  # longest one store call may take; slower is a miss
    retry_after_s: float = 1.0  # after a store error, answer misses this long before calling it again
    max_queued_writes: int = 256  # batches waiting for the writer; beyond it the oldest are dropped
    # The host-tier read bandwidth the router prices a worker's host-tier fetches at until that worker
    # reported fetches of its own (then its measured fit replaces it)
    host_read_prior_bytes_per_s: float = 2e9

    @property
    def enabled(self) -> bool:
        return self.url is not None or self.host_tier_bytes > 0


def check_kv_store(config: KVStoreConfig) -> None:
    if config.url is not None:
        try:
            parse_redis_url(config.url, "kv_store.url")
        except ValueError as err:  # its message already starts with the key
            raise ConfigError(str(err)) from None
    check(config.host_tier_bytes >= 0, "kv_store.host_tier_bytes", "must be >= 0")
    check(config.host_tier in HOST_TIER_KINDS, "kv_store.host_tier", f"must be one of {list(HOST_TIER_KINDS)}")
    check(
        config.host_tier_dir is None or bool(config.host_tier_dir),
        "kv_store.host_tier_dir",
        "must be None or non-empty",
    )
    check(config.timeout_s > 0, "kv_store.timeout_s", "must be > 0")
    check(config.retry_after_s > 0, "kv_store.retry_after_s", "must be > 0")
    check(config.max_queued_writes >= 1, "kv_store.max_queued_writes", "must be >= 1")
    check(
        math.isfinite(config.host_read_prior_bytes_per_s) and config.host_read_prior_bytes_per_s > 0,
        "kv_store.host_read_prior_bytes_per_s",
        "must be a finite number > 0",
    )
