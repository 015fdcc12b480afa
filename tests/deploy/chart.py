"""Rendering the Helm chart offline (Helm's Go SDK through helm-python-sdk) and picking objects out.

`MATRIX` is the set of value files every chart test runs over: each names one way an operator
deploys the chart (GPUs, external Redis, auth, metrics, ...).
"""
from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import helm_python
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "deploy" / "helm" / "splitserve"
RELEASE = "rel"
NAMESPACE = "serving"
KUBE_VERSION = "1.37.0"
CONFIG_PATH = "/etc/splitserve/cluster.yaml"

MATRIX: dict[str, dict] = {
    "defaults": {},
    "gpu": {"gpu": {"enabled": True, "nodeSelector": {"accelerator": "h100"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
            "prefill": {"replicas": 3, "numCpus": 0.5},
            "decode": {"replicas": 2, "tpSize": 4, "numCpus": 2}},
    "external-redis-url": {"redis": {"external": {"url": "rediss://:pw@redis.example.com:6380/0"}}},
    "external-redis-secret": {"redis": {"external": {"existingSecret": "redis-conn"}}},
    "no-redis": {"redis": {"enabled": False}},
    "auth-existing-secret": {"auth": {"enabled": True, "existingSecret": "splitserve-token", "secretKey": "bearer"}},
    "auth-created-secret": {"auth": {"enabled": True, "token": "s3cret-token"}},
    "metrics": {"metrics": {"enabled": True, "port": 9400,
                            "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}}},
    "observability": {"metrics": {"enabled": True, "podMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
                                  "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}},
                                  "grafanaDashboard": {"enabled": True}},
                      "config": {"prefill": {"metrics_port": 9500}, "decode": {"metrics_port": 9500}}},
    "everything": {
        "model": {"dir": "/models/llama", "volume": {"persistentVolumeClaim": {"claimName": "llama", "readOnly": True}}},
        "config": {"dtype": "bfloat16", "block_size": 32, "prefill": {"max_num_batched_tokens": 4096, "threads": 4},
                   "decode": {"num_kv_blocks": 8192, "quantization": "none"},
                   "router": {"max_concurrent_requests": 256}},
        "router": {"policy": "prefix_hash", "service": {"type": "LoadBalancer", "port": 443}, "port": 8443},
        "gpu": {"enabled": True},
        "decode": {"tpSize": 2, "speculativeConfig": {"model": "/models/llama-draft", "num_speculative_tokens": 3}},
        "quantization": {"kvCacheDtype": "int8", "weights": "int8", "groupSize": 128},
        "auth": {"enabled": True, "token": "t"},
        "metrics": {"enabled": True, "serviceMonitor": {"enabled": True}},
        "redis": {"external": {"url": "redis://redis.shared:6379/3"}},
        "networkPolicy": {"routerFrom": [{"namespaceSelector": {"matchLabels": {"team": "serving"}}}]},
        "imagePullSecrets": [{"name": "registry"}],
        # OpenShift-style uids: large numbers must render as integers, not 1.00068e+09.
        "podSecurity": {"runAsUser": 1000680000, "runAsGroup": 1000680000, "fsGroup": 1000680000},
    },
    "hub-download": {"model": {"dir": "Qwen/Qwen3-30B-A3B", "hubCache": {"persistentVolumeClaim": {"claimName": "hf"}},
                               "download": {"enabled": True, "tokenSecret": "hf-token",
                                            "extraArgs": ["--include", "*.safetensors", "--include", "*.json"]}},
                     "config": {"model_revision": "v2"}},
    "planner": {"planner": {"enabled": True, "profile": {"format": "splitserve-profile/v1", "kind": "measured"}},
                "config": {"planner": {"interval_s": 15, "max_workers": 8}}},
    "minimal-objects": {"networkPolicy": {"enabled": False}, "serviceAccount": {"create": False},
                        "router": {"podDisruptionBudget": {"enabled": False}}, "test": {"enabled": False}},
    "tls-existing-secret": {"tls": {"enabled": True, "existingSecret": "router-tls", "caKey": ""},
                            "router": {"replicas": 3}},
    "tls-cert-manager-mutual": {
        "tls": {"enabled": True, "healthPort": 8081, "clientCA": {"existingSecret": "client-ca"},
                "certManager": {"enabled": True, "issuerRef": {"name": "ca", "kind": "ClusterIssuer",
                                                               "group": "cert-manager.io"},
                                "extraDnsNames": ["llm.example.com"]}},
        "auth": {"enabled": True, "existingSecret": "splitserve-token"},
        "router": {"replicas": 1, "podDisruptionBudget": {"enabled": True, "maxUnavailable": 0}}},
}
# TLS on top of everything else at once: an existing certificate, mutual TLS, the test's own client cert.
MATRIX["everything"] = {**MATRIX["everything"], "tls": {
    "enabled": True, "existingSecret": "router-tls", "clientCA": {"existingSecret": "clients", "key": "bundle.pem"},
    "testClientSecret": "test-client-tls"}}


@functools.lru_cache(maxsize=1)
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART_DIR)


@functools.lru_cache(maxsize=None)
def _render_cached(values_json: str) -> tuple[tuple[str, str], ...]:
    manifests = chart().render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE)
    return tuple(sorted(manifests.items()))


def render(values: dict) -> dict[str, str]:
    """{template path: rendered text}; cached per distinct values."""
    return dict(_render_cached(json.dumps(values, sort_keys=True)))


def objects(values: dict) -> list[dict]:
    """Every Kubernetes object the chart renders (empty documents and NOTES.txt skipped)."""
    found = []
    for path, text in render(values).items():
        if path.endswith("NOTES.txt"):
            continue
        found.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return copy.deepcopy(found)


def only(objs: list[dict], kind: str, name_suffix: str = "") -> dict:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(matches) == 1, f"expected one {kind} named *{name_suffix}, got {[o['metadata']['name'] for o in matches]}"
    return matches[0]


def of_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def cluster_config_raw(objs: list[dict]) -> dict:
    """The cluster config YAML the ConfigMap carries, as plain data."""
    config_map = only(objs, "ConfigMap", "-config")
    return yaml.safe_load(config_map["data"]["cluster.yaml"])


def pod_templates(objs: list[dict]) -> dict[str, dict]:
    """Every pod (template) of the release by component label: workloads, RayCluster groups and the
    helm test pod."""
    templates = [o["spec"]["template"] for o in objs if o["kind"] in ("Deployment", "StatefulSet")]
    templates.extend({"metadata": o["metadata"], "spec": o["spec"]} for o in objs if o["kind"] == "Pod")
    for ray in of_kind(objs, "RayCluster"):
        templates.append(ray["spec"]["headGroupSpec"]["template"])
        templates.extend(group["template"] for group in ray["spec"]["workerGroupSpecs"])
    return {t["metadata"]["labels"]["app.kubernetes.io/component"]: t for t in templates}
