"""The router process: builds the service around a launched cluster and serves it over grpc.aio.

    server = await RouterServer.start(launched_cluster, cluster_config)
    print(server.address)        # 127.0.0.1:PORT (port 0 in the config: the OS picks)
    ...
    await server.stop()

What it wires: the tokenizer (if the checkpoint has one), the prefix index (in-process, fed from the
workers' KV events; Redis when `redis_url` is set), the routing policy, the worker monitor, the
Router servicer behind the auth and error interceptors, the standard health service and reflection,
and the OpenAI-compatible HTTP front (`router.openai`) over the same service, token and metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from cluster.cluster_view import ClusterView
from cluster.launcher import LaunchedCluster
from common import tracing
from common.config import ClusterConfig, ConfigError
from common.metrics_http import start_metrics_server
from common.router_config import API_KEY_ENV
from policies.admission.gate import AdmissionGate
from policies.routing import make_policy
from router.health_listener import HealthListener
from router.index_feeder import IndexFeeder
from router.interceptors import AccessLogInterceptor, AuthInterceptor, ErrorInterceptor
from router.metrics import RouterMetrics
from router.openai import HttpFront
from router.service import RouterService
from router.servicer import RouterServicer
from router.tls import load_server_tls, server_ssl_context
from router.tls_credentials import bind
from splitserve_client.protocol import splitserve_v1_pb2 as pb
from splitserve_client.protocol import splitserve_v1_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Router"].full_name
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class RouterServer:
    def __init__(
        self,
        server,
        service: RouterService,
        health: HealthServicer,
        port: int,
        host: str,
        background: list,
        exporter=None,
        http=None,
    ):
        self.server, self.service, self.health = server, service, health
        self.port, self.host = port, host
        self._background = background  # feeder / monitor / index: closed on stop
        self.exporter = exporter  # the Prometheus endpoint, when metrics_port is set
        self.http = http  # the OpenAI-compatible HTTP front (router.openai.HttpFront), unless turned off

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def health_port(self) -> int | None:
        """The plaintext health-only port (`router.health_port`), when configured."""
        return next((part.port for part in self._background if isinstance(part, HealthListener)), None)

    @classmethod
    async def start(
        cls,
        launched: LaunchedCluster,
        config: ClusterConfig,
        extra_addresses: tuple[str, ...] | list[str] = (),
        http_uds: str | None = None,
    ) -> RouterServer:
        """Serves gRPC on router.host:router.port, plus `extra_addresses` (e.g. "unix:/path/router.sock"), and
        the OpenAI-compatible HTTP API on router.host:router.http_port and/or the unix socket `http_uds`, for
        the cluster `launched` joined; follows its membership from then on."""
        router = config.router
        tracing.configure(config.otlp_traces_endpoint, "splitserve-router")
        load_server_tls(router)  # unusable TLS files fail here, before anything starts
        cluster = ClusterView(launched)
        index, feeder = await _make_index(cluster, config)
        metrics = RouterMetrics(model_name=served_model_names(cluster.model_dir, cluster.config.served_model_name)[0])
        service = RouterService(
            cluster,
            make_policy(router.policy, index),
            tokenizer=_load_tokenizer(cluster),
            max_concurrent_requests=router.max_concurrent_requests,
            index=index,
            metrics=metrics,
            admission=_make_admission(cluster, config),
        )
        metrics.track_inflight(lambda: service.inflight_requests)
        cluster.outage_listeners.append(metrics.controller_outage)
        interceptors: list[grpc.aio.ServerInterceptor] = [AccessLogInterceptor(), ErrorInterceptor(metrics)]
        token = read_auth_token(router.auth_token_file, os.environ.get(API_KEY_ENV))
        chat_template = read_chat_template(router.chat_template)
        if token is not None:
            interceptors.insert(1, AuthInterceptor(token))
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                # gRPC sets SO_REUSEPORT by default: a second router given this one's port would then share
                # it silently (the kernel splitting connections between them) instead of failing to bind.
                ("grpc.so_reuseport", 0),
            ],
        )
        pb_grpc.add_RouterServicer_to_server(RouterServicer(service), server)
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        reflection.enable_server_reflection((SERVICE_NAME, "grpc.health.v1.Health", reflection.SERVICE_NAME), server)
        background: list = [None, cluster, feeder, service.monitor, service.traffic, service, index]
        exporter = http = None
        try:
            # gRPC and metrics bind before any background task runs (health and HTTP follow the gRPC start).
            port = bind(server, router, extra_addresses)  # TLS on every address when configured
            if router.metrics_port is not None:
                exporter = start_metrics_server(
                    metrics.registry, router.metrics_port, router.host, key="router.metrics_port"
                )
                log.info("router metrics on http://%s:%d/metrics", exporter.host, exporter.port)
            cluster.start()
            service.monitor.start()
            service.traffic.start()
            if feeder is not None:
                feeder.start()
            await server.start()
            if router.health_port is not None:
                background[0] = await HealthListener.start(health, router.host, router.health_port)
            for name in ("", SERVICE_NAME):
                await health.set(name, health_pb2.HealthCheckResponse.SERVING)
            log.info(
                "router serving %s on %s:%d (policy %s%s)",
                SERVICE_NAME,
                router.host,
                port,
                router.policy,
                ", TLS" if router.tls_cert_file else "",
            )
            if router.http_port is not None or http_uds is not None:
                http = await HttpFront.start(
                    service,
                    host=router.host,
                    port=router.http_port,
                    uds=http_uds,
                    token=token,
                    model_names=served_model_names(cluster.model_dir, cluster.config.served_model_name),
                    ssl_context=server_ssl_context(router),
                    tool_call_parser=router.tool_call_parser,
                    reasoning_parser=router.reasoning_parser,
                    chat_template=chat_template,
                    trust_request_chat_template=router.trust_request_chat_template,
                )
                log.info("router serving the OpenAI API on %s", http.url if router.http_port is not None else http_uds)
        except BaseException:
            # Nothing this start began outlives it: another router (or program) keeps the port it holds,
            # and this process's tasks, threads and listeners end here.
            await _discard(server, exporter, background)
            raise
        return cls(server, service, health, port, router.host, background, exporter, http)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stops taking calls, lets streams in flight end for `grace_s`, then cancels the rest."""
        await self.health.enter_graceful_shutdown()
        await asyncio.gather(self.server.stop(grace_s), *([self.http.stop(grace_s)] if self.http else []))
        for part in self._background:
            if part is not None:
                await part.close()
        if self.exporter is not None:
            self.exporter.stop()


