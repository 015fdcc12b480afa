"""The OpenAI-compatible HTTP front: an aiohttp server on the router's event loop, beside gRPC.

    front = await HttpFront.start(service, host="127.0.0.1", port=8000, uds=None, token=None,
                                  model_names=("demo-model-v1",))
    front.url          # http://127.0.0.1:8000
    await front.stop(grace_s=5.0)

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (whole or streamed as server-sent events ending
`data: [DONE]`), `POST /v1/responses` (OpenAI's Responses API over the chat path: a body parsed by
`router.openai.responses_parse`, written by `router.openai.responses`), `GET /v1/models` (a card per served
name), vLLM's `POST /tokenize` and `POST /detokenize` (`router.openai.tokenize`) and `GET /version`,
`GET /health`, `GET /metrics` (the router's Prometheus registry), `GET /openapi.json` (the OpenAPI 3.1 document of
these routes, `router.openai.openapi`, built once at start from the served model's limits). A body is read up
to `parse.MAX_BODY_BYTES` (a longer one is a 413) and decoded only when nested at most `parse.MAX_JSON_DEPTH`
levels (a deeper one is a 400 naming `body`); aiohttp's own refusals (an unknown path, a wrong method) come in
OpenAI's error shape too. Every request goes through the same `RouterService.generate` as gRPC: validation
rules, admission, routing, metrics, deadlines and cancellation are the service's. The bearer token (the API
key), when set, guards `/v1/`, `/tokenize`, `/detokenize` and `/openapi.json`; `/health`, `/version` and
`/metrics` stay open for probes and scrapers. A client that disconnects cancels its handler (aiohttp's handler
cancellation), which aborts the request on its workers. A streamed request's status is decided before the 200
is sent: the first output (or the failure) of its choices comes first, so admission's 429, a bad field's 400
or a deadline's 504 arrive as statuses; a failure after that is the renderer's failure events (chat: an error
event, then `[DONE]`; Responses: `error`, then `response.failed`).
aiohttp was measured against uvicorn (bare ASGI and Starlette) and grpc.aio: benchmarks/http_stacks.py.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import ssl
import time
from collections.abc import Callable, Mapping
from contextlib import aclosing
from importlib import metadata

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common.ports import CannotListenOnSocket, bind_error
from engine.errors import InvalidRequestError
from router.access_log import access_log
from router.errors import Unauthenticated
from router.openai.choices import run_choices
from router.openai.errors import HttpError, http_error
from router.openai.openapi import openapi_document
from router.openai.parse import (
    MAX_BODY_BYTES,
    ApiRequest,
    BodyTooLarge,
    Context,
    decode_body,
    parse_chat,
    parse_completion,
)
from router.openai.render import Renderer
from router.openai.responses import ResponsesRenderer
from router.openai.responses_parse import parse_responses
from router.openai.tokenize import detokenize, tokenize
from router.service import RouterService
from router.validation import client_wait_s
from splitserve_client.sdk_types import SENT_AT_KEY

log = logging.getLogger(__name__)
AnyRenderer = Renderer | ResponsesRenderer  # chunk, add, response, closing and failure
RendererType = Callable[..., AnyRenderer]  # (the parsed request, the tokenizer)
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class HttpFront:
    def __init__(self, service: RouterService, context: Context, token: str | None):
        self.service, self.context = service, context
        self._expected = f"Bearer {token}".encode() if token else None
        self._serving = True
        self._openapi_body = b""  # the OpenAPI document, encoded once at start
        self.runner: web.AppRunner | None = None
        self.host, self.port, self.scheme = "", 0, "http"
        self.uds: str | None = None

    @classmethod
    async def start(
        cls,
        service: RouterService,
        *,
        host: str,
        port: int | None,
        uds: str | None = None,
        token: str | None = None,
        model_names: tuple[str, ...],
        ssl_context: ssl.SSLContext | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        chat_template: str | None = None,
        trust_request_chat_template: bool = False,
    ) -> HttpFront:
        """Serves on host:port (0: the OS picks; None: no TCP) and/or the unix socket `uds`; HTTPS on both
        when `ssl_context` is given (the router's TLS keys, as for gRPC). Raises common.ports.PortInUse
        (key router.http_port) when host:port is taken."""
        context = Context(
            service.limits,
            service.tokenizer,
            model_names,
            tool_call_parser,
            reasoning_parser,
            chat_template,
            trust_request_chat_template,
        )
        front = cls(service, context, token)
        document = openapi_document(front.context, auth=token is not None, max_body_bytes=MAX_BODY_BYTES)
        front._openapi_body = json.dumps(document).encode()
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.middlewares.extend((access_log, openai_errors))
        app.router.add_post("/v1/completions", front._completions)
        app.router.add_post("/v1/chat/completions", front._chat)
        app.router.add_post("/v1/responses", front._responses)
        app.router.add_get("/v1/models", front._models)
        app.router.add_post("/tokenize", front._tokenize)
        app.router.add_post("/detokenize", front._detokenize)
        app.router.add_get("/version", front._version)
        app.router.add_get("/health", front._health)
        app.router.add_get("/metrics", front._metrics)
        app.router.add_get("/openapi.json", front._openapi)
        front.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await front.runner.setup()
        try:
            if port is not None:
                try:
                    await web.TCPSite(front.runner, host, port, ssl_context=ssl_context).start()
                except OSError as err:
                    raise bind_error("router.http_port", host, port, err) from None
                front.host, front.port = host, front.runner.addresses[0][1]
            if uds is not None:
                try:
                    await web.UnixSite(front.runner, uds, ssl_context=ssl_context).start()
                except OSError as err:
                    raise CannotListenOnSocket("--http-uds", uds, err.strerror or str(err), err.errno) from None
                front.uds = uds
        except BaseException:  # a site that did start is not left listening
            await front.runner.cleanup()
            raise
        front.scheme = "http" if ssl_context is None else "https"
        return front

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stops accepting, lets requests in flight finish for `grace_s`, then cancels the rest."""
        self._serving = False
        runner = self.runner
        if runner is None:  # never started
            return
        for site in list(runner.sites):
            await site.stop()
        if runner.server is not None:
            runner.server.pre_shutdown()
            await runner.server.shutdown(grace_s)
        await runner.cleanup()

    # ---- routes ----

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion, "prompt")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat, "messages")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_responses, "input", ResponsesRenderer)

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._authorize(request)
        except Unauthenticated as err:
            return self._error_response(self._failed(err, "prompt"))
        info, limits = self.service.info, self.context.limits
        card = {
            "object": "model",
            "created": 0,
            "owned_by": "splitserve",
            "root": self.context.model_names[-1],
            "max_model_len": limits.max_model_len,
            "splitserve": {
                "model_identity": info.model_identity,
                "vocab_size": limits.vocab_size,
                "block_size": info.block_size,
                "eos_token_ids": list(info.eos_token_ids),
                "has_tokenizer": limits.has_tokenizer,
            },
        }
        # Every name the server answers to is a model clients may pick (vLLM lists each served name).
        cards = [{"id": name, **card} for name in self.context.model_names]
        return web.json_response({"object": "list", "data": cards})

    async def _tokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer_route(request, tokenize, "prompt")

    async def _detokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer_route(request, detokenize, "tokens")

    async def _tokenizer_route(self, request: web.Request, handle, field: str) -> web.Response:
        """Not generation: errors are answered, not counted among the requests served."""
        try:
            self._authorize(request)
            return web.json_response(handle(decode_body(await read_body(request)), self.context))
        except Exception as err:
            error = http_error(err, field)
            if error.status == 500:
                log.error("unexpected error in an HTTP request", exc_info=err)
            return self._error_response(error)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": server_version()})

    async def _health(self, request: web.Request) -> web.Response:
        if not self._serving:
            return web.json_response({"status": "shutting down"}, status=503)
        return web.json_response({"status": "ok"})

    async def _openapi(self, request: web.Request) -> web.Response:
        try:
            self._authorize(request)
        except Unauthenticated as err:
            return self._error_response(self._failed(err, "prompt"))
        return web.Response(body=self._openapi_body, content_type="application/json")

    async def _metrics(self, request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(self.service.metrics.registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    # ---- generation ----

    async def _generate(
        self, request: web.Request, parse, prompt_field: str, render: RendererType = Renderer
    ) -> web.StreamResponse:
        """`parse` reads the body into an ApiRequest; `render` writes its outputs (JSON, or events)."""
        try:
            self._authorize(request)
            body = decode_body(await read_body(request))
            api = parse(body, self.context, request.headers.get("X-Request-Id"))
            deadline_s = None if api.timeout_s is None else time.monotonic() + api.timeout_s
            waited_s = waited_s_from(request.headers)
            renderer = render(api, self.context.tokenizer)
            if api.stream:
                return await self._stream(request, api, renderer, deadline_s, waited_s, prompt_field)
            return await self._whole(api, renderer, deadline_s, waited_s)
        except Exception as err:  # noqa: BLE001 - every error becomes an HTTP error (_failed classifies and logs)
            return self._error_response(self._failed(err, prompt_field))

    async def _whole(self, api: ApiRequest, renderer: AnyRenderer, deadline_s, waited_s) -> web.Response:
        async with aclosing(run_choices(self.service, api, deadline_s, waited_s)) as outputs:
            async for position, output in outputs:
                renderer.add(position, output)
        return web.Response(body=renderer.response(), content_type="application/json")

    async def _stream(
        self, request: web.Request, api: ApiRequest, renderer: AnyRenderer, deadline_s, waited_s, prompt_field: str
    ) -> web.StreamResponse:
        async with aclosing(run_choices(self.service, api, deadline_s, waited_s)) as outputs:
            iterator = aiter(outputs)
            first = await anext(iterator)  # a failure here is still a status
            response = web.StreamResponse(headers=_SSE_HEADERS)
            await response.prepare(request)
            # The client left between writes: closing `outputs` aborts the rest.
            with contextlib.suppress(ConnectionError):
                await self._events(response, renderer, first, iterator, prompt_field)
        return response

    async def _events(
        self, response: web.StreamResponse, renderer: AnyRenderer, first, iterator, prompt_field: str
    ) -> None:
        try:
            await response.write(renderer.chunk(*first))
            async for position, output in iterator:
                await response.write(renderer.chunk(position, output))
            await response.write(renderer.closing())
        except ConnectionError:
            raise
        except Exception as err:  # noqa: BLE001 - after the 200: the renderer's failure events end the stream
            await response.write(renderer.failure(self._failed(err, prompt_field)))
        await response.write_eof()

    # ---- errors ----

    def _authorize(self, request: web.Request) -> None:
        if self._expected is None:
            return
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, self._expected):
            raise Unauthenticated("missing or invalid bearer token in the Authorization header")

    def _failed(self, err: Exception, prompt_field: str) -> HttpError:
        """The one place a failed HTTP request is classified, logged and counted."""
        error = http_error(err, prompt_field)
        if error.status == 500:
            log.error("unexpected error in an HTTP request", exc_info=err)
        if error.status != 401:  # as over gRPC, where the auth interceptor answers before the error one
            self.service.metrics.observe_request(error.outcome)
        return error

    @staticmethod
    def _error_response(error: HttpError) -> web.Response:
        return web.Response(
            status=error.status, body=error.body, headers=error.headers, content_type="application/json"
        )


def server_version() -> str:
    """The installed splitserve's version (what vLLM's `/version` answers)."""
    try:
        return metadata.version("splitserve")
    except metadata.PackageNotFoundError:
        return "unknown"


async def read_body(request: web.Request) -> bytes:
    """The body, up to MAX_BODY_BYTES (the application's client_max_size): a longer one is refused by its
    Content-Length before it is read, or as soon as it passes the limit."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise BodyTooLarge(MAX_BODY_BYTES)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BodyTooLarge(MAX_BODY_BYTES) from None


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own refusals (an unknown path's 404, a wrong method's 405) in OpenAI's error shape, with
    their headers (a 405's Allow)."""
    try:
        return await handler(request)
    except web.HTTPException as err:
        if err.status < 400:
            raise
        error_type = "invalid_request_error" if err.status < 500 else "server_error"
        message = f"{request.method} {request.path}: {err.reason}"
        body = json.dumps({"error": {"message": message, "type": error_type, "param": None, "code": None}})
        headers = {k: v for k, v in err.headers.items() if k.lower() not in ("content-type", "content-length")}
        return web.Response(status=err.status, body=body.encode(), headers=headers, content_type="application/json")


def waited_s_from(headers: Mapping[str, str]) -> float:
    """The client's wait from its send-time header; a bad value's error names the header (the shared
    rule names the gRPC metadata)."""
    if SENT_AT_KEY not in headers:
        return 0.0
    try:
        return client_wait_s(((SENT_AT_KEY, headers[SENT_AT_KEY]),))
    except InvalidRequestError as err:
        raise InvalidRequestError(SENT_AT_KEY, err.reason) from None
