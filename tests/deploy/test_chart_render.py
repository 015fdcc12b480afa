"""The chart renders, lints strictly clean, and every object it renders is valid for its API.

Core objects are checked against Kubernetes' own schemas (kubernetes-validate, strict: unknown fields
fail); the RayCluster against the hand-kept KubeRay field list, with its pod templates checked as core
PodTemplateSpecs; the ServiceMonitor against the few Prometheus-operator fields it uses.
"""
from __future__ import annotations

import copy

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from cluster.config import ClusterConfig
from tests.deploy.chart import CHART_DIR, KUBE_VERSION, MATRIX, NAMESPACE, of_kind, objects, only
from tests.deploy.raycluster_schema import ray_pod_templates, validate_raycluster

CUSTOM_KINDS = {"RayCluster", "ServiceMonitor"}
HELM_WARNING = 2  # lint severities: 1 info, 2 warning, 3 error

matrix = pytest.mark.parametrize("case", sorted(MATRIX))


@matrix
def test_lint_is_strictly_clean(case):
    report = helm_python.lint(CHART_DIR, MATRIX[case], strict=True, namespace=NAMESPACE,
                              kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= HELM_WARNING] == []


@matrix
def test_core_objects_validate_against_kubernetes_schemas(case):
    core = [o for o in objects(MATRIX[case]) if o["kind"] not in CUSTOM_KINDS]
    assert {"ConfigMap", "Deployment", "Service"} <= {o["kind"] for o in core}
    for obj in core:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


@matrix
def test_raycluster_uses_known_fields_and_valid_pod_templates(case):
    ray = only(objects(MATRIX[case]), "RayCluster")
    validate_raycluster(ray)
    templates = ray_pod_templates(ray)
    assert set(templates) == {"head", "prefill", "decode"}
    for group, template in templates.items():
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"ray-{group}"},
                   "template": template}
        kubernetes_validate.validate(wrapped, KUBE_VERSION, strict=True)
        # KubeRay treats the first container as the Ray container it starts `ray start` in.
        assert template["spec"]["containers"][0]["name"].startswith("ray-")


@matrix
def test_rendered_cluster_config_loads(case):
    raw = only(objects(MATRIX[case]), "ConfigMap", "-config")["data"]["cluster.yaml"]
    config = ClusterConfig.from_dict(yaml.safe_load(raw))
    assert config.router.host == "0.0.0.0"
    assert config.ray_address.startswith("ray://")
    quantization = {"kvCacheDtype": "auto", "weights": "none", **MATRIX[case].get("quantization", {})}
    assert (config.kv_cache_dtype, config.quantization) == (quantization["kvCacheDtype"], quantization["weights"])


@matrix
def test_service_monitor_only_when_asked_and_well_formed(case):
    values = MATRIX[case]
    monitors = of_kind(objects(values), "ServiceMonitor")
    wanted = values.get("metrics", {}).get("serviceMonitor", {}).get("enabled", False)
    assert len(monitors) == (1 if wanted else 0)
    for monitor in monitors:
        jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)


SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "required": ["matchLabels"]},
                "namespaceSelector": {"type": "object", "properties": {"matchNames": {"type": "array"}}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["port"],
                    "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                                   "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}}}},
            },
        },
    },
}


def test_the_validators_have_teeth():
    """A misspelt field fails each validator: passing above means something."""
    objs = objects({})
    deployment = copy.deepcopy(only(objs, "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)
    ray = copy.deepcopy(only(objs, "RayCluster"))
    ray["spec"]["workerGroupSpecs"][0]["replica"] = 1
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        validate_raycluster(ray)
    ray = copy.deepcopy(only(objs, "RayCluster"))
    ray["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_raycluster(ray)
