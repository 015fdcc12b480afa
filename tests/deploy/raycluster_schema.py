"""A hand-kept JSON schema for the ray.io/v1 RayCluster fields the chart writes.

kubernetes-validate has no schemas for custom resources, so this one covers exactly the fields the
chart uses, named as KubeRay's Go types name them (ray-operator/apis/ray/v1/raycluster_types.go:
RayClusterSpec, HeadGroupSpec, WorkerGroupSpec). Every object is closed (additionalProperties
false): a misspelt field fails here instead of being silently dropped by the API server. The pod
templates inside are checked separately, as core PodTemplateSpecs, by kubernetes-validate.
If the chart starts using another RayCluster field, add it here after checking KubeRay's types.
"""
from __future__ import annotations

import jsonschema

# KubeRay pastes rayStartParams into the `ray start` command line: values are strings (the CRD's
# map[string]string), keys are `ray start` long options without the leading dashes.
_RAY_START_PARAMS = {
    "type": "object",
    "propertyNames": {"pattern": "^[a-z][a-z0-9-]*$"},
    "additionalProperties": {"type": "string"},
}

_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}

_TEMPLATE = {"type": "object", "required": ["spec"]}

_REPLICAS = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}

RAYCLUSTER_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayCluster"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {"name": {"type": "string", "maxLength": 63}, "labels": _LABELS},
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["headGroupSpec"],
            "properties": {
                "rayVersion": {"type": "string"},
                "enableInTreeAutoscaling": {"type": "boolean"},
                "headGroupSpec": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["rayStartParams", "template"],
                    "properties": {"rayStartParams": _RAY_START_PARAMS, "template": _TEMPLATE},
                },
                "workerGroupSpecs": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams",
                                     "template"],
                        "properties": {
                            "groupName": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                            "replicas": _REPLICAS,
                            "minReplicas": _REPLICAS,
                            "maxReplicas": _REPLICAS,
                            "rayStartParams": _RAY_START_PARAMS,
                            "template": _TEMPLATE,
                        },
                    },
                },
            },
        },
    },
}


def validate_raycluster(obj: dict) -> None:
    """Raises jsonschema.ValidationError naming the offending path."""
    jsonschema.validate(obj, RAYCLUSTER_SCHEMA, cls=jsonschema.Draft202012Validator)


def ray_pod_templates(obj: dict) -> dict[str, dict]:
    """{group name ("head" for the head group): PodTemplateSpec} of one RayCluster."""
    spec = obj["spec"]
    templates = {"head": spec["headGroupSpec"]["template"]}
    for group in spec.get("workerGroupSpecs", []):
        templates[group["groupName"]] = group["template"]
    return templates
