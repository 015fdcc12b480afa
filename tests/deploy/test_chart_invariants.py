"""Cross-object invariants of the rendered release: what schemas cannot see.

Ports line up (Service → container, probes, NetworkPolicy, config), selectors select the pods they
are meant for, the config the router reads points at objects that exist, and the worker groups
advertise exactly the Ray resources the pools will ask for.
"""
from __future__ import annotations

import json
import shlex

import pytest

from tests.deploy.chart import (
    CONFIG_PATH,
    MATRIX,
    NAMESPACE,
    RELEASE,
    cluster_config_raw,
    objects,
    of_kind,
    only,
    pod_templates,
)

matrix = pytest.mark.parametrize("case", sorted(MATRIX))
# What a worker needs to land on its own worker group and join the right cluster: always rendered,
# never left to a default that only fits a laptop.
PLACEMENT_KEYS = {"replicas", "tp_size", "num_cpus", "num_gpus", "ray_resource"}


def _selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels + In/NotIn expressions) against a label set."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        present = labels.get(expr["key"]) in expr["values"]
        if present != (expr["operator"] == "In"):
            return False
    return True


def _selected(selector: dict, objs: list[dict]) -> set[str]:
    return {c for c, t in pod_templates(objs).items() if _selects(selector, t["metadata"]["labels"])}


def _container_port(template: dict, port) -> int:
    """Resolve a numeric or named port against the pod's containers."""
    ports = [p for c in template["spec"]["containers"] for p in c.get("ports", [])]
    if isinstance(port, int):
        assert port in {p["containerPort"] for p in ports}, f"no container listens on {port}"
        return port
    named = {p["name"]: p["containerPort"] for p in ports}
    assert port in named, f"no container port named {port!r}; have {sorted(named)}"
    return named[port]


@matrix
def test_workload_and_service_selectors_pick_exactly_their_pods(case):
    objs = objects(MATRIX[case])
    for workload in of_kind(objs, "Deployment") + of_kind(objs, "StatefulSet"):
        spec = workload["spec"]
        assert _selects(spec["selector"], spec["template"]["metadata"]["labels"])
    for service in of_kind(objs, "Service"):
        component = service["metadata"]["labels"]["app.kubernetes.io/component"]
        assert _selected({"matchLabels": service["spec"]["selector"]}, objs) == {component}
    for pdb in of_kind(objs, "PodDisruptionBudget"):
        assert _selected(pdb["spec"]["selector"], objs) == {"router"}


@matrix
def test_service_target_ports_are_container_ports(case):
    objs = objects(MATRIX[case])
    templates = pod_templates(objs)
    for service in of_kind(objs, "Service"):
        template = templates[service["metadata"]["labels"]["app.kubernetes.io/component"]]
        for port in service["spec"]["ports"]:
            _container_port(template, port["targetPort"])


