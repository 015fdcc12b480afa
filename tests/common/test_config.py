"""ClusterConfig: one loader for every source; bad and unknown keys are named."""
from __future__ import annotations

import pytest

from common.config import ClusterConfig, ConfigError, PoolConfig


def test_from_dict_round_trips_and_builds_engine_configs():
    config = ClusterConfig.from_dict({"block_size": 32, "decode": {"replicas": 2, "tp_size": 2, "threads": 3},
                                      "prefill": {"prefill_chunk_tokens": 256}})
    assert config.decode == PoolConfig(replicas=2, tp_size=2, threads=3)
    assert ClusterConfig.from_dict(config.to_dict()) == config
    prefill = config.engine_config("prefill", "/m")
    decode = config.engine_config("decode", "/m")
    assert (prefill.role, prefill.block_size, prefill.prefill_chunk_tokens, prefill.enable_prefix_caching) == (
        "prefill", 32, 256, True)
    assert (decode.role, decode.tp_size, decode.num_threads, decode.enable_prefix_caching) == ("decode", 2, 3, False)
    assert config.num_cpus_needed == 1 + 2 * 2


def test_the_decode_pool_speculates_from_yaml_shaped_data():
    raw = {"decode": {"speculative_config": {"model": "/drafts/small", "num_speculative_tokens": 3}}}
    config = ClusterConfig.from_dict(raw)
    assert ClusterConfig.from_dict(config.to_dict()) == config
    decode, prefill = config.engine_config("decode", "/m"), config.engine_config("prefill", "/m")
    assert (decode.speculative_config.method, decode.speculative_config.model) == ("draft_model", "/drafts/small")
    assert prefill.speculative_config is None


@pytest.mark.parametrize("raw, key", [
    ({"blocksize": 16}, "blocksize"),
    ({"decode": {"tp": 2}}, "decode.tp"),
    ({"decode": {"tp_size": 3}}, "decode.tp_size"),
    ({"prefill": {"tp_size": 2}}, "prefill.tp_size"),
    ({"prefill": {"replicas": 0}}, "prefill.replicas"),
    ({"decode": {"num_cpus": -1}}, "decode.num_cpus"),
    ({"block_size": 0}, "block_size"),
    ({"dtype": "float64"}, "dtype"),
    ({"handoff_lease_s": 0}, "handoff_lease_s"),
    ({"decode": {"replicas": True}}, "decode.replicas"),
    ({"prefill": "big"}, "prefill"),
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
    ({"quantization": "fp8"}, "quantization"),
    ({"decode": {"quantization": "int3"}}, "decode.quantization"),
    ({"quantization": "int8", "quantization_group_size": 100}, "quantization_group_size"),
    ({"quantization_group_size": 128}, "quantization_group_size"),  # no pool quantizes
    ({"decode": {"speculative_config": {"num_speculative_tokens": 99}}},
     "decode.speculative_config.num_speculative_tokens"),
    ({"decode": {"speculative_config": {"method": "ngram", "typo": 1}}}, "decode.speculative_config"),
    ({"decode": {"speculative_config": "ngram"}}, "decode.speculative_config"),
    ({"prefill": {"speculative_config": {"method": "ngram"}}}, "prefill.speculative_config"),
])
def test_bad_values_name_the_key(raw, key):
    with pytest.raises(ConfigError) as err:
        ClusterConfig.from_dict(raw)
    assert key in str(err.value)


def test_kv_cache_dtype_is_cluster_wide_and_weights_may_differ_per_pool():
    config = ClusterConfig.from_dict({"kv_cache_dtype": "fp8", "quantization": "int8",
                                      "prefill": {"quantization": "none"}})
    prefill, decode = config.engine_config("prefill", "/m"), config.engine_config("decode", "/m")
    assert (prefill.kv_cache_dtype, decode.kv_cache_dtype) == ("fp8", "fp8")
    assert (prefill.quantization, decode.quantization) == ("none", "int8")
    assert ClusterConfig.from_dict(config.to_dict()) == config
    # A pool cannot store KV differently from the other: blocks move between them as stored.
    for pool in ("prefill", "decode"):
        with pytest.raises(ConfigError, match=f"{pool}.kv_cache_dtype: .*cluster-wide.*must store KV alike"):
            ClusterConfig.from_dict({"kv_cache_dtype": "int8", pool: {"kv_cache_dtype": "fp8"}})


def test_a_group_size_reaches_only_the_pools_that_quantize():
    config = ClusterConfig.from_dict({"quantization_group_size": 64, "decode": {"quantization": "int8"}})
    prefill, decode = config.engine_config("prefill", "/m"), config.engine_config("decode", "/m")
    assert (prefill.quantization, prefill.quantization_group_size) == ("none", None)
    assert (decode.quantization, decode.quantization_group_size) == ("int8", 64)
    assert ClusterConfig.from_dict(config.to_dict()) == config


def test_serve_flags_set_the_kv_cache_dtype_and_weight_quantization():
    from splitserve.serve import build_config, parser

    config, _ = build_config(parser("splitserve serve").parse_args(["--kv-cache-dtype", "int8", "--quantization",
                                                                   "int8"]))
    assert (config.kv_cache_dtype, config.quantization) == ("int8", "int8")
    config, _ = build_config(parser("splitserve serve").parse_args(["--quantization", "int4",
                                                                   "--quantization-group-size", "64"]))
    assert (config.quantization, config.quantization_group_size) == ("int4", 64)
    with pytest.raises(ConfigError, match="kv_cache_dtype: must be one of"):
        build_config(parser("splitserve serve").parse_args(["--kv-cache-dtype", "int4"]))


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_decode_instances_of_any_tp_size_store_their_blocks_when_the_store_is_on(tp_size):
    def config(**kv_store) -> ClusterConfig:
        return ClusterConfig.from_dict({"decode": {"tp_size": tp_size}, "kv_store": kv_store})

    on = config(url="redis://127.0.0.1:6379/0")
    assert on.decode_stores_blocks
    assert on.engine_config("decode", "model").enable_prefix_caching, "the decode pool hashes the blocks it stores"
    assert not config(url="redis://127.0.0.1:6379/0", write_decode_blocks=False).decode_stores_blocks
    assert not config(host_tier_bytes=1 << 20).decode_stores_blocks, "a host tier alone outlives no instance"
