"""bench_llamacpp without llama.cpp (CI has none): its arguments, its committed report, and its worker's import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_llamacpp

REPO = Path(__file__).resolve().parents[2]
REPORTS = sorted((REPO / "docs/perf/llamacpp_side_by_side").glob("*.json"))


def test_arguments_are_checked_naming_the_flag(capsys):
    args = bench_llamacpp.parse_args(["--llamacpp-python", "python3"])
    assert (args.threads, args.batch_sizes, args.output) == (2, "1,32", 32)
    for bad, flag in (
        (["--output", "1"], "--output"),
        (["--min-prompt", "200", "--max-prompt", "100"], "--min-prompt"),
    ):
        with pytest.raises(SystemExit):
            bench_llamacpp.parse_args(["--llamacpp-python", "python3", *bad])
        assert flag in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_llamacpp.parse_args([])  # the llama.cpp venv's python is required


def test_arms_pair_each_engine_width_with_a_gguf_type():
    kinds = [arm.gguf for arm in bench_llamacpp.ARMS if arm.gguf]
    assert kinds == ["F32", "Q8_0", "Q4_0"]
    assert all((arm.engine is None) != (arm.gguf is None) for arm in bench_llamacpp.ARMS)
    assert len({arm.name for arm in bench_llamacpp.ARMS}) == len(bench_llamacpp.ARMS)


def test_common_prefix():
    assert bench_llamacpp.common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert bench_llamacpp.common_prefix([1, 2], [1, 2, 3]) == 2
    assert bench_llamacpp.common_prefix([], [1]) == 0


def test_worker_imports_without_llama_cpp_and_names_a_bad_command():
    done = subprocess.run(
        [sys.executable, str(bench_llamacpp.WORKER), "benchmark"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "command: expected quantize or serve" in done.stderr
    done = subprocess.run(
        [sys.executable, str(bench_llamacpp.WORKER), "serve", "2", "1", "64"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.startswith("llama_cpp: not importable by")


def test_reports_are_committed():
    assert [path.name for path in REPORTS] == ["cpu-demo.json", "cpu.json"]


@pytest.mark.parametrize("path", REPORTS, ids=lambda path: path.name)
def test_committed_report_has_every_arm_and_the_agreement_check(path):
    report = json.loads(path.read_text())
    names = {arm.name for arm in bench_llamacpp.ARMS}
    assert report["settings"]["threads"] == 2
    assert report["versions"]["llama_cpp_python"] and report["versions"]["torch"] and report["machine"]
    assert set(report["results"]) == {"1", "32"}
    for rows in report["results"].values():
        assert set(rows) == names
        assert all(row["decode_tok_s"] > 0 and row["output_tok_s"] > 0 for row in rows.values())
    agreement = report["greedy_agreement"]
    output = report["settings"]["output"]
    assert len(agreement["hf_generate"]) == output
    for name in names:
        assert len(agreement[name]["tokens"]) == output
        assert agreement[name]["prefix_equal_to_hf"] == bench_llamacpp.common_prefix(
            agreement[name]["tokens"], agreement["hf_generate"]
        )
    assert agreement["engine fp32"]["prefix_equal_to_hf"] == output  # the engine's fp32 greedy is HF's