@matrix
def test_router_port_is_one_number_everywhere(case):
    objs = objects(MATRIX[case])
    router = pod_templates(objs)["router"]
    config = cluster_config_raw(objs)["router"]
    port = config["port"]
    assert _container_port(router, "grpc") == port
    http_port = config["http_port"]
    assert _container_port(router, "http") == http_port != port
    # Without TLS the probes GET /health on the HTTP front; with TLS, Kubernetes' gRPC probes (plaintext)
    # ask the health-only port.
    assert ("health_port" in config) == ("tls_cert_file" in config)
    container = router["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if "health_port" in config:
            assert container[probe]["grpc"] == {"port": config["health_port"]}, probe
        else:
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    if "health_port" in config:
        assert _container_port(router, "health") == config["health_port"] not in (port, http_port)
    service = only(objs, "Service", "-router")
    assert {"grpc", "http"} <= {p["targetPort"] for p in service["spec"]["ports"]}
    metrics_port = cluster_config_raw(objs)["router"].get("metrics_port")
    if metrics_port is not None:
        assert _container_port(router, "metrics") == metrics_port


@matrix
def test_network_policies_open_the_router_only(case):
    values, objs = MATRIX[case], objects(MATRIX[case])
    policies = {p["metadata"]["name"].rsplit("-", 1)[1]: p["spec"] for p in of_kind(objs, "NetworkPolicy")}
    if values.get("networkPolicy", {}).get("enabled", True) is False:
        assert policies == {}
        return
    router_templates = pod_templates(objs)["router"]
    assert _selected(policies["router"]["podSelector"], objs) == {"router"}
    outside, inside = policies["router"]["ingress"]
    exposed = {_container_port(router_templates, p["port"]) for p in outside["ports"]}
    config = cluster_config_raw(objs)["router"]
    assert exposed == {config["port"], config["http_port"],
                       *([config["metrics_port"]] if "metrics_port" in config else [])}
    assert outside.get("from", []) == values.get("networkPolicy", {}).get("routerFrom", [])
    ray_components = {"ray-head", "ray-prefill", "ray-decode"}
    assert _selected(policies["ray"]["podSelector"], objs) == ray_components
    ray_rules = policies["ray"]["ingress"]
    pod_monitor = values.get("metrics", {}).get("podMonitor", {})
    if pod_monitor.get("enabled"):  # Prometheus scrapes the workers: their metrics port only, from its peers
        *ray_rules, scrape = ray_rules
        assert [p["port"] for p in scrape["ports"]] == ["worker-metrics"]
        assert scrape.get("from", []) == pod_monitor.get("from", [])
    for rule in (inside, *ray_rules, *policies.get("redis", {}).get("ingress", [])):
        release_peer = rule["from"][0]["podSelector"]
        assert "namespaceSelector" not in rule["from"][0]
        assert _selected(release_peer, objs) == set(pod_templates(objs)), "peer must be every pod of the release"
    if "redis" in policies:
        assert _selected(policies["redis"]["podSelector"], objs) == {"redis"}


@matrix
def test_config_addresses_point_at_rendered_objects(case):
    objs = objects(MATRIX[case])
    config = cluster_config_raw(objs)
    ray = only(objs, "RayCluster")
    head_client = _container_port(ray["spec"]["headGroupSpec"]["template"], "client")
    # KubeRay names the head Service "<RayCluster name>-head-svc".
    expected = f"ray://{ray['metadata']['name']}-head-svc.{NAMESPACE}.svc:{head_client}"
    args = pod_templates(objs)["router"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["--ray-address", expected] and "ray_address" not in config
    assert len(f"{ray['metadata']['name']}-head-svc") <= 50, "KubeRay would shorten the name"
    redis = [s for s in of_kind(objs, "Service") if s["metadata"]["name"].endswith("-redis")]
    external = MATRIX[case].get("redis", {}).get("external", {})
    if redis:
        port = redis[0]["spec"]["ports"][0]["port"]
        assert config["redis_url"] == f"redis://{redis[0]['metadata']['name']}.{NAMESPACE}.svc:{port}/0"
    elif external.get("url"):
        assert config["redis_url"] == external["url"]
    else:
        assert "redis_url" not in config


def test_redis_url_from_a_secret_reaches_the_router_as_a_flag_only():
    objs = objects(MATRIX["external-redis-secret"])
    assert "redis_url" not in cluster_config_raw(objs)
    container = pod_templates(objs)["router"]["spec"]["containers"][0]
    assert container["args"][2:] == ["--redis-url", "$(SPLITSERVE_REDIS_URL)"]
    env = {e["name"]: e for e in container["env"]}
    assert env["SPLITSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "redis-conn", "key": "redis-url"}


@matrix
def test_worker_groups_advertise_what_the_pools_ask_for(case):
    objs = objects(MATRIX[case])
    config = cluster_config_raw(objs)
    groups = {g["groupName"]: g for g in only(objs, "RayCluster")["spec"]["workerGroupSpecs"]}
    for name in ("prefill", "decode"):
        pool, group = config[name], groups[name]
        assert PLACEMENT_KEYS <= pool.keys(), name
        actors_per_pod = pool["tp_size"]  # a prefill pod hosts one actor, a decode pod one instance
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == pool["replicas"]
        params = group["rayStartParams"]
        assert _advertised_resources(params["resources"]) == {pool["ray_resource"]: actors_per_pod}
        assert float(params["num-cpus"]) >= actors_per_pod * pool["num_cpus"]
        limits = group["template"]["spec"]["containers"][0]["resources"].get("limits", {})
        gpus = actors_per_pod * pool["num_gpus"]
        assert int(params.get("num-gpus", "0")) == gpus
        assert int(limits.get("nvidia.com/gpu", 0)) == gpus
    head_params = only(objs, "RayCluster")["spec"]["headGroupSpec"]["rayStartParams"]
    assert head_params["num-cpus"] == "0", "no worker actor may be placed on the head"


def _advertised_resources(param: str) -> dict:
    """What `ray start --resources=<param>` receives once bash has parsed KubeRay's command line."""
    (argument,) = shlex.split(param)
    return json.loads(argument)


@matrix
def test_config_and_model_are_mounted_in_router_and_ray_pods(case):
    values, objs = MATRIX[case], objects(MATRIX[case])
    config_dir, config_file = CONFIG_PATH.rsplit("/", 1)
    model = values.get("model", {})
    for component, template in pod_templates(objs).items():
        if component in ("redis", "test"):
            continue
        mounts = {m["mountPath"]: m["name"] for m in template["spec"]["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes[mounts[config_dir]]["configMap"]["name"] == only(objs, "ConfigMap", "-config")["metadata"]["name"]
        if model.get("volume"):
            assert mounts.get(model.get("mountPath", "/models")) == "model", component
            assert cluster_config_raw(objs)["model_dir"].startswith(model.get("mountPath", "/models") + "/")
    assert config_file == "cluster.yaml"
    command = pod_templates(objs)["router"]["spec"]["containers"][0]["command"]
    assert command == ["splitserve", "serve", "--config", CONFIG_PATH]


@matrix
def test_auth_token_file_is_the_mounted_secret_key(case):
    values, objs = MATRIX[case], objects(MATRIX[case])
    router = pod_templates(objs)["router"]["spec"]
    token_file = cluster_config_raw(objs)["router"].get("auth_token_file")
    auth = values.get("auth", {})
    if not auth.get("enabled"):
        assert token_file is None and "auth" not in {v["name"] for v in router["volumes"]}
        assert of_kind(objs, "Secret") == []
        return
    mount = next(m for m in router["containers"][0]["volumeMounts"] if m["name"] == "auth")
    volume = next(v for v in router["volumes"] if v["name"] == "auth")["secret"]
    (item,) = volume["items"]
    assert token_file == f"{mount['mountPath']}/{item['path']}"
    assert item["key"] == auth.get("secretKey", "token")
    secrets = of_kind(objs, "Secret")
    if auth.get("existingSecret"):
        assert volume["secretName"] == auth["existingSecret"] and secrets == []
    else:
        (secret,) = secrets
        assert volume["secretName"] == secret["metadata"]["name"] and item["key"] in secret["data"]


@matrix
def test_every_pod_runs_non_root_and_locked_down(case):
    planner = MATRIX[case].get("planner", {}).get("enabled", False)
    for component, template in pod_templates(objects(MATRIX[case])).items():
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, component
        assert pod["securityContext"]["runAsUser"] > 0, component
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, component
        # the one exception: the Ray head, where the planner's controller patches the RayCluster
        assert pod["automountServiceAccountToken"] is (planner and component == "ray-head"), component
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, component
            assert context["capabilities"]["drop"] == ["ALL"], component
            assert context["readOnlyRootFilesystem"] is True, component
        assert {"/tmp", "/data"} & {m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"]}, component


@matrix
def test_routers_are_peers_that_join_the_ray_cluster(case):
    values, objs = MATRIX[case], objects(MATRIX[case])
    router = only(objs, "Deployment", "-router")
    replicas = values.get("router", {}).get("replicas", 2)
    assert router["spec"]["replicas"] == replicas and router["spec"]["strategy"]["type"] == "RollingUpdate"
    container = router["spec"]["template"]["spec"]["containers"][0]
    # The command line the controller design fixes: serve joins (or first starts) the cluster's controller.
    assert container["command"] + container["args"][:2] == ["splitserve", "serve", "--config", CONFIG_PATH,
                                                             "--ray-address", cluster_ray_address(objs)]
    assert "POD_IP" not in {e["name"] for e in container["env"]}, "no worker dials a router pod any more"
    pdbs = of_kind(objs, "PodDisruptionBudget")
    budget = values.get("router", {}).get("podDisruptionBudget", {})
    assert len(pdbs) == (1 if budget.get("enabled", True) else 0)
    for pdb in pdbs:
        assert pdb["spec"]["maxUnavailable"] == budget.get("maxUnavailable", 1) and "minAvailable" not in pdb["spec"]
    affinity = router["spec"]["template"]["spec"]["affinity"]
    (term,) = affinity["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert _selects(term["podAffinityTerm"]["labelSelector"], router["spec"]["template"]["metadata"]["labels"])


def cluster_ray_address(objs: list[dict]) -> str:
    ray = only(objs, "RayCluster")
    return f"ray://{ray['metadata']['name']}-head-svc.{NAMESPACE}.svc:10001"


def test_one_cluster_per_release_and_no_rendezvous_in_the_router_pod():
    """The controller of the release's cluster (named after the release) owns the pools and the
    rendezvous store lives in the Ray cluster: a router pod carries neither, so losing one loses neither."""
    for case in ("defaults", "gpu"):
        objs = objects(MATRIX[case])
        assert cluster_config_raw(objs)["cluster_name"] == f"{RELEASE}-splitserve"
        container = pod_templates(objs)["router"]["spec"]["containers"][0]
        assert "--rendezvous-host" not in container.get("args", [])
