"""Scaling on Kubernetes: the planner's pool sizes become the RayCluster's worker-group replicas.

On KubeRay every pool is a worker group of the release's RayCluster (deploy/helm/splitserve/
templates/raycluster.yaml: groups `prefill` and `decode`, a decode group counting TP ranks as pods).
`RayClusterActuator.scale(role, replicas)` reads the RayCluster, builds a JSON Patch (RFC 6902) that
first *tests* the group's name at its index (a concurrent edit that reordered the groups makes the
API server refuse the patch instead of scaling the wrong pool), then replaces `replicas`, raising
`maxReplicas` or lowering `minReplicas` where the new count would leave their range, and sends it
through the `kubernetes` client's `CustomObjectsApi` as application/json-patch+json (the client's
default for custom objects is a merge patch, which would replace the whole group list). The chart's
Role lets the planner get and patch only this RayCluster.
`in_cluster(name, namespace)` builds one from the pod's service-account token (the chart mounts it
on the Ray head only, and only with the planner on: the controller is pinned there).
The controller still decides which workers drain: KubeRay adds or removes pods, the controller's
`scale` (cluster/controller.py) is what the planner calls on the Ray side.
"""

from __future__ import annotations

from typing import cast

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayclusters"
SERVICE_ACCOUNT_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def replicas_patch(raycluster: dict, group_name: str, pods: int, pods_to_delete: tuple[str, ...] = ()) -> list[dict]:
    """The JSON Patch setting worker group `group_name` of a RayCluster object to `pods` replicas;
    `pods_to_delete` names the pods that go (KubeRay's `scaleStrategy.workersToDelete`: without it a
    lower `replicas` removes no pod, since only the named ones are known to be idle)."""
    if pods < 1:
        raise ValueError(f"replicas: must be >= 1, got {pods}")
    groups = raycluster.get("spec", {}).get("workerGroupSpecs", [])
    index = next((i for i, g in enumerate(groups) if g.get("groupName") == group_name), None)
    if index is None:
        raise ValueError(
            f"RayCluster {raycluster.get('metadata', {}).get('name')!r} has no worker group "
            f"{group_name!r}; it has {[g.get('groupName') for g in groups]}"
        )
    path = f"/spec/workerGroupSpecs/{index}"
    ops: list[dict] = [
        {"op": "test", "path": f"{path}/groupName", "value": group_name},
        {"op": "replace", "path": f"{path}/replicas", "value": pods},
    ]
    group = groups[index]
    if group.get("maxReplicas", pods) < pods:
        ops.append({"op": "replace", "path": f"{path}/maxReplicas", "value": pods})
    if group.get("minReplicas", 0) > pods:
        ops.append({"op": "replace", "path": f"{path}/minReplicas", "value": pods})
    if pods_to_delete:  # "add" on an object member replaces it when present (RFC 6902 4.1)
        ops.append({"op": "add", "path": f"{path}/scaleStrategy", "value": {"workersToDelete": sorted(pods_to_delete)}})
    return ops


class RayClusterActuator:
    """`scale(role, replicas)` on the RayCluster `name` in `namespace` (pods = replicas x ranks)."""

    def __init__(self, name: str, namespace: str, api_client=None, decode_ranks: int = 1):
        from kubernetes import client

        self.name, self.namespace, self.decode_ranks = name, namespace, decode_ranks
        self.api = client.CustomObjectsApi(api_client)

    def scale(self, role: str, replicas: int, pods_to_delete: tuple[str, ...] = ()) -> list[dict]:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role: must be prefill or decode, got {role!r}")
        pods = replicas * (self.decode_ranks if role == "decode" else 1)
        # The client types custom objects as `object`; the API returns the RayCluster as a dict.
        current = cast(dict, self.api.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name))
        patch = replicas_patch(current, role, pods, pods_to_delete)
        self.api.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, self.name, patch, _content_type="application/json-patch+json"
        )
        return patch


def in_cluster(name: str, namespace: str | None, decode_ranks: int) -> RayClusterActuator:
    """An actuator authenticated by the pod's own service account; `namespace` None: the pod's."""
    from kubernetes import config

    config.load_incluster_config()
    if namespace is None:
        with open(SERVICE_ACCOUNT_NAMESPACE_FILE, encoding="utf-8") as f:
            namespace = f.read().strip()
    return RayClusterActuator(name, namespace, decode_ranks=decode_ranks)
