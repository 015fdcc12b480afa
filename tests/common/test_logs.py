"""Log lines name the request they are about; bad --log-level / --log-format values fail naming the flag.
(JSON lines from a real cluster: tests/observability/test_logs.py.)"""
from __future__ import annotations

import io
import logging

import pytest

from common.logs import configure_logging


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
