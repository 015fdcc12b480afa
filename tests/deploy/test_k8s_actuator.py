"""The planner's Kubernetes actuator (cluster/k8s_actuator.py): the real `kubernetes` client sends its
JSON Patch to an HTTP server on loopback (the tests run no API server); the patch, applied
to the chart's rendered RayCluster, still validates against KubeRay's CRD and scales the right group."""
from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jsonschema
import pytest

from cluster.k8s_actuator import RayClusterActuator, replicas_patch
from tests.deploy.chart import NAMESPACE, objects, only
from tests.deploy.crd_schema import validate_custom_resource


def apply_patch(obj: dict, ops: list[dict]) -> dict:
    """RFC 6902 `test`, `replace` and `add` (on an object member) on object / list paths (all the
    actuator sends)."""
    out = copy.deepcopy(obj)
    for op in ops:
        *parents, last = [int(p) if p.isdigit() else p for p in op["path"].strip("/").split("/")]
        node = out
        for key in parents:
            node = node[key]
        if op["op"] == "test":
            if node[last] != op["value"]:
                raise ValueError(f"test failed at {op['path']}")
        elif op["op"] == "replace":
            node[last]  # noqa: B018  (replace needs the target to exist: KeyError otherwise)
            node[last] = op["value"]
        elif op["op"] == "add" and isinstance(node, dict):
            node[last] = op["value"]
        else:
            raise ValueError(f"unexpected op {op['op']}")
    return out


@pytest.fixture
def raycluster():
    return only(objects({}), "RayCluster")


def groups(obj):
    return {g["groupName"]: g for g in obj["spec"]["workerGroupSpecs"]}


def test_patch_scales_one_group_and_stays_valid(raycluster):
    before = groups(raycluster)
    patched = apply_patch(raycluster, replicas_patch(raycluster, "prefill", before["prefill"]["maxReplicas"] + 3))
    validate_custom_resource(patched)
    after = groups(patched)
    assert after["prefill"]["replicas"] == after["prefill"]["maxReplicas"] == before["prefill"]["maxReplicas"] + 3
    assert after["decode"] == before["decode"]
    shrunk = apply_patch(patched, replicas_patch(patched, "prefill", 1))
    validate_custom_resource(shrunk)
    assert groups(shrunk)["prefill"]["replicas"] == 1 and groups(shrunk)["prefill"]["minReplicas"] <= 1


def test_a_shrink_names_the_drained_pods_for_kuberay_and_stays_valid(raycluster):
    grown = apply_patch(raycluster, replicas_patch(raycluster, "decode", 3))
    shrunk = apply_patch(grown, replicas_patch(grown, "decode", 1, ("rel-decode-b", "rel-decode-a")))
    validate_custom_resource(shrunk)
    decode = groups(shrunk)["decode"]
    assert decode["replicas"] == 1 and decode["scaleStrategy"] == {"workersToDelete": ["rel-decode-a", "rel-decode-b"]}
    assert "scaleStrategy" not in groups(shrunk)["prefill"]


def test_a_reordered_cluster_refuses_the_patch_and_bad_input_is_named(raycluster):
    ops = replicas_patch(raycluster, "decode", 2)
    reordered = copy.deepcopy(raycluster)
    reordered["spec"]["workerGroupSpecs"].reverse()
    with pytest.raises(ValueError, match="test failed"):
        apply_patch(reordered, ops)
    with pytest.raises(ValueError, match="no worker group 'gpu'"):
        replicas_patch(raycluster, "gpu", 2)
    with pytest.raises(ValueError, match="replicas"):
        replicas_patch(raycluster, "decode", 0)
    bad = apply_patch(raycluster, [{"op": "replace", "path": "/spec/workerGroupSpecs/0/replicas", "value": "2"}])
    with pytest.raises(jsonschema.ValidationError):
        validate_custom_resource(bad)  # the CRD check is not vacuous


def test_actuator_sends_the_patch_through_the_kubernetes_client(raycluster):
    from kubernetes import client

    seen = []

    class Api(BaseHTTPRequestHandler):
        def do_GET(self):
            self._reply(raycluster)

        def do_PATCH(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers["Content-Type"], body))
            self._reply(apply_patch(raycluster, body))

        def _reply(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        config = client.Configuration(host=f"http://127.0.0.1:{server.server_port}")
        name = raycluster["metadata"]["name"]
        actuator = RayClusterActuator(name, NAMESPACE, client.ApiClient(config), decode_ranks=2)
        patch = actuator.scale("decode", 3)
    finally:
        server.shutdown()
        server.server_close()
    ((path, content_type, body),) = seen
    assert path == f"/apis/ray.io/v1/namespaces/{NAMESPACE}/rayclusters/{name}"
    assert content_type == "application/json-patch+json" and body == patch
    assert groups(apply_patch(raycluster, body))["decode"]["replicas"] == 6  # 3 instances x 2 ranks


def test_planner_rbac_renders_only_when_enabled_and_names_its_raycluster():
    import kubernetes_validate

    assert not [o for o in objects({}) if o["kind"] in ("Role", "RoleBinding")]
    objs = objects({"planner": {"enabled": True, "profile": {"format": "splitserve-profile/v1"}}})
    role, binding = only(objs, "Role"), only(objs, "RoleBinding")
    for obj in (role, binding):
        kubernetes_validate.validate(obj, "1.37.0", strict=True)
    (rule,) = role["spec"]["rules"] if "spec" in role else role["rules"]
    assert rule == {"apiGroups": ["ray.io"], "resources": ["rayclusters"],
                    "resourceNames": [only(objs, "RayCluster")["metadata"]["name"]], "verbs": ["get", "patch"]}
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == only(objs, "ServiceAccount")["metadata"]["name"]


def test_planner_values_render_its_config_profile_and_the_head_token_only():
    from common.config import ClusterConfig
    from tests.deploy.chart import cluster_config_raw, pod_templates

    off = objects({})
    assert cluster_config_raw(off)["planner"] == {"enabled": False}
    assert all(t["spec"]["automountServiceAccountToken"] is False for t in pod_templates(off).values())
    profile = {"format": "splitserve-profile/v1", "kind": "measured", "label": "l40s run"}
    objs = objects({"planner": {"enabled": True, "profile": profile},
                    "config": {"planner": {"interval_s": 10, "report_interval_s": 2, "ttft_ms": 500}}})
    raw = cluster_config_raw(objs)
    config = ClusterConfig.from_dict(raw).planner
    assert (config.enabled, config.interval_s, config.report_interval_s, config.ttft_ms) == (True, 10, 2, 500)
    assert config.raycluster_name == only(objs, "RayCluster")["metadata"]["name"]
    assert config.raycluster_namespace == NAMESPACE
    data = only(objs, "ConfigMap", "-config")["data"]
    assert config.profile_path == "/etc/splitserve/planner-profile.json"
    assert json.loads(data["planner-profile.json"]) == profile
    tokens = {c: t["spec"]["automountServiceAccountToken"] for c, t in pod_templates(objs).items()}
    assert tokens.pop("ray-head") is True and not any(tokens.values()), tokens  # the controller's pod only
    with pytest.raises(Exception, match="planner.profile"):
        objects({"planner": {"enabled": True}})
