"""Logs as an operator collects them: with `--log-format json` every line parses, every line about a request
carries its id, each HTTP request and gRPC call ends with one access line (method, status, duration,
tokens), and no prompt text is logged. (Cluster: tests/observability/conftest.py.)"""
from __future__ import annotations

import io
import json
import logging

import openai
import pytest

from common.logs import ACCESS_LOGGER, configure_logging
from common.metric_identity import served_model_name
from splitserve_client.client import Client
from tests.factories import TinySpec


@pytest.fixture
def json_lines():
    """Root logging as `--log-level debug --log-format json` sets it, into a buffer; restored afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    buffer = io.StringIO()
    configure_logging("debug", "json", buffer)
    try:
        yield lambda: [json.loads(line) for line in buffer.getvalue().splitlines()]
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


def test_json_lines_carry_each_requests_id_and_one_access_line(stack, checkpoint, json_lines):
    model = served_model_name(checkpoint(TinySpec()))
    prompts = {f"logged-{i}": f"secret prompt number {i} xyzzy" for i in range(3)}
    with openai.OpenAI(base_url=f"{stack.server.http.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        for request_id, prompt in prompts.items():
            client.completions.create(model=model, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True},
                                      extra_headers={"X-Request-Id": request_id})
    with Client(stack.target) as client:
        assert len(client.generate("a grpc call that is logged xyzzy", request_id="logged-grpc", max_tokens=3,
                                   ignore_eos=True).token_ids) == 3
    lines = json_lines()
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    for request_id in (*prompts, "logged-grpc"):
        about = [line for line in lines if request_id in line["message"] or line.get("request_id") == request_id]
        assert len(about) >= 2, request_id  # its routing line and its access line at least
        assert all(line.get("request_id") == request_id for line in about), about
        (access,) = [line for line in about if line["logger"] == ACCESS_LOGGER]
        grpc_call = request_id == "logged-grpc"
        assert access["protocol"] == ("grpc" if grpc_call else "http")
        assert access["path"] == ("/splitserve.v1.Router/Generate" if grpc_call else "/v1/completions")
        assert access["status"] == ("OK" if grpc_call else 200) and access["duration_ms"] > 0
        assert access["output_tokens"] == (3 if grpc_call else 4) and access["prompt_tokens"] > 0
    assert not any("xyzzy" in json.dumps(line) for line in lines), "prompt text must not be logged"

