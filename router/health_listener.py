"""A plaintext port that serves only the standard gRPC health service (`router.health_port`).

Kubernetes' native gRPC probes cannot speak TLS, and exec probes would start a Python process every
few seconds; with TLS on, the chart points its probes here instead. It answers from the router's own
health servicer, so it says SERVING exactly when the main port does (and NOT_SERVING while the
router drains), and it exposes nothing else: no generation, no status, no reflection.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from common.ports import cannot_listen


class HealthListener:
    def __init__(self, server: grpc.aio.Server, host: str, port: int):
        self._server, self.host, self.port = server, host, port

    @classmethod
    async def start(cls, health: HealthServicer, host: str, port: int) -> HealthListener:
        # No SO_REUSEPORT (gRPC's default): a port another router's listener holds must fail to bind, not be shared.
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        try:
            bound = server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:  # newer grpcio raises where older ones return 0
            bound = 0
        if bound == 0:
            raise cannot_listen("router.health_port", host, port)
        await server.start()
        return cls(server, host, bound)

    async def close(self) -> None:
        await self._server.stop(0)
