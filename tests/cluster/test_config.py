"""ClusterConfig: one loader for every source; bad and unknown keys are named."""
from __future__ import annotations

import pytest

from cluster.config import ClusterConfig, ConfigError, PoolConfig


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
])
def test_bad_values_name_the_key(raw, key):
    with pytest.raises(ConfigError) as err:
        ClusterConfig.from_dict(raw)
    assert key in str(err.value)
