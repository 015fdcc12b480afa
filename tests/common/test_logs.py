"""Log lines name the request they are about; bad --log-level / --log-format values fail naming the flag.
(JSON lines from a real cluster: tests/observability/test_logs.py.)"""
from __future__ import annotations

import io
import logging

import pytest

from common.logs import (
    LOG_FORMAT_ENV,
    LOG_LEVEL_ENV,
    actor_log_env,
    configure_logging,
    configure_logging_from_env,
    export_logging,
)


def test_text_lines_name_the_request_and_bad_settings_fail_naming_the_flag():
    from common import logs

    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.addFilter(logs.RequestIdFilter())
    handler.setFormatter(logs.TextFormatter())
    logger = logging.getLogger("tests.observability.text")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        _, token = logs.begin_request()
        logs.set_request_id("r-7")
        logger.info("about a request")
        logs.end_request(token)
        logger.info("about nothing")
    finally:
        logger.removeHandler(handler)
    first, second = buffer.getvalue().splitlines()
    assert first.endswith("about a request [request_id=r-7]") and second.endswith("about nothing")
    with pytest.raises(ValueError, match="--log-format must be one of text, json"):
        configure_logging("info", "xml")
    with pytest.raises(ValueError, match="--log-level must be one of"):
        configure_logging("loud", "json")


def test_the_exported_settings_reach_an_actor_process_through_its_runtime_env(ray_session, monkeypatch):
    """What `splitserve serve --log-format json --log-level debug` passes on to the controller and workers:
    a real Ray actor started with `actor_log_env()` logs JSON at debug, one started without it does not."""
    for name in (LOG_LEVEL_ENV, LOG_FORMAT_ENV):  # set, then removed: undone after the test either way
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert actor_log_env() == {}
    export_logging("debug", "json")
    assert actor_log_env() == {LOG_LEVEL_ENV: "debug", LOG_FORMAT_ENV: "json"}

    def root_logging():  # what an actor's constructor does first, then what its process logs with
        configure_logging_from_env()
        root = logging.getLogger()
        return [type(h.formatter).__name__ for h in root.handlers], logging.getLevelName(root.level)

    probe = ray_session.remote(root_logging)
    exported = probe.options(runtime_env={"env_vars": actor_log_env()}).remote()
    assert ray_session.get(exported, timeout=120) == (["JsonFormatter"], "DEBUG")
    formatters, _ = ray_session.get(probe.remote(), timeout=120)
    assert "JsonFormatter" not in formatters
