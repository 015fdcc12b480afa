"""Listening ports: one typed error for a port that cannot be bound, named by its config key, and a probe
that tells why.

    check_free("router.http_port", "127.0.0.1", 8000)    # raises PortInUse when something listens there

Servers raise `PortInUse` (an OSError with errno EADDRINUSE) where they bind; the command line turns it
into one line naming the flag or config key. gRPC reports a failed bind only as 0 or a RuntimeError,
without the reason, so `cannot_listen` binds a plain socket to the same address to find it out.
"""

from __future__ import annotations

import errno
import os
import socket

from common.router_config import RouterConfig


class CannotListen(OSError):
    """The port configured as `key` (e.g. "router.http_port") cannot be bound on `host`; `reason` says why."""

    def __init__(self, key: str, host: str, port: int, reason: str, code: int | None = None):
        super().__init__(code, f"{key}: cannot listen on {host}:{port}: {reason}")
        self.key, self.host, self.port, self.reason = key, host, port, reason

    def __str__(self) -> str:  # the message alone, as a config error reads ("[Errno 98]" says nothing more)
        return str(self.strerror)


class PortInUse(CannotListen):
    """Another socket already listens on host:port (another router, or any other program)."""

    def __init__(self, key: str, host: str, port: int):
        super().__init__(key, host, port, "already in use", errno.EADDRINUSE)


class CannotListenOnSocket(CannotListen):
    """The unix socket path given as `key` (a flag such as "--uds") cannot be listened on; `reason` says why."""

    def __init__(self, key: str, path: str, reason: str, code: int | None = None):
        OSError.__init__(self, code, f"{key} {path}: cannot listen on this unix socket: {reason}")
        self.key, self.host, self.port, self.reason = key, path, 0, reason


def unix_socket_error(key: str, path: str) -> CannotListenOnSocket:
    """Why a server could not listen on the unix socket `path`, found by binding it with a plain socket
    (gRPC reports only that it failed)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.bind(path)
    except OSError as err:
        return CannotListenOnSocket(key, path, err.strerror or str(err), err.errno)
    else:
        os.unlink(path)  # the probe's own socket file, not one another program listens on
    return CannotListenOnSocket(key, path, "the server could not bind it")


def bind_error(key: str, host: str, port: int, err: OSError) -> CannotListen:
    """The typed error for a failed bind of host:port (PortInUse for EADDRINUSE)."""
    if err.errno == errno.EADDRINUSE:
        return PortInUse(key, host, port)
    return CannotListen(key, host, port, err.strerror or str(err), err.errno)


def check_free(key: str, host: str, port: int) -> None:
    """Raises PortInUse (or CannotListen with the reason) when host:port cannot be bound right now.
    Port 0 always can; an unresolvable host is left to the server's own bind to report."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            # As the servers do: a port whose old connections linger in TIME_WAIT is free. No SO_REUSEPORT:
            # a port another process listens on is taken even when that process shares it.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as err:
                raise bind_error(key, host, port, err) from None


def cannot_listen(key: str, host: str, port: int) -> CannotListen:
    """Why a server could not bind host:port, found by binding it with a plain socket."""
    try:
        check_free(key, host, port)
    except CannotListen as err:
        return err
    return CannotListen(key, host, port, "the server could not bind it")


def router_ports(router: RouterConfig) -> list[tuple[str, int]]:
    """The TCP ports a router with these settings listens on: (config key, port), fixed ones only."""
    keys = ("port", "http_port", "health_port", "metrics_port")
    return [(f"router.{key}", port) for key in keys if (port := getattr(router, key)) not in (None, 0)]


def check_router_ports(router: RouterConfig) -> None:
    """Raises PortInUse for the first of the router's ports that is taken, before anything starts (the
    servers check again where they bind: a port can be taken in between)."""
    for key, port in router_ports(router):
        check_free(key, router.host, port)
