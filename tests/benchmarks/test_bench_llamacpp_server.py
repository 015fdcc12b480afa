"""bench_llamacpp_server without llama-server (CI has none): its arguments, its arms, and its committed report."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

from benchmarks import bench_llamacpp_server as bench

REPO = Path(__file__).resolve().parents[2]
REPORT = REPO / "docs/perf/llamacpp_server/cpu.json"


def test_arguments_are_checked_naming_the_flag(capsys):
    args = bench.parse_args(["--llama-server", sys.executable])
    assert (args.threads, args.concurrency, args.output, args.batch1_requests) == (2, 32, 32, 4)
    for bad, flag in (
        (["--output", "1"], "--output"),
        (["--min-prompt", "200", "--max-prompt", "100"], "--min-prompt"),
        (["--concurrency", "0"], "--concurrency"),
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(["--llama-server", sys.executable, *bad])
        assert flag in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--llama-server", str(REPO / "README.md")])  # not executable
    assert "--llama-server: " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args([])  # the binary is required


def test_arms_pair_each_splitserve_width_with_a_gguf_type():
    assert [arm.kind for arm in bench.ARMS if arm.side == "llama.cpp"] == ["F32", "Q8_0", "Q4_0"]
    assert [arm.kind for arm in bench.ARMS if arm.side == "splitserve"] == ["none", "int8", "int4"]
    assert len({arm.name for arm in bench.ARMS}) == len(bench.ARMS)
    assert bench.BASELINE == "splitserve fp32"


def test_llama_server_command_line(tmp_path):
    args = bench.parse_args(["--llama-server", sys.executable, "--concurrency", "8", "--threads", "3"])
    server = bench.start_llama_server(args, "F32", "model.gguf", tmp_path)  # python refuses the flags at once
    server.process.wait(timeout=60)
    command = server.process.args
    assert command[command.index("--parallel") + 1] == "8"
    assert command[command.index("--ctx-size") + 1] == str(8 * (128 + 32 + 16))
    assert command[command.index("--threads") + 1] == command[command.index("--threads-batch") + 1] == "3"
    assert {"--no-kv-unified", "--no-cache-prompt"} <= set(command)
    with pytest.raises(SystemExit, match="llama-server F32: exited"):
        server.wait_ready(deadline_s=float("inf"))


def test_common_chars():
    assert bench._common_chars("abc", "abd") == 2
    assert bench._common_chars("ab", "abc") == 2
    assert bench._common_chars("", "a") == 0


def test_committed_report_has_every_arm_mode_and_the_agreement_check():
    report = json.loads(REPORT.read_text())
    names = {arm.name for arm in bench.ARMS}
    assert report["settings"]["threads"] == 2 and report["settings"]["concurrency"] == 32
    assert report["versions"]["llama_server"] and report["versions"]["torch"] and report["machine"]
    assert len(report["load_average_1min_per_round"]) == report["settings"]["rounds"]
    assert set(report["results"]) == {"concurrent", "batch1"}
    for rows in report["results"].values():
        assert set(rows) == names
        assert rows[bench.BASELINE]["output_tok_s_x_splitserve_fp32"] == 1.0
        for row in rows.values():
            assert row["output_tok_s"] > 0 and row["ttft_p50_ms"] > 0 and row["tpot_p50_ms"] > 0
            ratios = row["output_tok_s_x_splitserve_fp32_per_round"]
            assert len(ratios) == report["settings"]["rounds"]
            assert row["output_tok_s_x_splitserve_fp32_paired"] == statistics.median(ratios)
    agreement = report["greedy_agreement"]
    prompts = agreement["prompts"]
    assert len(prompts) == report["settings"]["agreement_prompts"]
    assert set(agreement["equal_to_hf"]) == {bench.BASELINE, "llama-server F32"}
    for name, count in agreement["equal_to_hf"].items():
        assert count == sum(p["servers"][name]["text"] == p["hf_generate_text"] for p in prompts)
    assert agreement["equal_to_hf"][bench.BASELINE] == len(prompts)  # splitserve's fp32 greedy is HF's
