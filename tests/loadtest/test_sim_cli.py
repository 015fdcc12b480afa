"""`splitserve profile`, `simulate` and `plan` through the real command entry, on a tiny checkpoint."""
from __future__ import annotations

import json

import pytest

from sim.profile import Profile
from sim.step_cost import prefill_pairs
from splitserve.cli import main as splitserve


@pytest.fixture(scope="module")
def measured(checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "cpu.json"
    splitserve(["profile", "--quick", "--model", str(checkpoint()), "--out", str(path)])
    return path


def test_profile_measures_the_engine_and_fits_it(measured):
    profile = Profile.load(measured)
    assert profile.kind == "measured" and profile.tp_sizes == (1,)
    assert profile.model.block_size == 16 and profile.model.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    # prefill: chunks 8, 32, 128 after 0 and after 128 tokens (512 reaches max_model_len); decode: 3 x 2
    assert profile.source["samples"] == 3 + 3 + 6
    cost = profile.step_cost(1)
    # A 256-token prompt's prefill step (its attention pairs included: the tiny model's steps are mostly
    # fixed cost, and a noisy fit may put all the growth into the pair term) costs more than one decode
    # token at that context.
    assert 0 < cost.seconds(1, 1, 0.0, 256) < cost.seconds(256, 1, prefill_pairs(0, 256))
    # The tiny model's steps are timer noise on a busy box: the fit is loose, but it is reported.
    assert 0 <= profile.source["fit_rms_relative_error"] < 1.0


def test_profile_takes_the_device_and_the_workers_kv_memory(checkpoint, tmp_path, capsys):
    """A GPU box's profile is written with `--device cuda` and the KV memory its workers get (measured
    on an H200: docs/perf/profile/h200.json); here the same flags on CPU."""
    path = tmp_path / "cpu-kv.json"
    splitserve(["profile", "--quick", "--model", str(checkpoint()), "--device", "cpu", "--kv-cache-gib", "0.01",
                "--decode-contexts", "96,32", "--decode-batches", "2", "--out", str(path)])
    profile = Profile.load(path)
    assert profile.source["grid"]["contexts"] == [32, 96] and profile.source["grid"]["batches"] == [2]
    decode_steps = [step for step in profile.source["steps"] if step[2] == 0.0]  # no prefill pairs
    short, long = sorted(step[3] / 2 for step in decode_steps)  # KV each of the two sequences read
    assert 32 <= short < 48 and 96 <= long < 112
    block = profile.model.block_size  # whole blocks of the given memory (below the pool's cap here)
    assert profile.kv_capacity_tokens[1] == int(0.01 * 2**30) // (profile.model.kv_bytes_per_token * block) * block
    bad = (["--kv-cache-gib", "0"], "--kv-cache-gib"), (["--device", "tpu"], "device")
    for flags, named in (*bad, (["--decode-contexts", "64,x"], "--decode-contexts")):
        with pytest.raises(SystemExit):
            splitserve(["profile", "--quick", "--model", str(checkpoint()), "--out", str(path), *flags])
        assert named in capsys.readouterr().err


def test_roofline_profile_is_labelled(tmp_path, capsys):
    path = tmp_path / "h100.json"
    splitserve(["profile", "--roofline", "--model", "llama-3.2-1b", "--gpu", "h100", "--tp", "1,2", "--out", str(path)])
    assert "ROOFLINE" in capsys.readouterr().out and Profile.load(path).tp_sizes == (1, 2)


def test_simulate_reports_as_the_bench_does(measured, tmp_path, capsys):
    out = tmp_path / "summary.json"
    splitserve(["simulate", "--profile", str(measured), "--prefill", "2", "--workload", "shared-prefix",
                "--groups", "2", "--prompts-per-group", "4", "--prefix-len", "64", "--suffix-len", "8",
                "--rate", "2", "--ttft-ms", "5000", "--json", str(out)])
    text = capsys.readouterr().out
    assert "splitserve bench: shared-prefix" in text and "simulated requests/s" in text
    summary = json.loads(out.read_text())
    assert summary["requests_completed"] == 8 and summary["cluster"] == "2P1D"
    assert summary["prefix_hit_rate"] > 0  # later prompts of a group hit its 64-token prefix


def test_plan_prints_the_table_and_sizes_a_fleet(measured, tmp_path, capsys):
    out = tmp_path / "plan.json"
    splitserve(["plan", "--profile", str(measured), "--workload", "poisson", "--rate", "2", "--num-requests", "40",
                "--ttft-ms", "2000", "--tpot-ms", "500", "--max-workers", "3", "--fleet-rate", "20",
                "--fleet-duration-s", "60", "--json", str(out)])
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert {r["shape"] for r in report["rows"]} == {"1P1D", "1P2D", "2P1D", "1C", "2C", "3C"}
    assert report["choice"] == report["rows"][0]["shape"] and f"->{report['choice']}" in text.replace(" ", "")
    assert report["fleet"]["requests"] >= 40 and report["fleet"]["simulated_requests_per_s"] > 0
    # The fleet is copies of the choice, each with its router: none refused for one router's limit.
    chosen = next(r for r in report["rows"] if r["shape"] == report["choice"])
    assert report["fleet"]["routers"] == report["fleet"]["workers"] // chosen["workers"]


def test_a_fleet_far_beyond_one_routers_limit_is_not_refused_by_it(measured, tmp_path):
    """--router-max-requests 2: one router would refuse most of a 200 req/s fleet's traffic; the fleet
    check gives every copy of the chosen shape its own router, as the plan assumed for one."""
    out = tmp_path / "plan.json"
    splitserve(["plan", "--profile", str(measured), "--workload", "poisson", "--rate", "1", "--num-requests", "20",
                "--ttft-ms", "5000", "--tpot-ms", "1000", "--max-workers", "2", "--router-max-requests", "2",
                "--fleet-rate", "200", "--fleet-duration-s", "5", "--json", str(out)])
    fleet = json.loads(out.read_text())["fleet"]
    assert fleet["routers"] > 1 and fleet["requests"] >= 200
    assert fleet["rejected"] <= 0.05 * fleet["requests"], fleet


def test_plan_refuses_a_run_without_an_slo(measured, capsys):
    with pytest.raises(SystemExit):
        splitserve(["plan", "--profile", str(measured), "--workload", "poisson"])
    assert "--ttft-ms" in capsys.readouterr().err


def test_plan_says_when_trace_rows_did_not_fit_the_model(measured, tmp_path, capsys):
    """Rows longer than the profile's model are dropped before planning; the table must say so, or a
    plan for the short half of a trace reads like a plan for all of it."""
    rows = [{"timestamp": 100 * i, "input_length": 600 if i % 3 == 0 else 40, "output_length": 8,
             "hash_ids": [i, 100 + i] if i % 3 == 0 else [i]} for i in range(12)]
    trace = tmp_path / "mooncake.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    max_model_len = Profile.load(measured).model.max_model_len
    assert max_model_len < 600 + 8
    splitserve(["plan", "--profile", str(measured), "--workload", "trace", "--trace", str(trace),
                "--trace-prompt-scale", "1", "--ttft-ms", "5000", "--max-workers", "2"])
    text = capsys.readouterr().out
    assert (f"workload: dropped 4 of 12 rows (exceeds max_model_len after scaling); the profile's model takes "
            f"{max_model_len:,} tokens") in text


def test_a_gpu_profile_reaches_long_contexts_by_default():
    """On a GPU the decode points and the prefill chunks' earlier context go to 16,384 tokens unless told
    otherwise (a profile that stops decode at 1,024 fits the KV-reading term at 0 on an H200, and one with
    prefill after at most 1,024 tokens fits the attention-pair term at 0); a CPU keeps
    its short grid."""
    from loadtest.profile_cli import GPU_DECODE_CONTEXTS, GPU_PREFILL_STARTS, _grid, build_parser

    def grid(*flags):
        return _grid(build_parser().parse_args(["--out", "p.json", *flags]))

    assert grid("--device", "cuda").contexts == GPU_DECODE_CONTEXTS == (64, 1024, 4096, 16384)
    assert grid("--device", "cuda:1", "--decode-contexts", "128").contexts == (128,)
    assert grid().contexts == (64, 256, 1024) and grid("--device", "cuda", "--quick").contexts == (32, 128)
    assert grid("--device", "cuda").starts == GPU_PREFILL_STARTS == (0, 256, 1024, 4096, 16384)
    assert grid("--device", "cuda", "--prefill-starts", "512,0").starts == (0, 512)
    assert grid().starts == (0, 256, 1024)
    with pytest.raises(ValueError, match="--prefill-starts"):
        grid("--prefill-starts", "-1")


def test_simulate_runs_the_routers_admission_policy(tmp_path, capsys):
    # threshold with max_queued_prompt_tokens = 1: a request routed while another's prompt is still queued on
    # its one prefill worker is refused. 40 requests at once (a rate far above what one worker prefills).
    profile, settings = tmp_path / "h100.json", tmp_path / "admission.json"
    splitserve(["profile", "--roofline", "--model", "llama-3.2-1b", "--gpu", "h100", "--out", str(profile)])
    settings.write_text(json.dumps({"max_queued_prompt_tokens": 1}))
    runs = {}
    for policy, extra in (("always", []), ("threshold", ["--admission-config", str(settings)])):
        out = tmp_path / f"{policy}.json"
        splitserve(["simulate", "--profile", str(profile), "--workload", "poisson", "--rate", "100000",
                    "--num-requests", "40", "--ttft-ms", "5000", "--admission", policy, *extra, "--json", str(out)])
        runs[policy] = json.loads(out.read_text())
    capsys.readouterr()
    assert runs["always"]["rejection_rate"] == 0
    assert 0 < runs["threshold"]["rejection_rate"] < 1
    with pytest.raises(SystemExit):
        splitserve(["simulate", "--profile", str(profile), "--workload", "poisson", "--num-requests", "4",
                    "--admission", "ttft"])
