"""values.schema.json: bad values fail before anything renders, naming the key; and the chart's
values cover common/config.py's keys exactly once (chart-owned or passed through under `config`)."""
from __future__ import annotations

import dataclasses
import json

import helm_python
import pytest

from common.config import ROUTING_POLICIES, ClusterConfig, ConfigError, PoolConfig, RouterConfig
from common.planner_config import PlannerConfig
from engine.config import DTYPES
from engine.kv_quant import KV_CACHE_DTYPES
from engine.layers.quantization import QUANTIZATIONS
from tests.deploy.chart import CHART_DIR, MATRIX, chart, cluster_config_raw, objects

# Config keys the chart sets from its own values (or from the release: addresses, mounts).
CHART_OWNED_TOP = {"model_dir", "redis_url", "prefill", "decode", "router",
                   "ray_address",  # the RayCluster's head, passed as --ray-address
                   "ray_num_cpus",  # sizes a local Ray cluster; a release always joins KubeRay's
                   "cluster_name",  # the release's full name: one cluster (one controller) per release
                   "kv_cache_dtype", "quantization", "quantization_group_size"}  # values.yaml `quantization:`
# values.yaml `planner:` (enabled, the profile rendered into the ConfigMap) and the release's RayCluster
CHART_OWNED_PLANNER = {"enabled", "profile_path", "raycluster_name", "raycluster_namespace"}
CHART_OWNED_POOL = {"replicas", "tp_size", "num_cpus", "num_gpus", "ray_resource",
                    "speculative_config"}  # decode.speculativeConfig (decode only)
CHART_OWNED_ROUTER = {"host", "port", "http_port", "policy", "auth_token_file", "metrics_port",
                      "tls_cert_file", "tls_key_file", "tls_client_ca_file", "health_port"}  # from tls.*

