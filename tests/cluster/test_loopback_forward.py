"""The loopback forwarder `make run` uses: TCP on 127.0.0.1 → a unix socket, both ways, as bytes come."""
from __future__ import annotations

import asyncio

import pytest

from splitserve.loopback_forward import Route, parse_route, serve


def test_routes_bind_loopback_only():
    assert parse_route("127.0.0.1:8000=/run/http.sock") == Route("127.0.0.1", 8000, "/run/http.sock")
    assert parse_route("[::1]:0=s.sock") == Route("::1", 0, "s.sock")
    assert parse_route("localhost:9=s.sock").host == "localhost"
    for spec, message in (("0.0.0.0:8000=s.sock", "only loopback"), ("10.0.0.2:80=s.sock", "only loopback"),
                          ("example.com:80=s.sock", "only loopback"), ("127.0.0.1:8000", "expected HOST:PORT="),
                          ("127.0.0.1:x=s.sock", "expected HOST:PORT=")):
        with pytest.raises(ValueError, match=message):
            parse_route(spec)


def test_bytes_flow_both_ways_as_they_come_and_half_close_passes(tmp_path):
    path = str(tmp_path / "upstream.sock")

    async def upstream(reader, writer):  # answers each line at once, then "bye" after the client's EOF
        while line := await reader.readline():
            writer.write(b"echo " + line)
            await writer.drain()
        writer.write(b"bye\n")
        await writer.drain()
        writer.close()

    async def run():
        server = await asyncio.start_unix_server(upstream, path)
        ports = asyncio.get_running_loop().create_future()
        forwarder = asyncio.create_task(serve([Route("127.0.0.1", 0, path), Route("127.0.0.1", 0, path + ".none")],
                                              lambda addresses: ports.set_result([a[1] for a in addresses])))
        port, dead_port = await asyncio.wait_for(ports, 10)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            replies = []
            for word in (b"one\n", b"two\n"):  # each answered before the next is sent: nothing is buffered
                writer.write(word)
                replies.append(await asyncio.wait_for(reader.readline(), 5))
            writer.write_eof()
            replies.append(await asyncio.wait_for(reader.read(), 5))
            writer.close()
            dead_reader, dead_writer = await asyncio.open_connection("127.0.0.1", dead_port)
            closed = await asyncio.wait_for(dead_reader.read(), 5)  # no socket there: closed at once
            dead_writer.close()
            return replies, closed
        finally:
            forwarder.cancel()
            await asyncio.gather(forwarder, return_exceptions=True)
            server.close()
            await server.wait_closed()

    replies, closed = asyncio.run(asyncio.wait_for(run(), 30))
    assert replies == [b"echo one\n", b"echo two\n", b"bye\n"] and closed == b""
