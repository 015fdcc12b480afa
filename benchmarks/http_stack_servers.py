"""The candidate servers benchmarks/http_stacks.py measures, one per process:

    python -m benchmarks.http_stack_servers NAME   (the listening socket's fd in $BENCH_FD)

Each serves `POST /stream?n=N` (N server-sent events of a completion chunk's size, yielding to the loop
between chunks), `POST /unary` (a small JSON body) and `GET /cpu` (this process's CPU seconds).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time

CHUNK = (
    "data: "
    + json.dumps(
        {
            "id": "cmpl-0123456789abcdef",
            "object": "text_completion",
            "created": 1700000000,
            "model": "demo-model",
            "choices": [{"index": 0, "text": " token", "logprobs": None, "finish_reason": None}],
        }
    )
    + "\n\n"
).encode()
REPLY = json.dumps({"object": "list", "data": [{"id": "demo-model", "object": "model"}]}).encode()


def serve_aiohttp(sock: socket.socket) -> None:
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        n = int(request.query["n"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for _ in range(n):
            await asyncio.sleep(0)
            await response.write(CHUNK)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def unary(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=REPLY, content_type="application/json")

    async def cpu(request: web.Request) -> web.Response:
        return web.Response(text=repr(time.process_time()))

    app = web.Application()
    app.router.add_post("/stream", stream)
    app.router.add_post("/unary", unary)
    app.router.add_get("/cpu", cpu)
    web.run_app(app, sock=sock, print=None, access_log=None, handle_signals=True)


def _asgi_app():
    async def app(scope, receive, send):
        path = scope["path"]
        while (await receive()).get("more_body"):
            pass
        if path == "/stream":
            n = int(scope["query_string"].decode().split("=")[1])
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
                }
            )
            for _ in range(n):
                await asyncio.sleep(0)
                await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            return
        body = REPLY if path == "/unary" else repr(time.process_time()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


def _starlette_app():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def stream(request):
        await request.body()
        n = int(request.query_params["n"])

        async def chunks():
            for _ in range(n):
                await asyncio.sleep(0)
                yield CHUNK
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def unary(request):
        await request.body()
        return Response(REPLY, media_type="application/json")

    async def cpu(request):
        return PlainTextResponse(repr(time.process_time()))

    return Starlette(
        routes=[
            Route("/stream", stream, methods=["POST"]),
            Route("/unary", unary, methods=["POST"]),
            Route("/cpu", cpu),
        ]
    )


def _serve_uvicorn(app, sock: socket.socket) -> None:
    import uvicorn

    config = uvicorn.Config(
        app, http="httptools", loop="asyncio", lifespan="off", access_log=False, log_level="warning"
    )
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


def serve_grpc(sock: socket.socket) -> None:
    import grpc

    port = sock.getsockname()[1]
    sock.close()

    async def stream(request: bytes, context):
        n = int(request)
        for _ in range(n):
            await asyncio.sleep(0)
            yield CHUNK

    async def unary(request: bytes, context) -> bytes:
        return REPLY

    async def cpu(request: bytes, context) -> bytes:
        return repr(time.process_time()).encode()

    async def main():
        server = grpc.aio.server()
        handlers: dict[str, grpc.RpcMethodHandler] = {
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Cpu": grpc.unary_unary_rpc_method_handler(cpu),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench", handlers),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


SERVERS = {
    "grpc.aio (baseline)": serve_grpc,
    "aiohttp": serve_aiohttp,
    "uvicorn+httptools, bare ASGI": lambda sock: _serve_uvicorn(_asgi_app(), sock),
    "uvicorn+httptools, Starlette": lambda sock: _serve_uvicorn(_starlette_app(), sock),
}


if __name__ == "__main__":
    SERVERS[sys.argv[1]](socket.socket(fileno=int(os.environ["BENCH_FD"])))
