"""Forwards loopback TCP ports to unix sockets: how `make run` makes a router that lives inside the
loopback-only network sandbox reachable at 127.0.0.1 from the user's other shells.

    python -m splitserve.loopback_forward 127.0.0.1:8000=.run/http.sock 127.0.0.1:50051=.run/router.sock

Each connection to a listening port gets its own connection to the socket; bytes are relayed both
ways as they come (server-sent events and gRPC streams are not buffered), and a half-close on one
side is passed to the other. Only loopback addresses may be bound: this exposes nothing beyond the
machine. A socket that is not there yet (the router still starting) closes the client's connection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import ipaddress
import signal
import sys
from typing import NamedTuple

CHUNK_BYTES = 256 * 1024


class Route(NamedTuple):
    host: str
    port: int
    socket_path: str


def parse_route(spec: str) -> Route:
    """HOST:PORT=PATH with a loopback HOST; ValueError naming what is wrong."""
    address, sep, path = spec.partition("=")
    host, colon, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not path or not colon or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{spec!r}: expected HOST:PORT=UNIX_SOCKET_PATH")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"{spec!r}: only loopback addresses may be bound (127.0.0.1, ::1, localhost)")
    return Route(host, int(port), path)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK_BYTES):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


async def _relay(route: Route, client_reader, client_writer) -> None:
    try:
        server_reader, server_writer = await asyncio.open_unix_connection(route.socket_path)
    except OSError:
        client_writer.close()
        return
    try:
        await asyncio.gather(_pipe(client_reader, server_writer), _pipe(server_reader, client_writer))
    finally:
        for writer in (client_writer, server_writer):
            writer.close()


async def serve(routes: list[Route], ready=None) -> None:
    """Listens on every route until cancelled; `ready(list of (host, port))` once all listen."""
    servers = []
    try:
        for route in routes:  # one at a time: the finally closes those already listening
            server = await asyncio.start_server(functools.partial(_relay, route), route.host, route.port)
            servers.append(server)
        if ready is not None:
            ready([s.sockets[0].getsockname()[:2] for s in servers])
        await asyncio.gather(*(s.serve_forever() for s in servers))
    finally:
        for server in servers:
            server.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m splitserve.loopback_forward", description=__doc__.split("\n\n")[0])
    parser.add_argument("routes", nargs="+", metavar="HOST:PORT=PATH")
    args = parser.parse_args(argv)
    try:
        routes = [parse_route(spec) for spec in args.routes]
    except ValueError as err:
        parser.error(str(err))

    def ready(addresses) -> None:
        for (host, port), route in zip(addresses, routes, strict=True):
            print(f"forwarding {host}:{port} -> unix:{route.socket_path}", flush=True)

    async def run() -> None:
        task = asyncio.current_task()
        assert task is not None, "run() runs as a task"
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await serve(routes, ready)

    try:
        asyncio.run(run())
    except OSError as err:
        sys.exit(f"loopback_forward: {err}")


if __name__ == "__main__":
    main()
