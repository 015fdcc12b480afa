"""The simulator against a real `splitserve bench` run, in CI: 1P1D at one rate (benchmarks/validate_sim.py,
the full validation, runs 3 shapes x 3 rates: docs/performance.md has its table).

In one test, on the tiny test model: the engine's profile measured in this process (the quick grid),
the cluster's overheads calibrated against the running 1P1D cluster, then one Poisson bench run for
real and the simulation of the very same requests. Asserted: goodput within 30%, under an SLO
(TTFT 200 ms, TPOT 60 ms) loose enough that a shared 2-core machine's contention does not decide it (10-15x the tiny
model's p50s here, 2-3x the p99s measured at a load average of 14) and tight enough to matter: the
same simulation with every cost 20x dearer (engine steps, cluster overheads, hand-off) must miss the
measured goodput by more than the bound, so an order-of-magnitude modelling error fails the check
instead of hiding under a loose SLO. That is all a CI check can promise on such a machine: contention moves
the measured tail latencies by up to ~10x, so a tighter SLO would fail whenever the machine is busy.

Why goodput and why 30% (the full validation's target is 15%): a CI machine has 2 cores shared with
other jobs, and the profile times one engine alone, so every latency figure carries CPU the simulator
models only on average (the full validation, calibrated and with the host's streaming CPU measured,
misses some cells; docs/performance.md has its current count). Goodput (requests meeting the SLO per second) is what the planner
sizes pools by, and at a rate the cluster can serve it stays near the offered rate on both sides
unless the model of step costs, batching or hand-off is grossly wrong — a profile off by 20x, a
hand-off charged per token instead of per byte, batches never formed: those push the predicted
latencies past the SLO and the predicted goodput far below the measured one. 30% leaves room for
the requests a noisy run loses to the SLO (32 requests: one is 3%) without hiding such an
error. The latencies are printed (pytest -s) for the record, not asserted.

The run is repeated once (`--repeats 2`): the second sends the same requests under another tenant,
which must hit none of the prefix cache the first filled; the row pools both and says how the two
real runs compare with each other.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
from argparse import Namespace

import pytest

from benchmarks.resimulate_validation import resimulate
from benchmarks.validate_sim import ShapeModel, calibration_entry, run_shape, spec_for
from benchmarks.validate_sim_predict import SETTINGS
from benchmarks.validate_sim_report import format_row
from sim.config import SimConfig
from sim.profile import Profile, Transfer
from sim.profiler import Grid, measure_profile
from sim.simulator import simulate
from loadtest.cluster_calibration import CALIBRATION_LENGTHS
from loadtest.records import read_jsonl
from loadtest.sim_workload import limits_of, sim_requests
from tests.factories import TinySpec

GOODPUT_BOUND = 0.30


def test_simulator_predicts_the_goodput_of_a_real_1p1d_bench_run(ray_session, checkpoint, tmp_path):
    model_dir = str(checkpoint(TinySpec()))
    profile = measure_profile(model_dir, threads=1, grid=Grid.quick())
    args = Namespace(rates=[4.0], num_requests=32, prompt_len="uniform:16,200", output_len="uniform:8,24",
                     ttft_ms=200.0, tpot_ms=60.0, max_concurrency=64, seed=0, dump=str(tmp_path),
                     calibration_probes=CALIBRATION_LENGTHS[:16], repeats=2,  # half the full fit's probes
                     warmup_steady=8)
    model, (row,) = asyncio.run(
        asyncio.wait_for(run_shape(model_dir, (1, 1), ShapeModel(profile, None), args, calibrate=True), 120)
    )
    profile = model.profile
    print(format_row(row), profile.overheads)
    # The decode workers' own step timings were read around the probes: the decode step scale is
    # measured (the engines' batch-1 step over the profile's), not left at its default.
    assert profile.overheads.decode_step_scale != 1.0 and 0.25 < profile.overheads.decode_step_scale < 8.0
    goodput = row["goodput"]
    assert goodput["measured"] > 0 and goodput["predicted"] > 0
    assert abs(goodput["error"]) <= GOODPUT_BOUND, format_row(row)
    # --dump: the measured and the simulated requests side by side, one line each, same indices.
    folder = tmp_path / "1P1D_4"
    measured = [_indices(folder / f"run-{k}" / "records.jsonl") for k in (1, 2)]
    assert measured[0] == measured[1] == _indices(folder / "sim_records.jsonl") == set(range(args.num_requests))
    # the repeat: the same prompts, none of them served from the first run's cache
    runs = [read_jsonl(folder / f"run-{k}" / "records.jsonl") for k in (1, 2)]
    assert [r.prompt_tokens for r in runs[0]] == [r.prompt_tokens for r in runs[1]]
    assert {r.tenant for r in runs[1]} == {"repeat-1"} and sum(r.cached_prompt_tokens or 0 for r in runs[1]) == 0
    assert len(row["repeats"]) == 2 and set(row["noise_floor"]) == set(row["repeats"][0])
    # the engines' own step time, read from the workers' metrics, beside the simulated busy time
    for pool, busy in row["engine_busy"].items():
        assert busy["measured_s"] > 0 and busy["measured_steps"] > 0 and busy["simulated_steps"] > 0, (pool, busy)
    # the run predicted again from its report and dump alone (benchmarks/resimulate_validation.py)
    report = {"settings": {key: getattr(args, key) for key in SETTINGS}, "profile": profile.to_dict(),
              "calibrations": [calibration_entry(model)], "rows": [{**row, "calibrated_on": model.shape}]}
    (again,) = resimulate(report, str(tmp_path))
    for name in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "goodput"):
        assert again[name]["measured"] == pytest.approx(row[name]["measured"]), name
        assert again[name]["predicted"] == pytest.approx(row[name]["predicted"], rel=1e-6), name
    with pytest.raises(ValueError, match="host_cores"):  # no host model here: streaming figures need one
        resimulate(report, str(tmp_path), {"host_stream_interference": 2.0})
    dearer = _goodput(_dearer(profile, 20.0), args)  # a 20x modelling error would fail the bound above
    assert dearer < (1 - GOODPUT_BOUND) * goodput["measured"], f"the SLO is too loose to test anything ({dearer:.2f}/s)"


def _indices(path) -> set[int]:
    return {json.loads(line)["index"] for line in path.read_text().splitlines()}


def _dearer(profile: Profile, factor: float) -> Profile:
    """Every cost `factor` times: engine steps, the calibrated cluster overheads, the hand-off."""
    steps = {tp: cost.scaled(factor) for tp, cost in profile.steps.items()}
    over = profile.overheads
    times = {f.name: _times(getattr(over, f.name), factor) for f in dataclasses.fields(over) if f.name.endswith("_s")}
    overheads = dataclasses.replace(over, **times)  # the step scales kept: the steps are dearer already
    transfer = Transfer(profile.transfer.latency_s * factor, profile.transfer.bytes_per_s / factor)
    return dataclasses.replace(profile, steps=steps, overheads=overheads, transfer=transfer)


def _times(value: float | tuple[float, ...], factor: float) -> float | tuple[float, ...]:
    """A duration, or a tuple of them (the host's jitter draws), `factor` times."""
    return tuple(v * factor for v in value) if isinstance(value, tuple) else value * factor


def _goodput(profile: Profile, args) -> float:
    spec = spec_for(args, args.rates[0])
    requests, _ = sim_requests(spec, limits_of(profile), profile.model.block_size, args.seed)
    config = SimConfig(ttft_slo_s=args.ttft_ms / 1e3, tpot_slo_s=args.tpot_ms / 1e3, max_concurrency=args.max_concurrency)
    return simulate(config, profile, requests).summary().goodput_per_s
