"""The simulator against real `splitserve bench` runs: predicted vs measured, per cluster shape and rate.

    scripts/in_sandbox.sh .venv/bin/python -m benchmarks.validate_sim [--shapes 1P1D,2P1D,1P2D] \\
        [--rates 1,2,4] [--num-requests 60] [--json out.json] [--dump DIR]

One process does it all, on this machine: it writes a small validation model (the demo model's
tokenizer and architecture, shrunk so that a step is milliseconds, `--model` overrides), measures its
profile with the engine in this process (`splitserve profile`'s code), starts each cluster shape with
one router, calibrates the profile's cluster overheads and the host's idle cores on that shape just
before its runs (the host's streaming figures on the first shape; `--calibrate`), then per rate
runs the bench's Poisson workload for real and simulates the very same requests. The table prints
measured / predicted and the error of p50 and p99 TTFT and TPOT and of goodput against the validation
targets (benchmarks/validate_sim_report.py, which also says what `--repeats N` adds: N runs per rate,
pooled, and the host's noise floor, run 2 against run 1). `--dump DIR` keeps each run's requests,
measured (`records.jsonl`, the bench's; `run-K/` per repeat) and simulated (`sim_records.jsonl`),
under DIR/<shape>_<rate>/.

Every worker here is a process with one torch thread on this machine's cores (2 on a small VM), so
a 2P1D cluster's three workers ask for more cores than there are: the simulation says so
(`SimConfig.host_cores`, `--host-cores`, default this machine's count; 0: every worker on its own
accelerator, which the rows also report as `unshared` for comparison). Before the calibration and
before each shape's bench, `--warmup` rounds of concurrent requests (discarded) warm every worker and
every prefill->decode hand-off pair, and `--warmup-steady` sequential ones bring the engines to their
steady speed. Other jobs on a shared box are not modelled: the load average
is printed before and after each shape; take timing runs on a quiet box (`flock` the lock the other
timing runs take).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import tempfile
from typing import NamedTuple

from benchmarks.engine_busy import pool_steps
from benchmarks.validate_sim_predict import SETTINGS, parse_shape, predict, spec_for
from benchmarks.validate_sim_report import (
    compare,
    dump_simulated,
    engine_busy,
    pooled_summary,
    print_row,
    within_counts,
)
from benchmarks.warm_cluster import STEADY_REQUESTS, warm_up
from cluster.launcher import launch
from common.config import ClusterConfig, PoolConfig, RouterConfig
from engine.heap import CollectionPauses, freeze_startup_heap
from loadtest.cluster_calibration import CALIBRATION_LENGTHS, calibrate_cluster, describe, host_report
from loadtest.config import BenchConfig, DriverConfig
from loadtest.plan import RequestDefaults, Slo
from loadtest.records import read_jsonl
from loadtest.runner import run_bench
from loadtest.sim_workload import limits_of
from sim.config import SimConfig
from sim.profile import Profile
from sim.profiler import Grid, measure_profile

VALIDATION_MODEL = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}


def validation_model() -> str:
    from engine.demo_model import write_demo_model

    out = tempfile.mkdtemp(prefix="splitserve-validate-model-")
    write_demo_model(out, progress=False, config_overrides=VALIDATION_MODEL)
    return out


async def run_shape(model_dir: str, shape: tuple[int, int], model: ShapeModel, args, calibrate: bool):
    """(model, rows): the bench and the simulation at every rate on one cluster shape; with
    `calibrate`, `model` calibrated on this shape first."""
    prefill, decode = shape
    config = ClusterConfig(
        prefill=PoolConfig(replicas=prefill, num_cpus=1.0, threads=1, metrics_port=0),  # engine_busy reads them
        decode=PoolConfig(replicas=decode, num_cpus=1.0, threads=1, metrics_port=0),
        router=RouterConfig(port=0, http_port=None),
        ray_num_cpus=8,
    )
    from router.server import RouterServer

    loop = asyncio.get_running_loop()
    cluster = await loop.run_in_executor(None, launch, config, model_dir)
    rows = []
    try:
        server = await RouterServer.start(cluster, config)
        # This process hosts the router: its startup heap frozen as `splitserve serve` does (parity:
        # without it the rows' benches ran no full collection either; engine/heap.py).
        freeze_startup_heap()
        try:
            vocab = tuple(limits_of(model.profile).ordinary_token_ids)
            rounds, steady = getattr(args, "warmup", 2), getattr(args, "warmup_steady", STEADY_REQUESTS)
            await warm_up(server.address, vocab, prefill * decode * 2, rounds, steady)
            if calibrate:

                async def engine_steps():
                    return await loop.run_in_executor(None, pool_steps, cluster)

                model = await _calibrate(server.address, shape, model, vocab, args, engine_steps)
            # Each rate its own seed: the same prompts again would hit the cluster's prefix cache from
            # the previous rate's run (measured TTFTs below one prefill step), which the simulation,
            # starting empty, cannot know.
            for i, rate in enumerate(args.rates):
                rows.append(await _one_rate(cluster, server.address, shape, model, rate, args, args.seed + i))
        finally:
            await server.stop(1.0)
            gc.unfreeze()  # this shape's cluster and router objects become collectable again
    finally:
        cluster.shutdown()
    return model, rows


class ShapeModel(NamedTuple):
    """What a shape's simulations run on: the profile with its overheads and, when the simulation
    shares the host's cores, a SimConfig holding the host's figures (its HOST_FIGURES)."""

    profile: Profile
    host: SimConfig | None
    shape: str = ""  # the shape it was calibrated on ("": not calibrated)


async def _calibrate(
    target: str, shape: tuple[int, int], model: ShapeModel, vocab: tuple[int, ...], args, engine_steps=None
) -> ShapeModel:
    """The profile with this shape's cluster overheads and, when the simulation shares the host's
    cores, the host's figures measured on it; the streaming figures are `model`'s when it has them
    and `--calibrate` is `each` (loadtest/cluster_calibration.py). `engine_steps`: reads the workers'
    step timings, which the decode step scale and the step overhead are measured from."""
    background, host_cores = getattr(args, "host_background_cores", None), getattr(args, "host_cores", None)
    streaming = model.host if getattr(args, "calibrate", "each") == "each" else None
    probes = getattr(args, "calibration_probes", None) or CALIBRATION_LENGTHS  # fewer: the CI test's
    calibration = await calibrate_cluster(
        target,
        model.profile,
        vocab,
        host_cores or None,
        background,
        shape,
        streaming,
        probes,
        engine_steps,
    )
    print(f"calibration on {shape[0]}P{shape[1]}D:\n{describe(calibration)}", flush=True)
    return ShapeModel(calibration.profile, calibration.host, f"{shape[0]}P{shape[1]}D")


def calibration_entry(model: ShapeModel) -> dict:
    """A report's record of one shape's calibration (benchmarks/validate_sim_predict.py reads it back)."""
    return {"shape": model.shape, "overheads": model.profile.overheads.to_dict(), "host": host_report(model.host)}


async def _one_rate(cluster, target: str, shape, model: ShapeModel, rate: float, args, seed: int) -> dict:
    spec = spec_for(args, rate)
    dump = os.path.join(args.dump, f"{shape[0]}P{shape[1]}D_{rate:g}") if args.dump else None
    loop, runs, engines = asyncio.get_running_loop(), [], []
    with CollectionPauses() as pauses:
        for k in range(args.repeats):
            before = await loop.run_in_executor(None, pool_steps, cluster)
            runs.append(await _measure(target, spec, seed, args, dump, k))
            after = await loop.run_in_executor(None, pool_steps, cluster)
            engines.append({pool: after[pool].minus(before[pool]) for pool in after})
    (predicted, result), (unshared, _) = (
        predict(shape, rate, seed, model.profile, h, args) for h in (model.host, None)
    )
    if dump is not None:
        dump_simulated(dump, result.records)
    measured = pooled_summary(runs)
    row = {"shape": f"{shape[0]}P{shape[1]}D", "rate_per_s": rate, **compare(measured, predicted)}
    row["unshared"] = compare(measured, unshared)
    if len(runs) > 1:
        row["repeats"] = [compare(summary, predicted) for _, summary in runs]
        row["noise_floor"] = compare(runs[0][1], runs[1][1])  # run 2 held against run 1
    row["engine_busy"] = engine_busy(engines, result)
    row["router_gc"] = {"full_collections": pauses.count, "longest_ms": round(pauses.longest_s * 1e3, 1)}
    print_row(row, f"router process: {pauses.describe()}", shared_host=model.host is not None)
    return row


async def _measure(target: str, spec, seed: int, args, dump: str | None, repeat: int) -> tuple[list, dict]:
    """One bench run of the rate's requests: (its records, its summary dict). Repeat k > 0 sends the
    same requests under tenant `repeat-k`: the prefix cache keeps tenants apart, so it hits nothing
    the earlier runs left (the simulation starts empty every time)."""
    folder = dump if dump is None or args.repeats == 1 else os.path.join(dump, f"run-{repeat + 1}")
    with tempfile.TemporaryDirectory(prefix="splitserve-validate-run-") as scratch:
        bench = BenchConfig(
            target=target,
            workload="poisson",
            spec=spec,
            seed=seed,
            driver=DriverConfig(max_concurrency=args.max_concurrency),
            defaults=RequestDefaults(Slo(args.ttft_ms, args.tpot_ms), tenant=f"repeat-{repeat}" if repeat else ""),
            out_dir=folder or scratch,
        )
        (summary,) = await run_bench(bench, echo=lambda _: None)
        records = read_jsonl(os.path.join(folder or scratch, "records.jsonl"))
    return records, summary.to_dict()


async def main_async(args) -> dict:
    model_dir = args.model or validation_model()
    profile = measure_profile(
        model_dir,
        threads=1,
        grid=Grid.quick() if args.quick_profile else Grid(),
        say=lambda line: print(line, flush=True),
    )
    print(f"load average (1, 5, 15 min) before: {_load()}; host cores simulated: {args.host_cores or 'not shared'}")
    print(f"profile: {profile.label} (fit RMS error {profile.source['fit_rms_relative_error']:.1%})")
    rows, loads, calibrations = [], [_load()], []
    model = ShapeModel(profile, None)
    for i, shape in enumerate(args.shapes):
        calibrate = i == 0 or args.calibrate != "first"
        model, shape_rows = await run_shape(model_dir, shape, model, args, calibrate=calibrate)
        if calibrate:
            calibrations.append(calibration_entry(model))
        loads.append(_load())
        print(f"load average (1, 5, 15 min) after {shape[0]}P{shape[1]}D: {loads[-1]}", flush=True)
        rows += [{**row, "calibrated_on": model.shape} for row in shape_rows]
    report = {
        "settings": {key: getattr(args, key) for key in SETTINGS},
        "profile": profile.to_dict(),
        "calibrations": calibrations,
        "rows": rows,
        "within_target": within_counts(rows),
        "runs": len(rows),
        "loads": loads,
    }
    if args.repeats > 1:  # the pooled runs above; each run alone, and two real runs against each other
        report["within_target_each_run"] = [
            within_counts([row["repeats"][k] for row in rows]) for k in range(args.repeats)
        ]
        report["within_target_noise_floor"] = within_counts(rows, "noise_floor")
    return report


def _load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: a shrunken demo model)")
    parser.add_argument("--shapes", default="1P1D,2P1D,1P2D")
    parser.add_argument("--rates", default="1,2,4", help="request rates, req/s")
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--prompt-len", default="uniform:32,512")
    parser.add_argument("--output-len", default="uniform:16,64")
    parser.add_argument("--ttft-ms", type=float, default=500.0)
    parser.add_argument("--tpot-ms", type=float, default=100.0)
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=1, help="bench runs per rate (>1: pooled, each, and run 2 vs run 1)"
    )
    parser.add_argument(
        "--host-cores", type=int, default=os.cpu_count() or 1, help="cores the workers share (0: not shared)"
    )
    parser.add_argument("--host-background-cores", type=float, help="busy cores while idle (default: measured)")
    parser.add_argument(
        "--calibrate",
        choices=("each", "each-full", "first"),
        default="each",
        help="per shape: overheads, idle cores (each), every figure (each-full); first: once, on the first",
    )
    parser.add_argument("--warmup", type=int, default=2, help="rounds of discarded requests before timing")
    parser.add_argument(
        "--warmup-steady", type=int, default=STEADY_REQUESTS, help="then sequential discarded requests (0: none)"
    )
    parser.add_argument("--quick-profile", action="store_true", help="the small profile grid (for smoke runs)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--dump", help="folder for each run's measured and simulated per-request records")
    args = parser.parse_args(argv)
    args.shapes = [parse_shape(s) for s in args.shapes.split(",")]
    args.rates = [float(r) for r in args.rates.split(",")]
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    report = asyncio.run(main_async(args))
    print(f"within target ({report['runs']} runs): {report['within_target']}")
    if args.repeats > 1:
        for k, counts in enumerate(report["within_target_each_run"]):
            print(f"  prediction vs run {k + 1} alone: {counts}")
        print(f"  run 2 vs run 1 (the host's noise floor): {report['within_target_noise_floor']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
