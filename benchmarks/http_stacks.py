"""What an HTTP stack costs per streamed chunk and per request, to choose the router's HTTP front.

    .venv/bin/python -m benchmarks.http_stacks [--streams 16] [--chunks 400] [--requests 2000]

Each candidate serves, in a server process of its own, the two things the OpenAI front does:
  stream — one `POST` answered with `--chunks` server-sent events of a completion chunk's size
           (~180 bytes of JSON each), the handler yielding to the event loop between chunks as it
           does while waiting for the next decode step;
  unary  — one small `POST` answered with a small JSON body.
A client process (raw asyncio sockets: the same fixed cost for every candidate) runs `--streams`
concurrent streams, then `--requests` unary calls over 32 kept-alive connections. The server reports its own CPU
time, so the figures are what the stack burns in the router's process: CPU µs per chunk and per
request, plus the client-side wall time per chunk. grpc.aio (server streaming, the same payload as a
bytes message) runs as the baseline, same run: ratios are against it.
Candidates: aiohttp's web server; uvicorn (httptools parser) with a bare ASGI app; uvicorn with
Starlette's StreamingResponse (what FastAPI streams with).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

from benchmarks.http_stack_servers import SERVERS

BODY = json.dumps({"model": "demo-model", "prompt": "Hello there", "max_tokens": 16}).encode()


# The client: raw HTTP/1.1 over asyncio streams (or the grpc channel for the baseline).


async def _http(port: int, method: str, path: str, body: bytes = b"") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    data = await reader.read()  # the server closes: Connection: close
    writer.close()
    return data


async def _http_stream(port: int, n: int) -> list[float]:
    """Chunk arrival gaps of one stream (seconds)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"POST /stream?n={n} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(BODY)}\r\nConnection: close\r\n\r\n".encode()
        + BODY
    )
    seen, times = 0, []
    while True:
        data = await reader.read(65536)
        if not data:
            break
        count = data.count(b"data: ")
        if count:
            times.extend([time.perf_counter()] * count)
            seen += count
    writer.close()
    if seen != n + 1:
        raise RuntimeError(f"stream got {seen} events, expected {n + 1}")
    return times


async def client_http(port: int, args) -> dict:
    cpu0 = _cpu_from(await _http(port, "GET", "/cpu"))
    started = time.perf_counter()
    await asyncio.gather(*(_http_stream(port, args.chunks) for _ in range(args.streams)))
    stream_wall_s = time.perf_counter() - started
    cpu1 = _cpu_from(await _http(port, "GET", "/cpu"))
    started = time.perf_counter()
    await asyncio.gather(*(_keepalive_calls(port, args.requests // 32) for _ in range(32)))
    unary_wall_s = time.perf_counter() - started
    cpu2 = _cpu_from(await _http(port, "GET", "/cpu"))
    return _figures(args, cpu1 - cpu0, cpu2 - cpu1, stream_wall_s, unary_wall_s)


async def _keepalive_calls(port: int, count: int) -> None:
    """`count` unary calls one after another on one kept-alive connection (as HTTP clients pool them)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = (
        f"POST /unary HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
    ).encode() + BODY
    for _ in range(count):
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            raise RuntimeError(head[:200])
        length = int(
            next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        )
        await reader.readexactly(length)
    writer.close()


def _cpu_from(reply: bytes) -> float:
    body = reply.split(b"\r\n\r\n", 1)[1]
    if b"\r\n" in body:  # chunked transfer encoding: size line, payload, terminator
        body = body.split(b"\r\n")[1]
    return float(body)


async def client_grpc(port: int, args) -> dict:
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stream: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream("/bench/Stream")
        unary: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary("/bench/Unary")
        cpu: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary("/bench/Cpu")
        cpu0 = float(await cpu(b""))

        async def one_stream():
            got = 0
            async for _ in stream(str(args.chunks).encode()):
                got += 1
            assert got == args.chunks

        started = time.perf_counter()
        await asyncio.gather(*(one_stream() for _ in range(args.streams)))
        stream_wall_s = time.perf_counter() - started
        cpu1 = float(await cpu(b""))

        async def calls(count: int):
            for _ in range(count):
                await unary(BODY)

        started = time.perf_counter()
        await asyncio.gather(*(calls(args.requests // 32) for _ in range(32)))
        unary_wall_s = time.perf_counter() - started
        cpu2 = float(await cpu(b""))
    return _figures(args, cpu1 - cpu0, cpu2 - cpu1, stream_wall_s, unary_wall_s)


def _figures(args, stream_cpu_s, unary_cpu_s, stream_wall_s, unary_wall_s) -> dict:
    chunks = args.streams * args.chunks
    requests = args.requests // 32 * 32
    return {
        "server_cpu_us_per_chunk": stream_cpu_s / chunks * 1e6,
        "wall_us_per_chunk": stream_wall_s / chunks * 1e6,
        "server_cpu_us_per_request": unary_cpu_s / requests * 1e6,
        "requests_per_s": requests / unary_wall_s,
    }


def _run_one(name: str, args) -> dict:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.http_stack_servers", name],
        pass_fds=(sock.fileno(),),
        env={**os.environ, "BENCH_FD": str(sock.fileno())},
    )
    sock.close()
    try:
        time.sleep(3.0)  # imports and start-up
        client = client_grpc if name.startswith("grpc") else client_http
        warm = argparse.Namespace(**{**vars(args), "requests": 200, "chunks": 50})
        asyncio.run(client(port, warm))
        return asyncio.run(client(port, args))
    finally:
        server.terminate()
        server.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=400)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2, help="each candidate this many times, interleaved")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in SERVERS}
    for _ in range(args.rounds):
        for name in SERVERS:
            results[name].append(_run_one(name, args))
    base = _best(results["grpc.aio (baseline)"])
    print(
        f"{args.streams} streams x {args.chunks} chunks, {args.requests} unary requests; best of {args.rounds} rounds"
    )
    print(
        f"{'stack':<32}{'CPU µs/chunk':>14}{'x grpc':>8}{'wall µs/chunk':>15}{'CPU µs/req':>12}{'x grpc':>8}"
        f"{'req/s':>9}"
    )
    for name, runs in results.items():
        best = _best(runs)
        print(
            f"{name:<32}{best['server_cpu_us_per_chunk']:>14.1f}"
            f"{best['server_cpu_us_per_chunk'] / base['server_cpu_us_per_chunk']:>8.2f}"
            f"{best['wall_us_per_chunk']:>15.1f}{best['server_cpu_us_per_request']:>12.1f}"
            f"{best['server_cpu_us_per_request'] / base['server_cpu_us_per_request']:>8.2f}"
            f"{best['requests_per_s']:>9.0f}"
        )


def _best(runs: list[dict]) -> dict:
    """Per figure, the best round (the least disturbed by other jobs on the machine)."""
    return {key: (max if key == "requests_per_s" else min)(r[key] for r in runs) for key in runs[0]}


if __name__ == "__main__":
    main()
