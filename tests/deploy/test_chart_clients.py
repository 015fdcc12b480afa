"""Invariants of the release's client-facing security and its `helm test` hook: the files the TLS
settings name are the mounted Secrets' keys (whole Secrets, so renewals reach the pods), and the test
pod is a client of the release with the right target, CA, client certificate and token."""
from __future__ import annotations

import argparse

import pytest

from splitserve_client.cli_args import add_connection_flags
from tests.deploy.chart import MATRIX, NAMESPACE, cluster_config_raw, objects, of_kind, only, pod_templates

matrix = pytest.mark.parametrize("case", sorted(MATRIX))


@matrix
def test_tls_files_are_the_mounted_secrets(case):
    values, objs = MATRIX[case], objects(MATRIX[case])
    tls = values.get("tls", {})
    config = cluster_config_raw(objs)["router"]
    router = pod_templates(objs)["router"]["spec"]
    service = only(objs, "Service", "-router")
    grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    if not tls.get("enabled"):
        assert not {"tls_cert_file", "tls_key_file", "tls_client_ca_file", "health_port"} & config.keys()
        assert grpc_port["appProtocol"] == "kubernetes.io/h2c"
        return
    assert "appProtocol" not in grpc_port, "TLS end to end: not cleartext HTTP/2"
    mounts = {m["name"]: m["mountPath"] for m in router["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v["secret"] for v in router["volumes"] if "secret" in v}
    secret = tls.get("existingSecret") or "rel-splitserve-router-tls"
    assert volumes["tls"]["secretName"] == secret and "items" not in volumes["tls"], "renewals must reach the pod"
    assert config["tls_cert_file"] == f"{mounts['tls']}/tls.crt" and config["tls_key_file"] == f"{mounts['tls']}/tls.key"
    client_ca = tls.get("clientCA", {})
    if client_ca.get("existingSecret"):
        key = client_ca.get("key", "ca.crt")
        assert volumes["client-ca"]["secretName"] == client_ca["existingSecret"]
        assert config["tls_client_ca_file"] == f"{mounts['client-ca']}/{key}"
    else:
        assert "tls_client_ca_file" not in config and "client-ca" not in volumes
    certificates = {c["spec"]["secretName"]: c for c in of_kind(objs, "Certificate")}
    if tls.get("certManager", {}).get("enabled"):
        names = certificates[secret]["spec"]["dnsNames"]
        assert f"{service['metadata']['name']}.{NAMESPACE}.svc" in names, "the name clients dial"
        assert set(tls["certManager"].get("extraDnsNames", [])) <= set(names)


@matrix
def test_helm_test_pod_checks_health_then_generates_as_a_client_of_the_release(case):
    values, objs = MATRIX[case], objects(MATRIX[case])
    pods = of_kind(objs, "Pod")
    if values.get("test", {}).get("enabled", True) is False:
        assert pods == []
        return
    (pod,) = pods
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test" and pod["spec"]["restartPolicy"] == "Never"
    (health,), (generate,) = pod["spec"]["initContainers"], pod["spec"]["containers"]
    assert health["command"][:2] == ["splitserve", "health"] and generate["command"][:2] == ["splitserve", "generate"]
    service = only(objs, "Service", "-router")
    target = f"{service['metadata']['name']}.{NAMESPACE}.svc:{service['spec']['ports'][0]['port']}"
    parser = argparse.ArgumentParser()
    add_connection_flags(parser)
    parser.add_argument("--timeout-s")
    for container in (health, generate):
        args, _ = parser.parse_known_args(container["command"][2:])
        assert args.target == target
        files = [f for f in (args.tls_ca_file, args.tls_cert_file, args.tls_key_file, args.auth_token_file) if f]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        for path in files:  # every file a flag names is a key of a mounted Secret
            folder, key = path.rsplit("/", 1)
            assert key in {i["path"] for i in volumes[mounts[folder]]["secret"]["items"]}, path
        tls = values.get("tls", {})
        assert bool(args.tls_ca_file or args.tls) == bool(tls.get("enabled"))
        assert bool(args.tls_cert_file) == bool(tls.get("enabled") and tls.get("clientCA", {}).get("existingSecret"))
        assert bool(args.auth_token_file) == bool(values.get("auth", {}).get("enabled"))
    generated = parser.parse_known_args(generate["command"][2:])[1]
    assert generated[-1] == values.get("test", {}).get("prompt", "Hello") and "--max-tokens" in generated
