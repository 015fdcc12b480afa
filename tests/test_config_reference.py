"""The config reference in docs/serving.md is what scripts/config_reference.py generates, it names every
cluster config key, and every key can be set through the Helm chart (or is listed here with the reason
it cannot)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import ClusterConfig
from common.router_config import ROUTING_POLICIES
from engine.speculative.config import SpeculativeConfig
from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "serving.md"
CHART = ROOT / "deploy" / "helm" / "splitserve"

# Config keys the chart sets from its own values (templates/_config.tpl) → the value that sets them
# (a dotted path in values.yaml), or None where the chart fixes the key itself.
CHART_MAPPED = {
    "cluster_name": "fullnameOverride",  # the release's full name: one controller per release
    "model_dir": "model.dir",
    "kv_cache_dtype": "quantization.kvCacheDtype",
    "quantization": "quantization.weights",
    "quantization_group_size": "quantization.groupSize",
    "redis_url": "redis.external.url",  # or the bundled Redis, or an existing Secret (--redis-url)
    "prefill.replicas": "prefill.replicas",
    "prefill.tp_size": None,  # always 1: prefill workers run one rank
    "prefill.num_cpus": "prefill.numCpus",
    "prefill.num_gpus": "gpu.enabled",
    "prefill.ray_resource": "prefill.rayResource",
    "decode.replicas": "decode.replicas",
    "decode.tp_size": "decode.tpSize",
    "decode.num_cpus": "decode.numCpus",
    "decode.num_gpus": "gpu.enabled",
    "decode.ray_resource": "decode.rayResource",
    "decode.speculative_config": "decode.speculativeConfig",
    "router.host": None,  # 0.0.0.0: the pod's Service reaches it
    "router.port": "router.port",
    "router.http_port": "router.httpPort",
    "router.policy": "router.policy",
    "router.auth_token_file": "auth.enabled",  # the mounted token Secret
    "router.metrics_port": "metrics.port",
    "router.tls_cert_file": "tls.enabled",  # the mounted TLS Secret
    "router.tls_key_file": "tls.enabled",
    "router.tls_client_ca_file": "tls.clientCA.existingSecret",
    "router.health_port": "tls.healthPort",
    "planner.enabled": "planner.enabled",
    "planner.profile_path": "planner.profile",  # rendered into the config ConfigMap
    "planner.raycluster_name": None,  # the release's RayCluster
    "planner.raycluster_namespace": None,  # the release's namespace
}
# Keys deliberately not settable through Helm, with the reason.
NOT_IN_CHART = {
    "ray_address": "per process: the router's command line names the RayCluster head (--ray-address)",
    "ray_num_cpus": "sizes a local Ray cluster; a release always joins KubeRay's",
    "prefill.speculative_config": "speculative decoding runs on the decode pool; the loader refuses it here",
}


def config_keys() -> list[str]:
    """Every dotted key of the cluster config, found by walking the dataclasses (independently of the
    script under test): sections, their keys, and decode.speculative_config's keys."""

    def walk(obj, prefix: str):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            yield prefix + f.name
            if dataclasses.is_dataclass(value):
                yield from walk(value, f"{prefix}{f.name}.")

    keys = list(walk(ClusterConfig(), ""))
    keys += [f"decode.speculative_config.{f.name}" for f in dataclasses.fields(SpeculativeConfig)]
    return keys


def _schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def _resolve(prop: dict, schema: dict) -> dict:
    if "$ref" in prop:
        return {**schema["definitions"][prop["$ref"].rsplit("/", 1)[1]], **prop}
    return prop


def _schema_path(schema: dict, root: dict, dotted: str) -> dict | None:
    """The schema of `dotted` under `root` (following `$ref`s), or None."""
    node = root
    for part in dotted.split("."):
        node = _resolve(node, schema).get("properties", {}).get(part)
        if node is None:
            return None
    return _resolve(node, schema)


def test_the_generated_reference_is_current():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "config_reference.py"), "--check", str(DOC)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_the_reference_names_every_key_with_its_default():
    module = load_script("config_reference")
    generated = module.render()
    missing = [key for key in config_keys() if f"`{key}`" not in generated]
    assert not missing, f"keys missing from the reference: {missing}"
    listed = {key.name for key in module.all_keys()}
    assert listed == set(config_keys())
    rows = {key.name: key for key in module.all_keys()}
    assert rows["router.port"].default == 50051 and rows["router.port"].type == "int"
    assert rows["decode.speculative_config.num_speculative_tokens"].default == 4


def test_descriptions_come_from_the_source_comments():
    module = load_script("config_reference")
    rows = {key.name: key for key in module.all_keys()}
    # a trailing comment
    assert rows["controller.health_interval_s"].description == "every worker rank is pinged this often"
    # comment lines above the field, joined
    assert rows["router.health_port"].description.startswith("A plaintext port serving only the standard gRPC")
    assert rows["router.health_port"].description.endswith("None: health is served on `port` only.")
    # a constant of choices named in a comment is spelled out
    assert f"({', '.join(ROUTING_POLICIES)})" in rows["router.policy"].description


def test_check_names_the_difference(tmp_path):
    module = load_script("config_reference")
    stale = tmp_path / "doc.md"
    stale.write_text(f"intro\n{module.START}\n| `old` | row |\n{module.END}\nafter\n")
    assert module.check(stale) == 1
    assert module.write(stale) == 0
    assert module.check(stale) == 0
    text = stale.read_text()
    assert text.startswith("intro\n") and text.endswith("after\n") and "`old`" not in text


@pytest.mark.parametrize("key", config_keys())
def test_every_key_is_reachable_from_the_chart(key):
    schema = _schema()
    config = schema["properties"]["config"]
    sources = []
    if key.startswith("decode.speculative_config."):  # the chart's decode.speculativeConfig, verbatim keys
        spec = schema["properties"]["decode"]["properties"]["speculativeConfig"]
        if key.rsplit(".", 1)[1] in spec["properties"]:
            sources.append("decode.speculativeConfig")
    elif _schema_path(schema, config, key) is not None:
        sources.append("config")
    if key in CHART_MAPPED:
        sources.append("chart")
    if key in NOT_IN_CHART:
        sources.append("not settable")
    assert len(sources) == 1, f"{key}: set by {sources or 'nothing'} (values.schema.json config, chart, or listed)"


def test_chart_mapped_keys_name_real_values_the_template_uses():
    schema = _schema()
    template = (CHART / "templates" / "_config.tpl").read_text()
    keys = set(config_keys())
    for key, value in CHART_MAPPED.items():
        assert key in keys, f"{key} is not a config key"
        assert f'"{key.rsplit(".", 1)[-1]}"' in template, f"_config.tpl does not set {key}"
        if value is not None:
            assert _schema_path(schema, schema, value) is not None, f"{value} is not a chart value"
    assert set(NOT_IN_CHART) <= keys


def test_admission_schema_accepts_what_the_loader_does():
    """The admission keys added to the schema take the plain-data form AdmissionConfig.from_dict reads."""
    admission = _schema()["properties"]["config"]["properties"]["admission"]
    slos = admission["properties"]["priority_slos"]
    entry = next(iter(slos["patternProperties"].values()))
    assert set(entry["required"]) == {"ttft_ms", "tpot_ms"}
    raw = {"admission": {"policy": "predictive", "priority_slos": {"2": {"ttft_ms": 300, "tpot_ms": 50}}}}
    config = ClusterConfig.from_dict(raw)
    assert config.admission.slo_for(2) == (300, 50)
