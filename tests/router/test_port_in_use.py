"""A router whose port is taken (gRPC, HTTP, health, metrics) fails with PortInUse naming the config key
and the port, leaves nothing of its own running, and the router holding the port goes on serving; the
command line turns the error into one line naming the flag (or the config file's key), without a
traceback. All servers are real ones on loopback."""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.metrics_http import scrape
from common.ports import CannotListen, CannotListenOnSocket, PortInUse
from router.server import RouterServer
from splitserve.serve import build_config, parser, port_error_line
from splitserve_client import Client
from tests.router.conftest import router_config
from tests.sandbox_guard import require_sandbox

KEYS = ("port", "http_port", "metrics_port", "health_port")
SPLITSERVE = [sys.executable, "-m", "splitserve.cli"]


@pytest.fixture(scope="module")
def first(router_stack):
    """A router with every kind of listener, on the package's cluster (ports picked by the OS)."""
    server = router_stack.loop.call(
        RouterServer.start(router_stack.cluster, router_config(metrics_port=0, health_port=0))
    )
    yield server
    router_stack.loop.call(server.stop(grace_s=1.0))


def _ports(server) -> dict[str, int]:
    return {
        "port": server.port,
        "http_port": server.http.port,
        "metrics_port": server.exporter.port,
        "health_port": server.health_port,
    }


def _assert_serving(server) -> None:
    """Every listener of `server` answers."""
    with Client(server.address) as client:
        assert len(client.generate([5, 6, 7], max_tokens=2, temperature=0.0, ignore_eos=True).token_ids) == 2
    with urllib.request.urlopen(f"{server.http.url}/health", timeout=10) as response:
        assert response.status == 200
    assert scrape(server.exporter.url)
    with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


# Set in the failing start's context: every task it (or a task it started) creates inherits it, while the
# first router's own tasks on the same loop (long-polls, probes it keeps starting) do not.
_IN_FAILED_START: contextvars.ContextVar[bool] = contextvars.ContextVar("in_failed_start", default=False)


def _start_recording_tasks(loop) -> list[asyncio.Task]:
    """From now on, tasks created on `loop` from the failed start's context are listed in the returned list."""
    created: list[asyncio.Task] = []

    def factory(event_loop, coro, **kwargs):
        task = asyncio.Task(coro, loop=event_loop, **kwargs)
        if _IN_FAILED_START.get():  # the factory runs in the creating code's context
            created.append(task)
        return task

    async def install() -> None:
        asyncio.get_running_loop().set_task_factory(factory)

    loop.call(install())
    return created


def _stop_recording_tasks(loop) -> None:
    async def uninstall() -> None:
        asyncio.get_running_loop().set_task_factory(None)

    loop.call(uninstall())


async def _failed_start(cluster, config):
    _IN_FAILED_START.set(True)
    await RouterServer.start(cluster, config)


def _assert_nothing_left(created: list[asyncio.Task], threads_before: set) -> None:
    """No task the failed start created and no thread is left (cancelled tasks end within a few loop turns)."""
    deadline_s = time.monotonic() + 10
    while True:
        tasks = [task for task in created if not task.done()]
        threads = {t for t in threading.enumerate() if t.is_alive()} - threads_before
        if not tasks and not threads:
            return
        assert time.monotonic() < deadline_s, (tasks, threads)
        time.sleep(0.1)


@pytest.mark.parametrize("key", KEYS)
def test_a_second_router_on_a_taken_port_fails_naming_it_and_the_first_serves_on(router_stack, first, key):
    taken = _ports(first)[key]
    # The second router asks for one of the first's ports; every other port is the OS's pick (metrics
    # and health too, so that the failing start has begun all its other listeners when it hits it).
    second = router_config(**{"metrics_port": 0, "health_port": 0, key: taken})
    loop = router_stack.loop
    threads_before = set(threading.enumerate())
    created = _start_recording_tasks(loop)
    try:
        with pytest.raises(PortInUse) as caught:
            loop.call(_failed_start(router_stack.cluster, second))
        assert (caught.value.key, caught.value.host, caught.value.port) == (f"router.{key}", "127.0.0.1", taken)
        assert str(caught.value) == f"router.{key}: cannot listen on 127.0.0.1:{taken}: already in use"
        if key in ("http_port", "health_port"):  # these bind after the background loops have started
            assert created, "the failed start's tasks are recorded"
        _assert_nothing_left(created, threads_before)
    finally:
        _stop_recording_tasks(loop)
    _assert_serving(first)
    assert _ports(first)[key] == taken


def _router_args(*flags: str) -> argparse.Namespace:
    return parser("splitserve router", need_ray=True).parse_args(["--ray-address", "127.0.0.1:6379", *flags])


def _assert_router_serves(router, port: int, http_port: int) -> None:
    assert (router.port, router.http.port) == (port, http_port)
    with Client(router.address) as client:
        assert len(client.generate([9, 8, 7], max_tokens=2, temperature=0.0, ignore_eos=True).token_ids) == 2
    with urllib.request.urlopen(f"{router.http.url}/health", timeout=10) as response:
        assert response.status == 200


