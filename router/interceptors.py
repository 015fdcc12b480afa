"""The router's server interceptors: bearer-token auth, exceptions → status codes, and the access log (with
the caller's trace context: router/access_log.py).

The error interceptor is the only place a domain exception becomes a gRPC status: servicer methods
just raise. It wraps unary and server-streaming handlers alike; the status's field name and
retry-after travel in trailing metadata (keys in splitserve_client.sdk_types) as well as in the details text.
"""

from __future__ import annotations

import hmac
import logging
import time

import grpc

from common import logs, tracing
from router.errors import Status, Unauthenticated, status_for
from router.metrics import RouterMetrics
from splitserve_client.sdk_types import FIELD_KEY, RETRY_AFTER_KEY

log = logging.getLogger(__name__)
_OPEN_METHODS = ("/grpc.health.v1.Health/",)  # probes (Kubernetes, Docker) carry no token


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(_OPEN_METHODS):
            return await continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode(), self._expected):
            return await continuation(handler_call_details)
        return _failing_handler(Unauthenticated("missing or invalid bearer token in 'authorization' metadata"))


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Counts every failed call by outcome in `metrics` (successful streams are counted by the
    service, which knows whether they met their SLO)."""

    def __init__(self, metrics: RouterMetrics):
        self.metrics = metrics
        # method → (handler found, its wrapped version): the lookup returns the same handler object
        # for a method every call, so it is wrapped once instead of per call.
        self._wrapped: dict[str, tuple] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        cached = self._wrapped.get(handler_call_details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler)
        self._wrapped[handler_call_details.method] = (handler, wrapped)
        return wrapped

    def _wrap(self, handler):
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer
            )
        return handler

    def _wrap_unary(self, method):
        async def call(request, context):
            try:
                return await method(request, context)
            except Exception as err:  # noqa: BLE001 - every error becomes a status here (_abort classifies and logs)
                await self._abort(context, err)

        return call

    def _wrap_stream(self, method):
        async def call(request, context):
            try:
                async for response in method(request, context):
                    yield response
            except Exception as err:  # noqa: BLE001 - every error becomes a status here (_abort classifies and logs)
                await self._abort(context, err)

        return call

    async def _abort(self, context, err: Exception) -> None:
        if isinstance(err, grpc.aio.AbortError):  # already a status (context.abort in a handler)
            raise err
        status = status_for(err)
        if status.code is grpc.StatusCode.INTERNAL:
            log.error("unexpected error in a router call", exc_info=err)
        self.metrics.observe_request(status.outcome)
        await abort_with(context, status)


class AccessLogInterceptor(grpc.aio.ServerInterceptor):
    """One access-log line per call (health checks aside), the request id on every line logged meanwhile, and
    the caller's `traceparent` metadata as the parent of the call's spans. Outermost: it sees the final status."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_OPEN_METHODS):
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _logged_unary(method, handler.unary_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _logged_stream(method, handler.unary_stream), handler.request_deserializer, handler.response_serializer
            )
        return handler


def _logged_unary(path: str, method):
    async def call(request, context):
        started_s, metadata = time.perf_counter(), dict(context.invocation_metadata() or ())
        record, token = logs.begin_request(metadata.get("x-request-id"))
        try:
            with tracing.remote_parent(metadata):
                return await method(request, context)
        finally:
            logs.end_request(token)
            logs.log_access("grpc", "POST", path, _code_name(context), time.perf_counter() - started_s, record)

    return call


def _logged_stream(path: str, method):
    async def call(request, context):
        started_s, metadata = time.perf_counter(), dict(context.invocation_metadata() or ())
        record, token = logs.begin_request(metadata.get("x-request-id"))
        try:
            with tracing.remote_parent(metadata):
                async for response in method(request, context):
                    yield response
        finally:
            logs.end_request(token)
            logs.log_access("grpc", "POST", path, _code_name(context), time.perf_counter() - started_s, record)

    return call


def _code_name(context) -> str:
    code = context.code()
    return "OK" if code is None else getattr(code, "name", str(code))


async def abort_with(context, status: Status) -> None:
    trailing = []
    if status.field:
        trailing.append((FIELD_KEY, status.field))
    if status.retry_after_s is not None:
        trailing.append((RETRY_AFTER_KEY, str(int(status.retry_after_s * 1000))))
    await context.abort(status.code, status.details, trailing_metadata=tuple(trailing))


def _failing_handler(err: Exception):
    """A handler that fails every call with `err`'s status (works for unary and streaming callers)."""

    async def fail(request, context):
        await abort_with(context, status_for(err))

    return grpc.unary_unary_rpc_method_handler(fail)
