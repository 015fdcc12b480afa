"""A private Redis Cluster for tests and benches: N `redis-server --cluster-enabled yes` nodes on free
127.0.0.1 ports, joined with `redis-cli --cluster create` (no replicas), each a `RedisServer` so a
test can kill one by PID (a shard going away)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

from tests.redis_server import RedisServer

REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


class ClusterNode(RedisServer):
    """One cluster-enabled node (its cluster state file lives in its own workdir). Its port is at most
    55535: a node also listens on port + 10000 for the cluster bus."""

    def __init__(self, workdir: str):
        super().__init__(port=_free_bus_port(), workdir=workdir)

    def _command(self) -> list[str]:
        return [
            *super()._command(),
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "2000",
        ]


def _free_bus_port() -> int:
    for _ in range(200):
        port = random.randrange(20000, 55535)
        if _free(port) and _free(port + 10000):
            return port
    raise RuntimeError("found no free port pair for a redis cluster node")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class RedisClusterNodes:
    def __init__(self, num_shards: int = 3, workdir: str | None = None):
        self._owns_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="redis-cluster-"))
        self.nodes = [ClusterNode(workdir=str(self.workdir / f"node{i}")) for i in range(num_shards)]

    @property
    def seeds(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", node.port) for node in self.nodes]

    @property
    def url(self) -> str:
        """The `redis+cluster://` URL with every node as a seed."""
        return "redis+cluster://" + ",".join(f"{host}:{port}" for host, port in self.seeds)

    def start(self, timeout_s: float = 30.0) -> Self:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=timeout_s,
        )
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis cluster on {addresses} did not reach state ok in {timeout_s} s")
            time.sleep(0.05)
        return self

    def flush_all(self) -> None:
        """Empties every live shard (between tests sharing one cluster)."""
        for node in self.nodes:
            if node.pid is not None:
                subprocess.run(
                    [REDIS_CLI, "-p", str(node.port), "flushall"], check=True, capture_output=True, timeout=10
                )

    def kill(self, index: int) -> None:
        """SIGKILL shard `index` (its slots stay unserved: no replica takes over)."""
        self.nodes[index].kill()

    def _ready(self) -> bool:
        for node in self.nodes:
            out = subprocess.run(
                [REDIS_CLI, "-p", str(node.port), "cluster", "info"], capture_output=True, text=True, timeout=10
            ).stdout
            if "cluster_state:ok" not in out:
                return False
        return True

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        for node in self.nodes:
            node.kill()
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