BAD_VALUES = [
    ({"prefill": {"replicas": -1}}, "/prefill/replicas", "minimum"),
    ({"decode": {"replicas": 0}}, "/decode/replicas", "minimum"),
    ({"router": {"policy": "fastest"}}, "/router/policy", "round_robin"),
    ({"decode": {"tpSize": 3}}, "/decode/tpSize", "1, 2, 4, 8"),
    ({"prefill": {"numCpus": "1"}}, "/prefill/numCpus", "string"),
    ({"router": {"port": 70000}}, "/router/port", "maximum"),
    ({"router": {"httpPort": 0}}, "/router/httpPort", "minimum"),
    ({"gpu": {"enabled": "yes"}}, "/gpu/enabled", "boolean"),
    ({"replicas": 2}, "additional properties 'replicas'", "not allowed"),
    ({"config": {"model_dir": "/m"}}, "/config", "'model_dir' not allowed"),
    ({"config": {"prefill": {"replicas": 2}}}, "/config/prefill", "'replicas' not allowed"),
    ({"config": {"router": {"port": 1}}}, "/config/router", "'port' not allowed"),
    ({"config": {"dtype": "fp8"}}, "/config/dtype", "bfloat16"),
    ({"config": {"block_size": 0}}, "/config/block_size", "minimum"),
    ({"redis": {"external": {"url": "http://redis:6379"}}}, "/redis/external/url", "pattern"),
    ({"auth": {"enabled": True}}, "/auth/token", "minLength"),
    ({"metrics": {"serviceMonitor": {"enabled": True}}}, "/metrics/enabled", "true"),
    ({"prefill": {"rayResource": "bad-name"}}, "/prefill/rayResource", "pattern"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy", "IfNotPresent"),
    ({"podSecurity": {"runAsUser": 0}}, "/podSecurity/runAsUser", "minimum"),
    ({"router": {"replicas": 0}}, "/router/replicas", "minimum"),
    ({"router": {"podDisruptionBudget": {"minAvailable": 1}}}, "/router/podDisruptionBudget", "'minAvailable'"),
    ({"tls": {"healthPort": 0}}, "/tls/healthPort", "minimum"),
    ({"tls": {"certManager": {"issuerRef": {"kind": "Cluster"}}}}, "/tls/certManager/issuerRef/kind", "Issuer"),
    ({"tls": {"certManager": {"duration": "90d"}}}, "/tls/certManager/duration", "pattern"),
    ({"tls": {"enable": True}}, "/tls", "'enable' not allowed"),
    ({"test": {"maxTokens": 0}}, "/test/maxTokens", "minimum"),
    ({"quantization": {"kvCacheDtype": "int4"}}, "/quantization/kvCacheDtype", "fp8"),
    ({"quantization": {"weights": "fp8"}}, "/quantization/weights", "int8"),
    ({"quantization": {"weights": "int8", "groupSize": 48}}, "/quantization/groupSize", "multiple"),
    ({"config": {"decode": {"kv_cache_dtype": "int8"}}}, "/config/decode", "'kv_cache_dtype' not allowed"),
    ({"decode": {"speculativeConfig": {"method": "medusa"}}}, "/decode/speculativeConfig/method", "ngram"),
    ({"decode": {"speculativeConfig": {"num_speculative_tokens": 0}}},
     "/decode/speculativeConfig/num_speculative_tokens", "minimum"),
]


@pytest.mark.parametrize("values,where,what", BAD_VALUES, ids=[w for _, w, _ in BAD_VALUES])
def test_schema_rejects_bad_values_naming_the_key(values, where, what):
    with pytest.raises(helm_python.HelmValuesError) as caught:
        chart().validate_schema(values)
    assert where in str(caught.value) and what in str(caught.value), str(caught.value)
    with pytest.raises(helm_python.HelmValuesError, match="schema"):
        chart().render(values, name="rel", namespace="ns")


@pytest.mark.parametrize("values,message", [
    ({"redis": {"external": {"url": "redis://r:6379", "existingSecret": "s"}}}, "set url or existingSecret, not both"),
    ({"metrics": {"enabled": True, "port": 50051}}, "metrics.port must differ from router.port"),
    ({"router": {"httpPort": 50051}}, "router.httpPort must differ from router.port"),
    ({"metrics": {"enabled": True, "port": 8000}}, "metrics.port must differ from router.httpPort"),
    ({"tls": {"enabled": True}}, "set tls.existingSecret .* or tls.certManager.enabled"),
    ({"tls": {"enabled": True, "existingSecret": "s", "certManager": {"enabled": True, "issuerRef": {"name": "i"}}}},
     "not both"),
    ({"tls": {"enabled": True, "certManager": {"enabled": True}}}, "tls.certManager.issuerRef.name"),
    ({"tls": {"enabled": True, "existingSecret": "s", "healthPort": 50051}}, "tls.healthPort must differ from router.port"),
    ({"tls": {"enabled": True, "existingSecret": "s", "healthPort": 8000}}, "tls.healthPort must differ from router.httpPort"),
    ({"tls": {"enabled": True, "existingSecret": "s", "clientCA": {"existingSecret": "ca"}}},
     "the helm test pod needs a client certificate"),
])
def test_cross_field_rules_fail_rendering_with_a_reason(values, message):
    chart().validate_schema(values)
    with pytest.raises(helm_python.HelmRenderError, match=message):
        chart().render(values, name="rel", namespace="ns")


@pytest.mark.parametrize("case", sorted(MATRIX))
def test_every_matrix_case_passes_the_schema(case):
    chart().validate_schema(MATRIX[case])


def _schema() -> dict:
    return json.loads((CHART_DIR / "values.schema.json").read_text())


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_chart_values_cover_each_config_key_exactly_once():
    """A key added to common/config.py fails here until the chart decides who sets it."""
    config = _schema()["properties"]["config"]["properties"]
    pool = _schema()["definitions"]["poolEngine"]["properties"]
    router = config["router"]["properties"]
    top_passthrough = set(config) - {"prefill", "decode", "router"}
    assert top_passthrough.isdisjoint(CHART_OWNED_TOP) and top_passthrough | CHART_OWNED_TOP == _fields(ClusterConfig)
    assert set(pool).isdisjoint(CHART_OWNED_POOL) and set(pool) | CHART_OWNED_POOL == _fields(PoolConfig)
    assert set(router).isdisjoint(CHART_OWNED_ROUTER) and set(router) | CHART_OWNED_ROUTER == _fields(RouterConfig)
    planner = config["planner"]["properties"]
    assert set(planner).isdisjoint(CHART_OWNED_PLANNER) and set(planner) | CHART_OWNED_PLANNER == _fields(PlannerConfig)


def test_schema_enums_match_the_config_loader():
    props = _schema()["properties"]
    assert props["quantization"]["properties"]["kvCacheDtype"]["enum"] == list(KV_CACHE_DTYPES)
    assert props["quantization"]["properties"]["weights"]["enum"] == list(QUANTIZATIONS)
    pool = _schema()["definitions"]["poolEngine"]["properties"]
    assert pool["quantization"]["enum"] == [None, *QUANTIZATIONS]
    assert props["router"]["properties"]["policy"]["enum"] == list(ROUTING_POLICIES)
    assert set(props["config"]["properties"]["dtype"]["enum"]) == {"auto", *DTYPES}
    for tp_size in props["decode"]["properties"]["tpSize"]["enum"]:
        ClusterConfig.from_dict({"decode": {"tp_size": tp_size}})
    with pytest.raises(ConfigError, match="decode.tp_size"):
        ClusterConfig.from_dict({"decode": {"tp_size": 3}})


def _sample(prop: dict):
    """A value the schema accepts for `prop` (its enum's last entry, its first example, its minimum, or a
    plain one)."""
    if "enum" in prop:
        return prop["enum"][-1]
    if "examples" in prop:
        return prop["examples"][0]
    kinds = prop["type"] if isinstance(prop["type"], list) else [prop["type"]]
    if "integer" in kinds:
        return prop.get("minimum", 0) + 7
    if "object" in kinds:
        return {k: _sample(p) for k, p in prop.get("properties", {}).items()}
    if "number" in kinds:
        return min(2.5, prop.get("maximum", 2.5))
    if "array" in kinds:
        return [_sample(prop["items"])]
    return {"boolean": False, "string": "x"}[kinds[0]]


def test_every_passthrough_key_renders_into_a_config_the_loader_accepts():
    config_props = _schema()["properties"]["config"]["properties"]
    pool = _schema()["definitions"]["poolEngine"]["properties"]
    passthrough = {k: _sample(p) for k, p in config_props.items() if k not in ("prefill", "decode", "router")}
    passthrough["prefill"] = {k: _sample(p) for k, p in pool.items()}
    passthrough["decode"] = {k: _sample(p) for k, p in pool.items()}
    passthrough["router"] = {k: _sample(p) for k, p in config_props["router"]["properties"].items()}
    raw = cluster_config_raw(objects({"config": passthrough}))
    for section in ("prefill", "decode", "router"):
        assert passthrough[section].items() <= raw[section].items()
    assert {k: v for k, v in passthrough.items() if not isinstance(v, dict)}.items() <= raw.items()
    assert raw["admission"] == passthrough["admission"]
    ClusterConfig.from_dict(raw)
