"""One access-log line per HTTP request and gRPC call, the request id on every log line about it, and the
W3C trace context a caller sent (common/logs.py, common/tracing.py).

`access_log` is the HTTP front's aiohttp middleware; the gRPC side is `AccessLogInterceptor` in
router/interceptors.py. Both open the request's `RequestLog` (the router's service fills in the request id
and the token counts) and continue the caller's `traceparent`, if any, for the spans the call makes.
"""

from __future__ import annotations

import time

from aiohttp import web

from common import logs, tracing

_QUIET_PATHS = ("/health", "/metrics")  # probes and scrapes: a line each would drown the requests


@web.middleware
async def access_log(request: web.Request, handler) -> web.StreamResponse:
    started_s = time.perf_counter()
    record, token = logs.begin_request(request.headers.get("X-Request-Id"))
    status = 500
    try:
        with tracing.remote_parent(request.headers):
            response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as err:
        status = err.status
        raise
    finally:
        logs.end_request(token)
        if request.path not in _QUIET_PATHS:
            logs.log_access("http", request.method, request.path, status, time.perf_counter() - started_s, record)
