"""A model by Hub id on Kubernetes: with `model.hubCache` every pod that reads the model (the router
and each Ray group) mounts the cache read-only with HF_HOME pointing at it, the pods stay offline, the
rendered objects validate, and the cluster config carries the id, its revision and the served names;
without it nothing of the cache is rendered. With `model.download` each of those pods first runs an
init container that `hf download`s the id at its revision into the cache (writable there only); the
rendered command runs offline against a filled cache, and the chart refuses what it cannot fill."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest

from common.config import ClusterConfig
from tests.deploy.chart import KUBE_VERSION, chart, cluster_config_raw, objects, pod_templates

HUB = {
    "model": {"dir": "Qwen/Qwen3-30B-A3B", "hubCache": {"persistentVolumeClaim": {"claimName": "hf", "readOnly": True}},
              "hubCacheMountPath": "/hf"},
    "config": {"model_revision": "main", "served_model_name": ["qwen3-moe"], "max_model_len": 8192,
               "decode": {"expert_parallel": False}},
}


READERS = ("router", "ray-head", "ray-prefill", "ray-decode")  # the pods that read the model


def _model_readers(objs) -> dict[str, dict]:
    return {name: t for name, t in pod_templates(objs).items() if name in READERS}


def test_hub_cache_is_mounted_read_only_with_hf_home_in_every_model_reader():
    objs = objects(HUB)
    readers = _model_readers(objs)
    assert len(readers) == 4, sorted(readers)
    for component, template in readers.items():
        container = template["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HF_HOME"] == "/hf" and env["HF_HUB_OFFLINE"] == "1", component
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["hub-cache"]["mountPath"] == "/hf" and mounts["hub-cache"]["readOnly"], component
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["hub-cache"]["persistentVolumeClaim"]["claimName"] == "hf", component
    for obj in objs:
        if obj["kind"] == "Deployment":
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    raw = cluster_config_raw(objs)
    config = ClusterConfig.from_dict(raw)
    assert (config.model_dir, config.model_revision, config.served_model_name) == (
        "Qwen/Qwen3-30B-A3B", "main", ["qwen3-moe"])
    assert config.max_model_len == 8192 and config.decode.expert_parallel is False


def test_without_a_hub_cache_nothing_of_it_renders():
    for template in _model_readers(objects({})).values():
        container = template["spec"]["containers"][0]
        assert "HF_HOME" not in {e["name"] for e in container["env"]}
        assert "hub-cache" not in {m["name"] for m in container["volumeMounts"]}


DOWNLOAD = {
    "model": {"dir": "tiny-org/tiny-llama", "hubCache": {"persistentVolumeClaim": {"claimName": "hf"}},
              "hubCacheMountPath": "/hf", "download": {"enabled": True, "tokenSecret": "hf-token",
                                                       "extraArgs": ["--include", "*.json"]}},
    "config": {"model_revision": "v1"},
}


def test_download_init_container_fills_the_cache_in_every_model_reader():
    objs = objects(DOWNLOAD)
    readers = _model_readers(objs)
    assert len(readers) == 4, sorted(readers)
    for component, template in readers.items():
        (init,) = template["spec"]["initContainers"]
        assert init["command"] == ["hf", "download", "tiny-org/tiny-llama", "--revision", "v1", "--include", "*.json"]
        env = {e["name"]: e for e in init["env"]}
        assert env["HF_HOME"]["value"] == "/hf" and "HF_HUB_OFFLINE" not in env, component
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
        mounts = {m["name"]: m for m in init["volumeMounts"]}
        assert mounts["hub-cache"]["mountPath"] == "/hf" and not mounts["hub-cache"].get("readOnly"), component
        assert init["securityContext"]["readOnlyRootFilesystem"] and "tmp" in mounts
        # The serving container still reads the cache read-only and offline.
        container = template["spec"]["containers"][0]
        assert {m["name"]: m for m in container["volumeMounts"]}["hub-cache"]["readOnly"], component
        assert {e["name"]: e.get("value") for e in container["env"]}["HF_HUB_OFFLINE"] == "1"
    for obj in objs:
        if obj["kind"] == "Deployment":
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_without_download_no_init_container_renders():
    for values in ({}, HUB):
        for template in _model_readers(objects(values)).values():
            assert "initContainers" not in template["spec"]


def test_the_rendered_download_command_runs_against_a_filled_cache(tmp_path, checkpoint):
    """The init container's command line, run by the `hf` this project installs, offline against a
    cache that already holds the revision: it finds the snapshot (a download would only add files)."""
    from tests.engine.test_model_source import _hub_cache
    from tests.factories import TinySpec

    snapshot = _hub_cache(tmp_path / "hub", checkpoint(TinySpec()))
    (init,) = pod_templates(objects(DOWNLOAD))["router"]["spec"]["initContainers"]
    hf = Path(sys.executable).with_name("hf")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    done = subprocess.run([str(hf), *init["command"][1:]], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert str(snapshot) in done.stdout, done.stdout  # where it found (or would put) the files
    missing = subprocess.run([str(hf), "download", "tiny-org/absent"], env=env, capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode != 0


@pytest.mark.parametrize("model, message", [
    ({"dir": "org/name", "download": {"enabled": True}}, "set model.hubCache to a writable volume source"),
    ({"dir": "/models/llama", "hubCache": {"emptyDir": {}}, "download": {"enabled": True}},
     "model.dir must be a Hub id"),
    ({"dir": "org/name", "hubCache": {"persistentVolumeClaim": {"claimName": "hf", "readOnly": True}},
      "download": {"enabled": True}}, "readOnly must be false"),
])
def test_download_refuses_what_it_cannot_fill(model, message):
    chart().validate_schema({"model": model})
    with pytest.raises(helm_python.HelmRenderError, match=message):
        chart().render({"model": model}, name="rel", namespace="ns")
