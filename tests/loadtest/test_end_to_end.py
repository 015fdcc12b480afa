"""`splitserve bench` against a real router on loopback (tests/router's `router_target`: a Ray cluster of
one prefill and one decode worker over the tiny Llama checkpoint), through the real command entry."""
from __future__ import annotations

import json


from splitserve.cli import main as splitserve
from loadtest.records import read_jsonl

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def max_open(records) -> int:
    """Most requests open at one time (a request ending as another starts counts as closed first)."""
    events = sorted([(r.end_s, -1) for r in records] + [(r.send_s, 1) for r in records])
    open_now = peak = 0
    for _, delta in events:
        open_now += delta
        peak = max(peak, open_now)
    return peak


def test_shared_prefix_run_reports_prefix_hits_and_slo(router_stack, router_target, tmp_path, capsys):
    out, plots = tmp_path / "out", tmp_path / "plots"
    splitserve(["bench", "--target", router_target, "--workload", "shared-prefix", "--groups", "2",
                "--prompts-per-group", "3", "--prefix-len", "64", "--suffix-len", "8", "--output-len", "fixed:4",
                "--rate", "inf", "--max-concurrency", "1", "--ttft-ms", "60000", "--tpot-ms", "60000",
                "--seed", "11", "--no-progress", "--out", str(out), "--plot", str(plots)])
    records = read_jsonl(out / "records.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    assert [r.index for r in records] == list(range(6))
    assert all(r.ok and r.finish_reason == "length" and r.output_tokens == 4 for r in records)
    assert all(r.prompt_tokens == 72 and r.ttft_slo_ms == 60000.0 for r in records)
    # one at a time: each group's first request finds nothing cached, the later ones its 64-token prefix
    assert [r.cached_prompt_tokens for r in records[:2]] == [0, 0]
    assert all(0 < r.cached_prompt_tokens <= 64 for r in records[2:])
    assert summary["requests_completed"] == 6 and summary["requests_failed"] == 0
    assert summary["slo_attainment"] == 1.0 and summary["errors"] == {}
    assert summary["goodput_per_s"] == summary["request_throughput_per_s"] > 0
    assert summary["prefix_hit_rate"] == sum(r.cached_prompt_tokens for r in records) / (6 * 72)
    assert summary["ttft_ms"]["count"] == 6 and summary["tpot_ms"]["count"] == 6
    assert summary["run"]["model"]["block_size"] >= 1 and summary["notes"]["groups"] == 2
    assert sorted(p.name for p in plots.iterdir()) == ["e2e_cdf.png", "tpot_cdf.png", "ttft_cdf.png"]
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in plots.iterdir())
    assert "splitserve bench: shared-prefix" in capsys.readouterr().out
    router_stack.check_workers_clean()


def test_sweep_bounded_in_time_accounts_for_every_request(router_stack, router_target, tmp_path):
    out = tmp_path / "out"
    splitserve(["bench", "--target", router_target, "--workload", "poisson", "--sweep", "4,8",
                "--num-requests", "12", "--prompt-len", "uniform:8,40", "--output-len", "fixed:400",
                "--duration-s", "1.0", "--grace-s", "0.3", "--max-concurrency", "3", "--no-progress",
                "--out", str(out), "--plot", str(tmp_path / "plots")])
    sweep = json.loads((out / "sweep.json").read_text())
    assert [p["rate_per_s"] for p in sweep["points"]] == [4.0, 8.0]
    codes = []
    for rate in ("4", "8"):
        records = read_jsonl(out / f"rate-{rate}" / "records.jsonl")
        summary = json.loads((out / f"rate-{rate}" / "summary.json").read_text())
        assert summary["rate_per_s"] == float(rate)
        assert len(records) + summary["requests_not_issued"] == summary["requests_planned"] == 12
        assert all(r.arrival_s <= r.send_s < 1.0 for r in records)  # never early, never after --duration-s
        assert max_open(records) <= 3  # --max-concurrency
        assert all(r.ok or r.error_code in ("CANCELLED", "RESOURCE_EXHAUSTED") for r in records)
        assert all(r.end_s <= 1.0 + 0.3 + 0.5 for r in records)  # grace, plus cancellation's own latency
        assert sum(summary["errors"].values()) == summary["requests_failed"]
        codes += [r.error_code for r in records]
    # 400 tokens take ~0.7 s on the tiny model here (more on a slower machine): the last ones issued
    # before 1.0 s are still streaming at 1.3 s and are cancelled
    assert "CANCELLED" in codes
    assert {p.name for p in (tmp_path / "plots").iterdir()} >= {"slo_attainment_vs_rate.png", "goodput_vs_rate.png"}
    router_stack.check_workers_clean()


def test_mooncake_replay_shares_the_traces_first_block(router_stack, router_target, tmp_path):
    from tests.loadtest.test_trace import CONVERSATION as FULL
    from tests.loadtest.test_trace_slices import CONVERSATION as SLICE

    conversation = FULL if FULL.is_file() else SLICE
    out = tmp_path / "out"
    splitserve(["bench", "--target", router_target, "--workload", "trace", "--trace", str(conversation),
                "--num-requests", "4", "--trace-speedup", "1000", "--trace-output-scale", "0.01",
                "--max-concurrency", "1", "--no-progress", "--out", str(out)])
    records = read_jsonl(out / "records.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    block_size = summary["run"]["model"]["block_size"]
    assert len(records) == 4 and all(r.ok for r in records)
    # every conversation request starts with hash id 0, i.e. the same first KV block of tokens
    assert records[0].cached_prompt_tokens == 0
    assert all(r.cached_prompt_tokens >= block_size for r in records[1:])
    assert summary["notes"]["format"] == "mooncake" and summary["notes"]["rows_read"] == sum(1 for _ in conversation.open())
    router_stack.check_workers_clean()
