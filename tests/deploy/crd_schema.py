"""Validating rendered custom resources against their upstream CRDs (vendored under tests/deploy/crds/,
sources and versions in its README), the way a strict API server would.

The CRD's `openAPIV3Schema` is used as it is, with Kubernetes' own semantics added where JSON Schema
has none: an object schema that lists `properties` accepts no other field (the API server prunes or,
with strict field validation, rejects unknown ones) unless it says
`x-kubernetes-preserve-unknown-fields`; `nullable: true` admits null; `x-kubernetes-int-or-string`
admits an integer or a string; a pattern's inline flag group moves to the front, where Python's `re` wants it
(Kubernetes evaluates patterns with Go's RE2, which takes it anywhere). CEL rules (`x-kubernetes-validations`) are not evaluated.
"""
from __future__ import annotations

import copy
import functools
import gzip
from pathlib import Path

import jsonschema
import yaml

CRD_DIR = Path(__file__).resolve().parent / "crds"
CRDS = {  # (apiVersion, kind) -> the vendored CRD file
    ("ray.io/v1", "RayCluster"): CRD_DIR / "kuberay" / "ray.io_rayclusters.yaml.gz",
    ("monitoring.coreos.com/v1", "ServiceMonitor"):
        CRD_DIR / "prometheus-operator" / "monitoring.coreos.com_servicemonitors.yaml.gz",
    ("monitoring.coreos.com/v1", "PodMonitor"):
        CRD_DIR / "prometheus-operator" / "monitoring.coreos.com_podmonitors.yaml.gz",
    ("monitoring.coreos.com/v1", "PrometheusRule"):
        CRD_DIR / "prometheus-operator" / "monitoring.coreos.com_prometheusrules.yaml.gz",
}


@functools.cache
def _schema(api_version: str, kind: str) -> dict:
    crd = yaml.safe_load(gzip.decompress(CRDS[(api_version, kind)].read_bytes()))
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _kubernetes_semantics(copy.deepcopy(served["schema"]["openAPIV3Schema"]))
    schema["properties"]["apiVersion"] = {"const": api_version}
    schema["properties"]["kind"] = {"const": kind}
    schema["properties"]["metadata"] = _OBJECT_META
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
    return schema


# What a chart may set in a custom resource's metadata (the API server checks ObjectMeta itself).
_OBJECT_META = {
    "type": "object", "additionalProperties": False, "required": ["name"],
    "properties": {"name": {"type": "string", "maxLength": 63, "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                   "namespace": {"type": "string"},
                   "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                   "annotations": {"type": "object", "additionalProperties": {"type": "string"}}},
}


def _kubernetes_semantics(node):
    if isinstance(node, list):
        return [_kubernetes_semantics(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _kubernetes_semantics(value) if key not in ("enum", "default", "example") else value
            for key, value in node.items()}
    if node.get("x-kubernetes-int-or-string"):
        node.pop("type", None)
        node.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    pattern = node.get("pattern")
    if isinstance(pattern, str) and pattern.startswith("^(?i)"):  # RE2 takes a flag group anywhere, Python first
        node["pattern"] = "(?i)^" + pattern[len("^(?i)"):]
    if node.get("nullable") and "type" in node:
        node["type"] = [node["type"], "null"]
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        node["additionalProperties"] = False
    return node


def validate_custom_resource(obj: dict) -> None:
    """Raises jsonschema.ValidationError naming the offending path; KeyError for a kind with no CRD here."""
    schema = _schema(obj["apiVersion"], obj["kind"])
    jsonschema.validate(obj, schema, cls=jsonschema.Draft7Validator)


def ray_pod_templates(obj: dict) -> dict[str, dict]:
    """{group name ("head" for the head group): PodTemplateSpec} of one RayCluster."""
    spec = obj["spec"]
    templates = {"head": spec["headGroupSpec"]["template"]}
    for group in spec.get("workerGroupSpecs", []):
        templates[group["groupName"]] = group["template"]
    return templates
