"""The cluster's torch.distributed rendezvous store, in an actor of its own.

Every KV transport channel and tensor-parallel group meets through one TCPStore per cluster
(`kvtransfer.store`). Workers keep a connection to it for their whole life, so it must outlive
everything that can crash and come back: it is not hosted by a router (whose death would strand the
workers) nor by the controller (whose restart would move it), but by this small detached actor that
does nothing else. The controller creates it once per cluster, finds it again after a restart, and
publishes its address to the workers it starts. Like the controller it asks for no CPU.
"""

from __future__ import annotations

import ray

from kvtransfer.store import create_rendezvous_store


class RendezvousHost:
    def __init__(self, host: str | None):
        """`host`: the address workers dial (the store listens on every interface); None: this node's IP."""
        self._store = create_rendezvous_store(host or ray.util.get_node_ip_address())

    async def address(self) -> tuple[str, int]:
        return self._store.host, self._store.port


def rendezvous_name(cluster_name: str) -> str:
    return f"{cluster_name}:rendezvous"


async def ensure_rendezvous(cluster_name: str, host: str | None) -> tuple[object, tuple[str, int]]:
    """The cluster's rendezvous host (created if it does not exist yet) and its store's address."""
    actor = (
        ray.remote(RendezvousHost)
        .options(
            name=rendezvous_name(cluster_name), get_if_exists=True, lifetime="detached", num_cpus=0, max_restarts=0
        )
        .remote(host)
    )
    # Ray's stubs type a handle's methods as the class's plain methods, without .remote().
    return actor, tuple(await actor.address.remote())  # type: ignore[attr-defined]
