"""`splitserve bench --backend openai` against the router's own HTTP front (a real OpenAI-compatible
server), side by side with the gRPC backend on the same router: same summary keys, exact token counts,
prefix hits from the usage's cached tokens."""
from __future__ import annotations

import json

import pytest

from splitserve.cli import main as splitserve
from loadtest.backends import RequestError
from loadtest.openai_backend import _event
from loadtest.records import read_jsonl

SHARED_PREFIX = ["--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "3", "--prefix-len", "64",
                 "--suffix-len", "8", "--output-len", "fixed:5", "--rate", "inf", "--max-concurrency", "1",
                 "--ttft-ms", "60000", "--tpot-ms", "60000", "--seed", "12", "--no-progress"]
# (a seed no other test of this package sends: the package shares one router stack, and the first request
# of each group must find its prefix uncached)


def test_openai_backend_runs_the_workload_like_the_grpc_one(router_stack, router_target, tmp_path):
    url = router_stack.server.http.url
    for backend, target in (("openai", url), ("splitserve", router_target)):
        splitserve(["bench", "--backend", backend, "--target", target, *SHARED_PREFIX,
                    "--out", str(tmp_path / backend), "--plot", str(tmp_path / f"{backend}-plots")])
    summaries = {b: json.loads((tmp_path / b / "summary.json").read_text()) for b in ("openai", "splitserve")}
    assert summaries["openai"].keys() == summaries["splitserve"].keys()
    assert summaries["openai"]["ttft_ms"].keys() >= {"mean", "median", "std", "p99"}
    ours = summaries["openai"]
    assert ours["run"]["backend"] == "openai" and ours["run"]["model"]["vocab_size"] == 512
    assert ours["requests_completed"] == 6 and ours["errors"] == {} and ours["slo_attainment"] == 1.0
    records = read_jsonl(tmp_path / "openai" / "records.jsonl")
    assert all(r.ok and r.output_tokens == 5 and r.prompt_tokens == 72 for r in records)
    # one at a time: each group's first request finds nothing cached, the later ones the shared prefix
    assert [r.cached_prompt_tokens for r in records[:2]] == [0, 0]
    assert all(0 < r.cached_prompt_tokens <= 64 for r in records[2:])
    assert ours["ttft_ms"]["count"] == 6 and ours["itl_ms"]["count"] == 6 * 4
    router_stack.check_workers_clean()


def test_errors_come_back_as_the_same_status_names(router_stack, tmp_path):
    out = tmp_path / "out"
    splitserve(["bench", "--backend", "openai", "--target", router_stack.server.http.url, "--num-requests", "2",
                "--prompt-len", "fixed:8", "--output-len", "fixed:2", "--rate", "inf", "--ttft-ms", "60000",
                "--priority", "1000", "--tenant", "t", "--no-progress", "--out", str(out), "--seed", "3",
                "--temperature", "0"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests_completed"] == 2  # priority / tenant / SLO ride along as extra body fields


def test_sse_events_of_other_servers():
    # vLLM-style: text only, usage in the last chunk
    event = _event({"choices": [{"index": 0, "text": " hi", "finish_reason": None}]})
    assert (event.num_tokens, event.exact) == (1, False)
    assert _event({"choices": [{"index": 0, "text": "", "finish_reason": None}]}).num_tokens == 0
    usage = _event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7}})
    assert (usage.num_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (0, 7, None)
    chat = _event({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}]})
    assert (chat.num_tokens, chat.finish_reason) == (1, "stop")
    with pytest.raises(RequestError) as err:
        _event({"error": {"message": "boom", "code": 503}})
    assert (err.value.code, err.value.reason) == ("UNAVAILABLE", "boom")
    with pytest.raises(RequestError) as err:
        _event({"error": {"message": "late", "type": "timeout", "code": "deadline_exceeded"}})
    assert err.value.code == "DEADLINE_EXCEEDED"
