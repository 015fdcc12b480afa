"""What the controller must find again after its process dies: kept in Ray's GCS key-value store.

Ray restarts a dead controller (`max_restarts`), but nothing in its memory survives. Workers are
detached actors that outlive it, so the restarted controller re-adopts them from this record: the
cluster's id, its desired config (with every `scale` applied), the epoch counter, the membership
version, and for every pool slot the names of the actors (and placement group) of its current start.
Names are the controller's own bookkeeping for finding its actors again; nobody else uses them.

The record is JSON under one key per cluster name, rewritten whole on every change (a few KB).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from ray.experimental import internal_kv

KV_NAMESPACE = "splitserve"
STATE_VERSION = 1


@dataclass
class SlotRecord:
    worker_id: str
    role: str
    index: int
    epoch: int
    actor_names: list[str]  # rank 0 first
    placement_group: str | None
    state: str  # "starting" | "serving" | "draining"
    restarts: int = 0


@dataclass
class ControllerState:
    cluster_name: str
    cluster_id: str
    config: dict  # ClusterConfig.to_dict(), replicas as last scaled
    model_dir: str
    next_epoch: int = 1
    version: int = 0  # membership version last published
    slots: list[SlotRecord] = field(default_factory=list)

    def save(self) -> None:
        raw = dataclasses.asdict(self)
        raw["state_version"] = STATE_VERSION
        internal_kv._internal_kv_put(
            _key(self.cluster_name), json.dumps(raw).encode(), overwrite=True, namespace=KV_NAMESPACE
        )

    @classmethod
    def load(cls, cluster_name: str) -> ControllerState | None:
        blob = internal_kv._internal_kv_get(_key(cluster_name), namespace=KV_NAMESPACE)
        if blob is None:
            return None
        raw = json.loads(blob)
        if raw.pop("state_version", None) != STATE_VERSION:
            raise RuntimeError(f"cluster {cluster_name!r}: controller state of another version in Ray's GCS")
        raw["slots"] = [SlotRecord(**slot) for slot in raw["slots"]]
        return cls(**raw)

    @staticmethod
    def delete(cluster_name: str) -> None:
        internal_kv._internal_kv_del(_key(cluster_name), namespace=KV_NAMESPACE)

    def take_epoch(self) -> int:
        epoch, self.next_epoch = self.next_epoch, self.next_epoch + 1
        return epoch


def _key(cluster_name: str) -> bytes:
    return f"cluster/{cluster_name}/controller".encode()
