"""A model by Hub id on Kubernetes: with `model.hubCache` every pod that reads the model (the router
and each Ray group) mounts the cache read-only with HF_HOME pointing at it, the pods stay offline, the
rendered objects validate, and the cluster config carries the id, its revision and the served names;
without it nothing of the cache is rendered."""
from __future__ import annotations

import kubernetes_validate

from common.config import ClusterConfig
from tests.deploy.chart import KUBE_VERSION, cluster_config_raw, objects, pod_templates

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
