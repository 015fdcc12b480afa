"""Log output of splitserve's processes: the level and format (`--log-level`, `--log-format text|json`), and
the request a line is about.

Each HTTP request and gRPC call runs with a `RequestLog` (router/access_log.py opens it); the router fills
in the request's id once it knows it, and its token counts when it ends. Every line logged meanwhile, by any
module, carries that id (`request_id`, in both formats), and the call ends with one access-log line on the
`splitserve.access` logger (method, path, status, duration, tokens). Prompt and output text are never logged.

JSON lines hold `time` (ISO 8601, UTC), `level`, `logger`, `message`, `request_id` when there is one, the
access line's fields, and `exception` with the traceback when one is attached.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
from dataclasses import dataclass
from datetime import UTC, datetime

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
ACCESS_LOGGER = "splitserve.access"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The access line's fields (LogRecord attributes set through `extra`), in the order JSON lines show them.
ACCESS_FIELDS = ("protocol", "method", "path", "status", "duration_ms", "prompt_tokens", "output_tokens")


@dataclass
class RequestLog:
    """What the log knows about the request being served; one object shared by the tasks serving it."""

    request_id: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0


_current: contextvars.ContextVar[RequestLog | None] = contextvars.ContextVar("splitserve_request_log", default=None)


def begin_request(request_id: str | None = None) -> tuple[RequestLog, contextvars.Token]:
    """Opens the record of a request for the current task (and the tasks it starts); `end_request` closes it."""
    record = RequestLog(request_id)
    return record, _current.set(record)


def end_request(token: contextvars.Token) -> None:
    _current.reset(token)


def current_request() -> RequestLog | None:
    return _current.get()


def set_request_id(request_id: str) -> None:
    """The request being served now is `request_id`, unless the call already named one (an HTTP request's
    `X-Request-Id`, which its choices' ids extend); no-op outside a request."""
    record = _current.get()
    if record is not None and record.request_id is None:
        record.request_id = request_id


def count_tokens(prompt_tokens: int, output_tokens: int) -> None:
    """Adds a finished request's tokens to the current record (several choices of one HTTP request add up)."""
    record = _current.get()
    if record is not None:
        record.prompt_tokens += prompt_tokens
        record.output_tokens += output_tokens


class RequestIdFilter(logging.Filter):
    """Sets `record.request_id` (None outside a request) on every line a handler emits."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            current = _current.get()
            record.request_id = current.request_id if current is not None else None
        return True


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = getattr(record, "request_id", None)
        return line if request_id is None else f"{line} [request_id={request_id}]"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            line["request_id"] = request_id
        for name in ACCESS_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(level: str = "info", fmt: str = "text", stream=None) -> logging.Handler:
    """Replaces the root logger's handlers with one writing `fmt` lines to `stream` (stderr) at `level`."""
    if level not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler


# How `splitserve serve` / `controller` hand their --log-level / --log-format to the processes the cluster
# starts (the controller actor, and the worker actors it starts): environment variables in the actors'
# runtime_env, read by `configure_logging_from_env` first thing in each actor's constructor.
LOG_LEVEL_ENV = "SPLITSERVE_LOG_LEVEL"
LOG_FORMAT_ENV = "SPLITSERVE_LOG_FORMAT"


def export_logging(level: str, fmt: str) -> None:
    """Makes `level` / `fmt` the log settings of the actors this process (and the controller) starts."""
    os.environ[LOG_LEVEL_ENV], os.environ[LOG_FORMAT_ENV] = level, fmt


def actor_log_env() -> dict[str, str]:
    """The environment variables an actor needs to log as this process was told to ({} when told nothing)."""
    return {name: os.environ[name] for name in (LOG_LEVEL_ENV, LOG_FORMAT_ENV) if name in os.environ}


def configure_logging_from_env() -> None:
    """In an actor's process: `configure_logging` with the exported settings; nothing when none were
    exported (the actor keeps Ray's default logging, as in tests that start clusters in-process)."""
    env = actor_log_env()
    if env:
        configure_logging(env.get(LOG_LEVEL_ENV, "info"), env.get(LOG_FORMAT_ENV, "text"))


def log_access(protocol: str, method: str, path: str, status: int | str, duration_s: float, record: RequestLog) -> None:
    """The access line of one finished HTTP request or gRPC call."""
    logging.getLogger(ACCESS_LOGGER).info(
        "%s %s %s %.1f ms",
        method,
        path,
        status,
        duration_s * 1000.0,
        extra={
            "protocol": protocol,
            "method": method,
            "path": path,
            "status": status,
            "duration_ms": round(duration_s * 1000.0, 3),
            "prompt_tokens": record.prompt_tokens,
            "output_tokens": record.output_tokens,
            "request_id": record.request_id,
        },
    )