def test_the_documented_second_router_flags_serve_beside_a_router_on_the_defaults(router_stack):
    """docs/serving.md: a second router on one host takes `--port 50052 --http-port 8001`; with only
    `--port 50052` it fails on the HTTP port, and the message names `--http-port`."""
    require_sandbox()  # fixed ports: only in the private network namespace
    loop, cluster = router_stack.loop, router_stack.cluster
    mistaken = _router_args("--port", "50052")
    default = loop.call(RouterServer.start(cluster, build_config(_router_args())[0]))  # 50051 and 8000
    try:
        documented = loop.call(
            RouterServer.start(cluster, build_config(_router_args("--port", "50052", "--http-port", "8001"))[0])
        )
        try:
            _assert_router_serves(default, 50051, 8000)
            _assert_router_serves(documented, 50052, 8001)
        finally:
            loop.call(documented.stop(grace_s=1.0))
        config, given = build_config(mistaken)
        with pytest.raises(PortInUse) as caught:
            loop.call(RouterServer.start(cluster, config))
        assert (caught.value.key, caught.value.port) == ("router.http_port", 8000)
        assert port_error_line("splitserve router", caught.value, mistaken, given) == (
            "splitserve router: --http-port 8000 is already in use on 127.0.0.1 "
            "(pick another port, or 0 to turn the HTTP API off)"
        )
        _assert_router_serves(default, 50051, 8000)  # undisturbed
    finally:
        loop.call(default.stop(grace_s=1.0))


@pytest.mark.parametrize(
    ("flags", "in_file", "key", "named"),
    [
        (("--port", "9100"), {}, "port", "--port 9100"),
        (("--http-port", "9101"), {}, "http_port", "--http-port 9101"),
        (("--metrics-port", "9102"), {}, "metrics_port", "--metrics-port 9102"),
        (("--health-port", "9103"), {}, "health_port", "--health-port 9103"),
        ((), {"metrics_port": 9102}, "metrics_port", "router.metrics_port 9102"),  # set by the file only: its key
        ((), {"http_port": 9101}, "http_port", "router.http_port 9101"),
        (("--health-port", "9103"), {"health_port": 9200}, "health_port", "--health-port 9103"),  # the flag wins
        ((), {}, "http_port", "--http-port 8000"),  # a default: the flag is what changes it
        ((), {}, "port", "--port 50051"),
    ],
)
def test_the_error_line_names_the_flag_or_the_config_files_key(tmp_path, flags, in_file, key, named):
    config_file = tmp_path / "cluster.yaml"
    config_file.write_text(yaml.safe_dump({"router": in_file}))
    args = _router_args("--config", str(config_file), *flags)
    config, given = build_config(args)
    port = getattr(config.router, key)
    line = port_error_line("splitserve router", PortInUse(f"router.{key}", "127.0.0.1", port), args, given)
    hint = "0 to turn the HTTP API off" if named.startswith("--http-port") else "0 for any free one"
    assert line == f"splitserve router: {named} is already in use on 127.0.0.1 (pick another port, or {hint})"
    other = port_error_line("splitserve router", CannotListen(f"router.{key}", "10.9.9.9", port, "denied"), args, given)
    assert other == f"splitserve router: {named} cannot be bound on 10.9.9.9: denied"


def _held_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SPLITSERVE, *args], capture_output=True, text=True, timeout=120)


def test_the_command_line_reports_a_taken_port_in_one_line(tmp_path):
    """Both entry points, against ports a plain socket holds: the second router's common mistake (only
    `--port` given, the default HTTP port taken) and a metrics port set in the config file. Neither
    reaches Ray: the ports are checked first (the Ray address here leads nowhere)."""
    require_sandbox()  # port 8000: only in the private network namespace
    with socket.create_server(("127.0.0.1", 8000)), _held_port() as metrics:
        result = _run_cli("router", "--ray-address", "127.0.0.1:1", "--port", "0")
        assert result.returncode != 0
        expected = (
            "splitserve router: --http-port 8000 is already in use on 127.0.0.1 "
            "(pick another port, or 0 to turn the HTTP API off)"
        )
        assert result.stderr.splitlines() == [expected], result.stderr

        held = metrics.getsockname()[1]
        config_file = tmp_path / "cluster.yaml"
        config_file.write_text(yaml.safe_dump({"router": {"metrics_port": held}}))
        result = _run_cli("serve", "--config", str(config_file), "--port", "0", "--http-port", "0")
        assert result.returncode != 0
        assert "Traceback" not in result.stderr
        expected = (
            f"splitserve serve: router.metrics_port {held} is already in use on 127.0.0.1 "
            "(pick another port, or 0 for any free one)"
        )
        assert result.stderr.splitlines() == [expected], result.stderr


@pytest.mark.parametrize("flag", ["--uds", "--http-uds"])
def test_a_unix_socket_that_cannot_be_listened_on_is_one_line_naming_the_flag(router_stack, tmp_path, flag):
    path = str(tmp_path / "no-such-folder" / "router.sock")
    uds = {"extra_addresses": [f"unix:{path}"]} if flag == "--uds" else {"http_uds": path}
    with pytest.raises(CannotListenOnSocket) as caught:
        router_stack.loop.call(RouterServer.start(router_stack.cluster, router_config(), **uds))
    line = port_error_line("splitserve serve", caught.value, _router_args(), {})
    assert line == f"splitserve serve: {flag} {path}: cannot listen on this unix socket: No such file or directory"
