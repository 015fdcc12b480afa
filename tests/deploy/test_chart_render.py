"""The chart renders, lints strictly clean, and every object it renders is valid for its API.

Core objects are checked against Kubernetes' own schemas (kubernetes-validate, strict: unknown fields
fail); the RayCluster and the ServiceMonitor against their upstream CRDs (KubeRay's and the Prometheus
operator's, vendored in tests/deploy/crds/), the RayCluster's pod templates also as core
PodTemplateSpecs; the cert-manager Certificate against the fields of cert-manager's v1 API it uses.
"""
from __future__ import annotations

import copy
import json

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from common.config import ClusterConfig
from engine.speculative.config import SpeculativeConfig
from tests.deploy.certificate_schema import validate_certificate
from tests.deploy.chart import CHART_DIR, KUBE_VERSION, MATRIX, NAMESPACE, objects, of_kind, only, pod_templates
from tests.deploy.crd_schema import ray_pod_templates, validate_custom_resource

CUSTOM_KINDS = {"RayCluster", "ServiceMonitor", "PodMonitor", "PrometheusRule", "Certificate"}
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
def test_raycluster_validates_against_the_kuberay_crd_and_its_pods_as_core_pods(case):
    ray = only(objects(MATRIX[case]), "RayCluster")
    validate_custom_resource(ray)
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
    objs = objects(MATRIX[case])
    config = ClusterConfig.from_dict(yaml.safe_load(only(objs, "ConfigMap", "-config")["data"]["cluster.yaml"]))
    assert config.router.host == "0.0.0.0"
    assert config.ray_address is None, "the Ray address has one source: the router's --ray-address flag"
    args = pod_templates(objs)["router"]["spec"]["containers"][0]["args"]
    assert args[args.index("--ray-address") + 1].startswith("ray://")
    quantization = {"kvCacheDtype": "auto", "weights": "none", **MATRIX[case].get("quantization", {})}
    assert (config.kv_cache_dtype, config.quantization) == (quantization["kvCacheDtype"], quantization["weights"])
    assert config.quantization_group_size == quantization.get("groupSize")
    spec = MATRIX[case].get("decode", {}).get("speculativeConfig")
    assert config.decode.speculative_config == (None if spec is None else SpeculativeConfig.from_dict(spec))
    assert config.prefill.speculative_config is None


@matrix
def test_service_monitor_only_when_asked_and_valid_for_the_operator(case):
    values = MATRIX[case]
    monitors = of_kind(objects(values), "ServiceMonitor")
    wanted = values.get("metrics", {}).get("serviceMonitor", {}).get("enabled", False)
    assert len(monitors) == (1 if wanted else 0)
    for monitor in monitors:
        validate_custom_resource(monitor)


@matrix
def test_worker_monitoring_rules_and_dashboard_only_when_asked_and_valid(case):
    """The PodMonitor scrapes the port the worker pods open; the PrometheusRule and the dashboard ConfigMap
    carry the plain files unchanged."""
    values, objs = MATRIX[case], objects(MATRIX[case])
    metrics = values.get("metrics", {})
    pod_monitors, rules = of_kind(objs, "PodMonitor"), of_kind(objs, "PrometheusRule")
    dashboards = [o for o in of_kind(objs, "ConfigMap") if "grafana_dashboard" in o["metadata"]["labels"]]
    assert len(pod_monitors) == int(metrics.get("podMonitor", {}).get("enabled", False))
    assert len(rules) == int(metrics.get("prometheusRule", {}).get("enabled", False))
    assert len(dashboards) == int(metrics.get("grafanaDashboard", {}).get("enabled", False))
    templates = ray_pod_templates(only(objs, "RayCluster"))
    for monitor in pod_monitors:
        validate_custom_resource(monitor)
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        for pool in ("prefill", "decode"):
            ports = {p["name"]: p["containerPort"] for p in templates[pool]["spec"]["containers"][0]["ports"]}
            assert ports[endpoint["port"]] == values["config"][pool]["metrics_port"]
            assert pool_component(pool) in monitor["spec"]["selector"]["matchExpressions"][0]["values"]
    for rule in rules:
        validate_custom_resource(rule)
        assert rule["spec"] == yaml.safe_load((CHART_DIR / "files" / "splitserve-rules.yaml").read_text())
    for dashboard in dashboards:
        assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(dashboard["data"]["splitserve.json"]) == json.loads(
            (CHART_DIR / "files" / "splitserve-dashboard.json").read_text()
        )


def test_the_monitoring_validators_have_teeth():
    objs = objects(MATRIX["observability"])
    monitor = copy.deepcopy(only(objs, "PodMonitor"))
    monitor["spec"]["podMetricsEndpoints"][0]["portt"] = "x"
    with pytest.raises(jsonschema.ValidationError, match="portt"):
        validate_custom_resource(monitor)
    rule = copy.deepcopy(only(objs, "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["recordd"] = "x"
    with pytest.raises(jsonschema.ValidationError, match="recordd"):
        validate_custom_resource(rule)


def pool_component(pool: str) -> str:
    return f"ray-{pool}"


def test_pod_monitor_needs_the_workers_metrics_port():
    with pytest.raises(Exception, match="config.prefill.metrics_port"):
        objects({"metrics": {"podMonitor": {"enabled": True}}})


@matrix
def test_certificates_only_with_cert_manager_and_well_formed(case):
    tls = MATRIX[case].get("tls", {})
    certificates = of_kind(objects(MATRIX[case]), "Certificate")
    wanted = tls.get("enabled") and tls.get("certManager", {}).get("enabled")
    mutual_test_cert = wanted and tls.get("clientCA", {}).get("existingSecret") and not tls.get("testClientSecret")
    assert len(certificates) == (0 if not wanted else 2 if mutual_test_cert else 1)
    for certificate in certificates:
        validate_certificate(certificate)


def test_the_validators_have_teeth():
    """A misspelt field fails each validator: passing above means something."""
    objs = objects(MATRIX["everything"] | {"metrics": {"enabled": True, "serviceMonitor": {"enabled": True}}})
    deployment = copy.deepcopy(only(objs, "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)
    for path, wrong in ((["spec", "workerGroupSpecs", 0, "replica"], 1),  # misspelt replicas
                        (["spec", "workerGroupSpecs", 0, "rayStartParams", "num-cpus"], 1),  # a number, not a string
                        (["spec", "headGroupSpec", "template", "spec", "containers", 0, "imagePullPolcy"], "x"),
                        (["spec", "enableInTreeAutoscaling"], "no")):
        ray = copy.deepcopy(only(objs, "RayCluster"))
        _set(ray, path, wrong)
        with pytest.raises(jsonschema.ValidationError):
            validate_custom_resource(ray)
    monitor = copy.deepcopy(only(objs, "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    with pytest.raises(jsonschema.ValidationError, match="intervall"):
        validate_custom_resource(monitor)
    certificate = copy.deepcopy(of_kind(objects(MATRIX["tls-cert-manager-mutual"]), "Certificate")[0])
    certificate["spec"]["dnsName"] = ["x"]
    with pytest.raises(jsonschema.ValidationError, match="dnsName"):
        validate_certificate(certificate)


def _set(obj, path: list, value) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value