async def _discard(server, exporter, background: list) -> None:
    """Stops what a failed start had begun; a failure here must not hide the one that ended the start."""
    try:
        await server.stop(0)
    except Exception:
        log.debug("stopping the gRPC server of a failed start", exc_info=True)
    for part in background:
        if part is not None:
            try:
                await part.close()
            except Exception:
                log.debug("closing %s of a failed start", type(part).__name__, exc_info=True)
    if exporter is not None:
        exporter.stop()


async def _make_index(cluster: ClusterView, config: ClusterConfig):
    """Redis when configured (the workers publish into it; several routers share it), else an
    in-process index this router feeds by pulling the workers' KV events."""
    from prefix_index import IndexNamespace, make_prefix_index

    info = cluster.prefill[0].info
    namespace = IndexNamespace(info.model_identity, info.block_size)
    index = make_prefix_index(config.redis_url, namespace, config.index_lease_s)
    if config.redis_url is not None:
        return index, None
    # An idle worker's long poll comes back within a quarter of the lease: its entries never lapse meanwhile.
    feeder = IndexFeeder(
        cluster, index, interval_s=config.router.index_poll_interval_s, max_wait_s=min(1.0, config.index_lease_s / 4)
    )
    return index, feeder


def _make_admission(cluster: ClusterView, config: ClusterConfig) -> AdmissionGate | None:
    """None for the `always` policy: admitting everything needs no view of the cluster."""
    if config.admission.policy == "always":
        return None
    return AdmissionGate(
        config.admission,
        cluster.prefill[0].info.kv_bytes_per_token,
        config.block_size,
        config.prefill.max_num_batched_tokens,
    )


def _load_tokenizer(cluster: ClusterView):
    if not (Path(cluster.model_dir) / "tokenizer.json").is_file():
        log.warning("%s has no tokenizer.json: only token-id prompts will be accepted", cluster.model_dir)
        return None
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(cluster.model_dir)


def served_model_names(model_dir, served: list[str] | None = None) -> tuple[str, ...]:
    """The names the OpenAI API answers to: `served_model_name` when set (the first is the one responses
    carry), else the checkpoint folder's name and the path it was served from."""
    return tuple(served) if served else (Path(model_dir).name, str(model_dir))


def read_auth_token(path: str | None, api_key: str | None = None) -> str | None:
    """The bearer token: the one in `path` (surrounding whitespace stripped), or the API key given in the
    environment (`--api-key` / SPLITSERVE_API_KEY, as vLLM takes it); None when auth is off. Both guard the
    same routes, gRPC and HTTP, so only one may be given."""
    if api_key is not None and path is not None:
        raise ConfigError(f"router.auth_token_file: {API_KEY_ENV} is set too; give the token one way")
    if api_key is not None:
        if not api_key.strip():
            raise ConfigError(f"{API_KEY_ENV}: is empty")
        return api_key.strip()
    if path is None:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as err:
        raise ConfigError(f"router.auth_token_file: cannot read {path}: {err.strerror}") from None
    if not token:
        raise ConfigError(f"router.auth_token_file: {path} is empty")
    return token


def read_chat_template(path: str | None) -> str | None:
    """The Jinja text of `router.chat_template` (a file), or None: the checkpoint's own template."""
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"router.chat_template: cannot read {path}: {err.strerror}") from None
