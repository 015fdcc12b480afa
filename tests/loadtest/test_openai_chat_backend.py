"""`splitserve bench --backend openai-chat` against the router's own HTTP front: plain chat, tool calls
forced by tool_choice required, a JSON schema, and a ShareGPT-style conversation file as the workload."""
from __future__ import annotations

import json

import pytest

from loadtest.config import BenchConfig
from loadtest.lengths import LengthDist
from loadtest.plan import ModelLimits, RequestDefaults
from loadtest.poisson import PoissonSpec
from loadtest.records import read_jsonl
from loadtest.sharegpt import ShareGptSpec, read_conversations
from splitserve.cli import main as splitserve

RUN = ["--rate", "inf", "--max-concurrency", "2", "--no-progress", "--temperature", "1", "--seed", "31"]
CONVERSATIONS = [
    {"conversations": [{"from": "human", "value": "Tell me about the sea."}, {"from": "gpt", "value": "x" * 40}]},
    {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "And the sky?"},
                       {"from": "gpt", "value": "y" * 24}]},
    {"conversations": [{"from": "gpt", "value": "no question"}]},
    {"id": "no conversations"},
]


@pytest.mark.parametrize("chat_format", ["plain", "tools", "json-schema"])
def test_chat_formats_run_and_count_exact_tokens(router_stack, tmp_path, chat_format):
    out = tmp_path / chat_format
    splitserve(["bench", "--backend", "openai-chat", "--target", router_stack.server.http.url, "--chat-format",
                chat_format, "--num-requests", "3", "--prompt-len", "fixed:12", "--output-len", "fixed:48",
                *RUN, "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests_completed"] == 3 and summary["errors"] == {}
    records = read_jsonl(out / "records.jsonl")
    if chat_format == "plain":  # ignore_eos: the planned length exactly
        assert all(r.output_tokens == 48 for r in records)
    else:  # the grammar ends the answer (or the planned length cuts it)
        assert all(1 <= r.output_tokens <= 48 for r in records)
    assert all(r.prompt_tokens > 12 for r in records)  # the chat template's tokens besides the prompt's
    router_stack.check_workers_clean()


def test_a_sharegpt_file_is_a_workload(router_stack, tmp_path):
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(CONVERSATIONS))
    out = tmp_path / "out"
    splitserve(["bench", "--backend", "openai-chat", "--target", router_stack.server.http.url, "--workload",
                "sharegpt", "--dataset", str(dataset), *RUN, "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests_completed"] == 2 and summary["notes"]["skipped"] == 2


def test_sharegpt_reading_and_lengths(tmp_path):
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(CONVERSATIONS))
    assert read_conversations(str(dataset)) == ([("Tell me about the sea.", "x" * 40), ("And the sky?", "y" * 24)], 2)
    plan = ShareGptSpec(str(dataset), 2.0, num_requests=3).build(ModelLimits(512, 512, 16, (1,)), RequestDefaults(), 0)
    assert [(r.prompt_text, r.max_tokens) for r in plan.requests] == [
        ("Tell me about the sea.", 10), ("And the sky?", 6), ("Tell me about the sea.", 10)]
    dataset.write_text("{}")
    with pytest.raises(ValueError, match="JSON list"):
        read_conversations(str(dataset))


@pytest.mark.parametrize("fields, message", [
    ({"backend": "openai", "chat_format": "tools"}, "--chat-format applies to --backend openai-chat"),
    ({"backend": "openai-chat", "chat_format": "xml"}, "--chat-format must be one of"),
    ({"backend": "openai-chat", "target": "127.0.0.1:8000"}, "http"),
])
def test_chat_flags_are_checked(fields, message):
    spec = PoissonSpec(1, 1.0, LengthDist.parse("fixed:4"), LengthDist.parse("fixed:4"))
    with pytest.raises(ValueError, match=message):
        BenchConfig(**{"target": "http://127.0.0.1:8000", "workload": "poisson", "spec": spec, **fields})
